#!/usr/bin/env bash
# When does tensor parallelism beat data parallelism on this machine? Stage
# 01 at 1 and 2 threads, 03 and 06 at 2 ranks (one thread each), on three
# workloads, each cell the median of REPEATS runs (default 3), runs
# alternating so that a slow minute of this noisy machine lands on every
# column alike. Then one --explain run of 03 and of 06 per workload: the cost
# model's predicted speedup at 2 ranks. 06-tensor-parallel/README.md's table
# is this script's output.
#
# usage: tools/bench_tp.sh        (from the project root, after make)
#   REPEATS=N  WORKS="mlp vit gpt"
set -uo pipefail
repeats=${REPEATS:-3}
works=${WORKS:-"mlp vit gpt"}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
declare -A flags=(
  [mlp]="--model mlp --batch-size 128"
  [vit]="--model vit --dim 192 --depth 6 --heads 4 --patch 4 --batch-size 64"   # 4 heads: they split over 2 ranks
  [gpt]="--model gpt --batch-size 32"
)
configs="01-1t 01-2t 03 06"
command_of() {
  case $1 in
    01-1t) echo "env OMP_NUM_THREADS=1 ./01-single-gpu/train";;
    01-2t) echo "env OMP_NUM_THREADS=2 ./01-single-gpu/train";;
    03) echo "./03-ddp/train --nproc 2";;
    06) echo "./06-tensor-parallel/train --nproc 2";;
  esac
}
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }
for stage in 01-single-gpu 03-ddp 06-tensor-parallel; do
  [ -x "$stage/train" ] || { echo "bench_tp.sh: $stage/train is not built: run make first" >&2; exit 1; }
done
for ((rep = 1; rep <= repeats; rep++)); do
  for w in $works; do
    for c in $configs; do
      # shellcheck disable=SC2046,SC2086  # the flags are words
      line=$($(command_of "$c") --bench ${flags[$w]} 2>&1 | grep -m1 '^bench:')
      rate=$(field "$line" tokens_per_s)
      [ -n "$rate" ] || rate=$(field "$line" samples_per_s)
      if [ -z "$rate" ]; then echo "bench_tp.sh: $c on $w printed no bench line" >&2; exit 1; fi
      echo "$w $c $rate" >>"$out"
      echo "run $rep/$repeats: $w $c $rate $([ "$w" = gpt ] && echo tokens/s || echo samples/s)"
    done
  done
done
# the median and the spread of each cell
median() { sort -g | awk '{ v[NR] = $1 } END { printf "%.1f (%.1f-%.1f)", v[int((NR + 1) / 2)], v[1], v[NR] }'; }
one_thread() { awk -v w="$1" '$1 == w && $2 == "01-1t" { print $3 }' "$out" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
echo
printf "%-5s %-24s %-24s %-24s %-24s %-14s %-14s\n" workload "01, 1 thread" "01, 2 threads" "03, 2 ranks" "06, 2 ranks" "03 meas/pred" "06 meas/pred"
for w in $works; do
  row=""
  for c in $configs; do row="$row $(printf '%-24s' "$(awk -v w="$w" -v c="$c" '$1 == w && $2 == c { print $3 }' "$out" | median)")"; done
  base=$(one_thread "$w")
  ratios=""
  for c in 03 06; do
    med=$(awk -v w="$w" -v c="$c" '$1 == w && $2 == c { print $3 }' "$out" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
    # shellcheck disable=SC2046,SC2086
    pred=$($(command_of "$c") --bench --explain ${flags[$w]} 2>&1 | sed -n 's/.*predicted speedup \([0-9.]*x\) over one rank.*/\1/p' | head -1)
    ratios="$ratios $(printf '%-14s' "$(awk -v a="$med" -v b="$base" 'BEGIN { printf "%.2fx", a / b }')/${pred:-?}")"
  done
  printf "%-5s%s%s\n" "$w" "$row" "$ratios"
done
echo "(03 reads twice the samples a step, 06's ranks share one batch; both against 01 at one thread, as each rank has one)"
