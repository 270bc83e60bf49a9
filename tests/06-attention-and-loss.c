/* tests/06-attention-and-loss.c -- tests of dtrain.h's chapter
   06-attention-and-loss: cross-entropy and attention. (tests/helpers.h: how
   the suite's files make one program.) */
#include "helpers.h"

/* Cross-entropy over GPT-2's vocabulary: 50,257 terms per row, summed by the
   threads in partial sums, against a double reference; the loss and the
   gradient the same bits at 1 and 2 threads. */
TEST(cross_entropy_over_a_large_vocabulary_matches_double_at_any_thread_count, QUICK) {
    int B = 7, C = 50257;
    dt__rng r = { 8 };
    dt_tensor *lg = leaf2(B, C, &r, 8);
    int32_t labels[7];
    double want = 0;
    for (int i = 0; i < B; i++) {
        labels[i] = (int32_t)(dt__rng_u64(&r) % (uint64_t)C);
        const float *row = lg->data + (size_t)i * C;
        double mx = row[0], sum = 0;
        for (int j = 1; j < C; j++) mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j < C; j++) sum += exp((double)row[j] - mx);
        want += -((double)row[labels[i]] - mx - log(sum)) / B;
    }
    float loss[2], *grad[2];
#ifdef _OPENMP
    int keep = omp_get_max_threads();
#endif
    for (int t = 0; t < 2; t++) {
#ifdef _OPENMP
        omp_set_num_threads(t + 1);
#endif
        memset(lg->grad, 0, sizeof(float) * (size_t)lg->numel);
        dt_step_arena_reset();
        dt_tensor *l = dt_cross_entropy(lg, labels);
        loss[t] = l->data[0];
        dt_backward(l);
        grad[t] = (float *)malloc(sizeof(float) * (size_t)lg->numel);
        memcpy(grad[t], lg->grad, sizeof(float) * (size_t)lg->numel);
    }
#ifdef _OPENMP
    omp_set_num_threads(keep);
#endif
    CHECKF(fabs(loss[0] - want) <= 1e-6 * fabs(want), "cross-entropy %.9g, double reference %.9g", loss[0], want);
    CHECK(loss[0] == loss[1]);
    CHECK(memcmp(grad[0], grad[1], sizeof(float) * (size_t)lg->numel) == 0);
    double worst = 0;          /* d loss / d logit = (softmax - onehot) / B */
    for (int i = 0; i < B; i++) {
        const float *row = lg->data + (size_t)i * C;
        double mx = row[0], sum = 0;
        for (int j = 1; j < C; j++) mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j < C; j++) sum += exp((double)row[j] - mx);
        for (int j = 0; j < C; j++) {
            double g = (exp((double)row[j] - mx) / sum - (j == labels[i])) / B;
            double d = fabs(grad[0][(size_t)i * C + j] - g);
            worst = d > worst ? d : worst;
        }
    }
    CHECKF(worst <= 1e-7, "cross-entropy gradient: error %.3g", worst);
    free(grad[0]); free(grad[1]);
    leaf_free(lg);
}

/* Instruction data: a label of -100 (a prompt's position) adds nothing to the
   loss or its gradient, the mean is over the labels that count, and a divisor
   the run sets for these very labels replaces their count, for this step only. */
TEST(cross_entropy_ignores_masked_labels_and_takes_the_divisor_it_is_given, QUICK) {
    int B = 6, C = 11;
    dt__rng r = { 21 };
    dt_tensor *lg = leaf2(B, C, &r, 3);
    int32_t labels[6] = { 3, DT_IGNORE_INDEX, 0, DT_IGNORE_INDEX, 10, 7 };
    double sum = 0, prob[6][11];
    for (int i = 0; i < B; i++) {
        const float *row = lg->data + (size_t)i * C;
        double mx = row[0], z = 0;
        for (int j = 1; j < C; j++) mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j < C; j++) z += exp((double)row[j] - mx);
        for (int j = 0; j < C; j++) prob[i][j] = exp((double)row[j] - mx) / z;
        if (labels[i] != DT_IGNORE_INDEX) sum -= log(prob[i][labels[i]]);
    }
    for (int k = 0; k < 2; k++) {                  /* its own count (4), then a divisor of 2.5 */
        double divisor = k ? 2.5 : 4;
        memset(lg->grad, 0, sizeof(float) * (size_t)lg->numel);
        dt_step_arena_reset();
        if (k) dt_cross_entropy_set_divisor(labels, divisor);
        dt_tensor *l = dt_cross_entropy(lg, labels);
        CHECKF(fabs(l->data[0] - sum / divisor) <= 1e-6 * sum, "divisor %g: loss %.9g, expected %.9g", divisor, l->data[0],
               sum / divisor);
        dt_backward(l);
        double worst = 0;
        for (int i = 0; i < B; i++)
            for (int j = 0; j < C; j++) {
                double g = labels[i] == DT_IGNORE_INDEX ? 0 : (prob[i][j] - (j == labels[i])) / divisor;
                worst = fmax(worst, fabs(lg->grad[(size_t)i * C + j] - g));
            }
        CHECKF(worst <= 1e-7, "divisor %g: gradient off by %.3g (ignored rows must get none)", divisor, worst);
    }
    /* the divisor belonged to that step and those labels: a new step counts again */
    dt_step_arena_reset();
    CHECK(fabs(dt_cross_entropy(lg, labels)->data[0] - sum / 4) <= 1e-6 * sum);
    int32_t none[6] = { DT_IGNORE_INDEX, DT_IGNORE_INDEX, DT_IGNORE_INDEX, DT_IGNORE_INDEX, DT_IGNORE_INDEX, DT_IGNORE_INDEX };
    dt_step_arena_reset();
    CHECK(dt_cross_entropy(lg, none)->data[0] == 0);
    leaf_free(lg);
}

TEST(causal_attention_ignores_later_tokens, QUICK) {
    dt__rng r = { 5 };
    int T = 6, D = 8, H = 2;
    dt_tensor *qkv = leaf2(T, 3 * D, &r, 1);
    dt_set_grad_enabled(0);
    dt_step_arena_reset();
    float before[6 * 8];
    memcpy(before, dt_attention(qkv, 1, T, H, 1)->data, sizeof before);
    for (int j = 0; j < 3 * D; j++) qkv->data[(T - 1) * 3 * D + j] += 3.0f;  /* change the last token */
    dt_tensor *after = dt_attention(qkv, 1, T, H, 1);
    CHECK(memcmp(before, after->data, sizeof(float) * (T - 1) * D) == 0);          /* earlier rows: same */
    CHECK(memcmp(before + (T - 1) * D, after->data + (T - 1) * D, sizeof(float) * D) != 0); /* last: changed */
    dt_set_grad_enabled(1);
    leaf_free(qkv);
}

/* The CPU's tiled attention promises the bits of the straightforward body
   (per head, two matmuls forward and four backward through dt_gemm): the
   same sums in the same order. Checked on vit-tiny's and the GPT's shapes,
   5 tokens, 1 token and 130; forward, and backward both adding to a
   gradient and writing it first. With a system BLAS (DT_HAVE_CBLAS) the
   straightforward body sums in the BLAS's order: there the two agree within
   rounding instead. */
TEST(tiled_attention_gives_the_bits_of_the_matmul_body, QUICK) {
    static const int shapes[][4] = { { 2, 65, 3, 192 }, { 2, 64, 4, 128 }, { 3, 5, 2, 64 }, { 2, 1, 1, 32 }, { 1, 130, 2, 128 } };
    dt__rng r = { 6 };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int causal = 0; causal < 2; causal++)
            for (int through = 0; through < 2; through++) {
                int B = shapes[s][0], T = shapes[s][1], H = shapes[s][2], D = shapes[s][3];
                size_t n_out = (size_t)B * T * D, n_in = (size_t)B * T * 3 * D;
                dt_tensor *qkv = leaf2(B * T, 3 * D, &r, 2);
                float *seed = (float *)malloc(sizeof(float) * n_out), *out[2], *grad[2];
                for (size_t i = 0; i < n_out; i++) seed[i] = (float)rnd(&r);
                for (int by_gemm = 0; by_gemm < 2; by_gemm++) {
                    dt__attention_by_gemm = by_gemm;
                    for (size_t i = 0; i < n_in; i++) qkv->grad[i] = 0.25f;
                    dt_step_arena_reset();
                    dt_tensor *in = through ? dt_add(qkv, dt_tensor_new(qkv->ndim, qkv->shape)) : qkv;
                    dt_tensor *o = dt_attention(in, B, T, H, causal);
                    out[by_gemm] = (float *)malloc(sizeof(float) * n_out);
                    memcpy(out[by_gemm], o->data, sizeof(float) * n_out);
                    dt_backward_from(o, seed);
                    grad[by_gemm] = (float *)malloc(sizeof(float) * n_in);
                    memcpy(grad[by_gemm], qkv->grad, sizeof(float) * n_in);
                }
                dt__attention_by_gemm = 0;
#ifdef DT_HAVE_CBLAS                          /* within 1e-5 of the largest value, as the GPU's ops */
                double d_out = 0, d_grad = 0, m_out = 0, m_grad = 0;
                for (size_t i = 0; i < n_out; i++) { d_out = fmax(d_out, fabs(out[0][i] - out[1][i])); m_out = fmax(m_out, fabs(out[1][i])); }
                for (size_t i = 0; i < n_in; i++) { d_grad = fmax(d_grad, fabs(grad[0][i] - grad[1][i])); m_grad = fmax(m_grad, fabs(grad[1][i])); }
                int same_out = d_out <= 1e-5 * m_out, same_grad = d_grad <= 1e-5 * m_grad;
#else
                int same_out = memcmp(out[0], out[1], sizeof(float) * n_out) == 0;
                int same_grad = memcmp(grad[0], grad[1], sizeof(float) * n_in) == 0;
#endif
                CHECKF(same_out, "attention B=%d T=%d H=%d D=%d causal=%d: the tiled forward differs from the matmul body", B, T, H,
                       D, causal);
                CHECKF(same_grad, "attention B=%d T=%d H=%d D=%d causal=%d%s: the tiled backward differs from the matmul body", B, T,
                       H, D, causal, through ? " (gradient written first)" : " (adding)");
                free(seed); free(out[0]); free(out[1]); free(grad[0]); free(grad[1]);
                leaf_free(qkv);
            }
}
