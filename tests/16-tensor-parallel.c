/* tests/16-tensor-parallel.c -- tests of dtrain.h's chapter
   16-tensor-parallel: stage 06. (tests/helpers.h: how the suite's files make
   one program.) */
#include "helpers.h"

/* ---- stage 06: tensor parallelism ---- */

/* The losses of two --log files agree within tol, step by step (and they
   logged as many steps); the largest difference, or 1e9. */
static double losses_differ_by(const char *a, const char *b, int expect) {
    double x[64], y[64];
    int n = read_losses(a, x, 64), m = read_losses(b, y, 64);
    double worst = n == expect && m == expect ? 0 : 1e9;
    for (int i = 0; i < n && i < m; i++) worst = fmax(worst, fabs(x[i] - y[i]));
    return worst;
}
/* 06 at T = 2 and 4 against stage 01 with the same batch of 32, 20 steps (2
   epochs of 320 samples), and --tp 2 over 4 ranks (2 groups of 16 each)
   against 01 with 32 all the same; each also with --sequence-parallel (once
   with --recompute, whose blocks run again inside the rows-split region):
   only the order of the sums differs (each row-parallel layer adds T partial
   products). Losses within 1e-5, every weight and Adam moment within 2e-5,
   as for DDP. */
typedef struct { int nproc, tp, batch; const char *flags; } tp_layout;
static void tp_layouts_equal_01(const char *data, int samples, const char *flags, const char *model, const char *extra,
                                const tp_layout *layouts, int nlayouts) {
    char out[16384], ref[600], rlog[700], dir[600], log[700], p[700], q[700];
    snprintf(ref, sizeof ref, "%s/tp-%s-01%s", tmpdir, model, *extra ? "-x" : "");
    snprintf(rlog, sizeof rlog, "%s.jsonl", ref);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s %s --batch-size 32 --save-dir %s --log %s", train_cpu, data,
                     flags, extra, ref, rlog);
    CHECKF(st == 0, "01: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/%s_data0-%d_epoch2", ref, model, samples);
    for (int k = 0; k < nlayouts; k++) {
        snprintf(dir, sizeof dir, "%s/tp-%s-%d%s", tmpdir, model, k, *extra ? "-x" : "");
        snprintf(log, sizeof log, "%s.jsonl", dir);
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s %s %s --batch-size %d --nproc %d --tp %d --save-dir %s --log %s",
                     stage_bin("06-tensor-parallel"), data, flags, extra, layouts[k].flags, layouts[k].batch, layouts[k].nproc,
                     layouts[k].tp, dir, log);
        CHECKF(st == 0, "06 --nproc %d --tp %d %s: exit %d\n%s", layouts[k].nproc, layouts[k].tp, layouts[k].flags, st, out);
        double dl = losses_differ_by(rlog, log, 20);
        CHECKF(dl <= 1e-5, "%s %s 06 --nproc %d --tp %d %s: losses differ from 01 by %.3g", model, extra, layouts[k].nproc,
               layouts[k].tp, layouts[k].flags, dl);
        double e1 = summary_value(rlog, "eval_loss"), e6 = summary_value(log, "eval_loss");   /* the whole logits, gathered */
        CHECKF(e1 > 0 && fabs(e1 - e6) <= 1e-5, "%s %s 06 --nproc %d --tp %d %s: eval loss %.6f, 01's %.6f", model, extra,
               layouts[k].nproc, layouts[k].tp, layouts[k].flags, e6, e1);
        snprintf(q, sizeof q, "%s/%s_data0-%d_epoch2", dir, model, samples);
        double d = max_tensor_diff(p, q);
        CHECKF(d >= 0 && d <= 2e-5, "%s %s 06 --nproc %d --tp %d %s: weights or optimizer state differ from 01 by %.3g", model,
               extra, layouts[k].nproc, layouts[k].tp, layouts[k].flags, d);
    }
}
static void tp_equivalence(const char *data, int samples, const char *flags, const char *model, const char *extra) {
    static const tp_layout layouts[6] = {
        { 2, 0, 32, "" }, { 4, 0, 32, "" }, { 4, 2, 16, "" },
        { 2, 0, 32, "--sequence-parallel" }, { 4, 0, 32, "--sequence-parallel --recompute" }, { 4, 2, 16, "--sequence-parallel" } };
    tp_layouts_equal_01(data, samples, flags, model, extra, layouts, 6);
}
TEST(tensor_parallel_equals_one_device, QUICK) {
    tp_equivalence(small_data(), 320, "", "mlp", "");
    tp_equivalence(small_data(), 320, "--model vit --depth 2 --heads 4 --patch 4", "vit", "");
    tp_equivalence(gpt_text(), 320, "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16", "gpt", "");
    /* llama: grouped-query attention (8 query heads, 4 key/value heads: at T = 4 each rank has 2 and 1), RMSNorm,
       the gated MLP, and its own head (split by the vocabulary as the tied one is) */
    tp_equivalence(gpt_text(), 320, "--model llama --dim 32 --depth 2 --heads 8 --kv-heads 4 --seq-len 16 --untied-head",
                   "llama", "");
    /* clipping on every step: the norm counts each replicated gradient once */
    tp_equivalence(small_data(), 320, "--model vit --depth 2 --heads 4 --patch 4", "vit", "--clip 0.01");
}

/* The ViT's last block carries the class token alone (the models chapter)
   only where each rank's rows are whole sequences. Under --sequence-parallel
   with a batch that does not divide over the group -- 6 sequences of 10
   tokens over 4 ranks, 15 rows each -- it runs on every token, as timm's
   does, and trains as stage 01 does (20 steps; losses within 1e-5, weights
   and Adam moments within 2e-5). */
TEST(vit_sequence_parallel_with_sequences_cut_equals_one_device, QUICK) {
    char out[16384], dir[600], log[2][700], ck[2][700];
    const char *flags = "--model vit --image-size 24 --patch 8 --dim 32 --depth 2 --heads 4 --batch-size 6 --end-idx 60 "
                        "--epochs 2 --log-every 1000 --quiet";
    for (int k = 0; k < 2; k++) {
        snprintf(dir, sizeof dir, "%s/vit-sequences-cut-%d", tmpdir, k);
        snprintf(log[k], sizeof log[k], "%s.jsonl", dir);
        int st = run_cmd(out, sizeof out, "%s --data %s %s %s --save-dir %s --log %s", k ? stage_bin("06-tensor-parallel") : train_cpu,
                         small_data(), flags, k ? "--nproc 4 --sequence-parallel" : "", dir, log[k]);
        CHECKF(st == 0, "%s: exit %d\n%s", k ? "06 --nproc 4 --sequence-parallel" : "01", st, out);
        snprintf(ck[k], sizeof ck[k], "%s/vit_data0-60_epoch2", dir);
    }
    double dl = losses_differ_by(log[0], log[1], 20), dw = max_tensor_diff(ck[0], ck[1]);
    CHECKF(dl <= 1e-5 && dw >= 0 && dw <= 2e-5, "06 --sequence-parallel, 6 sequences of 10 tokens over 4 ranks: losses differ from "
           "01's by %.3g, weights or optimizer state by %.3g", dl, dw);
}

/* 2-D parallelism: FSDP around tensor parallelism. 4 ranks are 2 groups of
   --tp 2; the data-parallel engine shards each rank's pieces over the 2
   ranks that hold the same pieces (ZeRO-1, -2, -3, and -3 with the shards
   in host memory), and 20 steps equal stage 01's at the same global batch:
   the losses, the eval loss, and the weights and optimizer state of the
   checkpoint, which the engine and tensor parallelism gather whole between
   them. Clipping counts every gradient once (the shards over the groups,
   the replicated parameters once in each group). */
TEST(sharded_data_parallel_around_tensor_parallel_equals_one_device, QUICK) {
    static const tp_layout layouts[4] = {
        { 4, 2, 16, "--shard full" }, { 4, 2, 16, "--shard full --cpu-offload" }, { 4, 2, 16, "--shard optimizer" },
        { 4, 2, 16, "--shard grads" } };
    tp_layouts_equal_01(gpt_text(), 320, "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16", "gpt", "", layouts, 4);
    tp_layouts_equal_01(gpt_text(), 320, "--model llama --dim 32 --depth 2 --heads 8 --kv-heads 4 --seq-len 16 --untied-head",
                        "llama", "", layouts, 4);
    tp_layouts_equal_01(gpt_text(), 320, "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16", "gpt", "--clip 0.01", layouts, 1);
}

/* What 2-D saves: each rank's optimizer state is its pieces' (1/T of the
   split tensors, the rest whole), sharded over the D groups -- 1/(T x D) of
   the split ones -- as measured (the summary's peak), and as the memory
   table says (its optimizer row, and its formula O/N of the pieces). Bad
   combinations are refused, naming the flags. */
TEST(sharded_data_parallel_around_tensor_parallel_keeps_one_t_d_th, QUICK) {
    char out[16384], log[3][600];
    const char *flags = "--model gpt --dim 64 --depth 2 --heads 4 --seq-len 16 --epochs 1 --steps 2 --batch-size 8";
    const char *layouts[3] = { "01-single-gpu", "06-tensor-parallel --nproc 2 --tp 2", "06-tensor-parallel --nproc 4 --tp 2 --shard full" };
    double opt[3];
    for (int k = 0; k < 3; k++) {
        char stage[64];
        const char *sp = strchr(layouts[k], ' ');
        snprintf(stage, sizeof stage, "%.*s", (int)(sp ? (size_t)(sp - layouts[k]) : strlen(layouts[k])), layouts[k]);
        snprintf(log[k], sizeof log[k], "%s/mem%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s %s %s --log %s", stage_bin(stage), gpt_text(), flags, sp ? sp + 1 : "", log[k]);
        CHECKF(st == 0, "%s: exit %d\n%s", layouts[k], st, out);
        opt[k] = summary_value(log[k], "peak_optimizer_bytes");
        if (k == 2) {                        /* the table's optimizer row: this rank's, in MB */
            const char *row = strstr(out, "  optimizer state  ");
            double mb = -1;
            CHECKF(row && sscanf(row + 19, "%lf", &mb) == 1 && fabs(mb - opt[k] / 1e6) <= 0.006,
                   "the memory table's optimizer row says %.3f MB, the run measured %.3f MB\n%s", mb, opt[k] / 1e6, out);
            CHECKF(strstr(out, "memory per rank, --shard full (ZeRO-3), 2 ranks") && strstr(out, "O/N"),
                   "no FSDP table over the 2 groups:\n%s", out);
        }
    }
    /* 01: 2 moments of the whole (8 bytes a parameter). --tp 2: of the pieces. Sharded over 2 groups: half of those,
       but for each unit's padding to a multiple of 2 (at most a value per unit per rank) */
    double pieces = opt[1], whole = opt[0];
    CHECKF(pieces < 0.6 * whole && pieces > 0.5 * whole, "--tp 2 keeps %.0f bytes of optimizer state, 01 %.0f", pieces, whole);
    CHECKF(fabs(opt[2] - pieces / 2) <= 8.0 * 8, "--tp 2 --shard full over 2 groups keeps %.0f bytes of optimizer state, "
           "expected half of --tp 2's %.0f", opt[2], pieces);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --nproc 4 --tp 2 --shard full --sequence-parallel",
                     stage_bin("06-tensor-parallel"), gpt_text(), flags);
    expect_error(out, st, 2, "--sequence-parallel with --shard");
    st = run_cmd(out, sizeof out, "%s --data %s %s --nproc 4 --tp 2 --cpu-offload", stage_bin("06-tensor-parallel"), gpt_text(), flags);
    expect_error(out, st, 2, "--cpu-offload");
}

static void resumes_alike(const char *data, const char *first, const char *model, const char *const runs[3], const char *tag);
/* A checkpoint of 2-D training is whole: it resumes bit for bit at the same
   layout, at --tp 2 without sharding, and in stage 01; and a checkpoint of
   --tp 2 resumes sharded over the groups. */
TEST(sharded_data_parallel_around_tensor_parallel_checkpoints_are_whole, QUICK) {
    char out[16384], a[600], b[600];
    const char *flags = "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16";
    snprintf(a, sizeof a, "%s/fsdptp-a", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --nproc 4 --tp 2 --shard full --save-dir %s",
                     stage_bin("06-tensor-parallel"), gpt_text(), flags, a);
    CHECKF(st == 0, "06 --shard full: exit %d\n%s", st, out);
    static const char *const again[3] = {
        "06-tensor-parallel --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16 --nproc 4 --tp 2 --shard full",
        "06-tensor-parallel --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16 --nproc 4 --tp 2",
        "01-single-gpu --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 32" };
    resumes_alike(gpt_text(), a, "gpt", again, "fsdptp");
    snprintf(b, sizeof b, "%s/fsdptp-c", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --nproc 4 --tp 2 --save-dir %s", stage_bin("06-tensor-parallel"),
                 gpt_text(), flags, b);
    CHECKF(st == 0, "06 --tp 2: exit %d\n%s", st, out);
    static const char *const sharded[3] = {
        "06-tensor-parallel --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16 --nproc 4 --tp 2",
        "06-tensor-parallel --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16 --nproc 4 --tp 2 --shard full --cpu-offload",
        "06-tensor-parallel --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16 --nproc 4 --tp 2 --shard optimizer" };
    resumes_alike(gpt_text(), b, "gpt", sharded, "tpfsdp");
}

/* Evaluation runs with the gradient off, and its batch need not split over
   the group: 17 validation images, one batch of 17 rows, which the ranks of
   --sequence-parallel then read whole. The mlp's backward has no entry to
   walk back out of the rows-split region (its input needs no gradient), so
   the state it leaves must not carry into evaluation (it crashed). The eval
   loss and accuracy equal stage 01's. */
TEST(tensor_parallel_evaluates_and_samples_on_every_rank, QUICK) {
    char data[700];
    snprintf(data, sizeof data, "%s/odd-val", tmpdir);
    dt_synthetic_write(data, 320, 17, 16, 7);
    char out[16384], a[600], b[600];
    snprintf(a, sizeof a, "%s/tpeval-01.jsonl", tmpdir);
    snprintf(b, sizeof b, "%s/tpeval-06.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 32 --eval-every 5 --log %s", train_cpu, data, a);
    CHECKF(st == 0, "01: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 32 --eval-every 5 --nproc 2 --sequence-parallel --log %s",
                 stage_bin("06-tensor-parallel"), data, b);
    CHECKF(st == 0, "06 --sequence-parallel: exit %d\n%s", st, out);
    static const char *keys[2] = { "eval_loss", "eval_acc" };
    for (int k = 0; k < 2; k++) {
        double x = summary_value(a, keys[k]), y = summary_value(b, keys[k]);
        CHECKF(x >= 0 && fabs(x - y) <= 1e-5, "%s: 06 --sequence-parallel %.6f, 01 %.6f", keys[k], y, x);
    }
    /* The GPT's split vocabulary: --sample gathers the logits on every rank
       (a rank that skipped it would leave the others waiting), and a
       vocabulary of 258 splits over 2 ranks but not over 4, so a checkpoint
       of --tp 2 resumes at --tp 4 with wte whole, and goes on as 06 at 2 does. */
    const char *gflags = "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --vocab 258 --batch-size 32 --sample 20 "
                         "--epochs 2 --log-every 1000";   /* not --quiet: the samples and the table are printed */
    char run[600], again[600], p[700], q[700], out1[16384];
    snprintf(run, sizeof run, "%s/tpeval-gpt", tmpdir);
    snprintf(again, sizeof again, "%s/tpeval-gpt-4", tmpdir);
    st = run_cmd(out1, sizeof out1, "%s --data %s %s", train_cpu, gpt_text(), gflags);
    CHECKF(st == 0, "01 --sample: exit %d\n%s", st, out1);
    st = run_cmd(out, sizeof out, "%s --data %s %s --nproc 2 --save-dir %s", stage_bin("06-tensor-parallel"),
                 gpt_text(), gflags, run);
    CHECKF(st == 0, "06 --sample: exit %d\n%s", st, out);
    int n1 = 0, n6 = 0;
    for (const char *s1 = out1; (s1 = strstr(s1, "sample step")); s1++) n1++;
    for (const char *s6 = out; (s6 = strstr(s6, "sample step")); s6++) n6++;
    CHECKF(n1 > 0 && n6 == n1, "06 --sample printed %d samples, 01 %d", n6, n1);
    st = run_cmd(out, sizeof out, "%s --data %s %s --nproc 4 --resume %s/gpt_data0-320_epoch1 --save-dir %s",
                 stage_bin("06-tensor-parallel"), gpt_text(), gflags, run, again);
    CHECKF(st == 0 && strstr(out, "rows stay whole"), "06 --nproc 4 --resume of --nproc 2 (vocabulary 258): exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/gpt_data0-320_epoch2", run);
    snprintf(q, sizeof q, "%s/gpt_data0-320_epoch2", again);
    double d = max_tensor_diff(p, q);
    CHECKF(d >= 0 && d <= 2e-5, "06 at --tp 4 (wte whole) resumed from --tp 2 (wte split): differs by %.3g", d);
}

/* Each rank's parameters, gradients and Adam moments are exactly its pieces
   of the split tensors plus the rest whole (the log's peaks, after start-up),
   and the table at start-up says which tensors are cut, whole and here. */
TEST(tensor_parallel_keeps_one_tth_of_the_split_layers, QUICK) {
    char out[16384], log[600];
    dt_model_config mc = { DT_MODEL_VIT, 3, 16, 10, 32, 2, 4, 4, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&mc, 1);
    for (int n = 2; n <= 4; n += 2) {
        double split = 0, whole = 0;
        for (int i = 0; i < m->nparams; i++) {
            if (m->splits[i].dim >= 0) split += 4.0 * m->params[i].numel;
            else whole += 4.0 * m->params[i].numel;
        }
        snprintf(log, sizeof log, "%s/tpmem-%d.jsonl", tmpdir, n);
        int st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 32 --epochs 1 --steps 2 --model vit --depth 2 "
                         "--heads 4 --batch-size 8 --nproc %d --log %s", stage_bin("06-tensor-parallel"), small_data(), n, log);
        CHECKF(st == 0, "exit %d\n%s", st, out);
        double here = split / n + whole;
        double params = summary_value(log, "peak_params_bytes"), grads = summary_value(log, "peak_grads_bytes");
        double optim = summary_value(log, "peak_optimizer_bytes");
        CHECKF(split > 0.8 * (split + whole), "the split tensors are only %.0f of %.0f bytes", split, split + whole);
        CHECKF(params == here && grads == here && optim == 2 * here,
               "--tp %d: peaks params %.0f, grads %.0f, optimizer %.0f bytes; expected %.0f, %.0f and %.0f (whole: %.0f)", n,
               params, grads, optim, here, here, 2 * here, split + whole);
        char row[128];
        snprintf(row, sizeof row, "blocks.*.attn.qkv.weight              96x32 -> %dx32", 96 / n);
        CHECKF(strstr(out, row) && strstr(out, "x2 blocks"), "no row '%s' in the memory table:\n%s", row, out);
        /* --sequence-parallel: the rows between the split layers are 1/T each, so fewer activation bytes */
        double acts = summary_value(log, "peak_activations_bytes");
        snprintf(log, sizeof log, "%s/tpmem-sp-%d.jsonl", tmpdir, n);
        st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 32 --epochs 1 --steps 2 --model vit --depth 2 "
                     "--heads 4 --batch-size 8 --nproc %d --sequence-parallel --log %s", stage_bin("06-tensor-parallel"),
                     small_data(), n, log);
        CHECKF(st == 0, "exit %d\n%s", st, out);
        double sp = summary_value(log, "peak_activations_bytes");
        CHECKF(sp > 0 && sp < 0.95 * acts, "--tp %d: activations peak at %.0f bytes with --sequence-parallel, %.0f without", n,
               sp, acts);
    }
    dt_model_free(m);
    /* The GPT's vocabulary is split too: wte (its embedding and its tied
       head) in halves; a vocabulary that does not divide stays whole, and the
       table says so. */
    dt_model_config gc = { DT_MODEL_GPT, 0, 0, 256, 32, 2, 4, 0, 128, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    m = dt_model_create(&gc, 1);
    double split = 0, whole = 0;
    for (int i = 0; i < m->nparams; i++) {
        if (m->splits[i].dim >= 0) split += 4.0 * m->params[i].numel;
        else whole += 4.0 * m->params[i].numel;
    }
    dt_model_free(m);
    snprintf(log, sizeof log, "%s/tpmem-gpt.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --epochs 1 --steps 2 "
                     "--batch-size 8 --nproc 2 --log %s", stage_bin("06-tensor-parallel"), gpt_text(), log);
    CHECKF(st == 0, "gpt: exit %d\n%s", st, out);
    double params = summary_value(log, "peak_params_bytes");
    CHECKF(params == split / 2 + whole, "gpt --tp 2: peak params %.0f bytes, expected %.0f (split %.0f, whole %.0f)", params,
           split / 2 + whole, split, whole);
    CHECKF(strstr(out, "wte.weight                           256x32 -> 128x32       the vocabulary, by tokens"),
           "no row for wte.weight cut in halves in the memory table:\n%s", out);
    st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --vocab 257 --epochs 1 "
                 "--steps 2 --batch-size 8 --nproc 2", stage_bin("06-tensor-parallel"), gpt_text());
    CHECKF(st == 0 && strstr(out, "wte.weight                              257 rows stay whole: the vocabulary does not divide by 2"),
           "--vocab 257 at --tp 2: exit %d\n%s", st, out);
}

/* The epoch-1 checkpoint in `first` (of `model` on `data`) resumed by three
   runs, "stage flags" each: the first must end bit for bit where the run
   that went on (`first`'s epoch 2) ended, the others within 2e-5. */
static void resumes_alike(const char *data, const char *first, const char *model, const char *const runs[3], const char *tag) {
    char out[16384], b[600], p[700], q[700];
    snprintf(p, sizeof p, "%s/%s_data0-320_epoch2", first, model);
    for (int k = 0; k < 3; k++) {
        char stage[64];                     /* the run's first word; its flags follow */
        const char *sp = strchr(runs[k], ' ');
        snprintf(stage, sizeof stage, "%.*s", (int)(sp ? (size_t)(sp - runs[k]) : strlen(runs[k])), runs[k]);
        snprintf(b, sizeof b, "%s/%s-b%d", tmpdir, tag, k);
        int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --resume %s/%s_data0-320_epoch1 --save-dir %s",
                         stage_bin(stage), data, sp ? sp + 1 : "", first, model, b);
        CHECKF(st == 0, "%s --resume: exit %d\n%s", runs[k], st, out);
        snprintf(q, sizeof q, "%s/%s_data0-320_epoch2", b, model);
        if (k == 0) CHECKF(files_equal_tensors(p, q), "%s resumed at the same layout: not bit for bit the run that went on", runs[k]);
        else {
            double diff = max_tensor_diff(p, q);
            CHECKF(diff >= 0 && diff <= 2e-5, "%s resumed from %s: differs by %.3g from the run that went on", runs[k], first, diff);
        }
    }
}

/* A tensor-parallel run saves the whole model, as stage 01 does (every
   rank's pieces gathered, rank 0 writes): it resumes bit for bit at the same
   --tp, at another --tp (each rank cuts its pieces again) and in stage 01,
   and --init starts 06 from a checkpoint of 01. */
TEST(tensor_parallel_checkpoints_are_whole_and_resume_at_any_tp, QUICK) {
    char out[16384], a[600], c[600], d[600], p[700];
    const char *flags = "--model vit --depth 2 --heads 4 --patch 4 --batch-size 16";
    snprintf(a, sizeof a, "%s/tpck-a", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --nproc 2 --save-dir %s", stage_bin("06-tensor-parallel"),
                     small_data(), flags, a);
    CHECKF(st == 0, "06: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/vit_data0-320_epoch1/model.safetensors", a);
    dt_safetensors *sf = dt_safetensors_read(p);
    float qkv[96 * 32];
    int shape[2] = { 96, 32 };
    CHECKF(dt_safetensors_get(sf, "blocks.0.attn.qkv.weight", qkv, 2, shape), "no whole blocks.0.attn.qkv.weight [96, 32] in %s", p);
    dt_safetensors_close(sf);
    static const char *const again[3] = {
        "06-tensor-parallel --model vit --depth 2 --heads 4 --patch 4 --batch-size 16 --nproc 2",
        "06-tensor-parallel --model vit --depth 2 --heads 4 --patch 4 --batch-size 16 --nproc 4",
        "01-single-gpu --model vit --depth 2 --heads 4 --patch 4 --batch-size 16" };
    resumes_alike(small_data(), a, "vit", again, "tpck");
    /* --init from stage 01's checkpoint: the same first loss as 01 from it */
    snprintf(c, sizeof c, "%s/tpck-c.jsonl", tmpdir);
    snprintf(d, sizeof d, "%s/tpck-d.jsonl", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --init %s/tpck-b2/vit_data0-320_epoch2 --steps 3 --log %s", train_cpu,
                 small_data(), flags, tmpdir, c);
    CHECKF(st == 0, "01 --init: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --nproc 2 --init %s/tpck-b2/vit_data0-320_epoch2 --steps 3 --log %s",
                 stage_bin("06-tensor-parallel"), small_data(), flags, tmpdir, d);
    CHECKF(st == 0, "06 --init: exit %d\n%s", st, out);
    double dl = losses_differ_by(c, d, 3);
    CHECKF(dl <= 1e-5, "06 --init from 01's checkpoint: losses differ from 01's by %.3g", dl);
}
