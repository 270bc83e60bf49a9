/* tests/19-expert-parallel.c -- tests of dtrain.h's chapter 19-expert-parallel:
   the all-to-all of rows on the tape, stage 09 against stage 01, what each
   rank keeps, its checkpoints and its errors. (tests/helpers.h: how the
   suite's files make one program.) */
#include "helpers.h"

/* ---- the all-to-all of rows ---- */
/* Rank r sends rank q (r + 2q) % 3 rows: some pieces empty, every count
   different. Row i of rank r holds r * 100 + i + column / 1000. */
static int a2a_count(int r, int q) { return (r + 2 * q) % 3; }
typedef struct { dt_comm_group *group; int rank, P, D, failed; char why[200]; } a2a_rank;
static void *a2a_rank_main(void *arg) {
    a2a_rank *a = (a2a_rank *)arg;
    dt_comm *c = dt_comm_join(a->group, a->rank);
    int send[4], recv[4], rows = 0, got = 0, D = a->D;
    for (int q = 0; q < a->P; q++) {
        send[q] = a2a_count(a->rank, q);
        recv[q] = a2a_count(q, a->rank);
        rows += send[q];
        got += recv[q];
    }
    dt_step_arena_reset();
    int shape[2] = { rows, D };
    dt_tensor *x = dt_tensor_new(2, shape);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < D; j++) x->data[(size_t)i * D + j] = (float)(a->rank * 100 + i) + (float)j / 1000;
    x->requires_grad = 1;
    dt_tensor *y = dt_all_to_all_rows(c, x, send, recv);
    /* rank q's rows for this rank arrive in rank order, each run in the order q sent them */
    int row = 0;
    for (int q = 0; q < a->P && !a->failed; q++) {
        int first = 0;
        for (int p = 0; p < a->rank; p++) first += a2a_count(q, p);
        for (int i = 0; i < recv[q]; i++, row++)
            for (int j = 0; j < D; j++)
                if (y->data[(size_t)row * D + j] != (float)(q * 100 + first + i) + (float)j / 1000) {
                    a->failed = 1;
                    snprintf(a->why, sizeof a->why, "rank %d of %d: row %d (rank %d's row %d) column %d is %g", a->rank, a->P,
                             row, q, first + i, j, (double)y->data[(size_t)row * D + j]);
                }
    }
    if (y->shape[0] != got && !a->failed) {
        a->failed = 1;
        snprintf(a->why, sizeof a->why, "rank %d of %d: %d rows arrived, %d expected", a->rank, a->P, y->shape[0], got);
    }
    /* backward: each row's gradient (its own values, times 2) goes home */
    float *dy = (float *)malloc(sizeof(float) * (size_t)(got * D + 1));
    for (int i = 0; i < got * D; i++) dy[i] = 2 * y->data[i];
    dt_backward_from(y, dy);
    for (int i = 0; i < rows * D && !a->failed; i++)
        if (!x->grad || x->grad[i] != 2 * x->data[i]) {
            a->failed = 1;
            snprintf(a->why, sizeof a->why, "rank %d of %d: gradient %d is %g, expected %g", a->rank, a->P, i,
                     x->grad ? (double)x->grad[i] : -1.0, 2.0 * x->data[i]);
        }
    free(dy);
    dt_comm_free(c);
    dt__context_release();
    return NULL;
}
/* Over 1 to 4 ranks (threads), uneven pieces and empty ones: every row
   arrives where it was sent, in order, and its gradient comes back to the
   row it came from. */
TEST(all_to_all_rows_moves_rows_and_their_gradients_over_1_to_4_ranks, QUICK) {
    for (int P = 1; P <= 4; P++) {
        dt_comm_group *g = dt_comm_group_create(P, 30);
        a2a_rank a[4];
        pthread_t th[4];
        for (int r = 0; r < P; r++) {
            a[r] = (a2a_rank){ g, r, P, 5, 0, "" };
            pthread_create(&th[r], NULL, a2a_rank_main, &a[r]);
        }
        for (int r = 0; r < P; r++) {
            pthread_join(th[r], NULL);
            CHECKF(!a[r].failed, "all_to_all_rows: %s", a[r].why);
        }
        dt_comm_group_free(g);
    }
}

/* ---- stage 09 ---- */
typedef struct { int nproc, ep, batch; const char *flags; } ep_run;
/* 09 against 01 at the same global batch (32), 20 steps (2 epochs of 320
   sequences): every step's loss and the eval loss within 1e-5, every weight
   and Adam moment within 2e-5, and the same choices dropped each step. */
static void ep_equals_01(const char *flags, const char *tag, const ep_run *runs, int n) {
    char out[16384], ref[600], rlog[700], dir[600], log[700], p[700], q[800];
    snprintf(ref, sizeof ref, "%s/ep-%s-01", tmpdir, tag);
    snprintf(rlog, sizeof rlog, "%s.jsonl", ref);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --batch-size 32 --save-dir %s --log %s", train_cpu, gpt_text(),
                     flags, ref, rlog);
    CHECKF(st == 0, "01: exit %d\n%s", st, out);
    const char *model = strstr(flags, "llama") ? "llama" : "gpt";
    snprintf(p, sizeof p, "%s/%s_data0-320_epoch2", ref, model);
    double want_dropped[32], got_dropped[32];
    int nd = log_series(rlog, "moe_dropped", want_dropped, 32);
    double dropped = 0;
    for (int i = 0; i < nd; i++) dropped += want_dropped[i];
    CHECKF(!strstr(flags, "--moe-capacity") || dropped > 0, "%s: 01 dropped no choice in %d steps", tag, nd);
    for (int k = 0; k < n; k++) {
        snprintf(dir, sizeof dir, "%s/ep-%s-%d", tmpdir, tag, k);
        snprintf(log, sizeof log, "%s.jsonl", dir);
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s %s --batch-size %d --nproc %d --ep %d --save-dir %s --log %s",
                     stage_bin("09-expert-parallel"), gpt_text(), flags, runs[k].flags, runs[k].batch, runs[k].nproc, runs[k].ep,
                     dir, log);
        CHECKF(st == 0, "09 --nproc %d --ep %d %s: exit %d\n%s", runs[k].nproc, runs[k].ep, runs[k].flags, st, out);
        double dl = losses_differ_by(rlog, log, 20);
        CHECKF(dl <= 1e-5, "%s 09 --nproc %d --ep %d %s: losses differ from 01's by %.3g", tag, runs[k].nproc, runs[k].ep,
               runs[k].flags, dl);
        /* (with a capacity, evaluation's last batch is not 01's: the loader pads
           the 35 sequences to 36 so that every rank scores as many, and the
           padding takes part in the capacity's cut) */
        double e1 = summary_value(rlog, "eval_loss"), e9 = summary_value(log, "eval_loss");
        CHECKF(e1 > 0 && (strstr(flags, "--moe-capacity") || fabs(e1 - e9) <= 1e-5), "%s 09 --nproc %d --ep %d %s: eval loss %.6f, 01's %.6f", tag, runs[k].nproc,
               runs[k].ep, runs[k].flags, e9, e1);
        int nd9 = log_series(log, "moe_dropped", got_dropped, 32);
        CHECKF(nd == 20 && nd9 == nd, "%s: %d and %d steps logged moe_dropped", tag, nd, nd9);
        for (int i = 0; i < nd && i < nd9; i++)
            CHECKF(got_dropped[i] == want_dropped[i], "%s 09 --nproc %d --ep %d %s: step %d dropped %g choices, 01 %g", tag,
                   runs[k].nproc, runs[k].ep, runs[k].flags, i + 1, got_dropped[i], want_dropped[i]);
        snprintf(q, sizeof q, "%s/%s_data0-320_epoch2", dir, model);   /* whole, FSDP's too: the experts gathered */
        double d = max_tensor_diff(p, q);
        CHECKF(d >= 0 && d <= 2e-5, "%s 09 --nproc %d --ep %d %s: weights or Adam moments differ from 01's by %.3g", tag,
               runs[k].nproc, runs[k].ep, runs[k].flags, d);
    }
}
#define EP_GPT "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --moe-experts 4 --moe-top-k 2"
#define EP_LLAMA "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --moe-experts 8 --moe-top-k 1"
/* P = 2 and 4 with E = 4, top-2 (gpt) and E = 8, top-1 (llama), dropless;
   llama's P = 2 as 2 groups of 2, the experts averaged over the groups
   only. And a capacity so small that most choices drop, and whole ranks
   are left with no slot or no row for an expert: the same. */
TEST(expert_parallel_equals_one_device, QUICK) {
    static const ep_run gpt[2] = { { 2, 2, 16, "" }, { 4, 4, 8, "" } }, llama[2] = { { 4, 4, 8, "" }, { 4, 2, 8, "" } };
    ep_equals_01(EP_GPT, "gpt", gpt, 2);
    ep_equals_01(EP_LLAMA, "llama", llama, 2);
    static const ep_run starved[1] = { { 4, 2, 8, "" } };
    ep_equals_01("--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --moe-experts 8 --moe-top-k 1 --moe-capacity 0.01",
                 "gpt-starved", starved, 1);
}
/* A capacity that drops choices and the balancing loss (taken over the
   whole job's batch, ties by place in 01's batch): the same choices drop.
   4 ranks as 2 groups of 2, under DDP and under FSDP (ZeRO-1, -2, -3, whose
   units meet the group's sum one by one); P = 4 with top-2. */
TEST(expert_parallel_with_capacity_and_engines_equals_one_device, FULL) {
    static const ep_run gpt[4] = { { 4, 2, 8, "" }, { 4, 2, 8, "--shard full" }, { 4, 2, 8, "--shard grads" },
                                   { 4, 4, 8, "--shard optimizer --bucket-mb 0" } };
    ep_equals_01(EP_GPT " --moe-capacity 0.8 --moe-aux-loss 0.05", "gpt-capacity", gpt, 4);
    static const ep_run llama[2] = { { 2, 2, 16, "--recompute" }, { 4, 4, 8, "--shard full" } };
    ep_equals_01("--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16 --moe-experts 8 --moe-top-k 2 "
                 "--moe-capacity 1", "llama-capacity", llama, 2);
}

/* Each rank keeps E/P experts: the memory table's parameters, X/P + R, are
   what the model holds with E/P of each layer's experts (counted here from
   the model itself), and its gradients and Adam state the same. A
   checkpoint is whole: it resumes bit for bit in 09, in 09 over another
   --ep, and in stage 01. Bad flags are refused, naming them. */
TEST(expert_parallel_keeps_its_experts_and_saves_the_whole_model, QUICK) {
    char out[16384], a[600];
    dt_model_config mc = { .kind = DT_MODEL_GPT, .dim = 32, .depth = 2, .heads = 2, .seq_len = 16, .classes = 256,
                           .mlp_hidden = 128, .moe_experts = 4, .moe_top_k = 2, .moe_every = 1 };
    dt_model *m = dt_model_create(&mc, 1);
    double experts = 0, shared = 0;
    for (int i = 0; i < m->nparams; i++) *(m->splits[i].expert ? &experts : &shared) += 4.0 * (double)m->params[i].numel;
    dt_model_free(m);
    CHECKF(experts > 2 * shared, "the test model's experts %.0f bytes, the rest %.0f", experts, shared);
    char want[200], log[700];
    snprintf(log, sizeof log, "%s/epmem.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " EP_GPT " --batch-size 16 --nproc 2 --ep 2 --steps 1 --log %s",
                     stage_bin("09-expert-parallel"), gpt_text(), log);
    snprintf(want, sizeof want, "  parameters       %9.3f %9.3f   (X/2 + R)", (experts / 2 + shared) / 1e6, (experts + shared) / 1e6);
    CHECKF(st == 0 && strstr(out, want) && strstr(out, "2 of every MoE layer's 4 experts here (experts 0-1)"),
           "09 --ep 2: exit %d, expected \"%s\" in its memory table\n%s", st, want, out);
    static const char *const arenas[3] = { "peak_params_bytes", "peak_grads_bytes", "peak_optimizer_bytes" };
    for (int k = 0; k < 3; k++)
        CHECKF(summary_value(log, arenas[k]) == (k == 2 ? 2 : 1) * (experts / 2 + shared), "09 --ep 2: %s %.0f, expected %.0f",
               arenas[k], summary_value(log, arenas[k]), (k == 2 ? 2 : 1) * (experts / 2 + shared));
    snprintf(a, sizeof a, "%s/epck-a", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " EP_GPT " --batch-size 16 --nproc 2 --ep 2 --save-dir %s",
                 stage_bin("09-expert-parallel"), gpt_text(), a);
    CHECKF(st == 0, "09: exit %d\n%s", st, out);
    static const char *const again[3] = { "09-expert-parallel " EP_GPT " --batch-size 16 --nproc 2 --ep 2",
                                          "09-expert-parallel " EP_GPT " --batch-size 8 --nproc 4 --ep 4",
                                          "01-single-gpu " EP_GPT " --batch-size 32" };
    resumes_alike(gpt_text(), a, "gpt", again, "epck");
    static const struct { const char *flags, *want; } bad[5] = {
        { EP_GPT " --nproc 4 --ep 3", "--ep 3 does not divide the job's 4 ranks" },
        { "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --moe-experts 6 --moe-top-k 2 --nproc 4 --ep 4",
          "--moe-experts 6 does not divide by --ep 4" },
        { "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --moe-experts 4 --moe-top-k 5 --nproc 2",
          "--moe-top-k 5: a token cannot go to more than the 4 experts" },
        { "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --nproc 2", "this model has no experts to spread" },
        { EP_GPT " --nproc 2 --dtype fp16", "--dtype fp16: fp16 needs its loss scaled (stage 05), which 09-expert-parallel" },
    };
    for (int k = 0; k < 5; k++) {
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --steps 1", stage_bin("09-expert-parallel"), gpt_text(),
                     bad[k].flags);
        CHECKF(st == 2 && strstr(out, bad[k].want), "09 %s: exit %d, expected \"%s\"\n%s", bad[k].flags, st, bad[k].want, out);
    }
}

/* --dtype bf16: the rows cross the all-to-alls in bf16. 10 steps of 09 over
   2 ranks track stage 05 in bf16 on one rank within 5e-3 and are not the
   fp32 curve. */
TEST(expert_parallel_trains_in_bf16, FULL) {
    char out[16384], log[3][600];
    static const char *const runs[3] = { "05-accum-mixed-precision --batch-size 16 --dtype bf16",
                                         "09-expert-parallel --nproc 2 --batch-size 8 --dtype bf16",
                                         "09-expert-parallel --nproc 2 --batch-size 8" };
    double loss[3][10];
    for (int k = 0; k < 3; k++) {
        char stage[64];
        const char *sp = strchr(runs[k], ' ');
        snprintf(stage, sizeof stage, "%.*s", (int)(sp - runs[k]), runs[k]);
        snprintf(log[k], sizeof log[k], "%s/ep-bf16-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s " EP_GPT " --epochs 1 --steps 10 --quiet %s --log %s", stage_bin(stage),
                         gpt_text(), sp + 1, log[k]);
        CHECKF(st == 0 && log_series(log[k], "loss", loss[k], 10) == 10, "%s: exit %d\n%s", runs[k], st, out);
    }
    if (t_failed) return;
    double d = 0, from_fp32 = 0;
    for (int i = 0; i < 10; i++) {
        d = fmax(d, fabs(loss[1][i] - loss[0][i]));
        from_fp32 = fmax(from_fp32, fabs(loss[1][i] - loss[2][i]));
    }
    CHECKF(d <= 5e-3, "09 --dtype bf16: losses %.3g from 05's in bf16", d);
    CHECKF(from_fp32 > 0, "09 --dtype bf16 gave the fp32 curve bit for bit: bf16 did not run");
}
