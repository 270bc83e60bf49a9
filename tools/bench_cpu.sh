#!/usr/bin/env bash
# `make bench` on the CPU: dtrain's stage 01 against PyTorch on the same
# workloads, a full fp32 training step with AdamW, at 1 and 2 threads.
# Runs alternate (dtrain, PyTorch, dtrain, ...) and each cell is the median of
# REPEATS runs (default 3) with their spread: this machine is noisy, and a
# single run is not a figure. PyTorch runs with OMP_WAIT_POLICY=PASSIVE (see
# tools/bench_torch.py). Then GPT-2 small's shape at context 256, BIG_REPEATS
# alternating runs per thread count (default REPEATS; a step takes seconds,
# and one run of each was not a figure either: PyTorch's ran at 96.7 and at
# 111-114 tokens/s on the same machine on two days).
#
# Before each round, tools/roofline --quick (when it is built): the core's FMA
# peak and OpenBLAS's 1024^3 matmul at one thread, the limits (their medians)
# each workload's step GFLOP/s (the bench line's gflops=) is given as a
# fraction of. And right before and right after each of dtrain's runs,
# OpenBLAS's 1024^3 again for about a second: each run's GFLOP/s against the
# mean of the two, both as the best call and as the rate kept up over all the
# calls (a step's own rate is the second kind), the median of those ratios.
# On a virtual machine whose speed swings by a third from one second to the
# next, a limit measured minutes away, or the best of many calls against a
# step's average, says more about the machine than about the code.
#
# usage: tools/bench_cpu.sh [stage-01 binary] [python with torch, or ""]
#   REPEATS=N  THREADS="1 2"  SECONDS_PER_RUN=3  BIG=0 (skip GPT-2's shape)  BIG_REPEATS=N
#   ROOFLINE=path (default tools/roofline; "" skips it)
set -uo pipefail
bin=${1:-01-single-gpu/train}
py=${2:-}
repeats=${REPEATS:-3}
threads=${THREADS:-"1 2"}
secs=${SECONDS_PER_RUN:-3}
big=${BIG:-1}
big_repeats=${BIG_REPEATS:-$repeats}
out=$(mktemp)
torch_coretype=""   # the OpenBLAS core type picked for PyTorch's runs (below); dtrain's runs are not given it
trap 'rm -f "$out"' EXIT

declare -A flags=(
  [mlp]="--model mlp --batch-size 128"
  [vit-tiny]="--model vit --batch-size 64"
  [gpt-char]="--model gpt --batch-size 32"
  [gpt2-124m-ctx256]="--model gpt --dim 768 --depth 12 --heads 12 --seq-len 256 --vocab 50257 --batch-size 4 --steps 3"
)
# one run: WORKLOAD THREADS -> "dtrain|torch WORKLOAD THREADS RATE" lines in $out
run_dtrain() {
  local line rate fpt stepgf before after
  before=$(blas_now)
  # shellcheck disable=SC2086  # the flags are words
  line=$(OMP_NUM_THREADS=$2 "$bin" --bench --device cpu ${flags[$1]} 2>&1 | grep -m1 '^bench:')
  rate=$(tr ' ' '\n' <<<"$line" | sed -n 's/^tokens_per_s=//p')
  [ -n "$rate" ] || rate=$(tr ' ' '\n' <<<"$line" | sed -n 's/^samples_per_s=//p')
  if [ -z "$rate" ]; then echo "bench_cpu.sh: $bin --bench ${flags[$1]} at $2 threads printed no bench line" >&2; return 1; fi
  echo "dtrain $1 $2 $rate" | tee -a "$out"
  stepgf=$(tr ' ' '\n' <<<"$line" | sed -n 's/^gflops=//p')   # the step's GFLOP/s, for the fractions of the peak
  [ -z "$stepgf" ] || echo "gflops $1 $2 $stepgf" >>"$out"
  [ -z "$stepgf" ] || [ -z "$before" ] || { after=$(blas_now); [ -z "$after" ] || echo "pair $1 $2 $stepgf $before $after" >>"$out"; }
  # the GPTs' FLOP per token, as dtrain counts them: both sides run the same model
  fpt=$(tr ' ' '\n' <<<"$line" | sed -n 's/^flops_per_token=//p')
  [ -z "$fpt" ] || echo "flops $1 $2 $fpt" >>"$out"
}
run_torch() {
  local line rate
  [ -n "$py" ] || return 0
  line=$(env ${torch_coretype:+OPENBLAS_CORETYPE=$torch_coretype} "$py" tools/bench_torch.py --threads "$2" --workloads "$1" --seconds "$secs" 2>&1 | grep -m1 '^torch-bench:')
  rate=$(tr ' ' '\n' <<<"$line" | sed -n 's/^tokens_per_s=//p')
  [ -n "$rate" ] || rate=$(tr ' ' '\n' <<<"$line" | sed -n 's/^samples_per_s=//p')
  if [ -z "$rate" ]; then echo "bench_cpu.sh: tools/bench_torch.py --workloads $1 at $2 threads printed no torch-bench line" >&2; return 1; fi
  echo "torch $1 $2 $rate" | tee -a "$out"
}

# OpenBLAS's core type for PyTorch's runs (tools/openblas_coretype.sh says why)
. "$(dirname "$0")/openblas_coretype.sh"
[ -z "$py" ] || pick_torch_coretype "$py"

# The machine's own limits, at one thread: the core's FMA peak and OpenBLAS's
# cblas_sgemm on 1024^3 (with the core type PyTorch runs with, when one was
# picked). Measured at the start of every round, between the workloads' runs,
# and the median taken as the workloads' are: this machine's speed drifts by
# 10-20% over minutes (a virtual machine's neighbours, its clock), so one
# measurement at the start could set every fraction below too high or too low.
roofline=${ROOFLINE-tools/roofline}
if [ -z "$py" ] && [ -n "$roofline" ] && [ -x "$roofline" ]; then pick_roofline_coretype "$roofline"; fi
run_roofline() {
  local rl peak blas
  [ -n "$roofline" ] && [ -x "$roofline" ] || return 0
  rl=$(env ${torch_coretype:+OPENBLAS_CORETYPE=$torch_coretype} OMP_NUM_THREADS=1 "$roofline" --quick 2>&1)
  peak=$(sed -n 's/^fma_peak .*gflops=\([0-9.]*\).*/\1/p' <<<"$rl")
  blas=$(sed -n 's/^gemm shape=square-1024 .*openblas_gflops=\([0-9.]*\).*/\1/p' <<<"$rl")
  echo "Roofline at one thread ($roofline --quick): the core's FMA peak ${peak:-?} GFLOP/s; OpenBLAS's 1024^3 matmul ${blas:-not found} GFLOP/s" \
       "(dtrain's dt_gemm: $(sed -n 's/^gemm shape=square-1024 .*dtrain_gflops=\([0-9.]*\).*/\1/p' <<<"$rl") GFLOP/s)"
  [ -z "$peak" ] || echo "roofline $peak ${blas:-0}" >>"$out"
}
# OpenBLAS's 1024^3 now, about a second of calls: "BEST MEAN" GFLOP/s, or nothing
blas_now() {
  [ -n "$roofline" ] && [ -x "$roofline" ] || return 0
  env ${torch_coretype:+OPENBLAS_CORETYPE=$torch_coretype} OMP_NUM_THREADS=1 "$roofline" --quick --seconds 1 2>/dev/null |
    sed -n 's/^gemm shape=square-1024 .*openblas_gflops=\([0-9.]*\).*openblas_mean_gflops=\([0-9.]*\).*/\1 \2/p'
}
if [ -n "$roofline" ] && [ ! -x "$roofline" ]; then
  echo "($roofline is not built: make tools/roofline; no fractions of the peak below)"
fi

status=0
for r in $(seq 1 "$repeats"); do
  echo "== round $r of $repeats"
  run_roofline
  for w in mlp vit-tiny gpt-char; do
    for t in $threads; do run_dtrain "$w" "$t" || status=1; run_torch "$w" "$t" || status=1; done
  done
done
if [ "$big" = 1 ]; then
  for r in $(seq 1 "$big_repeats"); do
    echo "== GPT-2 124M's shape at context 256, batch 4: round $r of $big_repeats"
    run_roofline
    for t in $threads; do run_dtrain gpt2-124m-ctx256 "$t" || status=1; run_torch gpt2-124m-ctx256 "$t" || status=1; done
  done
fi
[ -n "$py" ] || echo "(PyTorch not installed: dtrain alone; Debian: apt-get install python3-torch)"

awk -v repeats="$repeats" -v big_repeats="$big_repeats" '
  $1 == "flops" { fpt[$2] = $4; next }
  $1 == "roofline" { nr++; pk[nr] = $2; bl[nr] = $3; next }
  $1 == "gflops" { key = $2 " " $3; ng[key]++; g[key, ng[key]] = $4; next }
  $1 == "pair" {                        # the run against OpenBLAS just before and after it: best, kept-up
    key = $2 " " $3; np[key]++
    pb[key, np[key]] = $4 / ($3 * ($5 + $7) / 2); pm[key, np[key]] = $4 / ($3 * ($6 + $8) / 2); next
  }
  { key = $2 " " $3; n[$1, key]++; v[$1, key, n[$1, key]] = $4; if (!(key in seen)) { seen[key] = 1; order[++k] = key } }
  function median(a, m,   i, j, t) {    # of a[1..m]; leaves them in sorted[1..m]
    for (i = 1; i <= m; i++) sorted[i] = a[i]
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (sorted[j] < sorted[i]) { t = sorted[i]; sorted[i] = sorted[j]; sorted[j] = t }
    return m < 1 ? 0 : m % 2 ? sorted[(m + 1) / 2] : (sorted[m / 2] + sorted[m / 2 + 1]) / 2
  }
  function med(who, key,   m, i, j, t, a) {
    lo[who] = hi[who] = ""
    m = n[who, key]; if (!m) return ""
    for (i = 1; i <= m; i++) a[i] = v[who, key, i]
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    lo[who] = a[1]; hi[who] = a[m]
    return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
  }
  END {
    runs = repeats > 0 ? sprintf("%d alternating runs (GPT-2'"'"'s shape: %d)", repeats, big_repeats) : sprintf("%d alternating runs", big_repeats)
    printf "\nA full fp32 training step with AdamW, median of %s [lowest-highest]; rate = samples/s\n(tokens/s for gpt)\n", runs
    printf "%-18s %7s %26s %26s %8s\n", "workload", "threads", "dtrain", "PyTorch", "ratio"
    for (i = 1; i <= k; i++) {
      key = order[i]; split(key, kt, " ")
      d = med("dtrain", key); dl = lo["dtrain"]; dh = hi["dtrain"]
      t = med("torch", key); tl = lo["torch"]; th = hi["torch"]
      tcell = (t == "") ? "-" : sprintf("%.1f [%.1f-%.1f]", t, tl, th)
      ratio = (t > 0) ? sprintf("%.2fx", d / t) : "-"
      dcell = (d == "") ? "-" : sprintf("%.1f [%.1f-%.1f]", d, dl, dh)
      ratio = (d != "" && t > 0) ? sprintf("%.2fx", d / t) : "-"
      printf "%-18s %7s %26s %26s %8s\n", kt[1], kt[2], dcell, tcell, ratio
      if (kt[1] ~ /^gpt2/ && fpt[kt[1]] > 0)
        gf = gf sprintf("%-18s %7s %26s %26s\n", kt[1], kt[2], sprintf("%.1f GFLOP/s", d * fpt[kt[1]] / 1e9),
                        (t > 0) ? sprintf("%.1f GFLOP/s", t * fpt[kt[1]] / 1e9) : "-")
    }
    if (gf != "") printf "\nThe same medians as GFLOP/s (tokens/s x the FLOP per token dtrain counts, %.3g; the same model on both sides):\n%s", fpt["gpt2-124m-ctx256"], gf
    peak = median(pk, nr); peak_lo = sorted[1]; peak_hi = sorted[nr]
    blas = median(bl, nr); blas_lo = sorted[1]; blas_hi = sorted[nr]
    if (peak > 0) {
      printf "\ndtrain'"'"'s step against the machine'"'"'s limits: the step'"'"'s GFLOP/s (the bench line'"'"'s gflops=, median) as a fraction of\n"
      printf "the core'"'"'s FMA peak (%.1f [%.1f-%.1f] GFLOP/s a core) and of OpenBLAS'"'"'s 1024^3 matmul (%s GFLOP/s a core), both times the\n", peak, peak_lo, peak_hi, (blas > 0 ? sprintf("%.1f [%.1f-%.1f]", blas, blas_lo, blas_hi) : "none")
      printf "threads; each limit the median of its %d measurements, one before each round and each of GPT-2'"'"'s\n", nr
      printf "%-18s %7s %12s %10s %12s\n", "workload", "threads", "GFLOP/s", "of peak", "of OpenBLAS"
      for (i = 1; i <= k; i++) {
        key = order[i]; split(key, kt, " "); m = ng[key]; if (!m) continue
        for (a = 1; a <= m; a++) s[a] = g[key, a]
        for (a = 1; a <= m; a++) for (b = a + 1; b <= m; b++) if (s[b] < s[a]) { t = s[a]; s[a] = s[b]; s[b] = t }
        x = m % 2 ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
        printf "%-18s %7s %12.1f %9.0f%% %11s\n", kt[1], kt[2], x, 100 * x / (peak * kt[2]), (blas > 0 ? sprintf("%.0f%%", 100 * x / (blas * kt[2])) : "-")
      }
    }
    paired = 0
    for (i = 1; i <= k; i++) if (np[order[i]]) paired = 1
    if (paired) {
      printf "\nEach of dtrain'"'"'s runs against OpenBLAS'"'"'s 1024^3 measured right before and right after it (about a second\n"
      printf "of calls each time, times the threads): the step'"'"'s GFLOP/s over the mean of the two, as the best call and as\n"
      printf "the rate kept up over all the calls (a step'"'"'s rate is of that kind); median of the runs [lowest-highest]\n"
      printf "%-18s %7s %22s %22s\n", "workload", "threads", "of its best call", "of its kept-up rate"
      for (i = 1; i <= k; i++) {
        key = order[i]; split(key, kt, " "); m = np[key]; if (!m) continue
        for (a = 1; a <= m; a++) q[a] = pb[key, a]
        xb = median(q, m); lb = sorted[1]; hb = sorted[m]
        for (a = 1; a <= m; a++) q[a] = pm[key, a]
        xm = median(q, m); lm = sorted[1]; hm = sorted[m]
        printf "%-18s %7s %22s %22s\n", kt[1], kt[2], sprintf("%.0f%% [%.0f-%.0f]", 100 * xb, 100 * lb, 100 * hb),
               sprintf("%.0f%% [%.0f-%.0f]", 100 * xm, 100 * lm, 100 * hm)
        delete q
      }
    }
  }' "$out" || status=1
exit $status
