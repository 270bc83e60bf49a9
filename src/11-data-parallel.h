//@ lesson: data parallelism -- DataParallel, DDP (buckets all-reduced during backward), FSDP (ZeRO-1/2/3, CPU offload)
/* ---- parallel wrappers ------------------------------------------------------- */

/* What a step of each parallel scheme computes and communicates, as the
   cost model (a chapter of the machinery) prices it: each wrapper fills its
   part from what its last step measured (dt_parallel's cost_input). */
typedef enum { DT_PAR_NONE = 0, DT_PAR_DP, DT_PAR_DDP, DT_PAR_ZERO1, DT_PAR_ZERO2, DT_PAR_ZERO3, DT_PAR_TP, DT_PAR_PP } dt_parallelism;
typedef struct dt_cost_input {
    dt_parallelism kind;
    double compute_ms;         /* one rank's forward + backward for one micro-batch, on its own device */
    double contention;         /* how much slower that compute runs when N ranks share the device(s): 1 on
                                  GPUs of their own; on a CPU about N (the ranks share its cores) */
    double backward_share;     /* the part of compute that is backward, which DDP's buckets hide behind (~2/3) */
    double params;             /* parameter count */
    double gather_bytes;       /* bytes per parameter gathered (FSDP: 4, or 2 in bf16/fp16) */
    double reduce_bytes;       /* bytes per gradient reduced (4, or 2 with --reduce-dtype bf16) */
    int accum_steps;           /* micro-batches per optimizer step */
    int messages;              /* collectives per step on the critical path: DDP's buckets, FSDP's units */
    double optimizer_ms;       /* the optimizer's step, on its own device: sharded (ZeRO), each rank does 1/N */
    /* tensor parallelism: the share of compute (and optimizer) in the split
       layers, which N ranks divide; the sums of activations or their
       gradients per micro-batch (4 per transformer block: 2 forward, 2
       backward), and the bytes of each (batch x tokens x width x 4) */
    double tp_share, tp_sums, tp_bytes;
    /* ... and, for a pipeline (DT_PAR_PP) whose stages split their layers
       too (07's --tp), how many ranks each stage's layers are split over
       (0 or 1: none); tp_sums then counts the whole model's sums per
       micro-batch, and tp_bytes those of a micro-batch. Tensor parallelism
       alone (DT_PAR_TP) has its T in dt_cost_predict's n. */
    int tp_ranks;
    /* ... and with more ranks than T (or P), the data-parallel groups of T
       (pipelines of P): after backward each rank's gradients (tensor: params
       x (tp_share / T + 1 - tp_share) x reduce_bytes; pipeline: its stage's)
       are averaged over them, exposed (0 or 1: one group) */
    int dp_groups;
    /* pipeline parallelism: the micro-batches of a step; the largest
       stage's share of the compute times P (1 when the stages are even: the
       slowest stage sets the pipeline's pace); the bytes of one activation
       sent on (micro-batch x tokens x width x 4), a gradient as many back */
    int pp_micro_batches;
    double pp_balance, pp_bytes;
    int pp_zero1;               /* --shard optimizer: the D pipelines each step 1/D of the optimizer state */
    double pp_measured_bubble;  /* ... and the share of the step this rank waited, as measured: printed beside the
                                   formula's, not used by the prediction */
} dt_cost_input;

/* DataParallel (stage 02): one process drives N devices. Device 0 holds the
   model and the optimizer; every other device holds a replica, run by a thread
   of its own. Each step: replicate (device 0's parameters broadcast to every
   replica), scatter (each device takes its slice of the batch), forward on
   every device at once, gather (the logits back to device 0, where the loss is
   computed). Backward runs on every device, then the gradients are summed onto
   device 0 (reduce), which steps alone. Device 0 does more than the others:
   that is DataParallel's bottleneck, and the reason for DDP. */
typedef struct dt_dp dt_dp;
/* Start devices-1 replica threads (devices <= 1: none, the model runs alone). */
dt_dp *dt_dp_create(dt_model *model, int devices, double timeout_s);
/* Replicate, scatter the inputs [N*B, ...] in N slices, run every device's
   forward, gather the logits on device 0, device after device ([N*B, classes],
   or a language model's [N*B*T, vocab]). The gather is on the tape: its
   backward hands each device its slice of the gradient and starts that
   device's backward while device 0 goes on with its own. */
dt_tensor *dt_dp_forward(dt_dp *dp, dt_tensor *inputs);
/* Wait for every device's backward, then sum their gradients into device 0's. */
void dt_dp_reduce_grads(dt_dp *dp);
int dt_dp_devices(const dt_dp *dp);
/* Stop the replicas; prints each device's peak memory unless quiet. */
void dt_dp_free(dt_dp *dp, int quiet);

/* DistributedDataParallel (stages 03-05): one process per device, each with a
   whole replica and its own optimizer; only gradients travel. They travel in
   buckets: runs of parameters taken in reverse order (the order backward
   finishes them), about bucket_mb each (the first one 1 MB, so communication
   starts early). A bucket's all-reduce (average) starts the moment its last
   gradient is final, on the communication thread or stream, while backward
   goes on. bucket_mb 0: one all-reduce of everything after backward, the
   no-overlap baseline (same bits: the sums run in rank order either way). */
typedef struct dt_ddp dt_ddp;
/* Broadcast rank 0's parameters (every replica starts equal) and plan the buckets. */
dt_ddp *dt_ddp_create(dt_model *model, dt_comm *comm, double bucket_mb);
/* After backward: start what has not started, wait for every bucket. Every
   rank then holds the average gradient. */
void dt_ddp_sync_grads(dt_ddp *ddp);
int dt_ddp_buckets(const dt_ddp *ddp);
/* Gradient accumulation (stage 05): with sync 0 the backward passes that follow
   leave their gradients to add up locally and communicate nothing (PyTorch's
   no_sync()); the backward after dt_ddp_set_sync(ddp, 1) all-reduces the sum. */
void dt_ddp_set_sync(dt_ddp *ddp, int sync);
void dt_ddp_free(dt_ddp *ddp);

/* Fully sharded data parallel (stages 04-05): like DDP, but no rank keeps the
   whole model. Each unit's parameters are one flat buffer padded to a multiple
   of N; rank r keeps elements [r, r + 1) * size/N of it -- its shard -- and the
   optimizer state of that shard only. The mode chooses what is sharded, as the
   ZeRO paper's stages do:
     DT_SHARD_OPTIMIZER  optimizer state (ZeRO-1): gradients reduce-scattered
                         after backward, each rank steps its shard, the new
                         parameters are all-gathered
     DT_SHARD_GRADS      + gradients (ZeRO-2): each unit's gradients are
                         reduce-scattered as soon as its backward is done
     DT_SHARD_FULL       + parameters (ZeRO-3): a unit is all-gathered just
                         before its forward, freed after it, gathered again
                         just before its backward; the next unit's all-gather
                         is started while one computes (prefetch), and the
                         last unit stays gathered from its forward into its
                         backward, which needs it first
   Checkpoints of a sharded model are sharded too (the checkpoints chapter). */
typedef enum { DT_SHARD_NONE = -1, DT_SHARD_OPTIMIZER = 0, DT_SHARD_GRADS = 1, DT_SHARD_FULL = 2 } dt_shard_mode;   /* NONE: 07's default */
typedef struct dt_fsdp dt_fsdp;
/* Broadcast rank 0's parameters, keep this rank's shards, free the rest. The
   optimizer, created after this, holds the shard's state only. cpu_offload:
   the shards and the optimizer state live in host memory, the optimizer steps
   on the CPU, and a unit's shard is copied to the device just before its
   all-gather (on a CPU-only run, between the device and host arenas). */
dt_fsdp *dt_fsdp_create(dt_model *model, dt_comm *comm, dt_shard_mode mode, int cpu_offload);
/* After backward: DT_SHARD_OPTIMIZER reduce-scatters every gradient now (the
   other modes did it unit by unit during backward). */
void dt_fsdp_sync_grads(dt_fsdp *fsdp);
/* Gradient accumulation (stage 05), as dt_ddp_set_sync: with sync 0 no unit is
   reduce-scattered, and each unit's whole gradient adds up in a buffer of the
   model's size (PyTorch's FSDP no_sync() keeps unsharded gradients too: fewer
   collectives, paid for in memory); the next synchronised backward
   reduce-scatters the sums. */
void dt_fsdp_set_sync(dt_fsdp *fsdp, int sync);
/* Reduce-scatter gradients in this dtype (default f32), as PyTorch's
   MixedPrecision(reduce_dtype=...). Parameters are gathered in the compute
   dtype that was set when dt_fsdp_create ran (the mixed-precision chapter). */
void dt_fsdp_set_reduce_dtype(dt_fsdp *fsdp, dt_dtype dtype);
void dt_fsdp_free(dt_fsdp *fsdp);

//@ implementation
/* ==== parallel wrappers =====================================================
   Data parallel training in three shapes. DataParallel (stage 02): one
   process, N devices, device 0 in charge -- replicate, scatter, forward,
   gather, loss, backward, reduce, step, all through device 0.
   DistributedDataParallel (stage 03): N processes, each a full replica with its
   own optimizer; the only traffic is the average of the gradients, and it
   overlaps with backward. Fully sharded (stage 04): N processes that each keep
   1/N of the model and of its optimizer state; a unit is gathered whole only
   while it computes, the next one's gather already on its way, and each rank
   receives the average gradient of its own part only. The model, autograd and
   the optimizer are the ones stage 01 uses: the wrappers only decide where
   copies (or pieces) of them live and what crosses between them. */

/* What the wrappers communicated, for this step's log line and trace. `hidden`
   is the part of [t0, t1] that ran while backward was still computing. */
static void dt__record_span(const char *name, double t0, double t1, int pipeline) {
    if (dt__ctx.ncomm_events < (int)(sizeof dt__ctx.comm_events / sizeof dt__ctx.comm_events[0])) {
        int k = dt__ctx.ncomm_events++;
        dt__copy_str(dt__ctx.comm_events[k].name, sizeof dt__ctx.comm_events[k].name, name);
        dt__ctx.comm_events[k].t0 = t0;
        dt__ctx.comm_events[k].t1 = t1;
        dt__ctx.comm_events[k].pipeline = pipeline;
    }
}
static void dt__record_comm(const char *name, double t0, double t1, double hidden) {
    dt__ctx.comm_ms += t1 - t0;
    dt__ctx.comm_hidden_ms += hidden;
    dt__record_span(name, t0, t1, 0);
}
/* Pipeline parallelism's forwards, backwards and waits: a track of their own. */
static void dt__record_event(const char *name, double t0, double t1) { dt__record_span(name, t0, t1, 1); }

/* A thread that ran ops gives back what its context holds before it ends. */
static void dt__context_release(void) {
    dt_step_arena_reset();                  /* the tape emptied */
    dt__step_arena_free(dt__ctx.step);      /* spill blocks and blocks back */
    dt__step_arena_free(dt__ctx.scratch);
    free(dt__ctx.tape);
    dt__ctx.tape = NULL;
    dt__ctx.tape_cap = 0;
    DT_OMP("omp parallel")
    {
        free(dt__pack_buffer);               /* each thread of this device's team frees its own */
        dt__pack_buffer = NULL;
        dt__pack_floats = 0;
    }
}

/* -- DataParallel -- */
typedef enum { DT_DP_FORWARD = 1, DT_DP_BACKWARD, DT_DP_REDUCE, DT_DP_QUIT } dt__dp_job;

typedef struct dt__dp_device {
    struct dt_dp *dp;
    int index;
    pthread_t thread;
    dt_model *model;            /* device 0: the model itself; the others: replicas */
    dt_comm *comm;
    dt_tensor *logits;          /* this device's output, in its own step arena */
    const float *dlogits;       /* its slice of the gradient of the gathered logits */
    double flops;               /* counted by its thread this step */
    size_t mem_peak;
    dt__dp_job job;
    int64_t posted, finished;
    int has_base;               /* LoRA: the frozen model came from device 0 (once: it never changes) */
} dt__dp_device;

struct dt_dp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_dp */
    dt_model *model;
    int devices, threads_per_device;
    dt_tensor *inputs;          /* the batch being scattered, and its rows per device */
    int rows;
    int out_rows;               /* rows of each device's output (a language model's: rows x tokens) */
    dt_comm_group *group;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dt__dp_device dev[DT_MAX_RANKS];
};

/* Replicate, scatter, forward: the same on every device, device 0 included.
   Returns when the replicate started and ended. */
static void dt__dp_device_forward(dt_dp *dp, dt__dp_device *d, double *t0, double *t1) {
    dt_model *m = d->model;
    dt_model_set_recompute(m, dp->model->recompute);                   /* as device 0's model does */
    *t0 = dt_now_ms();
    if (m->base && !d->has_base) dt_broadcast(d->comm, m->base->flat_data, m->base->numel, DT_F32, 0);
    d->has_base = 1;
    dt_broadcast(d->comm, m->flat_data, m->numel, DT_F32, 0);          /* device 0's weights, every step */
    *t1 = dt_now_ms();
    const dt_tensor *all = dp->inputs;
    int shape[4] = { dp->rows, all->shape[1], all->shape[2], all->shape[3] };
    size_t per_image = (size_t)(all->numel / all->shape[0]);
    dt_tensor *mine = dt__tensor_alloc(all->ndim, shape, DT_F32);
    memcpy(mine->data, all->data + (size_t)d->index * dp->rows * per_image,      /* scatter: a copy to this device */
           (size_t)dp->rows * per_image * sizeof(float));
    d->logits = dt_model_forward(m, mine);
}

static void dt__dp_post(dt_dp *dp, dt__dp_job job) {
    pthread_mutex_lock(&dp->mu);
    for (int i = 1; i < dp->devices; i++) { dp->dev[i].job = job; dp->dev[i].posted++; }
    pthread_cond_broadcast(&dp->cv);
    pthread_mutex_unlock(&dp->mu);
}
static void dt__dp_wait(dt_dp *dp) {
    pthread_mutex_lock(&dp->mu);
    for (int i = 1; i < dp->devices; i++)
        while (dp->dev[i].finished != dp->dev[i].posted) pthread_cond_wait(&dp->cv, &dp->mu);
    pthread_mutex_unlock(&dp->mu);
}

/* A replica's thread: a context of its own (tape, step arena, memory counts),
   a share of the cores, and a loop doing what device 0 asks. */
static void *dt__dp_worker(void *arg) {
    dt__dp_device *d = (dt__dp_device *)arg;
    dt_dp *dp = d->dp;
    dt__flush_subnormals();
#ifdef _OPENMP
    omp_set_num_threads(dp->threads_per_device);
#endif
    d->model = dt_model_create(&dp->model->cfg, 0);     /* its weights arrive with the first broadcast */
    d->comm = dt_comm_join(dp->group, d->index);
    for (;;) {
        pthread_mutex_lock(&dp->mu);
        while (d->posted == d->finished) pthread_cond_wait(&dp->cv, &dp->mu);
        dt__dp_job job = d->job;
        pthread_mutex_unlock(&dp->mu);
        if (job == DT_DP_QUIT) break;
        if (job == DT_DP_FORWARD) {
            double t0, t1;
            dt_step_arena_reset();
            dt_flops_reset();
            dt__dp_device_forward(dp, d, &t0, &t1);
        }
        if (job == DT_DP_BACKWARD) dt_backward_from(d->logits, d->dlogits);
        if (job == DT_DP_REDUCE) {
            dt_model *m = d->model;
            dt_reduce(d->comm, m->flat_grad, m->flat_grad, m->numel, DT_F32, DT_SUM, 0);
            dt_model_zero_grad(m);
            d->flops = dt_flops_counted();
        }
        d->mem_peak = dt_mem_total_peak();
        pthread_mutex_lock(&dp->mu);
        d->finished = d->posted;
        pthread_cond_broadcast(&dp->cv);
        pthread_mutex_unlock(&dp->mu);
    }
    dt_comm_free(d->comm);
    dt_model_free(d->model);
    dt__context_release();
    return NULL;
}

static void dt__dp_backward_done(dt_parallel *par) {
    dt_dp *dp = (dt_dp *)par;
    if (dp->devices == 1) return;
    dt__dp_wait(dp);                                    /* every device's backward has finished */
    double t0 = dt_now_ms();
    dt__dp_post(dp, DT_DP_REDUCE);
    dt_model *m = dp->model;
    dt_reduce(dp->dev[0].comm, m->flat_grad, m->flat_grad, m->numel, DT_F32, DT_SUM, 0);
    dt__dp_wait(dp);
    dt__record_comm("reduce gradients", t0, dt_now_ms(), 0);
    for (int i = 1; i < dp->devices; i++) dt__ctx.flops += dp->dev[i].flops;   /* the work of every device */
}
void dt_dp_reduce_grads(dt_dp *dp) { dt_parallel_backward_done(&dp->par); }

dt_dp *dt_dp_create(dt_model *model, int devices, double timeout_s) {
    if (devices < 1 || devices > DT_MAX_RANKS) dt_fail("DataParallel over %d devices (1 to %d)", devices, DT_MAX_RANKS);
    if (devices > 1 && model->device != DT_CPU)
        dt_fail("02-dp on %d GPUs: driving several GPUs from one process needs a CUDA stream, a cuBLAS handle and an "
                "NCCL communicator per GPU, and this version keeps one per process. Use --nproc 1 here, or 03-ddp "
                "(one process per GPU)", devices);
    if (dt__ctx.compute_dtype != DT_F32)
        dt_fail("DataParallel (stage 02) runs in fp32 only; mixed precision comes with DDP and FSDP (stage 05)");
    dt_dp *dp = (dt_dp *)calloc(1, sizeof *dp);
    if (!dp) dt_fail("out of memory (DataParallel)");
    dp->par = (dt_parallel){ .create_fn = "dt_dp_create", .sync_fn = "dt_dp_reduce_grads", .free_fn = "dt_dp_free",
                             .backward_done = dt__dp_backward_done };
    dt_model_set_parallel(model, &dp->par);
    dp->model = model;
    dp->devices = devices;
    dp->threads_per_device = dt_threads() / devices > 1 ? dt_threads() / devices : 1;
    dt__ctx.devices = devices;
    if (devices == 1) return dp;
    pthread_mutex_init(&dp->mu, NULL);
    pthread_cond_init(&dp->cv, NULL);
    dp->group = dt_comm_group_create(devices, timeout_s);
#ifdef _OPENMP
    omp_set_num_threads(dp->threads_per_device);      /* the cores shared out among the devices */
#endif
    dp->dev[0].dp = dp;
    dp->dev[0].model = model;
    dp->dev[0].comm = dt_comm_join(dp->group, 0);
    for (int i = 1; i < devices; i++) {
        dp->dev[i].dp = dp;
        dp->dev[i].index = i;
        if (pthread_create(&dp->dev[i].thread, NULL, dt__dp_worker, &dp->dev[i]) != 0)
            dt_fail("cannot start the thread of device %d", i);
    }
    return dp;
}
int dt_dp_devices(const dt_dp *dp) { return dp->devices; }

/* The gather's backward: each device gets its slice of d(loss)/d(logits) and
   starts its own backward; device 0's slice flows on through device 0's tape. */
static void dt__dp_gather_backward(dt__tape_entry *e) {
    dt_dp *dp = (dt_dp *)e->saved;
    int64_t per = (int64_t)dp->out_rows * dt_tensor_cols(e->out);
    for (int i = 1; i < dp->devices; i++) dp->dev[i].dlogits = e->out->grad + i * per;
    dt__dp_post(dp, DT_DP_BACKWARD);
    float *g = dt_grad(e->in[0]);
    for (int64_t k = 0; k < per; k++) g[k] += e->out->grad[k];
}

dt_tensor *dt_dp_forward(dt_dp *dp, dt_tensor *inputs) {
    if (dp->devices == 1) return dt_model_forward(dp->model, inputs);
    int N = dp->devices, B = inputs->shape[0];
    if (B % N) dt_fail("DataParallel: a batch of %d samples does not split evenly over %d devices", B, N);
    dp->inputs = inputs;
    dp->rows = B / N;
    double t0, t1;
    dt__dp_post(dp, DT_DP_FORWARD);
    dt__dp_device_forward(dp, &dp->dev[0], &t0, &t1);
    dt__dp_wait(dp);
    dt__record_comm("broadcast parameters", t0, t1, 0);
    /* gather: every device's logits, in device order, on device 0 */
    dt_tensor *mine = dp->dev[0].logits;
    int C = (int)dt_tensor_cols(mine), R = dp->out_rows = (int)dt_tensor_rows(mine);
    dt_tensor *out = dt__tensor_out_2d(N * R, C);
    for (int i = 0; i < N; i++)
        memcpy(out->data + (size_t)i * R * C, dp->dev[i].logits->data, sizeof(float) * (size_t)R * C);
    if (dt__wants_grad(mine, NULL, NULL)) dt__tape_push(dt__dp_gather_backward, out, mine, NULL, NULL)->saved = dp;
    return out;
}

void dt_dp_free(dt_dp *dp, int quiet) {
    if (!dp) return;
    dt_model_set_parallel(dp->model, NULL);
    if (dp->devices > 1) {
        dt__dp_post(dp, DT_DP_QUIT);
        for (int i = 1; i < dp->devices; i++) pthread_join(dp->dev[i].thread, NULL);
        if (!quiet) {
            printf("peak memory per device: 0: %.1f MB (model, optimizer, gathered logits)", dt_mem_total_peak() / 1e6);
            for (int i = 1; i < dp->devices; i++) printf(", %d: %.1f MB", i, dp->dev[i].mem_peak / 1e6);
            printf("\n");
            fflush(stdout);
        }
        dt_comm_free(dp->dev[0].comm);
        dt_comm_group_free(dp->group);
        pthread_mutex_destroy(&dp->mu);
        pthread_cond_destroy(&dp->cv);
    }
    free(dp);
}

/* -- DistributedDataParallel -- */
typedef struct dt__ddp_bucket {
    int first, last;            /* parameters first..last: one run of the flat gradient */
    int64_t offset, count;
    int pending;                /* gradients of this bucket not final yet in this backward */
    dt_comm_handle handle;
} dt__ddp_bucket;

struct dt_ddp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_ddp */
    dt_model *model;
    dt_comm *comm;
    int nbuckets, launched;     /* buckets start in order: 0, 1, ... */
    dt__ddp_bucket *buckets;
    int *bucket_of;             /* parameter -> bucket */
    int sync;                   /* 0: accumulate locally (no-sync), communicate nothing */
};

/* Start every bucket that is complete and whose predecessors have started:
   all ranks must issue the collectives in the same order. */
static void dt__ddp_launch(dt_ddp *d, int all) {
    while (d->launched < d->nbuckets && (all || d->buckets[d->launched].pending == 0)) {
        dt__ddp_bucket *b = &d->buckets[d->launched++];
        float *g = d->model->flat_grad + b->offset;
        b->handle = dt_all_reduce_async(d->comm, g, g, b->count, DT_F32, DT_AVG);
        dt__ctx.grad_collectives++;
    }
}
static void dt__ddp_grad_ready(dt_parallel *par, dt_tensor *p) {
    dt_ddp *d = (dt_ddp *)par;
    if (!d->sync) return;                             /* no-sync: the gradient stays here */
    int64_t i = p - d->model->params;
    dt__ddp_bucket *b = &d->buckets[d->bucket_of[i]];
    if (b->pending > 0) b->pending--;
    dt__ddp_launch(d, 0);
}

/* After backward: start what has not started, wait for every bucket. */
static void dt__ddp_backward_done(dt_parallel *par) {
    dt_ddp *d = (dt_ddp *)par;
    if (!d->sync) return;                             /* accumulating: nothing leaves this rank */
    double backward_end = dt__ctx.backward_end_ms;
    dt__ddp_launch(d, 1);
    for (int k = 0; k < d->nbuckets; k++) {
        dt__ddp_bucket *b = &d->buckets[k];
        double t0, t1;
        char name[32];
        dt_comm_wait(d->comm, b->handle);
        dt__comm_interval(d->comm, b->handle, &t0, &t1);
        snprintf(name, sizeof name, "all_reduce bucket %d", k);
        dt__record_comm(name, t0, t1, t0 < backward_end ? (t1 < backward_end ? t1 : backward_end) - t0 : 0);
        b->pending = b->last - b->first + 1;
    }
    d->launched = 0;
}
void dt_ddp_sync_grads(dt_ddp *ddp) { dt_parallel_backward_done(&ddp->par); }

dt_ddp *dt_ddp_create(dt_model *model, dt_comm *comm, double bucket_mb) {
    dt_ddp *d = (dt_ddp *)calloc(1, sizeof *d);
    int n = model->nparams;
    if (!d || !(d->buckets = (dt__ddp_bucket *)calloc((size_t)n, sizeof(dt__ddp_bucket))) ||
        !(d->bucket_of = (int *)calloc((size_t)n, sizeof(int))))
        dt_fail("out of memory (DDP)");
    d->par = (dt_parallel){ .create_fn = "dt_ddp_create", .sync_fn = "dt_ddp_sync_grads", .free_fn = "dt_ddp_free",
                            .grad_ready = bucket_mb > 0 ? dt__ddp_grad_ready : NULL,
                            .backward_done = dt__ddp_backward_done };
    dt_model_set_parallel(model, &d->par);
    dt__comm_hold(comm, "dt_ddp_free");
    d->model = model;
    d->comm = comm;
    d->sync = 1;
    dt_broadcast(comm, model->flat_data, model->numel, DT_F32, 0);   /* every replica starts from rank 0's */
    /* Buckets, from the last parameter back: ~bucket_mb each, the first 1 MB. */
    double cap = bucket_mb > 0 ? bucket_mb * 1048576.0 : 1e300, first_cap = cap < 1048576.0 ? cap : 1048576.0;
    double bytes = 0;
    for (int i = n - 1; i >= 0; i--) {
        dt__ddp_bucket *b = &d->buckets[d->nbuckets];
        if (bytes == 0) b->last = i;
        bytes += 4.0 * model->params[i].numel;
        d->bucket_of[i] = d->nbuckets;
        if (bytes >= (d->nbuckets == 0 ? first_cap : cap) || i == 0) {
            b->first = i;
            b->offset = model->params[i].data - model->flat_data;
            b->count = model->params[b->last].data + model->params[b->last].numel - model->params[i].data;
            b->pending = b->last - b->first + 1;
            d->nbuckets++;
            bytes = 0;
        }
    }
    return d;
}
int dt_ddp_buckets(const dt_ddp *ddp) { return ddp->nbuckets; }
void dt_ddp_set_sync(dt_ddp *ddp, int sync) { ddp->sync = sync; }

void dt_ddp_free(dt_ddp *ddp) {
    if (!ddp) return;
    dt_model_set_parallel(ddp->model, NULL);
    dt__comm_release(ddp->comm);
    free(ddp->buckets);
    free(ddp->bucket_of);
    free(ddp);
}

/* -- Fully sharded data parallel -- */
typedef struct dt__fsdp_unit {
    int first, end;             /* its parameters: first .. end - 1 */
    int64_t offset, numel;      /* where it sits in the model's parameter order */
    int64_t shard;              /* elements per rank: numel rounded up to a multiple of world, / world */
    int64_t shard_offset;       /* where its shard starts in this rank's flat shard buffers */
    int64_t accum_offset;       /* where its whole gradient adds up while accumulating (no-sync) */
    void *full;                 /* [shard * world] gathered parameters, in the compute dtype */
    float *full_grad;           /* [shard * world] their gradients, f32 */
    dt_comm_handle gathering;   /* an all-gather in flight (a prefetch), or 0 */
} dt__fsdp_unit;

struct dt_fsdp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_fsdp */
    dt_model *model;
    dt_comm *comm;
    dt_shard_mode mode;
    int offload;                /* shards and optimizer state in host memory */
    int rank, world, nunits;
    dt__fsdp_unit *units;
    float *shard_params, *shard_grads;   /* this rank's slice of every unit, one after another */
    int64_t shard_numel;
    /* Buffers made once and reused by every unit: a malloc per unit per step
       costs page faults on a CPU, and a cudaFree synchronises the whole GPU.
       At most two neighbouring units are gathered at once, so two parameter
       buffers serve all of them (unit k takes buffer k % 2), and one gradient
       buffer, as backward does one unit at a time. Offloaded shards are
       uploaded into staging buffers, by the same rule. The model's outer unit
       (dt_model.outer_unit), gathered from the start of forward to the end of
       backward, has buffers of its own: slot 2, and outer_grad. */
    void *gathered[3];
    float *gathered_grad, *outer_grad, *staged[3], *scattered;
    int holder[3];                       /* the unit in each parameter buffer, or -1 */
    size_t largest, largest_shard;       /* f32 bytes: the largest unit, gathered, and its shard */
    int64_t prefetched;                  /* units that were already on their way when needed */
    /* Stage 05. Mixed precision: parameters are gathered in param_dtype (the
       compute dtype), each rank first narrowing its f32 shard into send16;
       gradients are reduce-scattered in reduce_dtype through grad16 and
       scattered16. Accumulation: with sync 0 nothing is reduce-scattered and
       the units' whole gradients add up in `accum`. */
    dt_dtype param_dtype, reduce_dtype;
    void *send16[3], *grad16, *scattered16;
    int sync;
    float *accum;
    int64_t accum_numel;
};

static size_t dt__fsdp_full_bytes(const dt_fsdp *f, const dt__fsdp_unit *u) { return (size_t)(u->shard * f->world) * sizeof(float); }
static size_t dt__fsdp_param_bytes(const dt_fsdp *f, const dt__fsdp_unit *u) {
    return (size_t)(u->shard * f->world) * dt_dtype_size(f->param_dtype);
}
static size_t dt__fsdp_largest_params(const dt_fsdp *f) { return f->largest / sizeof(float) * dt_dtype_size(f->param_dtype); }
/* Which of the reused buffers unit k takes: neighbours alternate, the outer unit has its own. */
static int dt__fsdp_slot(const dt_fsdp *f, int k) { return k == f->model->outer_unit ? 2 : k % 2; }

/* Unit k's slice of a shard buffer where the collectives can read it: the
   buffer itself, or, offloaded, a copy uploaded into the staging buffer of its slot. */
static float *dt__fsdp_shard_on_device(dt_fsdp *f, const float *shards, int k) {
    const dt__fsdp_unit *u = &f->units[k];
    if (!f->offload) return (float *)shards + u->shard_offset;
    dt_upload(f->staged[dt__fsdp_slot(f, k)], shards + u->shard_offset, (size_t)u->shard * sizeof(float));
    return f->staged[dt__fsdp_slot(f, k)];
}
/* Unit k's shard as the all-gather sends it: in the compute dtype, which under
   mixed precision is a 16-bit copy (send16, one per neighbouring unit). */
static const void *dt__fsdp_send_buffer(dt_fsdp *f, int k) {
    float *mine = dt__fsdp_shard_on_device(f, f->shard_params, k);
    if (f->param_dtype == DT_F32) return mine;
    dt_convert(mine, DT_F32, f->send16[dt__fsdp_slot(f, k)], f->param_dtype, f->units[k].shard);
    return f->send16[dt__fsdp_slot(f, k)];
}
/* A unit's whole parameters from f32 host values, in the compute dtype. */
static void dt__fsdp_fill_params(dt_fsdp *f, dt__fsdp_unit *u, const float *host) {
    if (f->param_dtype == DT_F32) { dt_upload(u->full, host, (size_t)u->numel * sizeof(float)); return; }
    uint16_t *h = (uint16_t *)malloc((size_t)u->numel * 2 + 1);
    if (!h) dt_fail("out of memory");
    dt__f32_to_half_cpu(host, h, f->param_dtype, u->numel);
    dt_upload(u->full, h, (size_t)u->numel * 2);
    free(h);
}
/* Host values into a shard buffer: a copy when offloaded, else an upload. */
static void dt__fsdp_put(dt_fsdp *f, float *dst, const float *host, int64_t n) {
    if (n <= 0) return;
    if (f->offload) memcpy(dst, host, (size_t)n * sizeof(float));
    else dt_upload(dst, host, (size_t)n * sizeof(float));
}

/* Point the unit's parameters (or their f32 gradients) into a gathered buffer,
   or nowhere. Gathered parameters are in the compute dtype. */
static void dt__fsdp_point(dt_fsdp *f, dt__fsdp_unit *u, int grads, void *buf) {
    for (int i = u->first; i < u->end; i++) {
        dt_tensor *p = &f->model->params[i];
        int64_t at = f->model->offsets[i] - u->offset;
        if (grads) p->grad = buf ? (float *)buf + at : NULL;
        else {
            p->dtype = f->param_dtype;
            p->data = buf ? (float *)((char *)buf + at * dt_dtype_size(f->param_dtype)) : NULL;
        }
    }
}

/* All-gather: every rank's shard of the unit, side by side, is the unit. It is
   started ahead of need -- the next unit's while this one computes -- and
   finished when the unit is about to run. Every rank starts and finishes them
   in the same order, so the collectives pair up. */
static void dt__fsdp_gather_start(dt_fsdp *f, int k) {
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL || u->full || u->gathering) return;        /* there already, or on its way */
    int slot = dt__fsdp_slot(f, k);
    if (f->holder[slot] >= 0)
        dt_fail("internal: FSDP gathers unit %d while unit %d still holds its buffer", k, f->holder[slot]);
    f->holder[slot] = k;
    u->full = f->gathered[slot];
    u->gathering = dt_all_gather_async(f->comm, dt__fsdp_send_buffer(f, k), u->full, u->shard, f->param_dtype);
}
static void dt__fsdp_gather_unit(dt_fsdp *f, int k, int next) {
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL) return;
    double wait_from = dt_now_ms(), t0, t1;
    f->prefetched += u->gathering != 0;
    dt__fsdp_gather_start(f, k);
    if (next >= 0 && next < f->nunits) dt__fsdp_gather_start(f, next);      /* prefetch */
    if (!u->gathering) return;
    dt_comm_wait(f->comm, u->gathering);
    dt__comm_interval(f->comm, u->gathering, &t0, &t1);
    double hidden = (t1 < wait_from ? t1 : wait_from) - t0;
    dt__record_comm("all_gather unit", t0, t1, hidden > 0 ? hidden : 0);
    u->gathering = 0;
    dt__fsdp_point(f, u, 0, u->full);
}
static void dt__fsdp_release_unit(dt_fsdp *f, int k) {     /* reshard: keep only our slice */
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL) return;
    if (u->full) f->holder[dt__fsdp_slot(f, k)] = -1;
    u->full = NULL;
    dt__fsdp_point(f, u, 0, NULL);
}
/* Reduce-scatter: the average of every rank's gradient of the unit, of which
   this rank keeps its slice (added to what it holds: accumulation needs it). */
static void dt__fsdp_reduce_scatter_unit(dt_fsdp *f, int k) {
    dt__fsdp_unit *u = &f->units[k];
    dt_device dev = f->model->device;
    float *mine = f->scattered, *dst = f->shard_grads + u->shard_offset;
    double t0 = dt_now_ms();
    if (f->reduce_dtype == DT_F32) dt_reduce_scatter(f->comm, u->full_grad, mine, u->shard, DT_F32, DT_AVG);
    else {                                          /* 16-bit copies travel */
        dt_convert(u->full_grad, DT_F32, f->grad16, f->reduce_dtype, u->shard * f->world);
        dt_reduce_scatter(f->comm, f->grad16, f->scattered16, u->shard, f->reduce_dtype, DT_AVG);
        dt_convert(f->scattered16, f->reduce_dtype, mine, DT_F32, u->shard);
    }
    dt__ctx.grad_collectives++;
    dt__record_comm("reduce_scatter unit", t0, dt_now_ms(), 0);
    const dt_backend *gpu = f->offload ? NULL : dt__backend_of(dev);
    if (gpu) gpu->accumulate(dst, mine, u->shard);
    else {                                          /* offloaded: to the host, added there */
        float *host = dt__host_view(dev, mine, u->shard);
        for (int64_t i = 0; i < u->shard; i++) dst[i] += host[i];
        dt__host_view_close(dev, host, mine, u->shard, 0);
    }
}

/* The two marks a unit leaves on the tape; backward meets them in reverse. */
static void dt__fsdp_before_unit_backward(dt__tape_entry *e) {
    dt_fsdp *f = (dt_fsdp *)e->saved;
    dt__fsdp_unit *u = &f->units[e->iarg[0]];
    dt__fsdp_gather_unit(f, e->iarg[0], e->iarg[0] - 1);             /* gathered again; the one before on its way */
    if (f->mode != DT_SHARD_OPTIMIZER) {
        if (f->accum) u->full_grad = f->accum + u->accum_offset;     /* adds to the micro-batches before */
        else {                                                       /* backward adds into it: zeroed */
            u->full_grad = e->iarg[0] == f->model->outer_unit ? f->outer_grad : f->gathered_grad;
            dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
        }
        dt__fsdp_point(f, u, 1, u->full_grad);
    }
}
static void dt__fsdp_after_unit_backward(dt__tape_entry *e) {
    dt_fsdp *f = (dt_fsdp *)e->saved;
    dt__fsdp_unit *u = &f->units[e->iarg[0]];
    if (f->mode == DT_SHARD_OPTIMIZER) return;                                  /* all at once, after backward */
    if (f->sync) {                                                              /* no-sync: it stays in accum */
        dt__fsdp_reduce_scatter_unit(f, e->iarg[0]);
        if (f->accum) dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
    }
    u->full_grad = NULL;
    dt__fsdp_point(f, u, 1, NULL);
    dt__fsdp_release_unit(f, e->iarg[0]);
}

static void dt__fsdp_unit_begin(dt_parallel *par, int unit) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt__fsdp_gather_unit(f, unit, unit + 1);                               /* and the next one on its way */
    if (dt__ctx.grad_enabled) dt__tape_mark(dt__fsdp_after_unit_backward, f, unit);
}
static void dt__fsdp_unit_end(dt_parallel *par, int unit) {
    dt_fsdp *f = (dt_fsdp *)par;
    int training = dt__ctx.grad_enabled;
    /* reshard after forward -- but the last unit is the first that backward
       needs, so in training it stays gathered (one all-gather saved); so
       does the outer unit, whose backward ends the step */
    if (!(training && (unit == f->nunits - 1 || unit == f->model->outer_unit))) dt__fsdp_release_unit(f, unit);
    if (training) dt__tape_mark(dt__fsdp_before_unit_backward, f, unit);
}
static void dt__fsdp_backward_done(dt_parallel *par);
static void dt__fsdp_step_done(dt_parallel *par);
static void dt__fsdp_optimizer_view(dt_parallel *par, dt_optimizer *o);
static float *dt__fsdp_state_open(dt_parallel *par, dt_optimizer *o, int which, int for_load);
static void dt__fsdp_state_close(dt_parallel *par, dt_optimizer *o, int which, float *host, int written);
static void dt__fsdp_memory_table(const dt_parallel *par, const dt_optimizer *o);
static void dt__fsdp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_fsdp *)par)->comm, values, n, DT_SUM);
}
/* The cost model's view (the cost-model chapter): which ZeRO, and the optimizer step
   of the whole model, N times the shard's this rank measured. */
static int dt__fsdp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    static const dt_parallelism zero[3] = { DT_PAR_ZERO1, DT_PAR_ZERO2, DT_PAR_ZERO3 };   /* by dt_shard_mode */
    in->kind = zero[f->mode];
    in->optimizer_ms *= f->world;
    return f->world;
}

dt_fsdp *dt_fsdp_create(dt_model *model, dt_comm *comm, dt_shard_mode mode, int cpu_offload) {
    dt_fsdp *f = (dt_fsdp *)calloc(1, sizeof *f);
    if (!f || !(f->units = (dt__fsdp_unit *)calloc((size_t)model->nunits, sizeof(dt__fsdp_unit))))
        dt_fail("out of memory (FSDP)");
    f->par = (dt_parallel){ .create_fn = "dt_fsdp_create", .sync_fn = "dt_fsdp_sync_grads", .free_fn = "dt_fsdp_free",
                            .unit_begin = dt__fsdp_unit_begin, .unit_end = dt__fsdp_unit_end,
                            .backward_done = dt__fsdp_backward_done, .step_done = dt__fsdp_step_done,
                            .optimizer_view = dt__fsdp_optimizer_view, .sum_over_ranks = dt__fsdp_sum_over_ranks,
                            .state_open = dt__fsdp_state_open, .state_close = dt__fsdp_state_close,
                            .memory_table = dt__fsdp_memory_table, .cost_input = dt__fsdp_cost_input };
    dt_model_set_parallel(model, &f->par);
    dt__comm_hold(comm, "dt_fsdp_free");
    f->model = model; f->comm = comm; f->mode = mode; f->offload = cpu_offload;
    f->param_dtype = dt__ctx.compute_dtype; f->reduce_dtype = DT_F32; f->sync = 1;
    f->rank = dt_comm_rank(comm); f->world = dt_comm_size(comm); f->nunits = model->nunits;
    dt_device dev = model->device;
    dt_broadcast(comm, model->flat_data, model->numel, DT_F32, 0);     /* every rank starts from rank 0's */
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        u->first = model->unit_first[k];
        u->end = model->unit_first[k + 1];
        u->offset = model->offsets[u->first];
        u->numel = (u->end < model->nparams ? model->offsets[u->end] : model->numel) - u->offset;
        u->shard = (u->numel + f->world - 1) / f->world;
        u->shard_offset = f->shard_numel;
        f->shard_numel += u->shard;
        u->accum_offset = f->accum_numel;
        f->accum_numel += u->shard * f->world;
        if (dt__fsdp_full_bytes(f, u) > f->largest) f->largest = dt__fsdp_full_bytes(f, u);
    }
    f->largest_shard = f->largest / (size_t)f->world;
    int outer = model->outer_unit, used[3] = { 0, 0, 0 };                   /* the slots some unit takes */
    for (int k = 0; k < f->nunits; k++) used[dt__fsdp_slot(f, k)] = 1;
    f->holder[0] = f->holder[1] = f->holder[2] = -1;
    for (int b = 0; b < 3; b++) {
        if (!used[b]) continue;
        if (mode == DT_SHARD_FULL) f->gathered[b] = dt_alloc_on(dev, DT_ARENA_PARAMS, dt__fsdp_largest_params(f));
        if (f->param_dtype != DT_F32) f->send16[b] = dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard / 2);
        if (cpu_offload) f->staged[b] = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard);
    }
    if (mode != DT_SHARD_OPTIMIZER) f->gathered_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, f->largest);
    if (mode != DT_SHARD_OPTIMIZER && outer >= 0) f->outer_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, f->largest);
    f->scattered = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard);
    size_t shard_bytes = (size_t)f->shard_numel * sizeof(float);
    f->shard_params = (float *)(f->offload ? dt_alloc_host(DT_ARENA_PARAMS, shard_bytes) : dt_alloc_on(dev, DT_ARENA_PARAMS, shard_bytes));
    f->shard_grads = (float *)(f->offload ? dt_alloc_host(DT_ARENA_GRADS, shard_bytes) : dt_alloc_on(dev, DT_ARENA_GRADS, shard_bytes));
    /* Cut the model into shards: this rank keeps elements [rank * shard, (rank + 1) * shard) of each unit. */
    float *host = dt__host_view(dev, model->flat_data, model->numel);
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard < u->numel ? lo + u->shard : u->numel;
        dt__fsdp_put(f, f->shard_params + u->shard_offset, host + u->offset + lo, hi - lo);
        if (mode != DT_SHARD_FULL) {             /* ZeRO-1 and -2 keep every parameter, in per-unit buffers */
            u->full = dt_alloc_on(dev, DT_ARENA_PARAMS, dt__fsdp_param_bytes(f, u));
            dt__fsdp_fill_params(f, u, host + u->offset);
            dt__fsdp_point(f, u, 0, u->full);
        }
        if (mode == DT_SHARD_OPTIMIZER) {        /* ZeRO-1 keeps every gradient too */
            u->full_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, dt__fsdp_full_bytes(f, u));
            dt__fsdp_point(f, u, 1, u->full_grad);
        }
        if (mode == DT_SHARD_FULL) dt__fsdp_point(f, u, 0, NULL);
        if (mode != DT_SHARD_OPTIMIZER) dt__fsdp_point(f, u, 1, NULL);
    }
    dt__host_view_close(dev, host, model->flat_data, model->numel, 0);
    dt_free_on(dev, DT_ARENA_PARAMS, model->flat_data, (size_t)model->numel * sizeof(float));
    dt_free_on(dev, DT_ARENA_GRADS, model->flat_grad, (size_t)model->numel * sizeof(float));
    model->flat_data = model->flat_grad = NULL;
    return f;
}

/* The optimizer of a sharded model steps this rank's shard: one slice per
   part of a parameter inside it (the padding belongs to no parameter). */
static void dt__fsdp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_model *m = f->model;
    o->params = f->shard_params; o->grads = f->shard_grads; o->numel = f->shard_numel;
    o->sharded_by = par;
    if (f->offload) { o->device = DT_CPU; o->offloaded = 1; }     /* the optimizer steps on the CPU */
    o->slices = (struct dt_param_slice *)calloc((size_t)m->nparams, sizeof *o->slices);
    if (!o->slices) dt_fail("out of memory (optimizer)");
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard;
        for (int i = u->first; i < u->end; i++) {
            int64_t a = m->offsets[i] - u->offset, b = a + m->params[i].numel;
            if (a < lo) a = lo;
            if (b > hi) b = hi;
            if (b <= a) continue;
            struct dt_param_slice *s = &o->slices[o->nslices++];
            s->offset = u->shard_offset + (a - lo);
            s->length = b - a;
            s->decay = m->params[i].ndim >= 2;
        }
    }
}

void dt_fsdp_set_sync(dt_fsdp *fsdp, int sync) {
    fsdp->sync = sync;
    if (!sync && !fsdp->accum && fsdp->mode != DT_SHARD_OPTIMIZER) {     /* ZeRO-1 keeps whole gradients anyway */
        fsdp->accum = (float *)dt_alloc_on(fsdp->model->device, DT_ARENA_GRADS, (size_t)fsdp->accum_numel * sizeof(float));
        dt__zero_on(fsdp->model->device, fsdp->accum, (size_t)fsdp->accum_numel * sizeof(float));
        dt_free_on(fsdp->model->device, DT_ARENA_GRADS, fsdp->gathered_grad, fsdp->largest);   /* each unit has its slice now */
        dt_free_on(fsdp->model->device, DT_ARENA_GRADS, fsdp->outer_grad, fsdp->largest);
        fsdp->gathered_grad = fsdp->outer_grad = NULL;
    }
}
void dt_fsdp_set_reduce_dtype(dt_fsdp *fsdp, dt_dtype dtype) {
    dt_device dev = fsdp->model->device;
    dt_free_on(dev, DT_ARENA_COMM, fsdp->grad16, fsdp->largest / 2);
    dt_free_on(dev, DT_ARENA_COMM, fsdp->scattered16, fsdp->largest_shard / 2);
    fsdp->grad16 = fsdp->scattered16 = NULL;
    fsdp->reduce_dtype = dtype;
    if (dtype == DT_F32) return;
    fsdp->grad16 = dt_alloc_on(dev, DT_ARENA_COMM, fsdp->largest / 2);
    fsdp->scattered16 = dt_alloc_on(dev, DT_ARENA_COMM, fsdp->largest_shard / 2);
}

static void dt__fsdp_backward_done(dt_parallel *par) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (f->mode != DT_SHARD_OPTIMIZER || !f->sync) return;   /* reduce-scattered during backward, or accumulating */
    for (int k = f->nunits - 1; k >= 0; k--) {
        dt__fsdp_unit *u = &f->units[k];
        dt__fsdp_reduce_scatter_unit(f, k);
        dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
    }
}

void dt_fsdp_sync_grads(dt_fsdp *fsdp) { dt_parallel_backward_done(&fsdp->par); }

/* After the optimizer: DT_SHARD_OPTIMIZER and _GRADS all-gather the updated
   parameters (DT_SHARD_FULL gathers each unit when it is next used). */
static void dt__fsdp_step_done(dt_parallel *par) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (f->mode == DT_SHARD_FULL) return;              /* gathered when next needed */
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        double t0 = dt_now_ms();
        dt_all_gather(f->comm, dt__fsdp_send_buffer(f, k), u->full, u->shard, f->param_dtype);
        dt__record_comm("all_gather parameters", t0, dt_now_ms(), 0);
    }
}

/* Checkpoints see a sharded model whole: every rank's shards gathered into one
   host array in parameter order (a collective), or written back into them. */
static float *dt__fsdp_state_gather(dt_fsdp *f, const float *shards) {
    dt_device dev = f->model->device;
    float *host = (float *)malloc((size_t)f->model->numel * sizeof(float) + 1);
    if (!host) dt_fail("out of memory (gathering a sharded checkpoint)");
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        float *full = (float *)dt_alloc_on(dev, DT_ARENA_COMM, dt__fsdp_full_bytes(f, u));
        dt_all_gather(f->comm, dt__fsdp_shard_on_device(f, shards, k), full, u->shard, DT_F32);
        dt__download_from(dev, host + u->offset, full, (size_t)u->numel * sizeof(float));
        dt_free_on(dev, DT_ARENA_COMM, full, dt__fsdp_full_bytes(f, u));
    }
    return host;
}
static void dt__fsdp_state_scatter(dt_fsdp *f, const float *host, float *shards, int parameters) {
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard < u->numel ? lo + u->shard : u->numel;
        dt__fsdp_put(f, shards + u->shard_offset, host + u->offset + lo, hi - lo);
        if (parameters && u->full) dt__fsdp_fill_params(f, u, host + u->offset);
    }
}
static float *dt__fsdp_state_open(dt_parallel *par, dt_optimizer *o, int which, int for_load) {
    dt_fsdp *f = (dt_fsdp *)par;
    (void)for_load;                       /* every rank gets the whole, gathered, either way */
    return dt__fsdp_state_gather(f, which == 0 ? f->shard_params : which == 1 ? o->m : o->v);
}
static void dt__fsdp_state_close(dt_parallel *par, dt_optimizer *o, int which, float *host, int written) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (written) dt__fsdp_state_scatter(f, host, which == 0 ? f->shard_params : which == 1 ? o->m : o->v, which == 0);
    free(host);
}

/* What each rank holds, against what DDP would hold: the ZeRO paper's
   formulas with P, G, O the bytes of parameters, gradients and optimizer state
   (O = 2P for AdamW, P for SGD's momentum), N ranks. The buffers that a unit
   is gathered into are shown apart: they are the price of sharding. */
static void dt__fsdp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    /* ZeRO-1 and -2 here keep the shards the optimizer steps apart from the
       whole copies: P/N (and for ZeRO-1 G/N) more than the paper, which steps
       a slice of the copy in place */
    static const char *formulas[3][3] = { { "P + P/N", "G + G/N", "O/N" }, { "P + P/N", "G/N", "O/N" }, { "P/N", "G/N", "O/N" } };
    static const char *names[3] = { "optimizer (ZeRO-1)", "grads (ZeRO-2)", "full (ZeRO-3)" };
    double P = 4.0 * f->model->numel, ddp[3] = { P, P, o->v ? 2 * P : P };
    dt_arena arenas[3] = { DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM };
    const char *rows[3] = { "parameters", "gradients", "optimizer state" };
    double buffers[3] = { ((f->gathered[0] ? 1.0 : 0.0) + (f->gathered[1] ? 1.0 : 0.0) + (f->gathered[2] ? 1.0 : 0.0)) *
                          dt__fsdp_largest_params(f),
                          ((f->gathered_grad ? 1.0 : 0.0) + (f->outer_grad ? 1.0 : 0.0)) * (double)f->largest, 0 };
    double frozen = f->model->base ? 4.0 * (double)f->model->base->numel : 0;   /* LoRA's: in the parameters' arena */
    buffers[0] += frozen;
    printf("memory per rank, --shard %s%s, %d ranks (MB):\n", names[f->mode], f->offload ? " --cpu-offload" : "", f->world);
    printf("  %-16s %8s %8s %8s   %s\n", "", "device", "host", "DDP", "formula");
    for (int i = 0; i < 3; i++)
        printf("  %-16s %8.2f %8.2f %8.2f   %s\n", rows[i], (dt_mem_now(arenas[i]) - buffers[i]) / 1e6,
               dt_mem_host_now(arenas[i]) / 1e6, ddp[i] / 1e6, formulas[f->mode][i]);
    if (frozen > 0)
        printf("  %-16s %8.2f %8s %8.2f   %s\n", "frozen (LoRA)", frozen / 1e6, "", frozen / 1e6,
               "F: whole on every rank and device, read only: no gradient, no state, never sent");
    if (f->param_dtype != DT_F32)
        printf("  (f32 shards and optimizer; parameters gathered in %s, 2 bytes each)\n", dt_dtype_name(f->param_dtype));
    if (buffers[0] + buffers[1] - frozen > 0)
        printf("  %-16s %8.2f %8s %8s   %s\n", "gather buffers", (buffers[0] + buffers[1] - frozen) / 1e6, "", "",
               f->mode == DT_SHARD_FULL ? "2 units of parameters (one computes, the next arrives) + 1 of gradients"
                                        : "1 unit of gradients (whole during its backward)");
    if (f->model->outer_unit >= 0 && buffers[0] + buffers[1] - frozen > 0)
        printf("  %-16s %8s %8s %8s   %s\n", "", "", "", "", "+ the outer unit's (embeddings, shared with the head), whole all step");
    fflush(stdout);
}

/* The FSDP wrapper of a model, or NULL: for the checkpoints and reports that
   need its shards. */
static dt_fsdp *dt__fsdp_of(const dt_model *m) {
    return m->parallel && m->parallel->step_done == dt__fsdp_step_done ? (dt_fsdp *)m->parallel : NULL;
}

void dt_fsdp_free(dt_fsdp *fsdp) {
    if (!fsdp) return;
    dt_model *m = fsdp->model;
    dt_model_set_parallel(m, NULL);
    for (int k = 0; k < fsdp->nunits; k++) {
        dt__fsdp_unit *u = &fsdp->units[k];
        if (u->gathering) dt__fsdp_gather_unit(fsdp, k, -1);      /* a prefetch nobody used: let it land */
        if (fsdp->mode != DT_SHARD_FULL) dt_free_on(m->device, DT_ARENA_PARAMS, u->full, dt__fsdp_param_bytes(fsdp, u));
        if (fsdp->mode == DT_SHARD_OPTIMIZER) dt_free_on(m->device, DT_ARENA_GRADS, u->full_grad, dt__fsdp_full_bytes(fsdp, u));
        dt__fsdp_point(fsdp, u, 0, NULL);
        dt__fsdp_point(fsdp, u, 1, NULL);
    }
    for (int b = 0; b < 3; b++) {
        dt_free_on(m->device, DT_ARENA_PARAMS, fsdp->gathered[b], dt__fsdp_largest_params(fsdp));
        dt_free_on(m->device, DT_ARENA_COMM, fsdp->staged[b], fsdp->largest_shard);
        dt_free_on(m->device, DT_ARENA_COMM, fsdp->send16[b], fsdp->largest_shard / 2);
    }
    dt__comm_release(fsdp->comm);            /* after the last prefetch has landed */
    dt_fsdp_set_reduce_dtype(fsdp, DT_F32);
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->accum, (size_t)fsdp->accum_numel * sizeof(float));
    for (int i = 0; i < m->nparams; i++) m->params[i].dtype = DT_F32;
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->gathered_grad, fsdp->largest);
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->outer_grad, fsdp->largest);
    dt_free_on(m->device, DT_ARENA_COMM, fsdp->scattered, fsdp->largest_shard);
    size_t shard_bytes = (size_t)fsdp->shard_numel * sizeof(float);
    if (fsdp->offload) { dt_free_host(DT_ARENA_PARAMS, fsdp->shard_params, shard_bytes); dt_free_host(DT_ARENA_GRADS, fsdp->shard_grads, shard_bytes); }
    else { dt_free_on(m->device, DT_ARENA_PARAMS, fsdp->shard_params, shard_bytes); dt_free_on(m->device, DT_ARENA_GRADS, fsdp->shard_grads, shard_bytes); }
    free(fsdp->units);
    free(fsdp);
}

