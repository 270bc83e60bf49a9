//@ lesson: errors -- every failure says what went wrong and what to do, then exits; what is removed when it does
/* ---- errors -------------------------------------------------------------- */

/* Print "dtrain: error: <message>" (prefixed by the rank when there are several)
   and exit with status 1. Messages name the file or flag at fault. */
void dt_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;
/* A command-line mistake: the error, a short usage line (a stage's), exit status 2. */
void dt_usage_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;
/* Print a warning line to stderr and carry on. */
void dt_warn(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

//@ implementation
/* ==== errors =================================================================
   A library for learners fails early and says why. There is no error code to
   forget to check: the message names the culprit and the program exits. */

static void dt__vmessage(const char *kind, const char *fmt, va_list ap) {
    char line[2048];             /* one write per message: ranks failing together do not interleave */
    int n;
    fflush(stdout);
    if (dt__ctx.world_size > 1) n = snprintf(line, sizeof line, "dtrain[rank %d]: %s: ", dt__ctx.rank, kind);
    else n = snprintf(line, sizeof line, "dtrain: %s: ", kind);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    strcat(line, "\n");
    fputs(line, stderr);
    fflush(stderr);
}
/* What to remove if the program stops early: a shared-memory segment whose
   name has not yet been shared out, a checkpoint's .tmp file and the folder
   it is written into. dt_fail and a second Ctrl-C remove them, so a job
   stopped at any moment leaves nothing behind. unlink() and rmdir() are safe
   inside a signal handler, hence plain paths. */
#define DT_CLEANUP_SLOTS 16
static void dt__copy_str(char *out, size_t n, const char *s);
static char dt__cleanup_paths[DT_CLEANUP_SLOTS][4096];
static volatile sig_atomic_t dt__cleanup_used[DT_CLEANUP_SLOTS];
static int dt__cleanup_add(const char *path) {
    for (int i = 0; i < DT_CLEANUP_SLOTS; i++) {
        sig_atomic_t unused = 0;             /* 2: taken by a thread that is writing its path */
        if (__atomic_compare_exchange_n(&dt__cleanup_used[i], &unused, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            dt__copy_str(dt__cleanup_paths[i], sizeof dt__cleanup_paths[i], path);
            __atomic_signal_fence(__ATOMIC_RELEASE);     /* the path is whole before a handler may read it */
            dt__cleanup_used[i] = 1;
            return i;
        }
    }
    return -1;                               /* full: that file is merely not cleaned up */
}
static void dt__cleanup_done(int slot) { if (slot >= 0) dt__cleanup_used[slot] = 0; }
/* What empties a folder rmdir could not remove: set by the chapter that
   registers such a folder (checkpoints: a NAME.tmp loses dtrain's files, and
   only those), so that this chapter knows nothing of what the files are. */
static void (*dt__cleanup_empty_folder)(const char *path);
/* in_handler: called from a signal handler, where only unlink and rmdir may be
   used. Otherwise a folder that is not yet empty -- a checkpoint's NAME.tmp in
   which another rank, killed, left its half-written shard -- is emptied and
   goes too. */
static void dt__cleanup_run_in(int in_handler) {
    for (int i = 0; i < DT_CLEANUP_SLOTS; i++)          /* the files, then the folders they emptied */
        if (dt__cleanup_used[i] == 1 && unlink(dt__cleanup_paths[i]) == 0) dt__cleanup_used[i] = 0;
    for (int i = 0; i < DT_CLEANUP_SLOTS; i++)
        if (dt__cleanup_used[i] == 1) {
            if (rmdir(dt__cleanup_paths[i]) != 0 && !in_handler && dt__cleanup_empty_folder)
                dt__cleanup_empty_folder(dt__cleanup_paths[i]);
            dt__cleanup_used[i] = 0;
        }
}
static void dt__cleanup_run(void) { dt__cleanup_run_in(1); }

/* Who must hear of a failure before this process exits: the collectives
   (the collectives chapter) put a function here once a communicator is open, so that the
   other ranks stop at once instead of waiting for their timeout. */
static void (*dt__on_fail)(void);
/* ... and the run's tracking (the run-driver chapter): an MLflow run marked FAILED. */
static void (*dt__on_fail_tracking)(void);
#ifdef DT_FUZZING
/* The fuzzing harnesses (tests/fuzz/) take an error back instead of the exit:
   an input refused with a clear error is a correct result, and the next
   input follows in the same process. */
static void (*dt__fuzz_refused)(void);
#define DT__FUZZ_REFUSED() do { if (dt__fuzz_refused) dt__fuzz_refused(); } while (0)
#else
#define DT__FUZZ_REFUSED() ((void)0)
#endif
void dt_fail(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); dt__vmessage("error", fmt, ap); va_end(ap);
    DT__FUZZ_REFUSED();
    dt__cleanup_run_in(0);
    void (*tell)(void) = __atomic_load_n(&dt__on_fail, __ATOMIC_ACQUIRE);
    if (tell) tell();            /* the other ranks must not wait for us (the tracking below may take seconds) */
    void (*track)(void) = __atomic_exchange_n(&dt__on_fail_tracking, NULL, __ATOMIC_ACQ_REL);
    if (track) track();          /* once, by whichever thread fails first: its own writes may fail */
    exit(1);
}
/* The program the usage line names: a stage's, as it was run (dt_parse_args
   sets it). A tool's own flags are not a stage's, so a tool's error ends at
   the message; the usage is the tool's own (the top of its file). */
static const char *dt__usage_program;
void dt_usage_error(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); dt__vmessage("error", fmt, ap); va_end(ap);
    DT__FUZZ_REFUSED();
    if (dt__usage_program) fprintf(stderr, "usage: %s [--flag value ...]; run with --help for the flags\n", dt__usage_program);
    exit(2);
}
/* Paths and parameter names are built with this: one that does not fit is an
   error, never a silently shortened name. */
static void dt__path(char *out, size_t n, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void dt__path(char *out, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    if (len < 0 || (size_t)len >= n) dt_fail("name or path too long (over %zu characters): %.60s...", n - 1, out);
}
/* Copy a string, shortening it to fit (for labels and messages only). */
static void dt__copy_str(char *out, size_t n, const char *s) {
    size_t l = strlen(s);
    if (l >= n) l = n - 1;
    memcpy(out, s, l);
    out[l] = 0;
}
void dt_warn(const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); dt__vmessage("warning", fmt, ap); va_end(ap);
}
/* Sizes made of numbers from flags and files (shapes, counts, offsets) are
   multiplied and added here: a product that would wrap around is an error
   naming what it sized, never a small buffer that later writes overrun. */
static int64_t dt__size_mul(int64_t a, int64_t b, const char *what) {
    int64_t r;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r))
        dt_fail("%s: a size out of range (%lld x %lld)", what, (long long)a, (long long)b);
    return r;
}
static int64_t dt__size_add(int64_t a, int64_t b, const char *what) {
    int64_t r;
    if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r))
        dt_fail("%s: a size out of range (%lld + %lld)", what, (long long)a, (long long)b);
    return r;
}
/* This machine's memory in bytes (0 when the system does not say). */
static double dt__host_memory_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (double)pages * (double)page : 0;
}
/* A file cut short by a full disk or a quota must stop the program, or a log
   that ends early reads as a run that ended early. stdio reports a failed
   write late -- at the flush the buffer's filling causes, or at fclose -- and
   keeps the error in the stream, so one look after each record finds it.
   `flag` names the option the path came from ("--log"), or is NULL. */
static void dt__write_failed(const char *flag, const char *path, int err) {
    if (!err) err = EIO;            /* ferror without an errno: say something true */
    if (flag) dt_fail("cannot write %s '%s': %s", flag, path, strerror(err));
    dt_fail("cannot write '%s': %s", path, strerror(err));
}
static void dt__file_check(FILE *f, const char *flag, const char *path) {
    if (ferror(f)) dt__write_failed(flag, path, errno);
}
static void dt__file_close(FILE *f, const char *flag, const char *path) {
    int failed = fflush(f) != 0 || ferror(f), err = errno;
    if (fclose(f) != 0 && !failed) { failed = 1; err = errno; }
    if (failed) dt__write_failed(flag, path, err);
}

