#!/usr/bin/env bash
# The curves in the stage READMEs: every stage trains the small GPT on the
# built-in text for the same steps with the same global batch (16
# sequences), and tools/plot draws each stage's run beside stage 01's (loss,
# evaluation loss, tokens/s and peak memory against the step). The exact
# stages (02, 03, 04, 06, 07) take 01's steps to within float rounding; over
# 200 steps that rounding grows, as between any two orders of the same sums,
# so the curves part by a few hundredths. The speed and memory panels show
# what each stage costs here.
#
# usage: tools/stage_curves.sh [OUT_DIR]   (after make; default OUT_DIR:
#                                           docs/curves, under the project)
#   STEPS=N   steps per run (default 200)
#   TRACK=DIR stages 01, 03 and 05 also record their runs with --mlflow
#             DIR/mlruns and --tensorboard DIR/tensorboard (the README's
#             screenshots of both tools are of these three runs); DIR must
#             be new or empty, so that it holds these runs alone
#   LOGS=DIR  keep the runs' --log files there (default: a temporary folder)
set -euo pipefail
[ $# -le 1 ] || { echo "usage: tools/stage_curves.sh [OUT_DIR]" >&2; exit 2; }
out=$(realpath -m "${1:-$(dirname "$0")/../docs/curves}")
[ -z "${TRACK:-}" ] || TRACK=$(realpath -m "$TRACK")
[ -z "${LOGS:-}" ] || LOGS=$(realpath -m "$LOGS")
cd "$(dirname "$0")/.."
if [ -n "${TRACK:-}" ] && [ -e "$TRACK" ] && { [ ! -d "$TRACK" ] || [ -n "$(ls -A "$TRACK")" ]; }; then
  echo "stage_curves.sh: TRACK=$TRACK is not a new or empty folder: its runs would join these in the screenshots" >&2
  exit 2
fi
steps=${STEPS:-200}
if [ -n "${LOGS:-}" ]; then
  logs=$LOGS
  mkdir -p "$logs"
else
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
fi
common="--model gpt --steps $steps --eval-every 50 --log-every 50"
stages="01-single-gpu 02-dp 03-ddp 04-fsdp 05-accum-mixed-precision 06-tensor-parallel 07-pipeline-parallel"
# Each stage's flags for a step of 16 sequences | its label, saying what differs.
declare -A runs=(
  [01-single-gpu]="--batch-size 16|01"
  [02-dp]="--nproc 2 --batch-size 8|02 (2 devices)"
  [03-ddp]="--nproc 2 --batch-size 8|03 (2 ranks)"
  [04-fsdp]="--nproc 2 --batch-size 8|04 (2 ranks, --shard full)"
  [05-accum-mixed-precision]="--nproc 2 --batch-size 4 --accum-steps 2 --dtype bf16|05 (2 ranks, bf16, 2 micro-batches)"
  [06-tensor-parallel]="--nproc 2 --batch-size 16|06 (--tp 2)"
  [07-pipeline-parallel]="--nproc 2 --batch-size 16 --micro-batches 4|07 (--pp 2, 4 micro-batches)"
)
flags() { echo "${runs[$1]%%|*}"; }
label() { echo "${runs[$1]#*|}"; }
for s in $stages; do
  [ -x "$s/train" ] || { echo "stage_curves.sh: $s/train is not built: run make first" >&2; exit 1; }
done
[ -x tools/plot ] || { echo "stage_curves.sh: tools/plot is not built: run make first" >&2; exit 1; }
mkdir -p "$out"
for s in $stages; do
  track=()
  case $s in 01-*|03-*|05-*) [ -n "${TRACK:-}" ] && track=(--mlflow "$TRACK/mlruns" --tensorboard "$TRACK/tensorboard");; esac
  echo "$s/train $common $(flags "$s")"
  # shellcheck disable=SC2086,SC2046  # the flags are words
  "$s/train" $common $(flags "$s") "${track[@]}" --log "$logs/$s.jsonl" > "$logs/$s.out" ||
    { tail -n 5 "$logs/$s.out" >&2; echo "stage_curves.sh: $s failed (its output above)" >&2; exit 1; }
  done_line=$(grep '^done:' "$logs/$s.out" || true)
  echo "$done_line"
  # a run stopped early (a signal) ends well too: its curve would be short
  case $done_line in "done: $steps steps"*) ;; *) echo "stage_curves.sh: $s did not run its $steps steps" >&2; exit 1;; esac
done
for s in $stages; do
  logs_of=("$logs/01-single-gpu.jsonl=$(label 01-single-gpu)")
  title="$s against 01"
  if [ "$s" = 01-single-gpu ]; then title=$s; else logs_of+=("$logs/$s.jsonl=$(label "$s")"); fi
  tools/plot --out "$out/$s.svg" --title "$title: gpt, 16 sequences a step, $steps steps" "${logs_of[@]}"
done
