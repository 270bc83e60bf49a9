# Sourced by tools/bench_cpu.sh and tools/bench_qwen2.sh: the OpenBLAS core type
# PyTorch is compared with.
#
# PyTorch's speed rests on the BLAS that libblas.so.3 points to: Debian's
# reference BLAS (the default without libopenblas0) is ~30x slower than OpenBLAS.
# And OpenBLAS picks its kernels by the processor's model number: one it does
# not know (a newer Xeon, or a virtual machine that hides the model) gets the
# generic SSE3 kernels, 5x slower (27 against 145 GFLOP/s on this project's CI
# machine, OpenBLAS 0.3.21). PyTorch is compared at its best, so unless
# OPENBLAS_CORETYPE is set, each core type the processor's flags allow is tried
# on a 512x512 matmul and the fastest is kept for every PyTorch run (only
# theirs: a dtrain built against OpenBLAS, -DDT_HAVE_CBLAS, keeps its own).
matmul_gflops() {  # PY, OPENBLAS_CORETYPE value ("" = OpenBLAS's own choice) -> GFLOP/s at one thread
  env ${2:+OPENBLAS_CORETYPE=$2} OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$1" -c '
import time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
for _ in range(3): a @ b
best = 1e9
for _ in range(5):
    t = time.perf_counter()
    for _ in range(10): a @ b
    best = min(best, time.perf_counter() - t)
print(round(10 * 2 * 512**3 / best / 1e9, 1))' 2>/dev/null
}
# the core types this processor's flags allow, "" (OpenBLAS's own choice) first, in candidates[]
coretype_candidates() {
  candidates=("")
  grep -qw avx2 /proc/cpuinfo 2>/dev/null && candidates+=(HASWELL)
  grep -qw avx512f /proc/cpuinfo 2>/dev/null && candidates+=(SKYLAKEX)
  grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && candidates+=(COOPERLAKE)
}
# pick_roofline_coretype ROOFLINE: with no PyTorch to pick by, the same choice
# made on tools/roofline's own 1024^3 OpenBLAS matmul, so that the fractions of
# OpenBLAS's rate are of its best kernels, not of the generic ones it falls
# back to on a model it does not know. Sets torch_coretype, as above.
pick_roofline_coretype() {
  local rl=$1 g c gf=0 best="" candidates
  torch_coretype=""
  [ -z "${OPENBLAS_CORETYPE:-}" ] || return 0
  coretype_candidates
  for c in "${candidates[@]}"; do
    g=$(env ${c:+OPENBLAS_CORETYPE=$c} OMP_NUM_THREADS=1 "$rl" --quick --reps 3 2>/dev/null |
        sed -n 's/^gemm shape=square-1024 .*openblas_gflops=\([0-9.]*\).*/\1/p')
    [ -n "$g" ] || continue                      # no OpenBLAS, or not with this core type
    echo "  OpenBLAS core type ${c:-(its own choice)}: $g GFLOP/s on 1024^3 (tools/roofline)"
    if awk -v g="$g" -v b="$gf" 'BEGIN { exit !(g > b) }'; then gf=$g; best=$c; fi
  done
  torch_coretype=$best
  [ "$gf" = 0 ] || echo "tools/roofline measures OpenBLAS with ${best:+OPENBLAS_CORETYPE=}${best:-its own core type} (the fastest)"
}
# pick_torch_coretype PY: sets torch_coretype ("" for OpenBLAS's own choice, or
# when OPENBLAS_CORETYPE is set, which every run then inherits) and says what it
# picked; the benches run PyTorch with ${torch_coretype:+OPENBLAS_CORETYPE=...}.
pick_torch_coretype() {
  local py=$1 gf g c best pick candidates
  torch_coretype=""
  if [ -n "${OPENBLAS_CORETYPE:-}" ]; then
    gf=$(matmul_gflops "$py" "$OPENBLAS_CORETYPE"); pick="OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE (set by you)"
  else
    coretype_candidates
    gf=0; best=""
    for c in "${candidates[@]}"; do
      g=$(matmul_gflops "$py" "$c")
      echo "  OpenBLAS core type ${c:-(its own choice)}: ${g:-?} GFLOP/s"
      if awk -v g="${g:-0}" -v b="$gf" 'BEGIN { exit !(g > b) }'; then gf=$g; best=$c; fi
    done
    if [ -n "$best" ]; then torch_coretype=$best; pick="OPENBLAS_CORETYPE=$best (the fastest)"; else pick="OpenBLAS's own core type (the fastest)"; fi
  fi
  echo "PyTorch $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null) runs with $pick: a 512x512 matmul at one thread at ${gf:-?} GFLOP/s"
  if awk -v g="${gf:-0}" 'BEGIN { exit !(g < 20) }'; then
    echo "  (that is a reference BLAS: install an optimised one, e.g. Debian's libopenblas0, or the comparison is unfair to PyTorch)"
  fi
}
