/* tests/17-pipeline-parallel.c -- tests of dtrain.h's chapter
   17-pipeline-parallel: stage 07, and what every stage must do alike: order
   mistakes, language models, recompute. (tests/helpers.h: how the suite's
   files make one program.) */
#include "helpers.h"

/* ---- stage 07: pipeline parallelism ---- */

/* 07 against stage 01 with the same global batch of 32, 20 steps: P = 2 and
   4, both schedules, M = 1, 2, 4 and 8 (every combination, for each model),
   and --pp 2 over 4 ranks (2 pipelines of 16 each). Only the order of
   the gradient's sums differs (the micro-batches' are added one after the
   other), so losses within 1e-5, eval loss within 1e-5 (the last stage's
   logits, broadcast), every weight and Adam moment within 4e-5: gcc's
   builds stay within 2e-5, clang's AVX2 build (make test-msan) reached 2.2e-5
   at 8 micro-batches and 2.8e-5 with --pp 2 (the same sums, other roundings
   on the way). */
typedef struct { int nproc, pp, batch; const char *flags; } pp_layout;
static void pp_equivalence_in(const char *data, int samples, const char *flags, const char *model, const pp_layout *layouts,
                              int nlayouts, double weight_tol) {
    char out[16384], ref[600], rlog[700], dir[600], log[700], p[700], q[700];
    snprintf(ref, sizeof ref, "%s/pp-%s-01", tmpdir, model);
    snprintf(rlog, sizeof rlog, "%s.jsonl", ref);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --batch-size 32 --save-dir %s --log %s", train_cpu, data,
                     flags, ref, rlog);
    CHECKF(st == 0, "01: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/%s_data0-%d_epoch2", ref, model, samples);
    for (int k = 0; k < nlayouts; k++) {
        snprintf(dir, sizeof dir, "%s/pp-%s-%d%s%s", tmpdir, model, k, strstr(layouts[k].flags, "--tp") ? "-tp" : "",
                 strstr(layouts[k].flags, "--shard") ? "-shard" : "");
        snprintf(log, sizeof log, "%s.jsonl", dir);
        st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s %s --batch-size %d --nproc %d --pp %d --save-dir %s --log %s",
                     stage_bin("07-pipeline-parallel"), data, flags, layouts[k].flags, layouts[k].batch, layouts[k].nproc,
                     layouts[k].pp, dir, log);
        CHECKF(st == 0, "07 --nproc %d --pp %d %s: exit %d\n%s", layouts[k].nproc, layouts[k].pp, layouts[k].flags, st, out);
        double dl = losses_differ_by(rlog, log, 20);
        CHECKF(dl <= 1e-5, "%s 07 --nproc %d --pp %d %s: losses differ from 01 by %.3g", model, layouts[k].nproc, layouts[k].pp,
               layouts[k].flags, dl);
        double e1 = summary_value(rlog, "eval_loss"), e7 = summary_value(log, "eval_loss");
        CHECKF(e1 > 0 && fabs(e1 - e7) <= 1e-5, "%s 07 --nproc %d --pp %d %s: eval loss %.6f, 01's %.6f", model, layouts[k].nproc,
               layouts[k].pp, layouts[k].flags, e7, e1);
        snprintf(q, sizeof q, "%s/%s_data0-%d_epoch2", dir, model, samples);
        double d = max_tensor_diff(p, q);
        CHECKF(d >= 0 && d <= weight_tol, "%s 07 --nproc %d --pp %d %s: weights or optimizer state differ from 01 by %.3g "
               "(tolerance %.0e)", model, layouts[k].nproc, layouts[k].pp, layouts[k].flags, d, weight_tol);
    }
}
static void pp_equivalence(const char *data, int samples, const char *flags, const char *model) {
    static const pp_layout layouts[17] = {
        { 2, 0, 32, "--schedule gpipe --micro-batches 1" }, { 2, 0, 32, "--schedule gpipe --micro-batches 2" },
        { 2, 0, 32, "--schedule gpipe --micro-batches 4" }, { 2, 0, 32, "--schedule gpipe --micro-batches 8" },
        { 2, 0, 32, "--schedule 1f1b --micro-batches 1" }, { 2, 0, 32, "--schedule 1f1b --micro-batches 2" },
        { 2, 0, 32, "--schedule 1f1b --micro-batches 4" }, { 2, 0, 32, "--schedule 1f1b --micro-batches 8" },
        { 4, 0, 32, "--schedule gpipe --micro-batches 1" }, { 4, 0, 32, "--schedule gpipe --micro-batches 2" },
        { 4, 0, 32, "--schedule gpipe --micro-batches 4" }, { 4, 0, 32, "--schedule gpipe --micro-batches 8" },
        { 4, 0, 32, "--schedule 1f1b --micro-batches 1" }, { 4, 0, 32, "--schedule 1f1b --micro-batches 2" },
        { 4, 0, 32, "--schedule 1f1b --micro-batches 4" }, { 4, 0, 32, "--schedule 1f1b --micro-batches 8" },
        { 4, 2, 16, "--schedule 1f1b --micro-batches 2" } };
    pp_equivalence_in(data, samples, flags, model, layouts, 17, 4e-5);
}
TEST(pipeline_parallel_equals_one_device, FULL) {
    pp_equivalence(small_data(), 320, "--depth 3", "mlp");                           /* 4 layers: 4 stages of one */
    pp_equivalence(small_data(), 320, "--model vit --depth 4 --heads 2 --patch 4", "vit");
    /* the tied head: wte at the first stage and the last, their gradients added */
    pp_equivalence(gpt_text(), 320, "--model gpt --dim 32 --depth 4 --heads 4 --seq-len 16", "gpt");
    /* rotary tables cached in a micro-batch's arena must not be read from another's (they were) */
    pp_equivalence(gpt_text(), 320, "--model llama --dim 32 --depth 4 --heads 8 --kv-heads 4 --seq-len 16", "llama");
}

/* A number of a step's --log record ("key":value), or -1. */
static double step_value(const char *log, int step, const char *key) {
    FILE *f = fopen(log, "r");
    char line[8192], want[64], k[96];
    snprintf(want, sizeof want, "{\"step\":%d,", step);
    snprintf(k, sizeof k, "\"%s\":", key);
    double v = -1;
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, want, strlen(want))) continue;
        const char *at = strstr(line, k);
        if (at) v = atof(at + strlen(k));
    }
    if (f) fclose(f);
    return v;
}
/* What a stage keeps: under 1F1B the first of P = 4 stages holds at most 4
   micro-batches' activations at once however many there are (8 here), under
   GPipe all 8 -- counted where they are kept, each micro-batch's arena, and
   seen in the activations' peak. Each stage holds only its blocks'
   parameters, the embedding with the first and the head with the last. The
   bubble's accounting: the formula (P - 1) / (M + P - 1) beside the
   measured share of the stages' time spent waiting (this rank's computing
   and waiting within its time in the pipeline), which a single stage never
   does. */
TEST(pipeline_parallel_keeps_p_micro_batches_under_1f1b, QUICK) {
    char out[16384], log[600];
    const char *flags = "--model vit --dim 32 --depth 4 --heads 2 --patch 4 --image-size 16 --epochs 1 --steps 3 --batch-size 32 "
                        "--micro-batches 8 --nproc 4";
    double peaks[2] = { 0, 0 };
    static const char *schedules[2] = { "1f1b", "gpipe" };
    for (int k = 0; k < 2; k++) {
        snprintf(log, sizeof log, "%s/ppmem-%s.jsonl", tmpdir, schedules[k]);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --schedule %s --log %s", stage_bin("07-pipeline-parallel"), small_data(),
                         flags, schedules[k], log);
        CHECKF(st == 0, "--schedule %s: exit %d\n%s", schedules[k], st, out);
        double alive = step_value(log, 3, "pp_kept_micro_batches"), kept = step_value(log, 3, "pp_kept_bytes");
        double micro = step_value(log, 3, "pp_micro_bytes"), want = k == 0 ? 4 : 8;
        CHECKF(alive == want, "--schedule %s: %g micro-batches alive at once at stage 0, expected %g", schedules[k], alive, want);
        CHECKF(micro > 0 && kept <= want * micro && kept >= (want - 0.5) * micro,
               "--schedule %s: %.0f bytes kept at once, %.0f per micro-batch (expected %g of them)", schedules[k], kept, micro, want);
        double predicted = step_value(log, 3, "bubble_predicted"), bubble = step_value(log, 3, "bubble");
        CHECKF(fabs(predicted - 3.0 / 11.0) < 1e-4 && bubble >= 0 && bubble < 1, "bubble %.4f, predicted %.4f (expected 3/11)",
               bubble, predicted);
        double busy = step_value(log, 3, "pp_busy_ms"), idle = step_value(log, 3, "pp_idle_ms");
        double in_pipe = step_value(log, 3, "pp_step_ms"), step = step_value(log, 3, "step_ms");
        CHECKF(busy > 0 && idle >= 0 && busy + idle <= in_pipe * 1.01 && in_pipe <= step * 1.01,
               "busy %.3f ms + idle %.3f ms, in the pipeline %.3f ms, a step of %.3f ms", busy, idle, in_pipe, step);
        peaks[k] = summary_value(log, "peak_activations_bytes");
    }
    CHECKF(peaks[0] > 0 && peaks[0] < 0.75 * peaks[1], "activations peak at %.0f bytes under 1F1B, %.0f under GPipe", peaks[0],
           peaks[1]);
    /* one stage: nothing to wait for, so no idle time is counted at all (exactly 0: a timed bound failed on a loaded CI machine) */
    snprintf(log, sizeof log, "%s/ppmem-one.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s --model vit --dim 32 --depth 4 --heads 2 --image-size 16 --epochs 1 --steps 3 "
                     "--batch-size 32 --micro-batches 4 --log %s", stage_bin("07-pipeline-parallel"), small_data(), log);
    CHECKF(st == 0, "one stage: exit %d\n%s", st, out);
    CHECKF(step_value(log, 3, "bubble_predicted") == 0 && step_value(log, 3, "bubble") == 0 && step_value(log, 3, "pp_idle_ms") == 0,
           "one stage: bubble %.4f (predicted %.4f)", step_value(log, 3, "bubble"), step_value(log, 3, "bubble_predicted"));
    /* each stage's parameters: the table, and rank 0's peak (the embedding and its blocks) */
    snprintf(log, sizeof log, "%s/ppmem-table.jsonl", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --epochs 1 --steps 2 "
                 "--batch-size 8 --nproc 2 --log %s", stage_bin("07-pipeline-parallel"), gpt_text(), log);
    CHECKF(st == 0, "gpt: exit %d\n%s", st, out);
    dt_model_config gc = { DT_MODEL_GPT, 0, 0, 256, 32, 4, 4, 0, 128, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&gc, 1);
    double first = 0;                       /* stage 0 of 2: wte, wpe and blocks 0-1 (the head is at the other end) */
    for (int i = 0; i < m->nparams; i++)
        if (m->splits[i].tied || m->splits[i].block < 2) first += 4.0 * m->params[i].numel;
    dt_model_free(m);
    CHECKF(strstr(out, "stage 0: the embedding, blocks 0-1") && strstr(out, "stage 1: blocks 2-3, the head"),
           "the stages are not blocks 0-1 and 2-3:\n%s", out);
    CHECKF(summary_value(log, "peak_params_bytes") == first, "stage 0 holds %.0f bytes of parameters, expected %.0f",
           summary_value(log, "peak_params_bytes"), first);
}

/* A pipeline's checkpoint is whole, as stage 01's (each stage sends what it
   holds to rank 0, which writes): it resumes bit for bit at the same layout,
   and at another (--pp 4, or stage 01) within the sums' order. */
TEST(pipeline_parallel_checkpoints_are_whole_and_resume, QUICK) {
    char out[16384], a[600], p[700];
    const char *flags = "--model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 16 --micro-batches 4";
    snprintf(a, sizeof a, "%s/ppck-a", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " %s --nproc 2 --save-dir %s", stage_bin("07-pipeline-parallel"),
                     gpt_text(), flags, a);
    CHECKF(st == 0, "07: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/gpt_data0-320_epoch1/model.safetensors", a);
    dt_safetensors *sf = dt_safetensors_read(p);
    float w[256 * 32];
    int shape[2] = { 256, 32 };
    CHECKF(dt_safetensors_get(sf, "wte.weight", w, 2, shape) && dt_safetensors_get(sf, "h.3.mlp.c_fc.bias", w, 1, (int[]){ 128 }),
           "no whole wte.weight or h.3.mlp.c_fc.bias in %s", p);
    dt_safetensors_close(sf);
    static const char *const again[3] = {
        "07-pipeline-parallel --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 16 --micro-batches 4 --nproc 2",
        "07-pipeline-parallel --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 16 --micro-batches 4 --nproc 4",
        "01-single-gpu --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 16" };
    resumes_alike(gpt_text(), a, "gpt", again, "ppck");
}

/* All three dimensions on a mesh, D x T x P ranks ("dp" x "pp" x "tp",
   tensor parallelism inside each stage): 1 x 2 x 2 and 2 x 2 x 1 on 4
   ranks, and 2 x 2 x 2 on 8, against stage 01 with the same global batch of
   32 (2 x 1 x 2 is among the layouts above): losses and eval loss within
   1e-5, weights within 2e-5 (the vit's 1e-4, below); the GPT's vocabulary is then
   split over T inside the two end stages, which add up its gradients. A
   checkpoint of 1 x 2 x 2 (the stages' pieces, gathered over both) resumes
   bit for bit. */
TEST(data_tensor_and_pipeline_parallel_together_equal_one_device, QUICK) {
    static const pp_layout layouts[3] = {
        { 4, 0, 32, "--tp 2 --micro-batches 4" }, { 4, 1, 16, "--tp 2 --micro-batches 2" },
        { 8, 2, 16, "--tp 2 --micro-batches 2 --schedule gpipe" } };
    pp_equivalence_in(gpt_text(), 320, "--model gpt --dim 32 --depth 4 --heads 4 --seq-len 16", "gpt", layouts, 3, 2e-5);
    /* the vit's weights within 1e-4: built by clang (make test-msan), 1 x 2 x 2 ended one fc2 weight of 4096 6.4e-5
       away (every other value within 3.2e-6, its Adam moments within 0.15%). Its gradient is small (v 3e-9), and
       AdamW divides by sqrt(v), so the rounding of the split sums moves its update; gcc's build was within 2e-5. */
    pp_equivalence_in(small_data(), 320, "--model vit --depth 4 --heads 2 --patch 4", "vit", layouts, 2, 1e-4);
    char out[16384], b[600], p[700], q[700];
    snprintf(b, sizeof b, "%s/pp3d-again", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 "
                     "--batch-size 32 --nproc 4 --tp 2 --micro-batches 4 --resume %s/pp-gpt-0-tp/gpt_data0-320_epoch1 --save-dir %s",
                     stage_bin("07-pipeline-parallel"), gpt_text(), tmpdir, b);
    CHECKF(st == 0, "07 --tp 2 --resume: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/pp-gpt-0-tp/gpt_data0-320_epoch2", tmpdir);
    snprintf(q, sizeof q, "%s/gpt_data0-320_epoch2", b);
    CHECKF(files_equal_tensors(p, q), "07 --nproc 4 --tp 2 resumed: not bit for bit the run that went on");
}

/* 05's two ways to do more with the same memory, in a pipeline. --dtype
   bf16: activations, and what the stages send each other, in bf16 -- the
   same arithmetic as 05's bf16 with --accum-steps M, so 2 stages x 2
   micro-batches give 05's losses (and not fp32's). --accum-steps K: the
   micro-batches already add up, so K steps of B are one step of K x B in
   K x M micro-batches (one fill and drain, not K), bit for bit. fp16, whose
   loss scale no stage carries, is refused, naming bf16. */
TEST(pipeline_parallel_trains_in_bf16_and_accumulates_as_05_does, QUICK) {
    char out[16384], log[4][600];
    const char *model = "--model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --epochs 1 --steps 6 --quiet";
    const char *runs[4][2] = {
        { "05-accum-mixed-precision", "--dtype bf16 --batch-size 8 --accum-steps 2" },
        { "07-pipeline-parallel", "--dtype bf16 --nproc 2 --batch-size 16 --micro-batches 2" },
        { "07-pipeline-parallel", "--nproc 2 --batch-size 16 --micro-batches 2" },
        { "07-pipeline-parallel", "--nproc 2 --batch-size 8 --micro-batches 1 --accum-steps 2" } };
    double loss[4][6], eval[4];
    for (int k = 0; k < 4; k++) {
        snprintf(log[k], sizeof log[k], "%s/ppmix-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s %s %s --log %s", stage_bin(runs[k][0]), gpt_text(), model, runs[k][1],
                         log[k]);
        CHECKF(st == 0, "%s %s: exit %d\n%s", runs[k][0], runs[k][1], st, out);
        CHECKF(log_series(log[k], "loss", loss[k], 6) == 6, "%s %s: not 6 steps logged", runs[k][0], runs[k][1]);
        eval[k] = summary_value(log[k], "eval_loss");
    }
    if (t_failed) return;
    double bf16 = 0, fp32 = 0, accum = 0;
    for (int i = 0; i < 6; i++) {
        bf16 = fmax(bf16, fabs(loss[1][i] - loss[0][i]));
        fp32 = fmax(fp32, fabs(loss[2][i] - loss[1][i]));
        accum = fmax(accum, fabs(loss[3][i] - loss[2][i]));
    }
    CHECKF(bf16 <= 1e-6 && fabs(eval[1] - eval[0]) <= 1e-6, "07 --dtype bf16: losses %.3g from 05's (eval %.6f against %.6f)",
           bf16, eval[1], eval[0]);
    CHECKF(fp32 > 1e-6, "07 --dtype bf16: the losses are fp32's (nothing was rounded)");
    CHECKF(accum == 0 && eval[3] == eval[2], "07 --accum-steps 2: losses %.3g from 2 x the batch and micro-batches (eval %.6f, %.6f)",
           accum, eval[3], eval[2]);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --nproc 2 --dtype fp16", stage_bin("07-pipeline-parallel"), gpt_text(), model);
    CHECKF(st == 2 && strstr(out, "--dtype fp16") && strstr(out, "bf16"), "07 --dtype fp16: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s %s --nproc 2 --micro-batches 200 --accum-steps 2", stage_bin("07-pipeline-parallel"),
                 gpt_text(), model);
    CHECKF(st == 2 && strstr(out, "--accum-steps 2 x --micro-batches 200"), "07 --accum-steps 2 --micro-batches 200: exit %d\n%s",
           st, out);
}

/* 3-D with sharding: the data-parallel engine around a pipeline whose
   stages split their layers (--pp 2 --tp 2 over 8 ranks: 2 pipelines). FSDP
   shards each rank's pieces of its stage over the 2 ranks that hold the
   same ones -- ZeRO-3, with the shards in host memory too -- and 20 steps
   equal stage 01's at the same global batch, for the GPT (its tied
   vocabulary split over T at both ends, added up before it is sharded) and
   Llama: the losses, the eval loss, and the weights and Adam moments of the
   checkpoint, which the engine, the pipeline and tensor parallelism gather
   whole between them. */
TEST(sharded_data_parallel_around_pipeline_and_tensor_parallel_equals_one_device, QUICK) {
    static const pp_layout layouts[2] = { { 8, 2, 16, "--tp 2 --shard full --micro-batches 2" },
                                          { 8, 2, 16, "--tp 2 --shard full --cpu-offload --micro-batches 2 --schedule gpipe" } };
    pp_equivalence_in(gpt_text(), 320, "--model gpt --dim 32 --depth 4 --heads 4 --seq-len 16", "gpt", layouts, 2, 2e-5);
    pp_equivalence_in(gpt_text(), 320, "--model llama --dim 32 --depth 4 --heads 8 --kv-heads 4 --seq-len 16", "llama", layouts, 2,
                      2e-5);
}
/* ... and every other way the engine wraps a pipeline: ZeRO-1 and -2 (each
   micro-batch's gradients reduce-scattered as its backward ends), a
   pipeline without tensor parallelism, the untied Llama, the vit, with
   clipping (the norm adds every shard and stage once). */
TEST(sharded_data_parallel_around_pipeline_parallel_in_every_mode_equals_one_device, FULL) {
    static const pp_layout layouts[7] = { { 4, 2, 16, "--shard optimizer --micro-batches 2" },
                                          { 4, 2, 16, "--shard grads --micro-batches 4 --schedule gpipe" },
                                          { 4, 2, 16, "--shard full --micro-batches 4" },
                                          { 4, 2, 16, "--shard full --micro-batches 4 --schedule gpipe" },
                                          { 4, 1, 8, "--shard full --micro-batches 2 --schedule gpipe" },
                                          { 8, 2, 16, "--tp 2 --shard grads --micro-batches 2" },
                                          { 8, 2, 16, "--tp 2 --shard optimizer --micro-batches 2 --schedule gpipe" } };
    pp_equivalence_in(gpt_text(), 320, "--model gpt --dim 32 --depth 4 --heads 4 --seq-len 16", "gpt", layouts, 7, 2e-5);
    pp_equivalence_in(gpt_text(), 320, "--model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --clip 0.01", "gpt", layouts + 2, 3,
                      2e-5);
    pp_equivalence_in(gpt_text(), 320, "--model llama --dim 32 --depth 4 --heads 8 --kv-heads 4 --seq-len 16 --untied-head",
                      "llama", layouts, 7, 2e-5);
    pp_equivalence_in(small_data(), 320, "--model vit --depth 4 --heads 2 --patch 4", "vit", layouts, 5, 1e-4);
    /* bf16: the parameters gathered in bf16 around a pipeline, as the unsharded pipeline rounds them. The
       micro-batches' gradients are reduce-scattered one by one instead of added first, and a sum in another
       order can flip a bf16 rounding of an activation (1.5e-5 seen): within 1e-4, where fp32's are within 1e-5 */
    char out[16384], log[2][600];
    double loss[2][6];
    for (int k = 0; k < 2; k++) {
        snprintf(log[k], sizeof log[k], "%s/bf16-shard-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --epochs 1 --steps 6 "
                         "--quiet --dtype bf16 --nproc 4 --pp 2 --batch-size 16 --micro-batches 2 %s --log %s",
                         stage_bin("07-pipeline-parallel"), gpt_text(), k ? "--shard full" : "", log[k]);
        CHECKF(st == 0 && log_series(log[k], "loss", loss[k], 6) == 6, "07 --dtype bf16 %s: exit %d\n%s", k ? "--shard full" : "",
               st, out);
    }
    double d = 0;
    for (int i = 0; i < 6 && !t_failed; i++) d = fmax(d, fabs(loss[1][i] - loss[0][i]));
    CHECKF(d <= 1e-4, "07 --dtype bf16 --shard full: losses %.3g from the unsharded pipeline's", d);
}

/* What 3-D with sharding keeps: rank 0 holds its stage's pieces (the
   pipeline's table: stage 0's, split over --tp 2), and the engine shards
   them over the 2 pipelines -- its parameters, gradients and optimizer
   state each half of the unsharded run's, as measured (the summary's
   peaks) and as the FSDP table's rows say (which leave out the gather
   buffers, the price of sharding). A checkpoint of 3-D resumes bit for bit
   at the same layout, and unsharded and in stage 01 within 2e-5. */
TEST(sharded_data_parallel_around_pipeline_parallel_keeps_one_p_t_d_th, QUICK) {
    char out[16384], log[2][600];
    const char *flags = "--model gpt --dim 64 --depth 4 --heads 4 --seq-len 16 --epochs 1 --steps 2 --batch-size 8 --micro-batches 2";
    const char *layouts[2] = { "--nproc 4 --pp 2 --tp 2", "--nproc 8 --pp 2 --tp 2 --shard full" };
    double peak[2][3], row[3] = { -1, -1, -1 }, stage0 = -1, buffers = -1;
    static const char *const keys[3] = { "peak_params_bytes", "peak_grads_bytes", "peak_optimizer_bytes" };
    static const char *const rows[3] = { "  parameters       ", "  gradients        ", "  optimizer state  " };
    for (int k = 0; k < 2; k++) {
        snprintf(log[k], sizeof log[k], "%s/pp-mem-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s %s %s --log %s", stage_bin("07-pipeline-parallel"), gpt_text(), flags,
                         layouts[k], log[k]);
        CHECKF(st == 0, "07 %s: exit %d\n%s", layouts[k], st, out);
        for (int r = 0; r < 3; r++) peak[k][r] = summary_value(log[k], keys[r]);
        const char *s0 = strstr(out, "  stage 0: the embedding, blocks 0-1  ");
        if (k == 0) CHECKF(s0 && sscanf(s0 + 38, "%lf", &stage0) == 1, "no stage 0 in the pipeline's table:\n%s", out);
        for (int r = 0; r < 3 && k == 1; r++) {
            const char *at = strstr(out, rows[r]);
            CHECKF(at && sscanf(at + strlen(rows[r]), "%lf", &row[r]) == 1, "no %s row in the FSDP table:\n%s", rows[r], out);
        }
        CHECKF(k == 0 || strstr(out, "memory per rank, --shard full (ZeRO-3), 2 ranks"), "no FSDP table over the 2 pipelines:\n%s",
               out);
        const char *gb = k == 1 ? strstr(out, "  gather buffers   ") : NULL;
        CHECKF(k == 0 || (gb && sscanf(gb + 19, "%lf", &buffers) == 1), "no gather buffers row in the FSDP table:\n%s", out);
    }
    if (t_failed) return;
    CHECKF(fabs(peak[0][0] / 1e6 - stage0) <= 0.0005, "unsharded, rank 0 keeps %.0f bytes of parameters; its stage's pieces are "
           "%.3f MB", peak[0][0], stage0);
    for (int r = 0; r < 3; r++)         /* each unit padded to a multiple of 2: at most a value per unit per rank */
        CHECKF(fabs(row[r] * 1e6 - peak[0][r] / 2) <= 0.006e6, "--shard full over 2 pipelines: the table's %s row says %.3f MB, "
               "half the unsharded run's is %.3f", rows[r] + 2, row[r], peak[0][r] / 2e6);
    CHECKF(fabs(peak[1][2] - peak[0][2] / 2) <= 8.0 * 2 * 6, "--shard full over 2 pipelines keeps %.0f bytes of optimizer state, "
           "expected half of %.0f", peak[1][2], peak[0][2]);
    /* the measured peaks of the parameters and gradients: the shards (the rows) and the buffers the table shows apart */
    CHECKF(fabs(peak[1][0] + peak[1][1] - (row[0] + row[1] + buffers) * 1e6) <= 0.015e6, "--shard full: %.0f bytes of parameters "
           "and %.0f of gradients at their peaks; the table says %.2f + %.2f MB of shards and %.2f MB of gather buffers",
           peak[1][0], peak[1][1], row[0], row[1], buffers);
    char a[600];
    snprintf(a, sizeof a, "%s/pp3d-ck", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 "
                     "--batch-size 16 --nproc 8 --pp 2 --tp 2 --micro-batches 2 --shard full --save-dir %s",
                     stage_bin("07-pipeline-parallel"), gpt_text(), a);
    CHECKF(st == 0, "07 --shard full: exit %d\n%s", st, out);
    static const char *const again[3] = {
        ("07-pipeline-parallel --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 16 --nproc 8 --pp 2 --tp 2 "
         "--micro-batches 2 --shard full"),
        "07-pipeline-parallel --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 16 --nproc 4 --pp 2 --micro-batches 2",
        "01-single-gpu --model gpt --dim 32 --depth 4 --heads 4 --seq-len 16 --batch-size 32" };
    resumes_alike(gpt_text(), a, "gpt", again, "pp3d");
}

/* A stage killed while it sends an activation: the stages waiting on it
   (for the activation, the gradient back, the loss) stop within --timeout,
   naming it, and none waits forever on a receive. */
TEST(a_killed_pipeline_stage_stops_every_rank, QUICK) {
    char out[16384];
    double t0 = dt_now_ms();
    int st = run_cmd(out, sizeof out, "env DT_TEST_DIE_RANK=1 DT_TEST_DIE_SEND=5 %s --data %s " PAR_FLAGS " --batch-size 16 "
                     "--depth 3 --micro-batches 4 --nproc 4 --timeout 10", stage_bin("07-pipeline-parallel"), small_data());
    double s = (dt_now_ms() - t0) / 1e3;
    CHECKF(st != 0 && s < 20, "exit %d after %.1f s (timeout 10 s):\n%s", st, s, out);
    CHECKF(strstr(out, "rank 1 (pid"), "no rank named rank 1 as the one that died:\n%s", out);
}

/* Order mistakes: a stage file with one line moved -- a wrapper created after
   the optimizer, gradients used before they are synchronised, things freed
   before what holds them -- still compiles, and must stop with the message
   that says what to call first, never crash. Each copy is built as the
   Makefile builds a stage (one C file that includes ../dtrain.h), CPU only. */
typedef struct { const char *stage, *move, *after, *names; } order_mistake;
static const order_mistake order_mistakes[] = {
    { "01-single-gpu", "dt_optimizer_free(", "dt_model_free(", "call dt_optimizer_free first" },
    { "02-dp", "dt_dp_create(", "dt_optimizer_create(", "create the optimizer after dt_dp_create" },
    { "02-dp", "dt_dp_reduce_grads(", "dt_optimizer_step(", "call dt_dp_reduce_grads first" },
    { "02-dp", "dt_optimizer_free(", "dt_dp_free(", "dt_dp_free: the optimizer still steps" },
    { "02-dp", "dt_dp_free(", "dt_model_free(", "dt_model_free: dt_dp_create still wraps this model; call dt_dp_free" },
    { "03-ddp", "dt_ddp_create(", "dt_optimizer_create(", "create the optimizer after dt_ddp_create" },
    { "03-ddp", "dt_backward(", "dt_ddp_sync_grads(", "dt_ddp_sync_grads: no backward has run" },
    { "03-ddp", "dt_ddp_sync_grads(", "dt_optimizer_step(", "call dt_ddp_sync_grads first" },
    { "03-ddp", "dt_optimizer_free(", "dt_ddp_free(", "call dt_optimizer_free first" },
    { "03-ddp", "dt_ddp_free(", "dt_model_free(", "call dt_ddp_free first" },
    { "03-ddp", "dt_comm_free(", "dt_optimizer_free(", "dt_comm_free: a parallel wrapper still uses this communicator; call dt_ddp_free first" },
    { "04-fsdp", "dt_fsdp_create(", "dt_optimizer_create(", "create the optimizer after dt_fsdp_create" },
    { "04-fsdp", "dt_backward(", "dt_fsdp_sync_grads(", "dt_fsdp_sync_grads: no backward has run" },
    { "04-fsdp", "dt_fsdp_sync_grads(", "dt_optimizer_step(", "call dt_fsdp_sync_grads first" },
    { "04-fsdp", "dt_optimizer_free(", "dt_fsdp_free(", "dt_fsdp_free: the optimizer still steps" },
    { "04-fsdp", "dt_fsdp_free(", "dt_model_free(", "call dt_fsdp_free first" },
    { "04-fsdp", "dt_comm_free(", "dt_optimizer_free(", "dt_comm_free: a parallel wrapper still uses this communicator; call dt_fsdp_free first" },
    { "05-accum-mixed-precision", "dt_set_compute_dtype(", "dt_fsdp_create(", "call dt_set_compute_dtype before" },
    { "05-accum-mixed-precision", "dt_optimizer_create(", "dt_model_create(", "create the optimizer after dt_fsdp_create" },
    { "05-accum-mixed-precision", "dt_fsdp_sync_grads(", "dt_optimizer_step(", "dt_loss_scaler_unscale: the gradients" },
    { "05-accum-mixed-precision", "dt_loss_scaler_unscale(", "dt_optimizer_step(", "dt_optimizer_step: the gradients are still multiplied by the loss scale; call dt_loss_scaler_unscale first" },
    { "05-accum-mixed-precision", "dt_optimizer_free(", "dt_fsdp_free(", "call dt_optimizer_free first" },
    { "05-accum-mixed-precision", "dt_fsdp_free(", "dt_model_free(", "call dt_fsdp_free first" },
    { "06-tensor-parallel", "dt_data_parallel_create(", "dt_optimizer_create(", "create the optimizer after dt_data_parallel_create" },
    { "06-tensor-parallel", "dt_backward(", "dt_data_parallel_sync_grads(", "dt_data_parallel_sync_grads: no backward has run" },
    { "06-tensor-parallel", "dt_data_parallel_sync_grads(", "dt_optimizer_step(", "call dt_data_parallel_sync_grads first" },
    { "06-tensor-parallel", "dt_optimizer_free(", "dt_data_parallel_free(", "dt_data_parallel_free: the optimizer still steps" },
    { "06-tensor-parallel", "dt_data_parallel_free(", "dt_tp_free(",
      "dt_tp_free: another wrapper still wraps the model it cut; call dt_data_parallel_free first" },
    { "06-tensor-parallel", "dt_tp_free(", "dt_model_free(", "call dt_tp_free first" },
    { "06-tensor-parallel", "dt_comm_free(", "dt_optimizer_free(", "dt_comm_free: a parallel wrapper still uses this communicator; call dt_tp_free first" },
    { "07-pipeline-parallel", "dt_data_parallel_create(", "dt_optimizer_create(", "create the optimizer after dt_data_parallel_create" },
    { "07-pipeline-parallel", "dt_pp_forward_backward(", "dt_data_parallel_sync_grads(", "dt_data_parallel_sync_grads: no backward has run" },
    { "07-pipeline-parallel", "dt_data_parallel_sync_grads(", "dt_optimizer_step(", "call dt_data_parallel_sync_grads first" },
    { "07-pipeline-parallel", "dt_optimizer_free(", "dt_data_parallel_free(", "dt_data_parallel_free: the optimizer still steps" },
    { "07-pipeline-parallel", "dt_data_parallel_free(", "dt_pp_free(", "call dt_data_parallel_free first" },
    { "07-pipeline-parallel", "dt_pp_free(", "dt_tp_free(", "dt_tp_free: another wrapper still wraps the model it cut; call dt_pp_free first" },
    { "07-pipeline-parallel", "dt_tp_free(", "dt_model_free(", "call dt_tp_free first" },
};

/* Copy src to dst with the line containing `move` taken out and put back just
   after the line containing `after`; 0 when either is not found once. */
static int move_line(const char *src, const char *dst, const char *move, const char *after) {
    char lines[256][512], *held = NULL;
    int n = 0, moved = 0, placed = 0;
    FILE *in = fopen(src, "r"), *out = NULL;
    if (!in) return 0;
    while (n < 256 && fgets(lines[n], sizeof lines[n], in)) n++;
    fclose(in);
    for (int i = 0; i < n; i++) if (strstr(lines[i], move)) { held = lines[i]; moved++; }
    if (moved != 1 || !(out = fopen(dst, "w"))) return 0;
    for (int i = 0; i < n; i++) {
        if (lines[i] != held) fputs(lines[i], out);
        if (strstr(lines[i], after) && lines[i] != held) { fputs(held, out); placed++; }
    }
    fclose(out);
    return placed == 1;
}

TEST(order_mistakes_in_each_stage_are_named_errors, FULL) {
    char root[512], out[8192], dir[1024], src[1200], dst[1200], bin[1200];
    if (!getcwd(root, sizeof root)) SKIP("no working directory");
    snprintf(src, sizeof src, "%s/dtrain.h", root);
    if (access(src, R_OK) != 0) SKIP("run from the repository root: the stage files are compiled from there");
    const char *cc = getenv("CC") ? getenv("CC") : "cc";
    for (size_t i = 0; i < sizeof order_mistakes / sizeof order_mistakes[0]; i++) {
        const order_mistake *m = &order_mistakes[i];
        char which[256];
        snprintf(which, sizeof which, "%s with the line of %s moved after %s", m->stage, m->move, m->after);
        snprintf(dir, sizeof dir, "%s/order%zu", tmpdir, i);
        snprintf(src, sizeof src, "%s/%s/train.c", root, m->stage);
        snprintf(dst, sizeof dst, "%s/train.c", dir);
        snprintf(bin, sizeof bin, "%s/train", dir);
        mkdir(dir, 0755);
        CHECKF(move_line(src, dst, m->move, m->after), "%s: those lines are not in the stage file", which);
        /* "../dtrain.h" is looked up next to the copy, then from each -I folder */
        int st = run_cmd(out, sizeof out, "%s -std=c11 -O0 -I%s/tests %s -o %s -lm -lpthread", cc, root, dst, bin);
        CHECKF(st == 0, "%s does not compile:\n%s", which, out);
        if (st != 0) continue;
        st = run_cmd(out, sizeof out, "%s --bench --steps 2 --batch-size 8 --dim 16 --quiet%s", bin,
                     strncmp(m->stage, "05", 2) ? "" : " --dtype fp16");     /* not the default, and loss-scaled */
        expect_error_in(which, out, st, 1, m->names);
    }
}

/* The equivalence tests of stages 02-05, with the GPT on text. */
static void equivalence(const char *data, int samples, const char *model_flags, const char *model);
/* model: the checkpoints' prefix; flags: the model and its shape */
static void language_model_trains_alike_in_every_stage(const char *model, const char *flags) {
    char out[16384], ref[600], dir[600], p[700], q[700], la[700], lb[700];
    /* DataParallel and DDP, N = 2 and 4, against stage 01 */
    equivalence(gpt_text(), 320, flags, model);
    /* FSDP in every shard mode: DDP's bits (no clipping: its norm sums in another order) */
    static const char *modes[4] = { "optimizer", "grads", "full", "full --cpu-offload" };
    for (int n = 2; n <= 4; n += 2) {
        snprintf(ref, sizeof ref, "%s/%s-fsdp-ref-%d", tmpdir, model, n);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --log-every 1000 --quiet --epochs 1 --batch-size %d --nproc %d --clip 0 --save-dir %s",
                         stage_bin("03-ddp"), gpt_text(), flags, 32 / n, n, ref);
        CHECKF(st == 0, "03 --nproc %d: exit %d\n%s", n, st, out);
        snprintf(p, sizeof p, "%s/%s_data0-320_epoch1", ref, model);
        for (int k = 0; k < 4; k++) {
            snprintf(dir, sizeof dir, "%s/%s-fsdp-%d-%d", tmpdir, model, k, n);
            st = run_cmd(out, sizeof out, "%s --data %s %s --log-every 1000 --quiet --epochs 1 --batch-size %d --nproc %d --clip 0 --shard %s "
                         "--save-dir %s", stage_bin("04-fsdp"), gpt_text(), flags, 32 / n, n, modes[k], dir);
            CHECKF(st == 0, "04 --shard %s --nproc %d: exit %d\n%s", modes[k], n, st, out);
            snprintf(q, sizeof q, "%s/full", dir);
            st = run_cmd(out, sizeof out, "%s %s/%s_data0-320_epoch1 %s", build_path("tools/consolidate"), dir, model, q);
            CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
            CHECKF(files_equal_tensors(p, q), "%s --shard %s N=%d: not bit for bit DDP's", model, modes[k], n);
        }
    }
    /* accumulation (stage 05): 4 micro-batches = one batch 4x as big; the
       outer unit and 2 blocks make 3 reduce-scatters per optimizer step */
    static const char *acc_modes[3] = { "full", "full", "optimizer" };
    for (int run = 0; run < 3; run++) {
        int n = run ? 2 : 1;
        for (int k = 0; k < 2; k++) {
            snprintf(dir, sizeof dir, "%s/%s-acc-%d-%d", tmpdir, model, run, k);
            snprintf(k ? lb : la, 700, "%s.jsonl", dir);
            int st = run_cmd(out, sizeof out, "%s --data %s %s --log-every 1000 --quiet --epochs 1 --nproc %d --batch-size %d --accum-steps %d "
                             "--shard %s --save-dir %s --log %s", stage_bin("05-accum-mixed-precision"), gpt_text(), flags, n,
                             k ? 8 / n : 32 / n, k ? 4 : 1, acc_modes[run], dir, k ? lb : la);
            CHECKF(st == 0, "05 --nproc %d --accum-steps %d: exit %d\n%s", n, k ? 4 : 1, st, out);
            snprintf(k ? q : p, 700, "%s/full%d", tmpdir, k);
            st = run_cmd(out, sizeof out, "%s %s/%s_data0-320_epoch1 %s", build_path("tools/consolidate"), dir, model, k ? q : p);
            CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
        }
        /* Not bit for bit: the four micro-batches' weight gradients are summed
           apart and then added, one batch's in one matmul. 1e-5 held with the
           matmul's multiplies and adds rounded apart; with them fused (one
           rounding, issue 22) the same runs differ by 1.1e-5. A micro-batch
           scaled wrong or dropped moves every weight's update instead. */
        double d = max_tensor_diff(p, q);
        CHECKF(d >= 0 && d <= 2e-5, "%s FSDP N=%d --shard %s: 4 micro-batches vs one batch differ by %.3g", model, n, acc_modes[run], d);
        if (run != 2)
            CHECKF(log_lines_with_value(la, "grad_collectives", 3) == 10 && log_lines_with_value(lb, "grad_collectives", 3) == 10,
                   "%s N=%d: not 3 reduce-scatters in each of the 10 steps", model, n);
    }
    /* mixed precision: bf16 and fp16 follow fp32's losses; --sample generates text on every rank */
    double curve[3][16];
    for (int k = 0; k < 3; k++) {
        static const char *dt[3] = { "fp32", "bf16", "fp16" };
        snprintf(la, sizeof la, "%s/%s-mp-%d.jsonl", tmpdir, model, k);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --log-every 1000 --quiet --epochs 1 --nproc 2 --batch-size 16 --dtype %s --log %s "
                         "--lr 3e-3", stage_bin("05-accum-mixed-precision"), gpt_text(), flags, dt[k], la);
        CHECKF(st == 0, "05 --dtype %s: exit %d\n%s", dt[k], st, out);
        CHECKF(read_losses(la, curve[k], 16) == 10, "05 --dtype %s: not 10 steps", dt[k]);
        for (int s = 0; k && s < 10; s++)
            CHECKF(fabs(curve[k][s] - curve[0][s]) < 0.05, "%s %s step %d: loss %.4f, fp32 %.4f", model, dt[k], s + 1, curve[k][s], curve[0][s]);
    }
    CHECK(curve[0][9] < curve[0][0] - 0.5);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --nproc 2 --batch-size 16 --sample 40",
                     stage_bin("04-fsdp"), gpt_text(), flags);
    const char *s = strstr(out, "sample step 10");
    CHECKF(st == 0 && s && count_lines_with(out, "sample step") == 1, "04 --sample: exit %d\n%s", st, out);
    CHECKF(strstr(out, "tokens/s") && strstr(out, "baseline"), "no tokens/s or baseline in:\n%s", out);
}
TEST(gpt_trains_alike_in_every_stage, QUICK) {
    language_model_trains_alike_in_every_stage("gpt", "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16");
}
/* Llama's layout (grouped-query attention: 4 query heads, 2 key/value heads)
   in every stage, as the GPT */
TEST(llama_trains_alike_in_every_stage, QUICK) {
    language_model_trains_alike_in_every_stage("llama", "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16");
}
/* Instruction data, whose batches count very different numbers of targets:
   the loss is the mean over the step's targets on every rank and micro-batch,
   so DataParallel, DDP and accumulation (stage 05 over FSDP) still equal
   stage 01 with the whole batch. With each rank's own mean instead, 03 at
   N = 2 ends 0.016 away in weights and Adam moments, 05 (2 ranks x 4
   micro-batches) 0.034 (measured with the divisor left out). */
TEST(masked_instruction_data_trains_alike_in_every_stage, QUICK) {
    const char *flags = "--model llama --dim 32 --depth 2 --heads 4 --kv-heads 2 --seq-len 16";
    char out[16384], dir[600], p[700], q[700], log[700];
    double ref[64], got[64];
    equivalence(instruction_data(), 320, flags, "llama");
    snprintf(dir, sizeof dir, "%s/masked-05", tmpdir);
    snprintf(log, sizeof log, "%s.jsonl", dir);
    int st = run_cmd(out, sizeof out, "%s --tokens %s " PAR_FLAGS " %s --nproc 2 --batch-size 4 --accum-steps 4 --shard full "
                     "--save-dir %s --log %s", stage_bin("05-accum-mixed-precision"), instruction_data(), flags, dir, log);
    CHECKF(st == 0, "05: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/eq-llama-tokens-01/llama_data0-320_epoch2", tmpdir);
    snprintf(q, sizeof q, "%s/full", dir);
    st = run_cmd(out, sizeof out, "%s %s/llama_data0-320_epoch2 %s", build_path("tools/consolidate"), dir, q);
    CHECKF(st == 0, "consolidate: exit %d\n%s", st, out);
    snprintf(dir, sizeof dir, "%s/eq-llama-tokens-01.jsonl", tmpdir);
    int n = read_losses(dir, ref, 64), m = read_losses(log, got, 64);
    double worst = n == 20 && m == 20 ? 0 : 1e9;
    for (int i = 0; i < n && i < m; i++) worst = fmax(worst, fabs(got[i] - ref[i]));
    CHECKF(worst <= 1e-5, "05, 2 ranks x 4 micro-batches: %d logged losses, worst difference from 01 %.3g", m, worst);
    double d = max_tensor_diff(p, q);
    CHECKF(d >= 0 && d <= 2e-5, "05, 2 ranks x 4 micro-batches: weights differ from 01 by %.3g", d);
    /* 07: a pipeline's 4 micro-batches each divide by the step's count / 4 (by their own counts: losses 0.72 off,
       weights 0.045); 08: each of a group's C ranks divides its tokens' losses by the group's count / C (by its own:
       0.044, 0.039) */
    static const struct { const char *stage, *flags, *what; } split[2] = {
        { "07-pipeline-parallel", "--nproc 2 --batch-size 32 --micro-batches 4", "07, 2 stages x 4 micro-batches" },
        { "08-context-parallel", "--nproc 4 --cp 2 --batch-size 16", "08, 2 groups of 2 ranks" } };
    for (int k = 0; k < 2; k++) {
        char pdir[600], plog[700];
        snprintf(pdir, sizeof pdir, "%s/masked-%.2s", tmpdir, split[k].stage);
        snprintf(plog, sizeof plog, "%s.jsonl", pdir);
        st = run_cmd(out, sizeof out, "%s --tokens %s " PAR_FLAGS " %s %s --save-dir %s --log %s", stage_bin(split[k].stage),
                     instruction_data(), flags, split[k].flags, pdir, plog);
        CHECKF(st == 0, "%.2s: exit %d\n%s", split[k].stage, st, out);
        m = read_losses(plog, got, 64);
        worst = n == 20 && m == 20 ? 0 : 1e9;
        for (int i = 0; i < n && i < m; i++) worst = fmax(worst, fabs(got[i] - ref[i]));
        CHECKF(worst <= 1e-5, "%s: %d logged losses, worst difference from 01 %.3g", split[k].what, m, worst);
        snprintf(q, sizeof q, "%s/llama_data0-320_epoch2", pdir);
        d = max_tensor_diff(p, q);
        CHECKF(d >= 0 && d <= 2e-5, "%s: weights differ from 01 by %.3g", split[k].what, d);
    }
    /* stopped in mid-epoch and resumed, 03 counts the rest of the epoch's targets as the straight run did */
    char a[600], b[600];
    snprintf(a, sizeof a, "%s/masked-straight", tmpdir);
    snprintf(b, sizeof b, "%s/masked-resumed", tmpdir);
    st = run_cmd(out, sizeof out, "%s --tokens %s " PAR_FLAGS " %s --nproc 2 --batch-size 16 --save-dir %s", stage_bin("03-ddp"),
                 instruction_data(), flags, a);
    CHECKF(st == 0, "03 straight: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --tokens %s " PAR_FLAGS " %s --nproc 2 --batch-size 16 --steps 7 --save-dir %s",
                 stage_bin("03-ddp"), instruction_data(), flags, b);
    CHECKF(st == 0, "03 to step 7: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --tokens %s " PAR_FLAGS " %s --nproc 2 --batch-size 16 --resume %s/llama_data0-320_step7 "
                 "--save-dir %s", stage_bin("03-ddp"), instruction_data(), flags, b, b);
    CHECKF(st == 0, "03 resumed: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/llama_data0-320_epoch2", a);
    snprintf(q, sizeof q, "%s/llama_data0-320_epoch2", b);
    CHECKF(files_equal_tensors(p, q), "03 on masked data: resumed at step 7, not bit for bit the straight run");
}

/* The activations' figure of a run's "peak memory:" line, in MB (-1: none). */
static double peak_activations_mb(const char *out) {
    const char *p = strstr(out, "peak memory:");
    p = p ? strstr(p, "activations ") : NULL;
    return p ? atof(p + 12) : -1;
}
/* --recompute drops each block's activations after forward and makes them
   again in backward: the same ops in the same order, so a run ends with the
   same bits as without it, in less activation memory. One case: `bin` is a
   stage with its --device. */
typedef struct { const char *stage, *flags, *model; int fewer; } recompute_case;
static void recompute_gives_the_same_bits(const char *bin, const recompute_case *c, const char *tag) {
    char out[16384], dir[2][600];
    double act[2];
    for (int r = 0; r < 2; r++) {
        snprintf(dir[r], 600, "%s/recompute-%s-%d", tmpdir, tag, r);
        int images = strstr(c->model, "vit") || strstr(c->model, "mlp");      /* the test's own data: any build reads it */
        int st = run_cmd(out, sizeof out, "%s %s %s --data %s --dim 32 --image-size 16 --batch-size 8 --steps 20 --epochs 4 "
                         "--log-every 1000 --save-dir %s%s", bin, c->flags, c->model, images ? small_data() : gpt_text(), dir[r],
                         r ? " --recompute" : "");
        CHECKF(st == 0, "%s %s%s: exit %d\n%s", c->stage, c->model, r ? " --recompute" : "", st, out);
        act[r] = peak_activations_mb(out);
    }
    /* every file of every checkpoint (whole, or a rank's shard), byte for byte */
    int st = run_cmd(out, sizeof out, "sh -c 'cd %s && n=0; for f in */*.safetensors; do cmp \"$f\" \"%s/$f\" || exit 1; "
                     "n=$((n+1)); done; echo files $n'", dir[0], dir[1]);
    CHECKF(st == 0 && strstr(out, "files ") && atoi(strstr(out, "files ") + 6) >= 2, "%s %s %s: --recompute changed the bits:\n%s",
           c->stage, c->flags, c->model, out);
    printf("    %s %s %s: activations %.1f MB, with --recompute %.1f MB\n", c->stage, c->flags, c->model, act[0], act[1]);
    /* What --recompute saves is every block's activations but one; without it a block's gradients
       go back after its backward already, and at these sizes the head's share is large: 5% at least. */
    if (c->fewer)
        CHECKF(act[1] > 0 && act[1] < 0.95 * act[0], "%s %s: activations %.1f MB with --recompute, %.1f MB without", c->stage,
               c->model, act[1], act[0]);
}
#define RC_VIT "--model vit --depth 3 --heads 2 --patch 4"
#define RC_GPT "--model gpt --depth 4 --heads 2 --seq-len 32"
#define RC_LLAMA "--model llama --depth 4 --heads 4 --kv-heads 2 --seq-len 32"
/* Every stage: DDP's buckets (which still overlap backward), FSDP's units
   gathered again for the recompute, bf16 and accumulation, and 08's ring,
   which goes around again for the recompute. */
TEST(recompute_repeats_the_bits_of_every_stage_in_less_memory, QUICK) {
    static const recompute_case cases[] = {
        { "01-single-gpu", "", RC_VIT, 1 }, { "01-single-gpu", "", RC_GPT, 1 },
        { "01-single-gpu", "", RC_LLAMA " --untied-head --qkv-bias", 1 }, { "01-single-gpu", "", "--model mlp --depth 3", 0 },
        { "02-dp", "--nproc 2", RC_LLAMA, 1 }, { "03-ddp", "--nproc 2 --bucket-mb 0.01", RC_GPT, 1 },
        { "04-fsdp", "--nproc 2 --shard full", RC_LLAMA, 1 }, { "04-fsdp", "--nproc 2 --shard grads --cpu-offload", RC_VIT, 1 },
        { "05-accum-mixed-precision", "--nproc 2 --dtype bf16 --accum-steps 2", RC_LLAMA, 1 },
        { "08-context-parallel", "--nproc 2 --cp 2", "--model gpt --depth 3 --heads 2 --seq-len 64", 0 },
        { "08-context-parallel", "--nproc 4 --cp 2 --cp-layout contiguous --shard full",
          "--model llama --depth 3 --heads 4 --kv-heads 2 --seq-len 64", 1 },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char tag[16];
        snprintf(tag, sizeof tag, "cpu%zu", k);
        recompute_gives_the_same_bits(stage_bin(cases[k].stage), &cases[k], tag);
    }
}
