#!/usr/bin/env bash
# The GPU tests of the `cuda` feature against a stand-in for the NVIDIA driver
# (scripts/fake_libcuda.c: "device memory" is host memory in memfds), on a machine
# without a GPU. It checks multiproc's own logic — handles on the wire, leases and the
# pool, identity across processes, views, copies, bad handles, the fork check — not
# CUDA: the real thing is scripts/gpu_check.sh on a GPU machine. Its "free memory" is
# what no process holds any more (see the C file), so the lifetime tests run too.
set -euo pipefail
cd "$(dirname "$0")/.."
lib=target/fake-cuda
mkdir -p "$lib"
cc -Wall -Wextra -O1 -shared -fPIC -o "$lib/libcuda.so.1" scripts/fake_libcuda.c
ln -sf libcuda.so.1 "$lib/libcuda.so"
LD_LIBRARY_PATH="$PWD/$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test -p multiproc --features cuda,async --test cuda_tensors --test cuda_sharing --test cuda_loader --test cuda_async \
  -- --include-ignored \
  --skip write_cuda_inputs_into_the_corpus \
  --test-threads 1
