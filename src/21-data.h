//@ machinery: data -- image folders, CIFAR-10, text and token files, instruction data, the loader, the synthetic sets
/* ---- data ---------------------------------------------------------------------- */

typedef struct dt_dataset {
    int64_t n;                 /* images, or text sequences */
    int channels, size, num_classes;
    uint8_t *pixels;           /* n images, channels first, each channels*size*size bytes */
    int32_t *labels;
    char **class_names;        /* num_classes names (folder names, or CIFAR-10's) */
    char source[512];
    int64_t capacity;          /* images allocated (n shrinks when the set is sliced) */
    /* Text: a run of token ids (num_classes is the vocabulary). Sequence i is
       tokens [i*seq_len, (i+1)*seq_len]: seq_len inputs, and the same shifted
       by one as the labels, so neighbours share one token. */
    int32_t *tokens;
    int64_t ntokens, tokens_capacity;
    int seq_len;
    /* Instruction data (JSON lines): every example a sequence of its own.
       Sequence i is tokens [i*seq_len, (i+1)*seq_len) with its labels at the
       same places here, DT_IGNORE_INDEX where the loss ignores a position (a
       prompt, the padding). NULL for plain text. */
    int32_t *targets;
} dt_dataset;

/* Load `split` ("train" or "val") of an image folder (DIR/split/<class>/<file>)
   or of a CIFAR-10 binary folder, every image resized to size x size RGB. For
   "val" of an image folder, class names must match `classes_from` (may be NULL). */
void dt_dataset_load(const char *dir, const char *split, int size,
                     const dt_dataset *classes_from, dt_dataset *ds);
void dt_dataset_free(dt_dataset *ds);
/* Text: a .txt file, or a folder of them joined in name order, read as bytes
   (vocabulary 256); or, is_tokens, a file of token ids: a NumPy .npy array
   (one dimension; uint16, uint32, int32 or int64), JSON lines of instruction
   examples (a file whose first character, past white space and a UTF-8
   byte-order mark, is `{`: see "instruction data" below), or else little-endian uint16 ids (vocab 0: the largest id + 1). The
   last val_fraction of the tokens (of the examples, for JSON lines), by
   position, is the validation set. */
void dt_text_load(const char *path, int is_tokens, int vocab, int seq_len, double val_fraction, dt_dataset *train,
                  dt_dataset *val);
/* Write `bytes` of English-like generated text (sentences from a small grammar
   over a few hundred words) to path: the built-in text of --model gpt. */
void dt_synthetic_text_write(const char *path, int64_t bytes, uint64_t seed);
/* The loss to beat, in nats per token: the cross-entropy of `eval`'s tokens
   under the token frequencies of `train` (a model that ignores context). */
double dt_unigram_loss(const dt_dataset *train, const dt_dataset *eval);
/* Keep images (or sequences) [start, end) only: --start-idx/--end-idx. */
void dt_dataset_slice(dt_dataset *ds, int64_t start, int64_t end);

/* Decode one image file to 8-bit RGB (grey and alpha are converted) and resize
   it to size x size. Returns NULL and a reason in err when it cannot. */
uint8_t *dt_image_load_rgb(const char *path, int size, char *err, size_t errlen);
/* Bilinear resize of channels-first 8-bit planes. */
void dt_image_resize(const uint8_t *src, int channels, int w, int h, uint8_t *dst, int dw, int dh);

/* The sample order of one epoch for one rank, like PyTorch's DistributedSampler:
   a permutation seeded by (seed, epoch), padded by wrapping to a multiple of
   world, then every world-th index starting at rank. Writes ceil(n/world)
   indices to out and returns that count. */
int64_t dt_sampler_indices(int64_t n, uint64_t seed, int epoch, int shuffle, int rank, int world,
                           int64_t *out);

typedef struct dt_loader {
    const dt_dataset *ds;
    int batch_size, rank, world, shuffle, augment, drop_last;
    uint64_t seed;
    int epoch;
    int64_t *order, count, pos;
    int64_t *counted;          /* instruction data: the targets that count in each batch, every rank's together */
} dt_loader;

dt_loader dt_loader_create(const dt_dataset *ds, int batch_size, uint64_t seed, int shuffle,
                           int augment, int drop_last, int rank, int world);
void dt_loader_free(dt_loader *l);
/* Begin `epoch`, skipping the first `skip_batches` (resume in mid-epoch). */
void dt_loader_start_epoch(dt_loader *l, int epoch, int64_t skip_batches);
/* The next batch, in the per-step arena; 0 at the end of the epoch. */
int dt_loader_next(dt_loader *l, dt_batch *b);
int64_t dt_loader_batches_per_epoch(const dt_loader *l);
/* Instruction data: the targets that count (not DT_IGNORE_INDEX) in the next
   `batches` batches of every rank of the loader's world. */
int64_t dt_loader_counted_targets(const dt_loader *l, int batches);

/* Write a learnable 10-class synthetic image set to dir/train and dir/val (PNG
   with stb, PPM without): coloured shapes on noisy backgrounds. */
void dt_synthetic_write(const char *dir, int n_train, int n_val, int size, uint64_t seed);

//@ implementation
/* ==== data ===================================================================
   Images are decoded once, resized, and kept in memory as bytes (a 50,000-image
   32x32 set is 150 MB). Each epoch the sampler deals out a fresh permutation,
   the same one on every rank, and each rank takes every world-th index: that
   is all "sharding the data" means. Augmentation draws its randomness from a
   hash of (seed, epoch, image index), so a resumed run crops and flips exactly
   as the uninterrupted one would have. */

static int dt__name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Sorted entries of a folder (no hidden files); want_dirs picks folders or files. */
static char **dt__list_dir(const char *path, int want_dirs, int *count) {
    DIR *d = opendir(path);
    if (!d) dt_fail("cannot open folder '%s': %s", path, strerror(errno));
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (ent->d_name[0] == '.') continue;
        char full[4096];
        struct stat st;
        dt__path(full, sizeof full, "%s/%s", path, ent->d_name);
        if (stat(full, &st) != 0) continue;
        if (want_dirs != S_ISDIR(st.st_mode)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = (char **)realloc(names, cap * sizeof(char *));
            if (!names) dt_fail("out of memory listing '%s'", path);
        }
        names[n] = (char *)malloc(strlen(ent->d_name) + 1);
        if (!names[n]) dt_fail("out of memory listing '%s'", path);
        strcpy(names[n++], ent->d_name);
    }
    closedir(d);
    if (n > 1) qsort(names, n, sizeof(char *), dt__name_cmp);
    *count = n;
    return names;
}
static void dt__free_names(char **names, int n) { for (int i = 0; i < n; i++) free(names[i]); free(names); }

/* A whole file into memory, or NULL with errno set (dt__read_failure says
   why). Regular files only: a FIFO would block the run until something wrote
   to it (one in an image folder hung a run), a device such as /dev/zero never
   ends. Opened without blocking, then looked at, before anything is read. */
static DT_THREAD_LOCAL int dt__read_not_regular;
static const char *dt__read_failure(void) {
    return dt__read_not_regular ? "not a regular file (a FIFO, a device or a socket): dtrain reads files" : strerror(errno);
}
static unsigned char *dt__read_file(const char *path, size_t *len) {
    struct stat st;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    dt__read_not_regular = 0;
    if (fd < 0) return NULL;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        int e = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        dt__read_not_regular = e == EINVAL;
        close(fd);
        errno = e;
        return NULL;
    }
    fcntl(fd, F_SETFL, 0);
    FILE *f = fdopen(fd, "rb");
    if (!f) { close(fd); return NULL; }
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = (unsigned char *)malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        unsigned char *bigger = (unsigned char *)realloc(buf, cap * 2);
        if (!bigger) { free(buf); buf = NULL; break; }
        buf = bigger;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(buf); return NULL; }
    *len = n;
    return buf;
}

/* A JSON reader just big enough for what dtrain reads: JSON-lines token data
   (below), safetensors headers and config.json (the checkpoints and hugging-face chapters). */
typedef struct { const char *s; size_t pos, len; int ok; } dt__json;
static void dt__json_ws(dt__json *j) { while (j->pos < j->len && isspace((unsigned char)j->s[j->pos])) j->pos++; }
static int dt__json_peek(dt__json *j) { dt__json_ws(j); return j->pos < j->len ? j->s[j->pos] : -1; }
static int dt__json_eat(dt__json *j, char c) {
    if (dt__json_peek(j) == c) { j->pos++; return 1; }
    j->ok = 0;
    return 0;
}
/* A string, decoded; NULL (and j->ok 0) when it is not one. Its buffer is
   as long as the string, not the rest of the text (a header of 120,000 names
   once took 538 MB and 9 s). \u0000 is refused: every string dtrain reads is
   a name or a value that a NUL would cut short. */
static char *dt__json_str(dt__json *j) {
    if (!dt__json_eat(j, '"')) return NULL;
    size_t end = j->pos;
    while (end < j->len && j->s[end] != '"') end += j->s[end] == '\\' ? 2 : 1;
    if (end >= j->len) { j->ok = 0; return NULL; }
    char *out = (char *)malloc(end - j->pos + 1);
    if (!out) dt_fail("out of memory reading a JSON string (%zu bytes)", end - j->pos);
    size_t n = 0;
    while (j->pos < j->len && j->s[j->pos] != '"') {
        char c = j->s[j->pos++];
        if (c == '\\' && j->pos < j->len) {
            char e = j->s[j->pos++];
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int k = 0; k < 4; k++) {
                    char hx = j->pos < j->len ? j->s[j->pos++] : 0;
                    if (!isxdigit((unsigned char)hx)) v = 0, k = 4;       /* not four hex digits: refused below */
                    else v = v * 16 + (unsigned)(isdigit((unsigned char)hx) ? hx - '0' : (tolower((unsigned char)hx) - 'a' + 10));
                }
                if (v == 0) { free(out); j->ok = 0; return NULL; }
                c = v < 128 ? (char)v : '?';
                break;
            }
            default: c = e;
            }
        }
        out[n++] = c;
    }
    out[n] = 0;
    if (!dt__json_eat(j, '"')) { free(out); return NULL; }
    return out;
}
static int64_t dt__json_int(dt__json *j) {
    dt__json_ws(j);
    int neg = 0;
    int64_t v = 0;
    if (j->pos < j->len && j->s[j->pos] == '-') { neg = 1; j->pos++; }
    if (j->pos >= j->len || !isdigit((unsigned char)j->s[j->pos])) { j->ok = 0; return 0; }
    while (j->pos < j->len && isdigit((unsigned char)j->s[j->pos])) {
        if (v > (INT64_MAX - 9) / 10) { j->ok = 0; return 0; }
        v = v * 10 + (j->s[j->pos++] - '0');
    }
    return neg ? -v : v;
}
static void dt__json_skip(dt__json *j, int depth) {       /* any value we do not need */
    int c = dt__json_peek(j);
    if (depth > 64) { j->ok = 0; return; }
    if (c == '"') free(dt__json_str(j));
    else if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        j->pos++;
        if (dt__json_peek(j) == close) { j->pos++; return; }
        while (j->ok) {
            if (c == '{') { free(dt__json_str(j)); dt__json_eat(j, ':'); }
            dt__json_skip(j, depth + 1);
            if (dt__json_peek(j) == ',') { j->pos++; continue; }
            dt__json_eat(j, close);
            return;
        }
    } else {                                              /* a number, true, false or null: something */
        size_t from = j->pos;
        while (j->pos < j->len && j->s[j->pos] && (isalnum((unsigned char)j->s[j->pos]) || strchr("+-.", j->s[j->pos]))) j->pos++;
        if (j->pos == from) j->ok = 0;
    }
}
static int dt__json_int_array(dt__json *j, int64_t *out, int max) {
    int n = 0;
    if (!dt__json_eat(j, '[')) return 0;
    if (dt__json_peek(j) == ']') { j->pos++; return 0; }
    while (j->ok) {
        int64_t v = dt__json_int(j);
        if (n < max) out[n] = v; else j->ok = 0;
        n++;
        if (dt__json_peek(j) == ',') { j->pos++; continue; }
        dt__json_eat(j, ']');
        break;
    }
    return n;
}

void dt_image_resize(const uint8_t *src, int channels, int w, int h, uint8_t *dst, int dw, int dh) {
    /* bilinear with pixel centres aligned (PyTorch's align_corners=False) */
    float sx = (float)w / dw, sy = (float)h / dh;
    for (int c = 0; c < channels; c++)
        for (int y = 0; y < dh; y++) {
            float fy = (y + 0.5f) * sy - 0.5f;
            if (fy < 0) fy = 0;
            int y0 = (int)fy, y1 = y0 + 1 < h ? y0 + 1 : h - 1;
            float wy = fy - y0;
            for (int x = 0; x < dw; x++) {
                float fx = (x + 0.5f) * sx - 0.5f;
                if (fx < 0) fx = 0;
                int x0 = (int)fx, x1 = x0 + 1 < w ? x0 + 1 : w - 1;
                float wx = fx - x0;
                const uint8_t *p = src + (size_t)c * w * h;
                float v = (1 - wy) * ((1 - wx) * p[y0 * w + x0] + wx * p[y0 * w + x1]) +
                          wy * ((1 - wx) * p[y1 * w + x0] + wx * p[y1 * w + x1]);
                dst[((size_t)c * dh + y) * dw + x] = (uint8_t)(v + 0.5f);
            }
        }
}

/* PPM (P3, P6) and PGM (P2, P5), read without any library. */
static uint8_t *dt__decode_pnm(const unsigned char *buf, size_t len, int *w, int *h, char *err, size_t errlen) {
    size_t pos = 2;
    if (len < 2 || buf[0] != 'P' || (buf[1] != '2' && buf[1] != '3' && buf[1] != '5' && buf[1] != '6')) {
#ifdef DT_HAVE_STB
        snprintf(err, errlen, "not an image");
#else
        snprintf(err, errlen, "not a PPM/PGM image (this build reads only PPM/PGM; install libstb-dev "
                              "and rebuild for PNG, JPEG and BMP)");
#endif
        return NULL;
    }
    int binary = buf[1] == '5' || buf[1] == '6', chans = (buf[1] == '3' || buf[1] == '6') ? 3 : 1;
    long vals[3];
    for (int i = 0; i < 3; i++) {
        for (;;) {                                     /* whitespace and # comments */
            while (pos < len && isspace(buf[pos])) pos++;
            if (pos < len && buf[pos] == '#') { while (pos < len && buf[pos] != '\n') pos++; continue; }
            break;
        }
        if (pos >= len || !isdigit(buf[pos])) { snprintf(err, errlen, "corrupt PPM/PGM header"); return NULL; }
        long v = 0;                                    /* every digit is the number's (past 10^9: too large, said so) */
        while (pos < len && isdigit(buf[pos])) { v = v < 1000000000 ? v * 10 + (buf[pos] - '0') : v; pos++; }
        vals[i] = v;
    }
    if (vals[0] <= 0 || vals[1] <= 0 || vals[0] > 32768 || vals[1] > 32768 || vals[2] <= 0 || vals[2] > 65535) {
        char size[64];
        if (vals[0] >= 1000000000 || vals[1] >= 1000000000) snprintf(size, sizeof size, "a size of over 10^9 pixels a side");
        else snprintf(size, sizeof size, "%ldx%ld", vals[0], vals[1]);
        snprintf(err, errlen, "corrupt PPM/PGM header (%s, max value %ld; sides of 1 to 32768, values up to 65535)", size, vals[2]);
        return NULL;
    }
    *w = (int)vals[0]; *h = (int)vals[1];
    int maxv = (int)vals[2], bps = maxv > 255 ? 2 : 1;
    size_t count = (size_t)*w * *h * chans;
    uint8_t *rgb = (uint8_t *)malloc((size_t)*w * *h * 3);
    if (!rgb) { snprintf(err, errlen, "out of memory"); return NULL; }
    if (binary) pos++;                                /* the single whitespace after maxval */
    if (binary && len - (pos < len ? pos : len) < count * bps) {
        snprintf(err, errlen, "truncated: %zu bytes of pixels expected, %zu found", count * bps, len > pos ? len - pos : 0);
        free(rgb);
        return NULL;
    }
    for (size_t i = 0; i < count; i++) {
        long v = 0;
        if (binary) {
            v = bps == 2 ? (buf[pos] << 8 | buf[pos + 1]) : buf[pos];
            pos += bps;
        } else {
            while (pos < len && isspace(buf[pos])) pos++;
            if (pos >= len || !isdigit(buf[pos])) { snprintf(err, errlen, "truncated or corrupt pixel data"); free(rgb); return NULL; }
            while (pos < len && isdigit(buf[pos])) { v = v <= 65535 ? v * 10 + (buf[pos] - '0') : v; pos++; }   /* no overflow */
        }
        uint8_t b = (uint8_t)((v > maxv ? maxv : v) * 255 / maxv);
        if (chans == 3) rgb[i] = b;
        else rgb[3 * i] = rgb[3 * i + 1] = rgb[3 * i + 2] = b;     /* grey becomes RGB */
    }
    return rgb;
}

#ifdef DT_HAVE_STB
/* stb_image decodes what it can of a damaged file and fills the rest with
   zeros. A training set should not silently hold half-black images, so the
   containers are checked first: every PNG chunk must fit and the file must
   end with IEND; a JPEG must end with its end-of-image marker. */
static int dt__check_container(const unsigned char *b, size_t len, char *err, size_t errlen) {
    static const unsigned char png_sig[8] = { 137, 80, 78, 71, 13, 10, 26, 10 };
    if (len >= 8 && memcmp(b, png_sig, 8) == 0) {
        size_t pos = 8;
        while (pos + 8 <= len) {
            size_t clen = (size_t)b[pos] << 24 | (size_t)b[pos + 1] << 16 | (size_t)b[pos + 2] << 8 | b[pos + 3];
            if (memcmp(b + pos + 4, "IEND", 4) == 0) return 1;
            if (clen > len || pos + 12 + clen > len) break;
            pos += 12 + clen;
        }
        snprintf(err, errlen, "truncated PNG (the file ends before its IEND chunk)");
        return 0;
    }
    if (len >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) {
        size_t end = len;
        while (end > 2 && (b[end - 1] == 0 || b[end - 1] == '\n' || b[end - 1] == '\r')) end--;
        if (end < 4 || b[end - 2] != 0xFF || b[end - 1] != 0xD9) {
            snprintf(err, errlen, "truncated JPEG (no end-of-image marker)");
            return 0;
        }
    }
    return 1;
}
#endif

uint8_t *dt_image_load_rgb(const char *path, int size, char *err, size_t errlen) {
    size_t len = 0;
    unsigned char *buf = dt__read_file(path, &len);
    if (!buf) { snprintf(err, errlen, "cannot read: %s", dt__read_failure()); return NULL; }
    int w = 0, h = 0;
    uint8_t *rgb = NULL;
    if (len == 0) snprintf(err, errlen, "empty file");
    else if (len >= 2 && buf[0] == 'P' && buf[1] >= '1' && buf[1] <= '7') rgb = dt__decode_pnm(buf, len, &w, &h, err, errlen);
    else {
#ifdef DT_HAVE_STB
        int comp = 0;
        if (dt__check_container(buf, len, err, errlen)) {
            rgb = stbi_load_from_memory(buf, (int)len, &w, &h, &comp, 3);  /* 3: grey and alpha -> RGB */
            const char *why = rgb ? NULL : stbi_failure_reason();
            if (why && !strcmp(why, "unknown image type"))
                snprintf(err, errlen, "not an image (no format stb_image reads: PNG, JPEG, BMP, GIF, TGA, PNM, ...)");
            else if (why) snprintf(err, errlen, "corrupt image (stb_image: %s)", why);
        }
#else
        rgb = dt__decode_pnm(buf, len, &w, &h, err, errlen);
#endif
    }
    free(buf);
    if (!rgb) return NULL;
    uint8_t *planes = (uint8_t *)malloc((size_t)w * h * 3), *out = (uint8_t *)malloc((size_t)size * size * 3);
    if (!planes || !out) dt_fail("out of memory decoding '%s'", path);
    for (int i = 0; i < w * h; i++)                            /* interleaved -> channels first */
        for (int c = 0; c < 3; c++) planes[(size_t)c * w * h + i] = rgb[3 * i + c];
    free(rgb);
    if (w == size && h == size) memcpy(out, planes, (size_t)size * size * 3);
    else dt_image_resize(planes, 3, w, h, out, size, size);
    free(planes);
    return out;
}

/* The one constructor of an image set (dt__text_split is text's): every field
   starts at zero, so one that no loader writes (tokens, for images) reads as
   empty, never as whatever the caller's stack held. */
static void dt__dataset_alloc(dt_dataset *ds, int64_t n, int size, int classes) {
    memset(ds, 0, sizeof *ds);
    ds->n = n; ds->capacity = n; ds->channels = 3; ds->size = size; ds->num_classes = classes;
    ds->pixels = (uint8_t *)dt_alloc(DT_ARENA_DATA, (size_t)n * 3 * size * size);
    ds->labels = (int32_t *)dt_alloc(DT_ARENA_DATA, (size_t)n * sizeof(int32_t));
    ds->class_names = (char **)calloc((size_t)(classes > 0 ? classes : 1), sizeof(char *));
}

static int dt__is_cifar_dir(const char *dir, char *batches, size_t n) {
    struct stat st;
    char p[4096];
    dt__path(p, sizeof p, "%s/data_batch_1.bin", dir);
    if (stat(p, &st) == 0) { dt__path(batches, n, "%s", dir); return 1; }
    dt__path(p, sizeof p, "%s/cifar-10-batches-bin/data_batch_1.bin", dir);
    if (stat(p, &st) == 0) { dt__path(batches, n, "%s/cifar-10-batches-bin", dir); return 1; }
    return 0;
}

/* CIFAR-10 binary: records of 1 label byte + 3072 pixel bytes (R, G, B planes). */
static void dt__load_cifar(const char *dir, const char *split, int size, dt_dataset *ds) {
    static const char *names[10] = { "airplane", "automobile", "bird", "cat", "deer",
                                     "dog", "frog", "horse", "ship", "truck" };
    const char *files[5] = { "data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin",
                             "data_batch_4.bin", "data_batch_5.bin" };
    const char *test[1] = { "test_batch.bin" };
    int nfiles = strcmp(split, "train") == 0 ? 5 : 1;
    const char **list = nfiles == 5 ? files : test;
    unsigned char *bufs[5] = { 0 };
    size_t lens[5] = { 0 };
    int64_t total = 0;
    for (int i = 0; i < nfiles; i++) {
        char p[4096];
        dt__path(p, sizeof p, "%s/%s", dir, list[i]);
        bufs[i] = dt__read_file(p, &lens[i]);
        if (!bufs[i]) dt_fail("CIFAR-10: cannot read '%s': %s", p, dt__read_failure());
        if (lens[i] == 0 || lens[i] % 3073 != 0)
            dt_fail("CIFAR-10: '%s' is truncated or not a CIFAR-10 batch (%zu bytes, not a multiple of 3073)", p, lens[i]);
        total += lens[i] / 3073;
    }
    dt__dataset_alloc(ds, total, size, 10);
    for (int c = 0; c < 10; c++) { ds->class_names[c] = (char *)malloc(16); strcpy(ds->class_names[c], names[c]); }
    int64_t k = 0;
    size_t img = (size_t)3 * size * size;
    for (int i = 0; i < nfiles; i++) {
        for (size_t r = 0; r < lens[i] / 3073; r++, k++) {
            const unsigned char *rec = bufs[i] + r * 3073;
            if (rec[0] > 9) dt_fail("CIFAR-10: '%s/%s' record %zu has label %d (not 0-9)", dir, list[i], r, rec[0]);
            ds->labels[k] = rec[0];
            if (size == 32) memcpy(ds->pixels + k * img, rec + 1, 3072);
            else dt_image_resize(rec + 1, 3, 32, 32, ds->pixels + k * img, size, size);
        }
        free(bufs[i]);
    }
    dt__copy_str(ds->source, sizeof ds->source, dir);
}

void dt_dataset_load(const char *dir, const char *split, int size, const dt_dataset *classes_from, dt_dataset *ds) {
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        dt_fail("data folder '%s' does not exist (give --data DIR holding train/ and val/ class folders, "
                "or a CIFAR-10 binary folder; leave --data out to use the synthetic set)", dir);
    char cifar[4096];
    if (dt__is_cifar_dir(dir, cifar, sizeof cifar)) { dt__load_cifar(cifar, split, size, ds); return; }
    char split_dir[4096];
    dt__path(split_dir, sizeof split_dir, "%s/%s", dir, split);
    if (stat(split_dir, &st) != 0 || !S_ISDIR(st.st_mode))
        dt_fail("data folder '%s' has no %s/ folder (expected %s/%s/<class>/<image>)", dir, split, dir, split);
    int nclass = 0;
    char **classes = dt__list_dir(split_dir, 1, &nclass);
    if (nclass == 0) dt_fail("'%s' holds no class folders (expected %s/<class>/<image>)", split_dir, split_dir);
    if (classes_from) {
        int same = classes_from->num_classes == nclass;
        for (int c = 0; same && c < nclass; c++) same = strcmp(classes[c], classes_from->class_names[c]) == 0;
        if (!same) dt_fail("the class folders of '%s' differ from those of the training set", split_dir);
    }
    /* list every file first, so the images can be decoded in parallel */
    int64_t n = 0, cap = 1024;
    char **paths = (char **)malloc(cap * sizeof(char *));
    int32_t *labels = (int32_t *)malloc(cap * sizeof(int32_t));
    for (int c = 0; c < nclass; c++) {
        char cdir[4096];
        int nf = 0;
        dt__path(cdir, sizeof cdir, "%s/%s", split_dir, classes[c]);
        char **files = dt__list_dir(cdir, 0, &nf);
        if (nf == 0) dt_fail("class folder '%s' is empty (every class needs at least one image)", cdir);
        for (int i = 0; i < nf; i++) {
            if (n == cap) {
                cap *= 2;
                paths = (char **)realloc(paths, cap * sizeof(char *));
                labels = (int32_t *)realloc(labels, cap * sizeof(int32_t));
                if (!paths || !labels) dt_fail("out of memory listing '%s'", cdir);
            }
            size_t plen = strlen(cdir) + strlen(files[i]) + 2;
            paths[n] = (char *)malloc(plen);
            snprintf(paths[n], plen, "%s/%s", cdir, files[i]);
            labels[n++] = c;
        }
        dt__free_names(files, nf);
    }
    dt__dataset_alloc(ds, n, size, nclass);
    for (int c = 0; c < nclass; c++) ds->class_names[c] = classes[c];
    free(classes);
    size_t img = (size_t)3 * size * size;
    int64_t first_bad = -1;
    char bad_reason[256] = "";
    DT_OMP("omp parallel for schedule(dynamic, 64)")
    for (int64_t i = 0; i < n; i++) {
        char err[256];
        uint8_t *px = dt_image_load_rgb(paths[i], size, err, sizeof err);
        if (px) { memcpy(ds->pixels + i * img, px, img); free(px); }
        else {
            DT_OMP("omp critical(dt__bad_image)")
            if (first_bad < 0 || i < first_bad) { first_bad = i; snprintf(bad_reason, sizeof bad_reason, "%s", err); }
        }
        ds->labels[i] = labels[i];
    }
    if (first_bad >= 0) dt_fail("cannot load image '%s': %s", paths[first_bad], bad_reason);
    for (int64_t i = 0; i < n; i++) free(paths[i]);
    free(paths);
    free(labels);
    dt__copy_str(ds->source, sizeof ds->source, split_dir);
}

void dt_dataset_free(dt_dataset *ds) {
    size_t img = (size_t)ds->channels * ds->size * ds->size;
    dt_free(DT_ARENA_DATA, ds->pixels, (size_t)ds->capacity * img);
    dt_free(DT_ARENA_DATA, ds->labels, (size_t)ds->capacity * sizeof(int32_t));
    dt_free(DT_ARENA_DATA, ds->tokens, (size_t)ds->tokens_capacity * sizeof(int32_t));
    dt_free(DT_ARENA_DATA, ds->targets, ds->targets ? (size_t)ds->tokens_capacity * sizeof(int32_t) : 0);
    for (int c = 0; ds->class_names && c < ds->num_classes; c++) free(ds->class_names[c]);
    free(ds->class_names);
    memset(ds, 0, sizeof *ds);
}

void dt_dataset_slice(dt_dataset *ds, int64_t start, int64_t end) {
    if (end < 0 || end > ds->n) end = ds->n;
    if (start < 0 || start >= end)
        dt_usage_error("--start-idx %lld / --end-idx %lld select no %s of the %lld in %s", (long long)start,
                       (long long)end, ds->tokens ? "sequences" : "images", (long long)ds->n, ds->source);
    if (ds->tokens) {                      /* sequences [start, end): their tokens and the one after */
        int64_t T = ds->seq_len, after = ds->targets ? 0 : 1;
        memmove(ds->tokens, ds->tokens + start * T, (size_t)((end - start) * T + after) * sizeof(int32_t));
        if (ds->targets) memmove(ds->targets, ds->targets + start * T, (size_t)((end - start) * T) * sizeof(int32_t));
        ds->ntokens = (end - start) * T + after;
        ds->n = end - start;
        return;
    }
    size_t img = (size_t)ds->channels * ds->size * ds->size;
    memmove(ds->pixels, ds->pixels + start * img, (size_t)(end - start) * img);
    memmove(ds->labels, ds->labels + start, (size_t)(end - start) * sizeof(int32_t));
    ds->n = end - start;
}

int64_t dt_sampler_indices(int64_t n, uint64_t seed, int epoch, int shuffle, int rank, int world, int64_t *out) {
    int64_t *perm = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (!perm) dt_fail("out of memory (sampler)");
    for (int64_t i = 0; i < n; i++) perm[i] = i;
    if (shuffle) {                                     /* Fisher-Yates, seeded by (seed, epoch) */
        dt__rng r = { dt__hash3(seed, (uint64_t)epoch, 0x5A4D50u) };
        for (int64_t i = n - 1; i > 0; i--) {
            int64_t j = (int64_t)(dt__rng_u64(&r) % (uint64_t)(i + 1));
            int64_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
        }
    }
    int64_t per_rank = n == 0 ? 0 : (n + world - 1) / world;
    for (int64_t i = 0; i < per_rank; i++) out[i] = perm[(rank + i * world) % n];  /* pad by wrapping */
    free(perm);
    return per_rank;
}

dt_loader dt_loader_create(const dt_dataset *ds, int batch_size, uint64_t seed, int shuffle, int augment,
                           int drop_last, int rank, int world) {
    dt_loader l;
    memset(&l, 0, sizeof l);
    l.ds = ds; l.batch_size = batch_size; l.seed = seed; l.shuffle = shuffle; l.augment = augment;
    l.drop_last = drop_last; l.rank = rank; l.world = world;
    l.order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(ds->n / world + 2));
    if (!l.order) dt_fail("out of memory (loader)");
    return l;
}
void dt_loader_free(dt_loader *l) { free(l->order); free(l->counted); l->order = l->counted = NULL; }

int64_t dt_loader_batches_per_epoch(const dt_loader *l) {
    int64_t per_rank = (l->ds->n + l->world - 1) / l->world;
    return l->drop_last ? per_rank / l->batch_size : (per_rank + l->batch_size - 1) / l->batch_size;
}

void dt_loader_start_epoch(dt_loader *l, int epoch, int64_t skip_batches) {
    const dt_dataset *ds = l->ds;
    l->epoch = epoch;
    l->count = dt_sampler_indices(ds->n, l->seed, epoch, l->shuffle, l->rank, l->world, l->order);
    l->pos = skip_batches * l->batch_size;
    if (!ds->targets) return;
    /* Every rank deals itself the same permutation, so each can count what
       the others' batches hold without asking them. */
    int64_t batches = l->count / l->batch_size + 1, *theirs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(l->count + 1));
    free(l->counted);
    l->counted = (int64_t *)calloc((size_t)batches, sizeof(int64_t));
    if (!theirs || !l->counted) dt_fail("out of memory (loader)");
    for (int r = 0; r < l->world; r++) {
        int64_t n = dt_sampler_indices(ds->n, l->seed, epoch, l->shuffle, r, l->world, theirs);
        for (int64_t i = 0; i < n; i++) {
            const int32_t *t = ds->targets + theirs[i] * ds->seq_len;
            for (int k = 0; k < ds->seq_len; k++) l->counted[i / l->batch_size] += t[k] != DT_IGNORE_INDEX;
        }
    }
    free(theirs);
}
int64_t dt_loader_counted_targets(const dt_loader *l, int batches) {
    if (!l->counted) dt_fail("dt_loader_counted_targets: the loader's data has no masked targets (or no epoch has begun)");
    int64_t sum = 0, first = l->pos / l->batch_size, last = dt_loader_batches_per_epoch(l) - 1;
    for (int64_t b = first; b < first + batches && b <= last; b++) sum += l->counted[b];
    return sum;
}

/* A batch of text: B sequences of T token ids, and the T tokens that follow
   each (or, for instruction data, each sequence's own targets). */
static void dt__loader_text(dt_loader *l, dt_batch *b, int B) {
    const dt_dataset *ds = l->ds;
    int T = ds->seq_len, shape[2] = { B, T };
    b->inputs = dt__tensor_alloc(2, shape, DT_F32);
    b->labels = (int32_t *)dt_step_alloc(sizeof(int32_t) * (size_t)B * T);
    size_t bytes = (size_t)B * T * sizeof(float);
    float *host = b->inputs->device == DT_CPU ? b->inputs->data : (float *)dt__step_alloc_uninit(bytes);
    for (int i = 0; i < B; i++) {
        const int32_t *src = ds->tokens + l->order[l->pos + i] * T;
        const int32_t *next = ds->targets ? ds->targets + l->order[l->pos + i] * T : src + 1;
        for (int t = 0; t < T; t++) {
            host[(size_t)i * T + t] = (float)src[t];
            b->labels[(size_t)i * T + t] = next[t];
        }
    }
    if (host != b->inputs->data) dt_upload(b->inputs->data, host, bytes);
}

int dt_loader_next(dt_loader *l, dt_batch *b) {
    int64_t left = l->count - l->pos;
    if (left <= 0 || (l->drop_last && left < l->batch_size)) return 0;
    int B = (int)(left < l->batch_size ? left : l->batch_size);
    const dt_dataset *ds = l->ds;
    memset(b, 0, sizeof *b);
    b->size = B;
    if (ds->tokens) {
        dt__loader_text(l, b, B);
        l->pos += B;
        return 1;
    }
    int C = ds->channels, S = ds->size, pad = S / 8;
    int shape[4] = { B, C, S, S };
    b->inputs = dt__tensor_alloc(4, shape, DT_F32);
    b->labels = (int32_t *)dt_step_alloc(sizeof(int32_t) * B);
    /* The batch is assembled on the host; a GPU gets it in one upload. */
    size_t bytes = (size_t)b->inputs->numel * sizeof(float);
    float *host = b->inputs->device == DT_CPU ? b->inputs->data : (float *)dt__step_alloc_uninit(bytes);
    for (int i = 0; i < B; i++) {
        int64_t idx = l->order[l->pos + i];
        const uint8_t *src = ds->pixels + (size_t)idx * C * S * S;
        float *dst = host + (size_t)i * C * S * S;
        int flip = 0, dx = 0, dy = 0;
        if (l->augment) {                   /* random crop (zero padding S/8) + horizontal flip */
            uint64_t h = dt__hash3(l->seed, (uint64_t)l->epoch, (uint64_t)idx);
            flip = (int)(h & 1);
            dx = (int)((h >> 8) % (uint64_t)(2 * pad + 1)) - pad;
            dy = (int)((h >> 24) % (uint64_t)(2 * pad + 1)) - pad;
        }
        for (int c = 0; c < C; c++)
            for (int y = 0; y < S; y++)
                for (int x = 0; x < S; x++) {
                    int sx = (flip ? S - 1 - x : x) + dx, sy = y + dy;
                    uint8_t v = (sx >= 0 && sx < S && sy >= 0 && sy < S) ? src[((size_t)c * S + sy) * S + sx] : 0;
                    dst[((size_t)c * S + y) * S + x] = v / 127.5f - 1.0f;
                }
        b->labels[i] = ds->labels[idx];
    }
    if (host != b->inputs->data) dt_upload(b->inputs->data, host, bytes);
    l->pos += B;
    return 1;
}

/* -- text. A language model learns to predict each token from the ones before
      it, so a text is one long run of tokens: every position is a training
      example. Bytes are the simplest tokens (256 of them, nothing to
      download); a tokenizer's ids come pre-made in a file. -- */
static void dt__text_split(const int32_t *tok, int64_t n, int vocab, int seq_len, const char *source, dt_dataset *ds) {
    memset(ds, 0, sizeof *ds);
    ds->tokens = (int32_t *)dt_alloc(DT_ARENA_DATA, (size_t)n * sizeof(int32_t));
    memcpy(ds->tokens, tok, (size_t)n * sizeof(int32_t));
    ds->ntokens = ds->tokens_capacity = n;
    ds->seq_len = seq_len;
    ds->n = (n - 1) / seq_len;
    ds->num_classes = vocab;
    dt__copy_str(ds->source, sizeof ds->source, source);
}

/* Token ids are held as floats in the input tensor: whole numbers up to 2^24
   are exact there. */
#define DT_MAX_VOCAB (1 << 24)
/* A NumPy .npy file of token ids (numpy.save): the magic, a version, and a
   Python dict that says the element type, the order and the shape. One
   dimension of uint16, uint32, int32 or int64, little-endian; anything else
   is an error naming what it found. */
static void dt__npy_ids(const char *path, const unsigned char *b, size_t len, size_t *width, int *is_signed, size_t *start) {
    if (len < 10 || b[6] < 1 || b[6] > 3) dt_fail("'%s': a .npy file of version %d; NumPy writes 1, 2 or 3", path, len > 6 ? b[6] : 0);
    size_t hlen = b[6] == 1 ? (size_t)(b[8] | b[9] << 8) : len >= 12 ? (size_t)b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24 : len;
    size_t at = b[6] == 1 ? 10 : 12;
    if (hlen > len - at) dt_fail("'%s' is truncated: its .npy header claims %zu bytes", path, hlen);
    char header[1024];
    dt__copy_str(header, sizeof header < hlen + 1 ? sizeof header : hlen + 1, (const char *)b + at);
    const char *d = strstr(header, "'descr'"), *f = strstr(header, "'fortran_order'"), *sh = strstr(header, "'shape'");
    char descr[16] = "";
    if (d && (d = strchr(d + 7, '\'')) != NULL) {
        size_t k = 0;
        for (d++; *d && *d != '\'' && k + 1 < sizeof descr; d++) descr[k++] = *d;
        descr[k] = 0;
    }
    static const struct { const char *descr; size_t width; int is_signed; } types[] = {
        { "<u2", 2, 0 }, { "<u4", 4, 0 }, { "<i4", 4, 1 }, { "<i8", 8, 1 } };
    int type = -1;
    for (int k = 0; k < 4; k++) if (!strcmp(descr, types[k].descr)) type = k;
    if (type < 0)
        dt_fail("'%s': a .npy array of '%s'; token ids must be uint16, uint32, int32 or int64 ('<u2', '<u4', '<i4', '<i8')",
                path, descr[0] ? descr : "(no descr)");
    if (!f || !strstr(f, "False")) dt_fail("'%s': a .npy array in Fortran order; save a one-dimensional array", path);
    long long n = -1;
    char close = 0;                                  /* "(n,)": one dimension */
    if (!sh || sscanf(strchr(sh, '(') ? strchr(sh, '(') : sh, "(%lld , %c", &n, &close) != 2 || n < 0 || close != ')')
        dt_fail("'%s': a .npy array of shape %.40s; token ids are one dimension, (n,)", path, sh ? sh + 8 : "(none)");
    *width = types[type].width;
    *is_signed = types[type].is_signed;
    *start = at + hlen;
    size_t want;
    if (__builtin_mul_overflow((size_t)n, *width, &want) || len - *start != want)
        dt_fail("'%s': the .npy header says %lld ids of %zu bytes, the file holds %zu bytes after it (truncated?)", path, n,
                *width, len - *start);
}

/* -- instruction data. An example for fine-tuning is a prompt and its answer,
      and only the answer is to be learned: the prompt's positions are left
      out of the loss. The file is JSON lines, one example per line, which a
      tokenized Hugging Face dataset writes with one line of Python,
          ds.to_json("train.jsonl")
      "input_ids" are the example's tokens; "labels" (optional) are Hugging
      Face's: the token each position is to produce, -100 where the loss
      ignores it, shifted by one here as the model does; an "attention_mask"
      of 0s at the end is right padding, dropped; other keys are ignored.
      Each example is a sequence of its own, inputs ids[0, L-1) and targets
      labels[1, L), padded to --seq-len with ignored targets: causal attention
      never lets a real token see the padding, so nothing leaks between
      examples. -- */

/* One JSON array of whole numbers into a growing buffer; its length, or -1
   when it is not one. */
static int64_t dt__json_ids(dt__json *j, int64_t **buf, int64_t *cap) {
    int64_t n = 0;
    if (!dt__json_eat(j, '[')) return -1;
    if (dt__json_peek(j) == ']') { j->pos++; return 0; }
    while (j->ok) {
        if (n == *cap) {
            *cap = *cap ? 2 * *cap : 1024;
            *buf = (int64_t *)realloc(*buf, sizeof(int64_t) * (size_t)*cap);
            if (!*buf) dt_fail("out of memory (JSON lines)");
        }
        (*buf)[n++] = dt__json_int(j);
        if (dt__json_peek(j) == ',') { j->pos++; continue; }
        dt__json_eat(j, ']');
        break;
    }
    return j->ok ? n : -1;
}

static void dt__records_load(const char *path, const unsigned char *bytes, size_t len, int vocab, int seq_len,
                             double val_fraction, dt_dataset *train, dt_dataset *val) {
    int64_t lines = 0, n = 0, T = seq_len;
    for (size_t i = 0; i < len; i++) lines += bytes[i] == '\n';
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)(lines + 1) * T);
    int32_t *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)(lines + 1) * T);
    int64_t *field[3] = { NULL, NULL, NULL }, cap[3] = { 0, 0, 0 }, counted = 0;
    static const char *keys[3] = { "input_ids", "labels", "attention_mask" };
    if (!tok || !tgt) dt_fail("out of memory reading '%s'", path);
    int largest = 0;
    size_t at = 0;
    for (int64_t line = 1; at < len; line++) {
        size_t end = at;
        while (end < len && bytes[end] != '\n') end++;
        dt__json j = { (const char *)bytes + at, 0, end - at, 1 };
        at = end + 1;
        if (dt__json_peek(&j) < 0) continue;                  /* a blank line */
        int64_t count[3] = { -2, -2, -2 };                    /* -2: absent */
        if (!dt__json_eat(&j, '{')) dt_fail("'%s' line %lld: not a JSON object (JSON lines hold one example per line)", path, (long long)line);
        if (dt__json_peek(&j) == '}') j.pos++;
        else while (j.ok) {
            char *key = dt__json_str(&j);
            int k = 0;
            while (key && k < 3 && strcmp(key, keys[k])) k++;
            if (!key || !dt__json_eat(&j, ':')) { free(key); j.ok = 0; break; }
            if (k < 3 && (count[k] = dt__json_ids(&j, &field[k], &cap[k])) < 0)
                dt_fail("'%s' line %lld: \"%s\" is not a list of whole numbers", path, (long long)line, key);
            if (k == 3) dt__json_skip(&j, 0);
            free(key);
            if (dt__json_peek(&j) == ',') { j.pos++; continue; }
            dt__json_eat(&j, '}');
            break;
        }
        if (!j.ok || dt__json_peek(&j) >= 0)
            dt_fail("'%s' line %lld: not valid JSON near byte %zu of the line", path, (long long)line, j.pos + 1);
        int64_t L = count[0];
        if (L == -2) dt_fail("'%s' line %lld: no \"input_ids\" (a tokenized dataset has them: tokenizer(...)[\"input_ids\"])", path, (long long)line);
        for (int k = 1; k < 3; k++)
            if (count[k] != -2 && count[k] != L)
                dt_fail("'%s' line %lld: %lld \"%s\" for %lld \"input_ids\"; they pair up one to one", path, (long long)line,
                        (long long)count[k], keys[k], (long long)L);
        if (count[2] != -2) {                                 /* right padding ends the example */
            int64_t real = 0;
            while (real < L && field[2][real] == 1) real++;
            for (int64_t t = real; t < L; t++)
                if (field[2][t] != 0)
                    dt_fail("'%s' line %lld: attention_mask %lld at position %lld after a 0; only right padding "
                            "(1s, then 0s) is read", path, (long long)line, (long long)field[2][t], (long long)t);
            L = real;
        }
        if (L < 2) dt_fail("'%s' line %lld: %lld tokens; an example needs two at least (one to read, one to predict)", path, (long long)line, (long long)L);
        if (L - 1 > T)
            dt_fail("'%s' line %lld: %lld tokens; --seq-len %lld holds examples of up to %lld (raise --seq-len, or cut "
                    "or drop long examples when you tokenize)", path, (long long)line, (long long)L, (long long)T, (long long)T + 1);
        const int64_t *labels = count[1] != -2 ? field[1] : field[0];
        for (int64_t t = 0; t < L; t++) {
            if (field[0][t] < 0 || field[0][t] >= DT_MAX_VOCAB || (vocab > 0 && field[0][t] >= vocab))
                dt_fail("'%s' line %lld: input_ids[%lld] is %lld; ids run from 0 to %d", path, (long long)line, (long long)t,
                        (long long)field[0][t], (vocab > 0 ? vocab : DT_MAX_VOCAB) - 1);
            if (labels[t] != DT_IGNORE_INDEX && (labels[t] < 0 || labels[t] >= DT_MAX_VOCAB || (vocab > 0 && labels[t] >= vocab)))
                dt_fail("'%s' line %lld: labels[%lld] is %lld; a label is a token id from 0 to %d, or -100 (ignored)", path,
                        (long long)line, (long long)t, (long long)labels[t], (vocab > 0 ? vocab : DT_MAX_VOCAB) - 1);
            if (field[0][t] > largest) largest = (int)field[0][t];
            if (labels[t] > largest) largest = (int)labels[t];
        }
        int32_t *x = tok + n * T, *y = tgt + n * T;
        for (int64_t t = 0; t < T; t++) {
            x[t] = t < L - 1 ? (int32_t)field[0][t] : 0;
            y[t] = t < L - 1 ? (int32_t)labels[t + 1] : DT_IGNORE_INDEX;
            counted += y[t] != DT_IGNORE_INDEX;
        }
        n++;
    }
    for (int k = 0; k < 3; k++) free(field[k]);
    int64_t nval = (int64_t)((double)n * val_fraction), ntrain = n - nval;
    if (ntrain < 1 || (val_fraction > 0 && nval < 1))
        dt_fail("'%s' has %lld examples: too few (training and validation need one each; the last %.0f%% is validation)",
                path, (long long)n, 100 * val_fraction);
    if (!counted) dt_fail("'%s': every label is -100; there is nothing to learn", path);
    if (vocab <= 0) vocab = largest + 1;
    char source[512];
    snprintf(source, sizeof source, "%s (instruction examples, JSON lines)", path);
    for (int part = 0; part < 2; part++) {
        dt_dataset *ds = part ? val : train;
        int64_t first = part ? ntrain : 0, count = part ? nval : ntrain;
        if (!ds) continue;
        memset(ds, 0, sizeof *ds);
        ds->n = count;
        ds->ntokens = ds->tokens_capacity = count * T;
        ds->tokens = (int32_t *)dt_alloc(DT_ARENA_DATA, sizeof(int32_t) * (size_t)(count * T));
        ds->targets = (int32_t *)dt_alloc(DT_ARENA_DATA, sizeof(int32_t) * (size_t)(count * T));
        memcpy(ds->tokens, tok + first * T, sizeof(int32_t) * (size_t)(count * T));
        memcpy(ds->targets, tgt + first * T, sizeof(int32_t) * (size_t)(count * T));
        ds->seq_len = seq_len;
        ds->num_classes = vocab;
        dt__copy_str(ds->source, sizeof ds->source, source);
    }
    free(tok);
    free(tgt);
}

void dt_text_load(const char *path, int is_tokens, int vocab, int seq_len, double val_fraction, dt_dataset *train,
                  dt_dataset *val) {
    struct stat st;
    if (stat(path, &st) != 0) dt_fail("cannot open '%s': %s", path, strerror(errno));
    unsigned char *bytes = NULL;
    size_t len = 0;
    if (S_ISDIR(st.st_mode)) {                       /* every .txt file, in name order, one after another */
        if (is_tokens) dt_fail("--tokens '%s' is a folder; it takes one file of token ids (.npy, JSON lines, or raw uint16)", path);
        int count = 0, used = 0;
        char **names = dt__list_dir(path, 0, &count);
        for (int i = 0; i < count; i++) {
            size_t l = strlen(names[i]), flen = 0;
            if (l < 4 || strcmp(names[i] + l - 4, ".txt")) continue;
            char full[4096];
            dt__path(full, sizeof full, "%s/%s", path, names[i]);
            unsigned char *part = dt__read_file(full, &flen);
            if (!part) dt_fail("cannot read '%s': %s", full, dt__read_failure());
            unsigned char *grown = (unsigned char *)realloc(bytes, len + flen + 1);
            if (!grown) dt_fail("out of memory reading '%s'", full);
            bytes = grown;
            memcpy(bytes + len, part, flen);
            len += flen;
            free(part);
            used++;
        }
        dt__free_names(names, count);
        if (!used) dt_fail("'%s' holds no .txt file", path);
    } else if (!(bytes = dt__read_file(path, &len))) dt_fail("cannot read '%s': %s", path, dt__read_failure());
    size_t first = len >= 3 && !memcmp(bytes, "\xEF\xBB\xBF", 3) ? 3 : 0;     /* past a UTF-8 byte-order mark */
    while (first < len && isspace(bytes[first])) first++;
    if (is_tokens && first < len && bytes[first] == '{') {                       /* JSON lines */
        dt__records_load(path, bytes + first, len - first, vocab, seq_len, val_fraction, train, val);
        free(bytes);
        return;
    }
    if (is_tokens && first + 1 < len && bytes[first] == '[' && (bytes[first + 1] == '{' || isspace(bytes[first + 1])))
        dt_fail("'%s' is one JSON array; --tokens reads JSON lines, one example per line: ds.to_json(path), whose "
                "default is lines=True", path);
    int npy = is_tokens && len >= 6 && !memcmp(bytes, "\x93NUMPY", 6);
    size_t path_len = strlen(path);
    if (is_tokens && !npy && path_len > 4 && !strcmp(path + path_len - 4, ".npy"))   /* not read as raw uint16 */
        dt_fail("'%s' is named .npy but is not a NumPy file (it does not begin with \\x93NUMPY): numpy.save writes one; "
                "a file of raw uint16 ids takes another name (.bin)", path);
    size_t width = 2, at = 0;                        /* bytes per id, where the ids start */
    int is_signed = 0;
    if (npy) dt__npy_ids(path, bytes, len, &width, &is_signed, &at);
    else if (is_tokens && len % 2)
        dt_fail("'%s' has %zu bytes, an odd number: a file of uint16 token ids has 2 bytes per token (truncated?)", path, len);
    int64_t n = is_tokens ? (int64_t)((len - at) / width) : (int64_t)len;
    int32_t *tok = (int32_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!tok) dt_fail("out of memory reading '%s'", path);
    int largest = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!is_tokens) tok[i] = bytes[i];
        else {                                       /* little-endian, as NumPy writes on every common machine */
            const unsigned char *b = bytes + at + (size_t)i * width;
            uint64_t u = 0;
            for (size_t k = 0; k < width; k++) u |= (uint64_t)b[k] << (8 * k);
            int64_t v = (int64_t)u;
            if (is_signed && width < 8 && (u >> (8 * width - 1)) & 1) v = (int64_t)(u | ~0ULL << (8 * width));   /* sign */
            if (v < 0 || v >= DT_MAX_VOCAB) {
                free(tok);                           /* nothing of the load outlives the error (LeakSanitizer) */
                free(bytes);
                dt_fail("'%s': token %lld is id %lld; ids run from 0 to %d (whole numbers a float holds exactly)", path,
                        (long long)i, (long long)v, DT_MAX_VOCAB - 1);
            }
            tok[i] = (int32_t)v;
        }
        if (tok[i] > largest) largest = tok[i];
    }
    free(bytes);
    if (!is_tokens && vocab <= 0) vocab = 256;
    if (!is_tokens && vocab < 256) dt_usage_error("--vocab %d: text read as bytes needs a vocabulary of at least 256", vocab);
    if (vocab <= 0) vocab = largest + 1;
    if (largest >= vocab) {
        int64_t at = 0;
        while (tok[at] < vocab) at++;
        dt_fail("'%s': token %lld is id %d, outside --vocab %d", path, (long long)at, tok[at], vocab);
    }
    int64_t nval = (int64_t)(n * val_fraction), ntrain = n - nval;
    if (ntrain < seq_len + 1 || (val_fraction > 0 && nval < seq_len + 1))
        dt_fail("'%s' has %lld tokens: too few for sequences of --seq-len %d (training and validation need %d each; "
                "the last %.0f%% is validation)", path, (long long)n, seq_len, seq_len + 1, 100 * val_fraction);
    char source[512];
    snprintf(source, sizeof source, "%s (%s)", path, !is_tokens ? "bytes" : npy ? "token ids, .npy" : "uint16 token ids");
    dt__text_split(tok, ntrain, vocab, seq_len, source, train);
    if (val) dt__text_split(tok + ntrain, nval, vocab, seq_len, source, val);
    free(tok);
}

/* The tokens a data set asks to be predicted: every one after the first, or
   the targets of instruction data (DT_IGNORE_INDEX where none is asked). */
static int64_t dt__predicted_count(const dt_dataset *ds) { return ds->targets ? ds->ntokens : ds->ntokens - 1; }
static int32_t dt__predicted(const dt_dataset *ds, int64_t i) { return ds->targets ? ds->targets[i] : ds->tokens[i + 1]; }
/* The targets its sequences' losses count: n x seq_len, less the ignored ones. */
static int64_t dt__counted_targets(const dt_dataset *ds) {
    int64_t n = ds->n * ds->seq_len;
    for (int64_t i = 0; ds->targets && i < ds->ntokens; i++) n -= ds->targets[i] == DT_IGNORE_INDEX;
    return n;
}
double dt_unigram_loss(const dt_dataset *train, const dt_dataset *eval) {
    int V = train->num_classes;
    double *count = (double *)calloc((size_t)V, sizeof(double)), loss = 0, total = V, scored = 0;
    if (!count) dt_fail("out of memory");
    for (int64_t i = 0; i < dt__predicted_count(train); i++) {
        int32_t t = dt__predicted(train, i);
        if (t != DT_IGNORE_INDEX) { count[t] += 1; total += 1; }     /* add-one smoothing */
    }
    for (int64_t i = 0; i < dt__predicted_count(eval); i++) {
        int32_t t = dt__predicted(eval, i);
        if (t != DT_IGNORE_INDEX) { loss -= log((count[t] + 1) / total); scored += 1; }
    }
    free(count);
    return scored > 0 ? loss / scored : 0;
}

/* -- the built-in text: sentences from a small grammar. Enough structure to
      learn in minutes on a laptop (spelling, word order, punctuation), enough
      variety that a model must generalise rather than memorise. -- */
static const char *dt__pick(dt__rng *r, const char *const *words, int n) { return words[dt__rng_u64(r) % (uint64_t)n]; }
#define DT_PICK(r, list) dt__pick(r, list, (int)(sizeof list / sizeof list[0]))

void dt_synthetic_text_write(const char *path, int64_t bytes, uint64_t seed) {
    static const char *const people[] = { "the farmer", "the old woman", "a young sailor", "the miller", "my brother",
        "the teacher", "a tired soldier", "the baker", "her father", "the little girl", "the doctor", "a stranger",
        "the king", "the shepherd", "his mother", "the captain", "a merchant", "the children", "our neighbour", "the cook" };
    static const char *const animals[] = { "the grey cat", "a brown dog", "the old horse", "a small bird", "the fox",
        "the white goose", "a black crow", "the lazy pig", "the goat", "a field mouse" };
    static const char *const things[] = { "the bread", "a letter", "the lamp", "an apple", "the basket", "a red coat",
        "the key", "the boat", "a loaf of bread", "the garden gate", "a cup of tea", "the map", "an old book",
        "the candle", "a bag of flour", "the wooden box", "the bell", "a pair of boots" };
    static const char *const places[] = { "the market", "the river", "the village", "the forest", "the mill",
        "the harbour", "the church", "the hill", "the kitchen", "the barn", "the town square", "the bridge",
        "the school", "the road to the sea", "the orchard" };
    static const char *const carry[] = { "carried", "found", "lost", "opened", "mended", "sold", "bought", "hid",
        "painted", "washed", "cleaned", "dropped", "brought", "borrowed", "wanted" };
    static const char *const move[] = { "walked to", "ran to", "went down to", "came back from", "hurried to",
        "looked at", "waited by", "slept near", "sang near", "played by" };
    static const char *const when[] = { "in the morning", "at night", "after dinner", "before the rain",
        "on Sunday", "every day", "in the spring", "at noon", "late in the evening", "once again" };
    static const char *const feel[] = { "happy", "tired", "hungry", "afraid", "angry", "quiet", "sad", "glad",
        "cold", "proud" };
    static const char *const said[] = { "said", "asked", "cried", "whispered", "answered", "shouted" };
    static const char *const lines[] = { "where is the key", "the bread is warm", "it is going to rain",
        "we must go home now", "who has seen my dog", "the boat is ready", "I am not afraid",
        "the market is closed today", "bring me the lamp", "look at the sky" };
    FILE *f = fopen(path, "wb");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
    dt__rng r = { seed };
    char sentence[512];
    int64_t written = 0;
    int in_paragraph = 0;
    while (written < bytes) {
        const char *who = dt__rng_uniform(&r) < 0.75 ? DT_PICK(&r, people) : DT_PICK(&r, animals);
        switch ((int)(dt__rng_u64(&r) % 6)) {
        case 0: snprintf(sentence, sizeof sentence, "%s %s %s %s.", who, DT_PICK(&r, carry), DT_PICK(&r, things), DT_PICK(&r, when)); break;
        case 1: snprintf(sentence, sizeof sentence, "%s %s %s.", who, DT_PICK(&r, move), DT_PICK(&r, places)); break;
        case 2: snprintf(sentence, sizeof sentence, "%s was %s, so %s %s %s.", who, DT_PICK(&r, feel), DT_PICK(&r, people),
                         DT_PICK(&r, move), DT_PICK(&r, places)); break;
        case 3: {
            const char *line = DT_PICK(&r, lines);
            snprintf(sentence, sizeof sentence, "\"%c%s,\" %s %s.", line[0] == 'I' ? 'I' : line[0] - 'a' + 'A', line + 1,
                     DT_PICK(&r, said), who);
            break;
        }
        case 4: snprintf(sentence, sizeof sentence, "%s %s %s in %s, but %s %s it %s.", who, DT_PICK(&r, carry),
                         DT_PICK(&r, things), DT_PICK(&r, places), DT_PICK(&r, people), DT_PICK(&r, carry), DT_PICK(&r, when)); break;
        default: snprintf(sentence, sizeof sentence, "%s %s %s, and %s %s %s.", who, DT_PICK(&r, move), DT_PICK(&r, places),
                          DT_PICK(&r, animals), DT_PICK(&r, move), DT_PICK(&r, places)); break;
        }
        int64_t len = (int64_t)strlen(sentence);
        if (len > 0 && sentence[0] >= 'a' && sentence[0] <= 'z') sentence[0] = (char)(sentence[0] - 'a' + 'A');
        in_paragraph++;
        const char *sep = in_paragraph >= 3 + (int)(dt__rng_u64(&r) % 4) ? (in_paragraph = 0, "\n\n") : " ";
        if (fputs(sentence, f) < 0 || fputs(sep, f) < 0) dt__write_failed(NULL, path, errno);
        written += len + (int64_t)strlen(sep);
    }
    dt__file_close(f, NULL, path);
}
#undef DT_PICK

/* -- the synthetic set: ten classes = five shapes x two colour families, drawn
      at random positions and sizes on noisy backgrounds. Learnable, but not by
      looking at one pixel: the shape has to be recognised. -- */
static void dt__hsv_to_rgb(float h, float s, float v, float *rgb) {
    float c = v * s, hp = fmodf(h, 360.0f) / 60.0f, x = c * (1 - fabsf(fmodf(hp, 2.0f) - 1)), m = v - c;
    float r = 0, g = 0, b = 0;
    if (hp < 1) { r = c; g = x; } else if (hp < 2) { r = x; g = c; } else if (hp < 3) { g = c; b = x; }
    else if (hp < 4) { g = x; b = c; } else if (hp < 5) { r = x; b = c; } else { r = c; b = x; }
    rgb[0] = r + m; rgb[1] = g + m; rgb[2] = b + m;
}

static void dt__synthetic_image(int cls, int S, dt__rng *r, uint8_t *hwc) {
    static const float hue_base[2] = { 10.0f, 200.0f };       /* warm, cool */
    int shape = cls % 5, family = cls / 5;
    float bg = 60 + 130 * (float)dt__rng_uniform(r), gx = (float)dt__rng_uniform(r) * 40 - 20;
    float fg[3];
    dt__hsv_to_rgb(hue_base[family] + 50 * (float)dt__rng_uniform(r), 0.55f + 0.45f * (float)dt__rng_uniform(r),
                  0.5f + 0.5f * (float)dt__rng_uniform(r), fg);
    float cx = S * (0.5f + 0.2f * ((float)dt__rng_uniform(r) - 0.5f)), cy = S * (0.5f + 0.2f * ((float)dt__rng_uniform(r) - 0.5f));
    float rad = S * (0.22f + 0.12f * (float)dt__rng_uniform(r));
    for (int y = 0; y < S; y++)
        for (int x = 0; x < S; x++) {
            float u = (x + 0.5f - cx) / rad, v = (y + 0.5f - cy) / rad, d2 = u * u + v * v;
            int in = 0;
            switch (shape) {
            case 0: in = d2 <= 1.0f; break;                                       /* disk */
            case 1: in = fabsf(u) <= 0.8f && fabsf(v) <= 0.8f; break;             /* square */
            case 2: in = v <= 0.8f && v >= -1.0f && fabsf(u) <= (v + 1.0f) * 0.55f; break;  /* triangle */
            case 3: in = (fabsf(u) <= 0.3f && fabsf(v) <= 1.0f) || (fabsf(v) <= 0.3f && fabsf(u) <= 1.0f); break;
            case 4: in = d2 <= 1.0f && d2 >= 0.4f; break;                         /* ring */
            }
            for (int c = 0; c < 3; c++) {
                float noise = 24.0f * ((float)dt__rng_uniform(r) - 0.5f);
                float val = in ? fg[c] * 255.0f + noise : bg + gx * (x - S / 2.0f) / S + noise;
                hwc[((size_t)y * S + x) * 3 + c] = (uint8_t)(val < 0 ? 0 : val > 255 ? 255 : val);
            }
        }
}

static void dt__mkdir(const char *path) {
    if (mkdir(path, 0755) != 0 && errno != EEXIST) dt_fail("cannot create folder '%s': %s", path, strerror(errno));
}

#ifdef DT_HAVE_STB
/* stbi_write_png ignores what its fwrite returns, so a full disk would leave a
   cut-off PNG; through this callback the writes land in a FILE we check. */
static void dt__png_to_file(void *f, void *data, int size) { fwrite(data, 1, (size_t)size, (FILE *)f); }
#endif

static void dt__write_image(const char *path_noext, const uint8_t *hwc, int S) {
    char path[4096];
#ifdef DT_HAVE_STB
    dt__path(path, sizeof path, "%s.png", path_noext);
#else
    dt__path(path, sizeof path, "%s.ppm", path_noext);
#endif
    FILE *f = fopen(path, "wb");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
#ifdef DT_HAVE_STB
    if (!stbi_write_png_to_func(dt__png_to_file, f, S, S, 3, hwc, S * 3)) dt_fail("cannot encode '%s' as PNG", path);
#else
    fprintf(f, "P6\n%d %d\n255\n", S, S);             /* a failure stays in f for dt__file_close */
    fwrite(hwc, 1, (size_t)S * S * 3, f);
#endif
    dt__file_close(f, NULL, path);
}

void dt_synthetic_write(const char *dir, int n_train, int n_val, int size, uint64_t seed) {
    static const char *names[10] = { "disk-warm", "square-warm", "triangle-warm", "cross-warm", "ring-warm",
                                     "disk-cool", "square-cool", "triangle-cool", "cross-cool", "ring-cool" };
    /* Written beside the target and renamed at the end, so an interrupted run
       never leaves a half-made set that the next run would trust. */
    char tmp[4096], path[4096];
    dt__path(tmp, sizeof tmp, "%s.partial", dir);
    dt__mkdir(tmp);
    uint8_t *hwc = (uint8_t *)malloc((size_t)size * size * 3);
    if (!hwc) dt_fail("out of memory (an image of %d x %d)", size, size);
    for (int split = 0; split < 2; split++) {
        const char *sname = split == 0 ? "train" : "val";
        int n = split == 0 ? n_train : n_val;
        dt__path(path, sizeof path, "%s/%s", tmp, sname);
        dt__mkdir(path);
        for (int c = 0; c < 10; c++) { dt__path(path, sizeof path, "%s/%s/%s", tmp, sname, names[c]); dt__mkdir(path); }
        for (int i = 0; i < n; i++) {
            int cls = i % 10;
            dt__rng r = { dt__hash3(seed, (uint64_t)split, (uint64_t)i) };
            dt__synthetic_image(cls, size, &r, hwc);
            dt__path(path, sizeof path, "%s/%s/%s/%05d", tmp, sname, names[cls], i / 10);
            dt__write_image(path, hwc, size);
        }
    }
    free(hwc);
    if (rename(tmp, dir) != 0) dt_fail("cannot rename '%s' to '%s': %s", tmp, dir, strerror(errno));
}

