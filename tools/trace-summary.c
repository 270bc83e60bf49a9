/* trace-summary: where each rank's time went, from the Chrome traces a run
   wrote (--trace; one file per rank). Per rank: the time in each phase of
   the step (data, forward, backward, waiting for communication, optimizer,
   evaluation, checkpoint), the communication the communication thread did,
   how much of it ran while the rank computed (hidden: its overlap with
   forward, backward and the optimizer, as HTA's overlap breakdown counts
   communication under compute kernels), the time in no phase at all (idle)
   and, under pipeline parallelism, the time a stage waited for its
   neighbours. Then the straggler: the rank that computed longest, which the
   others wait for at every collective.

   usage: tools/trace-summary TRACE...      (run.json, or run.rank0.json run.rank1.json ...) */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { TRACKS = DT_TRACK_PIPELINE + 1, COMM = DT_TRACK_COMM, PIPELINE = DT_TRACK_PIPELINE };   /* dtrain.h's tracks */
typedef struct { double t0, t1; } span;
typedef struct {
    const char *path;
    int rank;
    double in_track[TRACKS], waiting, first, last;
    span *spans[TRACKS];
    int n[TRACKS], cap[TRACKS];
    double comm, hidden, idle, compute;
} rank_summary;

static double number_after(const char *line, const char *key, const char *path, int lineno) {
    const char *at = strstr(line, key);
    char *end = NULL;
    double v = at ? strtod(at + strlen(key), &end) : 0;
    if (!at || end == at + strlen(key) || !isfinite(v))
        dt_fail("'%s' line %d: a complete event has %s followed by a number: %.80s", path, lineno, key, line);
    return v;
}

static void add_span(rank_summary *r, int track, double t0, double t1) {
    if (r->n[track] == r->cap[track]) {
        r->cap[track] = r->cap[track] ? 2 * r->cap[track] : 256;
        r->spans[track] = (span *)realloc(r->spans[track], sizeof(span) * (size_t)r->cap[track]);
        if (!r->spans[track]) dt_fail("out of memory (reading '%s')", r->path);
    }
    r->spans[track][r->n[track]++] = (span){ t0, t1 };
}

/* One rank's trace: dtrain writes one event per line; any other "ph":"X"
   line that lacks its numbers is a damaged file, named with its line. */
static void read_trace(rank_summary *r) {
    FILE *f = fopen(r->path, "r");
    if (!f) dt_fail("cannot read '%s': %s", r->path, strerror(errno));
    char line[4096];
    int lineno = 0, events = 0;
    r->first = HUGE_VAL;
    r->last = -HUGE_VAL;
    r->rank = -1;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (lineno == 1 && line[0] != '[') dt_fail("'%s' is not a Chrome trace (it does not begin with '[')", r->path);
        if (!strstr(line, "\"ph\":\"X\"")) continue;
        int tid = (int)number_after(line, "\"tid\":", r->path, lineno), pid = (int)number_after(line, "\"pid\":", r->path, lineno);
        double ts = number_after(line, "\"ts\":", r->path, lineno), dur = number_after(line, "\"dur\":", r->path, lineno);
        if (tid < 0 || tid >= TRACKS || dur < 0)
            dt_fail("'%s' line %d: track %d, duration %g: not an event dtrain writes", r->path, lineno, tid, dur);
        if (r->rank < 0) r->rank = pid;
        double t0 = ts / 1e3, t1 = (ts + dur) / 1e3;        /* microseconds in the file, milliseconds here */
        r->in_track[tid] += t1 - t0;
        if (tid == PIPELINE && strstr(line, "\"name\":\"waiting\"")) r->waiting += t1 - t0;
        add_span(r, tid, t0, t1);
        if (t0 < r->first) r->first = t0;
        if (t1 > r->last) r->last = t1;
        events++;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) dt_fail("cannot read '%s': %s", r->path, strerror(errno));
    if (!events) dt_fail("'%s' holds no timed events (a trace of a run that took no step?)", r->path);
}

static int by_start(const void *a, const void *b) {
    double x = ((const span *)a)->t0, y = ((const span *)b)->t0;
    return (x > y) - (x < y);
}

/* The phases are one after another on a rank, so their spans do not overlap
   each other: sorted, what a communication span shares with them is found by
   a binary search and a short walk. */
static void summarize(rank_summary *r) {
    static const int computing[3] = { DT_PHASE_FWD, DT_PHASE_BWD, DT_PHASE_OPT };
    int n = 0;
    for (int k = 0; k < 3; k++) n += r->n[computing[k]];
    span *busy = (span *)malloc(sizeof(span) * (size_t)(n + 1));
    if (!busy) dt_fail("out of memory (summarizing '%s')", r->path);
    n = 0;
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < r->n[computing[k]]; i++) busy[n++] = r->spans[computing[k]][i];
    qsort(busy, (size_t)n, sizeof(span), by_start);
    r->compute = 0;
    for (int i = 0; i < n; i++) r->compute += busy[i].t1 - busy[i].t0;
    r->comm = r->in_track[COMM];
    r->hidden = 0;
    for (int c = 0; c < r->n[COMM]; c++) {
        span s = r->spans[COMM][c];
        int lo = 0, hi = n;                     /* the first busy span that ends after s begins */
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (busy[mid].t1 <= s.t0) lo = mid + 1;
            else hi = mid;
        }
        for (int i = lo; i < n && busy[i].t0 < s.t1; i++) r->hidden += fmax(0, fmin(s.t1, busy[i].t1) - fmax(s.t0, busy[i].t0));
    }
    free(busy);
    double in_phases = 0;
    for (int k = 0; k < DT_PHASE_COUNT; k++) in_phases += r->in_track[k];
    r->idle = fmax(0, (r->last - r->first) - in_phases);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        int help = argc == 2;
        fprintf(help ? stdout : stderr, "usage: %s TRACE...  (the --trace files of a run: one per rank)\n", argv[0]);
        return help ? 0 : 2;
    }
    int R = argc - 1;
    rank_summary *ranks = (rank_summary *)calloc((size_t)R, sizeof(rank_summary));
    if (!ranks) dt_fail("out of memory");
    for (int i = 0; i < R; i++) {
        ranks[i].path = argv[i + 1];
        read_trace(&ranks[i]);
        summarize(&ranks[i]);
    }
    int pipeline = 0;
    for (int i = 0; i < R; i++) pipeline |= ranks[i].n[PIPELINE] > 0;
    printf("milliseconds per rank, over the whole run (%d trace%s)\n", R, R > 1 ? "s" : "");
    printf("%-5s %9s %9s %9s %9s %9s %9s %9s | %9s %9s %8s %9s%s\n", "rank", "data", "forward", "backward", "comm wait",
           "optimizer", "eval", "checkpt", "comm", "hidden", "overlap", "idle", pipeline ? "   waiting (pipeline)" : "");
    double mean = 0;
    int slowest = 0;
    for (int i = 0; i < R; i++) {
        rank_summary *r = &ranks[i];
        printf("%-5d", r->rank);
        for (int k = 0; k < DT_PHASE_COUNT; k++) printf(" %9.1f", r->in_track[k]);
        printf(" | %9.1f %9.1f %7.1f%% %9.1f", r->comm, r->hidden, r->comm > 0 ? 100 * r->hidden / r->comm : 0.0, r->idle);
        if (pipeline) printf("   %9.1f", r->waiting);
        printf("\n");
        mean += r->compute / R;
        if (r->compute > ranks[slowest].compute) slowest = i;
    }
    if (R > 1)
        printf("straggler: rank %d computed %.1f ms (forward, backward, optimizer), %.1f%% above the ranks' mean: the others "
               "wait for it at each collective (their comm wait)\n", ranks[slowest].rank, ranks[slowest].compute,
               mean > 0 ? 100 * (ranks[slowest].compute / mean - 1) : 0.0);
    for (int i = 0; i < R; i++)
        for (int k = 0; k < TRACKS; k++) free(ranks[i].spans[k]);
    free(ranks);
    return 0;
}
