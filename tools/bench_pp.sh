#!/usr/bin/env bash
# Pipeline parallelism on this machine: stage 07 at 2 stages (one thread
# each: the 2 cores, unloaded) with 1, 2, 4 and 8 micro-batches under both
# schedules, against stage 01 at 1 thread, on two workloads. Each cell is the
# median of REPEATS runs (default 3; the spread in brackets), the runs
# alternating so that a slow minute lands on every column alike. Beside each
# rate: the measured bubble (the stages' time spent waiting, over their time
# in the pipeline) and the formula's (P - 1) / (M + P - 1); the largest
# rank's peak memory; and, from one --explain run per cell, the cost model's
# predicted speedup. 07-pipeline-parallel/README.md's table is this script's
# output.
#
# usage: tools/bench_pp.sh        (from the project root, after make)
#   REPEATS=N  WORKS="vit gpt"  MICRO="1 2 4 8"
set -uo pipefail
repeats=${REPEATS:-3}
works=${WORKS:-"vit gpt"}
micro=${MICRO:-"1 2 4 8"}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
declare -A flags=(
  [vit]="--model vit --dim 192 --depth 6 --heads 3 --patch 4 --batch-size 64"
  [gpt]="--model gpt --batch-size 32"
)
configs="01"
for m in $micro; do configs="$configs gpipe-$m 1f1b-$m"; done
command_of() {
  case $1 in
    01) echo "env OMP_NUM_THREADS=1 ./01-single-gpu/train";;
    *) echo "env OMP_NUM_THREADS=1 ./07-pipeline-parallel/train --nproc 2 --schedule ${1%-*} --micro-batches ${1#*-}";;
  esac
}
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }
for stage in 01-single-gpu 07-pipeline-parallel; do
  [ -x "$stage/train" ] || { echo "bench_pp.sh: $stage/train is not built: run make first" >&2; exit 1; }
done
for ((rep = 1; rep <= repeats; rep++)); do
  for w in $works; do
    for c in $configs; do
      # shellcheck disable=SC2046,SC2086  # the flags are words
      line=$($(command_of "$c") --bench ${flags[$w]} 2>&1 | grep -m1 '^bench:')
      rate=$(field "$line" tokens_per_s)
      [ -n "$rate" ] || rate=$(field "$line" samples_per_s)
      if [ -z "$rate" ]; then echo "bench_pp.sh: $c on $w printed no bench line" >&2; exit 1; fi
      bubble=$(field "$line" bubble)
      echo "$w $c $rate ${bubble:-0} $(field "$line" bubble_predicted) $(field "$line" peak_mem_mb)" >>"$out"
      echo "run $rep/$repeats: $w $c $rate $([ "$w" = gpt ] && echo tokens/s || echo samples/s) bubble ${bubble:--}"
    done
  done
done
median_of() {   # column $3 of workload $1, config $2: "median (low-high)"
  awk -v w="$1" -v c="$2" -v k="$3" '$1 == w && $2 == c { print $k }' "$out" | sort -g |
    awk -v pct="$4" '{ v[NR] = $1 } END { m = v[int((NR + 1) / 2)]; if (pct) printf "%.0f%% (%.0f-%.0f)", 100 * m, 100 * v[1], 100 * v[NR];
                                          else printf "%.1f (%.1f-%.1f)", m, v[1], v[NR] }'
}
middle() { awk -v w="$1" -v c="$2" -v k="$3" '$1 == w && $2 == c { print $k }' "$out" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
echo
printf "%-5s %-10s %-24s %-16s %-20s %-9s %-10s\n" workload config rate "speedup meas/pred" "bubble measured" formula "peak MB"
for w in $works; do
  base=$(middle "$w" 01 3)
  for c in $configs; do
    rate=$(median_of "$w" "$c" 3 0)
    if [ "$c" = 01 ]; then
      printf "%-5s %-10s %-24s %-16s %-20s %-9s %-10s\n" "$w" "01, 1 thr" "$rate" "1.00x" "-" "-" "$(middle "$w" "$c" 6)"
      continue
    fi
    # shellcheck disable=SC2046,SC2086
    pred=$($(command_of "$c") --bench --explain ${flags[$w]} 2>&1 | sed -n 's/.*predicted speedup \([0-9.]*x\) over one rank.*/\1/p' | head -1)
    speed=$(awk -v a="$(middle "$w" "$c" 3)" -v b="$base" 'BEGIN { printf "%.2fx", a / b }')
    formula=$(awk -v f="$(middle "$w" "$c" 5)" 'BEGIN { printf "%.0f%%", 100 * f }')
    printf "%-5s %-10s %-24s %-16s %-20s %-9s %-10s\n" "$w" "$c" "$rate" "$speed/${pred:-?}" "$(median_of "$w" "$c" 4 1)" "$formula" \
      "$(middle "$w" "$c" 6)"
  done
done
echo "(07: 2 stages, one thread each; rates in samples/s (vit) and tokens/s (gpt))"
