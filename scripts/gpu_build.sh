#!/usr/bin/env bash
# Builds the bundle that scripts/gpu_check.sh runs on a GPU machine with no Rust
# toolchain: the CUDA test binaries (tests/cuda_*.rs, feature `cuda`), the CUDA benchmark
# (examples/cuda_bench.rs, release), the prefetch example (examples/prefetch_overlap.rs,
# release), the torch comparison script, and the `multiproc` command (release), whose
# CPU benchmarks gpu_check.sh also runs there: the GPU machine has many more cores than
# a CI runner, which the wake-up and throughput figures depend on.
#
#     scripts/gpu_build.sh [DIR]      # default target/gpu-bundle
#
# Then, on the GPU machine, from the repo root: scripts/gpu_check.sh [DIR]. With the
# device tool: carry ["target/gpu-bundle"] and run `bash scripts/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-bundle}
rm -rf "$out"
mkdir -p "$out"

# Every test target of tests/cuda_*.rs, as cuda_tests/<target>: scripts/gpu_check.sh runs
# them all.
cuda_targets=$(cd crates/multiproc/tests && ls cuda_*.rs | sed 's/\.rs$//')
echo "== test binaries ($(echo $cuda_targets | tr ' ' ','), --features cuda,async)"
tests=$(cargo test -p multiproc --features cuda,async $(printf -- '--test %s ' $cuda_targets) --no-run \
  --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("cuda_"):
        print(m["target"]["name"], m["executable"])')
mkdir -p "$out/cuda_tests"
while read -r name exe; do cp "$exe" "$out/cuda_tests/$name"; done <<<"$tests"
[ "$(ls "$out/cuda_tests" | wc -l)" = "$(echo $cuda_targets | wc -w)" ] \
  || { echo "test executables missing: got $(ls "$out/cuda_tests")" >&2; exit 1; }

echo "== benchmark and example (examples/cuda_bench.rs, prefetch_overlap.rs, release, --features cuda)"
cargo build -p multiproc --features cuda --release --example cuda_bench --example prefetch_overlap
cp target/release/examples/cuda_bench "$out/cuda_bench"
cp target/release/examples/prefetch_overlap "$out/prefetch_overlap"

cargo build -p multiproc-cli --release
cp target/release/multiproc "$out/multiproc"

cp scripts/compare_torch_cuda.py "$out/"
# Debug info is most of a test binary's size; the bundle travels (64 MiB at most).
strip --strip-debug "$out"/cuda_tests/* "$out/cuda_bench" "$out/prefetch_overlap" "$out/multiproc"
git rev-parse HEAD >"$out/COMMIT"
git status --porcelain --untracked-files=no | grep -q . && echo "(with uncommitted changes)" >>"$out/COMMIT"
ls -la "$out"
du -sh "$out"
