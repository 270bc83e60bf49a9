/* tests/16-context-parallel.c -- tests of dtrain.h's chapter
   16-context-parallel: ring attention against whole-sequence attention, and
   the work each rank does in the zig-zag and contiguous layouts. (tests/helpers.h:
   how the suite's files make one program.) */
#include "helpers.h"

/* C ranks as threads of this process, each holding its tokens of B sequences
   of T: its rows of the whole qkv in, its rows of the output and of the qkv
   gradient (for the loss sum(out * w)) written back where the whole
   sequence has them. */
typedef struct {
    dt_comm_group *group;
    int rank, C, B, T, H, D, causal;
    dt_cp_layout layout;
    const float *qkv, *w;                 /* the whole sequences' */
    float *out, *grad;                    /* written at the rank's rows */
    int64_t scores;                       /* its attention work */
} ring_rank;
static void *ring_rank_main(void *arg) {
    ring_rank *a = (ring_rank *)arg;
    dt_comm *c = dt_comm_join(a->group, a->rank);
    int T = a->T / a->C, D = a->D, pos[256];
    dt_cp_positions(a->layout, a->T, a->C, a->rank, pos);
    dt_step_arena_reset();
    dt_tensor *qkv = dt_tensor_2d(a->B * T, 3 * D);
    float *w = (float *)malloc(sizeof(float) * (size_t)a->B * T * D);
    for (int b = 0; b < a->B; b++)
        for (int i = 0; i < T; i++) {
            memcpy(qkv->data + ((size_t)b * T + i) * 3 * D, a->qkv + ((size_t)b * a->T + pos[i]) * 3 * D, sizeof(float) * 3 * D);
            memcpy(w + ((size_t)b * T + i) * D, a->w + ((size_t)b * a->T + pos[i]) * D, sizeof(float) * D);
        }
    qkv->requires_grad = 1;
    int64_t before = dt_ring_attention_scores();
    dt_tensor *out = dt_ring_attention(qkv, a->B, T, a->H, a->causal, pos, c);
    dt_backward_from(out, w);
    a->scores = dt_ring_attention_scores() - before;
    for (int b = 0; b < a->B; b++)
        for (int i = 0; i < T; i++) {
            memcpy(a->out + ((size_t)b * a->T + pos[i]) * D, out->data + ((size_t)b * T + i) * D, sizeof(float) * D);
            memcpy(a->grad + ((size_t)b * a->T + pos[i]) * 3 * D, qkv->grad + ((size_t)b * T + i) * 3 * D, sizeof(float) * 3 * D);
        }
    free(w);
    dt_comm_free(c);
    dt__context_release();                /* this thread's arenas */
    return NULL;
}
/* The whole job: C threads; the output and gradient of the whole sequences,
   and each rank's work in scores[]. */
static void ring_attention_job(int C, dt_cp_layout layout, int causal, int B, int T, int H, int D, const float *qkv,
                               const float *w, float *out, float *grad, int64_t *scores) {
    dt_comm_group *g = dt_comm_group_create(C, 30);
    ring_rank a[8];
    pthread_t th[8];
    for (int r = 0; r < C; r++) {
        a[r] = (ring_rank){ g, r, C, B, T, H, D, causal, layout, qkv, w, out, grad, 0 };
        pthread_create(&th[r], NULL, ring_rank_main, &a[r]);
    }
    for (int r = 0; r < C; r++) {
        pthread_join(th[r], NULL);
        if (scores) scores[r] = a[r].scores;
    }
    dt_comm_group_free(g);
}

/* 2 and 4 ranks, zig-zag and contiguous, causal and not: the output and the
   gradient of q, k and v are whole-sequence attention's (dt_attention on one
   device) within 1e-5 of their largest values. */
TEST(ring_attention_over_2_and_4_ranks_equals_whole_sequence_attention, QUICK) {
    enum { B = 2, T = 48, H = 2, D = 16 };
    dt__rng r = { 16 };
    dt_tensor *qkv = leaf2(B * T, 3 * D, &r, 1.5);
    float w[B * T * D], want_out[B * T * D], *want_grad = (float *)malloc(sizeof(float) * B * T * 3 * D);
    float out[B * T * D], *grad = (float *)malloc(sizeof(float) * B * T * 3 * D);
    for (int i = 0; i < B * T * D; i++) w[i] = (float)rnd(&r);
    for (int causal = 0; causal < 2; causal++) {
        memset(qkv->grad, 0, sizeof(float) * (size_t)qkv->numel);
        dt_step_arena_reset();
        dt_tensor *o = dt_attention(qkv, B, T, H, causal);
        memcpy(want_out, o->data, sizeof want_out);
        dt_backward_from(o, w);
        memcpy(want_grad, qkv->grad, sizeof(float) * B * T * 3 * D);
        double top_out = 0, top_grad = 0;
        for (int i = 0; i < B * T * D; i++) top_out = fmax(top_out, fabs(want_out[i]));
        for (int i = 0; i < B * T * 3 * D; i++) top_grad = fmax(top_grad, fabs(want_grad[i]));
        for (int C = 2; C <= 4; C += 2)
            for (int layout = 0; layout < 2; layout++) {
                memset(out, 0, sizeof out);
                memset(grad, 0, sizeof(float) * B * T * 3 * D);
                ring_attention_job(C, (dt_cp_layout)layout, causal, B, T, H, D, qkv->data, w, out, grad, NULL);
                double d_out = 0, d_grad = 0;
                for (int i = 0; i < B * T * D; i++) d_out = fmax(d_out, fabs(out[i] - want_out[i]));
                for (int i = 0; i < B * T * 3 * D; i++) d_grad = fmax(d_grad, fabs(grad[i] - want_grad[i]));
                CHECKF(d_out <= 1e-5 * top_out && d_grad <= 1e-5 * top_grad,
                       "ring attention, %d ranks, %s, %s: output %.3g and gradient %.3g from whole-sequence attention's "
                       "(largest %.3g, %.3g)", C, layout ? "contiguous" : "zig-zag", causal ? "causal" : "not causal", d_out,
                       d_grad, top_out, top_grad);
            }
    }
    free(want_grad); free(grad);
    leaf_free(qkv);
}

/* A causal model's work per rank, counted (score products, forward and
   backward): the zig-zag layout gives every rank the same within 10%; the
   contiguous one gives the last rank several times the first's. Bad
   layouts are refused. */
TEST(zig_zag_gives_every_rank_the_same_attention_work_and_contiguous_does_not, QUICK) {
    enum { B = 1, T = 64, H = 1, D = 8, C = 4 };
    dt__rng r = { 17 };
    dt_tensor *qkv = leaf2(B * T, 3 * D, &r, 1);
    float w[B * T * D], out[B * T * D], *grad = (float *)malloc(sizeof(float) * B * T * 3 * D);
    for (int i = 0; i < B * T * D; i++) w[i] = (float)rnd(&r);
    int64_t work[2][C];
    for (int layout = 0; layout < 2; layout++)
        ring_attention_job(C, (dt_cp_layout)layout, 1, B, T, H, D, qkv->data, w, out, grad, work[layout]);
    int64_t lo[2], hi[2];
    for (int k = 0; k < 2; k++) {
        lo[k] = hi[k] = work[k][0];
        for (int q = 1; q < C; q++) { lo[k] = work[k][q] < lo[k] ? work[k][q] : lo[k]; hi[k] = work[k][q] > hi[k] ? work[k][q] : hi[k]; }
    }
    CHECKF(lo[0] > 0 && hi[0] <= 1.1 * lo[0], "zig-zag: ranks' attention work %lld .. %lld", (long long)lo[0], (long long)hi[0]);
    CHECKF(hi[1] >= 3 * lo[1], "contiguous: ranks' attention work %lld .. %lld (expected the last several times the first)",
           (long long)lo[1], (long long)hi[1]);
    CHECKF(work[0][0] + work[0][1] + work[0][2] + work[0][3] == work[1][0] + work[1][1] + work[1][2] + work[1][3],
           "the two layouts' total work differs");
    free(grad);
    leaf_free(qkv);
    char outs[4096];
    int st = run_cmd(outs, sizeof outs, "%s --selftest-cp-layout", self_bin);
    CHECKF(st == 1 && strstr(outs, "a sequence of 30 tokens does not cut into 8 equal chunks (4 ranks, zig-zag layout)"),
           "T = 30 over 4 ranks, zig-zag: exit %d\n%s", st, outs);
}
