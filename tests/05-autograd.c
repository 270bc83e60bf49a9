/* tests/05-autograd.c -- tests of dtrain.h's chapter 05-autograd: ops by
   hand, backward against finite differences, the grad-ready callback.
   (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- autograd: ops by hand, backward against finite differences, the grad-ready callback ---- */

TEST(ops_forward_hand_values, QUICK) {
    dt__rng r = { 3 };
    dt_set_grad_enabled(0);
    /* linear: [1 2] x [[1 0] [0 1] [1 1]]^T + [0.5 0 -1] = [1.5 2 2] */
    dt_tensor *x = leaf2(1, 2, &r, 1), *w = leaf2(3, 2, &r, 1), *b = leaf2(1, 3, &r, 1);
    float xv[] = { 1, 2 }, wv[] = { 1, 0, 0, 1, 1, 1 }, bv[] = { 0.5f, 0, -1 };
    memcpy(x->data, xv, sizeof xv); memcpy(w->data, wv, sizeof wv); memcpy(b->data, bv, sizeof bv);
    dt_tensor *y = dt_linear(x, w, b);
    CHECK(y->data[0] == 1.5f && y->data[1] == 2.0f && y->data[2] == 2.0f);
    /* GELU: x Phi(x) */
    CHECK(dt_gelu_value(0) == 0);
    CHECK(CLOSE(dt_gelu_value(1.0f), 0.8413447460685429, 1e-6));
    CHECK(CLOSE(dt_gelu_value(-1.0f), -0.15865525393145707, 1e-6));
    CHECK(CLOSE(dt_gelu_derivative(1.0f), 0.8413447460685429 + 0.24197072451914337, 1e-6));
    /* layernorm of [1 2 3]: mean 2, variance 2/3 */
    dt_tensor *ln_in = leaf2(1, 3, &r, 1);
    float lv[] = { 1, 2, 3 };
    memcpy(ln_in->data, lv, sizeof lv);
    dt_tensor *ln = dt_layernorm(ln_in, NULL, NULL, 0.0f);
    CHECK(CLOSE(ln->data[0], -1.224744871391589, 1e-6) && fabs(ln->data[1]) < 1e-7 && CLOSE(ln->data[2], 1.224744871391589, 1e-6));
    /* cross-entropy: uniform logits give ln C; logits [0, ln 3] with label 1 give -ln(3/4) */
    dt_tensor *lg = leaf2(2, 10, &r, 0);
    int32_t labels[2] = { 3, 7 };
    CHECK(CLOSE(dt_cross_entropy(lg, labels)->data[0], log(10.0), 1e-6));
    dt_tensor *lg2 = leaf2(1, 2, &r, 0);
    lg2->data[1] = (float)log(3.0);
    int32_t one[1] = { 1 };
    CHECK(CLOSE(dt_cross_entropy(lg2, one)->data[0], -log(0.75), 1e-6));
    /* attention: with zero queries every key scores the same -> the mean of V */
    int T = 2, D = 2;
    dt_tensor *qkv = leaf2(T, 3 * D, &r, 1);
    float qv[] = { 0, 0, 5, 1, 1, 2, 0, 0, -3, 2, 3, 4 };      /* rows: q q k k v v */
    memcpy(qkv->data, qv, sizeof qv);
    dt_tensor *att = dt_attention(qkv, 1, T, 1, 0);
    CHECK(CLOSE(att->data[0], 2.0, 1e-6) && CLOSE(att->data[1], 3.0, 1e-6) && CLOSE(att->data[2], 2.0, 1e-6));
    dt_tensor *causal = dt_attention(qkv, 1, T, 1, 1);         /* token 0 sees only itself */
    CHECK(CLOSE(causal->data[0], 1.0, 1e-6) && CLOSE(causal->data[1], 2.0, 1e-6));
    /* patchify: a 4x4 image of 0..15, patch 2: rows are (y, x) patches, (c, ky, kx) columns */
    int shape[4] = { 1, 1, 4, 4 };
    dt_tensor *img = dt_tensor_new(4, shape);
    for (int i = 0; i < 16; i++) img->data[i] = (float)i;
    dt_tensor *pt = dt_patchify(img, 2);
    float want[16] = { 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15 };
    CHECK(pt->shape[0] == 4 && pt->shape[1] == 4 && memcmp(pt->data, want, sizeof want) == 0);
    /* ViT tokens: [cls; patches] + pos, then the class token back out */
    dt_tensor *patches = leaf2(2, 2, &r, 1), *cls = leaf2(1, 2, &r, 1), *pos = leaf2(3, 2, &r, 1);
    dt_tensor *tok = dt_vit_tokens(patches, cls, pos, 1);
    CHECK(tok->data[0] == cls->data[0] + pos->data[0] && tok->data[3] == patches->data[1] + pos->data[3]);
    dt_tensor *sel = dt_select_token(tok, 1, 2, 1);
    CHECK(sel->data[0] == tok->data[2] && sel->data[1] == tok->data[3]);
    /* GPT-2's pieces: the tanh GELU; a Conv1D weight [in, out] ([[1 1 0] [0 1 1]]: [1 2] -> [1 3 2]); token + position */
    CHECK(CLOSE(dt_gelu_tanh_value(1.0f), 0.8411919906082768, 1e-6) && CLOSE(dt_gelu_tanh_value(-2.0f), -0.04540230591222494, 1e-5));
    dt_tensor *w_io = leaf2(2, 3, &r, 1);
    float wio[] = { 1, 1, 0, 0, 1, 1 };
    memcpy(w_io->data, wio, sizeof wio);
    dt_tensor *yio = dt_linear_in_out(x, w_io, NULL);
    CHECK(yio->shape[1] == 3 && yio->data[0] == 1.0f && yio->data[1] == 3.0f && yio->data[2] == 2.0f);
    dt_tensor *wte = leaf2(5, 2, &r, 1), *wpe = leaf2(3, 2, &r, 1);
    int ts[2] = { 1, 3 };
    float ids[3] = { 4, 0, 4 };
    dt_tensor *emb = dt_token_embedding(dt_tensor_from_host(2, ts, ids), wte, wpe);
    CHECK(emb->shape[0] == 3 && emb->data[0] == wte->data[8] + wpe->data[0] && emb->data[3] == wte->data[1] + wpe->data[3] &&
          emb->data[4] == wte->data[8] + wpe->data[4]);
    dt_set_grad_enabled(1);
    leaf_free(w_io); leaf_free(wte); leaf_free(wpe);
    leaf_free(x); leaf_free(w); leaf_free(b); leaf_free(ln_in); leaf_free(lg); leaf_free(lg2); leaf_free(qkv);
    leaf_free(patches); leaf_free(cls); leaf_free(pos);
}

static dt_tensor *f_linear(dt_tensor **l, void *c) { (void)c; return dt_linear(l[0], l[1], l[2]); }
static dt_tensor *f_gelu(dt_tensor **l, void *c) { (void)c; return dt_gelu(l[0]); }
static dt_tensor *f_layernorm(dt_tensor **l, void *c) { (void)c; return dt_layernorm(l[0], l[1], l[2], 1e-5f); }
static dt_tensor *f_add(dt_tensor **l, void *c) { (void)c; return dt_add(l[0], l[1]); }
static dt_tensor *f_scale(dt_tensor **l, void *c) { (void)c; return dt_scale(l[0], -2.5f); }   /* LoRA's alpha / r */
static dt_tensor *f_attention(dt_tensor **l, void *c) { return dt_attention(l[0], 2, 5, 2, *(int *)c); }
static dt_tensor *f_attention_37(dt_tensor **l, void *c) { return dt_attention(l[0], 1, 37, 2, *(int *)c); }
static dt_tensor *f_attention_wide(dt_tensor **l, void *c) { return dt_attention(l[0], 2, 19, 2, *(int *)c); }
static dt_tensor *f_tokens(dt_tensor **l, void *c) { (void)c; return dt_vit_tokens(l[0], l[1], l[2], 2); }
static dt_tensor *f_select(dt_tensor **l, void *c) { (void)c; return dt_select_token(l[0], 2, 3, 1); }
static dt_tensor *f_xent(dt_tensor **l, void *c) { return dt_cross_entropy(l[0], (const int32_t *)c); }
static dt_tensor *f_linear_io(dt_tensor **l, void *c) { (void)c; return dt_linear_in_out(l[0], l[1], l[2]); }
static dt_tensor *f_gelu_tanh(dt_tensor **l, void *c) { (void)c; return dt_gelu_tanh(l[0]); }
static dt_tensor *f_linear_gelu(dt_tensor **l, void *c) { (void)c; return dt_linear_gelu(l[0], l[1], l[2]); }
static dt_tensor *f_embed(dt_tensor **l, void *c) {       /* 2 sequences of 4 ids, some repeated: their rows add up */
    static const float ids[8] = { 3, 1, 3, 0, 2, 3, 1, 1 };
    int s[2] = { 2, 4 };
    (void)c;
    return dt_token_embedding(dt_tensor_from_host(2, s, ids), l[0], l[1]);
}

TEST(backward_matches_finite_differences, FULL) {
    dt__rng r = { 4 };
    dt_tensor *x = leaf2(5, 7, &r, 1), *w = leaf2(4, 7, &r, 1), *b = leaf2(1, 4, &r, 1);
    dt_tensor *L1[3] = { x, w, b };
    fd_check("linear", f_linear, L1, 3, NULL, 1e-2f, 2e-3);
    dt_tensor *g = leaf2(6, 9, &r, 3);
    fd_check("gelu", f_gelu, &g, 1, NULL, 1e-3f, 2e-3);
    dt_tensor *lx = leaf2(4, 8, &r, 2), *lw = leaf2(1, 8, &r, 1), *lb = leaf2(1, 8, &r, 1);
    dt_tensor *L3[3] = { lx, lw, lb };
    fd_check("layernorm", f_layernorm, L3, 3, NULL, 1e-2f, 3e-3);
    dt_tensor *a1 = leaf2(3, 4, &r, 1), *a2 = leaf2(3, 4, &r, 1);
    dt_tensor *L4[2] = { a1, a2 };
    fd_check("add", f_add, L4, 2, NULL, 1e-2f, 1e-3);
    dt__rng rs = { 41 };
    dt_tensor *sc = leaf2(3, 5, &rs, 1);
    fd_check("scale", f_scale, &sc, 1, NULL, 1e-2f, 1e-3);
    leaf_free(sc);
    dt_tensor *qkv = leaf2(2 * 5, 3 * 6, &r, 1);
    int causal = 0;
    fd_check("attention", f_attention, &qkv, 1, &causal, 1e-2f, 3e-3);
    causal = 1;
    fd_check("causal attention", f_attention, &qkv, 1, &causal, 1e-2f, 3e-3);
    /* rows longer than the 16 lanes of LayerNorm's and the softmax's sums */
    dt_tensor *wx = leaf2(3, 40, &r, 2), *ww = leaf2(1, 40, &r, 1), *wb = leaf2(1, 40, &r, 1);
    dt_tensor *L3w[3] = { wx, ww, wb };
    fd_check("layernorm, 40 wide", f_layernorm, L3w, 3, NULL, 1e-2f, 3e-3);
    dt_tensor *qkv37 = leaf2(37, 3 * 16, &r, 1);
    for (causal = 0; causal < 2; causal++)
        fd_check(causal ? "causal attention, 37 tokens" : "attention, 37 tokens", f_attention_37, &qkv37, 1, &causal, 1e-2f, 3e-3);
    /* heads 32 wide: a whole number of vectors, so the CPU's tiled body runs
       (19 tokens: the last row tile is short) */
    dt_tensor *qkvw = leaf2(2 * 19, 3 * 64, &r, 1);
    for (causal = 0; causal < 2; causal++)
        fd_check(causal ? "causal attention, heads of 32" : "attention, heads of 32", f_attention_wide, &qkvw, 1, &causal, 1e-2f, 3e-3);
    leaf_free(wx); leaf_free(ww); leaf_free(wb); leaf_free(qkv37); leaf_free(qkvw);
    dt_tensor *pp = leaf2(4, 3, &r, 1), *pc = leaf2(1, 3, &r, 1), *pe = leaf2(3, 3, &r, 1);
    dt_tensor *L5[3] = { pp, pc, pe };
    fd_check("vit tokens", f_tokens, L5, 3, NULL, 1e-2f, 1e-3);
    dt_tensor *st = leaf2(6, 4, &r, 1);
    fd_check("select token", f_select, &st, 1, NULL, 1e-2f, 1e-3);
    dt_tensor *lg = leaf2(5, 6, &r, 2);
    int32_t labels[5] = { 0, 5, 2, 2, 3 };
    fd_check("cross entropy", f_xent, &lg, 1, labels, 1e-2f, 2e-3);
    int32_t masked[5] = { 0, DT_IGNORE_INDEX, 2, DT_IGNORE_INDEX, 3 };   /* a prompt's positions count for nothing */
    fd_check("cross entropy with ignored labels", f_xent, &lg, 1, masked, 1e-2f, 2e-3);
    dt_tensor *ix = leaf2(5, 7, &r, 1), *iw = leaf2(7, 4, &r, 1), *ib = leaf2(1, 4, &r, 1);
    dt_tensor *L6[3] = { ix, iw, ib };
    fd_check("linear [in, out]", f_linear_io, L6, 3, NULL, 1e-2f, 2e-3);
    dt_tensor *gt = leaf2(6, 9, &r, 3);
    fd_check("gelu tanh", f_gelu_tanh, &gt, 1, NULL, 1e-3f, 2e-3);
    dt_tensor *te = leaf2(4, 3, &r, 1), *tp = leaf2(5, 3, &r, 1);    /* a vocabulary of 4; 5 positions, 4 used */
    dt_tensor *L7[2] = { te, tp };
    fd_check("token embedding", f_embed, L7, 2, NULL, 1e-2f, 1e-3);
    leaf_free(ix); leaf_free(iw); leaf_free(ib); leaf_free(gt); leaf_free(te); leaf_free(tp);
    leaf_free(x); leaf_free(w); leaf_free(b); leaf_free(g); leaf_free(lx); leaf_free(lw); leaf_free(lb);
    leaf_free(a1); leaf_free(a2); leaf_free(qkv); leaf_free(pp); leaf_free(pc); leaf_free(pe); leaf_free(st); leaf_free(lg);
}

/* LayerNorm's weight and bias gradients sum over every row: over 4 million
   rows they must still be the sums (a double reference here), not what a
   running float sum keeps of them (8e-5 off, found on the first GPU run). */
TEST(layernorm_weight_and_bias_gradients_stay_exact_over_millions_of_rows, QUICK) {
    dt__rng r = { 12 };
    int N = 4194304 + 77, D = 4;
    dt_tensor *x = leaf2(N, D, &r, 1), *w = leaf2(1, D, &r, 1), *b = leaf2(1, D, &r, 1);
    float *seed = (float *)malloc(sizeof(float) * (size_t)N * D);
    for (int64_t i = 0; i < (int64_t)N * D; i++) seed[i] = (float)rnd(&r);
    dt_step_arena_reset();
    dt_backward_from(dt_layernorm(x, w, b, 1e-5f), seed);
    double dw[4] = { 0 }, db[4] = { 0 }, scale_w = 0, scale_b = 0, err_w = 0, err_b = 0;
    for (int i = 0; i < N; i++) {
        const float *xr = x->data + (size_t)i * D;
        double mean = 0, var = 0;
        for (int j = 0; j < D; j++) mean += xr[j] / (double)D;
        for (int j = 0; j < D; j++) var += (xr[j] - mean) * (xr[j] - mean) / D;
        for (int j = 0; j < D; j++) {
            dw[j] += seed[(size_t)i * D + j] * (xr[j] - mean) / sqrt(var + 1e-5);
            db[j] += seed[(size_t)i * D + j];
        }
    }
    for (int j = 0; j < D; j++) {
        scale_w = fmax(scale_w, fabs(dw[j])); scale_b = fmax(scale_b, fabs(db[j]));
        err_w = fmax(err_w, fabs(w->grad[j] - dw[j])); err_b = fmax(err_b, fabs(b->grad[j] - db[j]));
    }
    CHECKF(err_w <= 1e-6 * scale_w, "weight gradient off by %.3g of its largest (%.4g)", err_w / scale_w, scale_w);
    CHECKF(err_b <= 1e-6 * scale_b, "bias gradient off by %.3g of its largest (%.4g)", err_b / scale_b, scale_b);
    dt_step_arena_reset();
    free(seed); leaf_free(x); leaf_free(w); leaf_free(b);
}

static int hook_order[64], hook_count;
static dt_model *hook_model;
static void record_hook(dt_parallel *par, dt_tensor *p) { (void)par; hook_order[hook_count++] = (int)(p - hook_model->params); }

TEST(grad_ready_hook_fires_once_per_parameter_in_reverse, QUICK) {
    dt_model_config c = { DT_MODEL_MLP, 3, 4, 3, 8, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 2);
    hook_model = m;
    hook_count = 0;
    dt_parallel recorder = { .create_fn = "recorder", .sync_fn = "recorder", .free_fn = "recorder", .grad_ready = record_hook };
    dt_model_set_parallel(m, &recorder);
    dt_step_arena_reset();
    int shape[4] = { 2, 3, 4, 4 };
    dt_tensor *img = dt_tensor_new(4, shape);
    int32_t labels[2] = { 0, 2 };
    dt_backward(dt_cross_entropy(dt_model_forward(m, img), labels));
    dt_model_set_parallel(m, NULL);
    CHECKF(hook_count == m->nparams, "%d calls for %d parameters", hook_count, m->nparams);
    /* fc3 is the last layer, so its weight and bias are ready first */
    CHECK(hook_count >= 2 && hook_order[0] >= m->nparams - 2 && hook_order[hook_count - 1] <= 1);
    dt_model_free(m);
}
