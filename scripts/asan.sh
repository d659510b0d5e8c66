#!/usr/bin/env bash
# The integration tests (and the unit tests) of the multiproc library, once, under
# AddressSanitizer: out-of-bounds accesses, use-after-free and double frees in the
# cross-process code (mmap'd segments, fds received over sockets, forked and re-executed
# workers — every worker is this same instrumented test binary).
#
# Works on a stable toolchain: -Zsanitizer needs nightly features, which
# RUSTC_BOOTSTRAP=1 unlocks. Without -Zbuild-std (which needs the rust-src component)
# the standard library is not instrumented, so the sanitizer flag must be allowed to
# differ from std's (-Cunsafe-allow-abi-mismatch=sanitizer), and --target keeps the
# flags off build scripts and proc-macros. Output goes to target/asan (its own build).
#
# Usage: scripts/asan.sh [extra cargo test arguments, e.g. --test hostile_packets]
set -euo pipefail
cd "$(dirname "$0")/.."

target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Zsanitizer=address -Cunsafe-allow-abi-mismatch=sanitizer -Cforce-frame-pointers=yes ${RUSTFLAGS:-}"
export RUSTDOCFLAGS="$RUSTFLAGS"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/asan}
# Memory errors only: LeakSanitizer is off by default. Workers are this test binary run
# again or forked, and several leave with exit() on purpose holding what they made (a
# scenario that keeps tensors alive for a killer, a forked child of the multithreaded
# harness, whose threads LSan cannot stop): leak reports there are noise. The tests'
# own leak checks (fds, /dev/shm, children) cover what matters. ASAN_OPTIONS=detect_leaks=1
# turns it on. allocator_may_return_null: tests allocate 2^62 bytes to see the error.
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:detect_stack_use_after_return=0:${ASAN_OPTIONS:-}"

echo "== AddressSanitizer: cargo test -p multiproc --target $target (lib and integration tests)"
cargo test -p multiproc --target "$target" --lib --tests "$@"
echo "asan: no errors"
