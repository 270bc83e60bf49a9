/* tests/18-context-parallel.c -- tests of dtrain.h's chapter
   18-context-parallel: ring attention against whole-sequence attention, and
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

/* 1 to 4 ranks, zig-zag and contiguous, causal and not: the output and the
   gradient of q, k and v are whole-sequence attention's (dt_attention on one
   device) within 1e-5 of their largest values. */
TEST(ring_attention_over_1_to_4_ranks_equals_whole_sequence_attention, QUICK) {
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
        for (int C = 1; C <= 4; C++)                     /* odd C too: the gradient sums end in the other buffer */
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

/* The GPT and Llama (grouped-query attention, rotary angles) run on a rank's
   tokens of each sequence with the sequence split set (dt_set_sequence_split):
   over 2 and 4 ranks, zig-zag and contiguous, each rank's logits are the whole
   model's rows for its tokens, and the mean of the ranks' gradients (each of
   the mean loss over its own tokens) is the whole model's gradient, within
   1e-5 of the largest. */
typedef struct {
    dt_comm_group *group;
    int rank, C, B, T;
    dt_cp_layout layout;
    const dt_model_config *mc;
    const float *tokens;
    const int32_t *labels;
    float *logits, *grad;                 /* the whole batch's rows; rank 0: the ranks' mean gradient */
} cp_model_rank;
static void *cp_model_rank_main(void *arg) {
    cp_model_rank *a = (cp_model_rank *)arg;
    dt_comm *c = dt_comm_join(a->group, a->rank);
    dt_model *m = dt_model_create(a->mc, 5);
    int T = a->T / a->C, V = a->mc->classes, pos[64], shape[2] = { a->B, T };
    dt_cp_positions(a->layout, a->T, a->C, a->rank, pos);
    dt_sequence_split split = { c, pos, T };
    dt_set_sequence_split(&split);
    float tokens[256];
    int32_t labels[256];
    for (int b = 0; b < a->B; b++)
        for (int i = 0; i < T; i++) {
            tokens[b * T + i] = a->tokens[b * a->T + pos[i]];
            labels[b * T + i] = a->labels[b * a->T + pos[i]];
        }
    dt_step_arena_reset();
    dt_tensor *logits = dt_model_forward(m, dt_tensor_from_host(2, shape, tokens));
    dt_backward(dt_cross_entropy(logits, labels));
    for (int b = 0; b < a->B; b++)
        for (int i = 0; i < T; i++)
            memcpy(a->logits + ((size_t)b * a->T + pos[i]) * V, logits->data + ((size_t)b * T + i) * V, sizeof(float) * V);
    dt_all_reduce(c, m->flat_grad, m->flat_grad, m->numel, DT_F32, DT_AVG);
    if (a->rank == 0) memcpy(a->grad, m->flat_grad, sizeof(float) * (size_t)m->numel);
    dt_set_sequence_split(NULL);
    dt_step_arena_reset();
    dt_model_free(m);
    dt_comm_free(c);
    dt__context_release();
    return NULL;
}
TEST(a_gpt_and_a_llama_on_each_ranks_tokens_equal_the_whole_model, QUICK) {
    enum { B = 2, T = 32, V = 11 };
    dt_model_config models[2] = {
        { DT_MODEL_GPT, 0, 0, V, 16, 2, 2, 0, 48, T, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 },
        { DT_MODEL_LLAMA, 0, 0, V, 16, 2, 4, 0, 24, T, 2, 0, 0, 10000.0f, 1e-5f, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 },
    };
    dt__rng r = { 18 };
    float tokens[B * T], want_logits[B * T * V], logits[B * T * V];
    int32_t labels[B * T];
    for (int i = 0; i < B * T; i++) { tokens[i] = (float)(dt__rng_u64(&r) % V); labels[i] = (int32_t)(dt__rng_u64(&r) % V); }
    for (int k = 0; k < 2; k++) {
        dt_model *whole = dt_model_create(&models[k], 5);
        int shape[2] = { B, T };
        dt_step_arena_reset();
        dt_tensor *lg = dt_model_forward(whole, dt_tensor_from_host(2, shape, tokens));
        dt_backward(dt_cross_entropy(lg, labels));
        memcpy(want_logits, lg->data, sizeof want_logits);
        int64_t n = whole->numel;
        float *want_grad = (float *)malloc(sizeof(float) * (size_t)n), *grad = (float *)malloc(sizeof(float) * (size_t)n);
        memcpy(want_grad, whole->flat_grad, sizeof(float) * (size_t)n);
        double top_l = 0, top_g = 0;
        for (int i = 0; i < B * T * V; i++) top_l = fmax(top_l, fabs(want_logits[i]));
        for (int64_t i = 0; i < n; i++) top_g = fmax(top_g, fabs(want_grad[i]));
        for (int C = 2; C <= 4; C += 2)
            for (int layout = 0; layout < 2; layout++) {
                dt_comm_group *g = dt_comm_group_create(C, 30);
                cp_model_rank a[4];
                pthread_t th[4];
                for (int q = 0; q < C; q++) {
                    a[q] = (cp_model_rank){ g, q, C, B, T, (dt_cp_layout)layout, &models[k], tokens, labels, logits, grad };
                    pthread_create(&th[q], NULL, cp_model_rank_main, &a[q]);
                }
                for (int q = 0; q < C; q++) pthread_join(th[q], NULL);
                dt_comm_group_free(g);
                double dl = 0, dg = 0;
                for (int i = 0; i < B * T * V; i++) dl = fmax(dl, fabs(logits[i] - want_logits[i]));
                for (int64_t i = 0; i < n; i++) dg = fmax(dg, fabs(grad[i] - want_grad[i]));
                CHECKF(dl <= 1e-5 * top_l && dg <= 1e-5 * top_g, "%s over %d ranks, %s: logits %.3g and gradients %.3g from the "
                       "whole model's (largest %.3g, %.3g)", k ? "llama" : "gpt", C, layout ? "contiguous" : "zig-zag", dl, dg,
                       top_l, top_g);
            }
        free(want_grad); free(grad);
        dt_step_arena_reset();
        dt_model_free(whole);
    }
}

/* ---- stage 08 ---- */
typedef struct { int nproc, cp, batch; const char *flags; } cp_layout_run;
/* 08 in each layout against 01 at the same global batch (32), 20 steps (2
   epochs of 320 sequences): losses and the eval loss within 1e-5, every
   weight and Adam moment within 2e-5. */
static void cp_equals_01(const char *flags, const char *model, const cp_layout_run *runs, int n) {
    char out[16384], ref[600], rlog[700], dir[600], log[700], p[700], q[800];
    snprintf(ref, sizeof ref, "%s/cp-%s-01", tmpdir, model);
    snprintf(rlog, sizeof rlog, "%s.jsonl", ref);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --batch-size 32 --save-dir %s --log %s", train_cpu, gpt_text(),
                     flags, ref, rlog);
    CHECKF(st == 0, "01: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/%s_data0-320_epoch2", ref, model);
    for (int k = 0; k < n; k++) {
        snprintf(dir, sizeof dir, "%s/cp-%s-%d", tmpdir, model, k);
        snprintf(log, sizeof log, "%s.jsonl", dir);
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s %s --batch-size %d --nproc %d --cp %d --save-dir %s --log %s",
                     stage_bin("08-context-parallel"), gpt_text(), flags, runs[k].flags, runs[k].batch, runs[k].nproc, runs[k].cp,
                     dir, log);
        CHECKF(st == 0, "08 --nproc %d --cp %d %s: exit %d\n%s", runs[k].nproc, runs[k].cp, runs[k].flags, st, out);
        double dl = losses_differ_by(rlog, log, 20);
        CHECKF(dl <= 1e-5, "%s 08 --nproc %d --cp %d %s: losses differ from 01's by %.3g", model, runs[k].nproc, runs[k].cp,
               runs[k].flags, dl);
        double e1 = summary_value(rlog, "eval_loss"), e8 = summary_value(log, "eval_loss");
        CHECKF(e1 > 0 && fabs(e1 - e8) <= 1e-5, "%s 08 --nproc %d --cp %d %s: eval loss %.6f, 01's %.6f", model, runs[k].nproc,
               runs[k].cp, runs[k].flags, e8, e1);
        snprintf(q, sizeof q, "%s/%s_data0-320_epoch2", dir, model);
        if (strstr(runs[k].flags, "--shard")) {      /* FSDP saved its shards: put them together first */
            char whole[720];
            snprintf(whole, sizeof whole, "%.700s.whole", q);
            st = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/consolidate"), q, whole);
            CHECKF(st == 0, "consolidate %s: exit %d\n%s", q, st, out);
            snprintf(q, sizeof q, "%s", whole);
        }
        double d = max_tensor_diff(p, q);
        CHECKF(d >= 0 && d <= 2e-5, "%s 08 --nproc %d --cp %d %s: weights or Adam moments differ from 01's by %.3g", model,
               runs[k].nproc, runs[k].cp, runs[k].flags, d);
    }
}
#define CP_GPT "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16"
#define CP_LLAMA "--model llama --dim 32 --depth 2 --heads 8 --kv-heads 4 --seq-len 16"
/* 2 ranks of one group, zig-zag; 4 ranks as 2 groups of 2 under FSDP: the
   GPT and Llama (grouped-query attention, rotary angles at the tokens' true
   places) equal one device. */
TEST(context_parallel_equals_one_device, QUICK) {
    static const cp_layout_run runs[2] = { { 2, 2, 32, "" }, { 4, 2, 16, "--shard full" } };
    cp_equals_01(CP_GPT, "gpt", runs, 2);
    cp_equals_01(CP_LLAMA, "llama", runs, 2);
}
/* ... and in the other layouts: contiguous, 4 ranks in one group, DDP
   around 2 groups of 2. */
TEST(context_parallel_in_every_layout_equals_one_device, FULL) {
    static const cp_layout_run runs[4] = { { 2, 2, 32, "--cp-layout contiguous" }, { 4, 4, 32, "" },
                                           { 4, 4, 32, "--cp-layout contiguous" }, { 4, 2, 16, "" } };
    cp_equals_01(CP_GPT, "gpt", runs, 4);
    cp_equals_01(CP_LLAMA, "llama", runs, 4);
}

/* What it is for: each rank keeps its share of the activations. The GPT at
   context 512: a rank's peak activation bytes at most 0.6x stage 01's with
   2 ranks and 0.35x with 4 (training and evaluation alike, as both go
   around the ring). */
TEST(context_parallel_keeps_a_share_of_the_activations, QUICK) {
    char out[16384], log[4][600];
    const char *flags = "--model gpt --dim 64 --depth 2 --heads 4 --seq-len 512 --batch-size 2 --epochs 1 --steps 2 --quiet";
    static const int cp[4] = { 1, 2, 4, 1 };          /* 01, then 08 at C = 2, 4 and 1 */
    double bytes[4];
    for (int k = 0; k < 4; k++) {
        snprintf(log[k], sizeof log[k], "%s/cp-mem%d.jsonl", tmpdir, k);
        int st = k == 0 ? run_cmd(out, sizeof out, "%s --data %s %s --log %s", train_cpu, gpt_text(), flags, log[k])
                        : run_cmd(out, sizeof out, "%s --data %s %s --nproc %d --cp %d --log %s", stage_bin("08-context-parallel"),
                                  gpt_text(), flags, cp[k], cp[k], log[k]);
        CHECKF(st == 0, "--cp %d: exit %d\n%s", cp[k], st, out);
        bytes[k] = summary_value(log[k], "peak_activations_bytes");
    }
    CHECKF(bytes[0] > 0 && bytes[1] <= 0.6 * bytes[0] && bytes[2] <= 0.35 * bytes[0],
           "peak activations per rank: 01 %.0f, --cp 2 %.0f (%.2fx), --cp 4 %.0f (%.2fx)", bytes[0], bytes[1], bytes[1] / bytes[0],
           bytes[2], bytes[2] / bytes[0]);
    /* ... and what the split itself saves, apart from the online softmax every ring runs (08 at C = 1, the same body) */
    CHECKF(bytes[3] > 0 && bytes[1] <= 0.6 * bytes[3] && bytes[2] <= 0.35 * bytes[3],
           "peak activations per rank against 08 --cp 1 (%.0f): --cp 2 %.2fx, --cp 4 %.2fx", bytes[3], bytes[1] / bytes[3],
           bytes[2] / bytes[3]);
}

/* A checkpoint of 08 is whole: it resumes bit for bit in 08, in 08 over
   another layout, and in stage 01. Bad flags are refused, naming them. */
TEST(context_parallel_checkpoints_are_whole_and_bad_flags_are_refused, QUICK) {
    char out[16384], a[600];
    snprintf(a, sizeof a, "%s/cpck-a", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " CP_GPT " --batch-size 32 --nproc 2 --cp 2 --save-dir %s",
                     stage_bin("08-context-parallel"), gpt_text(), a);
    CHECKF(st == 0, "08: exit %d\n%s", st, out);
    static const char *const again[3] = { "08-context-parallel " CP_GPT " --batch-size 32 --nproc 2 --cp 2",
                                          "08-context-parallel " CP_GPT " --batch-size 16 --nproc 4 --cp 2",
                                          "01-single-gpu " CP_GPT " --batch-size 32" };
    resumes_alike(gpt_text(), a, "gpt", again, "cpck");
    static const struct { const char *flags, *want; } bad[4] = {
        { CP_GPT " --nproc 4 --cp 3", "--cp 3 does not divide the job's 4 ranks" },
        { "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 20 --nproc 4 --cp 4",
          "--cp 4 --cp-layout zigzag: --seq-len 20 must be a multiple of 8" },
        { "--model mlp --nproc 2", "--model mlp: context parallelism splits sequences of tokens" },   /* on the images */
        { CP_GPT " --nproc 2 --tp 2", "--tp" },
    };
    for (int k = 0; k < 4; k++) {
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --steps 1", stage_bin("08-context-parallel"),
                     k == 2 ? small_data() : gpt_text(), bad[k].flags);
        CHECKF(st == 2 && strstr(out, bad[k].want), "08 %s: exit %d, expected \"%s\"\n%s", bad[k].flags, st, bad[k].want, out);
    }
}

/* --dtype bf16: activations in bf16 (the ring's sums in f32): 10 steps of
   08 over 2 ranks track stage 05 in bf16 on one rank within 5e-3 (measured
   7.6e-4: a bf16 rounding flips where the ring adds in another order), and
   are not the fp32 curve; fp16, which needs 05's loss scaling, is refused. */
TEST(context_parallel_trains_in_bf16, QUICK) {
    char out[16384], log[3][600];
    static const char *const runs[3] = { "05-accum-mixed-precision --dtype bf16", "08-context-parallel --nproc 2 --cp 2 --dtype bf16",
                                         "08-context-parallel --nproc 2 --cp 2" };
    double loss[3][10];
    for (int k = 0; k < 3; k++) {
        char stage[64];
        const char *sp = strchr(runs[k], ' ');
        snprintf(stage, sizeof stage, "%.*s", (int)(sp - runs[k]), runs[k]);
        snprintf(log[k], sizeof log[k], "%s/cp-bf16-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s " CP_GPT " --batch-size 16 --epochs 1 --steps 10 --quiet %s --log %s",
                         stage_bin(stage), gpt_text(), sp + 1, log[k]);
        CHECKF(st == 0 && log_series(log[k], "loss", loss[k], 10) == 10, "%s: exit %d\n%s", runs[k], st, out);
    }
    if (t_failed) return;
    double d = 0, from_fp32 = 0;
    for (int i = 0; i < 10; i++) {
        d = fmax(d, fabs(loss[1][i] - loss[0][i]));
        from_fp32 = fmax(from_fp32, fabs(loss[1][i] - loss[2][i]));
    }
    CHECKF(d <= 5e-3, "08 --dtype bf16: losses %.3g from 05's in bf16", d);
    CHECKF(from_fp32 > 0, "08 --dtype bf16 gave the fp32 curve bit for bit: bf16 did not run");
    /* the evaluation goes around the ring and gathers the logits, bf16 ones too */
    double e5 = summary_value(log[0], "eval_loss"), e8 = summary_value(log[1], "eval_loss");
    CHECKF(e5 > 0 && isfinite(e8) && fabs(e8 - e5) <= 5e-3, "08 --dtype bf16: eval loss %.6f, 05's in bf16 %.6f", e8, e5);
    int st = run_cmd(out, sizeof out, "%s --data %s " CP_GPT " --nproc 2 --cp 2 --dtype fp16 --steps 1", stage_bin("08-context-parallel"),
                     gpt_text());
    CHECKF(st == 2 && strstr(out, "--dtype fp16: fp16 needs its loss scaled (stage 05), which 08-context-parallel does not do"),
           "08 --dtype fp16: exit %d\n%s", st, out);
    /* llama (grouped-query attention) over 4 ranks, contiguous, against 05 in bf16 */
    static const char *const llama[2] = { "05-accum-mixed-precision --dtype bf16",
                                          "08-context-parallel --nproc 4 --cp 4 --cp-layout contiguous --dtype bf16" };
    double lloss[2][10];
    for (int k = 0; k < 2; k++) {
        char stage[64];
        const char *sp = strchr(llama[k], ' ');
        snprintf(stage, sizeof stage, "%.*s", (int)(sp - llama[k]), llama[k]);
        snprintf(log[k], sizeof log[k], "%s/cp-bf16-llama-%d.jsonl", tmpdir, k);
        st = run_cmd(out, sizeof out, "%s --data %s " CP_LLAMA " --batch-size 16 --epochs 1 --steps 10 --quiet %s --log %s",
                     stage_bin(stage), gpt_text(), sp + 1, log[k]);
        CHECKF(st == 0 && log_series(log[k], "loss", lloss[k], 10) == 10, "%s (llama): exit %d\n%s", llama[k], st, out);
    }
    if (t_failed) return;
    d = 0;
    for (int i = 0; i < 10; i++) d = fmax(d, fabs(lloss[1][i] - lloss[0][i]));
    e5 = summary_value(log[0], "eval_loss");
    e8 = summary_value(log[1], "eval_loss");
    CHECKF(d <= 5e-3 && e5 > 0 && isfinite(e8) && fabs(e8 - e5) <= 5e-3,
           "08 llama --cp 4 contiguous --dtype bf16: losses %.3g from 05's in bf16, eval loss %.6f against %.6f", d, e8, e5);
}
