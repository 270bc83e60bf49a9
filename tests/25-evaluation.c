/* tests/25-evaluation.c -- tests of dtrain.h's chapter 25-evaluation:
   evaluation and generation. (tests/helpers.h: how the suite's files make
   one program.) */
#include "helpers.h"

/* ---- evaluation and generation ------------------------------------------ */

/* The evaluation says what it is about to do before it does it (a long
   evaluation is otherwise a silent minute), then prints its result. */
TEST(evaluation_announces_itself_before_its_result, QUICK) {
    char out[32768];
    int st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --dim 32 --batch-size 32 --epochs 1", train_cpu, small_data());
    CHECKF(st == 0, "exit %d\n%s", st, out);
    const char *before = find_line(out, "eval  step 10: evaluating 80 images ..."), *result = find_line(out, "eval  step 10: loss ");
    CHECKF(before && result && before < result, "no 'evaluating 80 images' line before the result:\n%s", out);
}

/* At a temperature near 0, sampling is the model's own argmax, token after
   token, past the end of the context (the window slides). */
TEST(gpt_generation_follows_the_model, QUICK) {
    dt_model_config c = tiny_gpt();
    dt_model *m = dt_model_create(&c, 5);
    for (int64_t i = 0; i < m->numel; i++) m->flat_data[i] *= 30;      /* sharp logits: no near ties */
    int32_t prompt[2] = { 3, 8 }, out[7];
    dt_generate(m, prompt, 2, 7, 1e-4f, 1, out);
    float seq[9] = { 3, 8 }, logits[6 * 11];
    dt_set_grad_enabled(0);
    for (int n = 2; n < 9; n++) {
        int from = n > 6 ? n - 6 : 0, L = n - from;
        gpt_ctx g = { m, seq + from, 1, L, NULL };
        dt_step_arena_reset();
        dt_tensor_to_host(gpt_logits(&g), logits);
        int best = 0;
        for (int j = 1; j < 11; j++) if (logits[(L - 1) * 11 + j] > logits[(L - 1) * 11 + best]) best = j;
        CHECKF(out[n - 2] == best, "token %d: generated %d, the model's argmax is %d", n, out[n - 2], best);
        seq[n] = (float)best;
    }
    dt_set_grad_enabled(1);
    dt_model_free(m);
}

/* Stage 01 on text learns what a model without context cannot: in 150 steps
   the validation loss falls well below the unigram baseline. */
TEST(gpt_beats_the_unigram_baseline_on_text, FULL) {
    char out[16384], log[600];
    snprintf(log, sizeof log, "%s/gpt-learn.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " GPT_FLAGS " --epochs 15 --lr 3e-3 --log %s", train_cpu, gpt_text(), log);
    CHECKF(st == 0, "exit %d\n%s", st, out);
    double eval = summary_value(log, "eval_loss"), base = summary_value(log, "unigram_loss");
    CHECKF(base > 2.5 && eval < base - 0.5, "eval loss %.4f, unigram baseline %.4f", eval, base);
}
