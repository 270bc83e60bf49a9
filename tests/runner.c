/* tests/runner.c -- the test runner (tests/runner.h says what it does and
   how a test is defined): the registry, the running test's state, and the
   run -- one of each for the whole program, whichever file a test is in. */
#define _POSIX_C_SOURCE 200809L          /* as dtrain.h's implementation: mkdtemp, strsignal, sigaction */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "runner.h"

int t_failed, t_skipped;                 /* the running test's state: CHECK and SKIP set them */
char t_skip_reason[320];
char tmpdir[256];                        /* the running test's own folder, removed after a pass */
char t_shared_dir[64];                   /* the run's folder, for what several tests read (t_shared_file) */

typedef struct { const char *name; void (*fn)(void); const char *file; int line, flags; } t_case;
static t_case t_cases[T_MAX_TESTS];
static int t_ncases;

void t_register(const char *name, void (*fn)(void), const char *file, int line, int flags) {
    if (t_ncases == T_MAX_TESTS) {
        fprintf(stderr, "tests/runner.c: more than %d tests (raise T_MAX_TESTS)\n", T_MAX_TESTS);
        exit(2);
    }
    if ((flags & (QUICK | FULL)) == 0 || (flags & (QUICK | FULL)) == (QUICK | FULL)) {
        fprintf(stderr, "%s:%d: test %s must be in one suite, QUICK or FULL\n", file, line, name);
        exit(2);
    }
    t_case c = { name, fn, file, line, flags };
    t_cases[t_ncases++] = c;
}

/* ---- files several tests share ------------------------------------------------ */

/* A file or folder that several tests read (a synthetic data set, a
   checkpoint), made once per run by the first test that asks, in the run's
   folder: tests run at once, so the maker holds a lock, and the others wait
   for it and find it made. `make` writes `path`; NULL when it failed. */
const char *t_shared_file(char *path, size_t n, const char *name, int (*make)(const char *path)) {
    char lock[700], ready[700];
    snprintf(path, n, "%s/%s", t_shared_dir, name);
    snprintf(lock, sizeof lock, "%s/.%s.lock", t_shared_dir, name);
    snprintf(ready, sizeof ready, "%s/.%s.ready", t_shared_dir, name);
    int fd = open(lock, O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0 || flock(fd, LOCK_EX) != 0) {
        printf("    cannot lock %s: %s\n", lock, strerror(errno));
        exit(1);
    }
    int ok = access(ready, F_OK) == 0;
    if (!ok && make(path)) {
        FILE *f = fopen(ready, "w");
        ok = f != NULL;
        if (f) fclose(f);
    }
    flock(fd, LOCK_UN);
    close(fd);
    return ok ? path : NULL;
}

/* ---- the run ------------------------------------------------------------------- */

static double t_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* By file name (tests/NN-name.c: chapter by chapter), then line. */
static const char *t_base(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}
static int t_order(const void *a, const void *b) {
    const t_case *x = (const t_case *)a, *y = (const t_case *)b;
    int c = strcmp(t_base(x->file), t_base(y->file));
    return c ? c : x->line - y->line;
}

static const char *t_suite_name(int flags) { return flags & QUICK ? "quick" : "full"; }

/* Is test c chosen: its suite (QUICK, FULL or both), and the filter in its name. */
static int t_chosen(const t_case *c, int suites, const char *filter) {
    return (c->flags & suites) && (!filter || strstr(c->name, filter));
}

typedef struct { int index; pid_t pid; double start, last_note; } t_running;
static volatile sig_atomic_t t_interrupted;
static void t_on_signal(int sig) { t_interrupted = sig; }

/* The child: its own process group (so that a hang can be killed whole), its
   own folder, its output into a file; the exit status says how it went. */
static void t_child(const t_case *c, const char *out_path, const char *why_path, int beside_others) {
    setpgid(0, 0);
    /* Tests side by side share the cores: OpenMP's waiting threads then sleep
       rather than spin (a spinning team holds a core the other test's ranks
       need: the quick suite took 121 s at -j 2 with spinning, 88 s without,
       124 s at -j 1). Results do not change; a test run ALONE keeps the default. */
    if (beside_others && !getenv("OMP_WAIT_POLICY")) setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(1);
    close(fd);
    setvbuf(stdout, NULL, _IOLBF, 0);
    snprintf(tmpdir, sizeof tmpdir, "%s/%s", t_shared_dir, c->name);
    if (mkdir(tmpdir, 0755) != 0) {
        printf("    cannot create %s: %s\n", tmpdir, strerror(errno));
        exit(1);
    }
    t_failed = t_skipped = 0;
    c->fn();
    if (t_skipped) {
        FILE *f = fopen(why_path, "w");
        if (f) { fputs(t_skip_reason, f); fclose(f); }
        exit(77);
    }
    exit(t_failed ? 1 : 0);
}

/* Print a finished test: its output, then one line with its result and
   where the run is. Returns 1 passed, 0 failed, -1 skipped. */
static int t_report(const t_case *c, int status, double secs, int timed_out, int done, int total, double run_start) {
    char out_path[700], why_path[700], why[320] = "";
    snprintf(out_path, sizeof out_path, "%s/.%s.out", t_shared_dir, c->name);
    snprintf(why_path, sizeof why_path, "%s/.%s.why", t_shared_dir, c->name);
    FILE *f = fopen(out_path, "r");
    if (f) {
        char buf[4096];
        size_t got;
        while ((got = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, got, stdout);
        fclose(f);
    }
    int result;
    char where[64];
    int el = (int)(t_now_s() - run_start);
    snprintf(where, sizeof where, "[%d/%d, %d:%02d]", done, total, el / 60, el % 60);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
        f = fopen(why_path, "r");
        if (f) { if (!fgets(why, sizeof why, f)) why[0] = 0; fclose(f); }
        printf("SKIP %s (%s)  %s\n", c->name, why, where);
        result = -1;
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0 && !timed_out) {
        printf("PASS %s (%.1f s)  %s\n", c->name, secs, where);
        result = 1;
    } else {
        if (timed_out) printf("    no end after %.0f s: its processes were killed\n", secs);
        else if (WIFSIGNALED(status)) printf("    the test's process died of signal %d (%s)\n", WTERMSIG(status), strsignal(WTERMSIG(status)));
        else if (WEXITSTATUS(status) != 1) printf("    the test's process exited with status %d\n", WEXITSTATUS(status));
        printf("FAIL %s (%.1f s; its files are in %s/%s)  %s\n", c->name, secs, t_shared_dir, c->name, where);
        result = 0;
    }
    fflush(stdout);
    if (result != 0) {                            /* a failure's folder stays, to look into */
        char cmd[800];
        snprintf(cmd, sizeof cmd, "rm -rf '%s/%s'", t_shared_dir, c->name);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s/%s\n", t_shared_dir, c->name);
    }
    return result;
}

/* Run the chosen tests, `jobs` at a time; ALONE ones first, each by itself.
   Returns the exit status: 0 when none failed. */
static int t_run_all(const int *chosen, int n, int jobs, double timeout_s) {
    t_running run[64];
    int running = 0, next_alone = 0, next_shared = 0, done = 0, passed = 0, failed = 0, skipped = 0;
    int *alone = (int *)malloc(sizeof(int) * (size_t)(n + 1)), *shared = (int *)malloc(sizeof(int) * (size_t)(n + 1));
    int n_alone = 0, n_shared = 0;
    for (int i = 0; i < n; i++) {
        if (t_cases[chosen[i]].flags & ALONE) alone[n_alone++] = chosen[i];
        else shared[n_shared++] = chosen[i];
    }
    if (jobs > 64) jobs = 64;
    const char *failures[T_MAX_TESTS];
    double run_start = t_now_s();
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = t_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    while ((next_alone < n_alone || next_shared < n_shared || running) && !t_interrupted) {
        /* start what may start: an ALONE test only on an idle machine, and nothing beside it */
        while (!t_interrupted) {
            int idx = -1;
            if (next_alone < n_alone) { if (running == 0) idx = alone[next_alone++]; }
            else if (next_shared < n_shared && running < jobs) idx = shared[next_shared++];
            if (idx < 0) break;
            char out_path[700], why_path[700];
            snprintf(out_path, sizeof out_path, "%s/.%s.out", t_shared_dir, t_cases[idx].name);
            snprintf(why_path, sizeof why_path, "%s/.%s.why", t_shared_dir, t_cases[idx].name);
            fflush(NULL);
            pid_t pid = fork();
            if (pid < 0) { perror("test_dtrain: fork"); exit(1); }
            if (pid == 0) t_child(&t_cases[idx], out_path, why_path, jobs > 1 && !(t_cases[idx].flags & ALONE));
            setpgid(pid, pid);                    /* also here: no race with the child's own call */
            t_running r = { idx, pid, t_now_s(), t_now_s() };
            run[running++] = r;
            if (t_cases[idx].flags & ALONE) break;
        }
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid == 0 || (pid < 0 && errno == EINTR)) {
            double now = t_now_s();
            for (int k = 0; k < running; k++) {
                if (now - run[k].start > timeout_s) kill(-run[k].pid, SIGKILL);   /* reaped below as timed out */
                else if (now - run[k].last_note >= 60) {
                    printf("     ... %s still running (%.0f s)\n", t_cases[run[k].index].name, now - run[k].start);
                    fflush(stdout);
                    run[k].last_note = now;
                }
            }
            struct timespec ts = { 0, 20 * 1000000 };
            nanosleep(&ts, NULL);
            continue;
        }
        if (pid < 0) break;
        for (int k = 0; k < running; k++) {
            if (run[k].pid != pid) continue;
            double secs = t_now_s() - run[k].start;
            const t_case *c = &t_cases[run[k].index];
            kill(-pid, SIGKILL);                  /* what the test left running in its group */
            int r = t_report(c, status, secs, secs > timeout_s, ++done, n, run_start);
            if (r > 0) passed++;
            else if (r < 0) skipped++;
            else failures[failed++] = c->name;
            run[k] = run[--running];
            break;
        }
    }
    if (t_interrupted) {
        for (int k = 0; k < running; k++) kill(-run[k].pid, SIGKILL);
        while (running && waitpid(-1, NULL, 0) > 0) running--;
        printf("interrupted (signal %d) after %d of %d tests\n", (int)t_interrupted, done, n);
    }
    free(alone);
    free(shared);
    int el = (int)(t_now_s() - run_start);
    if (failed) {
        printf("failed:");
        for (int i = 0; i < failed; i++) printf(" %s", failures[i]);
        printf("\n");
    }
    printf("(%d:%02d with up to %d tests at once)\n", el / 60, el % 60, jobs);
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed || t_interrupted || done < n ? 1 : 0;
}

static const char *t_usage =
    "usage: %s [--suite quick|full|all] [-j N] [--timeout S] STAGE_BINARY [FILTER]\n"
    "       %s --list [--suite quick|full|all] [FILTER]\n"
    "  --suite    quick: make test's part (the default); full: make test-all's; all: both\n"
    "  FILTER     only the tests with FILTER in their name, of both parts unless --suite says\n"
    "  -j N       tests at once (default: one per core)\n"
    "  --timeout  a test still running after S seconds fails, its processes killed (default 900)\n";

/* Parse the runner's flags, choose the tests, run them. `setup` is handed the
   stage binary before any test runs (not for --list); non-zero stops the run. */
int t_main(int argc, char **argv, int (*setup)(const char *subject)) {
    int suites = 0, list = 0, jobs = (int)sysconf(_SC_NPROCESSORS_ONLN);
    double timeout_s = 900;
    const char *subject = NULL, *filter = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--list")) list = 1;
        else if (!strcmp(a, "--suite") && v) {
            suites = !strcmp(v, "quick") ? QUICK : !strcmp(v, "full") ? FULL : !strcmp(v, "all") ? QUICK | FULL : -1;
            if (suites < 0) { fprintf(stderr, "%s: --suite %s: quick, full or all\n", argv[0], v); return 2; }
            i++;
        } else if (!strcmp(a, "-j") && v) {
            char *end;
            long j = strtol(v, &end, 10);
            if (*end || j < 1 || j > 64) { fprintf(stderr, "%s: -j %s: a number of tests at once, 1 to 64\n", argv[0], v); return 2; }
            jobs = (int)j;
            i++;
        } else if (!strcmp(a, "--timeout") && v) {
            char *end;
            timeout_s = strtod(v, &end);
            if (*end || !(timeout_s > 0)) { fprintf(stderr, "%s: --timeout %s: seconds, more than 0\n", argv[0], v); return 2; }
            i++;
        } else if (!strcmp(a, "--help") || a[0] == '-') {
            fprintf(a[0] == '-' && strcmp(a, "--help") ? stderr : stdout, t_usage, argv[0], argv[0]);
            return strcmp(a, "--help") ? 2 : 0;
        } else if (!subject && !list) subject = a;
        else if (!filter) filter = a[0] ? a : NULL;
        else { fprintf(stderr, t_usage, argv[0], argv[0]); return 2; }
    }
    if (jobs < 1) jobs = 1;
    if (!suites) suites = filter ? QUICK | FULL : QUICK;
    qsort(t_cases, (size_t)t_ncases, sizeof t_cases[0], t_order);
    int *chosen = (int *)malloc(sizeof(int) * (size_t)(t_ncases + 1)), n = 0;
    for (int i = 0; i < t_ncases; i++)
        if (t_chosen(&t_cases[i], suites, filter)) chosen[n++] = i;
    if (!n) {
        if (filter)
            fprintf(stderr, "%s: no test name contains \"%s\" (%s --list names them all; make test T=PART runs those with PART in their name)\n",
                    argv[0], filter, argv[0]);
        else fprintf(stderr, "%s: no test in that suite\n", argv[0]);
        free(chosen);
        return 2;
    }
    if (list) {
        for (int i = 0; i < n; i++) printf("%s\n", t_cases[chosen[i]].name);
        free(chosen);
        return 0;
    }
    if (!subject) { fprintf(stderr, t_usage, argv[0], argv[0]); free(chosen); return 2; }
    snprintf(t_shared_dir, sizeof t_shared_dir, "/tmp/dtrain-test-XXXXXX");
    if (!mkdtemp(t_shared_dir)) { perror("test_dtrain: mkdtemp"); free(chosen); return 1; }
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (setup && setup(subject) != 0) { free(chosen); return 1; }
    printf("%d tests (%s%s%s%s), up to %d at once\n", n, suites == (QUICK | FULL) ? "both suites" : t_suite_name(suites),
           filter ? ", with \"" : "", filter ? filter : "", filter ? "\" in their name" : "", jobs);
    int status = t_run_all(chosen, n, jobs, timeout_s);
    free(chosen);
    char cmd[700];
    DIR *d = opendir(t_shared_dir);            /* the run's folder goes unless a failed test's folder is in it */
    int keep = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[1100];
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s", t_shared_dir, e->d_name);
        if (e->d_name[0] != '.' && stat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
            for (int i = 0; i < t_ncases; i++) if (!strcmp(t_cases[i].name, e->d_name)) keep = 1;
    }
    if (d) closedir(d);
    if (!keep) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", t_shared_dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", t_shared_dir);
    }
    return status;
}
