/* tests/helpers.h -- the test suite of dtrain.h and its programs: what each of
   its files sees.

   usage: tests/test_dtrain [--suite quick|full|all] [-j N] path/to/01-single-gpu/train [name-filter]
          (tests/runner.h: the runner, and how a test is defined and put in a suite)

   Each test prints PASS, FAIL (with the checks that failed) or SKIP (with why);
   the last line is "N passed, N failed, N skipped". Ops are checked against
   hand-computed values and their backward passes against finite differences;
   the optimizers against closed-form steps; the command line, data and
   checkpoint errors by running the stage binaries.

   THE FILES
       tests/NN-name.c   the tests, a file per chapter of dtrain.h (NN-name is
                         the chapter's; several files may share a chapter's
                         number), and 00-build-and-tools.c
       tests/helpers.c   what the tests of several files use, declared below
       tests/main.c      main(): the runner, or a part of this program that a
                         test runs on its own (--selftest-..., --write-fuzz-seeds)
       tests/runner.c    the runner (tests/runner.h)

   HOW THEY MAKE ONE PROGRAM
       The tests reach into dtrain.h's implementation (dt__ names, which are
       static, and the structs it keeps to itself), so the implementation and
       every test are one translation unit: make writes build/tests/suite.c,
       which includes tests/helpers.c, then each tests/[0-9][0-9]-*.c in the
       order of their names, then tests/main.c, and compiles it; the runner is
       compiled on its own. There is no list to keep: a file added is compiled
       and its tests run. A test file includes this header (so that it reads,
       and an editor parses it, on its own); what it defines is seen by the
       files after it, and what one of them needs from a file after it is
       declared here, at the end. */
#ifndef DT_TEST_HELPERS_H
#define DT_TEST_HELPERS_H

#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "runner.h"

extern const char *train_bin;            /* the stage 01 under test (its path: the other programs are beside it) */
extern char train_cpu[600];              /* the command that runs it on the CPU */
extern const char *self_bin;             /* this program: some tests run a part of it alone */

#define CLOSE(a, b, tol) (fabs((double)(a) - (double)(b)) <= (tol) * (1.0 + fabs((double)(b))))

/* ---- tests/helpers.c ---------------------------------------------------------- */

/* leaves, and backward against finite differences */
static double rnd(dt__rng *r);
static dt_tensor *leaf(int ndim, const int *shape, dt__rng *r, double scale);
static dt_tensor *leaf2(int rows, int cols, dt__rng *r, double scale);
static void leaf_free(dt_tensor *t);
typedef dt_tensor *(*fd_forward)(dt_tensor **leaves, void *ctx);
static double fd_loss(fd_forward f, dt_tensor **leaves, void *ctx, const float *w);
static void fd_check(const char *what, fd_forward f, dt_tensor **leaves, int nleaves, void *ctx, float eps, double tol);

/* ports, shell commands and what they print */
static int free_port(void);
static int run_cmd(char *out, size_t n, const char *fmt, ...);
static int has_line(const char *text, const char *line);
static int count_lines_with(const char *text, const char *needle);
static const char *find_line(const char *text, const char *line);
static void expect_error(const char *out, int status, int want_status, const char *names);
static void expect_error_in(const char *which, const char *out, int status, int want_status, const char *names);
#define NO_MPI_BUILD "this build has no MPI: make found no mpicc (Debian's libopenmpi-dev, which .ci/run installs), " \
                     "or left it out (MPI=0; the MSan build, since MPI's library is not instrumented)"

/* files */
static void write_npy(const char *path, const char *descr, const char *shape, const void *data, size_t bytes, int fortran);
static void write_bytes(const char *path, const void *data, size_t n);
static unsigned char *read_bytes(const char *path, size_t *n);
static char *read_text(const char *path);

/* this build's programs, and the repository */
static const char *build_path(const char *rel);
static const char *repo_root(void);
static const char *stage_on(const char *stage, const char *device);
static const char *stage_bin(const char *stage);

/* what several tests read, made once per run */
static const char *shared(char *path, size_t n, const char *name, int (*make)(const char *path));
static int make_small_data(const char *dir);
static int make_mp_data(const char *dir);
static const char *small_data(void);
static const char *mp_data(void);
#define SMALL_FLAGS "--image-size 16 --dim 32 --batch-size 32 --log-every 1000 --quiet"
#define PAR_FLAGS "--image-size 16 --dim 32 --log-every 1000 --quiet --epochs 2"

/* checkpoints and logs */
static int tensor_files(const char *path, char files[2][800]);
static int file_equal_tensors(const char *a, const char *b);
static const char *meta_file(const char *ck, char *out, size_t n);
static int files_equal_tensors(const char *a, const char *b);
static int log_lines_with_value(const char *log, const char *key, long long value);
static int log_series(const char *log, const char *key, double *out, int max);

/* Every GPU test begins here: skip, saying why, when this machine has no GPU.
   Where one is visible, a build that cannot use it (no CUDA, no NCCL) FAILS
   the test instead: a green run on a GPU machine means the GPU path ran. */
#define NEED(available, what)                                                                        \
    do {                                                                                             \
        char why_[256] = "";                                                                         \
        if (!(available)(why_, sizeof why_)) {                                                       \
            if (!machine_has_gpu()) SKIP("no GPU: %s", why_);                                        \
            CHECKF(0, "a GPU is visible, but %s (%s): this test cannot run, and must not pass", why_, what); \
            return;                                                                                  \
        }                                                                                            \
    } while (0)
#define NEED_GPU() NEED(dt_cuda_available, "the build cannot use it")

/* ---- defined in a chapter's file, used by a file before it -------------------- */

/* tests/08-models.c: small GPT and Llama configurations */
static dt_model_config tiny_gpt(void);
static dt_model_config tiny_llama(int untied_head, int qkv_bias);
/* tests/13-data-parallel.c: a log's losses, checkpoints' largest difference,
   and DP, DDP and FSDP against one device with N times the batch */
static int read_losses(const char *path, double *loss, int max);
static double file_max_tensor_diff(const char *a, const char *b);
static double max_tensor_diff(const char *a, const char *b);
static void equivalence(const char *data, int samples, const char *model_flags, const char *model);
/* tests/15-fsdp.c: a value of a log's summary line */
static double summary_value(const char *log, const char *key);
/* tests/21-data.c: a small generated text; instruction data (JSON lines) */
static const char *gpt_text(void);
static const char *instruction_data(void);
/* tests/23-checkpoints.c: a checkpoint 3 steps into a run */
static const char *short_checkpoint(void);
/* tests/30-cuda.c: is a GPU visible (NEED, above) */
static int machine_has_gpu(void);

#endif
