/* tests/runner.h -- the test runner: tests that register themselves, two
   suites, each test in a process of its own, several at once.

   A test is defined once, where it is, with the suite it belongs to:

       TEST(gemm_matches_reference, QUICK) { ... CHECK(...); ... }
       TEST(gpt_beats_the_unigram_baseline_on_text, FULL) { ... }
       TEST(a_killed_rank_stops_the_others_with_its_name, QUICK | ALONE) { ... }

   QUICK is `make test` (what a student runs, within 3 minutes on 2 cores,
   build included), FULL is `make test-all` (the rest; CI runs both). ALONE:
   nothing else runs beside it -- it counts what every process leaves in
   /dev/shm, or it needs the cores to itself to measure what it measures.
   The tests are in files that follow dtrain.h's chapters, tests/NN-name.c
   (tests/helpers.h says how they are put together). There is no list to
   keep: the Makefile compiles every tests/[0-9][0-9]-*.c it finds, each TEST
   registers itself before main() runs (a constructor), and the runner orders
   them by file name and line -- chapter by chapter, as dtrain.h reads.

   Each test runs in a child process with a folder of its own (tmpdir), its
   output captured and printed whole when it ends, with where the run is:
   "PASS name (1.2 s)  [12/117, 0:41]". A test that crashes or hangs fails
   alone (a hang after --timeout seconds: its process group is killed; what
   it started in groups of their own -- a command under `timeout`, --nproc's
   ranks -- ends by its own timeout), and the others go on. The last line is
   "N passed, N failed, N skipped".

   This header is what a test file sees; the runner itself, and the state
   below, is tests/runner.c, one for the whole program. */
#ifndef DT_TEST_RUNNER_H
#define DT_TEST_RUNNER_H

#include <stddef.h>
#include <stdio.h>

enum { QUICK = 1, FULL = 2, ALONE = 4 };

/* The running test's state (tests/runner.c): CHECK and SKIP set it. */
extern int t_failed, t_skipped;
extern char t_skip_reason[320];
extern char tmpdir[256];                 /* the running test's own folder, removed after a pass */
extern char t_shared_dir[64];            /* the run's folder, for what several tests read (t_shared_file) */

#define CHECK(cond) CHECKF(cond, "%s", #cond)
#define CHECKF(cond, ...)                                                   \
    do {                                                                    \
        if (!(cond)) {                                                      \
            t_failed = 1;                                                   \
            printf("    line %d: ", __LINE__);                              \
            printf(__VA_ARGS__);                                            \
            printf("\n");                                                   \
        }                                                                   \
    } while (0)
#define SKIP(...) do { t_skipped = 1; snprintf(t_skip_reason, sizeof t_skip_reason, __VA_ARGS__); return; } while (0)

#define T_MAX_TESTS 512
/* The registry (tests/runner.c): TEST calls it before main(). */
void t_register(const char *name, void (*fn)(void), const char *file, int line, int flags);

#define TEST(name, flags)                                                                      \
    static void test_##name(void);                                                             \
    __attribute__((constructor)) static void t_register_##name(void) {                        \
        t_register(#name, test_##name, __FILE__, __LINE__, flags);                             \
    }                                                                                          \
    static void test_##name(void)

/* A file or folder that several tests read (a synthetic data set, a
   checkpoint), made once per run by the first test that asks, in the run's
   folder: tests run at once, so the maker holds a lock, and the others wait
   for it and find it made. `make` writes `path`; NULL when it failed. */
const char *t_shared_file(char *path, size_t n, const char *name, int (*make)(const char *path));

/* Parse the runner's flags, choose the tests, run them. `setup` is handed the
   stage binary before any test runs (not for --list); non-zero stops the run.
   Returns the exit status. */
int t_main(int argc, char **argv, int (*setup)(const char *subject));

#endif
