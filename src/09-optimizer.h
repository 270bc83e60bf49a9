//@ lesson: the optimizer -- AdamW, SGD with momentum, gradient clipping, warmup + cosine
/* ---- optimizer ----------------------------------------------------------------- */

typedef enum { DT_ADAMW = 0, DT_SGD = 1 } dt_optimizer_kind;

typedef struct dt_optimizer {
    dt_optimizer_kind kind;
    float beta1, beta2, eps, weight_decay, momentum, clip_norm;
    int64_t step;              /* optimizer steps taken (AdamW's bias correction uses it) */
    float *m, *v;              /* AdamW's moments, or SGD's momentum in m */
    dt_model *model;
    float last_grad_norm;
    /* What it updates: flat buffers of numel values, cut into slices that share
       a weight decay -- one per parameter, or, when FSDP shards the model, one
       per part of a parameter that lies in this rank's shard. */
    float *params, *grads;
    int64_t numel;
    int nslices;
    /* copy: another rank of the wrapper's group holds the same gradient and
       counts it in the norm (a replicated parameter under tensor parallelism) */
    struct dt_param_slice { int64_t offset, length; int decay, copy; } *slices;
    dt_parallel *sharded_by;   /* sharded: its wrapper sums the gradient norm over the ranks */
    dt_device device;          /* where its buffers are and it computes */
    int offloaded;             /* its buffers are host memory (FSDP's --cpu-offload) */
} dt_optimizer;

/* It steps what the model's parallel wrapper gives it (FSDP: this rank's
   shard), so a wrapper must exist before it or not at all. */
dt_optimizer *dt_optimizer_create(dt_model *model, dt_optimizer_kind kind, float weight_decay,
                                  float momentum, float clip_norm);
void dt_optimizer_free(dt_optimizer *opt);
/* Clip the gradients (when clip_norm > 0), update every parameter, zero the
   gradients, then tell the wrapper the step is done (FSDP's ZeRO-1 and -2
   gather the new parameters). Fails while the wrapper has not synchronised
   the gradients of the last backward. */
void dt_optimizer_step(dt_optimizer *opt, float lr);
/* Linear warmup from 0 over `warmup` steps, then cosine decay to 0 at `total`. */
float dt_schedule_lr(float base_lr, int64_t step, int64_t warmup, int64_t total);
/* The per-element updates (PyTorch's AdamW and SGD), shared with the GPU kernels. */
DT_HD static inline void dt_adamw_update(float *p, float *m, float *v, float g, float lr,
                                         float beta1, float beta2, float eps, float wd,
                                         float bias_correction1, float bias_correction2);
DT_HD static inline void dt_sgd_update(float *p, float *buf, float g, float lr, float momentum,
                                       float wd);

//@ implementation
/* ==== optimizer ==============================================================
   The update rules are PyTorch's, element for element, so a step here matches a
   step there. Biases and norm weights (1-D parameters) get no weight decay. */

/* The optimizer steps the model's flat buffers, one slice per parameter
   (decayed when it is a matrix): without a wrapper, or as a wrapper's view
   begins (tensor parallelism then marks the replicated ones). */
static void dt__optimizer_view_all(dt_optimizer *o, const dt_model *m) {
    o->params = m->flat_data; o->grads = m->flat_grad; o->numel = m->numel;
    o->nslices = m->nparams;
    o->slices = (struct dt_param_slice *)calloc((size_t)m->nparams, sizeof *o->slices);
    if (!o->slices) dt_fail("out of memory (optimizer)");
    for (int i = 0; i < m->nparams; i++)
        o->slices[i] = (struct dt_param_slice){ m->offsets[i], m->params[i].numel, m->params[i].ndim >= 2, 0 };
}
dt_optimizer *dt_optimizer_create(dt_model *model, dt_optimizer_kind kind, float weight_decay,
                                  float momentum, float clip_norm) {
    dt_optimizer *o = (dt_optimizer *)calloc(1, sizeof(dt_optimizer));
    if (!o) dt_fail("out of memory (optimizer)");
    o->kind = kind;
    o->beta1 = 0.9f; o->beta2 = 0.999f; o->eps = 1e-8f;
    o->weight_decay = weight_decay; o->momentum = momentum; o->clip_norm = clip_norm;
    o->model = model;
    o->device = model->device;
    model->optimizers++;
    dt_parallel *view = model->parallel;              /* in a stack, the outermost wrapper that has a view */
    while (view && !view->optimizer_view) view = view->inner;
    if (view) {
        view->optimizer_view(view, o);
        if (o->sharded_by && !o->sharded_by->sum_over_ranks)
            dt_fail("%s: its optimizer view shards the optimizer but gives no sum_over_ranks for the gradient norm",
                    o->sharded_by->create_fn);
    } else dt__optimizer_view_all(o, model);
    size_t bytes = (size_t)o->numel * sizeof(float);
    o->m = (float *)(o->offloaded ? dt_alloc_host(DT_ARENA_OPTIM, bytes) : dt_alloc_on(o->device, DT_ARENA_OPTIM, bytes));
    if (kind == DT_ADAMW)
        o->v = (float *)(o->offloaded ? dt_alloc_host(DT_ARENA_OPTIM, bytes) : dt_alloc_on(o->device, DT_ARENA_OPTIM, bytes));
    return o;
}
void dt_optimizer_free(dt_optimizer *opt) {
    if (!opt) return;
    size_t bytes = (size_t)opt->numel * sizeof(float);
    if (opt->offloaded) { dt_free_host(DT_ARENA_OPTIM, opt->m, bytes); dt_free_host(DT_ARENA_OPTIM, opt->v, bytes); }
    else { dt_free_on(opt->device, DT_ARENA_OPTIM, opt->m, bytes); dt_free_on(opt->device, DT_ARENA_OPTIM, opt->v, bytes); }
    free(opt->slices);
    opt->model->optimizers--;
    free(opt);
}

/* The optimizer needs the average gradient: a backward whose gradients the
   wrapper has not synchronised yet is an order mistake, named. */
static void dt__optimizer_check_synced(const dt_optimizer *o, const char *caller) {
    const dt_parallel *par = o->model->parallel;
    if (par && par->grads_pending)
        dt_fail("%s: the gradients of the last backward are not synchronised across the ranks yet; call %s first",
                caller, par->sync_fn);
}

/* The squared norm of every gradient the optimizer steps -- of the whole
   model: a sharded optimizer sums its ranks' parts. */
static double dt__sum_squares_on(dt_device device, const float *g, int64_t n) {
    const dt_backend *gpu = dt__backend_of(device);
    if (gpu) return gpu->sum_squares(g, n);
    double lane[8] = { 0 }, sq = 0;     /* 8 fixed lanes: vectorizes, and sums in the same order every run */
    int64_t i8 = n - n % 8;
    for (int64_t i = 0; i < i8; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)g[i + l] * g[i + l];
    for (int64_t i = i8; i < n; i++) lane[i % 8] += (double)g[i] * g[i];
    for (int l = 0; l < 8; l++) sq += lane[l];
    return sq;
}
static double dt__optimizer_grad_sum_squares(dt_optimizer *o) {
    int copies = 0;
    for (int si = 0; si < o->nslices; si++) copies += o->slices[si].copy;
    double sq = 0;
    if (!copies) sq = dt__sum_squares_on(o->device, o->grads, o->numel);
    else                                 /* what another rank counts, left out */
        for (int si = 0; si < o->nslices; si++)
            if (!o->slices[si].copy) sq += dt__sum_squares_on(o->device, o->grads + o->slices[si].offset, o->slices[si].length);
    if (o->sharded_by) {                 /* each rank holds a part: the norm is of the whole */
        float part = (float)sq;
        o->sharded_by->sum_over_ranks(o->sharded_by, &part, 1);
        sq = part;
    }
    return sq;
}
void dt_optimizer_step(dt_optimizer *opt, float lr) {
    dt__optimizer_check_synced(opt, "dt_optimizer_step");
    if (dt__ctx.grads_scaled)
        dt_fail("dt_optimizer_step: the gradients are still multiplied by the loss scale; call dt_loss_scaler_unscale first");
    int64_t n = opt->numel;
    float *g = opt->grads;
    const dt_backend *gpu = dt__backend_of(opt->device);
    opt->last_grad_norm = (float)sqrt(dt__optimizer_grad_sum_squares(opt));
    dt__ctx.lazy.stale = 1;              /* logits that still wait would be made from the moved weights */
    if (opt->clip_norm > 0 && opt->last_grad_norm > opt->clip_norm) {   /* torch.nn.utils.clip_grad_norm_ */
        float c = opt->clip_norm / (opt->last_grad_norm + 1e-6f);
        if (gpu) gpu->scale(g, c, n);
        else
            for (int64_t i = 0; i < n; i++) g[i] *= c;
    }
    opt->step++;
    float bc1 = 1.0f - powf(opt->beta1, (float)opt->step), bc2 = 1.0f - powf(opt->beta2, (float)opt->step);
    for (int si = 0; si < opt->nslices; si++) {
        int64_t off = opt->slices[si].offset, len = opt->slices[si].length;
        float wd = opt->slices[si].decay ? opt->weight_decay : 0.0f;
        float *p = opt->params + off, *mm = opt->m + off, *gg = g + off;
        if (gpu && opt->kind == DT_ADAMW)
            gpu->adamw(p, mm, opt->v + off, gg, len, lr, opt->beta1, opt->beta2, opt->eps, wd, bc1, bc2);
        else if (gpu)
            gpu->sgd(p, mm, gg, len, lr, opt->momentum, wd);
        else if (opt->kind == DT_ADAMW) {
            float *vv = opt->v + off;
            DT_OMP("omp parallel for if(len > 65536)")
            for (int64_t i = 0; i < len; i++)
                dt_adamw_update(&p[i], &mm[i], &vv[i], gg[i], lr, opt->beta1, opt->beta2, opt->eps, wd, bc1, bc2);
        } else {
            DT_OMP("omp parallel for if(len > 65536)")
            for (int64_t i = 0; i < len; i++) dt_sgd_update(&p[i], &mm[i], gg[i], lr, opt->momentum, wd);
        }
    }
    dt__zero_on(opt->device, g, (size_t)n * sizeof(float));
    for (dt_parallel *par = opt->model->parallel; par; par = par->inner)   /* each wrapper of a stack, outer first */
        if (par->step_done) par->step_done(par);
}

float dt_schedule_lr(float base_lr, int64_t step, int64_t warmup, int64_t total) {
    if (warmup > 0 && step < warmup) return base_lr * (float)(step + 1) / (float)warmup;
    int64_t span = total - warmup;
    if (span <= 0) return base_lr;
    double progress = (double)(step - warmup) / (double)span;
    if (progress > 1) progress = 1;
    return (float)(base_lr * 0.5 * (1.0 + cos(3.14159265358979323846 * progress)));
}

