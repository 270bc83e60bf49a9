/* tests/27-cost-model.c -- tests of dtrain.h's chapter 27-cost-model:
   hand-computed cases. (tests/helpers.h: how the suite's files make one
   program.) */
#include "helpers.h"

/* ---- the cost model ----------------------------------------------------- */

TEST(cost_model_matches_hand_computed_cases, QUICK) {
    dt_link l = { "test", 10, 10 };                                  /* 10 us, 10 GB/s */
    /* ring all-reduce of 1 GB: 2(N-1) hops of 10 us, 2(N-1)/N of the bytes at 10 GB/s */
    CHECK(dt_cost_all_reduce_ms(&l, 1, 1e9) == 0);
    CHECKF(CLOSE(dt_cost_all_reduce_ms(&l, 2, 1e9), 100.02, 1e-12), "N=2: %.6f ms", dt_cost_all_reduce_ms(&l, 2, 1e9));
    CHECKF(CLOSE(dt_cost_all_reduce_ms(&l, 8, 1e9), 175.14, 1e-12), "N=8: %.6f ms", dt_cost_all_reduce_ms(&l, 8, 1e9));
    CHECKF(CLOSE(dt_cost_all_gather_ms(&l, 8, 1e9), 87.57, 1e-12), "all-gather N=8: %.6f ms", dt_cost_all_gather_ms(&l, 8, 1e9));
    /* tensor parallelism, 100 ms of compute of which 80% in the split layers,
       8 sums of 1.25e7 bytes (1.25 ms each at N=2): 100 x (0.8/2 + 0.2) = 60
       ms of compute and 10 of sums, none hidden: 100 / 70 over one rank with
       the same batch (not twice it) */
    dt_cost_input tp = { DT_PAR_TP, 100, 1, 0, 1e6, 4, 4, 1, 1, 0, 0.8, 8, 1.25e7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, { "", 0, 0 } };
    dt_cost_prediction q = dt_cost_predict(&tp, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.compute_ms, 60, 1e-12) && CLOSE(q.comm_ms, 10, 1e-12) && CLOSE(q.exposed_ms, 10, 1e-12) &&
           CLOSE(q.speedup, 100.0 / 70, 1e-12) && CLOSE(q.bytes, 8 * 1.25e7, 1e-12),
           "TP: compute %.4f, comm %.4f, exposed %.4f, speedup %.4f, bytes %.4g", q.compute_ms, q.comm_ms, q.exposed_ms,
           q.speedup, q.bytes);
    /* the same over 2 data-parallel groups: each rank's 0.6e6 gradients (2.4e6
       bytes) averaged over 2 groups, 0.24 ms exposed; twice the samples */
    tp.dp_groups = 2;
    q = dt_cost_predict(&tp, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.comm_ms, 10.24, 1e-12) && CLOSE(q.step_ms, 70.24, 1e-12) && CLOSE(q.speedup, 200 / 70.24, 1e-12) &&
           CLOSE(q.efficiency, 50 / 70.24, 1e-12) && CLOSE(q.bytes, 8 * 1.25e7 + 2.4e6, 1e-12),
           "TP x 2 groups: comm %.4f, step %.4f, speedup %.4f, efficiency %.4f, bytes %.6g", q.comm_ms, q.step_ms, q.speedup,
           q.efficiency, q.bytes);
    /* 2-D: the same groups sharding the pieces (FSDP around TP, ZeRO-3): the
       gradients' 0.24 ms times 1.5 (the parameters gathered twice), and each
       group steps half the optimizer: 10 ms x 0.6 kept / 2 groups */
    tp.dp_shard = 3;
    tp.optimizer_ms = 10;
    q = dt_cost_predict(&tp, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.compute_ms, 63, 1e-12) && CLOSE(q.comm_ms, 10.36, 1e-12) && CLOSE(q.step_ms, 73.36, 1e-12) &&
           CLOSE(q.bytes, 8 * 1.25e7 + 3.6e6, 1e-12),
           "TP x 2 groups, ZeRO-3: compute %.4f, comm %.4f, step %.4f, bytes %.6g", q.compute_ms, q.comm_ms, q.step_ms, q.bytes);
    tp.dp_shard = 0;
    tp.optimizer_ms = 0;
    /* pipeline parallelism, 100 ms of compute in 4 even stages, 8 micro-batches:
       11 turns of 100 / 4 / 8 = 3.125 ms; activations of 1e6 bytes, 0.1 ms a
       hop at 10 GB/s, 16 of them a step, of which those of the fill and the
       drain (2 x 3) are not hidden: 34.375 + 0.6 ms, a bubble of 3/11; each
       rank sends 16e6 bytes but an end stage half of that: 12e6 on average */
    dt_cost_input pp = { DT_PAR_PP, 100, 1, 0, 1e6, 4, 4, 1, 1, 0, 0, 0, 0, 0, 0, 8, 1, 1e6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, { "", 0, 0 } };
    q = dt_cost_predict(&pp, &(dt_link){ "no latency", 0, 10 }, 4);
    CHECKF(CLOSE(q.compute_ms, 34.375, 1e-12) && CLOSE(q.comm_ms, 1.6, 1e-12) && CLOSE(q.exposed_ms, 0.6, 1e-12) &&
           CLOSE(q.bubble, 3.0 / 11, 1e-12) && CLOSE(q.speedup, 100 / 34.975, 1e-12) && CLOSE(q.bytes, 12e6, 1e-12),
           "PP: compute %.4f, comm %.4f, exposed %.4f, bubble %.4f, speedup %.4f, bytes %.6g", q.compute_ms, q.comm_ms,
           q.exposed_ms, q.bubble, q.speedup, q.bytes);
    /* a stage twice the others' share (balance 2: half the compute) sets the pace: 11 turns of 6.25 ms */
    pp.pp_balance = 2;
    q = dt_cost_predict(&pp, &(dt_link){ "no latency", 0, 10 }, 4);
    CHECKF(CLOSE(q.compute_ms, 68.75, 1e-12), "PP, uneven stages: compute %.4f", q.compute_ms);
    /* the even pipeline again, each stage's layers split over 2 ranks (80%
       of the compute in split layers: 0.6 of it left per rank), 8 sums of
       1.25e6 bytes per micro-batch in the whole model (0.125 ms each), and 2
       such pipelines: turns of 100 / 4 x 0.6 / 8 = 1.875 ms and 2 sums of
       0.125 ms each; 11 turns and the bubble's 3 turns of sums, 21.375 ms of
       compute; 8 turns of sums (2 ms), 16 hops (0.6 ms of them exposed), and
       each rank's 6e5 gradient bytes averaged over 2 (0.06 ms); 16 ranks */
    pp.pp_balance = 1; pp.tp_ranks = 2; pp.tp_share = 0.8; pp.tp_sums = 8; pp.tp_bytes = 1.25e6; pp.dp_groups = 2;
    q = dt_cost_predict(&pp, &(dt_link){ "no latency", 0, 10 }, 4);
    CHECKF(CLOSE(q.compute_ms, 21.375, 1e-12) && CLOSE(q.comm_ms, 3.66, 1e-12) && CLOSE(q.exposed_ms, 2.66, 1e-12) &&
           CLOSE(q.speedup, 200 / 24.035, 1e-12) && CLOSE(q.efficiency, 200 / 24.035 / 16, 1e-12) &&
           CLOSE(q.bytes, 12e6 + 2e7 + 6e5, 1e-12),
           "PP x TP x DP: compute %.4f, comm %.4f, exposed %.4f, speedup %.4f, efficiency %.4f, bytes %.6g", q.compute_ms,
           q.comm_ms, q.exposed_ms, q.speedup, q.efficiency, q.bytes);
    /* context parallelism, 100 ms of compute of the whole sequences, half of
       it attention, over 2 ranks (zig-zag: the same work each): 50 ms a
       rank. 2 layers, keys and values of 2e6 bytes (a rank's block 1e6, 0.1
       ms at 10 GB/s): forward passes it on once behind a block's attention
       (100 x 0.5 x 0.5 forward / (2 layers x 2 x 2 blocks) = 3.125 ms:
       hidden), backward once again and its gradients' sum once (0.2 ms,
       behind a block's 3.125 ms of backward), then the sum home (0.1 ms),
       waited for: 0.2 ms exposed of 0.8; the gradients' all-reduce (4e6
       bytes, 0.4 ms) behind backward; each rank sends 2 x (1 + 1 + 2) x 1e6
       + 4e6 bytes. Against one rank with the same batch: 100 / 50.2 */
    dt_cost_input cp = { .kind = DT_PAR_CP, .compute_ms = 100, .contention = 1, .backward_share = 0.5, .params = 1e6,
                         .gather_bytes = 4, .reduce_bytes = 4, .accum_steps = 1, .cp_attention_share = 0.5, .cp_kv_bytes = 2e6,
                         .cp_layers = 2 };
    q = dt_cost_predict(&cp, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.compute_ms, 50, 1e-12) && CLOSE(q.comm_ms, 1.2, 1e-12) && CLOSE(q.exposed_ms, 0.2, 1e-12) &&
           CLOSE(q.speedup, 100 / 50.2, 1e-12) && CLOSE(q.bytes, 12e6, 1e-12),
           "CP: compute %.4f, comm %.4f, exposed %.4f, speedup %.4f, bytes %.6g", q.compute_ms, q.comm_ms, q.exposed_ms,
           q.speedup, q.bytes);
    /* contiguous pieces of a causal model: the last rank's attention is 1.5x
       the mean's, 100 x (0.5 + 0.5 x 1.5) / 2 = 62.5 ms */
    cp.cp_contiguous = 1;
    q = dt_cost_predict(&cp, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.compute_ms, 62.5, 1e-12) && CLOSE(q.step_ms, 62.7, 1e-12), "CP contiguous: compute %.4f, step %.4f",
           q.compute_ms, q.step_ms);
    /* zig-zag again, in 2 groups: the gradients averaged over all 4 ranks
       (2 x 3/4 x 4e6 bytes, 0.6 ms, behind backward), twice the samples */
    cp.cp_contiguous = 0;
    cp.dp_groups = 2;
    q = dt_cost_predict(&cp, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.comm_ms, 1.4, 1e-12) && CLOSE(q.exposed_ms, 0.2, 1e-12) && CLOSE(q.speedup, 200 / 50.2, 1e-12) &&
           CLOSE(q.efficiency, 50 / 50.2, 1e-12) && CLOSE(q.bytes, 14e6, 1e-12),
           "CP x 2 groups: comm %.4f, exposed %.4f, speedup %.4f, efficiency %.4f, bytes %.6g", q.comm_ms, q.exposed_ms,
           q.speedup, q.efficiency, q.bytes);
    /* Expert parallelism over 2 ranks, each its own batch (100 ms, as one
       rank): 8 all-to-alls of 1e6 bytes each (0.1 ms at 10 GB/s), waited
       for; 80% of 1e6 parameters are experts, so the rest (8e5 bytes of
       gradients) is all-reduced over the pair after backward, 0.08 ms, also
       waited for. Against one rank with the same batch per rank: 200 / 100.88. */
    dt_cost_input ep = { .kind = DT_PAR_EP, .compute_ms = 100, .contention = 1, .backward_share = 0.5, .params = 1e6,
                         .gather_bytes = 4, .reduce_bytes = 4, .accum_steps = 1, .ep_expert_share = 0.8, .ep_exchanges = 8,
                         .ep_bytes = 1e6 };
    q = dt_cost_predict(&ep, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.compute_ms, 100, 1e-12) && CLOSE(q.comm_ms, 0.88, 1e-12) && CLOSE(q.exposed_ms, 0.88, 1e-12) &&
           CLOSE(q.speedup, 200 / 100.88, 1e-12) && CLOSE(q.bytes, 8.8e6, 1e-12),
           "EP: compute %.4f, comm %.4f, exposed %.4f, speedup %.4f, bytes %.6g", q.compute_ms, q.comm_ms, q.exposed_ms,
           q.speedup, q.bytes);
    /* ... in 2 groups: what a rank holds (half the experts and the rest,
       2.4e6 bytes of gradients) averaged over the groups behind backward
       (0.24 ms, hidden), twice the samples */
    ep.dp_groups = 2;
    q = dt_cost_predict(&ep, &(dt_link){ "no latency", 0, 10 }, 2);
    CHECKF(CLOSE(q.comm_ms, 1.12, 1e-12) && CLOSE(q.exposed_ms, 0.88, 1e-12) && CLOSE(q.speedup, 400 / 100.88, 1e-12) &&
           CLOSE(q.bytes, 11.2e6, 1e-12), "EP x 2 groups: comm %.4f, exposed %.4f, speedup %.4f, bytes %.6g", q.comm_ms,
           q.exposed_ms, q.speedup, q.bytes);
    /* 2 pipelines of one stage on a device they share (contention 2): both
       ranks' compute is slowed, though each pipeline has one rank */
    dt_cost_input shared = { DT_PAR_PP, 100, 2, 0, 1e6, 4, 4, 1, 1, 0, 0, 0, 0, 0, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, { "", 0, 0 } };
    q = dt_cost_predict(&shared, &(dt_link){ "no latency", 0, 10 }, 1);
    CHECKF(CLOSE(q.compute_ms, 200, 1e-12) && CLOSE(q.comm_ms, 0.4, 1e-12), "2 x 1 x 1 sharing a device: compute %.4f, comm %.4f",
           q.compute_ms, q.comm_ms);
    /* an optimizer step of 10 ms on the whole model: 20 on the shared device, 10 each with it shared out (ZeRO-1) */
    shared.optimizer_ms = 10;
    q = dt_cost_predict(&shared, &(dt_link){ "no latency", 0, 10 }, 1);
    double whole_opt = q.compute_ms;
    shared.dp_shard = 1;
    q = dt_cost_predict(&shared, &(dt_link){ "no latency", 0, 10 }, 1);
    CHECKF(CLOSE(whole_opt, 220, 1e-12) && CLOSE(q.compute_ms, 210, 1e-12), "ZeRO-1 over 2 pipelines: compute %.4f, unsharded %.4f",
           q.compute_ms, whole_opt);
    /* ZeRO-2 and -3 around a pipeline reduce-scatter each of its M micro-batches' gradients ((M + 1) / 2 times DDP's
       average, with the step's all-gather), ZeRO-3 also gathers twice a micro-batch (1.5 M times) */
    double comm[4];
    for (int z = 0; z < 4; z++) {
        dt_cost_input m4 = shared;
        m4.pp_micro_batches = 4;
        m4.dp_shard = z;
        comm[z] = dt_cost_predict(&m4, &(dt_link){ "no latency", 0, 10 }, 1).comm_ms;
    }
    CHECKF(comm[0] > 0 && CLOSE(comm[1], comm[0], 1e-12) && CLOSE(comm[2], 2.5 * comm[0], 1e-12) && CLOSE(comm[3], 6 * comm[0], 1e-12),
           "ZeRO-0..3 around a pipeline of 4 micro-batches: communication %.4f %.4f %.4f %.4f", comm[0], comm[1], comm[2], comm[3]);
    /* a pipeline of one stage whose layers split over 2 ranks is tensor
       parallelism: the same step as the TP case above, at any M (each
       micro-batch's sums 1/M of the bytes) */
    tp.dp_groups = 0;                       /* one group again */
    for (int M = 1; M <= 4; M *= 2) {
        dt_cost_input one = tp;
        one.kind = DT_PAR_PP; one.tp_ranks = 2; one.dp_groups = 0; one.pp_micro_batches = M; one.tp_bytes = tp.tp_bytes / M;
        dt_cost_prediction a = dt_cost_predict(&one, &(dt_link){ "no latency", 0, 10 }, 1);
        dt_cost_prediction b = dt_cost_predict(&tp, &(dt_link){ "no latency", 0, 10 }, 2);
        CHECKF(CLOSE(a.step_ms, b.step_ms, 1e-12) && CLOSE(a.comm_ms, b.comm_ms, 1e-12) && CLOSE(a.speedup, b.speedup, 1e-12) &&
               CLOSE(a.efficiency, b.efficiency, 1e-12) && CLOSE(a.bytes, b.bytes, 1e-9),
               "--pp 1 --tp 2, M %d: step %.4f comm %.4f speedup %.4f bytes %.6g; --tp 2: %.4f %.4f %.4f %.6g", M, a.step_ms,
               a.comm_ms, a.speedup, a.bytes, b.step_ms, b.comm_ms, b.speedup, b.bytes);
    }
    /* DDP, 100 ms of compute, 25 ms of all-reduce (2.5e8 bytes at N=2, no latency):
       nothing hidden: 125 ms a step, 80% efficiency; hidden behind half of
       compute (50 ms): 100% */
    dt_link fast = { "no latency", 0, 10 };
    dt_cost_input in = { DT_PAR_DDP, 100, 1, 0, 6.25e7, 4, 4, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, { "", 0, 0 } };
    dt_cost_prediction p = dt_cost_predict(&in, &fast, 2);
    CHECKF(CLOSE(p.comm_ms, 25, 1e-12) && CLOSE(p.step_ms, 125, 1e-12) && CLOSE(p.efficiency, 0.8, 1e-12),
           "DDP: comm %.4f, step %.4f, efficiency %.4f", p.comm_ms, p.step_ms, p.efficiency);
    in.backward_share = 0.5;
    p = dt_cost_predict(&in, &fast, 2);
    CHECKF(p.exposed_ms == 0 && CLOSE(p.speedup, 2, 1e-12), "DDP hidden: exposed %.4f, speedup %.4f", p.exposed_ms, p.speedup);
    /* accumulation: 4 micro-batches, one all-reduce: 400 / 425 */
    in.backward_share = 0; in.accum_steps = 4;
    p = dt_cost_predict(&in, &fast, 2);
    CHECKF(CLOSE(p.efficiency, 400.0 / 425, 1e-12), "DDP K=4: efficiency %.4f", p.efficiency);
    /* on a CPU two ranks share the cores (contention 2): 200 ms of compute + 25 */
    in.accum_steps = 1; in.contention = 2;
    p = dt_cost_predict(&in, &fast, 2);
    CHECKF(CLOSE(p.speedup, 2 * 100.0 / 225, 1e-12), "DDP contended: speedup %.4f", p.speedup);
    /* FSDP (ZeRO-3) moves 1.5x DDP's bytes: parameters gathered twice, gradients reduce-scattered once */
    in.contention = 1;
    dt_cost_input z3 = in, z1 = in;
    z3.kind = DT_PAR_ZERO3; z1.kind = DT_PAR_ZERO1;
    for (int n = 2; n <= 8; n *= 2) {
        dt_cost_prediction d = dt_cost_predict(&in, &fast, n), f = dt_cost_predict(&z3, &fast, n), o = dt_cost_predict(&z1, &fast, n);
        CHECKF(CLOSE(f.bytes, 1.5 * d.bytes, 1e-12) && CLOSE(f.comm_ms, 1.5 * d.comm_ms, 1e-12),
               "N=%d: FSDP %.4g bytes, %.4f ms; DDP %.4g bytes, %.4f ms", n, f.bytes, f.comm_ms, d.bytes, d.comm_ms);
        CHECKF(CLOSE(o.bytes, d.bytes, 1e-12), "N=%d: ZeRO-1 %.4g bytes, DDP %.4g", n, o.bytes, d.bytes);
    }
    /* ZeRO-3 on 2 machines of 2 ranks, 1e6 f32 parameters: each of the
       three collectives (two gathers, one reduce-scatter; 4e6 bytes) runs on
       a ring of 4 whose links carry 3/4 of it, 2 of them between the
       machines: 1.5 x 4e6 across and as much within, three times. ZeRO++
       with int8 weights (1 + 4/256 bytes a parameter), int4 gradients (0.5
       + 4/256) and the second copy: the forward's gather sends each rank's
       1/4 once to the other machine (1.015625e6 across) and the machine's
       halves within (2.03125e6); backward's within (8e6); the gradients'
       sums within (1.03125e6), then half of them across (0.515625e6). */
    dt_cost_input zm = z3;
    zm.params = 1e6; zm.machine_ranks = 2; zm.backward_gather_share = 1;
    p = dt_cost_predict(&zm, &fast, 4);
    CHECKF(CLOSE(p.bytes_across, 18e6, 1e-12) && CLOSE(p.bytes_within, 18e6, 1e-12), "ZeRO-3 on 2 machines: %.6g across, %.6g within",
           p.bytes_across, p.bytes_within);
    zm.qw_bits = 8; zm.qg_bits = 4; zm.hierarchical = 1; zm.quant_block = 256;
    p = dt_cost_predict(&zm, &fast, 4);
    CHECKF(CLOSE(p.bytes_across, 1.53125e6, 1e-12) && CLOSE(p.bytes_within, 11.0625e6, 1e-12),
           "ZeRO++ on 2 machines: %.6g across, %.6g within", p.bytes_across, p.bytes_within);
    /* ZeRO-1 with a 20 ms optimizer: each of 2 ranks steps half (10 ms); a
       reduce-scatter and an all-gather of 2.5e8 bytes, 12.5 ms each: 2 x 120 / 135 */
    z1.optimizer_ms = 20;
    p = dt_cost_predict(&z1, &fast, 2);
    CHECKF(CLOSE(p.step_ms, 135, 1e-12) && CLOSE(p.speedup, 240.0 / 135, 1e-12), "ZeRO-1: step %.4f, speedup %.4f",
           p.step_ms, p.speedup);
    /* bf16 halves FSDP's bytes; a unit's gathers hide behind the compute of the others */
    z3.gather_bytes = z3.reduce_bytes = 2; z3.messages = 4;
    p = dt_cost_predict(&z3, &fast, 2);    /* 2 gathers of 6.25 ms hide behind 75 ms; the 6.25 ms reduce-scatter shows */
    CHECKF(CLOSE(p.comm_ms, 18.75, 1e-12) && CLOSE(p.exposed_ms, 6.25, 1e-12), "FSDP bf16: comm %.4f, exposed %.4f",
           p.comm_ms, p.exposed_ms);
    dt_link nv;
    CHECK(dt_link_preset("nvlink", &nv) && nv.bandwidth_gbs > 100 && !dt_link_preset("carrier-pigeon", &nv));
    /* --explain on a real run: the prediction, the ratio and the levers, after 3 steps */
    char out[16384];
    int st = run_cmd(out, sizeof out, "%s --data %s " SMALL_FLAGS " --steps 4 --explain --link pcie", stage_bin("03-ddp"),
                     small_data());
    CHECKF(st == 0 && strstr(out, "cost model: DDP on 2 ranks over pcie") && strstr(out, "compute : communication") &&
           strstr(out, "4x --accum-steps") && strstr(out, "predicted speedup at 2 ranks"), "--explain: exit %d\n%s", st, out);
    /* ... and of a composed layout, 1 x 2 x 2: the pipeline's stages, the
       sums of each stage's split layers as the run counted them (4 per
       block and the vocabulary's, each micro-batch), the bubble */
    st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 16 --steps 4 "
                 "--epochs 1 --nproc 4 --tp 2 --pp 2 --micro-batches 4 --explain", stage_bin("07-pipeline-parallel"), gpt_text());
    const char *split = strstr(out, "ranks splitting each stage's layers (--tp 2): ");
    double share = 0, sums = 0;
    if (split) sscanf(split + strlen("ranks splitting each stage's layers (--tp 2): "), "%lf%% of the compute split, %lf sums", &share,
                      &sums);
    CHECKF(st == 0 && strstr(out, "cost model: pipeline parallel on 2 stages") && split && share > 50 && share <= 100 &&
           sums >= 8 && strstr(out, "4 micro-batches through 2 stages: the bubble is (P - 1) / (M + P - 1) = 20%") &&
           strstr(out, "predicted speedup at --pp 2"), "07 --tp 2 --pp 2 --explain: exit %d (split %.1f%%, %.1f sums)\n%s", st,
           share, sums, out);
    /* ... and of context parallelism: its ring, attention's share, the layout's lever */
    st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 2 --heads 4 --seq-len 64 --batch-size 4 --steps 4 "
                 "--epochs 1 --nproc 2 --cp 2 --cp-layout contiguous --explain", stage_bin("08-context-parallel"), gpt_text());
    const char *att = strstr(out, "(contiguous): attention is ");
    double attention = 0;
    if (att) sscanf(att + strlen("(contiguous): attention is "), "%lf", &attention);
    CHECKF(st == 0 && strstr(out, "cost model: context parallel on 2 ranks") && att && attention > 5 && attention < 95 &&
           strstr(out, "the busiest rank's 1.50x the mean's") && strstr(out, "blocks 1 time forward and 1 back, and their gradient sums 2 times") &&
           strstr(out, "--cp-layout zigzag:") && strstr(out, "predicted speedup at --cp 2"),
           "08 --cp 2 --explain: exit %d (attention %.1f%%)\n%s", st, attention, out);
    /* ... and of expert parallelism: the experts' share, four all-to-alls per MoE layer (2 layers here) */
    st = run_cmd(out, sizeof out, "%s --data %s --model gpt --dim 32 --depth 2 --heads 4 --seq-len 16 --batch-size 4 --steps 4 "
                 "--epochs 1 --moe-experts 4 --moe-top-k 2 --nproc 2 --ep 2 --explain", stage_bin("09-expert-parallel"), gpt_text());
    const char *xs = strstr(out, "each rank keeps 1/2 of the experts (");
    double experts = 0;
    if (xs) sscanf(xs + strlen("each rank keeps 1/2 of the experts ("), "%lf", &experts);
    CHECKF(st == 0 && strstr(out, "cost model: expert parallel on 2 ranks") && xs && experts > 50 && experts < 100 &&
           strstr(out, "per micro-batch 8 all-to-alls") && strstr(out, "--ep 1 instead of 2:") &&
           strstr(out, "predicted speedup at --ep 2"), "09 --ep 2 --explain: exit %d (experts %.1f%%)\n%s", st, experts, out);
}
