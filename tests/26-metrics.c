/* tests/26-metrics.c -- tests of dtrain.h's chapter 26-metrics: logs,
   traces, progress, TensorBoard, MLflow, the bench line, the plots.
   (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* ---- metrics: logs, traces, progress, the bench line -------------------- */

TEST(training_run_log_trace_and_bench, QUICK) {
    char out[16384], log[600], trace[600];
    snprintf(log, sizeof log, "%s/run.jsonl", tmpdir);
    snprintf(trace, sizeof trace, "%s/run.trace.json", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 10 --lr 3e-3 --augment 0 --log %s --trace %s", train_cpu,
                     small_data(), log, trace);
    CHECKF(st == 0, "exit %d:\n%s", st, out);
    CHECKF(strstr(out, "done: 100 steps") != NULL, "summary missing:\n%s", out);
    size_t n = 0;
    char *text = (char *)read_bytes(log, &n);
    CHECK(text != NULL);
    if (text) {
        text = (char *)realloc(text, n + 1);
        text[n] = 0;
        const char *keys[] = { "\"step\":", "\"epoch\":", "\"loss\":", "\"lr\":", "\"samples_per_s\":", "\"step_ms\":",
                               "\"data_ms\":", "\"fwd_ms\":", "\"bwd_ms\":", "\"comm_ms\":", "\"opt_ms\":", "\"mem_bytes\":" };
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++)
            CHECKF(count_lines_with(text, keys[k]) >= 100, "fewer than 100 log lines with %s", keys[k]);
        CHECK(count_lines_with(text, "\"eval_acc\":") == 10 + 1);  /* 10 evaluations + the summary */
        const char *sum = strstr(text, "\"summary\":true");
        CHECK(sum && strstr(sum, "\"final_loss\":") && strstr(sum, "\"peak_mem_bytes\":") && strstr(sum, "\"world_size\":1"));
        double acc = sum && strstr(sum, "\"eval_acc\":") ? atof(strstr(sum, "\"eval_acc\":") + 11) : 0;
        CHECKF(acc > 0.3, "the small model did not learn: eval accuracy %.3f (chance is 0.1)", acc);
        free(text);
    }
    text = (char *)read_bytes(trace, &n);
    CHECK(text && n > 2 && text[0] == '[' && text[n - 2] == ']');
    if (text) { text = (char *)realloc(text, n + 1); text[n] = 0; CHECK(count_lines_with(text, "\"name\":\"forward\",\"ph\":\"X\"") == 100); free(text); }
    st = run_cmd(out, sizeof out, "%s --bench --steps 2 --batch-size 8 --dim 16", train_cpu);
    CHECKF(st == 0 && strstr(out, "bench: workload=mlp-custom") && strstr(out, "samples_per_s=") && strstr(out, "gflops="),
           "bench output:\n%s", out);
}

/* The lines of `text` that begin with `prefix`, and whether one begins with `line`. */
static int count_line_starts(const char *text, const char *prefix) {
    int n = 0;
    for (const char *p = text; p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) n += !strncmp(p, prefix, strlen(prefix));
    return n;
}

/* Progress is printed by the clock: 3 epochs of 40 steps of a few milliseconds
   give the first step, each epoch's last and a few timed lines, not 120. With
   --log-every N, every N-th step and no other. */
TEST(progress_lines_come_by_time_and_at_each_epochs_end, QUICK) {
    char out[32768], want[64];
    const char *flags = "--image-size 16 --dim 32 --batch-size 8 --epochs 3";
    double t0 = dt_now_ms();
    int st = run_cmd(out, sizeof out, "%s --data %s %s", train_cpu, small_data(), flags);
    double s = (dt_now_ms() - t0) / 1e3;
    CHECKF(st == 0, "exit %d\n%s", st, out);
    int lines = count_line_starts(out, "step ");
    /* 4 lines (steps 1, 40, 80, 120), and one more per 3 s the run took */
    CHECKF(lines >= 4 && lines <= 60 && lines <= 4 + (int)(s / 3) + 1, "%d progress lines for 120 steps in %.1f s:\n%s", lines, s, out);
    CHECKF(find_line(out, "step      1/120  epoch 1/3"), "no line for the first step:\n%s", out);
    for (int e = 1; e <= 3; e++) {
        snprintf(want, sizeof want, "step %6d/120  epoch %d/3", 40 * e, e);
        CHECKF(find_line(out, want), "no progress line at the end of epoch %d ('%s'):\n%s", e, want, out);
    }
    st = run_cmd(out, sizeof out, "%s --data %s %s --epochs 1 --log-every 7", train_cpu, small_data(), "--image-size 16 --dim 32 --batch-size 8");
    CHECKF(st == 0 && count_line_starts(out, "step ") == 6 && find_line(out, "step     35/40") && !find_line(out, "step     40/40"),
           "--log-every 7 over 40 steps: expected steps 1, 7, ..., 35 (exit %d):\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s --log-every 0", train_cpu, small_data());
    expect_error(out, st, 2, "--log-every");
}

/* The ETA's step time follows the recent steps: after a slow warm-up it comes
   down to the fast steps' time, and it follows a slowdown up again, where a
   mean since the start would lag behind both. */
TEST(eta_follows_the_recent_step_time, QUICK) {
    double avg = 0, mean = 0;
    int64_t n = 0;
    for (int i = 0; i < 60; i++) {          /* 5 steps of 1 s (warm-up), then 55 of 100 ms */
        double ms = i < 5 ? 1000 : 100;
        avg = dt__eta_update(avg, ms, ++n);
        mean += (ms - mean) / (double)n;
    }
    CHECKF(fabs(avg - 100) < 5, "after the warm-up: %.1f ms a step, the steps take 100 (the mean since the start: %.1f)", avg, mean);
    for (int i = 0; i < 40; i++) avg = dt__eta_update(avg, 300, ++n);
    CHECKF(fabs(avg - 300) < 10, "after slowing down to 300 ms a step: %.1f ms", avg);
    /* the very first step says little: the second replaces it */
    avg = dt__eta_update(0, 5000, 1);
    CHECK(avg == 5000);
    CHECK(dt__eta_update(avg, 10, 2) == 10);
    CHECK(dt__eta_update(10, 20, 3) > 10 && dt__eta_update(10, 20, 3) < 20);
}

/* Which steps print a line, with the clock passed in. */
TEST(progress_is_due_by_time_epoch_end_or_log_every, QUICK) {
    CHECK(dt__progress_due(1, 0, 0, 0, 0));                    /* the first step */
    CHECK(!dt__progress_due(2, 0, 0, 1000, 0));                /* 1 s later: not yet */
    CHECK(!dt__progress_due(50, 0, 0, 2999, 0));               /* the old every-50 is gone */
    CHECK(dt__progress_due(51, 0, 0, 3000, 0));                /* 3 s: a line */
    CHECK(dt__progress_due(7, 0, 1, 10, 0));                   /* an epoch's last step */
    CHECK(dt__progress_due(10, 10, 0, 0, 0) && dt__progress_due(1, 10, 0, 0, 0));   /* --log-every 10 */
    CHECK(!dt__progress_due(11, 10, 0, 1e6, 0) && !dt__progress_due(12, 10, 1, 0, 0));  /* and nothing else */
}
/* The python with the tracking tools' own readers (tensorboard, mlflow):
   $DT_TEST_TRACKING_PYTHON, the venv .ci/run makes for them
   (build/trackvenv, apart from build/pyvenv's pinned Hugging Face tools), or
   python3. */
static const char *tracking_python(void) {
    static char python[800];
    const char *env = getenv("DT_TEST_TRACKING_PYTHON");
    if (env && env[0]) return env;
    snprintf(python, sizeof python, "%s/build/trackvenv/bin/python", repo_root());
    return access(python, X_OK) == 0 ? python : "python3";
}

/* TensorBoard's event files, checked without Python: CRC-32C's check value
   (of "123456789") and its mask, and a scalar's record byte for byte --
   worked out by hand from TFRecord's framing and event.proto: length 27
   (little-endian uint64), its masked CRC, the Event (0x09 + the wall time as
   a double, 0x10 + the step as a varint, 0x2a + the Summary: 0x0a + the
   Value: 0x0a "loss", 0x15 + 2.5 as a float), the Event's masked CRC. The
   file begins with a record naming the format. A folder that cannot be made
   is an error with errno set, not a crash. */
TEST(tensorboard_event_files_are_framed_and_checksummed_as_tfrecord, QUICK) {
    CHECKF(dt_crc32c("123456789", 9) == 0xe3069283u, "crc32c('123456789') = %08x, the check value is e3069283",
           dt_crc32c("123456789", 9));
    CHECKF(dt_crc32c_masked("123456789", 9) == 0xc78ab0e5u, "masked: %08x, expected c78ab0e5", dt_crc32c_masked("123456789", 9));
    char dir[800];
    snprintf(dir, sizeof dir, "%s/tb-frame", tmpdir);
    dt_tensorboard *tb = dt_tensorboard_open(dir);
    CHECKF(tb != NULL, "cannot open an event file in %s: %s", dir, strerror(errno));
    if (!tb) return;
    char path[4200];
    snprintf(path, sizeof path, "%s", dt_tensorboard_path(tb));
    CHECKF(strstr(path, "/events.out.tfevents.") != NULL, "the file '%s' is not named as TensorBoard looks for", path);
    CHECK(dt_tensorboard_scalar(tb, "loss", 2.5f, 300, 1700000000.5));
    CHECK(dt_tensorboard_close(tb));
    static const unsigned char want[43] = {
        0x1b, 0, 0, 0, 0, 0, 0, 0, 0x1a, 0x0d, 0x9e, 0x13,                         /* 27 bytes, and its masked CRC */
        0x09, 0x00, 0x00, 0x20, 0x40, 0xfc, 0x54, 0xd9, 0x41,                        /* wall_time 1700000000.5 */
        0x10, 0xac, 0x02,                                                            /* step 300 */
        0x2a, 0x0d, 0x0a, 0x0b, 0x0a, 0x04, 'l', 'o', 's', 's', 0x15, 0x00, 0x00, 0x20, 0x40,   /* summary: loss 2.5 */
        0x94, 0xa3, 0x24, 0xbf };                                                    /* the Event's masked CRC */
    size_t n = 0;
    unsigned char *bytes = read_bytes(path, &n);
    CHECKF(bytes && n > 43 + 16, "%s: %zu bytes", path, n);
    if (!bytes || n <= 43 + 16) { free(bytes); return; }
    uint64_t first = 0;
    for (int i = 0; i < 8; i++) first |= (uint64_t)bytes[i] << (8 * i);
    CHECKF(first + 16 + 43 == n, "%s: the first record holds %llu bytes, the file %zu", path, (unsigned long long)first, n);
    uint32_t head_crc = bytes[8] | bytes[9] << 8 | bytes[10] << 16 | (uint32_t)bytes[11] << 24;
    CHECK(first < n && head_crc == dt_crc32c_masked(bytes, 8));
    int named = 0;
    for (uint64_t i = 12; i + 13 <= 12 + first && i + 13 <= n; i++) named |= !memcmp(bytes + i, "brain.Event:2", 13);
    CHECKF(named, "the first record does not name brain.Event:2");
    CHECKF(!memcmp(bytes + n - 43, want, 43), "the scalar's record is not the one worked out by hand");
    free(bytes);
    char file[700];
    snprintf(file, sizeof file, "%s/tb-not-a-folder", tmpdir);
    write_bytes(file, "x", 1);
    snprintf(dir, sizeof dir, "%s/inside", file);
    errno = 0;
    tb = dt_tensorboard_open(dir);
    CHECKF(!tb && errno != 0, "an event file opened inside a file ('%s')", dir);
}

/* --tensorboard on a real run, read back by TensorBoard's own reader
   (tests/tb_read.py, when the tensorboard package is there; .ci/run puts it
   in build/trackvenv): one run (a folder of its own in DIR), every step's
   loss and learning rate as --log has them, the evaluation, the speed --
   steps 1-4, then 5-6 resumed from the step-4 checkpoint into the same run,
   each step once. A folder that cannot be written is named. */
TEST(tensorboard_reads_every_scalar_dtrain_wrote, FULL) {
    char out[16384], dir[600], log[600], bad[700];
    snprintf(dir, sizeof dir, "%s/tb-run", tmpdir);
    snprintf(bad, sizeof bad, "%s/tb-blocker", tmpdir);
    write_bytes(bad, "x", 1);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --tensorboard %s/sub", train_cpu, small_data(), bad);
    CHECKF(st != 0 && strstr(out, "--tensorboard") && strstr(out, bad), "--tensorboard under a file: exit %d\n%s", st, out);
    const char *py = tracking_python();
    if (run_cmd(out, sizeof out, "%s -c 'import tensorboard'", py) != 0)
        SKIP("%.90s cannot import tensorboard; bash .ci/run puts it in build/trackvenv", py);
    snprintf(log, sizeof log, "%s/tb-run.jsonl", tmpdir);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 4 --tensorboard %s --log %s --save-dir %s/tb-ck",
                 train_cpu, small_data(), dir, log, tmpdir);
    CHECKF(st == 0, "--tensorboard: exit %d\n%s", st, out);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 6 --tensorboard %s --log %s "
                 "--resume %s/tb-ck/mlp_data0-320_step4", train_cpu, small_data(), dir, log, tmpdir);
    CHECKF(st == 0, "--tensorboard --resume: exit %d\n%s", st, out);
    static char text[65536];
    st = run_cmd(text, sizeof text, "%s %s/tests/tb_read.py %s", py, repo_root(), dir);
    CHECKF(st == 0, "tests/tb_read.py: exit %d\n%s", st, text);
    double loss[6], lr[6], evals[2];
    CHECK(log_series(log, "loss", loss, 6) == 6 && log_series(log, "lr", lr, 6) == 6 && log_series(log, "eval_loss", evals, 2) == 2);
    int seen[4] = { 0 }, runs = 0;
    char first_run[256] = "";
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char run[256], tag[64];
        long long step;
        double v;
        if (sscanf(line, "%255s %63s %lld %lf", run, tag, &step, &v) != 4) continue;
        if (strcmp(run, first_run)) { runs++; snprintf(first_run, sizeof first_run, "%s", run); }
        if (!strcmp(tag, "train/loss") && step >= 1 && step <= 6) {
            seen[0]++;
            CHECKF(fabs(v - loss[step - 1]) <= 1e-6 * fabs(loss[step - 1]), "train/loss at step %lld: %.8g, --log %.8g", step, v,
                   loss[step - 1]);
        } else if (!strcmp(tag, "train/lr") && step >= 1 && step <= 6) {
            seen[1]++;                      /* --log writes the rate with 6 digits */
            CHECKF(fabs(v - lr[step - 1]) <= 1e-5 * fabs(lr[step - 1]), "train/lr at step %lld: %.8g, --log %.8g", step, v,
                   lr[step - 1]);
        } else if (!strcmp(tag, "eval/loss")) {
            seen[2]++;                      /* at step 4 and at step 6, as the log's evaluation lines */
            CHECKF((step == 4 || step == 6) && fabs(v - evals[step / 6]) <= 1e-5, "eval/loss %.6f at step %lld (--log: %.6f, %.6f)",
                   v, step, evals[0], evals[1]);
        } else if (!strcmp(tag, "speed/samples_per_s")) seen[3] += v > 0;
    }
    CHECKF(runs == 1 && strstr(first_run, "01-single-gpu-mlp-") == first_run,
           "TensorBoard read %d runs (the last '%s'): the resumed run should go on in the first one's folder", runs, first_run);
    CHECKF(seen[0] == 6 && seen[1] == 6 && seen[2] == 2 && seen[3] == 6,
           "TensorBoard read %d losses, %d learning rates, %d evaluations, %d speeds (6, 6, 2, 6 written)", seen[0], seen[1],
           seen[2], seen[3]);
}
/* --mlflow: the run in MLflow's file store, as MLflow lays it out, checked
   without MLflow -- the Default experiment and "dtrain", the run's folder
   (32 hex digits) with its meta.yaml (FINISHED: status 3), params, tags,
   and a metrics file per figure, "<ms> <value> <step>" a line, holding
   --log's losses. Resumed from its checkpoint, the same run goes on (the
   checkpoint names it): steps 5-6 land in the same files, and no run is
   added. A folder that cannot be made is named. */
TEST(mlflow_file_store_holds_the_run_as_mlflow_lays_it_out, QUICK) {
    char out[16384], dir[600], log[600], ck[600], p[1400], run[1000] = "";
    snprintf(dir, sizeof dir, "%s/mlruns", tmpdir);
    snprintf(log, sizeof log, "%s/mlflow.jsonl", tmpdir);
    snprintf(ck, sizeof ck, "%s/mlflow-ck", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 4 --mlflow %s --log %s --save-dir %s",
                     train_cpu, small_data(), dir, log, ck);
    CHECKF(st == 0, "--mlflow: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/0/meta.yaml", dir);
    char *text = read_text(p);
    CHECKF(text && strstr(text, "experiment_id: '0'") && strstr(text, "name: 'Default'"), "%s:\n%s", p, text ? text : "(none)");
    free(text);
    snprintf(p, sizeof p, "%s/1/meta.yaml", dir);
    text = read_text(p);
    CHECKF(text && strstr(text, "experiment_id: '1'") && strstr(text, "name: 'dtrain'") && strstr(text, "lifecycle_stage: active"),
           "%s:\n%s", p, text ? text : "(none)");
    free(text);
    int runs = 0;
    snprintf(p, sizeof p, "%s/1", dir);
    DIR *d = opendir(p);
    for (struct dirent *e; d && (e = readdir(d));)
        if (strlen(e->d_name) == 32 && strspn(e->d_name, "0123456789abcdef") == 32) {
            runs++;
            snprintf(run, sizeof run, "%s/1/%s", dir, e->d_name);
        }
    if (d) closedir(d);
    CHECKF(runs == 1, "%d runs in %s/1 (1 expected)", runs, dir);
    if (runs != 1) return;
    snprintf(p, sizeof p, "%s/meta.yaml", run);
    text = read_text(p);
    CHECKF(text && strstr(text, "status: 3\n") && strstr(text, "run_name: '01-single-gpu mlp'\n") && strstr(text, "end_time: 1"),
           "%s:\n%s", p, text ? text : "(none)");
    free(text);
    static const char *const files[4][2] = { { "params/model", "mlp" }, { "params/batch_size", "32" }, { "tags/stage", "01-single-gpu" },
                                             { "tags/mlflow.runName", "01-single-gpu mlp" } };
    for (int k = 0; k < 4; k++) {
        snprintf(p, sizeof p, "%s/%s", run, files[k][0]);
        text = read_text(p);
        CHECKF(text && !strcmp(text, files[k][1]), "%s holds '%s', expected '%s'", p, text ? text : "(none)", files[k][1]);
        free(text);
    }
    double loss[6];
    CHECK(log_series(log, "loss", loss, 6) == 4);
    for (int resumed = 0; resumed < 2; resumed++) {
        if (resumed) {
            st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 6 --mlflow %s --log %s "
                         "--resume %s/mlp_data0-320_step4", train_cpu, small_data(), dir, log, ck);
            CHECKF(st == 0, "--mlflow --resume: exit %d\n%s", st, out);
            CHECK(log_series(log, "loss", loss, 6) == 6);
        }
        snprintf(p, sizeof p, "%s/metrics/loss", run);
        FILE *f = fopen(p, "r");
        long long ms, step;
        double v;
        int n = 0;
        while (f && fscanf(f, "%lld %lf %lld", &ms, &v, &step) == 3) {
            n++;
            CHECKF(step == n && ms > 1700000000000LL && fabs(v - loss[n - 1]) <= 1e-6 * fabs(loss[n - 1]),
                   "%s line %d: %lld %.9g %lld (--log: step %d, loss %.9g)", p, n, ms, v, step, n, loss[n - 1]);
        }
        if (f) fclose(f);
        CHECKF(n == (resumed ? 6 : 4), "%s: %d points after %s", p, n, resumed ? "resuming to step 6" : "4 steps");
    }
    runs = 0;
    snprintf(p, sizeof p, "%s/1", dir);
    d = opendir(p);
    for (struct dirent *e; d && (e = readdir(d));) runs += strlen(e->d_name) == 32;
    if (d) closedir(d);
    CHECKF(runs == 1, "the resumed run made %d runs (it goes on in the one it was part of)", runs);
    /* an experiment "dtrain" that MLflow made (an id of 18 random digits) is the one a run joins */
    char theirs[700], exp[800];
    snprintf(theirs, sizeof theirs, "%s/mlruns-theirs", tmpdir);
    snprintf(exp, sizeof exp, "%s/523940861947208175", theirs);
    CHECK(dt__mkdirs(exp));
    snprintf(p, sizeof p, "%s/meta.yaml", exp);
    const char *meta = "artifact_location: file:///x\nexperiment_id: '523940861947208175'\nlifecycle_stage: active\nname: dtrain\n";
    write_bytes(p, meta, strlen(meta));
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 1 --mlflow %s", train_cpu, small_data(), theirs);
    CHECKF(st == 0, "--mlflow into MLflow's own experiment: exit %d\n%s", st, out);
    runs = 0;
    d = opendir(exp);
    for (struct dirent *e; d && (e = readdir(d));) runs += strlen(e->d_name) == 32;
    if (d) closedir(d);
    snprintf(p, sizeof p, "%s/523940861947208176", theirs);
    CHECKF(runs == 1 && access(p, F_OK) != 0, "the run did not join the experiment 'dtrain' MLflow made (%d runs in it)", runs);
    char bad[700];
    snprintf(bad, sizeof bad, "%s/ml-blocker", tmpdir);
    write_bytes(bad, "x", 1);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --mlflow %s/sub", train_cpu, small_data(), bad);
    CHECKF(st != 0 && strstr(out, "--mlflow") && strstr(out, bad), "--mlflow under a file: exit %d\n%s", st, out);
}

/* MLflow's own tracking client (tests/mlflow_read.py; .ci/run puts mlflow
   in build/trackvenv) reads the runs of two stages written to one folder:
   each with its name, FINISHED, its flags and stage, and every loss --log
   has, step by step. */
TEST(mlflow_reads_the_runs_dtrain_wrote, FULL) {
    char out[16384], dir[600], log[2][600];
    const char *py = tracking_python();
    if (run_cmd(out, sizeof out, "%s -c 'import mlflow'", py) != 0)
        SKIP("%.90s cannot import mlflow; bash .ci/run puts it in build/trackvenv", py);
    snprintf(dir, sizeof dir, "%s/mlruns-two", tmpdir);
    static const char *const stages[2] = { "01-single-gpu", "03-ddp" };
    for (int k = 0; k < 2; k++) {
        snprintf(log[k], sizeof log[k], "%s/mlflow-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 5 %s --mlflow %s --log %s",
                         stage_bin(stages[k]), small_data(), k ? "--nproc 2" : "", dir, log[k]);
        CHECKF(st == 0, "%s --mlflow: exit %d\n%s", stages[k], st, out);
    }
    static char text[65536];
    int st = run_cmd(text, sizeof text, "%s %s/tests/mlflow_read.py %s", py, repo_root(), dir);
    CHECKF(st == 0, "tests/mlflow_read.py: exit %d\n%s", st, text);
    if (st) return;
    int k = -1, seen[2] = { 0, 0 }, named[2] = { 0, 0 };
    double loss[2][5];
    for (int j = 0; j < 2; j++) CHECK(log_series(log[j], "loss", loss[j], 5) == 5);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char a[64], b[128], c[128];
        double v;
        if (sscanf(line, "run %63s %127s %127s", a, b, c) == 3) {
            k++;
            CHECKF(k < 2 && !strcmp(c, "FINISHED") && !strncmp(b, stages[k < 2 ? k : 1], 5), "run %d: %s", k, line);
        } else if (k >= 0 && k < 2 && sscanf(line, "tag stage %127s", b) == 1) named[k] += !strcmp(b, stages[k]);
        else if (k >= 0 && k < 2 && sscanf(line, "param world_size %127s", b) == 1) named[k] += atoi(b) == (k ? 2 : 1);
        else if (k >= 0 && k < 2 && sscanf(line, "metric loss %127s %lf", b, &v) == 2) {
            int step = atoi(b);
            CHECKF(step >= 1 && step <= 5 && fabs(v - loss[k][step - 1]) <= 1e-6 * fabs(loss[k][step - 1]),
                   "%s: loss %.9g at step %d, --log %.9g", stages[k], v, step, step >= 1 && step <= 5 ? loss[k][step - 1] : 0);
            seen[k]++;
        }
    }
    CHECKF(k == 1 && seen[0] == 5 && seen[1] == 5 && named[0] == 2 && named[1] == 2,
           "MLflow read %d runs, %d and %d losses, %d and %d of stage and world size (2 runs, 5 losses, 2 each expected)\n%s", k + 1,
           seen[0], seen[1], named[0], named[1], text);
}

/* The hardware's own figures at each progress line (--log-every 2: steps 1,
   2, 4 and 6), in --log and as MLflow's system/ metrics (the file store
   keeps a key with a slash in a folder, as MLflow does): the process's
   resident memory (more than a megabyte, less than a terabyte) and its CPU
   time (growing); none at the steps between. */
TEST(hardware_figures_come_with_each_progress_line, QUICK) {
    char out[16384], log[600], dir[600], p[1000];
    snprintf(log, sizeof log, "%s/hw.jsonl", tmpdir);
    snprintf(dir, sizeof dir, "%s/hw-mlruns", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 6 --log-every 2 --log %s --mlflow %s", train_cpu,
                     small_data(), log, dir);
    CHECKF(st == 0, "exit %d\n%s", st, out);
    int64_t steps[16], cs[16];
    double rss[16], cpu[16];
    int n = log_points(log, "rss_bytes", steps, rss, 16), m = log_points(log, "cpu_s", cs, cpu, 16);
    CHECKF(n == 4 && m == 4 && steps[0] == 1 && steps[1] == 2 && steps[2] == 4 && steps[3] == 6 && cs[3] == 6,
           "rss_bytes at %d steps, cpu_s at %d (steps 1, 2, 4, 6 expected)", n, m);
    for (int i = 0; i < n && i < m; i++)
        CHECKF(rss[i] > 1e6 && rss[i] < 1e12 && cpu[i] > 0 && (i == 0 || cpu[i] >= cpu[i - 1]), "step %lld: rss %.0f bytes, cpu %.3f s",
               (long long)steps[i], rss[i], cpu[i]);
    /* the same in MLflow, in megabytes */
    char exp[700], run[960] = "";
    snprintf(exp, sizeof exp, "%s/1", dir);
    DIR *d = opendir(exp);
    for (struct dirent *e; d && (e = readdir(d));)
        if (strlen(e->d_name) == 32) snprintf(run, sizeof run, "%s/%s", exp, e->d_name);
    if (d) closedir(d);
    snprintf(p, sizeof p, "%s/metrics/system/rss_mb", run);
    FILE *f = fopen(p, "r");
    long long ms, step;
    double v;
    int k = 0;
    while (f && k < n && fscanf(f, "%lld %lf %lld", &ms, &v, &step) == 3) {
        CHECKF(step == steps[k] && fabs(v - rss[k] / 1e6) <= 1e-6 * v, "%s line %d: %.9g MB at step %lld, --log %.0f bytes at %lld", p, k + 1,
               v, step, rss[k], (long long)steps[k]);
        k++;
    }
    if (f) fclose(f);
    CHECKF(k == n, "%s: %d points, --log has %d", p, k, n);
}

/* --mlflow http://HOST:PORT with no server there (or a build without
   libcurl) is an error naming the flag and the address, before training. */
TEST(mlflow_server_that_cannot_be_reached_is_an_error_before_training, QUICK) {
    char out[16384], url[64];
    int port = free_port();
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 2 --mlflow %s", train_cpu, small_data(), url);
#ifdef DT_HAVE_CURL
    CHECKF(st == 1 && strstr(out, "cannot reach --mlflow") && strstr(out, url) && !strstr(out, "done:"),
           "--mlflow %s (nothing listening): exit %d\n%s", url, st, out);
#else
    CHECKF(st == 1 && strstr(out, "--mlflow") && strstr(out, "libcurl") && !strstr(out, "done:"),
           "--mlflow %s in a build without libcurl: exit %d\n%s", url, st, out);
#endif
}

#ifdef DT_HAVE_CURL                /* the server's test needs it, and only a build with libcurl runs that */
/* A real `mlflow server` (SQLite behind it; .ci/run installs MLflow in
   build/trackvenv) on a free port, its pid; 0 when it did not come up. */
static int mlflow_server_start(const char *py, const char *dir, int port, char *why, size_t n) {
    char out[4096], cwd[1024] = "", mlflow[2000] = "mlflow";
    if (strchr(py, '/')) {                      /* the command beside that python (a venv's) */
        if (py[0] != '/' && !getcwd(cwd, sizeof cwd)) cwd[0] = 0;
        snprintf(mlflow, sizeof mlflow, "%s%s%.900s", cwd, cwd[0] ? "/" : "", py);
        strcpy(strrchr(mlflow, '/') + 1, "mlflow");
    }
    if (run_cmd(out, sizeof out, "mkdir -p %s && cd %s && { %s server --backend-store-uri sqlite:///%s/mlflow.db --default-artifact-root "
                "%s/artifacts --host 127.0.0.1 --port %d --workers 1 > %s/server.log 2>&1 & echo $!; }", dir, dir, mlflow, dir, dir,
                port, dir) != 0)
        return snprintf(why, n, "could not start %.300s server: %.1000s", mlflow, out), 0;
    int pid = atoi(out);
    for (int i = 0; i < 1200; i++) {           /* up to 60 s: it makes its database first */
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = { 0 };
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int up = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
        if (fd >= 0) close(fd);
        if (up) return pid;
        if (kill(pid, 0) != 0) break;
        struct timespec ts = { 0, 50000000L };
        nanosleep(&ts, NULL);
    }
    char log[1000];
    snprintf(log, sizeof log, "%s/server.log", dir);
    char *text = read_text(log);
    snprintf(why, n, "%.300s server did not come up on port %d: %.1000s", mlflow, port, text ? text : "(no log)");
    free(text);
    kill(pid, SIGTERM);
    return 0;
}
#endif

/* --mlflow http://127.0.0.1:PORT against a real `mlflow server`: MLflow's own
   client reads back one run -- the first 4 steps, then the same run resumed
   from its checkpoint to step 6 (RUNNING again, then FINISHED) -- with its
   params and tags, and every point of every figure --log has, step by step, within
   --log's printed digits. Then the server is stopped while a run goes on:
   a warning, the training finishes (exit 0, every step in --log), and what
   could not be sent is counted at the end. */
TEST(mlflow_server_takes_the_run_live_through_its_rest_api, FULL) {
#ifndef DT_HAVE_CURL
    SKIP("a build without libcurl: --mlflow takes a folder only");
#else
    char out[16384], dir[600], why[4096], url[64], log[700], ck[700];
    const char *py = tracking_python();
    if (run_cmd(out, sizeof out, "%s -c 'import mlflow, flask, sqlalchemy'", py) != 0)
        SKIP("%.90s cannot import the whole of mlflow (a server needs flask and sqlalchemy); bash .ci/run puts it in build/trackvenv", py);
    snprintf(dir, sizeof dir, "%s/mlflow-server", tmpdir);
    int port = free_port(), pid = mlflow_server_start(py, dir, port, why, sizeof why);
    CHECKF(pid > 0, "%s", why);
    if (!pid) return;
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    snprintf(log, sizeof log, "%s/run.jsonl", dir);
    snprintf(ck, sizeof ck, "%s/ck", dir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 4 --mlflow %s/ --log %s --save-dir %s", train_cpu,
                     small_data(), url, log, ck);
    CHECKF(st == 0 && !strstr(out, "warning"), "--mlflow %s: exit %d\n%s", url, st, out);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 6 --mlflow %s --log %s --resume %s/mlp_data0-320_step4",
                 train_cpu, small_data(), url, log, ck);
    /* the resumed part's --steps differs, and MLflow's params do not change: said, not an error */
    CHECKF(st == 0 && strstr(out, "warning: --mlflow: the run continued has steps = 4"), "--mlflow %s --resume: exit %d\n%s", url, st, out);
    static char text[262144];
    st = run_cmd(text, sizeof text, "%s %s/tests/mlflow_read.py %s", py, repo_root(), url);
    CHECKF(st == 0, "tests/mlflow_read.py %s: exit %d\n%s", url, st, text);
    int runs = 0, params = 0, finished = 0, tags = 0;
    static const char *const want[][2] = { { "model", "mlp" }, { "batch_size", "32" }, { "steps", "4" }, { "world_size", "1" },
                                           { "lr", "0.001" }, { "optimizer", "adamw" }, { "seed", "1" } };
    enum { MAX = 4096 };
    static char keys[MAX][64];
    static int64_t steps[MAX];
    static double values[MAX];
    int points = 0;
    long long step;
    for (char *line = strtok(st == 0 ? text : NULL, "\n"); line; line = strtok(NULL, "\n")) {
        char a[128], b[128], c[128];
        if (sscanf(line, "run %127s %127s %127s", a, b, c) == 3) { runs++; finished += !strcmp(c, "FINISHED"); }
        else if (sscanf(line, "tag %127s %127s", a, b) == 2)
            tags += (!strcmp(a, "stage") && !strcmp(b, "01-single-gpu")) + (!strcmp(a, "mlflow.runName") && !strcmp(b, "01-single-gpu_mlp")) +
                    (!strcmp(a, "device") && !strcmp(b, "cpu"));
        else if (sscanf(line, "param %127s %127s", a, b) == 2) {
            for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
                if (!strcmp(a, want[k][0])) { CHECKF(!strcmp(b, want[k][1]), "param %s is %s, expected %s", a, b, want[k][1]); params++; }
        } else if (points < MAX && sscanf(line, "metric %63s %lld %lf", keys[points], &step, &values[points]) == 3)
            steps[points++] = step;
    }
    CHECKF(runs == 1 && finished == 1, "%d runs (%d FINISHED): the run and its resumed part are one run, finished", runs, finished);
    CHECKF(params == (int)(sizeof want / sizeof want[0]), "%d of the %d params looked for", params, (int)(sizeof want / sizeof want[0]));
    CHECKF(tags == 3, "%d of the tags stage, mlflow.runName and device with their values", tags);
    /* each figure of --log, as MLflow names it and with the digits --log prints */
    static const struct { const char *log, *mlflow; double scale, rel, abs; } figures[] = {
        { "loss", "loss", 1, 1e-7, 0 }, { "lr", "lr", 1, 1e-5, 0 }, { "grad_norm", "grad_norm", 1, 1e-4, 0 },
        { "step_ms", "step_ms", 1, 0, 6e-4 }, { "samples_per_s", "samples_per_s", 1, 0, 0.06 },
        { "mem_bytes", "memory_mb", 1e-6, 1e-9, 0 }, { "eval_loss", "eval_loss", 1, 0, 6e-7 }, { "eval_acc", "eval_accuracy", 1, 0, 6e-7 },
        { "rss_bytes", "system/rss_mb", 1e-6, 1e-9, 0 }, { "cpu_s", "system/cpu_s", 1, 0, 6e-4 } };
    int64_t ls[64];
    double lv[64];
    for (size_t f = 0; f < sizeof figures / sizeof figures[0]; f++) {
        int n = log_points(log, figures[f].log, ls, lv, 64), theirs = 0, matched = 0;
        for (int i = 0; i < points; i++) theirs += !strcmp(keys[i], figures[f].mlflow);
        for (int k = 0; k < n; k++)
            for (int i = 0; i < points; i++)
                if (!strcmp(keys[i], figures[f].mlflow) && steps[i] == ls[k]) {
                    double v = lv[k] * figures[f].scale;
                    CHECKF(fabs(values[i] - v) <= figures[f].rel * fabs(v) + figures[f].abs, "%s at step %lld: MLflow %.17g, --log %.17g",
                           figures[f].mlflow, (long long)ls[k], values[i], v);
                    matched++;
                    break;
                }
        /* evaluations: at steps 4 and 6; the hardware's: at each progress line (--log-every 1000: the first step's) */
        int expect = !strncmp(figures[f].log, "eval", 4) ? 2 : !strncmp(figures[f].mlflow, "system/", 7) ? 1 : 6;
        CHECKF(n == expect && matched == n && theirs == n, "%s: --log has %d points (%d expected), MLflow %d, %d of them at --log's steps",
               figures[f].mlflow, n, expect, theirs, matched);
    }
    /* the server goes away after 20 of 40 steps of 100 ms (2 s: the sender has sent a batch a second), however
       long the run took to start: some of the run was sent, the rest is counted */
    snprintf(log, sizeof log, "%s/gone.jsonl", dir);
    double t0 = dt_now_ms();
    st = run_cmd(out, sizeof out, "sh -c '(i=0; while [ $(cat %s 2>/dev/null | grep -c lr) -lt 20 ] && [ $i -lt 600 ]; do sleep 0.1; "
                 "i=$((i+1)); done; kill %d) & DT_TEST_STEP_SLEEP_MS=100 %s --data %s " SMALL_FLAGS " --epochs 4 --mlflow %s --log %s'",
                 log, pid, train_cpu, small_data(), url, log);
    double took_ms = dt_now_ms() - t0, loss[50];
    const char *count = strstr(out, "warning: --mlflow: ");
    long long lost = 0, all = 0;
    while (count && sscanf(count, "warning: --mlflow: %lld of the run's %lld records", &lost, &all) != 2) count = strstr(count + 1, "warning: --mlflow: ");
    CHECKF(st == 0 && strstr(out, "warning: --mlflow: the server at") && lost > 0 && lost < all &&
           log_series(log, "loss", loss, 50) == 40 && strstr(out, "done: 40 steps"),
           "the server stopped mid-run: exit %d after %.1f s, %lld of %lld records lost, %d steps in --log\n%s", st, took_ms / 1e3,
           lost, all, log_series(log, "loss", loss, 50), out);
    kill(pid, SIGKILL);
#endif
}

/* tools/trace-summary on the two traces of a 2-rank stage 03 run: rank 0's
   communication and the part of it hidden under compute, as it works them
   out from the trace (the all-reduces' overlap with forward, backward and
   the optimizer), agree with what the run's --log summed (comm_ms,
   comm_hidden_ms) -- within half of the table's 0.1 ms unit, plus 0.01 ms
   and 0.1% for the trace's 0.1 us rounding of each event's start and length.
   Both measure the hidden part up to the same clock read (the end of the
   backward span): a rank paused between backward and its wait (a loaded
   machine) once made the log count 2.8 ms more than the trace. It names the
   straggler; a damaged trace is an error naming the file and the line. */
TEST(trace_summary_reports_the_overlap_the_log_measured, QUICK | ALONE) {
    char out[16384], trace[600], log[600], t0[700], t1[700];
    snprintf(trace, sizeof trace, "%s/ts.json", tmpdir);
    snprintf(log, sizeof log, "%s/ts.jsonl", tmpdir);
    snprintf(t0, sizeof t0, "%s/ts.rank0.json", tmpdir);
    snprintf(t1, sizeof t1, "%s/ts.rank1.json", tmpdir);
    double comm[6], hidden[6], want_comm = 0, want_hidden = 0;
    /* A machine busy with other work may starve the communication thread
       until backward is over: then nothing was hidden and there is nothing
       to compare, so such a run is made again (3 tries). */
    for (int attempt = 0; attempt < 3 && want_hidden == 0; attempt++) {
        int st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --batch-size 16 --quiet --epochs 1 --steps 6 --nproc 2 "
                         "--bucket-mb 1 --trace %s --log %s", stage_bin("03-ddp"), small_data(), trace, log);  /* 16 MB of grads */
        CHECKF(st == 0, "03 --trace: exit %d\n%s", st, out);
        st = run_cmd(out, sizeof out, "%s %s %s", build_path("tools/trace-summary"), t0, t1);
        CHECKF(st == 0, "tools/trace-summary: exit %d\n%s", st, out);
        CHECK(log_series(log, "comm_ms", comm, 6) == 6 && log_series(log, "comm_hidden_ms", hidden, 6) == 6);
        want_comm = want_hidden = 0;
        for (int i = 0; i < 6; i++) { want_comm += comm[i]; want_hidden += hidden[i]; }
    }
    const char *row = strstr(out, "\n0 ");
    double v[12] = { 0 };
    int got = row ? sscanf(row + 2, "%lf %lf %lf %lf %lf %lf %lf | %lf %lf %lf%% %lf", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                           &v[7], &v[8], &v[9], &v[10]) : 0;
    CHECKF(got == 11, "no row for rank 0:\n%s", out);
    CHECKF(want_comm > 0 && want_hidden > 0, "3 runs hid no communication (the last: comm %.3f ms, hidden %.3f ms): nothing to compare",
           want_comm, want_hidden);
    CHECKF(fabs(v[7] - want_comm) <= 0.05 + 0.01 + 1e-3 * want_comm && fabs(v[8] - want_hidden) <= 0.05 + 0.01 + 1e-3 * want_hidden,
           "trace-summary: comm %.2f ms, hidden %.2f ms; the log: %.3f and %.3f\n%s", v[7], v[8], want_comm, want_hidden, out);
    CHECKF(strstr(out, "straggler: rank "), "no straggler named:\n%s", out);
    char bad[700];
    snprintf(bad, sizeof bad, "%s/ts-bad.json", tmpdir);
    const char *cut = "[{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0}\n,{\"name\":\"forward\",\"ph\":\"X\",\"pid\":0,\"tid\":1,\"ts\":\n";
    write_bytes(bad, cut, strlen(cut));
    int st = run_cmd(out, sizeof out, "%s %s", build_path("tools/trace-summary"), bad);
    CHECKF(st == 1 && strstr(out, bad) && strstr(out, "line 2"), "a damaged trace: exit %d\n%s", st, out);
}

/* tools/plot: two runs' --log files (stage 01, and 03 with two ranks) as
   one SVG -- a polyline per run in each of the four panels (loss,
   evaluation loss, speed, memory), the loss's with a point per logged step,
   the legend naming each run -- and --time puts the training time on the x
   axis. A log with a line that is not JSON is an error naming the file and
   the line. */
TEST(plot_draws_each_run_in_each_panel, QUICK) {
    char out[16384], log[2][600], svg[600];
    static const char *const stages[2] = { "01-single-gpu", "03-ddp" };
    for (int k = 0; k < 2; k++) {
        snprintf(log[k], sizeof log[k], "%s/plot-%d.jsonl", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --steps 7 %s --log %s", stage_bin(stages[k]),
                         small_data(), k ? "--nproc 2 --batch-size 16" : "", log[k]);
        CHECKF(st == 0, "%s: exit %d\n%s", stages[k], st, out);
    }
    for (int by_time = 0; by_time < 2; by_time++) {
        snprintf(svg, sizeof svg, "%s/plot-%d.svg", tmpdir, by_time);
        int st = run_cmd(out, sizeof out, "%s --out %s %s %s=01 %s=03-ddp", build_path("tools/plot"), svg, by_time ? "--time" : "",
                         log[0], log[1]);
        CHECKF(st == 0 && strstr(out, "01 (7 steps), 03-ddp (7 steps)"), "tools/plot: exit %d\n%s", st, out);
        char *text = read_text(svg);
        CHECKF(text != NULL, "no %s", svg);
        if (!text) return;
        int lines = 0, points[8] = { 0 };
        for (const char *p = strstr(text, "<polyline"); p; p = strstr(p + 1, "<polyline")) {
            const char *pts = strstr(p, "points='"), *end = pts ? strchr(pts + 8, '\'') : NULL;
            if (lines < 8 && end)
                for (const char *c = pts + 8; c < end; c++) points[lines] += *c == ',';
            lines++;
        }
        CHECKF(lines == 8 && points[0] == 7 && points[1] == 7 && points[2] == 1 && points[3] == 1 && points[4] == 7 && points[6] == 7,
               "%s: %d polylines, points %d %d %d %d %d %d (8 lines; 7 per run for loss, speed and memory, 1 evaluation each)", svg,
               lines, points[0], points[1], points[2], points[3], points[4], points[6]);
        CHECKF(strstr(text, ">01</text>") && strstr(text, ">03-ddp</text>") && strstr(text, by_time ? "training time (s)" : ">step</text>"),
               "%s: the legend or the x axis is missing", svg);
        free(text);
    }
    char bad[700];
    snprintf(bad, sizeof bad, "%s/plot-bad.jsonl", tmpdir);
    const char *text = "{\"step\":1,\"loss\":2.5,\"samples_per_s\":10}\nnot json\n";
    write_bytes(bad, text, strlen(text));
    int st = run_cmd(out, sizeof out, "%s --out %s/plot-bad.svg %s", build_path("tools/plot"), tmpdir, bad);
    CHECKF(st == 1 && strstr(out, bad) && strstr(out, "line 2"), "tools/plot on a damaged log: exit %d\n%s", st, out);
}
