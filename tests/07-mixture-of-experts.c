/* tests/07-mixture-of-experts.c -- tests of dtrain.h's chapter 07-mixture-of-experts:
   the route (top k, capacity, which choices drop, the slots' order, the
   balancing term) by hand, and every op's backward -- and the whole layer's,
   dropping or not -- against finite differences. */
#include "helpers.h"

/* ---- mixture of experts: the route by hand, the ops against finite differences ---- */

/* 6 tokens, 3 experts, top 1, capacity factor 1: each expert takes
   ceil(1 x 1 x 6 / 3) = 2. Expert 0 is first choice of tokens 0, 1, 2 and 5,
   so the two least probable of those drop: token 2, and of tokens 1 and 5,
   which tie (the same scores), the later one. */
TEST(moe_route_keeps_the_most_probable_and_numbers_slots_by_expert, QUICK) {
    float scores[6][3] = { { 3, 0, 0 }, { 1, 0, 0 }, { 0.5f, 0, 0 }, { 0, 2, 0 }, { 0, 0, 1 }, { 1, 0, 0 } };
    int s[2] = { 6, 3 };
    dt_step_arena_reset();
    dt_tensor *logits = dt_tensor_from_host(2, s, &scores[0][0]);
    dt_moe_stats st = { 3, (int64_t[3]){ 0 }, 0, 0, 0, 0 };
    dt_moe_plan *p = dt_moe_route(logits, 1, 1.0f, 6, &st, NULL);
    CHECKF(p->capacity == 2 && p->dropped == 2 && p->S == 4, "capacity %d, dropped %d, slots %d", p->capacity, p->dropped, p->S);
    CHECK(p->routed[0] == 4 && p->routed[1] == 1 && p->routed[2] == 1);
    /* kept: tokens 0 and 1 at expert 0, then 3 at 1, 4 at 2 -- expert order, then token order */
    int want_token[4] = { 0, 1, 3, 4 }, want_first[4] = { 0, 2, 3, 4 };
    for (int i = 0; i < 4; i++) CHECKF(p->slot_token[i] == want_token[i], "slot %d holds token %d", i, p->slot_token[i]);
    for (int e = 0; e <= 3; e++) CHECKF(p->expert_first[e] == want_first[e], "expert %d starts at slot %d", e, p->expert_first[e]);
    CHECK(p->slot_of_choice[2] == -1 && p->slot_of_choice[5] == -1 && p->slot_of_choice[1] == 1);
    /* E x sum f_e P_e, f = (4, 1, 1) / 6, P the mean of the softmax columns */
    double P[3] = { 0 }, want = 0;
    for (int n = 0; n < 6; n++) {
        double z = 0;
        for (int e = 0; e < 3; e++) z += exp(scores[n][e]);
        for (int e = 0; e < 3; e++) P[e] += exp(scores[n][e]) / z / 6;
    }
    want = 3 * (4.0 / 6 * P[0] + 1.0 / 6 * P[1] + 1.0 / 6 * P[2]);
    CHECKF(CLOSE(p->balance, want, 1e-6), "balance %.7g, by hand %.7g", (double)p->balance, want);
    CHECK(st.layers == 1 && st.dropped == 2 && st.choices == 6 && st.routed[0] == 4);
    /* top 2, no limit: every token's two best, most probable first, lower index on a tie */
    p = dt_moe_route(logits, 2, 0, 6, NULL, NULL);
    CHECKF(p->S == 12 && p->dropped == 0 && p->choice[0] == 0 && p->choice[1] == 1 && p->choice[6] == 1 && p->choice[7] == 0,
           "slots %d, token 0 chose %d then %d, token 3 %d then %d", p->S, p->choice[0], p->choice[1], p->choice[6], p->choice[7]);
    dt_step_arena_reset();
}

/* Ranks of a data-parallel engine route the whole batch as one device with
   all of it: here rank 1 of 2, each with 2 sequences of 2 tokens, every token
   scoring the experts alike, so the capacity's cut (3 of the batch's 8
   choices) falls among ties, broken by the place in stage 01's batch. The
   loader deals samples in turn (rank r's sample j is the batch's j x 2 + r),
   so the batch's first three tokens are rank 0's sample 0 and rank 1's
   first token: this rank keeps that one alone. */
static void fake_gather(dt_parallel *par, const float *mine, float *all, int64_t n, int *rank, int *ranks) {
    (void)par;
    *rank = 1; *ranks = 2;
    if (all) { memcpy(all, mine, sizeof(float) * (size_t)n); memcpy(all + n, mine, sizeof(float) * (size_t)n); }
}
TEST(moe_route_of_a_data_parallel_rank_cuts_ties_by_the_place_in_the_whole_batch, QUICK) {
    float scores[4][2] = { { 1, 0 }, { 1, 0 }, { 1, 0 }, { 1, 0 } };
    int s[2] = { 4, 2 };
    dt_parallel batch = { .data_all_gather = fake_gather };
    dt_step_arena_reset();
    dt_moe_plan *p = dt_moe_route(dt_tensor_from_host(2, s, &scores[0][0]), 1, 0.75f, 2, NULL, &batch);
    CHECKF(p->N_all == 8 && p->capacity == 3 && p->S == 1 && p->slot_token[0] == 0 && p->dropped == 3,
           "the whole batch %d tokens, capacity %d; this rank keeps %d (the first: token %d), drops %d", p->N_all, p->capacity,
           p->S, p->S ? p->slot_token[0] : -1, p->dropped);
    CHECK(p->routed[0] == 8 && p->routed[1] == 0);
    dt_step_arena_reset();
}

/* Expert e: y = x W_e^T, its weight the leaf after the router. */
static dt_tensor *one_linear_expert(void *ctx, int e, dt_tensor *rows) { return dt_linear(rows, ((dt_tensor **)ctx)[2 + e], NULL); }
typedef struct { int k; float capacity, coef; } moe_case;
static dt_tensor *f_moe_layer(dt_tensor **l, void *c) {
    const moe_case *mc = (const moe_case *)c;
    dt_moe_layer L = { l[1], mc->k, 1, mc->capacity, mc->coef, one_linear_expert, l, NULL, NULL };
    return dt_moe_forward(&L, l[0]);
}
static dt_tensor *f_gate_weights(dt_tensor **l, void *c) {
    const moe_case *mc = (const moe_case *)c;
    return dt_moe_gate_weights(l[0], dt_moe_route(l[0], mc->k, mc->capacity, 1, NULL, NULL), 0);
}
static dt_tensor *f_rows_cat(dt_tensor **l, void *c) {
    (void)c;
    dt_tensor *parts[3] = { dt_rows(l[0], 3, 2), l[1], dt_rows(l[0], 0, 3) };
    return dt_cat_rows(parts, 3);
}

TEST(moe_ops_and_layer_match_finite_differences, QUICK) {
    dt__rng r = { 21 };
    /* 9 tokens of 5 into 4 experts, each a 5 x 5 linear layer */
    dt_tensor *x = leaf2(9, 5, &r, 1), *router = leaf2(4, 5, &r, 1.5), *w[4];
    for (int e = 0; e < 4; e++) w[e] = leaf2(5, 5, &r, 0.7);
    dt_tensor *L[6] = { x, router, w[0], w[1], w[2], w[3] };
    moe_case cases[4] = { { 2, 0, 0 }, { 1, 0, 0 }, { 2, 1.0f, 0 }, { 1, 0.75f, 0 } };
    const char *names[4] = { "top 2", "top 1", "top 2, capacity 1 (drops)", "top 1, capacity 0.75 (drops)" };
    for (int c = 0; c < 4; c++) fd_check(names[c], f_moe_layer, L, 6, &cases[c], 1e-3f, 3e-3);
    dt_tensor *logits = leaf2(7, 4, &r, 2);
    for (int c = 0; c < 4; c++) fd_check("gate weights", f_gate_weights, &logits, 1, &cases[c], 1e-3f, 3e-3);
    dt_tensor *a = leaf2(5, 3, &r, 1), *b = leaf2(2, 3, &r, 1), *RC[2] = { a, b };
    fd_check("rows and cat_rows", f_rows_cat, RC, 2, NULL, 1e-2f, 1e-3);
    leaf_free(a); leaf_free(b); leaf_free(logits);
    leaf_free(x); leaf_free(router);
    for (int e = 0; e < 4; e++) leaf_free(w[e]);
}

/* The balancing term's gradient, which backward adds on its own (coef x
   d(balance)/d(logits), f held: it only counts), against the term's finite
   differences: the gate weights' own gradient seeded with zeros. */
TEST(moe_balancing_gradient_matches_finite_differences, QUICK) {
    dt__rng r = { 5 };
    dt_tensor *logits = leaf2(8, 4, &r, 1);
    for (int k = 1; k <= 2; k++) {
        memset(logits->grad, 0, sizeof(float) * 32);
        dt_step_arena_reset();
        dt_moe_plan *p = dt_moe_route(logits, k, 0, 8, NULL, NULL);
        dt_tensor *w = dt_moe_gate_weights(logits, p, 0.5f);
        float zeros[64] = { 0 };
        dt_backward_from(w, zeros);
        double worst = 0;
        for (int i = 0; i < 32; i++) {
            float keep = logits->data[i];
            double b[2];
            for (int side = 0; side < 2; side++) {
                logits->data[i] = keep + (side ? -1e-2f : 1e-2f);   /* the term is a float: a wide step */
                dt_step_arena_reset();
                b[side] = dt_moe_route(logits, k, 0, 8, NULL, NULL)->balance;
            }
            logits->data[i] = keep;
            double num = 0.5 * (b[0] - b[1]) / 2e-2, err = fabs(num - logits->grad[i]) / (1e-2 + fabs(num));
            worst = err > worst ? err : worst;
            CHECKF(err <= 3e-3, "top %d: logit %d: analytic %.6g, numeric %.6g", k, i, (double)logits->grad[i], num);
        }
    }
    dt_step_arena_reset();
    leaf_free(logits);
}

/* The experts in a model: GPT-2's with experts in its second block, and
   Mixtral's (a llama with experts in every block) -- their names, and the
   whole model's gradients against finite differences, with tokens dropped
   and not. */
typedef struct { dt_model *m; const float *ids; const int32_t *labels; } moe_model_ctx;
static dt_tensor *f_moe_model(dt_tensor **l, void *c) {
    (void)l;
    const moe_model_ctx *g = (const moe_model_ctx *)c;
    int s[2] = { 2, 5 };
    return dt_cross_entropy(dt_model_forward(g->m, dt_tensor_from_host(2, s, g->ids)), g->labels);
}
TEST(models_with_experts_have_mixtral_names_and_match_finite_differences, FULL) {
    float ids[10] = { 1, 7, 7, 3, 10, 0, 5, 1, 1, 9 };
    int32_t labels[10] = { 7, 7, 3, 10, 2, 5, 1, 1, 9, 4 };
    for (int variant = 0; variant < 4; variant++) {
        int llama = variant >= 2;
        float capacity = variant % 2 ? 0.6f : 0;              /* 0.6 x k x 10 / 4: 3 or 6 choices an expert, some dropped */
        dt_model_config c = { llama ? DT_MODEL_LLAMA : DT_MODEL_GPT, 0, 0, 11, 12, 2, 2, 0, 16, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                              0, 0, "", 4, llama ? 2 : 1, llama ? 1 : 2, capacity, 0 };
        dt_model *m = dt_model_create(&c, 9);
        const char *want = llama ? "model.layers.0.block_sparse_moe.experts.3.w2.weight" : "h.1.mlp.experts.3.c_proj.bias";
        dt_tensor *p = dt_model_param(m, want);
        CHECKF(p && p->shape[0] == (llama ? 12 : 12), "%s: %s", want, p ? "the wrong shape" : "absent");
        CHECKF(!llama || dt_model_param(m, "model.layers.1.block_sparse_moe.gate.weight"), "llama: no router in block 1");
        CHECKF(llama || (dt_model_param(m, "h.0.mlp.c_fc.weight") && !dt_model_param(m, "h.0.mlp.gate.weight")),
               "gpt, --moe-every 2: block 0 is not dense");
        for (int64_t i = 0; i < m->numel; i++) m->flat_data[i] *= 3;     /* larger weights: every path matters */
        moe_model_ctx g = { m, ids, labels };
        dt_tensor **leaves = (dt_tensor **)malloc(sizeof(dt_tensor *) * m->nparams);
        for (int i = 0; i < m->nparams; i++) leaves[i] = &m->params[i];
        dt_model_zero_grad(m);
        char what[64];
        snprintf(what, sizeof what, "%s with experts%s", llama ? "llama" : "gpt", capacity > 0 ? ", dropping" : "");
        fd_check(what, f_moe_model, leaves, m->nparams, &g, 2e-3f, 2e-2);
        free(leaves);
        dt_model_free(m);
    }
}

/* Flags that cannot work are refused, naming the flag (exit 2); a checkpoint
   of a model with experts resumes exactly, into its own shape only. */
TEST(moe_flags_are_checked_and_checkpoints_resume_exactly, QUICK) {
    char out[16384], a[600], b[600], p[800], q[800];
    static const struct { const char *stage, *flags, *names; } bad[] = {
        { "01-single-gpu", "--model gpt --moe-experts 2 --moe-top-k 3", "--moe-top-k" },
        { "01-single-gpu", "--model gpt --moe-top-k 2", "--moe-experts" },
        { "01-single-gpu", "--model mlp --moe-experts 2", "--moe-experts" },
        { "01-single-gpu", "--model llama --moe-experts 2 --moe-every 2", "--moe-every" },
        { "01-single-gpu", "--model llama --moe-experts 2 --qkv-bias", "--qkv-bias" },
        { "01-single-gpu", "--model gpt --moe-experts 2 --moe-capacity -1", "--moe-capacity" },
        { "02-dp", "--model gpt --moe-experts 2 --moe-aux-loss 0.01", "--moe-aux-loss" },
        { "03-ddp", "--model gpt --moe-experts 2 --moe-capacity 1 --recompute", "--recompute" },
        { "05-accum-mixed-precision", "--model gpt --moe-experts 2 --moe-capacity 1 --accum-steps 2", "--accum-steps" },
        { "06-tensor-parallel", "--model gpt --moe-experts 2", "--moe-experts" } };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int st = run_cmd(out, sizeof out, "%s --data %s %s --steps 1", stage_bin(bad[i].stage), gpt_text(), bad[i].flags);
        expect_error_in(bad[i].flags, out, st, 2, bad[i].names);
    }
    const char *model = "--model llama --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4 --moe-experts 4 --moe-top-k 1 "
                        "--moe-capacity 1.25 --moe-aux-loss 0.01 --quiet";
    snprintf(a, sizeof a, "%s/moe-straight", tmpdir);
    snprintf(b, sizeof b, "%s/moe-resumed", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --steps 8 --save-dir %s", train_cpu, gpt_text(), model, a);
    CHECKF(st == 0, "8 steps: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --steps 4 --save-dir %s", train_cpu, gpt_text(), model, b);
    CHECKF(st == 0, "4 steps: exit %d\n%s", st, out);
    run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step4'", b);
    out[strcspn(out, "\n")] = 0;
    dt__copy_str(q, sizeof q, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --steps 8 --resume %s --save-dir %s", train_cpu, gpt_text(), model, q, b);
    CHECKF(st == 0, "resumed: exit %d\n%s", st, out);
    run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step8'", a);
    out[strcspn(out, "\n")] = 0;
    dt__copy_str(p, sizeof p, out);
    run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step8'", b);
    out[strcspn(out, "\n")] = 0;
    CHECKF(files_equal_tensors(p, out), "resumed at step 4, the run does not end bit for bit where the straight one does");
    /* into a model of other experts, or none: refused, naming the shape's numbers */
    st = run_cmd(out, sizeof out, "%s --data %s --model llama --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4 "
                 "--moe-experts 2 --steps 8 --resume %s", train_cpu, gpt_text(), q);
    expect_error_in("--resume with 2 experts", out, st, 1, "moe_experts");
    st = run_cmd(out, sizeof out, "%s --data %s --model llama --dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4 --steps 8 "
                 "--resume %s", train_cpu, gpt_text(), q);
    expect_error_in("--resume without experts", out, st, 1, "llama");
}
