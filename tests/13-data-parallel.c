/* tests/13-data-parallel.c -- tests of dtrain.h's chapter 13-data-parallel:
   DataParallel (stage 02) and DDP equal one device with N times the batch.
   (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- parallel wrappers: DP, DDP and FSDP equal one device with N times the batch; order mistakes ---- */

/* The losses of a --log file, step by step. */
static int read_losses(const char *path, double *loss, int max) {
    size_t n = 0;
    char *text = (char *)read_bytes(path, &n);
    int count = 0;
    if (!text) return 0;
    text = (char *)realloc(text, n + 1);
    text[n] = 0;
    for (char *line = strtok(text, "\n"); line && count < max; line = strtok(NULL, "\n")) {
        char *p = strstr(line, "\"loss\":");
        if (p && !strstr(line, "summary")) loss[count++] = atof(p + 7);
    }
    free(text);
    return count;
}

static double file_max_tensor_diff(const char *a, const char *b) {
    dt_safetensors *x = dt_safetensors_read(a), *y = dt_safetensors_read(b);
    double worst = x->n == y->n && x->n > 0 ? 0 : -1;
    for (int i = 0; worst >= 0 && i < x->n; i++) {
        dt__st_tensor *t = &x->t[i], *u = NULL;
        for (int j = 0; j < y->n; j++) if (!strcmp(y->t[j].name, t->name)) u = &y->t[j];
        if (!u || t->end - t->begin != u->end - u->begin || strcmp(t->dtype, "F32")) { worst = -1; break; }
        const float *p = (const float *)(x->buf + x->data_start + t->begin), *q = (const float *)(y->buf + y->data_start + u->begin);
        for (size_t k = 0; k < (t->end - t->begin) / 4; k++) worst = fmax(worst, fabs((double)p[k] - q[k]));
    }
    dt_safetensors_close(x);
    dt_safetensors_close(y);
    return worst;
}
/* Largest |a - b| over every tensor of two checkpoints (-1 when they do not pair up). */
static double max_tensor_diff(const char *a, const char *b) {
    char fa[2][800], fb[2][800];
    int n = tensor_files(a, fa);
    double worst = n == tensor_files(b, fb) ? 0 : -1;
    for (int k = 0; worst >= 0 && k < n; k++) {
        double d = file_max_tensor_diff(fa[k], fb[k]);
        worst = d < 0 ? -1 : fmax(worst, d);
    }
    return worst;
}

/* 20 steps (2 epochs of 320 images in batches of 32) of stage 01, and of 02 and
   03 over N = 2 and 4 devices or ranks with batches of 32/N each: the same
   images make each step, so only the order of the sums differs. Tolerances:
   losses within 1e-5, every parameter and optimizer moment within 2e-5 (the
   learning rate is 1e-3; measured differences are 1e-7 for the MLP, 4e-6 for
   the ViT). */
static void equivalence(const char *data, int samples, const char *model_flags, const char *model) {
    char out[16384], dir[600], log[700], ref_dir[600], ref_log[700], p[700], q[700];
    double ref[64], got[64];
    const char *flag = strstr(data, ".jsonl") ? "--tokens" : "--data";   /* instruction data, or images and text */
    snprintf(ref_dir, sizeof ref_dir, "%s/eq-%s-%s-01", tmpdir, model, flag + 2);
    snprintf(ref_log, sizeof ref_log, "%s.jsonl", ref_dir);
    int st = run_cmd(out, sizeof out, "%s %s %s " PAR_FLAGS " %s --batch-size 32 --save-dir %s --log %s", train_cpu,
                     flag, data, model_flags, ref_dir, ref_log);
    CHECKF(st == 0, "01: exit %d\n%s", st, out);
    int nref = read_losses(ref_log, ref, 64);
    CHECKF(nref == 20, "01 logged %d steps, expected 20", nref);
    snprintf(p, sizeof p, "%s/%s_data0-%d_epoch2", ref_dir, model, samples);
    const char *stages[2] = { "02-dp", "03-ddp" };
    for (int s = 0; s < 2; s++)
        for (int n = 2; n <= 4; n += 2) {
            snprintf(dir, sizeof dir, "%s/eq-%s-%s-%s-%d", tmpdir, model, flag + 2, stages[s], n);
            snprintf(log, sizeof log, "%s.jsonl", dir);
            st = run_cmd(out, sizeof out, "%s %s %s " PAR_FLAGS " %s --batch-size %d --nproc %d --save-dir %s --log %s",
                         stage_bin(stages[s]), flag, data, model_flags, 32 / n, n, dir, log);
            CHECKF(st == 0, "%s --nproc %d: exit %d\n%s", stages[s], n, st, out);
            int ngot = read_losses(log, got, 64);
            double worst_loss = ngot == nref ? 0 : 1e9;
            for (int i = 0; i < ngot && i < nref; i++) worst_loss = fmax(worst_loss, fabs(got[i] - ref[i]));
            CHECKF(worst_loss <= 1e-5, "%s %s N=%d: %d logged losses, worst difference from 01 %.3g", model, stages[s], n,
                   ngot, worst_loss);
            snprintf(q, sizeof q, "%s/%s_data0-%d_epoch2", dir, model, samples);
            double d = max_tensor_diff(p, q);
            CHECKF(d >= 0 && d <= 2e-5, "%s %s N=%d: parameters or optimizer state differ from 01 by %.3g", model,
                   stages[s], n, d);
        }
}
TEST(dp_and_ddp_equal_one_device_with_n_times_the_batch, QUICK) {
    equivalence(small_data(), 320, "", "mlp");
    equivalence(small_data(), 320, "--model vit --depth 2 --heads 2 --patch 4", "vit");
}

TEST(dp_and_ddp_runs_repeat_bit_for_bit, QUICK) {
    char out[16384], a[600], b[600], p[700], q[700];
    const char *stages[2] = { "02-dp", "03-ddp" }, *flags[2] = { "", "--bucket-mb 0.02" };   /* DDP: many buckets */
    for (int s = 0; s < 2; s++) {
        for (int k = 0; k < 2; k++) {
            snprintf(k ? b : a, 600, "%s/rep-%s-%d", tmpdir, stages[s], k);
            int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model vit --depth 1 --heads 2 --batch-size 16 "
                             "--nproc 2 %s --save-dir %s", stage_bin(stages[s]), small_data(), flags[s], k ? b : a);
            CHECKF(st == 0, "%s: exit %d\n%s", stages[s], st, out);
        }
        snprintf(p, sizeof p, "%s/vit_data0-320_epoch2", a);
        snprintf(q, sizeof q, "%s/vit_data0-320_epoch2", b);
        CHECKF(files_equal_tensors(p, q), "%s: two runs of the same command differ", stages[s]);
    }
}

/* A language model with experts trains in 02 to 05 as on one device: the
   experts are parameters like any others to the data-parallel engines (an
   expert a rank's tokens never reach gets a zero gradient there, averaged
   with the others'), so 10 steps of each over 2 ranks with half the batch
   (05: a quarter, twice) give 01's losses within 1e-5 and its weights and
   moments within 2e-5; --recompute changes no bit. With a capacity that
   drops choices and the balancing loss, 03, 04 and 05 route the whole batch
   as 01 does (every rank sees every rank's router probabilities): the same
   choices drop, and the same loss is added. */
TEST(models_with_experts_in_02_to_05_equal_one_device, QUICK) {
    char out[16384], ref[600], dir[600], log[700], ref_log[700], p[800], q[800];
    double want[16], got[16];
    static const struct { const char *stage, *flags; int whole_batch; } runs[] = {
        { "02-dp", "--nproc 2 --batch-size 4", 0 }, { "03-ddp", "--nproc 2 --batch-size 4 --bucket-mb 0.01", 1 },
        { "04-fsdp", "--nproc 2 --batch-size 4", 1 }, { "05-accum-mixed-precision", "--nproc 2 --batch-size 2 --accum-steps 2", 0 },
        { "05-accum-mixed-precision", "--nproc 2 --batch-size 4", 1 }, { "01-single-gpu", "--batch-size 8 --recompute", 1 } };
    for (int balanced = 0; balanced < 2; balanced++) {
        char model[400];
        snprintf(model, sizeof model, "--model gpt --dim 32 --depth 2 --heads 2 --seq-len 16 --moe-experts 4 --moe-top-k 2 "
                 "--log-every 1000 --quiet --steps 10 --lr 1e-2%s", balanced ? " --moe-capacity 0.8 --moe-aux-loss 0.05" : "");
        snprintf(ref, sizeof ref, "%s/moe%d-01", tmpdir, balanced);
        snprintf(ref_log, sizeof ref_log, "%s.jsonl", ref);
        int st = run_cmd(out, sizeof out, "%s --data %s %s --batch-size 8 --save-dir %s --log %s", train_cpu, gpt_text(), model,
                         ref, ref_log);
        CHECKF(st == 0, "01: exit %d\n%s", st, out);
        int n = read_losses(ref_log, want, 16);
        CHECKF(n == 10 && want[9] < want[0] - 0.5, "01 logged %d losses, from %.4f to %.4f", n, want[0], n ? want[n - 1] : 0);
        if (balanced)
            CHECKF(log_lines_with_value(ref_log, "moe_dropped", 0) < 10, "--moe-capacity 0.8 dropped nothing in 10 steps");
        st = run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step10'", ref);
        out[strcspn(out, "\n")] = 0;
        dt__copy_str(p, sizeof p, out);
        for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
            if (balanced && !runs[r].whole_batch) continue;
            snprintf(dir, sizeof dir, "%s/moe%d-%s-%d", tmpdir, balanced, runs[r].stage, (int)r);
            snprintf(log, sizeof log, "%s.jsonl", dir);
            st = run_cmd(out, sizeof out, "%s --data %s %s %s --save-dir %s --log %s", stage_bin(runs[r].stage), gpt_text(), model,
                         runs[r].flags, dir, log);
            CHECKF(st == 0, "%s %s: exit %d\n%s", runs[r].stage, runs[r].flags, st, out);
            int k = read_losses(log, got, 16);
            double worst = k == n ? 0 : 1e9;
            for (int i = 0; i < k && i < n; i++) worst = fmax(worst, fabs(got[i] - want[i]));
            CHECKF(worst <= 1e-5, "%s %s%s: %d losses, %.3g from 01's", runs[r].stage, runs[r].flags,
                   balanced ? " (capacity, balancing loss)" : "", k, worst);
            st = run_cmd(out, sizeof out, "sh -c 'ls -d %s/*_step10'", dir);
            out[strcspn(out, "\n")] = 0;
            if (!strcmp(runs[r].stage, "04-fsdp") || !strcmp(runs[r].stage, "05-accum-mixed-precision")) {   /* sharded: made whole */
                snprintf(q, sizeof q, "%s/whole", dir);
                char cmd_out[4096];
                st = run_cmd(cmd_out, sizeof cmd_out, "%s %s %s", build_path("tools/consolidate"), out, q);
                CHECKF(st == 0, "%s: consolidate: exit %d\n%s", runs[r].stage, st, cmd_out);
            } else dt__copy_str(q, sizeof q, out);
            double d = max_tensor_diff(p, q);
            CHECKF(d >= 0 && d <= (strstr(runs[r].flags, "recompute") ? 0 : 2e-5), "%s %s%s: weights or moments %.3g from 01's",
                   runs[r].stage, runs[r].flags, balanced ? " (capacity, balancing loss)" : "", d);
        }
    }
}
