//@ machinery: the cost model -- how a stage should scale, and why (--explain)
/* ---- the cost model ----------------------------------------------------- */

/* The cost model: does it scale, and why not? A step of N ranks costs its
   compute plus the communication that compute could not hide. Communication
   follows the alpha-beta model of a link -- a message of b bytes takes
   latency + b / bandwidth -- on a ring, where each of N ranks sends and
   receives (N-1)/N of the buffer per all-gather or reduce-scatter, twice
   that per all-reduce (a reduce-scatter and then an all-gather). */
typedef struct dt_link {
    char name[64];
    double latency_us;         /* per message hop */
    double bandwidth_gbs;      /* bus bandwidth, GB/s, as nccl-tests reports it */
} dt_link;
/* "shm" (shared memory on this machine, as tools/collectives measured it),
   "pcie", "nvlink", "infiniband", "ethernet": rough figures of common links (see the
   definitions). Returns 0 for an unknown name. */
int dt_link_preset(const char *name, dt_link *out);
/* Milliseconds of one ring collective over n ranks, of a buffer of `bytes`
   (the whole buffer: what each rank holds after an all-gather). */
double dt_cost_all_reduce_ms(const dt_link *link, int n, double bytes);
double dt_cost_all_gather_ms(const dt_link *link, int n, double bytes);      /* = reduce-scatter */
/* How many buckets DDP makes of `params` f32 gradients (the first 1 MB, then bucket_mb). */
int dt_cost_ddp_buckets(double params, double bucket_mb);

/* What a step of each parallel scheme computes and communicates, as the
   cost model prices it: the run fills it from what the last step measured,
   and a wrapper that splits or shards the model its own part (its
   dt_parallel_report's cost_input, the run-driver chapter). */
typedef enum { DT_PAR_NONE = 0, DT_PAR_DP, DT_PAR_DDP, DT_PAR_ZERO1, DT_PAR_ZERO2, DT_PAR_ZERO3, DT_PAR_TP, DT_PAR_PP,
               DT_PAR_CP, DT_PAR_EP } dt_parallelism;
typedef struct dt_cost_input {
    dt_parallelism kind;
    double compute_ms;         /* one rank's forward + backward for one micro-batch, on its own device */
    double contention;         /* how much slower that compute runs when N ranks share the device(s): 1 on
                                  GPUs of their own; on a CPU about N (the ranks share its cores) */
    double backward_share;     /* the part of compute that is backward, which DDP's buckets hide behind (~2/3) */
    double params;             /* parameter count */
    double gather_bytes;       /* bytes per parameter gathered (FSDP: 4, or 2 in bf16/fp16) */
    double reduce_bytes;       /* bytes per gradient reduced (4, or 2 with --reduce-dtype bf16) */
    int accum_steps;           /* micro-batches per optimizer step */
    int messages;              /* collectives per step on the critical path: DDP's buckets, FSDP's units */
    double optimizer_ms;       /* the optimizer's step, on its own device: sharded (ZeRO), each rank does 1/N */
    /* tensor parallelism: the share of compute (and optimizer) in the split
       layers, which N ranks divide; the sums of activations or their
       gradients per micro-batch (4 per transformer block: 2 forward, 2
       backward), and their mean bytes as measured (mostly batch x tokens x
       width x 4; the ViT's last block sums only the class tokens' rows) */
    double tp_share, tp_sums, tp_bytes;
    /* ... and, for a pipeline (DT_PAR_PP) whose stages split their layers
       too (07's --tp), how many ranks each stage's layers are split over
       (0 or 1: none); tp_sums then counts the whole model's sums per
       micro-batch, and tp_bytes those of a micro-batch. Tensor parallelism
       alone (DT_PAR_TP) has its T in dt_cost_predict's n. */
    int tp_ranks;
    /* ... and with more ranks than T (or P), the data-parallel groups of T
       (pipelines of P): after backward each rank's gradients (tensor: params
       x (tp_share / T + 1 - tp_share) x reduce_bytes; pipeline: its stage's)
       are averaged over them, exposed (0 or 1: one group) */
    int dp_groups;
    /* pipeline parallelism: the micro-batches of a step; the largest
       stage's share of the compute times P (1 when the stages are even: the
       slowest stage sets the pipeline's pace); the bytes of one activation
       sent on (micro-batch x tokens x width x 4), a gradient as many back */
    int pp_micro_batches;
    double pp_balance, pp_bytes;
    double pp_measured_bubble;  /* ... and the share of the step this rank waited, as measured: printed beside the
                                   formula's, not used by the prediction */
    /* tensor or pipeline parallelism inside FSDP (06, 07 --shard): the ZeRO
       stage (1, 2, 3; 0: DDP) over the data-parallel groups. Each group
       steps 1/D of the optimizer; ZeRO-3 gathers the parameters twice, 1.5x
       DDP's bytes; around a pipeline ZeRO-2 and -3 do so each micro-batch
       (ZeRO-2: M reduce-scatters and one all-gather, (M + 1) / 2 DDP's) */
    int dp_shard;
    /* context parallelism (DT_PAR_CP; n: the C ranks that split each
       sequence, compute_ms one rank's of the whole sequences): attention's
       share of that compute (the rest is per token: it divides by C); the
       keys and values of one layer, the whole micro-batch's (micro-batch x
       T x 2 x width x 4: a rank's block is 1/C of it); the layers the ring
       goes around; 1 when a causal model is cut into contiguous pieces, so
       that the last rank's attention is about (2C - 1) / C the mean's (0:
       zig-zag, or no mask: every rank the same). Forward sends the block on
       C - 1 times, each behind a block's attention; backward sends it on
       C - 1 times again and each block's gradient sum C times (as many
       bytes), two transfers behind each block's backward and the last,
       which brings each sum home, waited for. The gradients are averaged
       over every rank of the job (dp_groups x C): DDP's behind backward, or
       sharded (dp_shard). */
    double cp_attention_share, cp_kv_bytes;
    int cp_layers, cp_contiguous;
    /* expert parallelism (DT_PAR_EP; n: the P ranks that split the
       experts, each reading its own batch): the share of the parameters in
       the experts (each rank keeps 1/P of them), the all-to-alls of a
       micro-batch (four an MoE layer: dispatch and combine, forward and
       backward; six with --recompute, whose forward runs again), and the bytes a rank sends to the others in each. They
       stand where the layer waits for them: nothing hides them. Then the
       experts' gradients are averaged over the dp_groups (DDP's, behind
       backward, or sharded), the rest over every rank: the groups' average,
       then the group's, after backward. */
    double ep_expert_share, ep_exchanges, ep_bytes;
    /* machines (FSDP): the ranks as machines of machine_ranks each (0, or
       n: one machine), joined by `across` (a slower link; empty: `l`). A
       ring over all n ranks crosses between machines once per machine, and
       waits on that link. ZeRO++ (ZeRO-3): qw_bits 8, the forward's
       gathers in int8 codes plus a 4-byte scale per quant_block values,
       gathered across machines at each place, then within each; with
       hierarchical the backward's from the machine's second copy, never
       across; qg_bits 8 or 4, the gradients quantized, exchanged within
       the machine, then the sums quantized again and exchanged across.
       backward_gather_share: the share of the parameters ZeRO-3 gathers
       again in backward (not the last unit, nor the outer one: kept). */
    int machine_ranks, qw_bits, qg_bits, hierarchical, quant_block;
    double backward_gather_share;
    dt_link across;
} dt_cost_input;

typedef struct dt_cost_prediction {
    int ranks;
    double compute_ms;         /* per optimizer step, on one rank: forward, backward and optimizer */
    double comm_ms;            /* communication per optimizer step */
    double exposed_ms;         /* the part of it compute does not hide */
    double step_ms, speedup, efficiency;   /* speedup: samples/s against one rank with the same batch */
    double bytes;              /* bytes each rank sends per step */
    double bubble;             /* pipeline parallelism: the share of the step a stage waits, (P - 1) / (M + P - 1) */
    double bytes_within, bytes_across;   /* FSDP: bytes a step moves, the whole job's, within machines and across them */
} dt_cost_prediction;
/* Predict a step of `ranks` ranks: DDP all-reduces the gradients once per
   step behind backward; DP (02) also broadcasts the parameters, hiding
   nothing; ZeRO-1 and -2 reduce-scatter the gradients and all-gather the
   parameters (the same bytes as DDP, not hidden here); ZeRO-3 all-gathers the
   parameters twice per micro-batch, prefetched behind compute, and
   reduce-scatters the gradients: 1.5x DDP's bytes. Tensor parallelism
   divides the split layers' compute by N and all-reduces activations inside
   forward and backward, where nothing hides them; its N ranks share one
   batch, so its speedup is against one rank with that batch, not N times it.
   Context parallelism divides the work by N too, the busiest rank's
   attention setting the pace, and passes key/value blocks around a ring.
   Expert parallelism divides nothing but the experts' memory: each rank
   computes its own batch, its tokens' expert rows on other ranks, and waits
   for four all-to-alls an MoE layer. */
dt_cost_prediction dt_cost_predict(const dt_cost_input *in, const dt_link *l, int n);
/* Print the prediction, the compute-to-communication ratio, and what bigger
   batches, accumulation, bf16 communication or fewer ranks would change. */
void dt_cost_explain(FILE *out, const dt_cost_input *in, const dt_link *l, int n);

//@ implementation
/* ==== the cost model ========================================================
   Why a stage scales as it does. It is deliberately small -- a link of two
   numbers, ring collectives, and what each wrapper sends and can hide -- so
   that a student can check it by hand (tests/27-cost-model.c does) and see
   which lever moves the answer. --explain prints it for a run. */

/* Rough figures, to be replaced by measured ones (tools/collectives --bench
   measures "shm"; nccl-tests measures a GPU link). Bus bandwidth per rank:
   - shm: this project's shared-memory ring on a 2-core machine (2 ranks, 2026-11-21);
   - pcie: GPUs talking through PCIe 4.0 x16 and the host, no NVLink;
   - nvlink: 8 H100 SXM GPUs on NVLink 4 and NVSwitch, as nccl-tests all-reduce reaches;
   - infiniband: one HDR 200 Gb/s NIC per GPU, between machines;
   - ethernet: 10 Gb/s between machines, TCP. */
int dt_link_preset(const char *name, dt_link *out) {
    static const struct { const char *name; double us, gbs; } presets[] = {
        { "shm", 15, 5 }, { "pcie", 10, 16 }, { "nvlink", 10, 400 }, { "infiniband", 8, 24 }, { "ethernet", 30, 1.25 } };
    size_t len = strlen(name);
    memset(out, 0, sizeof *out);         /* an unknown name leaves an empty link, not the caller's garbage */
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (strlen(presets[i].name) == len && !memcmp(name, presets[i].name, len)) {
            dt__copy_str(out->name, sizeof out->name, name);
            out->latency_us = presets[i].us;
            out->bandwidth_gbs = presets[i].gbs;
            return 1;
        }
    return 0;
}

/* A ring all-reduce is a reduce-scatter then an all-gather: 2(N-1) hops, each
   moving 1/N of the buffer. */
double dt_cost_all_reduce_ms(const dt_link *link, int n, double bytes) {
    if (n <= 1) return 0;
    return 2.0 * (n - 1) * link->latency_us / 1e3 + 2.0 * (n - 1) / n * bytes / (link->bandwidth_gbs * 1e9) * 1e3;
}
double dt_cost_all_gather_ms(const dt_link *link, int n, double bytes) {
    if (n <= 1) return 0;
    return (double)(n - 1) * link->latency_us / 1e3 + (double)(n - 1) / n * bytes / (link->bandwidth_gbs * 1e9) * 1e3;
}

int dt_cost_ddp_buckets(double params, double bucket_mb) {
    if (bucket_mb <= 0) return 1;
    return 1 + (int)ceil(fmax(0, 4 * params - 1048576) / (bucket_mb * 1048576.0));
}

/* FSDP's bytes between machines, the whole job's: each collective priced
   on its groups' rings, as the FSDP chapter counts the calls it makes. A
   ring of n over all the ranks (contiguous machines) crosses H times. */
static void dt__cost_ring(double whole, int n, int groups, int crossing, double *within, double *across) {
    if (n < 2) return;
    *across += whole * (n - 1) / n * crossing * groups;
    *within += whole * (n - 1) / n * (n - crossing) * groups;
}
static void dt__cost_machines(const dt_cost_input *in, int n, int K, dt_cost_prediction *p) {
    int L = in->machine_ranks > 0 && in->machine_ranks < n && n % in->machine_ranks == 0 ? in->machine_ranks : n, H = n / L;
    int crossing = H > 1 ? H : 0, B = in->quant_block > 0 ? in->quant_block : 256;
    double P = in->params, g = in->gather_bytes, r = in->reduce_bytes, *w = &p->bytes_within, *a = &p->bytes_across;
    double qw = in->qw_bits ? in->qw_bits / 8.0 + 4.0 / B : 0, qg = in->qg_bits ? in->qg_bits / 8.0 + 4.0 / B : 0;
    for (int pass = 0; in->kind == DT_PAR_ZERO3 && pass < 2; pass++) {     /* forward's gathers, then backward's */
        double share = K * (pass ? in->backward_gather_share : 1);
        if (pass && in->hierarchical) dt__cost_ring(share * P * g, L, H, 0, w, a);        /* the machine's second copy */
        else if (qw) {                                                                   /* across at each place, then within */
            dt__cost_ring(share * P * qw / L, H, L, crossing, w, a);
            dt__cost_ring(share * P * qw, L, H, 0, w, a);
        } else dt__cost_ring(share * P * g, n, 1, crossing, w, a);
    }
    if (in->kind != DT_PAR_ZERO3) dt__cost_ring(P * g, n, 1, crossing, w, a);              /* ZeRO-1, -2: the new parameters */
    if (qg) {                                                   /* within (an all-to-all: (L - 1) of L pieces), then across */
        dt__cost_ring(P * qg, L, H, 0, w, a);
        dt__cost_ring(P * qg / L, H, L, crossing, w, a);
    } else dt__cost_ring(P * r, n, 1, crossing, w, a);
}

dt_cost_prediction dt_cost_predict(const dt_cost_input *in, const dt_link *l, int n) {
    dt_cost_prediction p;
    memset(&p, 0, sizeof p);
    int K = in->accum_steps > 0 ? in->accum_steps : 1, msgs = in->messages > 0 ? in->messages : 1;
    /* every rank of the job shares the device(s), not only the n of one
       group or pipeline: a layout of one stage or one group still has D x T */
    int groups = (in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP || in->kind == DT_PAR_EP) && in->dp_groups > 1
                 ? in->dp_groups : 1;
    int everyone = n * groups * (in->kind == DT_PAR_PP && in->tp_ranks > 1 ? in->tp_ranks : 1);
    double slow = everyone > 1 && in->contention > 0 ? in->contention : 1.0;
    double c = in->compute_ms * slow;                                      /* one micro-batch */
    int sharded = in->kind == DT_PAR_ZERO1 || in->kind == DT_PAR_ZERO2 || in->kind == DT_PAR_ZERO3;
    double G = in->params * in->reduce_bytes, W = in->params * in->gather_bytes, lat = l->latency_us / 1e3;
    double share = n > 1 ? (double)(n - 1) / n : 0;
    p.ranks = n;
    p.compute_ms = K * c + in->optimizer_ms * slow / (sharded ? n : 1);
    if (n > 1 || in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP || in->kind == DT_PAR_EP)
        switch (in->kind) {   /* --tp 1: groups */
    case DT_PAR_NONE: break;
    case DT_PAR_DDP:            /* one all-reduce per bucket, once per step, behind the last backward */
        p.comm_ms = dt_cost_all_reduce_ms(l, n, G) + (msgs - 1) * 2.0 * (n - 1) * lat;
        p.exposed_ms = fmax(0, p.comm_ms - in->backward_share * c);
        p.bytes = 2 * share * G;
        break;
    case DT_PAR_DP:             /* parameters out to every device, gradients back: device 0 waits for both */
        p.comm_ms = dt_cost_all_reduce_ms(l, n, 4 * in->params);
        p.exposed_ms = p.comm_ms;
        p.bytes = 2 * share * 4 * in->params;
        break;
    case DT_PAR_ZERO1: case DT_PAR_ZERO2:   /* reduce-scatter the gradients, all-gather the new parameters */
        p.comm_ms = dt_cost_all_gather_ms(l, n, G) + dt_cost_all_gather_ms(l, n, W) + (msgs - 1) * 2.0 * (n - 1) * lat;
        p.exposed_ms = p.comm_ms;
        p.bytes = share * (G + W);
        break;
    case DT_PAR_TP: {           /* the split layers' compute divided; each sum waited for where it stands */
        double kept = in->tp_share / n + (1 - in->tp_share);
        int D = in->dp_groups > 1 ? in->dp_groups : 1;
        double grads = in->params * kept * in->reduce_bytes;              /* this rank's, averaged over the groups */
        double zero = in->dp_shard == 3 ? 1.5 : 1;                        /* sharded over the groups: ZeRO-3 gathers twice */
        p.compute_ms = K * c * kept + in->optimizer_ms * slow * kept / (in->dp_shard ? D : 1);
        p.comm_ms = K * in->tp_sums * dt_cost_all_reduce_ms(l, n, in->tp_bytes) + zero * dt_cost_all_reduce_ms(l, D, grads);
        p.exposed_ms = p.comm_ms;
        p.bytes = K * in->tp_sums * 2 * share * in->tp_bytes + zero * 2.0 * (D - 1) / D * grads;
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * D);
        return p;
    }
    case DT_PAR_PP: {           /* M micro-batches through n stages: M + n - 1 turns of the slowest stage */
        int M = in->pp_micro_batches > 0 ? in->pp_micro_batches : 1, D = in->dp_groups > 1 ? in->dp_groups : 1;
        int T = in->tp_ranks > 1 ? in->tp_ranks : 1;
        double stage = fmin(1, (in->pp_balance > 0 ? in->pp_balance : 1.0) / n);
        double kept = T > 1 ? in->tp_share / T + (1 - in->tp_share) : 1;    /* each of a stage's T ranks: its share */
        double turn = K * c * stage * kept / M;                           /* one micro-batch's forward + backward */
        double sums = T > 1 ? K * in->tp_sums * stage * dt_cost_all_reduce_ms(l, T, in->tp_bytes) : 0;   /* ... its sums */
        double hop = n > 1 ? lat + in->pp_bytes / (l->bandwidth_gbs * 1e9) * 1e3 : 0;
        double grads = in->params * stage * kept * in->reduce_bytes;
        double zero = in->dp_shard == 3 ? 1.5 * M : in->dp_shard == 2 ? (M + 1) / 2.0 : 1;   /* times DDP's average */
        /* the turns of the bubble, with their sums, count with compute, as
           the turns of the fill and the drain always have */
        p.compute_ms = (M + n - 1) * turn + (n - 1) * sums + in->optimizer_ms * slow * stage * kept / (in->dp_shard ? D : 1);
        /* every message but those of the fill and the drain arrives while
           the stage computes (its receive is posted early); the layers'
           sums stand in each turn, where nothing hides them */
        p.comm_ms = M * sums + 2 * M * hop + zero * dt_cost_all_reduce_ms(l, D, grads);
        p.exposed_ms = M * sums + 2 * (n - 1) * hop + zero * dt_cost_all_reduce_ms(l, D, grads);
        p.bytes = (n > 1 ? 2 * M * in->pp_bytes * (n - 1) / n : 0) + 2.0 * (T - 1) / T * M * K * in->tp_sums * stage * in->tp_bytes +
                  zero * 2.0 * (D - 1) / D * grads;
        p.bubble = (double)(n - 1) / (M + n - 1);
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * T * D);
        return p;
    }
    case DT_PAR_CP: {           /* 1/n of every sequence's tokens a rank; the keys and values go around a ring */
        int D = in->dp_groups > 1 ? in->dp_groups : 1, L = in->cp_layers > 0 ? in->cp_layers : 1;
        double a = in->cp_attention_share, bal = in->cp_contiguous ? (2.0 * n - 1) / n : 1;
        double busiest = c * ((1 - a) + a * bal) / n;                       /* the slowest rank's micro-batch */
        double kv = in->cp_kv_bytes / n, per_ms = l->bandwidth_gbs * 1e6;  /* a block; bytes a millisecond */
        double hop = lat + kv / per_ms;
        double block = c * a / ((double)L * n * n);      /* one block's attention, forward and backward */
        double fwd = (n - 1) * fmax(0, hop - block * (1 - in->backward_share));
        double bwd = n > 1 ? (n - 1) * fmax(0, 2 * hop - block * in->backward_share) + hop : 0;   /* + the sums home */
        double grads = in->params * in->reduce_bytes, zero = in->dp_shard == 3 ? 1.5 : 1;
        double sync = zero * dt_cost_all_reduce_ms(l, n * D, grads);
        p.compute_ms = K * busiest + in->optimizer_ms * slow / (in->dp_shard ? n * D : 1);
        p.comm_ms = K * L * (n > 1 ? (3.0 * n - 2) * hop : 0) + sync;
        p.exposed_ms = K * L * (fwd + bwd) + (in->dp_shard ? sync : fmax(0, sync - in->backward_share * busiest));
        p.bytes = (n > 1 ? K * L * kv * (3.0 * (n - 1) + 1) : 0) + zero * 2.0 * (n * D - 1) / (n * D) * grads;
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * D);
        return p;
    }
    case DT_PAR_EP: {           /* each rank its batch; the slots to their experts' ranks and back, waited for */
        int D = in->dp_groups > 1 ? in->dp_groups : 1;
        double a2a = in->ep_exchanges * (n > 1 ? (n - 1) * lat + in->ep_bytes / (l->bandwidth_gbs * 1e9) * 1e3 : 0);
        double experts = in->params * in->ep_expert_share, shared = in->params - experts, kept = experts / n + shared;
        double zero = in->dp_shard == 3 ? 1.5 : 1;
        double sync_dp = zero * dt_cost_all_reduce_ms(l, D, kept * in->reduce_bytes);    /* over the groups */
        double sync_ep = dt_cost_all_reduce_ms(l, n, shared * in->reduce_bytes);        /* the rest, over the group */
        p.compute_ms = K * c + in->optimizer_ms * slow * (in->params > 0 ? kept / in->params : 1) / (in->dp_shard ? D : 1);
        p.comm_ms = K * a2a + sync_dp + sync_ep;
        p.exposed_ms = K * a2a + (in->dp_shard ? sync_dp : fmax(0, sync_dp - in->backward_share * c)) + sync_ep;
        p.bytes = K * in->ep_exchanges * in->ep_bytes + zero * 2.0 * (D - 1) / D * kept * in->reduce_bytes +
                  2.0 * share * shared * in->reduce_bytes;
        p.step_ms = p.compute_ms + p.exposed_ms;
        p.speedup = p.step_ms > 0 ? n * D * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
        p.efficiency = p.speedup / (n * D);
        return p;
    }
    case DT_PAR_ZERO3: {        /* every micro-batch gathers twice, prefetched behind compute; one reduce-scatter */
        double gathers = 2 * (dt_cost_all_gather_ms(l, n, W) + (msgs - 1) * (n - 1) * lat);
        double scatter = dt_cost_all_gather_ms(l, n, G) + (msgs - 1) * (n - 1) * lat;
        p.comm_ms = K * gathers + scatter;
        p.exposed_ms = K * fmax(0, gathers - c * (msgs - 1) / msgs) + scatter;
        p.bytes = share * (2 * K * W + G);
        break;
    }
    }
    if (sharded) {
        dt__cost_machines(in, n, K, &p);
        /* on several machines the bytes across wait on the slower link: each rank's share of them, beside the rest */
        int L = in->machine_ranks > 0 && in->machine_ranks < n ? in->machine_ranks : n;
        if (L < n && in->across.bandwidth_gbs > 0 && l->bandwidth_gbs > 0) {
            double t = (p.bytes_across / n / in->across.bandwidth_gbs + p.bytes_within / n / l->bandwidth_gbs) / 1e6;
            p.exposed_ms += fmax(0, t - p.comm_ms);
            p.comm_ms = fmax(p.comm_ms, t);
            p.bytes = (p.bytes_within + p.bytes_across) / n;
        }
    }
    p.step_ms = p.compute_ms + p.exposed_ms;
    p.speedup = p.step_ms > 0 ? n * (K * in->compute_ms + in->optimizer_ms) / p.step_ms : 0;
    p.efficiency = p.speedup / n;
    return p;
}

void dt_cost_explain(FILE *out, const dt_cost_input *in, const dt_link *l, int n) {
    static const char *kinds[] = { "one rank", "DataParallel", "DDP", "FSDP ZeRO-1", "FSDP ZeRO-2", "FSDP ZeRO-3",
                                   "tensor parallel", "pipeline parallel", "context parallel", "expert parallel" };
    dt_cost_prediction p = dt_cost_predict(in, l, n);
    int T = in->kind == DT_PAR_PP && in->tp_ranks > 1 ? in->tp_ranks : 1;     /* a pipeline's stages split too */
    fprintf(out, "cost model: %s on %d %s%s over %s (%.0f GB/s, %.0f us), %.2fM parameters\n", kinds[in->kind], n,
            in->kind == DT_PAR_PP ? "stage" : "rank", n == 1 ? "" : "s", l->name, l->bandwidth_gbs, l->latency_us, in->params / 1e6);
    if (T > 1)
        fprintf(out, "  x %d ranks splitting each stage's layers (--tp %d): %.0f%% of the compute split, %.1f sums of %.0f KB "
                "per micro-batch in all, none hidden\n", T, T, 100 * in->tp_share, in->tp_sums, in->tp_bytes / 1e3);
    static const char *const sharded[2][4] = {      /* by dt_cost_input's dp_shard, for groups and for pipelines */
        { "", "; the optimizer state sharded over them", "; the optimizer state and the gradients sharded over them",
          "; the pieces sharded over them (ZeRO-3: the parameters gathered twice)" },
        { "", "; the optimizer state sharded over them", "; the optimizer state and the gradients sharded over them "
          "(each micro-batch's reduce-scattered)", "; the pieces sharded over them (ZeRO-3: each micro-batch gathers the "
          "parameters twice, reduce-scatters its gradients)" } };
    if (in->kind == DT_PAR_CP)
        fprintf(out, "  each sequence split over the %d ranks (%s): attention is %.0f%% of the compute, the busiest rank's "
                "%.2fx the mean's;\n  in each of %d layers the ring sends %.0f KB blocks %d time%s forward and %d back, and "
                "their gradient sums %d time%s (all but the last behind attention)\n", n, in->cp_contiguous ? "contiguous" : "every rank the same work",
                100 * in->cp_attention_share, in->cp_contiguous ? (2.0 * n - 1) / n : 1.0, in->cp_layers,
                in->cp_kv_bytes / n / 1e3, n - 1, n == 2 ? "" : "s", n - 1, n > 1 ? n : 0, n == 1 ? "" : "s");
    if (in->kind == DT_PAR_EP)
        fprintf(out, "  each rank keeps 1/%d of the experts (%.0f%% of the parameters) and reads its own batch; per "
                "micro-batch %.0f all-to-alls,\n  each sending %.1f KB to the other ranks, none hidden\n", n,
                100 * in->ep_expert_share, in->ep_exchanges, in->ep_bytes / 1e3);
    if ((in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP || in->kind == DT_PAR_EP) && in->dp_groups > 1)
        fprintf(out, "  x %d data-parallel %s of %d ranks: %d ranks in all, each its own batch%s\n", in->dp_groups,
                in->kind != DT_PAR_PP ? "groups" : "pipelines", n * T, in->dp_groups * n * T,
                sharded[in->kind == DT_PAR_PP][in->dp_shard >= 0 && in->dp_shard <= 3 ? in->dp_shard : 0]);
    if (in->kind == DT_PAR_PP && n > 1)
        fprintf(out, "  %d micro-batches through %d stages: the bubble is (P - 1) / (M + P - 1) = %.0f%% of the step "
                "(measured on this rank: %.0f%%)\n", in->pp_micro_batches > 0 ? in->pp_micro_batches : 1, n, 100 * p.bubble,
                100 * in->pp_measured_bubble);
    int L = in->machine_ranks > 0 && in->machine_ranks < n ? in->machine_ranks : n;
    if (p.bytes_within + p.bytes_across > 0 && (L < n || in->qw_bits || in->qg_bits || in->hierarchical)) {
        char zpp[96] = "";
        if (in->qw_bits || in->qg_bits || in->hierarchical)
            snprintf(zpp, sizeof zpp, "; ZeRO++:%s%s%s%s%s", in->qw_bits ? " weights int8" : "", in->qg_bits ? " gradients int" : "",
                     in->qg_bits == 8 ? "8" : in->qg_bits == 4 ? "4" : "", in->hierarchical ? " hierarchical" : "",
                     in->qw_bits || in->qg_bits ? " (quantized)" : "");
        fprintf(out, "  %d machine%s of %d ranks%s%s%s: a step moves %.3f MB across machines and %.3f MB within them (the "
                "whole job's)\n", n / L, n / L == 1 ? "" : "s", L, zpp, in->across.name[0] && L < n ? ", across them " : "",
                in->across.name[0] && L < n ? in->across.name : "", p.bytes_across / 1e6, p.bytes_within / 1e6);
    }
    fprintf(out, "  compute %.2f ms a step per rank; communication %.2f ms (%.1f MB sent per rank), %.2f ms of it not "
            "hidden\n", p.compute_ms, p.comm_ms, p.bytes / 1e6, p.exposed_ms);
    if (p.comm_ms > 0) fprintf(out, "  compute : communication = %.1f : 1", p.compute_ms / p.comm_ms);
    else fprintf(out, "  no communication");
    fprintf(out, "  ->  predicted speedup %.2fx over one rank, efficiency %.0f%%\n", p.speedup, 100 * p.efficiency);
    if (n <= 1 || in->kind == DT_PAR_NONE) return;
    /* what would change it: each lever alone */
    dt_cost_input big = *in, acc = *in, half = *in;
    big.compute_ms *= 2;
    big.tp_bytes *= 2;                   /* tensor parallelism sums activations: they double too */
    big.cp_kv_bytes *= 2;                /* ... and context parallelism's ring blocks */
    big.ep_bytes *= 2;                   /* ... and the rows expert parallelism sends */
    acc.accum_steps = (in->accum_steps > 0 ? in->accum_steps : 1) * 4;
    half.reduce_bytes = half.gather_bytes = 2;
    half.tp_bytes /= 2;
    half.ep_bytes = in->gather_bytes > 2 ? in->ep_bytes / 2 : in->ep_bytes;
    dt_cost_prediction pb = dt_cost_predict(&big, l, n), pa = dt_cost_predict(&acc, l, n), ph = dt_cost_predict(&half, l, n);
    dt_cost_prediction pf = dt_cost_predict(in, l, n / 2 > 1 ? n / 2 : 1);
    fprintf(out, "  what would change it (efficiency now %.0f%%):\n", 100 * p.efficiency);
    if (in->kind == DT_PAR_PP) {
        dt_cost_input more = *in;
        more.pp_micro_batches = (in->pp_micro_batches > 0 ? in->pp_micro_batches : 1) * 4;
        more.pp_bytes /= 4;
        more.tp_bytes /= 4;
        fprintf(out, "    4x --micro-batches:              %.0f%% (the bubble shrinks; each micro-batch is smaller)\n",
                100 * dt_cost_predict(&more, l, n).efficiency);
    } else if (in->kind == DT_PAR_CP) {
        dt_cost_input even = *in;
        even.cp_contiguous = 0;
        fprintf(out, "    twice the batch per group:       %.0f%% (compute and the ring's blocks both double)\n", 100 * pb.efficiency);
        if (in->cp_contiguous)
            fprintf(out, "    --cp-layout zigzag:              %.0f%% (every rank the same attention work)\n",
                    100 * dt_cost_predict(&even, l, n).efficiency);
    } else if (in->kind == DT_PAR_EP) {
        fprintf(out, "    twice the batch per rank:        %.0f%% (compute and the rows sent both double)\n", 100 * pb.efficiency);
        if (in->gather_bytes > 2)
            fprintf(out, "    --dtype bf16:                    %.0f%% (half the bytes of every all-to-all)\n", 100 * ph.efficiency);
    } else if (in->kind == DT_PAR_TP) {
        fprintf(out, "    twice the batch per group:       %.0f%% (compute and the activations summed both double)\n",
                100 * pb.efficiency);
        fprintf(out, "    bf16 activations:                %.0f%% (half the bytes of every sum; 06 has no --dtype yet)\n",
                100 * ph.efficiency);
    } else {
        fprintf(out, "    twice the batch per rank:        %.0f%% (compute doubles, communication does not)\n", 100 * pb.efficiency);
        fprintf(out, "    4x --accum-steps:                %.0f%% (gradients travel once per 4 micro-batches)\n", 100 * pa.efficiency);
    }
    if (in->kind != DT_PAR_TP && in->kind != DT_PAR_PP && in->kind != DT_PAR_CP && in->kind != DT_PAR_EP && (in->reduce_bytes > 2 || (in->kind == DT_PAR_ZERO3 && in->gather_bytes > 2)))
        fprintf(out, "    bf16 communication:              %.0f%% (half the bytes)\n", 100 * ph.efficiency);
    char fewer[64];
    if (in->kind == DT_PAR_TP || in->kind == DT_PAR_PP || in->kind == DT_PAR_CP || in->kind == DT_PAR_EP)
        snprintf(fewer, sizeof fewer, "--%s %d instead of %d:", in->kind == DT_PAR_TP ? "tp" : in->kind == DT_PAR_PP ? "pp"
                 : in->kind == DT_PAR_CP ? "cp" : "ep", pf.ranks, n);
    else snprintf(fewer, sizeof fewer, "%d rank%s instead of %d:", pf.ranks, pf.ranks > 1 ? "s" : "", n);
    fprintf(out, "    %-33s%.0f%% (%.2fx speedup)\n", fewer, 100 * pf.efficiency, pf.speedup);
}

