#!/usr/bin/env bash
# `make bench` on a machine with a GPU: dtrain's CUDA backend and PyTorch eager on
# the same workloads (vit-tiny, vit-base), fp32 with TF32 off in both, then one
# table side by side; then stage 03 on one GPU against stage 01: what DDP's
# machinery costs when there is nobody to talk to (target: under 3%); then
# stage 05 on vit-base in fp32, bf16 and fp16 (target: bf16 at least 2x fp32).
# usage: tools/bench_gpu.sh [stage-01 binary] [python] [stage-03 binary] [stage-05 binary]
set -euo pipefail
bin=${1:-01-single-gpu/train}
py=${2:-}
ddp=${3:-03-ddp/train}
mixed=${4:-05-accum-mixed-precision/train}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$bin" --bench --device cuda --model vit --dim 192 --depth 6 --heads 3 --patch 4 --batch-size 64 | tee -a "$out"
"$bin" --bench --device cuda --model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 --batch-size 64 \
  | tee -a "$out"
"$ddp" --bench --device cuda --model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 --batch-size 64 \
  | tee -a "$out"
for t in fp32 bf16 fp16; do
  "$mixed" --bench --device cuda --dtype $t --model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 \
    --batch-size 64 | tee -a "$out"
done
if [ -n "$py" ]; then "$py" tools/bench_torch.py --device cuda | tee -a "$out"
else echo "(PyTorch not installed: no comparison)"; fi
awk '
  function val(key,   i, kv) { for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] } return "" }
  /^bench:/ && val("stage") == "03-ddp" { ddp = val("samples_per_s"); next }
  /^bench:/ && val("stage") ~ /^05-/ { st = val("stage"); t = st ~ /bf16/ ? "bf16" : st ~ /fp16/ ? "fp16" : "fp32"
                                       mixed[t] = val("samples_per_s"); mem[t] = val("peak_mem_mb"); next }
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
    if (mixed["fp32"] > 0) {
      printf "\nstage 05, vit-base, batch 64:\n%-6s %12s %10s %14s\n", "dtype", "samples/s", "vs fp32", "peak memory MB"
      split("fp32 bf16 fp16", ts, " ")
      for (i = 1; i <= 3; i++) if (mixed[ts[i]] > 0)
        printf "%-6s %12s %9.2fx %14s\n", ts[i], mixed[ts[i]], mixed[ts[i]] / mixed["fp32"], mem[ts[i]]
      printf "(target: bf16 at least 2x fp32)\n"
    }
  }' "$out"
