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
   keys and values around again, each block's gradients travelling with it
   until they reach the rank that owns it.

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
   collective of the ring, forward and backward; CPU only so far. */
dt_tensor *dt_ring_attention(dt_tensor *qkv, int B, int T, int H, int causal, const int32_t *positions, dt_comm *ring);
/* Query-key score products the ring attention made on this thread so far,
   forward and backward: a rank's attention work, counted, not timed. */
int64_t dt_ring_attention_scores(void);

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

/* What travels the ring: a rank's block, its T positions (as floats: exact
   below 2^24) then its keys and values, [B*T, D] each; in backward, their
   gradients after them. */
typedef struct dt__ring {
    dt_comm *comm;
    int B, T, H, D, causal;
    float scale, *qpos, *lse, *O;        /* this rank's positions, each row's log-sum-exp [B*H*T], output [B*T, D] */
} dt__ring;
static void dt__ring_pack(const dt__ring *r, const float *qkvv, float *blk) {
    int64_t BT = (int64_t)r->B * r->T, D = r->D;
    float *K = blk + r->T, *V = K + BT * D;
    memcpy(blk, r->qpos, sizeof(float) * (size_t)r->T);
    for (int64_t i = 0; i < BT; i++) {
        memcpy(K + i * D, qkvv + i * 3 * D + D, sizeof(float) * (size_t)D);
        memcpy(V + i * D, qkvv + i * 3 * D + 2 * D, sizeof(float) * (size_t)D);
    }
}
/* How many of a block's keys (positions ascending) a query at position p sees. */
static int dt__ring_visible(const float *kpos, int T, float p, int causal) {
    int lo = 0, hi = T;
    while (causal && lo < hi) {
        int mid = (lo + hi) / 2;
        if (kpos[mid] <= p) lo = mid + 1;
        else hi = mid;
    }
    return causal ? lo : T;
}
static float dt__ring_dot(const float *a, const float *b, int n) {
    float s = 0;
    for (int c = 0; c < n; c++) s += a[c] * b[c];
    return s;
}
/* This rank's queries against the block it holds: each row's (m, l) and
   unnormalised output acc move on by the online softmax. */
static void dt__ring_attend(const dt__ring *r, const float *qkvv, const float *blk, float *m, float *l, float *acc,
                            float *space) {
    int B = r->B, T = r->T, H = r->H, D = r->D, hd = D / H;
    const float *kpos = blk, *K = blk + T, *V = K + (size_t)B * T * D;
    int64_t work = 0;
    DT_OMP("omp parallel for schedule(static) reduction(+:work) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        float *s = space + (size_t)T * (size_t)dt__thread_num();
        for (int i = 0; i < T; i++) {
            int n = dt__ring_visible(kpos, T, r->qpos[i], r->causal);
            if (n == 0) continue;
            const float *q = qkvv + ((size_t)b * T + i) * 3 * D + h * hd;
            float top = -INFINITY, *a = acc + ((size_t)b * T + i) * D + h * hd;
            for (int j = 0; j < n; j++) {
                s[j] = dt__ring_dot(q, K + ((size_t)b * T + j) * D + h * hd, hd) * r->scale;
                top = s[j] > top ? s[j] : top;
            }
            size_t row = (size_t)bh * T + i;
            float c = dt_online_softmax_rescale(&m[row], top);     /* what came before, on the new scale */
            l[row] *= c;
            for (int d = 0; d < hd; d++) a[d] *= c;
            for (int j = 0; j < n; j++) {
                float p = dt_exp_value(s[j] - m[row]);
                const float *v = V + ((size_t)b * T + j) * D + h * hd;
                l[row] += p;
                for (int d = 0; d < hd; d++) a[d] += p * v[d];
            }
            work += n;
        }
    }
    dt__ring_scores += work;
}
/* Backward against the block held: p made again from each row's log-sum-exp;
   dQ into this rank's rows, dK and dV into the block's, which travel with it. */
static void dt__ring_attend_backward(const dt__ring *r, const float *qkvv, const float *dout, const float *rowdot,
                                     float *blk, float *dqkv) {
    int B = r->B, T = r->T, H = r->H, D = r->D, hd = D / H;
    int64_t BTD = (int64_t)B * T * D, work = 0;
    const float *kpos = blk, *K = blk + T, *V = K + BTD;
    float *dK = blk + T + 2 * BTD, *dV = dK + BTD;
    DT_OMP("omp parallel for schedule(static) reduction(+:work) if(B * H > 1)")
    for (int bh = 0; bh < B * H; bh++) {                 /* a head's columns: no two threads write the same */
        int b = bh / H, h = bh % H;
        for (int i = 0; i < T; i++) {
            int n = dt__ring_visible(kpos, T, r->qpos[i], r->causal);
            size_t row = (size_t)bh * T + i, at = ((size_t)b * T + i) * D + h * hd;
            const float *q = qkvv + ((size_t)b * T + i) * 3 * D + h * hd, *dO = dout + at;
            float *dq = dqkv + ((size_t)b * T + i) * 3 * D + h * hd;
            for (int j = 0; j < n; j++) {
                size_t kj = ((size_t)b * T + j) * D + h * hd;
                float p = dt_exp_value(dt__ring_dot(q, K + kj, hd) * r->scale - r->lse[row]);
                float ds = p * (dt__ring_dot(dO, V + kj, hd) - rowdot[row]) * r->scale;
                for (int d = 0; d < hd; d++) {
                    dq[d] += ds * K[kj + d];
                    dK[kj + d] += ds * q[d];
                    dV[kj + d] += p * dO[d];
                }
            }
            work += n;
        }
    }
    dt__ring_scores += work;
}

static void dt__ring_attention_backward(dt__tape_entry *e) {
    dt_tensor *qkv = e->in[0];
    if (!qkv->requires_grad) return;
    const dt__ring *r = (const dt__ring *)e->saved;
    int B = r->B, T = r->T, H = r->H, D = r->D, hd = D / H, C = dt_comm_size(r->comm), first;
    int64_t BTD = (int64_t)B * T * D, nblk = T + 4 * BTD;
    const float *qkvv = dt__in(qkv), *dout = dt__grad_in(e->out);
    float *dqkv = dt__grad_acc_first(qkv, &first);
    if (first) memset(dqkv, 0, sizeof(float) * (size_t)qkv->numel);
    float *rowdot = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)B * H * T);
    float *blk[2] = { (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)nblk) };
    blk[1] = blk[0] + nblk;
    for (int bh = 0; bh < B * H; bh++)                  /* dO . O, the softmax backward's subtrahend */
        for (int i = 0; i < T; i++) {
            size_t at = ((size_t)(bh / H) * T + i) * D + (bh % H) * hd;
            rowdot[(size_t)bh * T + i] = dt__ring_dot(dout + at, r->O + at, hd);
        }
    dt__ring_pack(r, qkvv, blk[0]);
    memset(blk[0] + T + 2 * BTD, 0, sizeof(float) * 2 * (size_t)BTD);
    /* C steps around, then one more shift: a block's gradients home to its
       owner. The gradients are written while the block is held, so here the
       shift waits for the step (forward overlaps them). */
    for (int s = 0; s < C; s++) {
        dt__ring_attend_backward(r, qkvv, dout, rowdot, blk[s & 1], dqkv);
        if (s < C - 1) dt_ring_shift(r->comm, blk[s & 1], blk[(s + 1) & 1], nblk, DT_F32);
        else if (C > 1) dt_ring_shift(r->comm, blk[s & 1] + T + 2 * BTD, blk[(s + 1) & 1] + T + 2 * BTD, 2 * BTD, DT_F32);
    }
    const float *dK = blk[C > 1 ? C & 1 : 0] + T + 2 * BTD, *dV = dK + BTD;
    for (int64_t i = 0; i < (int64_t)B * T; i++)
        for (int d = 0; d < D; d++) {
            dqkv[i * 3 * D + D + d] += dK[i * D + d];
            dqkv[i * 3 * D + 2 * D + d] += dV[i * D + d];
        }
    dt__grad_acc_done(qkv, dqkv);
}

dt_tensor *dt_ring_attention(dt_tensor *qkv, int B, int T, int H, int causal, const int32_t *positions, dt_comm *ring) {
    int D = (int)dt_tensor_cols(qkv) / 3, C = dt_comm_size(ring);
    if (dt_tensor_cols(qkv) != 3 * D || D % H != 0 || dt_tensor_rows(qkv) != (int64_t)B * T)
        dt_fail("ring attention: qkv is [%lld, %lld], expected [%d, 3*D] with D divisible by %d heads",
                (long long)dt_tensor_rows(qkv), (long long)dt_tensor_cols(qkv), B * T, H);
    if (dt__backend_for(qkv)) dt_fail("context parallelism's ring attention runs on the CPU only so far");
    for (int i = 1; i < T; i++)
        if (positions[i] <= positions[i - 1]) dt_fail("ring attention: positions must ascend (%d after %d)", positions[i], positions[i - 1]);
    int64_t BTD = (int64_t)B * T * D, nblk = T + 2 * BTD, rows = (int64_t)B * H * T;
    dt__scratch_reset();
    dt__ring *r = (dt__ring *)dt__step_alloc_uninit(sizeof(dt__ring) + sizeof(float) * (size_t)(T + rows + BTD));
    *r = (dt__ring){ ring, B, T, H, D, causal != 0, 1.0f / sqrtf((float)(D / H)), (float *)(r + 1), NULL, NULL };
    r->lse = r->qpos + T;
    r->O = r->lse + rows;
    for (int i = 0; i < T; i++) r->qpos[i] = (float)positions[i];
    const float *qkvv = dt__in(qkv);
    float *m = (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)rows), *l = m + rows;
    float *space = (float *)dt__scratch_on(DT_CPU, sizeof(float) * (size_t)T * (size_t)dt_threads());
    float *blk[2] = { (float *)dt__scratch_on(DT_CPU, sizeof(float) * 2 * (size_t)nblk) };
    blk[1] = blk[0] + nblk;
    for (int64_t i = 0; i < rows; i++) { m[i] = -INFINITY; l[i] = 0; }
    memset(r->O, 0, sizeof(float) * (size_t)BTD);
    dt__ring_pack(r, qkvv, blk[0]);
    for (int s = 0; s < C; s++) {                         /* the next block travels while this one is used */
        dt_comm_handle next = s < C - 1 ? dt_ring_shift_async(ring, blk[s & 1], blk[(s + 1) & 1], nblk, DT_F32) : 0;
        dt__ring_attend(r, qkvv, blk[s & 1], m, l, r->O, space);
        if (next) dt_comm_wait(ring, next);
    }
    dt_tensor *out = dt__tensor_out_2d(B * T, D);
    float *outv = dt__out(out);
    for (int64_t i = 0; i < BTD; i++) {
        int64_t row = (i / D / T * H + i % D / (D / H)) * T + i / D % T;      /* (b, h, t) of element (b, t, d) */
        outv[i] = r->O[i] = r->O[i] / l[row];
    }
    for (int64_t i = 0; i < rows; i++) r->lse[i] = m[i] + logf(l[i]);
    dt__out_done(out, outv);
    dt__ctx.flops += 4.0 * B * H * T * (double)T * C * (D / H);         /* as dt_attention counts the whole square */
    if (dt__wants_grad(qkv, NULL, NULL)) dt__tape_push(dt__ring_attention_backward, out, qkv, NULL, NULL)->saved = r;
    return out;
}
