//@ lesson: fully sharded data parallel -- ZeRO-1/2/3: optimizer state, gradients and parameters sharded; CPU offload
/* ---- fully sharded data parallel --------------------------------------------- */

/* Fully sharded data parallel (stages 04-05, and the engine of 06-07 with
   --shard): like DDP, but no rank keeps the
   whole model. Each unit's parameters are one flat buffer padded to a multiple
   of N; rank r keeps elements [r, r + 1) * size/N of it -- its shard -- and the
   optimizer state of that shard only. The mode chooses what is sharded, as the
   ZeRO paper's stages do:
     DT_SHARD_OPTIMIZER  optimizer state (ZeRO-1): gradients reduce-scattered
                         after backward, each rank steps its shard, the new
                         parameters are all-gathered
     DT_SHARD_GRADS      + gradients (ZeRO-2): each unit's gradients are
                         reduce-scattered as soon as its backward is done
                         (the outer unit's after backward, with the rest of
                         the step's sums)
     DT_SHARD_FULL       + parameters (ZeRO-3): a unit is all-gathered just
                         before its forward, freed after it, gathered again
                         just before its backward; the next unit's all-gather
                         is started while one computes (prefetch), and the
                         last unit stays gathered from its forward into its
                         backward, which needs it first
   Checkpoints of a sharded model are sharded too (the checkpoints chapter). */
typedef enum { DT_SHARD_NONE = -1, DT_SHARD_OPTIMIZER = 0, DT_SHARD_GRADS = 1, DT_SHARD_FULL = 2 } dt_shard_mode;   /* NONE: 06's and 07's default (DDP) */
typedef struct dt_fsdp dt_fsdp;
/* Broadcast rank 0's parameters, keep this rank's shards, free the rest. The
   optimizer, created after this, holds the shard's state only. cpu_offload:
   the shards and the optimizer state live in host memory, the optimizer steps
   on the CPU, and a unit's shard is copied to the device just before its
   all-gather (on a CPU-only run, between the device and host arenas). */
dt_fsdp *dt_fsdp_create(dt_model *model, dt_comm *comm, dt_shard_mode mode, int cpu_offload);
/* After backward: DT_SHARD_OPTIMIZER reduce-scatters every gradient now; the
   other modes did it unit by unit during backward, all but the outer unit's,
   which they reduce-scatter now (after what the wrappers inside add up). */
void dt_fsdp_sync_grads(dt_fsdp *fsdp);
/* Gradient accumulation (stage 05), as dt_ddp_set_sync: with sync 0 no unit is
   reduce-scattered, and each unit's whole gradient adds up in a buffer of the
   model's size (PyTorch's FSDP no_sync() keeps unsharded gradients too: fewer
   collectives, paid for in memory); the next synchronised backward
   reduce-scatters the sums. */
void dt_fsdp_set_sync(dt_fsdp *fsdp, int sync);
/* Reduce-scatter gradients in this dtype (default f32), as PyTorch's
   MixedPrecision(reduce_dtype=...). Parameters are gathered in the compute
   dtype that was set when dt_fsdp_create ran (the mixed-precision chapter). */
void dt_fsdp_set_reduce_dtype(dt_fsdp *fsdp, dt_dtype dtype);
/* ZeRO++ (Wang et al. 2023): across machines a sharded step is limited by the
   network, which every weight crosses twice (forward and backward gathers)
   and every gradient once. Three levers cut those bytes:
     quantize_weights 8   qwZ: a unit's shards travel as int8, one scale per
                          block of quant_block values, dequantized on arrival
     hierarchical 1       hpZ: each machine keeps a second copy of every unit,
                          cut over its own ranks (1/L each, L ranks a machine)
                          from the forward gather, so the backward gather
                          never leaves the machine
     quantize_grads 8, 4  qgZ: gradients quantized, exchanged within the
                          machine (all-to-all), summed, quantized again,
                          exchanged across machines, summed: each rank gets
                          its shard of the mean, and only 1/L of them crosses
   Machines are the launcher's (dt_comm_machine), or every ranks_per_machine
   consecutive ranks of comm (a lesson on one machine; alone, it changes only how
   the bytes are counted). Weight levers need DT_SHARD_FULL (the gathers
   they change); the gradient lever any mode. Set before the first forward;
   all zero changes nothing. Checkpoints stay f32. */
typedef struct dt_zeropp {
    int quantize_weights, quantize_grads, hierarchical, quant_block, ranks_per_machine;
} dt_zeropp;
void dt_fsdp_set_zeropp(dt_fsdp *fsdp, dt_zeropp zeropp);
void dt_fsdp_free(dt_fsdp *fsdp);

/* The data-parallel engine a stage applies last, over the ranks that hold
   the same model or the same pieces of it (06: around tensor parallelism,
   over dt_tp_data_group; 07: around a pipeline, over dt_pp_data_group): DDP
   when nothing is sharded (DT_SHARD_NONE, with bucket_mb), else FSDP in that
   mode, with cpu_offload. Create it before the optimizer, sync after
   backward (it syncs the wrappers inside it too), free it before what it
   wraps. */
typedef struct dt_data_parallel dt_data_parallel;
dt_data_parallel *dt_data_parallel_create(dt_model *model, dt_comm *comm, dt_shard_mode shard, int cpu_offload,
                                          double bucket_mb);
void dt_data_parallel_sync_grads(dt_data_parallel *dp);
/* ZeRO++ (dt_fsdp_set_zeropp) when it shards; DDP refuses any lever. */
void dt_data_parallel_set_zeropp(dt_data_parallel *dp, dt_zeropp zeropp);
void dt_data_parallel_free(dt_data_parallel *dp);

//@ implementation

/* -- Fully sharded data parallel -- */
typedef struct dt__fsdp_unit {
    int first, end;             /* its parameters: first .. end - 1 */
    int64_t offset, numel;      /* where it sits in the model's parameter order */
    int64_t shard;              /* elements per rank: numel rounded up to a multiple of world, / world */
    int64_t shard_offset;       /* where its shard starts in this rank's flat shard buffers */
    int64_t accum_offset;       /* where its whole gradient adds up while accumulating (no-sync) */
    void *full;                 /* [shard * world] gathered parameters, in the compute dtype */
    float *full_grad;           /* [shard * world] their gradients, f32 */
    dt_comm_handle gathering;   /* an all-gather in flight (a prefetch), or 0 */
    dt_comm *gathered_over;     /* its communicator */
    int gather_how;             /* ZeRO++: DT__GATHER_PLAIN, _QUANTIZED or _SECONDARY */
    int64_t second_offset;      /* hpZ: where its 1/L sits in `second`, in elements */
} dt__fsdp_unit;
enum { DT__GATHER_PLAIN, DT__GATHER_QUANTIZED, DT__GATHER_SECONDARY };

struct dt_fsdp {
    dt_parallel par;            /* first: the model's dt_parallel * is this dt_fsdp */
    dt_model *model;
    dt_comm *comm;
    dt_shard_mode mode;
    int offload;                /* shards and optimizer state in host memory */
    int pipelined;              /* a pipeline inside runs M forwards and backwards a step */
    int rank, world, nunits;
    dt__fsdp_unit *units;
    float *shard_params, *shard_grads;   /* this rank's slice of every unit, one after another */
    int64_t shard_numel;
    /* Buffers made once and reused by every unit: a malloc per unit per step
       costs page faults on a CPU, and a cudaFree synchronises the whole GPU.
       At most two neighbouring units are gathered at once, so two parameter
       buffers serve all of them (unit k takes buffer k % 2), and one gradient
       buffer, as backward does one unit at a time. Offloaded shards are
       uploaded into staging buffers, by the same rule. The model's outer unit
       (dt_model.outer_unit), gathered from the start of forward to the end of
       backward, has buffers of its own: slot 2, and outer_grad. */
    void *gathered[3];
    float *gathered_grad, *outer_grad, *staged[3], *scattered;
    int holder[3];                       /* the unit in each parameter buffer, or -1 */
    size_t largest, largest_shard;       /* f32 bytes: the largest unit, gathered, and its shard */
    int64_t prefetched;                  /* units that were already on their way when needed */
    /* Stage 05. Mixed precision: parameters are gathered in param_dtype (the
       compute dtype), each rank first narrowing its f32 shard into send16;
       gradients are reduce-scattered in reduce_dtype through grad16 and
       scattered16. Accumulation: with sync 0 nothing is reduce-scattered and
       the units' whole gradients add up in `accum`. */
    dt_dtype param_dtype, reduce_dtype;
    void *send16[3], *grad16, *scattered16;
    int sync;
    float *accum;
    int64_t accum_numel;
    /* ZeRO++ (dt_fsdp_set_zeropp). The ranks as a grid of H machines x L
       ranks: `local` the L on this machine, `cross` the H at this place on
       every machine; owner[h * L + l] is the rank at place l of machine h. */
    dt_zeropp zpp;
    int zpp_set, forwards;
    dt_comm *local, *cross;
    int L, H, place, machine, ring_crossings;
    int owner[DT_MAX_RANKS], machine_of[DT_MAX_RANKS];
    void *second;                        /* hpZ: this rank's 1/L of every unit, as the forward gathered it */
    int64_t second_numel;
    void *qsend[3], *qcross[3], *qall[3];   /* qwZ, per slot: my shard, the H of my place, all W (quantized) */
    void *gq_send, *gq_recv;             /* qgZ: W quantized chunks out and in */
    float *gpart;                        /* qgZ: H partial sums of this place's chunks */
    size_t qw_bytes, qg_bytes;           /* the largest shard quantized, by each lever */
    /* bytes a step moves, the whole job's (a collective's every link), within
       machines and across them; the last finished step's in step_* */
    double bytes_within, bytes_across, step_bytes_within, step_bytes_across;
};

static size_t dt__fsdp_full_bytes(const dt_fsdp *f, const dt__fsdp_unit *u) { return (size_t)(u->shard * f->world) * sizeof(float); }
static size_t dt__fsdp_param_bytes(const dt_fsdp *f, const dt__fsdp_unit *u) {
    return (size_t)(u->shard * f->world) * dt_dtype_size(f->param_dtype);
}
static size_t dt__fsdp_largest_params(const dt_fsdp *f) { return f->largest / sizeof(float) * dt_dtype_size(f->param_dtype); }
/* Which of the reused buffers unit k takes: neighbours alternate, the outer unit has its own. */
static int dt__fsdp_slot(const dt_fsdp *f, int k) { return k == f->model->outer_unit ? 2 : k % 2; }

/* Unit k's slice of a shard buffer where the collectives can read it: the
   buffer itself, or, offloaded, a copy uploaded into the staging buffer of its slot. */
static float *dt__fsdp_shard_on_device(dt_fsdp *f, const float *shards, int k) {
    const dt__fsdp_unit *u = &f->units[k];
    if (!f->offload) return (float *)shards + u->shard_offset;
    dt_upload(f->staged[dt__fsdp_slot(f, k)], shards + u->shard_offset, (size_t)u->shard * sizeof(float));
    return f->staged[dt__fsdp_slot(f, k)];
}
/* Unit k's shard as the all-gather sends it: in the compute dtype, which under
   mixed precision is a 16-bit copy (send16, one per neighbouring unit). */
static const void *dt__fsdp_send_buffer(dt_fsdp *f, int k) {
    float *mine = dt__fsdp_shard_on_device(f, f->shard_params, k);
    if (f->param_dtype == DT_F32) return mine;
    dt_convert(mine, DT_F32, f->send16[dt__fsdp_slot(f, k)], f->param_dtype, f->units[k].shard);
    return f->send16[dt__fsdp_slot(f, k)];
}
/* A unit's whole parameters from f32 host values, in the compute dtype. */
static void dt__fsdp_fill_params(dt_fsdp *f, dt__fsdp_unit *u, const float *host) {
    if (f->param_dtype == DT_F32) { dt_upload(u->full, host, (size_t)u->numel * sizeof(float)); return; }
    uint16_t *h = (uint16_t *)malloc((size_t)u->numel * 2 + 1);
    if (!h) dt_fail("out of memory");
    dt__f32_to_half_cpu(host, h, f->param_dtype, u->numel);
    dt_upload(u->full, h, (size_t)u->numel * 2);
    free(h);
}
/* Host values into a shard buffer: a copy when offloaded, else an upload. */
static void dt__fsdp_put(dt_fsdp *f, float *dst, const float *host, int64_t n) {
    if (n <= 0) return;
    if (f->offload) memcpy(dst, host, (size_t)n * sizeof(float));
    else dt_upload(dst, host, (size_t)n * sizeof(float));
}

/* Point the unit's parameters (or their f32 gradients) into a gathered buffer,
   or nowhere. Gathered parameters are in the compute dtype. */
static void dt__fsdp_point(dt_fsdp *f, dt__fsdp_unit *u, int grads, void *buf) {
    for (int i = u->first; i < u->end; i++) {
        dt_tensor *p = &f->model->params[i];
        int64_t at = f->model->offsets[i] - u->offset;
        if (grads) p->grad = buf ? (float *)buf + at : NULL;
        else {
            p->dtype = f->param_dtype;
            p->data = buf ? (float *)((char *)buf + at * dt_dtype_size(f->param_dtype)) : NULL;
        }
    }
}

/* -- ZeRO++: the quantized and hierarchical ways a unit travels -- */
/* What a collective moves, counted as a ring moves it (each of a group's n
   links carries (n - 1) / n of the whole), for the whole job: `groups` groups
   of n ranks, `crossing` of each group's links between machines. */
static void dt__fsdp_count(dt_fsdp *f, double whole_bytes, int n, int groups, int crossing) {
    if (!dt__ctx.grad_enabled || n < 2) return;             /* (evaluation's gathers are not a step's) */
    double per_link = whole_bytes * (n - 1) / n;
    f->bytes_across += per_link * crossing * groups;
    f->bytes_within += per_link * (n - crossing) * groups;
}
static void dt__fsdp_count_flat(dt_fsdp *f, double whole_bytes) { dt__fsdp_count(f, whole_bytes, f->world, 1, f->ring_crossings); }

static size_t dt__zpp_qbytes(const dt_fsdp *f, int64_t n, int bits) { return (size_t)dt_quantized_bytes(n, bits, f->zpp.quant_block); }
/* qwZ, started: this rank's shard quantized, gathered from the H ranks at
   this place on every machine (the only bytes that cross). */
static dt_comm_handle dt__zpp_gather_start(dt_fsdp *f, int k, const float *shard) {
    dt__fsdp_unit *u = &f->units[k];
    int slot = dt__fsdp_slot(f, k);
    size_t qb = dt__zpp_qbytes(f, u->shard, f->zpp.quantize_weights);
    dt_quantize(shard, u->shard, f->zpp.quantize_weights, f->zpp.quant_block, f->qsend[slot]);
    dt__fsdp_count(f, (double)qb * f->H, f->H, f->L, f->H > 1 ? f->H : 0);
    u->gathered_over = f->cross;
    return dt_all_gather_async(f->cross, f->qsend[slot], f->qcross[slot], (int64_t)(qb / 4), DT_F32);
}
/* qwZ, finished: the H pieces gathered over the machine too, each piece
   dequantized into its owner's place in the unit. */
static void dt__zpp_gather_finish(dt_fsdp *f, int k) {
    dt__fsdp_unit *u = &f->units[k];
    int slot = dt__fsdp_slot(f, k);
    size_t qb = dt__zpp_qbytes(f, u->shard, f->zpp.quantize_weights), es = dt_dtype_size(f->param_dtype);
    dt_all_gather(f->local, f->qcross[slot], f->qall[slot], (int64_t)(qb * f->H / 4), DT_F32);
    dt__fsdp_count(f, (double)qb * f->H * f->L, f->L, f->H, 0);
    for (int l = 0; l < f->L; l++)
        for (int h = 0; h < f->H; h++)
            dt_dequantize((char *)f->qall[slot] + (size_t)(l * f->H + h) * qb, u->shard, f->zpp.quantize_weights,
                          f->zpp.quant_block, (char *)u->full + (size_t)(f->owner[h * f->L + l] * u->shard) * es,
                          f->param_dtype, 0);
}
/* hpZ: the machine's place-th 1/L of a unit just gathered in forward, kept
   for its backward gather (a copy: the same values, from nearer). */
static void dt__zpp_keep_second(dt_fsdp *f, dt__fsdp_unit *u) {
    int64_t piece = u->shard * f->H;
    size_t es = dt_dtype_size(f->param_dtype);
    dt_convert((char *)u->full + (size_t)(f->place * piece) * es, f->param_dtype, (char *)f->second + (size_t)u->second_offset * es,
               f->param_dtype, piece);
}
static dt_comm_handle dt__zpp_gather_second(dt_fsdp *f, dt__fsdp_unit *u) {
    int64_t piece = u->shard * f->H;
    size_t es = dt_dtype_size(f->param_dtype);
    dt__fsdp_count(f, (double)piece * f->L * es, f->L, f->H, 0);
    u->gathered_over = f->local;
    return dt_all_gather_async(f->local, (char *)f->second + (size_t)u->second_offset * es, u->full, piece, f->param_dtype);
}
/* qgZ: this rank's shard of the unit's mean gradient, into `mine`. Chunk c
   of the unit is rank c's shard. The chunks of the ranks at place l on every
   machine go, quantized, to this machine's place-l rank, which sums what the
   L ranks sent (in place order: the same bits every run), quantizes the H
   sums again and sends each to its owner across the machines; the owner sums
   the H and divides by the world. One rank a machine, or one machine: that
   level is a plain copy, not quantized. */
static void dt__zpp_reduce_scatter(dt_fsdp *f, dt__fsdp_unit *u, float *mine) {
    int bits = f->zpp.quantize_grads, block = f->zpp.quant_block, L = f->L, H = f->H;
    int64_t n = u->shard;
    size_t qb = dt__zpp_qbytes(f, n, bits), fb = (size_t)n * sizeof(float);
    int64_t counts[2 * DT_MAX_RANKS];
    dt_device dev = f->model->device;
    dt__zero_on(dev, f->gpart, fb * (size_t)H);
    if (L > 1) {
        for (int l = 0; l < L; l++)
            for (int h = 0; h < H; h++)
                dt_quantize(u->full_grad + (int64_t)f->owner[h * L + l] * n, n, bits, block, (char *)f->gq_send + (size_t)(l * H + h) * qb);
        for (int r = 0; r < 2 * L; r++) counts[r] = (int64_t)(qb * H / 4);
        dt_all_to_all(f->local, f->gq_send, counts, f->gq_recv, counts + L, DT_F32);
        dt__fsdp_count(f, (double)qb * H * L, L, H, 0);
        for (int l = 0; l < L; l++)                   /* what each rank of the machine sent, in place order */
            for (int h = 0; h < H; h++)
                dt_dequantize((char *)f->gq_recv + (size_t)(l * H + h) * qb, n, bits, block, f->gpart + (int64_t)h * n, DT_F32, 1);
    } else
        for (int h = 0; h < H; h++) dt_convert(u->full_grad + (int64_t)f->owner[h] * n, DT_F32, f->gpart + (int64_t)h * n, DT_F32, n);
    if (H > 1) {
        for (int h = 0; h < H; h++) dt_quantize(f->gpart + (int64_t)h * n, n, bits, block, (char *)f->gq_send + (size_t)h * qb);
        for (int r = 0; r < 2 * H; r++) counts[r] = (int64_t)(qb / 4);
        dt_all_to_all(f->cross, f->gq_send, counts, f->gq_recv, counts + H, DT_F32);
        dt__fsdp_count(f, (double)qb * H, H, L, H);
        dt__zero_on(dev, mine, fb);
        for (int h = 0; h < H; h++) dt_dequantize((char *)f->gq_recv + (size_t)h * qb, n, bits, block, mine, DT_F32, 1);
    } else dt_convert(f->gpart, DT_F32, mine, DT_F32, n);
    const dt_backend *gpu = dt__backend_of(dev);
    if (gpu) gpu->scale(mine, 1.0f / (float)f->world, n);
    else
        for (int64_t i = 0; i < n; i++) mine[i] /= (float)f->world;
}

/* All-gather: every rank's shard of the unit, side by side, is the unit. It is
   started ahead of need -- the next unit's while this one computes -- and
   finished when the unit is about to run. Every rank starts and finishes them
   in the same order, so the collectives pair up. */
/* backward: for a backward, which hpZ serves from the machine's second copy. */
static void dt__fsdp_gather_start(dt_fsdp *f, int k, int backward) {
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL || u->full || u->gathering || !u->numel) return;   /* there already, on its way, or */
                                                                                    /* another pipeline stage's */
    int slot = dt__fsdp_slot(f, k);
    if (f->holder[slot] >= 0)
        dt_fail("internal: FSDP gathers unit %d while unit %d still holds its buffer", k, f->holder[slot]);
    f->holder[slot] = k;
    u->full = f->gathered[slot];
    if (backward && f->second) {
        u->gather_how = DT__GATHER_SECONDARY;
        u->gathering = dt__zpp_gather_second(f, u);
    } else if (f->zpp.quantize_weights) {
        u->gather_how = DT__GATHER_QUANTIZED;
        u->gathering = dt__zpp_gather_start(f, k, dt__fsdp_shard_on_device(f, f->shard_params, k));
    } else {
        u->gather_how = DT__GATHER_PLAIN;
        dt__fsdp_count_flat(f, (double)dt__fsdp_param_bytes(f, u));
        u->gathered_over = f->comm;
        u->gathering = dt_all_gather_async(f->comm, dt__fsdp_send_buffer(f, k), u->full, u->shard, f->param_dtype);
    }
}
static void dt__fsdp_gather_unit(dt_fsdp *f, int k, int next, int backward) {
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL) return;
    double wait_from = dt_now_ms(), t0, t1;
    f->prefetched += u->gathering != 0;
    dt__fsdp_gather_start(f, k, backward);
    if (next >= 0 && next < f->nunits) dt__fsdp_gather_start(f, next, backward);      /* prefetch */
    if (!u->gathering) return;
    dt_comm_wait(u->gathered_over, u->gathering);
    dt__comm_interval(u->gathered_over, u->gathering, &t0, &t1);
    double hidden = (t1 < wait_from ? t1 : wait_from) - t0;
    u->gathering = 0;
    if (u->gather_how == DT__GATHER_QUANTIZED) dt__zpp_gather_finish(f, k);
    if (u->gather_how != DT__GATHER_SECONDARY && f->second) dt__zpp_keep_second(f, u);
    dt__record_comm(u->gather_how == DT__GATHER_PLAIN ? "all_gather unit" : u->gather_how == DT__GATHER_QUANTIZED
                    ? "all_gather unit (int8, across machines)" : "all_gather unit (second copy, in the machine)",
                    t0, u->gather_how == DT__GATHER_QUANTIZED ? dt_now_ms() : t1, hidden > 0 ? hidden : 0);
    dt__fsdp_point(f, u, 0, u->full);
}
static void dt__fsdp_release_unit(dt_fsdp *f, int k) {     /* reshard: keep only our slice */
    dt__fsdp_unit *u = &f->units[k];
    if (f->mode != DT_SHARD_FULL) return;
    if (u->full) f->holder[dt__fsdp_slot(f, k)] = -1;
    u->full = NULL;
    dt__fsdp_point(f, u, 0, NULL);
}
/* Reduce-scatter: the average of every rank's gradient of the unit, of which
   this rank keeps its slice (added to what it holds: accumulation needs it). */
static void dt__fsdp_reduce_scatter_unit(dt_fsdp *f, int k) {
    dt__fsdp_unit *u = &f->units[k];
    dt_device dev = f->model->device;
    if (!u->numel) return;                          /* another pipeline stage's: nothing here, nor on the peers */
    dt__data_parallel_sum_shared(&f->par, u->first, u->end);   /* first, what the wrappers inside add up across their
                                                                 groups (a tied vocabulary's two ends) */
    float *mine = f->scattered, *dst = f->shard_grads + u->shard_offset;
    double t0 = dt_now_ms();
    if (f->zpp.quantize_grads) dt__zpp_reduce_scatter(f, u, mine);
    else if (f->reduce_dtype == DT_F32) {
        dt__fsdp_count_flat(f, (double)dt__fsdp_full_bytes(f, u));
        dt_reduce_scatter(f->comm, u->full_grad, mine, u->shard, DT_F32, DT_AVG);
    } else {                                        /* 16-bit copies travel */
        dt__fsdp_count_flat(f, (double)dt__fsdp_full_bytes(f, u) / 2);
        dt_convert(u->full_grad, DT_F32, f->grad16, f->reduce_dtype, u->shard * f->world);
        dt_reduce_scatter(f->comm, f->grad16, f->scattered16, u->shard, f->reduce_dtype, DT_AVG);
        dt_convert(f->scattered16, f->reduce_dtype, mine, DT_F32, u->shard);
    }
    dt__ctx.grad_collectives++;
    dt__record_comm(f->zpp.quantize_grads ? "reduce_scatter unit (quantized, by machine)" : "reduce_scatter unit", t0,
                    dt_now_ms(), 0);
    const dt_backend *gpu = f->offload ? NULL : dt__backend_of(dev);
    if (gpu) gpu->accumulate(dst, mine, u->shard);
    else {                                          /* offloaded: to the host, added there */
        float *host = dt__host_view(dev, mine, u->shard);
        for (int64_t i = 0; i < u->shard; i++) dst[i] += host[i];
        dt__host_view_close(dev, host, mine, u->shard, 0);
    }
}

/* The two marks a unit leaves on the tape; backward meets them in reverse. */
static void dt__fsdp_before_unit_backward(dt__tape_entry *e) {
    dt_fsdp *f = (dt_fsdp *)e->saved;
    dt__fsdp_unit *u = &f->units[e->iarg[0]];
    if (!u->numel) return;                          /* nothing of it here (frozen under LoRA, another stage's) */
    dt__fsdp_gather_unit(f, e->iarg[0], e->iarg[0] - 1, 1);          /* gathered again; the one before on its way */
    if (f->mode != DT_SHARD_OPTIMIZER && !u->full_grad) {           /* (the outer unit's stays all step) */
        if (f->accum) u->full_grad = f->accum + u->accum_offset;     /* adds to the micro-batches before */
        else {                                                       /* backward adds into it: zeroed */
            u->full_grad = e->iarg[0] == f->model->outer_unit ? f->outer_grad : f->gathered_grad;
            dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
        }
        dt__fsdp_point(f, u, 1, u->full_grad);
    }
}
static void dt__fsdp_after_unit_backward(dt__tape_entry *e) {
    dt_fsdp *f = (dt_fsdp *)e->saved;
    dt__fsdp_unit *u = &f->units[e->iarg[0]];
    if (!u->numel) return;
    if (f->mode == DT_SHARD_OPTIMIZER) return;                                  /* all at once, after backward */
    if (e->iarg[0] == f->model->outer_unit) {   /* whole until the step's backward is done: a pipeline's */
        dt__fsdp_release_unit(f, e->iarg[0]);   /* micro-batches add into it, and a tied vocabulary's */
        return;                                 /* two ends are added up before it is sharded */
    }
    if (f->sync) {                                                              /* no-sync: it stays in accum */
        dt__fsdp_reduce_scatter_unit(f, e->iarg[0]);
        if (f->accum) dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
    }
    u->full_grad = NULL;
    dt__fsdp_point(f, u, 1, NULL);
    dt__fsdp_release_unit(f, e->iarg[0]);
}

static void dt__fsdp_unit_begin(dt_parallel *par, int unit) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt__fsdp_gather_unit(f, unit, unit + 1, 0);                            /* and the next one on its way */
    f->forwards++;
    if (dt__ctx.grad_enabled) dt__tape_mark(dt__fsdp_after_unit_backward, f, unit);
}
static void dt__fsdp_unit_end(dt_parallel *par, int unit) {
    dt_fsdp *f = (dt_fsdp *)par;
    int training = dt__ctx.grad_enabled;
    /* reshard after forward -- but the last unit is the first that backward
       needs, so in training it stays gathered (one all-gather saved), unless
       a pipeline runs more forwards first (its buffer is a neighbour's); so
       does the outer unit, whose backward ends the step */
    int kept = unit == f->model->outer_unit || (unit == f->nunits - 1 && !f->pipelined);
    if (!(training && kept)) dt__fsdp_release_unit(f, unit);
    if (training) dt__tape_mark(dt__fsdp_before_unit_backward, f, unit);
}
static void dt__fsdp_backward_done(dt_parallel *par);
static void dt__fsdp_step_done(dt_parallel *par);
static void dt__fsdp_optimizer_view(dt_parallel *par, dt_optimizer *o);
static void dt__fsdp_data_all_gather(dt_parallel *par, const float *mine, float *all, int64_t n, int *rank, int *ranks) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (par->inner && par->inner->data_all_gather) { par->inner->data_all_gather(par->inner, mine, all, n, rank, ranks); return; }
    *rank = dt_comm_rank(f->comm); *ranks = dt_comm_size(f->comm);
    if (all) dt__comm_all_gather_host(f->comm, mine, all, sizeof(float) * (size_t)n);
}
static void dt__fsdp_sum_over_ranks(dt_parallel *par, float *values, int n) {
    dt__comm_all_reduce_host(((dt_fsdp *)par)->comm, values, n, DT_SUM);
    if (par->inner && par->inner->sum_over_ranks) par->inner->sum_over_ranks(par->inner, values, n);   /* the tensor group's parts */
}

/* Which machine each rank is on -- the launcher's, or every ranks_per_machine
   ranks -- numbered in the order of their first rank; how many of a ring's
   links (rank r to r + 1) cross between machines; and the grid of H machines
   x L places, which the hierarchical levers need to be whole. */
static void dt__fsdp_find_machines(dt_fsdp *f, int ranks_per_machine) {
    int first[DT_MAX_RANKS] = { 0 }, count[DT_MAX_RANKS] = { 0 }, place[DT_MAX_RANKS] = { 0 }, machines = 0;
    for (int r = 0; r < f->world; r++) {
        int id = ranks_per_machine > 0 ? r / ranks_per_machine : dt_comm_machine(f->comm, r), m = 0;
        while (m < machines && first[m] != id) m++;
        if (m == machines) { first[machines] = id; count[machines++] = 0; }
        f->machine_of[r] = m;
        place[r] = count[m]++;
    }
    f->ring_crossings = 0;
    for (int r = 0; r < f->world; r++) f->ring_crossings += f->world > 1 && f->machine_of[r] != f->machine_of[(r + 1) % f->world];
    f->H = machines; f->L = count[0]; f->machine = f->machine_of[f->rank]; f->place = place[f->rank];
    for (int m = 1; m < machines; m++) if (count[m] != f->L) f->L = 0;      /* uneven: no grid */
    for (int r = 0; f->L && r < f->world; r++) f->owner[f->machine_of[r] * f->L + place[r]] = r;
}

dt_fsdp *dt_fsdp_create(dt_model *model, dt_comm *comm, dt_shard_mode mode, int cpu_offload) {
    dt_fsdp *f = (dt_fsdp *)calloc(1, sizeof *f);
    if (!f || !(f->units = (dt__fsdp_unit *)calloc((size_t)model->nunits, sizeof(dt__fsdp_unit))))
        dt_fail("out of memory (FSDP)");
    f->par = (dt_parallel){ .create_fn = "dt_fsdp_create", .sync_fn = "dt_fsdp_sync_grads", .free_fn = "dt_fsdp_free",
                            .unit_begin = dt__fsdp_unit_begin, .unit_end = dt__fsdp_unit_end,
                            .backward_done = dt__fsdp_backward_done, .step_done = dt__fsdp_step_done,
                            .optimizer_view = dt__fsdp_optimizer_view, .sum_over_ranks = dt__fsdp_sum_over_ranks,
                            .data_all_gather = dt__fsdp_data_all_gather,
                            .inner = model->parallel };          /* around tensor parallelism: its pieces */
    dt__data_parallel_can_wrap(&f->par, comm, 1);
    for (dt_parallel *q = f->par.inner; q; q = q->inner) f->pipelined |= q->forward != NULL;
    dt_model_set_parallel(model, &f->par);
    dt__comm_hold(comm, "dt_fsdp_free");
    f->model = model; f->comm = comm; f->mode = mode; f->offload = cpu_offload;
    f->param_dtype = dt__ctx.compute_dtype; f->reduce_dtype = DT_F32; f->sync = 1;
    f->rank = dt_comm_rank(comm); f->world = dt_comm_size(comm); f->nunits = model->nunits;
    dt__fsdp_find_machines(f, 0);
    dt_device dev = model->device;
    dt_broadcast(comm, model->flat_data, model->numel, DT_F32, 0);     /* every rank starts from rank 0's */
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        u->first = model->unit_first[k];
        u->end = model->unit_first[k + 1];
        u->offset = model->offsets[u->first];
        u->numel = (u->end < model->nparams ? model->offsets[u->end] : model->numel) - u->offset;
        u->shard = (u->numel + f->world - 1) / f->world;
        u->shard_offset = f->shard_numel;
        f->shard_numel += u->shard;
        u->accum_offset = f->accum_numel;
        f->accum_numel += u->shard * f->world;
        if (dt__fsdp_full_bytes(f, u) > f->largest) f->largest = dt__fsdp_full_bytes(f, u);
    }
    f->largest_shard = f->largest / (size_t)f->world;
    int outer = model->outer_unit >= 0 && f->units[model->outer_unit].numel ? model->outer_unit : -1;
    int used[3] = { 0, 0, 0 };              /* the slots some unit here takes (a pipeline stage's units only) */
    for (int k = 0; k < f->nunits; k++) used[dt__fsdp_slot(f, k)] |= f->units[k].numel > 0;
    f->holder[0] = f->holder[1] = f->holder[2] = -1;
    for (int b = 0; b < 3; b++) {
        if (!used[b]) continue;
        if (mode == DT_SHARD_FULL) f->gathered[b] = dt_alloc_on(dev, DT_ARENA_PARAMS, dt__fsdp_largest_params(f));
        if (f->param_dtype != DT_F32) f->send16[b] = dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard / 2);
        if (cpu_offload) f->staged[b] = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard);
    }
    if (mode != DT_SHARD_OPTIMIZER) f->gathered_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, f->largest);
    if (mode != DT_SHARD_OPTIMIZER && outer >= 0) f->outer_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, f->largest);
    f->scattered = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard);
    size_t shard_bytes = (size_t)f->shard_numel * sizeof(float);
    f->shard_params = (float *)(f->offload ? dt_alloc_host(DT_ARENA_PARAMS, shard_bytes) : dt_alloc_on(dev, DT_ARENA_PARAMS, shard_bytes));
    f->shard_grads = (float *)(f->offload ? dt_alloc_host(DT_ARENA_GRADS, shard_bytes) : dt_alloc_on(dev, DT_ARENA_GRADS, shard_bytes));
    /* Cut the model into shards: this rank keeps elements [rank * shard, (rank + 1) * shard) of each unit. */
    float *host = dt__host_view(dev, model->flat_data, model->numel);
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard < u->numel ? lo + u->shard : u->numel;
        dt__fsdp_put(f, f->shard_params + u->shard_offset, host + u->offset + lo, hi - lo);
        if (mode != DT_SHARD_FULL) {             /* ZeRO-1 and -2 keep every parameter, in per-unit buffers */
            u->full = dt_alloc_on(dev, DT_ARENA_PARAMS, dt__fsdp_param_bytes(f, u));
            dt__fsdp_fill_params(f, u, host + u->offset);
            dt__fsdp_point(f, u, 0, u->full);
        }
        if (mode == DT_SHARD_OPTIMIZER) {        /* ZeRO-1 keeps every gradient too */
            u->full_grad = (float *)dt_alloc_on(dev, DT_ARENA_GRADS, dt__fsdp_full_bytes(f, u));
            dt__fsdp_point(f, u, 1, u->full_grad);
        }
        if (mode == DT_SHARD_FULL) dt__fsdp_point(f, u, 0, NULL);
        if (mode != DT_SHARD_OPTIMIZER) dt__fsdp_point(f, u, 1, NULL);
    }
    dt__host_view_close(dev, host, model->flat_data, model->numel, 0);
    dt_free_on(dev, DT_ARENA_PARAMS, model->flat_data, (size_t)model->numel * sizeof(float));
    dt_free_on(dev, DT_ARENA_GRADS, model->flat_grad, (size_t)model->numel * sizeof(float));
    model->flat_data = model->flat_grad = NULL;
    return f;
}

/* The optimizer of a sharded model steps this rank's shard: one slice per
   part of a parameter inside it (the padding belongs to no parameter). */
static void dt__fsdp_optimizer_view(dt_parallel *par, dt_optimizer *o) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_model *m = f->model;
    /* Around tensor parallelism: which parameters another rank of the tensor
       group also holds (the replicated ones), from the inner wrapper's view. */
    int *copy = (int *)calloc((size_t)m->nparams + 1, sizeof(int));
    if (!copy) dt_fail("out of memory (optimizer)");
    if (par->inner && par->inner->optimizer_view) {
        par->inner->optimizer_view(par->inner, o);
        for (int i = 0; i < o->nslices && i < m->nparams; i++) copy[i] = o->slices[i].copy;
        free(o->slices);
        o->slices = NULL;
        o->nslices = 0;
    }
    o->params = f->shard_params; o->grads = f->shard_grads; o->numel = f->shard_numel;
    o->sharded_by = par;
    if (f->offload) { o->device = DT_CPU; o->offloaded = 1; }     /* the optimizer steps on the CPU */
    o->slices = (struct dt_param_slice *)calloc((size_t)m->nparams, sizeof *o->slices);
    if (!o->slices) dt_fail("out of memory (optimizer)");
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard;
        for (int i = u->first; i < u->end; i++) {
            int64_t a = m->offsets[i] - u->offset, b = a + m->params[i].numel;
            if (a < lo) a = lo;
            if (b > hi) b = hi;
            if (b <= a) continue;
            struct dt_param_slice *s = &o->slices[o->nslices++];
            s->offset = u->shard_offset + (a - lo);
            s->length = b - a;
            s->decay = m->params[i].ndim >= 2;
            s->copy = copy[i];
        }
    }
    free(copy);
}

void dt_fsdp_set_sync(dt_fsdp *fsdp, int sync) {
    int outer = fsdp->model->outer_unit;
    if (!sync && !fsdp->accum && fsdp->mode != DT_SHARD_OPTIMIZER && outer >= 0 && fsdp->units[outer].full_grad)
        dt_fail("dt_fsdp_set_sync: the last backward's gradients are not synchronised yet (its outer unit's is whole, "
                "waiting); call %s first", fsdp->par.sync_fn);
    fsdp->sync = sync;
    if (!sync && !fsdp->accum && fsdp->mode != DT_SHARD_OPTIMIZER) {     /* ZeRO-1 keeps whole gradients anyway */
        fsdp->accum = (float *)dt_alloc_on(fsdp->model->device, DT_ARENA_GRADS, (size_t)fsdp->accum_numel * sizeof(float));
        dt__zero_on(fsdp->model->device, fsdp->accum, (size_t)fsdp->accum_numel * sizeof(float));
        dt_free_on(fsdp->model->device, DT_ARENA_GRADS, fsdp->gathered_grad, fsdp->largest);   /* each unit has its slice now */
        dt_free_on(fsdp->model->device, DT_ARENA_GRADS, fsdp->outer_grad, fsdp->largest);
        fsdp->gathered_grad = fsdp->outer_grad = NULL;
    }
}
void dt_fsdp_set_reduce_dtype(dt_fsdp *fsdp, dt_dtype dtype) {
    dt_device dev = fsdp->model->device;
    if (fsdp->zpp.quantize_grads && dtype != DT_F32)
        dt_usage_error("--reduce-dtype %s with --quantize-grads: the gradients travel quantized, so no reduce dtype applies; "
                       "drop one", dt_dtype_name(dtype));
    dt_free_on(dev, DT_ARENA_COMM, fsdp->grad16, fsdp->largest / 2);
    dt_free_on(dev, DT_ARENA_COMM, fsdp->scattered16, fsdp->largest_shard / 2);
    fsdp->grad16 = fsdp->scattered16 = NULL;
    fsdp->reduce_dtype = dtype;
    if (dtype == DT_F32) return;
    fsdp->grad16 = dt_alloc_on(dev, DT_ARENA_COMM, fsdp->largest / 2);
    fsdp->scattered16 = dt_alloc_on(dev, DT_ARENA_COMM, fsdp->largest_shard / 2);
}

void dt_fsdp_set_zeropp(dt_fsdp *fsdp, dt_zeropp zeropp) {
    dt_fsdp *f = fsdp;
    dt_zeropp z = zeropp;
    static const char *modes[3] = { "optimizer", "grads", "full" };
    if (f->zpp_set || f->forwards)
        dt_fail("dt_fsdp_set_zeropp: %s; set ZeRO++ once, before the first forward (it makes its groups and buffers then)",
                f->zpp_set ? "called twice" : "called after a forward");
    if (z.ranks_per_machine < 0 || (z.ranks_per_machine > 0 && f->world % z.ranks_per_machine))
        dt_usage_error("--ranks-per-machine %d: it must divide the %d ranks that shard the model", z.ranks_per_machine, f->world);
    if (!z.quantize_weights && !z.quantize_grads && !z.hierarchical) {         /* plain ZeRO, perhaps on pretended machines */
        if (z.ranks_per_machine) dt__fsdp_find_machines(f, z.ranks_per_machine);
        return;
    }
    if (z.quant_block == 0) z.quant_block = 256;
    if ((z.quantize_weights || z.hierarchical) && f->mode != DT_SHARD_FULL)
        dt_usage_error("--quantize-weights and --hierarchical change how ZeRO-3 gathers the parameters of each unit; with "
                       "--shard %s nothing is gathered per unit: use --shard full", modes[f->mode]);
    if (z.quantize_weights && z.quantize_weights != 8)
        dt_usage_error("--quantize-weights: int8 (the weights' codes have 8 bits), not %d bits", z.quantize_weights);
    if (z.quantize_grads && z.quantize_grads != 8 && z.quantize_grads != 4)
        dt_usage_error("--quantize-grads: int8 or int4, not %d bits", z.quantize_grads);
    if (z.quant_block < 8 || z.quant_block > 65536 || z.quant_block % 2)
        dt_usage_error("--quant-block %d: the values that share a scale, an even number from 8 to 65536", z.quant_block);
    if (z.quantize_grads && f->reduce_dtype != DT_F32)
        dt_usage_error("--quantize-grads with --reduce-dtype %s: the gradients travel quantized, so no reduce dtype applies; "
                       "drop one", dt_dtype_name(f->reduce_dtype));
    dt__fsdp_find_machines(f, z.ranks_per_machine);
    if (!f->L)
        dt_fail("ZeRO++: the %d ranks sit on %d machines unevenly; its hierarchical collectives pair the ranks at the same "
                "place on every machine, so every machine needs as many (start the same number of ranks on each)", f->world, f->H);
    f->zpp = z;
    f->zpp_set = 1;
    f->local = dt_comm_split(f->comm, f->machine, f->place);
    f->cross = dt_comm_split(f->comm, f->place, f->machine);
    dt_device dev = f->model->device;
    size_t es = dt_dtype_size(f->param_dtype);
    int64_t largest = (int64_t)(f->largest_shard / sizeof(float));
    int used[3] = { 0, 0, 0 };
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        used[dt__fsdp_slot(f, k)] |= u->numel > 0;
        u->second_offset = f->second_numel;
        if (z.hierarchical && u->numel) f->second_numel += u->shard * f->H;
    }
    if (z.hierarchical) f->second = dt_alloc_on(dev, DT_ARENA_PARAMS, (size_t)f->second_numel * es);
    if (z.quantize_weights) f->qw_bytes = dt__zpp_qbytes(f, largest, z.quantize_weights);
    for (int b = 0; b < 3 && z.quantize_weights; b++) {
        if (!used[b]) continue;
        f->qsend[b] = dt_alloc_on(dev, DT_ARENA_COMM, f->qw_bytes);
        f->qcross[b] = dt_alloc_on(dev, DT_ARENA_COMM, f->qw_bytes * (size_t)f->H);
        f->qall[b] = dt_alloc_on(dev, DT_ARENA_COMM, f->qw_bytes * (size_t)f->world);
    }
    if (z.quantize_grads) {
        f->qg_bytes = dt__zpp_qbytes(f, largest, z.quantize_grads);
        f->gq_send = dt_alloc_on(dev, DT_ARENA_COMM, f->qg_bytes * (size_t)f->world);
        f->gq_recv = dt_alloc_on(dev, DT_ARENA_COMM, f->qg_bytes * (size_t)f->world);
        f->gpart = (float *)dt_alloc_on(dev, DT_ARENA_COMM, f->largest_shard * (size_t)f->H);
    }
}
static void dt__zpp_free(dt_fsdp *f) {
    if (!f->zpp_set) return;
    dt_device dev = f->model->device;
    dt_free_on(dev, DT_ARENA_PARAMS, f->second, (size_t)f->second_numel * dt_dtype_size(f->param_dtype));
    for (int b = 0; b < 3; b++) {
        dt_free_on(dev, DT_ARENA_COMM, f->qsend[b], f->qw_bytes);
        dt_free_on(dev, DT_ARENA_COMM, f->qcross[b], f->qw_bytes * (size_t)f->H);
        dt_free_on(dev, DT_ARENA_COMM, f->qall[b], f->qw_bytes * (size_t)f->world);
    }
    dt_free_on(dev, DT_ARENA_COMM, f->gq_send, f->qg_bytes * (size_t)f->world);
    dt_free_on(dev, DT_ARENA_COMM, f->gq_recv, f->qg_bytes * (size_t)f->world);
    dt_free_on(dev, DT_ARENA_COMM, f->gpart, f->largest_shard * (size_t)f->H);
    dt_comm_free(f->cross);
    dt_comm_free(f->local);
}

/* After backward: ZeRO-1 reduce-scatters every unit now; ZeRO-2 and -3 the
   outer unit (the others went during backward). */
static void dt__fsdp_backward_done(dt_parallel *par) {
    dt_fsdp *f = (dt_fsdp *)par;
    if (!f->sync) return;                                    /* accumulating */
    for (int k = f->nunits - 1; k >= 0; k--) {
        dt__fsdp_unit *u = &f->units[k];
        if (!u->numel || !u->full_grad || (f->mode != DT_SHARD_OPTIMIZER && k != f->model->outer_unit)) continue;
        dt__fsdp_reduce_scatter_unit(f, k);
        dt__zero_on(f->model->device, u->full_grad, dt__fsdp_full_bytes(f, u));
        if (f->mode == DT_SHARD_OPTIMIZER) continue;         /* ZeRO-1 keeps its whole gradients */
        u->full_grad = NULL;
        dt__fsdp_point(f, u, 1, NULL);
    }
}

void dt_fsdp_sync_grads(dt_fsdp *fsdp) { dt_parallel_backward_done(&fsdp->par); }

/* After the optimizer: DT_SHARD_OPTIMIZER and _GRADS all-gather the updated
   parameters (DT_SHARD_FULL gathers each unit when it is next used). */
static void dt__fsdp_step_done(dt_parallel *par) {
    dt_fsdp *f = (dt_fsdp *)par;
    for (int k = 0; f->mode != DT_SHARD_FULL && k < f->nunits; k++) {   /* ZeRO-3: gathered when next needed */
        dt__fsdp_unit *u = &f->units[k];
        double t0 = dt_now_ms();
        if (!u->numel) continue;
        dt__fsdp_count_flat(f, (double)dt__fsdp_param_bytes(f, u));
        dt_all_gather(f->comm, dt__fsdp_send_buffer(f, k), u->full, u->shard, f->param_dtype);
        dt__record_comm("all_gather parameters", t0, dt_now_ms(), 0);
    }
    f->step_bytes_within = f->bytes_within; f->step_bytes_across = f->bytes_across;
    f->bytes_within = f->bytes_across = 0;
}

void dt_fsdp_free(dt_fsdp *fsdp) {
    if (!fsdp) return;
    dt_model *m = fsdp->model;
    dt__data_parallel_unwrap(m, &fsdp->par);
    for (int k = 0; k < fsdp->nunits; k++) {
        dt__fsdp_unit *u = &fsdp->units[k];
        if (u->gathering) dt__fsdp_gather_unit(fsdp, k, -1, u->gather_how == DT__GATHER_SECONDARY);   /* a prefetch nobody */
                                                                                                        /* used: let it land */
        if (fsdp->mode != DT_SHARD_FULL) dt_free_on(m->device, DT_ARENA_PARAMS, u->full, dt__fsdp_param_bytes(fsdp, u));
        if (fsdp->mode == DT_SHARD_OPTIMIZER) dt_free_on(m->device, DT_ARENA_GRADS, u->full_grad, dt__fsdp_full_bytes(fsdp, u));
        dt__fsdp_point(fsdp, u, 0, NULL);
        dt__fsdp_point(fsdp, u, 1, NULL);
    }
    for (int b = 0; b < 3; b++) {
        dt_free_on(m->device, DT_ARENA_PARAMS, fsdp->gathered[b], dt__fsdp_largest_params(fsdp));
        dt_free_on(m->device, DT_ARENA_COMM, fsdp->staged[b], fsdp->largest_shard);
        dt_free_on(m->device, DT_ARENA_COMM, fsdp->send16[b], fsdp->largest_shard / 2);
    }
    dt__zpp_free(fsdp);                      /* after the last prefetch has landed */
    dt__comm_release(fsdp->comm);
    dt_fsdp_set_reduce_dtype(fsdp, DT_F32);
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->accum, (size_t)fsdp->accum_numel * sizeof(float));
    for (int i = 0; i < m->nparams; i++) m->params[i].dtype = DT_F32;
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->gathered_grad, fsdp->largest);
    dt_free_on(m->device, DT_ARENA_GRADS, fsdp->outer_grad, fsdp->largest);
    dt_free_on(m->device, DT_ARENA_COMM, fsdp->scattered, fsdp->largest_shard);
    size_t shard_bytes = (size_t)fsdp->shard_numel * sizeof(float);
    if (fsdp->offload) { dt_free_host(DT_ARENA_PARAMS, fsdp->shard_params, shard_bytes); dt_free_host(DT_ARENA_GRADS, fsdp->shard_grads, shard_bytes); }
    else { dt_free_on(m->device, DT_ARENA_PARAMS, fsdp->shard_params, shard_bytes); dt_free_on(m->device, DT_ARENA_GRADS, fsdp->shard_grads, shard_bytes); }
    free(fsdp->units);
    free(fsdp);
}

/* -- the data-parallel engine: DDP or FSDP, chosen once -- */
struct dt_data_parallel {
    dt_model *model;
    dt_ddp *ddp;                /* one of the two */
    dt_fsdp *fsdp;
    dt_parallel *par;           /* its dt_parallel */
};
dt_data_parallel *dt_data_parallel_create(dt_model *model, dt_comm *comm, dt_shard_mode shard, int cpu_offload,
                                          double bucket_mb) {
    if (cpu_offload && shard == DT_SHARD_NONE)
        dt_usage_error("--cpu-offload keeps the shards in host memory: it needs --shard optimizer, grads or full");
    if (model->optimizers)
        dt_fail("dt_data_parallel_create: this model already has an optimizer; create the optimizer after "
                "dt_data_parallel_create, which decides what it steps");
    dt_data_parallel *dp = (dt_data_parallel *)calloc(1, sizeof *dp);
    if (!dp) dt_fail("out of memory (data parallelism)");
    dp->model = model;
    if (shard != DT_SHARD_NONE) dp->fsdp = dt_fsdp_create(model, comm, shard, cpu_offload);
    else dp->ddp = dt_ddp_create(model, comm, bucket_mb);          /* over one rank too: the same calls, in the same order */
    if (dp->fsdp) {                                                 /* what the order mistakes name */
        dp->fsdp->par.sync_fn = "dt_data_parallel_sync_grads";
        dp->fsdp->par.free_fn = "dt_data_parallel_free";
        dp->par = &dp->fsdp->par;
    } else dp->par = dt__ddp_as_engine(dp->ddp, "dt_data_parallel_sync_grads", "dt_data_parallel_free");
    return dp;
}
void dt_data_parallel_sync_grads(dt_data_parallel *dp) {
    dt_parallel_backward_done(dp->par);                             /* this engine's, then what it wraps */
}
void dt_data_parallel_set_zeropp(dt_data_parallel *dp, dt_zeropp zeropp) {
    if (dp->fsdp) { dt_fsdp_set_zeropp(dp->fsdp, zeropp); return; }
    if (zeropp.quantize_weights || zeropp.quantize_grads || zeropp.hierarchical || zeropp.ranks_per_machine)
        dt_usage_error("ZeRO++ (--quantize-weights, --quantize-grads, --hierarchical, --ranks-per-machine) changes how a "
                       "sharded engine's collectives travel; DDP shards nothing: add --shard full");
}
void dt_data_parallel_free(dt_data_parallel *dp) {
    if (!dp) return;
    dt_fsdp_free(dp->fsdp);
    dt_ddp_free(dp->ddp);
    free(dp);
}

//@ for the machinery
/* ---- what the machinery asks of FSDP (the run driver's dt_parallel_report) ----
   A checkpoint sees the sharded model whole, or writes each rank's shards as
   they are; the memory table compares what a rank holds with DDP; the cost
   model and --bench learn which ZeRO stage this is. */
/* The cost model's view (the cost-model chapter): which ZeRO, and the optimizer step
   of the whole model, N times the shard's this rank measured. */
static int dt__fsdp_cost_input(const dt_parallel *par, dt_cost_input *in) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    dt_parallel *who;
    const dt_parallel_report *inner = dt_parallel_report_of(par->inner, &who);
    if (inner && inner->cost_input) {     /* around tensor parallelism: its pieces, sharded over the groups (2-D) */
        in->optimizer_ms *= f->world;     /* the pieces' step, which the tensor-parallel view makes the whole model's */
        int n = inner->cost_input(who, in);
        in->dp_shard = f->mode + 1;
        return n;
    }
    static const dt_parallelism zero[3] = { DT_PAR_ZERO1, DT_PAR_ZERO2, DT_PAR_ZERO3 };   /* by dt_shard_mode */
    in->kind = zero[f->mode];
    in->machine_ranks = f->L;                       /* the machines, and what ZeRO++ does on them */
    in->qw_bits = f->zpp.quantize_weights; in->qg_bits = f->zpp.quantize_grads;
    in->hierarchical = f->zpp.hierarchical; in->quant_block = f->zpp.quant_block;
    double again = 0, all = 0;                      /* backward gathers all but the last unit and the outer one again */
    for (int k = 0; k < f->nunits; k++) {
        all += (double)f->units[k].numel;
        if (k != f->model->outer_unit && (k != f->nunits - 1 || f->pipelined)) again += (double)f->units[k].numel;
    }
    in->backward_gather_share = all > 0 ? again / all : 1;
    in->optimizer_ms *= f->world;
    return f->world;
}

/* Checkpoints see a sharded model whole: every rank's shards gathered into one
   host array in parameter order (a collective), or written back into them. */
static float *dt__fsdp_state_gather(dt_fsdp *f, const float *shards) {
    dt_device dev = f->model->device;
    float *host = (float *)malloc((size_t)f->model->numel * sizeof(float) + 1);
    if (!host) dt_fail("out of memory (gathering a sharded checkpoint)");
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        if (!u->numel) continue;
        float *full = (float *)dt_alloc_on(dev, DT_ARENA_COMM, dt__fsdp_full_bytes(f, u));
        dt_all_gather(f->comm, dt__fsdp_shard_on_device(f, shards, k), full, u->shard, DT_F32);
        dt__download_from(dev, host + u->offset, full, (size_t)u->numel * sizeof(float));
        dt_free_on(dev, DT_ARENA_COMM, full, dt__fsdp_full_bytes(f, u));
    }
    return host;
}

static void dt__fsdp_state_scatter(dt_fsdp *f, const float *host, float *shards, int parameters) {
    for (int k = 0; k < f->nunits; k++) {
        dt__fsdp_unit *u = &f->units[k];
        int64_t lo = f->rank * u->shard, hi = lo + u->shard < u->numel ? lo + u->shard : u->numel;
        dt__fsdp_put(f, shards + u->shard_offset, host + u->offset + lo, hi - lo);
        if (parameters && u->full) dt__fsdp_fill_params(f, u, host + u->offset);
    }
}

/* Around tensor parallelism the shards make this rank's pieces, not the
   whole: the inner wrapper's report turns those into the whole and back
   (they pass through the device, where it keeps its pieces). That report,
   when the inner wrapper cut the model (tensor, pipeline parallelism); NULL
   when it keeps the model whole (context parallelism) or there is none. */
static const dt_parallel_report *dt__fsdp_inner_cut(const dt_parallel *par, dt_parallel **who) {
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, who);
    return in && in->whole_from_local ? in : NULL;
}
static float *dt__fsdp_to_whole(dt_fsdp *f, const dt_parallel_report *in, dt_parallel *who, float *pieces) {
    dt_device dev = f->model->device;
    size_t bytes = (size_t)f->model->numel * sizeof(float);
    float *local = (float *)dt_alloc_on(dev, DT_ARENA_COMM, bytes);
    dt__upload_to(dev, local, pieces, bytes);
    free(pieces);
    float *whole = in->whole_from_local(who, f->model, local);
    dt_free_on(dev, DT_ARENA_COMM, local, bytes);
    return whole;
}
static float *dt__fsdp_from_whole(dt_fsdp *f, const dt_parallel_report *in, dt_parallel *who, float *whole) {
    dt_device dev = f->model->device;
    size_t bytes = (size_t)f->model->numel * sizeof(float);
    float *local = (float *)dt_alloc_on(dev, DT_ARENA_COMM, bytes), *pieces = (float *)malloc(bytes + 1);
    if (!pieces) dt_fail("out of memory (a checkpoint's pieces)");
    in->local_from_whole(who, f->model, whole, local);
    dt__download_from(dev, pieces, local, bytes);
    dt_free_on(dev, DT_ARENA_COMM, local, bytes);
    return pieces;
}
static float *dt__fsdp_state_open(dt_parallel *par, dt_optimizer *o, int which) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_parallel *who;
    const dt_parallel_report *in = dt__fsdp_inner_cut(par, &who);
    /* every rank gets the whole of its shards, gathered (for a load, too: the file overwrites it) */
    float *gathered = dt__fsdp_state_gather(f, which == 0 ? f->shard_params : which == 1 ? o->m : o->v);
    return in ? dt__fsdp_to_whole(f, in, who, gathered) : gathered;
}

static void dt__fsdp_state_close(dt_parallel *par, dt_optimizer *o, int which, float *host, int written) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_parallel *who;
    const dt_parallel_report *in = dt__fsdp_inner_cut(par, &who);
    if (written && in) {
        float *pieces = dt__fsdp_from_whole(f, in, who, host);
        dt__fsdp_state_scatter(f, pieces, which == 0 ? f->shard_params : which == 1 ? o->m : o->v, which == 0);
        free(pieces);
    } else if (written) dt__fsdp_state_scatter(f, host, which == 0 ? f->shard_params : which == 1 ? o->m : o->v, which == 0);
    free(host);
}

/* What each rank holds, against what DDP would hold: the ZeRO paper's
   formulas with P, G, O the bytes of parameters, gradients and optimizer state
   (O = 2P for AdamW, P for SGD's momentum), N ranks. The buffers that a unit
   is gathered into are shown apart: they are the price of sharding. */
static void dt__fsdp_memory_table(const dt_parallel *par, const dt_optimizer *o) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    /* ZeRO-1 and -2 here keep the shards the optimizer steps apart from the
       whole copies: P/N (and for ZeRO-1 G/N) more than the paper, which steps
       a slice of the copy in place */
    static const char *formulas[3][3] = { { "P + P/N", "G + G/N", "O/N" }, { "P + P/N", "G/N", "O/N" }, { "P/N", "G/N", "O/N" } };
    static const char *names[3] = { "optimizer (ZeRO-1)", "grads (ZeRO-2)", "full (ZeRO-3)" };
    double P = 4.0 * f->model->numel, ddp[3] = { P, P, o->v ? 2 * P : P };
    dt_arena arenas[3] = { DT_ARENA_PARAMS, DT_ARENA_GRADS, DT_ARENA_OPTIM };
    const char *rows[3] = { "parameters", "gradients", "optimizer state" };
    double buffers[3] = { ((f->gathered[0] ? 1.0 : 0.0) + (f->gathered[1] ? 1.0 : 0.0) + (f->gathered[2] ? 1.0 : 0.0)) *
                          dt__fsdp_largest_params(f),
                          ((f->gathered_grad ? 1.0 : 0.0) + (f->outer_grad ? 1.0 : 0.0)) * (double)f->largest, 0 };
    double frozen = f->model->base ? 4.0 * (double)f->model->base->numel : 0;   /* LoRA's: in the parameters' arena */
    double second = (double)f->second_numel * (double)dt_dtype_size(f->param_dtype);   /* hpZ's, shown apart */
    buffers[0] += frozen + second;
    printf("memory per rank, --shard %s%s, %d ranks (MB):\n", names[f->mode], f->offload ? " --cpu-offload" : "", f->world);
    printf("  %-16s %8s %8s %8s   %s\n", "", "device", "host", "DDP", "formula");
    for (int i = 0; i < 3; i++)
        printf("  %-16s %8.2f %8.2f %8.2f   %s\n", rows[i], (dt_mem_now(arenas[i]) - buffers[i]) / 1e6,
               dt_mem_host_now(arenas[i]) / 1e6, ddp[i] / 1e6, formulas[f->mode][i]);
    if (frozen > 0)
        printf("  %-16s %8.2f %8s %8.2f   %s\n", "frozen (LoRA)", frozen / 1e6, "", frozen / 1e6,
               "F: whole on every rank and device, read only: no gradient, no state, never sent");
    if (second > 0)
        printf("  %-16s %8.2f %8s %8s   %s\n", "second copy", second / 1e6, "", "",
               "P/L (hpZ: this rank's 1/L of every unit, L ranks a machine, for backward's gathers)");
    if (f->param_dtype != DT_F32)
        printf("  (f32 shards and optimizer; parameters gathered in %s, 2 bytes each)\n", dt_dtype_name(f->param_dtype));
    if (buffers[0] + buffers[1] - frozen - second > 0)
        printf("  %-16s %8.2f %8s %8s   %s\n", "gather buffers", (buffers[0] + buffers[1] - frozen - second) / 1e6, "", "",
               f->mode == DT_SHARD_FULL ? "2 units of parameters (one computes, the next arrives) + 1 of gradients"
                                        : "1 unit of gradients (whole during its backward)");
    if ((f->gathered[2] || f->outer_grad) && buffers[0] + buffers[1] - frozen - second > 0)
        printf("  %-16s %8s %8s %8s   %s\n", "", "", "", "", "+ the outer unit's (embeddings, shared with the head), whole all step");
    fflush(stdout);
}

/* The shards as they are, for a sharded checkpoint: each rank writes its own. */
static int dt__fsdp_shards(dt_parallel *par, dt_optimizer *o, dt_shard_view *view) {
    dt_fsdp *f = (dt_fsdp *)par;
    dt_parallel *who;                     /* shards of pieces (an inner wrapper that cut the model): saved whole, */
    if (dt__fsdp_inner_cut(par, &who)) return 0;                  /* through that wrapper */
    *view = (dt_shard_view){ .state = { f->shard_params, o->m, o->v }, .numel = f->shard_numel,
                             .where = f->offload ? DT_CPU : f->model->device, .rank = f->rank, .world = f->world, .comm = f->comm };
    return 1;
}
/* --bench's stage=: which --shard, and whether offloaded. */
static void dt__fsdp_label(const dt_parallel *par, char *out, size_t n) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    static const char *modes[3] = { "optimizer", "grads", "full" };
    char qw[16] = "", qg[16] = "";
    if (f->zpp.quantize_weights) snprintf(qw, sizeof qw, "+qw%d", f->zpp.quantize_weights);
    if (f->zpp.quantize_grads) snprintf(qg, sizeof qg, "+qg%d", f->zpp.quantize_grads);
    snprintf(out, n, "/%s%s%s%s%s", modes[f->mode], f->offload ? "+offload" : "", qw, qg, f->zpp.hierarchical ? "+hp" : "");
}
static void dt__fsdp_bytes_moved(const dt_parallel *par, double *within, double *across) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    *within = f->step_bytes_within;
    *across = f->step_bytes_across;
}
/* Around tensor or pipeline parallelism, what it reports too. */
static void dt__fsdp_bench_fields(const dt_parallel *par, FILE *out, int accum_steps) {
    const dt_fsdp *f = (const dt_fsdp *)par;
    fprintf(out, " machines=%d bytes_in_machines=%.0f bytes_across_machines=%.0f", f->H, f->step_bytes_within, f->step_bytes_across);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (in && in->bench_fields) in->bench_fields(who, out, accum_steps);
}
static void dt__fsdp_log_fields(const dt_parallel *par, FILE *log) {
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (in && in->log_fields) in->log_fields(who, log);
}
static void dt__fsdp_memory_tables(const dt_parallel *par, const dt_optimizer *o) {
    dt__fsdp_memory_table(par, o);
    dt_parallel *who;
    const dt_parallel_report *in = dt_parallel_report_of(par->inner, &who);
    if (in && in->memory_table) in->memory_table(who, o);
}
const dt_parallel_report dt__fsdp_report = {
    .create_fn = "dt_fsdp_create", .state_open = dt__fsdp_state_open, .state_close = dt__fsdp_state_close,
    .shards = dt__fsdp_shards, .memory_table = dt__fsdp_memory_tables, .label = dt__fsdp_label, .cost_input = dt__fsdp_cost_input,
    .bench_fields = dt__fsdp_bench_fields, .log_fields = dt__fsdp_log_fields, .bytes_moved = dt__fsdp_bytes_moved,
};
