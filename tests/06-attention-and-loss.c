/* tests/06-attention-and-loss.c -- tests of dtrain.h's chapter
   06-attention-and-loss: cross-entropy and attention. (tests/helpers.h: how
   the suite's files make one program.) */
#include "helpers.h"

/* Cross-entropy over GPT-2's vocabulary: 50,257 terms per row, summed by the
   threads in partial sums, against a double reference; the loss and the
   gradient the same bits at 1 and 2 threads. The fused classifier keeps two
   numbers a row for backward, not the B x C probabilities. */
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
    size_t kept = 0;
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
        kept = dt__ctx.step[DT_CPU].high;
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
    CHECKF(kept < sizeof(float) * (size_t)lg->numel / 100, "the cross-entropy kept %zu bytes for backward", kept);
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

/* The online body (--attention online: FlashAttention's online softmax, no
   T x T matrix kept) against the matmul body: the outputs and the gradient
   of qkv (written first, and added) within 1e-5 of the largest value, causal
   and not, at 1 token, 5, 64 (one block of keys), 65 and 200 (blocks
   rescaled), with scores spread wide (scale 8: exp would overflow without the
   running max), and with heads 18 wide (its plain loops, where the tiles'
   product needs whole vectors). And the recurrence alone: a row's m and l from blocks of
   any size give the two-pass softmax's max and sum, scores from -1e4 to 80. */
TEST(online_attention_gives_the_matmul_bodys_values, QUICK) {
    static const int shapes[][4] = { { 2, 1, 1, 32 }, { 3, 5, 2, 64 }, { 2, 64, 4, 128 }, { 2, 65, 3, 192 }, { 1, 200, 2, 64 },
                                     { 2, 70, 2, 36 } };   /* the last: heads 18 wide, not whole vectors */
    dt__rng r = { 7 };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int causal = 0; causal < 2; causal++)
            for (int through = 0; through < 2; through++) {
                int B = shapes[s][0], T = shapes[s][1], H = shapes[s][2], D = shapes[s][3];
                size_t n_out = (size_t)B * T * D, n_in = (size_t)B * T * 3 * D;
                dt_tensor *qkv = leaf2(B * T, 3 * D, &r, s == 4 ? 8 : 2);
                float *seed = (float *)malloc(sizeof(float) * n_out), *out[2], *grad[2];
                for (size_t i = 0; i < n_out; i++) seed[i] = (float)rnd(&r);
                for (int online = 0; online < 2; online++) {
                    dt_set_attention_body(online ? DT_ATTENTION_ONLINE : DT_ATTENTION_MATMUL);
                    for (size_t i = 0; i < n_in; i++) qkv->grad[i] = 0.25f;
                    dt_step_arena_reset();
                    dt_tensor *in = through ? dt_add(qkv, dt_tensor_new(qkv->ndim, qkv->shape)) : qkv;
                    size_t before = dt__ctx.step[DT_CPU].high;
                    dt_tensor *o = dt_attention(in, B, T, H, causal);
                    /* what the forward keeps: its output and each row's log-sum-exp, or the T x T probabilities;
                       the f32 output is not kept twice (64-byte pieces, and the tensor's own record) */
                    size_t took = dt__ctx.step[DT_CPU].high - before, kept = online ? (size_t)B * H * T : (size_t)B * H * T * T;
                    CHECKF(took <= sizeof(float) * (n_out + kept) + 256, "attention B=%d T=%d H=%d D=%d, %s body: the forward took "
                           "%zu bytes of the step arena, expected at most %zu", B, T, H, D, online ? "online" : "matmul", took,
                           sizeof(float) * (n_out + kept) + 256);
                    out[online] = (float *)malloc(sizeof(float) * n_out);
                    memcpy(out[online], o->data, sizeof(float) * n_out);
                    dt_backward_from(o, seed);
                    grad[online] = (float *)malloc(sizeof(float) * n_in);
                    memcpy(grad[online], qkv->grad, sizeof(float) * n_in);
                }
                dt_set_attention_body(DT_ATTENTION_MATMUL);
                double d_out = 0, d_grad = 0, m_out = 0, m_grad = 0;
                for (size_t i = 0; i < n_out; i++) { d_out = fmax(d_out, fabs(out[0][i] - out[1][i])); m_out = fmax(m_out, fabs(out[0][i])); }
                for (size_t i = 0; i < n_in; i++) { d_grad = fmax(d_grad, fabs(grad[0][i] - grad[1][i])); m_grad = fmax(m_grad, fabs(grad[0][i])); }
                CHECKF(d_out <= 1e-5 * m_out, "attention B=%d T=%d H=%d D=%d causal=%d: the online forward is %.3g from the matmul "
                       "body's (largest %.3g)", B, T, H, D, causal, d_out, m_out);
                CHECKF(d_grad <= 1e-5 * m_grad, "attention B=%d T=%d H=%d D=%d causal=%d%s: the online backward is %.3g from the "
                       "matmul body's (largest %.3g)", B, T, H, D, causal, through ? " (gradient written first)" : " (adding)", d_grad,
                       m_grad);
                free(seed); free(out[0]); free(out[1]); free(grad[0]); free(grad[1]);
                leaf_free(qkv);
            }
    float row[300];
    for (int k = 0; k < 300; k++) row[k] = k % 7 == 3 ? 80.0f - (float)k / 10 : (float)(-1e4 * rnd(&r) * rnd(&r));
    for (int block = 1; block <= 300; block *= 4) {
        float m = -INFINITY, l = 0, mx = -INFINITY;
        double sum = 0;
        for (int j0 = 0; j0 < 300; j0 += block) {
            float bm = -INFINITY;
            for (int j = j0; j < j0 + block && j < 300; j++) bm = fmaxf(bm, row[j]);
            l *= dt_online_softmax_rescale(&m, bm);
            for (int j = j0; j < j0 + block && j < 300; j++) l += dt_exp_value(row[j] - m);
        }
        for (int j = 0; j < 300; j++) mx = fmaxf(mx, row[j]);
        for (int j = 0; j < 300; j++) sum += dt_exp_value(row[j] - mx);
        CHECKF(m == mx && fabs(l - sum) <= 1e-6 * sum, "the online softmax in blocks of %d: max %g and sum %.9g, two passes %g and %.9g",
               block, m, l, mx, sum);
    }
}

static double losses_differ_by(const char *a, const char *b, int steps);   /* (tests/16-tensor-parallel.c) */
/* --attention online in a stage: 20 steps of the GPT at context 128 (2
   epochs of 10 batches of 4 of its 40 sequences) give the matmul body's
   losses within 1e-5 and its weights and Adam moments within 2e-5, in less
   activation memory -- at least the probabilities the matmul body keeps,
   B x H x T x T floats for each of the 2 layers, less the T numbers a row
   the online body keeps instead (its f32 output is what backward reads).
   Under bf16 the output is not f32, and the online body keeps an f32 copy
   for backward: 20 steps in stage 05 give the matmul body's losses within
   1e-3 (9.9e-5 measured; reading the bf16 output as f32 instead made the
   loss NaN at step 2). On a GPU, heads wider than its
   kernel takes are refused. */
TEST(online_attention_trains_alike_in_less_memory, QUICK) {
    char out[16384], dir[2][700], log[2][800], p[2][900];
    const char *flags = "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 128 --batch-size 4 --epochs 2 --log-every 1000 --quiet";
    static const char *const body[2] = { "matmul", "online" };
    for (int k = 0; k < 2; k++) {
        snprintf(dir[k], sizeof dir[k], "%.600s/att-%s", tmpdir, body[k]);
        snprintf(log[k], sizeof log[k], "%.700s.jsonl", dir[k]);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --attention %s --save-dir %s --log %s", train_cpu, gpt_text(), flags,
                         body[k], dir[k], log[k]);
        CHECKF(st == 0, "01 --attention %s: exit %d\n%s", body[k], st, out);
        snprintf(p[k], sizeof p[k], "%.700s/gpt_data0-40_epoch2", dir[k]);
    }
    if (t_failed) return;
    double dl = losses_differ_by(log[0], log[1], 20), dw = max_tensor_diff(p[0], p[1]);
    CHECKF(dl <= 1e-5, "--attention online: losses %.3g from the matmul body's", dl);
    CHECKF(dw >= 0 && dw <= 2e-5, "--attention online: weights or Adam moments %.3g from the matmul body's", dw);
    double a0 = summary_value(log[0], "peak_activations_bytes"), a1 = summary_value(log[1], "peak_activations_bytes");
    /* two layers' B x H x T x T probabilities, against each row's log-sum-exp (the f32 output is not kept twice) */
    double kept = 2.0 * 4 * 4 * 128 * 128 * 4, instead = 2.0 * (4 * 4 * 128) * 4;
    CHECKF(a0 > 0 && a0 - a1 >= kept - instead, "--attention online: peak activations %.0f bytes, the matmul body's %.0f (expected "
           "%.0f less)", a1, a0, kept - instead);
    for (int k = 0; k < 2; k++) {
        snprintf(log[k], sizeof log[k], "%.600s/att-bf16-%s.jsonl", tmpdir, body[k]);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --dtype bf16 --attention %s --log %s", stage_bin("05-accum-mixed-precision"),
                         gpt_text(), flags, body[k], log[k]);
        CHECKF(st == 0, "05 --dtype bf16 --attention %s: exit %d\n%s", body[k], st, out);
    }
    dl = losses_differ_by(log[0], log[1], 20);
    printf("    bf16: the online body's losses at most %.3g from the matmul body's\n", dl);
    CHECKF(!t_failed && dl <= 1e-3, "--attention online under bf16: losses %.3g from the matmul body's", dl);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --attention online --device cuda --dim 264 --heads 2", train_cpu,
                     gpt_text(), flags);
    CHECKF(st == 2 && strstr(out, "--dim 264 / --heads 2 = 132 columns"), "--attention online --device cuda, heads of 132: exit %d\n%s",
           st, out);
}
