/* tests/08-lora.c -- tests of dtrain.h's chapter 08-models: LoRA's adapters.
   (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- LoRA --------------------------------------------------------------------- */

/* A model's output on fixed inputs (image models: 2 images; language models: 2 sequences of 5 tokens). */
static dt_tensor *lora_forward(dt_model *m, int32_t *labels) {
    const dt_model_config *c = &m->cfg;
    static float in[2 * 3 * 8 * 8];
    dt__rng r = { 3 };
    if (dt_model_is_language(c->kind)) {
        int s[2] = { 2, 5 };
        for (int i = 0; i < 10; i++) { in[i] = (float)(dt__rng_u64(&r) % (uint64_t)c->classes); labels[i] = (int32_t)((i * 7 + 1) % c->classes); }
        return dt_model_forward(m, dt_tensor_from_host(2, s, in));
    }
    int s[4] = { 2, c->channels, c->image_size, c->image_size };
    for (int i = 0; i < 2 * c->channels * c->image_size * c->image_size; i++) in[i] = (float)(2 * dt__rng_uniform(&r) - 1);
    labels[0] = 1; labels[1] = 2;
    return dt_model_forward(m, dt_tensor_from_host(4, s, in));
}
typedef struct { dt_model *m; int32_t labels[10]; } lora_ctx;
static dt_tensor *f_lora(dt_tensor **l, void *c) { (void)l; lora_ctx *x = (lora_ctx *)c; return dt_cross_entropy(lora_forward(x->m, x->labels), x->labels); }

/* The frozen model of a LoRA model of seed s is the plain model of seed s.
   With B at zero the logits are the plain model's, bit for bit; with A and B
   set they are the plain model's with W + (alpha/r) B A, folded in here; the
   adapters' gradients match finite differences; training changes the
   adapters and nothing else, and only they have gradients and optimizer state. */
TEST(lora_starts_at_the_frozen_model_and_trains_only_its_adapters, QUICK) {
    dt_model_config mlp = { DT_MODEL_MLP, 3, 4, 3, 8, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model_config vit = { DT_MODEL_VIT, 3, 8, 4, 16, 2, 2, 4, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    struct { dt_model_config c; const char *targets; int pairs; } cases[] = {
        { mlp, "", 3 },                                   /* the default: every layer */
        { vit, "qkv,fc1,head", 5 },                       /* fc1: GELU's fused form comes apart */
        { tiny_gpt(), "c_attn,c_fc,c_proj", 8 },          /* Conv1D's [in, out]; c_proj is attn's and mlp's */
        { tiny_llama(1, 1), "q_proj,down_proj,lm_head", 5 },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        dt_model_config c = cases[k].c, lc = c;
        const char *fam = dt__family(c.kind)->name;
        lc.lora_rank = 2; lc.lora_alpha = 3;
        snprintf(lc.lora_targets, sizeof lc.lora_targets, "%s", cases[k].targets);
        dt_model *plain = dt_model_create(&c, 5), *m = dt_model_create(&lc, 5);
        CHECKF(m->base && m->base->numel == plain->numel &&
               !memcmp(m->base->flat_data, plain->flat_data, sizeof(float) * (size_t)plain->numel),
               "%s: the frozen model is not the plain model of the same seed", fam);
        CHECKF(m->nparams == 2 * cases[k].pairs, "%s: %d adapter tensors, expected %d", fam, m->nparams, 2 * cases[k].pairs);
        CHECKF(m->base->flat_grad == NULL && !m->base->params[0].requires_grad, "%s: the frozen model has gradients", fam);
        int32_t labels[10];
        int64_t n = lora_forward(plain, labels)->numel;
        float *want = (float *)malloc(sizeof(float) * (size_t)n);
        memcpy(want, lora_forward(plain, labels)->data, sizeof(float) * (size_t)n);
        dt_tensor *got = lora_forward(m, labels);
        CHECKF(got->numel == n && !memcmp(got->data, want, sizeof(float) * (size_t)n), "%s: with B = 0 the logits differ", fam);
        dt_step_arena_reset();
        /* A and B at random; the same function as W + s B A */
        dt__rng r = { 11 + k };
        for (int64_t i = 0; i < m->numel; i++) m->flat_data[i] = (float)(dt__rng_uniform(&r) - 0.5);
        double s = 3.0 / 2;
        for (int i = 0; i < plain->nparams; i++) {
            int a = m->lora_of[i];
            if (a < 0) continue;
            const dt_tensor *A = &m->params[a], *Bm = &m->params[a + 1];
            int in = A->shape[1], out = Bm->shape[0];
            for (int o = 0; o < out; o++)
                for (int q = 0; q < in; q++) {
                    double d = 0;
                    for (int j = 0; j < 2; j++) d += (double)Bm->data[o * 2 + j] * A->data[j * in + q];
                    plain->params[i].data[c.kind == DT_MODEL_GPT ? q * out + o : o * in + q] += (float)(s * d);
                }
        }
        memcpy(want, lora_forward(plain, labels)->data, sizeof(float) * (size_t)n);
        got = lora_forward(m, labels);
        double worst = 0;
        for (int64_t i = 0; i < n; i++) worst = fmax(worst, fabs((double)got->data[i] - want[i]));
        CHECKF(worst < 2e-5, "%s: logits with adapters differ from W + (alpha/r) B A by %.3g", fam, worst);
        dt_step_arena_reset();
        lora_ctx x = { m, { 0 } };
        lora_forward(m, x.labels);
        dt_step_arena_reset();
        dt_tensor **leaves = (dt_tensor **)malloc(sizeof(dt_tensor *) * (size_t)m->nparams);
        for (int i = 0; i < m->nparams; i++) leaves[i] = &m->params[i];
        dt_model_zero_grad(m);
        fd_check(fam, f_lora, leaves, m->nparams, &x, 2e-3f, 2e-2);
        free(leaves);
        /* three steps of AdamW */
        float *before = (float *)malloc(sizeof(float) * (size_t)m->numel);
        memcpy(before, m->flat_data, sizeof(float) * (size_t)m->numel);
        dt_optimizer *o = dt_optimizer_create(m, DT_ADAMW, 0.01f, 0, 0);
        CHECKF(o->numel == m->numel, "%s: the optimizer steps %lld numbers, the adapters are %lld", fam, (long long)o->numel,
               (long long)m->numel);
        for (int step = 0; step < 3; step++) {
            dt_model_zero_grad(m);
            dt_backward(dt_cross_entropy(lora_forward(m, x.labels), x.labels));
            dt_optimizer_step(o, 1e-2f);
            dt_step_arena_reset();
        }
        for (int i = 0; i < m->nparams; i++) {
            const dt_tensor *p = &m->params[i];
            int changed = 0;
            for (int64_t j = 0; j < p->numel; j++) changed += p->data[j] != before[m->offsets[i] + j];
            CHECKF(changed == p->numel, "%s: %lld of %lld values of %s changed in training", fam, (long long)changed,
                   (long long)p->numel, p->name);
        }
        dt_model *fresh = dt_model_create(&c, 5);
        CHECKF(!memcmp(m->base->flat_data, fresh->flat_data, sizeof(float) * (size_t)fresh->numel), "%s: training moved frozen weights",
               fam);
        dt_optimizer_free(o);
        dt_model_free(fresh);
        dt_model_free(plain);
        dt_model_free(m);
        free(before);
        free(want);
    }
    /* names PEFT's; a target that names nothing is an error that lists what there is */
    dt_model_config lc = tiny_gpt();
    lc.lora_rank = 2; lc.lora_alpha = 8;
    dt_model *m = dt_model_create(&lc, 1);
    CHECKF(!strcmp(m->params[0].name, "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight") &&
           m->params[0].shape[0] == 2 && m->params[0].shape[1] == 12 && m->params[1].shape[0] == 36 && m->params[1].shape[1] == 2,
           "gpt's first adapter: %s [%d, %d]", m->params[0].name, m->params[0].shape[0], m->params[0].shape[1]);
    dt_model_free(m);
    char out[4096];
    int st = run_cmd(out, sizeof out, "%s --model gpt --dim 32 --depth 1 --heads 2 --seq-len 16 --data %s --lora-rank 2 "
                     "--lora-targets c_atn --steps 1", train_cpu, gpt_text());
    CHECKF(st != 0 && strstr(out, "'c_atn' names no linear layer") && strstr(out, "c_attn,c_proj,c_fc"), "a misspelt target: exit %d\n%s",
           st, out);
    st = run_cmd(out, sizeof out, "%s --model gpt --lora-alpha 4 --steps 1", train_cpu);
    CHECKF(st == 2 && strstr(out, "--lora-alpha and --lora-targets go with --lora-rank"), "--lora-alpha alone: exit %d\n%s", st, out);
}

/* The first logged loss of a stage 01 run of a few steps (-1: none). */
static double first_loss(const char *flags, const char *tag) {
    char out[16384], log[700];
    double loss[4];
    snprintf(log, sizeof log, "%s/lora-first-%s.jsonl", tmpdir, tag);
    int st = run_cmd(out, sizeof out, "%s --data %s %s --steps 1 --log %s --quiet", train_cpu, gpt_text(), flags, log);
    CHECKF(st == 0, "%s: exit %d\n%s", tag, st, out);
    return st == 0 && read_losses(log, loss, 4) >= 1 ? loss[0] : -1;
}
/* The "grads" and "optimizer" figures of a run's "peak memory:" line, in MB. */
static double peak_mb(const char *out, const char *what) {
    const char *p = strstr(out, "peak memory:");
    char key[32];
    snprintf(key, sizeof key, " %s ", what);
    p = p ? strstr(p, key) : NULL;
    return p ? atof(p + strlen(key)) : -1;
}
#define LORA_GPT "--model gpt --depth 2 --heads 2 --seq-len 16 --lora-rank 4 --lora-alpha 8 --lora-targets c_attn,c_fc"
/* LoRA in every stage: DataParallel and DDP (N = 2, 4) and FSDP equal stage 01
   with the same global batch; a checkpoint is PEFT's folder, resumes bit for
   bit, and comes back through --init and through tools/merge-lora to the
   same first loss; the memory line holds the adapters' gradients and
   optimizer state alone. */
TEST(lora_trains_alike_in_every_stage_and_round_trips, QUICK) {
    char out[16384], dir[600], log[700], ref[700], p[800], q[800];
    double want[64], got[64];
    equivalence(gpt_text(), 320, LORA_GPT, "gpt");
    snprintf(ref, sizeof ref, "%s/eq-gpt-data-01/gpt_data0-320_epoch2", tmpdir);
    snprintf(log, sizeof log, "%s/eq-gpt-data-01.jsonl", tmpdir);
    int nref = read_losses(log, want, 64);
    const char *modes[2] = { "--shard full", "--shard grads --cpu-offload" };
    for (int k = 0; k < 2; k++) {
        snprintf(dir, sizeof dir, "%s/lora-fsdp-%d", tmpdir, k);
        snprintf(log, sizeof log, "%s.jsonl", dir);
        int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " LORA_GPT " --batch-size 16 --nproc 2 %s --save-dir %s --log %s",
                         stage_bin("04-fsdp"), gpt_text(), modes[k], dir, log);
        CHECKF(st == 0, "04 %s: exit %d\n%s", modes[k], st, out);
        int n = read_losses(log, got, 64);
        double worst = n == nref ? 0 : 1e9;
        for (int i = 0; i < n && i < nref; i++) worst = fmax(worst, fabs(got[i] - want[i]));
        CHECKF(worst <= 1e-5, "04 %s with LoRA: %d losses, worst difference from 01 %.3g", modes[k], n, worst);
        snprintf(p, sizeof p, "%s/whole", dir);
        snprintf(q, sizeof q, "%s/gpt_data0-320_epoch2", dir);
        st = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/consolidate"), q, p);
        CHECKF(st == 0, "consolidate of 04's LoRA checkpoint: exit %d\n%s", st, out);
        double d = max_tensor_diff(ref, p);
        CHECKF(d >= 0 && d <= 2e-5, "04 %s with LoRA: adapters or moments differ from 01 by %.3g", modes[k], d);
    }
    /* PEFT's folder: adapter_model.safetensors of the adapters alone, under PEFT's names */
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", ref);
    snprintf(q, sizeof q, "%s/model.safetensors", ref);
    dt_safetensors *st = access(p, F_OK) == 0 ? dt_safetensors_read(p) : NULL;
    CHECKF(st && access(q, F_OK) != 0 && st->n == 8, "01's LoRA checkpoint %s: %d tensors (8 expected), model.safetensors %s", ref,
           st ? st->n : -1, access(q, F_OK) == 0 ? "there" : "absent");
    for (int i = 0; st && i < st->n; i++)
        CHECKF(!strncmp(st->t[i].name, "base_model.model.transformer.h.", 31) && strstr(st->t[i].name, ".lora_"),
               "%s: '%s' is not PEFT's name of an adapter", p, st->t[i].name);
    if (st) dt_safetensors_close(st);
    snprintf(p, sizeof p, "%s/adapter_config.json", ref);
    size_t len = 0;
    char *cfg = (char *)read_bytes(p, &len);
    CHECKF(cfg && strstr(cfg, "\"peft_type\": \"LORA\"") && strstr(cfg, "\"r\": 4") && strstr(cfg, "\"lora_alpha\": 8.0") &&
           strstr(cfg, "\"target_modules\": [\"c_attn\", \"c_fc\"]") && strstr(cfg, "\"fan_in_fan_out\": true"),
           "%s:\n%.600s", p, cfg ? cfg : "(unreadable)");
    free(cfg);
    /* resumed at step 7: the straight run's bits */
    snprintf(dir, sizeof dir, "%s/lora-resumed", tmpdir);
    int rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " LORA_GPT " --batch-size 32 --steps 7 --save-dir %s", train_cpu,
                     gpt_text(), dir);
    CHECKF(rc == 0, "01 LoRA to step 7: exit %d\n%s", rc, out);
    rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " LORA_GPT " --batch-size 32 --resume %s/gpt_data0-320_step7 --save-dir %s",
                 train_cpu, gpt_text(), dir, dir);
    CHECKF(rc == 0, "01 LoRA resumed: exit %d\n%s", rc, out);
    snprintf(q, sizeof q, "%s/gpt_data0-320_epoch2", dir);
    CHECKF(files_equal_tensors(ref, q), "LoRA resumed at step 7 is not bit for bit the straight run");
    rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model gpt --depth 2 --heads 2 --seq-len 16 --batch-size 32 --resume "
                 "%s/gpt_data0-320_step7", train_cpu, gpt_text(), dir);
    CHECKF(rc != 0 && strstr(out, "holds LoRA adapters"), "resuming LoRA adapters without --lora-rank: exit %d\n%s", rc, out);
    /* back through --init, and through the merge tool, to the same first loss */
    snprintf(dir, sizeof dir, "%s/lora-merged", tmpdir);
    rc = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/merge-lora"), ref, dir);
    CHECKF(rc == 0, "merge-lora: exit %d\n%s", rc, out);
    char flags[1400];
    snprintf(flags, sizeof flags, PAR_FLAGS " --batch-size 32 --model gpt --depth 2 --heads 2 --seq-len 16 --init %s", ref);
    double adapter = first_loss(flags, "adapter");        /* its frozen model is the seed's: the flags give the shape */
    snprintf(flags, sizeof flags, PAR_FLAGS " --batch-size 32 --init %s", dir);
    double merged = first_loss(flags, "merged");
    double untrained = first_loss(PAR_FLAGS " --batch-size 32 --model gpt --depth 2 --heads 2 --seq-len 16", "plain");
    printf("    first loss: frozen model %.6f, with the trained adapters %.6f, merged %.6f\n", untrained, adapter, merged);
    CHECKF(adapter > 0 && fabs(adapter - merged) <= 1e-5 && fabs(adapter - untrained) > 1e-3,
           "first loss: adapters %.7f, merged %.7f, the frozen model alone %.7f", adapter, merged, untrained);
    /* and the logits themselves: the adapter folder into a LoRA model, the merged one into a plain model */
    {
        dt_model_config c = tiny_gpt(), lc;
        c.classes = 256; c.dim = 32; c.seq_len = 16; c.mlp_hidden = 128;
        lc = c;
        lc.lora_rank = 4; lc.lora_alpha = 8;
        snprintf(lc.lora_targets, sizeof lc.lora_targets, "c_attn,c_fc");
        dt_model *a = dt_model_create(&lc, 1), *b = dt_model_create(&c, 77);
        dt_model_load_weights(a, ref);
        dt_model_load_weights(b, dir);
        int32_t labels[10];
        int64_t n = lora_forward(a, labels)->numel;
        float *la = (float *)malloc(sizeof(float) * (size_t)n);
        memcpy(la, lora_forward(a, labels)->data, sizeof(float) * (size_t)n);
        dt_tensor *lb = lora_forward(b, labels);
        double worst = lb->numel == n ? 0 : 1e9;
        for (int64_t i = 0; i < n && lb->numel == n; i++) worst = fmax(worst, fabs((double)la[i] - lb->data[i]));
        CHECKF(worst <= 1e-5, "logits of the adapter folder and of merge-lora's folder differ by %.3g", worst);
        dt_step_arena_reset();
        free(la);
        dt_model_free(a);
        dt_model_free(b);
    }
    /* a sharded LoRA checkpoint (04's) goes to --init and merge-lora as it is: 01's, within the tolerance */
    snprintf(p, sizeof p, "%s/lora-merged-sharded", tmpdir);
    snprintf(q, sizeof q, "%s/lora-fsdp-0/gpt_data0-320_epoch2", tmpdir);
    rc = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/merge-lora"), q, p);
    CHECKF(rc == 0, "merge-lora of a sharded checkpoint: exit %d\n%s", rc, out);
    char fa[900], fb[900];
    snprintf(fa, sizeof fa, "%s/model.safetensors", p);
    snprintf(fb, sizeof fb, "%s/model.safetensors", dir);
    double d = access(fa, F_OK) == 0 ? file_max_tensor_diff(fa, fb) : -1;
    CHECKF(d >= 0 && d <= 2e-5, "merged from 04's shards and from 01: %.3g apart", d);
    snprintf(flags, sizeof flags, PAR_FLAGS " --batch-size 32 --model gpt --depth 2 --heads 2 --seq-len 16 --init %s", q);
    double sharded = first_loss(flags, "sharded");
    CHECKF(fabs(sharded - adapter) <= 1e-5, "first loss from 04's sharded adapters %.7f, from 01's %.7f", sharded, adapter);
    /* the frozen model of a seed is that seed's: another --seed is refused, for --init and for --resume */
    rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model gpt --depth 2 --heads 2 --seq-len 16 --seed 2 --init %s --steps 1",
                 train_cpu, gpt_text(), ref);
    expect_error(out, rc, 1, "run with --seed 1");
    rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " LORA_GPT " --batch-size 32 --seed 2 --resume %s/lora-resumed/gpt_data0-320_step7",
                 train_cpu, gpt_text(), tmpdir);
    expect_error(out, rc, 1, "run with --seed 1");
    /* PEFT's options that dtrain's LoRA does not have are refused by name, not dropped */
    static const char *const options[][2] = { { "\"bias\": \"none\"", "\"bias\": \"lora_only\"" },
                                               { "\"modules_to_save\": null", "\"modules_to_save\": [\"lm_head\"]" },
                                               { "\"revision\": null", "\"rank_pattern\": {\"c_fc\": 8}" } };
    for (int k = 0; k < 3; k++) {
        snprintf(p, sizeof p, "%s/lora-option-%d", tmpdir, k);
        rc = run_cmd(out, sizeof out, "sh -c 'mkdir -p %s && cp %s/adapter_model.safetensors %s/'", p, ref, p);
        snprintf(q, sizeof q, "%s/adapter_config.json", ref);
        char *json = (char *)read_bytes(q, &len), *at = json ? strstr(json, options[k][0]) : NULL;
        CHECKF(rc == 0 && at, "copying the adapter folder: %s", out);
        if (!at) { free(json); continue; }
        FILE *f = fopen(strcat(strcpy(fa, p), "/adapter_config.json"), "w");
        if (f) {
            fprintf(f, "%.*s%s%s", (int)(at - json), json, options[k][1], at + strlen(options[k][0]));
            fclose(f);
        }
        free(json);
        rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model gpt --depth 2 --heads 2 --seq-len 16 --init %s --steps 1", train_cpu,
                     gpt_text(), p);
        expect_error_in(options[k][1], out, rc, 1, k == 0 ? "\"bias\" is not \"none\"" : k == 1 ? "\"modules_to_save\" is set"
                                                                                         : "\"rank_pattern\" is set");
    }
    /* FSDP's memory table: the frozen model has a row of its own */
    rc = run_cmd(out, sizeof out, "%s --data %s --dim 32 --log-every 1000 " LORA_GPT " --batch-size 16 --nproc 2 --steps 1",
                 stage_bin("04-fsdp"), gpt_text());
    CHECKF(rc == 0 && strstr(out, "frozen (LoRA)"), "04's memory table with LoRA: exit %d\n%s", rc, out);
    /* the memory line: gradients and optimizer state of the adapters alone */
    double grads[2], opt[2];
    for (int k = 0; k < 2; k++) {
        rc = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 128 --depth 2 --heads 2 --seq-len 16 --batch-size 8 --steps 2%s",
                     train_cpu, gpt_text(), k ? " --lora-rank 4" : "");
        CHECKF(rc == 0, "memory run %d: exit %d\n%s", k, rc, out);
        grads[k] = peak_mb(out, "grads");
        opt[k] = peak_mb(out, "optimizer");
    }
    printf("    peak memory, dim 128: grads %.2f MB, optimizer %.2f MB; with LoRA rank 4 on c_attn %.2f MB, %.2f MB\n", grads[0],
           opt[0], grads[1], opt[1]);
    CHECKF(grads[0] > 0.5 && grads[1] >= 0 && grads[1] < 0.05 * grads[0] && opt[1] >= 0 && opt[1] < 0.05 * opt[0],
           "peak memory: grads %.3f -> %.3f MB, optimizer %.3f -> %.3f MB with LoRA", grads[0], grads[1], opt[0], opt[1]);
    /* bf16 and accumulation train with it */
    rc = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " " LORA_GPT " --batch-size 8 --nproc 2 --accum-steps 2 --dtype bf16 --steps 4",
                 stage_bin("05-accum-mixed-precision"), gpt_text());
    CHECKF(rc == 0 && strstr(out, "done: 4 steps"), "05 bf16 with LoRA: exit %d\n%s", rc, out);
}
