//@ lesson: mixture of experts -- a router sends each token to k of E expert MLPs; capacity and dropped tokens; the balancing loss; dispatch and combine as ops on the tape
/* ---- mixture of experts ---------------------------------------------------------
   A mixture-of-experts (MoE) layer stands where a block's MLP stood: E MLPs,
   the experts, and a router, a linear layer that gives each token a score per
   expert. Each token goes to the k experts its softmax ranks highest, and
   leaves as their outputs weighted by those k probabilities renormalised to
   sum to 1 (Mixtral's rule: with k = 1 the weight is 1 and only the balancing
   loss below moves the router). A token costs k MLPs while the model holds
   E: parameters grow without the work per token growing -- conditional
   computation (Shazeer et al., 2017; GShard, 2020; Switch Transformer, 2021).

   Two more things make it train:
   - Balance. A router left alone favours a few experts, which then learn
     faster and are favoured more. The balancing loss (Switch Transformer's,
     as Hugging Face's Mixtral computes it) adds, per layer,
         E x sum over e of f_e x P_e,
     f_e the share of the tokens whose k choices hold e and P_e the mean
     probability of e: k when both are even, more when not. The model adds
     coefficient x its mean over the MoE layers to the loss (--moe-aux-loss;
     transformers takes f and P over every layer's tokens at once instead,
     the same with one MoE layer).
     f_e is a count and has no gradient; P_e's reaches the router. The term
     is added in backward only (the gate weights' op puts its gradient on
     the router's logits), so no training loop changes for it.
   - Capacity. Each expert takes at most ceil(c x k x N / E) of a batch's N
     tokens' choices (--moe-capacity c; 0, the default: all of them). The
     choices over it are dropped, lowest router probability first, ties by
     the token's place in the batch: a dropped choice adds nothing, and a
     token all of whose choices drop leaves the layer as zeros (the residual
     carries it on). Fixed sizes are what expert parallelism's buffers want
     (stage 09); the cost is the dropped tokens, which the log counts.

   The layer is ops on the tape, each simple: the router (dt_linear); the
   route, decided on the host from its logits (which token goes where: no
   gradient); the gate weights (logits -> each kept choice's weight); the
   dispatch (the tokens' rows copied into expert order, a token once per
   kept choice); each expert on its run of those rows; and the combine
   (each token's rows, weighted, summed back into place). Expert
   parallelism (stage 09) adds an all-to-all on either side of the experts
   and changes nothing else. */

/* A route: what the router decided for a batch's N tokens, in host memory
   (the step arena). The kept (token, choice) pairs are the slots, numbered
   in expert order and, within an expert, in token order. */
typedef struct dt_moe_plan {
    int N, E, k;
    int N_all;                    /* the whole batch's tokens (N, or every data-parallel rank's) */
    int S;                        /* slots kept */
    int capacity;                 /* slots an expert may hold; 0: no limit */
    float *probs;                 /* [N, E]: the softmax of each token's scores */
    int *choice;                  /* [N, k]: each token's experts, most probable first (ties: lower index) */
    int *slot_of_choice;          /* [N, k]: the slot each choice went to, -1 when dropped */
    int *expert_first;            /* [E + 1]: expert e holds slots expert_first[e] .. expert_first[e + 1] - 1 */
    int *slot_token;              /* [S]: the token in each slot */
    int *slot_pick;               /* [S]: which of that token's k choices it is */
    int *routed;                  /* [E]: the choices each expert was given in the whole batch, before any dropped */
    int dropped;                  /* this rank's choices over capacity */
    float balance;                /* this layer's E x sum f_e P_e (above), over the whole batch */
    const int *slot_token_dev, *slot_of_choice_dev;   /* the same two, where the rows are (a GPU's copies) */
} dt_moe_plan;

/* What the MoE layers of a model saw since the last read (the run driver
   reads it for the log): the choices each expert was given, those dropped,
   and the layers' balancing terms. Evaluation and --recompute's second
   forward add nothing. */
typedef struct dt_moe_stats {
    int experts;
    int64_t *routed;              /* [experts] */
    int64_t choices, dropped;
    double balance_sum;
    int64_t layers;               /* forwards of an MoE layer counted */
} dt_moe_stats;

/* The route of logits [N, E] (the router's scores; rows_per_sample rows a
   sample) with k choices a token and capacity factor `capacity` (0: no
   limit). Adds to stats (may be NULL). batch: the data-parallel wrapper whose
   ranks' batches make the step's batch (its data_all_gather), or NULL:
   capacity and balance are then taken over the whole batch, as one device
   with all of it takes them. */
dt_moe_plan *dt_moe_route(const dt_tensor *logits, int k, float capacity, int rows_per_sample, dt_moe_stats *stats,
                          dt_parallel *batch);
/* Each slot's weight [S]: its token's chosen probabilities renormalised over
   its k choices. Backward passes their gradient to the logits and adds the
   balancing term's, `balance_coef` x d(balance)/d(logits), scaled as the loss. */
dt_tensor *dt_moe_gate_weights(dt_tensor *logits, const dt_moe_plan *plan, float balance_coef);
/* x [N, D] -> [S, D]: slot s holds its token's row (the dispatch). */
dt_tensor *dt_moe_dispatch(dt_tensor *x, const dt_moe_plan *plan);
/* ys [S, D], weights [S] -> [N, D]: each token's slots' rows, weighted, summed
   in its choices' order (the combine). */
dt_tensor *dt_moe_combine(dt_tensor *ys, dt_tensor *weights, const dt_moe_plan *plan);
/* Rows first .. first + count - 1 of x [N, D], a copy; and rows of several
   tensors one after another: an expert's run of slots, and the runs again. */
dt_tensor *dt_rows(dt_tensor *x, int first, int count);
dt_tensor *dt_cat_rows(dt_tensor *const *parts, int n);
/* The whole layer: router [E, D] (no bias), and `expert`, which runs
   expert e's MLP on its rows (ctx: the model's). */
typedef dt_tensor *(*dt_moe_expert_fn)(void *ctx, int expert, dt_tensor *rows);
typedef struct dt_moe_layer {
    dt_tensor *router;
    int k, rows_per_sample;
    float capacity, balance_coef;
    dt_moe_expert_fn expert;
    void *ctx;
    dt_moe_stats *stats;
    /* The model's wrappers (a stack), or NULL: the data-parallel one gives the
       whole batch (dt_moe_route's `batch`; asked only when capacity or the
       balancing loss needs it), one that spreads the experts over ranks runs
       them (its moe_experts: expert parallelism). */
    dt_parallel *wrappers;
} dt_moe_layer;
dt_tensor *dt_moe_forward(const dt_moe_layer *layer, dt_tensor *x);

//@ implementation
/* -- the route: softmax, top k, capacity. The host decides: N x E numbers,
      and what is decided is indices, which nothing differentiates. -- */
static float *dt__host_f32(const dt_tensor *t) {
    float *h = (float *)dt_step_alloc(sizeof(float) * (size_t)t->numel);
    dt_download(h, dt__in(t), sizeof(float) * (size_t)t->numel);
    return h;
}
/* Drop order: the lower probability first, then the later token. */
typedef struct { float p; int place, token, j; } dt__moe_candidate;
static int dt__moe_keep_first(const void *a, const void *b) {
    const dt__moe_candidate *x = (const dt__moe_candidate *)a, *y = (const dt__moe_candidate *)b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->place - y->place;
}
static const int *dt__ints_on_device(const int *host, int n) {
    if (dt__ctx.device == DT_CPU) return host;
    int *d = (int *)dt__step_data(sizeof(int) * (size_t)(n > 0 ? n : 1));
    dt_upload(d, host, sizeof(int) * (size_t)n);
    return d;
}

dt_moe_plan *dt_moe_route(const dt_tensor *logits, int k, float capacity, int rows_per_sample, dt_moe_stats *stats,
                          dt_parallel *batch) {
    int N = (int)dt_tensor_rows(logits), E = (int)dt_tensor_cols(logits);
    if (k < 1 || k > E) dt_fail("dt_moe_route: --moe-top-k %d must be between 1 and the %d experts", k, E);
    if (!(capacity >= 0)) dt_fail("dt_moe_route: --moe-capacity %g must be 0 (no limit) or more", (double)capacity);
    dt__scratch_reset();
    dt_moe_plan *p = (dt_moe_plan *)dt_step_alloc(sizeof *p);
    p->N = N; p->E = E; p->k = k;
    p->probs = dt__host_f32(logits);
    for (int n = 0; n < N; n++) {                          /* softmax, in place */
        float *row = p->probs + (size_t)n * E, m = row[0], sum = 0;
        for (int e = 1; e < E; e++) m = row[e] > m ? row[e] : m;
        for (int e = 0; e < E; e++) sum += row[e] = dt_exp_value(row[e] - m);
        for (int e = 0; e < E; e++) row[e] /= sum;
    }
    /* The whole batch's probabilities: this rank's, or every rank's of a
       data-parallel engine, rank after rank. Every rank then decides for the
       whole batch alike, and keeps its own. */
    const float *all = p->probs;
    int first = 0, rank = 0, ranks = 1;
    if (batch && batch->data_all_gather) batch->data_all_gather(batch, NULL, NULL, 0, &rank, &ranks);
    if (ranks > 1) {
        float *gathered = (float *)dt_step_alloc(sizeof(float) * (size_t)N * E * (size_t)ranks);
        batch->data_all_gather(batch, p->probs, gathered, (int64_t)N * E, &rank, &ranks);
        all = gathered;
        first = rank * N;
    }
    int NA = N * ranks, T = rows_per_sample > 0 && N % rows_per_sample == 0 ? rows_per_sample : N;
    p->N_all = NA;
    /* Each token's place in stage 01's batch, which breaks the capacity's
       ties: the loader deals a step's samples to the ranks in turn, so rank
       r's sample j is the batch's sample j x ranks + r. */
    int *place = (int *)dt_step_alloc(sizeof(int) * (size_t)NA);
    for (int g = 0; g < NA; g++) {
        int r = g / N, n = g % N;
        place[g] = ((n / T) * ranks + r) * T + n % T;
    }
    size_t nk = (size_t)NA * k;
    int *choice = (int *)dt_step_alloc(sizeof(int) * nk), *kept = (int *)dt_step_alloc(sizeof(int) * nk);
    p->routed = (int *)dt_step_alloc(sizeof(int) * (size_t)E);
    for (int n = 0; n < NA; n++) {                         /* top k: k passes, each the best not taken */
        const float *row = all + (size_t)n * E;
        int *c = choice + (size_t)n * k;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= c[i] == e;
                if (!taken && (best < 0 || row[e] > row[best])) best = e;
            }
            c[j] = best;
            p->routed[best]++;
        }
    }
    /* capacity: over it, an expert keeps its most probable choices */
    double cap = ceil((double)capacity * k * NA / E);    /* as large as every choice: no limit */
    p->capacity = capacity > 0 && cap < (double)nk ? (int)cap : 0;
    dt__moe_candidate *cand = (dt__moe_candidate *)dt_step_alloc(sizeof *cand * (nk ? nk : 1));
    int dropped_here = 0;
    for (int e = 0; e < E; e++) {
        int n_cand = 0;
        for (int n = 0; n < NA; n++)
            for (int j = 0; j < k; j++)
                if (choice[(size_t)n * k + j] == e) cand[n_cand++] = (dt__moe_candidate){ all[(size_t)n * E + e], place[n], n, j };
        if (p->capacity && n_cand > p->capacity) {
            qsort(cand, (size_t)n_cand, sizeof *cand, dt__moe_keep_first);
            for (int i = p->capacity; i < n_cand; i++) dropped_here += cand[i].token >= first && cand[i].token < first + N;
            n_cand = p->capacity;
        }
        for (int i = 0; i < n_cand; i++) kept[(size_t)cand[i].token * k + cand[i].j] = 1;
    }
    p->dropped = dropped_here;
    double balance = 0;                                    /* E x sum f_e P_e, over the whole batch */
    for (int e = 0; e < E; e++) {
        double P = 0;
        for (int n = 0; n < NA; n++) P += all[(size_t)n * E + e];
        balance += ((double)p->routed[e] / NA) * (P / NA);
    }
    p->balance = (float)(E * balance);
    /* this rank's tokens: their choices, and their kept ones numbered by expert, then token */
    p->choice = choice + (size_t)first * k;
    p->slot_of_choice = (int *)dt_step_alloc(sizeof(int) * (size_t)N * k);
    p->expert_first = (int *)dt_step_alloc(sizeof(int) * (size_t)(E + 1));
    p->slot_token = (int *)dt_step_alloc(sizeof(int) * ((size_t)N * k + 1));
    p->slot_pick = (int *)dt_step_alloc(sizeof(int) * ((size_t)N * k + 1));
    for (size_t i = 0; i < (size_t)N * k; i++) p->slot_of_choice[i] = -1;
    for (int e = 0; e < E; e++) {
        p->expert_first[e] = p->S;
        for (int n = 0; n < N; n++)
            for (int j = 0; j < k; j++) {
                size_t i = (size_t)n * k + j;
                if (p->choice[i] != e || !kept[(size_t)first * k + i]) continue;
                p->slot_of_choice[i] = p->S;
                p->slot_token[p->S] = n;
                p->slot_pick[p->S++] = j;
            }
    }
    p->expert_first[E] = p->S;
    p->slot_token_dev = dt__ints_on_device(p->slot_token, p->S);
    p->slot_of_choice_dev = dt__ints_on_device(p->slot_of_choice, N * k);
    if (stats && dt__ctx.grad_enabled && !dt__ctx.recomputing) {
        if (stats->experts != E) dt_fail("dt_moe_route: stats kept for %d experts, the router has %d", stats->experts, E);
        for (size_t i = 0; i < (size_t)N * k; i++) stats->routed[p->choice[i]]++;    /* this rank's tokens' */
        stats->choices += (int64_t)N * k;
        stats->dropped += p->dropped;
        stats->balance_sum += p->balance;
        stats->layers++;
    }
    return p;
}

/* -- the gate weights. w_j = p_j / Z over a token's k choices, Z = their sum;
      dL/dp_i = (g_i - sum_j g_j w_j) / Z for a chosen i (g: the weights'
      gradients, 0 for a dropped choice), and the balancing term adds
      coef x E x f_e / N to every dL/dp_e; then softmax's backward,
      dL/dx_i = p_i (dL/dp_i - sum_e p_e dL/dp_e). On the host, as the route. -- */
static void dt__moe_gate_backward(dt__tape_entry *e) {
    dt_tensor *logits = e->in[0], *w = e->out;
    const dt_moe_plan *p = (const dt_moe_plan *)e->saved;
    float coef = e->farg[0] * dt__ctx.loss_seed;
    int N = p->N, E = p->E, k = p->k;
    if (!logits->requires_grad) return;
    float *g = (float *)dt_step_alloc(sizeof(float) * (size_t)(p->S > 0 ? p->S : 1));
    if (p->S) dt_download(g, dt__grad_in(w), sizeof(float) * (size_t)p->S);
    float *dx = (float *)dt_step_alloc(sizeof(float) * (size_t)N * E), *dp = (float *)dt_step_alloc(sizeof(float) * (size_t)E);
    for (int n = 0; n < N; n++) {
        const float *prob = p->probs + (size_t)n * E;
        const int *c = p->choice + (size_t)n * k, *slot = p->slot_of_choice + (size_t)n * k;
        float Z = 0, gw = 0, pdp = 0;
        for (int j = 0; j < k; j++) Z += prob[c[j]];
        for (int j = 0; j < k; j++) gw += (slot[j] >= 0 ? g[slot[j]] : 0.0f) * (prob[c[j]] / Z);
        for (int i = 0; i < E; i++) dp[i] = coef * E * ((float)p->routed[i] / p->N_all) / N;   /* the engine averages: / N, not N_all */
        for (int j = 0; j < k; j++) dp[c[j]] += ((slot[j] >= 0 ? g[slot[j]] : 0.0f) - gw) / Z;
        for (int i = 0; i < E; i++) pdp += prob[i] * dp[i];
        for (int i = 0; i < E; i++) dx[(size_t)n * E + i] = prob[i] * (dp[i] - pdp);
    }
    float *dev = (float *)dt__scratch_on(logits->device, sizeof(float) * (size_t)N * E);
    dt_upload(dev, dx, sizeof(float) * (size_t)N * E);
    dt__add_into_grad(logits, dev);
}
dt_tensor *dt_moe_gate_weights(dt_tensor *logits, const dt_moe_plan *plan, float balance_coef) {
    dt__backend_for(logits);
    dt__scratch_reset();
    int k = plan->k, S = plan->S;
    dt_tensor *w = dt__tensor_out(1, &S);
    float *h = (float *)dt_step_alloc(sizeof(float) * (size_t)(S > 0 ? S : 1));
    for (int s = 0; s < S; s++) {
        int n = plan->slot_token[s];
        const float *prob = plan->probs + (size_t)n * plan->E;
        const int *c = plan->choice + (size_t)n * k;
        float Z = 0;
        for (int j = 0; j < k; j++) Z += prob[c[j]];
        h[s] = prob[c[plan->slot_pick[s]]] / Z;
    }
    float *wv = dt__out(w);
    if (S) dt_upload(wv, h, sizeof(float) * (size_t)S);
    dt__out_done(w, wv);
    if (dt__wants_grad(logits, NULL, NULL)) {
        dt__tape_entry *e = dt__tape_push(dt__moe_gate_backward, w, logits, NULL, NULL);
        e->saved = (void *)plan;
        e->farg[0] = balance_coef;
    }
    return w;
}

/* -- dispatch and combine: rows between tokens and slots. A token's rows are
      summed over its choices in their order, on either device the same
      (dt_moe_token_sum), so every run gives the same bits. -- */
static void dt__moe_to_slots(const dt_tensor *like, const float *src, const float *w, const int *slot_token, float *dst, int S,
                             int D, int add) {
    const dt_backend *gpu = dt__backend_of(like->device);
    if (gpu) { gpu->moe_to_slots(src, w, slot_token, dst, S, D, add); return; }
    for (int s = 0; s < S; s++)
        for (int d = 0; d < D; d++) {
            float v = (w ? w[s] : 1.0f) * src[(size_t)slot_token[s] * D + d];
            dst[(size_t)s * D + d] = add ? dst[(size_t)s * D + d] + v : v;
        }
}
static void dt__moe_to_tokens(const dt_tensor *like, const float *src, const float *w, const int *slot_of_choice, float *dst,
                              int N, int k, int D, int add) {
    const dt_backend *gpu = dt__backend_of(like->device);
    if (gpu) { gpu->moe_to_tokens(src, w, slot_of_choice, dst, N, k, D, add); return; }
    for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++) {
            float v = dt_moe_token_sum(src, w, slot_of_choice + (size_t)n * k, k, D, d);
            dst[(size_t)n * D + d] = add ? dst[(size_t)n * D + d] + v : v;
        }
}

static void dt__moe_dispatch_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *xs = e->out;
    const dt_moe_plan *p = (const dt_moe_plan *)e->saved;
    if (!x->requires_grad) return;
    float *dx = dt__grad_acc(x);
    dt__moe_to_tokens(x, dt__grad_in(xs), NULL, p->slot_of_choice_dev, dx, p->N, p->k, (int)dt_tensor_cols(x), 1);
    dt__grad_acc_done(x, dx);
}
dt_tensor *dt_moe_dispatch(dt_tensor *x, const dt_moe_plan *plan) {
    int D = (int)dt_tensor_cols(x);
    if (dt_tensor_rows(x) != plan->N) dt_fail("dt_moe_dispatch: %lld rows, the route has %d tokens", (long long)dt_tensor_rows(x), plan->N);
    dt__backend_for(x);
    dt__scratch_reset();
    dt_tensor *xs = dt__tensor_out_2d(plan->S, D);
    float *v = dt__out(xs);
    dt__moe_to_slots(x, dt__in(x), NULL, plan->slot_token_dev, v, plan->S, D, 0);
    dt__out_done(xs, v);
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__moe_dispatch_backward, xs, x, NULL, NULL)->saved = (void *)plan;
    return xs;
}

/* y_n = sum_j w_s ys_s (s: its j-th choice's slot); dys_s = w_s dy_n,
   dw_s = dy_n . ys_s */
static void dt__moe_combine_backward(dt__tape_entry *e) {
    dt_tensor *ys = e->in[0], *w = e->in[1], *y = e->out;
    const dt_moe_plan *p = (const dt_moe_plan *)e->saved;
    int S = p->S, D = (int)dt_tensor_cols(y);
    const float *dy = dt__grad_in(y), *wv = dt__in(w), *yv = dt__in(ys);
    if (ys->requires_grad) {
        float *dys = dt__grad_acc(ys);
        dt__moe_to_slots(ys, dy, wv, p->slot_token_dev, dys, S, D, 1);
        dt__grad_acc_done(ys, dys);
    }
    if (w->requires_grad) {
        float *dw = dt__grad_acc(w);
        const dt_backend *gpu = dt__backend_of(y->device);
        if (gpu) gpu->moe_slot_dots(dy, yv, p->slot_token_dev, dw, S, D);
        else
            for (int s = 0; s < S; s++) dw[s] += dt_moe_row_dot(dy + (size_t)p->slot_token[s] * D, yv + (size_t)s * D, D);
        dt__grad_acc_done(w, dw);
    }
}
dt_tensor *dt_moe_combine(dt_tensor *ys, dt_tensor *weights, const dt_moe_plan *plan) {
    int D = (int)dt_tensor_cols(ys);
    if (dt_tensor_rows(ys) != plan->S || weights->numel != plan->S)
        dt_fail("dt_moe_combine: %lld rows and %lld weights for the route's %d slots", (long long)dt_tensor_rows(ys),
                (long long)weights->numel, plan->S);
    dt__backend_for(ys);
    dt__scratch_reset();
    dt_tensor *y = dt__tensor_out_2d(plan->N, D);
    float *v = dt__out(y);
    dt__moe_to_tokens(ys, dt__in(ys), dt__in(weights), plan->slot_of_choice_dev, v, plan->N, plan->k, D, 0);
    dt__out_done(y, v);
    if (dt__wants_grad(ys, weights, NULL)) dt__tape_push(dt__moe_combine_backward, y, ys, weights, NULL)->saved = (void *)plan;
    return y;
}

/* -- rows: copies of runs of rows, and their gradients added back -- */
static void dt__add_rows(const dt_tensor *like, float *dst, const float *src, int64_t rows, int D) {
    const dt_backend *gpu = dt__backend_of(like->device);
    if (gpu) { gpu->copy_columns(dst, D, src, D, rows, D, 1); return; }
    for (int64_t i = 0; i < rows * D; i++) dst[i] += src[i];
}
static void dt__rows_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *y = e->out;
    if (!x->requires_grad) return;
    int D = (int)dt_tensor_cols(x);
    float *dx = dt__grad_acc(x);
    dt__add_rows(x, dx + (size_t)e->iarg[0] * D, dt__grad_in(y), dt_tensor_rows(y), D);
    dt__grad_acc_done(x, dx);
}
dt_tensor *dt_rows(dt_tensor *x, int first, int count) {
    int D = (int)dt_tensor_cols(x), shape[2] = { count, D };
    if (first < 0 || count < 0 || first + (int64_t)count > dt_tensor_rows(x))
        dt_fail("dt_rows: rows %d .. %d of %lld", first, first + count - 1, (long long)dt_tensor_rows(x));
    dt__backend_for(x);
    dt_tensor *y = dt__tensor_alloc(2, shape, x->dtype);
    size_t z = dt_dtype_size(x->dtype);
    dt__lazy_make(x);                    /* logits that waited: whole now */
    if (count) dt_convert((const char *)x->data + (size_t)first * D * z, x->dtype, y->data, x->dtype, (int64_t)count * D);
    if (dt__wants_grad(x, NULL, NULL)) dt__tape_push(dt__rows_backward, y, x, NULL, NULL)->iarg[0] = first;
    return y;
}
static void dt__cat_rows_backward(dt__tape_entry *e) {
    dt_tensor *const *parts = (dt_tensor *const *)e->saved, *y = e->out;
    int D = (int)dt_tensor_cols(y);
    const float *dy = dt__grad_in(y);
    for (int i = 0; i < e->iarg[0]; dy += (size_t)parts[i]->numel, i++) {
        if (!parts[i]->requires_grad) continue;
        float *dx = dt__grad_acc(parts[i]);
        dt__add_rows(y, dx, dy, dt_tensor_rows(parts[i]), D);
        dt__grad_acc_done(parts[i], dx);
    }
}
dt_tensor *dt_cat_rows(dt_tensor *const *parts, int n) {
    if (n < 1) dt_fail("dt_cat_rows: no tensors to join");
    int D = (int)dt_tensor_cols(parts[0]), rows = 0, grad = 0;
    for (int i = 0; i < n; i++) {
        if (dt_tensor_cols(parts[i]) != D || parts[i]->dtype != parts[0]->dtype)
            dt_fail("dt_cat_rows: part %d is [%lld, %lld], part 0 has %d columns (the same dtype too)", i,
                    (long long)dt_tensor_rows(parts[i]), (long long)dt_tensor_cols(parts[i]), D);
        rows += (int)dt_tensor_rows(parts[i]);
        grad |= dt__wants_grad(parts[i], NULL, NULL);
        dt__backend_for(parts[i]);
    }
    int shape[2] = { rows, D };
    dt_tensor *y = dt__tensor_alloc(2, shape, parts[0]->dtype);
    size_t z = dt_dtype_size(y->dtype), at = 0;
    for (int i = 0; i < n; at += (size_t)parts[i]->numel * z, i++) {
        dt__lazy_make(parts[i]);         /* logits that waited: whole now */
        if (parts[i]->numel) dt_convert(parts[i]->data, y->dtype, (char *)y->data + at, y->dtype, parts[i]->numel);
    }
    if (grad) {
        dt_tensor **keep = (dt_tensor **)dt_step_alloc(sizeof *keep * (size_t)n);
        memcpy(keep, parts, sizeof *keep * (size_t)n);
        dt__tape_entry *e = dt__tape_push(dt__cat_rows_backward, y, NULL, NULL, NULL);
        e->saved = keep;
        e->iarg[0] = n;
    }
    return y;
}

/* -- the layer: route, weigh, dispatch, each expert on its rows, combine. An
      expert given no token is not run (nor its parameters' gradients touched). -- */
dt_tensor *dt_moe_forward(const dt_moe_layer *L, dt_tensor *x) {
    int E = (int)dt_tensor_rows(L->router);
    dt_tensor *logits = dt_linear(x, L->router, NULL);
    int whole = L->capacity > 0 || L->balance_coef > 0;     /* per token otherwise: no collective */
    dt_moe_plan *plan = dt_moe_route(logits, L->k, L->capacity, L->rows_per_sample, L->stats, whole ? L->wrappers : NULL);
    dt_tensor *w = dt_moe_gate_weights(logits, plan, L->balance_coef);
    dt_tensor *xs = dt_moe_dispatch(x, plan);
    dt_parallel *spread = L->wrappers;                     /* expert parallelism: the experts on other ranks too */
    while (spread && !spread->moe_experts) spread = spread->inner;
    if (spread) return dt_moe_combine(spread->moe_experts(spread, L, xs, plan), w, plan);
    dt_tensor **outs = (dt_tensor **)dt_step_alloc(sizeof *outs * (size_t)E);
    int ran = 0;
    for (int e = 0; e < E; e++) {
        int first = plan->expert_first[e], count = plan->expert_first[e + 1] - first;
        if (count) outs[ran++] = L->expert(L->ctx, e, dt_rows(xs, first, count));
    }
    return dt_moe_combine(ran ? dt_cat_rows(outs, ran) : xs, w, plan);   /* no slot: xs is [0, D] */
}
