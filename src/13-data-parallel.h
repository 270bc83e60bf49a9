//@ lesson: data parallelism -- DataParallel (one process, N devices); what every data-parallel wrapper records of its communication
/* ---- data parallelism: DataParallel ----------------------------------------- */

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

/* A data-parallel engine (DDP, FSDP) around another wrapper (a stack): a
   wrapper that cut the model (its `whole`: tensor parallelism, a pipeline's
   stages), over the ranks that hold the same pieces -- the engine averages
   or shards each piece over them. */
static void dt__data_parallel_can_wrap(const dt_parallel *outer, dt_comm *comm, int shards) {
    const dt_parallel *in = outer->inner;
    if (!in) return;
    if (!in->whole && !in->grad_ranks)   /* DDP around DDP, FSDP around DDP, ...: a model has one data-parallel wrapper */
        dt_fail("%s: this model is already wrapped (%s); one data-parallel wrapper per model, or call %s first",
                outer->create_fn, in->create_fn, in->free_fn);
    int want = in->grad_ranks > 0 ? in->grad_ranks : in->data_ranks;
    if (want > 0 && dt_comm_size(comm) != want)
        dt_fail("%s: its communicator has %d ranks, but %d ranks hold parts of the same gradients: give it the ranks that "
                "hold this rank's pieces (dt_tp_data_group, dt_pp_data_group, dt_cp_data_group)", outer->create_fn,
                dt_comm_size(comm), want);
    for (const dt_parallel *q = in; q && shards; q = q->inner)
        if (q->sp_all_gather)
            dt_usage_error("--sequence-parallel with --shard: the norms' gradients are summed over the tensor group after "
                           "backward, but a sharded engine has already reduce-scattered them by then; use one or the other");
}
/* What the wrappers inside hold in common with ranks outside the engine's
   group (a tied vocabulary at a pipeline's two ends): added up, once its
   gradients are whole and final. */
static void dt__data_parallel_sum_shared(dt_parallel *outer, int first, int end) {
    for (dt_parallel *q = outer->inner; q; q = q->inner)
        if (q->sum_shared_grads) q->sum_shared_grads(q, first, end);
}

/* A data-parallel wrapper lets go of its model; freed while another wraps it
   in turn, that one would point at freed memory: an error naming it. */
static void dt__data_parallel_unwrap(dt_model *m, dt_parallel *par) {
    if (m->parallel && m->parallel != par)
        dt_fail("%s: %s still wraps the model around it; call %s first", par->free_fn, m->parallel->create_fn,
                m->parallel->free_fn);
    dt_model_set_parallel(m, NULL);
}

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
