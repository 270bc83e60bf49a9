/* tests/helpers.c -- what the tests of several files use (tests/helpers.h
   declares it): leaves and finite differences, shell commands and their
   output, files, the data sets and checkpoints several tests share, the
   programs of this build. */
#include "helpers.h"

const char *train_bin = "01-single-gpu/train";
/* The command that runs stage 01 in the CPU tests: they say --device cpu, so
   that on a machine with a GPU they still test the CPU (the default, auto,
   would take the GPU); the GPU tests say --device cuda. */
char train_cpu[600];
const char *self_bin;                    /* this program: some tests run a part of it alone */

/* ---- helpers --------------------------------------------------------------- */

static double rnd(dt__rng *r) { return 2 * dt__rng_uniform(r) - 1; }

/* A leaf tensor that outlives the step arena, like a parameter. */
static dt_tensor *leaf(int ndim, const int *shape, dt__rng *r, double scale) {
    dt_tensor *t = (dt_tensor *)calloc(1, sizeof(dt_tensor));
    t->ndim = ndim;
    t->numel = 1;
    for (int i = 0; i < ndim; i++) { t->shape[i] = shape[i]; t->numel *= shape[i]; }
    t->data = (float *)calloc((size_t)t->numel, sizeof(float));
    t->grad = (float *)calloc((size_t)t->numel, sizeof(float));
    t->requires_grad = 1;
    for (int64_t i = 0; i < t->numel; i++) t->data[i] = (float)(rnd(r) * scale);
    return t;
}
static dt_tensor *leaf2(int rows, int cols, dt__rng *r, double scale) { int s[2] = { rows, cols }; return leaf(2, s, r, scale); }
static void leaf_free(dt_tensor *t) { free(t->data); free(t->grad); free(t); }

/* Finite-difference check. forward() builds an output from the leaves; the
   scalar is L = sum(out * w) with fixed random w, evaluated in double. */
static double fd_loss(fd_forward f, dt_tensor **leaves, void *ctx, const float *w) {
    dt_step_arena_reset();
    dt_set_grad_enabled(0);
    dt_tensor *out = f(leaves, ctx);
    dt_set_grad_enabled(1);
    double L = 0;
    for (int64_t i = 0; i < out->numel; i++) L += (double)out->data[i] * w[i];
    return L;
}
/* Each op's backward is checked twice: with its inputs the leaves, whose
   gradients exist and hold 0.5 (the op adds its share), and with each input coming out of
   another op (x + 0), whose gradient the op writes first (see
   dt__grad_acc_first). */
static void fd_check(const char *what, fd_forward f, dt_tensor **leaves, int nleaves, void *ctx, float eps, double tol) {
    for (int through = 0; through < 2; through++) {
        dt__rng r = { 777 };
        for (int k = 0; k < nleaves; k++)    /* a gradient already there: the op must add to it */
            for (int64_t i = 0; i < leaves[k]->numel; i++) leaves[k]->grad[i] = 0.5f;
        dt_step_arena_reset();
        dt_tensor *in[8], **args = leaves;   /* a whole model's leaves (more than 8): its own first writers */
        if (through && nleaves <= 8) {
            for (int k = 0; k < nleaves; k++)
                in[k] = leaves[k]->requires_grad ? dt_add(leaves[k], dt_tensor_new(leaves[k]->ndim, leaves[k]->shape))
                                                 : leaves[k];
            args = in;
        }
        dt_tensor *out = f(args, ctx);
        float *w = (float *)malloc(sizeof(float) * (size_t)out->numel);
        for (int64_t i = 0; i < out->numel; i++) w[i] = (float)rnd(&r);
        dt_backward_from(out, w);
        for (int k = 0; k < nleaves; k++) {
            dt_tensor *t = leaves[k];
            if (!t->requires_grad) continue;
            int probes = t->numel < 24 ? (int)t->numel : 24;
            for (int p = 0; p < probes; p++) {
                int64_t i = t->numel <= 24 ? p : (int64_t)(dt__rng_u64(&r) % (uint64_t)t->numel);
                float keep = t->data[i];
                t->data[i] = keep + eps;
                double lp = fd_loss(f, leaves, ctx, w);
                t->data[i] = keep - eps;
                double lm = fd_loss(f, leaves, ctx, w);
                t->data[i] = keep;
                double num = (lp - lm) / (2.0 * eps), ana = t->grad[i] - 0.5;
                double err = fabs(num - ana) / (1e-2 + fabs(num) + fabs(ana));
                CHECKF(err <= tol, "%s%s: leaf %d element %lld: analytic %.6g, numeric %.6g", what,
                       through ? " (input from another op)" : "", k, (long long)i, ana, num);
            }
        }
        free(w);
    }
}

/* A port no one listens on now, for ranks started by hand as torchrun would
   (--nproc's launcher holds its port instead: dt_launch says why). */
static int free_port(void) {
    int fd = dt__tcp_listen(0), port = fd >= 0 ? dt__tcp_port_of(fd) : 29500;
    if (fd >= 0) close(fd);
    return port;
}


/* Run a shell command; its output (stdout and stderr) into out. Returns the
   exit status, or 128 + signal. */
static int run_cmd(char *out, size_t n, const char *fmt, ...) {
    char cmd[8192], full[8300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(full, sizeof full, "timeout 300 %s 2>&1", cmd);
    FILE *p = popen(full, "r");
    size_t len = 0;
    if (!p) { snprintf(out, n, "popen failed"); return -1; }
    while (len + 1 < n) {
        size_t got = fread(out + len, 1, n - 1 - len, p);
        if (got == 0) break;
        len += got;
    }
    out[len] = 0;
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {}
    int st = pclose(p);
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return -1;
}

/* Is `line` one whole line of text? */
static int has_line(const char *text, const char *line) {
    size_t n = strlen(line);
    for (const char *p = text; (p = strstr(p, line)); p++)
        if ((p == text || p[-1] == '\n') && (p[n] == '\n' || p[n] == 0)) return 1;
    return 0;
}

static int count_lines_with(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* The one-line error contract: status as expected, a line "dtrain: error:"
   naming `names`, and no crash. */
static void expect_error(const char *out, int status, int want_status, const char *names) {
    CHECKF(status == want_status, "exit status %d, expected %d; output:\n%s", status, want_status, out);
    CHECKF(strstr(out, "dtrain: error:") || strstr(out, "dtrain[rank "), "no 'dtrain: error:' line in:\n%s", out);
    CHECKF(strstr(out, names) != NULL, "the error does not name '%s':\n%s", names, out);
    CHECKF(!strstr(out, "Sanitizer") && !strstr(out, "runtime error"), "sanitizer report:\n%s", out);
}

/* expect_error for one case of many: a failure says which. */
static void expect_error_in(const char *which, const char *out, int status, int want_status, const char *names) {
    int before = t_failed;
    t_failed = 0;
    expect_error(out, status, want_status, names);
    if (t_failed) printf("    (that was: %s)\n", which);
    t_failed |= before;
}

/* A NumPy .npy file (format version 1) as numpy.save writes it: the magic,
   the version, the header's length, a dict padded to 64 bytes, the data. */
static void write_npy(const char *path, const char *descr, const char *shape, const void *data, size_t bytes, int fortran) {
    char dict[128];
    int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }", descr, fortran ? "True" : "False",
                     shape);
    while ((10 + n + 1) % 64) dict[n++] = ' ';
    dict[n++] = '\n';
    unsigned char head[10] = { 0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(n & 255), (unsigned char)(n >> 8) };
    FILE *f = fopen(path, "wb");
    fwrite(head, 1, 10, f);
    fwrite(dict, 1, (size_t)n, f);
    fwrite(data, 1, bytes, f);
    fclose(f);
}
static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { printf("cannot write %s\n", path); exit(1); }
    fwrite(data, 1, n, f);
    fclose(f);
}
static unsigned char *read_bytes(const char *path, size_t *n) { return dt__read_file(path, n); }
/* A small file as a string (NULL when it cannot be read). */
static char *read_text(const char *path) {
    size_t n = 0;
    unsigned char *bytes = read_bytes(path, &n), *text = bytes ? (unsigned char *)realloc(bytes, n + 1) : NULL;
    if (!text) { free(bytes); return NULL; }
    text[n] = 0;
    return (char *)text;
}

/* A program of this build, by its path from the project root: the tests run
   either build (plain, or build/asan), found from stage 01's path. */
static const char *build_path(const char *rel) {
    static char paths[4][700];
    static int next;
    char *p = paths[next++ % 4], root[512];
    dt__copy_str(root, sizeof root, train_bin);
    for (int up = 0; up < 2; up++) {             /* <root>/01-single-gpu/train -> <root> */
        char *slash = strrchr(root, '/');
        if (slash) *slash = 0;
        else root[0] = 0;
    }
    snprintf(p, 700, "%s%s%s", root, root[0] ? "/" : "", rel);
    return p;
}

/* The repository root (for make), beside this build's programs. */
static const char *repo_root(void) {
    static char root[700];
    char probe[800];
    dt__copy_str(root, sizeof root, build_path(""));
    for (int up = 0; up < 3; up++) {              /* build/asan/ -> the root */
        snprintf(probe, sizeof probe, "%s%sMakefile", root, root[0] ? "/" : "");
        struct stat sb;
        if (stat(probe, &sb) == 0) return root[0] ? root : ".";
        char *slash = strrchr(root, '/');
        if (!slash) { root[0] = 0; continue; }
        *slash = 0;
    }
    return ".";
}

/* What several tests read (data sets, a checkpoint), made once per run by
   the first test that asks (tests/runner.h: t_shared_file); path caches it. */
static const char *shared(char *path, size_t n, const char *name, int (*make)(const char *path)) {
    if (!path[0] && !t_shared_file(path, n, name, make)) {
        printf("    could not make %s\n", path);
        exit(1);
    }
    return path;
}
/* Synthetic sets of 16x16 images: a small one for the command-line tests,
   and a bigger one, so that 200 steps learn something and the eval accuracy
   is measured to a tenth of a point. */
static int make_small_data(const char *dir) { dt_synthetic_write(dir, 320, 80, 16, 5); return 1; }
static int make_mp_data(const char *dir) { dt_synthetic_write(dir, 3200, 1000, 16, 9); return 1; }
static const char *small_data(void) { static char dir[600]; return shared(dir, sizeof dir, "small", make_small_data); }
static const char *mp_data(void) { static char dir[600]; return shared(dir, sizeof dir, "mp", make_mp_data); }
static const char *find_line(const char *text, const char *line) {
    for (const char *p = text; p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, line, strlen(line))) return p;
    return NULL;
}

/* A checkpoint folder's files of tensors (weights, optimizer state), or the one file given. */
static int tensor_files(const char *path, char files[2][800]) {
    struct stat s;
    if (stat(path, &s) != 0 || !S_ISDIR(s.st_mode)) { snprintf(files[0], 800, "%s", path); return 1; }
    snprintf(files[0], 800, "%s/model.safetensors", path);
    if (access(files[0], F_OK) != 0) snprintf(files[0], 800, "%s/adapter_model.safetensors", path);   /* LoRA's */
    snprintf(files[1], 800, "%s/optimizer.safetensors", path);
    return 2;
}
static int file_equal_tensors(const char *a, const char *b) {
    dt_safetensors *x = dt_safetensors_read(a), *y = dt_safetensors_read(b);
    int same = x->n == y->n && x->n > 0;
    for (int i = 0; same && i < x->n; i++) {
        dt__st_tensor *t = &x->t[i], *u = NULL;
        for (int j = 0; j < y->n; j++) if (!strcmp(y->t[j].name, t->name)) u = &y->t[j];
        same = u && t->end - t->begin == u->end - u->begin &&
               memcmp(x->buf + x->data_start + t->begin, y->buf + y->data_start + u->begin, t->end - t->begin) == 0;
    }
    dt_safetensors_close(x);
    dt_safetensors_close(y);
    return same;
}
/* The file of a checkpoint folder that holds its metadata: the sharded index or the weights. */
static const char *meta_file(const char *ck, char *out, size_t n) {
    snprintf(out, n, "%s/shards.safetensors", ck);
    if (access(out, F_OK) != 0) snprintf(out, n, "%s/model.safetensors", ck);
    if (access(out, F_OK) != 0) snprintf(out, n, "%s/adapter_model.safetensors", ck);
    return out;
}
/* Two checkpoints (folders or files) hold the same tensors, bit for bit. */
static int files_equal_tensors(const char *a, const char *b) {
    char fa[2][800], fb[2][800];
    int n = tensor_files(a, fa), same = n == tensor_files(b, fb);
    for (int k = 0; same && k < n; k++) same = file_equal_tensors(fa[k], fb[k]);
    return same;
}

/* The command of a stage, beside stage 01's (plain or sanitizer build), with --device `device`. */
static const char *stage_on(const char *stage, const char *device) {
    char rel[300];
    snprintf(rel, sizeof rel, "%s/train --device %s", stage, device);
    return build_path(rel);
}
/* On the CPU, as train_cpu is. */
static const char *stage_bin(const char *stage) { return stage_on(stage, "cpu"); }


/* How many lines of a log say `"key":value` followed by , or }. */
static int log_lines_with_value(const char *log, const char *key, long long value) {
    char a[96], b[96];
    snprintf(a, sizeof a, "\"%s\":%lld,", key, value);
    snprintf(b, sizeof b, "\"%s\":%lld}", key, value);
    size_t n = 0;
    char *text = (char *)read_bytes(log, &n);
    if (!text) return -1;
    text = (char *)realloc(text, n + 1);
    text[n] = 0;
    int c = count_lines_with(text, a) + count_lines_with(text, b);
    free(text);
    return c;
}

/* The (step, value) pairs of a key in --log's lines (not the summary). */
static int log_points(const char *log, const char *key, int64_t *steps, double *values, int max) {
    size_t n = 0;
    char *text = (char *)read_bytes(log, &n), pat[64];
    if (!text) return -1;
    text = (char *)realloc(text, n + 1);
    text[n] = 0;
    snprintf(pat, sizeof pat, "\"%s\":", key);
    int count = 0;
    for (char *line = strtok(text, "\n"); line && count < max; line = strtok(NULL, "\n")) {
        char *p = strstr(line, pat), *s = strstr(line, "\"step\":");
        if (p && s && !strstr(line, "\"summary\"")) {
            steps[count] = atoll(s + 7);
            values[count++] = atof(p + strlen(pat));
        }
    }
    free(text);
    return count;
}

/* The "key" values of a log's lines (not the summary), in order. */
static int log_series(const char *log, const char *key, double *out, int max) {
    int64_t *steps = (int64_t *)malloc(sizeof *steps * (size_t)(max > 0 ? max : 1));
    int n = steps ? log_points(log, key, steps, out, max) : -1;
    free(steps);
    return n;
}
