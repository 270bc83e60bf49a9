//@ backend: CUDA -- the GPU bodies of the ops, cuBLAS and NCCL (compiled by nvcc from dtrain.h)
//@ cuda
/* ================================================================================
   THE CUDA BACKEND
   Compiled by nvcc from this same file:
       nvcc -x cu -DDTRAIN_CUDA_IMPLEMENTATION -c dtrain.h -o dtrain_cuda.o
   and linked beside a C file built with -DDT_HAVE_CUDA (the Makefile does both).

   What it teaches: a GPU body differs from the CPU loop in three things only --
   indexing (one thread per element, or one warp per row), reductions (threads
   cooperate through warp shuffles and shared memory, in a fixed order so that
   every run gives the same bits), and launch shape. The arithmetic per element
   is the same DT_HD function the CPU calls. Matmuls go to cuBLAS in fp32 (no
   TF32), attention's per-head matmuls to one strided-batched call.
   Every CUDA and cuBLAS call is checked: a failure names the call, the file and
   line, and CUDA's own description, then exits like any other dtrain error.
   ================================================================================ */
#if defined(DTRAIN_CUDA_IMPLEMENTATION) && defined(__CUDACC__) && !defined(DTRAIN_CUDA_DONE)
#define DTRAIN_CUDA_DONE
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

/* cuBLAS is opened when a GPU is first used, not when the program starts:
   linked, its libraries (600 MB with cuBLASLt) cost every start about 70 ms
   of relocations, which every CPU run, every tool and every rank paid (the
   test suite starts well over a thousand). The calls dtrain makes are looked
   up once, by the names cublas_v2.h gives them; a library or call that is
   missing is an error that names it. */
/* cublasGemmEx is overloaded in C++ (an inline wrapper takes the old
   cudaDataType compute type): the library's own, by its type. */
typedef cublasStatus_t (*dt__cublas_gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                             const void *, const void *, cudaDataType, int, const void *, cudaDataType,
                                             int, const void *, void *, cudaDataType, int, cublasComputeType_t,
                                             cublasGemmAlgo_t);
static struct {
    decltype(&cublasCreate) create;
    decltype(&cublasSetStream) set_stream;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasGetStatusString) status_string;
    decltype(&cublasSgemm) sgemm;
    dt__cublas_gemm_ex gemm_ex;
    decltype(&cublasSgemmStridedBatched) sgemm_strided_batched;
} dt__cublas;
#define DT__NAME_OF(f) #f
#define DT__STRING(f) DT__NAME_OF(f)                 /* cublasCreate -> "cublasCreate_v2", as cublas_v2.h names it */
#define DT__CUBLAS_LOOKUP(field, f)                                                                          \
    if (!(dt__cublas.field = (decltype(dt__cublas.field))dlsym(lib, DT__STRING(f))))                         \
        dt_fail("%s has no %s (older than the cuBLAS %d this build was compiled with?)", name, DT__STRING(f), \
                CUBLAS_VER_MAJOR)
static void dt__cublas_load(void) {
    const char *name = "libcublas.so." DT__STRING(CUBLAS_VER_MAJOR);
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) dt_fail("cannot load cuBLAS for --device cuda: %s (the CUDA toolkit's lib64, or LD_LIBRARY_PATH)", dlerror());
    DT__CUBLAS_LOOKUP(create, cublasCreate);
    DT__CUBLAS_LOOKUP(set_stream, cublasSetStream);
    DT__CUBLAS_LOOKUP(set_math_mode, cublasSetMathMode);
    DT__CUBLAS_LOOKUP(status_string, cublasGetStatusString);
    DT__CUBLAS_LOOKUP(sgemm, cublasSgemm);
    DT__CUBLAS_LOOKUP(gemm_ex, cublasGemmEx);
    DT__CUBLAS_LOOKUP(sgemm_strided_batched, cublasSgemmStridedBatched);
}
static void dt__cublas_open(void) {                 /* once, whichever thread comes first (stage 02's devices) */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, dt__cublas_load);
}

/* NVML (libnvidia-ml, the driver's), for the figures a GPU gives of itself:
   loaded at run time, so a build needs nothing of it and a machine without
   it still trains (the figures are -1). Its types, as nvml.h declares them
   (the toolkit does not always ship that header): a status (0: success), an
   opaque device, utilisation as two percentages; sensor 0 is the GPU's. */
typedef int dt__nvml_status;
typedef struct dt__nvml_device_s *dt__nvml_device;
typedef struct { unsigned int gpu, memory; } dt__nvml_utilization;
static struct {
    dt__nvml_status (*init)(void);
    dt__nvml_status (*by_pci_bus)(const char *bus_id, dt__nvml_device *device);
    dt__nvml_status (*utilization)(dt__nvml_device device, dt__nvml_utilization *u);
    dt__nvml_status (*temperature)(dt__nvml_device device, int sensor, unsigned int *celsius);
    int ready;
} dt__nvml;
static void dt__nvml_load(void) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;                                            /* no NVML: the figures it gives are -1 */
    dt__nvml.init = (decltype(dt__nvml.init))dlsym(lib, "nvmlInit_v2");
    dt__nvml.by_pci_bus = (decltype(dt__nvml.by_pci_bus))dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
    dt__nvml.utilization = (decltype(dt__nvml.utilization))dlsym(lib, "nvmlDeviceGetUtilizationRates");
    dt__nvml.temperature = (decltype(dt__nvml.temperature))dlsym(lib, "nvmlDeviceGetTemperature");
    dt__nvml.ready = dt__nvml.init && dt__nvml.by_pci_bus && dt__nvml.utilization && dt__nvml.temperature && dt__nvml.init() == 0;
}

static struct {
    int index;
    cudaStream_t stream;                 /* every kernel, copy and matmul, in order */
    cublasHandle_t blas;
    double *partials;                    /* sum_squares: one double per block, then the total */
    float *scratch;                      /* column sums: partial sums per slab of rows */
    size_t scratch_floats;
    void *row_loss;                      /* cross-entropy: each row's loss, summed in order after */
    size_t row_loss_bytes;
    dt_backend table;
} dt__cuda;

static void dt__cuda_check(cudaError_t err, const char *call, const char *file, int line) {
    if (err != cudaSuccess)
        dt_fail("%s failed at %s:%d: %s (%s)", call, file, line, cudaGetErrorString(err), cudaGetErrorName(err));
}
static void dt__cublas_check(cublasStatus_t st, const char *call, const char *file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) dt_fail("%s failed at %s:%d: %s", call, file, line, dt__cublas.status_string(st));
}
#define DT_CUDA_CHECK(call) dt__cuda_check((call), #call, __FILE__, __LINE__)
#define DT_CUBLAS_CHECK(call) dt__cublas_check((call), #call, __FILE__, __LINE__)
/* A launch returns no status; cudaGetLastError() holds a bad launch shape. */
#define DT_LAUNCH(kernel, blocks, threads, ...)                                          \
    do {                                                                                 \
        kernel<<<(blocks), (threads), 0, dt__cuda.stream>>>(__VA_ARGS__);                \
        dt__cuda_check(cudaGetLastError(), "launching " #kernel, __FILE__, __LINE__);    \
    } while (0)

static unsigned dt__blocks_for_warps(int64_t rows) {      /* one warp (32 threads) per row */
    return dt_blocks_for(rows * 32);
}
#define DT_FOR_EACH(i, n)                                                                          \
    for (int64_t i = dt_grid_first(blockIdx.x, blockDim.x, threadIdx.x); i < (n);                  \
         i += dt_grid_stride(gridDim.x, blockDim.x))
/* One warp per row; `lane` is the thread's place in it. Whole warps move on
   together, so the shuffles inside see all 32 lanes. */
#define DT_FOR_EACH_ROW(row, rows)                                                                 \
    for (int64_t row = dt_grid_first(blockIdx.x, blockDim.x, threadIdx.x) / 32; row < (rows);      \
         row += dt_grid_stride(gridDim.x, blockDim.x) / 32)

__device__ static inline float dt__warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ static inline float dt__warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* The GPU's own figures (dt_hardware_read): its memory given out, and NVML's
   utilisation and temperature of the device this rank uses (found by its PCI
   address: NVML numbers devices its own way, CUDA_VISIBLE_DEVICES aside). */
static void dt__cuda_hardware(dt_hardware *out) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, dt__nvml_load);
    size_t free_b = 0, total_b = 0;
    out->gpu = 1;
    out->gpu_util_percent = out->gpu_temp_c = -1;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
        out->gpu_reserved_bytes = (double)(total_b - free_b);
        out->gpu_total_bytes = (double)total_b;
    } else cudaGetLastError();
    char bus[32];
    dt__nvml_device device;
    dt__nvml_utilization u;
    unsigned int celsius;
    if (!dt__nvml.ready || cudaDeviceGetPCIBusId(bus, sizeof bus, dt__cuda.index) != cudaSuccess || dt__nvml.by_pci_bus(bus, &device) != 0)
        return;
    if (dt__nvml.utilization(device, &u) == 0) out->gpu_util_percent = u.gpu;
    if (dt__nvml.temperature(device, 0, &celsius) == 0) out->gpu_temp_c = celsius;
}

/* ---- memory and copies ---- */
static void *dt__cuda_alloc(size_t bytes) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        dt_fail("cudaMalloc of %.1f MB failed: %s (%.1f MB of %.1f MB free on the GPU; try a smaller --batch-size)",
                bytes / 1e6, cudaGetErrorString(err), free_b / 1e6, total_b / 1e6);
    }
    return p;
}
/* Only the first steps free GPU memory (the step arena growing): let queued
   kernels that may still read it finish first. */
static void dt__cuda_release(void *p) {
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
    DT_CUDA_CHECK(cudaFree(p));
}
static void dt__cuda_zero(void *p, size_t bytes) { DT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, dt__cuda.stream)); }
/* Host buffers are ordinary (pageable) memory: wait, so the caller may reuse them at once. */
static void dt__cuda_upload(void *dst, const void *src, size_t bytes) {
    DT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dt__cuda.stream));
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
}
static void dt__cuda_download(void *dst, const void *src, size_t bytes) {
    DT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, dt__cuda.stream));
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
}
static void dt__cuda_synchronize(void) { DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream)); }
/* Is p memory of a GPU (or managed)? Host memory, and pointers CUDA has never
   seen, are not. */
static int dt__cuda_owns(const void *p) {
    cudaPointerAttributes a;
    cudaError_t err = cudaPointerGetAttributes(&a, p);
    if (err == cudaErrorInvalidValue) { cudaGetLastError(); return 0; }    /* a pointer CUDA does not know */
    DT_CUDA_CHECK(err);                                                    /* anything else is a real error */
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

/* ---- matmul: cuBLAS is column-major. A row-major matrix is its column-major
        transpose, so C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T:
        swap the operands and M with N, keep every leading dimension. ---- */
static void dt__cuda_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                         const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    DT_CUBLAS_CHECK(dt__cublas.sgemm(dt__cuda.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                &alpha, B, ldb, A, lda, &beta, C, ldc));
}
/* Mixed precision: 16-bit operands on the tensor cores, products summed in f32
   (CUBLAS_COMPUTE_32F), an f32 result. This is where bf16 earns its speed. */
static void dt__cuda_gemm_half(dt_dtype dtype, int ta, int tb, int M, int N, int K, const void *A, int lda,
                              const void *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    float alpha = 1.0f;
    cudaDataType_t t = dtype == DT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    DT_CUBLAS_CHECK(dt__cublas.gemm_ex(dt__cuda.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                                 &alpha, B, t, ldb, A, t, lda, &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
}
static void dt__cuda_gemm_batched(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                                 long long sa, const float *B, int ldb, long long sb, float beta, float *C, int ldc,
                                 long long sc, int batch) {
    DT_CUBLAS_CHECK(dt__cublas.sgemm_strided_batched(dt__cuda.blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                              N, M, K, &alpha, B, ldb, sb, A, lda, sa, &beta, C, ldc, sc, batch));
}

/* ---- column sums in a fixed order: out[j] += sum over rows of x[i, j] (times
        LayerNorm's x-hat for its weight gradient). Blocks of 32 columns x 8 row
        lanes sum one slab of rows each; a second kernel adds the slabs in order.
        No atomics, so the result is the same every run. ---- */
__global__ static void dt__k_colsum_partial(const float *dy, const float *x, const float *stats, int rows, int cols,
                                           int ld, int slab_rows, float *part_db, float *part_dw) {
    __shared__ float sh_db[8][33], sh_dw[8][33];
    int tx = threadIdx.x, ty = threadIdx.y, j = blockIdx.x * 32 + tx, slab = blockIdx.y;
    int r0 = slab * slab_rows, r1 = min(rows, r0 + slab_rows);
    float db = 0, dw = 0;
    if (j < cols)
        for (int i = r0 + ty; i < r1; i += 8) {
            float g = dy[(size_t)i * ld + j];
            db += g;
            if (part_dw) dw += g * (x[(size_t)i * ld + j] - stats[i]) * stats[rows + i];
        }
    sh_db[ty][tx] = db;
    sh_dw[ty][tx] = dw;
    __syncthreads();
    if (ty == 0 && j < cols) {
        float a = 0, b = 0;
        for (int k = 0; k < 8; k++) { a += sh_db[k][tx]; b += sh_dw[k][tx]; }
        part_db[(size_t)slab * cols + j] = a;
        if (part_dw) part_dw[(size_t)slab * cols + j] = b;
    }
}
__global__ static void dt__k_colsum_finish(const float *part, int slabs, int cols, float *out) {
    DT_FOR_EACH(j, cols) {
        float s = 0;
        for (int k = 0; k < slabs; k++) s += part[(size_t)k * cols + j];
        out[j] += s;
    }
}
/* A buffer that grows to the largest size asked (in the first step only). */
static void *dt__cuda_grow(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        if (*buf) dt__cuda_release(*buf);
        *buf = dt__cuda_alloc(bytes);
        *cap = bytes;
    }
    return *buf;
}
static float *dt__cuda_scratch(size_t floats) {
    if (floats > dt__cuda.scratch_floats) {        /* grows in the first step only */
        if (dt__cuda.scratch) dt__cuda_release(dt__cuda.scratch);
        dt__cuda.scratch = (float *)dt__cuda_alloc(floats * sizeof(float));
        dt__cuda.scratch_floats = floats;
    }
    return dt__cuda.scratch;
}
/* db[j] += sum_i dy[i*ld + j]; with x and stats also dw[j] += sum_i dy * x-hat. */
static void dt__cuda_column_sums(const float *dy, const float *x, const float *stats, int rows, int cols, int ld,
                                float *db, float *dw) {
    if (rows <= 0 || cols <= 0 || (!db && !dw)) return;
    int slabs = (rows + 63) / 64;
    if (slabs > 128) slabs = 128;
    int slab_rows = (rows + slabs - 1) / slabs;
    float *part = dt__cuda_scratch((size_t)2 * slabs * cols);
    dim3 grid((unsigned)((cols + 31) / 32), (unsigned)slabs), block(32, 8);
    DT_LAUNCH(dt__k_colsum_partial, grid, block, dy, x, stats, rows, cols, ld, slab_rows, part,
              dw ? part + (size_t)slabs * cols : (float *)NULL);
    if (db) DT_LAUNCH(dt__k_colsum_finish, dt_blocks_for(cols), DT_THREADS, part, slabs, cols, db);
    if (dw) DT_LAUNCH(dt__k_colsum_finish, dt_blocks_for(cols), DT_THREADS, part + (size_t)slabs * cols, slabs, cols, dw);
}
static void dt__cuda_sum_rows(const float *x, float *out, int rows, int cols) {
    dt__cuda_column_sums(x, NULL, NULL, rows, cols, cols, out, NULL);
}

/* ---- element-wise ops: one thread per element, the DT_HD arithmetic ---- */
__global__ static void dt__k_add_bias(float *y, const float *b, int64_t n, int cols) {
    DT_FOR_EACH(i, n) y[i] += b[i % cols];
}
static void dt__cuda_add_bias(float *y, const float *b, int rows, int cols) {
    int64_t n = (int64_t)rows * cols;
    DT_LAUNCH(dt__k_add_bias, dt_blocks_for(n), DT_THREADS, y, b, n, cols);
}
__global__ static void dt__k_gelu_forward(const float *x, float *y, int64_t n, int tanh_form) {
    DT_FOR_EACH(i, n) y[i] = tanh_form ? dt_gelu_tanh_value(x[i]) : dt_gelu_value(x[i]);
}
static void dt__cuda_gelu_forward(const float *x, float *y, int64_t n, int tanh_form) {
    DT_LAUNCH(dt__k_gelu_forward, dt_blocks_for(n), DT_THREADS, x, y, n, tanh_form);
}
__global__ static void dt__k_gelu_backward(const float *x, const float *dy, float *dx, int64_t n, int tanh_form) {
    DT_FOR_EACH(i, n) dx[i] += dy[i] * (tanh_form ? dt_gelu_tanh_derivative(x[i]) : dt_gelu_derivative(x[i]));
}
static void dt__cuda_gelu_backward(const float *x, const float *dy, float *dx, int64_t n, int tanh_form) {
    DT_LAUNCH(dt__k_gelu_backward, dt_blocks_for(n), DT_THREADS, x, dy, dx, n, tanh_form);
}
__global__ static void dt__k_add(const float *a, const float *b, float *y, int64_t n) {
    DT_FOR_EACH(i, n) y[i] = a[i] + b[i];
}
static void dt__cuda_add(const float *a, const float *b, float *y, int64_t n) {
    DT_LAUNCH(dt__k_add, dt_blocks_for(n), DT_THREADS, a, b, y, n);
}
__global__ static void dt__k_accumulate(float *dst, const float *src, int64_t n) {
    DT_FOR_EACH(i, n) dst[i] += src[i];
}
static void dt__cuda_accumulate(float *dst, const float *src, int64_t n) {
    DT_LAUNCH(dt__k_accumulate, dt_blocks_for(n), DT_THREADS, dst, src, n);
}
__global__ static void dt__k_scale(float *x, float c, int64_t n) {
    DT_FOR_EACH(i, n) x[i] *= c;
}
static void dt__cuda_scale(float *x, float c, int64_t n) { DT_LAUNCH(dt__k_scale, dt_blocks_for(n), DT_THREADS, x, c, n); }

/* ---- LayerNorm: one warp per row; the 32 lanes split the row and meet in
        warp shuffles. Two passes (mean, then variance), as on the CPU. ---- */
__global__ static void dt__k_layernorm_forward(const float *x, const float *w, const float *b, float *y, float *stats,
                                              int rows, int D, float eps) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D;
        float *yr = y + row * D;
        float sum = 0, var = 0;
        for (int j = lane; j < D; j += 32) sum += xr[j];
        float mean = dt__warp_sum(sum) / D;
        for (int j = lane; j < D; j += 32) { float d = xr[j] - mean; var += d * d; }
        float rstd = 1.0f / sqrtf(dt__warp_sum(var) / D + eps);
        for (int j = lane; j < D; j += 32) yr[j] = (xr[j] - mean) * rstd * (w ? w[j] : 1.0f) + (b ? b[j] : 0.0f);
        if (lane == 0) { stats[row] = mean; stats[rows + row] = rstd; }
    }
}
static void dt__cuda_layernorm_forward(const float *x, const float *w, const float *b, float *y, float *stats, int rows,
                                      int cols, float eps) {
    DT_LAUNCH(dt__k_layernorm_forward, dt__blocks_for_warps(rows), DT_THREADS, x, w, b, y, stats, rows, cols, eps);
}
__global__ static void dt__k_layernorm_backward_dx(const float *x, const float *w, const float *dy, const float *stats,
                                                  float *dx, int rows, int D) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D, *dyr = dy + row * D;
        float mean = stats[row], rstd = stats[rows + row], sum_g = 0, sum_gx = 0;
        for (int j = lane; j < D; j += 32) {
            float g = dyr[j] * (w ? w[j] : 1.0f);
            sum_g += g;
            sum_gx += g * (xr[j] - mean) * rstd;
        }
        float mg = dt__warp_sum(sum_g) / D, mgx = dt__warp_sum(sum_gx) / D;
        for (int j = lane; j < D; j += 32) {
            float g = dyr[j] * (w ? w[j] : 1.0f), xhat = (xr[j] - mean) * rstd;
            dx[row * D + j] += rstd * (g - mg - xhat * mgx);
        }
    }
}
static void dt__cuda_layernorm_backward(const float *x, const float *w, const float *dy, const float *stats, float *dx,
                                       float *dw, float *db, int rows, int cols) {
    if (dx) DT_LAUNCH(dt__k_layernorm_backward_dx, dt__blocks_for_warps(rows), DT_THREADS, x, w, dy, stats, dx, rows, cols);
    dt__cuda_column_sums(dy, x, stats, rows, cols, cols, db, dw);
}

/* ---- Llama's RMSNorm (a warp per row, as LayerNorm), SwiGLU and rotary
        embeddings (a thread per element; a key/value head's thread adds its
        group's query heads in order, as the CPU does) ---- */
__global__ static void dt__k_rmsnorm_forward(const float *x, const float *w, float *y, float *stats, int rows, int D, float eps) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D;
        float *yr = y + row * D, sq = 0;
        for (int j = lane; j < D; j += 32) sq += xr[j] * xr[j];
        float rstd = 1.0f / sqrtf(dt__warp_sum(sq) / D + eps);
        for (int j = lane; j < D; j += 32) yr[j] = (xr[j] * rstd) * w[j];
        if (lane == 0) { stats[row] = 0.0f; stats[rows + row] = rstd; }
    }
}
static void dt__cuda_rmsnorm_forward(const float *x, const float *w, float *y, float *stats, int rows, int cols, float eps) {
    DT_LAUNCH(dt__k_rmsnorm_forward, dt__blocks_for_warps(rows), DT_THREADS, x, w, y, stats, rows, cols, eps);
}
__global__ static void dt__k_rmsnorm_backward_dx(const float *x, const float *w, const float *dy, const float *stats, float *dx,
                                                int rows, int D) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *xr = x + row * D, *dyr = dy + row * D;
        float rstd = stats[rows + row], sum_gx = 0;
        for (int j = lane; j < D; j += 32) sum_gx += dyr[j] * w[j] * (xr[j] * rstd);
        float mgx = dt__warp_sum(sum_gx) / D;
        for (int j = lane; j < D; j += 32) dx[row * D + j] += rstd * (dyr[j] * w[j] - (xr[j] * rstd) * mgx);
    }
}
static void dt__cuda_rmsnorm_backward(const float *x, const float *w, const float *dy, const float *stats, float *dx, float *dw,
                                     int rows, int cols) {
    if (dx) DT_LAUNCH(dt__k_rmsnorm_backward_dx, dt__blocks_for_warps(rows), DT_THREADS, x, w, dy, stats, dx, rows, cols);
    dt__cuda_column_sums(dy, x, stats, rows, cols, cols, NULL, dw);
}
__global__ static void dt__k_swiglu_forward(const float *g, const float *u, float *y, int64_t n) {
    DT_FOR_EACH(i, n) y[i] = dt_silu_value(g[i]) * u[i];
}
static void dt__cuda_swiglu_forward(const float *gate, const float *up, float *y, int64_t n) {
    DT_LAUNCH(dt__k_swiglu_forward, dt_blocks_for(n), DT_THREADS, gate, up, y, n);
}
__global__ static void dt__k_swiglu_backward(const float *g, const float *u, const float *dy, float *dg, float *du, int64_t n) {
    DT_FOR_EACH(i, n) {
        if (dg) dg[i] += dy[i] * u[i] * dt_silu_derivative(g[i]);
        if (du) du[i] += dy[i] * dt_silu_value(g[i]);
    }
}
static void dt__cuda_swiglu_backward(const float *gate, const float *up, const float *dy, float *dgate, float *dup, int64_t n) {
    DT_LAUNCH(dt__k_swiglu_backward, dt_blocks_for(n), DT_THREADS, gate, up, dy, dgate, dup, n);
}
/* element i of a row's q (or k) part: its pair's value turned by (co, si) */
__device__ static float dt__rotated(const float *x, int j, int half, float co, float si, int sign) {
    return j < half ? x[j] * co - sign * x[j + half] * si : x[j] * co + sign * x[j - half] * si;
}
__global__ static void dt__k_rotary_qkv_forward(const float *q, const float *k, const float *v, const float *cs, float *y,
                                               int BT, int T, int H, int KV, int hd) {
    int D = H * hd, half = hd / 2, group = H / KV;
    DT_FOR_EACH(i, (int64_t)BT * 3 * D) {
        int64_t r = i / (3 * D);
        int c = (int)(i % (3 * D)), part = c / D, h = (c % D) / hd, j = c % hd;
        const float *pair = cs + (r % T) * hd + 2 * (j % half);
        if (part == 0) y[i] = dt__rotated(q + r * D + h * hd, j, half, pair[0], pair[1], 1);
        else if (part == 1) y[i] = dt__rotated(k + (r * KV + h / group) * hd, j, half, pair[0], pair[1], 1);
        else y[i] = v[(r * KV + h / group) * hd + j];
    }
}
static void dt__cuda_rotary_qkv_forward(const float *q, const float *k, const float *v, const float *cs, float *qkv, int BT,
                                       int T, int H, int KV, int hd) {
    DT_LAUNCH(dt__k_rotary_qkv_forward, dt_blocks_for((int64_t)BT * 3 * H * hd), DT_THREADS, q, k, v, cs, qkv, BT, T, H, KV, hd);
}
/* dq: one thread per element; dk, dv: one per element of a key/value head,
   adding its group's query heads in order */
__global__ static void dt__k_rotary_qkv_backward_q(const float *cs, const float *dy, float *dq, int BT, int T, int H, int hd) {
    int D = H * hd, half = hd / 2;
    DT_FOR_EACH(i, (int64_t)BT * D) {
        int64_t r = i / D;
        int c = (int)(i % D), j = c % hd;
        const float *pair = cs + (r % T) * hd + 2 * (j % half);
        dq[i] += dt__rotated(dy + r * 3 * D + (c - j), j, half, pair[0], pair[1], -1);
    }
}
__global__ static void dt__k_rotary_qkv_backward_kv(const float *cs, const float *dy, float *dk, float *dv, int BT, int T, int H,
                                                   int KV, int hd) {
    int D = H * hd, half = hd / 2, group = H / KV;
    DT_FOR_EACH(i, (int64_t)BT * KV * hd) {
        int64_t r = i / (KV * hd);
        int c = (int)(i % (KV * hd)), g = c / hd, j = c % hd;
        const float *pair = cs + (r % T) * hd + 2 * (j % half);
        float ak = 0, av = 0;
        for (int h = g * group; h < (g + 1) * group; h++) {
            ak += dt__rotated(dy + r * 3 * D + D + h * hd, j, half, pair[0], pair[1], -1);
            av += dy[r * 3 * D + 2 * D + h * hd + j];
        }
        if (dk) dk[i] += ak;
        if (dv) dv[i] += av;
    }
}
static void dt__cuda_rotary_qkv_backward(const float *cs, const float *dqkv, float *dq, float *dk, float *dv, int BT, int T, int H,
                                        int KV, int hd) {
    if (dq) DT_LAUNCH(dt__k_rotary_qkv_backward_q, dt_blocks_for((int64_t)BT * H * hd), DT_THREADS, cs, dqkv, dq, BT, T, H, hd);
    if (dk || dv)
        DT_LAUNCH(dt__k_rotary_qkv_backward_kv, dt_blocks_for((int64_t)BT * KV * hd), DT_THREADS, cs, dqkv, dk, dv, BT, T, H, KV, hd);
}

/* ---- attention: reorder Q, K, V to head-major, two strided-batched matmuls
        around a row softmax, reorder the output back. ---- */
/* rows [B, T, nsplit, H, hd] <-> heads [nsplit][B, H, T, hd] (nsplit 3: q, k, v):
   where element i of the rows sits among the heads. */
__device__ static inline int64_t dt__head_index(int64_t i, int B, int T, int H, int hd, int nsplit) {
    int64_t r = i;
    int d = (int)(r % hd); r /= hd;
    int h = (int)(r % H); r /= H;
    int which = (int)(r % nsplit); r /= nsplit;
    int t = (int)(r % T), b = (int)(r / T);
    return which * ((int64_t)B * T * H * hd) + (((int64_t)b * H + h) * T + t) * hd + d;
}
__global__ static void dt__k_split_heads(const float *rows, float *heads, int B, int T, int H, int hd, int nsplit) {
    DT_FOR_EACH(i, (int64_t)B * T * nsplit * H * hd) heads[dt__head_index(i, B, T, H, hd, nsplit)] = rows[i];
}
__global__ static void dt__k_merge_heads(const float *heads, float *rows, int B, int T, int H, int hd, int nsplit,
                                        int accumulate) {
    DT_FOR_EACH(i, (int64_t)B * T * nsplit * H * hd) {
        float v = heads[dt__head_index(i, B, T, H, hd, nsplit)];
        rows[i] = accumulate ? rows[i] + v : v;
    }
}
/* A row's online softmax by one warp: its largest value m and the sum l of
   exp(x - m) over r[0..n), in one pass -- each lane its own (m, l) over its
   columns, then the lanes' pairs merged by the same recurrence. Every lane
   ends with the row's pair. */
__device__ static void dt__warp_online_softmax(const float *r, int n, float *m_out, float *l_out) {
    float m = -INFINITY, l = 0;
    for (int j = threadIdx.x % 32; j < n; j += 32) {
        l *= dt_online_softmax_rescale(&m, r[j]);
        l += dt_exp_value(r[j] - m);
    }
    for (int o = 16; o > 0; o /= 2) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        l *= dt_online_softmax_rescale(&m, m2);
        l += m2 == -INFINITY ? 0.0f : l2 * dt_exp_value(m2 - m);
    }
    *m_out = m;
    *l_out = l;
}
__global__ static void dt__k_softmax_rows(float *P, int64_t rows, int T, int causal) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        float *r = P + row * T, m, l;
        int valid = causal ? (int)(row % T) + 1 : T;   /* causal: query i sees keys 0..i */
        dt__warp_online_softmax(r, valid, &m, &l);     /* one pass for m and l, one to write */
        for (int j = lane; j < T; j += 32) r[j] = j < valid ? dt_exp_value(r[j] - m) / l : 0.0f;
    }
}
__global__ static void dt__k_softmax_backward_rows(const float *P, float *dP, int64_t rows, int T, float scale) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(row, rows) {
        const float *p = P + row * T;
        float *d = dP + row * T, dot = 0;
        for (int j = lane; j < T; j += 32) dot += d[j] * p[j];
        dot = dt__warp_sum(dot);
        for (int j = lane; j < T; j += 32) d[j] = p[j] * (d[j] - dot) * scale;
    }
}
static void dt__cuda_attention_forward(const float *qkv, float *out, float *saved, int B, int T, int H, int D,
                                      float scale, int causal) {
    int hd = D / H, BH = B * H;
    int64_t btd = (int64_t)B * T * D, tt = (int64_t)T * T, th = (int64_t)T * hd;
    float *P = saved, *q = saved + (int64_t)BH * tt, *k = q + btd, *v = k + btd, *o = v + btd;
    DT_LAUNCH(dt__k_split_heads, dt_blocks_for(3 * btd), DT_THREADS, qkv, q, B, T, H, hd, 3);
    dt__cuda_gemm_batched(0, 1, T, T, hd, scale, q, hd, th, k, hd, th, 0.0f, P, T, tt, BH);   /* S = Q K^T / sqrt(d) */
    DT_LAUNCH(dt__k_softmax_rows, dt__blocks_for_warps((int64_t)BH * T), DT_THREADS, P, (int64_t)BH * T, T, causal);
    dt__cuda_gemm_batched(0, 0, T, hd, T, 1.0f, P, T, tt, v, hd, th, 0.0f, o, hd, th, BH);    /* O = P V */
    DT_LAUNCH(dt__k_merge_heads, dt_blocks_for(btd), DT_THREADS, o, out, B, T, H, hd, 1, 0);
}
static void dt__cuda_attention_backward(const float *saved, const float *dout, float *dqkv, float *scratch, int B,
                                       int T, int H, int D, float scale) {
    int hd = D / H, BH = B * H;
    int64_t btd = (int64_t)B * T * D, tt = (int64_t)T * T, th = (int64_t)T * hd;
    const float *P = saved, *q = saved + (int64_t)BH * tt, *k = q + btd, *v = k + btd;
    float *dP = scratch, *dO = scratch + (int64_t)BH * tt, *dq = dO + btd, *dk = dq + btd, *dv = dk + btd;
    DT_LAUNCH(dt__k_split_heads, dt_blocks_for(btd), DT_THREADS, dout, dO, B, T, H, hd, 1);
    dt__cuda_gemm_batched(0, 1, T, T, hd, 1.0f, dO, hd, th, v, hd, th, 0.0f, dP, T, tt, BH);   /* dP = dO V^T */
    dt__cuda_gemm_batched(1, 0, T, hd, T, 1.0f, P, T, tt, dO, hd, th, 0.0f, dv, hd, th, BH);   /* dV = P^T dO */
    DT_LAUNCH(dt__k_softmax_backward_rows, dt__blocks_for_warps((int64_t)BH * T), DT_THREADS, P, dP, (int64_t)BH * T, T,
              scale);
    dt__cuda_gemm_batched(0, 0, T, hd, T, 1.0f, dP, T, tt, k, hd, th, 0.0f, dq, hd, th, BH);   /* dQ = dS K */
    dt__cuda_gemm_batched(1, 0, T, hd, T, 1.0f, dP, T, tt, q, hd, th, 0.0f, dk, hd, th, BH);   /* dK = dS^T Q */
    DT_LAUNCH(dt__k_merge_heads, dt_blocks_for(3 * btd), DT_THREADS, dq, dqkv, B, T, H, hd, 3, 1);
}

/* ---- attention without its T x T matrix (--attention online): FlashAttention's
        algorithm (Dao et al., 2022), the online softmax of
        dt_online_softmax_rescale, in f32 on the CUDA cores. A block stages a
        tile of DT__FA_TILE rows of keys and values (in backward, also of
        queries and output gradients) in shared memory; each of its warps
        carries DT__FA_ROWS rows of the other side through the tiles, a lane
        to each staged row for the scores and a lane to each 32nd column for
        the products. Backward makes the scores twice, once by query rows (dQ)
        and once by key rows (dK, dV), so that every sum has one owner and a
        fixed order: the same bits every run, which atomic adds would not give.
        Saved: each row's log-sum-exp [B*H, T] and the output [B*T, D], as on
        the CPU. Not tuned (no tensor cores yet): the memory is the lesson. ---- */
#define DT__FA_TILE 32                        /* one lane per staged row */
#define DT__FA_WARPS 8
#define DT__FA_ROWS 4                         /* rows a warp carries */
#define DT__FA_BLOCK_ROWS (DT__FA_WARPS * DT__FA_ROWS)
#define DT__FA_COLS (DT_ATTENTION_ONLINE_MAX_HEAD_DIM / 32)   /* columns a lane holds */
typedef float dt__fa_tile[DT__FA_TILE][DT_ATTENTION_ONLINE_MAX_HEAD_DIM + 1];   /* + 1: lanes read rows in distinct banks */

/* rows j0 .. j0 + DT__FA_TILE - 1 of a head's column block (row stride ld) into a tile, zeros past T */
__device__ static void dt__fa_stage(const float *src, int64_t ld, int j0, int T, int hd, dt__fa_tile tile) {
    for (int e = threadIdx.x; e < DT__FA_TILE * hd; e += blockDim.x) {
        int k = e / hd, d = e % hd;
        tile[k][d] = j0 + k < T ? src[(int64_t)(j0 + k) * ld + d] : 0.0f;
    }
}
__device__ static float dt__fa_dot(const float *row, const float *staged, int hd) {
    float s = 0;
    for (int d = 0; d < hd; d++) s += row[d] * staged[d];
    return s;
}
/* The block's rows and a warp's: row r of warp w is the block's r * warps + w
   (interleaved, so that a causal block's warps see alike many keys). */
__device__ static int dt__fa_row(int first, int r) { return first + r * DT__FA_WARPS + (int)threadIdx.x / 32; }

/* The heads one launch covers -- the CPU's dt__online_head, B x H of them:
   query rows of qkv [B*Tq, 3*D]; keys and values at k and v (row t of
   sequence b at + (b * Tk + t) * ldkv, head h's columns at + h * hd), their
   positions ascending (qpos, kpos on the device; NULL: 0, 1, 2, ...). On
   one device k and v are qkv's own columns; under context parallelism
   they are the block the ring brought, at the tokens' true positions. */
typedef struct dt__fa_heads {
    const float *qkv, *k, *v, *qpos, *kpos;
    int64_t ldkv;
    int B, Tq, Tk, H, D, causal;
    float scale;
} dt__fa_heads;
__device__ static float dt__fa_qpos(const dt__fa_heads &a, int i) { return a.qpos ? a.qpos[i] : (float)i; }
__device__ static float dt__fa_kpos(const dt__fa_heads &a, int j) { return a.kpos ? a.kpos[j] : (float)j; }
/* Whether query i sees key j (positions compared as whole numbers when they are the indices). */
__device__ static int dt__fa_sees(const dt__fa_heads &a, int i, int j) {
    if (i >= a.Tq || j >= a.Tk || !a.causal) return i < a.Tq && j < a.Tk;
    return !a.qpos && !a.kpos ? j <= i : dt__fa_kpos(a, j) <= dt__fa_qpos(a, i);
}
/* How many keys sit at position p or before; the first query at p or after. */
__device__ static int dt__fa_keys_upto(const dt__fa_heads &a, float p) {
    int lo = 0, hi = a.Tk;
    while (lo < hi) { int mid = (lo + hi) / 2; if (dt__fa_kpos(a, mid) <= p) lo = mid + 1; else hi = mid; }
    return lo;
}
__device__ static int dt__fa_first_query(const dt__fa_heads &a, float p) {
    int lo = 0, hi = a.Tq;
    while (lo < hi) { int mid = (lo + hi) / 2; if (dt__fa_qpos(a, mid) < p) lo = mid + 1; else hi = mid; }
    return lo;
}

/* A block of query rows against the keys: each row's m, l and output move on
   by the online softmax. carry: start from the rows' m, l and unnormalised
   output in m_g [B*H, Tq], l_g, acc_g [B*Tq, D] (else from nothing); out
   non-NULL: finish -- out and O the output, lse the log-sum-exp (which may
   be m_g, acc_g) -- else keep m, l, acc
   in m_g, l_g, acc_g for the next block. A row is one warp's: its lanes read
   m_g[row] and l_g[row] at the start, lane 0 writes them at the end. */
__global__ static void dt__k_attention_online_forward(dt__fa_heads a, int carry, float *m_g, float *l_g, float *acc_g,
                                                     float *out, float *lse, float *O) {
    __shared__ dt__fa_tile ks, vs;
    int D = a.D, Tq = a.Tq, hd = D / a.H, lane = threadIdx.x % 32, tiles = (Tq + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS;
    int bh = blockIdx.x / tiles, b = bh / a.H, h = bh % a.H, i0 = (blockIdx.x % tiles) * DT__FA_BLOCK_ROWS;
    const float *q = a.qkv + (int64_t)b * Tq * 3 * D + h * hd;                          /* row t: + t * 3D */
    const float *k = a.k + (int64_t)b * a.Tk * a.ldkv + h * hd, *v = a.v + (int64_t)b * a.Tk * a.ldkv + h * hd;
    float m[DT__FA_ROWS], l[DT__FA_ROWS], acc[DT__FA_ROWS][DT__FA_COLS];
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int i = dt__fa_row(i0, r);
        int64_t row = (int64_t)bh * Tq + i, at = ((int64_t)b * Tq + i) * D + h * hd;
        m[r] = carry && i < Tq ? m_g[row] : -INFINITY;
        l[r] = carry && i < Tq ? l_g[row] : 0;
        for (int c = 0; c < DT__FA_COLS; c++) acc[r][c] = carry && i < Tq && lane + 32 * c < hd ? acc_g[at + lane + 32 * c] : 0;
    }
    int last = min(Tq, i0 + DT__FA_BLOCK_ROWS) - 1;                   /* the block's latest query: none sees further */
    int keys = a.causal ? dt__fa_keys_upto(a, dt__fa_qpos(a, last)) : a.Tk;
    for (int j0 = 0; j0 < keys; j0 += DT__FA_TILE) {
        __syncthreads();                                  /* every warp done with the last tile */
        dt__fa_stage(k, a.ldkv, j0, a.Tk, hd, ks);
        dt__fa_stage(v, a.ldkv, j0, a.Tk, hd, vs);
        __syncthreads();
        for (int r = 0; r < DT__FA_ROWS; r++) {
            int i = dt__fa_row(i0, r), j = j0 + lane, ok = dt__fa_sees(a, i, j);
            if (!dt__fa_sees(a, i, j0)) continue;          /* the whole warp alike: a tile past the row */
            float s = ok ? a.scale * dt__fa_dot(q + (int64_t)i * 3 * D, ks[lane], hd) : -INFINITY;
            float c = dt_online_softmax_rescale(&m[r], dt__warp_max(s));   /* what came before, on the new scale */
            float p = ok ? dt_exp_value(s - m[r]) : 0.0f;
            l[r] = l[r] * c + dt__warp_sum(p);
            for (int t = 0; t < DT__FA_COLS; t++) acc[r][t] *= c;
            for (int kk = 0; kk < DT__FA_TILE; kk++) {
                float pk = __shfl_sync(0xffffffffu, p, kk);
                for (int t = 0; t < DT__FA_COLS; t++)
                    if (lane + 32 * t < hd) acc[r][t] += pk * vs[kk][lane + 32 * t];
            }
        }
    }
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int i = dt__fa_row(i0, r);
        if (i >= Tq) continue;
        int64_t row = (int64_t)bh * Tq + i, at = ((int64_t)b * Tq + i) * D + h * hd;
        if (!out) {                                        /* more blocks to come */
            if (lane == 0) { m_g[row] = m[r]; l_g[row] = l[r]; }
            for (int t = 0; t < DT__FA_COLS; t++)
                if (lane + 32 * t < hd) acc_g[at + lane + 32 * t] = acc[r][t];
            continue;
        }
        for (int t = 0; t < DT__FA_COLS; t++)
            if (lane + 32 * t < hd) out[at + lane + 32 * t] = O[at + lane + 32 * t] = acc[r][t] / l[r];
        if (lane == 0) lse[row] = m[r] + logf(l[r]);
    }
}
/* Each row's dO . O, the softmax backward's subtrahend: [B*H, T], a warp a row. */
__global__ static void dt__k_attention_online_row_dots(const float *dout, const float *O, float *dots, int B, int T, int H,
                                                      int D) {
    int hd = D / H;
    DT_FOR_EACH_ROW(row, (int64_t)B * H * T) {
        int64_t bh = row / T, at = ((bh / H) * T + row % T) * D + (bh % H) * hd;
        float s = 0;
        for (int d = threadIdx.x % 32; d < hd; d += 32) s += dout[at + d] * O[at + d];
        s = dt__warp_sum(s);
        if (threadIdx.x % 32 == 0) dots[row] = s;
    }
}
/* dQ (added into dqkv's q columns): a warp's query rows against tiles of keys
   and values. dS = p (dP - dO.O) scale. */
__global__ static void dt__k_attention_online_dq(dt__fa_heads a, const float *lse, const float *dots, const float *dout,
                                                float *dqkv) {
    __shared__ dt__fa_tile ks, vs;
    int D = a.D, Tq = a.Tq, hd = D / a.H, lane = threadIdx.x % 32, tiles = (Tq + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS;
    int bh = blockIdx.x / tiles, b = bh / a.H, h = bh % a.H, i0 = (blockIdx.x % tiles) * DT__FA_BLOCK_ROWS;
    const float *q = a.qkv + (int64_t)b * Tq * 3 * D + h * hd;
    const float *k = a.k + (int64_t)b * a.Tk * a.ldkv + h * hd, *v = a.v + (int64_t)b * a.Tk * a.ldkv + h * hd;
    const float *dO = dout + (int64_t)b * Tq * D + h * hd;                              /* row t: + t * D */
    float dq[DT__FA_ROWS][DT__FA_COLS] = { { 0 } };
    int last = min(Tq, i0 + DT__FA_BLOCK_ROWS) - 1;
    int keys = a.causal ? dt__fa_keys_upto(a, dt__fa_qpos(a, last)) : a.Tk;
    for (int j0 = 0; j0 < keys; j0 += DT__FA_TILE) {
        __syncthreads();
        dt__fa_stage(k, a.ldkv, j0, a.Tk, hd, ks);
        dt__fa_stage(v, a.ldkv, j0, a.Tk, hd, vs);
        __syncthreads();
        for (int r = 0; r < DT__FA_ROWS; r++) {
            int i = dt__fa_row(i0, r), j = j0 + lane, ok = dt__fa_sees(a, i, j);
            if (!dt__fa_sees(a, i, j0)) continue;
            float p = ok ? dt_exp_value(a.scale * dt__fa_dot(q + (int64_t)i * 3 * D, ks[lane], hd) - lse[(int64_t)bh * Tq + i]) : 0.0f;
            float dp = ok ? dt__fa_dot(dO + (int64_t)i * D, vs[lane], hd) : 0.0f;
            float ds = p * (dp - dots[(int64_t)bh * Tq + i]) * a.scale;
            for (int kk = 0; kk < DT__FA_TILE; kk++) {
                float dsk = __shfl_sync(0xffffffffu, ds, kk);
                for (int t = 0; t < DT__FA_COLS; t++)
                    if (lane + 32 * t < hd) dq[r][t] += dsk * ks[kk][lane + 32 * t];
            }
        }
    }
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int i = dt__fa_row(i0, r);
        if (i >= Tq) continue;
        float *to = dqkv + ((int64_t)b * Tq + i) * 3 * D + h * hd;
        for (int t = 0; t < DT__FA_COLS; t++)
            if (lane + 32 * t < hd) to[lane + 32 * t] += dq[r][t];
    }
}
/* dK and dV (added into dk, dv: key j of sequence b at + (b * Tk + j) * ldkv):
   a warp's key rows against tiles of queries and output gradients (with
   their rows' log-sum-exps and dO . O). */
__global__ static void dt__k_attention_online_dkv(dt__fa_heads a, const float *lse, const float *dots, const float *dout,
                                                 float *dk, float *dv, int64_t ldkv) {
    __shared__ dt__fa_tile qs, dos;
    __shared__ float lse_s[DT__FA_TILE], dots_s[DT__FA_TILE];
    int D = a.D, Tq = a.Tq, hd = D / a.H, lane = threadIdx.x % 32, tiles = (a.Tk + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS;
    int bh = blockIdx.x / tiles, b = bh / a.H, h = bh % a.H, j0 = (blockIdx.x % tiles) * DT__FA_BLOCK_ROWS;
    const float *q = a.qkv + (int64_t)b * Tq * 3 * D + h * hd;
    const float *k = a.k + (int64_t)b * a.Tk * a.ldkv + h * hd, *v = a.v + (int64_t)b * a.Tk * a.ldkv + h * hd;
    const float *dO = dout + (int64_t)b * Tq * D + h * hd;
    float gk[DT__FA_ROWS][DT__FA_COLS] = { { 0 } }, gv[DT__FA_ROWS][DT__FA_COLS] = { { 0 } };
    int first = a.causal ? dt__fa_first_query(a, dt__fa_kpos(a, j0)) / DT__FA_TILE * DT__FA_TILE : 0;   /* none before sees j0 */
    for (int i0 = first; i0 < Tq; i0 += DT__FA_TILE) {
        __syncthreads();
        dt__fa_stage(q, 3 * D, i0, Tq, hd, qs);
        dt__fa_stage(dO, D, i0, Tq, hd, dos);
        if ((int)threadIdx.x < DT__FA_TILE) {
            int i = i0 + threadIdx.x;
            lse_s[threadIdx.x] = i < Tq ? lse[(int64_t)bh * Tq + i] : 0.0f;
            dots_s[threadIdx.x] = i < Tq ? dots[(int64_t)bh * Tq + i] : 0.0f;
        }
        __syncthreads();
        for (int r = 0; r < DT__FA_ROWS; r++) {
            int j = dt__fa_row(j0, r), i = i0 + lane, ok = dt__fa_sees(a, i, j);
            if (j >= a.Tk || !dt__fa_sees(a, min(Tq, i0 + DT__FA_TILE) - 1, j)) continue;   /* the tile's last query sees none */
            float p = ok ? dt_exp_value(a.scale * dt__fa_dot(qs[lane], k + (int64_t)j * a.ldkv, hd) - lse_s[lane]) : 0.0f;
            float dp = ok ? dt__fa_dot(dos[lane], v + (int64_t)j * a.ldkv, hd) : 0.0f;
            float ds = p * (dp - dots_s[lane]) * a.scale;
            for (int kk = 0; kk < DT__FA_TILE; kk++) {
                float pk = __shfl_sync(0xffffffffu, p, kk), dsk = __shfl_sync(0xffffffffu, ds, kk);
                for (int t = 0; t < DT__FA_COLS; t++)
                    if (lane + 32 * t < hd) {
                        gv[r][t] += pk * dos[kk][lane + 32 * t];
                        gk[r][t] += dsk * qs[kk][lane + 32 * t];
                    }
            }
        }
    }
    for (int r = 0; r < DT__FA_ROWS; r++) {
        int j = dt__fa_row(j0, r);
        if (j >= a.Tk) continue;
        int64_t at = ((int64_t)b * a.Tk + j) * ldkv + h * hd;
        for (int t = 0; t < DT__FA_COLS; t++)
            if (lane + 32 * t < hd) {
                dk[at + lane + 32 * t] += gk[r][t];
                dv[at + lane + 32 * t] += gv[r][t];
            }
    }
}
static unsigned dt__fa_blocks(int B, int T, int H) {
    int64_t n = (int64_t)B * H * ((T + DT__FA_BLOCK_ROWS - 1) / DT__FA_BLOCK_ROWS);
    if (n > 2147483647) dt_fail("online attention: %lld blocks of attention exceed the GPU's grid", (long long)n);
    return (unsigned)n;
}
/* Backward of the heads against their keys: the rows' dO . O, then dQ by query rows and dK, dV by key rows. */
static void dt__fa_backward(const dt__fa_heads *a, const float *lse, const float *O, const float *dout, float *dots, float *dqkv,
                            float *dk, float *dv, int64_t ld_dkv) {
    DT_LAUNCH(dt__k_attention_online_row_dots, dt__blocks_for_warps((int64_t)a->B * a->H * a->Tq), DT_THREADS, dout, O, dots, a->B,
              a->Tq, a->H, a->D);
    DT_LAUNCH(dt__k_attention_online_dq, dt__fa_blocks(a->B, a->Tq, a->H), 32 * DT__FA_WARPS, *a, lse, dots, dout, dqkv);
    DT_LAUNCH(dt__k_attention_online_dkv, dt__fa_blocks(a->B, a->Tk, a->H), 32 * DT__FA_WARPS, *a, lse, dots, dout, dk, dv, ld_dkv);
}
static void dt__cuda_attention_forward_online(const float *qkv, float *out, float *saved, int B, int T, int H, int D,
                                             float scale, int causal) {
    float *lse = saved, *O = saved + (int64_t)B * H * T;
    dt__fa_heads a = { qkv, qkv + D, qkv + 2 * D, NULL, NULL, 3 * D, B, T, T, H, D, causal, scale };
    DT_LAUNCH(dt__k_attention_online_forward, dt__fa_blocks(B, T, H), 32 * DT__FA_WARPS, a, 0, (float *)NULL, (float *)NULL,
              (float *)NULL, out, lse, O);
}
static void dt__cuda_attention_backward_online(const float *qkv, const float *saved, const float *dout, float *dqkv,
                                              float *scratch, int B, int T, int H, int D, float scale, int causal) {
    dt__fa_heads a = { qkv, qkv + D, qkv + 2 * D, NULL, NULL, 3 * D, B, T, T, H, D, causal, scale };
    dt__fa_backward(&a, saved, saved + (int64_t)B * H * T, dout, scratch, dqkv, dqkv + D, dqkv + 2 * D, 3 * D);
}
/* Context parallelism's ring (the context-parallel chapter): this rank's
   queries against the block held (its positions, then K and V [B*T, D]),
   the rows' m (in lse), l and output (in O) carried from block to block;
   the last block finishes them into out. Backward: dQ into dqkv, dK and
   dV into dkv (dK [B*T, D], then dV). */
static void dt__cuda_ring_attention_step(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O,
                                         float *out, int first, int B, int T, int H, int D, float scale, int causal) {
    int64_t BTD = (int64_t)B * T * D;
    dt__fa_heads a = { qkv, blk + T, blk + T + BTD, qpos, blk, D, B, T, T, H, D, causal, scale };
    DT_LAUNCH(dt__k_attention_online_forward, dt__fa_blocks(B, T, H), 32 * DT__FA_WARPS, a, !first, lse, l, O, out, lse, O);
}
static void dt__cuda_ring_attention_backward_step(const float *qkv, const float *blk, const float *qpos, const float *lse,
                                                  const float *O, const float *dout, float *dots, float *dqkv, float *dkv, int B,
                                                  int T, int H, int D, float scale, int causal) {
    int64_t BTD = (int64_t)B * T * D;
    dt__fa_heads a = { qkv, blk + T, blk + T + BTD, qpos, blk, D, B, T, T, H, D, causal, scale };
    dt__fa_backward(&a, lse, O, dout, dots, dqkv, dkv, dkv + BTD, D);
}
/* rows x cols floats from src (row stride ld_src) to dst (ld_dst), or added into it */
__global__ static void dt__k_add_columns(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols) {
    DT_FOR_EACH(e, rows * cols) dst[e / cols * ld_dst + e % cols] += src[e / cols * ld_src + e % cols];
}
static void dt__cuda_copy_columns(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add) {
    if (add) { DT_LAUNCH(dt__k_add_columns, dt_blocks_for(rows * cols), DT_THREADS, dst, ld_dst, src, ld_src, rows, cols); return; }
    DT_CUDA_CHECK(cudaMemcpy2DAsync(dst, (size_t)ld_dst * sizeof(float), src, (size_t)ld_src * sizeof(float),
                                    (size_t)cols * sizeof(float), (size_t)rows, cudaMemcpyDeviceToDevice, dt__cuda.stream));
}

/* ---- the ViT's token assembly, the class-token pick, patchify ---- */
__global__ static void dt__k_vit_tokens(const float *patches, const float *cls, const float *pos, float *y, int B, int P,
                                       int D) {
    int T = P + 1;
    DT_FOR_EACH(i, (int64_t)B * T * D) {
        int j = (int)(i % D), t = (int)((i / D) % T);
        int64_t b = i / ((int64_t)T * D);
        float src = t == 0 ? cls[j] : patches[(b * P + t - 1) * D + j];
        y[i] = src + pos[(int64_t)t * D + j];
    }
}
/* Token embedding: ids arrive as f32 (validated on the host when the data
   was read). */
__global__ static void dt__k_token_embedding(const float *tok, const float *wte, const float *wpe, float *y, int BT, int T, int D,
                                            int first, int V) {
    DT_FOR_EACH(i, (int64_t)BT * D) {
        int64_t r = i / D, j = i % D;
        int id = (int)tok[r] - first;
        y[i] = (id >= 0 && id < V ? wte[(int64_t)id * D + j] : 0.0f) + (wpe ? wpe[(r % T) * D + j] : 0.0f);
    }
}
static void dt__cuda_token_embedding_forward(const float *tok, const float *wte, const float *wpe, float *y, int BT, int T, int D,
                                             int first, int V) {
    DT_LAUNCH(dt__k_token_embedding, dt_blocks_for((int64_t)BT * D), DT_THREADS, tok, wte, wpe, y, BT, T, D, first, V);
}
/* One thread per (token, column) walks that token's rows in order, and one
   per (position, column) walks the batch: the CPU's order, no atomics. */
__global__ static void dt__k_token_embedding_backward_wte(const int32_t *order, const int32_t *start, const int32_t *token,
                                                         int groups, const float *dy, float *dwte, int D) {
    DT_FOR_EACH(i, (int64_t)groups * D) {
        int64_t g = i / D, j = i % D;
        float acc = dwte[(int64_t)token[g] * D + j];
        for (int k = start[g]; k < start[g + 1]; k++) acc += dy[(int64_t)order[k] * D + j];
        dwte[(int64_t)token[g] * D + j] = acc;
    }
}
__global__ static void dt__k_token_embedding_backward_wpe(const float *dy, float *dwpe, int BT, int T, int D) {
    DT_FOR_EACH(i, (int64_t)T * D) {
        int64_t t = i / D, j = i % D;
        float acc = dwpe[i];
        for (int64_t r = t; r < BT; r += T) acc += dy[r * D + j];
        dwpe[i] = acc;
    }
}
static void dt__cuda_token_embedding_backward(const int32_t *by_token, int groups, const float *dy, float *dwte, float *dwpe,
                                             int BT, int T, int D) {
    const int32_t *start = by_token + BT, *token = start + groups + 1;
    if (dwte) DT_LAUNCH(dt__k_token_embedding_backward_wte, dt_blocks_for((int64_t)groups * D), DT_THREADS, by_token, start,
                        token, groups, dy, dwte, D);
    if (dwpe) DT_LAUNCH(dt__k_token_embedding_backward_wpe, dt_blocks_for((int64_t)T * D), DT_THREADS, dy, dwpe, BT, T, D);
}
static void dt__cuda_vit_tokens_forward(const float *patches, const float *cls, const float *pos, float *y, int B, int P,
                                       int D) {
    DT_LAUNCH(dt__k_vit_tokens, dt_blocks_for((int64_t)B * (P + 1) * D), DT_THREADS, patches, cls, pos, y, B, P, D);
}
__global__ static void dt__k_vit_tokens_dpatch(const float *dy, float *dpatch, int B, int P, int D) {
    DT_FOR_EACH(i, (int64_t)B * P * D) {
        int j = (int)(i % D), t = (int)((i / D) % P);
        int64_t b = i / ((int64_t)P * D);
        dpatch[i] += dy[(b * (P + 1) + t + 1) * D + j];
    }
}
static void dt__cuda_vit_tokens_backward(const float *dy, float *dpatch, float *dcls, float *dpos, int B, int P, int D) {
    int T = P + 1;
    if (dpatch) DT_LAUNCH(dt__k_vit_tokens_dpatch, dt_blocks_for((int64_t)B * P * D), DT_THREADS, dy, dpatch, B, P, D);
    dt__cuda_column_sums(dy, NULL, NULL, B, T * D, T * D, dpos, NULL);   /* sum over the batch */
    dt__cuda_column_sums(dy, NULL, NULL, B, D, T * D, dcls, NULL);       /* token 0 of each sequence */
}
__global__ static void dt__k_select_token(const float *x, float *y, int B, int T, int idx, int D, int backward) {
    DT_FOR_EACH(i, (int64_t)B * D) {
        int64_t b = i / D, j = i % D, src = (b * T + idx) * D + j;
        if (backward) y[src] += x[i];             /* here x is dy [B, D] and y is dx */
        else y[i] = x[src];
    }
}
static void dt__cuda_select_token_forward(const float *x, float *y, int B, int T, int idx, int D) {
    DT_LAUNCH(dt__k_select_token, dt_blocks_for((int64_t)B * D), DT_THREADS, x, y, B, T, idx, D, 0);
}
static void dt__cuda_select_token_backward(const float *dy, float *dx, int B, int T, int idx, int D) {
    DT_LAUNCH(dt__k_select_token, dt_blocks_for((int64_t)B * D), DT_THREADS, dy, dx, B, T, idx, D, 1);
}
/* Mixture of experts: a thread per element of a slot's or a token's row; a
   token's sum is dt_moe_token_sum, the CPU's, and a slot's dot one thread's. */
__global__ static void dt__k_moe_to_slots(const float *src, const float *w, const int *tok, float *dst, int S, int D, int add) {
    DT_FOR_EACH(i, (int64_t)S * D) {
        int64_t s = i / D;
        float v = (w ? w[s] : 1.0f) * src[(int64_t)tok[s] * D + i % D];
        dst[i] = add ? dst[i] + v : v;
    }
}
__global__ static void dt__k_moe_to_tokens(const float *src, const float *w, const int *slots, float *dst, int N, int k, int D,
                                           int add) {
    DT_FOR_EACH(i, (int64_t)N * D) {
        float v = dt_moe_token_sum(src, w, slots + (i / D) * k, k, D, i % D);
        dst[i] = add ? dst[i] + v : v;
    }
}
__global__ static void dt__k_moe_slot_dots(const float *dy, const float *ys, const int *tok, float *dw, int S, int D) {
    DT_FOR_EACH(s, (int64_t)S) dw[s] += dt_moe_row_dot(dy + (int64_t)tok[s] * D, ys + s * D, D);
}
static void dt__cuda_moe_to_slots(const float *src, const float *w, const int *tok, float *dst, int S, int D, int add) {
    if (S) DT_LAUNCH(dt__k_moe_to_slots, dt_blocks_for((int64_t)S * D), DT_THREADS, src, w, tok, dst, S, D, add);
}
static void dt__cuda_moe_to_tokens(const float *src, const float *w, const int *slots, float *dst, int N, int k, int D, int add) {
    if (N) DT_LAUNCH(dt__k_moe_to_tokens, dt_blocks_for((int64_t)N * D), DT_THREADS, src, w, slots, dst, N, k, D, add);
}
static void dt__cuda_moe_slot_dots(const float *dy, const float *ys, const int *tok, float *dw, int S, int D) {
    if (S) DT_LAUNCH(dt__k_moe_slot_dots, dt_blocks_for(S), DT_THREADS, dy, ys, tok, dw, S, D);
}
__global__ static void dt__k_patchify(const float *img, float *out, int B, int C, int H, int W, int p) {
    int ph = H / p, pw = W / p, row_len = C * p * p;
    DT_FOR_EACH(i, (int64_t)B * ph * pw * row_len) {
        int64_t r = i / row_len;
        int e = (int)(i % row_len), c = e / (p * p), ky = (e / p) % p, kx = e % p;
        int px = (int)(r % pw), py = (int)((r / pw) % ph);
        int64_t b = r / ((int64_t)ph * pw);
        out[i] = img[((b * C + c) * H + py * p + ky) * W + px * p + kx];
    }
}
static void dt__cuda_patchify(const float *img, float *out, int B, int C, int H, int W, int p) {
    DT_LAUNCH(dt__k_patchify, dt_blocks_for((int64_t)B * (H / p) * (W / p) * C * p * p), DT_THREADS, img, out, B, C, H,
              W, p);
}

/* ---- the fused classifier: one warp per row, as many blocks as the rows
        need, each row's m and l by the online softmax (one pass over the
        logits, dt__warp_online_softmax); each row's loss goes to a buffer,
        and one block then adds the rows in a fixed order (thread t takes
        rows t, t + 256, ..., then a fixed tree), so the mean is the same
        every run. Backward makes each probability again as it writes. ---- */
__global__ static void dt__k_cross_entropy_rows(const float *logits, const int32_t *labels, double *inv_l, float *row_m,
                                               double *row_loss, int B, int C) {
    int lane = threadIdx.x % 32;
    DT_FOR_EACH_ROW(i, B) {
        if (labels[i] == DT_IGNORE_INDEX) {
            if (lane == 0) row_loss[i] = inv_l[i] = row_m[i] = 0;
            continue;
        }
        const float *r = logits + i * C;
        float m, l;
        dt__warp_online_softmax(r, C, &m, &l);
        if (lane == 0) {
            row_m[i] = m;
            inv_l[i] = 1.0 / (double)l;
            row_loss[i] = -((double)r[labels[i]] - m - log((double)l));
        }
    }
}
__global__ static void dt__k_mean_of_rows(const double *row_loss, int B, double divisor, float *loss) {
    __shared__ double sh[DT_THREADS];
    double s = 0;
    for (int i = threadIdx.x; i < B; i += DT_THREADS) s += row_loss[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = DT_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) loss[0] = (float)(sh[0] / divisor);
}
static void dt__cuda_cross_entropy_forward(const float *logits, const int32_t *labels, double *inv_l, float *m, float *loss,
                                          int B, int C, double divisor) {
    double *row_loss = (double *)dt__cuda_grow(&dt__cuda.row_loss, &dt__cuda.row_loss_bytes, sizeof(double) * (size_t)B);
    DT_LAUNCH(dt__k_cross_entropy_rows, dt__blocks_for_warps(B), DT_THREADS, logits, labels, inv_l, m, row_loss, B, C);
    DT_LAUNCH(dt__k_mean_of_rows, 1, DT_THREADS, row_loss, B, divisor, loss);
}
__global__ static void dt__k_cross_entropy_backward(const float *x, const double *inv_l, const float *m, const int32_t *labels,
                                                   const float *dloss, float *dl, int B, int C, float divisor) {
    float scale = dloss[0] / divisor;
    DT_FOR_EACH(i, (int64_t)B * C) {
        int64_t row = i / C;
        int j = (int)(i % C);
        if (labels[row] != DT_IGNORE_INDEX)
            dl[i] += dt_cross_entropy_grad(x[i], m[row], inv_l[row], j == labels[row] ? 1.0f : 0.0f, scale);
    }
}
static void dt__cuda_cross_entropy_backward(const float *logits, const double *inv_l, const float *m, const int32_t *labels,
                                           const float *dloss, float *dlogits, int B, int C, float divisor) {
    DT_LAUNCH(dt__k_cross_entropy_backward, dt_blocks_for((int64_t)B * C), DT_THREADS, logits, inv_l, m, labels, dloss,
              dlogits, B, C, divisor);
}

/* The cross-entropy of a split vocabulary: each row's m, l and x[label] over
   this rank's columns, one warp per row, as above. */
__global__ static void dt__k_softmax_row_stats(const float *x, const int32_t *labels, float *stats, int B, int C) {
    DT_FOR_EACH_ROW(i, B) {
        const float *r = x + i * C;
        float m, l;
        dt__warp_online_softmax(r, C, &m, &l);
        if (threadIdx.x % 32 == 0) {
            stats[i] = m;
            stats[B + i] = l;
            stats[2 * B + i] = labels[i] >= 0 && labels[i] < C ? r[labels[i]] : 0.0f;
        }
    }
}
static void dt__cuda_softmax_row_stats(const float *x, const int32_t *labels, float *stats, int B, int C) {
    DT_LAUNCH(dt__k_softmax_row_stats, dt__blocks_for_warps(B), DT_THREADS, x, labels, stats, B, C);
}

/* ---- the optimizer: a fixed-shape reduction for the gradient norm, then the
        same per-element updates as the CPU ---- */
#define DT_SUMSQ_BLOCKS 256
__global__ static void dt__k_sum_squares(const float *x, int64_t n, double *partials) {
    __shared__ double sh[DT_THREADS];
    double s = 0;
    DT_FOR_EACH(i, n) s += (double)x[i] * x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = DT_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}
__global__ static void dt__k_sum_partials(double *partials, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += partials[i];
    partials[n] = s;
}
static double dt__cuda_sum_squares(const float *x, int64_t n) {
    double total = 0;
    DT_LAUNCH(dt__k_sum_squares, DT_SUMSQ_BLOCKS, DT_THREADS, x, n, dt__cuda.partials);
    DT_LAUNCH(dt__k_sum_partials, 1, 1, dt__cuda.partials, DT_SUMSQ_BLOCKS);
    dt__cuda_download(&total, dt__cuda.partials + DT_SUMSQ_BLOCKS, sizeof total);
    return total;
}
__global__ static void dt__k_adamw(float *p, float *m, float *v, const float *g, int64_t n, float lr, float b1, float b2,
                                  float eps, float wd, float bc1, float bc2) {
    DT_FOR_EACH(i, n) dt_adamw_update(&p[i], &m[i], &v[i], g[i], lr, b1, b2, eps, wd, bc1, bc2);
}
static void dt__cuda_adamw(float *p, float *m, float *v, const float *g, int64_t n, float lr, float b1, float b2,
                          float eps, float wd, float bc1, float bc2) {
    DT_LAUNCH(dt__k_adamw, dt_blocks_for(n), DT_THREADS, p, m, v, g, n, lr, b1, b2, eps, wd, bc1, bc2);
}
__global__ static void dt__k_sgd(float *p, float *buf, const float *g, int64_t n, float lr, float momentum, float wd) {
    DT_FOR_EACH(i, n) dt_sgd_update(&p[i], &buf[i], g[i], lr, momentum, wd);
}
static void dt__cuda_sgd(float *p, float *buf, const float *g, int64_t n, float lr, float momentum, float wd) {
    DT_LAUNCH(dt__k_sgd, dt_blocks_for(n), DT_THREADS, p, buf, g, n, lr, momentum, wd);
}
__global__ static void dt__k_convert(const void *src, int from, void *dst, int to, int64_t n) {
    DT_FOR_EACH(i, n) {
        const uint16_t *h = (const uint16_t *)src;
        float v = from == DT_F32 ? ((const float *)src)[i] : from == DT_BF16 ? dt_bf16_to_f32(h[i]) : dt_f16_to_f32(h[i]);
        if (to == DT_F32) ((float *)dst)[i] = v;
        else ((uint16_t *)dst)[i] = to == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
    }
}
static void dt__cuda_convert(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n) {
    DT_LAUNCH(dt__k_convert, dt_blocks_for(n), DT_THREADS, src, (int)from, dst, (int)to, n);
}
/* Block quantization: a thread per block finds its scale and writes its
   codes, a thread per value reads them back -- the CPU's functions. */
__global__ static void dt__k_quantize(const float *x, int64_t n, int bits, int block, float *scales, uint8_t *codes) {
    DT_FOR_EACH(b, (n + block - 1) / block) {
        int64_t first = b * block, len = n - first < block ? n - first : block;
        scales[b] = dt_quant_block_scale(x + first, len, bits);
        dt_quant_block(x, first, len, bits, scales[b], codes);
    }
}
static void dt__cuda_quantize(const float *x, int64_t n, int bits, int block, void *q) {
    int64_t blocks = (n + block - 1) / block, used = 4 * blocks + (bits == 8 ? n : (n + 1) / 2);
    float *scales = (float *)q;
    dt__cuda_zero((char *)q + used, (size_t)(dt_quantized_bytes(n, bits, block) - used));
    DT_LAUNCH(dt__k_quantize, dt_blocks_for(blocks), DT_THREADS, x, n, bits, block, scales, (uint8_t *)(scales + blocks));
}
__global__ static void dt__k_dequantize(const float *scales, const uint8_t *codes, int64_t n, int bits, int block, void *out,
                                        int out_dtype, int add) {
    DT_FOR_EACH(i, n) {
        float v = dt_dequant_value(codes, i, bits, scales[i / block]);
        if (add) ((float *)out)[i] = v != v ? v : ((float *)out)[i] + v;     /* refused: the CPU's NaN, not the sum's */
        else if (out_dtype == DT_F32) ((float *)out)[i] = v;
        else ((uint16_t *)out)[i] = out_dtype == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
    }
}
static void dt__cuda_dequantize(const void *q, int64_t n, int bits, int block, void *out, dt_dtype out_dtype, int add) {
    int64_t blocks = (n + block - 1) / block;
    const float *scales = (const float *)q;
    DT_LAUNCH(dt__k_dequantize, dt_blocks_for(n), DT_THREADS, scales, (const uint8_t *)(scales + blocks), n, bits, block, out,
              (int)out_dtype, add);
}
