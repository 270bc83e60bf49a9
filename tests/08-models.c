/* tests/08-models.c -- tests of dtrain.h's chapter 08-models: gradients,
   names and shapes of the MLP, ViT, GPT-2 and Llama. (tests/helpers.h: how
   the suite's files make one program.) */
#include "helpers.h"

/* ---- models: gradients, names and shapes of timm's ViT and GPT-2 --------- */

/* The whole models: the gradient of the loss for parameters sampled across
   every layer, against finite differences of the loss. */
typedef struct { dt_model *m; dt_tensor *images; int32_t *labels; } model_ctx;
static dt_tensor *f_model(dt_tensor **l, void *c) {
    (void)l;
    model_ctx *mc = (model_ctx *)c;
    int shape[4] = { mc->images->shape[0], mc->images->shape[1], mc->images->shape[2], mc->images->shape[3] };
    dt_tensor *img = dt_tensor_new(4, shape);        /* forward may reshape its input view */
    memcpy(img->data, mc->images->data, sizeof(float) * (size_t)img->numel);
    return dt_cross_entropy(dt_model_forward(mc->m, img), mc->labels);
}
static void model_fd(dt_model_kind kind) {
    dt_model_config c = { kind, 3, 8, 5, kind == DT_MODEL_MLP ? 16 : 12, 2, 2, 4, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 9);
    dt__rng r = { 6 };
    int B = 3;
    int shape[4] = { B, 3, 8, 8 };
    dt_tensor *img = leaf(4, shape, &r, 1);
    img->requires_grad = 0;
    int32_t labels[3] = { 1, 4, 0 };
    model_ctx mc = { m, img, labels };
    dt_tensor **leaves = (dt_tensor **)malloc(sizeof(dt_tensor *) * m->nparams);
    for (int i = 0; i < m->nparams; i++) leaves[i] = &m->params[i];
    dt_model_zero_grad(m);
    fd_check(kind == DT_MODEL_MLP ? "mlp" : "vit", f_model, leaves, m->nparams, &mc, 2e-3f, 2e-2);
    free(leaves);
    leaf_free(img);
    dt_model_free(m);
}
TEST(mlp_gradients_match_finite_differences, FULL) { model_fd(DT_MODEL_MLP); }
TEST(vit_gradients_match_finite_differences, FULL) { model_fd(DT_MODEL_VIT); }

/* A model's size is a product of numbers from flags or a model folder's
   config.json, each within its range: the product is checked, and a model
   larger than the machine's memory is refused with its size before its
   weights are allocated (the sum of the parameters once wrapped past 2^64
   bytes to a small buffer that the initialisation overran: exit 139). */
TEST(a_model_larger_than_memory_is_refused_with_its_size, QUICK) {
    char out[8192], dir[700], path[800];
    int st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --model mlp --depth 1140 --dim 63630889 --steps 1 "
                     "--batch-size 2", train_cpu, small_data());
    expect_error(out, st, 1, "parameters");
    CHECKF(strstr(out, "GB of memory"), "the refusal does not say the model's size against the memory:\n%s", out);
    snprintf(dir, sizeof dir, "%s/huge", tmpdir);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f) return;
    fprintf(f, "{\"model_type\": \"gpt2\", \"vocab_size\": 7899597, \"n_embd\": 16772880, \"n_layer\": 1366, \"n_head\": 1}");
    fclose(f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_bytes(path, "\x02\0\0\0\0\0\0\0{}", 10);
    st = run_cmd(out, sizeof out, "%s --init %s --data %s --seq-len 16 --batch-size 1 --steps 1", train_cpu, dir, gpt_text());
    expect_error(out, st, 1, "parameters");
    /* and a model that fits still trains */
    st = run_cmd(out, sizeof out, "%s --data %s --image-size 16 --model mlp --depth 2 --dim 64 --steps 1 --batch-size 2", train_cpu,
                 small_data());
    CHECKF(st == 0, "a small mlp: exit %d\n%s", st, out);
}

/* Without --recompute, backward gives a block's gradients back when it
   leaves the block (the autograd chapter's tape regions): what backward adds
   to the forward's activations is one block's gradients at a time, and the
   gradients of the blocks' inputs, which take turns in two B x T x dim
   buffers: the same at depth 8 as at depth 2. Before, every block's
   gradients stayed to the step's end, and then every block's input's. */
TEST(backward_holds_one_blocks_gradients_at_a_time, QUICK) {
    enum { B = 2, T = 32, V = 11 };
    float tokens[B * T];
    int32_t labels[B * T];
    dt__rng r = { 8 };
    for (int i = 0; i < B * T; i++) { tokens[i] = (float)(dt__rng_u64(&r) % V); labels[i] = (int32_t)(dt__rng_u64(&r) % V); }
    double extra[2], forward[2];
    for (int k = 0; k < 2; k++) {
        int depth = k ? 8 : 2, shape[2] = { B, T };
        dt_model_config c = { DT_MODEL_LLAMA, 0, 0, V, 64, depth, 4, 0, 96, T, 2, 0, 0, 10000.0f, 1e-5f, 0, 0, 0, 0, 0, 0, "",
                              0, 0, 0, 0, 0 };
        dt_model *m = dt_model_create(&c, 5);
        for (int step = 0; step < 2; step++) {         /* the second: the arena is one block, as in training */
            dt_step_arena_reset();
            dt_tensor *loss = dt_cross_entropy(dt_model_forward(m, dt_tensor_from_host(2, shape, tokens)), labels);
            forward[k] = (double)dt__ctx.step[DT_CPU].high;
            dt_backward(loss);
            extra[k] = (double)dt__ctx.step[DT_CPU].peak - forward[k];
        }
        dt_step_arena_reset();
        dt_model_free(m);
    }
    double block = (forward[1] - forward[0]) / 6, input_grad = (double)B * T * 64 * sizeof(float);
    printf("    forward %.0f and %.0f KB (depth 2, 8); backward's extra %.0f and %.0f KB; a block's activations %.0f KB\n",
           forward[0] / 1e3, forward[1] / 1e3, extra[0] / 1e3, extra[1] / 1e3, block / 1e3);
    CHECKF(block > 0 && extra[1] - extra[0] < input_grad / 2,
           "backward's memory beyond the forward's grew with the depth: %.0f KB at depth 2, %.0f KB at depth 8 (a block's "
           "activations: %.0f KB, its input's gradient %.0f KB)", extra[0] / 1e3, extra[1] / 1e3, block / 1e3, input_grad / 1e3);
}

/* One forward and backward of a language model on B x T tokens: a copy of
   every gradient (the model's own are zeroed after), the loss, the logits. */
static float *one_step_grads(dt_model *m, const float *tokens, const int32_t *labels, int B, int T, float *loss,
                             dt_tensor **logits) {
    int shape[2] = { B, T };
    dt_step_arena_reset();
    dt_tensor *lg = dt_model_forward(m, dt_tensor_from_host(2, shape, tokens)), *l = dt_cross_entropy(lg, labels);
    dt_backward(l);
    *loss = dt_tensor_item(l);
    if (logits) *logits = lg;
    float *grad = (float *)malloc(sizeof(float) * (size_t)m->numel);
    memcpy(grad, m->flat_grad, sizeof(float) * (size_t)m->numel);
    memset(m->flat_grad, 0, sizeof(float) * (size_t)m->numel);
    return grad;
}
/* How many of n floats differ in their bits. */
static int64_t bits_differ(const float *a, const float *b, int64_t n) {
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) differ += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return differ;
}

/* The loss's backward through the head (the attention-and-loss chapter):
   the logits' gradient made a block of rows at a time and passed through
   the head's matmuls at once, never whole, gives every gradient bit for bit
   as the two entries apart do -- tied (llama's default, GPT-2's) and untied
   heads, rows that are not a whole block, a label ignored. So do logits that
   waited (dt_set_lazy_logits): the loss makes them a block at a time, and
   backward again; they are never whole until read, and then the same bits. */
TEST(the_loss_through_the_head_gives_the_gradients_of_the_two_apart, QUICK) {
    enum { B = 3, T = 200, V = 300 };                  /* 600 rows: two blocks of 256 and a part */
    static float want[B * T * V], got[B * T * V];
    dt__xent_block_bytes = 256.0 * V * sizeof(float);
    float tokens[B * T];
    int32_t labels[B * T];
    dt__rng r = { 9 };
    for (int i = 0; i < B * T; i++) { tokens[i] = (float)(dt__rng_u64(&r) % V); labels[i] = (int32_t)(dt__rng_u64(&r) % V); }
    labels[7] = DT_IGNORE_INDEX;
    for (int k = 0; k < 3; k++) {
        dt_model_config c = { k == 2 ? DT_MODEL_GPT : DT_MODEL_LLAMA, 0, 0, V, 32, 2, 4, 0, 48, T, 2, 0, 0, 10000.0f, 1e-5f,
                              0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
        c.untied_head = k == 1;
        if (k == 2) c.kv_heads = 0;                    /* GPT-2: every head its own keys */
        dt_model *m = dt_model_create(&c, 4);
        float *grad[3], loss[3];
        size_t peak[3];
        for (int way = 0; way < 3; way++) {            /* through the head; apart; logits that waited */
            dt_tensor *logits;
            dt__xent_apart = way == 1;
            dt_set_lazy_logits(way == 2 ? 0 : -1);
            grad[way] = one_step_grads(m, tokens, labels, B, T, &loss[way], &logits);
            peak[way] = dt__ctx.step[DT_CPU].peak;
            CHECKF((logits->grad == NULL) == (way != 1), "model %d, way %d: the logits %s a gradient", k, way,
                   way == 1 ? "have no" : "have");
            if (way == 2) CHECKF(logits->data == NULL, "model %d: the logits that waited were made whole", k);
            dt_tensor_to_host(logits, way == 1 ? want : got);     /* those that waited: made now */
        }
        dt__xent_apart = 0;
        dt_set_lazy_logits(-1);
        for (int way = 0; way < 3; way += 2) {
            int64_t differ = bits_differ(grad[way], grad[1], m->numel);
#ifdef DT_HAVE_CBLAS
            (void)differ;                              /* a system BLAS sums in its own slabs */
#else
            CHECKF(differ == 0, "model %d (%s head)%s: %lld of %lld gradients differ from the two entries apart", k,
                   k == 1 ? "untied" : "tied", way ? ", logits that waited" : "", (long long)differ, (long long)m->numel);
            CHECKF(memcmp(&loss[way], &loss[1], sizeof(float)) == 0, "model %d, way %d: loss %.9g, apart %.9g", k, way,
                   loss[way], loss[1]);
#endif
        }
        CHECKF(bits_differ(got, want, B * T * V) == 0, "model %d: the logits that waited, made when read, differ", k);
        CHECKF(peak[0] >= peak[2] + sizeof want * 9 / 10, "model %d: the step's memory with logits that waited, %zu bytes, "
               "against %zu with them whole (%zu bytes of logits)", k, peak[2], peak[0], sizeof want);
        free(grad[0]); free(grad[1]); free(grad[2]);
        dt_step_arena_reset();
        dt_model_free(m);
    }
    dt__xent_block_bytes = 64e6;
}

/* Logits that waited, read (or made again by backward) after the optimizer
   moved the head: an error that says so, not values of other weights. */
TEST(logits_that_waited_are_an_error_once_the_optimizer_moved_their_weights, QUICK) {
    float tokens[8] = { 1, 2, 3, 4, 5, 6, 7, 0 }, host[8 * 16];
    int32_t labels[8] = { 2, 3, 4, 5, 6, 7, 0, 1 };
    dt_model_config c = { DT_MODEL_LLAMA, 0, 0, 16, 32, 1, 4, 0, 48, 8, 2, 0, 0, 10000.0f, 1e-5f,
                          0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    for (int late_backward = 0; late_backward < 2; late_backward++) {
        fflush(stdout);
        pid_t pid = fork();              /* a dt_fail: let it end a child, not the suite */
        if (pid == 0) {
            dt_model *m = dt_model_create(&c, 4);
            dt_optimizer *o = dt_optimizer_create(m, DT_ADAMW, 0.0f, 0.0f, 0.0f);
            int shape[2] = { 1, 8 };
            dt_set_lazy_logits(0);
            dt_tensor *lg = dt_model_forward(m, dt_tensor_from_host(2, shape, tokens)), *l = dt_cross_entropy(lg, labels);
            if (!late_backward) dt_backward(l);
            dt_optimizer_step(o, 1e-3f);
            if (lg->data) _exit(3);      /* it never waited */
            if (late_backward) dt_backward(l);     /* must stop here */
            else dt_tensor_to_host(lg, host);      /* or here */
            _exit(0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 1, "logits that waited, %s after the optimizer step: status %d "
               "(want an error, exit 1)", late_backward ? "made again by backward" : "read", st);
    }
}

/* dt_swiglu_linear (Llama's MLP, Mixtral's experts) makes silu(gate) * up
   again in backward instead of keeping it: the loss and every gradient bit
   for bit as dt_swiglu and dt_linear apart give them. */
TEST(swiglu_and_down_in_one_op_give_the_bits_of_the_two_apart, QUICK) {
    enum { B = 2, T = 24, V = 40 };
    float tokens[B * T];
    int32_t labels[B * T];
    dt__rng r = { 10 };
    for (int i = 0; i < B * T; i++) { tokens[i] = (float)(dt__rng_u64(&r) % V); labels[i] = (int32_t)(dt__rng_u64(&r) % V); }
    for (int k = 0; k < 2; k++) {
        dt_model_config c = { DT_MODEL_LLAMA, 0, 0, V, 32, 2, 4, 0, 72, T, 2, 0, 0, 10000.0f, 1e-5f, 0, 0, 0, 0, 0, 0, "",
                              0, 0, 0, 0, 0 };
        if (k) { c.moe_experts = 4; c.moe_top_k = 2; c.moe_every = 1; }      /* Mixtral's experts */
        dt_model *m = dt_model_create(&c, 6);
        float *grad[2], loss[2];
        for (int apart = 0; apart < 2; apart++) {
            dt__swiglu_apart = apart;
            grad[apart] = one_step_grads(m, tokens, labels, B, T, &loss[apart], NULL);
        }
        dt__swiglu_apart = 0;
        int64_t differ = bits_differ(grad[0], grad[1], m->numel);
        CHECKF(memcmp(&loss[0], &loss[1], sizeof(float)) == 0, "%s: loss %.9g in one op, %.9g apart", k ? "mixtral" : "llama",
               loss[0], loss[1]);
        CHECKF(differ == 0, "%s: %lld of %lld gradients differ from the two ops apart", k ? "mixtral" : "llama", (long long)differ,
               (long long)m->numel);
        free(grad[0]); free(grad[1]);
        dt_step_arena_reset();
        dt_model_free(m);
    }
}

/* dt_residual_add writes a block's residual sum over its branch (the
   projection's output) when no backward reads it: the loss and every
   gradient bit for bit as with a new tensor, in two [tokens, width] tensors
   a block fewer; a branch from an op not known to leave its output unread
   gets a new tensor. */
TEST(the_residual_sum_over_its_branch_gives_the_same_bits_in_less_memory, QUICK) {
    enum { B = 2, T = 24, V = 40, D = 32, DEPTH = 3 };
    float tokens[B * T];
    int32_t labels[B * T];
    dt__rng r = { 11 };
    for (int i = 0; i < B * T; i++) { tokens[i] = (float)(dt__rng_u64(&r) % V); labels[i] = (int32_t)(dt__rng_u64(&r) % V); }
    for (int k = 0; k < 2; k++) {
        dt_model_config c = { k ? DT_MODEL_GPT : DT_MODEL_LLAMA, 0, 0, V, D, DEPTH, 4, k ? 0 : 2, 72, T, 2, 0, 0, 10000.0f,
                              1e-5f, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
        dt_model *m = dt_model_create(&c, 7);
        float *grad[2], loss[2];
        size_t peak[2];
        for (int apart = 0; apart < 2; apart++) {
            dt__residual_apart = apart;
            grad[apart] = one_step_grads(m, tokens, labels, B, T, &loss[apart], NULL);
            peak[apart] = dt__ctx.step[DT_CPU].peak;
        }
        dt__residual_apart = 0;
        CHECKF(memcmp(&loss[0], &loss[1], sizeof(float)) == 0, "%s: loss %.9g over the branch, %.9g apart", k ? "gpt" : "llama",
               loss[0], loss[1]);
        CHECKF(bits_differ(grad[0], grad[1], m->numel) == 0, "%s: gradients differ with the sum over the branch", k ? "gpt" : "llama");
        size_t two = 2 * DEPTH * (size_t)B * T * D * sizeof(float);
        CHECKF(peak[1] >= peak[0] + two, "%s: the step's memory %zu bytes over the branch, %zu apart (want %zu fewer)",
               k ? "gpt" : "llama", peak[0], peak[1], two);
        free(grad[0]); free(grad[1]);
        dt_step_arena_reset();
        dt_model_free(m);
    }
    /* the branch's maker decides */
    int xshape[2] = { 4, D }, wshape[2] = { D, D };
    float xs[4 * D], ws[D * D];
    for (int i = 0; i < 4 * D; i++) xs[i] = (float)i / 7;
    for (int i = 0; i < D * D; i++) ws[i] = (float)(i % 13) / 11;
    dt_tensor *x = dt_tensor_from_host(2, xshape, xs), *w = dt_tensor_from_host(2, wshape, ws);
    x->requires_grad = 1;
    dt_tensor *lin = dt_linear(x, w, NULL), *y = dt_residual_add(x, lin);
    CHECKF(y->data == lin->data, "a linear layer's output: the sum did not take its memory");
    dt_tensor *g = dt_gelu(x), *y2 = dt_residual_add(x, g);
    CHECKF(y2->data != g->data, "GELU's output (not a maker known to leave it unread) was written over");
    /* backward: the sum over the branch hands the branch its gradient; the other is a copy */
    dt_tensor *sum = dt_add(y, y2);
    float seed[4 * D], want[4 * D];
    for (int i = 0; i < 4 * D; i++) seed[i] = (float)(i % 5) - 2;
    dt_backward_from(sum, seed);
    CHECKF(lin->grad != NULL && lin->grad == y->grad, "the branch's gradient is not the sum's, handed over");
    CHECKF(g->grad != NULL && g->grad != y2->grad, "GELU's output shares the sum's gradient");
    dt_tensor_grad_to_host(lin, want);
    CHECKF(memcmp(want, seed, sizeof want) == 0, "the branch's gradient is not the sum's");
    dt_tensor_grad_to_host(g, want);
    CHECKF(memcmp(want, seed, sizeof want) == 0, "GELU's output's gradient is not the sum's");
    dt_step_arena_reset();
}

TEST(vit_parameter_names_and_shapes_follow_timm, QUICK) {
    dt_model_config c = { DT_MODEL_VIT, 3, 32, 10, 192, 6, 3, 4, 768, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 1);
    struct { const char *name; int ndim, s[4]; } want[] = {
        { "cls_token", 3, { 1, 1, 192 } }, { "pos_embed", 3, { 1, 65, 192 } },
        { "patch_embed.proj.weight", 4, { 192, 3, 4, 4 } }, { "patch_embed.proj.bias", 1, { 192 } },
        { "blocks.0.norm1.weight", 1, { 192 } }, { "blocks.0.attn.qkv.weight", 2, { 576, 192 } },
        { "blocks.0.attn.qkv.bias", 1, { 576 } }, { "blocks.0.attn.proj.weight", 2, { 192, 192 } },
        { "blocks.5.norm2.bias", 1, { 192 } }, { "blocks.5.mlp.fc1.weight", 2, { 768, 192 } },
        { "blocks.5.mlp.fc2.weight", 2, { 192, 768 } }, { "norm.weight", 1, { 192 } }, { "head.weight", 2, { 10, 192 } },
        { "head.bias", 1, { 10 } } };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        dt_tensor *p = dt_model_param(m, want[i].name);
        CHECKF(p != NULL, "no parameter %s", want[i].name);
        if (!p) continue;
        int same = p->ndim == want[i].ndim;
        for (int d = 0; same && d < p->ndim; d++) same = p->shape[d] == want[i].s[d];
        CHECKF(same, "%s has the wrong shape", want[i].name);
    }
    CHECK(m->nparams == 4 + 6 * 12 + 4);
    /* per block: qkv 192*576+576, proj 192*192+192, fc1 192*768+768, fc2 768*192+192, norms 4*192
       = 444,864; six blocks, plus patch embedding 192*48+192, pos 65*192, cls 192, norm 384, head 1,930 */
    CHECKF(m->numel == 6 * 444864 + 9408 + 12480 + 192 + 384 + 1930, "vit-tiny on 32x32 has %lld parameters",
           (long long)m->numel);
    dt_model_free(m);
}

/* The head reads the class token alone, so the last block carries that row
   alone past its attention: the logits and every gradient are those of the
   whole last block (timm's, built here from the same block function), and
   the step does less work -- the last projection and MLP on B rows, not
   B x T: at least 6 (B (T - 1)) (D^2 + 2 D H) FLOP fewer. */
TEST(vit_last_block_carries_the_class_token_alone, QUICK) {
    dt_model_config c = { DT_MODEL_VIT, 3, 16, 10, 32, 2, 2, 4, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    dt_model *m = dt_model_create(&c, 3);
    dt__rng r = { 8 };
    int B = 4, T = 17, shape[4] = { B, 3, 16, 16 };
    int32_t labels[4] = { 3, 0, 9, 5 };
    float *images = (float *)malloc(sizeof(float) * (size_t)B * 3 * 16 * 16), *grad[2], loss[2];
    double flops[2], worst = 0;
    for (int i = 0; i < B * 3 * 16 * 16; i++) images[i] = 2.0f * dt__rng_uniform(&r) - 1.0f;
    for (int whole = 0; whole < 2; whole++) {
        dt_step_arena_reset();
        double before = dt__ctx.flops;
        dt_tensor *img = dt_tensor_from_host(4, shape, images), *logits;
        if (!whole) logits = dt_model_forward(m, img);
        else {                                               /* every block on every token, as timm runs it */
            dt_tensor *E = dt__unit_weights(m, 0), *H = dt__unit_weights(m, 1 + c.depth);
            dt_tensor *x = dt_vit_tokens(dt_linear(dt_patchify(img, c.patch), &E[2], &E[3]), &E[0], &E[1], B);
            for (int l = 0; l < c.depth; l++) x = dt__vit_block(m, dt__unit_weights(m, 1 + l), x, B, T);
            logits = dt_linear(dt_layernorm(dt_select_token(x, B, T, 0), &H[0], &H[1], 1e-6f), &H[2], &H[3]);
        }
        dt_tensor *l = dt_cross_entropy(logits, labels);
        dt_backward(l);
        flops[whole] = dt__ctx.flops - before;
        loss[whole] = dt_tensor_item(l);
        grad[whole] = (float *)malloc(sizeof(float) * (size_t)m->numel);
        memcpy(grad[whole], m->flat_grad, sizeof(float) * (size_t)m->numel);
        dt_model_zero_grad(m);
    }
    for (int64_t i = 0; i < m->numel; i++) {
        double d = fabs((double)grad[0][i] - grad[1][i]) / (1e-3 + fabs((double)grad[1][i]));
        worst = d > worst ? d : worst;
    }
    double saved = 6.0 * B * (T - 1) * ((double)c.dim * c.dim + 2.0 * c.dim * c.mlp_hidden);
    printf("    loss %.7f against %.7f, gradients within %.2g; %.3g FLOP against %.3g\n", loss[0], loss[1], worst, flops[0], flops[1]);
    CHECKF(fabsf(loss[0] - loss[1]) <= 1e-6f * fabsf(loss[1]) && worst <= 1e-4,
           "the class token alone: loss %.7f against the whole block's %.7f, gradients %.3g apart", loss[0], loss[1], worst);
    CHECKF(flops[1] - flops[0] >= saved, "the last block on the class token alone saves %.3g FLOP of %.3g; at least %.3g expected",
           flops[1] - flops[0], flops[1], saved);
    free(grad[0]); free(grad[1]); free(images);
    dt_model_free(m);
}

static dt_model_config tiny_gpt(void) {                /* vocab 11, dim 12, depth 2, heads 2, mlp 48, context 6 */
    dt_model_config c = { DT_MODEL_GPT, 0, 0, 11, 12, 2, 2, 0, 48, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    return c;
}
typedef struct { dt_model *m; const float *ids; int B, T; const int32_t *labels; } gpt_ctx;
static dt_tensor *gpt_logits(gpt_ctx *g) {
    int s[2] = { g->B, g->T };
    return dt_model_forward(g->m, dt_tensor_from_host(2, s, g->ids));
}
static dt_tensor *f_gpt(dt_tensor **l, void *c) { (void)l; return dt_cross_entropy(gpt_logits((gpt_ctx *)c), ((gpt_ctx *)c)->labels); }

TEST(gpt_gradients_match_finite_differences, FULL) {
    dt_model_config c = tiny_gpt();
    dt_model *m = dt_model_create(&c, 9);
    for (int64_t i = 0; i < m->numel; i++) m->flat_data[i] *= 3;     /* larger weights: every path matters */
    float ids[10] = { 1, 7, 7, 3, 10, 0, 5, 1, 1, 9 };                  /* 2 sequences of 5 (shorter than the context) */
    int32_t labels[10] = { 7, 7, 3, 10, 2, 5, 1, 1, 9, 4 };
    gpt_ctx g = { m, ids, 2, 5, labels };
    dt_tensor **leaves = (dt_tensor **)malloc(sizeof(dt_tensor *) * m->nparams);
    for (int i = 0; i < m->nparams; i++) leaves[i] = &m->params[i];
    dt_model_zero_grad(m);
    fd_check("gpt", f_gpt, leaves, m->nparams, &g, 2e-3f, 2e-2);
    free(leaves);
    dt_model_free(m);
}

/* A language model of 11 tokens and a context of 6: a later token never
   changes an earlier position's logits, and an earlier one reaches every
   later position. */
static void check_causal(dt_model *m) {
    float ids[6] = { 1, 2, 3, 4, 5, 6 }, before[66], after[66];
    gpt_ctx g = { m, ids, 1, 6, NULL };
    dt_set_grad_enabled(0);
    dt_step_arena_reset();
    dt_tensor_to_host(gpt_logits(&g), before);
    ids[5] = 9;                                                          /* a different last token */
    dt_tensor_to_host(gpt_logits(&g), after);
    CHECK(memcmp(before, after, sizeof(float) * 5 * 11) == 0);           /* positions 0-4: the same bits */
    CHECK(memcmp(before + 55, after + 55, sizeof(float) * 11) != 0);     /* position 5: changed */
    ids[5] = 6; ids[2] = 0;                                              /* an earlier token reaches every later one */
    dt_tensor_to_host(gpt_logits(&g), after);
    CHECK(memcmp(before, after, sizeof(float) * 2 * 11) == 0);
    for (int t = 2; t < 6; t++) CHECKF(memcmp(before + t * 11, after + t * 11, sizeof(float) * 11) != 0, "position %d", t);
    dt_set_grad_enabled(1);
}

/* Names and shapes are GPT-2's (Conv1D weights [in, out], no lm_head: it is
   wte); a later token never changes an earlier position's logits. */
TEST(gpt_is_causal_and_named_like_gpt2, QUICK) {
    dt_model_config c = tiny_gpt();
    dt_model *m = dt_model_create(&c, 3);
    struct { const char *name; int ndim, s[2]; } want[] = {
        { "wte.weight", 2, { 11, 12 } }, { "wpe.weight", 2, { 6, 12 } }, { "ln_f.weight", 1, { 12 } }, { "ln_f.bias", 1, { 12 } },
        { "h.0.ln_1.weight", 1, { 12 } }, { "h.0.attn.c_attn.weight", 2, { 12, 36 } }, { "h.0.attn.c_attn.bias", 1, { 36 } },
        { "h.0.attn.c_proj.weight", 2, { 12, 12 } }, { "h.0.ln_2.bias", 1, { 12 } }, { "h.1.mlp.c_fc.weight", 2, { 12, 48 } },
        { "h.1.mlp.c_fc.bias", 1, { 48 } }, { "h.1.mlp.c_proj.weight", 2, { 48, 12 } }, { "h.1.mlp.c_proj.bias", 1, { 12 } } };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        dt_tensor *p = dt_model_param(m, want[i].name);
        CHECKF(p && p->ndim == want[i].ndim && p->shape[0] == want[i].s[0] && (p->ndim < 2 || p->shape[1] == want[i].s[1]),
               "%s is missing or misshapen", want[i].name);
    }
    CHECK(m->nparams == 4 + 2 * 12 && !dt_model_param(m, "lm_head.weight"));
    CHECK(m->nunits == 3 && m->outer_unit == 0);
    /* per block: 4*12 norms + 12*36+36 + 12*12+12 + 12*48+48 + 48*12+12 = 1,884; wte 132, wpe 72, ln_f 24 */
    CHECKF(m->numel == 2 * 1884 + 132 + 72 + 24, "%lld parameters", (long long)m->numel);
    CHECK(dt_model_flops_per_token(m) == 6.0 * (m->numel - 72) + 12.0 * 2 * 12 * 6);
    check_causal(m);
    dt_model_free(m);
}

/* ---- Llama: its three new ops, then the model ---- */
static dt_tensor *f_rmsnorm(dt_tensor **l, void *c) { (void)c; return dt_rmsnorm(l[0], l[1], 1e-5f); }
static dt_tensor *f_swiglu(dt_tensor **l, void *c) { (void)c; return dt_swiglu(l[0], l[1]); }
/* 2 sequences of 5 tokens; 4 query heads 6 wide in 2 key/value groups */
static dt_tensor *f_rotary(dt_tensor **l, void *c) { (void)c; return dt_rotary_qkv(l[0], l[1], l[2], 2, 5, 4, 2, (dt_rope){ 10000.0f, 0, 0, 0, 0 }); }
static dt_tensor *f_gqa(dt_tensor **l, void *c) {   /* a small base: the angles turn far within 5 positions */
    return dt_attention(dt_rotary_qkv(l[0], l[1], l[2], 2, 5, 4, 2, (dt_rope){ 3.0f, 0, 0, 0, 0 }), 2, 5, 4, *(int *)c);
}
static dt_tensor *f_embed_only(dt_tensor **l, void *c) {
    static const float ids[6] = { 2, 0, 2, 1, 1, 2 };
    int s[2] = { 2, 3 };
    (void)c;
    return dt_token_embedding(dt_tensor_from_host(2, s, ids), l[0], NULL);
}
/* The angle of position t, pair j of a head hd wide, as the definition says (in double). */
static double rope_angle(int t, int j, int hd, double theta) { return t * pow(theta, -2.0 * j / hd); }
/* The frequency of pair j with Llama 3's rescaling, from Hugging Face's
   definition (wavelengths against the original context), in double. */
static double rope_frequency(int j, int hd, const dt_model_config *c) {
    double f = pow(c->rope_theta, -2.0 * j / hd), context = c->rope_original_context;
    if (c->rope_factor > 0) {
        double wavelen = 2 * 3.14159265358979323846 / f;
        if (wavelen > context / c->rope_low_freq) f /= c->rope_factor;                 /* slow: stretched */
        else if (wavelen >= context / c->rope_high_freq) {                           /* between: blended */
            double smooth = (context / wavelen - c->rope_low_freq) / (c->rope_high_freq - c->rope_low_freq);
            f = (1 - smooth) * f / c->rope_factor + smooth * f;
        }
    }
    return f;
}

TEST(llama_ops_match_finite_differences_and_their_definitions, FULL) {
    dt__rng r = { 12 };
    /* RMSNorm, 8 and 40 wide (past its 16 lanes): y = x / sqrt(mean(x^2) + eps) * w */
    for (int width = 8; width <= 40; width += 32) {
        dt_tensor *x = leaf2(4, width, &r, 2), *w = leaf2(1, width, &r, 1), *L[2] = { x, w };
        fd_check(width == 8 ? "rmsnorm" : "rmsnorm, 40 wide", f_rmsnorm, L, 2, NULL, 1e-2f, 3e-3);
        dt_set_grad_enabled(0);
        dt_tensor *y = dt_rmsnorm(x, w, 1e-5f);
        double worst = 0;
        for (int i = 0; i < 4; i++) {
            double ms = 0;
            for (int j = 0; j < width; j++) ms += (double)x->data[i * width + j] * x->data[i * width + j];
            double rms = sqrt(ms / width + 1e-5);
            for (int j = 0; j < width; j++)
                worst = fmax(worst, fabs(y->data[i * width + j] - x->data[i * width + j] / rms * w->data[j]));
        }
        CHECKF(worst < 2e-6, "rmsnorm %d wide: %.3g from the definition", width, worst);
        dt_set_grad_enabled(1);
        leaf_free(x); leaf_free(w);
    }
    /* SwiGLU: silu(g) u, gates out to +-6 (both tails of the sigmoid) */
    dt_tensor *g = leaf2(5, 7, &r, 6), *u = leaf2(5, 7, &r, 1), *L2[2] = { g, u };
    fd_check("swiglu", f_swiglu, L2, 2, NULL, 1e-3f, 2e-3);
    dt_set_grad_enabled(0);
    dt_tensor *s = dt_swiglu(g, u);
    for (int i = 0; i < 35; i++) {
        double gv = g->data[i], want = gv / (1 + exp(-gv)) * u->data[i];
        CHECKF(fabs(s->data[i] - want) <= 1e-6 * (1 + fabs(want)), "swiglu element %d: %.9g, want %.9g", i, s->data[i], want);
    }
    dt_set_grad_enabled(1);
    leaf_free(g); leaf_free(u);
    /* rotary embeddings with grouped-query attention: through the op alone and into the attention */
    dt_tensor *q = leaf2(10, 24, &r, 1), *k = leaf2(10, 12, &r, 1), *v = leaf2(10, 12, &r, 1), *L3[3] = { q, k, v };
    fd_check("rotary qkv", f_rotary, L3, 3, NULL, 1e-2f, 2e-3);
    for (int causal = 0; causal < 2; causal++)
        fd_check(causal ? "causal grouped-query attention" : "grouped-query attention", f_gqa, L3, 3, &causal, 1e-2f, 3e-3);
    /* Hugging Face's rotate-half: pair (j, j + hd/2) of each head turned by
       t * theta^(-2j/hd); query head h reads key/value head h / (H / KV) */
    dt_set_grad_enabled(0);
    dt_tensor *y = dt_rotary_qkv(q, k, v, 2, 5, 4, 2, (dt_rope){ 10000.0f, 0, 0, 0, 0 });
    double worst = 0;
    for (int row = 0; row < 10; row++)
        for (int h = 0; h < 4; h++)
            for (int j = 0; j < 3; j++) {
                double a = rope_angle(row % 5, j, 6, 10000.0), c = cos(a), sn = sin(a);
                const float *qs = q->data + row * 24 + h * 6, *ks = k->data + row * 12 + (h / 2) * 6;
                const float *yq = y->data + row * 72 + h * 6, *yk = yq + 24, *yv = yq + 48;
                worst = fmax(worst, fabs(yq[j] - (qs[j] * c - qs[j + 3] * sn)));
                worst = fmax(worst, fabs(yq[j + 3] - (qs[j + 3] * c + qs[j] * sn)));
                worst = fmax(worst, fabs(yk[j] - (ks[j] * c - ks[j + 3] * sn)));
                worst = fmax(worst, fabs(yk[j + 3] - (ks[j + 3] * c + ks[j] * sn)));
                CHECKF(memcmp(yv, v->data + row * 12 + (h / 2) * 6, sizeof(float) * 6) == 0, "row %d head %d: not v's head %d", row,
                       h, h / 2);
            }
    CHECKF(worst < 2e-6, "rotary: %.3g from the definition", worst);
    /* what rotary embeddings are for: with the same q and k at every position,
       q_t . k_s depends on t - s only */
    for (int row = 0; row < 10; row++) {
        memcpy(q->data + row * 24, q->data, sizeof(float) * 24);
        memcpy(k->data + row * 12, k->data, sizeof(float) * 12);
    }
    y = dt_rotary_qkv(q, k, v, 2, 5, 4, 2, (dt_rope){ 10000.0f, 0, 0, 0, 0 });
    double dots[5][5];
    for (int t = 0; t < 5; t++)
        for (int u2 = 0; u2 < 5; u2++) {
            dots[t][u2] = 0;
            for (int j = 0; j < 6; j++) dots[t][u2] += (double)y->data[t * 72 + j] * y->data[u2 * 72 + 24 + j];
        }
    CHECKF(fabs(dots[3][1] - dots[2][0]) < 1e-5 && fabs(dots[4][1] - dots[3][0]) < 1e-5 && fabs(dots[4][4] - dots[0][0]) < 1e-5,
           "q.k at offsets: %.7f %.7f, %.7f %.7f, %.7f %.7f", dots[3][1], dots[2][0], dots[4][1], dots[3][0], dots[4][4], dots[0][0]);
    CHECK(fabs(dots[3][1] - dots[3][2]) > 1e-4);          /* and does depend on it */
    dt_set_grad_enabled(1);
    leaf_free(q); leaf_free(k); leaf_free(v);
    /* a token embedding with no position table (Llama's) */
    dt_tensor *e = leaf2(3, 4, &r, 1);
    fd_check("token embedding without positions", f_embed_only, &e, 1, NULL, 1e-2f, 1e-3);
    leaf_free(e);
}

/* vocab 11, dim 16, depth 2, 4 query heads of 4 in 2 key/value groups, SwiGLU 24 wide, context 6 */
static dt_model_config tiny_llama(int untied_head, int qkv_bias) {
    dt_model_config c = { DT_MODEL_LLAMA, 0, 0, 11, 16, 2, 4, 0, 24, 6, 2, untied_head, qkv_bias, 10000.0f, 1e-5f, 0, 0, 0, 0, 0, 0, "", 0, 0, 0, 0, 0 };
    return c;
}

/* Llama's forward in double, written from Hugging Face's modeling code, not
   from dtrain's: the mean next-token loss of B sequences of T tokens. */
static const double *llama_ref_param(dt_model *m, const char *name, double *store) {
    dt_tensor *p = dt_model_param(m, name);
    if (!p) return NULL;
    for (int64_t i = 0; i < p->numel; i++) store[i] = p->data[i];
    return store;
}
static void ref_matmul_t(const double *x, const double *w, const double *b, double *y, int n, int in, int out) {
    for (int i = 0; i < n; i++)
        for (int o = 0; o < out; o++) {
            double acc = b ? b[o] : 0;
            for (int j = 0; j < in; j++) acc += x[i * in + j] * w[o * in + j];
            y[i * out + o] = acc;
        }
}
static void ref_rmsnorm(const double *x, const double *w, double *y, int n, int d, double eps) {
    for (int i = 0; i < n; i++) {
        double ms = 0;
        for (int j = 0; j < d; j++) ms += x[i * d + j] * x[i * d + j];
        double inv = 1 / sqrt(ms / d + eps);
        for (int j = 0; j < d; j++) y[i * d + j] = x[i * d + j] * inv * w[j];
    }
}
static double llama_ref_loss(dt_model *m, const float *ids, const int32_t *labels, int B, int T) {
    const dt_model_config *c = &m->cfg;
    int D = c->dim, H = c->heads, KV = c->kv_heads, hd = D / H, F = c->mlp_hidden, V = c->classes, half = hd / 2, N = B * T;
    double *st[16];
    for (int i = 0; i < 16; i++) st[i] = (double *)calloc((size_t)V * D + (size_t)F * D + 64, sizeof(double));
    double *x = (double *)calloc((size_t)N * D, sizeof(double)), *h = (double *)calloc((size_t)N * D, sizeof(double));
    double *q = (double *)calloc((size_t)N * D, sizeof(double)), *k = (double *)calloc((size_t)N * D, sizeof(double));
    double *v = (double *)calloc((size_t)N * D, sizeof(double)), *att = (double *)calloc((size_t)N * D, sizeof(double));
    double *o = (double *)calloc((size_t)N * D, sizeof(double)), *ga = (double *)calloc((size_t)N * F, sizeof(double));
    double *up = (double *)calloc((size_t)N * F, sizeof(double)), *logits = (double *)calloc((size_t)N * V, sizeof(double));
    char name[128];
    const double *emb = llama_ref_param(m, "model.embed_tokens.weight", st[0]);
    for (int i = 0; i < N; i++) memcpy(x + i * D, emb + (int)ids[i] * D, sizeof(double) * D);
    for (int l = 0; l < c->depth; l++) {
#define P(slot, fmt) (snprintf(name, sizeof name, "model.layers.%d." fmt, l), llama_ref_param(m, name, st[slot]))
        ref_rmsnorm(x, P(1, "input_layernorm.weight"), h, N, D, c->norm_eps);
        ref_matmul_t(h, P(2, "self_attn.q_proj.weight"), P(3, "self_attn.q_proj.bias"), q, N, D, H * hd);
        ref_matmul_t(h, P(4, "self_attn.k_proj.weight"), P(5, "self_attn.k_proj.bias"), k, N, D, KV * hd);
        ref_matmul_t(h, P(6, "self_attn.v_proj.weight"), P(7, "self_attn.v_proj.bias"), v, N, D, KV * hd);
        for (int i = 0; i < N; i++) {                              /* rotate q and k: x cos + rotate_half(x) sin */
            for (int hh = 0; hh < H + KV; hh++) {
                double *z = hh < H ? q + i * H * hd + hh * hd : k + i * KV * hd + (hh - H) * hd;
                for (int j = 0; j < half; j++) {
                    double a = (i % T) * rope_frequency(j, hd, c), x1 = z[j], x2 = z[j + half];
                    z[j] = x1 * cos(a) - x2 * sin(a);
                    z[j + half] = x2 * cos(a) + x1 * sin(a);
                }
            }
        }
        for (int b = 0; b < B; b++)                                  /* causal attention, head hh on kv head hh / (H/KV) */
            for (int hh = 0; hh < H; hh++)
                for (int t = 0; t < T; t++) {
                    double sc[64], mx = -1e300, sum = 0;
                    const double *qr = q + ((size_t)(b * T + t) * H + hh) * hd;
                    for (int u = 0; u <= t; u++) {
                        const double *kr = k + ((size_t)(b * T + u) * KV + hh / (H / KV)) * hd;
                        sc[u] = 0;
                        for (int j = 0; j < hd; j++) sc[u] += qr[j] * kr[j];
                        sc[u] /= sqrt((double)hd);
                        mx = fmax(mx, sc[u]);
                    }
                    for (int u = 0; u <= t; u++) sum += (sc[u] = exp(sc[u] - mx));
                    double *ar = att + ((size_t)(b * T + t) * H + hh) * hd;
                    for (int j = 0; j < hd; j++) {
                        ar[j] = 0;
                        for (int u = 0; u <= t; u++) ar[j] += sc[u] / sum * v[((size_t)(b * T + u) * KV + hh / (H / KV)) * hd + j];
                    }
                }
        ref_matmul_t(att, P(8, "self_attn.o_proj.weight"), NULL, o, N, H * hd, D);
        for (int i = 0; i < N * D; i++) x[i] += o[i];
        ref_rmsnorm(x, P(9, "post_attention_layernorm.weight"), h, N, D, c->norm_eps);
        ref_matmul_t(h, P(10, "mlp.gate_proj.weight"), NULL, ga, N, D, F);
        ref_matmul_t(h, P(11, "mlp.up_proj.weight"), NULL, up, N, D, F);
        for (int i = 0; i < N * F; i++) ga[i] = ga[i] / (1 + exp(-ga[i])) * up[i];
        ref_matmul_t(ga, P(12, "mlp.down_proj.weight"), NULL, o, N, F, D);
        for (int i = 0; i < N * D; i++) x[i] += o[i];
#undef P
    }
    ref_rmsnorm(x, llama_ref_param(m, "model.norm.weight", st[13]), h, N, D, c->norm_eps);
    const double *head = llama_ref_param(m, "lm_head.weight", st[14]);
    ref_matmul_t(h, head ? head : emb, NULL, logits, N, D, V);
    double loss = 0;
    for (int i = 0; i < N; i++) {
        double mx = -1e300, sum = 0;
        for (int j = 0; j < V; j++) mx = fmax(mx, logits[i * V + j]);
        for (int j = 0; j < V; j++) sum += exp(logits[i * V + j] - mx);
        loss += mx + log(sum) - logits[i * V + labels[i]];
    }
    for (int i = 0; i < 16; i++) free(st[i]);
    free(x); free(h); free(q); free(k); free(v); free(att); free(o); free(ga); free(up); free(logits);
    return loss / N;
}

TEST(llama_gradients_and_loss_match_finite_differences_and_a_double_forward, FULL) {
    float ids[10] = { 1, 7, 7, 3, 10, 0, 5, 1, 1, 9 };                  /* 2 sequences of 5 (shorter than the context) */
    int32_t labels[10] = { 7, 7, 3, 10, 2, 5, 1, 1, 9, 4 };
    for (int variant = 0; variant < 2; variant++) {                      /* tied head; then a head of its own and Qwen2's biases */
        dt_model_config c = tiny_llama(variant, variant);
        dt_model *m = dt_model_create(&c, 9);
        for (int64_t i = 0; i < m->numel; i++) m->flat_data[i] *= 3;     /* larger weights: every path matters */
        dt__rng r = { 5 };
        for (int i = 0; i < m->nparams; i++)                             /* norms and biases away from 1 and 0 */
            if (m->params[i].ndim == 1)
                for (int64_t j = 0; j < m->params[i].numel; j++) m->params[i].data[j] += (float)(0.5 * rnd(&r));
        gpt_ctx g = { m, ids, 2, 5, labels };
        dt_set_grad_enabled(0);
        dt_step_arena_reset();
        float loss;
        dt_tensor_to_host(f_gpt(NULL, &g), &loss);
        double want = llama_ref_loss(m, ids, labels, 2, 5);
        CHECKF(fabs(loss - want) < 2e-6, "llama %s: first loss %.9f, the double forward %.9f", variant ? "untied, biases" : "tied",
               (double)loss, want);
        dt_set_grad_enabled(1);
        dt_tensor **leaves = (dt_tensor **)malloc(sizeof(dt_tensor *) * m->nparams);
        for (int i = 0; i < m->nparams; i++) leaves[i] = &m->params[i];
        dt_model_zero_grad(m);
        fd_check(variant ? "llama, untied head, q/k/v biases" : "llama", f_gpt, leaves, m->nparams, &g, 2e-3f, 2e-2);
        free(leaves);
        dt_model_free(m);
    }
}

/* Names and shapes are Hugging Face's LlamaForCausalLM (Qwen2ForCausalLM
   with biases); a later token never changes an earlier position's logits. */
TEST(llama_is_causal_and_named_like_hugging_face, QUICK) {
    for (int variant = 0; variant < 2; variant++) {
        dt_model_config c = tiny_llama(variant, variant);
        dt_model *m = dt_model_create(&c, 3);
        struct { const char *name; int ndim, s[2]; } want[] = {
            { "model.embed_tokens.weight", 2, { 11, 16 } }, { "model.norm.weight", 1, { 16 } },
            { "model.layers.0.input_layernorm.weight", 1, { 16 } }, { "model.layers.0.self_attn.q_proj.weight", 2, { 16, 16 } },
            { "model.layers.0.self_attn.k_proj.weight", 2, { 8, 16 } }, { "model.layers.1.self_attn.v_proj.weight", 2, { 8, 16 } },
            { "model.layers.1.self_attn.o_proj.weight", 2, { 16, 16 } },
            { "model.layers.1.post_attention_layernorm.weight", 1, { 16 } },
            { "model.layers.0.mlp.gate_proj.weight", 2, { 24, 16 } }, { "model.layers.0.mlp.up_proj.weight", 2, { 24, 16 } },
            { "model.layers.1.mlp.down_proj.weight", 2, { 16, 24 } } };
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            dt_tensor *p = dt_model_param(m, want[i].name);
            CHECKF(p && p->ndim == want[i].ndim && p->shape[0] == want[i].s[0] && (p->ndim < 2 || p->shape[1] == want[i].s[1]),
                   "%s is missing or misshapen", want[i].name);
        }
        dt_tensor *head = dt_model_param(m, "lm_head.weight"), *qb = dt_model_param(m, "model.layers.1.self_attn.k_proj.bias");
        CHECKF(variant ? head && head->shape[0] == 11 && head->shape[1] == 16 && qb && qb->numel == 8 : !head && !qb,
               "variant %d: lm_head %s, k_proj.bias %s", variant, head ? "present" : "absent", qb ? "present" : "absent");
        CHECK(!dt_model_param(m, "model.layers.0.self_attn.o_proj.bias") && !dt_model_param(m, "model.layers.0.mlp.up_proj.bias"));
        /* per layer: norms 2*16, q 256, k 128, v 128, o 256, gate, up, down 384 each = 1,952 (+ 16 + 8 + 8 biases) */
        int64_t layers = 2 * (1952 + variant * 32), want_numel = layers + 176 + 16 + variant * 176;
        CHECKF(m->numel == want_numel, "variant %d: %lld parameters, want %lld", variant, (long long)m->numel, (long long)want_numel);
        CHECK(variant ? m->nunits == 4 && m->outer_unit == -1 : m->nunits == 3 && m->outer_unit == 0);
        CHECK(dt_model_flops_per_token(m) == 6.0 * (m->numel - variant * 176) + 12.0 * 2 * 16 * 6);
        check_causal(m);
        char line[256];
        dt_model_describe(m, line, sizeof line);
        CHECKF(strstr(line, "llama dim=16 depth=2 heads=4 kv-heads=2 ffn=24 context=6 vocab=11") &&
               !strstr(line, "untied") == !variant, "described as: %s", line);
        dt_model_free(m);
    }
}
