/* tests/04-matmul.c -- tests of dtrain.h's chapter 04-matmul: the kernels
   against a reference, half types, the GPU launch shape, exp, tanh and erf.
   (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- kernels: matmul, half types, the GPU launch shape ------------------- */

static void naive_gemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                       int ldb, float beta, const float *C0, int ldc, double *out) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = 0;
            for (int k = 0; k < K; k++)
                s += (double)(ta ? A[k * lda + i] : A[i * lda + k]) * (tb ? B[j * ldb + k] : B[k * ldb + j]);
            out[i * N + j] = alpha * s + (beta == 0 ? 0 : beta * C0[i * ldc + j]);
        }
}

TEST(gemm_matches_reference, QUICK) {
    int sizes[][3] = { { 1, 1, 1 }, { 7, 5, 3 }, { 37, 129, 300 }, { 130, 70, 513 }, { 3, 200, 17 }, { 64, 64, 0 },
                      { 21, 1100, 40 },     /* B in two panels (transposed A; A in place: one, 6,528 wide) */
                      /* whole tiles of 14 rows (AVX-512's MR) and one row past them; 229 = 16 x 14 + 5
                         rows in three blocks of rows, two slabs; one row across two panels */
                      { 14, 32, 256 }, { 15, 33, 257 }, { 229, 65, 300 }, { 1, 1100, 300 },
                      /* A in place sums K <= 768 in one slab, B's panel then 1 MiB (352 columns at
                         K = 700 with AVX-512), and past 768 in slabs of 256 as a transposed A does (the
                         slabs above are a transposed A's) */
                      { 20, 400, 700 }, { 17, 40, 768 }, { 17, 40, 769 }, { 17, 40, 800 } };
    float alphas[] = { 1.0f, 0.5f }, betas[] = { 0.0f, 1.0f, 0.3f };
    dt__rng r = { 1 };
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int ab = 0; ab < 6; ab++) {
                    int M = sizes[s][0], N = sizes[s][1], K = sizes[s][2], pad = 3;
                    float alpha = alphas[ab % 2], beta = betas[ab / 2];
                    int lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
                    int arows = ta ? K : M, brows = tb ? N : K;
                    float *A = (float *)malloc(sizeof(float) * ((size_t)arows * lda + 1));
                    float *B = (float *)malloc(sizeof(float) * ((size_t)brows * ldb + 1));
                    float *C = (float *)malloc(sizeof(float) * (size_t)M * ldc), *C0 = (float *)malloc(sizeof(float) * (size_t)M * ldc);
                    double *ref = (double *)malloc(sizeof(double) * (size_t)M * N);
                    for (int i = 0; i < arows * lda; i++) A[i] = (float)rnd(&r);
                    for (int i = 0; i < brows * ldb; i++) B[i] = (float)rnd(&r);
                    for (int i = 0; i < M * ldc; i++) C[i] = C0[i] = beta == 0 ? NAN : (float)rnd(&r); /* beta 0 must not read C */
                    naive_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C0, ldc, ref);
                    dt_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
                    double worst = 0;
                    for (int i = 0; i < M; i++)
                        for (int j = 0; j < N; j++) {
                            double e = fabs(C[i * ldc + j] - ref[i * N + j]) / (1 + fabs(ref[i * N + j]));
                            if (!(e <= worst)) worst = e;
                        }
                    CHECKF(worst < 1e-4, "M=%d N=%d K=%d ta=%d tb=%d alpha=%g beta=%g: error %g", M, N, K, ta, tb, alpha, beta, worst);
                    int pad_ok = 1;          /* the padding columns of C are untouched */
                    for (int i = 0; i < M; i++)
                        for (int j = N; j < ldc; j++)
                            if (memcmp(&C[i * ldc + j], &C0[i * ldc + j], sizeof(float))) pad_ok = 0;
                    CHECKF(pad_ok, "gemm wrote outside C (M=%d N=%d)", M, N);
                    free(A); free(B); free(C); free(C0); free(ref);
                }
}

/* Rows 4 KB apart (a pitch of 1024 floats) are packed rather than read in
   place (they would evict each other in the L1 cache): a copy, so the
   product's bits are those of the same A laid out densely and read in place.
   A transposed B is packed in squares turned in registers at either pitch;
   the reference checks those. K = 300 and 37 columns of B leave a part of a
   square and of a strip to the element-by-element rest. */
TEST(gemm_gives_the_same_bits_at_a_pitch_the_cache_aliases, QUICK) {
    int M = 45, N = 70, K = 300, wide = 1024;
    dt__rng r = { 3 };
    float *A = (float *)malloc(sizeof(float) * M * wide), *B = (float *)malloc(sizeof(float) * (K > N ? K : N) * wide);
    float *Ad = (float *)malloc(sizeof(float) * M * K), *Bd = (float *)malloc(sizeof(float) * K * N);
    float *C1 = (float *)malloc(sizeof(float) * M * N), *C2 = (float *)malloc(sizeof(float) * M * N);
    double *ref = (double *)malloc(sizeof(double) * M * N);
    for (int i = 0; i < M * wide; i++) A[i] = (float)rnd(&r);
    for (int i = 0; i < (K > N ? K : N) * wide; i++) B[i] = (float)rnd(&r);
    for (int tb = 0; tb < 2; tb++)
        for (int n = 37; n <= N; n += N - 37) {
            for (int i = 0; i < M; i++) memcpy(Ad + (size_t)i * K, A + (size_t)i * wide, sizeof(float) * K);
            int brows = tb ? n : K, bcols = tb ? K : n;
            for (int i = 0; i < brows; i++) memcpy(Bd + (size_t)i * bcols, B + (size_t)i * wide, sizeof(float) * bcols);
            dt_gemm(0, tb, M, n, K, 1, A, wide, B, wide, 0, C1, n);
            dt_gemm(0, tb, M, n, K, 1, Ad, K, Bd, bcols, 0, C2, n);
            naive_gemm(0, tb, M, n, K, 1, Ad, K, Bd, bcols, 0, NULL, n, ref);
            double worst = 0;
            for (int i = 0; i < M * n; i++) {
                double e = fabs(C1[i] - ref[i]) / (1 + fabs(ref[i]));
                if (!(e <= worst)) worst = e;
            }
            CHECKF(worst < 1e-4, "tb=%d N=%d at a pitch of %d: error %g", tb, n, wide, worst);
            CHECKF(memcmp(C1, C2, sizeof(float) * M * n) == 0, "tb=%d N=%d: a pitch of %d and a dense layout differ", tb, n, wide);
        }
    free(A); free(B); free(Ad); free(Bd); free(C1); free(C2); free(ref);
}

TEST(gemm_same_result_for_any_thread_count, QUICK) {
#ifndef _OPENMP
    SKIP("built without OpenMP");
#else
    int M = 203, N = 300, K = 700;     /* 203: a last block of rows that is not whole */
    dt__rng r = { 2 };
    float *A = (float *)malloc(sizeof(float) * M * K), *B = (float *)malloc(sizeof(float) * K * N);
    float *C1 = (float *)malloc(sizeof(float) * M * N), *C2 = (float *)malloc(sizeof(float) * M * N);
    for (int i = 0; i < M * K; i++) A[i] = (float)rnd(&r);
    for (int i = 0; i < K * N; i++) B[i] = (float)rnd(&r);
    int keep = omp_get_max_threads();
    for (int tab = 0; tab < 4; tab++) {   /* 1, 2 and 3 threads cut the rows into different blocks */
        int ta = tab / 2, tb = tab % 2;
        omp_set_num_threads(1);
        dt_gemm(ta, tb, M, N, K, 1, A, ta ? M : K, B, tb ? K : N, 0, C1, N);
        for (int t = 2; t <= 3; t++) {
            omp_set_num_threads(t);
            dt_gemm(ta, tb, M, N, K, 1, A, ta ? M : K, B, tb ? K : N, 0, C2, N);
            CHECKF(memcmp(C1, C2, sizeof(float) * M * N) == 0, "ta=%d tb=%d: 1 and %d threads differ", ta, tb, t);
        }
    }
    omp_set_num_threads(keep);
    free(A); free(B); free(C1); free(C2);
#endif
}

/* A linear layer's bias, and the MLP's GELU, are applied by the matmul as it
   stores each tile (dt__epilogue): the bits must be those of the matmul
   followed by the separate loops -- the bias after the last slab of K (700:
   one slab; 900: four), GELU of exactly what was stored -- and the fused op's
   tape must give the separate ops' gradients. */
TEST(linear_bias_and_gelu_in_the_matmul_give_the_separate_ops_bits, QUICK) {
    int M = 67, N = 1030;                 /* edge tiles in rows and columns; two or three panels of columns */
    dt__rng r = { 3 };
    for (int in_out = 0; in_out < 2; in_out++) {
        int K = in_out ? 900 : 700;
        dt_tensor *x = leaf2(M, K, &r, 1), *w = in_out ? leaf2(K, N, &r, 0.1) : leaf2(N, K, &r, 0.1), *b = leaf2(1, N, &r, 1);
        float *want = (float *)malloc(sizeof(float) * M * N), *act = (float *)malloc(sizeof(float) * M * N);
        dt_gemm(0, !in_out, M, N, K, 1.0f, x->data, K, w->data, in_out ? N : K, 0.0f, want, N);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) want[i * N + j] += b->data[j];
        for (int i = 0; i < M * N; i++) act[i] = in_out ? dt_gelu_tanh_value(want[i]) : dt_gelu_value(want[i]);
        dt_step_arena_reset();
        dt_tensor *y = in_out ? dt_linear_in_out(x, w, b) : dt_linear(x, w, b);
        CHECKF(memcmp(y->data, want, sizeof(float) * M * N) == 0, "linear%s: the bias in the matmul changed bits", in_out ? " in_out" : "");
        float *grads[2][3];
        for (int fused = 0; fused < 2; fused++) {
            dt_tensor *L[3] = { x, w, b };
            for (int k = 0; k < 3; k++) memset(L[k]->grad, 0, sizeof(float) * (size_t)L[k]->numel);
            dt_step_arena_reset();
            dt_tensor *g = fused ? (in_out ? dt_linear_in_out_gelu_tanh(x, w, b) : dt_linear_gelu(x, w, b))
                                 : (in_out ? dt_gelu_tanh(dt_linear_in_out(x, w, b)) : dt_gelu(dt_linear(x, w, b)));
            CHECKF(memcmp(g->data, act, sizeof(float) * M * N) == 0, "linear%s + GELU (%s): not GELU of the linear's output",
                   in_out ? " in_out" : "", fused ? "fused" : "separate");
            float *seed = (float *)malloc(sizeof(float) * M * N);
            dt__rng rs = { 9 };
            for (int i = 0; i < M * N; i++) seed[i] = (float)rnd(&rs);
            dt_backward_from(g, seed);
            free(seed);
            for (int k = 0; k < 3; k++) {
                grads[fused][k] = (float *)malloc(sizeof(float) * (size_t)L[k]->numel);
                memcpy(grads[fused][k], L[k]->grad, sizeof(float) * (size_t)L[k]->numel);
            }
        }
        for (int k = 0; k < 3; k++) {
            int64_t n = k == 0 ? x->numel : k == 1 ? w->numel : b->numel;
            CHECKF(memcmp(grads[0][k], grads[1][k], sizeof(float) * (size_t)n) == 0,
                   "linear%s + GELU: the fused op's gradient of input %d differs from the separate ops'", in_out ? " in_out" : "", k);
            free(grads[0][k]); free(grads[1][k]);
        }
        free(want); free(act);
        leaf_free(x); leaf_free(w); leaf_free(b);
    }
}

/* The sums the routine adds as it packs (a bias's gradient from the weight
   gradient's matmul): op(A)'s row sums and op(B)'s column sums over k, the
   bits of a loop that adds them k by k in order onto what was there, for
   both transposes of each (packed, or summed apart), over three slabs of K (a transposed A's),
   two panels of columns (N 1030: the row sums once, not per panel) and 1, 2
   and 3 threads; C unchanged by them. */
TEST(gemm_sums_of_its_operands_as_it_packs_them, QUICK) {
    int M = 203, N = 1030, K = 700;
    dt__rng r = { 4 };
    float *A = (float *)malloc(sizeof(float) * M * K), *B = (float *)malloc(sizeof(float) * K * N);
    float *C = (float *)malloc(sizeof(float) * M * N), *C0 = (float *)malloc(sizeof(float) * M * N);
    float *sa = (float *)malloc(sizeof(float) * M), *sb = (float *)malloc(sizeof(float) * N);
    float *want_a = (float *)malloc(sizeof(float) * M), *want_b = (float *)malloc(sizeof(float) * N);
    for (int i = 0; i < M * K; i++) A[i] = (float)rnd(&r);
    for (int i = 0; i < K * N; i++) B[i] = (float)rnd(&r);
#ifdef _OPENMP
    int keep = omp_get_max_threads();
#endif
    for (int tab = 0; tab < 4; tab++) {
        int ta = tab / 2, tb = tab % 2, lda = ta ? M : K, ldb = tb ? K : N;
        for (int i = 0; i < M; i++) {
            want_a[i] = sa[i] = (float)i / 3;                       /* added onto what is there */
            for (int k = 0; k < K; k++) want_a[i] += ta ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
        }
        for (int j = 0; j < N; j++) {
            want_b[j] = sb[j] = -(float)j / 5;
            for (int k = 0; k < K; k++) want_b[j] += tb ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
        }
        dt_gemm(ta, tb, M, N, K, 1, A, lda, B, ldb, 0, C0, N);
        for (int t = 1; t <= 3; t++) {
#ifdef _OPENMP
            omp_set_num_threads(t);
#endif
            for (int i = 0; i < M; i++) sa[i] = (float)i / 3;
            for (int j = 0; j < N; j++) sb[j] = -(float)j / 5;
            dt__epilogue ep = { .a_sums = sa, .b_sums = sb };
            dt__gemm_epilogue(ta, tb, M, N, K, 1, A, lda, B, ldb, 0, C, N, &ep);
            CHECKF(memcmp(sa, want_a, sizeof(float) * M) == 0, "ta=%d, %d threads: op(A)'s row sums differ", ta, t);
            CHECKF(memcmp(sb, want_b, sizeof(float) * N) == 0, "tb=%d, %d threads: op(B)'s column sums differ", tb, t);
            CHECKF(memcmp(C, C0, sizeof(float) * M * N) == 0, "ta=%d tb=%d, %d threads: C changed by the sums", ta, tb, t);
        }
    }
#ifdef _OPENMP
    omp_set_num_threads(keep);
#endif
    free(A); free(B); free(C); free(C0); free(sa); free(sb); free(want_a); free(want_b);
}

/* The MLP's second layer makes the gradient of GELU's input as it stores its
   input gradient (dt__gelu_behind): the bits of GELU's backward on its own,
   in one slab of K (fc2's 700 outputs) and in four (900), two panels of
   columns or more and edge tiles, both forms, fc2's bias summed as dy is
   packed, at 1 and 2 threads, with the slope the fused forward stored and
   with GELU' made in the fold (an unfused forward); the activation's gradient
   is never made; and where another layer reads GELU's output too, the
   separate backward runs. */
TEST(gelu_backward_in_the_next_layers_matmul_gives_its_own_bits, QUICK) {
    int M = 37, D = 50, H = 1030;                     /* H: two panels of columns or more */
    dt__rng r = { 5 };
    for (int form = 0; form < 5; form++) {            /* erf; tanh with in_out weights; erf with a second reader; erf at 2
                                                         threads; erf after an unfused forward (no stored slope) */
        int in_out = form == 1, O = form % 2 ? 900 : 700;
#ifdef _OPENMP
        int keep = omp_get_max_threads();
        omp_set_num_threads(form == 3 ? 2 : 1);
#endif
        dt_tensor *x = leaf2(M, D, &r, 1), *w1 = in_out ? leaf2(D, H, &r, 0.3) : leaf2(H, D, &r, 0.3), *b1 = leaf2(1, H, &r, 1);
        dt_tensor *w2 = in_out ? leaf2(H, O, &r, 0.1) : leaf2(O, H, &r, 0.1), *w3 = leaf2(O, H, &r, 0.1), *b2 = leaf2(1, O, &r, 1);
        dt_tensor *L[6] = { x, w1, b1, w2, w3, b2 };
        float *grads[2][6], *seed = (float *)malloc(sizeof(float) * M * O);
        dt__rng rs = { 9 };
        for (int i = 0; i < M * O; i++) seed[i] = (float)rnd(&rs);
        for (int apart = 0; apart < 2; apart++) {
            for (int k = 0; k < 6; k++) memset(L[k]->grad, 0, sizeof(float) * (size_t)L[k]->numel);
            dt__gelu_apart = apart;
            dt_step_arena_reset();
            dt_tensor *g = in_out ? dt_linear_in_out_gelu_tanh(x, w1, b1) : form == 4 ? dt_gelu(dt_linear(x, w1, b1))
                                                                               : dt_linear_gelu(x, w1, b1);
            dt_tensor *y = in_out ? dt_linear_in_out(g, w2, b2) : dt_linear(g, w2, b2);
            if (form == 2) y = dt_add(y, dt_linear(g, w3, NULL));
            dt_backward_from(y, seed);
            CHECKF((g->grad == NULL) == (!apart && form != 2), "form %d, %s: GELU's output %s a gradient", form,
                   apart ? "apart" : "folded", g->grad ? "has" : "has no");
            for (int k = 0; k < 6; k++) {
                grads[apart][k] = (float *)malloc(sizeof(float) * (size_t)L[k]->numel);
                memcpy(grads[apart][k], L[k]->grad, sizeof(float) * (size_t)L[k]->numel);
            }
        }
        dt__gelu_apart = 0;
#ifdef _OPENMP
        omp_set_num_threads(keep);
#endif
        for (int k = 0; k < 6; k++) {
            CHECKF(memcmp(grads[0][k], grads[1][k], sizeof(float) * (size_t)L[k]->numel) == 0,
                   "form %d: the gradient of input %d differs with GELU's backward in the matmul", form, k);
            free(grads[0][k]); free(grads[1][k]);
            leaf_free(L[k]);
        }
        free(seed);
    }
    dt_step_arena_reset();
}

TEST(half_conversions_round_to_nearest_even, QUICK) {
    CHECK(dt_f32_to_bf16(1.0f) == 0x3F80);
    CHECK(dt_f32_to_bf16(dt_bits_float(0x3F808000u)) == 0x3F80);   /* tie, even below */
    CHECK(dt_f32_to_bf16(dt_bits_float(0x3F818000u)) == 0x3F82);   /* tie, odd below: up */
    CHECK(dt_f32_to_bf16(dt_bits_float(0x3F808001u)) == 0x3F81);
    CHECK(dt_f32_to_bf16(INFINITY) == 0x7F80 && dt_f32_to_bf16(-INFINITY) == 0xFF80);
    CHECK((dt_f32_to_bf16(NAN) & 0x7FFF) > 0x7F80);
    CHECK(dt_f32_to_bf16(dt_bits_float(0x00000001u)) == 0x0000);   /* smallest subnormal rounds down */
    CHECK(dt_f32_to_f16(1.0f) == 0x3C00 && dt_f32_to_f16(-2.0f) == 0xC000);
    CHECK(dt_f32_to_f16(65504.0f) == 0x7BFF);
    CHECK(dt_f32_to_f16(65519.0f) == 0x7BFF && dt_f32_to_f16(65520.0f) == 0x7C00);
    CHECK(dt_f32_to_f16(ldexpf(1, -14)) == 0x0400);                  /* smallest normal */
    CHECK(dt_f32_to_f16(ldexpf(1, -24)) == 0x0001);                  /* smallest subnormal */
    CHECK(dt_f32_to_f16(ldexpf(1, -25)) == 0x0000);                  /* tie to even: zero */
    CHECK(dt_f32_to_f16(ldexpf(1.5f, -25)) == 0x0001);
    CHECK(dt_f32_to_f16(ldexpf(3, -25)) == 0x0002);                  /* 1.5 ulp: tie, up to even 2 */
    CHECK(dt_f32_to_f16(1.0f + ldexpf(1, -11)) == 0x3C00);           /* tie, even below */
    CHECK(dt_f32_to_f16(1.0f + 3 * ldexpf(1, -11)) == 0x3C02);       /* tie, odd below: up */
    CHECK(dt_f32_to_f16(-0.0f) == 0x8000 && dt_f32_to_f16(INFINITY) == 0x7C00);
    CHECK((dt_f32_to_f16(NAN) & 0x7C00) == 0x7C00 && (dt_f32_to_f16(NAN) & 0x3FF) != 0);
    CHECK(dt_f16_to_f32(0x0001) == ldexpf(1, -24) && dt_f16_to_f32(0x03FF) == ldexpf(1023, -24));
    CHECK(isinf(dt_f16_to_f32(0x7C00)) && isnan(dt_f16_to_f32(0x7E00)));
    int round_trip = 1;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;        /* NaN payloads */
        if (dt_f32_to_f16(dt_f16_to_f32((uint16_t)h)) != h) round_trip = 0;
        if (dt_f32_to_bf16(dt_bf16_to_f32((uint16_t)h)) != h && !((h & 0x7F80) == 0x7F80 && (h & 0x7F))) round_trip = 0;
    }
    CHECK(round_trip);
    float v[5] = { 1.0f, -2.5f, 65520.0f, ldexpf(1.5f, -25), 3.14159f }, back[5];
    uint16_t h[5];
    dt_convert(v, DT_F32, h, DT_F16, 5);                 /* the buffer form runs the same functions */
    CHECK(h[0] == 0x3C00 && h[2] == 0x7C00 && h[3] == 0x0001 && h[4] == dt_f32_to_f16(3.14159f));
    dt_convert(h, DT_F16, back, DT_F32, 5);
    CHECK(back[1] == -2.5f && back[4] == dt_f16_to_f32(h[4]));
    dt_convert(v, DT_F32, h, DT_BF16, 5);
    CHECK(h[0] == 0x3F80 && h[4] == dt_f32_to_bf16(3.14159f));
    /* more hand-made patterns: the subnormal/normal border, bf16's own subnormals, overflow */
    CHECK(dt_f32_to_f16(ldexpf(2047, -25)) == 0x0400);              /* 1023.5 ulps: tie, up into the normals */
    CHECK(dt_f32_to_f16(ldexpf(2045, -25)) == 0x03FE);              /* 1022.5 ulps: tie, even below */
    CHECK(dt_f32_to_f16(-ldexpf(1, -24)) == 0x8001);
    CHECK(dt_f32_to_bf16(dt_bits_float(0x00010000u)) == 0x0001);   /* an f32 subnormal kept as a bf16 one */
    CHECK(dt_f32_to_bf16(dt_bits_float(0x00018000u)) == 0x0002);   /* tie, odd below: up */
    CHECK(dt_f32_to_bf16(dt_bits_float(0x00008000u)) == 0x0000);   /* tie, even below: to zero */
    CHECK(dt_f32_to_bf16(dt_bits_float(0x7F7FFFFFu)) == 0x7F80);   /* the largest float rounds to inf */
    CHECK(dt_f32_to_bf16(dt_bits_float(0x7F7F7FFFu)) == 0x7F7F);   /* just below the tie: the largest bf16 */
    CHECK(dt_bf16_to_f32(0x0001) == dt_bits_float(0x00010000u) && isinf(dt_bf16_to_f32(0xFF80)));
    /* dt_convert's CPU loops (vector code, F16C on x86) give the bits of the
       functions above: every 16-bit pattern, and a million f32 patterns */
    enum { NF = 1 << 20 };
    uint16_t *all = (uint16_t *)malloc(65536 * 2), *h16 = (uint16_t *)malloc(NF * 2);
    float *f = (float *)malloc(NF * sizeof(float));
    for (int t = 0; t < 2; t++) {
        dt_dtype d = t ? DT_F16 : DT_BF16;
        int bad = 0;
        for (int i = 0; i < 65536; i++) all[i] = (uint16_t)i;
        dt_convert(all, d, f, DT_F32, 65536);
        for (int i = 0; i < 65536; i++) {
            float want = d == DT_BF16 ? dt_bf16_to_f32((uint16_t)i) : dt_f16_to_f32((uint16_t)i);
            if (!isnan(want) && dt_float_bits(f[i]) != dt_float_bits(want)) bad++;
        }
        dt__rng r = { 11 };
        for (int i = 0; i < NF; i++) f[i] = dt_bits_float((uint32_t)(dt__rng_u64(&r) >> 32));
        f[0] = ldexpf(2047, -25); f[1] = 65520.0f; f[2] = dt_bits_float(0x00018000u); f[3] = -0.0f;
        dt_convert(f, DT_F32, h16, d, NF);
        for (int i = 0; i < NF; i++)
            if (!isnan(f[i]) && h16[i] != (d == DT_BF16 ? dt_f32_to_bf16(f[i]) : dt_f32_to_f16(f[i]))) bad++;
        CHECKF(bad == 0, "%s: dt_convert differs from the per-element functions in %d values", dt_dtype_name(d), bad);
    }
    free(all); free(h16); free(f);
}

/* The launch shape every kernel uses: a capped grid and a loop, so that rows
   beyond what one grid covers are not skipped. Emulated here for the sizes
   where a grid stops covering everything at once. */
TEST(launch_shapes_cover_every_row_past_the_grid_cap, QUICK) {
    static const int64_t sizes[] = { 1, 31, 33, 4194303, 4194304 + 7, 10000001 };
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int64_t rows = sizes[k];
        unsigned blocks = dt_blocks_for(rows * 32);                      /* one warp per row */
        unsigned char *seen = (unsigned char *)calloc((size_t)rows, 1);
        int64_t warps = (int64_t)blocks * DT_THREADS / 32, bad = 0;
        for (int64_t w = 0; w < warps; w++)                             /* lane 0 of each warp */
            for (int64_t row = dt_grid_first((unsigned)(w * 32 / DT_THREADS), DT_THREADS, (unsigned)(w * 32 % DT_THREADS)) / 32;
                 row < rows; row += dt_grid_stride(blocks, DT_THREADS) / 32)
                seen[row]++;
        for (int64_t i = 0; i < rows; i++) bad += seen[i] != 1;
        CHECKF(bad == 0, "%lld rows, %u blocks: %lld rows visited other than once", (long long)rows, blocks, (long long)bad);
        CHECKF(blocks <= DT_MAX_BLOCKS, "%u blocks is over the cap", blocks);
        free(seen);
    }
    int64_t n = 3LL * DT_MAX_BLOCKS * DT_THREADS + 5, covered = 0;      /* element loops: thread i takes i, i + stride, ... */
    unsigned blocks = dt_blocks_for(n);
    for (int64_t i = dt_grid_first(blocks - 1, DT_THREADS, DT_THREADS - 1); i < n; i += dt_grid_stride(blocks, DT_THREADS)) covered++;
    CHECKF(covered == 3 || covered == 4, "the last thread of a capped grid takes %lld items", (long long)covered);
}
/* dtrain's own exp, tanh and erf (vectorisable; the GELUs use them) against
   libm in double, over a dense grid: the accuracy the header states. */
TEST(exp_tanh_and_erf_match_libm_over_a_dense_grid, QUICK) {
    double worst_exp = 0, worst_tanh = 0, worst_erf = 0, at_exp = 0, at_tanh = 0, at_erf = 0, worst_dg = 0, at_dg = 0;
    for (double x = -30; x <= 30; x += 1.0 / 4096) {
        float f = (float)x;
        double e = exp((double)f), de = fabs(dt_exp_value(f) - e) / e;
        double dt = fabs(dt_tanh_value(f) - tanh((double)f)), de2 = fabs(dt_erf_value(f) - erf((double)f));
        /* GELU's derivative Phi(x) + x phi(x): its one exp serves both terms */
        double xd = f, dg = 0.5 * (1 + erf(xd / sqrt(2.0))) + xd * exp(-0.5 * xd * xd) / sqrt(2 * 3.14159265358979323846);
        double ddg = fabs(dt_gelu_derivative(f) - dg);
        if (de > worst_exp) { worst_exp = de; at_exp = f; }
        if (dt > worst_tanh) { worst_tanh = dt; at_tanh = f; }
        if (de2 > worst_erf) { worst_erf = de2; at_erf = f; }
        if (ddg > worst_dg) { worst_dg = ddg; at_dg = f; }
    }
    CHECKF(worst_exp <= 5e-7, "exp: relative error %.3g at %g", worst_exp, at_exp);
    CHECKF(worst_tanh <= 5e-7, "tanh: error %.3g at %g", worst_tanh, at_tanh);
    CHECKF(worst_erf <= 5e-7, "erf: error %.3g at %g", worst_erf, at_erf);
    CHECKF(worst_dg <= 5e-7, "GELU's derivative: error %.3g at %g", worst_dg, at_dg);
    CHECK(dt_exp_value(0) == 1.0f && dt_exp_value(-100) == 0.0f && dt_exp_value(80) > 5e34f && dt_exp_value(1000) < INFINITY);
    CHECK(dt_tanh_value(0) == 0.0f && dt_tanh_value(30) == 1.0f && dt_tanh_value(-30) == -1.0f);
    CHECK(dt_erf_value(9) == 1.0f && dt_erf_value(-9) == -1.0f);
    CHECK(isnan(dt_exp_value(NAN)) && isnan(dt_tanh_value(NAN)) && isnan(dt_erf_value(NAN)));
    CHECK(dt_exp_value(INFINITY) > 1e38f && dt_exp_value(-INFINITY) == 0.0f && dt_tanh_value(-INFINITY) == -1.0f);
}
/* tools/roofline, where make bench's limits come from: a shape's rate kept up
   over all its calls (*_mean_gflops) is at most its best call's rate, the
   number of calls is the one asked for, and a flag's value that is not a
   number it takes is an error naming the flag (not 0 calls, not a default). */
TEST(roofline_reports_its_kept_up_rate_and_refuses_bad_numbers, QUICK) {
    char out[8192];
    int st = run_cmd(out, sizeof out, "%s --quick --reps 3", build_path("tools/roofline"));
    CHECKF(st == 0, "tools/roofline --quick --reps 3: exit %d\n%s", st, out);
    const char *g = strstr(out, "gemm shape=square-1024 ");
    CHECKF(g && strstr(g, " reps=3 "), "no 1024^3 line of 3 calls:\n%s", out);
    const char *b = g ? strstr(g, " dtrain_gflops=") : NULL, *m = g ? strstr(g, " dtrain_mean_gflops=") : NULL;
    double best = b ? atof(b + 15) : 0, mean = m ? atof(m + 20) : 0;
    CHECKF(best > 0 && mean > 0 && mean <= best + 0.1, "best call %.1f GFLOP/s, kept up %.1f:\n%s", best, mean, out);
    const char *bl = g ? strstr(g, " openblas_gflops=") : NULL, *ml = g ? strstr(g, " openblas_mean_gflops=") : NULL;
    if (bl)                                  /* where OpenBLAS was found, its side too */
        CHECKF(ml && atof(ml + 22) > 0 && atof(ml + 22) <= atof(bl + 17) + 0.1, "OpenBLAS's rates:\n%s", out);
    static const char *bad[][2] = { { "--seconds", "x" }, { "--seconds", "0" }, { "--reps", "0" }, { "--reps", "2.5" },
                                    { "--threads", "-1" }, { "--threads", "" } };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        st = run_cmd(out, sizeof out, "%s --quick %s '%s'", build_path("tools/roofline"), bad[i][0], bad[i][1]);
        CHECKF(st == 2 && strstr(out, bad[i][0]) && !strstr(out, "gemm shape="), "%s '%s': exit %d\n%s", bad[i][0], bad[i][1], st,
               out);
    }
}
