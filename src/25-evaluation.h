//@ machinery: evaluation -- validation loss and accuracy over every rank's share, generated text
/* ---- evaluation --------------------------------------------------------- */

/* Mean loss and accuracy of the model over a data set, without gradients. In a
   job every rank evaluates its share and the sums are all-reduced; under
   tensor parallelism the share is its group's (the ranks of a group evaluate
   it together). */
void dt_evaluate(dt_model *m, const dt_dataset *ds, int batch_size, double *loss, double *acc);
/* gpt: continue `prompt` (n_prompt token ids) by n_new tokens into out, each
   drawn from the softmax of the last position's logits / temperature, seeded.
   Collective in a job: every rank calls it alike (FSDP gathers, tensor
   parallelism gathers the logits); rank 0's draws count. */
void dt_generate(dt_model *m, const int32_t *prompt, int n_prompt, int n_new, float temperature, uint64_t seed,
                 int32_t *out);

//@ implementation
/* ==== evaluation ============================================================
   The validation set is measured without the tape: no gradients, no
   activations kept. Every rank evaluates its share and the sums meet in one
   all-reduce, so the numbers are those of the whole set on every rank. */

/* Sum n host floats over the ranks of the job. */
static void dt__job_sum(float *host, int n) {
    if (!dt__ctx.job || dt__ctx.world_size == 1) return;
    dt__comm_all_reduce_host(dt__ctx.job, host, n, DT_SUM);
}
/* The largest of every rank's value. */
static float dt__job_max(float mine) {
    if (!dt__ctx.job || dt__ctx.world_size == 1) return mine;
    int W = dt__ctx.world_size;
    float *all = (float *)malloc(sizeof(float) * (size_t)W);
    if (!all) dt_fail("out of memory");
    dt__comm_all_gather_host(dt__ctx.job, &mine, all, sizeof mine);
    for (int r = 0; r < W; r++) if (all[r] > mine) mine = all[r];
    free(all);
    return mine;
}

/* Share `rank` of `world`: the run driver gives its loader's, as the ranks of
   a tensor-parallel group evaluate the same share together. */
static void dt__evaluate_share(dt_model *m, const dt_dataset *ds, int batch_size, int rank, int world, double *loss,
                               double *acc) {
    dt_loader l = dt_loader_create(ds, batch_size, 0, 0, 0, 0, rank, world);
    dt_loader_start_epoch(&l, 0, 0);
    dt_batch b;
    double total = 0;
    int64_t correct = 0, seen = 0;
    dt_set_grad_enabled(0);
    for (;;) {
        dt_step_arena_reset();
        int64_t first = l.pos;
        if (!dt_loader_next(&l, &b)) break;
        dt_tensor *logits = dt_model_forward(m, b.inputs);
        int C = (int)dt_tensor_cols(logits), R = (int)(dt_tensor_rows(logits) / b.size);   /* rows per sample: gpt's T */
        int split = dt__logits_split(logits);                   /* a split vocabulary: the group's columns */
        float *host = (float *)dt__step_alloc_uninit(sizeof(float) * (size_t)logits->numel * (size_t)split);
        dt_logits_to_host(logits, host);
        C *= split;
        for (int i = 0; i < b.size; i++) {
            if (rank + (first + i) * world >= ds->n) continue;   /* the sampler's padding: counted by its owner */
            for (int k = i * R; k < (i + 1) * R; k++) {
                if (b.labels[k] == DT_IGNORE_INDEX) continue;   /* a prompt's or the padding's */
                const float *row = host + (size_t)k * C;
                int best = 0;
                float mx = row[0], sum = 0;
                for (int j = 1; j < C; j++) if (row[j] > row[best]) best = j;
                mx = row[best];
                for (int j = 0; j < C; j++) sum += expf(row[j] - mx);
                total += (double)(logf(sum) + mx - row[b.labels[k]]);
                correct += best == b.labels[k];
                seen++;
            }
        }
    }
    dt_set_grad_enabled(1);
    dt_loader_free(&l);
    /* The sampler pads by wrapping, so every rank runs the same number of
       batches; the padding is not counted, so each sample is scored here, row
       by row, rather than through the batch mean dt_cross_entropy gives. */
    float sums[3] = { (float)total, (float)correct, (float)seen };
    dt_step_arena_reset();
    dt__job_sum(sums, 3);
    *loss = sums[2] > 0 ? sums[0] / sums[2] : 0;
    *acc = sums[2] > 0 ? sums[1] / sums[2] : 0;
}
void dt_evaluate(dt_model *m, const dt_dataset *ds, int batch_size, double *loss, double *acc) {
    const dt_parallel *par = m->parallel;
    while (par && par->data_ranks == 0) par = par->inner;       /* in a stack, the wrapper that says how the data splits */
    if (par && par->data_ranks > 0) dt__evaluate_share(m, ds, batch_size, par->data_rank, par->data_ranks, loss, acc);
    else dt__evaluate_share(m, ds, batch_size, dt__ctx.job ? dt__ctx.rank : 0, dt__ctx.job ? dt__ctx.world_size : 1, loss, acc);
}

/* Sampling, one token at a time: the whole window runs again for each new
   token (no key/value cache -- slower, but nothing new to learn). */
void dt_generate(dt_model *m, const int32_t *prompt, int n_prompt, int n_new, float temperature, uint64_t seed,
                 int32_t *out) {
    int T = m->cfg.seq_len, V = m->cfg.classes, len = n_prompt;
    if (!dt_model_is_language(m->cfg.kind)) dt_fail("generation needs a language model (--model gpt or llama)");
    if (n_prompt < 1) dt_fail("generation needs a prompt of at least one token");
    int32_t *seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n_prompt + n_new));
    float *window = (float *)malloc(sizeof(float) * (size_t)T), *logits = (float *)malloc(sizeof(float) * (size_t)V);
    if (!seq || !window || !logits) dt_fail("out of memory (generation)");
    memcpy(seq, prompt, sizeof(int32_t) * (size_t)n_prompt);
    int grad = dt__ctx.grad_enabled;
    dt_set_grad_enabled(0);
    dt__rng rng = { dt__hash3(seed, 0x47454Eu, 0) };
    for (int i = 0; i < n_new; i++, len++) {
        int from = len > T ? len - T : 0, L = len - from;
        for (int t = 0; t < L; t++) window[t] = (float)seq[from + t];
        dt_step_arena_reset();
        int shape[2] = { 1, L };
        dt_tensor *y = dt_model_forward(m, dt_tensor_from_host(2, shape, window));
        dt__logits_rows_to_host(y, L - 1, 1, logits);                   /* the last position's */
        float *weight = logits, mx = weight[0];
        for (int j = 1; j < V; j++) mx = weight[j] > mx ? weight[j] : mx;
        double total = 0;
        for (int j = 0; j < V; j++) total += weight[j] = expf((weight[j] - mx) / temperature);
        double u = dt__rng_uniform(&rng) * total;
        float pick = (float)(V - 1);
        for (int j = 0; j < V; j++)
            if ((u -= weight[j]) <= 0) { pick = (float)j; break; }
        if (dt__ctx.rank != 0) pick = 0;                  /* rank 0 decides for every rank */
        dt__job_sum(&pick, 1);
        seq[len] = (int32_t)pick;
    }
    dt_set_grad_enabled(grad);
    dt_step_arena_reset();
    memcpy(out, seq + n_prompt, sizeof(int32_t) * (size_t)n_new);
    free(seq); free(window); free(logits);
}

