//@ machinery: checkpoints -- safetensors files, checkpoint folders written atomically, sharded checkpoints, --resume auto's newest
/* ---- checkpoints (safetensors) ------------------------------------------------ */

/* A safetensors file: 8-byte little-endian header length, a JSON header naming
   each tensor's dtype, shape and byte range, then the raw data. PyTorch, numpy
   and Hugging Face read it. Writes go to FILE.tmp, then fsync, then rename:
   an existing file is replaced whole or not at all. */
typedef struct dt_named_tensor { const char *name; const float *data; int ndim; int64_t shape[4]; } dt_named_tensor;
void dt_safetensors_write(const char *path, const dt_named_tensor *tensors, int count,
                          const char *const *meta_kv, int meta_count);

typedef struct dt_safetensors dt_safetensors;   /* a file read whole and checked */
dt_safetensors *dt_safetensors_read(const char *path);
void dt_safetensors_close(dt_safetensors *st);
/* Copy tensor `name` into dst as f32 (F32, F16, BF16 and F64 are read); returns 0
   when absent, fails when its shape differs from the expected one. */
int dt_safetensors_get(dt_safetensors *st, const char *name, float *dst, int ndim, const int *shape);
const char *dt_safetensors_meta(dt_safetensors *st, const char *key); /* NULL when absent */

//@ implementation
/* ==== checkpoints ===========================================================
   Tensors go to disk as safetensors files: an 8-byte little-endian header
   length, a JSON header {"name": {"dtype", "shape", "data_offsets"},
   "__metadata__": {...}} and the raw tensors. A training checkpoint is a
   folder laid out as Hugging Face lays out a model, so that the tools people
   already use open it:
     model.safetensors      the weights under their PyTorch names, metadata
                            "format": "pt" and the run's position (epoch,
                            step, seed, data range);
     optimizer.safetensors  the optimizer's moments ("exp_avg.<name>", ...),
                            a file of their own: a strict load_state_dict of
                            the weights would refuse them;
     config.json            the model's shape (the models chapter writes it), so that
                            AutoModelForCausalLM.from_pretrained(folder) works.
   With LoRA the weights are the adapters, and the folder is the one PEFT
   saves: adapter_model.safetensors (PEFT's names, the same metadata) and
   adapter_config.json (rank, alpha, targets, the base model's folder), beside
   optimizer.safetensors; PeftModel.from_pretrained(base, folder) loads it.
   The folder is written as NAME.tmp, each file flushed to disk, and renamed to
   NAME only when complete: a crash or a full disk can lose the new
   checkpoint, never the previous one.
   A sharded model (FSDP) saves without gathering anything: each rank writes the
   shard it holds, and an index ties the shards together. Loading at the same
   world size reads one file per rank; at another, or into an unsharded model,
   the shards are put back together first -- and tools/consolidate does that
   once, into a whole checkpoint folder. */

static void dt__json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

void dt_safetensors_write(const char *path, const dt_named_tensor *tensors, int count, const char *const *meta_kv, int meta_count) {
    /* the header is built in memory first: its length comes before it */
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *h = open_memstream(&hdr, &hlen);
    if (!h) dt_fail("out of memory writing '%s'", path);
    fputc('{', h);
    if (meta_count > 0) {
        fputs("\"__metadata__\":{", h);
        for (int i = 0; i < meta_count; i++) {
            if (i) fputc(',', h);
            dt__json_string(h, meta_kv[2 * i]); fputc(':', h); dt__json_string(h, meta_kv[2 * i + 1]);
        }
        fputc('}', h);
    }
    uint64_t off = 0;
    for (int i = 0; i < count; i++) {
        int64_t numel = 1;
        if (meta_count > 0 || i) fputc(',', h);
        dt__json_string(h, tensors[i].name);
        fputs(":{\"dtype\":\"F32\",\"shape\":[", h);
        for (int d = 0; d < tensors[i].ndim; d++) { fprintf(h, d ? ",%lld" : "%lld", (long long)tensors[i].shape[d]); numel *= tensors[i].shape[d]; }
        fprintf(h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)(off + 4 * numel));
        off += 4 * (uint64_t)numel;
    }
    fputc('}', h);
    while ((ftell(h) % 8) != 0) fputc(' ', h);       /* the data starts 8-byte aligned */
    int hdr_failed = ferror(h);                        /* a memory stream fails only when memory runs out */
    if (fclose(h) != 0 || hdr_failed || !hdr) dt_fail("out of memory writing '%s'", path);

    char tmp[4096];
    dt__path(tmp, sizeof tmp, "%s.tmp", path);
    signal(SIGXFSZ, SIG_IGN);    /* over a file-size limit: an error to report, not a kill */
    int cleanup = dt__cleanup_add(tmp);       /* removed if the program is stopped while writing */
    FILE *f = fopen(tmp, "wb");
    if (!f) { free(hdr); dt_fail("cannot write checkpoint '%s': %s", tmp, strerror(errno)); }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(hdr, 1, hlen, f) == hlen;
#ifdef DT_TESTING
    /* Fault tests: DT_TEST_DIE_WRITING=PART kills the process once it has begun a file whose name holds PART. */
    if (getenv("DT_TEST_DIE_WRITING") && *getenv("DT_TEST_DIE_WRITING") && strstr(path, getenv("DT_TEST_DIE_WRITING"))) {
        fflush(f);
        raise(SIGKILL);
    }
#endif
    for (int i = 0; ok && i < count; i++) {
        int64_t numel = 1;
        for (int d = 0; d < tensors[i].ndim; d++) numel *= tensors[i].shape[d];
        ok = fwrite(tensors[i].data, sizeof(float), (size_t)numel, f) == (size_t)numel;   /* little-endian hosts */
    }
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int saved_errno = errno;
    if (fclose(f) != 0 && ok) { ok = 0; saved_errno = errno; }   /* the last of the data may fail only here */
    free(hdr);
    if (!ok) {
        unlink(tmp);
        dt_fail("could not write checkpoint '%s': %s (nothing was replaced; the previous file, if any, is intact)",
                path, strerror(saved_errno ? saved_errno : EIO));
    }
    if (rename(tmp, path) != 0) {
        saved_errno = errno;
        unlink(tmp);
        dt_fail("could not rename '%s' to '%s': %s", tmp, path, strerror(saved_errno));
    }
    dt__cleanup_done(cleanup);
}

typedef struct dt__st_tensor { char *name; char dtype[8]; int ndim; int64_t shape[8]; uint64_t begin, end; } dt__st_tensor;
struct dt_safetensors {
    char path[1024];
    unsigned char *buf;
    size_t len, data_start;
    dt__st_tensor *t;
    int n, cap;
    char **meta;                 /* key, value, key, value, ... */
    int nmeta;
};

static int dt__safetensors_dtype_size(const char *d) {
    if (!strcmp(d, "F32")) return 4;
    if (!strcmp(d, "F16") || !strcmp(d, "BF16")) return 2;
    if (!strcmp(d, "F64")) return 8;
    return 0;
}

/* buf holds the file's first `have` bytes (all of it, or its header alone);
   `len` is the file's length, which every tensor's byte range must fit. */
static int dt__st_by_name(const void *a, const void *b) {
    return strcmp((*(dt__st_tensor *const *)a)->name, (*(dt__st_tensor *const *)b)->name);
}
static int dt__st_by_offset(const void *a, const void *b) {
    const dt__st_tensor *x = *(dt__st_tensor *const *)a, *y = *(dt__st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : x->end > y->end;
}
/* Parse a safetensors file held in buf (have bytes of it read, len its size;
   the data may be left unread). What is wrong is an error naming the file --
   or, given `why`, said there, and NULL (buf freed): --resume auto looks over
   a folder of checkpoints and passes a damaged one by. */
#define DT__ST_REFUSE(...)                                          \
    do {                                                            \
        char refused[8192];  /* said after what was read is freed */  \
        snprintf(refused, sizeof refused, __VA_ARGS__);             \
        if (st) dt_safetensors_close(st);                           \
        else free(buf);                                             \
        free(by);                                                   \
        if (!why) dt_fail("%s", refused);                           \
        dt__copy_str(why, why_n, refused);                          \
        return NULL;                                                \
    } while (0)
static dt_safetensors *dt__safetensors_parse(const char *path, unsigned char *buf, size_t have, size_t len, char *why,
                                             size_t why_n) {
    dt_safetensors *st = NULL;
    dt__st_tensor **by = NULL;
    if (have < 8) DT__ST_REFUSE("'%s' is truncated or not a safetensors file (%zu bytes)", path, len);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)buf[i] << (8 * i);
    if (hlen > have - 8)
        DT__ST_REFUSE("'%s' is truncated or not a safetensors file (its header claims %llu bytes, the file has %zu)",
                path, (unsigned long long)hlen, len);
    st = (dt_safetensors *)calloc(1, sizeof *st);
    if (!st) dt_fail("out of memory reading '%s'", path);
    dt__copy_str(st->path, sizeof st->path, path);
    st->buf = buf; st->len = len; st->data_start = 8 + hlen;
    dt__json j = { (const char *)buf + 8, 0, hlen, 1 };
    dt__json_eat(&j, '{');
    while (j.ok && dt__json_peek(&j) != '}') {
        char *key = dt__json_str(&j);
        dt__json_eat(&j, ':');
        if (!j.ok) { free(key); break; }
        if (!strcmp(key, "__metadata__")) {
            dt__json_eat(&j, '{');
            while (j.ok && dt__json_peek(&j) != '}') {
                char *k = dt__json_str(&j);
                dt__json_eat(&j, ':');
                char *v = dt__json_peek(&j) == '"' ? dt__json_str(&j) : NULL;
                if (!v) { free(k); j.ok = 0; break; }
                st->meta = (char **)realloc(st->meta, sizeof(char *) * 2 * (st->nmeta + 1));
                st->meta[2 * st->nmeta] = k; st->meta[2 * st->nmeta + 1] = v; st->nmeta++;
                if (dt__json_peek(&j) == ',') j.pos++;
            }
            dt__json_eat(&j, '}');
            free(key);
        } else {
            if (st->n == st->cap) {
                st->cap = st->cap ? 2 * st->cap : 64;
                st->t = (dt__st_tensor *)realloc(st->t, sizeof(dt__st_tensor) * st->cap);
            }
            dt__st_tensor *t = &st->t[st->n++];
            memset(t, 0, sizeof *t);
            t->name = key;
            int64_t offs[2] = { -1, -1 };
            int have_dtype = 0, have_offsets = 0;
            dt__json_eat(&j, '{');
            while (j.ok && dt__json_peek(&j) != '}') {
                char *f = dt__json_str(&j);
                dt__json_eat(&j, ':');
                if (f && !strcmp(f, "dtype")) {
                    char *d = dt__json_str(&j);
                    if (d) { snprintf(t->dtype, sizeof t->dtype, "%s", d); have_dtype = 1; }
                    free(d);
                } else if (f && !strcmp(f, "shape")) t->ndim = dt__json_int_array(&j, t->shape, 8);
                else if (f && !strcmp(f, "data_offsets")) have_offsets = dt__json_int_array(&j, offs, 2) == 2;
                else dt__json_skip(&j, 0);
                free(f);
                if (dt__json_peek(&j) == ',') j.pos++;
            }
            dt__json_eat(&j, '}');
            if (j.ok && (!have_dtype || !have_offsets || offs[0] < 0 || offs[1] < offs[0]))
                DT__ST_REFUSE("'%s': tensor '%s' has a malformed entry in the safetensors header", path, key);
            t->begin = (uint64_t)offs[0]; t->end = (uint64_t)offs[1];
        }
        if (dt__json_peek(&j) == ',') j.pos++;
    }
    dt__json_eat(&j, '}');
    if (!j.ok) DT__ST_REFUSE("'%s' is not a valid safetensors file (corrupt JSON header near byte %zu)", path, 8 + j.pos);
    for (int i = 0; i < st->n; i++) {
        dt__st_tensor *t = &st->t[i];
        uint64_t numel = 1, bytes = 0;
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)t->shape[d], &numel))
                DT__ST_REFUSE("'%s': tensor '%s' has a shape out of range (dimension %d is %lld)", path, t->name, d,
                        (long long)t->shape[d]);
        int es = dt__safetensors_dtype_size(t->dtype);
        if (es && (__builtin_mul_overflow(numel, (uint64_t)es, &bytes) || t->end - t->begin != bytes))
            DT__ST_REFUSE("'%s': tensor '%s' claims %llu bytes for %llu %s elements", path, t->name,
                    (unsigned long long)(t->end - t->begin), (unsigned long long)numel, t->dtype);
        if (t->end > len - st->data_start)
            DT__ST_REFUSE("'%s' is truncated: tensor '%s' needs %llu bytes of data, the file has %zu", path, t->name,
                    (unsigned long long)t->end, len - st->data_start);
    }
    /* Each name once, and the tensors' bytes one after another from the start of the data, none shared and none
       left between (as the safetensors format says, and its own library checks): a name twice or bytes that two
       tensors share are a corrupt or crafted file. */
    by = (dt__st_tensor **)malloc(sizeof *by * (size_t)(st->n + 1));
    if (!by) dt_fail("out of memory reading '%s'", path);
    for (int i = 0; i < st->n; i++) by[i] = &st->t[i];
    qsort(by, (size_t)st->n, sizeof *by, dt__st_by_name);
    for (int i = 1; i < st->n; i++)
        if (!strcmp(by[i - 1]->name, by[i]->name)) DT__ST_REFUSE("'%s' names tensor '%s' twice", path, by[i]->name);
    qsort(by, (size_t)st->n, sizeof *by, dt__st_by_offset);
    uint64_t at = 0;
    for (int i = 0; i < st->n; i++) {
        if (by[i]->begin < at)
            DT__ST_REFUSE("'%s': tensor '%s' (bytes %llu to %llu of the data) overlaps another tensor's bytes", path, by[i]->name,
                    (unsigned long long)by[i]->begin, (unsigned long long)by[i]->end);
        if (by[i]->begin > at)
            DT__ST_REFUSE("'%s': tensor '%s' begins at byte %llu of the data, leaving bytes %llu to %llu to no tensor", path,
                    by[i]->name, (unsigned long long)by[i]->begin, (unsigned long long)at, (unsigned long long)by[i]->begin);
        at = by[i]->end;
    }
    free(by);
    return st;
}
#undef DT__ST_REFUSE

dt_safetensors *dt_safetensors_read(const char *path) {
    size_t len = 0;
    unsigned char *buf = dt__read_file(path, &len);
    if (!buf) dt_fail("cannot read '%s': %s", path, dt__read_failure());
    return dt__safetensors_parse(path, buf, len, len, NULL, 0);
}

/* The header alone (metadata and the tensor list, no data): what a look over a
   folder of checkpoints needs, without reading gigabytes. The file's size is
   checked against what the header says, so a file cut short is found. Given
   `why`, a file that cannot be read is said there and NULL returned. */
static dt_safetensors *dt__safetensors_read_header_or_why(const char *path, char *why, size_t why_n) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);  /* a FIFO does not block the look (dt__read_file) */
    FILE *f = NULL;
    unsigned char len8[8];
    struct stat s;
    if (fd >= 0 && fstat(fd, &s) == 0 && !S_ISREG(s.st_mode)) {
        close(fd);
        if (!why) dt_fail("cannot read '%s': not a regular file", path);
        snprintf(why, why_n, "cannot read '%s': not a regular file", path);
        return NULL;
    }
    if (fd >= 0) { fcntl(fd, F_SETFL, 0); f = fdopen(fd, "rb"); }
    if (!f || fstat(fileno(f), &s) != 0) {
        int e = errno;
        if (!f && fd >= 0) close(fd);
        if (f) fclose(f);
        if (!why) dt_fail("cannot read '%s': %s", path, strerror(e));
        snprintf(why, why_n, "cannot read '%s': %s", path, strerror(e));
        return NULL;
    }
    size_t have = fread(len8, 1, 8, f);
    uint64_t hlen = 0;
    for (size_t i = 0; i < have; i++) hlen |= (uint64_t)len8[i] << (8 * i);
    if (have == 8 && hlen > (uint64_t)s.st_size - 8) hlen = 0;      /* the parser names the lie */
    unsigned char *buf = (unsigned char *)malloc(8 + (size_t)hlen + 1);
    if (!buf) dt_fail("out of memory reading '%s'", path);
    memcpy(buf, len8, have);
    if (have == 8) have += fread(buf + 8, 1, (size_t)hlen, f);
    fclose(f);
    return dt__safetensors_parse(path, buf, have, (size_t)s.st_size, why, why_n);
}
static dt_safetensors *dt__safetensors_read_header(const char *path) { return dt__safetensors_read_header_or_why(path, NULL, 0); }

void dt_safetensors_close(dt_safetensors *st) {
    if (!st) return;
    for (int i = 0; i < st->n; i++) free(st->t[i].name);
    for (int i = 0; i < 2 * st->nmeta; i++) free(st->meta[i]);
    free(st->t); free(st->meta); free(st->buf); free(st);
}

const char *dt_safetensors_meta(dt_safetensors *st, const char *key) {
    for (int i = 0; i < st->nmeta; i++) if (!strcmp(st->meta[2 * i], key)) return st->meta[2 * i + 1];
    return NULL;
}

static void dt__shape_str(char *out, size_t n, int ndim, const int64_t *shape) {
    size_t p = (size_t)snprintf(out, n, "[");
    for (int d = 0; d < ndim && p < n; d++) p += (size_t)snprintf(out + p, n - p, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (p < n) snprintf(out + p, n - p, "]");
}

/* more_rows: a file's tensor may have more rows than wanted, and the first
   ones are read (a GPT-2 position table longer than --seq-len). */
static int dt__safetensors_get_rows(dt_safetensors *st, const char *name, float *dst, int ndim, const int *shape, int more_rows) {
    for (int i = 0; i < st->n; i++) {
        dt__st_tensor *t = &st->t[i];
        if (strcmp(t->name, name)) continue;
        int same = t->ndim == ndim;
        int64_t want[8];
        for (int d = 0; d < ndim; d++) {
            want[d] = shape[d];
            if (same && t->shape[d] != shape[d] && !(d == 0 && more_rows && t->shape[0] > shape[0])) same = 0;
        }
        if (!same) {
            char a[128], b[128];
            dt__shape_str(a, sizeof a, t->ndim, t->shape);
            dt__shape_str(b, sizeof b, ndim, want);
            dt_fail("'%s': tensor '%s' has shape %s but the model expects %s (a checkpoint of another model?)",
                    st->path, name, a, b);
        }
        const unsigned char *src = st->buf + st->data_start + t->begin;
        uint64_t numel = (t->end - t->begin) / (uint64_t)(dt__safetensors_dtype_size(t->dtype) ? dt__safetensors_dtype_size(t->dtype) : 1);
        if (ndim > 0 && t->shape[0] > shape[0]) numel = numel / (uint64_t)t->shape[0] * (uint64_t)shape[0];   /* the first rows */
        if (!strcmp(t->dtype, "F32")) memcpy(dst, src, numel * 4);
        else if (!strcmp(t->dtype, "F64")) for (uint64_t k = 0; k < numel; k++) { double v; memcpy(&v, src + 8 * k, 8); dst[k] = (float)v; }
        else if (!strcmp(t->dtype, "F16")) for (uint64_t k = 0; k < numel; k++) dst[k] = dt_f16_to_f32((uint16_t)(src[2 * k] | src[2 * k + 1] << 8));
        else if (!strcmp(t->dtype, "BF16")) for (uint64_t k = 0; k < numel; k++) dst[k] = dt_bf16_to_f32((uint16_t)(src[2 * k] | src[2 * k + 1] << 8));
        else dt_fail("'%s': tensor '%s' has dtype %s; dtrain reads F32, F16, BF16 and F64", st->path, name, t->dtype);
        return 1;
    }
    return 0;
}
int dt_safetensors_get(dt_safetensors *st, const char *name, float *dst, int ndim, const int *shape) {
    return dt__safetensors_get_rows(st, name, dst, ndim, shape, 0);
}

/* The whole training state as host arrays in parameter order (m->offsets):
   the parameters (which 0) or the optimizer's moments (1, 2). A view of the
   flat buffers, or what the model's wrapper gives (dt_parallel's
   state_open): FSDP gathers every rank's shards for every rank; tensor and
   pipeline parallelism gather for the rank that writes (NULL elsewhere). To
   load (for_load 1) a model that a wrapper cut, every rank gets an array of
   the whole to fill, and cuts its part from it when it is closed. Gathers
   are collectives: every rank opens and closes alike. */
/* The state a checkpoint saves: 0 the parameters, 1 and 2 the optimizer's
   moments, each laid out as the model's flat buffer. */
static float *dt__state_buffer(dt_model *m, dt_optimizer *o, int which) {
    return which == 0 ? m->flat_data : which == 1 ? o->m : o->v;
}
static float *dt__state_open(dt_model *m, dt_optimizer *o, int which, int for_load) {
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(m->parallel, &who);
    const dt_model *whole = dt_model_whole(m);
    if (for_load && whole != m) {
        float *host = (float *)calloc((size_t)whole->numel + 1, sizeof(float));
        if (!host) dt_fail("out of memory (reading a whole checkpoint to cut: %.1f MB)", whole->numel * 4e-6);
        return host;
    }
    if (rep && rep->state_open) return rep->state_open(who, o, which);
    /* a wrapper that cut the model: the whole from its pieces, written by the
       first of the data-parallel copies (which hold the same) */
    if (rep && rep->whole_from_local) return who->data_rank == 0 ? rep->whole_from_local(who, m, dt__state_buffer(m, o, which)) : NULL;
    return dt__host_view(m->device, dt__state_buffer(m, o, which), m->numel);
}
static void dt__state_close(dt_model *m, dt_optimizer *o, int which, float *host, int written) {
    if (!host) return;
    dt_parallel *who; const dt_parallel_report *rep = dt_parallel_report_of(m->parallel, &who);
    if (rep && rep->state_close) rep->state_close(who, o, which, host, written);
    else if (rep && rep->local_from_whole) {
        if (written) rep->local_from_whole(who, m, host, dt__state_buffer(m, o, which));
        free(host);
    } else dt__host_view_close(m->device, host, dt__state_buffer(m, o, which), m->numel, written);
}
/* The parameters the state arrays above are laid out by: the model's own, or,
   cut by tensor parallelism, the whole model's (a checkpoint holds the whole,
   which any stage and any --tp reads). */
static dt_model *dt__state_layout(dt_model *m) { return (dt_model *)dt_model_whole(m); }

/* -- the names in a whole checkpoint --
   The weights under their own names in model.safetensors, the optimizer's
   moments in optimizer.safetensors under "<moment>.<name>": what PyTorch's
   state_dict and optimizer call them. state[0..2] are host arrays in
   parameter order: weights, first moment (AdamW's exp_avg, SGD's
   momentum_buffer), AdamW's exp_avg_sq (or NULL). */
static const char *dt__moment_name(int adamw, int k) {
    return k == 1 ? (adamw ? "exp_avg" : "momentum_buffer") : "exp_avg_sq";
}
/* The tensor name of parameter p in state k: "<name>", "exp_avg.<name>", ... */
static void dt__state_tensor_name(char *out, size_t n, int adamw, int k, const dt_tensor *p) {
    if (k == 0) dt__path(out, n, "%s", p->name);
    else dt__path(out, n, "%s.%s", dt__moment_name(adamw, k), p->name);
}
/* The parameters of state k as named tensors (names[] owned by the caller). */
static void dt__state_named(const dt_model *m, int adamw, int k, const float *state, dt_named_tensor *t, char **names) {
    for (int i = 0; i < m->nparams; i++) {
        const dt_tensor *p = &m->params[i];
        size_t len = strlen(p->name) + 32;
        if (!(names[i] = (char *)malloc(len))) dt_fail("out of memory (checkpoint names)");
        dt__state_tensor_name(names[i], len, adamw, k, p);
        t[i].name = names[i];
        t[i].data = state + m->offsets[i];
        t[i].ndim = p->ndim;
        for (int d = 0; d < p->ndim; d++) t[i].shape[d] = p->shape[d];
    }
}

/* Metadata as it is built: key, value, key, value, ... for dt_safetensors_write. */
typedef struct { char **kv; int n; } dt__meta_list;
static void dt__meta_add(dt__meta_list *l, const char *key, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static void dt__meta_add(dt__meta_list *l, const char *key, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    l->kv = (char **)realloc(l->kv, sizeof(char *) * 2 * (size_t)(l->n + 1));
    char *v = (char *)malloc((size_t)len + 1);
    if (!l->kv || !v) dt_fail("out of memory (checkpoint metadata)");
    va_start(ap, fmt);
    vsnprintf(v, (size_t)len + 1, fmt, ap);
    va_end(ap);
    l->kv[2 * l->n] = strdup(key);
    l->kv[2 * l->n + 1] = v;
    l->n++;
}
static void dt__meta_free(dt__meta_list *l) {
    for (int i = 0; i < 2 * l->n; i++) free(l->kv[i]);
    free(l->kv);
    l->kv = NULL; l->n = 0;
}

/* -- reading the metadata back --
   Every number is read whole and checked against the values it can take: atoi
   would read "-5" as -5 and "abc" as 0, and a run would resume at a position no
   run ever reached. */
static const char *dt__meta_required(dt_safetensors *st, const char *path, const char *key) {
    const char *v = dt_safetensors_meta(st, key);
    if (!v) dt_fail("'%s' is not a dtrain checkpoint (no '%s' in its metadata; for plain weights use --init)", path, key);
    return v;
}
/* Digits only (no sign, no space, nothing after), lo <= value <= hi. */
static int dt__whole_number(const char *s, uint64_t lo, uint64_t hi, uint64_t *v) {
    char *end;
    if (!isdigit((unsigned char)*s)) return 0;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 10);
    if (*end || errno || x < lo || x > hi) return 0;
    *v = x;
    return 1;
}
/* "a,b,c" into v[0..max): how many, or -1 when it is anything else. */
static int dt__whole_numbers(const char *s, uint64_t *v, int max) {
    for (int n = 0;; n++) {
        char part[32];
        size_t len = strcspn(s, ",");
        if (n == max || len >= sizeof part) return -1;
        memcpy(part, s, len);
        part[len] = 0;
        if (!dt__whole_number(part, 0, UINT64_MAX, &v[n])) return -1;
        if (!s[len]) return n + 1;
        s += len + 1;
    }
}
static uint64_t dt__meta_whole(dt_safetensors *st, const char *path, const char *key, uint64_t lo, uint64_t hi) {
    const char *s = dt__meta_required(st, path, key);
    uint64_t v = 0;
    if (!dt__whole_number(s, lo, hi, &v)) {
        char range[64];
        if (hi >= (uint64_t)INT64_MAX) snprintf(range, sizeof range, ">= %llu", (unsigned long long)lo);
        else snprintf(range, sizeof range, "from %llu to %llu", (unsigned long long)lo, (unsigned long long)hi);
        dt_fail("'%s': metadata '%s' is '%s', not a whole number %s", path, key, s, range);
    }
    return v;
}
static float dt__meta_positive(dt_safetensors *st, const char *path, const char *key) {
    const char *s = dt__meta_required(st, path, key);
    char *end;
    float v = strtof(s, &end);
    if (end == s || *end || !isfinite(v) || !(v > 0)) dt_fail("'%s': metadata '%s' is '%s', not a positive number", path, key, s);
    return v;
}

/* -- writing a checkpoint folder --
   Its files go into NAME.tmp, and the folder is renamed NAME once all of them
   are on disk. An older NAME is moved aside (NAME.old) for that moment and
   removed after, so NAME is always a whole checkpoint or absent. Until the
   rename every file written is on the list that dt_fail and a second Ctrl-C
   remove. */
typedef struct dt__folder { char path[4096], tmp[4096]; int slots[DT_CLEANUP_SLOTS], nslots; } dt__folder;

/* The names dtrain writes into a checkpoint folder (and their .tmp while written):
   the only files it ever removes from one. */
static int dt__checkpoint_name(const char *name) {
    static const char *const names[] = { "config.json", "model.safetensors", "optimizer.safetensors", "shards.safetensors",
                                         "adapter_config.json", "adapter_model.safetensors" };
    char stem[256];
    size_t len = strlen(name);
    if (len >= sizeof stem) return 0;
    dt__copy_str(stem, sizeof stem, name);
    if (len > 4 && !strcmp(stem + len - 4, ".tmp")) stem[len - 4] = 0;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) if (!strcmp(stem, names[k])) return 1;
    int r, n, used = 0;
    return sscanf(stem, "shard%d-of-%d.safetensors%n", &r, &n, &used) == 2 && used == (int)strlen(stem);
}
/* Does `path` hold a dtrain checkpoint (one that may be replaced)? */
static int dt__checkpoint_file(const char *dir, const char *name, char *out, size_t n);
/* A whole checkpoint's weights: model.safetensors, or with LoRA adapter_model.safetensors. */
static int dt__checkpoint_weights(const char *dir, char *out, size_t n) {
    return dt__checkpoint_file(dir, "model.safetensors", out, n) || dt__checkpoint_file(dir, "adapter_model.safetensors", out, n);
}
static int dt__is_checkpoint_folder(const char *path) {
    char file[4200];
    struct stat s;
    if (lstat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return 0;
    if (dt__checkpoint_weights(path, file, sizeof file)) return 1;
    dt__path(file, sizeof file, "%s/shards.safetensors", path);
    return access(file, F_OK) == 0;
}
/* What a crashed or replaced save left: dtrain's files in the folder, then the
   folder when that empties it. Anything else stays. */
static void dt__folder_remove(const char *path) {
    struct stat s;
    if (lstat(path, &s) != 0 || !S_ISDIR(s.st_mode)) return;
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char file[8300];
        dt__path(file, sizeof file, "%s/%s", path, e->d_name);
        if (dt__checkpoint_name(e->d_name) && lstat(file, &s) == 0 && S_ISREG(s.st_mode)) unlink(file);
    }
    if (d) closedir(d);
    rmdir(path);
}
/* A name taken by something that is not a checkpoint is refused, never
   replaced; an empty folder is taken over. */
static void dt__folder_check_free(const char *path) {
    struct stat s;
    if (lstat(path, &s) == 0 && !dt__is_checkpoint_folder(path) && !(S_ISDIR(s.st_mode) && rmdir(path) == 0))
        dt_fail("'%s' exists and is not a dtrain checkpoint: not replaced (remove it, or write elsewhere)", path);
}
/* create: this process makes NAME.tmp (the only writer, or FSDP's rank 0); the
   others only name their files in it. Each registers the folder, so that the
   last process to clean up after a failure removes it. */
static void dt__folder_open(dt__folder *w, const char *path, int create) {
    memset(w, 0, sizeof *w);
    dt__copy_str(w->path, sizeof w->path, path);
    dt__path(w->tmp, sizeof w->tmp, "%s.tmp", path);
    if (create) {
        struct stat s;
        dt__folder_check_free(path);
        dt__folder_remove(w->tmp);
        if (lstat(w->tmp, &s) == 0 && !S_ISDIR(s.st_mode))
            dt_fail("'%s' exists and is not a folder dtrain writes: not replaced (remove it, or write elsewhere)", w->tmp);
        if (mkdir(w->tmp, 0755) != 0 && errno != EEXIST)
            dt_fail("cannot create checkpoint folder '%s': %s", w->tmp, strerror(errno));
    }
    dt__cleanup_empty_folder = dt__folder_remove;    /* what a failure does with a NAME.tmp it cannot rmdir */
    w->slots[w->nslots++] = dt__cleanup_add(w->tmp);
}
static void dt__folder_file(const dt__folder *w, const char *name, char *out, size_t n) {
    dt__path(out, n, "%s/%s", w->tmp, name);
}
static void dt__folder_wrote(dt__folder *w, const char *file) {
    if (w->nslots < DT_CLEANUP_SLOTS) w->slots[w->nslots++] = dt__cleanup_add(file);
}
static void dt__folder_forget(dt__folder *w) {
    for (int k = 0; k < w->nslots; k++) dt__cleanup_done(w->slots[k]);
    w->nslots = 0;
}
/* Files of the user's in an older NAME (a tokenizer, notes) go on with the
   new one: moved into NAME.tmp before the swap, so that what is moved aside
   holds dtrain's files alone and goes whole. */
static void dt__folder_carry_over(const char *from, const char *to) {
    DIR *d = opendir(from);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char src[8300], dst[8300];
        struct stat s;
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || dt__checkpoint_name(e->d_name)) continue;
        dt__path(src, sizeof src, "%s/%s", from, e->d_name);
        dt__path(dst, sizeof dst, "%s/%s", to, e->d_name);
        if (lstat(dst, &s) == 0) continue;
        if (rename(src, dst) != 0) dt_fail("cannot move '%s' into the new checkpoint '%s': %s", src, to, strerror(errno));
    }
    if (d) closedir(d);
}
/* NAME.tmp becomes NAME. An older NAME is moved to NAME.old first and removed
   after; a save cut off between the two renames leaves it there, whole, and
   --resume auto takes it when NAME is missing. */
static void dt__folder_commit(dt__folder *w) {
    char old[4200];
    struct stat s;
    int fd = open(w->tmp, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) { fsync(fd); close(fd); }               /* the files' names on disk before the folder's */
    dt__folder_check_free(w->path);
    dt__folder_forget(w);                                 /* from here on every file is a whole checkpoint's */
    dt__path(old, sizeof old, "%s.old", w->path);
    dt__folder_carry_over(w->path, w->tmp);               /* the newer copy of a file first */
    dt__folder_carry_over(old, w->tmp);
    if (lstat(w->path, &s) == 0) {
        dt__folder_remove(old);
        if (rename(w->path, old) != 0)
            dt_fail("cannot move the older checkpoint '%s' aside to '%s': %s", w->path, old, strerror(errno));
    }
    if (rename(w->tmp, w->path) != 0) {
        int e = errno;
        rename(old, w->path);
        dt_fail("could not rename '%s' to '%s': %s (the checkpoint written is in '%s')", w->tmp, w->path, strerror(e), w->tmp);
    }
    dt__folder_remove(old);
}

/* config.json, in the words of the library that has the same model (the Hugging Face chapter). */
static void dt__adapter_config_json(FILE *f, const dt_model *m);
static void dt__config_json(FILE *f, const dt_model_config *c);   /* the Hugging Face chapter's */
/* config.json, or a LoRA model's adapter_config.json */
static void dt__folder_write_config(dt__folder *w, const dt_model *m) {
    char file[4200];
    dt__folder_file(w, m->base ? "adapter_config.json" : "config.json", file, sizeof file);
    FILE *f = fopen(file, "w");
    if (!f) dt_fail("cannot write '%s': %s", file, strerror(errno));
    dt__folder_wrote(w, file);
    if (m->base) dt__adapter_config_json(f, m);
    else dt__config_json(f, &m->cfg);
    int ok = !ferror(f) && fflush(f) == 0 && fsync(fileno(f)) == 0, e = errno;
    if (fclose(f) != 0 && ok) { ok = 0; e = errno; }
    if (!ok) dt_fail("could not write '%s': %s", file, strerror(e ? e : EIO));
}

/* A whole checkpoint's files: config.json, the moments (tagged with the step,
   so that a file from another save is found out) and the weights, whose
   metadata is the run's. */
static void dt__folder_write_whole(dt__folder *w, const dt_model *m, int adamw, float *const state[3], dt__meta_list *meta,
                                   int64_t step) {
    char file[4200];
    dt_named_tensor *t = (dt_named_tensor *)calloc((size_t)m->nparams * 2 + 1, sizeof *t);
    char **names = (char **)calloc((size_t)m->nparams * 2 + 1, sizeof(char *));
    if (!t || !names) dt_fail("out of memory (writing checkpoint '%s')", w->path);
    dt__folder_write_config(w, m);
    int n = 0;
    for (int k = 1; k < 3; k++)
        if (state[k]) { dt__state_named(m, adamw, k, state[k], t + n, names + n); n += m->nparams; }
    dt__meta_list om = { NULL, 0 };
    dt__meta_add(&om, "dtrain_format", "optimizer-2");
    dt__meta_add(&om, "optimizer", "%s", adamw ? "adamw" : "sgd");
    dt__meta_add(&om, "step", "%lld", (long long)step);
    dt__folder_file(w, "optimizer.safetensors", file, sizeof file);
    dt_safetensors_write(file, t, n, (const char *const *)om.kv, om.n);
    dt__folder_wrote(w, file);
    dt__meta_free(&om);
    for (int i = 0; i < n; i++) free(names[i]);
    dt__state_named(m, adamw, 0, state[0], t, names);
    dt__folder_file(w, m->base ? "adapter_model.safetensors" : "model.safetensors", file, sizeof file);
    dt_safetensors_write(file, t, m->nparams, (const char *const *)meta->kv, meta->n);
    dt__folder_wrote(w, file);
    for (int i = 0; i < m->nparams; i++) free(names[i]);
    free(names);
    free(t);
}

/* -- reading a checkpoint folder --
   The file that describes it: shards.safetensors, the index of a sharded
   checkpoint, or model.safetensors. A file given instead of a folder, an
   older dtrain's one-file checkpoint among them, is refused by name. */
static int dt__is_sharded(dt_safetensors *st);
static int dt__checkpoint_file(const char *dir, const char *name, char *out, size_t n) {
    dt__path(out, n, "%s/%s", dir, name);
    return access(out, F_OK) == 0;
}
static dt_safetensors *dt__checkpoint_open(const char *path) {
    struct stat s;
    char file[4200];
    if (stat(path, &s) != 0) {
        int e = errno;
        dt__path(file, sizeof file, "%s.old", path);
        if (access(file, F_OK) == 0)
            dt_fail("cannot read checkpoint '%s': %s (a save of it was cut off; the one before is in '%s')", path, strerror(e), file);
        dt_fail("cannot read checkpoint '%s': %s", path, strerror(e));
    }
    if (!S_ISDIR(s.st_mode)) {
        dt_safetensors *st = dt__safetensors_read_header(path);
        const char *old = dt_safetensors_meta(st, "format");
        dt__is_sharded(st);                    /* one rank's shard is named as such */
        if (old && !strncmp(old, "dtrain-", 7))
            dt_fail("'%s' is a one-file checkpoint of an earlier dtrain (%s): checkpoints are folders now (model.safetensors, "
                    "optimizer.safetensors, config.json); --init takes this file's weights", path, old);
        dt_fail("'%s' is a file, not a checkpoint folder (one holds model.safetensors, optimizer.safetensors and "
                "config.json); --init takes the weights of a file", path);
    }
    if (dt__checkpoint_file(path, "shards.safetensors", file, sizeof file)) return dt_safetensors_read(file);
    if (!dt__checkpoint_weights(path, file, sizeof file))
        dt_fail("'%s' is not a dtrain checkpoint: it holds neither model.safetensors nor shards.safetensors (nor, from a "
                "LoRA run, adapter_model.safetensors)", path);
    dt_safetensors *st = dt_safetensors_read(file);
    if (!dt_safetensors_meta(st, "dtrain_format"))
        dt_fail("'%s' is not a dtrain checkpoint (no 'dtrain_format' in its metadata; for weights alone use --init)", file);
    return st;
}

/* -- sharded checkpoints --
   FSDP saves without gathering: each rank writes what it holds, its slice of
   every unit of the weights and of the optimizer's moments (1-D tensors
   "params", "optimizer.exp_avg", ..., the padding included), to its own file
   in the checkpoint's folder, shard<r>-of-<N>.safetensors. When every shard is
   on disk, rank 0 writes the index, shards.safetensors: a safetensors file with
   no tensors, whose metadata is a whole checkpoint's plus the layout (the
   ranks, each unit's size) and each shard file's size; and config.json. The
   folder is renamed into place last, so it never names a shard that is not
   complete. `path` below is the checkpoint's folder. */
static void dt__shard_path(char *out, size_t n, const char *path, int rank, int world) {
    dt__path(out, n, "%s/shard%d-of-%d.safetensors", path, rank, world);
}
/* Is this the index of a sharded checkpoint? (One of its shards is refused: it is not the whole.) */
static int dt__is_sharded(dt_safetensors *st) {
    const char *old = dt_safetensors_meta(st, "format");
    if (old && (!strcmp(old, "dtrain-shard-1") || !strcmp(old, "dtrain-sharded-checkpoint-1")))
        dt_fail("'%s' is part of a sharded checkpoint of an earlier dtrain (%s): put it together with that dtrain's "
                "tools/consolidate", st->path, old);
    const char *format = dt_safetensors_meta(st, "dtrain_format");
    if (format && !strcmp(format, "shard-2"))
        dt_fail("'%s' is one rank's shard of a sharded checkpoint: give the checkpoint's folder instead", st->path);
    return dt_safetensors_meta(st, "shards") != NULL;
}

/* Each unit's size, as the index recorded it, checked against the model's. */
static int dt__sharded_layout(dt_safetensors *index, const char *path, const dt_model *m, int64_t *unit_numel) {
    int world = (int)dt__meta_whole(index, index->path, "shards", 1, DT_MAX_RANKS);
    const char *s = dt__meta_required(index, index->path, "unit_numel");
    uint64_t *v = (uint64_t *)malloc(sizeof(uint64_t) * ((size_t)m->nunits + 1));
    if (!v) dt_fail("out of memory (reading '%s')", path);
    int n = dt__whole_numbers(s, v, m->nunits + 1);
    if (n < 0) dt_fail("'%s': metadata 'unit_numel' is '%s', not whole numbers separated by commas", index->path, s);
    for (int k = 0; k < n && k < m->nunits; k++) unit_numel[k] = v[k] > (uint64_t)INT64_MAX ? -1 : (int64_t)v[k];
    free(v);
    int same = n == m->nunits;
    for (int k = 0; same && k < n; k++) {
        int64_t end = m->unit_first[k + 1] < m->nparams ? m->offsets[m->unit_first[k + 1]] : m->numel;
        same = unit_numel[k] == end - m->offsets[m->unit_first[k]];
    }
    if (!same) dt_fail("'%s' was sharded by units that are not this model's (a checkpoint of another model?)", path);
    return world;
}

static int dt__sharded_layout_is(dt_safetensors *index, const char *path, const dt_model *m, int world) {
    int64_t *unit_numel = (int64_t *)calloc((size_t)m->nunits + 1, sizeof(int64_t));
    int shards = dt__sharded_layout(index, path, m, unit_numel);
    free(unit_numel);
    return shards == world;
}

/* Is rank r's shard file there, and as long as the index says? Every rank
   checks every file before reading any, so all of them name the one at fault. */
static void dt__shard_check(dt_safetensors *index, const char *path, int rank, int world, char *file, size_t n) {
    char key[32];
    struct stat s;
    dt__shard_path(file, n, path, rank, world);
    snprintf(key, sizeof key, "shard.%d.bytes", rank);
    if (!dt_safetensors_meta(index, key)) dt_fail("'%s': the index has no entry for shard %d of %d", path, rank, world);
    uint64_t bytes = dt__meta_whole(index, index->path, key, 0, INT64_MAX);
    if (stat(file, &s) != 0)
        dt_fail("sharded checkpoint '%s': shard %d of %d, '%s', is missing: %s", path, rank, world, file, strerror(errno));
    if ((uint64_t)s.st_size != bytes)
        dt_fail("sharded checkpoint '%s': shard %d of %d, '%s', has %lld bytes but the index recorded %llu "
                "(truncated, or written by another save)", path, rank, world, file, (long long)s.st_size,
                (unsigned long long)bytes);
}

/* Rank r's shard file, after checking it is there, whole, and of this save. */
static dt_safetensors *dt__shard_open(dt_safetensors *index, const char *path, int rank, int world) {
    char file[4096];
    dt__shard_check(index, path, rank, world, file, sizeof file);
    dt_safetensors *sh = dt_safetensors_read(file);
    const char *step = dt_safetensors_meta(sh, "step"), *want = dt_safetensors_meta(index, "step");
    const char *who = dt_safetensors_meta(sh, "rank");
    if (!step || !want || strcmp(step, want) || !who || dt__meta_whole(sh, file, "rank", 0, DT_MAX_RANKS - 1) != (uint64_t)rank)
        dt_fail("'%s' is not shard %d of checkpoint '%s' at step %s (it says rank %s, step %s)", file, rank, path,
                want ? want : "?", who ? who : "?", step ? step : "?");
    return sh;
}

/* One tensor of a shard file into dst (shard_numel floats), or an error naming the file. */
static void dt__shard_get(dt_safetensors *sh, int adamw, int k, float *dst, int64_t shard_numel) {
    char name[64];
    int len = (int)shard_numel;
    if (k == 0) snprintf(name, sizeof name, "params");
    else snprintf(name, sizeof name, "optimizer.%s", dt__moment_name(adamw, k));
    if (shard_numel > INT_MAX || !dt_safetensors_get(sh, name, dst, 1, &len))
        dt_fail("'%s' has no tensor '%s' of %lld elements", sh->path, name, (long long)shard_numel);
}

/* Every rank's shard put back together in parameter order, whatever the world
   size reading it: rank r held elements [r * s, (r + 1) * s) of each unit, s =
   the unit's size / N rounded up; what lies past the unit's end is padding. */
static void dt__sharded_assemble(dt_safetensors *index, const char *path, const dt_model *m, int adamw, float *state[3]) {
    int64_t *unit_numel = (int64_t *)calloc((size_t)m->nunits + 1, sizeof(int64_t)), shard_numel = 0;
    int world = dt__sharded_layout(index, path, m, unit_numel);
    char file[4096];
    for (int r = 0; r < world; r++) dt__shard_check(index, path, r, world, file, sizeof file);
    for (int k = 0; k < m->nunits; k++) shard_numel += (unit_numel[k] + world - 1) / world;
    float *buf = (float *)malloc((size_t)shard_numel * sizeof(float) + 1);
    if (!buf) dt_fail("out of memory (reading '%s')", path);
    for (int r = 0; r < world; r++) {
        dt_safetensors *sh = dt__shard_open(index, path, r, world);
        for (int k = 0; k < 3; k++) {
            if (!state[k]) continue;
            dt__shard_get(sh, adamw, k, buf, shard_numel);
            int64_t at = 0;
            for (int u = 0; u < m->nunits; u++) {
                int64_t s = (unit_numel[u] + world - 1) / world, lo = r * s, hi = lo + s < unit_numel[u] ? lo + s : unit_numel[u];
                if (hi > lo) memcpy(state[k] + m->offsets[m->unit_first[u]] + lo, buf + at, (size_t)(hi - lo) * sizeof(float));
                at += s;
            }
        }
        dt_safetensors_close(sh);
    }
    free(buf);
    free(unit_numel);
}

/* --resume auto: the checkpoint of the most steps in --save-dir, or NULL to
   start fresh -- what a requeued job runs, unchanged, after preemption. Every
   folder there should be whole: a checkpoint is renamed into place once
   written (NAME.tmp, being written, is passed over; NAME.old, being replaced,
   counts only when a save was cut off before NAME took its place). One that
   is not -- a file cut short or damaged since, a shard missing -- is passed
   over for the newest whole one, saying so: its files' headers and sizes are
   read, not their data. Ties go to the later name, so every rank picks the
   same folder. A one-file checkpoint of an earlier dtrain that would have been
   the newest is an error, not a silent fresh start. */
typedef struct { long long step; char path[4096]; } dt__candidate;
static int dt__candidate_newer(const void *a, const void *b) {
    const dt__candidate *x = (const dt__candidate *)a, *y = (const dt__candidate *)b;
    return x->step != y->step ? (x->step > y->step ? -1 : 1) : -strcmp(x->path, y->path);
}
/* Are the files of checkpoint folder `path` whole, as far as their headers and sizes tell? */
static int dt__checkpoint_whole(const char *path, dt_safetensors *meta, char *why, size_t n) {
    char file[4200];
    if (dt_safetensors_meta(meta, "shards")) {
        const char *shards = dt_safetensors_meta(meta, "shards");
        int world = atoi(shards);
        if (world < 1 || world > DT_MAX_RANKS) { snprintf(why, n, "its index says %.20s shards", shards); return 0; }
        for (int r = 0; r < world; r++) {
            char key[32];
            struct stat s;
            dt__shard_path(file, sizeof file, path, r, world);
            snprintf(key, sizeof key, "shard.%d.bytes", r);
            const char *bytes = dt_safetensors_meta(meta, key);
            if (stat(file, &s) != 0) { snprintf(why, n, "shard %d of %d is missing", r, world); return 0; }
            if (!bytes || strtoull(bytes, NULL, 10) != (unsigned long long)s.st_size) {
                snprintf(why, n, "shard %d of %d has %lld bytes, the index recorded %.20s", r, world, (long long)s.st_size,
                         bytes ? bytes : "none");
                return 0;
            }
        }
        return 1;
    }
    dt__path(file, sizeof file, "%s/optimizer.safetensors", path);
    dt_safetensors *st = dt__safetensors_read_header_or_why(file, why, n);
    dt_safetensors_close(st);
    return st != NULL;
}
static const char *dt__newest_checkpoint(const char *dir, char *out, size_t n) {
    DIR *d = opendir(dir);
    struct dirent *e;
    long long best = -1, best_old_format = -1;
    char old_format[4096] = "", why[600];
    dt__candidate *c = NULL;
    int nc = 0, cap = 0, unreadable = 0, talk = dt__ctx.rank == 0;
    out[0] = 0;
    while (d && (e = readdir(d))) {
        size_t len = strlen(e->d_name);
        char path[4096], file[4200];
        struct stat s;
        if (e->d_name[0] == '.' || (len > 4 && !strcmp(e->d_name + len - 4, ".tmp"))) continue;
        dt__path(path, sizeof path, "%s/%s", dir, e->d_name);
        if (len > 4 && !strcmp(e->d_name + len - 4, ".old")) {
            dt__path(file, sizeof file, "%.*s", (int)strlen(path) - 4, path);
            if (access(file, F_OK) == 0) continue;            /* replaced, and its successor is there */
        }
        if (stat(path, &s) == 0 && S_ISREG(s.st_mode) && len > 12 && !strcmp(e->d_name + len - 12, ".safetensors")) {
            dt_safetensors *st = dt__safetensors_read_header_or_why(path, why, sizeof why);
            const char *format = dt_safetensors_meta(st, "format"), *step = dt_safetensors_meta(st, "step");
            if (format && !strncmp(format, "dtrain-", 7) && strstr(format, "checkpoint") && step && atoll(step) > best_old_format) {
                best_old_format = atoll(step);
                dt__copy_str(old_format, sizeof old_format, path);
            }
            dt_safetensors_close(st);
            continue;
        }
        if (stat(path, &s) != 0 || !S_ISDIR(s.st_mode)) continue;
        if (!dt__checkpoint_file(path, "shards.safetensors", file, sizeof file) && !dt__checkpoint_weights(path, file, sizeof file))
            continue;
        dt_safetensors *st = dt__safetensors_read_header_or_why(file, why, sizeof why);
        if (!st) {
            if (talk) dt_warn("--resume auto: passing over '%s', which cannot be read: %s", path, why);
            unreadable++;
            continue;
        }
        const char *format = dt_safetensors_meta(st, "dtrain_format"), *step = dt_safetensors_meta(st, "step");
        if (format && strstr(format, "checkpoint") && step) {
            if (nc == cap && !(c = (dt__candidate *)realloc(c, sizeof *c * (size_t)(cap = cap ? 2 * cap : 16))))
                dt_fail("out of memory (--resume auto)");
            c[nc].step = atoll(step);
            dt__copy_str(c[nc++].path, sizeof c->path, path);
        }
        dt_safetensors_close(st);
    }
    if (d) closedir(d);
    if (nc > 1) qsort(c, (size_t)nc, sizeof *c, dt__candidate_newer);
    for (int k = 0; k < nc && !out[0]; k++) {
        char file[4200];
        if (!dt__checkpoint_file(c[k].path, "shards.safetensors", file, sizeof file)) dt__checkpoint_weights(c[k].path, file, sizeof file);
        dt_safetensors *meta = dt__safetensors_read_header(file);
        if (dt__checkpoint_whole(c[k].path, meta, why, sizeof why)) {
            best = c[k].step;
            dt__copy_str(out, n, c[k].path);
            if (talk && (k > 0 || unreadable))       /* something newer was passed over: say what is taken instead */
                printf("--resume auto: resuming '%s' (step %lld), the newest whole checkpoint in '%s'\n", out, best, dir);
        } else if (talk)
            dt_warn("--resume auto: passing over '%s' (step %lld), which is not whole: %s", c[k].path, c[k].step, why);
        dt_safetensors_close(meta);
    }
    free(c);
    if ((nc > 0 || unreadable > 0) && !out[0])        /* not a fresh start: that would train over them */
        dt_fail("--resume auto: no checkpoint in '%s' is whole (see above): resume one by name with --resume, or move "
                "them out of --save-dir to start afresh", dir);
    if (best_old_format >= 0 && best_old_format >= best)
        dt_fail("--resume auto: '%s' (step %lld) is a one-file checkpoint of an earlier dtrain, newer than any checkpoint "
                "folder in '%s': resume it with that dtrain, or move it out of --save-dir", old_format, best_old_format, dir);
    return out[0] ? out : NULL;
}

