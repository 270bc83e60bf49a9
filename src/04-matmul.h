//@ lesson: the matmul every linear layer goes through, tiled for the cache and the vector unit
/* ---- kernels ------------------------------------------------------------------ */

/* C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major; op transposes
   when trans_a / trans_b is set. The one routine every matmul goes through. */
void dt_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha,
             const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* Per-element arithmetic, shared with the GPU kernels. */
/* exp, tanh and erf in plain float arithmetic, with no call into libm, so that
   a compiler turns a loop of them into vector instructions (libm's are one
   value per call: a third of the GPT's step went to tanhf and expm1f). The
   same bits on the CPU and the GPU. Accuracy, tested against libm over a dense
   grid: exp within 4 ulps (relative 5e-7); tanh and erf within 5e-7 absolute. */
DT_HD static inline float dt_exp_value(float x);
DT_HD static inline float dt_tanh_value(float x);
DT_HD static inline float dt_erf_value(float x);
DT_HD static inline float dt_gelu_value(float x);        /* x * Phi(x), exact erf */
DT_HD static inline float dt_gelu_derivative(float x);
/* GPT-2's GELU: the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
DT_HD static inline float dt_gelu_tanh_value(float x);
DT_HD static inline float dt_gelu_tanh_derivative(float x);
/* Llama's SiLU, x * sigmoid(x), and its derivative */
DT_HD static inline float dt_silu_value(float x);
DT_HD static inline float dt_silu_derivative(float x);
/* Half types: round to nearest even; inf, NaN and subnormals survive. */
DT_HD static inline uint16_t dt_f32_to_bf16(float f);
DT_HD static inline float dt_bf16_to_f32(uint16_t h);
DT_HD static inline uint16_t dt_f32_to_f16(float f);
DT_HD static inline float dt_f16_to_f32(uint16_t h);

//@ implementation
/* ==== kernels: matrix multiply ===============================================
   Nearly all of training's arithmetic is matmul, so this is where speed lives.
   The classic recipe (Goto and van de Geijn): cut K into KC-deep slabs and N
   into NC-wide panels, copy ("pack") each KC x NC panel of B once into
   NR-column strips, k-major and zero-padded, and let a small register-blocked
   kernel compute an MR x NR tile of C from MR rows of A and one B strip. The
   MR x NR accumulators stay in vector registers for the whole KC loop; the
   kernel broadcasts one A value per row and multiplies it into a B row.
   A is read where it lies whenever it can be: the kernel only needs A's rows
   (or columns) to step by a fixed stride, so the common x W^T case packs
   nothing but B, which every block of rows shares. Copying costs as much as a
   few multiply-adds per value, and an activation's rows are read only N / NR
   times: packing A too, as the recipe does, cost up to a third of the time on
   this project's skinny shapes (N = 192). A transposed A (the weight gradient
   dY^T X) and the last few rows are copied into a small block per thread.
   Each C element is owned by one thread and summed in one fixed order (k
   within a slab, then slab after slab), so the bits do not depend on the
   thread count or on how the rows are cut into blocks. */

/* The tile: MR rows x NR = 2 vectors of columns, 2 MR accumulators. With
   AVX-512's 32 registers, 14 x 2 = 28 of them, the two B vectors and the
   broadcast A value: 14 rows at a time instead of 8 do 75% more arithmetic
   per B vector loaded. AVX2 has 16 registers: 6 x 2 + 2 + 1 of them.
   DT_ROWS_OUTER: which of a tile's operands stays in the L1 cache while a
   block of C is made. With NR = 32 floats a strip of B is 32 KB (KC 256 x NR),
   two thirds of a 48 KB L1 cache, and the 14 rows of A streamed past it
   pushed it out: on AVX-512 a block runs A's strip (14 KB) against every
   strip of B in turn. With the prefetch of C below, GPT-2's first MLP
   layer (1,024 x 3,072 x 768) went from 120 to 137 GFLOP/s at one thread
   and its head (N = 50,257) from 103 to 145. With AVX2 a strip of B is
   16 KB and stays, and B outer is as fast. Either way each C element's sum
   is the same. (In one slab of 768 neither strip stays: see DT_KC_WHOLE.) */
#if defined(__GNUC__) && defined(__AVX512F__)
#define DT_VL 16
#define DT_MR 14
#define DT_ROWS_OUTER 1
#elif defined(__GNUC__) && defined(__AVX__)
#define DT_VL 8
#define DT_MR 6
#define DT_ROWS_OUTER 0
#else
#define DT_VL 4
#define DT_MR 4
#define DT_ROWS_OUTER 0
#endif
#define DT_NR (2 * DT_VL)
#define DT_KC 256
#define DT_MC (DT_MR * 8)
#define DT_NC 1024
/* A slab of K is summed into C, stored, and read back for the next: with A
   read in place (not transposed) and K at most DT_KC_WHOLE, the whole of K
   is one slab, C is stored once, and B's panel is as wide as KC x NC floats
   stay 1 MiB (half an L2 cache; narrower past KC 256, wider below). Neither a
   strip of A nor of B then stays in the L1 cache, but vit-tiny's K = 768
   products went from ~120 to ~135 GFLOP/s inside its step, GPT-2's x W^T
   from 130-135 to 140-143 alone. A transposed A (dW = dY^T X: K is the tokens) keeps DT_KC slabs,
   which the loss's blocks of rows and attention's tiles are cut to match. */
#define DT_KC_WHOLE 768
/* Packing space, one buffer per calling thread, kept between calls (and freed
   with the device's arenas): attention makes thousands of small matmuls per
   step, and a fresh allocation for each costs more (the kernel zeroing new
   pages) than the arithmetic. Declared outside the built-in routine: the
   arenas free it in any build. */
static DT_THREAD_LOCAL float *dt__pack_buffer;
static DT_THREAD_LOCAL size_t dt__pack_floats;

/* The vector type, and the kernels' multiply-add, which attention (the attention-and-loss chapter)
   uses in every build. */
#if defined(__GNUC__)
typedef float dt__vec __attribute__((vector_size(DT_VL * 4), aligned(4)));
#define DT__INLINE static inline __attribute__((always_inline))
/* A vector's load and store at any float's address. Not memcpy into a
   dt__vec: gcc tuned for AMD's Zen (-march=native on a Ryzen or an EPYC)
   copies 32 bytes as two 16-byte halves through the stack and reads them
   back whole, a store the processor cannot forward, and kept the kernel's
   accumulators in memory: on an EPYC (Zen 3) the matmul ran at 10 GFLOP/s
   a thread, and 70-90 with these loads, OpenBLAS's speed there. gcc 12 makes
   the same round trip for -march=skylake-avx512 too. may_alias: floats read
   as a vector. */
typedef float dt__vec_at __attribute__((vector_size(DT_VL * 4), aligned(4), may_alias));
DT__INLINE dt__vec dt__vload(const float *p) { return *(const dt__vec_at *)p; }
DT__INLINE void dt__vstore(float *p, dt__vec v) { *(dt__vec_at *)p = v; }
#define DT__PREFETCH(p) __builtin_prefetch(p)     /* a line to be read soon: asked for now */
/* ... into the L2 cache, not the L1. As an instruction the compiler must
   keep: gcc 12's dead-code pass (cddce) deleted every
   __builtin_prefetch(p, 0, 2) of attention's, and the binary had none,
   where the same loop in a small file keeps them. */
#if defined(__x86_64__) || defined(__i386__)
#define DT__PREFETCH_L2(p) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(p)))
#else
#define DT__PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#endif
#else
#define DT__INLINE static inline
#define DT__PREFETCH(p) ((void)(p))
#define DT__PREFETCH_L2(p) ((void)(p))
#endif
/* c + s * b in one rounding (a fused multiply-add) where the processor has it:
   one instruction instead of two, so the kernel does twice the arithmetic per
   cycle. gcc under -std=c11 never fuses on its own (-ffp-contract=off), so the
   kernel asks. A result then differs from the unfused one in the last bit;
   every run of a build still gives the same bits, at any thread count. */
#if defined(__GNUC__) && defined(__AVX512F__) && DT_VL == 16
#include <immintrin.h>
#define DT__MADD(c, s, b) ((dt__vec)_mm512_fmadd_ps(_mm512_set1_ps(s), (__m512)(b), (__m512)(c)))
#elif defined(__GNUC__) && defined(__FMA__) && DT_VL == 8
#include <immintrin.h>
#define DT__MADD(c, s, b) ((dt__vec)_mm256_fmadd_ps(_mm256_set1_ps(s), (__m256)(b), (__m256)(c)))
#else
#define DT__MADD(c, s, b) ((c) + (s) * (b))
#endif

/* Sums in lanes: LayerNorm's rows and the softmax's, summed as DT_LANES
   interleaved partial sums and those added in a fixed order, which vectorise
   where one running sum could not (the autograd chapter's LayerNorm says why). */
#define DT_LANES 16
/* sum of f(j) for j < D as DT_LANES partial sums; `acc` must start at zero */
#define DT__LANE_SUM(acc, D, j, expr)                                          \
    do {                                                                       \
        int j##_0 = 0;                                                         \
        for (; j##_0 + DT_LANES <= (D); j##_0 += DT_LANES)                     \
            for (int l_ = 0; l_ < DT_LANES; l_++) { int j = j##_0 + l_; acc[l_] += (expr); } \
        for (int j = j##_0; j < (D); j++) acc[j % DT_LANES] += (expr);         \
    } while (0)
static float dt__lanes_total(const float *acc) {
    float s = 0;
    for (int l = 0; l < DT_LANES; l++) s += acc[l];
    return s;
}

/* What a linear layer's matmul does to C as it stores it: add a bias to
   every row, then, where `gelu` is set, write GELU of the result into a
   second matrix laid out as C. The built-in routine does both on each tile
   while it is in registers or the L1 cache, which saves the passes over the
   output that separate ops would make. In backward, where `gelu_grad` is
   set (the pre-activation x of the GELU whose output's gradient C is), C
   becomes that gradient times GELU'(x): the gradient of x, in C's place.
   `slope` trades the erf of backward for a store: forward then writes GELU'
   of C over C (its only reader is GELU's backward), and backward reads
   gelu_grad as GELU'(x) itself; each product has the same bits. And where
   `a_sums` (`b_sums`) is set, the sums over k of op(A)'s rows
   (op(B)'s columns) are added to it, k by k in order, while the routine
   packs them: a bias's gradient, the sum of dy over the rows, from the
   weight gradient's own pass over dy. */
typedef struct dt__epilogue {
    const float *bias;
    float *gelu;
    int tanh_form;
    const float *gelu_grad;
    int slope;
    float *a_sums, *b_sums;
} dt__epilogue;
static void dt__gelu_rows(float *restrict x, float *restrict y, ptrdiff_t ld, int rows, int cols, int tanh_form, int slope) {
    for (int i = 0; i < rows; i++) {                 /* a loop per form: each vectorises */
        float *xr = x + i * ld, *yr = y + i * ld;
        if (slope && tanh_form)                      /* value and slope share their tanh or erf */
            for (int j = 0; j < cols; j++) { float v = xr[j]; yr[j] = dt_gelu_tanh_value(v); xr[j] = dt_gelu_tanh_derivative(v); }
        else if (slope)
            for (int j = 0; j < cols; j++) { float v = xr[j]; yr[j] = dt_gelu_value(v); xr[j] = dt_gelu_derivative(v); }
        else if (tanh_form) for (int j = 0; j < cols; j++) yr[j] = dt_gelu_tanh_value(xr[j]);
        else for (int j = 0; j < cols; j++) yr[j] = dt_gelu_value(xr[j]);
    }
}
static void dt__gelu_grad_rows(float *restrict c, const float *restrict x, ptrdiff_t ld, int rows, int cols, int tanh_form, int slope) {
    for (int i = 0; i < rows; i++) {                 /* the bits of GELU's own backward: dy * GELU'(x) */
        float *cr = c + i * ld;
        const float *xr = x + i * ld;
        if (slope) for (int j = 0; j < cols; j++) cr[j] = cr[j] * xr[j];
        else if (tanh_form) for (int j = 0; j < cols; j++) cr[j] = cr[j] * dt_gelu_tanh_derivative(xr[j]);
        else for (int j = 0; j < cols; j++) cr[j] = cr[j] * dt_gelu_derivative(xr[j]);
    }
}

/* dst[j * ldd + i] = src[i * ld + j] for a DT_VL x DT_VL square: whole
   vectors loaded, turned in registers and stored, where element by element
   every store (or every load) goes to another line. Attention's K and V
   transposes, and the packing of a transposed B, use it. */
#if defined(__GNUC__) && defined(__AVX512F__) && DT_VL == 16
DT__INLINE void dt__transpose_block(const float *src, ptrdiff_t ld, float *dst, ptrdiff_t ldd) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ld);
    for (int i = 0; i < 16; i += 2) {          /* pairs of rows interleaved by element */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {          /* ... by pairs of elements: four rows' columns in each 128-bit lane */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {              /* then the 128-bit lanes, twice */
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldd, r[i]);   /* r[i]: column i */
}
#define DT__TRANSPOSE_BLOCKS 1
#elif defined(__GNUC__) && defined(__AVX__) && DT_VL == 8
#include <immintrin.h>
DT__INLINE void dt__transpose_block(const float *src, ptrdiff_t ld, float *dst, ptrdiff_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {              /* the low 128-bit lanes are columns 0-3, the high 4-7 */
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}
#define DT__TRANSPOSE_BLOCKS 1
#else
#define DT__TRANSPOSE_BLOCKS 0
#endif

/* With a system BLAS (DT_HAVE_CBLAS) none of the routine below is compiled. */
#ifndef DT_HAVE_CBLAS

/* One MR x NR tile of C = alpha * (sum over k of a(i, k) b[k][j]) + beta * C,
   where a(i, k) = a[i * row_step + k * k_step]: A's rows in place (k_step 1),
   or a transposed or packed block (row_step 1). Inlined at each call, so the
   strides that are constants there cost nothing. Only the first rows x cols
   of the tile are written. A bias (the tile's columns of it; NULL for none)
   is added to each row as the tile is stored: on the last slab, after the
   sum, so its bits are those of adding it afterwards. */
DT__INLINE void dt__gemm_micro(int kc, const float *restrict a, ptrdiff_t row_step, ptrdiff_t k_step,
                               const float *restrict b, float alpha, float beta, float *restrict C, int ldc,
                               int rows, int cols, const float *restrict bias) {
    float acc[DT_MR * DT_NR];
#if defined(__GNUC__)
    /* The tile of C is read (after the first slab) and written only once the
       sum is done; C is far larger than the caches, so without a word
       ahead each of its rows is a miss the kernel waits for at the end
       (15% of a GPT-2 layer's time). Asked for now, it arrives during the
       sum. The last float's line too: a row may start mid-line. */
    for (int i = 0; i < rows; i++) {
        __builtin_prefetch(C + (size_t)i * ldc, 1);
        __builtin_prefetch(C + (size_t)i * ldc + DT_VL, 1);
        __builtin_prefetch(C + (size_t)i * ldc + cols - 1, 1);
    }
    dt__vec c0[DT_MR], c1[DT_MR];
    for (int i = 0; i < DT_MR; i++) { c0[i] = (dt__vec){0}; c1[i] = (dt__vec){0}; }
    for (int k = 0; k < kc; k++) {
        dt__vec b0 = dt__vload(b + (size_t)k * DT_NR), b1 = dt__vload(b + (size_t)k * DT_NR + DT_VL);
#pragma GCC unroll 16
        for (int i = 0; i < DT_MR; i++) {
            float s = a[i * row_step + k * k_step];
            c0[i] = DT__MADD(c0[i], s, b0);
            c1[i] = DT__MADD(c1[i], s, b1);
        }
    }
    if (rows == DT_MR && cols == DT_NR) {            /* a whole tile: C in vectors */
        dt__vec bias0 = { 0 }, bias1 = { 0 };
        if (bias) { bias0 = dt__vload(bias); bias1 = dt__vload(bias + DT_VL); }
        for (int i = 0; i < DT_MR; i++) {
            float *c = C + (size_t)i * ldc;
            dt__vec o0, o1;
            if (beta == 0.0f) { o0 = alpha * c0[i]; o1 = alpha * c1[i]; }
            else {
                o0 = dt__vload(c);
                o1 = dt__vload(c + DT_VL);
                if (beta == 1.0f) { o0 += alpha * c0[i]; o1 += alpha * c1[i]; }
                else { o0 = beta * o0 + alpha * c0[i]; o1 = beta * o1 + alpha * c1[i]; }
            }
            if (bias) { o0 += bias0; o1 += bias1; }
            dt__vstore(c, o0);
            dt__vstore(c + DT_VL, o1);
        }
        return;
    }
    for (int i = 0; i < DT_MR; i++) {
        dt__vstore(acc + i * DT_NR, c0[i]);
        dt__vstore(acc + i * DT_NR + DT_VL, c1[i]);
    }
#else
    for (int i = 0; i < DT_MR * DT_NR; i++) acc[i] = 0;
    for (int k = 0; k < kc; k++)
        for (int i = 0; i < DT_MR; i++)
            for (int j = 0; j < DT_NR; j++) acc[i * DT_NR + j] += a[i * row_step + k * k_step] * b[k * DT_NR + j];
#endif
    for (int i = 0; i < rows; i++) {                 /* the edge of C, or no vectors */
        float *c = C + (size_t)i * ldc;
        const float *r = acc + i * DT_NR;
        if (beta == 0.0f) for (int j = 0; j < cols; j++) c[j] = alpha * r[j];
        else if (beta == 1.0f) for (int j = 0; j < cols; j++) c[j] += alpha * r[j];
        else for (int j = 0; j < cols; j++) c[j] = beta * c[j] + alpha * r[j];
        if (bias) for (int j = 0; j < cols; j++) c[j] += bias[j];
    }
}

/* The packings below read a short piece of each of kc rows a pitch apart
   (a row of dY or X is 3 KB in vit-tiny): too far apart for the hardware to
   guess the next, so each asks for the row DT_PACK_AHEAD further on (vit-
   tiny's weight gradients: about 1% of its step). */
#define DT_PACK_AHEAD 8
/* Copy A[i0:i0+rows, k0:k0+kc] (the last rows of a block, fewer than MR) into
   one MR-row strip, k-major, zero-padded (what dt__gemm_micro reads with
   row_step 1, k_step MR). */
static void dt__pack_a(const float *A, int lda, int i0, int rows, int k0, int kc, float *dst) {
    for (int k = 0; k < kc; k++) {
        float *d = dst + (size_t)k * DT_MR;
        for (int i = 0; i < rows; i++) d[i] = A[(size_t)(i0 + i) * lda + k0 + k];
        for (int i = rows; i < DT_MR; i++) d[i] = 0;
    }
}
/* A transposed A's whole block of mc rows (A's columns i0..i0+mc) at once,
   a row of A at a time: each row's mc floats are read in one go, where strip
   by strip they would be read in MR-float pieces, a cache line fetched for
   each k and each strip. */
static void dt__pack_a_block_trans(const float *A, int lda, int i0, int mc, int k0, int kc, float *block, float *sums) {
    for (int k = 0; k < kc; k++) {
        const float *src = A + (size_t)(k0 + k) * lda + i0;
        if (k + DT_PACK_AHEAD < kc)
            for (int i = 0; i < mc + 15; i += 16) DT__PREFETCH(src + DT_PACK_AHEAD * (size_t)lda + (i < mc ? i : mc - 1));
        if (sums) for (int i = 0; i < mc; i++) sums[i] += src[i];
        for (int is = 0; is < mc; is += DT_MR) {
            float *d = block + (size_t)is * kc + (size_t)k * DT_MR;
            if (mc - is >= DT_MR) { memcpy(d, src + is, DT_MR * sizeof(float)); continue; }
            for (int i = 0; i < DT_MR; i++) d[i] = is + i < mc ? src[is + i] : 0.0f;
        }
    }
}
/* Copy op(B)[k0:k0+kc, j0:j0+cols] into one NR-column strip, k-major,
   zero-padded. A transposed B (the weight in x W^T) is NR of W's rows: turned
   in DT_VL x DT_VL squares, each source line read once and whole. Read k by k
   (NR floats from NR rows), its lines had to stay in the L1 cache for their
   16 k, and rows 2 KB apart or a multiple of it (GPT-2's fc2, 3072 floats
   wide) fall into one or two of the cache's 64 sets, which hold 8 or 12
   lines each: every k fetched them again. */
static void dt__pack_b(int trans, const float *B, int ldb, int k0, int kc, int j0, int cols, float *dst, float *sums) {
    if (trans) {
        int k = 0;
#if DT__TRANSPOSE_BLOCKS
        if (cols == DT_NR)
            for (; k + DT_VL <= kc; k += DT_VL)
                for (int jb = 0; jb < DT_NR; jb += DT_VL)
                    dt__transpose_block(B + (size_t)(j0 + jb) * ldb + k0 + k, ldb, dst + (size_t)k * DT_NR + jb, DT_NR);
#endif
        for (; k < kc; k++) {                       /* the rest, k by k */
            const float *src = B + (size_t)j0 * ldb + k0 + k;
            float *d = dst + (size_t)k * DT_NR;
            for (int j = 0; j < cols; j++) d[j] = src[(size_t)j * ldb];
            for (int j = cols; j < DT_NR; j++) d[j] = 0;
        }
        return;
    }
    for (int k = 0; k < kc; k++) {
        const float *src = B + (size_t)(k0 + k) * ldb + j0;
        float *d = dst + (size_t)k * DT_NR;
        if (k + DT_PACK_AHEAD < kc) {
            for (int j = 0; j < cols + DT_VL - 1; j += DT_VL)   /* 32 floats may touch three lines */
                DT__PREFETCH(src + DT_PACK_AHEAD * (size_t)ldb + (j < cols ? j : cols - 1));
        }
        if (sums) for (int j = 0; j < cols; j++) sums[j] += src[j];
        if (cols == DT_NR) { memcpy(d, src, DT_NR * sizeof(float)); continue; }
        for (int j = 0; j < cols; j++) d[j] = src[j];
        for (int j = cols; j < DT_NR; j++) d[j] = 0;
    }
}

/* Aligned to a cache line: the kernel's two B vectors a k are then two whole
   lines. malloc's large blocks start 16 bytes into a page, which split every
   one of them across two lines: vit-tiny's step ran 6% slower. */
static float *dt__pack_space(size_t floats) {
    if (floats > dt__pack_floats) {
        free(dt__pack_buffer);
        void *p = NULL;
        dt__pack_buffer = posix_memalign(&p, 64, floats * sizeof(float)) == 0 ? (float *)p : NULL;
        if (!dt__pack_buffer) dt_fail("out of memory in matmul");
        dt__pack_floats = floats;
    }
    return dt__pack_buffer;
}

/* Blocks of rows: as many as a multiple of the thread count, each at most
   MC rows, cut at whole MR-row strips as evenly as they go (4160 rows for 2
   threads with AVX-512: 38 blocks of 7 or 8 strips of 14, 19 per thread). */
static int dt__gemm_blocks(int M, int threads) {
    return threads * ((M + threads * DT_MC - 1) / (threads * DT_MC));
}

/* The threads the routine's parallel region will have: one when it is called
   from inside another parallel region (attention's loop over heads) and
   OpenMP runs no nested teams, as by default. */
static int dt__gemm_threads(void) {
#ifdef _OPENMP
    if (omp_get_active_level() >= omp_get_max_active_levels()) return 1;
#endif
    return dt_threads();
}

static void dt__gemm_builtin(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                            const float *B, int ldb, float beta, float *C, int ldc, const dt__epilogue *ep) {
    int threads = dt__gemm_threads();
    int KC = !ta && K <= DT_KC_WHOLE ? K : DT_KC, NC = DT_KC * DT_NC / KC / DT_NR * DT_NR;   /* panel: KC x NC, 1 MiB at most */
    float *space = dt__pack_space((size_t)KC * NC + (size_t)threads * DT_MC * KC);
    float *panel = space;                              /* B's panel: shared by the threads */
    int blocks_m = dt__gemm_blocks(M, threads), strips_m = (M + DT_MR - 1) / DT_MR;
    float *a_sums = ep && ta ? ep->a_sums : NULL, *b_sums = ep && !tb ? ep->b_sums : NULL;   /* summed as packed */
    /* A's rows are read in place (no packing) unless they are 2 KB apart or
       a multiple of it: an L1 cache has 64 sets of 8 or 12 lines, and such
       rows fall into one or two sets, so the MR rows' lines evict each other
       every k. Packed, 1024^3 ran at 100 GFLOP/s where in place it ran at 77,
       and GPT-2's fc2 forward (x 3072 floats wide) at 92 where at 74 (AMD
       EPYC with AVX-512, one thread). */
    int aliased = lda % 512 == 0;
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        float b_eff = k0 == 0 ? beta : 1.0f;            /* later slabs add to the first */
        const float *bias_now = ep && k0 + kc == K ? ep->bias : NULL;   /* the epilogue: on the last slab */
        float *gelu_now = ep && k0 + kc == K ? ep->gelu : NULL;
        const float *gelu_grad_now = ep && k0 + kc == K ? ep->gelu_grad : NULL;
        for (int j0 = 0; j0 < N; j0 += NC) {
            int nc = N - j0 < NC ? N - j0 : NC, strips = (nc + DT_NR - 1) / DT_NR;
            DT_OMP("omp parallel num_threads(threads) if(blocks_m > 1 && (double)M * nc * kc > 65536.0)")
            {
                DT_OMP("omp for schedule(static)")
                for (int s = 0; s < strips; s++) {
                    int cols = nc - s * DT_NR < DT_NR ? nc - s * DT_NR : DT_NR;
                    dt__pack_b(tb, B, ldb, k0, kc, j0 + s * DT_NR, cols, panel + (size_t)s * DT_NR * kc,
                               b_sums ? b_sums + j0 + s * DT_NR : NULL);
                }
                float *block = space + (size_t)KC * NC + (size_t)dt__thread_num() * DT_MC * KC;
                DT_OMP("omp for schedule(static)")
                for (int bm = 0; bm < blocks_m; bm++) {
                    int i0 = (int)((int64_t)bm * strips_m / blocks_m) * DT_MR;
                    int i1 = (int)((int64_t)(bm + 1) * strips_m / blocks_m) * DT_MR, mc = (i1 < M ? i1 : M) - i0;
                    if (mc <= 0) continue;                     /* fewer strips than blocks */
                    int in_place = ta || aliased ? 0 : mc / DT_MR * DT_MR;  /* A's rows read where they lie */
                    if (ta) dt__pack_a_block_trans(A, lda, i0, mc, k0, kc, block, a_sums && j0 == 0 ? a_sums + i0 : NULL);
                    else
                        for (int is = in_place; is < mc; is += DT_MR)
                            dt__pack_a(A, lda, i0 + is, mc - is < DT_MR ? mc - is : DT_MR, k0, kc, block + (size_t)is * kc);
                    /* the block's tiles, strip of A by strip of B (DT_ROWS_OUTER) or the other way round */
                    int strips_a = (mc + DT_MR - 1) / DT_MR;
                    for (int t = 0; t < strips_a * strips; t++) {
                        int is = (DT_ROWS_OUTER ? t / strips : t % strips_a) * DT_MR, s = DT_ROWS_OUTER ? t % strips : t / strips_a;
                        int rows = mc - is < DT_MR ? mc - is : DT_MR, js = s * DT_NR, cols = nc - js < DT_NR ? nc - js : DT_NR;
                        const float *b = panel + (size_t)s * DT_NR * kc;
                        float *c = C + (size_t)(i0 + is) * ldc + j0 + js;
                        if (gelu_grad_now)         /* x, read after the sum: asked for now, as C is */
                            for (int i = 0; i < rows; i++) {
                                const float *x = gelu_grad_now + (size_t)(i0 + is + i) * ldc + j0 + js;
                                for (int j = 0; j < cols + DT_VL - 1; j += DT_VL) DT__PREFETCH(x + (j < cols ? j : cols - 1));
                            }
                        if (is < in_place)
                            dt__gemm_micro(kc, A + (size_t)(i0 + is) * lda + k0, lda, 1, b, alpha, b_eff, c, ldc, rows, cols,
                                           bias_now ? bias_now + j0 + js : NULL);
                        else
                            dt__gemm_micro(kc, block + (size_t)is * kc, 1, DT_MR, b, alpha, b_eff, c, ldc, rows, cols,
                                           bias_now ? bias_now + j0 + js : NULL);
                        if (gelu_now)
                            dt__gelu_rows(c, gelu_now + (size_t)(i0 + is) * ldc + j0 + js, ldc, rows, cols, ep->tanh_form, ep->slope);
                        if (gelu_grad_now)
                            dt__gelu_grad_rows(c, gelu_grad_now + (size_t)(i0 + is) * ldc + j0 + js, ldc, rows, cols, ep->tanh_form,
                                               ep->slope);
                    }
                }
            }
        }
    }
}
#endif /* !DT_HAVE_CBLAS */

/* op(A)'s row sums over k (or op(B)'s column sums: A = B^T), added k by k
   in order: the packing's sums, where the routine does not pack them. */
static void dt__add_k_sums(int trans, int M, int K, const float *A, int lda, float *sums) {
    DT_OMP("omp parallel if((double)M * K > 65536.0)")
    {                                    /* each thread a band of the sums: every sum keeps its order */
        int t = dt__thread_num(), nt = dt__team_size();
        int i0 = (int)((int64_t)M * t / nt), i1 = (int)((int64_t)M * (t + 1) / nt);
        for (int k = 0; k < K; k++)
            for (int i = i0; i < i1; i++) sums[i] += trans ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
    }
}
/* dt_gemm and then the epilogue (NULL: none). With a system BLAS, or with
   nothing to multiply, the epilogue is a loop afterwards. */
static void dt__gemm_epilogue(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
                              const float *B, int ldb, float beta, float *C, int ldc, const dt__epilogue *ep) {
    if (M <= 0 || N <= 0) {              /* nothing to multiply or store; the sums still */
        if (ep && ep->a_sums) dt__add_k_sums(trans_a, M, K, A, lda, ep->a_sums);
        if (ep && ep->b_sums) dt__add_k_sums(!trans_b, N, K, B, ldb, ep->b_sums);
        return;
    }
    int tiles = 0;                       /* the built-in routine ran: the epilogue is done, and the sums it packs */
    if (K <= 0)                          /* nothing to multiply: C = beta * C */
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
#ifdef DT_HAVE_CBLAS
    else
        cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#else
    else {
        dt__gemm_builtin(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ep);
        tiles = 1;
    }
#endif
    if (!ep) return;
    if (ep->a_sums && !(tiles && trans_a)) dt__add_k_sums(trans_a, M, K, A, lda, ep->a_sums);
    if (ep->b_sums && !(tiles && !trans_b)) dt__add_k_sums(!trans_b, N, K, B, ldb, ep->b_sums);
    if (tiles) return;
    DT_OMP("omp parallel for if((double)M * N > 32768.0)")
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        if (ep->bias) for (int j = 0; j < N; j++) c[j] += ep->bias[j];
        if (ep->gelu) dt__gelu_rows(c, ep->gelu + (size_t)i * ldc, ldc, 1, N, ep->tanh_form, ep->slope);
        if (ep->gelu_grad) dt__gelu_grad_rows(c, ep->gelu_grad + (size_t)i * ldc, ldc, 1, N, ep->tanh_form, ep->slope);
    }
}
void dt_gemm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A, int lda,
             const float *B, int ldb, float beta, float *C, int ldc) {
    dt__gemm_epilogue(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, NULL);
}

/* -- attention's per-head products (the attention chapter's tiled and online
      bodies): small, read in place, one register-blocked loop for all of them -- */
/* rows x vecs accumulators, vecs operands and a broadcast fit the registers:
   6 x 4 + 4 + 1 of AVX-512's 32, 6 x 2 + 2 + 1 of the 16 of AVX2 or SSE
   (3 x 4 there needed 17, and the spills cost nearly a third of attention's
   time on an EPYC) */
#define DT__ATT_ROWS 6
#define DT__ATT_VECS (DT_VL == 16 ? 4 : 2)

/* c[r][x] (+)= alpha * sum over k < kc of a[r * row_step + k * k_step] * b[k * b_step + x]
   for r < rows and x < NV vectors: rows x NV accumulators in registers. Rows
   from `rows` to DT__ATT_ROWS repeat the last row's reads (nothing past the
   operands is touched) and are not stored. */
DT__INLINE void dt__att_tile(int NV, int kc, const float *a, ptrdiff_t row_step, ptrdiff_t k_step, const float *b,
                             ptrdiff_t b_step, float alpha, int add, float *c, ptrdiff_t ldc, int rows) {
    const float *ar[DT__ATT_ROWS];
    for (int r = 0; r < DT__ATT_ROWS; r++) ar[r] = a + (r < rows ? r : rows - 1) * row_step;
#if defined(__GNUC__)
    dt__vec acc[DT__ATT_ROWS][DT__ATT_VECS];   /* in registers: every index below is a constant */
#pragma GCC unroll 8
    for (int r = 0; r < DT__ATT_ROWS; r++)
#pragma GCC unroll 4
        for (int x = 0; x < NV; x++) acc[r][x] = (dt__vec){ 0 };
    for (int k = 0; k < kc; k++) {
        dt__vec bv[DT__ATT_VECS];
#pragma GCC unroll 4
        for (int x = 0; x < NV; x++) bv[x] = dt__vload(b + k * b_step + x * DT_VL);
#pragma GCC unroll 8
        for (int r = 0; r < DT__ATT_ROWS; r++) {
            float s = ar[r][k * k_step];
#pragma GCC unroll 4
            for (int x = 0; x < NV; x++) acc[r][x] = DT__MADD(acc[r][x], s, bv[x]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < DT__ATT_ROWS; r++)
#pragma GCC unroll 4
        for (int x = 0; x < NV; x++) {
            if (r >= rows) continue;
            float *cp = c + r * ldc + x * DT_VL;
            dt__vec o = alpha * acc[r][x];
            if (add) o = dt__vload(cp) + o;
            dt__vstore(cp, o);
        }
#else
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < NV * DT_VL; x++) {
            float s = 0;
            for (int k = 0; k < kc; k++) s += ar[r][k * k_step] * b[k * b_step + x];
            c[r * ldc + x] = add ? c[r * ldc + x] + alpha * s : alpha * s;
        }
#endif
}
/* The same over `vecs` vectors of columns, DT__ATT_VECS at a time. */
static void dt__att_product(int vecs, int kc, const float *a, ptrdiff_t row_step, ptrdiff_t k_step, const float *b,
                            ptrdiff_t b_step, float alpha, int add, float *c, ptrdiff_t ldc, int rows) {
    for (int x0 = 0; x0 < vecs; x0 += DT__ATT_VECS) {
        const float *bx = b + x0 * DT_VL;
        float *cx = c + x0 * DT_VL;
        switch (vecs - x0 < DT__ATT_VECS ? vecs - x0 : DT__ATT_VECS) {
        case 1: dt__att_tile(1, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
#if DT__ATT_VECS == 4
        case 2: dt__att_tile(2, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
        case 3: dt__att_tile(3, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
#endif
        default: dt__att_tile(DT__ATT_VECS, kc, a, row_step, k_step, bx, b_step, alpha, add, cx, ldc, rows); break;
        }
    }
}
/* A head's rows lie a token's whole width apart (3 x 192 floats in vit-tiny's
   qkv), too far for the hardware to guess, and they are cold: the tiled
   bodies ask for the next head's (`mats` matrices `apart` floats apart, each
   head `width` wide) into the L2 cache while they make this one, a part at
   each of its tiles (`part` of `parts`). Until DT__PREFETCH_L2 became an
   instruction the compiler keeps, none of these were in the binary; since,
   vit-tiny's attention alone (six layers' forward and backward, one thread,
   6 runs alternating) takes 72 ms where it took 85 (medians). Head `bh` of
   `heads` is sequence bh / H's head bh % H. */
static void dt__att_prefetch_head(const float *x, ptrdiff_t ld, int mats, ptrdiff_t apart, int bh, int heads, int H,
                                  int T, int width, int part, int parts) {
    if (bh >= heads) return;
    x += (size_t)(bh / H) * T * ld + (size_t)(bh % H) * width;
    for (int m = 0; m < mats; m++)
        for (int j = (int)((int64_t)T * part / parts); j < (int)((int64_t)T * (part + 1) / parts); j++)
            for (int d = 0; d < width; d += DT_VL) DT__PREFETCH_L2(x + m * apart + (size_t)j * ld + d);
}
static int dt__att_padded(int T) { return (T + DT_VL - 1) / DT_VL * DT_VL; }
/* dst[d][j] = src[j * ld + d] for d < hd, j < T, rows of Tp with zeros after T.
   Element by element, every store of a head's 65 x 64 went to another row of
   dst: 0.36 ms a layer of vit-tiny's 192 heads with the head in the cache,
   where square blocks turned in registers (dt__transpose_block) take 0.12 (a
   harness, best of 20). A copy: the same bits. */
static void dt__att_transpose(const float *src, ptrdiff_t ld, int T, int hd, float *dst, int Tp) {
    int j0 = 0;
#if DT__TRANSPOSE_BLOCKS
    if (hd % DT_VL == 0)
        for (; j0 + DT_VL <= T; j0 += DT_VL)
            for (int d0 = 0; d0 < hd; d0 += DT_VL)
                dt__transpose_block(src + (size_t)j0 * ld + d0, ld, dst + (size_t)d0 * Tp + j0, Tp);
#endif
    for (int d = 0; d < hd; d++) {             /* the rest, a row of dst at a time */
        float *row = dst + (size_t)d * Tp;
        for (int j = j0; j < T; j++) row[j] = src[(size_t)j * ld + d];
        for (int j = T; j < Tp; j++) row[j] = 0.0f;
    }
}
