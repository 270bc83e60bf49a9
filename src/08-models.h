//@ lesson: models -- MLP, ViT, GPT-2 and Llama; activation recompute; LoRA; where tensor parallelism cuts each parameter
/* ---- models --------------------------------------------------------------------- */

typedef enum { DT_MODEL_MLP = 0, DT_MODEL_VIT = 1, DT_MODEL_GPT = 2, DT_MODEL_LLAMA = 3 } dt_model_kind;

typedef struct dt_model_config {
    dt_model_kind kind;
    int channels, image_size, classes;           /* gpt, llama: classes is the vocabulary */
    int dim, depth, heads, patch, mlp_hidden;    /* mlp: dim = hidden width, depth = hidden layers;
                                                    llama: mlp_hidden is the SwiGLU width (--ffn-dim) */
    int seq_len;                                 /* gpt, llama: the context, in tokens */
    /* llama only; 0 takes the default in brackets */
    int kv_heads;                                /* key/value heads, grouped-query attention [heads] */
    int untied_head;                             /* 1: an lm_head.weight of its own; 0: the head is embed_tokens */
    int qkv_bias;                                /* 1: q, k and v projections with biases (Qwen2) */
    float rope_theta;                            /* the rotary embeddings' base [10000] */
    float norm_eps;                              /* RMSNorm's epsilon [1e-5] */
    float rope_factor, rope_low_freq, rope_high_freq;   /* Llama 3's rescaled frequencies (dt_rope); 0: none */
    int rope_original_context;
    /* LoRA (--lora-rank): the weights above frozen, and beside each targeted
       linear layer a trainable pair A [rank, in], B [out, rank]: y = x W^T + b
       + (alpha / rank) (x A^T) B^T. rank 0: none. */
    int lora_rank;
    float lora_alpha;
    char lora_targets[256];                      /* module names, comma-separated: "q_proj,v_proj" */
    /* gpt, llama: a mixture of experts (the MoE chapter) in place of the MLP of
       every moe_every-th block (llama: every block, Mixtral's names): moe_experts
       of them (0: none), moe_top_k a token, the capacity factor (0: no limit) and
       the balancing loss's coefficient (0: none). */
    int moe_experts, moe_top_k, moe_every;
    float moe_capacity, moe_aux_loss;
} dt_model_config;

/* Where tensor parallelism (stage 06) may cut a parameter: the model says, the wrapper cuts (the
   tensor-parallel chapter). dim -1: whole on every rank (norms, position embeddings, the ViT's head, a
   row-parallel layer's bias). Otherwise dimension dim is cut into equal pieces, one per rank, in `parts`
   groups that are cut alike (the q, k and v of a fused projection: each rank takes its heads of all three),
   each piece a whole number of `align` (a head's width: attention is split by heads). A weight cut along
   its outputs is a column-parallel layer, along its inputs a row-parallel one. */
typedef struct dt_split {
    int dim, parts, align;
    int rows;      /* read between dt_sp_split and dt_sp_gather: under --sequence-parallel each rank's
                      gradient of a whole parameter is then its rows' part, summed over the group */
    int vocab;     /* the vocabulary's rows (an embedding, a head): cut only when they divide by T
                      (GPT-2's 50,257 do not), whole otherwise */
    /* Pipeline parallelism (stage 07) gives each rank a run of blocks, so it asks which block reads the
       parameter: -1 the embedding (the first stage), dt_model_blocks the head (the last); dt_model_create
       sets it from the parameter's unit. head: read by the head though it sits in the embedding's unit (the
       GPT's final norm). tied: read by the embedding and by the head (a tied vocabulary), so the first and
       the last stage each hold it, and add up its two gradients. */
    int block, head, tied;
    int expert;    /* 1 + the mixture's expert it is part of (0: none): expert parallelism keeps E/P of them a rank */
} dt_split;

typedef struct dt_model {
    dt_model_config cfg;
    int nparams;
    dt_tensor *params;         /* in forward order; data and grad point into the flat buffers */
    float *flat_data;          /* every parameter, one after another: what DDP and FSDP move */
    float *flat_grad;
    int64_t numel;
    int64_t *offsets;          /* where each parameter starts in the flat buffers */
    dt_split *splits;          /* per parameter: where tensor parallelism may cut it */
    dt_device device;          /* where the flat buffers live */
    /* Units: the pieces FSDP gathers one at a time -- a linear layer of the MLP;
       the embedding, each block, and the norm + head of the ViT. Unit u holds
       parameters unit_first[u] .. unit_first[u + 1] - 1. */
    int nunits;
    int *unit_first;
    /* -1, or the unit whose forward begins before every other unit's and ends
       after them: the GPT's embeddings and final norm, because its head reads
       the token embedding again (tied weights). FSDP keeps it gathered for the
       whole step, as PyTorch's FSDP does with its root unit. */
    int outer_unit;
    dt_parallel *parallel;     /* the wrapper this model is in (the parallel chapters), or NULL */
    int optimizers;            /* optimizers created on it and not freed yet */
    int recompute;             /* --recompute: each block's activations are made again in backward */
    /* Set by dt_tp_free (its name): the split parameters stay this rank's
       pieces, so the model can be freed but no longer run. */
    const char *left_cut_by;
    /* LoRA: the frozen model the adapters (this model's parameters) sit on,
       with no gradients and no optimizer state, never communicated; NULL
       without LoRA. lora_of[i]: where base parameter i's A is in params (B
       follows it), or -1. */
    struct dt_model *base;
    char *base_source;         /* where base's weights came from (--init's path), or NULL: the seed's */
    int *lora_of;
    float lora_scale;          /* alpha / rank */
    uint64_t base_seed;        /* the seed base's weights were drawn from (they stay, without --init) */
    dt_moe_stats moe;          /* what its MoE layers routed since the run driver last read it */
} dt_model;

/* Build a model with freshly initialised weights (seeded, so runs repeat) on
   the current device. The same seed gives the same weights on CPU and GPU. */
dt_model *dt_model_create(const dt_model_config *cfg, uint64_t seed);
/* Fails while a wrapper or an optimizer still holds the model: free those first. */
void dt_model_free(dt_model *m);
/* A parallel wrapper attaches itself (its create function calls this) and
   detaches (NULL, from its free function), before the optimizer (which steps
   what the wrapper gives it) and after it: the other orders are errors that
   say what to call first. A wrapper whose `inner` is the model's wraps it (a
   stack); detached, it leaves the model to the inner one again. */
void dt_model_set_parallel(dt_model *m, dt_parallel *par);
/* The model in its whole shapes: what a wrapper that cut it (tensor, pipeline
   parallelism; in a stack, the one inside) keeps as its `whole`; else m. */
const dt_model *dt_model_whole(const dt_model *m);
/* Activation recompute (--recompute) on or off: in training, each block keeps
   only its input and output, and its forward runs again when backward
   reaches it. The same bits, less memory, one more forward per step. */
void dt_model_set_recompute(dt_model *m, int on);
/* images [B, C, S, S] scaled to [-1, 1] -> logits [B, classes];
   gpt, llama: token ids [B, T] -> logits [B*T, vocab], row (b, t) predicting token t + 1 */
dt_tensor *dt_model_forward(dt_model *m, dt_tensor *inputs);
/* A model is an embedding, dt_model_blocks(m) blocks (the mlp's: its layers)
   and a head. Pipeline parallelism (stage 07) runs a share of them on each
   rank: blocks [first, end), from the embedding of `inputs` when first is 0,
   else from x (the activation the stage before computed), to the logits
   when end is dt_model_blocks(m), else to the activation the next stage
   takes. inputs give the shapes (B, and T) either way. */
int dt_model_blocks(const dt_model *m);
dt_tensor *dt_model_forward_blocks(dt_model *m, dt_tensor *inputs, dt_tensor *x, int first, int end);
/* Model FLOPs of one token's training step (forward and backward): 6 per
   parameter that multiplies (every one but the position embeddings, and
   Llama's token embedding when its head is a matrix of its own), plus the
   attention's 12 x depth x dim x context. Tokens/s times this is what MFU
   uses. 0 for the image models. */
double dt_model_flops_per_token(const dt_model *m);
dt_tensor *dt_model_param(dt_model *m, const char *name); /* NULL when absent */
void dt_model_zero_grad(dt_model *m);
/* Describes the model in one line: "vit dim=192 depth=6 heads=3 patch=4 (5.36M params)". */
void dt_model_describe(const dt_model *m, char *out, size_t n);
/* 1 for the language models (gpt, llama: token ids in, next-token logits out) */
int dt_model_is_language(dt_model_kind kind);

/* A batch the loader gives a model (the data chapter fills it; the pipeline cuts it into micro-batches). */
typedef struct dt_batch {
    dt_tensor *inputs;         /* images [B, C, S, S] in [-1, 1], or token ids [B, T] */
    int32_t *labels;           /* [B] classes, or [B*T] next tokens */
    int size;                  /* B */
} dt_batch;

//@ implementation
/* ==== layers and models ======================================================
   A model is a list of named parameters in forward order plus a forward
   function. All parameters sit in one flat buffer (and their gradients in
   another): the optimizer, gradient clipping, DDP's buckets and FSDP's shards
   are then loops over contiguous memory. Names and shapes are PyTorch's, so a
   checkpoint opens in PyTorch as a state_dict. */

typedef struct dt__rng { uint64_t s; } dt__rng;
/* splitmix64: tiny, and good enough for initialisation and shuffling */
static uint64_t dt__rng_u64(dt__rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double dt__rng_uniform(dt__rng *r) { return (dt__rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }
static double dt__rng_normal(dt__rng *r) {
    double u1 = dt__rng_uniform(r), u2 = dt__rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
static uint64_t dt__hash3(uint64_t a, uint64_t b, uint64_t c) {
    dt__rng r = { a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xD1B54A32D192ED03ull ^ c };
    dt__rng_u64(&r);
    return dt__rng_u64(&r);
}

typedef enum { DT_INIT_ZERO, DT_INIT_ONE, DT_INIT_UNIFORM, DT_INIT_NORMAL } dt__init_kind;

typedef struct dt__model_builder {
    dt_model *m;
    int cap;
    dt__init_kind *init;
    float *init_scale;
} dt__model_builder;

static void dt__unit_starts_here(dt__model_builder *mb) { mb->m->unit_first[mb->m->nunits++] = mb->m->nparams; }

static void dt__add_param(dt__model_builder *mb, const char *name, dt__init_kind init, float scale,
                         int ndim, int s0, int s1, int s2, int s3) {
    dt_model *m = mb->m;
    if (m->nparams == mb->cap) {
        mb->cap = mb->cap ? 2 * mb->cap : 64;
        m->params = (dt_tensor *)realloc(m->params, mb->cap * sizeof(dt_tensor));
        mb->init = (dt__init_kind *)realloc(mb->init, mb->cap * sizeof(dt__init_kind));
        mb->init_scale = (float *)realloc(mb->init_scale, mb->cap * sizeof(float));
        m->splits = (dt_split *)realloc(m->splits, mb->cap * sizeof(dt_split));
        if (!m->params || !mb->init || !mb->init_scale || !m->splits) dt_fail("out of memory (model)");
    }
    dt_tensor *t = &m->params[m->nparams];
    memset(t, 0, sizeof *t);
    size_t len = strlen(name) + 1;
    char *copy = (char *)malloc(len);
    if (!copy) dt_fail("out of memory (model)");
    memcpy(copy, name, len);
    t->name = copy;
    t->ndim = ndim;
    int s[4] = { s0, s1, s2, s3 };
    t->numel = 1;
    for (int i = 0; i < ndim; i++) { t->shape[i] = s[i]; t->numel = dt__size_mul(t->numel, s[i], name); }
    t->requires_grad = 1;
    t->is_param = 1;
    mb->init[m->nparams] = init;
    mb->init_scale[m->nparams] = scale;
    m->splits[m->nparams] = (dt_split){ .dim = -1, .parts = 1, .align = 1 };   /* whole, unless marked below */
    m->nparams++;
}
/* Where tensor parallelism may cut the layer just added (weight, then bias):
   a column-parallel layer along its outputs, weight and bias, in `parts`
   groups of `align`-wide pieces; a row-parallel one along its inputs, its
   bias whole (added once, after the sum). in_out: GPT-2's [in, out] weight. */
static void dt__split_column(dt__model_builder *mb, int in_out, int parts, int align) {
    dt_model *m = mb->m;
    m->splits[m->nparams - 2] = (dt_split){ .dim = in_out ? 1 : 0, .parts = parts, .align = align };
    m->splits[m->nparams - 1] = (dt_split){ .dim = 0, .parts = parts, .align = align };
}
static void dt__split_row(dt__model_builder *mb, int in_out, int align) {
    mb->m->splits[mb->m->nparams - 2] = (dt_split){ .dim = in_out ? 0 : 1, .parts = 1, .align = align };
}
/* The parameters from `first` on are read between dt_sp_split and
   dt_sp_gather (the blocks; every layer of the MLP). */
static void dt__rows_split_from(dt__model_builder *mb, int first) {
    for (int i = first; i < mb->m->nparams; i++) mb->m->splits[i].rows = 1;
}

static void dt__add_linear(dt__model_builder *mb, const char *prefix, int in, int out, dt__init_kind init, float scale) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, init, scale, 2, out, in, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    dt__add_param(mb, name, init == DT_INIT_UNIFORM ? DT_INIT_UNIFORM : DT_INIT_ZERO, scale, 1, out, 0, 0, 0);
}
/* GPT-2's Conv1D: a linear layer whose weight is stored [in, out] */
static void dt__add_conv1d(dt__model_builder *mb, const char *prefix, int in, int out, float scale) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, DT_INIT_NORMAL, scale, 2, in, out, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    dt__add_param(mb, name, DT_INIT_ZERO, 0, 1, out, 0, 0, 0);
}
static void dt__add_layernorm(dt__model_builder *mb, const char *prefix, int dim) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, DT_INIT_ONE, 0, 1, dim, 0, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    dt__add_param(mb, name, DT_INIT_ZERO, 0, 1, dim, 0, 0, 0);
}

/* Each model family is a row of one table (dt__model_families, below): how
   it names and shapes its parameters, its forward, its one-line description.
   The rest of the library asks the table, so a new family is a new row. */

/* GPT-2 (Hugging Face's): normal(0.02) weights, zero biases, unit LayerNorms;
   the projections that feed the residual stream shrink by 1/sqrt(2 x depth),
   so the sum of 2 x depth of them keeps its size. The outer unit comes first:
   wte and wpe, and ln_f, whose head is wte. */
/* Attention splits the width into heads. */
static void dt__check_heads(const dt_model_config *cfg) {
    if (cfg->heads < 1 || cfg->dim % cfg->heads) dt_fail("--dim %d is not divisible by --heads %d", cfg->dim, cfg->heads);
}
static void dt__add_projection(dt__model_builder *mb, const char *prefix, int in, int out, int bias) {
    char name[160];
    dt__path(name, sizeof name, "%s.weight", prefix);
    dt__add_param(mb, name, DT_INIT_NORMAL, 0.02f, 2, out, in, 0, 0);
    dt__path(name, sizeof name, "%s.bias", prefix);
    if (bias) dt__add_param(mb, name, DT_INIT_ZERO, 0, 1, out, 0, 0, 0);
}
/* A mixture of experts in block l's place of the MLP: the router, then each
   expert's layers, whole under tensor parallelism. GPT-2 has no MoE of its
   own: h.L.mlp.gate, h.L.mlp.experts.E.c_fc and .c_proj; llama's are Mixtral's
   (block_sparse_moe: gate, experts.E.w1, w2, w3). */
static int dt__moe_block(const dt_model_config *c, int l) { return c->moe_experts > 0 && (l + 1) % (c->moe_every > 1 ? c->moe_every : 1) == 0; }
static void dt__add_experts(dt__model_builder *mb, const dt_model_config *c, int l, float proj) {
    int llama = c->kind == DT_MODEL_LLAMA, F = c->mlp_hidden, D = c->dim;
    const char *at = llama ? "model.layers.%d.block_sparse_moe" : "h.%d.mlp";
    char prefix[96], name[160];
    if (c->moe_top_k < 1 || c->moe_top_k > c->moe_experts || !(c->moe_capacity >= 0) || !(c->moe_aux_loss >= 0))
        dt_fail("the experts: top-k %d of %d, capacity %g, balancing loss %g (k from 1 to the experts, the rest 0 or more)",
                c->moe_top_k, c->moe_experts, (double)c->moe_capacity, (double)c->moe_aux_loss);
    snprintf(prefix, sizeof prefix, at, l);
    snprintf(name, sizeof name, "%s.gate.weight", prefix);
    dt__add_param(mb, name, DT_INIT_NORMAL, 0.02f, 2, c->moe_experts, D, 0, 0);
    for (int e = 0, first = mb->m->nparams; e < c->moe_experts; e++, first = mb->m->nparams) {
        const char *w[3] = { "w1", "w2", "w3" }, *g[2] = { "c_fc", "c_proj" };
        for (int i = 0; i < (llama ? 3 : 2); i++) {
            snprintf(name, sizeof name, "%s.experts.%d.%s", prefix, e, llama ? w[i] : g[i]);
            int in = i == 1 ? F : D, out = i == 1 ? D : F;
            if (llama) dt__add_projection(mb, name, in, out, 0);
            else dt__add_conv1d(mb, name, in, out, i ? proj : 0.02f);
        }
        for (int j = first; j < mb->m->nparams; j++) mb->m->splits[j].expert = e + 1;
    }
}
static void dt__gpt_build(dt__model_builder *mb, const dt_model_config *cfg) {
    int D = cfg->dim;
    dt__check_heads(cfg);
    char name[160];
    float proj = 0.02f / sqrtf(2.0f * (cfg->depth > 0 ? cfg->depth : 1));
    mb->m->outer_unit = 0;
    dt__unit_starts_here(mb);
    dt__add_param(mb, "wte.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->classes, D, 0, 0);
    mb->m->splits[mb->m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = 1, .vocab = 1, .tied = 1 };   /* by tokens */
    dt__add_param(mb, "wpe.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->seq_len, D, 0, 0);
    dt__add_layernorm(mb, "ln_f", D);
    mb->m->splits[mb->m->nparams - 2].head = mb->m->splits[mb->m->nparams - 1].head = 1;
    int blocks = mb->m->nparams;
    for (int l = 0; l < cfg->depth; l++) {
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "h.%d.ln_1", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "h.%d.attn.c_attn", l); dt__add_conv1d(mb, name, D, 3 * D, 0.02f);
        dt__split_column(mb, 1, 3, D / cfg->heads);                    /* by heads, of q, k and v alike */
        snprintf(name, sizeof name, "h.%d.attn.c_proj", l); dt__add_conv1d(mb, name, D, D, proj);
        dt__split_row(mb, 1, D / cfg->heads);
        snprintf(name, sizeof name, "h.%d.ln_2", l); dt__add_layernorm(mb, name, D);
        if (dt__moe_block(cfg, l)) { dt__add_experts(mb, cfg, l, proj); continue; }
        snprintf(name, sizeof name, "h.%d.mlp.c_fc", l); dt__add_conv1d(mb, name, D, cfg->mlp_hidden, 0.02f);
        dt__split_column(mb, 1, 1, 1);
        snprintf(name, sizeof name, "h.%d.mlp.c_proj", l); dt__add_conv1d(mb, name, cfg->mlp_hidden, D, proj);
        dt__split_row(mb, 1, 1);
    }
    dt__rows_split_from(mb, blocks);
}
/* PyTorch's nn.Linear initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) */
static void dt__mlp_build(dt__model_builder *mb, const dt_model_config *cfg) {
    int in = cfg->channels * cfg->image_size * cfg->image_size;
    char name[160];
    for (int l = 0; l <= cfg->depth; l++) {
        int out = l == cfg->depth ? cfg->classes : cfg->dim;
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "fc%d", l + 1);
        dt__add_linear(mb, name, in, out, DT_INIT_UNIFORM, 1.0f / sqrtf((float)in));
        /* tensor parallelism pairs the hidden layers: column-, then row-parallel
           (an unpaired last one, and the head, stay whole) */
        if (l % 2 == 0 && l + 1 < cfg->depth) dt__split_column(mb, 0, 1, 1);
        if (l % 2 == 1 && l < cfg->depth) dt__split_row(mb, 0, 1);
        in = out;
    }
    dt__rows_split_from(mb, 0);
}
/* timm's VisionTransformer: truncated-normal(0.02) linears, zero biases, unit
   LayerNorms, a near-zero class token, conv-style patch embedding */
static void dt__vit_build(dt__model_builder *mb, const dt_model_config *cfg) {
    int C = cfg->channels, S = cfg->image_size, D = cfg->dim;
    int p = cfg->patch, P = (S / p) * (S / p), fan = C * p * p;
    char name[160];
    if (S % p) dt_fail("image size %d is not a multiple of the patch size %d", S, p);
    dt__check_heads(cfg);
    dt__unit_starts_here(mb);
    dt__add_param(mb, "cls_token", DT_INIT_NORMAL, 1e-6f, 3, 1, 1, D, 0);
    dt__add_param(mb, "pos_embed", DT_INIT_NORMAL, 0.02f, 3, 1, P + 1, D, 0);
    dt__add_param(mb, "patch_embed.proj.weight", DT_INIT_UNIFORM, 1.0f / sqrtf((float)fan), 4, D, C, p, p);
    dt__add_param(mb, "patch_embed.proj.bias", DT_INIT_UNIFORM, 1.0f / sqrtf((float)fan), 1, D, 0, 0, 0);
    int blocks = mb->m->nparams;
    for (int l = 0; l < cfg->depth; l++) {
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "blocks.%d.norm1", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "blocks.%d.attn.qkv", l); dt__add_linear(mb, name, D, 3 * D, DT_INIT_NORMAL, 0.02f);
        dt__split_column(mb, 0, 3, D / cfg->heads);
        snprintf(name, sizeof name, "blocks.%d.attn.proj", l); dt__add_linear(mb, name, D, D, DT_INIT_NORMAL, 0.02f);
        dt__split_row(mb, 0, D / cfg->heads);
        snprintf(name, sizeof name, "blocks.%d.norm2", l); dt__add_layernorm(mb, name, D);
        snprintf(name, sizeof name, "blocks.%d.mlp.fc1", l); dt__add_linear(mb, name, D, cfg->mlp_hidden, DT_INIT_NORMAL, 0.02f);
        dt__split_column(mb, 0, 1, 1);
        snprintf(name, sizeof name, "blocks.%d.mlp.fc2", l); dt__add_linear(mb, name, cfg->mlp_hidden, D, DT_INIT_NORMAL, 0.02f);
        dt__split_row(mb, 0, 1);
    }
    dt__rows_split_from(mb, blocks);
    dt__unit_starts_here(mb);
    dt__add_layernorm(mb, "norm", D);
    dt__add_linear(mb, "head", D, cfg->classes, DT_INIT_NORMAL, 0.02f);
}

/* A linear layer without bias, as every Llama projection is (Qwen2's q, k, v
   have one): nn.Linear's [out, in] weight. */
/* The same marks for a projection just added, with or without its bias:
   column-parallel (its outputs, in `align`-wide pieces: a head's width) or
   row-parallel (its inputs; it has no bias). */
static void dt__split_projection(dt__model_builder *mb, int bias, int column, int align) {
    dt_model *m = mb->m;
    if (!column) { m->splits[m->nparams - 1] = (dt_split){ .dim = 1, .parts = 1, .align = align }; return; }
    m->splits[m->nparams - 1 - bias] = (dt_split){ .dim = 0, .parts = 1, .align = align };
    if (bias) m->splits[m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = align };
}
/* Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM: normal(0.02) weights,
   zero biases, unit RMSNorms. With a tied head the embedding and the final
   norm are the outer unit (as the GPT's); with a head of its own the
   embedding is the first unit and the norm and head the last. */
static void dt__llama_build(dt__model_builder *mb, const dt_model_config *cfg) {
    dt__check_heads(cfg);
    /* the config's zeros become the defaults here, in the model's own copy,
       so forward, the description and checkpoints all read the numbers used */
    dt_model_config *own = &mb->m->cfg;
    if (own->kv_heads <= 0) own->kv_heads = cfg->heads;
    if (!(own->rope_theta > 0)) own->rope_theta = 10000.0f;
    if (!(own->norm_eps > 0)) own->norm_eps = 1e-5f;
    int D = cfg->dim, H = cfg->heads, KV = own->kv_heads, hd = D / H;
    char name[160];
    if (H % KV) dt_fail("llama: --heads %d is not a multiple of --kv-heads %d (each key/value head serves a group)", H, KV);
    if (hd % 2) dt_fail("llama: the head width --dim / --heads = %d is odd; rotary embeddings turn pairs", hd);
    if (!cfg->untied_head) mb->m->outer_unit = 0;
    dt__unit_starts_here(mb);
    int qb = cfg->qkv_bias != 0;
    dt__add_param(mb, "model.embed_tokens.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->classes, D, 0, 0);
    mb->m->splits[mb->m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = 1, .vocab = 1, .tied = !cfg->untied_head };
    if (!cfg->untied_head) {                                           /* by tokens, above; the head's norm */
        dt__add_param(mb, "model.norm.weight", DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        mb->m->splits[mb->m->nparams - 1].head = 1;
    }
    int blocks = mb->m->nparams;
    /* tensor parallelism: q, k and v by heads (k and v by their key/value
       heads), o_proj by its inputs; gate and up by the hidden units, down by
       its inputs */
    for (int l = 0; l < cfg->depth; l++) {
        dt__unit_starts_here(mb);
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        dt__add_param(mb, name, DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.q_proj", l); dt__add_projection(mb, name, D, H * hd, qb);
        dt__split_projection(mb, qb, 1, hd);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.k_proj", l); dt__add_projection(mb, name, D, KV * hd, qb);
        dt__split_projection(mb, qb, 1, hd);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.v_proj", l); dt__add_projection(mb, name, D, KV * hd, qb);
        dt__split_projection(mb, qb, 1, hd);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.o_proj", l); dt__add_projection(mb, name, H * hd, D, 0);
        dt__split_projection(mb, 0, 0, hd);
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        dt__add_param(mb, name, DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        if (dt__moe_block(cfg, l)) { dt__add_experts(mb, cfg, l, 0.02f); continue; }
        snprintf(name, sizeof name, "model.layers.%d.mlp.gate_proj", l); dt__add_projection(mb, name, D, cfg->mlp_hidden, 0);
        dt__split_projection(mb, 0, 1, 1);
        snprintf(name, sizeof name, "model.layers.%d.mlp.up_proj", l); dt__add_projection(mb, name, D, cfg->mlp_hidden, 0);
        dt__split_projection(mb, 0, 1, 1);
        snprintf(name, sizeof name, "model.layers.%d.mlp.down_proj", l); dt__add_projection(mb, name, cfg->mlp_hidden, D, 0);
        dt__split_projection(mb, 0, 0, 1);
    }
    dt__rows_split_from(mb, blocks);
    if (cfg->untied_head) {
        dt__unit_starts_here(mb);
        dt__add_param(mb, "model.norm.weight", DT_INIT_ONE, 0, 1, D, 0, 0, 0);
        dt__add_param(mb, "lm_head.weight", DT_INIT_NORMAL, 0.02f, 2, cfg->classes, D, 0, 0);
        mb->m->splits[mb->m->nparams - 1] = (dt_split){ .dim = 0, .parts = 1, .align = 1, .vocab = 1 };
    }
}

/* Where a unit's forward begins and ends: FSDP gathers its parameters there,
   and leaves marks on the tape for the same moments of backward. */
static void dt__unit_boundary(dt_model *m, int unit, int begin) {
    dt_parallel *par = m->parallel;
    if (par && begin && par->unit_begin) par->unit_begin(par, unit);
    if (par && !begin && par->unit_end) par->unit_end(par, unit);
}

/* -- activation recompute (--recompute). Most of a step's memory is the activations each block
      keeps for its backward, which needs a block's only when it reaches that block. So a block
      keeps what enters and leaves it: its forward runs as always, then all it made but its output
      goes back to the step arena, and one tape entry stands for its entries. Backward reaches it,
      and the block's forward runs again from the same input -- the same ops in the same order, so
      the same bits -- its new entries are walked, and their memory goes back too. The price: one
      more forward of each block a step. Under FSDP the unit's marks stand around that entry (it is
      gathered again). Without it a block is a region of the tape (the autograd chapter): its
      gradients go back after its backward; without gradients only its output stays at all. -- */
typedef dt_tensor *(*dt__block_fn)(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T);   /* P: its first parameter */
typedef struct { dt_model *m; dt__block_fn fn; dt_tensor *params; int B, T; } dt__block_call;
void dt_model_set_recompute(dt_model *m, int on) { m->recompute = on != 0; }

/* y's values, moved to the step arena's mark k: all else after k is given back. */
static dt_tensor *dt__keep_only(const dt__step_mark *k, const dt_tensor *y) {
    dt_tensor kept = *y;
    size_t bytes = (size_t)y->numel * dt_dtype_size(y->dtype);
    dt__scratch_reset();
    void *stash = dt__scratch_on(y->device, bytes);
    dt_convert(y->data, y->dtype, stash, y->dtype, y->numel);     /* a copy: the same dtype both sides */
    dt__step_back_to(k);
    dt_tensor *out = dt__tensor_alloc(kept.ndim, kept.shape, kept.dtype);
    dt_convert(stash, kept.dtype, out->data, kept.dtype, kept.numel);
    return out;
}
static void dt__recompute_backward(dt__tape_entry *e) {
    dt__block_call call = *(const dt__block_call *)e->saved;
    dt_tensor *x = e->in[0], *y = e->out;
    if (x->requires_grad) dt_grad(x);       /* before the mark: x's gradient outlives the block's */
    dt__step_mark k = dt__step_mark_now();
    int first = dt__ctx.tape_len;           /* e points into the tape, which grows: not used below */
    dt__ctx.recomputing = 1;
    dt_tensor *again = call.fn(call.m, call.params, x, call.B, call.T);
    dt__ctx.recomputing = 0;
    again->grad = y->grad;                  /* the gradient that reached the block's output */
    dt__tape_walk(first, dt__ctx.tape_len);
    dt__ctx.tape_len = first;
    dt__step_back_to(&k);
}
/* One block's forward, between its unit's boundaries (FSDP gathers there); x_of_block: x is the block before's output. */
static dt_tensor *dt__block(dt_model *m, int unit, dt__block_fn fn, dt_tensor *params, dt_tensor *x, int B, int T, int x_of_block) {
    dt__unit_boundary(m, unit, 1);
    int recompute = m->recompute && dt__ctx.grad_enabled;
    dt__grad_region *grads = dt__ctx.grad_enabled && !recompute ? dt__grad_region_begin(x, x_of_block) : NULL;
    dt__step_mark k = dt__step_mark_now();
    int first = dt__ctx.tape_len;
    dt_tensor *y = fn(m, params, x, B, T);
    if (grads) dt__grad_region_end(grads);      /* its gradients go back when its backward is done */
    if (!dt__ctx.grad_enabled) y = dt__keep_only(&k, y);   /* evaluation: one block's activations at a time */
    if (recompute) {
        dt__ctx.tape_len = first;           /* its entries go, one stands for them */
        y = dt__keep_only(&k, y);
        dt__block_call *call = (dt__block_call *)dt_step_alloc(sizeof *call);
        *call = (dt__block_call){ m, fn, params, B, T };
        dt__tape_push(dt__recompute_backward, y, x, NULL, NULL)->saved = call;
    }
    dt__unit_boundary(m, unit, 0);
    return y;
}

/* The weights a forward reads: unit u's first one (the base's, under LoRA). */
static dt_tensor *dt__unit_weights(dt_model *m, int unit) {
    dt_model *w = m->base ? m->base : m;
    return &w->params[w->unit_first[unit]];
}
/* A linear layer's output y = x W^T + b, plus LoRA's (alpha/r) (x A^T) B^T when W has an adapter.
   The sum is PEFT's order: the base's output first. */
static int dt__adapter_of(const dt_model *m, const dt_tensor *w) { return m->base ? m->lora_of[w - m->base->params] : -1; }
static dt_tensor *dt__with_adapter(dt_model *m, dt_tensor *x, const dt_tensor *w, dt_tensor *y) {
    int a = dt__adapter_of(m, w);
    if (a < 0) return y;
    dt_tensor *low = dt_linear(x, &m->params[a], NULL);
    return dt_add(y, dt_scale(dt_linear(low, &m->params[a + 1], NULL), m->lora_scale));
}
/* Did tensor parallelism (the tensor-parallel chapter) cut w? Along its outputs: a column-parallel
   layer; along its inputs: a row-parallel one; or not (or no wrapper splits layers). */
typedef enum { DT__WHOLE, DT__COLUMN_PARALLEL, DT__ROW_PARALLEL } dt__cut;
static dt__cut dt__tp_cut(const dt_model *m, const dt_tensor *w, int in_out) {
    if (!dt_parallel_splitting(m->parallel) || w < m->params || w >= m->params + m->nparams) return DT__WHOLE;
    int dim = m->splits[w - m->params].dim;
    return dim < 0 ? DT__WHOLE : dim == (in_out ? 1 : 0) ? DT__COLUMN_PARALLEL : DT__ROW_PARALLEL;
}
/* A column-parallel layer's input: its gradient is summed over the group. */
static dt_tensor *dt__tp_input(dt_model *m, dt_tensor *x, const dt_tensor *w, int in_out) {
    return dt__tp_cut(m, w, in_out) == DT__COLUMN_PARALLEL ? dt_tp_copy(m->parallel, x) : x;
}
/* A linear layer, whole or cut: a row-parallel one sums its partial outputs over the group, then adds its bias once. */
static dt_tensor *dt__linear_cut(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b, int in_out) {
    x = dt__tp_input(m, x, w, in_out);
    if (dt__tp_cut(m, w, in_out) != DT__ROW_PARALLEL) return in_out ? dt_linear_in_out(x, w, b) : dt_linear(x, w, b);
    dt_tensor *partial = in_out ? dt_linear_in_out(x, w, NULL) : dt_linear(x, w, NULL);
    dt_tensor *sum = dt_tp_sum(m->parallel, partial);
    return b ? dt_add_bias(sum, b) : sum;                   /* Llama's projections have none */
}
static dt_tensor *dt__lora_linear(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    return dt__with_adapter(m, x, w, dt__linear_cut(m, x, w, b, 0));
}
/* A language model's vocabulary (the GPT's wte, Llama's embed_tokens: the token embedding, and the head), cut
   over the group by its rows. Each rank looks up the tokens it holds, zeros for the others, and the group sums
   the rows (the one rank's row plus zeros: the same bits); the positions are added after, on every rank. */
static dt_tensor *dt__vocab_embedding(dt_model *m, const dt_tensor *tokens, dt_tensor *wte, dt_tensor *wpe) {
    if (dt__tp_cut(m, wte, 0) != DT__COLUMN_PARALLEL) return dt_token_embedding(tokens, wte, wpe);
    dt_parallel *par = dt_parallel_splitting(m->parallel);
    int V = (int)dt_tensor_rows(wte), B = tokens->shape[0], T = (int)dt_tensor_cols(tokens);
    dt_tensor *x = dt_tp_sum(par, dt__token_embedding_rows(tokens, wte, NULL, par->tp_rank * V, V * par->tp_size));
    if (!wpe) return x;                                                   /* Llama: positions by rotation */
    float *at = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)B * T);
    for (int r = 0; r < B * T; r++) at[r] = (float)(r % T);             /* each row's position, looked up in wpe */
    int shape[2] = { B, T };
    return dt_add(x, dt_token_embedding(dt_tensor_from_host(2, shape, at), wpe, NULL));
}
/* ... and its head, a column-parallel layer: each rank gives its columns of the logits, marked (their
   `parallel`) so that dt_cross_entropy and dt_logits_to_host work with the group on them. */
static dt_tensor *dt__vocab_head(dt_model *m, dt_tensor *x, dt_tensor *wte) {
    dt_tensor *logits = m->parallel ? dt__linear_cut(m, x, wte, NULL, 0) : dt_vocab_head(x, wte);   /* no wrapper: may wait */
    if (dt__tp_cut(m, wte, 0) == DT__COLUMN_PARALLEL) logits->parallel = dt_parallel_splitting(m->parallel);
    return logits;
}
static dt_tensor *dt__lora_linear_in_out(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    return dt__with_adapter(m, x, w, dt__linear_cut(m, x, w, b, 1));
}
/* the fused forms: apart when the adapter's term or a row-parallel sum comes between */
static dt_tensor *dt__lora_linear_gelu(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    if (dt__adapter_of(m, w) >= 0 || dt__tp_cut(m, w, 0) == DT__ROW_PARALLEL) return dt_gelu(dt__lora_linear(m, x, w, b));
    return dt_linear_gelu(dt__tp_input(m, x, w, 0), w, b);
}
static dt_tensor *dt__lora_linear_in_out_gelu_tanh(dt_model *m, dt_tensor *x, dt_tensor *w, dt_tensor *b) {
    if (dt__adapter_of(m, w) >= 0 || dt__tp_cut(m, w, 1) == DT__ROW_PARALLEL)
        return dt_gelu_tanh(dt__lora_linear_in_out(m, x, w, b));
    return dt_linear_in_out_gelu_tanh(dt__tp_input(m, x, w, 1), w, b);
}
/* The attention heads on this rank: all of them, or tensor parallelism's share (qkv: 3 x heads x head width columns). */
static int dt__heads_here(const dt_model *m, const dt_tensor *qkv) {
    return (int)((int64_t)m->cfg.heads * dt_tensor_cols(qkv) / (3 * (int64_t)m->cfg.dim));
}

/* -- the blocks a forward runs: all of them (dt_model_forward), or a pipeline stage's share
      (dt_model_forward_blocks), from x when it does not begin with the embedding, to x when it does not end with the head -- */
typedef struct dt__span { int first, end; dt_tensor *x; } dt__span;
static dt_tensor *dt__span_blocks(dt_model *m, const dt__span *s, int first_unit, dt__block_fn fn, dt__block_fn moe_fn,
                                  dt_tensor *x, int B, int T) {
    for (int l = s->first; l < s->end; l++)
        x = dt__block(m, first_unit + l, dt__moe_block(&m->cfg, l) ? moe_fn : fn, dt__unit_weights(m, first_unit + l), x, B, T, l > s->first);
    return x;
}
/* A mixture of experts on h (the MoE chapter), its router at P, each expert
   `per_expert` tensors after, run by mlp; the balancing loss shared out over the MoE layers. */
typedef struct { dt_model *m; dt_tensor *first; int per_expert; dt_tensor *(*mlp)(void *m, dt_tensor *P, dt_tensor *h); } dt__experts;
static dt_tensor *dt__run_expert(void *ctx, int e, dt_tensor *rows) {
    const dt__experts *x = (const dt__experts *)ctx;
    return x->mlp(x->m, x->first + (size_t)e * x->per_expert, rows);
}
static dt_tensor *dt__moe(dt_model *m, dt_tensor *P, dt_tensor *h, int T, int per_expert,
                          dt_tensor *(*mlp)(void *m, dt_tensor *P, dt_tensor *h)) {
    const dt_model_config *c = &m->cfg;
    int layers = 0;
    for (int l = 0; l < c->depth; l++) layers += dt__moe_block(c, l);
    dt__experts experts = { m, &P[1], per_expert, mlp };
    dt_moe_layer L = { &P[0], c->moe_top_k, T, c->moe_capacity, c->moe_aux_loss / layers, dt__run_expert, &experts, &m->moe,
                       m->parallel };
    return dt_moe_forward(&L, h);
}

/* The MLP: linear layers with GELU between them; a block is one layer and
   its GELU (none after the last). */
static dt_tensor *dt__mlp_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int last) {
    (void)B;
    x = dt__lora_linear(m, x, &P[0], &P[1]);
    return last ? x : dt_gelu(x);
}
static dt_tensor *dt__mlp_last_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { (void)T; return dt__mlp_block(m, P, x, B, 1); }
static dt_tensor *dt__mlp_hidden_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { (void)T; return dt__mlp_block(m, P, x, B, 0); }
static dt_tensor *dt__mlp_forward(dt_model *m, dt_tensor *images, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = images->shape[0];
    dt_tensor *x = s->x;
    if (s->first == 0) {
        x = (dt_tensor *)dt_step_alloc(sizeof(dt_tensor));
        *x = *images;                                                  /* flatten: a view */
        x->ndim = 2; x->shape[0] = B; x->shape[1] = (int)(images->numel / B);
        x = dt_sp_split(m->parallel, x);                               /* --sequence-parallel: this rank's images */
    }
    for (int l = s->first; l < s->end; l++)
        x = dt__block(m, l, l < c->depth ? dt__mlp_hidden_block : dt__mlp_last_block, dt__unit_weights(m, l), x, B, 0, l > s->first);
    return s->end == c->depth + 1 ? dt_sp_gather(m->parallel, x) : x;
}

/* A ViT block: pre-LN attention and MLP, each added to the residual stream. The head reads the class token alone, so
   after the last block's attention (every token's keys and values feed it) that row alone goes on (class_token_only). */
static dt_tensor *dt__vit_block_rows(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T, int class_token_only) {
    dt_tensor *n1w = &P[0], *n1b = &P[1], *qkvw = &P[2], *qkvb = &P[3], *pjw = &P[4], *pjb = &P[5];
    dt_tensor *n2w = &P[6], *n2b = &P[7], *f1w = &P[8], *f1b = &P[9], *f2w = &P[10], *f2b = &P[11];
    dt_tensor *h = dt__lora_linear(m, dt_layernorm(x, n1w, n1b, 1e-6f), qkvw, qkvb);
    h = dt_attention(h, B, T, dt__heads_here(m, h), 0);
    if (class_token_only) {   /* x: all B sequences, or --sequence-parallel's B / tp whole ones */
        h = dt_select_token(h, B, T, 0); x = dt_select_token(x, (int)(dt_tensor_rows(x) / T), T, 0);
    }
    x = dt_residual_add(x, dt__lora_linear(m, h, pjw, pjb));       /* pre-LN residual */
    h = dt__lora_linear_gelu(m, dt_layernorm(x, n2w, n2b, 1e-6f), f1w, f1b);
    return dt_residual_add(x, dt__lora_linear(m, h, f2w, f2b));
}
static dt_tensor *dt__vit_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { return dt__vit_block_rows(m, P, x, B, T, 0); }
static dt_tensor *dt__vit_last_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { return dt__vit_block_rows(m, P, x, B, T, 1); }

/* The ViT: patches as tokens, pre-LN blocks, the class token's logits. */
static dt_tensor *dt__vit_forward(dt_model *m, dt_tensor *images, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = images->shape[0], pi = 0;
    dt_tensor *P = dt__unit_weights(m, 0), *x = s->x;
#define DT_NEXT (&P[pi++])
    int T = (c->image_size / c->patch) * (c->image_size / c->patch) + 1;
    if (s->first == 0) {
        dt__unit_boundary(m, 0, 1);
        dt_tensor *cls = DT_NEXT, *pos = DT_NEXT, *pw = DT_NEXT, *pb = DT_NEXT;
        x = dt_linear(dt_patchify(images, c->patch), pw, pb);         /* the conv, as a matmul */
        x = dt_sp_split(m->parallel, dt_vit_tokens(x, cls, pos, B));  /* --sequence-parallel: this rank's rows */
        dt__unit_boundary(m, 0, 0);
    }
    dt_parallel *sp = dt_parallel_splitting(m->parallel);   /* the class token alone where each rank's sequences are whole */
    int cls_only = s->end == c->depth && s->first < s->end && !dt__seq_split.ring && !(sp && sp->rows_split && B % sp->tp_size);
    dt__span body = { s->first, s->end - cls_only, x };
    x = dt__span_blocks(m, &body, 1, dt__vit_block, NULL, x, B, T);
    if (cls_only) x = dt__block(m, c->depth, dt__vit_last_block, dt__unit_weights(m, c->depth), x, B, T, body.end > s->first);
    if (s->end < c->depth) return x;
    x = dt_sp_gather(m->parallel, x);
    dt__unit_boundary(m, 1 + c->depth, 1);
    P = dt__unit_weights(m, 1 + c->depth);
    pi = 0;
    dt_tensor *nw = DT_NEXT, *nb = DT_NEXT, *hw = DT_NEXT, *hb = DT_NEXT;
    /* timm normalises every token, then pools the class token: the same logits */
    x = dt_layernorm(cls_only ? x : dt_select_token(x, B, T, 0), nw, nb, 1e-6f);
    x = dt__lora_linear(m, x, hw, hb);
    dt__unit_boundary(m, 1 + c->depth, 0);
    return x;
#undef DT_NEXT
}

/* The context check of both language models. */
static void dt__check_context(const char *family, int T, int context) {
    if (T > context) dt_fail("%s: %d tokens do not fit a context of %d (--seq-len)", family, T, context);
}

/* A GPT-2 block: causal self-attention and an MLP, pre-LN, GPT-2's layout. */
static dt_tensor *dt__gpt_attention(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) {
    dt_tensor *n1w = &P[0], *n1b = &P[1], *aw = &P[2], *ab = &P[3], *pw = &P[4], *pb = &P[5];
    dt_tensor *h = dt__lora_linear_in_out(m, dt_layernorm(x, n1w, n1b, 1e-5f), aw, ab);
    h = dt__lora_linear_in_out(m, dt_attention(h, B, T, dt__heads_here(m, h), /*causal*/ 1), pw, pb);
    return dt_residual_add(x, h);
}
static dt_tensor *dt__gpt_mlp(void *model, dt_tensor *P, dt_tensor *h) {   /* c_fc, c_proj: an MLP, or an expert */
    dt_model *m = (dt_model *)model;
    return dt__lora_linear_in_out(m, dt__lora_linear_in_out_gelu_tanh(m, h, &P[0], &P[1]), &P[2], &P[3]);
}
static dt_tensor *dt__gpt_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) {
    x = dt__gpt_attention(m, P, x, B, T);
    return dt_residual_add(x, dt__gpt_mlp(m, &P[8], dt_layernorm(x, &P[6], &P[7], 1e-5f)));
}
static dt_tensor *dt__gpt_moe_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) {
    x = dt__gpt_attention(m, P, x, B, T);
    return dt_residual_add(x, dt__moe(m, &P[8], dt_layernorm(x, &P[6], &P[7], 1e-5f), T, 4, dt__gpt_mlp));
}

/* GPT-2: pre-LN blocks of causal self-attention and an MLP; the head is the
   token embedding again (x wte^T), so input and output share one table. */
static dt_tensor *dt__gpt_forward(dt_model *m, dt_tensor *tokens, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), pi = 0;
    dt_tensor *P = dt__unit_weights(m, 0), *x = s->x;
    dt__check_context("gpt", T, c->seq_len);
#define DT_NEXT (&P[pi++])
    dt_tensor *wte = DT_NEXT, *wpe = DT_NEXT, *nfw = DT_NEXT, *nfb = DT_NEXT;
    if (s->first == 0) {
        dt__unit_boundary(m, 0, 1);                                     /* the outer unit, until the head */
        x = dt_sp_split(m->parallel, dt__vocab_embedding(m, tokens, wte, wpe));   /* --sequence-parallel */
    }
    x = dt__span_blocks(m, s, 1, dt__gpt_block, dt__gpt_moe_block, x, B, T);
    if (s->end < c->depth) {                                            /* a pipeline stage before the head's */
        if (s->first == 0) dt__unit_boundary(m, 0, 0);
        return x;
    }
    if (s->first > 0) dt__unit_boundary(m, 0, 1);                       /* the head's stage: the outer unit again */
    x = dt_sp_gather(m->parallel, x);
    x = dt__vocab_head(m, dt_layernorm(x, nfw, nfb, 1e-5f), wte);     /* tied head: logits = x wte^T */
    dt__unit_boundary(m, 0, 0);
    return x;
#undef DT_NEXT
}

/* A Llama decoder layer (Qwen2's with biases on q, k and v; Mixtral's with experts). Its MLP,
   down(silu(gate h) * up h), keeps no copy of the activation (dt_swiglu_linear) unless an adapter's term comes between. */
static dt_tensor *dt__swiglu_mlp(dt_model *m, dt_tensor *h, dt_tensor *gate, dt_tensor *up, dt_tensor *down) {
    dt_tensor *g = dt__lora_linear(m, h, gate, NULL), *u = dt__lora_linear(m, h, up, NULL);
    if (dt__adapter_of(m, down) >= 0 || dt__tp_cut(m, down, 0) == DT__COLUMN_PARALLEL) return dt__lora_linear(m, dt_swiglu(g, u), down, NULL);
    dt_tensor *y = dt_swiglu_linear(g, u, down);
    return dt__tp_cut(m, down, 0) == DT__ROW_PARALLEL ? dt_tp_sum(m->parallel, y) : y;    /* a row-parallel layer's partial sums */
}
static dt_tensor *dt__llama_mlp(void *model, dt_tensor *P, dt_tensor *h) { return dt__swiglu_mlp((dt_model *)model, h, &P[0], &P[1], &P[2]); }
static dt_tensor *dt__mixtral_expert(void *model, dt_tensor *P, dt_tensor *h) { return dt__swiglu_mlp((dt_model *)model, h, &P[0], &P[2], &P[1]); }
static dt_tensor *dt__llama_layer(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T, int moe) {
    const dt_model_config *c = &m->cfg;
    dt_rope rope = { c->rope_theta, c->rope_factor, c->rope_low_freq, c->rope_high_freq, c->rope_original_context };
    int pi = 0;
#define DT_NEXT (&P[pi++])
#define DT_BIAS (c->qkv_bias ? DT_NEXT : NULL)
    dt_tensor *n1 = DT_NEXT, *qw = DT_NEXT, *qb = DT_BIAS, *kw = DT_NEXT, *kb = DT_BIAS, *vw = DT_NEXT, *vb = DT_BIAS;
    dt_tensor *ow = DT_NEXT, *n2 = DT_NEXT, *mlp = DT_NEXT;
#undef DT_BIAS
#undef DT_NEXT
    dt_tensor *h = dt_rmsnorm(x, n1, c->norm_eps);
    dt_tensor *q = dt__lora_linear(m, h, qw, qb), *k = dt__lora_linear(m, h, kw, kb), *v = dt__lora_linear(m, h, vw, vb);
    int hd = c->dim / c->heads, H = (int)(dt_tensor_cols(q) / hd), KV = (int)(dt_tensor_cols(k) / hd);   /* this rank's heads */
    dt_tensor *qkv = dt_rotary_qkv(q, k, v, B, T, H, KV, rope);
    x = dt_residual_add(x, dt__lora_linear(m, dt_attention(qkv, B, T, H, /*causal*/ 1), ow, NULL));
    h = dt_rmsnorm(x, n2, c->norm_eps);
    return dt_residual_add(x, moe ? dt__moe(m, mlp, h, T, 3, dt__mixtral_expert) : dt__llama_mlp(m, mlp, h));
}
static dt_tensor *dt__llama_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { return dt__llama_layer(m, P, x, B, T, 0); }
static dt_tensor *dt__llama_moe_block(dt_model *m, dt_tensor *P, dt_tensor *x, int B, int T) { return dt__llama_layer(m, P, x, B, T, 1); }

/* Llama: what changed since GPT-2, block by block. RMSNorm instead of
   LayerNorm; no position table, q and k rotated by position instead; fewer
   key/value heads than query heads; a gated MLP, down(silu(gate x) * up x);
   no biases (but Qwen2's q, k, v). */
static dt_tensor *dt__llama_forward(dt_model *m, dt_tensor *tokens, const dt__span *s) {
    const dt_model_config *c = &m->cfg;
    int B = tokens->shape[0], T = (int)dt_tensor_cols(tokens), tied = !c->untied_head;
    float eps = c->norm_eps;
    dt_tensor *P = dt__unit_weights(m, 0), *x = s->x;
    dt__check_context("llama", T, c->seq_len);
    dt_tensor *embed = &P[0], *norm = tied ? &P[1] : NULL;
    if (s->first == 0) {
        dt__unit_boundary(m, 0, 1);
        x = dt_sp_split(m->parallel, dt__vocab_embedding(m, tokens, embed, NULL));   /* --sequence-parallel */
        if (!tied) dt__unit_boundary(m, 0, 0);
    }
    x = dt__span_blocks(m, s, 1, dt__llama_block, dt__llama_moe_block, x, B, T);
    if (s->end < c->depth) {
        if (s->first == 0 && tied) dt__unit_boundary(m, 0, 0);
        return x;
    }
    if (s->first > 0 && tied) dt__unit_boundary(m, 0, 1);
    x = dt_sp_gather(m->parallel, x);
    if (tied) {
        x = dt__vocab_head(m, dt_rmsnorm(x, norm, eps), embed);      /* logits = x embed^T */
        dt__unit_boundary(m, 0, 0);
    } else {
        dt__unit_boundary(m, 1 + c->depth, 1);
        dt_tensor *nw = dt__unit_weights(m, 1 + c->depth), *head = nw + 1;
        x = dt_rmsnorm(x, nw, eps);
        x = dt__adapter_of(m, head) < 0 && dt__tp_cut(m, head, 0) != DT__ROW_PARALLEL ? dt__vocab_head(m, x, head)
                                                                                     : dt__lora_linear(m, x, head, NULL);
        dt__unit_boundary(m, 1 + c->depth, 0);
    }
    return x;
}

/* The parameters of the whole model: a wrapper that cuts it (tensor, pipeline
   parallelism) keeps its whole shapes (m->numel counts what this rank holds). */
static double dt__whole_params(const dt_model *m) {
    const dt_model *w = dt_model_whole(m);
    double n = 0;
    for (int i = 0; i < w->nparams; i++) n += (double)w->params[i].numel;
    return n;
}
static void dt__mlp_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    snprintf(out, n, "mlp %d -> %d x %d hidden -> %d (%.2fM params)", c->channels * c->image_size * c->image_size, c->depth,
             c->dim, c->classes, dt__whole_params(m) / 1e6);
}
static void dt__vit_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    snprintf(out, n, "vit dim=%d depth=%d heads=%d patch=%d mlp=%d on %dx%dx%d (%.2fM params)", c->dim, c->depth, c->heads,
             c->patch, c->mlp_hidden, c->channels, c->image_size, c->image_size, dt__whole_params(m) / 1e6);
}
static void dt__gpt_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    snprintf(out, n, "gpt dim=%d depth=%d heads=%d mlp=%d context=%d vocab=%d (%.2fM params)", c->dim, c->depth, c->heads,
             c->mlp_hidden, c->seq_len, c->classes, dt__whole_params(m) / 1e6);
}
static void dt__llama_describe(const dt_model *m, char *out, size_t n) {
    const dt_model_config *c = &m->cfg;
    char scaling[128] = "";
    if (c->rope_factor > 0)
        snprintf(scaling, sizeof scaling, " rope-llama3=%g,%g,%g,%d", (double)c->rope_factor, (double)c->rope_low_freq,
                 (double)c->rope_high_freq, c->rope_original_context);
    snprintf(out, n, "llama dim=%d depth=%d heads=%d kv-heads=%d ffn=%d context=%d vocab=%d rope-theta=%g%s norm-eps=%g%s%s "
             "(%.2fM params)", c->dim, c->depth, c->heads, c->kv_heads, c->mlp_hidden, c->seq_len, c->classes,
             (double)c->rope_theta, scaling, (double)c->norm_eps, c->untied_head ? " untied-head" : "",
             c->qkv_bias ? " qkv-bias" : "", dt__whole_params(m) / 1e6);
}
/* The parameters a language model looks up rather than multiplies: GPT-2's
   position table, Llama's embedding when its head is a matrix of its own. */
static int64_t dt__no_params(const dt_model *m) { (void)m; return 0; }
static int64_t dt__gpt_lookups(const dt_model *m) { return (int64_t)m->cfg.seq_len * m->cfg.dim; }
static int64_t dt__llama_lookups(const dt_model *m) { return m->cfg.untied_head ? (int64_t)m->cfg.classes * m->cfg.dim : 0; }

/* The rows a block passes the next, per sample: the mlp's one, the ViT's
   patches and class token, a language model's tokens. */
static int dt__one_row(const dt_model *m, const dt_tensor *inputs) { (void)m; (void)inputs; return 1; }
static int dt__vit_rows(const dt_model *m, const dt_tensor *inputs) {
    (void)inputs;
    return (m->cfg.image_size / m->cfg.patch) * (m->cfg.image_size / m->cfg.patch) + 1;
}
static int dt__token_rows(const dt_model *m, const dt_tensor *inputs) { (void)m; return (int)dt_tensor_cols(inputs); }

typedef struct dt__model_family dt__model_family;
static const dt__model_family *dt__family(dt_model_kind kind);

struct dt__model_family {
    const char *name;                  /* --model NAME, and a checkpoint's "model" */
    int language;                      /* token ids in, next-token logits out */
    int numbers;                       /* how many of a checkpoint's shape numbers describe it (the Hugging Face chapter) */
    void (*build)(dt__model_builder *mb, const dt_model_config *cfg);
    int blocks_past_depth;             /* its blocks are --depth plus this many (the mlp's output layer: 1) */
    dt_tensor *(*forward)(dt_model *m, dt_tensor *inputs, const dt__span *span);
    int (*rows_per_sample)(const dt_model *m, const dt_tensor *inputs);   /* of what one block passes the next */
    void (*describe)(const dt_model *m, char *out, size_t n);
    int64_t (*lookups)(const dt_model *m);   /* parameters that never multiply */
    const char *lora_targets;          /* LoRA's default targets (PEFT's, where it has them); NULL: every linear layer */
    const char *hf_prefix;             /* what Hugging Face's module names have before dtrain's */
};
/* in dt_model_kind's order */
static const dt__model_family dt__model_families[] = {
    { "mlp", 0, 8, dt__mlp_build, 1, dt__mlp_forward, dt__one_row, dt__mlp_describe, dt__no_params, NULL, "" },
    { "vit", 0, 8, dt__vit_build, 0, dt__vit_forward, dt__vit_rows, dt__vit_describe, dt__no_params, "qkv", "" },
    { "gpt", 1, 9, dt__gpt_build, 0, dt__gpt_forward, dt__token_rows, dt__gpt_describe, dt__gpt_lookups, "c_attn", "transformer." },
    { "llama", 1, 18, dt__llama_build, 0, dt__llama_forward, dt__token_rows, dt__llama_describe, dt__llama_lookups,
      "q_proj,v_proj", "" },
};
#define DT__NFAMILIES ((int)(sizeof dt__model_families / sizeof dt__model_families[0]))
static const dt__model_family *dt__family(dt_model_kind kind) {
    if ((int)kind < 0 || (int)kind >= DT__NFAMILIES) dt_fail("model kind %d is not one dtrain knows", (int)kind);
    return &dt__model_families[kind];
}
int dt_model_is_language(dt_model_kind kind) { return dt__family(kind)->language; }
/* The flat buffers of the parameters the builder listed, and their first values. */
static void dt__model_allocate(dt_model *m, dt__model_builder *mb, uint64_t seed, int frozen) {
    m->unit_first[m->nunits] = m->nparams;
    m->offsets = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m->nparams + 1));
    if (!m->offsets) dt_fail("out of memory (model)");
    for (int i = 0; i < m->nparams; i++) { m->offsets[i] = m->numel; m->numel = dt__size_add(m->numel, m->params[i].numel, "the model"); }
    /* A model that cannot fit is refused with its size before its weights are allocated (the system may
       promise more than it has, and the first write would then kill the run). */
    double weights = (double)m->numel * sizeof(float), have = dt__host_memory_bytes();
    if (dt__ctx.device == DT_CPU && have > 0 && weights * (frozen ? 1 : 2) > have)
        dt_fail("the model has %lld parameters: %.3g GB of weights%s, more than this machine's %.3g GB of memory (smaller "
                "--dim, --depth or vocabulary?)", (long long)m->numel, weights / 1e9,
                frozen ? "" : " and as much again of gradients", have / 1e9);
    size_t bytes = (size_t)dt__size_mul(m->numel, (int64_t)sizeof(float), "the model");
    m->device = dt__ctx.device;
    m->flat_data = (float *)dt_alloc_on(m->device, DT_ARENA_PARAMS, bytes);
    m->flat_grad = frozen ? NULL : (float *)dt_alloc_on(m->device, DT_ARENA_GRADS, bytes);
    /* Draw the weights on the host (the same numbers on every device), then upload. */
    float *init = m->device == DT_CPU ? m->flat_data : (float *)malloc(bytes ? bytes : 1);
    if (!init) dt_fail("out of memory (model initialisation)");
    dt__rng rng = { seed };
    int64_t off = 0;
    for (int i = 0; i < m->nparams; i++) {
        dt_tensor *t = &m->params[i];
        t->data = m->flat_data + off;
        t->grad = frozen ? NULL : m->flat_grad + off;
        t->requires_grad = !frozen;
        t->device = m->device;
        float sc = mb->init_scale[i], *dst = init + off;
        off += t->numel;
        for (int64_t j = 0; j < t->numel; j++) {
            switch (mb->init[i]) {
            case DT_INIT_ZERO: dst[j] = 0; break;
            case DT_INIT_ONE: dst[j] = 1; break;
            case DT_INIT_UNIFORM: dst[j] = (float)((2 * dt__rng_uniform(&rng) - 1) * sc); break;
            case DT_INIT_NORMAL: {       /* truncated at two standard deviations */
                double z;
                do z = dt__rng_normal(&rng); while (z < -2 || z > 2);
                dst[j] = (float)(z * sc);
                break;
            }
            }
        }
    }
    if (init != m->flat_data) { dt_upload(m->flat_data, init, bytes); free(init); }
    free(mb->init);
    free(mb->init_scale);
}

/* -- LoRA (Hu et al., 2021): fine-tuning changes a weight matrix by
      something of low rank, so learn that change as B A, with A [r, in] and
      B [out, r] for a small r, and leave W as it was. The model with LoRA is
      two models: the frozen one (m->base: its weights, no gradients, no
      optimizer state) and the adapters, which are the model's parameters --
      so the optimizer, DDP's all-reduce, FSDP's shards and the checkpoint see
      the adapters and nothing else, with no change of their own. The
      adapters' units are the base's, so FSDP gathers a block's adapters where
      it would have gathered the block. B starts at zero: training starts
      from the base model's outputs exactly. Names are PEFT's, so PEFT loads
      the saved adapters. -- */

/* A target names a module, or the last parts of its name, as PEFT's do:
   "q_proj" is every layer's self_attn.q_proj. Embeddings are no targets. */
static int dt__lora_target_matches(const char *module, const char *target, size_t tlen) {
    size_t ml = strlen(module);
    if (tlen == 0 || tlen > ml || strncmp(module + ml - tlen, target, tlen)) return 0;
    return ml == tlen || module[ml - tlen - 1] == '.';
}
static int dt__lora_module(const dt_tensor *p, char *module, size_t n) {
    size_t len = strlen(p->name);
    if (p->ndim != 2 || len < 8 || strcmp(p->name + len - 7, ".weight") || len - 7 >= n) return 0;
    memcpy(module, p->name, len - 7);
    module[len - 7] = 0;
    const char *last = strrchr(module, '.');
    last = last ? last + 1 : module;
    return strcmp(last, "wte") && strcmp(last, "wpe") && strcmp(last, "embed_tokens");
}
/* The targets of cfg, or the family's default. */
static void dt__lora_targets_of(const dt_model_config *cfg, char *out, size_t n) {
    const char *def = dt__family(cfg->kind)->lora_targets;
    if (cfg->lora_targets[0]) dt__copy_str(out, n, cfg->lora_targets);
    else if (def) dt__copy_str(out, n, def);
    else {                                     /* the MLP: every layer */
        size_t used = 0;
        out[0] = 0;
        for (int l = 0; l <= cfg->depth && used < n; l++) {
            int w = snprintf(out + used, n - used, "%sfc%d", l ? "," : "", l + 1);
            used += w > 0 ? (size_t)w : 0;
        }
    }
}
static void dt__lora_build(dt__model_builder *mb, dt_model *base, const dt_model_config *cfg) {
    dt_model *m = mb->m;
    char targets[256], module[200], name[320];
    dt__lora_targets_of(cfg, targets, sizeof targets);
    const char *prefix = dt__family(cfg->kind)->hf_prefix;
    int r = cfg->lora_rank;
    m->lora_of = (int *)malloc(sizeof(int) * (size_t)(base->nparams ? base->nparams : 1));
    if (!m->lora_of) dt_fail("out of memory (LoRA)");
    m->outer_unit = base->outer_unit;
    /* every target must name something: a typo would otherwise train nothing */
    for (const char *t = targets; *t;) {
        size_t len = strcspn(t, ",");
        int hits = 0;
        for (int i = 0; i < base->nparams; i++)
            hits += dt__lora_module(&base->params[i], module, sizeof module) && dt__lora_target_matches(module, t, len);
        if (!hits) {
            char have[1024] = "";
            size_t used = 0;
            for (int i = 0; i < base->nparams && used + 1 < sizeof have; i++) {
                if (!dt__lora_module(&base->params[i], module, sizeof module)) continue;
                const char *last = strrchr(module, '.');
                last = last ? last + 1 : module;
                int seen = 0;
                for (const char *h = have; *h && !seen; h += strcspn(h, ",") + (h[strcspn(h, ",")] == ','))
                    seen = strcspn(h, ",") == strlen(last) && !strncmp(h, last, strlen(last));
                int w = seen ? 0 : snprintf(have + used, sizeof have - used, "%s%s", used ? "," : "", last);
                used += w > 0 ? (size_t)w : 0;
            }
            dt_fail("LoRA target '%.*s' names no linear layer of this %s (its layers: %s)", (int)len, t,
                    dt__family(cfg->kind)->name, have);
        }
        t += len + (t[len] == ',');
    }
    for (int u = 0; u < base->nunits; u++) {
        dt__unit_starts_here(mb);
        for (int i = base->unit_first[u]; i < base->unit_first[u + 1]; i++) {
            const dt_tensor *w = &base->params[i];
            int hit = 0;
            m->lora_of[i] = -1;
            if (!dt__lora_module(w, module, sizeof module)) continue;
            for (const char *t = targets; *t && !hit;) {
                size_t len = strcspn(t, ",");
                hit = dt__lora_target_matches(module, t, len);
                t += len + (t[len] == ',');
            }
            if (!hit) continue;
            int gpt = cfg->kind == DT_MODEL_GPT;     /* Conv1D: [in, out] */
            int in = w->shape[gpt ? 0 : 1], out = w->shape[gpt ? 1 : 0];
            if (r > in || r > out)
                dt_fail("--lora-rank %d: '%s' is %d x %d; the rank must not exceed either side", r, w->name, w->shape[0], w->shape[1]);
            m->lora_of[i] = m->nparams;
            snprintf(name, sizeof name, "base_model.model.%s%s.lora_A.weight", prefix, module);
            dt__add_param(mb, name, DT_INIT_UNIFORM, 1.0f / sqrtf((float)in), 2, r, in, 0, 0);   /* PEFT's kaiming_uniform(a=sqrt 5) */
            snprintf(name, sizeof name, "base_model.model.%s%s.lora_B.weight", prefix, module);
            dt__add_param(mb, name, DT_INIT_ZERO, 0, 2, out, r, 0, 0);
        }
    }
    m->lora_scale = cfg->lora_alpha / (float)r;
}

static dt_model *dt__model_create(const dt_model_config *cfg, uint64_t seed, int frozen) {
    const dt__model_family *fam = dt__family(cfg->kind);
    dt_model *m = (dt_model *)calloc(1, sizeof(dt_model));
    if (!m) dt_fail("out of memory (model)");
    m->cfg = *cfg;
    m->unit_first = (int *)calloc((size_t)cfg->depth + 3, sizeof(int));
    if (!m->unit_first) dt_fail("out of memory (model)");
    dt__model_builder mb = { m, 0, NULL, NULL };
    m->outer_unit = -1;
    if (cfg->lora_rank > 0) {
        if (!(cfg->lora_alpha > 0)) dt_fail("LoRA: alpha must be positive, got %g", (double)cfg->lora_alpha);
        dt_model_config plain = *cfg;
        plain.lora_rank = 0;
        m->base = dt__model_create(&plain, seed, /*frozen*/ 1);
        m->base_seed = seed;
        m->cfg = m->base->cfg;               /* with the defaults the family filled in */
        m->cfg.lora_rank = cfg->lora_rank; m->cfg.lora_alpha = cfg->lora_alpha;
        dt__lora_targets_of(cfg, m->cfg.lora_targets, sizeof m->cfg.lora_targets);
        dt__lora_build(&mb, m->base, &m->cfg);
        seed ^= 0x4C6F5241ull;               /* the adapters' own draws ("LoRA") */
    } else
        fam->build(&mb, cfg);
    if (cfg->moe_experts > 0) {
        if (!fam->language) dt_fail("%s: experts replace a language model's MLP (gpt, llama)", fam->name);
        m->moe.experts = cfg->moe_experts;
        m->moe.routed = (int64_t *)calloc((size_t)cfg->moe_experts, sizeof(int64_t));
        if (!m->moe.routed) dt_fail("out of memory (model)");
    }
    /* which block reads each parameter (pipeline parallelism): its unit's,
       the first unit being the embedding when there are more units than
       blocks (all but the mlp) */
    int blocks = dt_model_blocks(m), embedding = m->nunits > blocks;
    for (int u = 0; u < m->nunits; u++)
        for (int i = m->unit_first[u]; i < (u + 1 < m->nunits ? m->unit_first[u + 1] : m->nparams); i++)
            m->splits[i].block = m->splits[i].head ? blocks : u - embedding;
    dt__model_allocate(m, &mb, seed, frozen);
    return m;
}
dt_model *dt_model_create(const dt_model_config *cfg, uint64_t seed) { return dt__model_create(cfg, seed, 0); }

void dt_model_free(dt_model *m) {
    if (!m) return;
    if (m->optimizers) dt_fail("dt_model_free: its optimizer still steps this model; call dt_optimizer_free first");
    if (m->parallel)
        dt_fail("dt_model_free: %s still wraps this model; call %s first", m->parallel->create_fn, m->parallel->free_fn);
    for (int i = 0; i < m->nparams; i++) free((void *)m->params[i].name);
    free(m->params);
    free(m->offsets);
    free(m->splits);
    free(m->unit_first);
    dt_free_on(m->device, DT_ARENA_PARAMS, m->flat_data, (size_t)m->numel * sizeof(float));
    dt_free_on(m->device, DT_ARENA_GRADS, m->flat_grad, (size_t)m->numel * sizeof(float));
    free(m->lora_of);
    free(m->moe.routed);
    free(m->base_source);
    dt_model_free(m->base);
    free(m);
}

const dt_model *dt_model_whole(const dt_model *m) {
    for (const dt_parallel *q = m->parallel; q; q = q->inner) if (q->whole) return q->whole;
    return m;
}
void dt_model_set_parallel(dt_model *m, dt_parallel *par) {
    if (par && m->left_cut_by)
        dt_fail("%s: %s has cut this model (each rank kept its pieces); create the model again for another wrapper",
                par->create_fn ? par->create_fn : "dt_model_set_parallel", m->left_cut_by);
    dt_parallel *now = par ? par : m->parallel;
    if (!now) return;
    if (par && (!par->create_fn || !par->sync_fn || !par->free_fn))
        dt_fail("dt_model_set_parallel: a dt_parallel must name its create, sync and free functions (for the errors)");
    if (par && m->parallel && par->inner != m->parallel)
        dt_fail("%s: this model is already wrapped (%s); one wrapper per model (or one that wraps it), or call %s first",
                par->create_fn, m->parallel->create_fn, m->parallel->free_fn);
    if (par && par->inner && par->inner != m->parallel)
        dt_fail("%s: the wrapper it wraps (%s) does not hold this model", par->create_fn, par->inner->create_fn);
    if (par && m->optimizers)
        dt_fail("%s: this model already has an optimizer; create the optimizer after %s, which decides what it steps",
                par->create_fn, par->create_fn);
    if (!par && m->optimizers)
        dt_fail("%s: the optimizer still steps what this wrapper gave it; call dt_optimizer_free first", now->free_fn);
    m->parallel = par ? par : now->inner;                /* unwrapped: the one it wrapped holds the model again */
    for (int i = 0; i < m->nparams; i++) m->params[i].parallel = m->parallel;
    dt__ctx.wrappers += par ? 1 : -1;
}

dt_tensor *dt_model_param(dt_model *m, const char *name) {
    for (int i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

void dt_model_zero_grad(dt_model *m) { dt__zero_on(m->device, m->flat_grad, (size_t)m->numel * sizeof(float)); }

void dt_model_describe(const dt_model *m, char *out, size_t n) {
    dt__family(m->cfg.kind)->describe(m->base ? m->base : m, out, n);
    size_t used = strlen(out);
    const dt_model_config *c = &m->cfg;
    if (c->moe_experts && used < n)
        used += (size_t)snprintf(out + used, n - used, " + %d experts, top-%d, every %d block(s), capacity %g", c->moe_experts,
                                 c->moe_top_k, c->moe_every, (double)c->moe_capacity);
    if (m->base && used < n)
        snprintf(out + used, n - used, " + LoRA rank=%d alpha=%g on %s (%lld trainable)", m->cfg.lora_rank,
                 (double)m->cfg.lora_alpha, m->cfg.lora_targets, (long long)m->numel);
}

/* How checkpoints name a model (their "model"). */
static const char *dt__model_kind_name(dt_model_kind k) { return dt__family(k)->name; }

double dt_model_flops_per_token(const dt_model *m) {
    const dt_model_config *c = &m->cfg;
    const dt__model_family *fam = dt__family(c->kind);
    if (!fam->language) return 0;
    const dt_model *w = m->base ? m->base : m;
    double multiplying = (double)w->numel - (double)fam->lookups(m), experts = 0;
    for (int i = 0; i < (c->moe_experts ? w->nparams : 0); i++) experts += strstr(w->params[i].name, ".experts.") ? (double)w->params[i].numel : 0;
    multiplying -= experts * (c->moe_experts - c->moe_top_k) / (c->moe_experts ? c->moe_experts : 1);   /* k of E work */
    /* a frozen weight costs its forward and the input's gradient, 4 per
       parameter, not the weight's gradient; LoRA's adapters cost 6 */
    return (m->base ? 4.0 * multiplying + 6.0 * (double)m->numel : 6.0 * multiplying) + 12.0 * c->depth * c->dim * c->seq_len;
}

dt_tensor *dt_model_forward(dt_model *m, dt_tensor *inputs) {
    if (!m->flat_data && !m->parallel)
        dt_fail("dt_model_forward: this model's parameters went with dt_fsdp_free (each rank kept only its shard); "
                "call dt_fsdp_free after the last forward");
    if (m->left_cut_by && !m->parallel)
        dt_fail("dt_model_forward: %s has run, and this rank holds only its pieces of the model's split layers; call %s "
                "after the last forward", m->left_cut_by, m->left_cut_by);
    for (dt_parallel *q = m->parallel; q; q = q->inner) if (q->forward) return q->forward(q, inputs);   /* a pipeline runs it */
    return dt_model_forward_blocks(m, inputs, NULL, 0, dt_model_blocks(m));
}
int dt_model_blocks(const dt_model *m) { return m->cfg.depth + dt__family(m->cfg.kind)->blocks_past_depth; }
dt_tensor *dt_model_forward_blocks(dt_model *m, dt_tensor *inputs, dt_tensor *x, int first, int end) {
    int n = dt_model_blocks(m);
    if (m->left_cut_by && !m->parallel)
        dt_fail("dt_model_forward_blocks: %s has run, and this rank holds only its pieces of the model; call %s after the last "
                "forward", m->left_cut_by, m->left_cut_by);
    if (first < 0 || end > n || first > end || (first == 0 && end == 0 && n > 0))
        dt_fail("dt_model_forward_blocks: blocks [%d, %d) of a model of %d", first, end, n);
    if ((first > 0) != (x != NULL))
        dt_fail("dt_model_forward_blocks: %s", first > 0 ? "a run of blocks after the first starts from x, the activation "
                                                           "the blocks before made: give it"
                                                         : "the first block starts from the embedding of the inputs: x must be NULL");
    const dt_model *w = m->base ? m->base : m;      /* the weights the blocks read must be here: only a */
    for (int i = 0; i < (dt_model_whole(m) != m ? w->nparams : 0); i++) {   /* cut model lacks any */
        int b = w->splits[i].block;
        int read = (b >= first && b < end) || (b < 0 && first == 0) || (b >= n && end == n) || (w->splits[i].tied && (first == 0 || end == n));
        if (read && w->params[i].numel == 0 && !w->splits[i].expert)   /* (expert parallelism's are elsewhere) */
            dt_fail("dt_model_forward_blocks: blocks [%d, %d) read %s, which this rank does not hold (a pipeline stage keeps "
                    "only its own blocks' parameters)", first, end, w->params[i].name);
    }
    if (x) {
        int64_t rows = (int64_t)inputs->shape[0] * dt__family(m->cfg.kind)->rows_per_sample(m, inputs);
        if (x->numel != rows * m->cfg.dim)
            dt_fail("dt_model_forward_blocks: x has %lld values; blocks after the first take %lld rows of %d (the inputs' "
                    "samples x their rows)", (long long)x->numel, (long long)rows, m->cfg.dim);
    }
    dt__span span = { first, end, x };
    return dt__family(m->cfg.kind)->forward(m, inputs, &span);
}
