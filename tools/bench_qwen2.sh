#!/usr/bin/env bash
# `make bench`'s Qwen2-0.5B row: a fine-tuning step of Qwen2-0.5B's shape (494M parameters, vocabulary 151,936,
# tied head; steps of 9 sequences of 128 tokens, fp32 with AdamW) in dtrain's stage 01 and in PyTorch +
# transformers, on the same weights (random, written once as a bf16 Hugging Face folder, as Qwen2-0.5B ships),
# at two threads: tokens/s and the process's peak resident memory (ru_maxrss). Runs alternate (dtrain,
# PyTorch, dtrain, ...), REPEATS of each (default 3), medians with [lowest-highest]. A step takes 10-20 s
# on two cores and each run loads the model and warms up first: about 2 minutes a pair of runs. Before them,
# with PyTorch at hand, the first loss on the same 9 sequences (DIR/tokens.npy) and weights: dtrain's and
# transformers' more than 1e-5 apart fail the bench (about a minute more). dtrain runs with
# `--attention online`, what a fine-tuning short of memory would choose: no B x heads x T x T
# probabilities kept (8.3 MB a layer here) and, at 128 tokens, as fast as the default body (docs/cpu-speed.md).
#
# usage: tools/bench_qwen2.sh [stage-01 binary] [python with torch and transformers]
#   REPEATS=N  THREADS=2  STEPS=2 (timed steps a run)  DIR=folder for the weights (default: a temporary one)
#   ATTENTION=online (dtrain's --attention; matmul: the default body)
set -uo pipefail
bin=${1:-01-single-gpu/train}
py=${2:-build/pyvenv/bin/python}
repeats=${REPEATS:-3}
threads=${THREADS:-2}
steps=${STEPS:-2}
attention=${ATTENTION:-online}
here=$(cd "$(dirname "$0")" && pwd)
if ! "$py" -c 'import torch, transformers' 2>/dev/null; then
  echo "bench_qwen2.sh: $py has no torch and transformers (make test-all's build/pyvenv has them): dtrain alone"
  py=""
fi
dir=${DIR:-}
if [ -z "$dir" ]; then dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT; fi
out="$dir/results.txt"
: >"$out"
if [ ! -f "$dir/model/config.json" ]; then
  if [ -n "$py" ]; then
    "$py" "$here/bench_qwen2.py" make "$dir/model" || { echo "bench_qwen2.sh: could not write the weights" >&2; exit 1; }
  fi
fi
# dtrain: the folder's weights when there is one, else the same shape from its own flags
if [ -f "$dir/model/config.json" ]; then dflags=(--init "$dir/model")
else dflags=(--model llama --dim 896 --depth 24 --heads 14 --kv-heads 2 --ffn-dim 4864 --vocab 151936 --qkv-bias
             --rope-theta 1000000 --norm-eps 1e-6); fi
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p"; }
# PyTorch at its best: OpenBLAS's fastest core type here (tools/openblas_coretype.sh says why)
. "$here/openblas_coretype.sh"
torch_coretype=""
[ -z "$py" ] || pick_torch_coretype "$py"
status=0
# The first loss, before the speed: dtrain's first step on DIR/tokens.npy against transformers' loss on the
# same 9 sequences and weights; more than 1e-5 apart fails the bench (the issue's bound)
if [ -n "$py" ] && [ -f "$dir/model/config.json" ]; then
  [ -f "$dir/tokens.npy" ] || "$py" "$here/bench_qwen2.py" tokens "$dir" || status=1
  rm -f "$dir/loss.jsonl"
  OMP_NUM_THREADS=$threads "$bin" --device cpu --init "$dir/model" --attention "$attention" --tokens "$dir/tokens.npy" --seq-len 128 \
    --batch-size 9 --steps 1 --log "$dir/loss.jsonl" --quiet >"$dir/loss.out" 2>&1 || { cat "$dir/loss.out" >&2; status=1; }
  dloss=$(sed -n 's/^{"step":1,[^}]*"loss":\([-0-9.e+]*\).*/\1/p' "$dir/loss.jsonl" 2>/dev/null | head -1)
  tloss=$(env ${torch_coretype:+OPENBLAS_CORETYPE=$torch_coretype} OMP_NUM_THREADS=$threads "$py" "$here/bench_qwen2.py" loss "$dir" 2>&1 |
          sed -n 's/^torch-loss: first_loss=\([^ ]*\).*/\1/p')
  if [ -z "$dloss" ]; then echo "bench_qwen2.sh: dtrain logged no first loss" >&2; cat "$dir/loss.out" >&2; status=1
  elif [ -z "$tloss" ]; then echo "bench_qwen2.sh: bench_qwen2.py printed no torch-loss line" >&2; status=1
  elif awk -v a="$dloss" -v b="$tloss" 'BEGIN { d = a - b; if (d < 0) d = -d; printf "first loss on the same 9 sequences and weights: dtrain %s, transformers %s, %.1e apart", a, b, d; exit !(d <= 1e-5) }'; then
    echo " (within 1e-5)"
  else
    echo " -- MORE than 1e-5" >&2; status=1
  fi
fi
for r in $(seq 1 "$repeats"); do
  echo "== round $r of $repeats (Qwen2-0.5B's shape, $threads threads, dtrain with --attention $attention)"
  line=$(OMP_NUM_THREADS=$threads "$bin" --bench --device cpu "${dflags[@]}" --attention "$attention" --seq-len 128 --batch-size 9 --steps "$steps" 2>&1 | grep -m1 '^bench:')
  if [ -z "$line" ]; then echo "bench_qwen2.sh: $bin --bench printed no bench line" >&2; status=1
  else echo "dtrain $(field "$line" tokens_per_s) $(field "$line" peak_rss_mb)" | tee -a "$out"; fi
  [ -n "$py" ] || continue
  line=$(env ${torch_coretype:+OPENBLAS_CORETYPE=$torch_coretype} OMP_NUM_THREADS=$threads "$py" "$here/bench_qwen2.py" torch "$dir/model" --steps "$steps" 2>&1 | grep -m1 '^torch-bench:')
  if [ -z "$line" ]; then echo "bench_qwen2.sh: bench_qwen2.py printed no torch-bench line" >&2; status=1
  else echo "torch $(field "$line" tokens_per_s) $(field "$line" peak_rss_mb)" | tee -a "$out"; fi
done
awk '
  { n[$1]++; t[$1, n[$1]] = $2; m[$1, n[$1]] = $3 }
  function med(who, arr,   k, i, j, x, a) {
    k = n[who]; if (!k) return ""
    for (i = 1; i <= k; i++) a[i] = (arr == "t") ? t[who, i] : m[who, i]
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
    lo = a[1]; hi = a[k]
    return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
  }
  END {
    printf "\nQwen2-0.5B shape, 9 x 128 tokens, fp32 + AdamW: median of the runs [lowest-highest]\n"
    printf "%-8s %26s %30s\n", "", "tokens/s", "peak RSS, MB"
    for (w = 1; w <= 2; w++) {
      who = w == 1 ? "dtrain" : "torch"
      if (!n[who]) continue
      a = med(who, "t"); ta = sprintf("%.1f [%.1f-%.1f]", a, lo, hi); tok[who] = a
      b = med(who, "m"); mb = sprintf("%.0f [%.0f-%.0f]", b, lo, hi); rss[who] = b
      printf "%-8s %26s %30s\n", who == "torch" ? "PyTorch" : who, ta, mb
    }
    if (tok["torch"] > 0 && rss["torch"] > 0)
      printf "dtrain / PyTorch: %.2fx the tokens/s, %.2fx the peak RSS\n", tok["dtrain"] / tok["torch"], rss["dtrain"] / rss["torch"]
  }' "$out" || status=1
exit $status
