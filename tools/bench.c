/* tools/bench -- the scaling study behind `make bench`: did more ranks make
   training faster on this machine, and why or why not?

   usage: tools/bench [--out DIR] [--max-ranks N] [--quick]

   For each reference workload (mlp; vit-tiny) and each stage, at 1, 2 and 4
   ranks, it runs the stage's own --bench and reads its "bench:" line. Each
   row gets its speedup and efficiency against the same stage at one rank,
   and the cost model's prediction (dtrain.h's cost-model chapter) next to it. The
   link the model uses is measured first: tools/collectives --bench at 2 and 4
   ranks. Writes DIR/results.csv, DIR/scaling.svg and DIR/memory.svg (default
   DIR: bench). --quick: fewer timed steps, for a first look. --only WORD: the
   stages or workloads whose name holds WORD (stage 01 runs for every workload
   left, as the baseline). --redraw DIR: the charts again
   from DIR/results.csv. --predict: the cost model alone, for vit-base on 1 to
   8 GPUs over NVLink and PCIe. --layouts N: one world size composed every
   way stage 07 can (D data-parallel pipelines x P stages x T ranks
   splitting each stage's layers, D x T x P = N), side by side with stage 01
   and the cost model's prediction for each: DIR/layouts.csv and
   DIR/layouts.svg. Without --layouts, a run at 4 ranks ends with
   --layouts 4 (unless --only leaves gpt-char and 07 out). */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A file in the output folder: a path that does not fit is an error, never a shortened name. */
static void out_path(char *path, size_t n, const char *dir, const char *file) {
    int len = snprintf(path, n, "%s/%s", dir, file);
    if (len < 0 || (size_t)len >= n) dt_fail("--out: the path '%s/%s' is too long", dir, file);
}

/* units: what FSDP gathers one at a time; heads: what tensor parallelism splits attention by (0: none);
   blocks: what pipeline parallelism splits into stages; language: a long-context language model, which
   context parallelism (08) is for, or (2) a mixture of experts, which expert parallelism (09) is for --
   each runs 01, 03 and its stage alone (the others have their workloads) */
typedef struct { const char *name, *flags; int units, heads, blocks, language; } workload;
static const workload workloads[] = {
    { "mlp", "--model mlp", 3, 0, 3, 0 },
    { "vit-tiny", "--model vit --dim 192 --depth 6 --heads 3 --patch 4 --batch-size 64", 8, 3, 6, 0 },
    { "gpt-512", "--model gpt --dim 64 --depth 2 --heads 4 --seq-len 512 --batch-size 4", 4, 4, 2, 1 },
    { "gpt-moe", "--model gpt --dim 128 --depth 2 --heads 4 --seq-len 64 --batch-size 8 --moe-experts 8 --moe-top-k 2", 4, 4, 2, 2 },
    { "vit-base", "--model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 --batch-size 64", 14, 12, 12, 0 },  /* GPUs only */
};
/* label, binary, flags, the parallelism the cost model sees, 16-bit gathers */
typedef struct { const char *label, *bin, *flags; dt_parallelism kind; int half; } stage;
static const stage stages[] = {
    { "01-single-gpu", "01-single-gpu/train", "", DT_PAR_NONE, 0 },
    { "02-dp", "02-dp/train", "", DT_PAR_DP, 0 },
    { "03-ddp", "03-ddp/train", "", DT_PAR_DDP, 0 },
    { "04-fsdp/optimizer", "04-fsdp/train", "--shard optimizer", DT_PAR_ZERO1, 0 },
    { "04-fsdp/grads", "04-fsdp/train", "--shard grads", DT_PAR_ZERO2, 0 },
    { "04-fsdp/full", "04-fsdp/train", "--shard full", DT_PAR_ZERO3, 0 },
    { "04-fsdp/full+offload", "04-fsdp/train", "--shard full --cpu-offload", DT_PAR_ZERO3, 0 },
    { "04-fsdp/full+zero++", "04-fsdp/train", "--shard full --quantize-weights int8 --quantize-grads int4 --hierarchical",
      DT_PAR_ZERO3, 0 },
    { "05/fp32", "05-accum-mixed-precision/train", "--dtype fp32", DT_PAR_ZERO3, 0 },
    { "05/bf16", "05-accum-mixed-precision/train", "--dtype bf16", DT_PAR_ZERO3, 1 },
    { "06-tensor-parallel", "06-tensor-parallel/train", "", DT_PAR_TP, 0 },
    { "07-pipeline-parallel", "07-pipeline-parallel/train", "--micro-batches 8", DT_PAR_PP, 0 },
    { "08-context-parallel", "08-context-parallel/train", "", DT_PAR_CP, 0 },
    { "09-expert-parallel", "09-expert-parallel/train", "", DT_PAR_EP, 0 },
};
/* Whether a stage runs on a workload: 08 splits sequences of tokens, 09 a
   mixture's experts; their workloads are there for them, against 01 and 03
   (DDP, which both build on). */
static int stage_runs(int s, const workload *w) {
    if (stages[s].kind == DT_PAR_CP) return w->language == 1;
    if (stages[s].kind == DT_PAR_EP) return w->language == 2;
    return !w->language || stages[s].kind == DT_PAR_NONE || stages[s].kind == DT_PAR_DDP;
}
enum { NSTAGES = sizeof stages / sizeof stages[0] };
static int NWORK = 4;                    /* vit-base joins when there is a GPU */

typedef struct {
    int ok, stage, work, ranks, threads, oversubscribed, one_thread;
    char device[16], dtype[8];
    double samples, gflops, step_ms, fwd, bwd, opt, comm, hidden, peak, state, host, params;
    double tp_share, tp_sums, tp_bytes;
    double cp_attention_share, cp_kv_bytes, cp_layers, cp_contiguous;
    double ep_share, ep_all_to_alls, ep_bytes;
    double pp_micro_batches, pp_balance, pp_bytes, bubble, bubble_predicted;
    double speedup, efficiency, predicted, predicted_eff;
} row;

static double field(const char *line, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, " %s=", key);
    const char *p = strstr(line, pat);
    return p ? atof(p + strlen(pat)) : 0;
}
static void field_str(const char *line, const char *key, char *out, size_t n) {
    char pat[64];
    snprintf(pat, sizeof pat, " %s=", key);
    const char *p = strstr(line, pat);
    out[0] = 0;
    if (!p) return;
    p += strlen(pat);
    size_t k = strcspn(p, " \n");
    snprintf(out, n, "%.*s", (int)(k < n ? k : n - 1), p);
}

/* Run a command; the first line starting with `prefix` (or all of stdout when
   prefix is NULL) goes to out. Returns the exit status. */
static int run(const char *cmd, const char *prefix, char *out, size_t n) {
    FILE *p = popen(cmd, "r");
    if (!p) dt_fail("cannot run '%s': %s", cmd, strerror(errno));
    char line[4096];
    size_t used = 0;
    out[0] = 0;
    while (fgets(line, sizeof line, p)) {
        if (prefix && !strncmp(line, prefix, strlen(prefix)) && !out[0]) snprintf(out, n, "%s", line);
        if (!prefix && used + strlen(line) < n) { memcpy(out + used, line, strlen(line) + 1); used += strlen(line); }
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}

/* The shared-memory link, from tools/collectives: bus bandwidth of the largest
   all-reduce, latency from the smallest (2(N-1) hops). */
static dt_link measure_link(int n) {
    dt_link l;
    dt_link_preset("shm", &l);
    char cmd[256], out[8192];
    snprintf(cmd, sizeof cmd, "./tools/collectives --nproc %d --bench 2>/dev/null", n);
    if (run(cmd, NULL, out, sizeof out) != 0) { printf("(tools/collectives failed: the shm preset stands in)\n"); return l; }
    double first_us = 0, bus = 0, bytes, us, alg, b;
    for (char *s = strtok(out, "\n"); s; s = strtok(NULL, "\n"))
        if (sscanf(s, "%lf %lf %lf %lf", &bytes, &us, &alg, &b) == 4) {
            if (first_us == 0) first_us = us;
            bus = b;
        }
    if (bus > 0) {
        snprintf(l.name, sizeof l.name, "shm, measured at %d ranks", n);
        l.bandwidth_gbs = bus;
        l.latency_us = first_us / (2.0 * (n - 1));
    }
    return l;
}

/* How much slower each of `ranks` ranks computes than one rank alone. On a
   CPU the ranks share its cores: with T = cores / N threads each, a rank
   computes at the speed 01 measured with T threads (from its 1- and
   all-core runs, c_one and c_all ms), and ranks beyond the cores take turns.
   GPUs are shared beyond their count. */
static double contention(const char *device, int ranks, int cores, int gpus, double c_one, double c_all) {
    if (strcmp(device, "cpu")) return gpus > 0 ? fmax(1, (double)ranks / gpus) : 1;
    int T = cores / ranks > 1 ? cores / ranks : 1;
    double eff_all = c_one > 0 && c_all > 0 ? c_one / (cores * c_all) : 1;      /* parallel efficiency */
    double eff_T = cores > 1 ? 1 + (eff_all - 1) * (T - 1) / (cores - 1) : 1;
    double c_T = c_one > 0 ? c_one / (T * eff_T) : c_all * ranks;
    return (c_all > 0 ? c_T / c_all : ranks) * fmax(1, (double)ranks * T / cores);
}

static const char *colors[] = { "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22",
                                "#393b79", "#637939", "#843c39", "#7b4173" };
_Static_assert(sizeof colors / sizeof colors[0] >= NSTAGES, "a colour for each stage");

/* scaling.svg: speedup against ranks, a panel per workload; measured solid,
   predicted dashed, and the machine's limit. */
static void draw_scaling(const char *path, row *rows, int nrows, int max_ranks, int cores, int gpus) {
    FILE *f = fopen(path, "w");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
    int W = 460, H = 360, L = 60, T = 50, PW = 360, PH = 250;
    double ymax = 2.0;
    for (int i = 0; i < nrows; i++) if (rows[i].ok) ymax = fmax(ymax, fmax(rows[i].speedup, rows[i].predicted) * 1.1);
    if (max_ranks > ymax) ymax = max_ranks;
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' font-family='sans-serif' font-size='12'>\n",
            W * NWORK + 200, H + 20);
    fprintf(f, "<rect width='100%%' height='100%%' fill='white'/>\n");
    fprintf(f, "<text x='10' y='20' font-size='15' font-weight='bold'>Speedup over 1 rank (samples/s), %d cores, %d GPUs: "
               "measured (solid) and predicted by the cost model (dashed)</text>\n", cores, gpus);
    int nticks = max_ranks >= 4 ? 3 : 2;
    for (int w = 0; w < NWORK; w++) {
        int ox = w * W + L;
        #define X(r) (ox + PW * (log2((double)(r)) / log2((double)(max_ranks > 1 ? max_ranks : 2))))
        #define Y(v) (T + PH - PH * (v) / ymax)
        fprintf(f, "<text x='%d' y='%d' font-size='13' font-weight='bold'>%s</text>\n", ox, T - 10, workloads[w].name);
        fprintf(f, "<rect x='%d' y='%d' width='%d' height='%d' fill='none' stroke='#444'/>\n", ox, T, PW, PH);
        for (double v = 0; v <= ymax + 1e-9; v += ymax > 6 ? 2 : 0.5) {
            fprintf(f, "<line x1='%d' x2='%d' y1='%.1f' y2='%.1f' stroke='#ddd'/>", ox, ox + PW, Y(v), Y(v));
            fprintf(f, "<text x='%d' y='%.1f' text-anchor='end'>%.1fx</text>\n", ox - 5, Y(v) + 4, v);
        }
        for (int k = 0; k < nticks; k++) {
            int r = 1 << k;
            fprintf(f, "<text x='%.1f' y='%d' text-anchor='middle'>%d</text>\n", X(r), T + PH + 16, r);
        }
        fprintf(f, "<text x='%d' y='%d' text-anchor='middle'>ranks</text>\n", ox + PW / 2, T + PH + 34);
        /* ideal N x, and what this machine allows: on a CPU one rank already has
           every core, so N ranks share them (1.0x); GPUs allow up to their count */
        fprintf(f, "<polyline fill='none' stroke='#999' stroke-dasharray='2,3' points='%.1f,%.1f %.1f,%.1f'/>\n", X(1), Y(1),
                X(max_ranks), Y(max_ranks));
        fprintf(f, "<text x='%.1f' y='%.1f' fill='#777' text-anchor='end'>N x (a device per rank)</text>\n", X(max_ranks) - 4,
                Y(max_ranks) + 14);
        fprintf(f, "<polyline fill='none' stroke='#999' stroke-width='2' stroke-dasharray='6,3' points='");
        for (int r = 1; r <= max_ranks; r *= 2) fprintf(f, "%.1f,%.1f ", X(r), Y(gpus > 0 ? (r < gpus ? r : gpus) : 1));
        fprintf(f, "'/>\n<text x='%d' y='%d' fill='#777' text-anchor='end'>thick grey dashes: the most this machine allows</text>\n",
                ox + PW - 6, T + PH - (gpus == 0 ? 24 : 8));
        if (gpus == 0)
            fprintf(f, "<text x='%d' y='%d' fill='#777' text-anchor='end'>(1.0x: its ranks share the cores one rank used)</text>\n",
                    ox + PW - 6, T + PH - 8);
        for (int s = 0; s < NSTAGES; s++)
            for (int pred = 0; pred < 2; pred++) {
                char pts[512] = "";
                int n = 0;
                for (int i = 0; i < nrows; i++)
                    if (rows[i].ok && rows[i].stage == s && rows[i].work == w && !rows[i].one_thread) {
                        if (pred && stages[s].kind == DT_PAR_NONE) continue;
                        double v = pred ? rows[i].predicted : rows[i].speedup;
                        snprintf(pts + strlen(pts), sizeof pts - strlen(pts), "%.1f,%.1f ", X(rows[i].ranks), Y(v));
                        if (!pred) fprintf(f, "<circle cx='%.1f' cy='%.1f' r='3' fill='%s'/>", X(rows[i].ranks), Y(v), colors[s]);
                        n++;
                    }
                if (n > 1)
                    fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='%s' %s points='%s'/>\n", colors[s],
                            pred ? "1" : "2", pred ? "stroke-dasharray='5,4'" : "", pts);
            }
        #undef X
        #undef Y
    }
    for (int s = 0; s < NSTAGES; s++) {       /* the legend */
        int y = T + 14 + 18 * s, x = NWORK * W + 10;
        fprintf(f, "<line x1='%d' x2='%d' y1='%d' y2='%d' stroke='%s' stroke-width='2'/>", x, x + 20, y - 4, y - 4, colors[s]);
        fprintf(f, "<text x='%d' y='%d'>%s</text>\n", x + 26, y, stages[s].label);
    }
    fprintf(f, "<line x1='%d' x2='%d' y1='%d' y2='%d' stroke='#333' stroke-dasharray='5,4'/><text x='%d' y='%d'>predicted</text>\n",
            NWORK * W + 10, NWORK * W + 30, T + 14 + 18 * NSTAGES + 6, T + 14 + 18 * NSTAGES + 6, NWORK * W + 36,
            T + 18 + 18 * NSTAGES + 6);
    fprintf(f, "</svg>\n");
    fclose(f);
}

/* memory.svg: the largest rank's peak device memory, a group of bars per
   stage (one bar per rank count), the sharded state darker inside it. */
static void draw_memory(const char *path, row *rows, int nrows, int max_ranks) {
    FILE *f = fopen(path, "w");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
    int L = 70, T = 50, PW = 620, PH = 230, H = PH + 150, nr = max_ranks >= 4 ? 3 : max_ranks >= 2 ? 2 : 1;
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' font-family='sans-serif' font-size='12'>\n",
            PW + L + 200, H * NWORK + 40);
    fprintf(f, "<rect width='100%%' height='100%%' fill='white'/>\n");
    fprintf(f, "<text x='10' y='20' font-size='15' font-weight='bold'>Peak memory per rank, MB: every arena (light); "
               "parameters + gradients + optimizer state (dark)</text>\n");
    static const char *shades[3][2] = { { "#aec7e8", "#1f77b4" }, { "#ffbb78", "#ff7f0e" }, { "#98df8a", "#2ca02c" } };
    for (int w = 0; w < NWORK; w++) {
        int oy = T + w * H;
        double ymax = 1;
        for (int i = 0; i < nrows; i++) if (rows[i].ok && rows[i].work == w) ymax = fmax(ymax, rows[i].peak * 1.1);
        #define Y(v) (oy + PH - PH * (v) / ymax)
        fprintf(f, "<text x='%d' y='%d' font-size='13' font-weight='bold'>%s</text>\n", L, oy - 8, workloads[w].name);
        fprintf(f, "<rect x='%d' y='%d' width='%d' height='%d' fill='none' stroke='#444'/>\n", L, oy, PW, PH);
        double step = ymax > 500 ? 200 : ymax > 200 ? 50 : ymax > 50 ? 20 : 5;
        for (double v = 0; v <= ymax; v += step) {
            fprintf(f, "<line x1='%d' x2='%d' y1='%.1f' y2='%.1f' stroke='#ddd'/>", L, L + PW, Y(v), Y(v));
            fprintf(f, "<text x='%d' y='%.1f' text-anchor='end'>%.0f</text>\n", L - 5, Y(v) + 4, v);
        }
        double gw = (double)PW / NSTAGES, bw = gw * 0.8 / nr;
        for (int s = 0; s < NSTAGES; s++) {
            for (int i = 0; i < nrows; i++) {
                row *r = &rows[i];
                if (!r->ok || r->work != w || r->stage != s) continue;
                int k = r->ranks == 1 ? 0 : r->ranks == 2 ? 1 : 2;
                double x = L + s * gw + gw * 0.1 + k * bw;
                fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='%s'/>", x, Y(r->peak), bw - 1,
                        PH * r->peak / ymax, shades[k][0]);
                fprintf(f, "<rect x='%.1f' y='%.1f' width='%.1f' height='%.1f' fill='%s'/>\n", x, Y(r->state), bw - 1,
                        PH * r->state / ymax, shades[k][1]);
            }
            fprintf(f, "<text transform='translate(%.1f,%d) rotate(35)' font-size='11'>%s</text>\n", L + s * gw + gw * 0.3,
                    oy + PH + 14, stages[s].label);
        }
        #undef Y
    }
    for (int k = 0; k < nr; k++)
        fprintf(f, "<rect x='%d' y='%d' width='14' height='10' fill='%s'/><text x='%d' y='%d'>%d rank%s</text>\n",
                L + PW - 240 + 80 * k, 28, shades[k][1], L + PW - 222 + 80 * k, 37, 1 << k, k ? "s" : "");
    fprintf(f, "</svg>\n");
    fclose(f);
}

/* --predict: vit-base (86M parameters, batch 64 per GPU) on 1 to 8 GPUs, by the
   cost model alone: no GPU has run dtrain yet. Compute per step is the FLOP
   count (forward + backward = 3x forward: 2 FLOPs per multiply-add in every
   linear layer, plus attention's QK^T and PV) at an assumed sustained rate. */
static void predict_vit_base(void) {
    const double T = 197, D = 768, depth = 12, B = 64, P = 86.6e6;
    double forward = depth * (24 * T * D * D + 4 * T * T * D) + 2 * 196 * 768 * D;    /* per image */
    double flops = 3 * forward * B;
    static const struct { const char *dtype; double tflops, bytes; } rates[] = {
        { "fp32 (TF32 off)", 40, 4 },     /* ~60% of an H100 SXM's 67 TFLOP/s fp32 */
        { "bf16", 400, 2 },               /* ~40% of its 989 TFLOP/s dense bf16 */
    };
    printf("vit-base, batch 64 per GPU: %.2f TFLOP a step. PREDICTIONS of the cost model (dtrain.h), not measurements:\n",
           flops / 1e12);
    printf("%-18s %-11s %-10s %10s %8s %8s %8s %8s\n", "dtype", "link", "parallel", "compute ms", "1 GPU", "2", "4", "8");
    for (int d = 0; d < 2; d++)
        for (int li = 0; li < 2; li++)
            for (int k = 0; k < 2; k++) {
                dt_link l;
                dt_link_preset(li ? "pcie" : "nvlink", &l);
                dt_cost_input in;
                memset(&in, 0, sizeof in);
                in.kind = k ? DT_PAR_ZERO3 : DT_PAR_DDP;
                in.compute_ms = flops / (rates[d].tflops * 1e12) * 1e3;
                in.contention = 1;
                in.backward_share = 2.0 / 3;
                in.params = P;
                in.gather_bytes = rates[d].bytes;
                in.reduce_bytes = rates[d].bytes;       /* bf16 runs reduce in bf16 too here */
                in.accum_steps = 1;
                in.messages = k ? 14 : dt_cost_ddp_buckets(P, 25);   /* FSDP: 12 blocks + embedding + head */
                printf("%-18s %-11s %-10s %10.1f", rates[d].dtype, l.name, k ? "FSDP full" : "DDP", in.compute_ms);
                for (int n = 1; n <= 8; n *= 2) {
                    dt_cost_prediction p = dt_cost_predict(&in, &l, n);
                    printf(" %5.2fx%s", p.speedup, n == 8 ? "" : " ");
                }
                printf("   (8 GPUs: %.0f%% efficiency)\n", 100 * dt_cost_predict(&in, &l, 8).efficiency);
            }
}

/* ---- --layouts N: one world size, every way to compose it ------------------
   A model that does not fit one device can be split many ways; which is
   fastest depends on the link, the batch and the model's shape. Each layout
   D x T x P runs stage 07 (--tp T --pp P, D = N / (T P) pipelines, each its
   own --batch-size) with the same micro-batches, against stage 01 on that
   batch, REPEATS times alternating; the cost model predicts each from 01's
   measured compute and what the layout's bench line says of its pipeline
   and its sums. */
typedef struct { const char *name, *flags; int heads, blocks; } layout_work;
static const layout_work layout_works[] = {
    { "gpt-char", "--model gpt --batch-size 32", 4, 4 },      /* 4 heads and 4 blocks: every layout of 4 ranks */
};
enum { LAYOUT_MICRO = 4, LAYOUT_MAX = 16, LAYOUT_REPEATS = 8 };
typedef struct {
    int D, T, P, ok;
    double rate[LAYOUT_REPEATS], median, low, high;   /* samples/s (tokens/s for a language model) */
    char line[4096];                                  /* the bench line of the last run */
    double speedup, predicted, predicted_step, step_ms, comm, bubble, formula, peak;
} layout_row;

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static void median_of(layout_row *r, int n) {
    double v[LAYOUT_REPEATS];
    memcpy(v, r->rate, sizeof(double) * (size_t)n);
    qsort(v, (size_t)n, sizeof(double), by_value);
    r->median = v[(n - 1) / 2]; r->low = v[0]; r->high = v[n - 1];
}

/* layouts.svg: a pair of bars per layout, measured speedup over stage 01
   (solid) and predicted (hollow). */
static void draw_layouts(const char *path, const char *work, int N, layout_row *rows, int n, int cores, int gpus) {
    FILE *f = fopen(path, "w");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
    int L = 60, T = 50, PW = 90 * n, PH = 240;
    double ymax = 0.5;
    for (int i = 0; i < n; i++) if (rows[i].ok) ymax = fmax(ymax, fmax(rows[i].speedup, rows[i].predicted) * 1.15);
    #define Y(v) (T + PH - PH * (v) / ymax)
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' font-family='sans-serif' font-size='12'>\n",
            PW + L + 40, PH + T + 70);
    fprintf(f, "<rect width='100%%' height='100%%' fill='white'/>\n");
    fprintf(f, "<text x='10' y='20' font-size='15' font-weight='bold'>%s on %d ranks (%d cores, %d GPUs): speedup over stage "
               "01, measured (solid) and predicted (hollow)</text>\n", work, N, cores, gpus);
    fprintf(f, "<rect x='%d' y='%d' width='%d' height='%d' fill='none' stroke='#444'/>\n", L, T, PW, PH);
    double step = ymax > 4 ? 1 : ymax > 1.5 ? 0.5 : 0.25;
    for (double v = 0; v <= ymax + 1e-9; v += step) {
        fprintf(f, "<line x1='%d' x2='%d' y1='%.1f' y2='%.1f' stroke='#ddd'/>", L, L + PW, Y(v), Y(v));
        fprintf(f, "<text x='%d' y='%.1f' text-anchor='end'>%.2fx</text>\n", L - 5, Y(v) + 4, v);
    }
    for (int i = 0; i < n; i++) {
        layout_row *r = &rows[i];
        double x = L + 90 * i + 15;
        fprintf(f, "<text x='%.1f' y='%d' text-anchor='middle'>%d x %d x %d</text>\n", x + 30, T + PH + 16, r->D, r->T, r->P);
        if (!r->ok) { fprintf(f, "<text x='%.1f' y='%d' text-anchor='middle'>failed</text>\n", x + 30, T + PH - 6); continue; }
        fprintf(f, "<rect x='%.1f' y='%.1f' width='28' height='%.1f' fill='%s'/>", x, Y(r->speedup), PH * r->speedup / ymax,
                colors[i % (int)(sizeof colors / sizeof colors[0])]);
        fprintf(f, "<rect x='%.1f' y='%.1f' width='28' height='%.1f' fill='none' stroke='%s' stroke-width='2'/>\n", x + 31,
                Y(r->predicted), PH * r->predicted / ymax, colors[i % (int)(sizeof colors / sizeof colors[0])]);
    }
    fprintf(f, "<text x='%d' y='%d' text-anchor='middle'>data x tensor x pipeline (D x T x P), %d micro-batches</text>\n",
            L + PW / 2, T + PH + 36, LAYOUT_MICRO);
    #undef Y
    fprintf(f, "</svg>\n");
    fclose(f);
}

static int layouts(int N, const char *outdir, const char *only, int repeats, int quick, int cores, int gpus, const dt_link *link) {
    int failed = 0, studied = 0;
    for (size_t w = 0; w < sizeof layout_works / sizeof layout_works[0]; w++) {
        const layout_work *lw = &layout_works[w];
        if (only && !strstr(lw->name, only) && !strstr("07-pipeline-parallel layouts", only)) continue;
        studied++;
        /* the layouts, then 01 with every core and with one (what the contention model needs) */
        layout_row rows[LAYOUT_MAX + 2];
        int n = 0;
        for (int T = 1; T <= N; T *= 2)
            for (int P = 1; T * P <= N; P *= 2) {
                if (N % (T * P) || (T > 1 && lw->heads % T) || P > lw->blocks || n == LAYOUT_MAX) continue;
                rows[n++] = (layout_row){ .D = N / (T * P), .T = T, .P = P };
            }
        int base = n;
        rows[n++] = (layout_row){ .D = 1, .T = 1, .P = 1 };
        rows[n++] = (layout_row){ .D = 1, .T = 1, .P = 1 };
        printf("\n%s on %d ranks, %d layouts (data x tensor x pipeline), %d micro-batches, %d run%s each, alternating:\n", lw->name,
               N, base, LAYOUT_MICRO, repeats, repeats > 1 ? "s" : "");
        for (int i = 0; i < n; i++) rows[i].ok = 1;
        for (int rep = 0; rep < repeats; rep++)
            for (int i = 0; i < n; i++) {
                layout_row *r = &rows[i];
                char cmd[1024];
                if (i >= base)
                    snprintf(cmd, sizeof cmd, "%s./01-single-gpu/train --bench %s%s 2>&1", i == base + 1 ? "OMP_NUM_THREADS=1 " : "",
                             lw->flags, quick ? " --steps 3" : "");
                else
                    snprintf(cmd, sizeof cmd, "./07-pipeline-parallel/train --bench --nproc %d --tp %d --pp %d --micro-batches %d "
                             "%s%s 2>&1", N, r->T, r->P, LAYOUT_MICRO, lw->flags, quick ? " --steps 3" : "");
                int st = run(cmd, "bench:", r->line, sizeof r->line);
                double rate = field(r->line, "samples_per_s");
                if (st != 0 || rate <= 0) {
                    if (r->ok) printf("FAILED (exit %d): %s\n", st, cmd);
                    r->ok = 0;
                    continue;
                }
                r->rate[rep] = rate;
                if (i < base) printf("  run %d/%d  %d x %d x %d  %9.1f samples/s\n", rep + 1, repeats, r->D, r->T, r->P, rate);
                else printf("  run %d/%d  01-single-gpu%s  %9.1f samples/s\n", rep + 1, repeats, i == base ? "" : " (1 thread)", rate);
                fflush(stdout);
            }
        for (int i = 0; i < n; i++) if (rows[i].ok) median_of(&rows[i], repeats);
        if (!rows[base].ok) { printf("stage 01 failed: no layout can be compared\n"); failed++; continue; }
        const char *one = rows[base].line;
        double c_all = field(one, "fwd_ms") + field(one, "bwd_ms"), opt = field(one, "opt_ms");
        double c_one = rows[base + 1].ok ? field(rows[base + 1].line, "fwd_ms") + field(rows[base + 1].line, "bwd_ms") : 0;
        char device[16];
        field_str(one, "device", device, sizeof device);
        for (int i = 0; i < base; i++) {
            layout_row *r = &rows[i];
            if (!r->ok) { failed++; continue; }
            r->speedup = r->median / rows[base].median;
            r->step_ms = field(r->line, "step_ms");
            r->comm = field(r->line, "comm_ms");
            r->bubble = field(r->line, "bubble");
            r->formula = field(r->line, "bubble_predicted");
            r->peak = field(r->line, "peak_mem_mb");
            dt_cost_input in;
            memset(&in, 0, sizeof in);
            in.kind = DT_PAR_PP;
            in.compute_ms = c_all;
            in.optimizer_ms = opt;
            in.params = field(r->line, "params");
            in.gather_bytes = in.reduce_bytes = 4;
            in.accum_steps = 1;
            in.tp_ranks = r->T;
            in.tp_share = field(r->line, "tp_share"); in.tp_sums = field(r->line, "tp_sums"); in.tp_bytes = field(r->line, "tp_bytes");
            in.dp_groups = r->D;
            in.pp_micro_batches = LAYOUT_MICRO;
            in.pp_balance = field(r->line, "pp_balance");
            in.pp_bytes = field(r->line, "pp_bytes");
            in.contention = contention(device, N, cores, gpus, c_one, c_all);
            dt_cost_prediction p = dt_cost_predict(&in, link, r->P);
            r->predicted = p.speedup;
            r->predicted_step = p.step_ms;
        }
        printf("\n%s, %d ranks over %s (%.2f GB/s, %.1f us); stage 01: %.1f samples/s (%.1f-%.1f)\n", lw->name, N, link->name,
               link->bandwidth_gbs, link->latency_us, rows[base].median, rows[base].low, rows[base].high);
        printf("%-13s %-24s %8s %8s %9s %10s %8s %8s %8s %8s\n", "D x T x P", "samples/s (spread)", "speedup", "predict",
               "step ms", "predicted", "comm ms", "bubble", "formula", "peak MB");
        for (int i = 0; i < base; i++) {
            layout_row *r = &rows[i];
            char name[32], rate[64];
            snprintf(name, sizeof name, "%d x %d x %d", r->D, r->T, r->P);
            if (!r->ok) { printf("%-13s failed\n", name); continue; }
            snprintf(rate, sizeof rate, "%.1f (%.1f-%.1f)", r->median, r->low, r->high);
            printf("%-13s %-24s %7.2fx %7.2fx %9.1f %10.1f %8.1f %7.0f%% %7.0f%% %8.1f\n", name, rate, r->speedup, r->predicted,
                   r->step_ms, r->predicted_step, r->comm, 100 * r->bubble, 100 * r->formula, r->peak);
        }
        char path[1024];
        out_path(path, sizeof path, outdir, "layouts.csv");
        FILE *csv = fopen(path, "w");
        if (!csv) dt_fail("cannot write '%s': %s", path, strerror(errno));
        fprintf(csv, "workload,ranks,dp,tp,pp,micro_batches,samples_per_s,low,high,speedup,predicted_speedup,step_ms,"
                     "predicted_step_ms,comm_ms,bubble,bubble_formula,peak_mem_mb_per_rank\n");
        for (int i = 0; i < base; i++) {
            layout_row *r = &rows[i];
            if (r->ok)
                fprintf(csv, "%s,%d,%d,%d,%d,%d,%.1f,%.1f,%.1f,%.3f,%.3f,%.2f,%.2f,%.2f,%.4f,%.4f,%.1f\n", lw->name, N, r->D, r->T,
                        r->P, LAYOUT_MICRO, r->median, r->low, r->high, r->speedup, r->predicted, r->step_ms, r->predicted_step,
                        r->comm, r->bubble, r->formula, r->peak);
        }
        if (fclose(csv) != 0) dt_fail("cannot write '%s': %s", path, strerror(errno));
        printf("wrote %s", path);
        out_path(path, sizeof path, outdir, "layouts.svg");
        draw_layouts(path, lw->name, N, rows, base, cores, gpus);
        printf(", %s\n", path);
        if (!strcmp(device, "cpu") && N > cores)
            printf("(%d ranks on %d cores: the ranks take turns, so a layout's speed here is mostly its compute and its "
                   "waiting; the prediction carries the same sharing)\n", N, cores);
    }
    if (!studied) printf("(--layouts: no workload left by --only %s)\n", only);
    return failed;
}

/* --redraw DIR: the charts again from DIR/results.csv, without running anything. */
static int redraw(const char *dir, int cores, int gpus) {
    char path[1024], line[1024];
    out_path(path, sizeof path, dir, "results.csv");
    FILE *f = fopen(path, "r");
    if (!f) dt_fail("cannot read '%s': %s (run tools/bench first)", path, strerror(errno));
    row *rows = (row *)calloc(256, sizeof(row));
    int n = 0, max_ranks = 1;
    if (!fgets(line, sizeof line, f)) dt_fail("'%s' is empty", path);
    while (n < 256 && fgets(line, sizeof line, f)) {
        char label[64], work[32];
        row *r = &rows[n];
        if (sscanf(line, "%63[^,],%31[^,],%d,%d,%15[^,],%7[^,],%lf,%lf,%lf,%lf,%lf,%*f,%*f,%*f,%lf,%lf", label, work, &r->ranks,
                   &r->threads, r->device, r->dtype, &r->samples, &r->speedup, &r->efficiency, &r->predicted,
                   &r->predicted_eff, &r->peak, &r->state) != 13) dt_fail("'%s': cannot read the line '%s'", path, line);
        r->stage = r->work = -1;
        for (int s = 0; s < NSTAGES; s++) if (!strcmp(label, stages[s].label)) r->stage = s;
        for (int w = 0; w < NWORK; w++) if (!strcmp(work, workloads[w].name)) r->work = w;
        if (r->stage < 0 || r->work < 0) dt_fail("'%s': unknown stage or workload in '%s'", path, line);
        r->ok = 1;
        r->one_thread = r->stage == 0 && n > 0 && rows[n - 1].stage == 0 && rows[n - 1].work == r->work;
        if (r->ranks > max_ranks) max_ranks = r->ranks;
        n++;
    }
    fclose(f);
    out_path(path, sizeof path, dir, "scaling.svg");
    draw_scaling(path, rows, n, max_ranks, cores, gpus);
    out_path(path, sizeof path, dir, "memory.svg");
    draw_memory(path, rows, n, max_ranks);
    printf("redrew %s/scaling.svg and %s/memory.svg from %d rows\n", dir, dir, n);
    free(rows);
    return 0;
}

int main(int argc, char **argv) {
    const char *outdir = "bench";
    int max_ranks = 4, quick = 0, layouts_n = 0, repeats = 0;
    const char *only = NULL, *redraw_dir = NULL, *link_name = "nvlink";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) outdir = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--max-ranks") && i + 1 < argc) max_ranks = (int)dt_flag_number("--max-ranks", argv[++i], 1, 4, 1);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--predict")) { predict_vit_base(); return 0; }
        else if (!strcmp(argv[i], "--redraw") && i + 1 < argc) redraw_dir = argv[++i];
        else if (!strcmp(argv[i], "--layouts") && i + 1 < argc) {
            layouts_n = (int)dt_flag_number("--layouts", argv[++i], 2, 16, 1);
            if (layouts_n & (layouts_n - 1))
                dt_usage_error("--layouts must be 2, 4, 8 or 16 ranks, got '%s'", argv[i]);
        }
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) {
            repeats = (int)dt_flag_number("--repeats", argv[++i], 1, LAYOUT_REPEATS, 1);
        }
        else if (!strcmp(argv[i], "--link") && i + 1 < argc) {
            link_name = argv[++i];
            dt_link probe;
            if (!dt_link_preset(link_name, &probe)) dt_usage_error("--link must be shm, pcie, nvlink or infiniband, got '%s'", link_name);
        }
        else {
            int help = !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
            fprintf(help ? stdout : stderr, "usage: %s [--out DIR] [--max-ranks 1|2|4] [--quick] [--only WORD] "
                    "[--link pcie|nvlink|infiniband (GPUs)] [--layouts N [--repeats R]] | --predict | --redraw DIR\n", argv[0]);
            return help ? 0 : 2;
        }
    }
    if (max_ranks != 1 && max_ranks != 2 && max_ranks != 4) dt_usage_error("--max-ranks must be 1, 2 or 4, got %d", max_ranks);
    int cores = dt_threads(), gpus = 0;
#ifdef DT_HAVE_CUDA
    char why[256];
    gpus = dt_cuda_device_count(why, sizeof why);      /* the stages pick a GPU when there is one */
#endif
    if (gpus > 0) {
        NWORK = 5;
        while (max_ranks > gpus) max_ranks /= 2;  /* NCCL takes one rank per GPU */
        printf("%d GPU%s: ranks up to %d, and vit-base too\n", gpus, gpus > 1 ? "s" : "", max_ranks);
    }
    if (redraw_dir) return redraw(redraw_dir, cores, gpus);
    struct stat sb;
    if (stat(outdir, &sb) != 0 && mkdir(outdir, 0755) != 0 && errno != EEXIST)
        dt_fail("--out: cannot create folder '%s': %s", outdir, strerror(errno));
    if (!repeats) repeats = quick ? 1 : 3;
    if (layouts_n) {                         /* the layouts alone */
        if (gpus > 0 && layouts_n > gpus)
            dt_usage_error("--layouts %d: this machine has %d GPU%s, and each rank of a layout needs its own (ranks sharing "
                           "one GPU measure their contention, not the layout)", layouts_n, gpus, gpus > 1 ? "s" : "");
        dt_link l;
        if (gpus > 0) dt_link_preset(link_name, &l);
        else l = measure_link(layouts_n);
        int failed = layouts(layouts_n, outdir, only, repeats, quick, cores, gpus, &l);
        if (failed) { fprintf(stderr, "tools/bench: %d layout run%s failed (see above)\n", failed, failed > 1 ? "s" : ""); return 1; }
        return 0;
    }
    dt_link links[5];
    for (int n = 2; n <= max_ranks; n *= 2) {
        /* GPUs talk over NCCL, whose link tools/collectives does not measure: the preset stands in */
        if (gpus > 0) dt_link_preset(link_name, &links[n]);
        else links[n] = measure_link(n);
        printf("link: %s: %.2f GB/s bus bandwidth, %.1f us per hop\n", links[n].name, links[n].bandwidth_gbs, links[n].latency_us);
    }
    /* --only naming a workload leaves the others out whole, their stage 01 baseline too */
    int total = 0, only_a_workload = 0, kept = 0, keep[sizeof workloads / sizeof workloads[0]];
    for (int w = 0; w < NWORK; w++) only_a_workload |= only && strstr(workloads[w].name, only);
    for (int w = 0; w < NWORK; w++) kept += keep[w] = !only_a_workload || strstr(workloads[w].name, only);
    for (int s = 0; s < NSTAGES; s++) total += s == 0 ? 2 : (max_ranks >= 4 ? 3 : max_ranks >= 2 ? 2 : 1);
    total *= kept;
    row *rows = (row *)calloc((size_t)total, sizeof(row));
    int nrows = 0;
    double t_start = dt_now_ms();
    for (int w = 0; w < NWORK; w++) {
        if (!keep[w]) continue;
        double c_all = 0, c_one = 0;          /* stage 01's compute with every core, and with one */
        for (int s = 0; s < NSTAGES; s++)
            for (int n = 1; n <= (s == 0 ? 2 : max_ranks); n *= 2) {
                if (only && s > 0 && !strstr(stages[s].label, only) && !strstr(workloads[w].name, only)) { total--; continue; }
                if (!stage_runs(s, &workloads[w])) { total--; continue; }
                if (gpus > 0 && s == 1 && n > 1) {   /* 02 drives one GPU per process in this version */
                    total--;
                    continue;
                }
                if (stages[s].kind == DT_PAR_PP && n > workloads[w].blocks) {
                    total--;
                    printf("(%s %s at %d ranks: its %d blocks do not make %d stages)\n", stages[s].label, workloads[w].name, n,
                           workloads[w].blocks, n);
                    continue;
                }
                if (stages[s].kind == DT_PAR_TP && n > 1 && workloads[w].heads % n) {
                    total--;
                    printf("(%s %s at %d ranks: its %d attention heads do not split over %d ranks, and tensor parallelism "
                           "splits attention by heads)\n", stages[s].label, workloads[w].name, n, workloads[w].heads, n);
                    continue;
                }
                /* stage 01 runs at 1 thread too (its "n = 2" slot): how compute scales with cores */
                int one_thread = s == 0 && n == 2, ranks = s == 0 ? 1 : n;
                char cmd[1024], line[4096], nproc[32] = "";
                if (stages[s].kind != DT_PAR_NONE) snprintf(nproc, sizeof nproc, " --nproc %d", ranks);   /* 01 takes no --nproc */
                snprintf(cmd, sizeof cmd, "%s./%s --bench%s %s %s%s 2>&1", one_thread ? "OMP_NUM_THREADS=1 " : "",
                         stages[s].bin, nproc, workloads[w].flags, stages[s].flags, quick ? " --steps 3" : "");
                double t0 = dt_now_ms();
                int st = run(cmd, "bench:", line, sizeof line);
                row *r = &rows[nrows++];
                r->stage = s; r->work = w; r->ranks = ranks; r->one_thread = one_thread;
                r->ok = st == 0 && line[0];
                printf("[%2d/%d] %-22s %-9s %d rank%s%s ", nrows, total, stages[s].label, workloads[w].name, ranks,
                       ranks > 1 ? "s" : " ", one_thread ? ", 1 thread" : "");
                if (!r->ok) { printf("FAILED (exit %d): %s\n", st, cmd); continue; }
                r->threads = (int)field(line, "threads");
                field_str(line, "device", r->device, sizeof r->device);
                snprintf(r->dtype, sizeof r->dtype, "%s", strstr(line, "/bf16") ? "bf16" : strstr(line, "/fp16") ? "fp16" : "fp32");
                r->samples = field(line, "samples_per_s"); r->step_ms = field(line, "step_ms");
                r->gflops = field(line, "gflops");
                r->fwd = field(line, "fwd_ms"); r->bwd = field(line, "bwd_ms"); r->opt = field(line, "opt_ms");
                r->comm = field(line, "comm_ms"); r->hidden = field(line, "comm_hidden_ms");
                r->peak = field(line, "peak_mem_mb"); r->state = field(line, "peak_state_mb"); r->host = field(line, "peak_host_mb");
                r->params = field(line, "params");
                r->tp_share = field(line, "tp_share"); r->tp_sums = field(line, "tp_sums"); r->tp_bytes = field(line, "tp_bytes");
                r->cp_attention_share = field(line, "cp_attention_share"); r->cp_kv_bytes = field(line, "cp_kv_bytes");
                r->cp_layers = field(line, "cp_layers"); r->cp_contiguous = field(line, "cp_contiguous");
                r->ep_share = field(line, "ep_share"); r->ep_all_to_alls = field(line, "ep_all_to_alls");
                r->ep_bytes = field(line, "ep_bytes");
                r->pp_micro_batches = field(line, "pp_micro_batches"); r->pp_balance = field(line, "pp_balance");
                r->pp_bytes = field(line, "pp_bytes"); r->bubble = field(line, "bubble");
                r->bubble_predicted = field(line, "bubble_predicted");
                r->oversubscribed = strcmp(r->device, "cpu") ? ranks > gpus : ranks * r->threads > cores;
                if (s == 0 && !one_thread) c_all = r->fwd + r->bwd + r->opt;
                if (one_thread) c_one = r->fwd + r->bwd + r->opt;
                printf("%9.1f samples/s %7.1f GFLOP/s  (%.1f s)\n", r->samples, r->gflops, (dt_now_ms() - t0) / 1e3);
                fflush(stdout);
            }
        /* speedups, and the model's prediction, against the same stage at 1 rank */
        for (int i = 0; i < nrows; i++) {
            row *r = &rows[i], *base = NULL;
            if (r->work != w || !r->ok) continue;
            for (int j = 0; j < nrows; j++)
                if (rows[j].ok && rows[j].work == w && rows[j].stage == r->stage && rows[j].ranks == 1 &&
                    (r->ranks > 1 || rows[j].threads == r->threads)) { base = &rows[j]; break; }
            if (!base) continue;
            r->speedup = r->samples / base->samples;
            r->efficiency = r->speedup / r->ranks;
            if (r->ranks == 1) { r->predicted = 1; r->predicted_eff = 1; continue; }
            const stage *sg = &stages[r->stage];
            double compute = base->fwd + base->bwd;
            dt_cost_input in;
            memset(&in, 0, sizeof in);
            in.kind = sg->kind;
            in.compute_ms = compute;
            in.optimizer_ms = base->opt;
            in.backward_share = compute > 0 ? base->bwd / compute : 0.66;
            in.params = r->params;
            in.gather_bytes = sg->half ? 2 : 4;
            in.reduce_bytes = 4;
            in.accum_steps = 1;
            /* DDP's buckets (25 MB, the first 1 MB); FSDP's units */
            in.messages = sg->kind == DT_PAR_DDP ? dt_cost_ddp_buckets(r->params, 25) : workloads[w].units;
            in.tp_share = r->tp_share; in.tp_sums = r->tp_sums; in.tp_bytes = r->tp_bytes;   /* 06 says, in its bench line */
            in.pp_micro_batches = (int)r->pp_micro_batches; in.pp_balance = r->pp_balance; in.pp_bytes = r->pp_bytes;   /* 07 */
            in.cp_attention_share = r->cp_attention_share; in.cp_kv_bytes = r->cp_kv_bytes;                         /* 08 */
            in.cp_layers = (int)r->cp_layers; in.cp_contiguous = (int)r->cp_contiguous;
            in.ep_expert_share = r->ep_share; in.ep_exchanges = r->ep_all_to_alls; in.ep_bytes = r->ep_bytes;   /* 09 */
            in.contention = contention(r->device, r->ranks, cores, gpus, c_one, c_all);
            dt_cost_prediction p = dt_cost_predict(&in, &links[r->ranks], r->ranks);
            r->predicted = p.speedup;
            r->predicted_eff = p.efficiency;
        }
    }
    /* the table */
    printf("\n%-22s %-9s %5s %7s %10s %8s %8s %10s %10s %8s %7s %8s %8s  %s\n", "stage", "workload", "ranks", "threads",
           "samples/s", "speedup", "predict", "efficiency", "compute ms", "comm ms", "hidden", "peak MB", "state MB", "note");
    for (int i = 0; i < nrows; i++) {
        row *r = &rows[i];
        if (!r->ok) continue;
        printf("%-22s %-9s %5d %7d %10.1f %7.2fx %7.2fx %9.0f%% %10.1f %8.1f %7.1f %8.1f %8.1f  %s\n", stages[r->stage].label,
               workloads[r->work].name, r->ranks, r->threads, r->samples, r->speedup, r->predicted, 100 * r->efficiency,
               r->fwd + r->bwd + r->opt, r->comm, r->hidden, r->peak, r->state,
               r->oversubscribed ? (strcmp(r->device, "cpu") ? "oversubscribed: more ranks than GPUs" : "oversubscribed: more ranks x threads than cores") : "");
        if (stages[r->stage].kind == DT_PAR_PP && r->ranks > 1)    /* the pipeline's idle share, beside the formula's */
            printf("%-22s %-9s %5s   the pipeline's bubble %.0f%% (the formula, (P - 1) / (M + P - 1): %.0f%%)\n", "", "", "",
                   100 * r->bubble, 100 * r->bubble_predicted);
    }
    char path[1024];
    out_path(path, sizeof path, outdir, "results.csv");
    FILE *csv = fopen(path, "w");
    if (!csv) dt_fail("cannot write '%s': %s", path, strerror(errno));
    fprintf(csv, "stage,workload,ranks,threads,device,dtype,samples_per_s,speedup,efficiency,predicted_speedup,"
                 "predicted_efficiency,compute_ms,comm_ms,hidden_comm_ms,peak_mem_mb_per_rank,state_mb_per_rank,"
                 "host_mb_per_rank,oversubscribed,gflops\n");
    for (int i = 0; i < nrows; i++) {
        row *r = &rows[i];
        if (!r->ok) continue;
        fprintf(csv, "%s,%s,%d,%d,%s,%s,%.1f,%.3f,%.3f,%.3f,%.3f,%.2f,%.2f,%.2f,%.1f,%.2f,%.2f,%d,%.2f\n", stages[r->stage].label,
                workloads[r->work].name, r->ranks, r->threads, r->device, r->dtype, r->samples, r->speedup, r->efficiency,
                r->predicted, r->predicted_eff, r->fwd + r->bwd + r->opt, r->comm, r->hidden, r->peak, r->state, r->host,
                r->oversubscribed, r->gflops);
    }
    fclose(csv);
    printf("\nwrote %s", path);
    out_path(path, sizeof path, outdir, "scaling.svg");
    draw_scaling(path, rows, nrows, max_ranks, cores, gpus);
    printf(", %s", path);
    out_path(path, sizeof path, outdir, "memory.svg");
    draw_memory(path, rows, nrows, max_ranks);
    printf(", %s (%.0f s in all)\n", path, (dt_now_ms() - t_start) / 1e3);
    int failed = 0;
    for (int i = 0; i < nrows; i++) failed += !rows[i].ok;
    free(rows);
    if (max_ranks >= 4) failed += layouts(4, outdir, only, repeats, quick, cores, gpus, &links[4]);   /* the composed rows */
    if (failed) { fprintf(stderr, "tools/bench: %d run%s failed (see above)\n", failed, failed > 1 ? "s" : ""); return 1; }
    return 0;
}
