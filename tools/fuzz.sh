#!/usr/bin/env bash
# make fuzz: every harness of tests/fuzz/ (libFuzzer, with ASan and UBSan) for
# FUZZ_SECONDS each (default 60), JOBS at once (default: one per core), from
# build/fuzz/corpus/NAME (kept from run to run: what earlier runs found
# interesting) and the test suite's own files (build/fuzz/seeds/NAME, written
# by tests/test_dtrain --write-fuzz-seeds). FUZZ_TARGETS picks harnesses.
# Prints, per harness, the inputs run, the coverage reached (edges and
# features, libFuzzer's "cov" and "ft") and the corpus. What a harness finds
# -- a crash, a sanitizer report, a hang past 10 s, memory past 2 GB -- is
# kept in build/fuzz/found/NAME/, and the script exits 1 naming it (what an
# earlier run found there is not counted again); rerun one with
# DT_FUZZ=NAME build/fuzz/fuzz FILE.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=build/fuzz/fuzz
secs=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-"safetensors config_json index_json npy jsonl pnm cifar rendezvous"}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 1)}
[ -x "$bin" ] || { echo "fuzz: no $bin (make fuzz builds it)" >&2; exit 2; }
rm -rf build/fuzz/seeds
tests/test_dtrain --write-fuzz-seeds build/fuzz/seeds || { echo "fuzz: could not write the seeds" >&2; exit 1; }

declare -A before                 # what earlier runs found is not this run's finding
for t in $targets; do before[$t]=" $(ls "build/fuzz/found/$t" 2>/dev/null | tr '\n' ' ')"; done

run_one() {
  local t=$1
  mkdir -p "build/fuzz/corpus/$t" "build/fuzz/found/$t"
  DT_FUZZ=$t ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -close_fd_mask=2 -detect_leaks=0 -print_final_stats=1 \
    -artifact_prefix="build/fuzz/found/$t/" "build/fuzz/corpus/$t" "build/fuzz/seeds/$t" >"build/fuzz/$t.log" 2>&1
}

echo "fuzzing $(echo $targets | wc -w) harnesses, $secs s each, $jobs at once"
running=0
for t in $targets; do
  run_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait

printf '%-12s %12s %8s %8s %8s  %s\n' harness runs cov ft corpus found
found=()
for t in $targets; do
  log=build/fuzz/$t.log
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done_line")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$done_line")
  corp=$(sed -n 's/.* corp: \([0-9]*\)\/.*/\1/p' <<<"$done_line")
  what=""
  for f in $(ls "build/fuzz/found/$t" 2>/dev/null); do
    case "${before[$t]}" in *" $f "*) ;; *) what+="$f " ;; esac
  done
  if [ -n "$what" ] || [ -z "$done_line" ]; then
    found+=("$t")
    [ -n "$what" ] || what="(no DONE line: see $log)"
  else what=none; fi
  printf '%-12s %12s %8s %8s %8s  %s\n' "$t" "${runs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$what"
done
if [ ${#found[@]} -gt 0 ]; then
  for t in "${found[@]}"; do echo "---- $t:"; grep -E 'ERROR|SUMMARY|==[0-9]+==|runtime error|deadly|Test unit' "build/fuzz/$t.log" | head -12; done
  echo "fuzz: findings in ${found[*]} (build/fuzz/found/)"
  exit 1
fi
echo "fuzz: nothing found"
