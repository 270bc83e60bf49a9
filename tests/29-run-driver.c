/* tests/29-run-driver.c -- tests of dtrain.h's chapter 29-run-driver: a full
   disk, preemption, the final loss. (tests/helpers.h: how the suite's files
   make one program.) */
#include "helpers.h"

/* ---- the run driver: a full disk, preemption ---------------------------- */

/* /dev/full takes no write (ENOSPC): a full disk. Where the program picks the
   name itself (a checkpoint's .tmp, a rank's trace), a link of that name
   points there. */
#define FULL_DISK "No space left on device"
TEST(a_full_disk_under_log_trace_or_checkpoint_stops_the_run, QUICK) {
    char out[16384], dir[600], p[800], q[900];
    struct stat sb;
    if (stat("/dev/full", &sb) != 0 || !S_ISCHR(sb.st_mode)) SKIP("no /dev/full on this machine");
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --log /dev/full", train_cpu, small_data());
    expect_error(out, st, 1, "cannot write --log '/dev/full': " FULL_DISK);
    /* found when a write fails (the log at the evaluation's flush, the trace once
       stdio's 4 KB buffer fills), not only when the file is closed */
    CHECKF(!strstr(out, "done:"), "the run went on to its end after its log failed:\n%s", out);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 3 --trace /dev/full", train_cpu, small_data());
    expect_error(out, st, 1, "cannot write --trace '/dev/full': " FULL_DISK);
    CHECKF(!strstr(out, "done:"), "the run went on to its end after its trace failed:\n%s", out);
    /* one step: the log's only records are still in stdio's buffer when the run ends */
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --steps 1 --log /dev/full --trace /dev/full", train_cpu, small_data());
    expect_error(out, st, 1, "/dev/full': " FULL_DISK);

    snprintf(dir, sizeof dir, "%s/full-ckpt", tmpdir);
    dt__mkdir(dir);
    /* a crashed save's folder, its weights file a link to the full disk (plain files there would be cleared) */
    snprintf(p, sizeof p, "%s/mlp_data0-320_epoch1", dir);
    snprintf(q, sizeof q, "%s.tmp", p);
    dt__mkdir(q);
    snprintf(q, sizeof q, "%s.tmp/model.safetensors.tmp", p);
    CHECK(symlink("/dev/full", q) == 0);
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --save-dir %s", train_cpu, small_data(), dir);
    expect_error(out, st, 1, "mlp_data0-320_epoch1");
    CHECKF(strstr(out, FULL_DISK) != NULL, "the checkpoint's error does not say why:\n%s", out);
    CHECKF(lstat(q, &sb) != 0, "%s was left behind", q);
    snprintf(q, sizeof q, "%s.tmp", p);
    CHECKF(lstat(q, &sb) != 0, "%s was left behind", q);
    CHECKF(stat(p, &sb) != 0, "%s was written although its data was not", p);

    /* the synthetic set, made on first use in the current folder, one image of it on the full disk */
    snprintf(dir, sizeof dir, "%s/full-data", tmpdir);
    st = run_cmd(out, sizeof out, "sh -c 'mkdir -p %s/data/synthetic.partial/train/disk-warm && cd %s && "
                 "ln -s /dev/full data/synthetic.partial/train/disk-warm/00003.ppm && "
                 "ln -s /dev/full data/synthetic.partial/train/disk-warm/00003.png'", dir, dir);
    CHECKF(st == 0, "%s", out);
    char cwd[2048], bin[3000];
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    snprintf(bin, sizeof bin, "%s%s%s", train_cpu[0] == '/' ? "" : cwd, train_cpu[0] == '/' ? "" : "/", train_cpu);
    st = run_cmd(out, sizeof out, "sh -c 'cd %s && %s --steps 1 --quiet'", dir, bin);
    expect_error(out, st, 1, "disk-warm/00003.p");
    CHECKF(strstr(out, FULL_DISK) != NULL, "the image's error does not say why:\n%s", out);

    /* rank 1's trace on the full disk: rank 1 stops, and so does rank 0, soon, naming it */
    snprintf(dir, sizeof dir, "%s/full-trace", tmpdir);
    dt__mkdir(dir);
    snprintf(p, sizeof p, "%s/run.rank1.json", dir);
    CHECK(symlink("/dev/full", p) == 0);
    double t0 = dt_now_ms();
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --batch-size 16 --epochs 3 --nproc 2 --timeout 30 "
                 "--trace %s/run.json", stage_bin("03-ddp"), small_data(), dir);
    double s = (dt_now_ms() - t0) / 1e3;
    expect_error(out, st, 1, "cannot write --trace '");
    CHECKF(strstr(out, "dtrain[rank 1]: error: cannot write --trace '") && strstr(out, "run.rank1.json': " FULL_DISK),
           "rank 1 did not name its trace file:\n%s", out);
    CHECKF(strstr(out, "dtrain[rank 0]: error: rank 1 failed"), "rank 0 was not stopped in mid-run, naming rank 1:\n%s", out);
    CHECKF(s < 30, "the job took %.1f s to stop (--timeout 30): rank 0 waited for the rank that failed", s);
}

/* Preemption: SIGTERM reaches a 2-rank FSDP job in the middle of epoch 2 (step
   50 of 80; the test hook makes rank 0 send it to the launcher then). The ranks
   finish that step, save it together and exit 75; the same command run again
   (--resume auto) ends bit for bit where an uninterrupted run ends. */
TEST(sigterm_preempts_fsdp_and_resume_auto_ends_bit_for_bit, QUICK) {
    char out[16384], a[600], b[600], p[700], q[700], cmd[2400];
    const char *bin = stage_bin("04-fsdp");
    snprintf(a, sizeof a, "%s/preempt-straight", tmpdir);
    snprintf(b, sizeof b, "%s/preempt", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --batch-size 4 --nproc 2 --save-dir %s", bin, small_data(), a);
    CHECKF(st == 0, "straight run: exit %d\n%s", st, out);
    snprintf(cmd, sizeof cmd, "%s --data %s " PAR_FLAGS " --batch-size 4 --nproc 2 --save-dir %s --resume auto", bin, small_data(), b);
    st = run_cmd(out, sizeof out, "env DT_TEST_STOP_AT_STEP=50 %s", cmd);
    CHECKF(st == 75 && strstr(out, "stopped by SIGTERM after step 50 of 80"), "preempted run: exit %d\n%s", st, out);
    snprintf(p, sizeof p, "%s/mlp_data0-320_step50", b);
    CHECKF(access(p, F_OK) == 0, "no checkpoint of step 50 in %s", b);
    st = run_cmd(out, sizeof out, "ls -a %s", b);
    CHECKF(!strstr(out, ".tmp"), "a .tmp file was left:\n%s", out);
    st = run_cmd(out, sizeof out, "%s", cmd);
    CHECKF(st == 0, "resumed run: exit %d\n%s", st, out);
    for (int r = 0; r < 2; r++) {
        snprintf(p, sizeof p, "%s/mlp_data0-320_epoch2/shard%d-of-2.safetensors", a, r);
        snprintf(q, sizeof q, "%s/mlp_data0-320_epoch2/shard%d-of-2.safetensors", b, r);
        CHECKF(files_equal_tensors(p, q), "shard %d: preempted and resumed differs from the straight run", r);
    }
    /* --resume auto with an empty --save-dir starts fresh; without --save-dir it is a usage error */
    st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 1 --resume auto", train_cpu, small_data());
    expect_error(out, st, 2, "--resume auto");
}
/* The final loss is the last step's: the same weights gave 1.2998 run
   straight and 0.9273 stopped by SIGTERM and resumed, since it was the mean
   since the last progress line, which the clock decides (and --quiet never
   reset). Run straight, stopped and resumed, and resumed once more with
   nothing left to train: one final loss, in the log and on the screen. */
static void summary_final_loss(const char *log, char *out, size_t n) {
    char *text = read_text(log), *last = NULL;
    for (char *p = text; p && (p = strstr(p, "\"final_loss\":")); p++) last = p + 13;
    snprintf(out, n, "%.*s", last ? (int)strcspn(last, ",}") : 0, last ? last : "");
    free(text);
}
TEST(the_final_loss_is_the_last_steps_whether_or_not_the_run_was_stopped, QUICK) {
    char out[16384], a[600], b[600], la[700], lb[700], fa[64], fb[64], ka[64], kb[64], cmd[4000];
    snprintf(a, sizeof a, "%s/straight", tmpdir);
    snprintf(b, sizeof b, "%s/stopped", tmpdir);
    snprintf(la, sizeof la, "%s/straight.jsonl", tmpdir);
    snprintf(lb, sizeof lb, "%s/stopped.jsonl", tmpdir);
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --epochs 2 --save-dir %s --log %s", train_cpu, small_data(), a, la);
    CHECKF(st == 0, "straight run: exit %d\n%s", st, out);
    const char *line = strstr(out, "final loss ");
    snprintf(fa, sizeof fa, "%.*s", line ? (int)strcspn(line, ",") : 0, line ? line : "");
    snprintf(cmd, sizeof cmd, "%s --data %s " SMALL_FLAGS " --epochs 2 --save-dir %s --resume auto --log %s", train_cpu,
             small_data(), b, lb);
    st = run_cmd(out, sizeof out, "env DT_TEST_STOP_AT_STEP=7 %s", cmd);
    CHECKF(st == 75, "stopped at step 7: exit %d\n%s", st, out);
    for (int again = 0; again < 2; again++) {              /* resumed; then resumed with nothing left to train */
        st = run_cmd(out, sizeof out, "%s", cmd);
        CHECKF(st == 0, "resumed (%d): exit %d\n%s", again, st, out);
        line = strstr(out, "final loss ");
        snprintf(fb, sizeof fb, "%.*s", line ? (int)strcspn(line, ",") : 0, line ? line : "");
        CHECKF(fa[0] && !strcmp(fa, fb), "straight: '%s'; stopped and resumed%s: '%s'", fa, again ? " twice" : "", fb);
        summary_final_loss(la, ka, sizeof ka);
        summary_final_loss(lb, kb, sizeof kb);
        CHECKF(ka[0] && strcmp(ka, "null") && !strcmp(ka, kb), "the logs' final_loss: straight %s, stopped and resumed%s %s", ka,
               again ? " twice" : "", kb);
    }
}

/* --early-stop 3 --save-best: the run stops at the third evaluation in a row
   that did not beat the best (worked out here from --log's evaluations),
   the summary says so, and the best checkpoint, evaluated, gives the best
   loss --log has. Resumed, the early-stopped run has ended: no step more.
   Stopped between and resumed (--resume auto), the run keeps the best and
   the count, and stops at the same step with the same final loss: stopped by
   --steps off the evaluations' grid (its own last evaluation is reported, not
   counted), and by SIGTERM at a step whose evaluation was due (the resumed
   run makes it first). --save-best with nowhere to save is a usage error
   naming --save-dir. */
TEST(early_stop_and_save_best_follow_the_evaluations_and_resume_keeps_them, QUICK) {
    char out[16384], dir[600], log[700], flags[800];
    snprintf(dir, sizeof dir, "%s/es-a", tmpdir);
    snprintf(log, sizeof log, "%s/es-a.jsonl", tmpdir);
    snprintf(flags, sizeof flags, SMALL_FLAGS " --epochs 30 --lr 0.03 --eval-every 2 --early-stop 3 --data %s", small_data());
    int st = run_cmd(out, sizeof out, "%s %s --save-best --save-dir %s --log %s", train_cpu, flags, dir, log);
    CHECKF(st == 0, "--early-stop 3 --save-best: exit %d\n%s", st, out);
    int64_t steps[200];
    double loss[200], best = 0;
    int n = log_points(log, "eval_loss", steps, loss, 200), since = 0, between = -1;
    int64_t stop = -1, best_step = -1;
    for (int i = 0; i < n && stop < 0; i++) {
        if (best_step < 0 || loss[i] < best) { best = loss[i]; best_step = steps[i]; since = 0; }
        else if (++since == 3) stop = steps[i];
        else if (between < 0 && since == 1) between = i;   /* a place to stop and resume: one evaluation without improving */
    }
    char done[64], said[160];
    snprintf(done, sizeof done, "done: %lld steps", (long long)stop);
    snprintf(said, sizeof said, "early stop at step %lld: the evaluation loss has not improved for 3 evaluations (the best, %.4f, at step %lld)",
             (long long)stop, best, (long long)best_step);
    CHECKF(stop > 0 && stop < 300 && strstr(out, done) && strstr(out, said) && between >= 0,
           "--log's %d evaluations say stop at step %lld (best %.6f at %lld); the run:\n%s", n, (long long)stop, best, (long long)best_step, out);
    /* the best checkpoint, evaluated (resumed with no step left to take), scores the best loss */
    char best_log[700];
    snprintf(best_log, sizeof best_log, "%s/es-best.jsonl", tmpdir);
    st = run_cmd(out, sizeof out, "%s %s --resume %s/mlp_data0-320_best --steps %lld --log %s", train_cpu, flags, dir, (long long)best_step,
                 best_log);
    int64_t bs[4];
    double bl[4];
    CHECKF(st == 0 && log_points(best_log, "eval_loss", bs, bl, 4) == 1 && bs[0] == best_step && fabs(bl[0] - best) < 5e-7,
           "the best checkpoint (step %lld, eval loss %.6f in --log): exit %d\n%s", (long long)best_step, best, st, out);
    /* the early-stopped run, resumed, has ended */
    st = run_cmd(out, sizeof out, "%s %s --save-dir %s --resume auto", train_cpu, flags, dir);
    CHECKF(st == 0 && strstr(out, done) && strstr(out, said), "the early-stopped run resumed: exit %d, it should take no step\n%s", st, out);
    /* stopped between, two ways, then resumed: the same stop, the same final loss */
    char whole[64];
    summary_final_loss(log, whole, sizeof whole);
    for (int how = 0; how < 2; how++) {
        char resumed[64], resumed_log[700], first[200];
        snprintf(dir, sizeof dir, "%s/es-b%d", tmpdir, how);
        snprintf(resumed_log, sizeof resumed_log, "%s/es-b%d.jsonl", tmpdir, how);
        if (how == 0) snprintf(first, sizeof first, "--steps %lld", (long long)steps[between] + 1);   /* odd: off the grid of 2 */
        else first[0] = 0;
        st = run_cmd(out, sizeof out, "%s%lld %s %s --save-dir %s %s", how ? "env DT_TEST_STOP_AT_STEP=" : "env X=",
                     (long long)steps[between], train_cpu, flags, dir, first);
        CHECKF(how ? st == 75 : st == 0, "stopped at step %lld (%s): exit %d\n%s", (long long)steps[between] + !how,
               how ? "SIGTERM" : "--steps", st, out);
        st = run_cmd(out, sizeof out, "%s %s --save-dir %s --resume auto --log %s", train_cpu, flags, dir, resumed_log);
        summary_final_loss(resumed_log, resumed, sizeof resumed);
        CHECKF(st == 0 && strstr(out, done) && strstr(out, said) && whole[0] && !strcmp(whole, resumed),
               "stopped at step %lld by %s and resumed: it should stop as the whole run did (final loss %s, resumed %s)\n%s",
               (long long)steps[between] + !how, how ? "SIGTERM" : "--steps", whole, resumed, out);
    }
    st = run_cmd(out, sizeof out, "%s %s --save-best", train_cpu, flags);
    CHECKF(st == 2 && strstr(out, "--save-best") && strstr(out, "--save-dir"), "--save-best without --save-dir: exit %d\n%s", st, out);
}
