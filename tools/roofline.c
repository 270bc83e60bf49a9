/* tools/roofline -- how fast can this machine multiply, and how close does dtrain come?

   usage: tools/roofline [--threads N] [--quick] [--only WORDS] [--reps N] [--seconds S]

   Prints key=value lines (one measurement a line) that a shell script reads:
     fma_peak  the core's limit: a loop of independent fused multiply-adds of
               the build's vector width (16 floats with AVX-512, 8 with AVX2
               and FMA, scalar otherwise), enough of them to hide their latency
     gemm      C = A B on one shape: dtrain's dt_gemm and OpenBLAS's
               cblas_sgemm side by side (GFLOP/s, best of several calls that
               alternate between the two; *_mean_gflops: all those calls'
               FLOP over all their time, the rate they kept up, which a
               training step's own rate compares with on a machine whose
               speed swings from call to call), first 1024^3, then the three
               matmuls of each linear layer y = x W^T of three workloads:
                 fwd  y = x W^T       ta=0 tb=1  M=rows N=out K=in
                 dx   dY W            ta=0 tb=0  M=rows N=in  K=out
                 dw   dY^T X          ta=1 tb=0  M=out  N=in  K=rows
   OpenBLAS is opened at run time (libopenblas.so.0, else libblas.so.3 when it
   has cblas_sgemm), so the tool builds without it; where there is none, a
   line says so. OpenBLAS 0.3.21 picks its kernels by the processor's model
   number and may not know a newer one: set OPENBLAS_CORETYPE (SKYLAKEX,
   COOPERLAKE, HASWELL) to measure it at its best.
     --threads N  OpenMP threads for dtrain and OpenBLAS (default 1)
     --quick      the peak and 1024^3 only
     --only WORDS the shapes whose name holds one of the comma-separated WORDS
                  (e.g. vit, dw, gpt2-124m-ctx256-b4/fc1/fwd; 1024: the square)
     --reps N     timed calls per shape (default: as many as fit in about 0.3 s,
                  at least 3; a call of over a second is timed once after its
                  warm-up: Qwen's head is 0.3 TFLOP a matmul)
     --seconds S  the time the calls of a shape should fill, each side (default
                  0.3; at most 50 calls unless --reps says)
   A whole run takes about a minute at one thread on a core with AVX-512. */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <dlfcn.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__GNUC__) && (defined(__AVX512F__) || defined(__FMA__))
#include <immintrin.h>
#endif

/* ---- the peak: CHAINS independent multiply-adds per iteration --------------
   A fused multiply-add takes 4 cycles and a core starts two a cycle, so at
   least 8 must be in flight; more, while they fit the registers, leave room
   for the loop's own instructions. */
#if defined(__GNUC__) && defined(__AVX512F__)
#define VL 16
#define CHAINS 24
typedef __m512 vec;
#define VSET(x) _mm512_set1_ps(x)
#define VFMA(c, a, b) _mm512_fmadd_ps(a, b, c)
static float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#define ISA "avx512"
#elif defined(__GNUC__) && defined(__FMA__) && defined(__AVX__)
#define VL 8
#define CHAINS 12
typedef __m256 vec;
#define VSET(x) _mm256_set1_ps(x)
#define VFMA(c, a, b) _mm256_fmadd_ps(a, b, c)
static float vsum(vec v) { float f[8]; memcpy(f, &v, sizeof f); return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7]; }
#define ISA "avx2-fma"
#else
#define VL 1
#define CHAINS 8
typedef float vec;
#define VSET(x) (x)
#define VFMA(c, a, b) ((c) + (a) * (b))
static float vsum(vec v) { return v; }
#define ISA "scalar"
#endif

/* GFLOP/s of `iters` rounds of CHAINS multiply-adds (acc = acc m + a) on
   each thread. The multiplier is just under 1 and the addend tiny, so nothing
   overflows or goes subnormal; the sum is kept, so nothing is optimised away. */
static double fma_loop(long iters, int threads, float *sink) {
    double t0 = dt_now_ms();
    float total = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+:total)
#endif
    {
        vec acc[CHAINS];
        vec m = VSET(0.9999999f), a = VSET(1e-7f);
        for (int j = 0; j < CHAINS; j++) acc[j] = VSET((float)j);
        for (long i = 0; i < iters; i++) {
#pragma GCC unroll 32
            for (int j = 0; j < CHAINS; j++) acc[j] = VFMA(a, acc[j], m);
        }
        float s = 0;
        for (int j = 0; j < CHAINS; j++) s += vsum(acc[j]);
        total += s;
    }
    double ms = dt_now_ms() - t0;
    *sink += total;
    return 2.0 * CHAINS * VL * (double)iters * threads / (ms / 1e3) / 1e9;
}

/* ---- OpenBLAS, opened at run time ---------------------------------------- */
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static sgemm_fn blas_sgemm;
static const char *blas_name = "none";

static void open_blas(int threads) {
    const char *names[] = { "libopenblas.so.0", "libopenblas.so", "libblas.so.3" };
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !blas_sgemm; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!h) continue;
        blas_sgemm = (sgemm_fn)(uintptr_t)dlsym(h, "cblas_sgemm");
        if (!blas_sgemm) { dlclose(h); continue; }
        blas_name = names[i];
        void (*set_threads)(int) = (void (*)(int))(uintptr_t)dlsym(h, "openblas_set_num_threads");
        if (set_threads) set_threads(threads);
    }
}
static void blas_gemm(int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B, int ldb, float *C, int ldc) {
    /* CBLAS's enums: CblasRowMajor 101, CblasNoTrans 111, CblasTrans 112 */
    blas_sgemm(101, ta ? 112 : 111, tb ? 112 : 111, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
}

/* ---- the shapes ----------------------------------------------------------- */
typedef struct { const char *workload, *layer; int rows, in, out; } layer;
static const layer layers[] = {
    { "vit-tiny-b64", "qkv", 4160, 192, 576 },      /* 64 images x 65 tokens */
    { "vit-tiny-b64", "proj", 4160, 192, 192 },
    { "vit-tiny-b64", "fc1", 4160, 192, 768 },
    { "vit-tiny-b64", "fc2", 4160, 768, 192 },
    { "gpt2-124m-ctx256-b4", "qkv", 1024, 768, 2304 },
    { "gpt2-124m-ctx256-b4", "proj", 1024, 768, 768 },
    { "gpt2-124m-ctx256-b4", "fc1", 1024, 768, 3072 },
    { "gpt2-124m-ctx256-b4", "fc2", 1024, 3072, 768 },
    { "gpt2-124m-ctx256-b4", "head", 1024, 768, 50257 },
    { "qwen2-0.5b-9x128", "q,o", 1152, 896, 896 },
    { "qwen2-0.5b-9x128", "k,v", 1152, 896, 128 },
    { "qwen2-0.5b-9x128", "gate,up", 1152, 896, 4864 },
    { "qwen2-0.5b-9x128", "down", 1152, 4864, 896 },
    { "qwen2-0.5b-9x128", "head", 1152, 896, 151936 },
};

/* Does `name` hold one of the comma-separated words of `only` (NULL: all)? */
static int wanted(const char *name, const char *only) {
    if (!only) return 1;
    for (const char *w = only; *w;) {
        size_t n = strcspn(w, ",");
        for (const char *p = name; n && *p; p++)
            if (!strncmp(p, w, n)) return 1;
        w += n + (w[n] == ',');
    }
    return 0;
}

static float *random_matrix(size_t n, uint64_t seed) {
    float *p = (float *)malloc(n * sizeof(float) + 64);
    if (!p) dt_fail("roofline: out of memory (%zu floats)", n);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        p[i] = (float)((s >> 40) * (1.0 / 16777216.0) - 0.5);
    }
    return p;
}

static double seconds_of(int blas, int ta, int tb, int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                         float *C, int ldc) {
    double t0 = dt_now_ms();
    if (blas) blas_gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    else dt_gemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
    return (dt_now_ms() - t0) / 1e3;
}

/* One shape: a warm-up call of each, then calls that alternate between
   dtrain and OpenBLAS (the load other programs put on the machine then
   falls on both), the best of each and the rate over all of them. */
static void time_shape(const char *name, int ta, int tb, int M, int N, int K, int reps_wanted, double window) {
    int lda = ta ? M : K, ldb = tb ? K : N, ldc = N;
    float *A = random_matrix((size_t)(ta ? K : M) * lda, 1), *B = random_matrix((size_t)(tb ? N : K) * ldb, 2);
    float *C = random_matrix((size_t)M * ldc, 3);
    double flops = 2.0 * M * N * K, best[2] = { 1e30, 1e30 }, total[2] = { 0, 0 };
    double first = seconds_of(0, ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
    if (blas_sgemm) first = fmax(first, seconds_of(1, ta, tb, M, N, K, A, lda, B, ldb, C, ldc));
    int reps = reps_wanted > 0 ? reps_wanted : first > 1.0 ? 1 : (int)fmin(50, fmax(3, window / first));
    for (int r = 0; r < reps; r++)
        for (int blas = 0; blas <= (blas_sgemm != NULL); blas++) {
            double t = seconds_of(blas, ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
            best[blas] = fmin(best[blas], t);
            total[blas] += t;
        }
    printf("gemm shape=%s ta=%d tb=%d M=%d N=%d K=%d reps=%d dtrain_gflops=%.1f", name, ta, tb, M, N, K, reps,
           flops / best[0] / 1e9);
    if (blas_sgemm) printf(" openblas_gflops=%.1f ratio=%.2f", flops / best[1] / 1e9, best[1] / best[0]);
    printf(" dtrain_mean_gflops=%.1f", flops * reps / total[0] / 1e9);
    if (blas_sgemm) printf(" openblas_mean_gflops=%.1f", flops * reps / total[1] / 1e9);
    printf("\n");
    fflush(stdout);
    free(A); free(B); free(C);
}

int main(int argc, char **argv) {
    int threads = 1, quick = 0, reps = 0;
    double window = 0.3;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = (int)dt_flag_number("--threads", argv[++i], 1, 1024, 1);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = (int)dt_flag_number("--reps", argv[++i], 1, 1e6, 1);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) window = dt_flag_number("--seconds", argv[++i], 0.001, 600, 0);
        else {
            fprintf(stderr, "usage: %s [--threads N] [--quick] [--only WORDS] [--reps N] [--seconds S]\n", argv[0]);
            return strcmp(argv[i], "--help") && strcmp(argv[i], "-h") ? 2 : 0;
        }
    }
    if (threads < 1) threads = 1;
#ifdef _OPENMP
    omp_set_num_threads(threads);
#else
    threads = 1;
#endif
#ifdef DT_HAVE_CBLAS
    const char *backend = "cblas";      /* this build's dt_gemm is the system BLAS's (make BLAS=0: the built-in) */
#else
    const char *backend = "builtin";
#endif
    printf("roofline threads=%d isa=%s vector_floats=%d dt_gemm=%s\n", threads, ISA, VL, backend);

    /* the peak: a short run to wake the core's clocks, then the best of 5 */
    float sink = 0;
    long iters = VL > 1 ? (long)(1e10 / (2.0 * CHAINS * VL)) : 20000000;   /* about 0.05 s a run */
    fma_loop(iters / 4, threads, &sink);
    double peak = 0;
    for (int r = 0; r < 5; r++) peak = fmax(peak, fma_loop(iters, threads, &sink));
    printf("fma_peak threads=%d gflops=%.1f chains=%d\n", threads, peak, CHAINS);
    if (sink == 12345.0f) printf("(sink)\n");

    open_blas(threads);
    if (blas_sgemm) {
        const char *core = getenv("OPENBLAS_CORETYPE");
        printf("openblas library=%s coretype=%s\n", blas_name, core && *core ? core : "(its own choice)");
    } else printf("openblas library=none (neither libopenblas.so.0 nor a libblas.so.3 with cblas_sgemm): dtrain alone\n");
    fflush(stdout);

    if (wanted("square-1024", only)) time_shape("square-1024", 0, 0, 1024, 1024, 1024, reps, window);
    if (quick) return 0;
    for (size_t i = 0; i < sizeof layers / sizeof layers[0]; i++) {
        const layer *l = &layers[i];
        static const char *kinds[] = { "fwd", "dx", "dw" };
        for (int k = 0; k < 3; k++) {
            char name[96];
            snprintf(name, sizeof name, "%s/%s/%s/%dx%d->%d", l->workload, l->layer, kinds[k], l->rows, l->in, l->out);
            if (!wanted(name, only)) continue;
            if (k == 0) time_shape(name, 0, 1, l->rows, l->out, l->in, reps, window);
            else if (k == 1) time_shape(name, 0, 0, l->rows, l->in, l->out, reps, window);
            else time_shape(name, 1, 0, l->out, l->in, l->rows, reps, window);
        }
    }
    return 0;
}
