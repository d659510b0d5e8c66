#!/usr/bin/env bash
# The GPU check of the `cuda` feature, in one go (about a minute on one GPU; every step
# has a timeout, 6 minutes in all at worst): every test of tests/cuda_*.rs (the GPU ones
# are #[ignore]d on CPU CI), the CUDA benchmark (sharing, and host-to-device copies from
# a data loader's batch, pinned and pageable) beside torch.multiprocessing's of the same
# sizes, then the prefetch example (a training step with and without prefetch_to), then
# the CPU benchmarks on this many-core machine (`multiproc bench --async`, the awaited
# wake-up beside the blocking one, and `multiproc bench`'s small, ping and fresh 4 KiB
# beside `bench-floor`), 3 runs each.
#
# Needs a bundle from scripts/gpu_build.sh (built where Rust is; this machine needs
# only the NVIDIA driver, python3 and torch):
#
#     scripts/gpu_check.sh [DIR]      # default target/gpu-bundle
#
# Logs go to $OUT (or /tmp/gpu-check): tests.log, multiproc.json, torch.log,
# prefetch.log, cpu_bench.log, summary.txt. Exit status: 0 when every test passed and the benchmarks
# and the example ran.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-target/gpu-bundle}
logs=${OUT:-/tmp/gpu-check}
mkdir -p "$logs"
[ -d "$bundle/cuda_tests" ] || { echo "no bundle at $bundle: run scripts/gpu_build.sh first" >&2; exit 2; }
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1

echo "== bundle: $(tr '\n' ' ' <"$bundle/COMMIT")"
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 || echo "(no nvidia-smi)"
uname -r

echo "== tests (tests/cuda_*.rs, one at a time: the lifetime tests read free device memory)"
: >"$logs/tests.log"
tests_rc=0
# 150 s for all the test binaries together.
tests_until=$(($(date +%s) + 150))
for t in "$bundle"/cuda_tests/*; do
  echo "== $(basename "$t")" | tee -a "$logs/tests.log"
  left=$((tests_until - $(date +%s)))
  [ "$left" -gt 0 ] || left=1
  timeout "$left" "$t" --include-ignored --skip write_cuda_inputs_into_the_corpus \
    --test-threads 1 --nocapture 2>&1 | tee -a "$logs/tests.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || tests_rc=$rc
done

echo "== benchmark: multiproc (cuda_bench)"
timeout 60 "$bundle/cuda_bench" --json 2>&1 | tee "$logs/multiproc.json"
bench_rc=${PIPESTATUS[0]}

echo "== benchmark: torch.multiprocessing, same sizes, same machine"
timeout 100 python3 "$bundle/compare_torch_cuda.py" --multiproc-json "$logs/multiproc.json" 2>&1 \
  | tee "$logs/torch.log"
torch_rc=${PIPESTATUS[0]}

echo "== example: prefetch_overlap (step time with and without prefetch_to)"
timeout 45 "$bundle/prefetch_overlap" 2>&1 | tee "$logs/prefetch.log"
prefetch_rc=${PIPESTATUS[0]}

echo "== CPU benchmarks on this machine ($(nproc) CPUs), 3 runs each"
: >"$logs/cpu_bench.log"
if [ -x "$bundle/multiproc" ]; then
  for i in 1 2 3; do
    timeout 30 "$bundle/multiproc" bench --async 2>&1 | grep -E '^(wake|disconnect)'
    timeout 40 "$bundle/multiproc" bench --scenario small --scenario ping --scenario fresh \
      --bytes 4096 --strategy file_descriptor 2>&1 | grep -E '^(small|ping|fresh)'
    timeout 30 "$bundle/multiproc" bench-floor 2>&1 | grep -E '^(spin-ping|fill\+sum +- +4 KiB)'
  done | tee -a "$logs/cpu_bench.log"
else
  echo "(no multiproc binary in the bundle)" | tee -a "$logs/cpu_bench.log"
fi

{
  echo "== summary"
  grep -E '^test result:' "$logs/tests.log" | sed 's/^/  /'
  # The names of the failed tests (the second "failures:" block libtest prints).
  awk '/^test result:/ {n = 0; next} /^failures:$/ {n++; next} n == 2 && NF {print "  FAILED " $1}' \
    "$logs/tests.log"
  grep -E '^(cuda_fresh|cuda_ping|d2d_copy|h2d_pinned|h2d_pageable) ' "$logs/torch.log" | sed 's/^/  /'
  grep -E '"scenario":"h2d_' "$logs/multiproc.json" | sed 's/^/  /'
  grep -E '^(batch|mode|pageable|pinned|prefetch) ' "$logs/prefetch.log" | sed 's/^/  /'
  sed 's/^/  /' "$logs/cpu_bench.log"
  echo "  tests exit $tests_rc, cuda_bench exit $bench_rc, torch script exit $torch_rc, prefetch_overlap exit $prefetch_rc"
} | tee "$logs/summary.txt"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$torch_rc" = 0 ] && [ "$prefetch_rc" = 0 ]
