#!/usr/bin/env bash
# `make gpu-check`: dtrain's GPU paths checked on a machine that has a GPU, in two
# tiers, because GPU time comes in windows of fifteen minutes:
#
#   tools/gpu_check.sh                     tier 1 (tools/gpu_check_tier1.sh): the open
#                                          defect, the kernels that have never run,
#                                          GPT-2 against PyTorch, 06 and 07 over NCCL;
#                                          at most six minutes on one H100, its build included
#   GPU_CHECK_TIER=2 tools/gpu_check.sh    tier 2 (tools/gpu_check_tier2.sh): the rest,
#                                          about twenty minutes (its build included)
#   GPU_CHECK_OUT=DIR                      where the report goes (default gpu-check/)
#   DT_GPU_CHECK_FORCE=1                   dry run without a GPU: --device cpu everywhere
#
# Without a GPU (and without DT_GPU_CHECK_FORCE=1) either tier says so in one line
# and exits 0. docs/gpu-check.md says what each check passes on.
set -u
here=$(dirname "${BASH_SOURCE[0]}")
case "${GPU_CHECK_TIER:-1}" in
    1) exec bash "$here/gpu_check_tier1.sh" "$@" ;;
    2) exec bash "$here/gpu_check_tier2.sh" "$@" ;;
    *) echo "gpu-check: GPU_CHECK_TIER=${GPU_CHECK_TIER} is not a tier (1, the default, or 2)" >&2; exit 2 ;;
esac
