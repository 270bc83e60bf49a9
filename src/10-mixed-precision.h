//@ lesson: mixed precision -- bf16/fp16 activations and matmul operands, f32 master weights, loss scaling
/* ---- mixed precision ------------------------------------------------------------ */

/* The dtype activations are stored in and matmuls read (default DT_F32). With
   DT_BF16 or DT_F16, parameters, their gradients and the optimizer state stay
   f32 -- the master weights -- and every op reads its inputs rounded to 16 bits
   and stores its output in 16 bits; layernorm statistics, softmax, the loss and
   every sum inside a matmul stay f32. A parallel wrapper fixes its buffers
   to it when created, so changing it while one exists is an error. */
void dt_set_compute_dtype(dt_dtype dtype);
dt_dtype dt_compute_dtype(void);

/* Dynamic loss scaling, for fp16: its smallest number is 6e-8 (2^-24), and
   gradients of activations fall below it and become 0. Multiplying the loss by
   `scale` lifts every gradient by the same factor; the optimizer sees them
   divided again. Too large a scale makes some gradient inf: that step is
   skipped and the scale halved. After growth_interval good steps in a row it
   doubles. bf16 has f32's exponent range and needs none (enabled 0, scale 1). */
typedef struct dt_loss_scaler {
    int enabled;
    float scale;               /* starts at 65536 */
    int growth_interval;       /* 2000 */
    int64_t good_steps;        /* since the last skip or growth */
    int64_t skipped;           /* steps skipped so far */
    int last_skipped;          /* the last step was skipped */
} dt_loss_scaler;
dt_loss_scaler dt_loss_scaler_create(dt_dtype dtype);
/* Backward of loss * scale / accum_steps: each of accum_steps micro-batches
   adds its share, so their sum is the gradient of the mean over all of them. */
void dt_backward_scaled(dt_tensor *loss, const dt_loss_scaler *scaler, int accum_steps);
/* After the gradients are synchronised, before the optimizer: returns 1 with
   the gradients divided by the scale; or, when any gradient on any rank is inf
   or NaN, 0 with the gradients zeroed, the scale halved and the step to be
   skipped -- every rank decides alike, as the check is summed over them. */
int dt_loss_scaler_unscale(dt_loss_scaler *scaler, dt_optimizer *opt);

/* Block quantization, for communication (ZeRO++, the FSDP chapter): n f32
   values as `bits`-bit integers (8, or 4: two to a byte), each block of
   `block` values (even, 8 to 65536) sharing one f32 scale, absmax / qmax
   (qmax 127, or 7). A value comes back as round(x / scale) * scale: within
   half a step, absmax / (2 qmax) of its block, of itself (plus f32 rounding,
   a few ulps of absmax); a block of zeros comes back as zeros, and so does
   one whose absmax is under qmax x 2^-126 (the step would be subnormal). A block that
   holds a NaN or an inf is refused: its scale is NaN, so all of it comes
   back NaN, never as numbers (the loss scaler then skips the step, or the
   run stops on a non-finite loss); dt_quantize returns how many blocks were
   refused (on a GPU, -1: counting would wait for the device).
   The buffer: the blocks' scales, then the codes, dt_quantized_bytes long (a
   multiple of 4, so it travels as f32 words). It lives where the current
   device's memory is. */
#define DT_QUANT_MAX(bits) ((1 << ((bits) - 1)) - 1)
int64_t dt_quantized_bytes(int64_t n, int bits, int block);
int64_t dt_quantize(const float *x, int64_t n, int bits, int block, void *q);
/* Into `out` as `out_dtype` (add: added to it, f32 only). */
void dt_dequantize(const void *q, int64_t n, int bits, int block, void *out, dt_dtype out_dtype, int add);
/* The arithmetic, one block and one value at a time, shared with the GPU. */
DT_HD static inline float dt_quant_block_scale(const float *x, int64_t n, int bits);
DT_HD static inline void dt_quant_block(const float *x, int64_t first, int64_t n, int bits, float scale, uint8_t *codes);
DT_HD static inline float dt_dequant_value(const uint8_t *codes, int64_t i, int bits, float scale);

//@ implementation
/* ==== mixed precision =======================================================
   Half the bytes: activations, the matmuls' operands and what the collectives
   carry in 16 bits, while everything that adds up many small numbers stays in
   f32 -- the master weights and the optimizer (an update of 1e-4 on a weight
   of 1 vanishes in bf16, whose 8 significant bits move it in steps of 1/128),
   the sums inside matmuls, the layernorm statistics, the softmax, the loss.
   The ops do it through the views of the autograd chapter; this chapter sets the dtype
   and scales the loss for fp16, whose range (6e-8 to 65504) is too narrow for
   gradients. */

void dt_set_compute_dtype(dt_dtype dtype) {
    if (dtype != dt__ctx.compute_dtype && dt__ctx.wrappers)
        dt_fail("dt_set_compute_dtype: a parallel wrapper already exists and gathers in %s; call dt_set_compute_dtype "
                "before dt_dp_create, dt_ddp_create or dt_fsdp_create", dt_dtype_name(dt__ctx.compute_dtype));
    dt__ctx.compute_dtype = dtype;
}
dt_dtype dt_compute_dtype(void) { return dt__ctx.compute_dtype; }

dt_loss_scaler dt_loss_scaler_create(dt_dtype dtype) {
    dt_loss_scaler s;
    memset(&s, 0, sizeof s);
    s.scale = 1.0f;
    s.growth_interval = 2000;
    if (dtype == DT_F16) { s.enabled = 1; s.scale = 65536.0f; }
    return s;
}

void dt_backward_scaled(dt_tensor *loss, const dt_loss_scaler *scaler, int accum_steps) {
    dt__backward_seeded(loss, scaler->scale / (float)(accum_steps > 0 ? accum_steps : 1));
    if (scaler->enabled) dt__ctx.grads_scaled = 1;    /* the optimizer must not see them so */
}

int dt_loss_scaler_unscale(dt_loss_scaler *scaler, dt_optimizer *opt) {
    dt__optimizer_check_synced(opt, "dt_loss_scaler_unscale");
    scaler->last_skipped = 0;
    dt__ctx.grads_scaled = 0;          /* divided below, or zeroed and the step skipped */
    if (!scaler->enabled) return 1;
    size_t bytes = (size_t)opt->numel * sizeof(float);
    /* one number says it all: a sum with an inf or a NaN in it is not finite;
       a sharded optimizer sums over the ranks, so they all see the same */
    if (!isfinite(dt__optimizer_grad_sum_squares(opt))) {
        dt__zero_on(opt->device, opt->grads, bytes);
        scaler->scale *= 0.5f;
        scaler->good_steps = 0;
        scaler->skipped++;
        scaler->last_skipped = 1;
        return 0;
    }
    float inv = 1.0f / scaler->scale;                /* a power of two: exact */
    const dt_backend *gpu = dt__backend_of(opt->device);
    if (gpu) gpu->scale(opt->grads, inv, opt->numel);
    else
        for (int64_t i = 0; i < opt->numel; i++) opt->grads[i] *= inv;
    if (++scaler->good_steps >= scaler->growth_interval) { scaler->scale *= 2.0f; scaler->good_steps = 0; }
    return 1;
}


/* -- block quantization: the CPU's loops (the GPU's kernels call the same
      per-block and per-value functions) -- */
static void dt__quant_check(int64_t n, int bits, int block) {
    if ((bits != 8 && bits != 4) || block < 8 || block > 65536 || block % 2 || n < 0)
        dt_fail("dt_quantize: %d bits in blocks of %d values (n %lld): bits must be 8 or 4, a block even, 8 to 65536", bits,
                block, (long long)n);
}
int64_t dt_quantized_bytes(int64_t n, int bits, int block) {
    dt__quant_check(n, bits, block);
    int64_t blocks = (n + block - 1) / block, codes = bits == 8 ? n : (n + 1) / 2;
    return (4 * blocks + codes + 3) / 4 * 4;
}
int64_t dt_quantize(const float *x, int64_t n, int bits, int block, void *q) {
    dt__quant_check(n, bits, block);                    /* before any division by block */
    int64_t blocks = (n + block - 1) / block, refused = 0;
    float *scales = (float *)q;
    uint8_t *codes = (uint8_t *)(scales + blocks);
    const dt_backend *gpu = dt__backend_of(dt__ctx.device);
    if (gpu) { gpu->quantize(x, n, bits, block, q); return -1; }
    DT_OMP("omp parallel for schedule(static) reduction(+:refused) if(blocks > 64)")
    for (int64_t b = 0; b < blocks; b++) {
        int64_t first = b * block, len = n - first < block ? n - first : block;
        scales[b] = dt_quant_block_scale(x + first, len, bits);
        refused += scales[b] != scales[b];
        dt_quant_block(x, first, len, bits, scales[b], codes);
    }
    int64_t used = 4 * blocks + (bits == 8 ? n : (n + 1) / 2);            /* the tail's padding: zeros, not garbage */
    memset((char *)q + used, 0, (size_t)(dt_quantized_bytes(n, bits, block) - used));
    return refused;
}
void dt_dequantize(const void *q, int64_t n, int bits, int block, void *out, dt_dtype out_dtype, int add) {
    dt__quant_check(n, bits, block);
    if (add && out_dtype != DT_F32) dt_fail("dt_dequantize: adds into f32 only, not %s", dt_dtype_name(out_dtype));
    int64_t blocks = (n + block - 1) / block;
    const float *scales = (const float *)q;
    const uint8_t *codes = (const uint8_t *)(scales + blocks);
    const dt_backend *gpu = dt__backend_of(dt__ctx.device);
    if (gpu) { gpu->dequantize(q, n, bits, block, out, out_dtype, add); return; }
    DT_OMP("omp parallel for schedule(static) if(n > 65536)")
    for (int64_t b = 0; b < blocks; b++) {            /* a block at a time: one scale, one kind of store */
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float *f = (float *)out;
        if (add && scales[b] != scales[b]) for (int64_t i = lo; i < hi; i++) f[i] = NAN;    /* refused: NaN, whatever was there */
        else if (add) for (int64_t i = lo; i < hi; i++) f[i] += dt_dequant_value(codes, i, bits, scales[b]);
        else if (out_dtype == DT_F32) for (int64_t i = lo; i < hi; i++) f[i] = dt_dequant_value(codes, i, bits, scales[b]);
        else for (int64_t i = lo; i < hi; i++) dt_store_f32(out, i, out_dtype, dt_dequant_value(codes, i, bits, scales[b]));
    }
}
