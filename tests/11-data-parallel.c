/* tests/11-data-parallel.c -- tests of dtrain.h's chapter 11-data-parallel:
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
