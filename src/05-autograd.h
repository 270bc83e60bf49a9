//@ lesson: autograd -- the tape and backward; the callbacks a parallel wrapper implements; linear, GELU, the norms, SwiGLU, the residual
/* ---- autograd: the ops ------------------------------------------------------ */

/* Each op computes its output now and, when gradients are on and an input
   requires them, appends its backward to the tape. */
dt_tensor *dt_linear(dt_tensor *x, dt_tensor *weight, dt_tensor *bias); /* x W^T + b */
/* x W + b with W stored [in, out]: the layout of GPT-2's Conv1D layers */
dt_tensor *dt_linear_in_out(dt_tensor *x, dt_tensor *weight, dt_tensor *bias);
dt_tensor *dt_gelu(dt_tensor *x);
dt_tensor *dt_gelu_tanh(dt_tensor *x);                                    /* GPT-2's GELU */
/* dt_gelu(dt_linear(...)), dt_gelu_tanh(dt_linear_in_out(...)) in one pass (the same results) */
dt_tensor *dt_linear_gelu(dt_tensor *x, dt_tensor *weight, dt_tensor *bias);
dt_tensor *dt_linear_in_out_gelu_tanh(dt_tensor *x, dt_tensor *weight, dt_tensor *bias);
dt_tensor *dt_layernorm(dt_tensor *x, dt_tensor *weight, dt_tensor *bias, float eps);
/* Llama's norm: x / sqrt(mean(x^2) + eps) * weight, no mean taken out, no bias */
dt_tensor *dt_rmsnorm(dt_tensor *x, dt_tensor *weight, float eps);
dt_tensor *dt_add(dt_tensor *a, dt_tensor *b);
/* x + branch, written over branch: a residual connection, whose branch (a
   block's attention or MLP) nothing reads again. The add's backward reads no
   values; when the op that made the branch reads none either (a linear
   layer, the fused SwiGLU, an add), the sum takes the branch's memory, else
   it is a new tensor as dt_add makes. A transformer block so keeps two of its
   [tokens, width] tensors fewer (Qwen2-0.5B's shape: 198 MB); the same bits. */
dt_tensor *dt_residual_add(dt_tensor *x, dt_tensor *branch);
dt_tensor *dt_scale(dt_tensor *x, float factor);                         /* factor x */
/* Llama's MLP activation: silu(gate) * up, element by element (SwiGLU) */
dt_tensor *dt_swiglu(dt_tensor *gate, dt_tensor *up);
/* dt_linear(dt_swiglu(gate, up), weight, NULL) -- Llama's down projection --
   keeping no copy of the activation: made again in backward (the same results) */
dt_tensor *dt_swiglu_linear(dt_tensor *gate, dt_tensor *up, dt_tensor *weight);

/* Convert n values between f32, bf16 and f16 buffers on the current device. */
void dt_convert(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n);
/* Element i of a buffer of dtype t, as f32; and an f32 stored there (a 16-bit
   dtype rounded to nearest even). */
float dt_load_f32(const void *p, int64_t i, dt_dtype t);
void dt_store_f32(void *p, int64_t i, dt_dtype t, float v);
/* Gradients on or off (off for evaluation: no tape, no gradient buffers). */
void dt_set_grad_enabled(int on);
/* Walk the tape backwards from a scalar loss, filling every .grad. */
void dt_backward(dt_tensor *loss);
/* The same from any tensor `loss`, given `seed`: d(objective)/d(loss), loss->numel values. */
void dt_backward_from(dt_tensor *loss, const float *seed);

/* A parallel wrapper (the parallel chapters: DataParallel, DDP, FSDP, TP, PP) is this one set of
   callbacks. Each is called by the code that owns its moment of a step: the
   model's forward (a unit begins, ends), the tape (a parameter's gradient is
   final: DDP starts all-reducing its bucket while backward goes on), the
   wrapper's own sync function (backward is done), the optimizer (which
   parameters it steps, when it is created; the step is done). A NULL
   callback: nothing to do at that moment -- DDP has no units, DataParallel
   only sums gradients when backward is done. A wrapper attaches itself with dt_model_set_parallel
   (the models chapter): the model and each of its parameters then point to it, so
   nothing is looked up in global state.
   Wrappers stack, as picotron's do: tensor parallelism cuts every layer,
   pipeline parallelism cuts the blocks into stages around it, and a
   data-parallel engine (DDP, FSDP) wraps the stack, averaging or sharding
   over the data groups what the others split. The outer one names the
   inner (`inner`) and becomes the model's; backward_done and step_done then
   run for each wrapper of the stack, outer first, and the layers' sums
   (tp_sum and the rest) are the inner's, found by dt_parallel_splitting.
   The moments inside a step (unit_begin, unit_end, grad_ready) go to the
   outer one alone: the engine's, as only it gathers units and averages
   gradients. */
typedef struct dt_parallel dt_parallel;
struct dt_optimizer;
struct dt_moe_layer;
struct dt_moe_plan;
struct dt_parallel {
    /* The wrapper's public functions, which the order mistakes name:
       "dt_fsdp_create", "dt_fsdp_sync_grads", "dt_fsdp_free". */
    const char *create_fn, *sync_fn, *free_fn;
    /* The wrapper this one wraps (set before dt_model_set_parallel), or NULL. */
    dt_parallel *inner;
    void (*unit_begin)(dt_parallel *par, int unit);
    void (*unit_end)(dt_parallel *par, int unit);
    void (*grad_ready)(dt_parallel *par, dt_tensor *param);
    void (*backward_done)(dt_parallel *par);
    void (*step_done)(dt_parallel *par);
    /* Pipeline parallelism runs M backwards a step, and says before each
       whether it is the step's last: an engine around it that averages
       whole gradients (DDP) waits for that one (its no-sync). NULL: it
       communicates after every backward (FSDP's ZeRO-2 and -3, which keep
       gradients sharded by reducing each micro-batch's at once). */
    void (*set_sync)(dt_parallel *par, int sync);
    /* Gradients this rank holds in common with ranks outside the engine's
       group -- a tied vocabulary, held by a pipeline's first and last
       stage; what expert parallelism's ranks share besides their experts --
       made whole across them, for parameters first .. end - 1. The engine
       around it calls this when those gradients are whole and final and
       before it shards them (it may average first: the two commute): DDP
       once a step for all of them, FSDP for each unit before its
       reduce-scatter. */
    void (*sum_shared_grads)(dt_parallel *par, int first, int end);
    void (*optimizer_view)(dt_parallel *par, struct dt_optimizer *opt);
    /* A sharded optimizer's partial sums (its gradient norm's), added over
       the ranks that share the model: what clipping needs of the whole. */
    void (*sum_over_ranks)(dt_parallel *par, float *values, int n);
    /* Tensor parallelism (stage 06): sum n f32 values on the device -- an
       activation or its gradient -- over the ranks that split the layers,
       in place. NULL: no layer is split, and dt_tp_copy and dt_tp_sum are
       the identity. */
    void (*tp_sum)(dt_parallel *par, float *values, int64_t n);
    /* The same group's largest of n values (each row's largest logit, when
       the vocabulary is split), and its all-gather (each rank's n values,
       rank after rank: the whole logits, for evaluation); NULL without it. */
    void (*tp_max)(dt_parallel *par, float *values, int64_t n);
    void (*tp_all_gather)(dt_parallel *par, const float *mine, float *all, int64_t n);
    /* Sequence parallelism (--sequence-parallel): the same group's all-gather
       (each rank's n values, rank after rank) and reduce-scatter (the sum,
       this rank keeping its n of n x tp_size), on the device; NULL without
       it. tp_rank, tp_size: this rank's place in the group. */
    void (*sp_all_gather)(dt_parallel *par, const float *mine, float *all, int64_t n);
    void (*sp_reduce_scatter)(dt_parallel *par, const float *all, float *mine, int64_t n);
    int tp_rank, tp_size;
    /* Kept by the same wrapper, for the cost model: the sums of this step's
       training so far (an all-gather or a reduce-scatter counts half), their
       bytes and their time. */
    double tp_sums, tp_sum_bytes, tp_sum_ms;
    /* The share of the data this rank reads, data_rank of data_ranks (what
       dt_evaluate splits by): 0 ranks means the job's rank and size. */
    int data_rank, data_ranks;
    /* A data-parallel engine's ranks, whose batches make the step's whole
       batch: this rank's place among them (rank of ranks), and, when all is
       not NULL, each one's n f32 host values, rank after rank. A mixture of
       experts routes the whole batch so (the MoE chapter). NULL: this rank's
       batch is the whole. */
    void (*data_all_gather)(dt_parallel *par, const float *mine, float *all, int64_t n, int *rank, int *ranks);
    /* Expert parallelism (stage 09): run a mixture's experts on the slots the
       layer dispatched to them (dt_moe_forward, the MoE chapter), the experts
       being spread over ranks; the result in the slots' order. NULL: every
       expert is on this rank. */
    struct dt_tensor *(*moe_experts)(dt_parallel *par, const struct dt_moe_layer *layer, struct dt_tensor *slots,
                                     const struct dt_moe_plan *plan);
    /* The ranks whose gradients of the same parameters a data-parallel engine
       around must average: 0, the data_ranks groups (each holds other
       pieces: tensor and pipeline parallelism); context parallelism, every
       rank of the job (each holds the whole model and a part of every
       gradient, its tokens'; only the groups read other batches). */
    int grad_ranks;
    /* Kept by the ops: 1 between dt_sp_split and dt_sp_gather, where each rank
       holds its share of the rows (and backward, walking back, sets it again). */
    int rows_split;
    /* A wrapper that cuts the model (tensor, pipeline parallelism): its
       parameters in their whole shapes, a shell without buffers (NULL: the
       model's own), which the flop count and checkpoints go by. */
    struct dt_model *whole;
    /* Pipeline parallelism (stage 07): the model's forward as the pipeline
       runs it -- this rank's blocks, the activations passed from stage to
       stage, the last stage's logits given to every rank -- for what calls
       dt_model_forward without gradients (evaluation, generation); NULL: the
       model's own. */
    dt_tensor *(*forward)(dt_parallel *par, dt_tensor *inputs);
    /* What the machinery asks of a wrapper besides -- a checkpoint of the
       whole model, what each rank holds, the figures of a step for the log,
       --bench and the cost model -- is not here: it is the run driver's
       dt_parallel_report, which each wrapper fills at its chapter's end. */
    /* Kept by the library: a backward ran since backward_done did, so the
       gradients are this rank's own, not yet the average the optimizer needs. */
    int grads_pending;
};
/* backward_done, called by each wrapper's sync function (dt_ddp_sync_grads,
   ...), then each inner wrapper's: fails unless a backward has run since the
   last one. */
void dt_parallel_backward_done(dt_parallel *par);
/* The wrapper of a stack that splits the layers (its tp_sum set), or NULL:
   what dt_tp_copy and the other ops of tensor parallelism use. */
dt_parallel *dt_parallel_splitting(dt_parallel *par);
/* Floating-point operations counted by the matmuls since the last reset. */
double dt_flops_counted(void);
void dt_flops_reset(void);

//@ implementation
/* ==== autograd ===============================================================
   Reverse-mode differentiation with a tape. Each op computes its output at once
   and, if gradients are on and any input needs one, appends an entry: which
   function computes the input gradients from the output gradient, and what it
   saved (layernorm's mean and 1/std, attention's probabilities). dt_backward()
   seeds d(loss)/d(loss) = 1 and calls the entries from last to first. Every
   backward ADDS into .grad, because a tensor used twice (a residual) receives
   gradient from both uses. */

void dt_set_grad_enabled(int on) { dt__ctx.grad_enabled = on; }
double dt_flops_counted(void) { return dt__ctx.flops; }
void dt_flops_reset(void) { dt__ctx.flops = 0; }

static int dt__wants_grad(dt_tensor *a, dt_tensor *b, dt_tensor *c) {
    if (!dt__ctx.grad_enabled) return 0;
    return (a && a->requires_grad) || (b && b->requires_grad) || (c && c->requires_grad);
}

/* A new, zeroed entry at the end of the tape. */
static dt__tape_entry *dt__tape_append(dt__backward_fn fn) {
    if (dt__ctx.tape_len == dt__ctx.tape_cap) {
        dt__ctx.tape_cap = dt__ctx.tape_cap ? 2 * dt__ctx.tape_cap : 256;
        dt__ctx.tape = (dt__tape_entry *)realloc(dt__ctx.tape, dt__ctx.tape_cap * sizeof(dt__tape_entry));
        if (!dt__ctx.tape) dt_fail("out of memory (autograd tape)");
    }
    dt__tape_entry *e = &dt__ctx.tape[dt__ctx.tape_len++];
    memset(e, 0, sizeof *e);
    e->backward = fn;
    return e;
}

static dt__tape_entry *dt__tape_push(dt__backward_fn fn, dt_tensor *out, dt_tensor *a, dt_tensor *b, dt_tensor *c) {
    dt__tape_entry *e = dt__tape_append(fn);
    e->out = out;
    e->in[0] = a; e->in[1] = b; e->in[2] = c;
    out->requires_grad = 1;
    return e;
}

/* A mark on the tape with no tensor: its function runs when backward reaches
   it. FSDP uses two per unit, to gather before the unit's backward and to
   reduce-scatter after it. */
static void dt__tape_mark(dt__backward_fn fn, void *user, int arg) {
    dt__tape_entry *e = dt__tape_append(fn);
    e->saved = user;
    e->iarg[0] = arg;
}

/* A region of the tape whose backward gives back what it allocated: a
   model's block (the models chapter). Without --recompute a block's
   activations stay until the step's end -- the peak is where backward
   begins, when all of them are there -- but what its backward makes, the
   gradient of each of its activations, is needed only until backward leaves
   the block, except the gradient of what entered it, which the block before
   reads next. Two tape marks stand around the region: the one walked first
   (its end) makes that gradient and notes the arena's place; the one walked
   last (its start) goes back there. Only one block's gradients are then in
   memory, not every block's (Qwen2-0.5B's shape at 9 x 128 tokens: the
   peak of activations 7.97 -> 5.13 GB). And the input's gradient is read by
   the block before and by nothing once that block's backward is done: the
   input gradients of blocks after the first of a run take turns in two
   buffers, made at the first region of a backward, not one a block piling up
   to the step's end (the same shape: 98 MB). Nothing made inside may be read
   after backward, and such a block's input gradient only until the backward
   of the block two before it begins; the first block's input (the caller's:
   an embedding's output, a pipeline stage's input) keeps its own. */
typedef struct { dt_tensor *x; dt__step_mark mark; int turns; } dt__grad_region;
static void dt__grad_region_enter(dt__tape_entry *e) {
    dt__grad_region *g = (dt__grad_region *)e->saved;
    dt_tensor *x = g->x;
    if (!x->requires_grad || x->grad) {
    } else if (!g->turns) dt_grad(x);          /* before the mark: x's gradient outlives the region's */
    else {
        size_t bytes = dt__grad_bytes(x);
        dt__block_grads *turns = &dt__ctx.block_grads;
        if (turns->generation != dt__ctx.backward_generation || turns->device != x->device || turns->bytes < bytes) {
            turns->buf[0] = dt__step_alloc_on(x->device, bytes);   /* the first region of this backward */
            turns->buf[1] = dt__step_alloc_on(x->device, bytes);
            turns->bytes = bytes; turns->device = x->device; turns->generation = dt__ctx.backward_generation; turns->turn = 0;
        }
        x->grad = (float *)turns->buf[turns->turn];
        turns->turn ^= 1;
        dt__zero_on(x->device, x->grad, bytes);
    }
    g->mark = dt__step_mark_now();
}
static void dt__grad_region_leave(dt__tape_entry *e) { dt__step_back_to(&((dt__grad_region *)e->saved)->mark); }
static dt__grad_region *dt__grad_region_begin(dt_tensor *x, int turns) {
    dt__grad_region *g = (dt__grad_region *)dt_step_alloc(sizeof *g);
    g->x = x; g->turns = turns;
    dt__tape_mark(dt__grad_region_leave, g, 0);
    return g;
}
static void dt__grad_region_end(dt__grad_region *g) { dt__tape_mark(dt__grad_region_enter, g, 0); }

/* Backward from a scalar loss, seeded with d(loss)/d(loss) = seed: 1, or a
   loss scale (the mixed-precision chapter). */
static void dt__backward_seeded(dt_tensor *loss, float seed) {
    if (loss->numel != 1) dt_fail("backward needs a scalar loss, got %lld elements", (long long)loss->numel);
    dt_backward_from(loss, &seed);
}
void dt_backward(dt_tensor *loss) { dt__backward_seeded(loss, 1.0f); }

/* Walk the tape's entries [lo, hi) from last to first. First, where each
   parameter is read first among them: its gradient is final once the walk has
   passed that entry -- the moment DDP may start communicating it. */
static void dt__tape_walk(int lo, int hi) {
    int generation = dt__ctx.backward_generation;
    for (int i = lo; i < hi; i++)
        for (int j = 0; j < 4; j++) {
            dt_tensor *p = dt__ctx.tape[i].in[j];
            if (p && p->is_param && p->hook_gen != generation) { p->hook_gen = generation; p->first_use = i; }
            if (p && p->is_param && p->parallel) p->parallel->grads_pending = 1;
        }
    for (int i = hi - 1; i >= lo; i--) {
        dt__tape_entry *e = &dt__ctx.tape[i];
        dt__scratch_reset();
        if (!e->out || e->out->grad) e->backward(e);
        e = &dt__ctx.tape[i];          /* a recomputed block (the models chapter) grows the tape, which may move it */
        for (int j = 0; j < 4; j++) {
            dt_tensor *p = e->in[j];
            if (p && p->is_param && p->first_use == i && p->hook_gen == generation && p->parallel && p->parallel->grad_ready)
                p->parallel->grad_ready(p->parallel, p);
        }
    }
}

void dt_backward_from(dt_tensor *loss, const float *seed) {
    if (!loss->requires_grad) dt_fail("the loss does not depend on any parameter (were gradients disabled?)");
    dt__ctx.backward_generation++;
    dt__backend_for(loss);
    dt__ctx.loss_seed = loss->numel == 1 ? seed[0] : 1.0f;
    dt_upload(dt_grad(loss), seed, sizeof(float) * (size_t)loss->numel);
    dt__tape_walk(0, dt__ctx.tape_len);
    dt__ctx.tape_len = 0;
    dt__ctx.backward_end_ms = dt_now_ms();
}

/* Backward over a run of the tape, [lo, hi), from `out`, whose gradient is
   already in place: pipeline parallelism (the pipeline-parallel chapter) walks one micro-batch's
   forward at a time, from the gradient the next stage sent back. The tape
   stays as it is (the step's end empties it). */
static void dt__backward_span(dt_tensor *out, int lo, int hi) {
    if (!out->requires_grad || !out->grad) dt_fail("a backward from a tensor that has no gradient to pass back");
    dt__ctx.backward_generation++;
    dt__backend_for(out);
    dt__tape_walk(lo, hi);
}

dt_parallel *dt_parallel_splitting(dt_parallel *par) {
    while (par && !par->tp_sum) par = par->inner;
    return par;
}
void dt_parallel_backward_done(dt_parallel *par) {
    if (!par->grads_pending)
        dt_fail("%s: no backward has run since the gradients were last synchronised; call it after dt_backward",
                par->sync_fn);
    par->grads_pending = 0;
    for (dt_parallel *q = par; q; q = q->inner) {
        if (q->backward_done) q->backward_done(q);
        q->rows_split = 0;        /* no rows-split region outlives its step */
    }
}

/* Round f32 values to a 16-bit type and widen them again, in one pass. */
static void dt__round_f32_cpu(const float *x, float *y, dt_dtype to, int64_t n) {
    uint16_t h[256];
    for (int64_t i = 0; i < n; i += 256) {
        int64_t c = n - i < 256 ? n - i : 256;
        dt__f32_to_half_cpu(x + i, h, to, c);
        dt__half_to_f32_cpu(h, y + i, to, c);
    }
}
float dt_load_f32(const void *p, int64_t i, dt_dtype t) {
    return t == DT_F32 ? ((const float *)p)[i] : t == DT_BF16 ? dt_bf16_to_f32(((const uint16_t *)p)[i])
                                                              : dt_f16_to_f32(((const uint16_t *)p)[i]);
}
void dt_store_f32(void *p, int64_t i, dt_dtype t, float v) {
    if (t == DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = t == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
}
void dt_convert(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n) {
    const dt_backend *gpu = dt__backend_of(dt__ctx.device);
    if (gpu) { gpu->convert(src, from, dst, to, n); return; }
    const int64_t chunk = 16384;              /* cores share the work when there is enough */
    DT_OMP("omp parallel for schedule(static) if(n > 4 * chunk)")
    for (int64_t i = 0; i < n; i += chunk) {
        int64_t c = n - i < chunk ? n - i : chunk;
        if (from == to) memcpy((char *)dst + i * dt_dtype_size(to), (const char *)src + i * dt_dtype_size(to), (size_t)c * dt_dtype_size(to));
        else if (from == DT_F32) dt__f32_to_half_cpu((const float *)src + i, (uint16_t *)dst + i, to, c);
        else if (to == DT_F32) dt__half_to_f32_cpu((const uint16_t *)src + i, (float *)dst + i, from, c);
        else
            for (int64_t k = i; k < i + c; k++) {       /* bf16 <-> f16, through f32 */
                float v = from == DT_BF16 ? dt_bf16_to_f32(((const uint16_t *)src)[k]) : dt_f16_to_f32(((const uint16_t *)src)[k]);
                ((uint16_t *)dst)[k] = to == DT_BF16 ? dt_f32_to_bf16(v) : dt_f32_to_f16(v);
            }
    }
}

/* -- how an op sees its tensors. Ops compute in f32. With f32 everywhere the
      views below are the tensors' own buffers and cost nothing. Under mixed
      precision (the mixed-precision chapter) an op reads every input as f32 values rounded to
      the compute dtype -- a 16-bit activation widened, or an f32 master weight
      narrowed, the cast PyTorch's autocast makes -- into the scratch arena,
      and stores its output narrowed to 16 bits. Gradients travel the same way:
      an activation's in its own dtype, a parameter's added to its f32 master
      gradient after rounding, as a 16-bit copy's gradient would have been. -- */
static int dt__mixed(void) { return dt__ctx.compute_dtype != DT_F32; }

/* On the CPU: n f32 values rounded to the compute dtype (y may be x), the
   cores sharing the work. */
static void dt__round_to_compute_cpu(const float *x, float *y, int64_t n) {
    const int64_t chunk = 16384;
    dt_dtype to = dt__ctx.compute_dtype;          /* read here: the context is per thread */
    DT_OMP("omp parallel for schedule(static) if(n > 4 * chunk)")
    for (int64_t i = 0; i < n; i += chunk) dt__round_f32_cpu(x + i, y + i, to, n - i < chunk ? n - i : chunk);
}
/* n values of dtype `from` at src as f32 in the scratch arena; f32 values are
   rounded to the compute dtype on the way (a 16-bit copy, widened again). */
static float *dt__scratch_f32(const void *src, dt_dtype from, int64_t n) {
    float *f = (float *)dt__scratch_on(dt__ctx.device, (size_t)n * sizeof(float));
    if (from == DT_F32 && dt__mixed() && dt__ctx.device == DT_CPU) {      /* the same, in one pass */
        dt__round_to_compute_cpu((const float *)src, f, n);
        return f;
    }
    if (from == DT_F32 && dt__mixed()) {
        void *half = dt__scratch_on(dt__ctx.device, (size_t)n * 2);
        dt_convert(src, DT_F32, half, dt__ctx.compute_dtype, n);
        src = half;
        from = dt__ctx.compute_dtype;
    }
    dt_convert(src, from, f, DT_F32, n);
    return f;
}
static const float *dt__in(const dt_tensor *t) {
    if (!t->data) dt__lazy_make(t);
    if (t->dtype == DT_F32 && !dt__mixed()) return t->data;
    return dt__scratch_f32(t->data, t->dtype, t->numel);
}
/* d(loss)/d(out) of an op's output, as f32. */
static const float *dt__grad_in(const dt_tensor *t) {
    dt_dtype g = dt__grad_dtype(t);
    if (g == DT_F32) return t->grad;
    return dt__scratch_f32(t->grad, g, t->numel);
}
/* Where an op writes its output as f32, and the store into the output's dtype. */
static float *dt__out(dt_tensor *y) {
    return y->dtype == DT_F32 ? y->data : (float *)dt__scratch_on(y->device, (size_t)y->numel * sizeof(float));
}
static void dt__out_done(dt_tensor *y, float *v) {
    if (v != y->data) dt_convert(v, DT_F32, y->data, y->dtype, y->numel);
}
/* Where a backward ADDS d(loss)/d(t) as f32, and the store after. */
static float *dt__grad_acc(dt_tensor *t) {
    dt_dtype g = dt__grad_dtype(t);
    float *grad = dt_grad(t);
    if (g == DT_F32 && !(t->is_param && dt__mixed())) return grad;
    float *f = (float *)dt__scratch_on(t->device, (size_t)t->numel * sizeof(float));
    if (g == DT_F32) dt__zero_on(t->device, f, (size_t)t->numel * sizeof(float));   /* a parameter's share */
    else dt_convert(grad, g, f, DT_F32, t->numel);
    return f;
}
static void dt__grad_acc_done(dt_tensor *t, float *f) {
    if (f == t->grad) return;
    if (dt__grad_dtype(t) != DT_F32) { dt_convert(f, DT_F32, t->grad, t->dtype, t->numel); return; }
    /* a parameter: its 16-bit gradient, added to the f32 master gradient */
    const dt_backend *gpu = dt__backend_of(t->device);
    if (gpu) { gpu->accumulate(t->grad, dt__scratch_f32(f, DT_F32, t->numel), t->numel); return; }
    int64_t n = t->numel;
    float *g = t->grad;
    dt__round_to_compute_cpu(f, f, n);                  /* in place: no second copy of a big weight */
    DT_OMP("omp parallel for if(n > 65536)")
    for (int64_t i = 0; i < n; i++) g[i] += f[i];
}
/* The same, for a backward that can write its share instead of adding it: an
   activation's gradient that no op has touched yet comes unzeroed, *first is
   1, and the caller must write every element. On the CPU the element-wise
   ops are bound by memory, not arithmetic: zeroing a buffer and then reading
   it back to add cost a third of GELU's and the residual's backward, and a
   memset of every activation's gradient besides. A GPU's kernels only add
   (the backend table has no overwriting form), so there *first is 0. */
static float *dt__grad_acc_first(dt_tensor *t, int *first) {
    *first = !t->grad && !t->is_param && !dt__backend_of(t->device);
    if (!*first) return dt__grad_acc(t);
    t->grad = (float *)dt__step_alloc_on(t->device, dt__grad_bytes(t));
    float *f = dt__grad_dtype(t) == DT_F32 ? t->grad
                                            : (float *)dt__scratch_on(t->device, (size_t)t->numel * sizeof(float));
#ifdef DT_TESTING
    /* The arena hands back last step's memory, which no sanitizer sees as
       unwritten: in the tests' builds an element the caller forgets is NaN. */
    for (int64_t i = 0; i < t->numel; i++) f[i] = NAN;
#endif
    return f;                                      /* a 16-bit gradient: converted by _done */
}

/* A matmul operand: a 2-D tensor's data (or gradient), row-major. */
typedef struct dt__operand { const dt_tensor *t; int grad; } dt__operand;
static dt__operand dt__op_data(const dt_tensor *t) { dt__operand o = { t, 0 }; return o; }
static dt__operand dt__op_grad(const dt_tensor *t) { dt__operand o = { t, 1 }; return o; }
/* Its values in the compute dtype: the tensor's own buffer, or a 16-bit copy
   in the scratch arena (what a GPU's tensor cores read). */
static const void *dt__operand_half(dt__operand o) {
    dt_dtype have = o.grad ? dt__grad_dtype(o.t) : o.t->dtype;
    const void *src = o.grad ? (const void *)o.t->grad : (const void *)o.t->data;
    if (have == dt__ctx.compute_dtype) return src;
    void *half = dt__scratch_on(o.t->device, (size_t)o.t->numel * 2);
    dt_convert(src, have, half, dt__ctx.compute_dtype, o.t->numel);
    return half;
}
/* The matmuls of linear layers: C[M,N] (+)= op(A) op(B), A and B seen in the
   compute dtype. A GPU multiplies 16-bit operands on its tensor cores,
   summing in f32; the CPU widens them to f32 first (dt__in and dt__grad_in) --
   products of 16-bit numbers are exact in f32, so both sum the same products.
   The epilogue (linear's forward; NULL elsewhere; ldc = N) is the CPU
   matmul's own, and kernels after the matmul on a GPU. */
static void dt__gpu_epilogue(const dt_backend *gpu, float *C, int M, int N, const dt__epilogue *ep) {
    if (ep && (ep->gelu_grad || ep->a_sums || ep->b_sums)) dt_fail("internal error: a CPU matmul's epilogue on a GPU");
    if (ep && ep->bias) gpu->add_bias(C, ep->bias, M, N);
    if (ep && ep->gelu) gpu->gelu_forward(C, ep->gelu, (int64_t)M * N, ep->tanh_form);
}
static void dt__matmul_op(const dt_backend *gpu, int ta, int tb, int M, int N, int K, dt__operand A, dt__operand B,
                         float beta, float *C, int ldc, const dt__epilogue *ep) {
    int lda = (int)dt_tensor_cols(A.t), ldb = (int)dt_tensor_cols(B.t);
    if (gpu && dt__mixed()) {
        gpu->gemm_half(dt__ctx.compute_dtype, ta, tb, M, N, K, dt__operand_half(A), lda, dt__operand_half(B), ldb, beta, C, ldc);
        dt__gpu_epilogue(gpu, C, M, N, ep);
        return;
    }
    const float *a = A.grad ? dt__grad_in(A.t) : dt__in(A.t), *b = B.grad ? dt__grad_in(B.t) : dt__in(B.t);
    if (gpu) {
        gpu->gemm(ta, tb, M, N, K, 1.0f, a, lda, b, ldb, beta, C, ldc);
        dt__gpu_epilogue(gpu, C, M, N, ep);
    } else dt__gemm_epilogue(ta, tb, M, N, K, 1.0f, a, lda, b, ldb, beta, C, ldc, ep);
}

/* -- linear: y = x W^T + b. The three matmuls of every layer's training step.
      GPT-2 stores its weights the other way round, [in, out] (in_out, in
      iarg[0]): the same matmuls with the weight's transposes flipped. -- */
/* The MLP's second layer reads GELU's output x and nothing else does: its input gradient times
   GELU'(pre) is pre's gradient, made as the matmul stores each tile (dt__epilogue). x's gradient,
   [tokens, 4 x width], is never made nor read back, and the walk passes GELU's entry over (its output
   has no gradient). The same bits: the same product, rounded to a float, times the same derivative.
   Only where nothing else can have read x: GELU's entry just before, neither gradient begun, f32, CPU. */
static int dt__gelu_apart;                     /* tests: GELU's backward on its own */
static void dt__gelu_backward(dt__tape_entry *e);
static dt__tape_entry *dt__gelu_behind(dt__tape_entry *e, const dt_tensor *x) {
    if (dt__gelu_apart || e == dt__ctx.tape || e[-1].backward != dt__gelu_backward || e[-1].out != x) return NULL;
    dt_tensor *pre = e[-1].in[0];
    if (x->grad || x->is_param || !pre->requires_grad || pre->grad || pre->is_param || dt__backend_of(x->device) ||
        dt__grad_dtype(x) != DT_F32 || dt__grad_dtype(pre) != DT_F32 || dt__mixed())
        return NULL;
    return &e[-1];
}
static void dt__linear_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *w = e->in[1], *b = e->in[2], *y = e->out;
    int in_out = e->iarg[0];
    int N = (int)dt_tensor_rows(x), in = (int)dt_tensor_cols(x), out = (int)dt_tensor_cols(y);
    const dt_backend *gpu = dt__backend_for(y);
    if (x->requires_grad) {              /* dx = dy W (in_out: dy W^T) */
        int first;
        dt__tape_entry *gelu = dt__gelu_behind(e, x);
        dt_tensor *to = gelu ? gelu->in[0] : x;                 /* x = GELU(pre): pre's gradient at once */
        dt__epilogue ep = { .tanh_form = gelu ? gelu->iarg[0] : 0, .gelu_grad = gelu ? dt__in(to) : NULL, .slope = gelu ? gelu->iarg[1] : 0 };
        float *dx = dt__grad_acc_first(to, &first);
        dt__matmul_op(gpu, 0, in_out, N, in, out, dt__op_grad(y), dt__op_data(w), first ? 0.0f : 1.0f, dx, in, gelu ? &ep : NULL);
        dt__grad_acc_done(to, dx);
        dt__ctx.flops += 2.0 * N * in * out;
    }
    float *db = b && b->requires_grad ? dt__grad_acc(b) : NULL;   /* db = sum of dy over rows, in row order */
    int db_packed = db && w->requires_grad && !gpu;
    if (w->requires_grad) {              /* dW = dy^T x (in_out: x^T dy); on the CPU db too, as dy is packed */
        float *dw = dt__grad_acc(w);
        dt__epilogue sums = { .a_sums = in_out ? NULL : db, .b_sums = in_out ? db : NULL };
        if (in_out) dt__matmul_op(gpu, 1, 0, in, out, N, dt__op_data(x), dt__op_grad(y), 1.0f, dw, out, db_packed ? &sums : NULL);
        else dt__matmul_op(gpu, 1, 0, out, in, N, dt__op_grad(y), dt__op_data(x), 1.0f, dw, in, db_packed ? &sums : NULL);
        dt__grad_acc_done(w, dw);
        dt__ctx.flops += 2.0 * N * in * out;
    }
    if (db && !db_packed) {              /* on a GPU, or beside a frozen weight: the sums alone */
        if (gpu) gpu->sum_rows(dt__grad_in(y), db, N, out);
        else dt__add_k_sums(1, out, N, dt__grad_in(y), out, db);
    }
    if (db) dt__grad_acc_done(b, db);
}
/* act: where linear + GELU (below) wants GELU of y, computed as y is stored */
static dt_tensor *dt__linear_layout(dt_tensor *x, dt_tensor *w, dt_tensor *b, int in_out, dt_tensor *act, int tanh_form) {
    int N = (int)dt_tensor_rows(x), in = (int)dt_tensor_cols(x);
    int out = (int)(in_out ? dt_tensor_cols(w) : dt_tensor_rows(w)), w_in = (int)(in_out ? dt_tensor_rows(w) : dt_tensor_cols(w));
    if (w_in != in)
        dt_fail("linear %s: input has %d features, weight expects %d", w->name ? w->name : "", in, w_in);
    const dt_backend *gpu = dt__backend_for(x);
    dt__backend_for(w);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(N, out);
    float *yv = dt__out(y);
    float *actv = act ? dt__out(act) : NULL;
    dt__epilogue ep = { .bias = b ? dt__in(b) : NULL, .gelu = actv, .tanh_form = tanh_form, .slope = act && !gpu };
    dt__matmul_op(gpu, 0, !in_out, N, out, in, dt__op_data(x), dt__op_data(w), 0.0f, yv, out, b || act ? &ep : NULL);
    dt__ctx.flops += 2.0 * N * in * out;
    dt__out_done(y, yv);
    if (act) dt__out_done(act, actv);
    if (dt__wants_grad(x, w, b)) dt__tape_push(dt__linear_backward, y, x, w, b)->iarg[0] = in_out;
    return y;
}
dt_tensor *dt_linear(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) { return dt__linear_layout(x, weight, bias, 0, NULL, 0); }
dt_tensor *dt_linear_in_out(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) { return dt__linear_layout(x, weight, bias, 1, NULL, 0); }

/* -- GELU: the exact erf form (PyTorch's nn.GELU() and timm), or the tanh
      approximation GPT-2 was trained with (tanh_form, in iarg[0]) -- */
static void dt__gelu_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    int first;
    float *dx = dt__grad_acc_first(x, &first);
    const float *dy = dt__grad_in(e->out), *xv = dt__in(x);
    int64_t n = x->numel;
    int tanh_form = e->iarg[0];
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->gelu_backward(xv, dy, dx, n, tanh_form);
    else if (e->iarg[1]) {                          /* x holds GELU'(x) (linear + GELU's forward) */
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) dx[i] = first ? dy[i] * xv[i] : dx[i] + dy[i] * xv[i];
    } else {                  /* one loop per form, and per write or add: a choice inside would keep gcc from vectorising */
        if (tanh_form && first) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * dt_gelu_tanh_derivative(xv[i]);
        } else if (tanh_form) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] += dy[i] * dt_gelu_tanh_derivative(xv[i]);
        } else if (first) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] = dy[i] * dt_gelu_derivative(xv[i]);
        } else {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dx[i] += dy[i] * dt_gelu_derivative(xv[i]);
        }
    }
    dt__grad_acc_done(x, dx);
}
static dt_tensor *dt__gelu_form(dt_tensor *x, int tanh_form) {
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    int64_t n = x->numel;
    const float *xv = dt__in(x);
    float *yv = dt__out(y);
    if (gpu) gpu->gelu_forward(xv, yv, n, tanh_form);
    else {
        if (tanh_form) {                            /* one loop per form, as in backward */
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) yv[i] = dt_gelu_tanh_value(xv[i]);
        } else {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) yv[i] = dt_gelu_value(xv[i]);
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__gelu_backward, y, x, NULL, NULL)->iarg[0] = tanh_form;
    return y;
}
dt_tensor *dt_gelu(dt_tensor *x) { return dt__gelu_form(x, 0); }
dt_tensor *dt_gelu_tanh(dt_tensor *x) { return dt__gelu_form(x, 1); }

/* -- linear, then GELU: the first layer of a transformer's MLP. On the tape
      they are the two ops above, so the backward is theirs, but the forward
      is one pass: the matmul writes GELU(y), and GELU'(y) where y was (on the
      CPU; a GPU keeps y), from each tile while it is hot (see dt__epilogue).
      Under mixed precision y is rounded to 16 bits before GELU reads it, so
      there the two ops simply run one after the other. -- */
static dt_tensor *dt__linear_gelu(dt_tensor *x, dt_tensor *w, dt_tensor *b, int in_out, int tanh_form) {
    if (dt__mixed()) return dt__gelu_form(dt__linear_layout(x, w, b, in_out, NULL, 0), tanh_form);
    dt_tensor *act = dt__tensor_out_2d((int)dt_tensor_rows(x), (int)(in_out ? dt_tensor_cols(w) : dt_tensor_rows(w)));
    dt_tensor *y = dt__linear_layout(x, w, b, in_out, act, tanh_form);
    if (dt__wants_grad(y, NULL, NULL)) {        /* on the CPU y holds GELU'(y): dt__epilogue's slope */
        dt__tape_entry *e = dt__tape_push(dt__gelu_backward, act, y, NULL, NULL);
        e->iarg[0] = tanh_form, e->iarg[1] = !dt__backend_for(x);
    }
    return act;
}
dt_tensor *dt_linear_gelu(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) { return dt__linear_gelu(x, weight, bias, 0, 0); }
dt_tensor *dt_linear_in_out_gelu_tanh(dt_tensor *x, dt_tensor *weight, dt_tensor *bias) {
    return dt__linear_gelu(x, weight, bias, 1, 1);
}

/* -- LayerNorm over the last dimension. Saves mean and 1/std per row.
      A row's sums run in DT_LANES interleaved partial sums, added up in a
      fixed order at the end: one running sum is a chain the compiler may not
      reorder, so it could not use vector instructions, and the row loops are
      most of LayerNorm's time. Sums in float: rows of up to a few thousand
      values lose nothing a test sees; the weight's gradient, summed over
      millions of rows, stays in double below. (DT__LANE_SUM: the matmul
      chapter, beside the vector type.) -- */
/* A norm's weight and bias gradients: sum[j] += the sum over rows i0..i1 of dy *
   x-hat, sum[D + j] += of dy (stats: the rows' means, then their 1/std;
   RMSNorm's means are 0). In double: in float, 4 million rows lost 8e-5 of a
   sum (the first GPU run, 2026-11-24). Columns are dealt to threads; each sums
   its rows in order, so a sum's bits do not depend on the threads or on where
   the caller cut the rows. The caller cuts them into chunks (dt__norm_chunk)
   whose x and dy fill 1 MB: it makes a chunk's dx, then these sums, which then
   read x and dy from the L2 cache, where a pass of their own read them from
   memory a second time (vit-tiny's step: 1% of it). */
static int dt__norm_chunk(int D) { return (int)((1 << 20) / (8 * (int64_t)(D > 0 ? D : 1))) + 1; }
static void dt__norm_weight_sums(const float *xv, const float *dy, const float *stats, int N, int i0, int i1, int D,
                                 double *sum) {
    /* Row after row, each thread its band of columns: the sums stay in the L1
       cache and x and dy stream through once. (Bands of 16 columns down all
       the rows, one cache line of each row at a time: 3.5x as long.) */
    DT_OMP("omp parallel if((int64_t)(i1 - i0) * D > 65536)")
    {
        int t = dt__thread_num(), nt = dt__team_size();
        int j0 = (int)((int64_t)D * t / nt), w = (int)((int64_t)D * (t + 1) / nt) - j0;
        double *s = sum + j0, *u = sum + D + j0;
        for (int i = i0; i < i1; i++) {
            const float *xr = xv + (size_t)i * D + j0, *dyr = dy + (size_t)i * D + j0;
            float mean = stats[i], rstd = stats[N + i];
            for (int j = 0; j < w; j++) {
                s[j] += (double)dyr[j] * ((xr[j] - mean) * rstd);
                u[j] += dyr[j];
            }
        }
    }
}
static void dt__layernorm_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *w = e->in[1], *b = e->in[2], *y = e->out;
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    const float *stats = (const float *)e->saved;      /* mean[N], rstd[N] */
    const float *dy = dt__grad_in(y), *xv = dt__in(x), *wv = w ? dt__in(w) : NULL;
    int first = 0;
    float *dx = x->requires_grad ? dt__grad_acc_first(x, &first) : NULL;
    float *dw = w && w->requires_grad ? dt__grad_acc(w) : NULL, *db = b && b->requires_grad ? dt__grad_acc(b) : NULL;
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->layernorm_backward(xv, wv, dy, stats, dx, dw, db, N, D);
    double *sum = !gpu && (dw || db) ? (double *)dt_step_alloc(sizeof(double) * 2 * (size_t)D) : NULL;
    for (int i0 = 0, chunk = dt__norm_chunk(D), i1; !gpu && i0 < N; i0 = i1) {
        i1 = N - i0 < chunk ? N : i0 + chunk;
        DT_OMP("omp parallel for if(dx && (int64_t)(i1 - i0) * D > 32768)")
        for (int i = i0; i < (dx ? i1 : i0); i++) {                 /* no dx: straight to the sums */
            const float *xr = xv + (size_t)i * D, *dyr = dy + (size_t)i * D;
            float mean = stats[i], rstd = stats[N + i];
            float acc_g[DT_LANES] = { 0 }, acc_gx[DT_LANES] = { 0 };  /* g = dy * w, the gradient of x-hat */
            if (wv) {
                DT__LANE_SUM(acc_g, D, j, dyr[j] * wv[j]);
                DT__LANE_SUM(acc_gx, D, j, dyr[j] * wv[j] * ((xr[j] - mean) * rstd));
            } else {
                DT__LANE_SUM(acc_g, D, j, dyr[j]);
                DT__LANE_SUM(acc_gx, D, j, dyr[j] * ((xr[j] - mean) * rstd));
            }
            float mg = dt__lanes_total(acc_g) / D, mgx = dt__lanes_total(acc_gx) / D;
            float *dxr = dx + (size_t)i * D;
            for (int j = 0; j < D; j++) {
                float g = dyr[j] * (wv ? wv[j] : 1.0f), xhat = (xr[j] - mean) * rstd;
                float d = rstd * (g - mg - xhat * mgx);
                dxr[j] = first ? d : dxr[j] + d;
            }
        }
        if (sum) dt__norm_weight_sums(xv, dy, stats, N, i0, i1, D, sum);
    }
    for (int j = 0; sum && j < D; j++) {
        if (dw) dw[j] += (float)sum[j];
        if (db) db[j] += (float)sum[D + j];
    }
    if (dx) dt__grad_acc_done(x, dx);
    if (dw) dt__grad_acc_done(w, dw);
    if (db) dt__grad_acc_done(b, db);
}
/* Under mixed precision the statistics are computed in f32 from the 16-bit
   input, and the normalised output is stored in 16 bits. */
dt_tensor *dt_layernorm(dt_tensor *x, dt_tensor *weight, dt_tensor *bias, float eps) {
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    float *stats = (float *)dt__step_data(sizeof(float) * 2 * (size_t)N);
    const float *xv = dt__in(x), *wv = weight ? dt__in(weight) : NULL, *bv = bias ? dt__in(bias) : NULL;
    float *yv = dt__out(y);
    if (gpu) gpu->layernorm_forward(xv, wv, bv, yv, stats, N, D, eps);
    else {
        DT_OMP("omp parallel for if(N * D > 32768)")
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D;
            float *yr = yv + (size_t)i * D;
            float acc_x[DT_LANES] = { 0 }, acc_d2[DT_LANES] = { 0 };
            DT__LANE_SUM(acc_x, D, j, xr[j]);
            float mean = dt__lanes_total(acc_x) / D;
            DT__LANE_SUM(acc_d2, D, j, (xr[j] - mean) * (xr[j] - mean));
            float rstd = 1.0f / sqrtf(dt__lanes_total(acc_d2) / D + eps);   /* biased variance, as PyTorch */
            for (int j = 0; j < D; j++)
                yr[j] = (xr[j] - mean) * rstd * (wv ? wv[j] : 1.0f) + (bv ? bv[j] : 0.0f);
            stats[i] = mean;
            stats[N + i] = rstd;
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, weight, bias)) dt__tape_push(dt__layernorm_backward, y, x, weight, bias)->saved = stats;
    return y;
}

/* -- RMSNorm (Llama's): LayerNorm without taking out the mean and without a
      bias, y = x / sqrt(mean(x^2) + eps) * w. It saves 1/rms per row, after a
      row of zeros where LayerNorm keeps its means: x-hat = (x - 0) / rms, so
      the weight's gradient is LayerNorm's, the same code. -- */
static void dt__rmsnorm_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *w = e->in[1], *y = e->out;
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    const float *stats = (const float *)e->saved;      /* zeros[N], rstd[N] */
    const float *dy = dt__grad_in(y), *xv = dt__in(x), *wv = dt__in(w);
    float *dx = x->requires_grad ? dt__grad_acc(x) : NULL, *dw = w->requires_grad ? dt__grad_acc(w) : NULL;
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->rmsnorm_backward(xv, wv, dy, stats, dx, dw, N, D);
    double *sum = !gpu && dw ? (double *)dt_step_alloc(sizeof(double) * 2 * (size_t)D) : NULL;
    for (int i0 = 0, chunk = dt__norm_chunk(D), i1; !gpu && i0 < N; i0 = i1) {   /* in chunks, as LayerNorm */
        i1 = N - i0 < chunk ? N : i0 + chunk;
        /* dx = rstd (g - x-hat mean(g x-hat)), g = dy w */
        DT_OMP("omp parallel for if(dx && (int64_t)(i1 - i0) * D > 32768)")
        for (int i = i0; i < (dx ? i1 : i0); i++) {
            const float *xr = xv + (size_t)i * D, *dyr = dy + (size_t)i * D;
            float rstd = stats[N + i], acc_gx[DT_LANES] = { 0 };
            DT__LANE_SUM(acc_gx, D, j, dyr[j] * wv[j] * (xr[j] * rstd));
            float mgx = dt__lanes_total(acc_gx) / D, *dxr = dx + (size_t)i * D;
            for (int j = 0; j < D; j++) dxr[j] += rstd * (dyr[j] * wv[j] - (xr[j] * rstd) * mgx);
        }
        if (sum) dt__norm_weight_sums(xv, dy, stats, N, i0, i1, D, sum);
    }
    for (int j = 0; sum && j < D; j++) dw[j] += (float)sum[j];
    if (dx) dt__grad_acc_done(x, dx);
    if (dw) dt__grad_acc_done(w, dw);
}
dt_tensor *dt_rmsnorm(dt_tensor *x, dt_tensor *weight, float eps) {
    int N = (int)dt_tensor_rows(x), D = (int)dt_tensor_cols(x);
    if (weight->numel != D) dt_fail("rmsnorm: rows of %d need a weight of %d, %s has %lld", D, D,
                                    weight->name ? weight->name : "the weight", (long long)weight->numel);
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    float *stats = (float *)dt__step_data(sizeof(float) * 2 * (size_t)N);
    const float *xv = dt__in(x), *wv = dt__in(weight);
    float *yv = dt__out(y);
    if (gpu) gpu->rmsnorm_forward(xv, wv, yv, stats, N, D, eps);
    else {
        DT_OMP("omp parallel for if(N * D > 32768)")
        for (int i = 0; i < N; i++) {
            const float *xr = xv + (size_t)i * D;
            float *yr = yv + (size_t)i * D, acc[DT_LANES] = { 0 };
            DT__LANE_SUM(acc, D, j, xr[j] * xr[j]);
            float rstd = 1.0f / sqrtf(dt__lanes_total(acc) / D + eps);
            for (int j = 0; j < D; j++) yr[j] = (xr[j] * rstd) * wv[j];   /* Hugging Face's order: normalise, then scale */
            stats[i] = 0.0f;
            stats[N + i] = rstd;
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, weight, NULL)) dt__tape_push(dt__rmsnorm_backward, y, x, weight, NULL)->saved = stats;
    return y;
}

/* -- SwiGLU (Llama's MLP): silu(gate) * up, element by element; gate and up
      are two linear layers of the same input. -- */
static void dt__swiglu_backward(dt__tape_entry *e) {
    dt_tensor *gate = e->in[0], *up = e->in[1];
    const float *dy = dt__grad_in(e->out), *gv = dt__in(gate), *uv = dt__in(up);
    float *dg = gate->requires_grad ? dt__grad_acc(gate) : NULL, *du = up->requires_grad ? dt__grad_acc(up) : NULL;
    int64_t n = gate->numel;
    const dt_backend *gpu = dt__backend_for(gate);
    if (gpu) gpu->swiglu_backward(gv, uv, dy, dg, du, n);
    else {
        if (dg) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) dg[i] += dy[i] * uv[i] * dt_silu_derivative(gv[i]);
        }
        if (du) {
            DT_OMP("omp parallel for if(n > 65536)")
            for (int64_t i = 0; i < n; i++) du[i] += dy[i] * dt_silu_value(gv[i]);
        }
    }
    if (dg) dt__grad_acc_done(gate, dg);
    if (du) dt__grad_acc_done(up, du);
}
dt_tensor *dt_swiglu(dt_tensor *gate, dt_tensor *up) {
    if (gate->numel != up->numel) dt_fail("swiglu: gate has %lld elements, up %lld", (long long)gate->numel, (long long)up->numel);
    const dt_backend *gpu = dt__backend_for(gate);
    dt__backend_for(up);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(gate->ndim, gate->shape);
    const float *gv = dt__in(gate), *uv = dt__in(up);
    float *yv = dt__out(y);
    int64_t n = gate->numel;
    if (gpu) gpu->swiglu_forward(gv, uv, yv, n);
    else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) yv[i] = dt_silu_value(gv[i]) * uv[i];
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(gate, up, NULL)) dt__tape_push(dt__swiglu_backward, y, gate, up, NULL);
    return y;
}

/* -- SwiGLU and the linear layer after it, in one op. The activation
      silu(gate) * up is as wide as gate and up (4,864 columns in Qwen2-0.5B,
      5.4x the model's width), and backward needs it only for the weight's
      gradient, dW = dy^T s; gate and up, which its own backward needs, are
      kept anyway. So the op makes s in the scratch arena, multiplies and
      forgets it, and makes it again in backward: a pass over gate and up
      instead of a third tensor of that width for every layer (Qwen2-0.5B at
      9 x 128 tokens: 538 MB). The same arithmetic in the same order as the
      two ops, so the same bits (a test holds them to it). On the CPU in f32;
      elsewhere, and with dt__swiglu_apart (tests), it is the two ops. -- */
static int dt__swiglu_apart;
static void dt__swiglu_rows(const float *gv, const float *uv, float *s, int64_t n) {
    DT_OMP("omp parallel for if(n > 65536)")
    for (int64_t i = 0; i < n; i++) s[i] = dt_silu_value(gv[i]) * uv[i];
}
static void dt__swiglu_linear_backward(dt__tape_entry *e) {
    dt_tensor *gate = e->in[0], *up = e->in[1], *w = e->in[2], *y = e->out;
    int N = (int)dt_tensor_rows(gate), in = (int)dt_tensor_cols(gate), out = (int)dt_tensor_cols(y);
    int64_t n = gate->numel;
    const float *gv = gate->data, *uv = up->data, *dy = y->grad;
    float *s = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)n);
    dt__swiglu_rows(gv, uv, s, n);
    if (w->requires_grad) {              /* dW = dy^T s */
        float *dw = dt__grad_acc(w);
        dt_gemm(1, 0, out, in, N, 1.0f, dy, out, s, in, 1.0f, dw, in);
        dt__grad_acc_done(w, dw);
        dt__ctx.flops += 2.0 * N * in * out;
    }
    float *dg = gate->requires_grad ? dt__grad_acc(gate) : NULL, *du = up->requires_grad ? dt__grad_acc(up) : NULL;
    if (!dg && !du) return;
    float *ds = s;                       /* ds = dy W, over s: dW has read it */
    dt_gemm(0, 0, N, in, out, 1.0f, dy, out, w->data, in, 0.0f, ds, in);
    dt__ctx.flops += 2.0 * N * in * out;
    if (dg) {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) dg[i] += ds[i] * uv[i] * dt_silu_derivative(gv[i]);
        dt__grad_acc_done(gate, dg);
    }
    if (du) {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) du[i] += ds[i] * dt_silu_value(gv[i]);
        dt__grad_acc_done(up, du);
    }
}
dt_tensor *dt_swiglu_linear(dt_tensor *gate, dt_tensor *up, dt_tensor *weight) {
    if (dt__swiglu_apart || dt__mixed() || dt__backend_of(gate->device) || gate->dtype != DT_F32 || up->dtype != DT_F32)
        return dt_linear(dt_swiglu(gate, up), weight, NULL);
    if (gate->numel != up->numel) dt_fail("swiglu: gate has %lld elements, up %lld", (long long)gate->numel, (long long)up->numel);
    int N = (int)dt_tensor_rows(gate), in = (int)dt_tensor_cols(gate), out = (int)dt_tensor_rows(weight);
    if ((int)dt_tensor_cols(weight) != in)
        dt_fail("linear %s: input has %d features, weight expects %d", weight->name ? weight->name : "", in, (int)dt_tensor_cols(weight));
    dt__backend_for(weight);
    dt__scratch_reset();
    float *s = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)gate->numel);
    dt__swiglu_rows(gate->data, up->data, s, gate->numel);
    dt_tensor *y = dt__tensor_out_2d(N, out);
    dt_gemm(0, 1, N, out, in, 1.0f, s, in, weight->data, in, 0.0f, y->data, out);
    dt__ctx.flops += 2.0 * N * in * out;
    if (dt__wants_grad(gate, up, weight)) dt__tape_push(dt__swiglu_linear_backward, y, gate, up, weight);
    return y;
}

/* -- residual addition: each input's gradient is the output's, added in
      (the first time, copied); tensor parallelism's ops (its chapter) add the same way -- */
static void dt__add_into_grad(dt_tensor *t, const float *v) {
    int first;
    float *g = dt__grad_acc_first(t, &first);
    const dt_backend *gpu = dt__backend_for(t);
    int64_t n = t->numel;
    if (gpu) gpu->accumulate(g, v, n);
    else if (first) {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] = v[i];
    } else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] += v[i];
    }
    dt__grad_acc_done(t, g);
}
/* A sum written over its branch (dt_residual_add) hands its gradient to the
   branch instead of copying it, when the branch's is not begun: no op after
   the sum read the branch (its values are gone), and no one reads the sum's
   gradient once this entry is done. A [tokens, width] tensor less a block. */
static void dt__add_backward(dt__tape_entry *e) {
    dt_tensor *y = e->out, *b = e->in[1];
    const float *dy = dt__grad_in(y);
    if (e->in[0]->requires_grad) dt__add_into_grad(e->in[0], dy);
    if (b->requires_grad && b->data && b->data == y->data && !b->grad && !b->is_param &&
        dt__grad_dtype(b) == dt__grad_dtype(y) && !dt__backend_of(b->device))
        b->grad = y->grad;                                   /* in its dtype, f32 or 16-bit */
    else if (b->requires_grad) dt__add_into_grad(b, dy);
}
static dt_tensor *dt__add_over(dt_tensor *a, dt_tensor *b, int over_b);
dt_tensor *dt_add(dt_tensor *a, dt_tensor *b) { return dt__add_over(a, b, 0); }
static int dt__residual_apart;                  /* tests: always a new tensor */
dt_tensor *dt_residual_add(dt_tensor *x, dt_tensor *branch) {
    int over = !dt__residual_apart && !branch->is_param && branch->dtype == dt__ctx.compute_dtype && branch->ndim == x->ndim &&
               !memcmp(branch->shape, x->shape, sizeof(int) * (size_t)x->ndim);
    if (over && dt__ctx.grad_enabled && branch->requires_grad) {      /* the op that made it, at the tape's end */
        const dt__tape_entry *e = dt__ctx.tape_len ? &dt__ctx.tape[dt__ctx.tape_len - 1] : NULL;
        dt__backward_fn made = e && e->out == branch ? e->backward : NULL;
        over = made == dt__linear_backward || made == dt__swiglu_linear_backward || made == dt__add_backward;
    }
    return dt__add_over(x, branch, over);
}
/* over_b: the sum is written over b, whose values no one reads again */
static dt_tensor *dt__add_over(dt_tensor *a, dt_tensor *b, int over_b) {
    if (a->numel != b->numel) dt_fail("add: %lld and %lld elements", (long long)a->numel, (long long)b->numel);
    const dt_backend *gpu = dt__backend_for(a);
    dt__backend_for(b);
    dt__scratch_reset();
    dt_tensor *y;
    if (over_b) {
        y = (dt_tensor *)dt_step_alloc(sizeof *y);
        *y = *b;
        y->grad = NULL; y->requires_grad = 0; y->name = NULL; y->parallel = NULL;
    } else y = dt__tensor_out(a->ndim, a->shape);
    const float *av = dt__in(a), *bv = dt__in(b);
    float *yv = dt__out(y);
    int64_t n = a->numel;
    if (gpu) gpu->add(av, bv, yv, n);
    else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) yv[i] = av[i] + bv[i];
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(a, b, NULL)) dt__tape_push(dt__add_backward, y, a, b, NULL);
    return y;
}

/* -- a constant factor (LoRA's alpha / rank): y = c x, dx += c dy -- */
static void dt__scale_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    float c = e->farg[0];
    int first;
    float *g = dt__grad_acc_first(x, &first);
    const float *dy = dt__grad_in(e->out);
    const dt_backend *gpu = dt__backend_for(x);
    int64_t n = x->numel;
    if (gpu) {
        float *scaled = (float *)dt__scratch_on(x->device, (size_t)n * sizeof(float));
        dt_convert(dy, DT_F32, scaled, DT_F32, n);
        gpu->scale(scaled, c, n);
        gpu->accumulate(g, scaled, n);
    } else if (first) {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] = c * dy[i];
    } else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) g[i] += c * dy[i];
    }
    dt__grad_acc_done(x, g);
}
dt_tensor *dt_scale(dt_tensor *x, float factor) {
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    const float *xv = dt__in(x);
    float *yv = dt__out(y);
    int64_t n = x->numel;
    if (gpu) {
        dt_convert(xv, DT_F32, yv, DT_F32, n);
        gpu->scale(yv, factor, n);
    } else {
        DT_OMP("omp parallel for if(n > 65536)")
        for (int64_t i = 0; i < n; i++) yv[i] = factor * xv[i];
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__scale_backward, y, x, NULL, NULL)->farg[0] = factor;
    return y;
}
