//@ lesson: expert parallelism -- each rank keeps E/P of a mixture's experts; the tokens go to their experts' ranks and back by all-to-all, on the tape
/* Expert parallelism (stage 09). A mixture of experts (the MoE chapter)
   holds E expert MLPs in each MoE layer but runs k of them a token, so its
   experts are most of its parameters and little of its work. Here the P
   ranks of a group each keep E/P of every layer's experts (rank r experts
   r x E/P .. (r + 1) x E/P - 1) and everything else whole; each reads its own
   batch, as in DDP. In an MoE layer each rank routes its own tokens as stage
   01 would, then:
     dispatch  an all-to-all sends each slot (a token's row, once per kept
               choice) to the rank that holds its expert;
     experts   each rank runs its experts on the rows it received, from
               every rank of the group;
     combine   a second all-to-all sends the results back where they came
               from, and the layer weighs and sums them as before.
   Both are ops on the tape (dt_all_to_all_rows), so backward sends the
   gradients back the same way, reversed. How many rows go where changes
   every step: the ranks first tell each other how many rows each expert
   gets (an all-gather of E numbers), so every rank knows what arrives.

   Gradients: a rank's expert received tokens from every rank of its group,
   so its gradient already holds the group's share of the batch; the ranks
   that hold the same experts (one per group: "dp") average theirs, and one
   more 1/P makes it the mean over the whole job's batch. What every rank
   holds -- attention, norms, the router, embeddings -- is averaged over the
   whole job: the engine averages it over "dp", this wrapper over "ep"
   (sum_shared_grads). The job's ranks form a "dp" x "ep" mesh, ep varying
   fastest, and a data-parallel engine wraps this over "dp"
   (dt_ep_data_group): DDP, or FSDP with --shard. */
typedef struct dt_ep dt_ep;
/* Keep this rank's E/P experts of every MoE layer (the model drawn whole
   from the seed, as in stage 01, then cut). ep 0: the whole job is one
   group. E must divide by it. */
dt_ep *dt_ep_create(dt_model *model, dt_comm *comm, int ep);
/* After backward, unwrapped (a job that is one group): the shared
   parameters' gradients averaged over the group, the experts' divided by P.
   Wrapped, the engine's sync does it; with more than one group unwrapped,
   an error that says so. */
void dt_ep_sync_grads(dt_ep *ep);
/* The ranks that hold the same experts, one per group ("dp"): what the
   data-parallel engine around this one averages or shards over. */
dt_comm *dt_ep_data_group(const dt_ep *ep);
/* The model stays cut (this rank's experts): after this it can be freed. */
void dt_ep_free(dt_ep *ep);
/* x [R, D]: its first send_rows[0] rows to rank 0 of `group`, the next
   send_rows[1] to rank 1, ...; returns [sum of recv_rows, D], rank 0's rows
   for this rank first (recv_rows[q] from rank q). On the tape: backward sends
   the rows' gradients back the same way. A collective of the group. */
dt_tensor *dt_all_to_all_rows(dt_comm *group, dt_tensor *x, const int *send_rows, const int *recv_rows);

//@ implementation
struct dt_ep {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_ep */
    dt_model *model;
    dt_comm *comm;              /* the job: the whole batch's ranks */
    dt_mesh *mesh;
    dt_comm *group, *across;    /* the ranks that split the experts ("ep"), and those that hold the same ones ("dp") */
    int size, rank;             /* P, and this rank's place in its group */
    int per_rank;               /* E / P: each rank holds experts rank x per_rank .. (rank + 1) x per_rank - 1 */
    /* this step's all-to-alls so far, their bytes sent to other ranks and
       time; and the last step's (for the log and the cost model) */
    double exchanges, exchange_bytes, exchange_ms, step_exchanges, step_exchange_bytes, step_exchange_ms;
    int64_t rows_in, step_rows_in;   /* slots this rank's experts computed */
    dt_model whole;             /* the model before the cut: checkpoints are laid out by it */
};

/* -- the all-to-all of rows, an op on the tape -- */
typedef struct { dt_comm *group; int64_t *send, *recv; dt_ep *count; } dt__a2a_rows;
static void dt__a2a_count(dt_ep *p, const dt__a2a_rows *s, dt_dtype dtype, double t0) {
    double t1 = dt_now_ms();
    dt__record_comm("all_to_all ep", t0, t1, 0);
    if (!p || !dt__ctx.grad_enabled) return;       /* evaluation's are not a training step's */
    double bytes = 0;
    for (int q = 0; q < dt_comm_size(s->group); q++)
        if (q != dt_comm_rank(s->group)) bytes += (double)s->send[q] * (double)dt_dtype_size(dtype);
    p->exchanges++;
    p->exchange_bytes += bytes;
    p->exchange_ms += t1 - t0;
}
static void dt__all_to_all_rows_backward(dt__tape_entry *e) {
    dt_tensor *x = e->in[0], *y = e->out;
    const dt__a2a_rows *s = (const dt__a2a_rows *)e->saved;
    int D = x->shape[1];
    double t0 = dt_now_ms();
    float *back = (float *)dt__step_data(sizeof(float) * (size_t)(x->numel > 0 ? x->numel : 1));
    dt_all_to_all(s->group, dt__grad_in(y), s->recv, back, s->send, DT_F32);    /* the same pieces, the other way */
    dt__a2a_count(s->count, &(dt__a2a_rows){ s->group, s->recv, s->send, NULL }, DT_F32, t0);
    if (!x->requires_grad) return;
    float *dx = dt__grad_acc(x);
    dt__add_rows(x, dx, back, dt_tensor_rows(x), D);
    dt__grad_acc_done(x, dx);
}
static dt_tensor *dt__all_to_all_rows(dt_comm *group, dt_tensor *x, const int *send_rows, const int *recv_rows, dt_ep *count) {
    if (x->ndim != 2) dt_fail("dt_all_to_all_rows: x has %d dimensions; it takes rows, [R, D]", x->ndim);
    int P = dt_comm_size(group), D = x->shape[1];                  /* (R may be 0) */
    dt__a2a_rows *s = (dt__a2a_rows *)dt_step_alloc(sizeof *s);
    s->group = group;
    s->send = (int64_t *)dt_step_alloc(sizeof(int64_t) * (size_t)P);
    s->recv = (int64_t *)dt_step_alloc(sizeof(int64_t) * (size_t)P);
    int64_t sent = 0, rows = 0;
    for (int q = 0; q < P; q++) {
        if (send_rows[q] < 0 || recv_rows[q] < 0)
            dt_fail("dt_all_to_all_rows: %d rows for rank %d and %d from it", send_rows[q], q, recv_rows[q]);
        s->send[q] = (int64_t)send_rows[q] * D;
        s->recv[q] = (int64_t)recv_rows[q] * D;
        sent += send_rows[q];
        rows += recv_rows[q];
    }
    if (sent != dt_tensor_rows(x) || rows > INT_MAX)
        dt_fail("dt_all_to_all_rows: %lld rows to send and %lld to receive, but x has %lld", (long long)sent, (long long)rows,
                (long long)dt_tensor_rows(x));
    dt__backend_for(x);
    int shape[2] = { (int)rows, D };
    dt_tensor *y = dt__tensor_alloc(2, shape, x->dtype);
    double t0 = dt_now_ms();
    dt_all_to_all(group, x->data, s->send, y->data, s->recv, x->dtype);
    dt__a2a_count(count, s, x->dtype, t0);
    s->count = count;
    if (dt__wants_grad(x, NULL, NULL)) {
        dt__tape_push(dt__all_to_all_rows_backward, y, x, NULL, NULL)->saved = s;
        dt_grad(y);          /* zeros from the start: backward walks past an entry whose output has no gradient, and every
                                rank of the group must meet this one, whether its rows were used or not */
    }
    return y;
}
dt_tensor *dt_all_to_all_rows(dt_comm *group, dt_tensor *x, const int *send_rows, const int *recv_rows) {
    return dt__all_to_all_rows(group, x, send_rows, recv_rows, NULL);
}

/* -- the experts of an MoE layer, spread over the group (dt_parallel's
      moe_experts, which dt_moe_forward calls with the dispatched slots) -- */
static dt_tensor *dt__ep_moe_experts(dt_parallel *par, const dt_moe_layer *L, dt_tensor *slots, const dt_moe_plan *plan) {
    dt_ep *p = (dt_ep *)par;
    int P = p->size, E = plan->E, per = p->per_rank;
    if (E != per * P) dt_fail("expert parallelism: a layer of %d experts, but the model was cut for %d", E, per * P);
    /* how many rows every rank sends each expert: all of it, so each rank
       knows what it sends (its own) and what it receives (the others') */
    int *mine = (int *)dt_step_alloc(sizeof(int) * (size_t)E), *all = (int *)dt_step_alloc(sizeof(int) * (size_t)E * P);
    for (int e = 0; e < E; e++) mine[e] = plan->expert_first[e + 1] - plan->expert_first[e];
    dt__comm_all_gather_host(p->group, mine, all, sizeof(int) * (size_t)E);
    int *send = (int *)dt_step_alloc(sizeof(int) * (size_t)P), *recv = (int *)dt_step_alloc(sizeof(int) * (size_t)P);
    for (int q = 0; q < P; q++)
        for (int i = 0; i < per; i++) {
            send[q] += mine[q * per + i];
            recv[q] += all[(size_t)q * E + p->rank * per + i];   /* rank q's rows for my expert i */
        }
    dt_tensor *got = dt__all_to_all_rows(p->group, slots, send, recv, p);   /* dispatch: rank by rank, expert by expert */
    /* Each expert on its rows from every rank (in rank order), then its
       results cut back into the order they arrived in. */
    dt_tensor **outs = (dt_tensor **)dt_step_alloc(sizeof *outs * (size_t)per);
    dt_tensor **parts = (dt_tensor **)dt_step_alloc(sizeof *parts * (size_t)P * per);
    int *at = (int *)dt_step_alloc(sizeof(int) * (size_t)P * per);   /* where rank q's rows for expert i begin in `got` */
    for (int q = 0, row = 0; q < P; q++)
        for (int i = 0; i < per; i++) {
            at[q * per + i] = row;
            row += all[(size_t)q * E + p->rank * per + i];
        }
    int npieces = 0;
    for (int i = 0; i < per; i++) {
        int n = 0, rows = 0;
        for (int q = 0; q < P; q++) {
            int count = all[(size_t)q * E + p->rank * per + i];
            if (count) parts[n++] = dt_rows(got, at[q * per + i], count);
            rows += count;
        }
        /* An expert no row came for runs on none: every rank's tape then reads
           the same parameters in the same places, so the engine's buckets
           start at the same moments of backward on every rank. */
        outs[i] = L->expert(L->ctx, p->rank * per + i, !rows ? dt_rows(got, 0, 0) : n == 1 ? parts[0] : dt_cat_rows(parts, n));
        if (dt__ctx.grad_enabled && !dt__ctx.recomputing) p->rows_in += rows;
    }
    for (int q = 0; q < P; q++)
        for (int i = 0; i < per; i++) {
            int count = all[(size_t)q * E + p->rank * per + i], first = 0;   /* after ranks 0 .. q - 1's rows */
            for (int r = 0; r < q; r++) first += all[(size_t)r * E + p->rank * per + i];
            if (count) parts[npieces++] = dt_rows(outs[i], first, count);
        }
    dt_tensor *back = npieces ? dt_cat_rows(parts, npieces) : got;         /* nothing came: got is [0, D] */
    return dt__all_to_all_rows(p->group, back, recv, send, p);            /* combine: each row home */
}

/* -- gradients: averaged over the whole job's batch -- */
/* The shared parameters' gradients, first .. end - 1, averaged over the
   group (the engine averaged them over "dp"); the experts' divided by P. */
static void dt__ep_sum_shared(dt_parallel *par, int first, int end) {
    dt_ep *p = (dt_ep *)par;
    dt_model *m = p->model;
    if (p->size == 1) return;
    double t0 = dt_now_ms();
    const dt_backend *gpu = dt__backend_of(m->device);
    for (int i = first; i < end;) {
        dt_tensor *t = &m->params[i];
        if (m->splits[i].expert || !t->numel) {
            if (t->numel && gpu) gpu->scale(t->grad, 1.0f / (float)p->size, t->numel);
            else for (int64_t j = 0; j < t->numel; j++) t->grad[j] /= (float)p->size;
            i++;
            continue;
        }
        int64_t n = t->numel;                      /* a run of shared parameters, their gradients one after another */
        int j = i + 1;
        for (; j < end && !m->splits[j].expert && m->params[j].numel && m->params[j].grad == t->grad + n; j++)
            n += m->params[j].numel;
        dt_all_reduce(p->group, t->grad, t->grad, n, DT_F32, DT_AVG);
        i = j;
    }
    dt__record_comm("all_reduce ep shared", t0, dt_now_ms(), 0);
}
static void dt__ep_backward_done(dt_parallel *par) {
    dt_ep *p = (dt_ep *)par;
    if (p->model->parallel == par) dt__ep_sum_shared(par, 0, p->model->nparams);   /* unwrapped (wrapped, the engine calls it) */
}
void dt_ep_sync_grads(dt_ep *ep) {
    if (ep->model->parallel != &ep->par)
        dt_fail("dt_ep_sync_grads: %s wraps this model; call %s, which syncs this one too", ep->model->parallel->create_fn,
                ep->model->parallel->sync_fn);
    if (ep->par.grad_ranks > 1)
        dt_fail("dt_ep_sync_grads: %d groups of %d ranks each hold the same experts, and nothing averages their gradients; "
                "wrap the model in a data-parallel engine over dt_ep_data_group (dt_data_parallel_create) and sync that",
                ep->par.grad_ranks, ep->size);
    dt_parallel_backward_done(&ep->par);
}
static void dt__ep_step_done(dt_parallel *par) {
    dt_ep *p = (dt_ep *)par;
    p->step_exchanges = p->exchanges; p->step_exchange_bytes = p->exchange_bytes; p->step_exchange_ms = p->exchange_ms;
    p->step_rows_in = p->rows_in;
    p->exchanges = p->exchange_bytes = p->exchange_ms = 0;
    p->rows_in = 0;
}
/* The optimizer steps what this rank holds; the gradient norm adds the
   group's experts and counts the shared parameters once (on rank 0). */
static void dt__ep_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_ep *p = (dt_ep *)par;
    dt_model *m = p->model;
    dt__optimizer_view_all(o, m);
    for (int i = 0; i < m->nparams; i++) o->slices[i].copy = p->rank > 0 && !m->splits[i].expert;
    o->sharded_by = par;
}
static void dt__ep_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_ep *)par)->group, values, n, DT_SUM);
}
/* Every rank reads its own batch: the step's batch is the whole job's, rank
   after rank (what capacity and the balancing loss are taken over). */
static void dt__ep_data_all_gather(dt_parallel *par, const float *mine, float *all, int64_t n, int *rank, int *ranks) {
    dt_ep *p = (dt_ep *)par;
    *rank = dt_comm_rank(p->comm); *ranks = dt_comm_size(p->comm);
    if (all) dt__comm_all_gather_host(p->comm, mine, all, sizeof(float) * (size_t)n);
}
dt_comm *dt_ep_data_group(const dt_ep *ep) { return ep->across; }

/* -- the cut: this rank's experts, and every shared parameter -- */
static int dt__ep_holds(const dt_ep *p, int i) {
    int e = p->model->splits[i].expert - 1;
    return e < 0 || e / p->per_rank == p->rank;
}
static void dt__ep_cut_shape(void *wrapper, int i, dt_tensor *t) {
    if (dt__ep_holds((dt_ep *)wrapper, i)) return;
    t->shape[0] = 0;                               /* another rank's expert: nothing here */
    t->numel = 0;
}
static void dt__ep_scatter(void *wrapper, float *whole, float *local) {
    dt_ep *p = (dt_ep *)wrapper;
    dt_model *m = p->model;
    for (int i = 0; i < m->nparams; i++)
        dt__upload_to(m->device, local + m->offsets[i], whole + p->whole.offsets[i], (size_t)m->params[i].numel * sizeof(float));
}

dt_ep *dt_ep_create(dt_model *model, dt_comm *comm, int ep) {
    int world = dt_comm_size(comm), E = model->cfg.moe_experts;
    char v[32];
    snprintf(v, sizeof v, "%d", ep);
    dt_comm_check_agree(comm, "--ep", v);
    if (ep <= 0) ep = world;
    if (E < 1)
        dt_usage_error("--ep %d: this model has no experts to spread; give it a mixture of experts (--moe-experts E "
                       "--moe-top-k K)", ep);
    if (world % ep)
        dt_usage_error("--ep %d does not divide the job's %d ranks (the ranks form groups of --ep, data parallel across them)",
                       ep, world);
    if (E % ep)
        dt_usage_error("--moe-experts %d does not divide by --ep %d: each rank of a group keeps E/P of every layer's experts",
                       E, ep);
    if (model->base) dt_usage_error("--lora-rank: LoRA's adapters are not spread by expert parallelism; train them with 03-05");
    dt_ep *p = (dt_ep *)calloc(1, sizeof *p);
    if (!p) dt_fail("out of memory (expert parallelism)");
    p->par = (dt_parallel){ .create_fn = "dt_ep_create", .sync_fn = "dt_ep_sync_grads", .free_fn = "dt_ep_free",
                            .backward_done = dt__ep_backward_done, .step_done = dt__ep_step_done,
                            .optimizer_view = dt__ep_optimizer_view, .sum_over_ranks = dt__ep_sum_over_ranks,
                            .sum_shared_grads = dt__ep_sum_shared, .data_all_gather = dt__ep_data_all_gather,
                            .moe_experts = dt__ep_moe_experts, .grad_ranks = world / ep };
    dt_model_set_parallel(model, &p->par);
    dt__comm_hold(comm, "dt_ep_free");
    p->model = model;
    p->comm = comm;
    int sizes[2] = { world / ep, ep };
    const char *names[2] = { "dp", "ep" };
    p->mesh = dt_mesh_create(comm, 2, sizes, names);
    p->group = dt_mesh_comm(p->mesh, "ep");
    p->across = dt_mesh_comm(p->mesh, "dp");
    p->size = ep;
    p->rank = dt_mesh_coord(p->mesh, "ep");
    p->per_rank = E / ep;
    p->par.whole = &p->whole;
    dt__model_cut(model, &p->whole, dt__ep_cut_shape, dt__ep_scatter, p);
    return p;
}

void dt_ep_free(dt_ep *ep) {
    if (!ep) return;
    if (ep->model->parallel && ep->model->parallel != &ep->par)
        dt_fail("dt_ep_free: another wrapper still wraps the model it cut; call %s first", ep->model->parallel->free_fn);
    dt_model_set_parallel(ep->model, NULL);
    ep->model->left_cut_by = "dt_ep_free";     /* the experts stay cut: the model can only be freed now */
    dt_mesh_free(ep->mesh);
    dt__comm_release(ep->comm);
    free(ep->whole.params);
    free(ep->whole.offsets);
    free(ep);
}

//@ for the machinery
/* ---- what the machinery asks of expert parallelism (the run driver's dt_parallel_report) ----
   A checkpoint holds the model whole: each expert sent by the rank that
   holds it to the first rank of the first group, which writes; to load,
   every rank keeps its experts of the whole. The memory table shows what a
   rank keeps; the log, --bench and the cost model get the all-to-alls. */
static int dt__ep_owner_of(const void *wrapper, int i) {        /* the rank of the group that holds parameter i */
    const dt_ep *p = (const dt_ep *)wrapper;
    int e = p->model->splits[i].expert - 1;
    return e < 0 ? 0 : e / p->per_rank;
}
static float *dt__ep_whole_from_local(dt_parallel *par, const dt_model *layout, float *local) {
    dt_ep *p = (dt_ep *)par;
    (void)layout;                                  /* the model as cut */
    if (dt_mesh_coord(p->mesh, "dp") != 0) return NULL;   /* the groups hold the same: the first one writes */
    return dt__state_from_owners(p->group, p->model, &p->whole, local, dt__ep_owner_of, p, "the experts");
}
static void dt__ep_local_from_whole(dt_parallel *par, const dt_model *layout, float *whole, float *local) {
    (void)layout;
    dt__ep_scatter(par, whole, local);
}

/* At start-up: what each rank keeps of the experts, against the whole. */
static void dt__ep_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_ep *p = (const dt_ep *)par;
    const dt_model *m = p->model, *W = &p->whole;
    double experts = 0, shared = 0, moments = o->v ? 2 : 1;
    for (int i = 0; i < m->nparams; i++) *(m->splits[i].expert ? &experts : &shared) += 4.0 * (double)W->params[i].numel;
    int wrapped = m->parallel != &p->par;
    printf("memory per rank, --ep %d: %d of every MoE layer's %d experts here (experts %d-%d), %d data-parallel group%s (MB):\n",
           p->size, p->per_rank, m->cfg.moe_experts, p->rank * p->per_rank, (p->rank + 1) * p->per_rank - 1,
           p->par.grad_ranks, p->par.grad_ranks > 1 ? "s" : "");
    printf("  %-16s %9s %9s   %s\n", "", wrapped ? "kept" : "this rank", "whole", "formula (X: the experts, R: the rest)");
    const char *rows[3] = { "parameters", "gradients", "optimizer state" };
    for (int r = 0; r < 3; r++)
        printf("  %-16s %9.3f %9.3f   %s(X/%d + R)%s\n", rows[r], (r == 2 ? moments : 1) * (experts / p->size + shared) / 1e6,
               (r == 2 ? moments : 1) * (experts + shared) / 1e6, r == 2 && moments == 2 ? "2 x " : "", p->size,
               wrapped ? ", which the engine above shards or keeps" : "");
    printf("  X = %.3f MB whole, %.3f here; R = %.3f MB (attention, norms, routers, embeddings) on every rank\n", experts / 1e6,
           experts / p->size / 1e6, shared / 1e6);
    fflush(stdout);
}

/* The experts' share of the whole model's parameters. */
static double dt__ep_expert_share(const dt_ep *p) {
    double experts = 0;
    for (int i = 0; i < p->whole.nparams; i++) experts += p->model->splits[i].expert ? (double)p->whole.params[i].numel : 0;
    return p->whole.numel > 0 ? experts / (double)p->whole.numel : 0;
}
/* The cost model's view of the last step: the all-to-alls apart from the
   compute, the optimizer as one rank stepping the whole model would. */
static int dt__ep_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_ep *p = (const dt_ep *)par;
    int K = in->accum_steps > 0 ? in->accum_steps : 1;
    in->kind = DT_PAR_EP;
    in->ep_expert_share = dt__ep_expert_share(p);
    in->ep_exchanges = p->step_exchanges / K;
    in->ep_bytes = p->step_exchanges > 0 ? p->step_exchange_bytes / p->step_exchanges : 0;
    in->compute_ms = fmax(0, in->compute_ms - p->step_exchange_ms / K);
    in->optimizer_ms *= p->model->numel > 0 ? (double)p->whole.numel / (double)p->model->numel : 1;
    in->dp_groups = p->par.grad_ranks;
    return p->size;
}

/* The step's all-to-alls, in its --log record. */
static void dt__ep_log_fields(const dt_parallel *par, FILE *log) {
    const dt_ep *p = (const dt_ep *)par;
    fprintf(log, ",\"ep_all_to_alls\":%.0f,\"ep_bytes\":%.0f,\"ep_ms\":%.3f,\"ep_rows_in\":%lld", p->step_exchanges,
            p->step_exchange_bytes, p->step_exchange_ms, (long long)p->step_rows_in);
}
static void dt__ep_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_ep *p = (const dt_ep *)par;
    fprintf(out, " ep=%d ep_share=%.4f ep_all_to_alls=%.1f ep_bytes=%.0f dp=%d", p->size, dt__ep_expert_share(p),
            p->step_exchanges / accum_steps, p->step_exchanges > 0 ? p->step_exchange_bytes / p->step_exchanges : 0.0,
            p->par.grad_ranks);
}

const dt_parallel_report dt__ep_report = {
    .create_fn = "dt_ep_create",
    .memory_table = dt__ep_memory_table, .log_fields = dt__ep_log_fields, .bench_fields = dt__ep_bench_fields,
    .cost_input = dt__ep_cost_input,
    .whole_from_local = dt__ep_whole_from_local, .local_from_whole = dt__ep_local_from_whole,
};
