//@ lesson: tensors -- a shape, a dtype, a pointer to the data and one to its gradient
/* ---- tensors ---------------------------------------------------------------- */

typedef enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 } dt_dtype;

typedef struct dt_tensor {
    const char *name;          /* parameters only: "blocks.0.attn.qkv.weight" */
    int ndim;
    int shape[4];
    int64_t numel;
    /* The bits of `data`: f32, or -- activations under mixed precision, see
       the mixed-precision chapter -- bf16 or f16, read and written through data16 then. */
    dt_dtype dtype;
    union { float *data; uint16_t *data16; };  /* on `device`: not readable by the host when that is a GPU */
    /* NULL until a gradient flows into it. An activation's gradient has the
       activation's dtype; a parameter's is always f32 (the master gradient). */
    union { float *grad; uint16_t *grad16; };
    dt_device device;
    int requires_grad;         /* parameters, and anything computed from them */
    int is_param;
    int hook_gen, first_use;   /* parameters: where the tape last reads them (grad ready) */
    struct dt_parallel *parallel;   /* parameters: the wrapper their model is in (the autograd chapter), or NULL */
} dt_tensor;

/* A tensor of f32 in the per-step arena (gone at the next reset). Contents are zero. */
dt_tensor *dt_tensor_new(int ndim, const int *shape);
dt_tensor *dt_tensor_2d(int rows, int cols);
/* Rows of a 2-D view: shape[0] x (product of the rest). */
int64_t dt_tensor_rows(const dt_tensor *t);
int64_t dt_tensor_cols(const dt_tensor *t);
/* The gradient buffer of t, allocated (zeroed) on first use. */
float *dt_grad(dt_tensor *t);
/* A tensor on the current device holding a copy of n host floats. */
dt_tensor *dt_tensor_from_host(int ndim, const int *shape, const float *host);
/* Copy a tensor's values (or its gradient) to host memory of t->numel floats. */
void dt_tensor_to_host(const dt_tensor *t, float *host);
void dt_tensor_grad_to_host(const dt_tensor *t, float *host);
/* The first element, on the host: a loss. */
float dt_tensor_item(const dt_tensor *t);
/* Bytes per element (4 or 2), and "fp32", "bf16", "fp16". */
size_t dt_dtype_size(dt_dtype d);
const char *dt_dtype_name(dt_dtype d);

//@ implementation
/* ==== tensors ================================================================
   A tensor is a shape, a dtype and a pointer. Activations are carved out of
   the step arena; parameters point into the model's flat buffers. Data is f32
   unless mixed precision (the mixed-precision chapter) stores activations in 16 bits. */

size_t dt_dtype_size(dt_dtype d) { return d == DT_F32 ? 4 : 2; }
const char *dt_dtype_name(dt_dtype d) { return d == DT_F32 ? "fp32" : d == DT_BF16 ? "bf16" : "fp16"; }

/* A tensor in the step arena, on the current device, its data not zeroed. The
   header always lives on the host. */
static dt_tensor *dt__tensor_alloc(int ndim, const int *shape, dt_dtype dtype) {
    dt_tensor *t = (dt_tensor *)dt_step_alloc(sizeof(dt_tensor));
    t->ndim = ndim;
    t->numel = 1;
    for (int i = 0; i < ndim; i++) { t->shape[i] = shape[i]; t->numel = dt__size_mul(t->numel, shape[i], "an activation"); }
    t->device = dt__ctx.device;
    t->dtype = dtype;
    t->data = (float *)dt__step_data((size_t)dt__size_mul(t->numel, (int64_t)dt_dtype_size(dtype), "an activation"));
    return t;
}
/* An op's output: every element is written by the op, so it is not zeroed.
   It is stored in the compute dtype (f32, or bf16/f16 under mixed precision). */
static dt_tensor *dt__tensor_out(int ndim, const int *shape) { return dt__tensor_alloc(ndim, shape, dt__ctx.compute_dtype); }
static dt_tensor *dt__tensor_out_2d(int rows, int cols) { int s[2] = { rows, cols }; return dt__tensor_out(2, s); }
dt_tensor *dt_tensor_new(int ndim, const int *shape) {
    dt_tensor *t = dt__tensor_alloc(ndim, shape, DT_F32);
    dt__zero_on(t->device, t->data, (size_t)t->numel * sizeof(float));
    return t;
}
dt_tensor *dt_tensor_2d(int rows, int cols) { int s[2] = { rows, cols }; return dt_tensor_new(2, s); }
dt_tensor *dt_tensor_from_host(int ndim, const int *shape, const float *host) {
    dt_tensor *t = dt__tensor_alloc(ndim, shape, DT_F32);
    dt_upload(t->data, host, (size_t)t->numel * sizeof(float));
    return t;
}
int64_t dt_tensor_rows(const dt_tensor *t) { return t->shape[0]; }
int64_t dt_tensor_cols(const dt_tensor *t) {          /* a product, not numel / rows: a tensor may have no rows */
    int64_t cols = 1;
    for (int d = 1; d < t->ndim; d++) cols *= t->shape[d];
    return cols;
}
/* A parameter's gradient is f32 whatever its data holds: the optimizer and the
   collectives read it. An activation's has the activation's dtype. */
static dt_dtype dt__grad_dtype(const dt_tensor *t) { return t->is_param ? DT_F32 : t->dtype; }
static size_t dt__grad_bytes(const dt_tensor *t) { return (size_t)t->numel * dt_dtype_size(dt__grad_dtype(t)); }
float *dt_grad(dt_tensor *t) {
    if (!t->grad) {                                /* a gradient lives beside its tensor */
        size_t bytes = dt__grad_bytes(t);
        t->grad = (float *)dt__step_alloc_on(t->device, bytes);
        dt__zero_on(t->device, t->grad, bytes);
    }
    return t->grad;
}
/* -- precision conversion: mixed precision converts every activation twice, so
      the CPU loops are written one per direction, where the compiler turns
      them into vector code; x86's F16C instructions convert f16 eight at a
      time, rounding to nearest even as dt_f32_to_f16 does (a test holds them
      to it, bit for bit). -- */
static void dt__f32_to_half_cpu(const float *x, uint16_t *h, dt_dtype to, int64_t n) {
    int64_t i = 0;
    if (to == DT_BF16) {
        for (; i < n; i++) h[i] = dt_f32_to_bf16(x[i]);
        return;
    }
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = dt_f32_to_f16(x[i]);
}
static void dt__half_to_f32_cpu(const uint16_t *h, float *x, dt_dtype from, int64_t n) {
    int64_t i = 0;
    if (from == DT_BF16) {
        for (; i < n; i++) x[i] = dt_bf16_to_f32(h[i]);
        return;
    }
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) x[i] = dt_f16_to_f32(h[i]);
}
/* n values of any dtype on device d, as f32 on the host. */
static void dt__download_as_f32(dt_device d, float *host, const void *src, dt_dtype dtype, int64_t n) {
    if (dtype == DT_F32) { dt__download_from(d, host, src, (size_t)n * sizeof(float)); return; }
    uint16_t *h = (uint16_t *)malloc((size_t)n * 2 + 1);
    if (!h) dt_fail("out of memory");
    dt__download_from(d, h, src, (size_t)n * 2);
    dt__half_to_f32_cpu(h, host, dtype, n);
    free(h);
}
static void dt__lazy_make(const dt_tensor *t);     /* logits that wait (the loss's chapter) are made when read */
void dt_tensor_to_host(const dt_tensor *t, float *host) {
    dt__lazy_make(t);
    dt__download_as_f32(t->device, host, t->data, t->dtype, t->numel);
}
void dt_tensor_grad_to_host(const dt_tensor *t, float *host) {
    if (!t->grad) { memset(host, 0, (size_t)t->numel * sizeof(float)); return; }
    dt__download_as_f32(t->device, host, t->grad, dt__grad_dtype(t), t->numel);
}
float dt_tensor_item(const dt_tensor *t) {
    float v;
    dt__lazy_make(t);
    dt__download_as_f32(t->device, &v, t->data, t->dtype, 1);
    return v;
}

/* Which body runs an op: the tensor's device must be the one dtrain runs on,
   and a GPU tensor gets the GPU's kernels (NULL means the CPU loop). */
static const dt_backend *dt__backend_for(const dt_tensor *t) {
    if (t->device != dt__ctx.device)
        dt_fail("tensor %s is on the %s but dtrain runs on the %s now (see dt_set_device)", t->name ? t->name : "",
                t->device == DT_CUDA ? "GPU" : "CPU", dt__ctx.device == DT_CUDA ? "GPU" : "CPU");
    return dt__backend_of(t->device);
}

