/* tests/fuzz/fuzz.c -- coverage-guided fuzzing of every loader dtrain has
   (libFuzzer, clang, with AddressSanitizer and UBSan): `make fuzz`.

   One harness per format, each in a file of its own here, all built into one
   program (the implementation is compiled once, and the harnesses reach its
   dt__ functions); DT_FUZZ=NAME picks the one a run fuzzes:

       safetensors   a checkpoint's or a model's weights file (the header parser)
       config_json   a Hugging Face folder's config.json, read and applied
       index_json    a folder's model.safetensors.index.json
       npy           a NumPy token file (--tokens FILE.npy)
       jsonl         instruction data, JSON lines (--tokens FILE.jsonl)
       pnm           a PPM/PGM image
       cifar         a CIFAR-10 binary batch
       rendezvous    a hello (rank 0 reads) or a welcome (a rank reads)

   An input refused with an error is a correct result: in this build dt_fail
   returns here (DT_FUZZING) and the next input follows. A crash, a sanitizer
   report (ASan, UBSan), a hang past 10 s or memory past 2 GB is a finding;
   leaks are not looked for (tools/fuzz.sh turns LeakSanitizer off: an error
   path frees nothing, since the process ends).
   Seeds: tests/test_dtrain --write-fuzz-seeds DIR writes the suite's own files. */
#define _POSIX_C_SOURCE 200809L        /* as dtrain.h asks: these includes come before it */
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* What an input allocated, so that what a refused one left behind goes with
   it: dtrain's errors end the process, which frees everything, and so an
   error path frees nothing -- here the next input follows, and millions of
   inputs would pile up their leftovers. Every allocation of the implementation
   (compiled below with these names standing for the real ones) is noted with
   the number of the input that made it; after a refused input, its own are
   freed. Allocations made by earlier inputs and still held (a cache) stay. */
#define FUZZ_SLOTS (1 << 21)
static struct { void *p; uint64_t input; } fuzz_held[FUZZ_SLOTS];   /* live ones; (void *)1: a freed slot */
static uint64_t fuzz_input = 1;
static size_t fuzz_slot(void *p) { return ((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull >> 43 & (FUZZ_SLOTS - 1); }
static void *fuzz_made[1 << 16];                 /* this input's, in order (more: not freed for it) */
static size_t fuzz_nmade;
static void *fuzz_note(void *p) {
    if (!p) return p;
    for (size_t i = fuzz_slot(p), k = 0; k < FUZZ_SLOTS; i = (i + 1) & (FUZZ_SLOTS - 1), k++)
        if (!fuzz_held[i].p || fuzz_held[i].p == (void *)1) {
            fuzz_held[i].p = p;
            fuzz_held[i].input = fuzz_input;
            if (fuzz_nmade < sizeof fuzz_made / sizeof fuzz_made[0]) fuzz_made[fuzz_nmade++] = p;
            return p;
        }
    return p;                                     /* full: this one is not freed for the input */
}
static int fuzz_forget(void *p) {                 /* 1 when p was noted */
    for (size_t i = fuzz_slot(p), k = 0; k < FUZZ_SLOTS && fuzz_held[i].p; i = (i + 1) & (FUZZ_SLOTS - 1), k++)
        if (fuzz_held[i].p == p) { fuzz_held[i].p = (void *)1; return 1; }
    return 0;
}
static void *fuzz_malloc(size_t n) { return fuzz_note(malloc(n)); }
static void *fuzz_calloc(size_t a, size_t b) { return fuzz_note(calloc(a, b)); }
static void *fuzz_realloc(void *p, size_t n) {
    int noted = p && fuzz_forget(p);
    void *q = realloc(p, n);
    if (!q && p && noted) fuzz_note(p);           /* p is still held */
    return q && (noted || !p) ? fuzz_note(q) : q;
}
static void fuzz_free(void *p) { if (p) fuzz_forget(p); free(p); }
static char *fuzz_strdup(const char *s) { return (char *)fuzz_note(strdup(s)); }
static int fuzz_posix_memalign(void **out, size_t align, size_t n) {
    int e = posix_memalign(out, align, n);
    if (!e) fuzz_note(*out);
    return e;
}
/* after a refused input: free what it allocated and still held */
static void fuzz_free_leftovers(void) {
    for (size_t k = 0; k < fuzz_nmade; k++)
        if (fuzz_forget(fuzz_made[k])) free(fuzz_made[k]);
}
#define malloc(n) fuzz_malloc(n)
#define calloc(a, b) fuzz_calloc(a, b)
#define realloc(p, n) fuzz_realloc(p, n)
#define free(p) fuzz_free(p)
#define strdup(s) fuzz_strdup(s)
#define posix_memalign(out, align, n) fuzz_posix_memalign(out, align, n)

#define DTRAIN_IMPLEMENTATION
#include "../../dtrain.h"

static jmp_buf fuzz_back;
static void fuzz_refused(void) { longjmp(fuzz_back, 1); }

/* A private folder for the loaders that read files, and a file in it holding the input. */
static char fuzz_dir[64];
static const char *fuzz_file(const char *name, const uint8_t *data, size_t n) {
    static char path[200];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) { perror(path); abort(); }
    return path;
}

#include "safetensors.c"
#include "config_json.c"
#include "index_json.c"
#include "npy.c"
#include "jsonl.c"
#include "pnm.c"
#include "cifar.c"
#include "rendezvous.c"

typedef struct { const char *name; void (*run)(const uint8_t *data, size_t n); } fuzz_target;
static const fuzz_target targets[] = {
    { "safetensors", fuzz_safetensors }, { "config_json", fuzz_config_json }, { "index_json", fuzz_index_json },
    { "npy", fuzz_npy }, { "jsonl", fuzz_jsonl }, { "pnm", fuzz_pnm }, { "cifar", fuzz_cifar },
    { "rendezvous", fuzz_rendezvous },
};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    snprintf(fuzz_dir, sizeof fuzz_dir, "/tmp/dtrain-fuzz-XXXXXX");
    if (!mkdtemp(fuzz_dir)) { perror("mkdtemp"); abort(); }
    dt__fuzz_refused = fuzz_refused;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    static const fuzz_target *t;
    if (!t) {
        const char *want = getenv("DT_FUZZ");
        for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++)
            if (want && !strcmp(want, targets[i].name)) t = &targets[i];
        if (!t) {
            fprintf(stderr, "DT_FUZZ=%s: which harness? one of:", want ? want : "");
            for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) fprintf(stderr, " %s", targets[i].name);
            fprintf(stderr, "\n");
            exit(2);
        }
    }
    if (setjmp(fuzz_back) == 0) t->run(data, n);
    else fuzz_free_leftovers();
    fuzz_input++;
    fuzz_nmade = 0;
    dt_step_arena_reset();
    return 0;
}
