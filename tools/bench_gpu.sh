#!/usr/bin/env bash
# `make bench` on a machine with a GPU: dtrain's CUDA backend and PyTorch eager on
# the same workloads (vit-tiny, vit-base), fp32 with TF32 off in both, then one
# table side by side; then stage 03 on one GPU against stage 01: what DDP's
# machinery costs when there is nobody to talk to (target: under 3%).
# usage: tools/bench_gpu.sh [stage-01 binary] [python] [stage-03 binary]
set -euo pipefail
bin=${1:-01-single-gpu/train}
py=${2:-}
ddp=${3:-03-ddp/train}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$bin" --bench --device cuda --model vit --dim 192 --depth 6 --heads 3 --patch 4 --batch-size 64 | tee -a "$out"
"$bin" --bench --device cuda --model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 --batch-size 64 \
  | tee -a "$out"
"$ddp" --bench --device cuda --model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 --batch-size 64 \
  | tee -a "$out"
if [ -n "$py" ]; then "$py" tools/bench_torch.py --device cuda | tee -a "$out"
else echo "(PyTorch not installed: no comparison)"; fi
awk '
  function val(key,   i, kv) { for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] } return "" }
  /^bench:/ && val("stage") == "03-ddp" { ddp = val("samples_per_s"); next }
  /^bench:/       { w = val("workload"); order[++n] = w; ours[w] = val("samples_per_s"); tf[w] = val("tflops"); mfu[w] = val("mfu") }
  /^torch-bench:/ { theirs[val("workload")] = val("samples_per_s") }
  END {
    printf "\n%-10s %16s %10s %8s %16s %8s\n", "workload", "dtrain samples/s", "TFLOP/s", "MFU", "torch samples/s", "ratio"
    for (i = 1; i <= n; i++) {
      w = order[i]; t = theirs[w]
      printf "%-10s %16s %10s %8s %16s %8s\n", w, ours[w], tf[w], mfu[w], t == "" ? "-" : t, t == "" ? "-" : sprintf("%.2f", ours[w] / t)
    }
    if (ddp > 0 && ours["vit-base"] > 0)
      printf "\nDDP on 1 GPU against stage 01, vit-base: %.1f%% slower (target: under 3%%)\n", 100 * (1 - ddp / ours["vit-base"])
  }' "$out"
