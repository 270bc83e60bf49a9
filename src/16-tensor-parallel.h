//@ lesson: tensor parallelism -- its ops on the tape (f and g, sequence parallelism's split and gather); Megatron-LM's column- and row-parallel layers, the split vocabulary
/* Tensor parallelism (stage 06), as Megatron-LM splits a transformer: every
   rank of a group of T keeps 1/T of each large weight and computes 1/T of
   each layer. In a block, the first MLP layer is column-parallel (each rank
   computes 1/T of the hidden units, and GELU runs on them where they are),
   the second row-parallel (partial outputs, summed over the group);
   attention is split by heads: q, k and v column-parallel, the output
   projection row-parallel. So a block costs two sums of its activations in
   forward (dt_tp_sum) and two of their gradients in backward (dt_tp_copy),
   and no weight ever travels. A language model's vocabulary (its embedding
   and its head, tied or not) is cut by tokens: each rank looks up and
   scores 1/T of them, and dt_cross_entropy takes the group's max and sum of
   each row. Llama's q, k and v are cut by their heads (k and v by the
   key/value heads), its gated MLP as the GPT's. Norms and
   position embeddings stay whole on every rank, where they compute the same
   values and get the same gradients. The model says where each parameter may be cut (dt_split); this
   wrapper cuts. With a job larger than T, the ranks form a mesh of
   data-parallel x tensor-parallel groups ("dp" x "tp", tp varying fastest):
   each group of T shares a batch, and a data-parallel engine wraps the cut
   model over the "dp" groups (dt_tp_data_group): DDP averages each piece's
   gradient over the groups, FSDP shards the pieces over them too (2-D
   parallelism: each rank keeps 1/(T x D) of a split weight). */
/* Tensor parallelism's two conjugate ops (Megatron-LM's f and g), which put
   its communication on the tape so that backward needs no special case. A
   column-parallel layer (each rank computes its share of the outputs) reads
   dt_tp_copy(x): the input itself, but in backward each rank holds only its
   share's part of x's gradient, so they are summed over the group. A
   row-parallel layer (each rank multiplies its share of the inputs) gives
   partial outputs: dt_tp_sum adds them up over the group, and in backward
   every rank needs the whole gradient, which it has. Without a wrapper that
   gives tp_sum, both return x. */
dt_tensor *dt_tp_copy(dt_parallel *par, dt_tensor *x);
dt_tensor *dt_tp_sum(dt_parallel *par, dt_tensor *x);
/* Sequence parallelism (Korthikanti et al., 2022): between the split layers,
   where the norms and residual adds work row by row, each rank of the group
   keeps 1/T of the rows (tokens) instead of all of them. dt_sp_split enters
   that region (this rank's rows; backward all-gathers their gradients),
   dt_sp_gather leaves it (every row again; backward keeps this rank's). In
   between, dt_tp_copy becomes an all-gather of the rows (backward: a
   reduce-scatter) and dt_tp_sum a reduce-scatter (backward: an all-gather):
   the same bytes as the all-reduces they replace, as each all-reduce is a
   reduce-scatter then an all-gather. Without a wrapper that gives
   sp_all_gather, both return x; so they do when the rows do not split evenly
   and no gradient is wanted (generation), and with gradients that is an error. */
dt_tensor *dt_sp_split(dt_parallel *par, dt_tensor *x);
dt_tensor *dt_sp_gather(dt_parallel *par, dt_tensor *x);
typedef struct dt_tp dt_tp;
/* Keep this rank's piece of every split parameter (the weights drawn whole
   from the seed, as in stage 01, then cut). tp 0: the whole job is one group.
   sequence_parallel: between the split layers each rank keeps 1/T of the
   rows too (dt_sp_split), and the gradients of the whole parameters read
   there (the blocks' norms, the row-parallel biases) are summed over the
   group after backward. */
dt_tp *dt_tp_create(dt_model *model, dt_comm *comm, int tp, int sequence_parallel);
/* After backward: the split layers need nothing (their sums ran on the tape);
   with --sequence-parallel the whole parameters read where the rows are
   split are summed over the group. With more than one group the engine that
   wraps it syncs (and this runs inside its sync); unwrapped, that is an
   error that says so. */
void dt_tp_sync_grads(dt_tp *tp);
/* The ranks that hold the same pieces, one per group ("dp"): what a
   data-parallel engine wrapping this one averages or shards over. */
dt_comm *dt_tp_data_group(const dt_tp *tp);
/* This rank's group among the data-parallel groups, and how many there are:
   the loader's rank and world (every rank of a group reads the same batch). */
int dt_tp_data_rank(const dt_tp *tp);
int dt_tp_data_ranks(const dt_tp *tp);
/* The model stays cut (this rank's pieces): after this it can be freed, and
   a forward is an error that says so. */
void dt_tp_free(dt_tp *tp);

//@ implementation
/* -- tensor parallelism's f and g, ops on the tape like any other (the wrapper
      after them cuts the layers); their gradients are added in as the
      residual's are (dt__add_into_grad). -- */
/* The rows of x [N, C] as f32 on the device: x's own values (06 has no
   16-bit activations). */
static float *dt__tp_rows_f32(const dt_tensor *x) { return (float *)dt__in(x); }
/* All of the group's rows, rank after rank: an all-gather of `mine` (n values). */
static float *dt__tp_all_rows(dt_parallel *par, const float *mine, int64_t n, dt_device device) {
    float *all = (float *)dt__scratch_on(device, (size_t)n * (size_t)par->tp_size * sizeof(float));
    par->sp_all_gather(par, mine, all, n);
    return all;
}

/* A column-parallel layer's input (Megatron-LM's f): the input itself, whose
   gradient is each rank's part, summed over the group. Between dt_sp_split
   and dt_sp_gather (iarg[0] 1) it is every rank's rows gathered, and the
   gradient is reduce-scattered: each rank keeps its rows' sum. */
static void dt__tp_copy_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    dt_parallel *par = (dt_parallel *)e->saved;
    int64_t n = e->out->numel;
    float *sum = (float *)dt__scratch_on(x->device, (size_t)n * sizeof(float));
    dt_convert(dt__grad_in(e->out), DT_F32, sum, DT_F32, n);
    if (!e->iarg[0]) {
        par->tp_sum(par, sum, n);
        dt__add_into_grad(x, sum);
        return;
    }
    float *mine = (float *)dt__scratch_on(x->device, (size_t)x->numel * sizeof(float));
    par->sp_reduce_scatter(par, sum, mine, x->numel);
    dt__add_into_grad(x, mine);
}
dt_tensor *dt_tp_copy(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->tp_sum) return x;
    dt_tensor *y;
    if (par->rows_split) {                                    /* the group's rows, gathered */
        dt__backend_for(x);
        dt__scratch_reset();
        int shape[4] = { (int)dt_tensor_rows(x) * par->tp_size, (int)dt_tensor_cols(x), 0, 0 };
        y = dt__tensor_out(2, shape);
        float *yv = dt__out(y);
        par->sp_all_gather(par, dt__tp_rows_f32(x), yv, x->numel);
        dt__out_done(y, yv);
    } else {
        y = (dt_tensor *)dt_step_alloc(sizeof *y);            /* the same values: a view with a gradient of its own */
        *y = *x;
        y->name = NULL;
        y->grad = NULL;
        y->requires_grad = 0;
        y->is_param = 0;
        y->parallel = NULL;
    }
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__tp_copy_backward, y, x, NULL, NULL);
        e->saved = par;
        e->iarg[0] = par->rows_split;
    }
    return y;
}
/* A row-parallel layer's output (Megatron-LM's g): every rank's partial
   output, added up; the gradient passes as it is. Between dt_sp_split and
   dt_sp_gather the sum is reduce-scattered (each rank keeps its rows of it),
   and the gradient all-gathered. */
static void dt__tp_sum_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    const float *dy = dt__grad_in(e->out);
    if (e->iarg[0]) dy = dt__tp_all_rows((dt_parallel *)e->saved, dy, e->out->numel, x->device);
    dt__add_into_grad(x, dy);
}
dt_tensor *dt_tp_sum(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->tp_sum) return x;
    dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y;
    if (par->rows_split) {                                    /* each rank its rows of the sum */
        int64_t rows = dt_tensor_rows(x);
        if (rows % par->tp_size) dt_fail("internal: %lld rows do not split over %d ranks", (long long)rows, par->tp_size);
        int shape[4] = { (int)(rows / par->tp_size), (int)dt_tensor_cols(x), 0, 0 };
        y = dt__tensor_out(2, shape);
        float *yv = dt__out(y);
        par->sp_reduce_scatter(par, dt__tp_rows_f32(x), yv, y->numel);
        dt__out_done(y, yv);
    } else {
        y = dt__tensor_out(x->ndim, x->shape);
        float *yv = dt__out(y);
        dt_convert(dt__in(x), DT_F32, yv, DT_F32, x->numel);
        par->tp_sum(par, yv, x->numel);
        dt__out_done(y, yv);
    }
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__tp_sum_backward, y, x, NULL, NULL);
        e->saved = par;
        e->iarg[0] = par->rows_split;
    }
    return y;
}

/* -- entering and leaving the rows-split region (sequence parallelism). Each
      backward also sets rows_split back to what it was there, so a block
      that --recompute runs again in backward sees the rows as its forward did. -- */
static void dt__sp_split_backward(dt__tape_entry *e) {
    dt_parallel *par = (dt_parallel *)e->saved;
    par->rows_split = 0;
    dt_tensor *x = e->in[0];
    if (x->requires_grad) dt__add_into_grad(x, dt__tp_all_rows(par, dt__grad_in(e->out), e->out->numel, x->device));
}
dt_tensor *dt_sp_split(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->sp_all_gather) return x;
    int64_t rows = dt_tensor_rows(x), cols = dt_tensor_cols(x);
    if (rows % par->tp_size) {
        if (!dt__ctx.grad_enabled) {                          /* evaluation's last batch, generation: whole rows */
            par->rows_split = 0;     /* whatever a backward that had no split entry to walk back left (the mlp's) */
            return x;
        }
        dt_fail("--sequence-parallel: a batch of %lld rows (sequences x tokens) does not split evenly over the %d ranks of a "
                "tensor-parallel group; choose --batch-size so that it does", (long long)rows, par->tp_size);
    }
    int64_t mine = rows / par->tp_size;
    int shape[4] = { (int)mine, (int)cols, 0, 0 };
    dt__backend_for(x);
    dt_tensor *y = dt__tensor_out(2, shape);
    size_t es = dt_dtype_size(x->dtype);
    dt_convert((const char *)x->data + (size_t)(par->tp_rank * mine * cols) * es, x->dtype, y->data, y->dtype, y->numel);
    par->rows_split = 1;
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__sp_split_backward, y, x, NULL, NULL)->saved = par;
    return y;
}
static void dt__sp_gather_backward(dt__tape_entry *e) {
    dt_parallel *par = (dt_parallel *)e->saved;
    par->rows_split = 1;
    dt_tensor *x = e->in[0];
    if (x->requires_grad)                      /* every rank holds the whole, equal gradient: its rows of it */
        dt__add_into_grad(x, dt__grad_in(e->out) + (size_t)par->tp_rank * (size_t)x->numel);
}
dt_tensor *dt_sp_gather(dt_parallel *par, dt_tensor *x) {
    par = dt_parallel_splitting(par);                        /* the stack's tensor-parallel wrapper */
    if (!par || !par->sp_all_gather || !par->rows_split) return x;
    dt__backend_for(x);
    dt__scratch_reset();
    int shape[4] = { (int)dt_tensor_rows(x) * par->tp_size, (int)dt_tensor_cols(x), 0, 0 };
    dt_tensor *y = dt__tensor_out(2, shape);
    float *yv = dt__out(y);
    par->sp_all_gather(par, dt__tp_rows_f32(x), yv, x->numel);
    dt__out_done(y, yv);
    par->rows_split = 0;
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__sp_gather_backward, y, x, NULL, NULL)->saved = par;
    return y;
}

/* -- tensor parallelism (Megatron-LM, Shoeybi et al., 2019) --
   The model marks where each parameter may be cut (dt_split, the models chapter), and
   its layers call dt_tp_copy and dt_tp_sum (above) wherever a layer is
   cut; this wrapper cuts the parameters and gives the sum. Every rank draws
   the whole model from the seed, as stage 01 does, and keeps its piece: the
   r-th of T along the cut dimension, of each of its `parts` groups (rank r
   gets its heads of q, of k and of v). Replicated parameters (norms,
   embeddings, the head) compute the same values on every rank of a group and
   get the same gradient bits, as the sums they read are the same bits on
   every rank; so they need no communication of their own, and the gradient
   norm counts them once (on the group's first rank). -- */
struct dt_tp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_tp */
    dt_model *model;
    dt_comm *comm;
    dt_mesh *mesh;
    dt_comm *group, *across;    /* the ranks that split the layers ("tp"), and the data-parallel groups ("dp") */
    int size, rank;             /* T, and this rank's piece */
    int sequence_parallel;
    /* (the group's share of the data is par's data_rank of data_ranks, where dt_evaluate reads it) */
    double step_sums, step_sum_bytes, step_sum_ms;   /* the last step's sums (par's: this step's so far) */
    /* The model as it was before the cut: its parameters' whole shapes and
       offsets, no buffers. Checkpoints are laid out by it (the checkpoints chapter). */
    dt_model whole;
};
/* Each sum of the step (an all-gather or a reduce-scatter: half of one, as
   many bytes, half the hops), for the cost model; evaluation's are not a
   training step's. */
static void dt__tp_count(dt_tp *t, const char *what, double t0, double sums, double bytes) {
    double t1 = dt_now_ms();
    dt__record_comm(what, t0, t1, 0);
    if (!dt__ctx.grad_enabled) return;
    t->par.tp_sum_ms += t1 - t0;
    t->par.tp_sums += sums;
    t->par.tp_sum_bytes += bytes;
}
static void dt__tp_sum(dt_parallel *par, float *values, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_all_reduce(t->group, values, values, n, DT_F32, DT_SUM);
    dt__tp_count(t, "all_reduce tp", t0, 1, 4.0 * (double)n);
}
static void dt__tp_max(dt_parallel *par, float *values, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_all_reduce(t->group, values, values, n, DT_F32, DT_MAX);
    dt__tp_count(t, "all_reduce max tp", t0, 1, 4.0 * (double)n);
}
static void dt__sp_all_gather(dt_parallel *par, const float *mine, float *all, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_all_gather(t->group, mine, all, n, DT_F32);
    dt__tp_count(t, "all_gather tp", t0, 0.5, 0.5 * 4.0 * (double)n * t->size);
}
static void dt__sp_reduce_scatter(dt_parallel *par, const float *all, float *mine, int64_t n) {
    dt_tp *t = (dt_tp *)par;
    double t0 = dt_now_ms();
    dt_reduce_scatter(t->group, all, mine, n, DT_F32, DT_SUM);
    dt__tp_count(t, "reduce_scatter tp", t0, 0.5, 0.5 * 4.0 * (double)n * t->size);
}
static void dt__tp_step_done(dt_parallel *par) {
    dt_tp *t = (dt_tp *)par;
    t->step_sums = t->par.tp_sums;
    t->step_sum_bytes = t->par.tp_sum_bytes;
    t->step_sum_ms = t->par.tp_sum_ms;
    t->par.tp_sums = t->par.tp_sum_bytes = t->par.tp_sum_ms = 0;
}
static void dt__tp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_tp *)par)->group, values, n, DT_SUM);
}
/* The optimizer steps this rank's pieces and the replicated parameters;
   only the group's first rank counts the replicated ones in the norm. */
static void dt__tp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_tp *t = (dt_tp *)par;
    dt_model *m = t->model;
    dt__optimizer_view_all(o, m);
    for (int i = 0; i < m->nparams; i++) o->slices[i].copy = t->rank > 0 && m->splits[i].dim < 0;
    o->sharded_by = par;
}
/* --sequence-parallel: each rank's part of the whole parameters read where
   the rows are split, summed over the group. (Averaging over the groups is
   the data-parallel engine's, which runs first when it wraps this.) */
static void dt__tp_backward_done(dt_parallel *par) {
    dt_tp *t = (dt_tp *)par;
    dt_model *m = t->model;
    if (t->sequence_parallel) {            /* the whole parameters read where the rows are split: summed */
        double t0 = dt_now_ms();
        for (int i = 0; i < m->nparams; i++)
            if (m->splits[i].dim < 0 && m->splits[i].rows)
                dt_all_reduce(t->group, m->params[i].grad, m->params[i].grad, m->params[i].numel, DT_F32, DT_SUM);
        dt__record_comm("all_reduce tp grads", t0, dt_now_ms(), 0);
    }
}
void dt_tp_sync_grads(dt_tp *tp) {
    if (tp->model->parallel != &tp->par)
        dt_fail("dt_tp_sync_grads: %s wraps this model; call %s, which syncs this one too", tp->model->parallel->create_fn,
                tp->model->parallel->sync_fn);
    if (tp->par.data_ranks > 1)
        dt_fail("dt_tp_sync_grads: %d groups of %d ranks each hold the same pieces, and nothing averages their gradients; "
                "wrap the model in a data-parallel engine over dt_tp_data_group (dt_data_parallel_create) and sync that",
                tp->par.data_ranks, tp->size);
    dt_parallel_backward_done(&tp->par);
}
dt_comm *dt_tp_data_group(const dt_tp *tp) { return tp->across; }
int dt_tp_data_rank(const dt_tp *tp) { return tp->par.data_rank; }
int dt_tp_data_ranks(const dt_tp *tp) { return tp->par.data_ranks; }

/* Piece r of T of a parameter (host values in its whole shape, whole_shape):
   out of the whole (to_whole 0) or back into it (1). */
static void dt__tp_piece(float *whole, float *piece, const int *whole_shape, int ndim, dt_split s, int T, int r,
                         int to_whole) {
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < s.dim; d++) outer *= whole_shape[d];
    for (int d = s.dim + 1; d < ndim; d++) inner *= whole_shape[d];
    int64_t group = whole_shape[s.dim] / s.parts, len = group / T;
    size_t bytes = (size_t)(len * inner) * sizeof(float);
    for (int64_t o = 0; o < outer; o++)
        for (int g = 0; g < s.parts; g++) {
            float *w = whole + (o * whole_shape[s.dim] + g * group + r * len) * inner, *p = piece + ((o * s.parts + g) * len) * inner;
            if (to_whole) memcpy(w, p, bytes);
            else memcpy(p, w, bytes);
        }
}
/* This rank's pieces of a whole state (host) into `local`, laid out by m: how the
   model is cut at the start, and a whole checkpoint loaded (dt__tp_state_gather,
   at the chapter's end, goes the other way). */
static void dt__tp_state_scatter(dt_tp *t, const dt_model *m, float *whole, float *local) {
    const dt_model *W = &t->whole;
    float *mine = (float *)malloc((size_t)m->numel * sizeof(float) + 1);
    if (!mine) dt_fail("out of memory (tensor parallelism)");
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].dim < 0) memcpy(mine + m->offsets[i], whole + W->offsets[i], (size_t)m->params[i].numel * sizeof(float));
        else dt__tp_piece(whole + W->offsets[i], mine + m->offsets[i], W->params[i].shape, m->params[i].ndim, m->splits[i],
                          t->size, t->rank, 0);
    }
    dt_upload(local, mine, (size_t)m->numel * sizeof(float));
    free(mine);
}

/* Cutting a model (tensor and pipeline parallelism): the whole model's
   layout kept in `whole`, a shell without buffers that checkpoints are laid
   out by; each parameter's shape made this rank's by cut_shape (a piece of
   it, or nothing); this rank's values moved into new flat buffers by
   scatter (the whole model's on the host -> this rank's on the device). */
static void dt__model_cut(dt_model *model, dt_model *whole, void (*cut_shape)(void *wrapper, int i, dt_tensor *p),
                          void (*scatter)(void *wrapper, float *whole, float *local), void *wrapper) {
    *whole = *model;
    whole->parallel = NULL;
    whole->flat_data = whole->flat_grad = NULL;
    whole->params = (dt_tensor *)malloc(sizeof(dt_tensor) * (size_t)model->nparams);
    whole->offsets = (int64_t *)malloc(sizeof(int64_t) * (size_t)(model->nparams + 1));
    if (!whole->params || !whole->offsets) dt_fail("out of memory (cutting the model)");
    memcpy(whole->params, model->params, sizeof(dt_tensor) * (size_t)model->nparams);
    memcpy(whole->offsets, model->offsets, sizeof(int64_t) * (size_t)model->nparams);
    whole->offsets[model->nparams] = model->numel;
    for (int i = 0; i < model->nparams; i++) whole->params[i].data = whole->params[i].grad = NULL;
    model->numel = 0;
    for (int i = 0; i < model->nparams; i++) {
        cut_shape(wrapper, i, &model->params[i]);
        model->offsets[i] = model->numel;
        model->numel += model->params[i].numel;
    }
    model->offsets[model->nparams] = model->numel;
    float *host = dt__host_view(model->device, model->flat_data, whole->numel);
    size_t bytes = (size_t)model->numel * sizeof(float), whole_bytes = (size_t)whole->numel * sizeof(float);
    float *mine = (float *)dt_alloc_on(model->device, DT_ARENA_PARAMS, bytes);
    scatter(wrapper, host, mine);
    dt__host_view_close(model->device, host, model->flat_data, whole->numel, 0);
    dt_free_on(model->device, DT_ARENA_PARAMS, model->flat_data, whole_bytes);
    dt_free_on(model->device, DT_ARENA_GRADS, model->flat_grad, whole_bytes);
    model->flat_data = mine;
    model->flat_grad = (float *)dt_alloc_on(model->device, DT_ARENA_GRADS, bytes);
    for (int i = 0; i < model->nparams; i++) {
        model->params[i].data = model->flat_data + model->offsets[i];
        model->params[i].grad = model->flat_grad + model->offsets[i];
    }
}
static void dt__tp_cut_shape(void *wrapper, int i, dt_tensor *p) {
    dt_tp *t = (dt_tp *)wrapper;
    dt_split sp = t->model->splits[i];
    if (sp.dim < 0) return;
    p->shape[sp.dim] /= t->size;
    p->numel /= t->size;
}
static void dt__tp_scatter(void *wrapper, float *whole, float *local) {
    dt_tp *t = (dt_tp *)wrapper;
    dt__tp_state_scatter(t, t->model, whole, local);
}

dt_tp *dt_tp_create(dt_model *model, dt_comm *comm, int tp, int sequence_parallel) {
    int world = dt_comm_size(comm);
    char v[64];
    snprintf(v, sizeof v, "%d %d", tp, sequence_parallel != 0);
    dt_comm_check_agree(comm, "--tp --sequence-parallel", v);
    if (tp <= 0) tp = world;
    if (world % tp)
        dt_usage_error("--tp %d does not divide the job's %d ranks (the ranks form groups of --tp, data parallel across them)",
                       tp, world);
    if (model->base) dt_usage_error("--lora-rank: LoRA's adapters are not split by tensor parallelism; train them with 03-05");
    int cuts = 0;
    for (int i = 0; i < model->nparams; i++) {
        dt_split sp = model->splits[i];
        if (sp.dim < 0) continue;
        if (sp.vocab && model->params[i].shape[sp.dim] % tp) {    /* the table at start-up says so */
            model->splits[i].dim = -1;
            continue;
        }
        cuts++;
        int64_t group = model->params[i].shape[sp.dim] / sp.parts;
        if (group % ((int64_t)tp * sp.align))
            dt_usage_error("--tp %d: %s's %lld %s do not split into %d equal shares (%s)", tp, model->params[i].name,
                           (long long)(group / sp.align), sp.align > 1 ? "attention heads" : "features", tp,
                           sp.align > 1 ? "--heads (and llama's --kv-heads) must be a multiple of --tp"
                                        : "--dim and the MLP's width must be multiples of --tp");
    }
    if (!cuts && tp > 1)
        dt_usage_error("--model %s: no layer of this model is split by tensor parallelism (the mlp needs --depth 2 or more)",
                       dt__model_kind_name(model->cfg.kind));
    dt_tp *t = (dt_tp *)calloc(1, sizeof *t);
    if (!t) dt_fail("out of memory (tensor parallelism)");
    t->par = (dt_parallel){ .create_fn = "dt_tp_create", .sync_fn = "dt_tp_sync_grads", .free_fn = "dt_tp_free",
                            .backward_done = dt__tp_backward_done, .step_done = dt__tp_step_done,
                            .optimizer_view = dt__tp_optimizer_view,
                            .sum_over_ranks = dt__tp_sum_over_ranks,
                            .tp_sum = tp > 1 ? dt__tp_sum : NULL,     /* a group of one: the layers as in stage 01 */
                            .tp_max = tp > 1 ? dt__tp_max : NULL, .tp_all_gather = tp > 1 ? dt__sp_all_gather : NULL,
                            .sp_all_gather = tp > 1 && sequence_parallel ? dt__sp_all_gather : NULL,
                            .sp_reduce_scatter = tp > 1 && sequence_parallel ? dt__sp_reduce_scatter : NULL };
    dt_model_set_parallel(model, &t->par);
    dt__comm_hold(comm, "dt_tp_free");
    t->model = model;
    t->comm = comm;
    int sizes[2] = { world / tp, tp };
    const char *names[2] = { "dp", "tp" };
    t->mesh = dt_mesh_create(comm, 2, sizes, names);
    t->group = dt_mesh_comm(t->mesh, "tp");
    t->across = dt_mesh_comm(t->mesh, "dp");
    t->size = tp;
    t->rank = dt_mesh_coord(t->mesh, "tp");
    t->par.tp_rank = t->rank;
    t->par.tp_size = tp;
    t->sequence_parallel = tp > 1 && sequence_parallel;
    t->par.data_rank = dt_mesh_coord(t->mesh, "dp");
    t->par.data_ranks = world / tp;

    t->par.whole = &t->whole;
    dt__model_cut(model, &t->whole, dt__tp_cut_shape, dt__tp_scatter, t);
    if (t->par.data_ranks > 1) dt_broadcast(t->across, model->flat_data, model->numel, DT_F32, 0);   /* every group starts alike */
    return t;
}

void dt_tp_free(dt_tp *tp) {
    if (!tp) return;
    if (tp->model->parallel && tp->model->parallel != &tp->par)   /* (a pipeline has let go of the model already) */
        dt_fail("dt_tp_free: another wrapper still wraps the model it cut; call %s first", tp->model->parallel->free_fn);
    dt_model_set_parallel(tp->model, NULL);
    tp->model->left_cut_by = "dt_tp_free";     /* the pieces stay: the model can only be freed now */
    dt_mesh_free(tp->mesh);
    dt__comm_release(tp->comm);
    free(tp->whole.params);
    free(tp->whole.offsets);
    free(tp);
}

/* -- the cross-entropy of logits whose columns, the vocabulary, are split
      over a tensor-parallel group (stage 06's GPT and Llama), so that the
      whole rows never exist on one rank. Each rank takes each row's m and l
      over its columns, and the label's logit where it holds that column; the
      group takes the largest m (an all-reduce), each rank moves its l onto
      that scale by the online softmax's step (as FlashAttention merges two
      blocks of keys), and the group sums the l's and the label's logits.
      Every rank then has each row's loss, log l + m - x[label], and the
      two numbers the backward above needs (m and 1 / l), the labels this
      rank does not hold out of its columns' range. -- */
static dt_tensor *dt__cross_entropy_split(dt_tensor *logits, const int32_t *labels) {
    dt_parallel *par = logits->parallel;
    int B = (int)dt_tensor_rows(logits), C = (int)dt_tensor_cols(logits), first = par->tp_rank * C;
    double divisor = dt__loss_divisor(labels, B, C * par->tp_size);
    const dt_backend *gpu = dt__backend_for(logits);
    dt_device dev = logits->device;
    dt__scratch_reset();
    void *saved = dt__cross_entropy_saved(B);
    dt__xent_rows k = dt__xent_rows_at(saved, B);
    int32_t *mine = k.labels;
    int32_t *host = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)B);
    for (int i = 0; i < B; i++)            /* this rank's columns: the label's, or -1 (another rank's) */
        host[i] = labels[i] == DT_IGNORE_INDEX ? DT_IGNORE_INDEX
                : labels[i] >= first && labels[i] < first + C ? labels[i] - first : -1;
    float *stats = (float *)dt__scratch_on(dev, sizeof(float) * 3 * (size_t)B);   /* m | l | x[label] */
    const float *lv = dt__in(logits);
    if (gpu) {
        gpu->upload(mine, host, sizeof(int32_t) * (size_t)B);
        gpu->softmax_row_stats(lv, mine, stats, B, C);
    } else {
        memcpy(mine, host, sizeof(int32_t) * (size_t)B);
        DT_OMP("omp parallel for schedule(static) if((double)B * C > 65536.0)")
        for (int i = 0; i < B; i++) {
            const float *r = lv + (size_t)i * C;
            stats[B + i] = (float)dt__row_softmax(r, C, &stats[i]);
            stats[2 * B + i] = mine[i] >= 0 ? r[mine[i]] : 0.0f;
        }
    }
    float *h = (float *)dt__step_alloc_uninit(sizeof(float) * 4 * (size_t)B), *top = h + 3 * (size_t)B;
    dt__download_from(dev, h, stats, sizeof(float) * 3 * (size_t)B);
    par->tp_max(par, stats, B);
    dt__download_from(dev, top, stats, sizeof(float) * (size_t)B);
    for (int i = 0; i < B; i++) {
        float m = h[i];
        h[B + i] *= dt_online_softmax_rescale(&m, top[i]);       /* this rank's l, on the group's scale */
    }
    dt__upload_to(dev, stats + B, h + B, sizeof(float) * 2 * (size_t)B);
    par->tp_sum(par, stats + B, 2 * (int64_t)B);
    dt__download_from(dev, h + B, stats + B, sizeof(float) * 2 * (size_t)B);
    /* each row's loss, added in row order on the host, as the whole-row op does */
    double total = 0, *inv = (double *)dt__step_alloc_uninit(sizeof(double) * (size_t)B);
    for (int i = 0; i < B; i++) {
        if (labels[i] != DT_IGNORE_INDEX) total += log((double)h[B + i]) + top[i] - h[2 * B + i];
        inv[i] = 1.0 / (double)h[B + i];
    }
    dt__upload_to(dev, k.inv_l, inv, sizeof(double) * (size_t)B);
    dt__upload_to(dev, k.m, top, sizeof(float) * (size_t)B);
    int s1[1] = { 1 };
    dt_tensor *loss = dt__tensor_alloc(1, s1, DT_F32);
    float value = (float)(total / divisor);
    dt__upload_to(dev, loss->data, &value, sizeof value);
    return dt__cross_entropy_done(logits, saved, divisor, loss);
}

//@ for the machinery
/* ---- what the machinery asks of tensor parallelism (the run driver's dt_parallel_report) ----
   A checkpoint holds the model whole: each split parameter's pieces gathered
   from the group (and cut again when one is loaded); the memory table shows
   which parameters are split and how; the cost model and --bench learn the
   share of the work that is split and the sums it cost. */
/* The share of the parameters the split layers hold: of the compute too,
   near enough (each parameter multiplies once per token either way). */
static double dt__tp_split_share(const dt_tp *t) {
    double split = 0;
    for (int i = 0; i < t->whole.nparams; i++)
        if (t->model->splits[i].dim >= 0) split += (double)t->whole.params[i].numel;
    return t->whole.numel > 0 ? split / (double)t->whole.numel : 0;
}

/* The cost model's view of the last step: the whole model's compute on one
   rank, from this rank's share of it and its sums' time. */
static int dt__tp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_tp *t = (const dt_tp *)par;
    int K = in->accum_steps > 0 ? in->accum_steps : 1;
    in->kind = DT_PAR_TP;
    in->tp_share = dt__tp_split_share(t);
    in->tp_sums = t->step_sums / K;
    in->tp_bytes = t->step_sums > 0 ? t->step_sum_bytes / t->step_sums : 0;
    double kept = in->tp_share / t->size + (1 - in->tp_share);
    in->compute_ms = fmax(0, in->compute_ms - t->step_sum_ms / K) / kept;
    in->optimizer_ms *= t->model->numel > 0 ? (double)t->whole.numel / (double)t->model->numel : 1;   /* it stepped its pieces */
    in->dp_groups = t->par.data_ranks;
    return t->size;
}

static void dt__tp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_tp *t = (const dt_tp *)par;
    fprintf(out, " tp=%d tp_share=%.4f tp_sums=%.1f tp_bytes=%.0f", t->size, dt__tp_split_share(t), t->step_sums / accum_steps,
            t->step_sums > 0 ? t->step_sum_bytes / t->step_sums : 0.0);
}

/* The state of a tensor-parallel model (parameters or a moment, `local` on
   the device) in the whole model's layout, on the host of the group's first
   rank, which writes it: one split tensor at a time, its pieces all-gathered
   on the device and put where they sit in the whole. So no rank holds more
   than the largest tensor beside its own pieces, and the writer the whole
   state once. The other ranks of the group take part and get NULL. `m`
   lays out `local`: the model, or (a pipeline's stages composed, the
   pipeline-parallel chapter) every stage's pieces. */
static float *dt__tp_state_gather(dt_tp *t, const dt_model *m, float *local) {
    const dt_model *W = &t->whole;
    float *whole = NULL;
    if (t->rank == 0 && !(whole = (float *)malloc((size_t)W->numel * sizeof(float) + 1)))
        dt_fail("out of memory (gathering the tensor-parallel pieces for a checkpoint: %.1f MB)", W->numel * 4e-6);
    for (int i = 0; i < m->nparams; i++) {
        const dt_tensor *p = &m->params[i];
        size_t bytes = (size_t)p->numel * sizeof(float);
        if (m->splits[i].dim < 0) {
            if (whole) dt__download_from(m->device, whole + W->offsets[i], local + m->offsets[i], bytes);
            continue;
        }
        float *all = (float *)dt_alloc_on(m->device, DT_ARENA_COMM, bytes * (size_t)t->size);
        dt_all_gather(t->group, local + m->offsets[i], all, p->numel, DT_F32);
        if (whole) {
            float *host = dt__host_view(m->device, all, p->numel * t->size);
            for (int r = 0; r < t->size; r++)
                dt__tp_piece(whole + W->offsets[i], host + (size_t)r * (size_t)p->numel, W->params[i].shape, p->ndim,
                             m->splits[i], t->size, r, 1);
            dt__host_view_close(m->device, host, all, p->numel * t->size, 0);
        }
        dt_free_on(m->device, DT_ARENA_COMM, all, bytes * (size_t)t->size);
    }
    return whole;
}


/* A parameter's name with its block number as "*": what every block shares. */
static void dt__block_pattern(const char *name, char *out, size_t n) {
    size_t k = 0;
    for (const char *c = name; *c && k + 1 < n; ) {
        const char *e = c;
        while (*e >= '0' && *e <= '9') e++;
        if (e > c && (c == name || c[-1] == '.') && (*e == '.' || !*e)) { out[k++] = '*'; c = e; }
        else out[k++] = *c++;
    }
    out[k] = 0;
}

static void dt__shape_string(const int *shape, int ndim, char *out, size_t n) {
    size_t k = 0;
    out[0] = 0;
    for (int d = 0; d < ndim && k < n; d++) k += (size_t)snprintf(out + k, n - k, d ? "x%d" : "%d", shape[d]);
}

/* At start-up: each rank's bytes against the whole model's, and which
   tensors are cut, whole and here (rows alike in every block printed once). */
static void dt__tp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_tp *t = (const dt_tp *)par;
    const dt_model *m = t->model, *W = &t->whole;
    double split = 0, whole = 0, moments = o->v ? 2 : 1;
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].dim >= 0) split += 4.0 * W->params[i].numel;
        else whole += 4.0 * W->params[i].numel;
    }
    /* wrapped by a data-parallel engine (2-D), this rank keeps what the
       engine's table above says: the pieces here are what it shards */
    int wrapped = t->model->parallel != &t->par;
    printf("memory per rank, --tp %d: every block's layers split over %d ranks, %d data-parallel group%s (MB):\n", t->size,
           t->size, t->par.data_ranks, t->par.data_ranks > 1 ? "s" : "");
    printf("  %-16s %9s %9s   %s\n", "", wrapped ? "pieces" : "this rank", "whole", "formula (S: the split tensors, R: the rest)");
    const char *rows[3] = { "parameters", "gradients", "optimizer state" };
    dt_arena arenas[3] = { DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM };
    for (int r = 0; r < 3; r++)
        printf("  %-16s %9.3f %9.3f   %s(S/%d + R)%s\n", rows[r],
               wrapped ? (r == 2 ? moments : 1) * (split / t->size + whole) / 1e6 : dt_mem_now(arenas[r]) / 1e6,
               (r == 2 ? moments : 1) * (split + whole) / 1e6, r == 2 && moments == 2 ? "2 x " : "", t->size,
               wrapped ? ", which the engine above shards or keeps" : "");
    printf("  S = %.3f MB whole, %.3f here; R = %.3f MB (norms, biases after a sum, what does not divide) on every rank\n",
           split / 1e6, split / t->size / 1e6, whole / 1e6);
    char seen[64][96];
    int nseen = 0;
    int width = 30;                             /* the names' column: Llama's are long */
    for (int i = 0; i < m->nparams; i++) {
        char pattern[96];
        dt__block_pattern(m->params[i].name, pattern, sizeof pattern);
        if (m->splits[i].dim >= 0 && (int)strlen(pattern) > width) width = (int)strlen(pattern);
    }
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].vocab && m->splits[i].dim < 0)
            printf("    %-*s %12d rows stay whole: the vocabulary does not divide by %d\n", width, m->params[i].name,
                   m->params[i].shape[0], t->size);
        if (m->splits[i].dim < 0) continue;
        char pattern[96], a[48], b[48];
        int count = 0, dup = 0;
        dt__block_pattern(m->params[i].name, pattern, sizeof pattern);
        for (int k = 0; k < nseen; k++) dup |= !strcmp(seen[k], pattern);
        if (dup) continue;
        if (nseen < 64) dt__copy_str(seen[nseen++], sizeof seen[0], pattern);
        for (int j = i; j < m->nparams; j++) {
            char other[96];
            dt__block_pattern(m->params[j].name, other, sizeof other);
            count += !strcmp(other, pattern);
        }
        dt__shape_string(W->params[i].shape, W->params[i].ndim, a, sizeof a);
        dt__shape_string(m->params[i].shape, m->params[i].ndim, b, sizeof b);
        printf("    %-*s %12s -> %-12s%s", width, pattern, a, b, m->splits[i].parts > 1 ? " q, k and v each by heads"
                                                                   : m->splits[i].vocab ? " the vocabulary, by tokens" : "");
        if (count > 1) printf("%s x%d blocks", m->splits[i].parts > 1 ? "," : "", count);
        printf("\n");
    }
    fflush(stdout);
}

/* A checkpoint's view (the checkpoints chapter, or a wrapper around this
   one): the whole state from a state laid out as this rank's pieces
   (`layout`: the model, or a pipeline's stages composed), gathered over the
   group for its first rank -- the first group's only, as the groups hold
   the same; and back, each rank cutting its pieces from the whole file. */
static float *dt__tp_whole_from_local(dt_parallel *par, const dt_model *layout, float *local) {
    dt_tp *t = (dt_tp *)par;
    return t->par.data_rank == 0 ? dt__tp_state_gather(t, layout, local) : NULL;
}
static void dt__tp_local_from_whole(dt_parallel *par, const dt_model *layout, float *whole, float *local) {
    dt__tp_state_scatter((dt_tp *)par, layout, whole, local);
}

const dt_parallel_report dt__tp_report = {
    .create_fn = "dt_tp_create",
    .memory_table = dt__tp_memory_table, .cost_input = dt__tp_cost_input, .bench_fields = dt__tp_bench_fields,
    .whole_from_local = dt__tp_whole_from_local, .local_from_whole = dt__tp_local_from_whole,
};
