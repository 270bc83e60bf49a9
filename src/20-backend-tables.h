//@ lesson: the backend tables -- the per-element arithmetic a GPU shares, what a device (dt_backend) and a transport (dt_comm_backend) provide
/* ---- per-element arithmetic (declared above; defined here because every file
        that includes the header, and nvcc, needs the bodies) ------------------ */
#include <math.h>
#include <string.h>

/* a * b + c in one rounding where the processor fuses it (a GPU, x86 with
   FMA, 64-bit ARM): a polynomial's steps then take one instruction each, not
   two, and GELU's forward with its slope took 28% less time on AVX-512. gcc
   under -std=c11 and nvcc with --fmad=false fuse nothing on their own, so
   this is where the fusing is. Elsewhere, two roundings: fmaf in software
   would be slower than all of it. A CPU build with FMA and a GPU give the
   same bits. */
#if defined(__CUDA_ARCH__) || defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define DT__FMA(a, b, c) fmaf((a), (b), (c))
#else
#define DT__FMA(a, b, c) ((a) * (b) + (c))
#endif

/* exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln 2 / 2: ln 2 in two
   parts (Cody and Waite) keeps r exact, a degree-6 Taylor polynomial gives
   exp(r), and n goes straight into the exponent bits. This is the arithmetic
   alone, for c in (-87.3, 88] and not NaN: tanh and erf only ask for exp of
   such a c, and skip dt_exp_value's choices (a quarter of a vectorised
   loop's instructions) with the same bits. */
DT_HD static inline float dt__exp_in_range(float c) {
    float n = DT__FMA(c, 1.44269504088896341f, 12582912.0f) - 12582912.0f;    /* round to nearest: 1.5 x 2^23 */
    float r = DT__FMA(-n, 1.42860682030941723e-6f, DT__FMA(-n, 0.693145751953125f, c));
    float p = DT__FMA(r, 1.38888892e-3f, 8.33333377e-3f);           /* Horner's rule, from the highest power */
    p = DT__FMA(r, p, 4.16666679e-2f);
    p = DT__FMA(r, p, 1.66666672e-1f);
    p = DT__FMA(r, p, 0.5f);
    p = DT__FMA(r, p, 1.0f);
    p = DT__FMA(r, p, 1.0f);
    uint32_t scale = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &scale, 4);
    return p * two_n;
}
/* Any x (softmax, cross-entropy and SiLU pass unbounded ones). Below -87.3
   the result would be subnormal: 0, as the flushed arithmetic everywhere
   else makes it; above 88 it is exp(88). */
DT_HD static inline float dt_exp_value(float x) {
    float c = x > -87.3f ? x : -87.3f;          /* NaN: worked as -87.3 (no undefined cast), returned as NaN */
    c = c < 88.0f ? c : 88.0f;                  /* two plain choices: one nested choice made longer vector code */
    float e = c > -87.3f ? dt__exp_in_range(c) : 0.0f;
    return x == x ? e : x;
}
/* tanh(x) = 1 - 2 / (exp(2|x|) + 1), with x's sign; 1 in float beyond |x| = 10. */
DT_HD static inline float dt_tanh_value(float x) {
    float a = fabsf(x) < 10.0f ? fabsf(x) : 10.0f;
    float t = 1.0f - 2.0f / (dt__exp_in_range(2.0f * a) + 1.0f);     /* 2a in [0, 20]; a NaN x gives a = 10 */
    return x == x ? (x < 0 ? -t : t) : x;                        /* NaN stays NaN */
}
/* Abramowitz and Stegun 7.1.26: erf(x) = 1 - t (a1 + t (a2 + ...)) exp(-x^2),
   t = 1 / (1 + p |x|), within 1.5e-7 of erf, with x's sign. The exp(-x^2)
   it used goes to *gauss (0 past |x| = 9, where erf is +-1 in float): GELU's
   derivative needs it too. */
DT_HD static inline float dt__erf_and_gauss(float x, float *gauss) {
    float a = fabsf(x) < 9.0f ? fabsf(x) : 9.0f;
    float t = 1.0f / DT__FMA(0.3275911f, a, 1.0f);
    float poly = DT__FMA(t, 1.061405429f, -1.453152027f);
    poly = DT__FMA(t, poly, 1.421413741f);
    poly = DT__FMA(t, poly, -0.284496736f);
    poly = DT__FMA(t, poly, 0.254829592f) * t;
    *gauss = fabsf(x) < 9.0f ? dt__exp_in_range(-a * a) : 0.0f;     /* -a^2 in [-81, 0]; NaN x: a = 9 */
    float e = DT__FMA(-poly, *gauss, 1.0f);
    return x == x ? (x < 0 ? -e : e) : x;                        /* NaN stays NaN */
}
DT_HD static inline float dt_erf_value(float x) {
    float gauss;
    return dt__erf_and_gauss(x, &gauss);
}
DT_HD static inline float dt_gelu_value(float x) {
    return 0.5f * x * (1.0f + dt_erf_value(x * 0.70710678118654752f));
}
/* d/dx [x Phi(x)] = Phi(x) + x phi(x), where phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
   and exp(-x^2 / 2) is the one erf(x / sqrt 2) computed: one exp, not two
   (past |x| = 12.7 it is 0, and the derivative Phi(x), 0 or 1) */
DT_HD static inline float dt_gelu_derivative(float x) {
    float gauss, cdf = 0.5f * (1.0f + dt__erf_and_gauss(x * 0.70710678118654752f, &gauss));
    return DT__FMA(x, 0.39894228040143268f * gauss, cdf);
}
DT_HD static inline float dt_gelu_tanh_value(float x) {
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);      /* sqrt(2/pi) (x + 0.044715 x^3) */
    return 0.5f * x * (1.0f + dt_tanh_value(u));
}
DT_HD static inline float dt_gelu_tanh_derivative(float x) {
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x), t = dt_tanh_value(u);
    float du = 0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}
/* sigmoid(x) = 1 / (1 + exp(-x)); exp(-x) saturates at exp(88), where
   sigmoid is 0 in float anyway */
DT_HD static inline float dt_silu_value(float x) { return x * (1.0f / (1.0f + dt_exp_value(-x))); }
/* The online softmax's step: m moves up to the block's largest score, and
   what was summed on the old scale shrinks by exp(m_old - m_new). */
DT_HD static inline float dt_online_softmax_rescale(float *m, float block_max) {
    float old = *m, now = old > block_max ? old : block_max;
    *m = now;
    return old == -INFINITY ? 0.0f : dt_exp_value(old - now);
}
DT_HD static inline float dt_cross_entropy_grad(float x, float m, double inv_l, float onehot, float scale) {
    return ((float)((double)dt_exp_value(x - m) * inv_l) - onehot) * scale;
}
DT_HD static inline float dt_silu_derivative(float x) {
    float sg = 1.0f / (1.0f + dt_exp_value(-x));
    return sg * (1.0f + x * (1.0f - sg));
}

/* Mixture of experts (its chapter): element d of token n's row, its slots'
   rows summed in its choices' order (slot -1: a dropped choice), weighted
   by w (NULL: 1); and a dot product, in index order. */
DT_HD static inline float dt_moe_token_sum(const float *src, const float *w, const int *slots, int k, int64_t D, int64_t d) {
    float acc = 0.0f;
    for (int j = 0; j < k; j++)
        if (slots[j] >= 0) acc += (w ? w[slots[j]] : 1.0f) * src[(int64_t)slots[j] * D + d];
    return acc;
}
DT_HD static inline float dt_moe_row_dot(const float *a, const float *b, int64_t D) {
    float acc = 0.0f;
    for (int64_t d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}
DT_HD static inline uint32_t dt_float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
DT_HD static inline float dt_bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* bf16 is the top half of an f32: round the bottom half to nearest even. */
DT_HD static inline uint16_t dt_f32_to_bf16(float f) {
    uint32_t x = dt_float_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
DT_HD static inline float dt_bf16_to_f32(uint16_t h) { return dt_bits_float((uint32_t)h << 16); }

/* f16: 5 exponent bits (bias 15), 10 mantissa bits; below 2^-14 the numbers
   are subnormal (m * 2^-24), above 65504 they round to infinity. */
DT_HD static inline uint16_t dt_f32_to_f16(float f) {
    uint32_t x = dt_float_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return (uint16_t)(sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u));
    if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);       /* >= 65520: inf */
    if (x < 0x38800000u) {                                           /* subnormal or zero */
        if (x <= 0x33000000u) return sign;                           /* <= 2^-25: rounds to 0 */
        uint32_t e = x >> 23, m = (x & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - e;
        uint32_t half = m >> shift, rem = m & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = x - 0x38000000u;                                    /* rebias 127 -> 15 */
    uint32_t half = r >> 13, rem = r & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;    /* a carry bumps the exponent */
    return (uint16_t)(sign | half);
}
DT_HD static inline float dt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, bits;
    if (e == 0) {
        if (m == 0) bits = sign;
        else {                                                       /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            bits = sign | (e << 23) | ((m & 0x3FFu) << 13);
        }
    } else if (e == 31) bits = sign | 0x7F800000u | (m << 13);
    else bits = sign | ((e + 112u) << 23) | (m << 13);
    return dt_bits_float(bits);
}

/* Block quantization (the mixed-precision chapter): one division and one
   rounding per value, no sum, so the CPU and the GPU agree bit for bit. */
DT_HD static inline float dt_quant_block_scale(const float *x, int64_t n, int bits) {
    float absmax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        finite &= a <= 3.40282347e38f;                   /* false for inf and for NaN */
        absmax = a > absmax ? a : absmax;
    }
    /* a block whose step would be subnormal (absmax under qmax x 2^-126,
       1.5e-36 for int8) is flushed to zeros, as the arithmetic elsewhere flushes */
    return !finite ? NAN : absmax < (float)DT_QUANT_MAX(bits) * 1.17549435e-38f ? 0.0f : absmax / (float)DT_QUANT_MAX(bits);
}
DT_HD static inline int dt__quant_code(float x, float scale, int bits) {
    if (!(scale > 0.0f)) return 0;                       /* a block of zeros, or a refused one */
    /* to nearest, ties to even, as rintf, without a call: |x / scale| <= qmax,
       far below 2^22, where adding 1.5 x 2^23 leaves no bits below the point */
    float v = (x / scale + 12582912.0f) - 12582912.0f;
    float m = (float)DT_QUANT_MAX(bits);
    return (int)(v > m ? m : v < -m ? -m : v);
}
/* Values first .. first + n - 1 of x as codes (first is even: a 4-bit pair never straddles two blocks). */
DT_HD static inline void dt_quant_block(const float *x, int64_t first, int64_t n, int bits, float scale, uint8_t *codes) {
    if (bits == 8) {
        for (int64_t i = first; i < first + n; i++) codes[i] = (uint8_t)(int8_t)dt__quant_code(x[i], scale, bits);
        return;
    }
    for (int64_t i = first; i < first + n; i += 2) {     /* low nibble: the even value; two's complement */
        int lo = dt__quant_code(x[i], scale, bits), hi = i + 1 < first + n ? dt__quant_code(x[i + 1], scale, bits) : 0;
        codes[i / 2] = (uint8_t)((lo & 0xF) | ((hi & 0xF) << 4));
    }
}
DT_HD static inline float dt_dequant_value(const uint8_t *codes, int64_t i, int bits, float scale) {
    int q = bits == 8 ? (int)(int8_t)codes[i] : ((((codes[i / 2] >> ((i & 1) * 4)) & 0xF) ^ 8) - 8);
    return scale == scale ? (float)q * scale : NAN;      /* a refused block: the constant NaN (a GPU's arithmetic */
}                                                        /* would give another NaN's bits than the CPU's) */

/* GPU launch shape, here so that a CPU test can check it: a grid is capped
   (DT_MAX_BLOCKS blocks of DT_THREADS), so every kernel loops -- thread i
   takes items i, i + stride, ...; a warp-per-row kernel takes rows w, w +
   warps, ... -- and no item is left out however large the tensor. */
#define DT_THREADS 256
#define DT_MAX_BLOCKS (65535 * 8)
DT_HD static inline unsigned dt_blocks_for(int64_t threads) {
    int64_t b = (threads + DT_THREADS - 1) / DT_THREADS;
    return (unsigned)(b < 1 ? 1 : b > DT_MAX_BLOCKS ? DT_MAX_BLOCKS : b);
}
DT_HD static inline int64_t dt_grid_first(unsigned block, unsigned block_dim, unsigned thread) {
    return (int64_t)block * block_dim + thread;
}
DT_HD static inline int64_t dt_grid_stride(unsigned grid_dim, unsigned block_dim) { return (int64_t)grid_dim * block_dim; }

/* AdamW exactly as torch.optim.AdamW: decoupled weight decay, then the moments,
   then the bias-corrected step. */
DT_HD static inline void dt_adamw_update(float *p, float *m, float *v, float g, float lr,
                                         float beta1, float beta2, float eps, float wd,
                                         float bias_correction1, float bias_correction2) {
    float pv = *p * (1.0f - lr * wd);
    float mv = beta1 * *m + (1.0f - beta1) * g;
    float vv = beta2 * *v + (1.0f - beta2) * g * g;
    float denom = sqrtf(vv / bias_correction2) + eps;
    *p = pv - (lr / bias_correction1) * mv / denom;
    *m = mv;
    *v = vv;
}
/* SGD with momentum as torch.optim.SGD (dampening 0): weight decay joins the
   gradient, the buffer accumulates it, the parameter follows the buffer. */
DT_HD static inline void dt_sgd_update(float *p, float *buf, float g, float lr, float momentum,
                                       float wd) {
    float gv = g + wd * *p;
    float b = momentum * *buf + gv;
    *buf = b;
    *p -= lr * b;
}

/* ---- the device backend: what a GPU must provide -------------------------------
   The ops of the autograd chapter are written once. Each checks where its tensors live and
   either runs its CPU loop or calls the matching entry of this table, which the
   CUDA chapter at the end of this file fills in. So the table is the whole
   contract between the library and a device: memory, copies, and one body per
   op. All pointers are device pointers, calls queue in order on one stream,
   backward bodies ADD into their gradient outputs (as the CPU loops do), and a
   NULL gradient output means that gradient is not wanted. */
typedef struct dt_backend {
    char name[256];                                  /* "NVIDIA H100 80GB HBM3" */
    void *(*alloc)(size_t bytes);                    /* not zeroed */
    void (*release)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*upload)(void *dst, const void *host_src, size_t bytes);
    void (*download)(void *host_dst, const void *src, size_t bytes);
    void (*synchronize)(void);
    void (*hardware)(dt_hardware *out);              /* fills the gpu_ figures (dt_hardware_read) */
    void (*gemm)(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc);
    /* mixed precision: A and B in 16 bits (`dtype`), C in f32, products summed in f32 */
    void (*gemm_half)(dt_dtype dtype, int ta, int tb, int M, int N, int K, const void *A, int lda,
                      const void *B, int ldb, float beta, float *C, int ldc);
    void (*add_bias)(float *y, const float *bias, int rows, int cols);
    void (*sum_rows)(const float *x, float *out, int rows, int cols);   /* out[j] += sum_i x[i,j] */
    void (*gelu_forward)(const float *x, float *y, int64_t n, int tanh_form);
    void (*gelu_backward)(const float *x, const float *dy, float *dx, int64_t n, int tanh_form);
    void (*layernorm_forward)(const float *x, const float *w, const float *b, float *y, float *stats,
                              int rows, int cols, float eps);
    void (*layernorm_backward)(const float *x, const float *w, const float *dy, const float *stats,
                               float *dx, float *dw, float *db, int rows, int cols);
    /* Llama's: stats as LayerNorm's with every mean 0, so dw is LayerNorm's sum */
    void (*rmsnorm_forward)(const float *x, const float *w, float *y, float *stats, int rows, int cols, float eps);
    void (*rmsnorm_backward)(const float *x, const float *w, const float *dy, const float *stats, float *dx, float *dw,
                             int rows, int cols);
    void (*swiglu_forward)(const float *gate, const float *up, float *y, int64_t n);
    void (*swiglu_backward)(const float *gate, const float *up, const float *dy, float *dgate, float *dup, int64_t n);
    /* cs: (cos, sin) of each position t < T and pair j < hd/2, [T, hd/2, 2] */
    void (*rotary_qkv_forward)(const float *q, const float *k, const float *v, const float *cs, float *qkv, int BT, int T,
                               int H, int KV, int hd);
    void (*rotary_qkv_backward)(const float *cs, const float *dqkv, float *dq, float *dk, float *dv, int BT, int T, int H,
                                int KV, int hd);
    void (*add)(const float *a, const float *b, float *y, int64_t n);
    void (*accumulate)(float *dst, const float *src, int64_t n);        /* dst += src */
    /* saved, scratch: DT_ATTENTION_SAVED_FLOATS, DT_ATTENTION_SCRATCH_FLOATS floats */
    void (*attention_forward)(const float *qkv, float *out, float *saved, int B, int T, int H, int D,
                              float scale, int causal);
    void (*attention_backward)(const float *saved, const float *dout, float *dqkv, float *scratch,
                               int B, int T, int H, int D, float scale);
    /* --attention online: saved is [B*H, T] log-sum-exps, then the output [B*T, D]
       (the CPU's layout); backward reads qkv again; scratch: B*H*T floats.
       Heads of at most DT_ATTENTION_ONLINE_MAX_HEAD_DIM. */
    void (*attention_forward_online)(const float *qkv, float *out, float *saved, int B, int T, int H, int D, float scale,
                                     int causal);
    void (*attention_backward_online)(const float *qkv, const float *saved, const float *dout, float *dqkv, float *scratch,
                                      int B, int T, int H, int D, float scale, int causal);
    /* Context parallelism's ring, a block at a time (dt_ring_attention): blk
       holds the block's T positions (f32), then its K and V [B*T, D]; qpos:
       this rank's T positions. Forward carries each row's m (in lse), l and
       unnormalised output (in O) from block to block -- first: from nothing;
       out non-NULL: the last block, which finishes them (O, out the output,
       lse the log-sum-exp). Backward adds dQ into dqkv and the block's dK,
       dV into dkv (dK [B*T, D], then dV); dots: B*H*T floats of scratch.
       The same heads as --attention online's. */
    void (*ring_attention_step)(const float *qkv, const float *blk, const float *qpos, float *lse, float *l, float *O,
                                float *out, int first, int B, int T, int H, int D, float scale, int causal);
    void (*ring_attention_backward_step)(const float *qkv, const float *blk, const float *qpos, const float *lse, const float *O,
                                         const float *dout, float *dots, float *dqkv, float *dkv, int B, int T, int H, int D,
                                         float scale, int causal);
    /* Mixture of experts: rows to slots, dst[s] (+)= w[s] src[slot_token[s]] (w NULL: 1); to tokens,
       dst[n] (+)= dt_moe_token_sum over its k choices' slots; dw[s] += dy[slot_token[s]] . ys[s] */
    void (*moe_to_slots)(const float *src, const float *w, const int *slot_token, float *dst, int S, int D, int add);
    void (*moe_to_tokens)(const float *src, const float *w, const int *slot_of_choice, float *dst, int N, int k, int D, int add);
    void (*moe_slot_dots)(const float *dy, const float *ys, const int *slot_token, float *dw, int S, int D);
    /* rows x cols floats from src (row stride ld_src) into dst (ld_dst): copied, or added (add 1) */
    void (*copy_columns)(float *dst, int64_t ld_dst, const float *src, int64_t ld_src, int64_t rows, int cols, int add);
    /* tokens: ids as f32. Backward: dwte, dwpe may be NULL; by_token lists the
       rows grouped by token: order[BT] (each group's rows ascending), then
       start[groups + 1] into it, then the token of each group, token[groups] */
    /* first, V: wte holds tokens first .. first + V - 1 (a rank's share of a
       split vocabulary); a row whose token is not among them gets zeros (+ wpe) */
    void (*token_embedding_forward)(const float *tokens, const float *wte, const float *wpe, float *y, int BT, int T, int D,
                                    int first, int V);
    void (*token_embedding_backward)(const int32_t *by_token, int groups, const float *dy, float *dwte, float *dwpe, int BT,
                                     int T, int D);
    void (*vit_tokens_forward)(const float *patches, const float *cls, const float *pos, float *y,
                               int B, int P, int D);
    void (*vit_tokens_backward)(const float *dy, float *dpatches, float *dcls, float *dpos, int B, int P, int D);
    void (*select_token_forward)(const float *x, float *y, int B, int T, int index, int D);
    void (*select_token_backward)(const float *dy, float *dx, int B, int T, int index, int D);
    /* The fused classifier. Forward: each row's largest value m, and 1 / l,
       l its sum of exp(x - m); rows whose label is DT_IGNORE_INDEX add
       nothing; the sum is divided by `divisor`. Backward: dlogits +=
       dt_cross_entropy_grad of each logit, in one pass. */
    void (*cross_entropy_forward)(const float *logits, const int32_t *labels, double *inv_l, float *m, float *loss,
                                  int B, int C, double divisor);
    void (*cross_entropy_backward)(const float *logits, const double *inv_l, const float *m, const int32_t *labels,
                                   const float *dloss, float *dlogits, int B, int C, float divisor);
    /* A vocabulary split over ranks: stats gets each row's m, then its l
       (over these C columns), then its x[label] (0 where the label is not
       among them); the group merges the rows' numbers between. */
    void (*softmax_row_stats)(const float *x, const int32_t *labels, float *stats, int B, int C);
    void (*patchify)(const float *images, float *patches, int B, int C, int H, int W, int p);
    double (*sum_squares)(const float *x, int64_t n);                   /* waits for the result */
    void (*scale)(float *x, float c, int64_t n);
    void (*adamw)(float *p, float *m, float *v, const float *g, int64_t n, float lr, float beta1,
                  float beta2, float eps, float wd, float bias_correction1, float bias_correction2);
    void (*sgd)(float *p, float *buf, const float *g, int64_t n, float lr, float momentum, float wd);
    void (*convert)(const void *src, dt_dtype from, void *dst, dt_dtype to, int64_t n);
    /* block quantization, as dt_quantize and dt_dequantize (no count of refused blocks) */
    void (*quantize)(const float *x, int64_t n, int bits, int block, void *q);
    void (*dequantize)(const void *q, int64_t n, int bits, int block, void *out, dt_dtype out_dtype, int add);
    int (*owns)(const void *p);                      /* 1 when p is memory of this device */
} dt_backend;

/* Attention on a GPU keeps Q, K and V in head-major order ([B*H, T, hd] each,
   so that one strided-batched matmul covers every head) beside the softmax
   probabilities P [B*H, T, T], with room for the output in that order; backward
   needs room for dP, dO and dQ, dK, dV. */
#define DT_ATTENTION_SAVED_FLOATS(B, T, H, D) ((int64_t)(B) * (H) * (T) * (T) + 4LL * (B) * (T) * (D))   /* P, Q, K, V, O */
#define DT_ATTENTION_SCRATCH_FLOATS(B, T, H, D) ((int64_t)(B) * (H) * (T) * (T) + 4LL * (B) * (T) * (D)) /* dP, dO, dQ, dK, dV */
/* The online kernels' widest head: a lane holds 4 of its columns. */
#define DT_ATTENTION_ONLINE_MAX_HEAD_DIM 128

/* ---- the collective backend: what a transport must provide --------------------
   The collectives chapter owns the queue and the communication thread; a backend moves the
   bytes. Every backend fills in every entry, and the shared code only calls
   through the table: shared memory, NCCL and MPI are three tables. A call is
   queued by the caller, started and finished by the communication thread, and
   waited for by the caller: on shared memory the thread does the whole work in
   `start`; on a GPU `start` only puts it on NCCL's stream, `finish` watches it
   to the end, and `wait` makes the caller's later kernels wait for it on the
   GPU: the host waits only until the call is on NCCL's stream, never for its
   result. `memory` is the one kind of buffer it takes: the collectives chapter refuses any
   other before the call is queued. */
typedef struct dt_comm_op {
    dt_coll kind;
    const void *send;
    void *recv;
    int64_t count;
    dt_dtype dtype;
    dt_reduce_op op;
    int root;                                                  /* the root; for send and recv the peer */
    int from;                                                  /* a ring shift's: root, the next rank; from, the one before */
    int64_t *counts;                                           /* an all-to-all's: what goes to each rank, then what comes from
                                                                  each (2 x size, freed when it is done) */
} dt_comm_op;
typedef struct dt_comm_backend {
    const char *name;
    dt_device memory;                                          /* where the buffers of its calls live */
    void (*submitted)(dt_comm *c, int64_t h);                  /* caller: call h is queued */
    void (*start)(dt_comm *c, int64_t h, const dt_comm_op *o); /* communication thread */
    void (*finish)(dt_comm *c, int64_t h);                     /* communication thread, after start */
    void (*wait)(dt_comm *c, int64_t h);                       /* caller, lock held: h started, not yet finished */
    /* caller, parent idle: make child's transport, collectively over parent */
    void (*split)(dt_comm *parent, dt_comm *child, int color, int key);
    void (*close)(dt_comm *c);                                 /* caller, after the thread has stopped */
    /* 1: its ranks are on one machine, so a group gets a shared segment, which
       the watchdog reads every rank through; 0 (MPI): each rank a header of
       its own, and a dead rank is the launcher's to notice */
    int shares_memory;
    int sums_in_rank_order;                                    /* 1: the same bits at any number of ranks, run after run */
} dt_comm_backend;

/* ---- the GPU collectives: what the collectives chapter asks of NCCL (the cuda chapter) -----------
   The collectives chapter owns the queue, the communication thread and the watchdog; NCCL
   only issues calls and answers questions, so a dead peer or a timeout is
   noticed by the same loop on CPUs and GPUs. The communicator is non-blocking:
   any call may leave it "in progress", and dt_nccl_progress says when it is
   ready for the next one. Every buffer is device memory. */
#define DT_COMM_QUEUE 256                 /* collectives in flight per communicator, at most */
/* The cuda chapter's two entry points (only in a build with
   CUDA): how many GPUs are visible (0, and why, when none), and the backend
   table of GPU local_rank % count, or NULL and why. */
int dt_cuda_device_count(char *why, size_t n);
const dt_backend *dt_cuda_backend(int local_rank, char *why, size_t n);

typedef struct dt_nccl dt_nccl;
/* 1 when this build has NCCL; else 0, and what to install in `why`. */
int dt_nccl_available(char *why, size_t n);
/* NCCL's version as a number (2.30.3 is 23003); 0 without NCCL. */
int dt_nccl_version(void);
int dt_nccl_unique_id(unsigned char *out, size_t n);
/* Start joining the communicator (non-blocking); poll dt_nccl_progress until it is ready. */
dt_nccl *dt_nccl_create(const unsigned char *id_bytes, int rank, int world);
/* The same for the group of `color` (ncclCommSplit), collectively over parent. */
dt_nccl *dt_nccl_split(dt_nccl *parent, int color, int key);
/* 1: ready for the next call; 0: still in progress; -1: failed, and why. */
int dt_nccl_progress(dt_nccl *s, char *why, size_t n);
/* The caller's thread, at submission: collective `slot` may start once the
   kernels queued so far on the compute stream are done (its input is theirs). */
void dt_nccl_mark_inputs(dt_nccl *s, int slot);
/* The communication thread: issue call `slot` on NCCL's stream, then, once
   dt_nccl_progress says ready, record its done-event. */
void dt_nccl_issue(dt_nccl *s, int slot, const dt_comm_op *o);
void dt_nccl_mark_done(dt_nccl *s, int slot);
int dt_nccl_finished(dt_nccl *s, int slot);           /* 1 when its done-event has fired */
/* The caller's thread: kernels queued from now on wait for collective `slot`. */
void dt_nccl_stream_wait(dt_nccl *s, int slot);
void dt_nccl_abort(dt_nccl *s);                       /* only from the thread that issues its calls */
/* Closing: finalize (poll dt_nccl_progress until ready), then free. */
void dt_nccl_finalize(dt_nccl *s);
void dt_nccl_free(dt_nccl *s);

//@ implementation
/* Without CUDA there is no NCCL: the CUDA chapter defines these when there is. */
#ifndef DT_HAVE_CUDA
int dt_nccl_available(char *why, size_t n) {
    dt__copy_str(why, n, "this build has no CUDA, so no NCCL (install the CUDA toolkit and NCCL, then make)");
    return 0;
}
int dt_nccl_version(void) { return 0; }
#endif
