#!/usr/bin/env bash
# `make gpu-check`, tier 1 (the default): what a GPU window must learn first, in at
# most six minutes on one H100, the build included. GPU time comes in windows of
# fifteen minutes (a command at most ten, the machine's start one or two), so this
# tier leaves room to fix something and run it again. In order of value:
#
#   build      only what this tier runs, with every core
#   defect     the open defect: stages 04 and 05 train the GPT differently on the GPU
#              (1.7e-4 off at step 2 on 2026-11-24). 10 steps of each stage and shard
#              mode, SGD, CUDA_LAUNCH_BLOCKING=1, --clip 0, llama, each against stage 01
#              on the GPU and on the CPU; then one step saved on both and compared
#              tensor by tensor (tools/tensor_diff.py)
#   kernels    the GPU tests of the kernels that have never run, against the CPU:
#              gpu_ops (online attention, the fused classifier, RMSNorm, SwiGLU, rotary,
#              the split vocabulary's row sums), the casts, one step, the online
#              attention trained 20 steps
#   gpt2       GPT-2 124M in bf16 (stage 05, context 1024, batch 8): tokens/s, MFU,
#              memory; with --attention online; then PyTorch eager on the same step
#   nccl       stages 06, 07 and 08 over NCCL, two and four ranks sharing the GPU, each
#              against stage 01 on the GPU at the same global batch (08: the ring's
#              kernels, zig-zag and contiguous)
#
# GPU_CHECK_TIER=2 runs the rest (tools/gpu_check_tier2.sh: 200-step curves, repeat
# and resume, every two-rank mode, the sanitizers, the PyTorch bench with
# torch.compile). The report: GPU_CHECK_OUT/report.txt (default gpu-check/), one
# PASS / FAIL / NOT RUN line per check, each with its seconds and its budget on one
# H100; logs/NAME.log holds every command of a check. Every command runs under its
# own timeout, so a hung NCCL run costs its limit, never the rest; no step starts
# after GPU_CHECK_CAP_S (default 350) seconds. Exit 1 when a check failed.
#
# Dry run, on a machine without a GPU: DT_GPU_CHECK_FORCE=1 tools/gpu_check.sh runs
# every step with --device cpu (GPT-2 at a tiny shape; PyTorch NOT RUN), so the
# script's own logic is tried end to end; it checks nothing about GPUs.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

DRY=${DT_GPU_CHECK_FORCE:-0}
[ "$DRY" = 1 ] || DRY=0
OUT=${GPU_CHECK_OUT:-gpu-check}
OUT=${OUT%/}
CAP=${GPU_CHECK_CAP_S:-350}
CORES=$(nproc 2>/dev/null || echo 1)
DEV=cuda
[ "$DRY" = 0 ] || DEV=cpu

if [ "$DRY" = 0 ] && ! timeout 60 nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu-check: no NVIDIA GPU visible here (nvidia-smi -L lists none); nothing to check"
    exit 0
fi
rm -rf "$OUT/logs" "$OUT/runs" "$OUT/report.txt"
mkdir -p "$OUT/logs" "$OUT/runs" || exit 1
REPORT=$OUT/report.txt R=$OUT/runs
T0=$SECONDS
say() { printf '%s\n' "$*" | tee -a "$REPORT"; }

# The plan: each check and its budget, seconds on one H100 (the 2026-11-24 run's
# figures and first-check.sh's; nccl: two runs of 08 since), 350 s in all with the header's 10.
PLAN=("build 50" "defect 70" "kernels 40" "gpt2 90" "nccl 90")
budget_of() { local p; for p in "${PLAN[@]}"; do [ "${p% *}" = "$1" ] && echo "${p#* }"; done; }

N_PASS=0 N_FAIL=0 N_NOTRUN=0 CUR="" CUR_T0=0 CUR_FAILS=0
# begin NAME: a check starts, unless the cap has passed (then NOT RUN).
begin() {
    CUR=$1 CUR_T0=$SECONDS CUR_FAILS=0
    if [ $((SECONDS - T0)) -gt "$CAP" ]; then
        N_NOTRUN=$((N_NOTRUN + 1)); say "NOT RUN $1 (past the cap of $CAP s)"; return 1
    fi
    say "---- $1 (budget $(budget_of "$1") s on one H100)"
}
# end WHAT: the check's line, PASS unless a comparison in it failed.
end() {
    local t="$((SECONDS - CUR_T0)) s, budget $(budget_of "$CUR") s"
    if [ "$CUR_FAILS" = 0 ]; then N_PASS=$((N_PASS + 1)); say "PASS $CUR ($1; $t)"
    else N_FAIL=$((N_FAIL + 1)); say "FAIL $CUR ($CUR_FAILS failed: $1; $t; see logs/$CUR-*.log)"; fi
}
# run NAME LIMIT CMD...: one command under `timeout`, its output in logs/CHECK-NAME.log
run() {
    local n=$1 limit=$2 t=$SECONDS rc; shift 2
    local log=$OUT/logs/$CUR-$n.log
    { printf '$'; printf ' %q' "$@"; printf '\n'; } >"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1 </dev/null
    rc=$?
    echo "exit $rc after $((SECONDS - t)) s (limit $limit s)" >>"$log"
    if [ "$rc" != 0 ]; then
        CUR_FAILS=$((CUR_FAILS + 1))
        say "  $n: exit $rc$([ "$rc" = 124 ] && echo " (timed out after $limit s)") $(grep -m1 -iE 'error|fail' "$log" | cut -c1-110)"
    fi
    return "$rc"
}
losses() { [ -f "$1" ] && awk '/"step":/ && /"loss":/ && !/"summary"/ { if (match($0, /"loss":[^,}]*/)) print substr($0, RSTART + 7, RLENGTH - 7) }' "$1"; }
# compare RUN REF TOL: the worst |loss - reference| over both logs' steps, one line
compare() {
    local w
    w=$(paste -d' ' <(losses "$R/$1.jsonl") <(losses "$R/$2.jsonl") |
        awk 'NF == 2 { n++; d = $1 - $2; if (d < 0) d = -d; if (d > w) w = d } END { if (n < 5) print "none"; else printf "%.2e\n", w }')
    if [ "$w" != none ] && awk -v w="$w" -v t="$3" 'BEGIN { exit !(w + 0 <= t + 0) }'; then
        say "  $(printf '%-18s against %-12s worst %s (within %s)' "$1" "$2" "$w" "$3")"
    else
        CUR_FAILS=$((CUR_FAILS + 1))
        say "  $(printf '%-18s against %-12s worst %s (OVER %s)' "$1" "$2" "$w" "$3")"
    fi
}

say "gpu-check tier 1, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(
     [ "$DRY" = 1 ] && echo ', DRY RUN: --device cpu, nothing about GPUs is checked')"
{ timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  timeout 30 nvcc --version 2>/dev/null | tail -1 | grep . || echo "nvcc: none"
  timeout 60 python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>/dev/null ||
      echo "torch: not importable"
} | sed 's/^/  /' | tee -a "$REPORT"
say "plan (budget on one H100, seconds):$(for p in "${PLAN[@]}"; do printf ' %s %s,' "${p% *}" "${p#* }"; done) header 10; cap $CAP s"

# ---- build: only what this tier runs --------------------------------------------
STAGES=(01-single-gpu/train 03-ddp/train 04-fsdp/train 05-accum-mixed-precision/train 06-tensor-parallel/train
        07-pipeline-parallel/train 08-context-parallel/train 09-expert-parallel/train)
STOP=""
if begin build; then
    run make 240 make -j"$CORES" "${STAGES[@]}" tests/test_dtrain build/test/01-single-gpu/train tools/consolidate
    if [ "$DRY" = 0 ] && [ ! -f build/dtrain_cuda.o ]; then
        CUR_FAILS=$((CUR_FAILS + 1)); STOP="the build has no CUDA (nvcc not found, or CUDA=0)"
    fi
    [ "$CUR_FAILS" = 0 ] || STOP=${STOP:-the build failed}
    end "${STOP:-8 stages, the tests, tools/consolidate with $CORES jobs}"
fi
if [ -n "$STOP" ]; then
    for p in "${PLAN[@]:1}"; do N_NOTRUN=$((N_NOTRUN + 1)); say "NOT RUN ${p% *} ($STOP)"; done
    say "$N_PASS passed, $N_FAIL failed, $N_NOTRUN not run, $((SECONDS - T0)) s"
    exit 1
fi

G=(--model gpt --dim 64 --depth 2 --heads 4 --seq-len 64 --batch-size 16 --epochs 1 --seed 1 --augment 0 --log-every 25)
LL=(--model llama --dim 64 --depth 2 --heads 4 --kv-heads 2 --seq-len 64 --batch-size 16 --epochs 1 --seed 1 --augment 0
    --log-every 25)
ONE=(env OMP_NUM_THREADS=1)        # CPU references on one thread: 16 threads ran this GPT slower (2026-11-24)
RPG2=() RPG4=()
[ "$DRY" = 1 ] || { RPG2=(--ranks-per-gpu 2); RPG4=(--ranks-per-gpu 4); }
tr1() { local n=$1; shift; run "$n" 60 "$@" --steps 10 --log "$R/$n.jsonl"; }   # ten steps, logged

# ---- the open 04/05 defect ---------------------------------------------------------
if begin defect; then
    tr1 cpu01 "${ONE[@]}" ./01-single-gpu/train --device cpu "${G[@]}"
    tr1 g01 ./01-single-gpu/train --device "$DEV" "${G[@]}"
    tr1 g03 ./03-ddp/train --device "$DEV" --nproc 1 "${G[@]}"
    for m in full grads optimizer; do tr1 "g04-$m" ./04-fsdp/train --device "$DEV" --nproc 1 "${G[@]}" --shard "$m"; done
    tr1 g04-blocking env CUDA_LAUNCH_BLOCKING=1 ./04-fsdp/train --device "$DEV" --nproc 1 "${G[@]}"
    tr1 g01-clip0 ./01-single-gpu/train --device "$DEV" "${G[@]}" --clip 0
    tr1 g04-clip0 ./04-fsdp/train --device "$DEV" --nproc 1 "${G[@]}" --clip 0
    tr1 g05-fp32 ./05-accum-mixed-precision/train --device "$DEV" --nproc 1 "${G[@]}"
    tr1 cpu01-sgd "${ONE[@]}" ./01-single-gpu/train --device cpu "${G[@]}" --optimizer sgd
    tr1 g01-sgd ./01-single-gpu/train --device "$DEV" "${G[@]}" --optimizer sgd
    tr1 g04-sgd ./04-fsdp/train --device "$DEV" --nproc 1 "${G[@]}" --optimizer sgd
    tr1 cpu01-llama "${ONE[@]}" ./01-single-gpu/train --device cpu "${LL[@]}"
    tr1 g01-llama ./01-single-gpu/train --device "$DEV" "${LL[@]}"
    tr1 g04-llama ./04-fsdp/train --device "$DEV" --nproc 1 "${LL[@]}"
    for f in g01 g03 g04-full g04-grads g04-optimizer g04-blocking g05-fp32; do compare "$f" cpu01 1e-5; done
    for f in g04-full g04-blocking g05-fp32; do compare "$f" g01 1e-5; done
    compare g04-clip0 g01-clip0 1e-5
    for f in g01-sgd g04-sgd; do compare "$f" cpu01-sgd 1e-5; done
    for f in g01-llama g04-llama; do compare "$f" cpu01-llama 1e-5; done
    # one step saved on the GPU and on the CPU, compared tensor by tensor: which gradients
    # (AdamW's first moment, 0.1 x the gradient) and which weights differ, largest first
    for d in "$DEV" cpu; do
        rm -rf "$R/one-$d" "$R/one-$d.whole"
        run "one-step-$d" 60 "${ONE[@]}" ./04-fsdp/train --device "$d" --nproc 1 "${G[@]}" --steps 1 --save-dir "$R/one-$d" &&
            run "consolidate-$d" 60 ./tools/consolidate "$(ls -d "$R/one-$d"/*_step1 | head -1)" "$R/one-$d.whole"
    done
    if [ -d "$R/one-$DEV.whole" ] && [ -d "$R/one-cpu.whole" ]; then
        { python3 tools/tensor_diff.py "$R/one-$DEV.whole/optimizer.safetensors" "$R/one-cpu.whole/optimizer.safetensors" \
              --only exp_avg. --top 8
          python3 tools/tensor_diff.py "$R/one-$DEV.whole/model.safetensors" "$R/one-cpu.whole/model.safetensors" --top 8
        } >"$OUT/logs/defect-tensor-diff.log" 2>&1
        sed 's/^/  | /' "$OUT/logs/defect-tensor-diff.log" | head -24 | tee -a "$REPORT"
    fi
    end "each GPU run's 10 losses against 01 on the CPU and on the GPU, within 1e-5"
fi

# ---- the kernels that have never run, against the CPU ------------------------------
if begin kernels; then
    for t in gpu_ops gpu_casts gpu_quantization gpu_fp32_step gpu_bf16_and_fp16_step gpu_online_attention gpu_hardware_figures; do
        run "$t" 120 ./tests/test_dtrain build/test/01-single-gpu/train "$t"
        if [ "$DRY" = 0 ] && grep -q '^SKIP' "$OUT/logs/kernels-$t.log"; then
            CUR_FAILS=$((CUR_FAILS + 1)); say "  $t: skipped where a GPU is visible"
        fi
        grep -E '^(PASS|FAIL|SKIP) ' "$OUT/logs/kernels-$t.log" | cut -c1-140 | sed 's/^/  /' | tee -a "$REPORT"
    done
    end "gpu_ops (online attention, the fused classifier, Llama's kernels), casts, ZeRO++'s quantization, one step, online attention, the GPU's own figures (NVML)"
fi

# ---- GPT-2 124M: dtrain against PyTorch eager on the same step ---------------------
if begin gpt2; then
    G2=(--model gpt --dim 768 --depth 12 --heads 12 --seq-len 1024 --vocab 50257 --batch-size 8 --dtype bf16 --peak-tflops 989)
    [ "$DRY" = 0 ] || G2=(--model gpt --dim 64 --depth 1 --heads 4 --seq-len 128 --vocab 50257 --batch-size 2 --steps 3)
    for v in "" "--attention online"; do
        n=bench$([ -z "$v" ] || echo -online)
        # shellcheck disable=SC2086
        run "$n" 120 ./05-accum-mixed-precision/train --bench --device "$DEV" --nproc 1 "${G2[@]}" $v &&
            grep '^bench:' "$OUT/logs/gpt2-$n.log" | tr ' ' '\n' |
                grep -E '^(tokens_per_s|tflops|mfu|step_ms|fwd_ms|bwd_ms|comm_ms|opt_ms|peak_mem_mb)=' | tr '\n' ' ' |
                sed "s/^/  dtrain $n: /; s/\$/\n/" | tee -a "$REPORT"
    done
    if [ "$DRY" = 0 ] && timeout 60 python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        run torch 150 python3 tools/bench_torch.py --device cuda --workloads gpt2-124m-bf16 &&
            grep '^torch-bench:' "$OUT/logs/gpt2-torch.log" | cut -c1-200 | sed 's/^/  /' | tee -a "$REPORT"
    else
        say "  PyTorch eager: not run (no CUDA build of PyTorch here)"
    fi
    end "the figures above; no bound yet (the speed issue's goal: at least PyTorch eager and 30% MFU)"
fi

# ---- 06 and 07 over NCCL, ranks sharing the GPU -------------------------------------
if begin nccl; then
    P=(--timeout 20 --steps 10)
    G4=("${G[@]}" --depth 4)
    tr1 g01-b32 ./01-single-gpu/train --device "$DEV" "${G[@]}" --batch-size 32
    tr1 g01-d4 ./01-single-gpu/train --device "$DEV" "${G4[@]}" --batch-size 32
    run tp2 45 ./06-tensor-parallel/train --device "$DEV" --nproc 2 "${RPG2[@]}" "${G[@]}" --batch-size 32 "${P[@]}" --log "$R/tp2.jsonl"
    run tp2-sp 45 ./06-tensor-parallel/train --device "$DEV" --nproc 2 "${RPG2[@]}" "${G[@]}" --batch-size 32 --sequence-parallel \
        "${P[@]}" --log "$R/tp2-sp.jsonl"
    run tp2-dp2-full 60 ./06-tensor-parallel/train --device "$DEV" --nproc 4 "${RPG4[@]}" --tp 2 --shard full "${G[@]}" \
        --batch-size 16 "${P[@]}" --log "$R/tp2-dp2-full.jsonl"
    for s in gpipe 1f1b; do
        run "pp2-$s" 45 ./07-pipeline-parallel/train --device "$DEV" --nproc 2 "${RPG2[@]}" "${G4[@]}" --batch-size 32 \
            --micro-batches 4 --schedule "$s" "${P[@]}" --log "$R/pp2-$s.jsonl"
    done
    run pp2-bf16 45 ./07-pipeline-parallel/train --device "$DEV" --nproc 2 "${RPG2[@]}" "${G4[@]}" --batch-size 32 --micro-batches 4 \
        --dtype bf16 "${P[@]}" --log "$R/pp2-bf16.jsonl"
    run pp2-dp2-full 60 ./07-pipeline-parallel/train --device "$DEV" --nproc 4 "${RPG4[@]}" --pp 2 --shard full "${G4[@]}" \
        --batch-size 16 --micro-batches 2 "${P[@]}" --log "$R/pp2-dp2-full.jsonl"
    for l in zigzag contiguous; do
        run "cp2-$l" 45 ./08-context-parallel/train --device "$DEV" --nproc 2 "${RPG2[@]}" --cp 2 --cp-layout "$l" "${G[@]}" \
            --batch-size 32 "${P[@]}" --log "$R/cp2-$l.jsonl"
    done
    MOE=(--moe-experts 4 --moe-top-k 2 --moe-capacity 1 --moe-aux-loss 0.01)
    tr1 g01-moe ./01-single-gpu/train --device "$DEV" "${G[@]}" "${MOE[@]}" --batch-size 32
    run ep2 45 ./09-expert-parallel/train --device "$DEV" --nproc 2 "${RPG2[@]}" --ep 2 "${G[@]}" "${MOE[@]}" --batch-size 16 \
        "${P[@]}" --log "$R/ep2.jsonl"
    for f in tp2 tp2-sp tp2-dp2-full cp2-zigzag cp2-contiguous; do compare "$f" g01-b32 1e-4; done
    compare ep2 g01-moe 1e-4
    ZPP=(--quantize-weights int8 --quantize-grads int4 --hierarchical --ranks-per-machine 1)
    run zpp2-hp 45 ./04-fsdp/train --device "$DEV" --nproc 2 "${RPG2[@]}" --hierarchical --ranks-per-machine 1 "${G[@]}" \
        --batch-size 16 "${P[@]}" --log "$R/zpp2-hp.jsonl"
    run zpp2-all 45 ./04-fsdp/train --device "$DEV" --nproc 2 "${RPG2[@]}" "${ZPP[@]}" "${G[@]}" --batch-size 16 "${P[@]}" \
        --log "$R/zpp2-all.jsonl"
    compare zpp2-hp g01-b32 1e-4
    compare zpp2-all g01-b32 0.05
    for f in pp2-gpipe pp2-1f1b pp2-dp2-full; do compare "$f" g01-d4 1e-4; done
    compare pp2-bf16 g01-d4 0.05
    end "two and four ranks on one GPU against 01 at the same global batch: fp32 within 1e-4, bf16 and ZeRO++'s quantized within 0.05"
fi

tar czf "$OUT/logs.tgz" -C "$OUT" logs runs 2>/dev/null
say "$N_PASS passed, $N_FAIL failed, $N_NOTRUN not run, $((SECONDS - T0)) s (cap $CAP s; tier 2: GPU_CHECK_TIER=2)"
[ "$N_FAIL" = 0 ]
