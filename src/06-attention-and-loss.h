//@ lesson: the rest of the layers' ops -- attention (three bodies: matmuls, tiles, the online softmax), rotary embeddings, embeddings, the cross-entropy
/* ---- autograd: attention, embeddings, the loss ---- */

/* x [rows, cols] + bias [cols] on every row: a row-parallel layer's bias, added
   once, after the sum. */
dt_tensor *dt_add_bias(dt_tensor *x, dt_tensor *bias);

/* Llama's attention input: q [B*T, H*hd], k and v [B*T, KV*hd] -> qkv
   [B*T, 3*H*hd] as dt_attention reads it. q and k are rotated by their
   position (rotary embeddings, Hugging Face's rotate-half pairs j and
   j + hd/2, angle t / theta^(2j/hd)); each of the KV key/value heads serves
   H/KV query heads (grouped-query attention), so it is repeated that often.
   Llama 3 rescales the frequencies (rope_type "llama3"): those slower than
   original_context / low_freq are divided by factor, those faster than
   original_context / high_freq kept, the ones between blended. factor 0: none. */
typedef struct dt_rope { float theta, factor, low_freq, high_freq; int original_context; } dt_rope;
dt_tensor *dt_rotary_qkv(dt_tensor *q, dt_tensor *k, dt_tensor *v, int B, int T, int H, int KV, dt_rope rope);
/* qkv: [B*T, 3*D] laid out as timm's (q | k | v, the H heads side by side) -> [B*T, D] */
dt_tensor *dt_attention(dt_tensor *qkv, int B, int T, int H, int causal);
/* How attention computes on the CPU. DT_ATTENTION_MATMUL (the default): each
   head's T x T probabilities made by two matmuls and kept for backward.
   DT_ATTENTION_ONLINE: never stored -- FlashAttention's online softmax (Dao
   et al., 2022): a row's keys are visited in blocks, its running largest
   score and sum rescaling what came before, and only the row's log-sum-exp
   is kept; backward makes each probability again from it, and reads the
   output (so nothing may write over it before; a GPU and mixed precision keep
   it in f32 too). T x T floats a head become T; the same values within
   rounding. The recurrence is per-element arithmetic that GPU kernels share
   (dt_online_softmax_rescale: its row softmax and classifier too). (--attention) */
typedef enum { DT_ATTENTION_MATMUL = 0, DT_ATTENTION_ONLINE = 1 } dt_attention_body;
void dt_set_attention_body(dt_attention_body body);
/* Context parallelism (stage 08): this thread holds T tokens of each
   sequence, at `positions` (ascending) of the whole, and attention's keys go
   around `ring` (dt_ring_attention, the context-parallel chapter). The ops
   that depend on where a token sits read it: learned position embeddings
   (dt_token_embedding: wpe's rows at the positions), rotary angles
   (dt_rotary_qkv) and dt_attention. Set by the context-parallel wrapper
   for this thread; NULL (the default): every sequence is whole here. */
typedef struct dt_sequence_split { struct dt_comm *ring; const int32_t *positions; int T; } dt_sequence_split;
void dt_set_sequence_split(const dt_sequence_split *split);
/* One row of the online softmax: m, the largest score seen so far. A block
   of new scores whose largest is block_max moves m up to it; what the row
   summed before (exp(s - m_old) each) is to be multiplied by the factor
   returned, exp(m_old - m_new) (0 before any score). */
DT_HD static inline float dt_online_softmax_rescale(float *m, float block_max);
/* The fused classifier's gradient of one logit x of a row whose largest
   value is m and sum of exp(x - m) is l: (p - onehot) * scale, p its
   softmax, exp(x - m) / l, rounded once (dt_cross_entropy's backward, on
   any device; inv_l = 1 / l in double). */
DT_HD static inline float dt_cross_entropy_grad(float x, float m, double inv_l, float onehot, float scale);
/* token ids [B, T] (whole numbers held as f32) -> [B*T, D]: row (b, t) is
   wte[token] + wpe[t], the token's embedding plus its position's (wpe NULL:
   no position embedding, as in Llama, whose attention rotates by position) */
dt_tensor *dt_token_embedding(const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe);
/* patches [B*P, D] -> tokens [B*(P+1), D]: class token first, position embedding added */
dt_tensor *dt_vit_tokens(dt_tensor *patches, dt_tensor *cls, dt_tensor *pos, int B);
/* x [B*T, D] -> [B, D]: token `index` of each sequence */
dt_tensor *dt_select_token(dt_tensor *x, int B, int T, int index);
/* A label of DT_IGNORE_INDEX (-100, as in PyTorch and Hugging Face) adds
   nothing to the loss: an instruction's prompt, an example's padding. */
#define DT_IGNORE_INDEX (-100)
/* Mean cross-entropy of logits [B, C] against labels, over the labels that are
   not ignored; a 1-element tensor. A language model's logits [B*T, vocab]
   take a label per row: the next token. Logits whose vocabulary tensor
   parallelism split (stage 06) are scored with the group: a collective. */
dt_tensor *dt_cross_entropy(dt_tensor *logits, const int32_t *labels);
/* A language model's vocabulary head, logits = x w^T, that waits to be read
   when its logits would take at least the bytes dt_set_lazy_logits gave (the
   run driver gives DT_LAZY_LOGITS_BYTES; negative, the default: never):
   dt_cross_entropy then makes them a block of rows at a time, keeping two
   numbers a row, and backward makes each block again, so the [rows,
   vocabulary] matrix is never whole (Qwen2's 151,936 words at 9 x 128
   tokens: 700 MB) for a third matmul of the head (GPT-2 124M's step at 1,024
   tokens: 14% slower to save its 206 MB, hence the threshold). Any other
   reader (an op, dt_tensor_to_host, dt_tensor_item, dt_logits_to_host)
   makes them whole first; until then `data` is NULL, so code of one's own
   reads them through those, not through `data`. Read after the optimizer has moved w,
   they are an error. Below the threshold, without gradients, on a GPU, under
   mixed precision or in a model with a parallel wrapper: dt_linear(x, w, NULL). */
dt_tensor *dt_vocab_head(dt_tensor *x, dt_tensor *w);
void dt_set_lazy_logits(int64_t from_bytes);
#define DT_LAZY_LOGITS_BYTES ((int64_t)512 << 20)
/* A model's logits on the host, rows x the whole vocabulary (the columns of
   a vocabulary split by tensor parallelism gathered first: a collective). */
void dt_logits_to_host(const dt_tensor *logits, float *host);
/* Make dt_cross_entropy of these labels (this very array, until the step
   arena is reset) divide its sum by `divisor` instead of by the labels it
   counts. For masked data the run driver sets the targets that count in the
   whole step, over every rank and micro-batch, divided by ranks x
   micro-batches: DDP's mean of the gradients and accumulation's 1/K then make
   it the mean over the step's targets, so N ranks train exactly as one device
   with N times the batch however the prompts fall (each rank's own mean would
   weigh a short answer's tokens more). */
void dt_cross_entropy_set_divisor(const int32_t *labels, double divisor);
/* images [B, C, H, W] -> [B*(H/p)*(W/p), C*p*p], each row one patch in (c, y, x)
   order, so a conv with kernel = stride = p is a linear layer on these rows. */
dt_tensor *dt_patchify(const dt_tensor *images, int patch);

//@ implementation
/* -- a bias on every row: y = x + b; dx = dy, db = the sum of dy over rows
      in row order, as linear's backward sums it (so the same bits) -- */
static void dt__add_bias_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *b = e->in[1], *y = e->out;
    const float *dy = dt__grad_in(y);
    int N = (int)dt_tensor_rows(y), C = (int)dt_tensor_cols(y);
    if (x->requires_grad) dt__add_into_grad(x, dy);
    if (b->requires_grad) {
        float *db = dt__grad_acc(b);
        const dt_backend *gpu = dt__backend_for(b);
        if (gpu) gpu->sum_rows(dy, db, N, C);
        else
            for (int i = 0; i < N; i++)
                for (int j = 0; j < C; j++) db[j] += dy[(size_t)i * C + j];
        dt__grad_acc_done(b, db);
    }
}
dt_tensor *dt_add_bias(dt_tensor *x, dt_tensor *bias) {
    int N = (int)dt_tensor_rows(x), C = (int)dt_tensor_cols(x);
    if (bias->numel != C) dt_fail("add_bias: %s has %lld values for %d columns", bias->name ? bias->name : "the bias",
                                  (long long)bias->numel, C);
    const dt_backend *gpu = dt__backend_for(x);
    dt__backend_for(bias);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out(x->ndim, x->shape);
    float *yv = dt__out(y);
    const float *bv = dt__in(bias);
    dt_convert(dt__in(x), DT_F32, yv, DT_F32, x->numel);
    if (gpu) gpu->add_bias(yv, bv, N, C);
    else
        for (int i = 0; i < N; i++)
            for (int j = 0; j < C; j++) yv[(size_t)i * C + j] += bv[j];
    dt__out_done(y, yv);
    if (dt__wants_grad(x, bias, NULL)) dt__tape_push(dt__add_bias_backward, y, x, bias, NULL);
    return y;
}

/* -- multi-head self-attention: softmax(Q K^T / sqrt(d)) V per (sequence, head).
      On the CPU, Q, K and V are read in place from the qkv projection (row
      stride 3D), so no reshuffling copies are needed, and the heads run in
      parallel. A GPU wants the opposite: one big batched matmul over every
      (sequence, head), so its body first copies Q, K and V into head-major
      order (see DT_ATTENTION_SAVED_FLOATS). -- */

/* The largest of r[0..n), n > 0, in lanes (a running max is a chain too). */
static float dt__row_max(const float *r, int n) {
    float top[DT_LANES], mx = r[0];
    for (int l = 0; l < DT_LANES; l++) top[l] = r[0];
    int j0 = 0;
    for (; j0 + DT_LANES <= n; j0 += DT_LANES)
        for (int l = 0; l < DT_LANES; l++) top[l] = r[j0 + l] > top[l] ? r[j0 + l] : top[l];
    for (int j = j0; j < n; j++) mx = r[j] > mx ? r[j] : mx;
    for (int l = 0; l < DT_LANES; l++) mx = top[l] > mx ? top[l] : mx;
    return mx;
}
/* One row of the softmax, in lanes as LayerNorm's sums; a causal row sees
   only its first `valid` keys and is 0 after them. */
static void dt__softmax_row(float *r, int valid, int T) {
    float acc[DT_LANES] = { 0 }, mx = dt__row_max(r, valid);
    for (int j = 0; j < valid; j++) r[j] = dt_exp_value(r[j] - mx);
    DT__LANE_SUM(acc, valid, j, r[j]);
    float sum = dt__lanes_total(acc);
    for (int j = 0; j < valid; j++) r[j] /= sum;
    for (int j = valid; j < T; j++) r[j] = 0.0f;
}
/* Back through a softmax row: ds = p (dp - <dp, p>) scale. */
static void dt__softmax_row_backward(float *dr, const float *pr, int T, float scale) {
    float lanes[DT_LANES] = { 0 };
    DT__LANE_SUM(lanes, T, j, dr[j] * pr[j]);
    float dot = dt__lanes_total(lanes);
    for (int j = 0; j < T; j++) dr[j] = pr[j] * (dr[j] - dot) * scale;
}

/* Tests set this to run the straightforward body wherever the fast one would. */
static int dt__attention_by_gemm;
/* --attention: set once, before any thread computes (DataParallel's replicas read it too). */
static dt_attention_body dt__attention_body;
void dt_set_attention_body(dt_attention_body body) {
    if (body != DT_ATTENTION_MATMUL && body != DT_ATTENTION_ONLINE) dt_fail("dt_set_attention_body: body %d is not one dtrain knows", (int)body);
    dt__attention_body = body;
}
static DT_THREAD_LOCAL dt_sequence_split dt__seq_split;        /* ring NULL: whole sequences */
void dt_set_sequence_split(const dt_sequence_split *split) {
    dt_sequence_split none = { NULL, NULL, 0 };
    if (split && (!split->ring || !split->positions || split->T < 1))
        dt_fail("dt_set_sequence_split: a split needs its ring, its positions and its tokens a sequence (T %d)", split->T);
    dt__seq_split = split ? *split : none;
}

/* The straightforward body: per (sequence, head), two matmuls forward and four
   backward, each through dt_gemm. The fast body below gives the same bits;
   this one runs where it cannot (a head width that is not a whole number of
   vectors) and is what the tests hold the fast one to. */
static void dt__attention_forward_gemm(const float *qkvv, float *outv, float *P, int B, int T, int H, int D,
                                       float scale, int causal) {
    int hd = D / H;
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *p = P + (size_t)bh * T * T;
        dt_gemm(0, 1, T, T, hd, scale, q, 3 * D, k, 3 * D, 0.0f, p, T);   /* S = Q K^T / sqrt(d) */
        for (int i = 0; i < T; i++) dt__softmax_row(p + (size_t)i * T, causal ? i + 1 : T, T);
        dt_gemm(0, 0, T, hd, T, 1.0f, p, T, v, 3 * D, 0.0f, outv + (size_t)b * T * D + h * hd, D);   /* O = P V */
    }
}
static void dt__attention_backward_gemm(const float *qkvv, const float *P, const float *dout, float *dqkv, float add,
                                        int B, int T, int H, int D, float scale) {
    int hd = D / H;
    float *dP_all = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)B * H * T * T);
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *dq = dqkv + (size_t)b * T * 3 * D + h * hd, *dk = dq + D, *dv = dq + 2 * D;
        const float *p = P + (size_t)bh * T * T, *dO = dout + (size_t)b * T * D + h * hd;
        float *dp = dP_all + (size_t)bh * T * T;
        dt_gemm(0, 1, T, T, hd, 1.0f, dO, D, v, 3 * D, 0.0f, dp, T);    /* dP = dO V^T */
        dt_gemm(1, 0, T, hd, T, 1.0f, p, T, dO, D, add, dv, 3 * D);      /* dV += P^T dO */
        for (int i = 0; i < T; i++) dt__softmax_row_backward(dp + (size_t)i * T, p + (size_t)i * T, T, scale);
        dt_gemm(0, 0, T, hd, T, 1.0f, dp, T, k, 3 * D, add, dq, 3 * D);   /* dQ += dS K */
        dt_gemm(1, 0, T, hd, T, 1.0f, dp, T, q, 3 * D, add, dk, 3 * D);   /* dK += dS^T Q */
    }
}

/* The fast body. A head's matmuls are small (65 x 65 x 64 in vit-tiny), and
   through the general matmul a third of their time went to its fixed costs:
   packing, edge tiles (65 columns fill three 32-wide strips), a call per
   product. Here each (sequence, head) runs in tiles of DT__ATT_ROWS query
   rows: the tile's scores are made, softmaxed and multiplied into V while
   they are in the cache, with one register-blocked loop (dt__att_tile, in
   the matmul chapter) for all six products, whose operands are read in
   place but for K^T and V^T (copied once per head, rows padded to whole
   vectors). Causal rows skip the keys they cannot see. Each output is still one sum in the built-in
   matmul's order (one slab of DT_KC while T and the head width are at most
   256), so the bits are the same as the body above's -- with the built-in
   matmul; a system BLAS sums in an order of its own. */
/* The tiled body reads a head's rows as whole vectors. */
static int dt__attention_tiled(int head_width) { return head_width % DT_VL == 0 && !dt__attention_by_gemm; }
static void dt__attention_forward_tiles(const float *qkvv, float *outv, float *P, int B, int T, int H, int D,
                                        float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T), R = DT__ATT_ROWS;
    size_t per_thread = (size_t)hd * Tp + (size_t)R * Tp;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * per_thread * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *kt = space + per_thread * (size_t)dt__thread_num(), *tile = kt + (size_t)hd * Tp;
        float *p = P + (size_t)bh * T * T, *o = outv + (size_t)b * T * D + h * hd;
        dt__att_transpose(k, 3 * D, T, hd, kt, Tp);
        for (int i0 = 0; i0 < T; i0 += R) {
            int rows = T - i0 < R ? T - i0 : R, keys = causal && i0 + rows < T ? i0 + rows : T;
            dt__att_prefetch_head(qkvv, 3 * D, 3, D, bh + 1, B * H, H, T, hd, i0 / R, (T + R - 1) / R);   /* q, k, v */
            dt__att_product((keys + DT_VL - 1) / DT_VL, hd, q + (size_t)i0 * 3 * D, 3 * D, 1, kt, Tp, scale, 0,
                            tile, Tp, rows);                                      /* S = Q K^T / sqrt(d) */
            for (int r = 0; r < rows; r++) {
                dt__softmax_row(tile + (size_t)r * Tp, causal ? i0 + r + 1 : T, T);
                memcpy(p + (size_t)(i0 + r) * T, tile + (size_t)r * Tp, sizeof(float) * (size_t)T);
            }
            dt__att_product(hd / DT_VL, keys, tile, Tp, 1, v, 3 * D, 1.0f, 0, o + (size_t)i0 * D, D, rows);  /* O = P V */
        }
    }
}
static void dt__attention_backward_tiles(const float *qkvv, const float *P, const float *dout, float *dqkv, int add,
                                         int B, int T, int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T), R = DT__ATT_ROWS;
    size_t per_thread = (size_t)hd * Tp + (size_t)T * Tp;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * per_thread * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd, *k = q + D, *v = q + 2 * D;
        float *dq = dqkv + (size_t)b * T * 3 * D + h * hd, *dk = dq + D, *dv = dq + 2 * D;
        const float *p = P + (size_t)bh * T * T, *dO = dout + (size_t)b * T * D + h * hd;
        float *vt = space + per_thread * (size_t)dt__thread_num(), *ds = vt + (size_t)hd * Tp;
        dt__att_transpose(v, 3 * D, T, hd, vt, Tp);
        for (int i0 = 0; i0 < T; i0 += R) {           /* by query rows: dS, then dQ */
            int rows = T - i0 < R ? T - i0 : R, keys = causal && i0 + rows < T ? i0 + rows : T;
            dt__att_prefetch_head(qkvv, 3 * D, 3, D, bh + 1, B * H, H, T, hd, i0 / R, (T + R - 1) / R);   /* q, k, v */
            dt__att_prefetch_head(dqkv, 3 * D, 3, D, bh + 1, B * H, H, T, hd, i0 / R, (T + R - 1) / R);   /* their grads */
            dt__att_prefetch_head(dout, D, 1, 0, bh + 1, B * H, H, T, hd, i0 / R, (T + R - 1) / R);       /* dO */
            float *dsi = ds + (size_t)i0 * Tp;
            dt__att_product((keys + DT_VL - 1) / DT_VL, hd, dO + (size_t)i0 * D, D, 1, vt, Tp, 1.0f, 0, dsi, Tp,
                            rows);                                                /* dP = dO V^T */
            for (int r = 0; r < rows; r++) {
                float *dr = dsi + (size_t)r * Tp;
                for (int j = keys; j < T; j++) dr[j] = 0.0f;  /* unseen keys: p = 0 there */
                dt__softmax_row_backward(dr, p + (size_t)(i0 + r) * T, T, scale);
            }
            dt__att_product(hd / DT_VL, keys, dsi, Tp, 1, k, 3 * D, 1.0f, add, dq + (size_t)i0 * 3 * D, 3 * D,
                            rows);                                                /* dQ += dS K */
        }
        for (int j0 = 0; j0 < T; j0 += R) {           /* by key rows: dV and dK (causal: from query j0 on) */
            int rows = T - j0 < R ? T - j0 : R, from = causal ? j0 : 0;
            dt__att_product(hd / DT_VL, T - from, p + (size_t)from * T + j0, 1, T, dO + (size_t)from * D, D, 1.0f,
                            add, dv + (size_t)j0 * 3 * D, 3 * D, rows);          /* dV += P^T dO */
            dt__att_product(hd / DT_VL, T - from, ds + (size_t)from * Tp + j0, 1, Tp, q + (size_t)from * 3 * D,
                            3 * D, 1.0f, add, dk + (size_t)j0 * 3 * D, 3 * D, rows);   /* dK += dS^T Q */
        }
    }
}

/* -- the online body: per (sequence, head) and query row, its keys in blocks
      of DT__ONLINE_KEYS; the row's m, l and output accumulate as the
      recurrence says, and the output is divided by l at the end. -- */
#define DT__ONLINE_KEYS 64
#define DT__ONLINE_ROWS DT__ATT_ROWS     /* query rows that share each key block's loads: a tile's */
typedef float dt__online_block[DT__ONLINE_ROWS][DT__ONLINE_KEYS];
/* The block's products, through the tiled body's register-blocked loop
   (dt__att_product) when the head is a whole number of vectors wide, else
   plain loops. Scores: s[r][j] = x_r . k_j * scale for `rows` rows (row r at
   x + r * ld) and the keys j0 .. j0 + n, from K transposed (kt, rows of Tp). */
static void dt__online_scores(const float *x, ptrdiff_t ld, int rows, const float *kt, int Tp, int j0, int n, int hd,
                              float scale, dt__online_block s) {
    if (hd % DT_VL == 0) {
        dt__att_product((n + DT_VL - 1) / DT_VL, hd, x, ld, 1, kt + j0, Tp, scale, 0, &s[0][0], DT__ONLINE_KEYS, rows);
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n; j++) {
            float dot = 0;
            for (int d = 0; d < hd; d++) dot += x[(size_t)r * ld + d] * kt[(size_t)d * Tp + j0 + j];
            s[r][j] = dot * scale;
        }
}
/* c_r += sum_j a[r][j] y_j (row r of c at c + r * ldc, y_j at y + j * ldy): P V, dS K */
static void dt__online_rows_times(const dt__online_block a, int rows, int n, const float *y, ptrdiff_t ldy, float *c,
                                  ptrdiff_t ldc, int hd) {
    if (hd % DT_VL == 0) { dt__att_product(hd / DT_VL, n, &a[0][0], DT__ONLINE_KEYS, 1, y, ldy, 1.0f, 1, c, ldc, rows); return; }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < n; j++)
            for (int d = 0; d < hd; d++) c[(size_t)r * ldc + d] += a[r][j] * y[(size_t)j * ldy + d];
}
/* c_j += sum_r a[r][j] x_r for the block's keys j < n (x_r at x + r * ldx): dS^T Q, P^T dO */
static void dt__online_keys_times(const dt__online_block a, int rows, int n, const float *x, ptrdiff_t ldx, float *c,
                                  ptrdiff_t ldc, int hd) {
    for (int j0 = 0; j0 < n && hd % DT_VL == 0; j0 += DT__ATT_ROWS)
        dt__att_product(hd / DT_VL, rows, &a[0][j0], 1, DT__ONLINE_KEYS, x, ldx, 1.0f, 1, c + (size_t)j0 * ldc, ldc,
                        n - j0 < DT__ATT_ROWS ? n - j0 : DT__ATT_ROWS);
    if (hd % DT_VL == 0) return;
    for (int j = 0; j < n; j++)
        for (int r = 0; r < rows; r++)
            for (int d = 0; d < hd; d++) c[(size_t)j * ldc + d] += a[r][j] * x[(size_t)r * ldx + d];
}
/* One head of one sequence, the unit every online body works on: Tq query
   rows (row i at q + i * ldq) against Tk keys (K transposed in kt, rows of
   Tp; V transposed in vt; key j's rows of K and V at k, v + j * ldkv). The
   tokens' positions ascend (qpos, kpos; NULL: 0, 1, 2, ...), and a causal
   row sees the keys at its position and before. On one device the queries
   and keys are the same tokens; under context parallelism the keys are the
   block the ring brought (dt_ring_attention): the same loops. */
typedef struct dt__online_head {
    const float *q, *kt, *vt, *k, *v, *qpos, *kpos;
    ptrdiff_t ldq, ldkv;
    int Tq, Tk, Tp, hd, causal;
    float scale;
} dt__online_head;
static int dt__online_visible(const dt__online_head *a, int i) {
    if (!a->causal) return a->Tk;
    float p = a->qpos ? a->qpos[i] : (float)i;
    int lo = 0, hi = a->Tk;
    if (!a->kpos) return p + 1 < 0 ? 0 : p + 1 < hi ? (int)p + 1 : hi;
    while (lo < hi) {                                    /* the keys at p and before */
        int mid = (lo + hi) / 2;
        if (a->kpos[mid] <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
/* Each row's largest score m, sum l and unnormalised output acc (row i at
   acc + i * ldacc) move on by the keys it sees, a tile of rows against
   DT__ONLINE_KEYS keys at a time; a tile of keys none of its rows sees is
   skipped. Returns the score products made (the work, counted). */
static int64_t dt__online_forward(const dt__online_head *a, float *m, float *l, float *acc, ptrdiff_t ldacc) {
    int64_t work = 0;
    int hd = a->hd, vis[DT__ONLINE_ROWS];
    dt__online_block s;
    for (int i0 = 0; i0 < a->Tq; i0 += DT__ONLINE_ROWS) {
        int rows = a->Tq - i0 < DT__ONLINE_ROWS ? a->Tq - i0 : DT__ONLINE_ROWS, keys = 0;
        for (int r = 0; r < rows; r++) keys = (vis[r] = dt__online_visible(a, i0 + r)) > keys ? vis[r] : keys;
        for (int j0 = 0; j0 < keys; j0 += DT__ONLINE_KEYS) {
            int n = keys - j0 < DT__ONLINE_KEYS ? keys - j0 : DT__ONLINE_KEYS;
            dt__online_scores(a->q + (size_t)i0 * a->ldq, a->ldq, rows, a->kt, a->Tp, j0, n, hd, a->scale, s);
            for (int r = 0; r < rows; r++) {
                int i = i0 + r, valid = vis[r] - j0 < 0 ? 0 : vis[r] - j0 < n ? vis[r] - j0 : n;
                float block_max = -INFINITY, *ar = acc + (size_t)i * ldacc;
                for (int j = 0; j < valid; j++) block_max = s[r][j] > block_max ? s[r][j] : block_max;
                if (valid > 0) {
                    float c = dt_online_softmax_rescale(&m[i], block_max);   /* what came before, on the new scale */
                    l[i] *= c;
                    for (int d = 0; d < hd; d++) ar[d] *= c;
                }
                for (int j = 0; j < valid; j++) s[r][j] = dt_exp_value(s[r][j] - m[i]);   /* unnormalised */
                for (int j = valid; j < n; j++) s[r][j] = 0.0f;                           /* past the row */
                for (int j = 0; j < valid; j++) l[i] += s[r][j];
                work += valid;
            }
            dt__online_rows_times(s, rows, n, a->v + (size_t)j0 * a->ldkv, a->ldkv, acc + (size_t)i0 * ldacc, ldacc, hd);  /* acc += P V */
        }
    }
    return work;
}
/* When every key has been seen: the output (acc / l, into acc and out, row i
   at + i * ld) and m becomes the row's log-sum-exp, all backward keeps. */
static void dt__online_finish(int Tq, int hd, float *m, const float *l, float *acc, ptrdiff_t ldacc, float *out, ptrdiff_t ldout) {
    for (int i = 0; i < Tq; i++) {
        float *ai = acc + (size_t)i * ldacc, *o = out + (size_t)i * ldout;
        for (int d = 0; d < hd; d++) o[d] = ai[d] = ai[d] / l[i];
        m[i] += logf(l[i]);                                   /* p = exp(s - lse) */
    }
}
/* Backward against the keys: each probability made again, p = exp(s - lse);
   dS = p (dP - <dO, O>) scale as the softmax's backward (dP = dO . v_j, from
   V transposed as the scores from K's), and dQ += dS K (row i at dq + i *
   ldq), dK += dS^T Q, dV += P^T dO (key j at dk, dv + j * ldkv); dO and O
   row i at + i * ldo. Returns the score products made. */
static int64_t dt__online_backward(const dt__online_head *a, const float *dO, const float *O, ptrdiff_t ldo, const float *lse,
                                   float *dq, float *dk, float *dv) {
    int64_t work = 0;
    int hd = a->hd, vis[DT__ONLINE_ROWS];
    dt__online_block p, ds;
    float Di[DT__ONLINE_ROWS];
    for (int i0 = 0; i0 < a->Tq; i0 += DT__ONLINE_ROWS) {
        int rows = a->Tq - i0 < DT__ONLINE_ROWS ? a->Tq - i0 : DT__ONLINE_ROWS, keys = 0;
        const float *qi = a->q + (size_t)i0 * a->ldq, *dOi = dO + (size_t)i0 * ldo;   /* row r: + r * ld */
        for (int r = 0; r < rows; r++) {
            const float *Or = O + (size_t)(i0 + r) * ldo, *dOr = dOi + (size_t)r * ldo;
            keys = (vis[r] = dt__online_visible(a, i0 + r)) > keys ? vis[r] : keys;
            Di[r] = 0;
            for (int d = 0; d < hd; d++) Di[r] += dOr[d] * Or[d];
        }
        for (int j0 = 0; j0 < keys; j0 += DT__ONLINE_KEYS) {
            int n = keys - j0 < DT__ONLINE_KEYS ? keys - j0 : DT__ONLINE_KEYS;
            dt__online_scores(qi, a->ldq, rows, a->kt, a->Tp, j0, n, hd, a->scale, p);
            dt__online_scores(dOi, ldo, rows, a->vt, a->Tp, j0, n, hd, 1.0f, ds);          /* dP = dO . v_j */
            for (int r = 0; r < rows; r++) {
                int valid = vis[r] - j0 < 0 ? 0 : vis[r] - j0 < n ? vis[r] - j0 : n;
                float L = lse[i0 + r];
                for (int j = 0; j < valid; j++) p[r][j] = dt_exp_value(p[r][j] - L);
                for (int j = valid; j < n; j++) p[r][j] = 0.0f;
                for (int j = 0; j < n; j++) ds[r][j] = p[r][j] * (ds[r][j] - Di[r]) * a->scale;
                work += valid;
            }
            dt__online_rows_times(ds, rows, n, a->k + (size_t)j0 * a->ldkv, a->ldkv, dq + (size_t)i0 * a->ldq, a->ldq, hd);
            dt__online_keys_times(ds, rows, n, qi, a->ldq, dk + (size_t)j0 * a->ldkv, a->ldkv, hd);
            dt__online_keys_times(p, rows, n, dOi, ldo, dv + (size_t)j0 * a->ldkv, a->ldkv, hd);
        }
    }
    return work;
}
/* lse: each row's log-sum-exp [B*H*T]; O: the output in f32 [B*T, D] for backward's <dO, O> (the matmul
   body's <dP, P>), which an f32 output is itself (O == outv: kept once, not twice). */
static void dt__attention_forward_online(const float *qkvv, float *outv, float *lse, float *O, int B, int T, int H, int D,
                                         float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)(hd * Tp + T) * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd;
        float *kt = space + (size_t)(hd * Tp + T) * (size_t)dt__thread_num(), *l = kt + (size_t)hd * Tp;
        float *m = lse + (size_t)bh * T, *acc = O + (size_t)b * T * D + h * hd;   /* row i: + i * D */
        dt__online_head a = { q, kt, NULL, NULL, q + 2 * D, NULL, NULL, 3 * D, 3 * D, T, T, Tp, hd, causal, scale };
        dt__att_transpose(q + D, 3 * D, T, hd, kt, Tp);
        for (int i = 0; i < T; i++) {
            m[i] = -INFINITY; l[i] = 0;
            for (int d = 0; d < hd; d++) acc[(size_t)i * D + d] = 0;
        }
        dt__online_forward(&a, m, l, acc, D);
        dt__online_finish(T, hd, m, l, acc, D, outv + (size_t)b * T * D + h * hd, D);
    }
}
static void dt__attention_backward_online(const float *qkvv, const float *lse, const float *O, const float *dout, float *dqkv,
                                          int add, int B, int T, int H, int D, float scale, int causal) {
    int hd = D / H, Tp = dt__att_padded(T);
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)hd * Tp * (size_t)dt_threads());
    DT_OMP("omp parallel for schedule(static) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        size_t at = (size_t)b * T * D + h * hd;                /* this head's rows of [B*T, D] (+ i * D) */
        const float *q = qkvv + (size_t)b * T * 3 * D + h * hd;
        float *dq = dqkv + (size_t)b * T * 3 * D + h * hd, *kt = space + 2 * (size_t)hd * Tp * (size_t)dt__thread_num();
        dt__online_head a = { q, kt, kt + (size_t)hd * Tp, q + D, q + 2 * D, NULL, NULL, 3 * D, 3 * D, T, T, Tp, hd, causal, scale };
        dt__att_transpose(q + D, 3 * D, T, hd, kt, Tp);
        dt__att_transpose(q + 2 * D, 3 * D, T, hd, kt + (size_t)hd * Tp, Tp);
        for (int i = 0; i < T && !add; i++)               /* written first: this head's columns start at 0 */
            for (int d = 0; d < hd; d++) dq[(size_t)i * 3 * D + d] = dq[(size_t)i * 3 * D + D + d] = dq[(size_t)i * 3 * D + 2 * D + d] = 0;
        dt__online_backward(&a, dout + at, O + at, D, lse + (size_t)bh * T, dq, dq + D, dq + 2 * D);
    }
}
static void dt__attention_backward(dt__tape_entry *e) {
    dt_tensor *qkv = e->in[0];
    if (!qkv->requires_grad) return;
    int B = e->iarg[0], T = e->iarg[1], H = e->iarg[2], causal = e->iarg[3] & 1, online = e->iarg[3] >> 1 & 1, o_is_out = e->iarg[3] >> 2;
    int D = (int)dt_tensor_cols(e->out);
    float scale = e->farg[0];
    const float *P = (const float *)e->saved, *dout = dt__grad_in(e->out), *qkvv = dt__in(qkv);
    int first;
    float *dqkv = dt__grad_acc_first(qkv, &first);
    const dt_backend *gpu = dt__backend_for(qkv);
    dt__ctx.flops += 8.0 * B * H * T * T * (D / H);
    if (gpu) {
        float *scratch = (float *)dt__scratch_on(qkv->device, sizeof(float) * (size_t)(online ? (int64_t)B * H * T
                                                                                   : DT_ATTENTION_SCRATCH_FLOATS(B, T, H, D)));
        if (online) gpu->attention_backward_online(qkvv, P, dout, dqkv, scratch, B, T, H, D, scale, causal);
        else gpu->attention_backward(P, dout, dqkv, scratch, B, T, H, D, scale);
    } else if (online)
        dt__attention_backward_online(qkvv, P, o_is_out ? e->out->data : P + (size_t)B * H * T, dout, dqkv, !first, B, T, H, D,
                                      scale, causal);
    else if (dt__attention_tiled(D / H))                           /* each element is one product's: */
        dt__attention_backward_tiles(qkvv, P, dout, dqkv, !first, B, T, H, D, scale, causal);   /* written first */
    else
        dt__attention_backward_gemm(qkvv, P, dout, dqkv, first ? 0.0f : 1.0f, B, T, H, D, scale);
    dt__grad_acc_done(qkv, dqkv);
}
dt_tensor *dt_attention(dt_tensor *qkv, int B, int T, int H, int causal) {
    int D = (int)dt_tensor_cols(qkv) / 3;
    if (dt_tensor_cols(qkv) != 3 * D || D % H != 0 || dt_tensor_rows(qkv) != (int64_t)B * T)
        dt_fail("attention: qkv is [%lld, %lld], expected [%d, 3*D] with D divisible by %d heads",
                (long long)dt_tensor_rows(qkv), (long long)dt_tensor_cols(qkv), B * T, H);
    if (dt__seq_split.ring) {                      /* this rank's tokens: the keys go around the ring */
        if (T != dt__seq_split.T) dt_fail("attention of %d tokens a sequence, where this rank holds %d of each", T, dt__seq_split.T);
        return dt_ring_attention(qkv, B, T, H, causal, dt__seq_split.positions, dt__seq_split.ring);
    }
    int hd = D / H;
    float scale = 1.0f / sqrtf((float)hd);
    const dt_backend *gpu = dt__backend_for(qkv);
    int online = dt__attention_body == DT_ATTENTION_ONLINE;
    if (gpu && online && hd > DT_ATTENTION_ONLINE_MAX_HEAD_DIM)
        dt_usage_error("--attention online: heads of %d columns; the GPU's online kernel takes at most %d (leave --attention out)",
                       hd, DT_ATTENTION_ONLINE_MAX_HEAD_DIM);
    dt__scratch_reset();
    dt_tensor *out = dt__tensor_out_2d(B * T, D);
    const float *qkvv = dt__in(qkv);
    float *outv = dt__out(out);
    /* f32 probabilities (mixed precision too); online: a row's log-sum-exp, and O unless the output is it (Qwen2: 98 MB) */
    int o_is_out = online && !gpu && outv == out->data;
    float *P = (float *)dt__step_data(sizeof(float) * (size_t)(online ? (int64_t)B * H * T + (o_is_out ? 0 : (int64_t)B * T * D)
                                                               : gpu ? DT_ATTENTION_SAVED_FLOATS(B, T, H, D)
                                                                     : (int64_t)B * H * T * T));
    if (gpu && online) gpu->attention_forward_online(qkvv, outv, P, B, T, H, D, scale, causal);
    else if (gpu) gpu->attention_forward(qkvv, outv, P, B, T, H, D, scale, causal);
    else if (online) dt__attention_forward_online(qkvv, outv, P, o_is_out ? outv : P + (size_t)B * H * T, B, T, H, D, scale, causal);
    else if (dt__attention_tiled(hd)) dt__attention_forward_tiles(qkvv, outv, P, B, T, H, D, scale, causal);
    else dt__attention_forward_gemm(qkvv, outv, P, B, T, H, D, scale, causal);
    dt__out_done(out, outv);
    dt__ctx.flops += 4.0 * B * H * T * T * hd;
    if (dt__wants_grad(qkv, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__attention_backward, out, qkv, NULL, NULL);
        e->iarg[0] = B; e->iarg[1] = T; e->iarg[2] = H; e->iarg[3] = (causal != 0) | online << 1 | o_is_out << 2; e->farg[0] = scale;
        e->saved = P;
    }
    return out;
}

/* -- rotary embeddings and grouped-query attention (Llama's): what q, k and v
      go through before dt_attention. A position is not added to the input,
      as GPT-2's table is; each (q, k) pair of a head is turned instead, pair
      (j, j + hd/2) by the angle t * theta^(-2j/hd), so that q_t . k_s depends
      on t - s only. The angles are Hugging Face's: the frequency and the
      product in float, as their float32 tensors make them. Grouped-query
      attention keeps KV < H key/value heads; each serves H/KV query heads
      (repeated here, as Hugging Face's eager attention does, so dt_attention
      is the GPT's, unchanged). Backward turns the gradient back and adds a
      group's heads into its key/value head, in head order. -- */
/* (cos, sin) per position and pair, made on the host once per step and shape
   (every layer reads the same) and kept in the step arena for backward. */
static int dt__rope_same(dt_rope a, dt_rope b) {
    return a.theta == b.theta && a.factor == b.factor && a.low_freq == b.low_freq && a.high_freq == b.high_freq &&
           a.original_context == b.original_context;
}
static float *dt__rope_table(int T, int hd, dt_rope rope, dt_device device) {
    const int32_t *at = dt__seq_split.positions;       /* a rank's share of the sequence: its tokens' angles, not kept */
    if (!at && dt__ctx.rope.cs && dt__ctx.rope.made_at == dt__ctx.arena_rewinds && dt__ctx.rope.T == T && dt__ctx.rope.hd == hd &&
        dt__rope_same(dt__ctx.rope.rope, rope) && dt__ctx.rope.device == device)
        return dt__ctx.rope.cs;
    int half = hd / 2;
    size_t bytes = sizeof(float) * (size_t)T * hd;
    float *host = (float *)dt__step_alloc_uninit(bytes), *inv = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)half);
    for (int j = 0; j < half; j++) {
        inv[j] = 1.0f / powf(rope.theta, (float)(2 * j) / (float)hd);
        if (rope.factor > 0) {                   /* Llama 3: a wavelength against the original context, in float */
            float wavelen = (float)(2 * 3.14159265358979323846) / inv[j], context = (float)rope.original_context;
            float low_wavelen = context / rope.low_freq, high_wavelen = context / rope.high_freq;
            if (wavelen > low_wavelen) inv[j] /= rope.factor;
            else if (!(wavelen < high_wavelen)) {
                float smooth = (context / wavelen - rope.low_freq) / (rope.high_freq - rope.low_freq);
                inv[j] = (1 - smooth) * inv[j] / rope.factor + smooth * inv[j];
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < half; j++) {
            float angle = (float)(at ? at[t] : t) * inv[j];
            host[(size_t)t * hd + 2 * j] = (float)cos((double)angle);
            host[(size_t)t * hd + 2 * j + 1] = (float)sin((double)angle);
        }
    float *cs = host;
    if (device != DT_CPU) {
        cs = (float *)dt__step_alloc_on(device, bytes);
        dt__upload_to(device, cs, host, bytes);
    }
    if (at) return cs;
    dt__ctx.rope.made_at = dt__ctx.arena_rewinds; dt__ctx.rope.T = T; dt__ctx.rope.hd = hd; dt__ctx.rope.rope = rope;
    dt__ctx.rope.device = device; dt__ctx.rope.cs = cs;
    return cs;
}
static void dt__rotary_qkv_backward(dt__tape_entry *e) {
    dt_tensor *q = e->in[0], *k = e->in[1], *v = e->in[2];
    int T = e->iarg[0], H = e->iarg[1], KV = e->iarg[2], BT = (int)dt_tensor_rows(q), hd = (int)dt_tensor_cols(q) / H;
    int half = hd / 2, D = H * hd, group = H / KV;
    const float *cs = (const float *)e->saved, *dy = dt__grad_in(e->out);
    float *dq = q->requires_grad ? dt__grad_acc(q) : NULL, *dk = k->requires_grad ? dt__grad_acc(k) : NULL;
    float *dv = v->requires_grad ? dt__grad_acc(v) : NULL;
    const dt_backend *gpu = dt__backend_for(q);
    if (gpu) gpu->rotary_qkv_backward(cs, dy, dq, dk, dv, BT, T, H, KV, hd);
    else {
        DT_OMP("omp parallel for if((int64_t)BT * D > 32768)")
        for (int r = 0; r < BT; r++) {
            const float *row = dy + (size_t)r * 3 * D, *c = cs + (size_t)(r % T) * hd;
            for (int h = 0; h < H; h++) {
                const float *gq = row + h * hd, *gk = row + D + h * hd, *gv = row + 2 * D + h * hd;
                float *oq = dq ? dq + (size_t)r * D + h * hd : NULL;
                float *ok = dk ? dk + ((size_t)r * KV + h / group) * hd : NULL, *ov = dv ? dv + ((size_t)r * KV + h / group) * hd : NULL;
                for (int j = 0; j < half; j++) {        /* the turn by -angle */
                    float co = c[2 * j], si = c[2 * j + 1];
                    if (oq) { oq[j] += gq[j] * co + gq[j + half] * si; oq[j + half] += gq[j + half] * co - gq[j] * si; }
                    if (ok) { ok[j] += gk[j] * co + gk[j + half] * si; ok[j + half] += gk[j + half] * co - gk[j] * si; }
                }
                if (ov) for (int j = 0; j < hd; j++) ov[j] += gv[j];
            }
        }
    }
    if (dq) dt__grad_acc_done(q, dq);
    if (dk) dt__grad_acc_done(k, dk);
    if (dv) dt__grad_acc_done(v, dv);
}
dt_tensor *dt_rotary_qkv(dt_tensor *q, dt_tensor *k, dt_tensor *v, int B, int T, int H, int KV, dt_rope rope) {
    int BT = B * T;
    if (H < 1 || KV < 1 || H % KV || dt_tensor_cols(q) % H || (dt_tensor_cols(q) / H) % 2)
        dt_fail("rotary_qkv: %d query heads of q's %lld columns in %d key/value groups (heads a multiple of groups, an even head width)",
                H, (long long)dt_tensor_cols(q), KV);
    int hd = (int)dt_tensor_cols(q) / H, half = hd / 2, D = H * hd;
    if (dt_tensor_rows(q) != BT || dt_tensor_rows(k) != BT || dt_tensor_rows(v) != BT || dt_tensor_cols(k) != (int64_t)KV * hd ||
        dt_tensor_cols(v) != (int64_t)KV * hd)
        dt_fail("rotary_qkv: q [%lld, %lld], k [%lld, %lld], v [%lld, %lld]; expected [%d, %d] and [%d, %d] twice", (long long)dt_tensor_rows(q),
                (long long)dt_tensor_cols(q), (long long)dt_tensor_rows(k), (long long)dt_tensor_cols(k), (long long)dt_tensor_rows(v),
                (long long)dt_tensor_cols(v), BT, D, BT, KV * hd);
    const dt_backend *gpu = dt__backend_for(q);
    dt__backend_for(k);
    dt__backend_for(v);
    if (!(rope.theta > 1) || (rope.factor != 0 && !(rope.factor > 0 && rope.low_freq > 0 && rope.high_freq > rope.low_freq &&
                                                     rope.original_context > 0)))
        dt_fail("rotary_qkv: base %g, rescaling factor %g, low %g, high %g, original context %d (a base above 1; a factor of 0, "
                "or positive with 0 < low < high and a positive context)", (double)rope.theta, (double)rope.factor,
                (double)rope.low_freq, (double)rope.high_freq, rope.original_context);
    float *cs = dt__rope_table(T, hd, rope, q->device);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(BT, 3 * D);
    const float *qv = dt__in(q), *kv = dt__in(k), *vv = dt__in(v);
    float *yv = dt__out(y);
    if (gpu) gpu->rotary_qkv_forward(qv, kv, vv, cs, yv, BT, T, H, KV, hd);
    else {
        int group = H / KV;
        DT_OMP("omp parallel for if((int64_t)BT * D > 32768)")
        for (int r = 0; r < BT; r++) {
            float *row = yv + (size_t)r * 3 * D;
            const float *c = cs + (size_t)(r % T) * hd;
            for (int h = 0; h < H; h++) {
                const float *sq = qv + (size_t)r * D + h * hd, *sk = kv + ((size_t)r * KV + h / group) * hd;
                const float *sv = vv + ((size_t)r * KV + h / group) * hd;
                float *oq = row + h * hd, *ok = row + D + h * hd, *ov = row + 2 * D + h * hd;
                for (int j = 0; j < half; j++) {        /* x cos + rotate_half(x) sin */
                    float co = c[2 * j], si = c[2 * j + 1];
                    oq[j] = sq[j] * co - sq[j + half] * si;
                    oq[j + half] = sq[j + half] * co + sq[j] * si;
                    ok[j] = sk[j] * co - sk[j + half] * si;
                    ok[j + half] = sk[j + half] * co + sk[j] * si;
                }
                memcpy(ov, sv, sizeof(float) * (size_t)hd);
            }
        }
    }
    dt__out_done(y, yv);
    if (dt__wants_grad(q, k, v)) {
        dt__tape_entry *e = dt__tape_push(dt__rotary_qkv_backward, y, q, k, v);
        e->iarg[0] = T; e->iarg[1] = H; e->iarg[2] = KV;
        e->saved = cs;
    }
    return y;
}

/* -- token embedding: a language model's input. A lookup, not a matmul: row
      (b, t) copies the token's row of wte and adds position t's row of wpe.
      Its backward adds each row's gradient back into the token's row, so a
      token seen twice collects both; it walks the rows in order, and each
      thread owns a band of columns, so sums never race and always run in the
      same order (the GPU's body too). The forward checked every id. -- */
static int dt__token_id(float v, int vocab) {
    int id = (int)v;
    if (!(v >= 0) || id >= vocab || (float)id != v) dt_fail("token id %g is outside the vocabulary [0, %d)", v, vocab);
    return id;
}
/* The GPU adds up a token's rows without atomics (which would sum in a
   different order every run): the host, which can read the ids, groups the
   rows by token with a counting sort -- stable, so each group keeps its rows in
   the CPU's order -- and the GPU gives a thread to each (token, column). The
   list goes to the device in the step arena (see the backend's comment). */
static const int32_t *dt__rows_by_token(const dt_tensor *tokens, int from, int vocab, int *groups) {
    int BT = (int)tokens->numel, G = 0;
    float *ids = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)BT);
    int32_t *first = (int32_t *)dt_step_alloc(sizeof(int32_t) * ((size_t)vocab + 1));
    int32_t *list = (int32_t *)dt_step_alloc(sizeof(int32_t) * (3 * (size_t)BT + 1));
    dt_tensor_to_host(tokens, ids);
    /* wte's rows are tokens from .. from + vocab - 1 (all of them, unless the
       vocabulary is split over ranks): the other rows add nothing here */
    for (int r = 0; r < BT; r++) {
        int id = (int)ids[r] - from;
        if (id >= 0 && id < vocab) first[id + 1]++;
    }
    for (int v = 0; v < vocab; v++) {
        if (first[v + 1]) G++;
        first[v + 1] += first[v];               /* where token v's rows begin */
    }
    int32_t *order = list, *start = list + BT, *token = start + G + 1;
    for (int v = 0, g = 0; v < vocab; v++)
        if (first[v + 1] > first[v]) { start[g] = first[v]; token[g++] = v; }
    start[G] = first[vocab];
    for (int r = 0; r < BT; r++) {
        int id = (int)ids[r] - from;
        if (id >= 0 && id < vocab) order[first[id]++] = r;
    }
    size_t bytes = sizeof(int32_t) * ((size_t)BT + 2 * (size_t)G + 1);
    int32_t *dev = (int32_t *)dt__step_alloc_on(tokens->device, bytes);
    dt__upload_to(tokens->device, dev, list, bytes);
    *groups = G;
    return dev;
}
static void dt__token_embedding_backward(dt__tape_entry *e) {
    const dt_tensor *tokens = (const dt_tensor *)e->saved;
    dt_tensor *wte = e->in[0], *wpe = e->in[1];
    int BT = (int)dt_tensor_rows(e->out), D = (int)dt_tensor_cols(e->out), T = e->iarg[0], from = e->iarg[1];
    int V = (int)dt_tensor_rows(wte);
    const float *dy = dt__grad_in(e->out);
    float *dwte = wte->requires_grad ? dt__grad_acc(wte) : NULL, *dwpe = wpe && wpe->requires_grad ? dt__grad_acc(wpe) : NULL;
    const dt_backend *gpu = dt__backend_for(e->out);
    if (gpu) {
        int groups = 0;
        const int32_t *by_token = dt__rows_by_token(tokens, from, V, &groups);
        gpu->token_embedding_backward(by_token, groups, dy, dwte, dwpe, BT, T, D);
    } else {
        DT_OMP("omp parallel for schedule(static) if(BT * D > 65536)")
        for (int j0 = 0; j0 < D; j0 += 16) {
            int j1 = j0 + 16 < D ? j0 + 16 : D;
            for (int r = 0; r < BT; r++) {
                const float *g = dy + (size_t)r * D;
                int id = (int)tokens->data[r] - from;
                if (dwte && id >= 0 && id < V) { float *w = dwte + (size_t)id * D; for (int j = j0; j < j1; j++) w[j] += g[j]; }
                if (dwpe) { float *p = dwpe + (size_t)(r % T) * D; for (int j = j0; j < j1; j++) p[j] += g[j]; }
            }
        }
    }
    if (dwte) dt__grad_acc_done(wte, dwte);
    if (dwpe) dt__grad_acc_done(wpe, dwpe);
}
/* wte holds the rows of tokens `from` .. from + rows - 1 of a vocabulary of
   `vocab`: all of them, or (stage 06) one rank's share, the other tokens'
   rows left zero, for the group's sum to fill. */
static dt_tensor *dt__token_embedding_rows(const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe, int from, int vocab) {
    int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), D = (int)dt_tensor_cols(wte), V = (int)dt_tensor_rows(wte);
    if (tokens->dtype != DT_F32) dt_fail("token embedding: the token ids must be f32 whole numbers");
    if (wpe && (dt_tensor_cols(wpe) != D || dt_tensor_rows(wpe) < T))
        dt_fail("token embedding: %d positions of width %d need %s of at least [%d, %d], it is [%lld, %lld]", T, D,
                wpe->name ? wpe->name : "the position embedding", T, D, (long long)dt_tensor_rows(wpe),
                (long long)dt_tensor_cols(wpe));
    const dt_backend *gpu = dt__backend_for(wte);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B * T, D);
    const float *wv = dt__in(wte), *pv = wpe ? dt__in(wpe) : NULL;
    float *yv = dt__out(y);
    if (gpu) gpu->token_embedding_forward(tokens->data, wv, pv, yv, B * T, T, D, from, V);
    else
        for (int r = 0; r < B * T; r++) {
            int id = dt__token_id(tokens->data[r], vocab) - from;
            if (id < 0 || id >= V) {                 /* another rank's token */
                if (pv) memcpy(yv + (size_t)r * D, pv + (size_t)(r % T) * D, sizeof(float) * (size_t)D);
                else memset(yv + (size_t)r * D, 0, sizeof(float) * (size_t)D);
                continue;
            }
            const float *w = wv + (size_t)id * D;
            if (pv) {
                const float *p = pv + (size_t)(r % T) * D;
                for (int j = 0; j < D; j++) yv[(size_t)r * D + j] = w[j] + p[j];
            } else memcpy(yv + (size_t)r * D, w, sizeof(float) * (size_t)D);
        }
    dt__out_done(y, yv);
    if (dt__wants_grad(wte, wpe, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__token_embedding_backward, y, wte, wpe, NULL);
        e->iarg[0] = T;
        e->iarg[1] = from;
        e->saved = (void *)tokens;
    }
    return y;
}
dt_tensor *dt_token_embedding(const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe) {
    if (wpe && dt__seq_split.positions) {          /* a rank's share of each sequence: wpe's rows at its positions */
        int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), shape[2] = { B, T };
        float *at = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * T);
        for (int r = 0; r < B * T; r++) at[r] = (float)dt__seq_split.positions[r % T];
        return dt_add(dt__token_embedding_rows(tokens, wte, NULL, 0, (int)dt_tensor_rows(wte)),
                      dt__token_embedding_rows(dt_tensor_from_host(2, shape, at), wpe, NULL, 0, (int)dt_tensor_rows(wpe)));
    }
    return dt__token_embedding_rows(tokens, wte, wpe, 0, (int)dt_tensor_rows(wte));
}

/* -- ViT token assembly: [class token; patch embeddings] + position embedding -- */
static void dt__vit_tokens_backward(dt__tape_entry *e) {
    dt_tensor *patches = e->in[0], *cls = e->in[1], *pos = e->in[2];
    int B = e->iarg[0], P = e->iarg[1], D = e->iarg[2], T = P + 1;
    const float *dy = dt__grad_in(e->out);
    float *dpatch = patches->requires_grad ? dt__grad_acc(patches) : NULL;
    float *dcls = cls->requires_grad ? dt__grad_acc(cls) : NULL, *dpos = pos->requires_grad ? dt__grad_acc(pos) : NULL;
    const dt_backend *gpu = dt__backend_for(patches);
    if (gpu) gpu->vit_tokens_backward(dy, dpatch, dcls, dpos, B, P, D);
    else
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                const float *g = dy + ((size_t)b * T + t) * D;
                if (dpos) for (int j = 0; j < D; j++) dpos[(size_t)t * D + j] += g[j];
                if (t == 0) { if (dcls) for (int j = 0; j < D; j++) dcls[j] += g[j]; }
                else if (dpatch) for (int j = 0; j < D; j++) dpatch[((size_t)b * P + t - 1) * D + j] += g[j];
            }
    if (dpatch) dt__grad_acc_done(patches, dpatch);
    if (dcls) dt__grad_acc_done(cls, dcls);
    if (dpos) dt__grad_acc_done(pos, dpos);
}
dt_tensor *dt_vit_tokens(dt_tensor *patches, dt_tensor *cls, dt_tensor *pos, int B) {
    int D = (int)dt_tensor_cols(patches), P = (int)(dt_tensor_rows(patches) / B), T = P + 1;
    if (pos->numel != (int64_t)T * D || cls->numel != D)
        dt_fail("vit tokens: %d patches of %d need pos_embed of %d x %d", P, D, T, D);
    const dt_backend *gpu = dt__backend_for(patches);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B * T, D);
    const float *pv = dt__in(patches), *cv = dt__in(cls), *posv = dt__in(pos);
    float *yv = dt__out(y);
    if (gpu) gpu->vit_tokens_forward(pv, cv, posv, yv, B, P, D);
    else
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                float *o = yv + ((size_t)b * T + t) * D;
                const float *src = t == 0 ? cv : pv + ((size_t)b * P + t - 1) * D;
                for (int j = 0; j < D; j++) o[j] = src[j] + posv[(size_t)t * D + j];
            }
    dt__out_done(y, yv);
    if (dt__wants_grad(patches, cls, pos)) {
        dt__tape_entry *e = dt__tape_push(dt__vit_tokens_backward, y, patches, cls, pos);
        e->iarg[0] = B; e->iarg[1] = P; e->iarg[2] = D;
    }
    return y;
}

/* -- pick one token per sequence (the class token feeds the head) -- */
static void dt__select_token_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0];
    if (!x->requires_grad) return;
    int B = e->iarg[0], T = e->iarg[1], idx = e->iarg[2], D = (int)dt_tensor_cols(x);
    float *dx = dt__grad_acc(x);
    const float *dy = dt__grad_in(e->out);
    const dt_backend *gpu = dt__backend_for(x);
    if (gpu) gpu->select_token_backward(dy, dx, B, T, idx, D);
    else
        for (int b = 0; b < B; b++)
            for (int j = 0; j < D; j++) dx[((size_t)b * T + idx) * D + j] += dy[(size_t)b * D + j];
    dt__grad_acc_done(x, dx);
}
dt_tensor *dt_select_token(dt_tensor *x, int B, int T, int index) {
    int D = (int)dt_tensor_cols(x);
    const dt_backend *gpu = dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B, D);
    const float *xv = dt__in(x);
    float *yv = dt__out(y);
    if (gpu) gpu->select_token_forward(xv, yv, B, T, index, D);
    else
        for (int b = 0; b < B; b++)
            memcpy(yv + (size_t)b * D, xv + ((size_t)b * T + index) * D, sizeof(float) * D);
    dt__out_done(y, yv);
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__select_token_backward, y, x, NULL, NULL);
        e->iarg[0] = B; e->iarg[1] = T; e->iarg[2] = index;
    }
    return y;
}

/* -- logits that wait (dt_vocab_head): the header and the head's tape entry
      now, the matmul when something reads them; the loss reads them in
      blocks (below) and never makes them whole. -- */
void dt_set_lazy_logits(int64_t from_bytes) { dt__ctx.lazy_from = from_bytes; }
static int dt__lazy_waiting(const dt_tensor *t) {
    return t && t == dt__ctx.lazy.logits && dt__ctx.lazy.step == dt__ctx.step_resets && !t->data;   /* a past step's is gone */
}
/* Rows [r0, r0 + n) of x w^T into y (n rows of C): the linear layer's own matmul, on fewer rows. */
static void dt__lazy_rows(const dt_tensor *x, const dt_tensor *w, int r0, int n, float *y) {
    int in = (int)dt_tensor_cols(x), C = (int)dt_tensor_rows(w);
    dt_gemm(0, 1, n, C, in, 1.0f, x->data + (size_t)r0 * in, in, w->data, in, 0.0f, y, C);
    dt__ctx.flops += 2.0 * n * in * C;
}
static void dt__lazy_make(const dt_tensor *t) {
    if (!dt__lazy_waiting(t)) return;
    if (dt__ctx.lazy.stale)
        dt_fail("the logits of a vocabulary head that waited to be read (dt_set_lazy_logits) were read after the "
                "optimizer had moved its weights: read them before dt_optimizer_step, or call dt_set_lazy_logits(-1)");
    dt_tensor *y = dt__ctx.lazy.logits;
    y->data = (float *)dt__step_data((size_t)y->numel * sizeof(float));
    dt__lazy_rows(dt__ctx.lazy.x, dt__ctx.lazy.w, 0, y->shape[0], y->data);
    dt__ctx.lazy.logits = NULL;
}
dt_tensor *dt_vocab_head(dt_tensor *x, dt_tensor *w) {
    if (dt__ctx.lazy_from < 0 || (double)dt_tensor_rows(x) * dt_tensor_rows(w) * sizeof(float) < (double)dt__ctx.lazy_from ||
        !dt__wants_grad(x, w, NULL) || w->parallel || dt__mixed() || x->dtype != DT_F32 ||
        w->dtype != DT_F32 || x->ndim != 2 || dt__backend_of(x->device) || dt__backend_of(w->device) ||
        dt_tensor_cols(w) != dt_tensor_cols(x))
        return dt_linear(x, w, NULL);              /* it makes them now (and says what is wrong with the shapes) */
    dt__lazy_make(dt__ctx.lazy.logits);            /* one waits at a time */
    dt_tensor *y = (dt_tensor *)dt_step_alloc(sizeof *y);
    y->ndim = 2;
    y->shape[0] = x->shape[0];
    y->shape[1] = w->shape[0];
    y->numel = dt__size_mul(y->shape[0], y->shape[1], "the logits");
    y->dtype = DT_F32;
    y->device = DT_CPU;
    dt__tape_push(dt__linear_backward, y, x, w, NULL);          /* in, out: iarg[0] = 0 */
    dt__ctx.lazy.logits = y; dt__ctx.lazy.x = x; dt__ctx.lazy.w = w;
    dt__ctx.lazy.step = dt__ctx.step_resets;
    dt__ctx.lazy.stale = 0;
    return y;
}

/* -- softmax cross-entropy, fused (llm.c's fused classifier is the model):
      forward reads the logits once for each row's largest value m and the
      sum l of exp(x - m), and keeps those two numbers a row, not the
      probabilities (at GPT-2's 50,257 words and 8,192 rows, 1.6 GB saved);
      backward reads the logits again and writes the gradient (p - onehot) / N
      in the pass that makes each probability again, p = exp(x - m) / l
      (dt_cross_entropy_grad, the GPU's arithmetic too). N is the labels that
      count (or the divisor the run set); a row whose label is ignored gets
      nothing. Labels arrive in host memory; the op checks them there, then
      copies them to the device beside the rows' two numbers. -- */
void dt_cross_entropy_set_divisor(const int32_t *labels, double divisor) {
    if (!(divisor > 0)) dt_fail("dt_cross_entropy_set_divisor: the divisor must be positive (it is %g)", divisor);
    dt__ctx.loss_divisor.step = dt__ctx.step_resets;
    dt__ctx.loss_divisor.labels = labels;
    dt__ctx.loss_divisor.divisor = divisor;
}
/* What the loss keeps for backward, in the step data: each row's 1 / l
   (double: p = exp(x - m) / l then rounds once, as the division would), each
   row's m, then the labels. */
typedef struct { double *inv_l; float *m; int32_t *labels; } dt__xent_rows;
static dt__xent_rows dt__xent_rows_at(void *saved, int B) {
    dt__xent_rows k = { (double *)saved, (float *)((double *)saved + B), NULL };
    k.labels = (int32_t *)(k.m + B);
    return k;
}
/* Rows [0, B) of the logits' gradient on the CPU, written (first) or added. */
static void dt__xent_rows_grad(const float *x, const double *inv_l, const float *m, const int32_t *labels, float *dl, int B,
                               int C, float scale, int first) {
    DT_OMP("omp parallel for schedule(static) if((double)B * C > 65536.0)")
    for (int i = 0; i < B; i++) {
        float *d = dl + (size_t)i * C;
        const float *r = x + (size_t)i * C;
        int label = labels[i], mine = label >= 0 && label < C;    /* a split vocabulary: another rank's label is not */
        if (label == DT_IGNORE_INDEX) { if (first) memset(d, 0, sizeof(float) * (size_t)C); continue; }
        float at_label = mine ? (first ? 0.0f : d[label]) + dt_cross_entropy_grad(r[label], m[i], inv_l[i], 1.0f, scale) : 0;
        if (first) for (int j = 0; j < C; j++) d[j] = dt_cross_entropy_grad(r[j], m[i], inv_l[i], 0.0f, scale);
        else for (int j = 0; j < C; j++) d[j] += dt_cross_entropy_grad(r[j], m[i], inv_l[i], 0.0f, scale);  /* it vectorises */
        if (mine) d[label] = at_label;
    }
}
/* The loss's backward through the head: when the logits are a linear layer's
   output (the vocabulary head, without a bias) that only the loss reads, on
   the CPU in f32, their gradient is made a block of rows at a time and each
   block goes through the head's two matmuls at once -- dx = dlogits W, dW +=
   dlogits^T x -- so the whole vocabulary's gradient is never in memory
   (Qwen2's 151,936 words at 9 x 128 tokens: 700 MB, against 155 MB for a
   block of 256 rows). The loss's entry hands that work to the head's entry,
   which runs where the head's backward would: after the marks around the
   head (FSDP gathers the unit and its gradient buffer there). A block is a
   whole number of the built-in matmul's DT_KC-row slabs, so dW's sums are
   those of one matmul over every row and the bits those of the two entries
   apart (a test holds them to it). dt__xent_apart (tests) keeps them apart. */
static int dt__xent_apart;
/* Rows a block: about dt__xent_block_bytes (tests make it small), whole slabs. */
static double dt__xent_block_bytes = 64e6;
static int dt__xent_block_rows(int B, int C) {
    int rows = DT_KC * (int)fmax(1.0, dt__xent_block_bytes / ((double)DT_KC * C * sizeof(float)));
    return rows > B ? B : rows;
}
/* x: the logits, or NULL when they waited (dt_vocab_head): each block is made again from the head's input. */
typedef struct { const float *x; const double *inv_l; const float *m; const int32_t *labels; int B, C; float scale; } dt__xent_job;
static dt__tape_entry *dt__xent_head(const dt__tape_entry *e, const dt_tensor *logits) {
    if (dt__xent_apart || logits->grad || logits->dtype != DT_F32 || dt__mixed() || dt__backend_of(logits->device)) return NULL;
    dt__tape_entry *head = NULL;
    for (int i = 0; i < dt__ctx.tape_len; i++) {      /* a few hundred entries, once a step */
        dt__tape_entry *t = &dt__ctx.tape[i];
        if (t == e) continue;
        for (int j = 0; j < 4; j++)
            if (t->in[j] == logits) return NULL;
        if (t->out == logits) head = t->backward == dt__linear_backward && !t->in[2] ? t : NULL;
    }
    return head;
}
static void dt__xent_through_head(dt__tape_entry *head) {
    const dt__xent_job *job = (const dt__xent_job *)head->saved;
    const float *x = job->x, *m = job->m;
    const double *inv_l = job->inv_l;
    const int32_t *labels = job->labels;
    int B = job->B, C = job->C;
    dt_tensor *h = head->in[0], *w = head->in[1];
    int in_out = head->iarg[0], in = (int)dt_tensor_cols(h), first = 0, rows = dt__xent_block_rows(B, C);
    float *dh = h->requires_grad ? dt__grad_acc_first(h, &first) : NULL, *dw = w->requires_grad ? dt__grad_acc(w) : NULL;
    const float *hv = dt__in(h), *wv = dt__in(w);
    dt__step_mark before = dt__step_mark_now();   /* the block goes back after: the blocks below reuse it */
    float *d = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)rows * C);
    for (int r0 = 0; r0 < B; r0 += rows) {
        int n = B - r0 < rows ? B - r0 : rows;
        if (!x) dt__lazy_rows(h, w, r0, n, d);    /* the logits that waited, made again, then their gradient in place */
        dt__xent_rows_grad(x ? x + (size_t)r0 * C : d, inv_l + r0, m + r0, labels + r0, d, n, C, job->scale, 1);
        if (dh) dt_gemm(0, in_out, n, in, C, 1.0f, d, C, wv, in_out ? C : in, first ? 0.0f : 1.0f, dh + (size_t)r0 * in, in);
        if (dw && in_out) dt_gemm(1, 0, in, C, n, 1.0f, hv + (size_t)r0 * in, in, d, C, 1.0f, dw, C);
        else if (dw) dt_gemm(1, 0, C, in, n, 1.0f, d, C, hv + (size_t)r0 * in, in, 1.0f, dw, in);
    }
    dt__step_back_to(&before);
    if (dh) dt__grad_acc_done(h, dh);
    if (dw) dt__grad_acc_done(w, dw);
    dt__ctx.flops += 2.0 * B * in * C * ((dh != NULL) + (dw != NULL));
}
static void dt__cross_entropy_backward(dt__tape_entry *e) {
    dt_tensor *logits = e->in[0];
    if (!logits->requires_grad) return;
    int B = (int)dt_tensor_rows(logits), C = (int)dt_tensor_cols(logits), first;
    dt__xent_rows k = dt__xent_rows_at(e->saved, B);
    const double *inv_l = k.inv_l;
    const float *m = k.m, *x;
    const int32_t *labels = k.labels;
    const dt_backend *gpu = dt__backend_for(logits);
    dt__tape_entry *head = dt__xent_head(e, logits);
    x = head && dt__lazy_waiting(logits) && !dt__ctx.lazy.stale ? NULL : dt__in(logits);   /* stale: dt__in says why */
    if (head) {                          /* the head's entry does it; no output gradient: the walk runs it anyway */
        dt__xent_job *job = (dt__xent_job *)dt__step_alloc_uninit(sizeof *job);
        *job = (dt__xent_job){ x, inv_l, m, labels, B, C, e->out->grad[0] / e->farg[0] };
        head->backward = dt__xent_through_head;
        head->saved = job;
        head->out = NULL;
        return;
    }
    float *dl = dt__grad_acc_first(logits, &first);
    if (gpu) gpu->cross_entropy_backward(x, inv_l, m, labels, e->out->grad, dl, B, C, e->farg[0]);
    else dt__xent_rows_grad(x, inv_l, m, labels, dl, B, C, e->out->grad[0] / e->farg[0], first);
    dt__grad_acc_done(logits, dl);
}
/* Logits whose columns tensor parallelism split (dt__vocab_head marks them
   with the wrapper): the ranks that hold the columns, or 1. */
static int dt__logits_split(const dt_tensor *logits) {
    return logits->parallel && !logits->is_param ? logits->parallel->tp_size : 1;
}
/* A row's largest value m, and its sum of exp(x - m) in DT_LANES partial sums
   of doubles (a vocabulary of 50,257 terms loses nothing), the exponentials
   made 256 at a time into a buffer so that they vectorise. */
static double dt__row_softmax(const float *r, int C, float *m) {
    double lanes[DT_LANES] = { 0 }, sum = 0;
    float e[256], mx = *m = dt__row_max(r, C);
    for (int j0 = 0; j0 < C; j0 += 256) {
        int n = C - j0 < 256 ? C - j0 : 256;
        for (int j = 0; j < n; j++) e[j] = dt_exp_value(r[j0 + j] - mx);
        DT__LANE_SUM(lanes, n, j, (double)e[j]);
    }
    for (int l = 0; l < DT_LANES; l++) sum += lanes[l];
    return sum;
}
/* The labels' check, and what the summed loss is divided by: the labels
   that count (or the divisor the run set). */
static double dt__loss_divisor(const int32_t *labels, int B, int C) {
    int counted = 0;
    for (int i = 0; i < B; i++) {
        if (labels[i] == DT_IGNORE_INDEX) continue;
        if (labels[i] < 0 || labels[i] >= C) dt_fail("cross entropy: label %d outside [0, %d)", labels[i], C);
        counted++;
    }
    double divisor = counted > 0 ? counted : 1;               /* nothing counted: the loss is 0 */
    if (dt__ctx.loss_divisor.labels == labels && dt__ctx.loss_divisor.step == dt__ctx.step_resets)
        divisor = dt__ctx.loss_divisor.divisor;
    return divisor;
}
/* Rows [0, B) of the logits lv: each row's m and 1 / l, and its loss (0 where the label is ignored). */
static void dt__xent_rows_forward(const float *lv, const int32_t *labels, double *inv_l, float *m, double *row_loss, int B,
                                  int C) {
    DT_OMP("omp parallel for schedule(static) if((double)B * C > 65536.0)")
    for (int i = 0; i < B; i++) {
        row_loss[i] = inv_l[i] = m[i] = 0;
        if (labels[i] == DT_IGNORE_INDEX) continue;      /* backward never reads its numbers */
        const float *r = lv + (size_t)i * C;
        double sum = dt__row_softmax(r, C, &m[i]);
        inv_l[i] = 1.0 / sum;
        row_loss[i] = -(r[labels[i]] - m[i] - log(sum));
    }
}
static void *dt__cross_entropy_saved(int B) { return dt__step_data((sizeof(double) + sizeof(float) + sizeof(int32_t)) * (size_t)B); }
static dt_tensor *dt__cross_entropy_done(dt_tensor *logits, void *saved, double divisor, dt_tensor *loss) {
    if (dt__wants_grad(logits, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__cross_entropy_backward, loss, logits, NULL, NULL);
        e->saved = saved;
        e->farg[0] = (float)divisor;
    }
    return loss;
}
/* The tensor-parallel chapter's: logits whose vocabulary is split over its group. */
static dt_tensor *dt__cross_entropy_split(dt_tensor *logits, const int32_t *labels);
dt_tensor *dt_cross_entropy(dt_tensor *logits, const int32_t *labels) {
    if (dt__logits_split(logits) > 1) return dt__cross_entropy_split(logits, labels);
    int B = (int)dt_tensor_rows(logits), C = (int)dt_tensor_cols(logits);
    double divisor = dt__loss_divisor(labels, B, C);
    const dt_backend *gpu = dt__backend_for(logits);
    dt__scratch_reset();
    void *saved = dt__cross_entropy_saved(B);
    dt__xent_rows k = dt__xent_rows_at(saved, B);
    double *inv_l = k.inv_l;
    float *m = k.m;
    int32_t *saved_labels = k.labels;
    int s1[1] = { 1 };
    dt_tensor *loss = dt__tensor_alloc(1, s1, DT_F32);        /* the loss is f32, always */
    if (gpu) {
        gpu->upload(saved_labels, labels, sizeof(int32_t) * B);
        gpu->cross_entropy_forward(dt__in(logits), saved_labels, inv_l, m, loss->data, B, C, divisor);
    } else {
        /* rows on every thread, the rows' losses added in row order after */
        double *row_loss = (double *)dt__scratch_on(DT_CPU, sizeof(double) * (size_t)B), total = 0;
        if (dt__lazy_waiting(logits)) {          /* a block of rows at a time, never the whole matrix */
            int rows = dt__xent_block_rows(B, C);
            dt__step_mark before = dt__step_mark_now();
            float *block = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)rows * C);
            for (int r0 = 0; r0 < B; r0 += rows) {
                int n = B - r0 < rows ? B - r0 : rows;
                dt__lazy_rows(dt__ctx.lazy.x, dt__ctx.lazy.w, r0, n, block);
                dt__xent_rows_forward(block, labels + r0, inv_l + r0, m + r0, row_loss + r0, n, C);
            }
            dt__step_back_to(&before);
        } else dt__xent_rows_forward(dt__in(logits), labels, inv_l, m, row_loss, B, C);
        for (int i = 0; i < B; i++) { total += row_loss[i]; saved_labels[i] = labels[i]; }
        loss->data[0] = (float)(total / divisor);
    }
    return dt__cross_entropy_done(logits, saved, divisor, loss);
}

/* Rows first .. first + rows - 1 of the logits on the host, each the whole
   vocabulary: a split vocabulary's columns of those rows all-gathered from
   the group (a collective of the group), then put side by side. */
static void dt__logits_rows_to_host(const dt_tensor *logits, int64_t first, int64_t rows, float *host) {
    dt_parallel *par = logits->parallel;
    int64_t C = dt_tensor_cols(logits);
    if (dt__logits_split(logits) == 1) {
        float *all = rows == dt_tensor_rows(logits) ? host : (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)logits->numel);
        dt_tensor_to_host(logits, all);
        if (all != host) memcpy(host, all + first * C, sizeof(float) * (size_t)(rows * C));
        return;
    }
    int64_t T = par->tp_size, n = rows * C;
    float *all = (float *)dt__scratch_on(logits->device, sizeof(float) * (size_t)(n * T));
    par->tp_all_gather(par, (const float *)dt__in(logits) + first * C, all, n);
    float *h = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)(n * T));
    dt__download_from(logits->device, h, all, sizeof(float) * (size_t)(n * T));
    for (int64_t r = 0; r < T; r++)
        for (int64_t i = 0; i < rows; i++) memcpy(host + (i * T + r) * C, h + (r * rows + i) * C, sizeof(float) * (size_t)C);
}
void dt_logits_to_host(const dt_tensor *logits, float *host) {
    dt__logits_rows_to_host(logits, 0, dt_tensor_rows(logits), host);
}

dt_tensor *dt_patchify(const dt_tensor *images, int patch) {
    int B = images->shape[0], C = images->shape[1], H = images->shape[2], W = images->shape[3];
    int ph = H / patch, pw = W / patch;
    const dt_backend *gpu = dt__backend_for(images);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(B * ph * pw, C * patch * patch);
    const float *iv = dt__in(images);
    float *yv = dt__out(y);
    if (gpu) gpu->patchify(iv, yv, B, C, H, W, patch);
    else
        for (int b = 0; b < B; b++)
            for (int py = 0; py < ph; py++)
                for (int px = 0; px < pw; px++) {
                    float *row = yv + ((size_t)(b * ph + py) * pw + px) * C * patch * patch;
                    for (int c = 0; c < C; c++)
                        for (int ky = 0; ky < patch; ky++)
                            memcpy(row + (c * patch + ky) * patch,
                                   iv + (((size_t)b * C + c) * H + py * patch + ky) * W + px * patch, sizeof(float) * patch);
                }
    dt__out_done(y, yv);
    return y;
}

