/* tests/14-ddp.c -- tests of dtrain.h's chapter 14-ddp: DDP's buckets (stage
   03). (tests/helpers.h: how the suite's files make one program.) */
#include "helpers.h"

/* With buckets, the first bucket's all-reduce starts while backward still runs
   (read from the per-rank trace, and from comm_hidden_ms in the log); with
   --bucket-mb 0 nothing overlaps, and the weights come out bit for bit equal. */
TEST(ddp_buckets_overlap_backward_and_change_no_bits, QUICK | ALONE) {
    char out[16384], dir[2][600], log[2][600], trace[600], p[700], q[700];
    for (int k = 0; k < 2; k++) {
        snprintf(dir[k], 600, "%s/ov%d", tmpdir, k);
        snprintf(log[k], 600, "%s/ov%d.jsonl", tmpdir, k);
        snprintf(trace, sizeof trace, "%s/ov%d.json", tmpdir, k);
        int st = run_cmd(out, sizeof out, "%s --data %s " PAR_FLAGS " --model vit --depth 3 --heads 2 --batch-size 16 --nproc 2 "
                         "--bucket-mb %s --save-dir %s --log %s --trace %s", stage_bin("03-ddp"), small_data(),
                         k ? "0" : "0.02", dir[k], log[k], trace);
        CHECKF(st == 0, "exit %d\n%s", st, out);
    }
    /* the trace of rank 0: each step's backward, then its buckets */
    snprintf(trace, sizeof trace, "%s/ov0.rank0.json", tmpdir);
    size_t n = 0;
    char *text = (char *)read_bytes(trace, &n);
    int steps = 0, early = 0, buckets = 0;
    double bwd_end = -1;
    CHECKF(text != NULL, "no per-rank trace %s", trace);
    if (text) {
        text = (char *)realloc(text, n + 1);
        text[n] = 0;
        for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
            double ts = 0, dur = 0;
            char *t = strstr(line, "\"ts\":"), *d = strstr(line, "\"dur\":");
            if (!t || !d) continue;
            ts = atof(t + 5);
            dur = atof(d + 6);
            if (strstr(line, "\"name\":\"backward\"")) { bwd_end = ts + dur; steps++; }
            if (strstr(line, "\"name\":\"all_reduce bucket ")) buckets++;
            if (strstr(line, "\"name\":\"all_reduce bucket 0\"") && bwd_end >= 0 && ts < bwd_end) early++;
        }
        free(text);
    }
    CHECKF(steps == 20 && buckets >= 3 * steps, "trace: %d backward events, %d bucket all-reduces", steps, buckets);
    CHECKF(early >= 1, "in no step of %d did the first all-reduce start before backward ended", steps);
    /* the log says the same: communication hidden behind backward, and none without buckets */
    double hidden[2] = { 0, 0 };
    for (int k = 0; k < 2; k++) {
        text = (char *)read_bytes(log[k], &n);
        if (!text) continue;
        text = (char *)realloc(text, n + 1);
        text[n] = 0;
        for (char *h = text; (h = strstr(h, "\"comm_hidden_ms\":")); h++) hidden[k] += atof(h + 17);
        free(text);
    }
    CHECKF(hidden[0] > 0 && hidden[1] == 0, "comm_hidden_ms summed %.3f with buckets, %.3f without", hidden[0], hidden[1]);
    snprintf(p, sizeof p, "%s/vit_data0-320_epoch2", dir[0]);
    snprintf(q, sizeof q, "%s/vit_data0-320_epoch2", dir[1]);
    CHECKF(files_equal_tensors(p, q), "bucketed and unbucketed all-reduce give different weights");
}
