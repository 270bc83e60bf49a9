#!/usr/bin/env bash
# `make bench` on a machine with a GPU: dtrain's CUDA backend and PyTorch on the
# same workloads, then one table side by side:
#   vit-tiny, vit-base       fp32, TF32 off in both (dtrain multiplies in plain fp32)
#   vit-base-tf32            PyTorch with TF32 on (dtrain has no TF32 mode: its row is PyTorch's alone)
#   vit-base-bf16            stage 05 --dtype bf16 against PyTorch's bf16 autocast
#   gpt2-124m-bf16           GPT-2 small (context 1024, vocabulary 50257) in bf16, batch 8:
#                            stage 05 against PyTorch's autocast with its fused attention
# PyTorch runs eager, and through torch.compile for the bf16 rows. Every row has
# the peak GPU memory of each. Then stage 03 on one GPU against stage 01: what
# DDP's machinery costs when there is nobody to talk to (target: under 3%); then
# stage 05 on vit-base in fp32, bf16 and fp16 (target: bf16 at least 2x fp32).
# usage: tools/bench_gpu.sh [stage-01 binary] [python] [stage-03 binary] [stage-05 binary]
# A run that fails (out of memory, a torch.compile error) is reported and the
# rest go on: the table shows "-" where it has no figure, and the exit status is 1.
set -uo pipefail
bin=${1:-01-single-gpu/train}
py=${2:-}
ddp=${3:-03-ddp/train}
mixed=${4:-05-accum-mixed-precision/train}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
vit_base=(--model vit --image-size 224 --dim 768 --depth 12 --heads 12 --patch 16 --batch-size 64)
gpt2=(--model gpt --dim 768 --depth 12 --heads 12 --seq-len 1024 --vocab 50257 --batch-size 8)
# The H100's and H200's bf16 dense peak, for the GPT-2 row's MFU (dtrain's own table holds fp32 peaks).
peak=()
case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) in
  *H100*PCIe*) peak=(--peak-tflops 756) ;; *H100*NVL*) peak=(--peak-tflops 835) ;; *H100* | *H200*) peak=(--peak-tflops 989) ;;
esac
status=0
run() { "$@" 2>&1 | tee -a "$out" || { echo "bench_gpu.sh: failed: $*"; status=1; }; }
run "$bin" --bench --device cuda --model vit --dim 192 --depth 6 --heads 3 --patch 4 --batch-size 64
run "$bin" --bench --device cuda "${vit_base[@]}"
run "$ddp" --bench --device cuda "${vit_base[@]}"
for t in fp32 bf16 fp16; do
  run "$mixed" --bench --device cuda --dtype $t "${vit_base[@]}"
done
run "$mixed" --bench --device cuda --dtype bf16 "${gpt2[@]}" ${peak[@]+"${peak[@]}"}
if [ -n "$py" ]; then
  run "$py" tools/bench_torch.py --device cuda --workloads vit-tiny,vit-base,vit-base-tf32
  run "$py" tools/bench_torch.py --device cuda --workloads vit-base-bf16,gpt2-124m-bf16 --compile
else echo "(PyTorch not installed: no comparison)"; fi
awk '
  function val(key,   i, kv) { for (i = 2; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] } return "" }
  function row(w, ours, mem, t, tm, c) {
    printf "%-15s %10s %9s %10s %9s %7s %10s %7s\n", w, (ours == "" ? "-" : ours), (mem == "" ? "-" : mem),
           (t == "" ? "-" : t), (tm == "" ? "-" : tm), ((ours != "" && t > 0) ? sprintf("%.2f", ours / t) : "-"),
           (c == "" ? "-" : c), ((ours != "" && c > 0) ? sprintf("%.2f", ours / c) : "-")
  }
  /^bench:/ && val("stage") == "03-ddp" { ddp = val("samples_per_s"); next }
  /^bench:/ && val("workload") == "gpt2-124m" {
    gpt = val("samples_per_s"); gpt_mem = val("peak_mem_mb"); gpt_tok = val("tokens_per_s")
    gpt_tf = val("tflops"); gpt_mfu = val("mfu"); gpt_peak = val("peak_tflops"); next }
  /^bench:/ && val("stage") ~ /^05-/ { st = val("stage"); t = st ~ /bf16/ ? "bf16" : st ~ /fp16/ ? "fp16" : "fp32"
                                       mixed[t] = val("samples_per_s"); mem[t] = val("peak_mem_mb"); next }
  /^bench:/       { w = val("workload"); ours[w] = val("samples_per_s"); ourmem[w] = val("peak_mem_mb") }
  /^torch-bench:/ { w = val("workload"); if (val("compiled") == "1") comp[w] = val("samples_per_s")
                    else { theirs[w] = val("samples_per_s"); theirmem[w] = val("peak_mem_mb"); tok[w] = val("tokens_per_s") } }
  END {
    printf "\n%-15s %10s %9s %10s %9s %7s %10s %7s\n", "workload", "dtrain/s", "dtrain MB", "torch/s", "torch MB", "ratio",
           "compile/s", "ratio"
    row("vit-tiny", ours["vit-tiny"], ourmem["vit-tiny"], theirs["vit-tiny"], theirmem["vit-tiny"], "")
    row("vit-base", ours["vit-base"], ourmem["vit-base"], theirs["vit-base"], theirmem["vit-base"], "")
    row("vit-base-tf32", "", "", theirs["vit-base-tf32"], theirmem["vit-base-tf32"], "")
    row("vit-base-bf16", mixed["bf16"], mem["bf16"], theirs["vit-base-bf16"], theirmem["vit-base-bf16"], comp["vit-base-bf16"])
    row("gpt2-124m-bf16", gpt, gpt_mem, theirs["gpt2-124m-bf16"], theirmem["gpt2-124m-bf16"], comp["gpt2-124m-bf16"])
    printf "(samples/s; a GPT-2 sample is 1024 tokens. dtrain has no TF32 mode: that row is PyTorch alone)\n"
    if (gpt != "")
      printf "\nGPT-2 124M bf16, batch 8: dtrain %s tokens/s, %s TFLOP/s, MFU %s of %s TFLOP/s (target: 0.40); PyTorch eager %s tokens/s\n",
             gpt_tok, gpt_tf, (gpt_mfu == "" ? "n/a" : gpt_mfu), (gpt_peak == "" ? "an unknown peak" : gpt_peak),
             (tok["gpt2-124m-bf16"] == "" ? "-" : tok["gpt2-124m-bf16"])
    if (ddp > 0 && ours["vit-base"] > 0)
      printf "\nDDP on 1 GPU against stage 01, vit-base: %.1f%% slower (target: under 3%%)\n", 100 * (1 - ddp / ours["vit-base"])
    if (mixed["fp32"] > 0) {
      printf "\nstage 05, vit-base, batch 64:\n%-6s %12s %10s %14s\n", "dtype", "samples/s", "vs fp32", "peak memory MB"
      split("fp32 bf16 fp16", ts, " ")
      for (i = 1; i <= 3; i++) if (mixed[ts[i]] > 0)
        printf "%-6s %12s %9.2fx %14s\n", ts[i], mixed[ts[i]], mixed[ts[i]] / mixed["fp32"], mem[ts[i]]
      printf "(target: bf16 at least 2x fp32)\n"
    }
  }' "$out" || status=1
exit $status
