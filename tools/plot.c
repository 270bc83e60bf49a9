/* plot: training curves from --log files, as one SVG -- the loss, the
   evaluation loss, the speed (samples/s, or tokens/s for a language model)
   and the memory in use, each against the step (or, with --time, the
   training time so far), one line per log, so that runs of different
   stages can be compared at a glance (stage 01 against 03 against 05 bf16).

   usage: tools/plot [--out FILE.svg] [--time] [--title TEXT] RUN.jsonl[=LABEL]...
     RUN.jsonl=LABEL names the run in the legend (default: the file's name).
     --out: where the SVG goes (default plot.svg). */
#define DTRAIN_IMPLEMENTATION
#include "../dtrain.h"
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { PANELS = 4, MAX_RUNS = 11 };
static const char *panel_names[PANELS] = { "training loss", "evaluation loss", "speed", "memory in use (MB)" };
static const char *colors[MAX_RUNS] = { "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                                        "#17becf", "#bcbd22", "#393b79" };

typedef struct { double x, y; } point;
typedef struct {
    const char *path;
    char label[128];
    point *pts[PANELS];
    int n[PANELS], cap[PANELS];
    int tokens;                  /* its speed is tokens/s */
} run_curves;

static void add_point(run_curves *r, int panel, double x, double y) {
    if (!isfinite(x) || !isfinite(y)) return;
    if (r->n[panel] == r->cap[panel]) {
        r->cap[panel] = r->cap[panel] ? 2 * r->cap[panel] : 256;
        r->pts[panel] = (point *)realloc(r->pts[panel], sizeof(point) * (size_t)r->cap[panel]);
        if (!r->pts[panel]) dt_fail("out of memory (reading '%s')", r->path);
    }
    r->pts[panel][r->n[panel]++] = (point){ x, y };
}

/* The number after "key": in a log line, or NAN when it has none. */
static double value_of(const char *line, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *at = strstr(line, pat);
    if (!at) return NAN;
    char *end = NULL;
    double v = strtod(at + strlen(pat), &end);
    return end == at + strlen(pat) ? NAN : v;
}

/* A --log file: its step lines (loss, speed, memory) and evaluation lines.
   A run resumed into the same log starts again at its step: the points are
   kept in the order written, so the curve goes on where it stopped. */
static void read_log(run_curves *r, int by_time) {
    FILE *f = fopen(r->path, "r");
    if (!f) dt_fail("cannot read '%s': %s", r->path, strerror(errno));
    char line[16384];
    int lineno = 0, steps = 0;
    double clock_ms = 0, last_x = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (line[0] != '{') {
            if (line[0] == '\n') continue;
            dt_fail("'%s' line %d is not a JSON object (a --log file has one per line): %.60s", r->path, lineno, line);
        }
        if (strstr(line, "\"summary\":")) continue;
        double step = value_of(line, "step");
        if (isnan(step)) dt_fail("'%s' line %d has no \"step\": is it a --log file?", r->path, lineno);
        double loss = value_of(line, "loss"), eval = value_of(line, "eval_loss");
        if (!isnan(loss)) {
            double ms = value_of(line, "step_ms"), tok = value_of(line, "tokens_per_s"), smp = value_of(line, "samples_per_s");
            if (!isnan(ms)) clock_ms += ms;
            last_x = by_time ? clock_ms / 1e3 : step;
            add_point(r, 0, last_x, loss);
            r->tokens |= !isnan(tok);
            add_point(r, 2, last_x, !isnan(tok) ? tok : smp);
            add_point(r, 3, last_x, value_of(line, "mem_bytes") / 1e6);
            steps++;
        } else if (!isnan(eval)) add_point(r, 1, by_time ? last_x : step, eval);
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) dt_fail("cannot read '%s': %s", r->path, strerror(errno));
    if (!steps) dt_fail("'%s' holds no training step (a --log file of a run that took none?)", r->path);
}

/* Round numbers for an axis: 0 to a little above the largest value. */
static double nice_step(double span) {
    double p = pow(10, floor(log10(span > 0 ? span : 1))), f = span / p;
    return (f <= 2 ? 0.25 : f <= 5 ? 0.5 : 1) * p;
}

static void draw(const char *path, run_curves *runs, int R, int by_time, const char *title) {
    FILE *f = fopen(path, "w");
    if (!f) dt_fail("cannot write '%s': %s", path, strerror(errno));
    int L = 70, T = 60, PW = 380, PH = 220, GAP = 90, W = 2 * (PW + L) + 40, H = T + 2 * (PH + GAP) + 40 + 18 * R;
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' font-family='sans-serif' font-size='12'>\n", W, H);
    fprintf(f, "<rect width='100%%' height='100%%' fill='white'/>\n");
    fprintf(f, "<text x='10' y='22' font-size='15' font-weight='bold'>");
    for (const char *c = title; *c; c++) {          /* the title is the user's text: escaped */
        if (*c == '<') fputs("&lt;", f);
        else if (*c == '>') fputs("&gt;", f);
        else if (*c == '&') fputs("&amp;", f);
        else fputc(*c, f);
    }
    fprintf(f, "</text>\n");
    for (int p = 0; p < PANELS; p++) {
        double xmax = 0, ymin = HUGE_VAL, ymax = -HUGE_VAL;
        int any = 0;
        for (int r = 0; r < R; r++)
            for (int i = 0; i < runs[r].n[p]; i++) {
                xmax = fmax(xmax, runs[r].pts[p][i].x);
                ymin = fmin(ymin, runs[r].pts[p][i].y);
                ymax = fmax(ymax, runs[r].pts[p][i].y);
                any = 1;
            }
        int ox = L + (p % 2) * (PW + L + 20), oy = T + (p / 2) * (PH + GAP);
        int tokens = 0;
        for (int r = 0; r < R; r++) tokens += runs[r].tokens;
        const char *name = p != 2 ? panel_names[p] : tokens == R ? "speed (tokens/s)" : tokens == 0 ? "speed (samples/s)"
                                                 : "speed (tokens/s for the language models, samples/s for the others)";
        fprintf(f, "<text x='%d' y='%d' font-size='13' font-weight='bold'>%s</text>\n", ox, oy - 8, name);
        fprintf(f, "<rect x='%d' y='%d' width='%d' height='%d' fill='none' stroke='#444'/>\n", ox, oy, PW, PH);
        if (!any) { fprintf(f, "<text x='%d' y='%d' fill='#777'>(none in these logs)</text>\n", ox + 10, oy + 20); continue; }
        double lo = p == 0 || p == 1 ? ymin : 0, span = ymax - lo;      /* losses from their lowest, the rest from 0 */
        double ystep = nice_step(span > 0 ? span : fabs(ymax) + 1);
        lo = floor(lo / ystep) * ystep;
        double hi = ceil(ymax / ystep) * ystep;
        if (hi <= lo) hi = lo + ystep;
        if (xmax <= 0) xmax = 1;
        double xstep = nice_step(xmax);
        #define X(v) (ox + PW * (v) / xmax)
        #define Y(v) (oy + PH - PH * ((v) - lo) / (hi - lo))
        for (double v = lo; v <= hi + 1e-9 * ystep; v += ystep) {
            fprintf(f, "<line x1='%d' x2='%d' y1='%.1f' y2='%.1f' stroke='#ddd'/>", ox, ox + PW, Y(v), Y(v));
            fprintf(f, "<text x='%d' y='%.1f' text-anchor='end'>%g</text>\n", ox - 5, Y(v) + 4, v);
        }
        for (double v = 0; v <= xmax + 1e-9 * xstep; v += xstep)
            fprintf(f, "<text x='%.1f' y='%d' text-anchor='middle'>%g</text>\n", X(v), oy + PH + 16, v);
        fprintf(f, "<text x='%d' y='%d' text-anchor='middle'>%s</text>\n", ox + PW / 2, oy + PH + 34,
                by_time ? "training time (s)" : "step");
        for (int r = 0; r < R; r++) {
            if (!runs[r].n[p]) continue;
            fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='1.5' points='", colors[r]);
            for (int i = 0; i < runs[r].n[p]; i++) fprintf(f, "%.1f,%.1f ", X(runs[r].pts[p][i].x), Y(runs[r].pts[p][i].y));
            fprintf(f, "'/>\n");
        }
        #undef X
        #undef Y
    }
    for (int r = 0; r < R; r++) {          /* the legend, under the panels */
        int y = T + 2 * (PH + GAP) + 10 + 18 * r;
        fprintf(f, "<line x1='%d' x2='%d' y1='%d' y2='%d' stroke='%s' stroke-width='3'/>", L, L + 24, y - 4, y - 4, colors[r]);
        fprintf(f, "<text x='%d' y='%d'>", L + 30, y);
        for (const char *c = runs[r].label; *c; c++) {
            if (*c == '<') fputs("&lt;", f);
            else if (*c == '&') fputs("&amp;", f);
            else fputc(*c, f);
        }
        fprintf(f, "</text>\n");
    }
    fprintf(f, "</svg>\n");
    if (fflush(f) != 0 || ferror(f)) dt_fail("cannot write '%s': %s", path, strerror(errno));
    if (fclose(f) != 0) dt_fail("cannot write '%s': %s", path, strerror(errno));
}

int main(int argc, char **argv) {
    const char *out = "plot.svg", *title = "training runs";
    int by_time = 0, R = 0;
    run_curves runs[MAX_RUNS];
    memset(runs, 0, sizeof runs);
    for (int i = 1; i < argc; i++) {
        int value = i + 1 < argc;
        if (!strcmp(argv[i], "--out") || !strcmp(argv[i], "--title")) {
            if (!value) { fprintf(stderr, "%s: %s needs a value\n", argv[0], argv[i]); return 2; }
            if (!strcmp(argv[i], "--out")) out = argv[++i];
            else title = argv[++i];
        } else if (!strcmp(argv[i], "--time")) by_time = 1;
        else if (argv[i][0] == '-') {
            int help = !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
            fprintf(help ? stdout : stderr, "usage: %s [--out FILE.svg] [--time] [--title TEXT] RUN.jsonl[=LABEL]...\n", argv[0]);
            if (!help) fprintf(stderr, "%s: unknown flag '%s'\n", argv[0], argv[i]);
            return help ? 0 : 2;
        } else {
            if (R == MAX_RUNS) { fprintf(stderr, "%s: at most %d logs in one plot (one colour each)\n", argv[0], MAX_RUNS); return 2; }
            run_curves *r = &runs[R++];
            static char paths[MAX_RUNS][4096];
            /* FILE=LABEL: the last '=' after the last '/', unless the whole is a file (runs/lr=3e-4.jsonl) */
            const char *eq = strrchr(argv[i], '='), *slash = strrchr(argv[i], '/');
            if (eq && ((slash && eq < slash) || access(argv[i], F_OK) == 0)) eq = NULL;
            int len = eq ? (int)(eq - argv[i]) : (int)strlen(argv[i]);
            if (len >= (int)sizeof paths[R - 1]) { fprintf(stderr, "%s: a path of over %zu characters: %.60s...\n", argv[0], sizeof paths[R - 1] - 1, argv[i]); return 2; }
            snprintf(paths[R - 1], sizeof paths[R - 1], "%.*s", len, argv[i]);
            r->path = paths[R - 1];
            const char *base = strrchr(r->path, '/');
            snprintf(r->label, sizeof r->label, "%s", eq ? eq + 1 : base ? base + 1 : r->path);
        }
    }
    if (!R) {
        fprintf(stderr, "usage: %s [--out FILE.svg] [--time] [--title TEXT] RUN.jsonl[=LABEL]...\n", argv[0]);
        return 2;
    }
    for (int r = 0; r < R; r++) read_log(&runs[r], by_time);
    draw(out, runs, R, by_time, title);
    printf("wrote %s:", out);
    for (int r = 0; r < R; r++) printf(" %s (%d steps)%s", runs[r].label, runs[r].n[0], r + 1 < R ? "," : "\n");
    for (int r = 0; r < R; r++)
        for (int p = 0; p < PANELS; p++) free(runs[r].pts[p]);
    return 0;
}
