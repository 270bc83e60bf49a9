//@ lesson: context parallelism -- ring attention, the zig-zag layout
/* Context parallelism (stage 08) splits every sequence along its length: each
   of C ranks holds T/C of its tokens. Everything in a transformer but
   attention works on each token alone, so it runs on a rank's tokens as it
   would on the whole sequence (at the tokens' true positions). Attention needs
   every key: the keys and values go around a ring of the C ranks (ring
   attention, Liu et al., 2023). In C steps each rank attends its queries to
   the block of keys it holds while the next block is on its way
   (dt_ring_shift_async), and merges the partial results by the online softmax
   -- what FlashAttention does between blocks of keys on one device
   (dt_online_softmax_rescale), done here between ranks. The result is exact:
   the rows of whole-sequence attention, within rounding. Backward sends the
   keys and values around again, each block's gradient sum travelling one
   step behind it until it reaches the rank that owns it.

   The ops that depend on where a token sits -- learned position embeddings,
   rotary angles, attention -- read a thread's sequence split
   (dt_set_sequence_split, the attention chapter): its tokens' positions and
   the ring. So a model runs unchanged on a rank's share of each sequence.

   A causal model's late tokens attend to more keys than its early ones, so
   cutting a sequence into C contiguous pieces gives the last rank about
   2C - 1 times the first's work. The zig-zag layout cuts it into 2C chunks and
   gives rank r chunks r and 2C - 1 - r, an early one and a late one: the same
   work on every rank (dt_ring_attention_scores counts it). */
typedef enum { DT_CP_ZIGZAG = 0, DT_CP_CONTIGUOUS = 1 } dt_cp_layout;
/* The positions, in a sequence of T tokens, of the T / C tokens that rank
   `rank` of C holds, in the order it holds them (ascending). T must be a
   multiple of 2C (zig-zag) or of C (contiguous); otherwise an error. */
void dt_cp_positions(dt_cp_layout layout, int T, int C, int rank, int32_t *positions);
/* dt_attention of a sequence split along its length over the ranks of
   `ring`: qkv [B*T, 3*D] holds this rank's T tokens of each of B sequences,
   at the places `positions` (T of them, ascending, the same for every
   sequence; a causal query sees the keys at its place and before). Out:
   [B*T, D], the rows of whole-sequence attention for this rank's tokens. A
   collective of the ring, forward and backward; on the CPU or a GPU (whose
   kernels, heads of at most DT_ATTENTION_ONLINE_MAX_HEAD_DIM, have not run yet). */
dt_tensor *dt_ring_attention(dt_tensor *qkv, int B, int T, int H, int causal, const int32_t *positions, dt_comm *ring);
/* Query-key score products the ring attention made on this thread so far,
   forward and backward: a rank's attention work, counted, not timed (by the
   CPU's bodies: the GPU's kernels do not count). */
int64_t dt_ring_attention_scores(void);

/* The wrapper (stage 08): a job of N ranks is N/C data-parallel groups of C
   ranks ("dp" x "cp", cp varying fastest); the ranks of a group read the same
   batch and each keeps its tokens of every sequence (dt_cp_split_batch).
   cp 0: the whole job is one group. A language model (gpt, llama) whose
   context cuts into the layout's chunks. It cuts no weight: every
   rank holds the whole model and, after backward, a part of every gradient
   (its tokens'), so a data-parallel engine must wrap it over every rank of the
   job (dt_cp_data_group) -- the mean of the ranks' gradients is the
   gradient of the mean loss over all the tokens of all the groups' batches.
   Evaluation splits its sequences around the ring too. */
typedef struct dt_cp dt_cp;
dt_cp *dt_cp_create(dt_model *model, dt_comm *comm, int cp, dt_cp_layout layout);
/* Keep this rank's tokens of the batch's sequences: inputs [B, T] become
   [B, T/C], the labels likewise (in the step arena). */
void dt_cp_split_batch(dt_cp *cp, dt_batch *batch);
/* Every rank of the job: what the data-parallel engine around averages over. */
dt_comm *dt_cp_data_group(const dt_cp *cp);
/* This rank's group among the data-parallel groups, and how many there are:
   the loader's rank and world (every rank of a group reads the same batch). */
int dt_cp_data_rank(const dt_cp *cp);
int dt_cp_data_ranks(const dt_cp *cp);
void dt_cp_free(dt_cp *cp);

//@ implementation
void dt_cp_positions(dt_cp_layout layout, int T, int C, int rank, int32_t *positions) {
    if (C < 1 || rank < 0 || rank >= C) dt_fail("dt_cp_positions: rank %d of %d", rank, C);
    int chunks = layout == DT_CP_ZIGZAG ? 2 * C : C, n = T / chunks, k = 0;
    if (T % chunks)
        dt_fail("context parallelism: a sequence of %d tokens does not cut into %d equal chunks (%d ranks, %s layout)", T,
                chunks, C, layout == DT_CP_ZIGZAG ? "zig-zag" : "contiguous");
    for (int j = 0; j < n; j++) positions[k++] = rank * n + j;
    if (layout == DT_CP_ZIGZAG)
        for (int j = 0; j < n; j++) positions[k++] = (2 * C - 1 - rank) * n + j;
}

static DT_THREAD_LOCAL int64_t dt__ring_scores;
int64_t dt_ring_attention_scores(void) { return dt__ring_scores; }
/* Training's time waiting for the ring on this thread, since the wrapper's
   last step (its step_done takes it): what the cost model takes out of the
   measured compute. On a GPU a wait only queues the wait on the device's
   stream, so this is the host's part alone (about 0). */
static DT_THREAD_LOCAL double dt__ring_wait_ms;
static void dt__ring_wait(dt_comm *ring, dt_comm_handle h) {
    double t0 = dt_now_ms();
    dt_comm_wait(ring, h);
    if (dt__ctx.grad_enabled) dt__ring_wait_ms += dt_now_ms() - t0;      /* training's: evaluation goes around too */
}

/* What travels the ring: a rank's block, its T positions (as floats: exact
   below 2^24) then its keys and values, [B*T, D] each (in backward, each
   block's gradient sum too, apart, a step behind it). All of it on the
   device that holds qkv. */
typedef struct dt__ring {
    dt_comm *comm;
    int B, T, H, D, causal;
    float scale, *qpos, *lse, *O;   /* on the device: this rank's positions, each row's log-sum-exp [B*H*T], output [B*T, D] */
} dt__ring;

/* The CPU's bodies of the backend table's ring entries (ring_attention_step,
   ring_attention_backward_step, copy_columns: the backend-tables chapter
   says what each does), with the same parameters. A step is this rank's
   queries against the block it holds, through the online body
   (dt__online_forward, the attention chapter's) at the tokens' true
   positions, each row's (m, l) and output carried from block to block: the
   same loops as one device's; the ring only brings the keys. */
static void dt__ring_attention_step(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O,
                                    float *out, int first, int B, int T, int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    int64_t rows = (int64_t)B * H * T, BTD = (int64_t)B * T * D, work = 0;
    const float *K = blk + T, *V = K + BTD;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)hd * Tp * (size_t)dt_threads());
    for (int64_t i = 0; i < rows && first; i++) { lse[i] = -INFINITY; l[i] = 0; }   /* lse holds m until the last block */
    if (first) memset(O, 0, sizeof(float) * (size_t)BTD);
    DT_OMP("omp parallel for schedule(static) reduction(+:work) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        size_t at = (size_t)b * T * D + h * hd;          /* this head's rows in [B*T, D] arrays (+ i * D) */
        float *kt = space + (size_t)hd * Tp * (size_t)dt__thread_num();
        dt__online_head a = { qkv + (size_t)b * T * 3 * D + h * hd, kt, NULL, NULL, V + at, qpos, blk, 3 * D, D,
                              T, T, Tp, hd, causal, scale };
        dt__att_transpose(K + at, D, T, hd, kt, Tp);
        work += dt__online_forward(&a, lse + (size_t)bh * T, l + (size_t)bh * T, O + at, D);
        if (out) dt__online_finish(T, hd, lse + (size_t)bh * T, l + (size_t)bh * T, O + at, D, out + at, D);
    }
    dt__ring_scores += work;
}
/* Backward against the block held (dt__online_backward): dQ into this
   rank's rows, dK and dV into dkv, this rank's share of the block's. */
static void dt__ring_attention_backward_step(const float *qkv, const float *blk, const float *qpos, const float *lse,
                                             const float *O, const float *dout, float *dots, float *dqkv, float *dkv, int B, int T,
                                             int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    int64_t BTD = (int64_t)B * T * D, work = 0;
    const float *K = blk + T, *V = K + BTD;
    float *dK = dkv, *dV = dkv + BTD;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)hd * Tp * (size_t)dt_threads());
    (void)dots;                                          /* the GPU's scratch: here each tile of rows makes its own */
    DT_OMP("omp parallel for schedule(static) reduction(+:work) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {                 /* a head's columns: no two threads write the same */
        int b = bh / H, h = bh % H;
        size_t at = (size_t)b * T * D + h * hd;
        float *kt = space + 2 * (size_t)hd * Tp * (size_t)dt__thread_num();
        dt__online_head a = { qkv + (size_t)b * T * 3 * D + h * hd, kt, kt + (size_t)hd * Tp, K + at, V + at, qpos, blk,
                              3 * D, D, T, T, Tp, hd, causal, scale };
        dt__att_transpose(K + at, D, T, hd, kt, Tp);
        dt__att_transpose(V + at, D, T, hd, kt + (size_t)hd * Tp, Tp);
        work += dt__online_backward(&a, dout + at, O + at, D, lse + (size_t)bh * T, dqkv + (size_t)b * T * 3 * D + h * hd,
                                    dK + at, dV + at);
    }
    dt__ring_scores += work;
}
static void dt__copy_columns(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add) {
    for (int64_t i = 0; i < rows; i++)
        if (!add) memcpy(dst + i * ld_dst, src + i * ld_src, sizeof(float) * (size_t)cols);
        else for (int c = 0; c < cols; c++) dst[i * ld_dst + c] += src[i * ld_src + c];
}
/* The ring's bodies on the device of its tensors: the GPU's table's, or the CPU's above. */
typedef struct dt__ring_bodies {
    void (*step)(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O, float *out, int first,
                 int B, int T, int H, int D, float scale, int causal);
    void (*backward_step)(const float *qkv, const float *blk, const float *qpos, const float *lse, const float *O,
                          const float *dout, float *dots, float *dqkv, float *dkv, int B, int T, int H, int D, float scale,
                          int causal);
    void (*copy_columns)(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add);
} dt__ring_bodies;
static dt__ring_bodies dt__ring_bodies_on(dt_device device) {
    const dt_backend *gpu = dt__backend_of(device);
    if (gpu) return (dt__ring_bodies){ gpu->ring_attention_step, gpu->ring_attention_backward_step, gpu->copy_columns };
    return (dt__ring_bodies){ dt__ring_attention_step, dt__ring_attention_backward_step, dt__copy_columns };
}
/* A rank's block: its positions, then its keys and values out of qkv. */
static void dt__ring_pack(const dt__ring *r, const dt__ring_bodies *f, const float *qkvv, float *blk) {
    int64_t BT = (int64_t)r->B * r->T, D = r->D;
    f->copy_columns(blk, r->T, r->qpos, r->T, 1, r->T, 0);
    f->copy_columns(blk + r->T, D, qkvv + D, 3 * D, BT, r->D, 0);
    f->copy_columns(blk + r->T + BT * D, D, qkvv + 2 * D, 3 * D, BT, r->D, 0);
}

/* Backward goes around the ring again, and each block's dK and dV are summed
   over the ranks its queries sit on. The keys and values travel as in
   forward, sent on while the block is used; each block's gradients travel
   one step behind it: a rank adds its share into the sum that comes from
   the rank before (which made it while this rank computed) and sends it on,
   so that transfer too overlaps the next step's compute. After C steps the
   sum of each block reaches the rank that owns it. */
static void dt__ring_attention_backward(dt__tape_entry *e) {
    dt_tensor *qkv = e->in[0];
    if (!qkv->requires_grad) return;
    const dt__ring *r = (const dt__ring *)e->saved;
    int B = r->B, T = r->T, H = r->H, D = r->D, C = dt_comm_size(r->comm), first;
    int64_t BTD = (int64_t)B * T * D, nkv = T + 2 * BTD;
    dt__ring_bodies f = dt__ring_bodies_on(qkv->device);
    const float *qkvv = dt__in(qkv), *dout = dt__grad_in(e->out);
    float *dqkv = dt__grad_acc_first(qkv, &first);
    if (first) dt__zero_on(qkv->device, dqkv, sizeof(float) * (size_t)qkv->numel);
    float *dots = (float *)dt__scratch_on(qkv->device, sizeof(float) * (size_t)B * H * T);
    float *kv[2] = { (float *)dt__scratch_on(qkv->device, sizeof(float) * 2 * (size_t)nkv) };
    float *g[2] = { (float *)dt__scratch_on(qkv->device, sizeof(float) * 6 * (size_t)BTD) };   /* two sums, a share */
    float *share = g[0] + 4 * BTD;
    kv[1] = kv[0] + nkv;
    g[1] = g[0] + 2 * BTD;
    dt__ring_pack(r, &f, qkvv, kv[0]);
    dt_comm_handle next = 0, sum = 0;
    for (int s = 0; s < C; s++) {                         /* holding the block of the rank s before this one */
        if (s < C - 1) next = dt_ring_shift_async(r->comm, kv[s & 1], kv[(s + 1) & 1], nkv, DT_F32);
        float *mine = s == 0 ? g[0] : share;              /* the owner's share starts the block's sum */
        dt__zero_on(qkv->device, mine, sizeof(float) * 2 * (size_t)BTD);
        f.backward_step(qkvv, kv[s & 1], r->qpos, r->lse, r->O, dout, dots, dqkv, mine, B, T, H, D, r->scale, r->causal);
        if (s > 0) {                                      /* the sum so far, from the rank before, plus this rank's share */
            dt__ring_wait(r->comm, sum);
            f.copy_columns(g[s & 1], D, share, D, 2 * (int64_t)B * T, D, 1);
        }
        if (C > 1) sum = dt_ring_shift_async(r->comm, g[s & 1], g[(s + 1) & 1], 2 * BTD, DT_F32);   /* the last: home */
        if (s < C - 1) dt__ring_wait(r->comm, next);
    }
    if (C > 1) dt__ring_wait(r->comm, sum);
    dt__ctx.flops += 8.0 * B * H * T * (double)T * C * (D / H);         /* as dt_attention's backward counts */
    const float *dK = g[C > 1 ? C & 1 : 0], *dV = dK + BTD;
    f.copy_columns(dqkv + D, 3 * D, dK, D, (int64_t)B * T, D, 1);
    f.copy_columns(dqkv + 2 * D, 3 * D, dV, D, (int64_t)B * T, D, 1);
    dt__grad_acc_done(qkv, dqkv);
}

dt_tensor *dt_ring_attention(dt_tensor *qkv, int B, int T, int H, int causal, const int32_t *positions, dt_comm *ring) {
    int D = (int)dt_tensor_cols(qkv) / 3, C = dt_comm_size(ring);
    if (dt_tensor_cols(qkv) != 3 * D || D % H != 0 || dt_tensor_rows(qkv) != (int64_t)B * T)
        dt_fail("ring attention: qkv is [%lld, %lld], expected [%d, 3*D] with D divisible by %d heads",
                (long long)dt_tensor_rows(qkv), (long long)dt_tensor_cols(qkv), B * T, H);
    if (dt__backend_for(qkv) && D / H > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_fail("ring attention on the GPU: heads of %d columns; its kernel takes at most %d", D / H,
                DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    for (int i = 1; i < T; i++)
        if (positions[i] <= positions[i - 1]) dt_fail("ring attention: positions must ascend (%d after %d)", positions[i], positions[i - 1]);
    int64_t BTD = (int64_t)B * T * D, nblk = T + 2 * BTD, rows = (int64_t)B * H * T;
    dt_device dev = qkv->device;
    dt__ring_bodies f = dt__ring_bodies_on(dev);
    dt__scratch_reset();
    dt__ring *r = (dt__ring *)dt__step_alloc_uninit(sizeof(dt__ring) + sizeof(float) * (size_t)T);
    float *host = (float *)(r + 1);                       /* the positions, as they travel */
    *r = (dt__ring){ ring, B, T, H, D, causal != 0, 1.0f / sqrtf((float)(D / H)), NULL, NULL, NULL };
    r->qpos = (float *)dt__step_alloc_on(dev, sizeof(float) * (size_t)(T + rows + BTD));
    r->lse = r->qpos + T;
    r->O = r->lse + rows;
    for (int i = 0; i < T; i++) host[i] = (float)positions[i];
    dt__upload_to(dev, r->qpos, host, sizeof(float) * (size_t)T);
    const float *qkvv = dt__in(qkv);
    float *l = (float *)dt__scratch_on(dev, sizeof(float) * (size_t)rows);
    float *blk[2] = { (float *)dt__scratch_on(dev, sizeof(float) * 2 * (size_t)nblk) };
    blk[1] = blk[0] + nblk;
    dt_tensor *out = dt__tensor_out_2d(B * T, D);
    float *outv = dt__out(out);
    dt__ring_pack(r, &f, qkvv, blk[0]);
    for (int s = 0; s < C; s++) {                         /* the next block travels while this one is used */
        dt_comm_handle next = s < C - 1 ? dt_ring_shift_async(ring, blk[s & 1], blk[(s + 1) & 1], nblk, DT_F32) : 0;
        f.step(qkvv, blk[s & 1], r->qpos, r->lse, l, r->O, s == C - 1 ? outv : NULL, s == 0, B, T, H, D, r->scale, r->causal);
        if (next) dt__ring_wait(ring, next);
    }
    dt__out_done(out, outv);
    dt__ctx.flops += 4.0 * B * H * T * (double)T * C * (D / H);         /* as dt_attention counts the whole square */
    if (dt__wants_grad(qkv, NULL, NULL)) dt__tape_push(dt__ring_attention_backward, out, qkv, NULL, NULL)->saved = r;
    return out;
}

/* -- the wrapper -- */
struct dt_cp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_cp */
    dt_model *model;
    dt_comm *comm;
    dt_mesh *mesh;
    dt_comm *ring;              /* the group's ranks ("cp"), around which attention goes */
    int size, rank, T;          /* C, this rank's place, the tokens of a sequence it keeps */
    int B;                      /* sequences in the last batch it split */
    double ring_ms, step_ring_ms;   /* waiting for the ring: this step's so far, the last step's */
    dt_cp_layout layout;
    int32_t *positions;         /* of those tokens, in the whole sequence */
};
/* This rank's tokens of each sequence of `inputs` [B, T] (in the step arena). */
static dt_tensor *dt__cp_tokens(const dt_cp *cp, const dt_tensor *inputs) {
    int B = inputs->shape[0], T = (int)dt_tensor_cols(inputs), t = cp->T, shape[2] = { B, t };
    float *all = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * T);
    float *mine = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * t);
    dt_tensor_to_host(inputs, all);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < t; i++) mine[b * t + i] = all[b * T + cp->positions[i]];
    return dt_tensor_from_host(2, shape, mine);
}
/* Training: a rank's tokens (dt_cp_split_batch's), attention around the
   ring. Evaluation (no gradients, whole sequences): each rank its tokens
   around the ring too, then the group's logits all-gathered into the whole
   sequences' rows, so that every rank scores every token, in 1/C of the
   activations. Generation's shorter windows run whole on every rank. */
static dt_tensor *dt__cp_forward(dt_parallel *par, dt_tensor *inputs) {
    dt_cp *cp = (dt_cp *)par;
    int n = dt_model_blocks(cp->model), B = inputs->shape[0], T = (int)dt_tensor_cols(inputs), C = cp->size, t = cp->T;
    if (dt__ctx.grad_enabled) {
        if (T != t)
            dt_fail("dt_model_forward under context parallelism: sequences of %d tokens, where this rank keeps %d of each "
                    "(give it dt_cp_split_batch's inputs)", T, t);
        return dt_model_forward_blocks(cp->model, inputs, NULL, 0, n);
    }
    if (T != t * C) {
        dt_set_sequence_split(NULL);
        dt_tensor *y = dt_model_forward_blocks(cp->model, inputs, NULL, 0, n);
        dt_sequence_split split = { cp->ring, cp->positions, t };
        dt_set_sequence_split(&split);
        return y;
    }
    dt_tensor *mine = dt_model_forward_blocks(cp->model, dt__cp_tokens(cp, inputs), NULL, 0, n);
    int64_t V = dt_tensor_cols(mine), each = (int64_t)B * t * V;
    float *all = (float *)dt__step_alloc_on(mine->device, sizeof(float) * (size_t)(each * C));
    int32_t *at = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)t);
    dt__ring_bodies f = dt__ring_bodies_on(mine->device);
    dt_all_gather(cp->ring, dt__in(mine), all, each, DT_F32);     /* as f32: under --dtype bf16 the head's are bf16 */
    dt_tensor *y = dt_tensor_2d(B * T, (int)V);
    for (int q = 0; q < C; q++) {             /* rank q's rows, a run of consecutive positions at a time */
        dt_cp_positions(cp->layout, T, C, q, at);
        for (int b = 0; b < B; b++)
            for (int i = 0, run; i < t; i += run) {
                for (run = 1; i + run < t && at[i + run] == at[i] + run; run++) {}
                f.copy_columns(y->data + ((size_t)b * T + at[i]) * V, V, all + q * each + ((size_t)b * t + i) * V, V, run, (int)V, 0);
            }
    }
    return y;
}
static void dt__cp_step_done(dt_parallel *par) {
    dt_cp *cp = (dt_cp *)par;
    cp->step_ring_ms = dt__ring_wait_ms;
    dt__ring_wait_ms = 0;
}
dt_cp *dt_cp_create(dt_model *model, dt_comm *comm, int cp, dt_cp_layout layout) {
    int world = dt_comm_size(comm), T = model->cfg.seq_len;
    char v[64];
    snprintf(v, sizeof v, "%d %d", cp, (int)layout);
    dt_comm_check_agree(comm, "--cp --cp-layout", v);
    if (cp <= 0) cp = world;
    if (world % cp)
        dt_usage_error("--cp %d does not divide the job's %d ranks (the ranks form groups of --cp, data parallel across them)",
                       cp, world);
    if (!dt_model_is_language(model->cfg.kind))
        dt_usage_error("--model %s: context parallelism splits sequences of tokens; it takes --model gpt or llama",
                       dt__model_kind_name(model->cfg.kind));
    if (model->device != DT_CPU && model->cfg.dim / model->cfg.heads > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_usage_error("--cp on a GPU: heads of %d columns (--dim %d / --heads %d); the ring's kernel takes at most %d",
                       model->cfg.dim / model->cfg.heads, model->cfg.dim, model->cfg.heads, DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    int chunks = layout == DT_CP_ZIGZAG ? 2 * cp : cp;
    if (T % chunks)
        dt_usage_error("--cp %d --cp-layout %s: --seq-len %d must be a multiple of %d (%s)", cp,
                       layout == DT_CP_ZIGZAG ? "zigzag" : "contiguous", T, chunks,
                       layout == DT_CP_ZIGZAG ? "2 x --cp chunks, two to a rank" : "a chunk to each rank");
    if (model->parallel) dt_fail("dt_cp_create: this model is already wrapped (%s); context parallelism goes first",
                                 model->parallel->create_fn);
    dt_cp *c = (dt_cp *)calloc(1, sizeof *c);
    if (!c || !(c->positions = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T / cp)))) dt_fail("out of memory (context parallelism)");
    c->par = (dt_parallel){ .create_fn = "dt_cp_create", .sync_fn = "dt_data_parallel_sync_grads", .free_fn = "dt_cp_free",
                            .forward = dt__cp_forward, .step_done = dt__cp_step_done, .grad_ranks = world };
    dt__comm_hold(comm, "dt_cp_free");
    c->model = model;
    c->comm = comm;
    int sizes[2] = { world / cp, cp };
    const char *names[2] = { "dp", "cp" };
    c->mesh = dt_mesh_create(comm, 2, sizes, names);
    c->ring = dt_mesh_comm(c->mesh, "cp");
    c->size = cp;
    c->rank = dt_mesh_coord(c->mesh, "cp");
    c->T = T / cp;
    c->layout = layout;
    c->par.data_rank = dt_mesh_coord(c->mesh, "dp");
    c->par.data_ranks = world / cp;
    dt_cp_positions(layout, T, cp, c->rank, c->positions);
    dt_model_set_parallel(model, &c->par);
    dt_sequence_split split = { c->ring, c->positions, c->T };
    dt_set_sequence_split(&split);
    return c;
}
void dt_cp_split_batch(dt_cp *cp, dt_batch *batch) {
    int B = batch->inputs->shape[0], T = (int)dt_tensor_cols(batch->inputs), t = cp->T;
    if (T != t * cp->size)
        dt_fail("dt_cp_split_batch: sequences of %d tokens, where the model's context is %d (split once)", T, t * cp->size);
    int32_t *labels = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)B * t);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < t; i++) labels[b * t + i] = batch->labels[b * T + cp->positions[i]];
    /* masked data: the run's divisor (its targets per data-parallel group)
       spread over the group's C ranks, whose mean the engine takes too */
    if (dt__ctx.loss_divisor.labels == batch->labels && dt__ctx.loss_divisor.step == dt__ctx.step_resets)
        dt_cross_entropy_set_divisor(labels, dt__ctx.loss_divisor.divisor / cp->size);
    batch->inputs = dt__cp_tokens(cp, batch->inputs);
    cp->B = B;
    batch->labels = labels;
}
dt_comm *dt_cp_data_group(const dt_cp *cp) { return cp->comm; }
int dt_cp_data_rank(const dt_cp *cp) { return cp->par.data_rank; }
int dt_cp_data_ranks(const dt_cp *cp) { return cp->par.data_ranks; }
void dt_cp_free(dt_cp *cp) {
    if (!cp) return;
    if (cp->model->parallel && cp->model->parallel != &cp->par)
        dt_fail("dt_cp_free: another wrapper still wraps the model; call %s first", cp->model->parallel->free_fn);
    dt_set_sequence_split(NULL);
    dt_model_set_parallel(cp->model, NULL);
    dt_mesh_free(cp->mesh);
    dt__comm_release(cp->comm);
    free(cp->positions);
    free(cp);
}

//@ for the machinery
/* ---- what the machinery asks of context parallelism (the run driver's
   dt_parallel_report) ----
   Every rank holds the whole model, so checkpoints and the memory table
   need nothing of it; the cost model and --bench learn its ring. */
/* A causal model's attention work of rank q, in query-key pairs: each of
   its tokens sees the keys at its position and before. */
static double dt__cp_attention_pairs(const dt_cp *cp, int q) {
    int32_t *at = (int32_t *)dt__step_alloc_uninit(sizeof(int32_t) * (size_t)cp->T);
    double pairs = 0;
    dt_cp_positions(cp->layout, cp->T * cp->size, cp->size, q, at);
    for (int i = 0; i < cp->T; i++) pairs += at[i] + 1.0;
    return pairs;
}
/* What the cost model needs of the ring, from the model's shape: attention's
   share of the compute, the keys and values a layer sends, the layers. */
static void dt__cp_ring_shape(const dt_cp *cp, dt_cost_input *in) {
    const dt_model *m = cp->model;
    int T = cp->T * cp->size;
    double square = 12.0 * m->cfg.depth * m->cfg.dim * T;    /* dt_model_flops_per_token's attention: the whole square */
    double attention = square * (T + 1.0) / (2.0 * T);       /* the causal half a token sees, on average */
    in->cp_attention_share = attention / (dt_model_flops_per_token(m) - square + attention);
    in->cp_kv_bytes = (double)cp->B * T * 2 * m->cfg.dim * 4;
    in->cp_layers = m->cfg.depth;
    in->cp_contiguous = cp->layout == DT_CP_CONTIGUOUS && cp->size > 1;
}
/* The cost model's view of the last step: the whole sequences' compute on
   one rank, from this rank's share of it (its tokens' per-token work, its
   attention pairs' share of attention) and the time it waited for the ring. */
static int dt__cp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_cp *cp = (const dt_cp *)par;
    int K = in->accum_steps > 0 ? in->accum_steps : 1, C = cp->size, T = cp->T * C;
    double mean = (double)T * (T + 1.0) / 2 / C, mine = dt__cp_attention_pairs(cp, cp->rank);
    in->kind = DT_PAR_CP;
    dt__cp_ring_shape(cp, in);
    double a = in->cp_attention_share, share = ((1 - a) + a * mine / mean) / C;   /* this rank's part of the work */
    in->compute_ms = fmax(0, in->compute_ms - cp->step_ring_ms / K) / share;
    in->dp_groups = cp->par.data_ranks;
    return C;
}
static void dt__cp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_cp *cp = (const dt_cp *)par;
    dt_cost_input in = { 0 };
    dt__cp_ring_shape(cp, &in);
    fprintf(out, " cp=%d cp_layout=%s cp_ring_ms=%.3f cp_attention_share=%.4f cp_kv_bytes=%.0f cp_layers=%d cp_contiguous=%d",
            cp->size, cp->layout == DT_CP_ZIGZAG ? "zigzag" : "contiguous", cp->step_ring_ms / accum_steps,
            in.cp_attention_share, in.cp_kv_bytes, in.cp_layers, in.cp_contiguous);
}
const dt_parallel_report dt__cp_report = {
    .create_fn = "dt_cp_create", .cost_input = dt__cp_cost_input, .bench_fields = dt__cp_bench_fields,
};
