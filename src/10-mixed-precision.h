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

