//@ machinery: metrics -- phases, Chrome traces, progress lines, TensorBoard, MLflow, the --bench line
/* ---- metrics and traces ------------------------------------------------- */

/* The phases of a training step, timed and traced. */
typedef enum { DT_PHASE_DATA, DT_PHASE_FWD, DT_PHASE_BWD, DT_PHASE_COMM, DT_PHASE_OPT,
               DT_PHASE_EVAL, DT_PHASE_CKPT, DT_PHASE_COUNT } dt_phase_kind;
/* A --trace file's tracks (its "tid"s, which tools/trace-summary reads): one
   per phase, then the communication thread's and the pipeline's. */
enum { DT_TRACK_COMM = DT_PHASE_COUNT, DT_TRACK_PIPELINE };

/* Charge the time since the last mark to `phase` (and draw it in the trace). */
void dt_phase(dt_run *run, dt_phase_kind phase);

/* TensorBoard's event files (--tensorboard DIR), written without TensorFlow.
   A file of records, each framed as TFRecord frames it: the length as a
   little-endian uint64, its masked CRC-32C, the bytes, their masked CRC-32C.
   Each record is an Event protocol buffer: the first says the format
   ("brain.Event:2"), each one after it holds a wall time, a step and a
   scalar. dt_tensorboard_open makes DIR and opens
   DIR/events.out.tfevents.<seconds>.<host>.<pid> (NULL, errno set, when it
   cannot); the others return 0 when a write failed (errno says why). */
typedef struct dt_tensorboard dt_tensorboard;
dt_tensorboard *dt_tensorboard_open(const char *dir);
int dt_tensorboard_scalar(dt_tensorboard *tb, const char *tag, float value, int64_t step, double wall_time);
/* A SessionLog START at `step`: TensorBoard drops what an earlier file of
   the run logged at that step or after (a run resumed from a checkpoint). */
int dt_tensorboard_restart(dt_tensorboard *tb, int64_t step, double wall_time);
int dt_tensorboard_close(dt_tensorboard *tb);
const char *dt_tensorboard_path(const dt_tensorboard *tb);
/* CRC-32C (Castagnoli's polynomial), and TFRecord's mask of it: rotated
   right by 15 bits, plus 0xa282ead8 (a CRC of data that holds CRCs is weak). */
uint32_t dt_crc32c(const void *data, size_t n);
uint32_t dt_crc32c_masked(const void *data, size_t n);

/* MLflow: a run with its params, tags and metrics, in one of two stores
   behind one interface. `where` is a folder -- MLflow's file store
   (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri DIR`; MLflow 3
   keeps it in maintenance mode) -- or http://HOST:PORT (https:// where
   libcurl has TLS): a tracking server (`mlflow server`), written live through
   MLflow's REST API. dt_mlflow_open finds the experiment by name or makes
   it, and starts a run -- or, given the id of an earlier one, continues it;
   NULL when it cannot (dt_mlflow_error says why, errno too).
   The file store: DIR/<experiment id>/meta.yaml names the experiment; each
   run is a folder DIR/<experiment id>/<run id>/ of meta.yaml (name, times,
   status), params/ and tags/ (a file per key holding its value) and metrics/
   (a file per key, a line "<ms since 1970> <value> <step>" per point); a
   call returns 0 when a write failed (errno says why).
   The server: the calls only queue (a bounded queue, sent by a thread of
   its own), so they never wait on the network and always return 1; a
   server that stops answering is a warning, and what could not be sent is
   said when the run closes. dt_mlflow_path names the run's folder, or its
   page in the server's UI. */
typedef struct dt_mlflow dt_mlflow;
typedef enum { DT_MLFLOW_RUNNING = 1, DT_MLFLOW_FINISHED = 3, DT_MLFLOW_FAILED = 4, DT_MLFLOW_KILLED = 5 } dt_mlflow_status;
dt_mlflow *dt_mlflow_open(const char *where, const char *experiment, const char *run_name, const char *run_id);
int dt_mlflow_param(dt_mlflow *ml, const char *key, const char *value);
int dt_mlflow_tag(dt_mlflow *ml, const char *key, const char *value);
int dt_mlflow_metric(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms);
int dt_mlflow_close(dt_mlflow *ml, dt_mlflow_status status);
const char *dt_mlflow_path(const dt_mlflow *ml);
const char *dt_mlflow_run_id(const dt_mlflow *ml);
const char *dt_mlflow_error(void);              /* why the last dt_mlflow_open failed */
int dt_mlflow_is_server(const char *where);    /* http:// or https:// */
int dt_mlflow_run_id_valid(const char *id);     /* 32 lowercase hex digits */

//@ implementation
/* ==== metrics, traces and the benchmark line ================================
   Time is charged to phases (data, forward, backward, waiting for
   communication, optimizer), drawn in a Chrome trace, turned into a progress
   line with an ETA, and, with --bench, into one "bench:" line that tools read. */

/* The trace has one track per phase, so that forward, backward, waiting for
   communication and the optimizer line up in rows, and one for the
   communication thread (or stream), where each collective -- each DDP bucket --
   shows when it really ran: overlap with backward is visible at a glance.
   Under pipeline parallelism a last track shows each micro-batch's forward
   and backward and the waits between them: the bubble. The tracks' numbers
   are declared above (DT_TRACK_COMM, DT_TRACK_PIPELINE). */
static const char *dt__phase_names[DT_PHASE_COUNT] = { "data", "forward", "backward", "comm wait", "optimizer", "eval", "checkpoint" };

static void dt__trace_event(dt_run *r, const char *name, int track, double t0, double t1) {
    if (!r->trace) return;
    /* the file opens with metadata events, so every event follows a comma */
    fprintf(r->trace, ",{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f}\n",
            name, dt__ctx.rank, track, (t0 - r->start_ms) * 1e3, (t1 - t0) * 1e3);
    dt__file_check(r->trace, "--trace", r->trace_path);
}

/* A counter (Perfetto draws it as a graph over the steps): two named values at t. */
static void dt__trace_counter(dt_run *r, const char *name, double t, const char *a, double va, const char *b, double vb) {
    if (!r->trace) return;
    fprintf(r->trace, ",{\"name\":\"%s\",\"ph\":\"C\",\"pid\":%d,\"ts\":%.1f,\"args\":{\"%s\":%.0f,\"%s\":%.0f}}\n", name,
            dt__ctx.rank, (t - r->start_ms) * 1e3, a, va, b, vb);
    dt__file_check(r->trace, "--trace", r->trace_path);
}

static void dt__trace_open(dt_run *r, const char *path) {
    char *mine = r->trace_path;
    size_t size = sizeof r->trace_path;
    const char *dot = strrchr(path, '.');
    if (dt__ctx.world_size == 1) dt__path(mine, size, "%s", path);
    else if (dot && !strcmp(dot, ".json"))          /* one file per rank: run.json -> run.rank1.json */
        dt__path(mine, size, "%.*s.rank%d.json", (int)(dot - path), path, dt__ctx.rank);
    else dt__path(mine, size, "%s.rank%d", path, dt__ctx.rank);
    if (!(r->trace = fopen(mine, "w"))) dt_fail("cannot open --trace '%s': %s", mine, strerror(errno));
    fprintf(r->trace, "[{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}\n",
            dt__ctx.rank, dt__ctx.rank);
    for (int t = 0; t <= DT_TRACK_PIPELINE; t++)
        fprintf(r->trace, ",{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}\n",
                dt__ctx.rank, t, t == DT_TRACK_COMM ? "communication" : t == DT_TRACK_PIPELINE ? "pipeline" : dt__phase_names[t]);
    dt__file_check(r->trace, "--trace", mine);
}

void dt_phase(dt_run *run, dt_phase_kind phase) {
    /* A GPU runs its queue of kernels behind the host's back: wait for it, or
       the time of this phase would show up in a later one. */
    dt_synchronize();
    double now = dt_now_ms();
    run->phase_ms[phase] += now - run->mark_ms;
    if (phase == DT_PHASE_BWD) dt__ctx.backward_end_ms = now;
    dt__trace_event(run, dt__phase_names[phase], phase == DT_PHASE_CKPT ? DT_PHASE_EVAL : phase, run->mark_ms, now);
    run->mark_ms = now;
}

static void dt__format_duration(double s, char *out, size_t n) {
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, n, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else if (t >= 60) snprintf(out, n, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, n, "%lds", t);
}

/* The time of a step, as the ETA and the progress line's rate assume it: a
   moving average that forgets old steps (weight 0.1: about the last 20), so
   that it follows a run that speeds up or slows down. The first step is not
   kept -- the second replaces it -- as it is warm-up (arenas allocated, cold
   caches, on a GPU cuBLAS's set-up), often several times slower than the
   rest. `step` counts this process's steps, 1 for the first. */
#define DT_ETA_WEIGHT 0.1
static double dt__eta_update(double avg_ms, double step_ms, int64_t step) {
    if (step <= 2) return step_ms;
    return avg_ms + DT_ETA_WEIGHT * (step_ms - avg_ms);
}

/* Whether step `step` prints a progress line. --log-every N: every N-th step
   (and the first). Otherwise by the clock, so a slow run is not silent for a
   minute and a fast one does not flood the terminal: the first step, then
   whenever DT_PROGRESS_MS have passed since the last line, and the last step
   of each epoch, so every epoch ends with its loss. */
#define DT_PROGRESS_MS 3000.0
static int dt__progress_due(int64_t step, int log_every, int last_of_epoch, double now_ms, double last_line_ms) {
    if (log_every > 0) return step % log_every == 0 || step == 1;
    return step == 1 || last_of_epoch || now_ms - last_line_ms >= DT_PROGRESS_MS;
}

/* A language model's rates are in tokens: a sequence is seq_len of them. */
static int dt__tokens_per_sample(const dt_run *r) { return dt_model_is_language(r->model->cfg.kind) ? r->model->cfg.seq_len : 0; }

/* The fp32 peak (no tensor cores: TF32 stays off) of GPUs a course may meet,
   from their data sheets, in TFLOP/s; --peak-tflops gives any other. */
static double dt__gpu_peak_tflops(const char *name) {
    static const struct { const char *match; double tflops; } peaks[] = {
        { "H200", 66.9 }, { "H100 PCIe", 51.2 }, { "H100 NVL", 60.0 }, { "H100", 66.9 }, { "A100", 19.5 },
        { "L40S", 91.6 }, { "L40", 90.5 }, { "L4", 30.3 }, { "A10G", 31.2 }, { "A10", 31.2 }, { "T4", 8.1 },
        { "RTX 4090", 82.6 }, { "RTX 4080", 48.7 }, { "RTX 3090", 35.6 }, { "RTX 3080", 29.8 }, { "A6000", 38.7 },
    };
    for (size_t i = 0; i < sizeof peaks / sizeof peaks[0]; i++)
        if (strstr(name, peaks[i].match)) return peaks[i].tflops;
    return 0;
}

/* The "bench:" line: what the timed steps of this stage did, in key=value
   pairs (tools and the Makefile read them). Throughput leaves out the data
   phase, so that it compares with a framework fed from a tensor in memory;
   data_ms says what loading cost. Rates and FLOP/s are for the whole job. */
static void dt__bench_report(dt_run *r) {
    const dt_config *cfg = &r->cfg;
    const dt_model_config *mc = &r->model->cfg;
    int64_t steps = r->step - r->bench_first;
    dt_synchronize();
    double wall = dt_now_ms() - r->bench_t0;
    double ms = wall - r->bench_phase_ms[DT_PHASE_DATA];
    if (steps <= 0 || ms <= 0) dt_fail("--bench: no step was timed");
    int devices = dt__ctx.devices > 1 ? dt__ctx.devices : 1;              /* stage 02: devices of one process */
    int world = dt__ctx.world_size, per_rank = r->loader->batch_size / devices * cfg->accum_steps, S = mc->image_size;
    int replicas = r->loader->world;                                     /* a tensor-parallel group shares a batch */
    const dt_model *whole = dt__state_layout(r->model);                  /* and its rank holds a piece of the model */
    double flops = dt_flops_counted() * world, gflops = flops / (ms / 1e3) / 1e9;
    float peak_mem = dt__job_max((float)dt_mem_total_peak());    /* the largest rank's peak */
    size_t host_bytes = 0;                                       /* and of offloaded (host) memory */
    for (int a = 0; a < DT_ARENA_COUNT; a++) host_bytes += dt_mem_host_peak((dt_arena)a);
    float peak_host = dt__job_max((float)host_bytes);
    /* what FSDP shards: parameters, gradients and optimizer state (the sum of their peaks) */
    float peak_state = dt__job_max((float)(dt_mem_peak(DT_ARENA_PARAMS) + dt_mem_peak(DT_ARENA_GRADS) + dt_mem_peak(DT_ARENA_OPTIM)));
    if (dt__ctx.rank != 0) return;
    /* a language model's MFU counts the model's FLOPs per token (6N + attention), as papers do */
    double tokens_per_s = steps * (double)per_rank * devices * replicas * mc->seq_len * 1e3 / ms;
    int language = dt_model_is_language(mc->kind);
    if (language) gflops = tokens_per_s * dt_model_flops_per_token(whole) / 1e9;
    /* GPT-2 small's shape at another context is named by it: gpt2-124m-ctx256 */
    char gpt2_name[32];
    if (mc->seq_len == 1024) snprintf(gpt2_name, sizeof gpt2_name, "gpt2-124m");
    else snprintf(gpt2_name, sizeof gpt2_name, "gpt2-124m-ctx%d", mc->seq_len);
    const char *workload = mc->kind == DT_MODEL_GPT
                         ? (mc->dim == 128 && mc->depth == 4 && mc->heads == 4 && mc->seq_len == 64 && mc->classes == 256 ? "gpt-char"
                         : (mc->dim == 768 && mc->depth == 12 && mc->heads == 12 && mc->classes == 50257 ? gpt2_name : "gpt-custom"))
                         : mc->kind == DT_MODEL_LLAMA ? (mc->dim == 128 && mc->depth == 4 && mc->heads == 4 && mc->seq_len == 64 &&
                                                         mc->classes == 256 ? "llama-char" : "llama-custom")
                         : mc->kind == DT_MODEL_MLP ? (mc->dim == 1024 && mc->depth == 2 && S == 32 ? "mlp" : "mlp-custom")
                         : (mc->dim == 192 && mc->depth == 6 && mc->heads == 3 && mc->patch == 4 && S == 32 ? "vit-tiny"
                         : (mc->dim == 768 && mc->depth == 12 && mc->heads == 12 && mc->patch == 16 && S == 224 ? "vit-base" : "vit-custom"));
    char where[256];
    if (r->model->device == DT_CUDA) {
        char gpu[128];
        size_t k = 0;
        for (const char *c = dt__ctx.gpu->name; *c && k + 1 < sizeof gpu; c++) gpu[k++] = *c == ' ' ? '_' : *c;
        gpu[k] = 0;
        /* the table holds fp32 peaks: a 16-bit run's peak must be given */
        double peak = cfg->peak_tflops > 0 ? cfg->peak_tflops : cfg->dtype == DT_F32 ? dt__gpu_peak_tflops(dt__ctx.gpu->name) : 0;
        if (peak > 0) snprintf(where, sizeof where, "device=cuda gpu=%s tflops=%.2f peak_tflops=%.1f mfu=%.3f", gpu,
                               gflops / 1e3, peak, gflops / 1e3 / world / peak);
        else snprintf(where, sizeof where, "device=cuda gpu=%s tflops=%.2f mfu=unknown(use --peak-tflops)", gpu, gflops / 1e3);
    } else snprintf(where, sizeof where, "device=cpu threads=%d", dt_threads());
    const double *p = r->bench_phase_ms;
    char stage[128];                     /* 04: which --shard, and whether offloaded (the wrapper's label) */
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(r->model->parallel, &who);
    snprintf(stage, sizeof stage, "%s", cfg->stage);
    if (rep && rep->label) rep->label(who, stage + strlen(stage), sizeof stage - strlen(stage));
    if (cfg->dtype != DT_F32 || cfg->reduce_dtype != DT_F32 || cfg->accum_steps > 1)   /* 05: precision, micro-batches */
        snprintf(stage + strlen(stage), sizeof stage - strlen(stage), "/%s%s%s%s", dt_dtype_name((dt_dtype)cfg->dtype),
                 cfg->reduce_dtype != DT_F32 ? "+reduce-" : "", cfg->reduce_dtype != DT_F32 ? dt_dtype_name((dt_dtype)cfg->reduce_dtype) : "",
                 cfg->accum_steps > 1 ? "+accum" : "");
    if (cfg->recompute) snprintf(stage + strlen(stage), sizeof stage - strlen(stage), "+recompute");
    if (r->model->base)                  /* LoRA: params= counts the adapters, what trains */
        snprintf(stage + strlen(stage), sizeof stage - strlen(stage), "+lora-rank%d", r->model->cfg.lora_rank);
    printf("bench: workload=%s stage=%s %s ranks=%d batch=%d params=%lld steps=%lld step_ms=%.2f samples_per_s=%.1f "
           "gflops=%.2f data_ms=%.2f fwd_ms=%.2f bwd_ms=%.2f comm_ms=%.2f comm_hidden_ms=%.2f comm_wait_ms=%.2f "
           "opt_ms=%.2f peak_mem_mb=%.1f peak_state_mb=%.2f peak_host_mb=%.2f",
           workload, stage, where, world * devices, per_rank, (long long)whole->numel, (long long)steps, ms / steps,
           steps * (double)per_rank * devices * replicas * 1e3 / ms, gflops, p[DT_PHASE_DATA] / steps, p[DT_PHASE_FWD] / steps,
           p[DT_PHASE_BWD] / steps, r->bench_comm_ms / steps, r->bench_hidden_ms / steps, p[DT_PHASE_COMM] / steps,
           p[DT_PHASE_OPT] / steps, peak_mem / 1e6, peak_state / 1e6, peak_host / 1e6);
    /* The process's peak resident memory, all of it (the arenas' counts above
       are tensors only): what decides whether a model fits on a machine. */
    struct rusage usage;
    if (getrusage(RUSAGE_SELF, &usage) == 0) printf(" peak_rss_mb=%.1f", usage.ru_maxrss * 1024.0 / 1e6);
    if (language)                       /* gflops is then tokens/s x flops per token */
        printf(" tokens_per_s=%.1f flops_per_token=%.4g", tokens_per_s, dt_model_flops_per_token(whole));
    if (rep && rep->bench_fields) rep->bench_fields(who, stdout, cfg->accum_steps);   /* what the cost model needs of it */
    printf("\n");
    fflush(stdout);
}

/* ---- TensorBoard's event files ----------------------------------------------
   The protocol buffer is written by hand: an Event is field 1 (wall_time, a
   double: wire type 1), field 2 (step, a varint: wire type 0), field 3
   (file_version, bytes: wire type 2) or field 5 (summary, a message: wire
   type 2); a Summary holds Values (field 1), each a tag (field 1) and a
   simple_value (field 2, a float: wire type 5). A key byte is
   field << 3 | wire type. */
static int dt__mkdir_ok(const char *path) { return mkdir(path, 0777) == 0 || errno == EEXIST; }
/* A folder and the folders above it (mkdir -p); 0 with errno on failure. */
static int dt__mkdirs(const char *path) {
    char p[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof p) { errno = ENAMETOOLONG; return 0; }
    memcpy(p, path, n + 1);
    for (size_t i = 1; i < n; i++)
        if (p[i] == '/') {
            p[i] = 0;
            if (!dt__mkdir_ok(p)) return 0;
            p[i] = '/';
        }
    return dt__mkdir_ok(p);
}
/* A string as a YAML scalar, single-quoted (a quote doubled), as MLflow
   writes one that needs it: names and paths may hold ': ', '#' or quotes. */
static void dt__yaml_quote(char *out, size_t n, const char *s) {
    size_t k = 0;
    if (n < 3) { if (n) out[0] = 0; return; }
    out[k++] = '\'';
    for (; *s && k + 3 < n; s++) {
        if (*s == '\'') out[k++] = '\'';
        if (*s == '\n' || *s == '\r') continue;
        out[k++] = *s;
    }
    out[k++] = '\'';
    out[k] = 0;
}
struct dt_tensorboard {
    FILE *f;
    char path[4096];
};
uint32_t dt_crc32c(const void *data, size_t n) {
    const uint8_t *p = (const uint8_t *)data;
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {          /* bit by bit: the records are a few dozen bytes */
        crc ^= p[i];
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
    }
    return ~crc;
}
uint32_t dt_crc32c_masked(const void *data, size_t n) {
    uint32_t c = dt_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}
static void dt__le_put(uint8_t *out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) out[i] = (uint8_t)(v >> (8 * i));
}
static size_t dt__pb_varint(uint8_t *out, uint64_t v) {
    size_t n = 0;
    do {
        out[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}
/* A length-delimited field: key, length, the bytes. */
static size_t dt__pb_bytes(uint8_t *out, int field, const void *bytes, size_t n) {
    size_t k = 0;
    out[k++] = (uint8_t)(field << 3 | 2);
    k += dt__pb_varint(out + k, n);
    memcpy(out + k, bytes, n);
    return k + n;
}
static size_t dt__tb_event_head(uint8_t *out, double wall_time, int64_t step) {
    uint64_t bits;
    memcpy(&bits, &wall_time, sizeof bits);
    out[0] = 1 << 3 | 1;
    dt__le_put(out + 1, bits, 8);
    out[9] = 2 << 3 | 0;
    return 10 + dt__pb_varint(out + 10, (uint64_t)step);
}
static int dt__tb_record(dt_tensorboard *tb, const uint8_t *data, size_t n) {
    uint8_t head[12], tail[4];
    dt__le_put(head, n, 8);
    dt__le_put(head + 8, dt_crc32c_masked(head, 8), 4);
    dt__le_put(tail, dt_crc32c_masked(data, n), 4);
    return fwrite(head, 1, 12, tb->f) == 12 && fwrite(data, 1, n, tb->f) == n && fwrite(tail, 1, 4, tb->f) == 4 &&
           fflush(tb->f) == 0;
}
dt_tensorboard *dt_tensorboard_open(const char *dir) {
    if (!dt__mkdirs(dir)) return NULL;
    dt_tensorboard *tb = (dt_tensorboard *)calloc(1, sizeof *tb);
    if (!tb) return NULL;
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    double now = (double)time(NULL);
    dt__path(tb->path, sizeof tb->path, "%s/events.out.tfevents.%.0f.%s.%d", dir, now, host, (int)getpid());
    if (!(tb->f = fopen(tb->path, "wb"))) { free(tb); return NULL; }
    uint8_t ev[64];
    size_t n = dt__tb_event_head(ev, now, 0);
    n += dt__pb_bytes(ev + n, 3, "brain.Event:2", 13);
    if (!dt__tb_record(tb, ev, n)) { int err = errno; fclose(tb->f); free(tb); errno = err; return NULL; }
    return tb;
}
int dt_tensorboard_scalar(dt_tensorboard *tb, const char *tag, float value, int64_t step, double wall_time) {
    size_t len = strlen(tag);
    if (len > 200) { errno = EINVAL; return 0; }
    uint8_t v[220], summary[230], ev[260];
    size_t nv = dt__pb_bytes(v, 1, tag, len);
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    v[nv++] = 2 << 3 | 5;
    dt__le_put(v + nv, bits, 4);
    nv += 4;
    size_t ns = dt__pb_bytes(summary, 1, v, nv);
    size_t n = dt__tb_event_head(ev, wall_time, step);
    n += dt__pb_bytes(ev + n, 5, summary, ns);
    return dt__tb_record(tb, ev, n);
}
int dt_tensorboard_restart(dt_tensorboard *tb, int64_t step, double wall_time) {
    uint8_t ev[40], session_log[2] = { 1 << 3 | 0, 1 };    /* SessionLog { status: START } */
    size_t n = dt__tb_event_head(ev, wall_time, step);
    n += dt__pb_bytes(ev + n, 6, session_log, 2);
    return dt__tb_record(tb, ev, n);
}
int dt_tensorboard_close(dt_tensorboard *tb) {
    if (!tb) return 1;
    int ok = fflush(tb->f) == 0 && !ferror(tb->f), err = errno;
    if (fclose(tb->f) != 0 && ok) { ok = 0; err = errno; }
    free(tb);
    errno = err;
    return ok;
}
const char *dt_tensorboard_path(const dt_tensorboard *tb) { return tb->path; }

/* ---- MLflow's file store ------------------------------------------------------
   Plain files, so C writes them as MLflow's FileStore would: the YAML is
   flat (key: value), ids are digits (experiments) and 32 hex digits (runs),
   times are milliseconds since 1970. */
/* What each store does with a run's records (the file store's just below,
   the tracking server's after it); close also frees. */
typedef struct {
    int (*param)(dt_mlflow *ml, const char *key, const char *value);
    int (*tag)(dt_mlflow *ml, const char *key, const char *value);
    int (*metric)(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms);
    int (*close)(dt_mlflow *ml, dt_mlflow_status status);
} dt__mlflow_store;
typedef struct dt__mlflow_server dt__mlflow_server;
struct dt_mlflow {
    const dt__mlflow_store *store;
    char exp_dir[4096], run_dir[4096], run_id[40], exp_id[24], name[256];
    int64_t start_ms;
    dt__mlflow_server *server;          /* the tracking server's connection and queue; NULL: the file store */
};
static char dt__mlflow_why[600];        /* dt_mlflow_error's */
const char *dt_mlflow_error(void) { return dt__mlflow_why; }
int dt_mlflow_is_server(const char *where) { return !strncmp(where, "http://", 7) || !strncmp(where, "https://", 8); }
static int64_t dt__unix_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
/* A whole small file, written and checked; 0 with errno on failure. */
static int dt__write_small(const char *path, const char *mode, const char *text) {
    FILE *f = fopen(path, mode);
    if (!f) return 0;
    int ok = fputs(text, f) >= 0 && fflush(f) == 0 && !ferror(f), err = errno;
    if (fclose(f) != 0 && ok) { ok = 0; err = errno; }
    errno = err;
    return ok;
}
/* The value of `key: ` in a flat YAML file, quotes dropped; 0 when absent. */
static int dt__yaml_value(const char *path, const char *key, char *out, size_t n) {
    FILE *f = fopen(path, "r");
    char line[1024];
    size_t k = strlen(key);
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f))
        if (!strncmp(line, key, k) && line[k] == ':' && line[k + 1] == ' ') {
            char *v = line + k + 2;
            v[strcspn(v, "\r\n")] = 0;
            size_t len = strlen(v);
            if (len >= 2 && v[0] == '\'' && v[len - 1] == '\'') {     /* quoted: '' is a quote */
                v[len - 1] = 0;
                char *w = v;
                for (char *r = v + 1; *r; r++) {
                    *w++ = *r;
                    if (r[0] == '\'' && r[1] == '\'') r++;
                }
                *w = 0;
            }
            dt__copy_str(out, n, v);
            found = 1;
        }
    if (f) fclose(f);
    return found;
}
static int dt__mlflow_meta(dt_mlflow *ml, dt_mlflow_status status, int64_t end_ms) {
    char path[4200], text[12288], end[32], uri[4300], q_uri[8700], q_name[520], q_user[200];
    if (end_ms > 0) snprintf(end, sizeof end, "%lld", (long long)end_ms);
    else snprintf(end, sizeof end, "null");
    const char *user = getenv("USER");
    dt__path(uri, sizeof uri, "file://%s/artifacts", ml->run_dir);
    dt__yaml_quote(q_uri, sizeof q_uri, uri);
    dt__yaml_quote(q_name, sizeof q_name, ml->name);
    dt__yaml_quote(q_user, sizeof q_user, user && *user ? user : "dtrain");
    dt__path(text, sizeof text,
             "artifact_uri: %s\nend_time: %s\nentry_point_name: ''\nexperiment_id: '%s'\n"
             "lifecycle_stage: active\nrun_id: '%s'\nrun_name: %s\nsource_name: ''\nsource_type: 4\nsource_version: ''\n"
             "start_time: %lld\nstatus: %d\ntags: []\nuser_id: %s\n",
             q_uri, end, ml->exp_id, ml->run_id, q_name, (long long)ml->start_ms, (int)status, q_user);
    dt__path(path, sizeof path, "%s/meta.yaml", ml->run_dir);
    return dt__write_small(path, "w", text);
}
static int dt__mlflow_experiment(const char *dir, const char *id, const char *name) {
    char path[4200], text[12288], uri[4300], q_uri[8700], q_name[520];
    int64_t now = dt__unix_ms();
    dt__path(path, sizeof path, "%s/%s", dir, id);
    if (!dt__mkdir_ok(path)) return 0;
    dt__path(uri, sizeof uri, "file://%s/%s", dir, id);
    dt__yaml_quote(q_uri, sizeof q_uri, uri);
    dt__yaml_quote(q_name, sizeof q_name, name);
    dt__path(text, sizeof text, "artifact_location: %s\ncreation_time: %lld\nexperiment_id: '%s'\n"
             "last_update_time: %lld\nlifecycle_stage: active\nname: %s\n", q_uri, (long long)now, id, (long long)now, q_name);
    dt__path(path, sizeof path, "%s/%s/meta.yaml", dir, id);
    return dt__write_small(path, "w", text);
}
static int dt__all_digits(const char *s) { return *s && strspn(s, "0123456789") == strlen(s); }
int dt_mlflow_run_id_valid(const char *id) { return id && strlen(id) == 32 && strspn(id, "0123456789abcdef") == 32; }
static int dt__mlflow_key_file(dt_mlflow *ml, const char *part, const char *key, const char *mode, const char *text) {
    char path[4400];
    if (!*key || strstr(key, "..") || key[0] == '/') { errno = EINVAL; return 0; }   /* a key is a file name (a/b: a folder) */
    dt__path(path, sizeof path, "%s/%s/%s", ml->run_dir, part, key);
    char *slash = strrchr(path, '/');
    if (strchr(key, '/')) {                                    /* system/rss_mb: metrics/system/, as MLflow makes it */
        *slash = 0;
        int made = dt__mkdirs(path);
        *slash = '/';
        if (!made) return 0;
    }
    return dt__write_small(path, mode, text);
}
static int dt__mlflow_file_param(dt_mlflow *ml, const char *key, const char *value) { return dt__mlflow_key_file(ml, "params", key, "w", value); }
static int dt__mlflow_file_tag(dt_mlflow *ml, const char *key, const char *value) { return dt__mlflow_key_file(ml, "tags", key, "w", value); }
static int dt__mlflow_file_metric(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms) {
    char line[128];
    snprintf(line, sizeof line, "%lld %.9g %lld\n", (long long)timestamp_ms, value, (long long)step);
    return dt__mlflow_key_file(ml, "metrics", key, "a", line);
}
static int dt__mlflow_file_close(dt_mlflow *ml, dt_mlflow_status status) {
    int ok = dt__mlflow_meta(ml, status, dt__unix_ms()), err = errno;
    free(ml);
    errno = err;
    return ok;
}
static const dt__mlflow_store dt__mlflow_files = { dt__mlflow_file_param, dt__mlflow_file_tag, dt__mlflow_file_metric,
                                                   dt__mlflow_file_close };

static dt_mlflow *dt__mlflow_files_open(const char *dir, const char *experiment, const char *run_name, const char *run_id) {
    char abs[4096], cwd[4096] = "", path[4200], value[256];
    if (!dt__mkdirs(dir) || (dir[0] != '/' && !getcwd(cwd, sizeof cwd))) return NULL;
    dt__path(abs, sizeof abs, "%s%s%s", cwd, cwd[0] ? "/" : "", dir);    /* MLflow's URIs are absolute */
    dt_mlflow *ml = (dt_mlflow *)calloc(1, sizeof *ml);
    if (!ml) return NULL;
    ml->store = &dt__mlflow_files;
    dt__copy_str(ml->name, sizeof ml->name, run_name);
    dt__path(path, sizeof path, "%s/0/meta.yaml", abs);        /* MLflow's Default experiment, as it makes it */
    if (access(path, F_OK) != 0 && !dt__mlflow_experiment(abs, "0", "Default")) { free(ml); return NULL; }
    /* the experiment of this name (MLflow's own ids are 18 random digits),
       or a new one, numbered after the largest id there */
    unsigned long long largest = 0;
    DIR *d = opendir(abs);
    for (struct dirent *e; d && !ml->exp_id[0] && (e = readdir(d));) {
        if (!dt__all_digits(e->d_name) || strlen(e->d_name) >= sizeof ml->exp_id) continue;
        unsigned long long id = strtoull(e->d_name, NULL, 10);
        if (id > largest) largest = id;
        dt__path(path, sizeof path, "%s/%s/meta.yaml", abs, e->d_name);
        if (dt__yaml_value(path, "name", value, sizeof value) && !strcmp(value, experiment))
            dt__copy_str(ml->exp_id, sizeof ml->exp_id, e->d_name);
    }
    if (d) closedir(d);
    if (!ml->exp_id[0]) {
        snprintf(ml->exp_id, sizeof ml->exp_id, "%llu", largest + 1);
        if (!dt__mlflow_experiment(abs, ml->exp_id, experiment)) { free(ml); return NULL; }
    }
    dt__path(ml->exp_dir, sizeof ml->exp_dir, "%s/%s", abs, ml->exp_id);
    if (run_id && *run_id) {                                   /* continue it: its start and name stay */
        if (!dt_mlflow_run_id_valid(run_id)) { free(ml); errno = EINVAL; return NULL; }
        dt__copy_str(ml->run_id, sizeof ml->run_id, run_id);
        dt__path(ml->run_dir, sizeof ml->run_dir, "%s/%s", ml->exp_dir, run_id);
        dt__path(path, sizeof path, "%s/meta.yaml", ml->run_dir);
        if (!dt__yaml_value(path, "start_time", value, sizeof value)) { free(ml); errno = ENOENT; return NULL; }
        ml->start_ms = strtoll(value, NULL, 10);
        if (dt__yaml_value(path, "run_name", value, sizeof value)) dt__copy_str(ml->name, sizeof ml->name, value);
    } else {                                                   /* a new run: 128 random bits, as a uuid4's hex */
        uint8_t bits[16];
        FILE *r = fopen("/dev/urandom", "rb");
        size_t got = r ? fread(bits, 1, sizeof bits, r) : 0;
        if (r) fclose(r);
        uint64_t mix = (uint64_t)dt__unix_ms() * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
        for (size_t i = got; i < sizeof bits; i++) { mix = mix * 6364136223846793005ull + 1442695040888963407ull; bits[i] = (uint8_t)(mix >> 56); }
        for (int i = 0; i < 16; i++) snprintf(ml->run_id + 2 * i, 3, "%02x", bits[i]);
        dt__path(ml->run_dir, sizeof ml->run_dir, "%s/%s", ml->exp_dir, ml->run_id);
        ml->start_ms = dt__unix_ms();
    }
    static const char *const parts[4] = { "metrics", "params", "tags", "artifacts" };
    int ok = dt__mkdir_ok(ml->run_dir);
    for (int i = 0; i < 4 && ok; i++) {
        dt__path(path, sizeof path, "%s/%s", ml->run_dir, parts[i]);
        ok = dt__mkdir_ok(path);
    }
    if (!ok || !dt__mlflow_meta(ml, DT_MLFLOW_RUNNING, 0) || !dt_mlflow_tag(ml, "mlflow.runName", ml->name)) {
        int err = errno;
        free(ml);
        errno = err;
        return NULL;
    }
    return ml;
}

/* ---- MLflow's tracking server (--mlflow http://HOST:PORT) --------------------
   The same run through MLflow's REST API (/api/2.0/mlflow/...), with libcurl.
   The experiment and the run are found or made before training starts, when
   an unreachable server can still be a clear error. From then on the
   training thread only puts records on a bounded queue, and a thread of the
   run's own sends them, a batch a second (runs/log-batch: at most 1000
   records, 100 of them params and 100 tags), so a slow server or a gone one
   never holds up a step: when the queue is full, a record is dropped and
   counted. A batch the server did not take is not sent again (it may have
   taken part of it: a point twice is worse than a point missing); the first
   is a warning, and the count is said when the run closes. */
#ifdef DT_HAVE_CURL
enum { DT__MLFLOW_QUEUE = 1 << 16, DT__MLFLOW_BATCH = 1000 };
typedef struct {
    char kind;                  /* 'p' param, 't' tag, 'm' metric point, 'e' the run's end */
    char *key, *text;           /* text: a param's or tag's value */
    double value;
    int64_t step, ms;           /* ms: when (a point), or the end's time */
} dt__mlflow_record;
struct dt__mlflow_server {
    char api[4200];             /* http://HOST:PORT/api/2.0/mlflow/ */
    CURL *http;                 /* the opening thread's until the sender starts, then the sender's */
    struct curl_slist *headers;
    char curl_error[CURL_ERROR_SIZE];
    pthread_t sender;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    dt__mlflow_record *queue;   /* a ring */
    dt__mlflow_record *batch;   /* the sender's: what it takes off the ring to send */
    int64_t head, count;
    int closing, failing;       /* failing: the last batch was not taken */
    double give_up_ms;          /* closing: what is not sent by then is not sent */
    int64_t queued, lost, dropped;   /* records: all, those the server did not take, those the full queue dropped */
    char last_error[600];       /* the sender's (the opening thread's before it starts) */
    char **known;               /* a continued run's params, "key=value": MLflow refuses to change one */
    int nknown;
};

/* A growing text: a request's JSON, or an answer. */
typedef struct { char *p; size_t n, cap; int failed; } dt__text;
static void dt__text_add(dt__text *t, const char *s, size_t n) {
    if (t->failed) return;
    if (t->n + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 1024;
        while (t->n + n + 1 > cap) cap *= 2;
        char *p = (char *)realloc(t->p, cap);
        if (!p) { t->failed = 1; return; }
        t->p = p;
        t->cap = cap;
    }
    memcpy(t->p + t->n, s, n);
    t->n += n;
    t->p[t->n] = 0;
}
static void dt__text_printf(dt__text *t, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void dt__text_printf(dt__text *t, const char *fmt, ...) {
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof small) dt__text_add(t, small, (size_t)n);
    else t->failed = 1;                     /* only numbers and short words go through here */
}
/* A string in JSON's quotes: a quote, a backslash and control characters escaped. */
static void dt__text_json(dt__text *t, const char *s) {
    dt__text_add(t, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { char e[2] = { '\\', (char)c }; dt__text_add(t, e, 2); }
        else if (c < 0x20) dt__text_printf(t, "\\u%04x", c);
        else dt__text_add(t, (const char *)&c, 1);
    }
    dt__text_add(t, "\"", 1);
}
static size_t dt__http_take(char *data, size_t size, size_t count, void *to) {
    dt__text *t = (dt__text *)to;
    if (t->n + size * count > ((size_t)16 << 20)) return 0;       /* no answer of MLflow's is this long */
    dt__text_add(t, data, size * count);
    return t->failed ? 0 : size * count;
}

/* The JSON value at a path of keys ("run.info.run_id"), j left at it; 0 when absent. */
static int dt__json_enter(dt__json *j, const char *path) {
    while (*path) {
        size_t len = strcspn(path, ".");
        if (!dt__json_eat(j, '{')) return 0;
        int found = 0;
        while (j->ok && !found && dt__json_peek(j) == '"') {
            char *key = dt__json_str(j);
            dt__json_eat(j, ':');
            found = key && strlen(key) == len && !strncmp(key, path, len);
            free(key);
            if (!found) {
                dt__json_skip(j, 0);
                if (dt__json_peek(j) == ',') j->pos++;
            }
        }
        if (!found || !j->ok) return 0;
        path += len + (path[len] == '.');
    }
    return 1;
}
/* The string at `path` in an answer, into out; 0 when it is not there. */
static int dt__json_string_at(const dt__text *answer, const char *path, char *out, size_t n) {
    dt__json j = { answer->p ? answer->p : "", 0, answer->n, 1 };
    if (!dt__json_enter(&j, path) || dt__json_peek(&j) != '"') return 0;
    char *v = dt__json_str(&j);
    if (!v) return 0;
    dt__copy_str(out, n, v);
    free(v);
    return 1;
}

/* One call of the REST API: GET `what` when body is NULL, else POST body as
   JSON. The HTTP status (0: no answer, and why in s->last_error; an
   answer of 400 or more: MLflow's error code and message there). */
static long dt__mlflow_call(dt__mlflow_server *s, const char *what, const dt__text *body, dt__text *answer) {
    char url[4600];
    snprintf(url, sizeof url, "%s%s", s->api, what);
    answer->n = 0;
    answer->failed = 0;
    if (answer->p) answer->p[0] = 0;
    CURL *h = s->http;
    curl_easy_setopt(h, CURLOPT_URL, url);
    if (body) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body->p);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, (long)body->n);
    } else curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, answer);
    s->curl_error[0] = 0;
    CURLcode rc = curl_easy_perform(h);
    long status = 0;
    if (rc != CURLE_OK) {
        snprintf(s->last_error, sizeof s->last_error, "%s", s->curl_error[0] ? s->curl_error : curl_easy_strerror(rc));
        return 0;
    }
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    if (status >= 400) {
        char code[64] = "", message[400] = "";
        dt__json_string_at(answer, "error_code", code, sizeof code);
        dt__json_string_at(answer, "message", message, sizeof message);
        snprintf(s->last_error, sizeof s->last_error, "HTTP %ld%s%s%s%s", status, code[0] ? " " : "", code,
                 message[0] ? ": " : "", message);
    }
    return status;
}
static int dt__mlflow_answer_is(const dt__text *answer, const char *code) {
    char got[64];
    return dt__json_string_at(answer, "error_code", got, sizeof got) && !strcmp(got, code);
}

/* One batch: params, tags and points as one runs/log-batch, or the run's
   end as runs/update. 1 when the server took it. */
static int dt__mlflow_send(dt_mlflow *ml, const dt__mlflow_record *batch, int n, dt__text *body, dt__text *answer) {
    static const char *const status_names[6] = { "", "RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED" };
    body->n = 0;
    body->failed = 0;
    if (batch[0].kind == 'e') {
        dt__text_printf(body, "{\"run_id\":\"%s\",\"status\":\"%s\",\"end_time\":%lld}", ml->run_id,
                        status_names[batch[0].step], (long long)batch[0].ms);
        return !body->failed && dt__mlflow_call(ml->server, "runs/update", body, answer) == 200;
    }
    static const char kinds[3] = { 'm', 'p', 't' };
    static const char *const names[3] = { "metrics", "params", "tags" };
    dt__text_printf(body, "{\"run_id\":\"%s\"", ml->run_id);
    for (int k = 0; k < 3; k++) {
        int first = 1;
        for (int i = 0; i < n; i++) {
            const dt__mlflow_record *r = &batch[i];
            if (r->kind != kinds[k]) continue;
            dt__text_printf(body, first ? ",\"%s\":[{\"key\":" : ",{\"key\":", names[k]);
            first = 0;
            dt__text_json(body, r->key);
            if (r->kind != 'm') {
                dt__text_add(body, ",\"value\":", 9);
                dt__text_json(body, r->text);
            } else if (isfinite(r->value)) dt__text_printf(body, ",\"value\":%.17g", r->value);
            else dt__text_printf(body, ",\"value\":\"%s\"", isnan(r->value) ? "NaN" : r->value > 0 ? "Infinity" : "-Infinity");
            if (r->kind == 'm') dt__text_printf(body, ",\"timestamp\":%lld,\"step\":%lld", (long long)r->ms, (long long)r->step);
            dt__text_add(body, "}", 1);
        }
        if (!first) dt__text_add(body, "]", 1);
    }
    dt__text_add(body, "}", 1);
    if (body->failed) { snprintf(ml->server->last_error, sizeof ml->server->last_error, "out of memory"); return 0; }
    return dt__mlflow_call(ml->server, "runs/log-batch", body, answer) == 200;
}

/* The sender: waits up to a second for records to gather, takes a batch
   off the queue, sends it with the queue unlocked, and goes on until the
   run closes and the queue is empty (or the time to close is up). */
static void *dt__mlflow_sender(void *arg) {
    dt_mlflow *ml = (dt_mlflow *)arg;
    dt__mlflow_server *s = ml->server;
    dt__mlflow_record *batch = s->batch;
    dt__text body = { 0 }, answer = { 0 };
    pthread_mutex_lock(&s->mu);
    for (;;) {
        if (s->count < DT__MLFLOW_BATCH / 2 && !s->closing) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1;
            pthread_cond_timedwait(&s->wake, &s->mu, &until);
        }
        if (s->count == 0) {
            if (s->closing) break;
            continue;
        }
        int n = 0, params = 0, tags = 0;
        while (s->count > 0 && n < DT__MLFLOW_BATCH) {
            dt__mlflow_record *r = &s->queue[s->head % DT__MLFLOW_QUEUE];
            if ((r->kind == 'e' && n > 0) || (r->kind == 'p' && params == 100) || (r->kind == 't' && tags == 100)) break;
            params += r->kind == 'p';
            tags += r->kind == 't';
            batch[n++] = *r;
            s->head++;
            s->count--;
            if (r->kind == 'e') break;           /* the end goes alone, after everything queued before it */
        }
        /* past the time to close, what is left is dropped -- but the run's end is still sent */
        int late = s->closing && dt_now_ms() > s->give_up_ms && batch[0].kind != 'e';
        pthread_mutex_unlock(&s->mu);
        int ok = !late && dt__mlflow_send(ml, batch, n, &body, &answer);
        if (late) snprintf(s->last_error, sizeof s->last_error, "the time to close the run was up");
        char said[900] = "";
        pthread_mutex_lock(&s->mu);
        if (!ok) {
            s->lost += n;
            if (!s->failing && !late)
                snprintf(said, sizeof said, "--mlflow: the server at %.*s did not take %d records (%s): training goes on, and what "
                         "cannot be sent is counted", (int)(strlen(s->api) - strlen("/api/2.0/mlflow/")), s->api, n, s->last_error);
            s->failing = 1;
        } else if (s->failing) {
            snprintf(said, sizeof said, "--mlflow: the server answers again (%lld records were lost so far)", (long long)s->lost);
            s->failing = 0;
        }
        for (int i = 0; i < n; i++) { free(batch[i].key); free(batch[i].text); }
        if (said[0]) {                /* said with the queue unlocked: a blocked terminal must not hold up a step */
            pthread_mutex_unlock(&s->mu);
            dt_warn("%s", said);
            pthread_mutex_lock(&s->mu);
        }
    }
    pthread_mutex_unlock(&s->mu);
    free(body.p);
    free(answer.p);
    return NULL;
}

/* A record onto the queue; dropped (and counted) when the queue is full. */
static int dt__mlflow_queue(dt_mlflow *ml, char kind, const char *key, const char *text, double value, int64_t step, int64_t ms) {
    dt__mlflow_server *s = ml->server;
    pthread_mutex_lock(&s->mu);
    s->queued++;
    dt__mlflow_record r = { kind, key ? strdup(key) : NULL, text ? strdup(text) : NULL, value, step, ms };
    /* the end always has a place: the others leave the ring's last one free */
    if (s->count >= DT__MLFLOW_QUEUE - (kind != 'e') || (key && !r.key) || (text && !r.text)) {
        s->dropped++;
        free(r.key);
        free(r.text);
    } else {
        s->queue[(s->head + s->count) % DT__MLFLOW_QUEUE] = r;
        s->count++;
        if (s->count >= DT__MLFLOW_BATCH / 2 || kind == 'e') pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->mu);
    return 1;
}
static int dt__mlflow_server_param(dt_mlflow *ml, const char *key, const char *value) {
    dt__mlflow_server *s = ml->server;
    size_t k = strlen(key);
    for (int i = 0; i < s->nknown; i++)         /* a continued run: the value it has stays */
        if (!strncmp(s->known[i], key, k) && s->known[i][k] == '=') {
            if (strcmp(s->known[i] + k + 1, value))
                dt_warn("--mlflow: the run continued has %s = %s; this part's %s is not recorded (MLflow's params do not change)",
                        key, s->known[i] + k + 1, value);
            return 1;
        }
    return dt__mlflow_queue(ml, 'p', key, value, 0, 0, 0);
}
static int dt__mlflow_server_tag(dt_mlflow *ml, const char *key, const char *value) { return dt__mlflow_queue(ml, 't', key, value, 0, 0, 0); }
static int dt__mlflow_server_metric(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms) {
    return dt__mlflow_queue(ml, 'm', key, NULL, value, step, timestamp_ms);
}
static void dt__mlflow_server_free(dt_mlflow *ml) {
    dt__mlflow_server *s = ml->server;
    if (s->http) curl_easy_cleanup(s->http);
    curl_slist_free_all(s->headers);
    for (int i = 0; i < s->nknown; i++) free(s->known[i]);
    free(s->known);
    free(s->queue);
    free(s->batch);
    free(s);
    free(ml);
}
/* The end: queued after everything else; the sender has 20 s to send
   what is queued (then it drops the rest and sends the end alone: one
   request, at most 15 s more); what was lost is said. */
static int dt__mlflow_server_close(dt_mlflow *ml, dt_mlflow_status status) {
    dt__mlflow_server *s = ml->server;
    dt__mlflow_queue(ml, 'e', NULL, NULL, 0, status, dt__unix_ms());
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    s->give_up_ms = dt_now_ms() + 20e3;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->sender, NULL);
    if (s->lost || s->dropped) {
        char why[800] = "";
        if (s->dropped) snprintf(why, sizeof why, "%lld dropped while the queue of %d was full%s", (long long)s->dropped,
                                 DT__MLFLOW_QUEUE, s->lost ? "; " : "");
        if (s->lost) snprintf(why + strlen(why), sizeof why - strlen(why), "the server's last answer: %s", s->last_error);
        dt_warn("--mlflow: %lld of the run's %lld records (params, tags, metric points, its end) could not be sent to %s (%s)",
                (long long)(s->lost + s->dropped), (long long)s->queued, ml->run_dir, why);
    }
    dt__mlflow_server_free(ml);
    return 1;
}
static const dt__mlflow_store dt__mlflow_server_store = { dt__mlflow_server_param, dt__mlflow_server_tag,
                                                          dt__mlflow_server_metric, dt__mlflow_server_close };

/* The experiment of this name, made when there is none (by whoever comes first). */
static int dt__mlflow_server_experiment(dt_mlflow *ml, const char *experiment, dt__text *body, dt__text *answer) {
    dt__mlflow_server *s = ml->server;
    char *name = curl_easy_escape(s->http, experiment, 0), what[1200];
    snprintf(what, sizeof what, "experiments/get-by-name?experiment_name=%s", name ? name : "");
    curl_free(name);
    for (int tries = 0; tries < 2; tries++) {
        long status = dt__mlflow_call(s, what, NULL, answer);
        if (status == 200) return dt__json_string_at(answer, "experiment.experiment_id", ml->exp_id, sizeof ml->exp_id);
        if (!status || !dt__mlflow_answer_is(answer, "RESOURCE_DOES_NOT_EXIST")) return 0;
        body->n = 0;
        dt__text_add(body, "{\"name\":", 8);
        dt__text_json(body, experiment);
        dt__text_add(body, "}", 1);
        status = dt__mlflow_call(s, "experiments/create", body, answer);
        if (status == 200) return dt__json_string_at(answer, "experiment_id", ml->exp_id, sizeof ml->exp_id);
        if (!status || !dt__mlflow_answer_is(answer, "RESOURCE_ALREADY_EXISTS")) return 0;   /* made meanwhile: look again */
    }
    return 0;
}
/* A continued run: its name, start and params as the server has them; it is RUNNING again. */
static int dt__mlflow_server_continue(dt_mlflow *ml, const char *run_id, dt__text *body, dt__text *answer) {
    dt__mlflow_server *s = ml->server;
    char what[200], start[32] = "";
    snprintf(what, sizeof what, "runs/get?run_id=%s", run_id);
    long status = dt__mlflow_call(s, what, NULL, answer);
    if (status != 200) {
        errno = status && dt__mlflow_answer_is(answer, "RESOURCE_DOES_NOT_EXIST") ? ENOENT : EIO;
        return 0;
    }
    dt__copy_str(ml->run_id, sizeof ml->run_id, run_id);
    dt__json_string_at(answer, "run.info.run_name", ml->name, sizeof ml->name);
    dt__json_string_at(answer, "run.info.experiment_id", ml->exp_id, sizeof ml->exp_id);
    dt__json j = { answer->p, 0, answer->n, 1 };
    if (dt__json_enter(&j, "run.info.start_time")) { int64_t t = dt__json_int(&j); if (j.ok) snprintf(start, sizeof start, "%lld", (long long)t); }
    ml->start_ms = start[0] ? strtoll(start, NULL, 10) : dt__unix_ms();
    dt__json p = { answer->p, 0, answer->n, 1 };
    if (dt__json_enter(&p, "run.data.params") && dt__json_eat(&p, '[')) {
        while (p.ok && dt__json_peek(&p) == '{') {
            char key[256] = "", value[1024] = "";
            p.pos++;
            while (p.ok && dt__json_peek(&p) == '"') {
                char *name = dt__json_str(&p), *v = NULL;
                dt__json_eat(&p, ':');
                if (dt__json_peek(&p) == '"') v = dt__json_str(&p);
                else dt__json_skip(&p, 0);
                if (name && v && !strcmp(name, "key")) dt__copy_str(key, sizeof key, v);
                if (name && v && !strcmp(name, "value")) dt__copy_str(value, sizeof value, v);
                free(name);
                free(v);
                if (dt__json_peek(&p) == ',') p.pos++;
            }
            dt__json_eat(&p, '}');
            char **more = (char **)realloc(s->known, sizeof *more * (size_t)(s->nknown + 1)), kv[1400];
            if (!more) break;
            s->known = more;
            snprintf(kv, sizeof kv, "%s=%s", key, value);
            if ((s->known[s->nknown] = strdup(kv))) s->nknown++;
            if (dt__json_peek(&p) == ',') p.pos++;
        }
    }
    body->n = 0;
    dt__text_printf(body, "{\"run_id\":\"%s\",\"status\":\"RUNNING\"}", run_id);
    if (dt__mlflow_call(s, "runs/update", body, answer) == 200) return 1;
    errno = EIO;                        /* the run is there: not a new one, whatever curl left in errno */
    return 0;
}
static void dt__curl_start(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }
static dt_mlflow *dt__mlflow_server_open(const char *url, const char *experiment, const char *run_name, const char *run_id) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, dt__curl_start);
    size_t len = strlen(url);
    while (len > 0 && url[len - 1] == '/') len--;          /* http://host:5000/ is http://host:5000 */
    if (!strncmp(url, "https://", 8) && !(curl_version_info(CURLVERSION_NOW)->features & CURL_VERSION_SSL)) {
        snprintf(dt__mlflow_why, sizeof dt__mlflow_why, "this libcurl (%s) has no TLS for https://", curl_version());
        errno = ENOTSUP;
        return NULL;
    }
    dt_mlflow *ml = (dt_mlflow *)calloc(1, sizeof *ml);
    dt__mlflow_server *s = (dt__mlflow_server *)calloc(1, sizeof *s);
    dt__mlflow_record *queue = (dt__mlflow_record *)calloc(DT__MLFLOW_QUEUE, sizeof *queue),
                      *batch = (dt__mlflow_record *)calloc(DT__MLFLOW_BATCH, sizeof *batch);
    if (!ml || !s || !queue || !batch || len > 4000 || !(s->http = curl_easy_init())) {
        free(ml); free(queue); free(batch);
        if (s && s->http) curl_easy_cleanup(s->http);
        free(s);
        errno = len > 4000 ? ENAMETOOLONG : ENOMEM;
        return NULL;
    }
    ml->store = &dt__mlflow_server_store;
    ml->server = s;
    s->queue = queue;
    s->batch = batch;
    snprintf(s->api, sizeof s->api, "%.*s/api/2.0/mlflow/", (int)len, url);
    dt__copy_str(ml->name, sizeof ml->name, run_name);
    /* MLflow's own settings for a server behind a login (its client reads the same) */
    const char *token = getenv("MLFLOW_TRACKING_TOKEN"), *user = getenv("MLFLOW_TRACKING_USERNAME"),
               *password = getenv("MLFLOW_TRACKING_PASSWORD"), *insecure = getenv("MLFLOW_TRACKING_INSECURE_TLS");
    char bearer[2200];
    s->headers = curl_slist_append(NULL, "Content-Type: application/json");
    if (token && *token) {
        snprintf(bearer, sizeof bearer, "Authorization: Bearer %.2000s", token);
        s->headers = curl_slist_append(s->headers, bearer);
    }
    CURL *h = s->http;
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, s->headers);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, dt__http_take);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, s->curl_error);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);               /* two threads, and the run's own signal handlers */
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 15000L);
    curl_easy_setopt(h, CURLOPT_USERAGENT, "dtrain");
    if (user && *user) { curl_easy_setopt(h, CURLOPT_USERNAME, user); curl_easy_setopt(h, CURLOPT_PASSWORD, password ? password : ""); }
    if (insecure && (!strcmp(insecure, "true") || !strcmp(insecure, "1"))) {
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 0L);
    }
    dt__text body = { 0 }, answer = { 0 };
    int ok = s->headers && dt__mlflow_server_experiment(ml, experiment, &body, &answer);
    errno = EIO;
    if (ok && run_id && *run_id) {
        if (!dt_mlflow_run_id_valid(run_id)) { errno = EINVAL; ok = 0; }
        else ok = dt__mlflow_server_continue(ml, run_id, &body, &answer);
    } else if (ok) {
        const char *who = getenv("USER");
        ml->start_ms = dt__unix_ms();
        body.n = 0;
        dt__text_add(&body, "{\"experiment_id\":", 17);
        dt__text_json(&body, ml->exp_id);
        dt__text_add(&body, ",\"run_name\":", 12);
        dt__text_json(&body, run_name);
        dt__text_printf(&body, ",\"start_time\":%lld,\"tags\":[{\"key\":\"mlflow.user\",\"value\":", (long long)ml->start_ms);
        dt__text_json(&body, who && *who ? who : "dtrain");
        dt__text_add(&body, "}]}", 3);
        errno = EIO;
        ok = !body.failed && dt__mlflow_call(s, "runs/create", &body, &answer) == 200 &&
             dt__json_string_at(&answer, "run.info.run_id", ml->run_id, sizeof ml->run_id) && dt_mlflow_run_id_valid(ml->run_id);
        if (!ok && !s->last_error[0]) snprintf(s->last_error, sizeof s->last_error, "the server's answer to runs/create has no run id");
    }
    int err = errno;
    free(body.p);
    free(answer.p);
    if (ok) {
        snprintf(ml->run_dir, sizeof ml->run_dir, "%.*s/#/experiments/%s/runs/%s", (int)len, url, ml->exp_id, ml->run_id);
        pthread_mutex_init(&s->mu, NULL);
        pthread_cond_init(&s->wake, NULL);
        int started = pthread_create(&s->sender, NULL, dt__mlflow_sender, ml);
        if (started == 0) return ml;
        err = started;                  /* pthread_create says why by its result, not errno */
        snprintf(s->last_error, sizeof s->last_error, "cannot start the thread that sends: %s", strerror(err));
    }
    if (s->last_error[0]) dt__copy_str(dt__mlflow_why, sizeof dt__mlflow_why, s->last_error);
    dt__mlflow_server_free(ml);
    errno = err ? err : EIO;
    return NULL;
}
#else
/* Built without libcurl: a tracking server's address is refused, saying what the build needs. */
static dt_mlflow *dt__mlflow_server_open(const char *url, const char *experiment, const char *run_name, const char *run_id) {
    (void)experiment; (void)run_name; (void)run_id;
    snprintf(dt__mlflow_why, sizeof dt__mlflow_why, "this dtrain was built without libcurl, which a tracking server's address "
             "(%.200s) needs: install it (Debian: libcurl4-openssl-dev) and build again, or give --mlflow a folder", url);
    errno = ENOTSUP;
    return NULL;
}
#endif

dt_mlflow *dt_mlflow_open(const char *where, const char *experiment, const char *run_name, const char *run_id) {
    dt__mlflow_why[0] = 0;
    dt_mlflow *ml = dt_mlflow_is_server(where) ? dt__mlflow_server_open(where, experiment, run_name, run_id)
                                               : dt__mlflow_files_open(where, experiment, run_name, run_id);
    if (!ml && !dt__mlflow_why[0]) dt__copy_str(dt__mlflow_why, sizeof dt__mlflow_why, strerror(errno));
    return ml;
}
int dt_mlflow_param(dt_mlflow *ml, const char *key, const char *value) { return ml->store->param(ml, key, value); }
int dt_mlflow_tag(dt_mlflow *ml, const char *key, const char *value) { return ml->store->tag(ml, key, value); }
int dt_mlflow_metric(dt_mlflow *ml, const char *key, double value, int64_t step, int64_t timestamp_ms) {
    return ml->store->metric(ml, key, value, step, timestamp_ms);
}
int dt_mlflow_close(dt_mlflow *ml, dt_mlflow_status status) { return ml ? ml->store->close(ml, status) : 1; }
const char *dt_mlflow_path(const dt_mlflow *ml) { return ml->run_dir; }
const char *dt_mlflow_run_id(const dt_mlflow *ml) { return ml->run_id; }

