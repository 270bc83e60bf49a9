//@ lesson: devices and memory -- the device (CPU or GPU), and where the bytes go, counted per arena
/* ---- devices and memory ------------------------------------------------------ */

typedef enum { DT_CPU = 0, DT_CUDA = 1 } dt_device;

/* Where tensors, parameters and kernels live from now on (default: the CPU).
   DT_CUDA needs a build with CUDA (the Makefile does it when nvcc is found) and
   a visible GPU; without them it is an error that says which is missing.
   local_rank picks the GPU when a machine has several. */
void dt_set_device(dt_device device, int local_rank);
dt_device dt_current_device(void);
/* 1 when this build has CUDA and a GPU is visible; else 0, and why in `why`. */
int dt_cuda_available(char *why, size_t n);
/* Copies between host memory and memory of the current device (a plain
   memcpy on the CPU). On a GPU they wait for queued kernels to finish. */
void dt_upload(void *device_dst, const void *host_src, size_t bytes);
void dt_download(void *host_dst, const void *device_src, size_t bytes);
/* Wait until every queued kernel has finished (nothing to do on the CPU). */
void dt_synchronize(void);
/* Milliseconds on a monotonic clock, and the threads OpenMP uses (1 without it). */
double dt_now_ms(void);
int dt_threads(void);

/* Every byte the library allocates is counted in one of these arenas, so the
   summary can say where the memory went -- the lesson of sharding (stage 04). */
typedef enum {
    DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM, DT_ARENA_ACTS,
    DT_ARENA_COMM, DT_ARENA_DATA, DT_ARENA_COUNT
} dt_arena;

/* Zeroed, 64-byte aligned host memory counted in `arena`. Fails loudly when out of memory. */
void *dt_alloc(dt_arena arena, size_t bytes);
/* Give back memory from dt_alloc; `bytes` must be what was asked for. */
void dt_free(dt_arena arena, void *ptr, size_t bytes);
/* The same on a given device: GPU memory is counted in the same arenas. */
void *dt_alloc_on(dt_device device, dt_arena arena, size_t bytes);
void dt_free_on(dt_device device, dt_arena arena, void *ptr, size_t bytes);
/* Bytes held now and at most, per arena. */
size_t dt_mem_now(dt_arena arena);
size_t dt_mem_peak(dt_arena arena);
size_t dt_mem_total_now(void);
size_t dt_mem_total_peak(void);
/* Host memory that holds what was moved off the device (FSDP's --cpu-offload),
   counted apart from the device's so that the move shows. */
void *dt_alloc_host(dt_arena arena, size_t bytes);
void dt_free_host(dt_arena arena, void *ptr, size_t bytes);
size_t dt_mem_host_now(dt_arena arena);
size_t dt_mem_host_peak(dt_arena arena);
/* Forget the peaks (set them to what is held now): the run does it once set up,
   so that peaks are those of training, not of building the model. */
void dt_mem_reset_peaks(void);
const char *dt_arena_name(dt_arena arena);

/* The hardware's own figures, beside the arenas' counts: the process's
   resident memory and CPU time (from the system), and on a GPU what the
   device says -- its memory given out (cudaMemGetInfo: this process's
   allocations and CUDA context, and any other process's), and NVML's
   utilisation and temperature (libnvidia-ml, which ships with the driver, is
   loaded at run time; without it those two are -1). The run driver puts them
   in --log, TensorBoard and MLflow at each progress line. */
typedef struct {
    double rss_bytes, cpu_seconds;             /* -1: the system did not say */
    int gpu;                                   /* 1: the figures below are of this rank's GPU */
    double gpu_reserved_bytes, gpu_total_bytes;
    double gpu_util_percent, gpu_temp_c;       /* -1: NVML is not there, or did not say */
} dt_hardware;
void dt_hardware_read(dt_device device, dt_hardware *out);

/* The per-step arena holds activations and their gradients. It is a bump
   allocator: one pointer moves forward, and dt_step_arena_reset() moves it back
   at the start of each step. After the first step it never calls malloc again. */
void *dt_step_alloc(size_t bytes);
void dt_step_arena_reset(void);

//@ implementation
/* ==== devices and memory =====================================================
   Every allocation names its arena. The counters are how a student sees that
   Adam's state is twice the parameters, or that activations dominate at large
   batch sizes. */

/* A clock for timeouts and timings, and the cores OpenMP may use: what the
   sections below ask of the machine besides memory. */
double dt_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
int dt_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
/* Inside a parallel region: this thread's number, and the team's size. */
static int dt__thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static int dt__team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static const char *dt__arena_names[DT_ARENA_COUNT] = {
    "params", "grads", "optimizer", "activations", "comm", "data" };
const char *dt_arena_name(dt_arena arena) { return dt__arena_names[arena]; }

static void dt__mem_count(dt_arena a, size_t bytes, int sign) {
    if (sign > 0) { dt__ctx.mem_now[a] += bytes; dt__ctx.mem_total += bytes; }
    else { dt__ctx.mem_now[a] -= bytes; dt__ctx.mem_total -= bytes; }
    if (dt__ctx.mem_now[a] > dt__ctx.mem_peak[a]) dt__ctx.mem_peak[a] = dt__ctx.mem_now[a];
    if (dt__ctx.mem_total > dt__ctx.mem_total_peak) dt__ctx.mem_total_peak = dt__ctx.mem_total;
}

static void *dt__alloc_uncounted(dt_arena arena, size_t bytes) {
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = NULL;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&p, 64, rounded) != 0 || !p)
        dt_fail("out of memory allocating %zu bytes for %s", bytes, dt__arena_names[arena]);
    memset(p, 0, rounded);
    return p;
}
void *dt_alloc(dt_arena arena, size_t bytes) {
    void *p = dt__alloc_uncounted(arena, bytes);
    dt__mem_count(arena, bytes, +1);
    return p;
}
void dt_free(dt_arena arena, void *ptr, size_t bytes) {
    if (!ptr) return;
    free(ptr);
    dt__mem_count(arena, bytes, -1);
}
void *dt_alloc_host(dt_arena arena, size_t bytes) {
    void *p = dt__alloc_uncounted(arena, bytes);
    dt__ctx.host_now[arena] += bytes;
    if (dt__ctx.host_now[arena] > dt__ctx.host_peak[arena]) dt__ctx.host_peak[arena] = dt__ctx.host_now[arena];
    return p;
}
void dt_free_host(dt_arena arena, void *ptr, size_t bytes) {
    if (!ptr) return;
    free(ptr);
    dt__ctx.host_now[arena] -= bytes;
}
size_t dt_mem_host_now(dt_arena arena) { return dt__ctx.host_now[arena]; }
size_t dt_mem_host_peak(dt_arena arena) { return dt__ctx.host_peak[arena]; }
void dt_mem_reset_peaks(void) {
    for (int a = 0; a < DT_ARENA_COUNT; a++) { dt__ctx.mem_peak[a] = dt__ctx.mem_now[a]; dt__ctx.host_peak[a] = dt__ctx.host_now[a]; }
    dt__ctx.mem_total_peak = dt__ctx.mem_total;
}
size_t dt_mem_now(dt_arena arena) { return dt__ctx.mem_now[arena]; }
size_t dt_mem_peak(dt_arena arena) { return dt__ctx.mem_peak[arena]; }
size_t dt_mem_total_now(void) { return dt__ctx.mem_total; }
size_t dt_mem_total_peak(void) { return dt__ctx.mem_total_peak; }

/* The backend of a device: NULL for the CPU, whose bodies are the loops below. */
static const dt_backend *dt__backend_of(dt_device d) {
    if (d == DT_CPU) return NULL;
    if (!dt__ctx.gpu) dt_fail("GPU memory or kernels used before dt_set_device(DT_CUDA, ...)");
    return dt__ctx.gpu;
}

void dt_hardware_read(dt_device device, dt_hardware *out) {
    memset(out, 0, sizeof *out);
    out->rss_bytes = out->cpu_seconds = -1;
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");               /* Linux: sizes in pages, the second one resident */
    if (f && fscanf(f, "%ld %ld", &pages, &resident) == 2 && resident >= 0) out->rss_bytes = (double)resident * (double)sysconf(_SC_PAGESIZE);
    if (f) fclose(f);
    struct timespec cpu;
    if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu) == 0) out->cpu_seconds = (double)cpu.tv_sec + cpu.tv_nsec * 1e-9;
    const dt_backend *gpu = dt__backend_of(device);
    if (gpu && gpu->hardware) gpu->hardware(out);
}

/* Zero memory on a device; a GPU does it in its queue. */
static void dt__zero_on(dt_device d, void *p, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(d);
    if (!bytes) return;                 /* (an empty tensor may have no memory at all) */
    if (gpu) gpu->zero(p, bytes);
    else memset(p, 0, bytes);
}

void *dt_alloc_on(dt_device device, dt_arena arena, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(device);
    if (!gpu) return dt_alloc(arena, bytes);
    void *p = gpu->alloc(bytes ? bytes : 1);
    dt__zero_on(device, p, bytes);
    dt__mem_count(arena, bytes, +1);
    return p;
}
void dt_free_on(dt_device device, dt_arena arena, void *ptr, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(device);
    if (!ptr) return;
    if (!gpu) { dt_free(arena, ptr, bytes); return; }
    gpu->release(ptr);
    dt__mem_count(arena, bytes, -1);
}

/* Set once this process has asked CUDA anything. A CUDA context does not
   survive fork(), so dt_launch refuses to fork after it (the launcher process
   never touches CUDA: each rank decides its device after the fork). */
static int dt__cuda_touched;

int dt_cuda_available(char *why, size_t n) {
#ifdef DT_HAVE_CUDA
    if (dt__ctx.gpu) return 1;
    dt__cuda_touched = 1;
    return dt_cuda_device_count(why, n) > 0;
#else
    dt__copy_str(why, n, "this build has no CUDA (nvcc was not found, or make CUDA=0)");
    return 0;
#endif
}

void dt_set_device(dt_device device, int local_rank) {
    if (device == DT_CUDA && !dt__ctx.gpu) {
#ifdef DT_HAVE_CUDA
        char why[256] = "";
        dt__cuda_touched = 1;
        dt__ctx.gpu = dt_cuda_backend(local_rank, why, sizeof why);
        if (!dt__ctx.gpu) dt_fail("cannot use the GPU: %s (run with --device cpu)", why);
#else
        (void)local_rank;
        dt_fail("--device cuda: this build has no CUDA (nvcc was not found, or make CUDA=0); use --device cpu");
#endif
    }
    dt__ctx.device = device;
}
dt_device dt_current_device(void) { return dt__ctx.device; }

static void dt__download_from(dt_device d, void *dst, const void *src, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(d);
    if (bytes == 0) return;
    if (gpu) gpu->download(dst, src, bytes);
    else memmove(dst, src, bytes);
}

static void dt__upload_to(dt_device d, void *dst, const void *src, size_t bytes) {
    const dt_backend *gpu = dt__backend_of(d);
    if (bytes == 0) return;
    if (gpu) gpu->upload(dst, src, bytes);
    else memmove(dst, src, bytes);
}
void dt_upload(void *device_dst, const void *host_src, size_t bytes) { dt__upload_to(dt__ctx.device, device_dst, host_src, bytes); }
void dt_download(void *host_dst, const void *device_src, size_t bytes) { dt__download_from(dt__ctx.device, host_dst, device_src, bytes); }
void dt_synchronize(void) {
    if (dt__ctx.device == DT_CUDA) dt__backend_of(DT_CUDA)->synchronize();
}

/* Files are read and written from host memory. A buffer on a GPU is seen
   through a host copy: downloaded when opened, uploaded when closed if it was
   written. On the CPU the "copy" is the buffer itself. */
static float *dt__host_view(dt_device d, float *buf, int64_t n) {
    if (d == DT_CPU) return buf;
    float *host = (float *)malloc((size_t)n * sizeof(float) + 1);
    if (!host) dt_fail("out of memory (%lld floats to copy from the GPU)", (long long)n);
    dt__download_from(d, host, buf, (size_t)n * sizeof(float));
    return host;
}
static void dt__host_view_close(dt_device d, float *host, float *buf, int64_t n, int written) {
    if (d == DT_CPU) return;
    if (written) dt__backend_of(d)->upload(buf, host, (size_t)n * sizeof(float));
    free(host);
}

/* Step-arena memory on `device` whose every byte the caller is about to write:
   op outputs skip the zeroing that gradient buffers need. */
static void *dt__arena_take(dt__step_arena *a, dt_device device, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    a->high += bytes;
    if (a->high > a->peak) a->peak = a->high;
    if (a->used + bytes <= a->cap) {
        void *p = a->base + a->used;
        a->used += bytes;
        return p;
    }
    /* Out of room (only in the first steps): a spill block, merged at the reset. */
    if (a->nspill == a->spill_cap) {
        a->spill_cap = a->spill_cap ? 2 * a->spill_cap : 64;
        a->spill = (void **)realloc(a->spill, a->spill_cap * sizeof(void *));
        a->spill_bytes = (size_t *)realloc(a->spill_bytes, a->spill_cap * sizeof(size_t));
        if (!a->spill || !a->spill_bytes) dt_fail("out of memory (step arena)");
    }
    void *p = dt_alloc_on(device, DT_ARENA_ACTS, bytes);
    a->spill[a->nspill] = p;
    a->spill_bytes[a->nspill++] = bytes;
    return p;
}
static void *dt__step_alloc_on(dt_device device, size_t bytes) { return dt__arena_take(&dt__ctx.step[device], device, bytes); }
static void *dt__step_alloc_uninit(size_t bytes) { return dt__step_alloc_on(DT_CPU, bytes); }
/* Data of activations and their gradients: on the device that runs the ops. */
static void *dt__step_data(size_t bytes) { return dt__step_alloc_on(dt__ctx.device, bytes); }

void *dt_step_alloc(size_t bytes) {
    void *p = dt__step_alloc_uninit(bytes);
    memset(p, 0, bytes);
    return p;
}

static void dt__arena_rewind(dt__step_arena *a, dt_device d) {
    if (a->nspill > 0 || a->peak > a->cap) {
        /* Grow the block to the high-water mark so the next step fits in one:
           after the first step there is no malloc (or cudaMalloc) at all. */
        size_t need = a->peak;
        for (int i = 0; i < a->nspill; i++) dt_free_on(d, DT_ARENA_ACTS, a->spill[i], a->spill_bytes[i]);
        /* glibc gives a freed block back to the system only when it was mapped on its own, and raises
           the size from which it maps one to the largest block freed so far (up to 32 MB): the spills
           after the first ones sat in the heap, freed but resident. Qwen2-0.5B's shape at 9 x 128
           tokens kept 2.4 GB so (14.2 GB resident against 11.8 GB counted). Trimming hands them back. */
#ifdef DT__TRIM_HEAP
        if (d == DT_CPU && a->nspill > 0) malloc_trim(0);
#endif
        a->nspill = 0;
        if (need > a->cap) {
            dt_free_on(d, DT_ARENA_ACTS, a->base, a->cap);
            /* exactly the first time (the block is zeroed, so resident: Qwen2-0.5B's 1/8 was 434 MB); a
               step that outgrew it since was no one-off, and the block takes an eighth more. */
            a->cap = need + (a->cap ? need / 8 : 0);
            a->base = (char *)dt_alloc_on(d, DT_ARENA_ACTS, a->cap);
        }
    }
    a->used = 0;
    a->high = 0;
    a->peak = 0;
}
void dt_step_arena_reset(void) {
    for (int d = 0; d < 2; d++) dt__arena_rewind(&dt__ctx.step[d], (dt_device)d);
    dt__ctx.tape_len = 0;
    dt__ctx.step_resets++;
    dt__ctx.arena_rewinds++;
}

/* A place in the step arena to come back to in mid-step: what was taken after
   it is given back (activation recompute, the models chapter, drops a block's
   activations so). Nothing taken after the mark may be used again. */
typedef struct { size_t used[2], high[2]; int nspill[2]; } dt__step_mark;
static dt__step_mark dt__step_mark_now(void) {
    dt__step_mark k;
    for (int d = 0; d < 2; d++) {
        k.used[d] = dt__ctx.step[d].used; k.high[d] = dt__ctx.step[d].high; k.nspill[d] = dt__ctx.step[d].nspill;
    }
    return k;
}
static void dt__step_back_to(const dt__step_mark *k) {
    for (int d = 0; d < 2; d++) {
        dt__step_arena *a = &dt__ctx.step[d];
        for (int i = k->nspill[d]; i < a->nspill; i++) dt_free_on((dt_device)d, DT_ARENA_ACTS, a->spill[i], a->spill_bytes[i]);
        a->nspill = k->nspill[d]; a->used = k->used[d]; a->high = k->high[d];
    }
    dt__ctx.arena_rewinds++;             /* what was cached after the mark is gone */
}

/* Arenas of one's own: pipeline parallelism (the pipeline-parallel chapter) keeps each micro-
   batch's activations apart, so that one micro-batch's go back when its
   backward is done while others' stay. Swapping puts `other` (one arena per
   device) where the step arena is, and the step arena in `other`; released,
   an arena keeps its block (grown to its high-water mark) for the next use. */
static void dt__step_arena_swap(dt__step_arena other[2]) {
    for (int d = 0; d < 2; d++) {
        dt__step_arena keep = dt__ctx.step[d];
        dt__ctx.step[d] = other[d];
        other[d] = keep;
    }
    dt__ctx.arena_rewinds++;             /* a cache in the arena that was in place is not this one's */
}
static void dt__step_arena_release(dt__step_arena a[2]) {
    for (int d = 0; d < 2; d++) dt__arena_rewind(&a[d], (dt_device)d);
    dt__ctx.arena_rewinds++;             /* what was cached in it is gone */
}
static void dt__step_arena_free(dt__step_arena a[2]) {
    for (int d = 0; d < 2; d++) {
        dt__arena_rewind(&a[d], (dt_device)d);
        if (a[d].base) dt_free_on((dt_device)d, DT_ARENA_ACTS, a[d].base, a[d].cap);
        free(a[d].spill);
        free(a[d].spill_bytes);
        memset(&a[d], 0, sizeof a[d]);
    }
}

/* The scratch arena works the same way but lives for one op only: under mixed
   precision (the mixed-precision chapter) an op reads its 16-bit inputs into f32 copies here,
   computes, and stores its output in 16 bits; the copies are gone at the next
   op, so only the 16-bit tensors stay for backward. */
static void *dt__scratch_on(dt_device device, size_t bytes) { return dt__arena_take(&dt__ctx.scratch[device], device, bytes); }
static void dt__scratch_reset(void) {
    for (int d = 0; d < 2; d++) dt__arena_rewind(&dt__ctx.scratch[d], (dt_device)d);
}

/* Numbers below 1.2e-38 ("subnormals") cost x86 cores up to a hundred times the
   time of ordinary ones, and training makes them: AdamW squares gradients that
   have become tiny. GPUs flush them to zero in their fast paths; so do we, in
   every thread of a training process (the control register is per thread).
   The effect on results is below anything a float can tell apart in training. */
static void dt__flush_subnormals_here(void) {          /* this thread only */
#if defined(__x86_64__) || defined(__SSE2__)
    _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_ON);
    _MM_SET_DENORMALS_ZERO_MODE(_MM_DENORMALS_ZERO_ON);
#endif
}
static void dt__flush_subnormals(void) {               /* this thread and its OpenMP team */
    DT_OMP("omp parallel")
    dt__flush_subnormals_here();
    dt__flush_subnormals_here();
}

