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
# pick_torch_coretype PY: sets torch_coretype ("" for OpenBLAS's own choice, or
# when OPENBLAS_CORETYPE is set, which every run then inherits) and says what it
# picked; the benches run PyTorch with ${torch_coretype:+OPENBLAS_CORETYPE=...}.
pick_torch_coretype() {
  local py=$1 gf g c best pick candidates
  torch_coretype=""
  if [ -n "${OPENBLAS_CORETYPE:-}" ]; then
    gf=$(matmul_gflops "$py" "$OPENBLAS_CORETYPE"); pick="OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE (set by you)"
  else
    candidates=("")
    grep -qw avx2 /proc/cpuinfo 2>/dev/null && candidates+=(HASWELL)
    grep -qw avx512f /proc/cpuinfo 2>/dev/null && candidates+=(SKYLAKEX)
    grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && candidates+=(COOPERLAKE)
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
