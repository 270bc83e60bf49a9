//@ backend: CUDA, start-up and NCCL -- the table every kernel of 29 fills, and the collectives on GPU buffers
//@ cuda
/* ---- start-up ---- */
extern "C" int dt_cuda_device_count(char *why, size_t n) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        int driver = 0, runtime = 0;
        cudaGetLastError();
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        if (driver == 0) snprintf(why, n, "no NVIDIA driver is installed");
        else snprintf(why, n, "%s (the driver supports CUDA %d.%d, this build needs %d.%d)", cudaGetErrorString(err),
                      driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
        return 0;
    }
    if (count == 0) snprintf(why, n, "no GPU is visible");
    return count;
}

extern "C" const dt_backend *dt_cuda_backend(int local_rank, char *why, size_t n) {
    int count = dt_cuda_device_count(why, n);
    if (count == 0) return NULL;
    if (dt__cuda.stream) return &dt__cuda.table;
    dt__cuda.index = local_rank % count;          /* one GPU per rank on this machine */
    DT_CUDA_CHECK(cudaSetDevice(dt__cuda.index));
    DT_CUDA_CHECK(cudaStreamCreateWithFlags(&dt__cuda.stream, cudaStreamNonBlocking));
    dt__cublas_open();
    DT_CUBLAS_CHECK(dt__cublas.create(&dt__cuda.blas));
    DT_CUBLAS_CHECK(dt__cublas.set_stream(dt__cuda.blas, dt__cuda.stream));
    DT_CUBLAS_CHECK(dt__cublas.set_math_mode(dt__cuda.blas, CUBLAS_DEFAULT_MATH));   /* fp32, no TF32 */
    dt__cuda.partials = (double *)dt__cuda_alloc((DT_SUMSQ_BLOCKS + 1) * sizeof(double));
    cudaDeviceProp prop;
    DT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dt__cuda.index));
    dt_backend *t = &dt__cuda.table;
    snprintf(t->name, sizeof t->name, "%s", prop.name);
    t->alloc = dt__cuda_alloc; t->release = dt__cuda_release; t->zero = dt__cuda_zero;
    t->upload = dt__cuda_upload; t->download = dt__cuda_download; t->synchronize = dt__cuda_synchronize;
    t->hardware = dt__cuda_hardware;
    t->gemm = dt__cuda_gemm; t->gemm_half = dt__cuda_gemm_half; t->add_bias = dt__cuda_add_bias; t->sum_rows = dt__cuda_sum_rows;
    t->gelu_forward = dt__cuda_gelu_forward; t->gelu_backward = dt__cuda_gelu_backward;
    t->layernorm_forward = dt__cuda_layernorm_forward; t->layernorm_backward = dt__cuda_layernorm_backward;
    t->rmsnorm_forward = dt__cuda_rmsnorm_forward; t->rmsnorm_backward = dt__cuda_rmsnorm_backward;
    t->swiglu_forward = dt__cuda_swiglu_forward; t->swiglu_backward = dt__cuda_swiglu_backward;
    t->rotary_qkv_forward = dt__cuda_rotary_qkv_forward; t->rotary_qkv_backward = dt__cuda_rotary_qkv_backward;
    t->add = dt__cuda_add; t->accumulate = dt__cuda_accumulate;
    t->attention_forward = dt__cuda_attention_forward; t->attention_backward = dt__cuda_attention_backward;
    t->attention_forward_online = dt__cuda_attention_forward_online;
    t->ring_attention_step = dt__cuda_ring_attention_step;
    t->ring_attention_backward_step = dt__cuda_ring_attention_backward_step;
    t->copy_columns = dt__cuda_copy_columns;
    t->attention_backward_online = dt__cuda_attention_backward_online;
    t->vit_tokens_forward = dt__cuda_vit_tokens_forward; t->vit_tokens_backward = dt__cuda_vit_tokens_backward;
    t->token_embedding_forward = dt__cuda_token_embedding_forward;
    t->token_embedding_backward = dt__cuda_token_embedding_backward;
    t->moe_to_slots = dt__cuda_moe_to_slots; t->moe_to_tokens = dt__cuda_moe_to_tokens; t->moe_slot_dots = dt__cuda_moe_slot_dots;
    t->select_token_forward = dt__cuda_select_token_forward; t->select_token_backward = dt__cuda_select_token_backward;
    t->cross_entropy_forward = dt__cuda_cross_entropy_forward; t->cross_entropy_backward = dt__cuda_cross_entropy_backward;
    t->softmax_row_stats = dt__cuda_softmax_row_stats;
    t->patchify = dt__cuda_patchify; t->sum_squares = dt__cuda_sum_squares; t->scale = dt__cuda_scale;
    t->adamw = dt__cuda_adamw; t->sgd = dt__cuda_sgd; t->convert = dt__cuda_convert; t->owns = dt__cuda_owns;
    t->quantize = dt__cuda_quantize; t->dequantize = dt__cuda_dequantize;
    return t;
}
/* ---- NCCL: the collectives chapter's operations on GPU buffers (the contract
        is in the backend-tables chapter). The communicator is non-blocking, so no
        call can hang the thread that makes it: the collectives chapter's watchdog polls
        dt_nccl_progress, and aborts when a rank dies or --timeout passes. Each
        collective has two events: `inputs`, recorded on the compute stream
        when it is queued (its input is the output of the kernels before it),
        and `done`, recorded on NCCL's stream after it; the compute stream
        waits for `done` -- for that collective only, so the next one (FSDP's
        prefetch) still overlaps the compute. ---- */
#ifdef DT_HAVE_NCCL
#include <nccl.h>
struct dt_nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t inputs[DT_COMM_QUEUE], done[DT_COMM_QUEUE];
    float *one;                          /* a 1-element buffer: a barrier is an all-reduce of it */
};
static void dt__nccl_check(ncclResult_t r, const char *call, const char *file, int line) {
    if (r != ncclSuccess && r != ncclInProgress) dt_fail("%s failed at %s:%d: %s", call, file, line, ncclGetErrorString(r));
}
#define DT_NCCL_CHECK(call) dt__nccl_check((call), #call, __FILE__, __LINE__)

extern "C" int dt_nccl_available(char *why, size_t n) { (void)why; (void)n; return 1; }
extern "C" int dt_nccl_version(void) {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}
extern "C" int dt_nccl_unique_id(unsigned char *out, size_t n) {
    ncclUniqueId id;
    if (n < sizeof id) return 0;
    DT_NCCL_CHECK(ncclGetUniqueId(&id));
    memcpy(out, &id, sizeof id);
    return 1;
}
/* A communicator's stream, events and barrier word; its ncclComm_t comes next. */
static dt_nccl *dt__nccl_new(void) {
    if (!dt__cuda.stream) dt_fail("internal error: NCCL started before the GPU was chosen (dt_set_device)");
    dt_nccl *s = (dt_nccl *)calloc(1, sizeof *s);
    if (!s) dt_fail("out of memory (NCCL)");
    DT_CUDA_CHECK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    for (int k = 0; k < DT_COMM_QUEUE; k++) {
        DT_CUDA_CHECK(cudaEventCreateWithFlags(&s->inputs[k], cudaEventDisableTiming));
        DT_CUDA_CHECK(cudaEventCreateWithFlags(&s->done[k], cudaEventDisableTiming));
    }
    s->one = (float *)dt__cuda_alloc(sizeof(float));
    DT_CUDA_CHECK(cudaMemsetAsync(s->one, 0, sizeof(float), dt__cuda.stream));
    DT_CUDA_CHECK(cudaStreamSynchronize(dt__cuda.stream));
    return s;
}
extern "C" dt_nccl *dt_nccl_create(const unsigned char *id_bytes, int rank, int world) {
    dt_nccl *s = dt__nccl_new();
    ncclUniqueId id;
    memcpy(&id, id_bytes, sizeof id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;                 /* every call returns at once; the collectives chapter polls */
    DT_NCCL_CHECK(ncclCommInitRankConfig(&s->comm, world, id, rank, &config));
    return s;
}
extern "C" dt_nccl *dt_nccl_split(dt_nccl *parent, int color, int key) {
    dt_nccl *s = dt__nccl_new();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    DT_CUDA_CHECK(cudaSetDevice(dt__cuda.index));
    DT_NCCL_CHECK(ncclCommSplit(parent->comm, color, key, &s->comm, &config));
    return s;
}
extern "C" int dt_nccl_progress(dt_nccl *s, char *why, size_t n) {
    ncclResult_t state = ncclSuccess, r = ncclCommGetAsyncError(s->comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return 1;
    if (state == ncclInProgress) return 0;
    snprintf(why, n, "%s (%s)", ncclGetErrorString(state), ncclGetLastError(s->comm));
    return -1;
}
extern "C" void dt_nccl_mark_inputs(dt_nccl *s, int slot) { DT_CUDA_CHECK(cudaEventRecord(s->inputs[slot], dt__cuda.stream)); }
extern "C" void dt_nccl_issue(dt_nccl *s, int slot, const dt_comm_op *o) {
    ncclDataType_t t = o->dtype == DT_F32 ? ncclFloat32 : o->dtype == DT_BF16 ? ncclBfloat16 : ncclFloat16;
    ncclRedOp_t red = o->op == DT_AVG ? ncclAvg : o->op == DT_MAX ? ncclMax : ncclSum;
    size_t n = (size_t)o->count;
    const void *send = o->send;
    void *recv = o->recv;
    ncclComm_t comm = s->comm;
    cudaStream_t st = s->stream;
    DT_CUDA_CHECK(cudaSetDevice(dt__cuda.index));           /* the current GPU is per thread */
    DT_CUDA_CHECK(cudaStreamWaitEvent(st, s->inputs[slot], 0));
    switch (o->kind) {
    case DT_COLL_ALL_REDUCE: DT_NCCL_CHECK(ncclAllReduce(send, recv, n, t, red, comm, st)); break;
    case DT_COLL_REDUCE_SCATTER: DT_NCCL_CHECK(ncclReduceScatter(send, recv, n, t, red, comm, st)); break;
    case DT_COLL_ALL_GATHER: DT_NCCL_CHECK(ncclAllGather(send, recv, n, t, comm, st)); break;
    case DT_COLL_BROADCAST: DT_NCCL_CHECK(ncclBroadcast(send, recv, n, t, o->root, comm, st)); break;
    case DT_COLL_REDUCE: DT_NCCL_CHECK(ncclReduce(send, recv, n, t, red, o->root, comm, st)); break;
    case DT_COLL_BARRIER: DT_NCCL_CHECK(ncclAllReduce(s->one, s->one, 1, ncclFloat32, ncclSum, comm, st)); break;
    case DT_COLL_SEND: DT_NCCL_CHECK(ncclSend(send, n, t, o->root, comm, st)); break;
    case DT_COLL_RECV: DT_NCCL_CHECK(ncclRecv(recv, n, t, o->root, comm, st)); break;
    case DT_COLL_RING_SHIFT:                 /* grouped: every rank's send and receive at once */
        DT_NCCL_CHECK(ncclGroupStart());
        DT_NCCL_CHECK(ncclSend(send, n, t, o->root, comm, st));
        DT_NCCL_CHECK(ncclRecv(recv, n, t, o->from, comm, st));
        DT_NCCL_CHECK(ncclGroupEnd());
        break;
    case DT_COLL_ALL_TO_ALL: {               /* grouped: a send and a receive per rank, this one's too */
        int W = 0;
        size_t es = o->dtype == DT_F32 ? 4 : 2, sent = 0, got = 0;
        DT_NCCL_CHECK(ncclCommCount(comm, &W));
        DT_NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < W; sent += (size_t)o->counts[r], got += (size_t)o->counts[W + r], r++) {
            if (o->counts[r]) DT_NCCL_CHECK(ncclSend((const char *)send + sent * es, (size_t)o->counts[r], t, r, comm, st));
            if (o->counts[W + r]) DT_NCCL_CHECK(ncclRecv((char *)recv + got * es, (size_t)o->counts[W + r], t, r, comm, st));
        }
        DT_NCCL_CHECK(ncclGroupEnd());
        break;
    }
    }
}
extern "C" void dt_nccl_mark_done(dt_nccl *s, int slot) { DT_CUDA_CHECK(cudaEventRecord(s->done[slot], s->stream)); }
extern "C" int dt_nccl_finished(dt_nccl *s, int slot) {
    cudaError_t q = cudaEventQuery(s->done[slot]);
    if (q == cudaErrorNotReady) { cudaGetLastError(); return 0; }     /* not an error: leave none behind */
    DT_CUDA_CHECK(q);
    return 1;
}
extern "C" void dt_nccl_stream_wait(dt_nccl *s, int slot) { DT_CUDA_CHECK(cudaStreamWaitEvent(dt__cuda.stream, s->done[slot], 0)); }
extern "C" void dt_nccl_abort(dt_nccl *s) { ncclCommAbort(s->comm); s->comm = NULL; }
extern "C" void dt_nccl_finalize(dt_nccl *s) { if (s->comm) DT_NCCL_CHECK(ncclCommFinalize(s->comm)); }
extern "C" void dt_nccl_free(dt_nccl *s) {
    if (s->comm) DT_NCCL_CHECK(ncclCommDestroy(s->comm));
    for (int k = 0; k < DT_COMM_QUEUE; k++) {
        DT_CUDA_CHECK(cudaEventDestroy(s->inputs[k]));
        DT_CUDA_CHECK(cudaEventDestroy(s->done[k]));
    }
    DT_CUDA_CHECK(cudaStreamDestroy(s->stream));
    dt__cuda_release(s->one);
    free(s);
}
#else
/* A CUDA build without NCCL: one GPU per job works; a job of several ranks
   on GPUs is refused at start (dt_parse_args asks dt_nccl_available). */
extern "C" int dt_nccl_available(char *why, size_t n) {
    snprintf(why, n, "this build has no NCCL: install it (Debian: libnccl-dev; or pip install nvidia-nccl-cu13, "
             "found by the Makefile; or NCCL_HOME=DIR), then make clean all");
    return 0;
}
extern "C" int dt_nccl_version(void) { return 0; }
static void dt__no_nccl(void) { dt_fail("internal error: NCCL used in a build without it"); }
extern "C" int dt_nccl_unique_id(unsigned char *out, size_t n) { (void)out; (void)n; dt__no_nccl(); return 0; }
extern "C" dt_nccl *dt_nccl_create(const unsigned char *id_bytes, int rank, int world) {
    (void)id_bytes; (void)rank; (void)world; dt__no_nccl(); return NULL;
}
extern "C" int dt_nccl_progress(dt_nccl *s, char *why, size_t n) { (void)s; (void)why; (void)n; dt__no_nccl(); return -1; }
extern "C" void dt_nccl_mark_inputs(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); }
extern "C" dt_nccl *dt_nccl_split(dt_nccl *parent, int color, int key) {
    (void)parent; (void)color; (void)key; dt__no_nccl(); return NULL;
}
extern "C" void dt_nccl_issue(dt_nccl *s, int slot, const dt_comm_op *o) { (void)s; (void)slot; (void)o; dt__no_nccl(); }
extern "C" void dt_nccl_mark_done(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); }
extern "C" int dt_nccl_finished(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); return 0; }
extern "C" void dt_nccl_stream_wait(dt_nccl *s, int slot) { (void)s; (void)slot; dt__no_nccl(); }
extern "C" void dt_nccl_abort(dt_nccl *s) { (void)s; }
extern "C" void dt_nccl_finalize(dt_nccl *s) { (void)s; }
extern "C" void dt_nccl_free(dt_nccl *s) { (void)s; }
#endif
#endif /* DTRAIN_CUDA_IMPLEMENTATION */
