#!/usr/bin/env bash
# make test-builds: the build a laptop without nvcc makes (make CUDA=0) at each
# optimisation level in LEVELS (default -O0 -O2 -O3, plain: no -march=native),
# each in a copy of the sources under build/cpu<level>/ so the fast binaries
# stay as they are. At each level: the build (no warning allowed), and the quick
# suite (make test) at each of SUITE_LEVELS (default -O0 -O2: the default build's
# make test runs it at -O3, -march=native, and CI's 45 minutes are better spent
# on the sanitizers than on a third run of it). At BENCH_LEVEL (default -O2) also every stage's --bench
# on every model, make bench with BENCH_FLAGS (default --quick --only mlp:
# every stage at 1, 2 and 4 ranks, the charts and the cost model, on the
# workload that takes seconds; the stage runs above cover vit and gpt), and
# the layouts study at 2 ranks (tools/bench --layouts 2 --quick).
#
# Why: what the optimiser does differs by level, and so does what it finds.
# What these builds caught before: a field read before it was written (zero
# at -O3 -march=native, garbage at -O2: the default build passed while a
# student's `make CUDA=0 OPT=-O2` failed; MemorySanitizer now looks for that
# kind everywhere); gcc's format-truncation warnings, which depend on the
# level (two at -O0, one at -O2: the build of each level); a test that timed
# two clocks apart, which only the slow -O0 build showed (its suite); and the
# port --nproc picked and let go, taken before rank 0 bound it, at -O3 (its
# suite). The benches check programs, not the optimiser: one level runs them.
# Exits non-zero when any level fails, naming it and the step.
set -uo pipefail
cd "$(dirname "$0")/.."

levels=${LEVELS:-"-O0 -O2 -O3"}
bench_level=${BENCH_LEVEL:--O2}
suite_levels=${SUITE_LEVELS:-"-O0 -O2"}
bench_flags=${BENCH_FLAGS:-"--quick --only mlp"}
failed=()
lap() { echo "  ($1: $((SECONDS - t0)) s)"; t0=$SECONDS; }

# The sources only: a copied binary would be newer than its source and never rebuilt.
copy_sources() {
  local dst=$1
  rm -rf "$dst"
  mkdir -p "$dst"
  for d in 0*/ src/ tools/ tests/; do
    mkdir -p "$dst/$d"
    find "$d" -maxdepth 1 -type f \( -name '*.c' -o -name '*.h' -o -name '*.sh' -o -name '*.py' -o -name '*.awk' -o -name assemble \) \
      -exec cp -p {} "$dst/$d" \;
  done
  # dtrain.h after its chapters, so that it is the newer and make does not assemble it again
  cp Makefile dtrain.h dtrain.c "$dst/"
}

# Every stage's --bench with every model: a few steps, a small batch, the
# parallel stages with two ranks, stage 05 with bf16 and accumulation, stage
# 07 as two pipelines of two stages in bf16 with the optimizer state shared
# out, stage 08 (context parallelism: language models only) as one group of two,
# stage 09 (expert parallelism) on language models with experts (a stage
# refuses the flags of others, so each gets its own).
stage_benches() {
  local s m extra out models
  for s in 0*/; do
    s=${s%/}
    models="mlp vit gpt"
    case $s in
      01-*) extra="" ;;
      05-*) extra="--nproc 2 --timeout 120 --dtype bf16 --accum-steps 2" ;;
      06-*) extra="--nproc 2 --timeout 120 --heads 4" ;;   # the vit's default 3 heads do not split over 2
      07-*) extra="--nproc 4 --pp 2 --timeout 120 --micro-batches 2 --dtype bf16 --shard optimizer" ;;   # 2 x 1 x 2
      08-*) extra="--nproc 2 --timeout 120"; models="gpt llama" ;;
      09-*) extra="--nproc 2 --timeout 120 --moe-experts 4 --moe-top-k 2"; models="gpt llama" ;;   # a mixture to spread
      *) extra="--nproc 2 --timeout 120" ;;
    esac
    for m in $models; do
      if ! out=$("./$s/train" --bench --device cpu --model "$m" --batch-size 8 --steps 2 $extra 2>&1); then
        printf '%s\n' "$out" | tail -5
        echo "FAILED: $s/train --bench --model $m $extra"
        return 1
      fi
      printf '%s\n' "$out" | grep '^bench:' | cut -c1-110
    done
  done
}

for level in $levels; do
  dir="build/cpu$level"
  echo "==== make CUDA=0 OPT=$level (in $dir)"
  copy_sources "$dir"
  t0=$SECONDS; start=$SECONDS
  if ! make -C "$dir" -s CUDA=0 OPT="$level" all >"$dir/build.log" 2>&1; then
    cat "$dir/build.log"; failed+=("$level: build"); continue
  fi
  if grep -v '^make' "$dir/build.log" | grep -q 'warning:'; then cat "$dir/build.log"; failed+=("$level: compiler warnings"); fi
  lap build
  case " $suite_levels " in
    *" $level "*)
      if ! make -C "$dir" -s CUDA=0 OPT="$level" test >"$dir/test.log" 2>&1; then
        grep -v '^PASS' "$dir/test.log" | tail -40; failed+=("$level: make test")
      else tail -1 "$dir/test.log"; fi
      lap "make test" ;;
  esac
  if [ "$level" = "$bench_level" ]; then
    if ! (cd "$dir" && stage_benches); then failed+=("$level: a stage's --bench"); fi
    lap "every stage's --bench"
    # TORCH_PY= BENCH_CPU=0 BENCH_QWEN2=0: the build is checked here, not compared with PyTorch (make bench does that)
    if ! make -C "$dir" -s CUDA=0 OPT="$level" TORCH_PY= BENCH_CPU=0 BENCH_QWEN2=0 bench BENCH_FLAGS="$bench_flags" >"$dir/bench.log" 2>&1; then
      tail -20 "$dir/bench.log"; failed+=("$level: make bench")
    else echo "make bench $bench_flags: $(grep -c '' "$dir/bench/results.csv") lines in $dir/bench/results.csv"; fi
    lap "make bench"
    # the layouts study at its smallest: 2 ranks, every layout once (its composed rows, each against a prediction)
    if ! (cd "$dir" && mkdir -p bench && ./tools/bench --layouts 2 --quick --out bench >bench/layouts.log 2>&1); then
      tail -20 "$dir/bench/layouts.log"; failed+=("$level: tools/bench --layouts 2")
    else echo "tools/bench --layouts 2 --quick: $(grep -c '' "$dir/bench/layouts.csv") lines in $dir/bench/layouts.csv"; fi
    lap "tools/bench --layouts"
  fi
  echo "($level took $((SECONDS - start)) s)"
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "test-builds: FAILED at ${failed[*]}"
  exit 1
fi
echo "test-builds: every level passed ($levels)"
