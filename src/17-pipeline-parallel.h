//@ lesson: pipeline parallelism -- stages of consecutive blocks, micro-batches in GPipe's or 1F1B's order
/* Pipeline parallelism (stage 07): each rank of a pipeline of P keeps a run
   of consecutive blocks, its stage (balanced by parameters; the embedding
   with the first, the head with the last); a batch goes through in M
   micro-batches, in the order the schedule gives each stage. It cuts the
   ranks of `comm` into pipelines of P stages (pp 0: one pipeline of them
   all). Around tensor parallelism, comm is dt_tp_data_group: each stage is
   then T ranks that split its blocks' layers as stage 06 does. With more
   than one pipeline, a data-parallel engine wraps this one over
   dt_pp_data_group, as in 06 -- DDP, which averages once a step, after the
   last micro-batch; or FSDP, ZeRO-1 once a step, ZeRO-2 and -3 each
   micro-batch's gradients as its backward ends (so they stay sharded). */
typedef struct dt_pp dt_pp;
typedef enum { DT_SCHEDULE_GPIPE = 0, DT_SCHEDULE_1F1B = 1 } dt_pp_schedule;
dt_pp *dt_pp_create(dt_model *model, dt_comm *comm, int pp, int micro_batches, dt_pp_schedule schedule);
/* A step's forward and backward: the batch cut into the micro-batches, each
   stage running its forwards and backwards in the schedule's order, sending
   activations on and gradients back. Returns the batch's mean loss, on every
   rank (the last stage computes it). Collective over the pipeline. */
dt_tensor *dt_pp_forward_backward(dt_pp *pp, const dt_batch *batch);
/* After it, unwrapped (one pipeline): the first and last stage add up the
   gradients of a tied vocabulary (each holds it). Wrapped, the engine's
   sync does, and this is an error naming it. */
void dt_pp_sync_grads(dt_pp *pp);
/* The ranks that hold the same stage, one per pipeline ("dp"): what a
   data-parallel engine wrapping this one averages or shards over; and this
   rank's pipeline among them, and how many: the loader's rank and world
   (every stage of a pipeline reads the same batch). */
dt_comm *dt_pp_data_group(const dt_pp *pp);
int dt_pp_data_rank(const dt_pp *pp);
int dt_pp_data_ranks(const dt_pp *pp);
/* The model stays cut (this rank's blocks), as after dt_tp_free. */
void dt_pp_free(dt_pp *pp);

//@ implementation
/* -- pipeline parallelism (GPipe: Huang et al., 2019; 1F1B: PipeDream-Flush,
      Narayanan et al., 2021) --
   The blocks are cut into P runs, one per rank of a pipeline: its stage. A
   micro-batch enters at the first stage; each stage runs its blocks and
   sends the activation on; the last one computes the loss. Backward goes
   back the same way, each stage sending the gradient of what it received to
   the stage before. A whole batch at once would keep all stages but one
   waiting, so it is cut into M micro-batches that follow each other down
   the pipeline: while stage 1 works on micro-batch 0, stage 0 starts
   micro-batch 1. What waiting is left -- the bubble, P - 1 micro-batches'
   time as the pipeline fills and as it drains -- is (P - 1) / (M + P - 1)
   of a step when every stage takes as long. The schedule orders a stage's
   forwards and backwards: GPipe runs every forward, then every backward, so
   a stage keeps the activations of all M micro-batches; 1F1B runs a
   micro-batch's backward as soon as it can, so it keeps at most P (the
   first stage P, the last one), for the same bubble. Each micro-batch has a
   step arena of its own, given back when its backward is done, so memory
   follows the schedule. Activations travel one way on one pair of ranks and
   gradients the other way on another, each pair with its own communication
   thread (or stream) and in micro-batch order on both sides, so the two
   directions never wait for each other; a stage posts its next receive as
   soon as it has taken the last one, into an inbox, so that the next
   message arrives while it computes. Every rank of a pipeline reads the
   same batch (the first stage its inputs, the last its labels). -- */
typedef struct { int backward, micro; } dt__pp_action;
/* A schedule is the order of one stage's 2M actions. */
static int dt__gpipe_order(int stage, int stages, int M, dt__pp_action *a) {
    (void)stage; (void)stages;
    int n = 0;
    for (int i = 0; i < M; i++) a[n++] = (dt__pp_action){ 0, i };
    for (int i = 0; i < M; i++) a[n++] = (dt__pp_action){ 1, i };
    return n;
}
/* 1F1B: as many forwards as the stages after this one (warm-up), then one
   forward and one backward in turn, then the backwards left (cool-down). */
static int dt__1f1b_order(int stage, int stages, int M, dt__pp_action *a) {
    int warm = stages - 1 - stage < M ? stages - 1 - stage : M, n = 0, f = 0, b = 0;
    while (f < warm) a[n++] = (dt__pp_action){ 0, f++ };
    while (f < M) { a[n++] = (dt__pp_action){ 0, f++ }; a[n++] = (dt__pp_action){ 1, b++ }; }
    while (b < M) a[n++] = (dt__pp_action){ 1, b++ };
    return n;
}
static const struct { const char *name; int (*order)(int stage, int stages, int M, dt__pp_action *a); } dt__pp_schedules[] = {
    { "gpipe", dt__gpipe_order }, { "1f1b", dt__1f1b_order } };   /* in dt_pp_schedule's order */

struct dt_pp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_pp */
    dt_model *model;
    dt_comm *comm;
    dt_mesh *mesh;
    dt_comm *pipe, *across;     /* the stages of one pipeline ("pp"), and the data-parallel pipelines ("dp") */
    dt_comm *ends;              /* the first and the last stage (a tied vocabulary), or NULL */
    dt_comm *to_next, *from_next, *to_prev, *from_prev;   /* one way each: activations on, gradients back */
    int stages, stage, micro_batches;
    dt_pp_schedule schedule;
    int *first_block;           /* stage s runs blocks [first_block[s], first_block[s + 1]) */
    dt_model whole;             /* the model before the cut into stages (around --tp: its pieces of every stage) */
    /* Per micro-batch slot: an arena pair, taken by a forward, given back
       after its backward (slots: as many as were ever alive at once). */
    dt__step_arena (*arenas)[2];
    int nslots;
    /* The inboxes the next receive lands in, and their handles (0: none posted). */
    void *inbox_x, *inbox_g;
    size_t inbox_bytes;
    dt_comm_handle recv_x, recv_g;
    /* The last step, for the log and the tests: this rank's time computing
       and waiting, and the activation bytes kept at once (at most, and per
       micro-batch); the pipeline's: its stages' times added up, and the
       busiest stage's (which sets the pace). */
    double busy_ms, idle_ms, step_ms;
    double pipe_busy_ms, pipe_idle_ms, pipe_step_ms, pipe_busiest_ms;
    double pipe_tp_sums, pipe_tp_sum_ms, pipe_tp_sum_bytes;   /* around --tp: the stages' layer sums, their time and bytes */
    double act_bytes;           /* one micro-batch's activation, sent on */
    double kept_peak, kept_micro;
    int kept_micro_batches;     /* the most micro-batches alive at once */
};

static int dt__pp_holds(const dt_pp *p, int stage, int i) {
    const dt_split *sp = &p->model->splits[i];
    int n = dt_model_blocks(p->model), last = stage == p->stages - 1;
    if (sp->tied && (stage == 0 || last)) return 1;
    if (sp->block < 0) return stage == 0;
    if (sp->block >= n) return last;
    return sp->block >= p->first_block[stage] && sp->block < p->first_block[stage + 1];
}
/* Stage s runs blocks [first[s], first[s + 1]): the cut whose largest stage
   holds the fewest parameters (the embedding's counted with the first stage,
   the head's with the last), found by dynamic programming over the cuts. */
static void dt__pp_balance(const dt_model *m, int P, int *first) {
    int n = dt_model_blocks(m);
    double *w = (double *)calloc((size_t)n + 3, sizeof(double)), *cum = (double *)calloc((size_t)n + 1, sizeof(double));
    double *best = (double *)malloc(sizeof(double) * (size_t)(P + 1) * (size_t)(n + 1));
    int *cut = (int *)malloc(sizeof(int) * (size_t)(P + 1) * (size_t)(n + 1));
    if (!w || !cum || !best || !cut) dt_fail("out of memory (pipeline stages)");
    for (int i = 0; i < m->nparams; i++) {
        int b = m->splits[i].block;
        w[(b < 0 ? -1 : b > n ? n : b) + 1] += (double)m->params[i].numel;
        if (m->splits[i].tied) w[n + 1] += (double)m->params[i].numel;
    }
    for (int b = 0; b < n; b++) cum[b + 1] = cum[b] + w[b + 1];
#define DT_BEST(k, j) best[(size_t)(k) * (size_t)(n + 1) + (size_t)(j)]
#define DT_CUT(k, j) cut[(size_t)(k) * (size_t)(n + 1) + (size_t)(j)]
    /* DT_BEST(k, j): the smallest largest stage of blocks [0, j) in k stages */
    for (int j = 1; j <= n; j++) DT_BEST(1, j) = w[0] + cum[j] + (P == 1 ? w[n + 1] : 0);
    for (int k = 2; k <= P; k++)
        for (int j = k; j <= n; j++) {
            DT_BEST(k, j) = HUGE_VAL;
            for (int c = k - 1; c < j; c++) {
                double here = cum[j] - cum[c] + (k == P && j == n ? w[n + 1] : 0);
                double worst = fmax(DT_BEST(k - 1, c), here);
                if (worst < DT_BEST(k, j)) { DT_BEST(k, j) = worst; DT_CUT(k, j) = c; }
            }
        }
    first[P] = n;
    for (int k = P, j = n; k > 1; k--) j = first[k - 1] = DT_CUT(k, j);
    first[0] = 0;
#undef DT_BEST
#undef DT_CUT
    free(w); free(cum); free(best); free(cut);
}

static void dt__pp_cut_shape(void *wrapper, int i, dt_tensor *p) {
    dt_pp *pp = (dt_pp *)wrapper;
    if (dt__pp_holds(pp, pp->stage, i)) return;
    p->shape[0] = 0;                        /* not this stage's: nothing here */
    p->numel = 0;
}
static void dt__pp_scatter(void *wrapper, float *whole, float *local) {
    dt_pp *p = (dt_pp *)wrapper;
    dt_model *m = p->model;
    for (int i = 0; i < m->nparams; i++)
        dt__upload_to(m->device, local + m->offsets[i], whole + p->whole.offsets[i], (size_t)m->params[i].numel * sizeof(float));
}

/* The shape of what stage s passes stage s + 1, for a micro-batch of these inputs. */
static void dt__pp_activation_shape(const dt_pp *p, const dt_tensor *inputs, int shape[2]) {
    shape[0] = inputs->shape[0] * dt__family(p->model->cfg.kind)->rows_per_sample(p->model, inputs);
    shape[1] = p->model->cfg.dim;
}
/* The inbox's next message from `from`, waited for (the time counts as
   idle), copied into dst, and the receive after it posted when `more`. */
static void dt__pp_take(dt_pp *p, dt_comm *from, int peer, void *inbox, dt_comm_handle *h, void *dst, int64_t n, dt_dtype t,
                        int more) {
    double t0 = dt_now_ms(), a, b;
    if (!*h) *h = dt_recv_async(from, inbox, n, t, peer);
    dt_comm_wait(from, *h);
    dt_synchronize();
    double t1 = dt_now_ms();
    p->idle_ms += t1 - t0;
    dt__record_event("waiting", t0, t1);
    /* the receive on the trace's communication row; not in the step's
       communication time, as it was posted early and its span holds the
       sender's compute (the send's, counted by the sender, is the message) */
    dt__comm_interval(from, *h, &a, &b);
    dt__record_span(from == p->from_prev ? "recv activation" : "recv gradient", a, b, 0);
    dt_convert(inbox, t, dst, t, n);                   /* a copy on the device */
    *h = more ? dt_recv_async(from, inbox, n, t, peer) : 0;
}
static void dt__pp_inboxes(dt_pp *p, size_t bytes) {
    if (bytes <= p->inbox_bytes) return;    /* grown between steps, when no receive is posted into them */
    dt_free_on(p->model->device, DT_ARENA_COMM, p->inbox_x, p->inbox_bytes);
    dt_free_on(p->model->device, DT_ARENA_COMM, p->inbox_g, p->inbox_bytes);
    p->inbox_x = dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    p->inbox_g = dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    p->inbox_bytes = bytes;
}

/* What one micro-batch leaves between its forward and its backward. */
typedef struct {
    int slot;                   /* its arena pair */
    int tape_lo, tape_hi;       /* its forward's entries on the tape */
    dt_tensor *in, *out;        /* what it received (NULL at the first stage), what it sent on or its loss */
    dt_comm_handle sent;        /* out, sent on (0: the last stage) */
    double kept;                /* the bytes its forward left in its arena */
} dt__pp_micro;
/* ... and what the step's actions share. */
typedef struct {
    const dt_batch *batch;
    int M, b, first, end, labels_per;   /* micro-batches, each b samples; this stage's blocks [first, end) */
    int act[2];                 /* what a stage passes the next: rows x width */
    int64_t act_n, in_per;      /* its values; an input sample's */
    dt_dtype t;
    double divisor;             /* masked data: the step's count of targets (0: none) */
    double loss_sum, kept;      /* the last stage's losses; the activation bytes kept now */
    int forwards, backwards, alive;
    int *free_slots, nfree;
    dt__pp_micro *mb;
} dt__pp_step;

/* The time since t0 was spent computing micro-batch i: counted, and on the trace. */
static void dt__pp_busy(dt_pp *p, const char *what, int i, double t0) {
    dt_synchronize();
    double t1 = dt_now_ms();
    char name[32];
    p->busy_ms += t1 - t0;
    snprintf(name, sizeof name, "%s %d", what, i);
    dt__record_event(name, t0, t1);
}
/* Wait until a send is taken; on the trace, the part before `since` hidden. */
static void dt__pp_sent(dt_comm *c, dt_comm_handle h, const char *name, double since) {
    if (!h) return;
    double a, z;
    dt_comm_wait(c, h);
    dt__comm_interval(c, h, &a, &z);
    dt__record_comm(name, a, z, fmax(0, fmin(z, since) - a));
}

/* Micro-batch i's forward: its slot's arena in place, its rows of the batch,
   what the stage before sent (from the inbox), this stage's blocks, then
   the activation sent on, or the loss. */
static void dt__pp_forward_one(dt_pp *pp, dt__pp_step *st, int i) {
    dt__pp_micro *u = &st->mb[i];
    int last = pp->stage == pp->stages - 1;
    u->slot = st->free_slots[--st->nfree];
    dt__step_arena_swap(pp->arenas[u->slot]);
    size_t before = dt__ctx.step[DT_CPU].high + dt__ctx.step[DT_CUDA].high;
    dt_tensor *inputs = (dt_tensor *)dt_step_alloc(sizeof(dt_tensor));   /* rows [i b, (i + 1) b) of the batch */
    *inputs = *st->batch->inputs;
    inputs->shape[0] = st->b;
    inputs->numel = st->in_per * st->b;
    inputs->data = (float *)((char *)inputs->data + (size_t)(st->in_per * st->b * i) * dt_dtype_size(inputs->dtype));
    u->in = NULL;
    if (pp->stage > 0) {
        u->in = dt__tensor_alloc(2, st->act, st->t);
        u->in->requires_grad = 1;           /* its gradient goes back to the stage before */
        dt__pp_take(pp, pp->from_prev, 0, pp->inbox_x, &pp->recv_x, u->in->data, st->act_n, st->t, st->forwards + 1 < st->M);
    }
    double t0 = dt_now_ms();
    u->tape_lo = dt__ctx.tape_len;
    dt_tensor *y = dt_model_forward_blocks(pp->model, inputs, u->in, st->first, st->end);
    u->sent = 0;
    if (last) {
        const int32_t *labels = st->batch->labels + (size_t)i * st->b * st->labels_per;
        if (st->divisor > 0) dt_cross_entropy_set_divisor(labels, st->divisor / st->M);
        y = dt_cross_entropy(y, labels);
        st->loss_sum += dt_tensor_item(y);
    } else {
        if (y->numel != st->act_n)
            dt_fail("pipeline: stage %d's blocks gave %lld values, %lld expected", pp->stage, (long long)y->numel,
                    (long long)st->act_n);
        u->sent = dt_send_async(pp->to_next, y->data, st->act_n, st->t, 1);
    }
    u->out = y;
    u->tape_hi = dt__ctx.tape_len;
    dt__pp_busy(pp, "forward", i, t0);
    u->kept = (double)(dt__ctx.step[DT_CPU].high + dt__ctx.step[DT_CUDA].high - before);
    st->kept += u->kept;
    st->alive++;
    pp->kept_peak = fmax(pp->kept_peak, st->kept);
    pp->kept_micro = fmax(pp->kept_micro, u->kept);
    if (st->alive > pp->kept_micro_batches) pp->kept_micro_batches = st->alive;
    dt__step_arena_swap(pp->arenas[u->slot]);
    st->forwards++;
}

/* Micro-batch i's backward: from 1/M at the last stage (the batch's loss
   is the micro-batches' mean), else from the gradient the next stage sent;
   its input's gradient sent back; then its arena given back, once what it
   sent is taken (by then the next stage has long had `out`). */
static void dt__pp_backward_one(dt_pp *pp, dt__pp_step *st, int i) {
    dt__pp_micro *u = &st->mb[i];
    dt__step_arena_swap(pp->arenas[u->slot]);
    if (pp->stage == pp->stages - 1) {
        float seed = 1.0f / (float)st->M;
        dt_upload(dt_grad(u->out), &seed, sizeof seed);
    } else
        dt__pp_take(pp, pp->from_next, 1, pp->inbox_g, &pp->recv_g, dt_grad(u->out), st->act_n, st->t, st->backwards + 1 < st->M);
    for (dt_parallel *q = pp->model->parallel; q != &pp->par; q = q->inner)   /* an engine around: the last one syncs */
        if (q->set_sync) q->set_sync(q, st->backwards == st->M - 1);
    double t0 = dt_now_ms();
    dt__backward_span(u->out, u->tape_lo, u->tape_hi);
    dt_comm_handle sent_back = pp->stage > 0 ? dt_send_async(pp->to_prev, dt_grad(u->in), st->act_n, st->t, 0) : 0;
    dt__pp_busy(pp, "backward", i, t0);
    if (sent_back || u->sent) {             /* idle is only ever time spent on a peer: a lone stage has none */
        double t1 = dt_now_ms();
        dt__pp_sent(pp->to_prev, sent_back, "send gradient", t1);
        dt__pp_sent(pp->to_next, u->sent, "send activation", t1);
        dt_synchronize();
        double t2 = dt_now_ms();
        pp->idle_ms += t2 - t1;
        if (t2 - t1 > 0.01) dt__record_event("waiting", t1, t2);
    }
    st->kept -= u->kept;
    st->alive--;
    dt__step_arena_swap(pp->arenas[u->slot]);
    dt__step_arena_release(pp->arenas[u->slot]);
    st->free_slots[st->nfree++] = u->slot;
    st->backwards++;
}

dt_tensor *dt_pp_forward_backward(dt_pp *pp, const dt_batch *batch) {
    int M = pp->micro_batches, B = batch->size, last = pp->stage == pp->stages - 1;
    if (B % M)
        dt_usage_error("--micro-batches %d does not divide --batch-size %d (each micro-batch takes an equal share)", M, B);
    if (pp->model->parallel->grads_pending)         /* the outermost wrapper's: what syncs them */
        dt_fail("dt_pp_forward_backward: the gradients of the last step were not synchronised; call %s before the next step",
                pp->model->parallel->sync_fn);
    if (!dt__ctx.grad_enabled) dt_fail("dt_pp_forward_backward: gradients are off (dt_set_grad_enabled(0)); it trains a step");
    dt__pp_step st = { .batch = batch, .M = M, .b = B / M, .first = pp->first_block[pp->stage],
                       .end = pp->first_block[pp->stage + 1], .t = dt__ctx.compute_dtype,
                       .in_per = batch->inputs->numel / B };
    st.labels_per = dt_model_is_language(pp->model->cfg.kind) ? (int)dt_tensor_cols(batch->inputs) : 1;
    if (dt__ctx.loss_divisor.labels == batch->labels && dt__ctx.loss_divisor.step == dt__ctx.step_resets)
        st.divisor = dt__ctx.loss_divisor.divisor;   /* set for the whole batch: each micro-batch takes 1/M of it */
    dt_tensor micro_inputs = *batch->inputs;
    micro_inputs.shape[0] = st.b;
    micro_inputs.numel = st.in_per * st.b;
    dt__pp_activation_shape(pp, &micro_inputs, st.act);
    st.act_n = (int64_t)st.act[0] * st.act[1];
    pp->act_bytes = (double)st.act_n * (double)dt_dtype_size(st.t);
    /* the order of this stage's actions, and an arena for each micro-batch
       (those never taken at once cost nothing) */
    dt__pp_action *order = (dt__pp_action *)dt_step_alloc(sizeof(dt__pp_action) * 2 * (size_t)M);
    int nactions = dt__pp_schedules[pp->schedule].order(pp->stage, pp->stages, M, order);
    st.mb = (dt__pp_micro *)dt_step_alloc(sizeof(dt__pp_micro) * (size_t)M);
    st.free_slots = (int *)dt_step_alloc(sizeof(int) * (size_t)M);
    if (pp->nslots < M) {
        pp->arenas = (dt__step_arena (*)[2])realloc(pp->arenas, sizeof *pp->arenas * (size_t)M);
        if (!pp->arenas) dt_fail("out of memory (pipeline)");
        memset(pp->arenas + pp->nslots, 0, sizeof *pp->arenas * (size_t)(M - pp->nslots));
        pp->nslots = M;
    }
    for (int k = M - 1; k >= 0; k--) st.free_slots[st.nfree++] = k;
    dt__pp_inboxes(pp, (size_t)st.act_n * dt_dtype_size(st.t));
    if (pp->stage > 0) pp->recv_x = dt_recv_async(pp->from_prev, pp->inbox_x, st.act_n, st.t, 0);   /* posted early */
    if (!last) pp->recv_g = dt_recv_async(pp->from_next, pp->inbox_g, st.act_n, st.t, 1);
    double t_start = dt_now_ms();
    pp->busy_ms = pp->idle_ms = 0;
    pp->kept_peak = pp->kept_micro = 0;
    pp->kept_micro_batches = 0;
    for (int k = 0; k < nactions; k++) {
        if (order[k].backward) dt__pp_backward_one(pp, &st, order[k].micro);
        else dt__pp_forward_one(pp, &st, order[k].micro);
    }
    dt__ctx.tape_len = 0;                   /* every micro-batch's entries are walked */
    /* the batch's loss from the last stage, on every rank: the step's end
       for every stage, so a stage done early waits here -- the drain's part
       of the bubble */
    double t_done = dt_now_ms();
    float mean = last ? (float)(st.loss_sum / M) : 0;
    dt__comm_all_reduce_host(pp->pipe, &mean, 1, DT_SUM);
    double t_end = dt_now_ms();
    if (pp->stages > 1) {
        pp->idle_ms += t_end - t_done;
        if (t_end - t_done > 0.01) dt__record_event("waiting", t_done, t_end);
    }
    pp->step_ms = t_end - t_start;
    /* the stages' times, and the sums their split layers waited for (the
       tensor-parallel wrapper counts a step's, from its step's start) */
    dt_parallel *split = dt_parallel_splitting(pp->par.inner);
    float sums[6] = { (float)pp->busy_ms, (float)pp->idle_ms, (float)pp->step_ms, 0, 0, 0 }, busiest = (float)pp->busy_ms;
    if (split) { sums[3] = (float)split->tp_sums; sums[4] = (float)split->tp_sum_ms; sums[5] = (float)split->tp_sum_bytes; }
    dt__comm_all_reduce_host(pp->pipe, sums, 6, DT_SUM);
    dt__comm_all_reduce_host(pp->pipe, &busiest, 1, DT_MAX);
    pp->pipe_busy_ms = sums[0]; pp->pipe_idle_ms = sums[1]; pp->pipe_step_ms = sums[2]; pp->pipe_busiest_ms = busiest;
    pp->pipe_tp_sums = sums[3]; pp->pipe_tp_sum_ms = sums[4]; pp->pipe_tp_sum_bytes = sums[5];
    int one[1] = { 1 };
    dt_tensor *loss = dt__tensor_alloc(1, one, DT_F32);
    dt_upload(loss->data, &mean, sizeof mean);
    return loss;
}

/* The batch's loss is the last stage's; the gradients of a tied vocabulary
   are the first stage's (the embedding) plus the last's (the head). */
static void dt__pp_sum_tied(dt_parallel *par, int first, int end) {
    dt_pp *p = (dt_pp *)par;
    dt_model *m = p->model;
    if (!p->ends) return;
    double t0 = dt_now_ms();
    int summed = 0;
    for (int i = first; i < end; i++)
        if (m->splits[i].tied) {
            dt_all_reduce(p->ends, m->params[i].grad, m->params[i].grad, m->params[i].numel, DT_F32, DT_SUM);
            summed = 1;
        }
    if (summed) dt__record_comm("all_reduce tied", t0, dt_now_ms(), 0);
}
/* Unwrapped, there is one pipeline and nothing to average; wrapped, the
   engine has summed the tied gradients (sum_shared_grads) when they were whole. */
static void dt__pp_backward_done(dt_parallel *par) {
    if (((dt_pp *)par)->model->parallel == par) dt__pp_sum_tied(par, 0, ((dt_pp *)par)->model->nparams);
}
void dt_pp_sync_grads(dt_pp *pp) {
    if (pp->model->parallel != &pp->par)
        dt_fail("dt_pp_sync_grads: %s wraps this model; call %s, which syncs this one too", pp->model->parallel->create_fn,
                pp->model->parallel->sync_fn);
    if (pp->par.data_ranks > 1)
        dt_fail("dt_pp_sync_grads: %d pipelines each hold the same stages, and nothing averages their gradients; wrap the "
                "model in a data-parallel engine over dt_pp_data_group (dt_data_parallel_create) and sync that",
                pp->par.data_ranks);
    dt_parallel_backward_done(&pp->par);
}
dt_comm *dt_pp_data_group(const dt_pp *pp) { return pp->across; }
int dt_pp_data_rank(const dt_pp *pp) { return pp->par.data_rank; }
int dt_pp_data_ranks(const dt_pp *pp) { return pp->par.data_ranks; }

/* Each stage steps what it holds; the gradient norm adds up the stages'
   parts, the tied vocabulary counted once (at the first stage), and around
   tensor parallelism a whole parameter once per group (the view inside). */
static void dt__pp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_pp *p = (dt_pp *)par;
    dt_model *m = p->model;
    if (par->inner && par->inner->optimizer_view) par->inner->optimizer_view(par->inner, o);   /* a slice per parameter */
    else dt__optimizer_view_all(o, m);
    for (int i = 0; i < m->nparams; i++) o->slices[i].copy |= p->stage > 0 && m->splits[i].tied;
    o->sharded_by = par;
}
static void dt__pp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_pp *)par)->pipe, values, n, DT_SUM);
    if (par->inner && par->inner->sum_over_ranks) par->inner->sum_over_ranks(par->inner, values, n);   /* the tensor group's parts */
}

/* Evaluation and generation: the batch down the pipeline at once (no
   micro-batches: there is no backward to overlap), and the last stage's
   logits to every rank. */
static dt_tensor *dt__pp_forward(dt_parallel *par, dt_tensor *inputs) {
    dt_pp *p = (dt_pp *)par;
    dt_model *m = p->model;
    int last = p->stage == p->stages - 1, act[2];
    dt_dtype t = dt__ctx.compute_dtype;
    if (dt__ctx.grad_enabled)
        dt_fail("dt_model_forward: under pipeline parallelism a training step is dt_pp_forward_backward (the stages take "
                "turns); dt_model_forward runs without gradients only (evaluation, generation)");
    dt__pp_activation_shape(p, inputs, act);
    dt_tensor *x = NULL;
    if (p->stage > 0) {
        x = dt__tensor_alloc(2, act, t);
        dt_recv(p->from_prev, x->data, x->numel, t, 0);
    }
    dt_tensor *y = dt_model_forward_blocks(m, inputs, x, p->first_block[p->stage], p->first_block[p->stage + 1]);
    if (!last) dt_send(p->to_next, y->data, y->numel, t, 1);
    /* the logits' columns: the vocabulary's share of this rank when --tp split it */
    float cols = last ? (float)dt_tensor_cols(y) : 0;
    dt__comm_all_reduce_host(p->pipe, &cols, 1, DT_SUM);
    if (!last) {
        int shape[2] = { inputs->shape[0] * (dt_model_is_language(m->cfg.kind) ? (int)dt_tensor_cols(inputs) : 1), (int)cols };
        y = dt__tensor_alloc(2, shape, t);
        if ((int)cols != m->cfg.classes) y->parallel = dt_parallel_splitting(par);   /* dt_logits_to_host gathers them */
    }
    dt_broadcast(p->pipe, y->data, y->numel, t, p->stages - 1);
    return y;
}

/* A one-way pair for each neighbour: `round` 0 pairs stages (0, 1), (2, 3)
   ..., round 1 pairs (1, 2), (3, 4) ...; a rank in no pair of a round is a
   group of its own, freed at once. */
static void dt__pp_pair(dt_pp *p, int round, dt_comm **with_next, dt_comm **with_prev) {
    int s = p->stage, P = p->stages;
    int j = (s % 2 == round) ? s : s - 1;       /* the boundary (j, j + 1) this rank is on this round */
    int paired = j >= 0 && j + 1 < P;
    dt_comm *c = dt_comm_split(p->pipe, paired ? j : P + s, s);
    if (!paired) { dt_comm_free(c); return; }
    if (j == s) *with_next = c;
    else *with_prev = c;
}

dt_pp *dt_pp_create(dt_model *model, dt_comm *comm, int pp, int micro_batches, dt_pp_schedule schedule) {
    int world = dt_comm_size(comm);
    char v[64];
    snprintf(v, sizeof v, "%d %d %d", pp, micro_batches, (int)schedule);
    dt_comm_check_agree(comm, "--pp --micro-batches --schedule", v);
    if (model->parallel && (!model->parallel->whole || model->parallel->forward))   /* DDP, FSDP, a pipeline: outside it */
        dt_fail("dt_pp_create: %s already wraps this model; a pipeline cuts the model first (or after tensor parallelism), "
                "and a data-parallel engine wraps it after", model->parallel->create_fn);
    if (model->parallel && model->parallel->data_ranks > 0 && world != model->parallel->data_ranks)
        dt_fail("dt_pp_create: its communicator has %d ranks, but %d groups of %s hold the same pieces: give it the ranks "
                "that hold this rank's pieces (dt_tp_data_group)", world, model->parallel->data_ranks,
                model->parallel->create_fn);
    const dt_parallel *split = dt_parallel_splitting(model->parallel);      /* comm: one rank of each tensor group */
    const char *over = split ? " over --tp" : "";
    if (pp <= 0) pp = world;
    if (world % pp)
        dt_usage_error("--pp %d does not divide the job's %d ranks%s (the ranks form pipelines of --pp stages%s, data parallel "
                       "across them)", pp, world * (split ? split->tp_size : 1), over, split ? " of --tp ranks each" : "");
    if (micro_batches < 1) dt_usage_error("--micro-batches %d: a step needs at least one", micro_batches);
    if ((int)schedule < 0 || (int)schedule >= (int)(sizeof dt__pp_schedules / sizeof dt__pp_schedules[0]))
        dt_fail("dt_pp_create: schedule %d is not one dtrain knows", (int)schedule);
    if (model->base) dt_usage_error("--lora-rank: LoRA's adapters are not split into pipeline stages; train them with 03-05");
    int n = dt_model_blocks(model);
    if (n < pp)
        dt_usage_error("--pp %d: the model has %d block%s (--depth), fewer than the stages, and each stage runs at least one",
                       pp, n, n == 1 ? "" : "s");
    dt_pp *p = (dt_pp *)calloc(1, sizeof *p);
    if (!p) dt_fail("out of memory (pipeline parallelism)");
    p->par = (dt_parallel){ .create_fn = "dt_pp_create", .sync_fn = "dt_pp_sync_grads", .free_fn = "dt_pp_free",
                            .backward_done = dt__pp_backward_done, .sum_shared_grads = dt__pp_sum_tied,
                            .optimizer_view = dt__pp_optimizer_view, .sum_over_ranks = dt__pp_sum_over_ranks,
                            .forward = dt__pp_forward,
                            .inner = model->parallel };       /* around tensor parallelism: its pieces, cut into stages */
    dt_model_set_parallel(model, &p->par);
    dt__comm_hold(comm, "dt_pp_free");
    p->model = model;
    p->comm = comm;
    int sizes[2] = { world / pp, pp };
    const char *names[2] = { "dp", "pp" };
    p->mesh = dt_mesh_create(comm, 2, sizes, names);
    p->pipe = dt_mesh_comm(p->mesh, "pp");
    p->across = dt_mesh_comm(p->mesh, "dp");
    p->stages = pp;
    p->stage = dt_mesh_coord(p->mesh, "pp");
    p->micro_batches = micro_batches;
    p->schedule = schedule;
    p->par.data_rank = dt_mesh_coord(p->mesh, "dp");
    p->par.data_ranks = world / pp;
    p->first_block = (int *)malloc(sizeof(int) * (size_t)(pp + 1));
    if (!p->first_block) dt_fail("out of memory (pipeline parallelism)");
    dt__pp_balance(model, pp, p->first_block);
    dt__model_cut(model, &p->whole, dt__pp_cut_shape, dt__pp_scatter, p);
    p->par.whole = p->par.inner ? p->par.inner->whole : &p->whole;   /* what checkpoints hold: the model whole */
    for (int round = 0; round < 2 && pp > 1; round++) {      /* activations on, then gradients back */
        dt__pp_pair(p, round, &p->to_next, &p->from_prev);
        dt__pp_pair(p, round, &p->from_next, &p->to_prev);
    }
    int tied = 0;
    for (int i = 0; i < model->nparams; i++) tied |= model->splits[i].tied;
    if (tied && pp > 1) {
        int end = p->stage == 0 || p->stage == pp - 1;
        p->ends = dt_comm_split(p->pipe, end ? 0 : 1 + p->stage, p->stage);
        if (!end) { dt_comm_free(p->ends); p->ends = NULL; }
    }
    return p;
}

void dt_pp_free(dt_pp *pp) {
    if (!pp) return;
    dt__data_parallel_unwrap(pp->model, &pp->par);        /* the wrapper inside, if any, holds the model again */
    dt_comm *mine[5] = { pp->ends, pp->to_next, pp->from_next, pp->to_prev, pp->from_prev };
    for (int k = 0; k < 5; k++) if (mine[k]) dt_comm_free(mine[k]);
    pp->model->left_cut_by = "dt_pp_free";   /* each rank keeps its stage: the model can only be freed now */
    for (int k = 0; k < pp->nslots; k++) dt__step_arena_free(pp->arenas[k]);
    free(pp->arenas);
    dt_free_on(pp->model->device, DT_ARENA_COMM, pp->inbox_x, pp->inbox_bytes);
    dt_free_on(pp->model->device, DT_ARENA_COMM, pp->inbox_g, pp->inbox_bytes);
    dt_mesh_free(pp->mesh);
    dt__comm_release(pp->comm);
    free(pp->first_block);
    free(pp->whole.params);
    free(pp->whole.offsets);
    free(pp);
}

//@ for the machinery
/* ---- what the machinery asks of pipeline parallelism (the run driver's dt_parallel_report) ----
   A checkpoint holds the model whole: the stages' parameters (and, with
   --tp, their pieces) gathered to the job's rank 0; the memory table shows
   each stage's share; the log, --bench and the cost model get the step's
   bubble and balance, measured. */
static double dt__pp_stage_params(const dt_pp *p, int stage) {
    double held = 0;
    for (int i = 0; i < p->model->nparams; i++) if (dt__pp_holds(p, stage, i)) held += (double)p->whole.params[i].numel;
    return held;
}

static int dt__pp_owner(const dt_pp *p, int i) {     /* the first stage that holds parameter i */
    for (int s = 0; s < p->stages; s++) if (dt__pp_holds(p, s, i)) return s;
    return 0;
}

/* A model cut so that each parameter is whole on one rank of `group` (its
   owner: a pipeline's stages, expert parallelism's experts): the whole
   state (`whole` lays it out) at the group's first rank, which writes it,
   from each rank's `local` (laid out as the cut model m) -- each owner sends
   its parameters there, one tensor at a time. The other ranks get NULL. */
static float *dt__state_from_owners(dt_comm *group, const dt_model *m, const dt_model *whole_layout, float *local,
                                    int (*owner_of)(const void *wrapper, int i), const void *wrapper, const char *what) {
    const dt_model *W = whole_layout;
    int me = dt_comm_rank(group);
    float *whole = NULL;
    if (me == 0 && !(whole = (float *)malloc((size_t)W->numel * sizeof(float) + 1)))
        dt_fail("out of memory (gathering %s for a checkpoint: %.1f MB)", what, W->numel * 4e-6);
    for (int i = 0; i < m->nparams; i++) {
        int owner = owner_of(wrapper, i);
        int64_t n = W->params[i].numel;
        size_t bytes = (size_t)n * sizeof(float);
        if (owner == 0) {
            if (whole) dt__download_from(m->device, whole + W->offsets[i], local + m->offsets[i], bytes);
        } else if (me == owner) dt_send(group, local + m->offsets[i], n, DT_F32, 0);
        else if (whole) {
            float *buf = (float *)dt_alloc_on(m->device, DT_ARENA_COMM, bytes);
            dt_recv(group, buf, n, DT_F32, owner);
            dt__download_from(m->device, whole + W->offsets[i], buf, bytes);
            dt_free_on(m->device, DT_ARENA_COMM, buf, bytes);
        }
    }
    return whole;
}
/* Checkpoints are whole (the checkpoints chapter): to save, the first pipeline's stages
   send what they hold to its first rank, and that rank -- the job's rank 0
   -- writes; to load, every rank reads the whole and keeps its stage's. */
static int dt__pp_owner_of(const void *wrapper, int i) { return dt__pp_owner((const dt_pp *)wrapper, i); }
static float *dt__pp_state_gather(dt_pp *p, float *local) {
    return dt__state_from_owners(p->pipe, p->model, &p->whole, local, dt__pp_owner_of, p, "the pipeline's stages");
}

/* The whole state from this rank's stage (`local`, laid out as the cut
   model): the stages' gathered at the first, and around tensor parallelism
   their pieces then gathered over its group by the report inside (and, to
   load, cut the other way). For an engine around this one too (FSDP). */
static float *dt__pp_whole_from_local(dt_parallel *par, const dt_model *layout, float *local) {
    dt_pp *p = (dt_pp *)par;
    (void)layout;                           /* this stage's: the model as cut */
    if (p->par.data_rank != 0) return NULL; /* the pipelines hold the same: the first one writes */
    float *staged = dt__pp_state_gather(p, local);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (!in || !in->whole_from_local || p->stage != 0) return staged;
    size_t bytes = (size_t)p->whole.numel * sizeof(float);
    float *pieces = (float *)dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    dt__upload_to(p->model->device, pieces, staged, bytes);
    free(staged);
    float *whole = in->whole_from_local(who, &p->whole, pieces);
    dt_free_on(p->model->device, DT_ARENA_COMM, pieces, bytes);
    return whole;
}
static void dt__pp_local_from_whole(dt_parallel *par, const dt_model *layout, float *whole, float *local) {
    dt_pp *p = (dt_pp *)par;
    (void)layout;
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (!in || !in->local_from_whole) { dt__pp_scatter(p, whole, local); return; }
    size_t bytes = (size_t)p->whole.numel * sizeof(float);
    float *pieces = (float *)dt_alloc_on(p->model->device, DT_ARENA_COMM, bytes);
    in->local_from_whole(who, &p->whole, whole, pieces);
    float *view = dt__host_view(p->model->device, pieces, p->whole.numel);
    dt__pp_scatter(p, view, local);
    dt__host_view_close(p->model->device, view, pieces, p->whole.numel, 0);
    dt_free_on(p->model->device, DT_ARENA_COMM, pieces, bytes);
}
/* At start-up: which blocks each stage runs, and what it holds. */
static void dt__pp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_pp *p = (const dt_pp *)par;
    const dt_model *m = p->model;
    int n = dt_model_blocks(m);
    printf("pipeline, --pp %d: %d stages, %d micro-batch%s per step, schedule %s (bubble (P - 1) / (M + P - 1) = %.0f%%); "
           "%d data-parallel pipeline%s\n", p->stages, p->stages, p->micro_batches, p->micro_batches > 1 ? "es" : "",
           dt__pp_schedules[p->schedule].name, 100.0 * (p->stages - 1) / (p->micro_batches + p->stages - 1),
           p->par.data_ranks, p->par.data_ranks > 1 ? "s" : "");
    int embedding = 0;                      /* the mlp has none: its first layer is a block */
    for (int i = 0; i < m->nparams; i++) embedding |= m->splits[i].block < 0;
    for (int s = 0; s < p->stages; s++) {
        double held = dt__pp_stage_params(p, s);
        int a = p->first_block[s], b = p->first_block[s + 1];
        char blocks[48];
        if (b - a > 1) snprintf(blocks, sizeof blocks, "blocks %d-%d", a, b - 1);
        else snprintf(blocks, sizeof blocks, "block %d", a);
        printf("  stage %d: %s%s%s  %.3f MB of parameters (%.3f MB with gradients and %s state)\n", s,
               s == 0 && embedding ? "the embedding, " : "", blocks, s == p->stages - 1 ? ", the head" : "", 4e-6 * held,
               4e-6 * held * (o->v ? 4 : 3), o->v ? "adamw's" : "sgd's");
    }
    const dt_parallel *split = dt_parallel_splitting(par->inner);
    if (split)
        printf("  each stage's blocks split over --tp %d ranks as in stage 06: the sizes above are one rank's pieces\n",
               split->tp_size);
    dt_parallel *who;
    if (m->parallel != par && p->par.data_ranks > 1)        /* DDP has no table; FSDP's is above */
        printf("  the %d pipelines' copies of each stage: %s\n", p->par.data_ranks,
               dt_parallel_report_of(m->parallel, &who) && who != par ? "sharded as FSDP's table above says"
                                                                       : "each whole, their gradients averaged (DDP)");
    printf("  the whole model: %.3f MB of parameters, %d blocks\n", 4e-6 * (double)par->whole->numel, n);
    fflush(stdout);
}

/* The last step's figures: the pipeline's bubble, its stages' idle time
   over their time in the pipeline (each stage waits its own share: the
   first more, when the last, with the head, computes more); how uneven the
   stages are, the busiest one's compute over the mean (1: even). */
static double dt__pp_bubble(const dt_pp *p) { return p->pipe_step_ms > 0 ? p->pipe_idle_ms / p->pipe_step_ms : 0; }
static double dt__pp_balance_of(const dt_pp *p) {
    return p->pipe_busy_ms > 0 ? p->pipe_busiest_ms * p->stages / p->pipe_busy_ms : 1;
}

/* The cost model's view of it: the whole model's compute on one rank is
   what the stages computed together -- with --tp, less the time their
   layers' sums took, and times the T ranks that shared each stage's split
   layers. */
/* Around tensor parallelism: its group's size (0: none) and the share of the
   parameters it splits, from the report inside. */
static int dt__pp_tp_share(const dt_parallel *par, double *share) {
    const dt_parallel *split = dt_parallel_splitting(par->inner);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    dt_cost_input mine = { 0 };
    *share = 0;
    if (!split || !in || !in->cost_input) return 0;
    in->cost_input(who, &mine);
    *share = mine.tp_share;
    return split->tp_size;
}
static int dt__pp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_pp *p = (const dt_pp *)par;
    in->kind = DT_PAR_PP;
    in->pp_micro_batches = p->micro_batches;
    in->pp_balance = dt__pp_balance_of(p);
    in->pp_bytes = p->act_bytes;
    in->pp_measured_bubble = dt__pp_bubble(p);
    in->compute_ms = p->pipe_busy_ms;
    in->dp_groups = p->par.data_ranks;
    int64_t stepped = p->model->numel;      /* the optimizer's share of the whole model (an engine around: times its ranks) */
    in->optimizer_ms *= stepped > 0 ? (double)par->whole->numel / (double)stepped : 1;
    double share;
    int T = dt__pp_tp_share(par, &share);
    if (T) {
        in->tp_ranks = T;
        in->tp_share = share;
        in->tp_sums = p->pipe_tp_sums / p->micro_batches;
        in->tp_bytes = p->pipe_tp_sums > 0 ? p->pipe_tp_sum_bytes / p->pipe_tp_sums : 0;
        double kept = share / T + (1 - share);
        in->compute_ms = fmax(0, p->pipe_busy_ms - p->pipe_tp_sum_ms) / kept;
    }
    return p->stages;
}

static void dt__pp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_pp *p = (const dt_pp *)par;
    (void)accum_steps;
    fprintf(out, " pp=%d pp_micro_batches=%d pp_balance=%.4f pp_bytes=%.0f bubble=%.4f bubble_predicted=%.4f", p->stages,
            p->micro_batches, dt__pp_balance_of(p), p->act_bytes, dt__pp_bubble(p),
            (p->stages - 1.0) / (p->micro_batches + p->stages - 1.0));
    double share;
    int T = dt__pp_tp_share(par, &share);
    if (T)            /* the whole pipeline's layer sums per micro-batch, as the cost model counts them */
        fprintf(out, " tp=%d tp_share=%.4f tp_sums=%.1f tp_bytes=%.0f", T, share, p->pipe_tp_sums / p->micro_batches,
                p->pipe_tp_sums > 0 ? p->pipe_tp_sum_bytes / p->pipe_tp_sums : 0.0);
    fprintf(out, " dp=%d", p->par.data_ranks);
}

/* The step's pipeline figures, in its --log record. */
static void dt__pp_log_fields(const dt_parallel *par, FILE *log) {
    const dt_pp *p = (const dt_pp *)par;
    double P = p->stages, M = p->micro_batches;
    fprintf(log, ",\"pp_busy_ms\":%.3f,\"pp_idle_ms\":%.3f,\"pp_step_ms\":%.3f,\"bubble\":%.4f,\"bubble_predicted\":%.4f,"
                 "\"pp_balance\":%.4f,\"pp_kept_bytes\":%.0f,\"pp_micro_bytes\":%.0f,\"pp_kept_micro_batches\":%d",
            p->busy_ms, p->idle_ms, p->step_ms, dt__pp_bubble(p), (P - 1) / (M + P - 1), dt__pp_balance_of(p), p->kept_peak,
            p->kept_micro, p->kept_micro_batches);
}

const dt_parallel_report dt__pp_report = {
    .create_fn = "dt_pp_create",
    .memory_table = dt__pp_memory_table, .log_fields = dt__pp_log_fields, .cost_input = dt__pp_cost_input,
    .bench_fields = dt__pp_bench_fields, .whole_from_local = dt__pp_whole_from_local,
    .local_from_whole = dt__pp_local_from_whole,
};
