//@ lesson: DistributedDataParallel -- one process per device, gradients all-reduced in buckets while backward runs
/* ---- DistributedDataParallel ------------------------------------------------ */
/* DistributedDataParallel (stage 03, and the engine of 06-07 without
   --shard): one process per device, each with a whole replica and its own
   optimizer; only gradients travel. They travel in
   buckets: runs of parameters taken in reverse order (the order backward
   finishes them), about bucket_mb each (the first one 1 MB, so communication
   starts early). A bucket's all-reduce (average) starts the moment its last
   gradient is final, on the communication thread or stream, while backward
   goes on. bucket_mb 0: one all-reduce of everything after backward, the
   no-overlap baseline (same bits: the sums run in rank order either way). */
typedef struct dt_ddp dt_ddp;
/* Broadcast rank 0's parameters (every replica starts equal) and plan the
   buckets. A model that tensor or pipeline parallelism holds is wrapped
   with it (a stack): comm is then the ranks that hold the same pieces. */
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

//@ implementation
/* -- DistributedDataParallel -- */
typedef struct dt__ddp_bucket {
    int first, last;            /* parameters first..last: one run of the flat gradient */
    int64_t offset, count;
    int held;                   /* its parameters this rank holds (a pipeline stage holds only its own) */
    int pending;                /* of those, the gradients not final yet in this backward */
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
        if (!b->count) continue;                      /* another stage's parameters: nothing here (nor on its peers) */
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
        b->pending = b->held;
        if (!b->count) continue;
        dt_comm_wait(d->comm, b->handle);
        dt__comm_interval(d->comm, b->handle, &t0, &t1);
        snprintf(name, sizeof name, "all_reduce bucket %d", k);
        dt__record_comm(name, t0, t1, t0 < backward_end ? (t1 < backward_end ? t1 : backward_end) - t0 : 0);
    }
    d->launched = 0;
    dt__data_parallel_sum_shared(&d->par, 0, d->model->nparams);   /* a tied vocabulary's two ends, averaged: added up */
}
static void dt__ddp_set_sync(dt_parallel *par, int sync) { ((dt_ddp *)par)->sync = sync; }
static void dt__ddp_data_all_gather(dt_parallel *par, const float *mine, float *all, int64_t n, int *rank, int *ranks) {
    dt_ddp *d = (dt_ddp *)par;
    if (par->inner && par->inner->data_all_gather) { par->inner->data_all_gather(par->inner, mine, all, n, rank, ranks); return; }
    *rank = dt_comm_rank(d->comm); *ranks = dt_comm_size(d->comm);
    if (all) dt__comm_all_gather_host(d->comm, mine, all, sizeof(float) * (size_t)n);
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
                            .backward_done = dt__ddp_backward_done, .set_sync = dt__ddp_set_sync,
                            .data_all_gather = dt__ddp_data_all_gather,
                            .inner = model->parallel };          /* around tensor parallelism: its pieces */
    dt__data_parallel_can_wrap(&d->par, comm, 0);
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
            for (int j = i; j <= b->last; j++) b->held += model->params[j].numel > 0;
            b->pending = b->held;
            d->nbuckets++;
            bytes = 0;
        }
    }
    return d;
}
/* The engine (dt_data_parallel_create) is what a stage calls: the order
   mistakes name its functions. */
static dt_parallel *dt__ddp_as_engine(dt_ddp *d, const char *sync_fn, const char *free_fn) {
    d->par.sync_fn = sync_fn;
    d->par.free_fn = free_fn;
    return &d->par;
}
int dt_ddp_buckets(const dt_ddp *ddp) { return ddp->nbuckets; }
void dt_ddp_set_sync(dt_ddp *ddp, int sync) { ddp->sync = sync; }

void dt_ddp_free(dt_ddp *ddp) {
    if (!ddp) return;
    dt__data_parallel_unwrap(ddp->model, &ddp->par);
    dt__comm_release(ddp->comm);
    free(ddp->buckets);
    free(ddp->bucket_of);
    free(ddp);
}
