#!/usr/bin/env bash
# Which library files one tensor's trip from `Queue::put` to `Queue::get` runs code in.
#
# Builds examples/one_trip with LLVM's coverage counters (in its own target directory),
# runs it twice (the parent getting, then the parent putting: a worker ends with
# `_exit`, which writes no profile), and lists every file of crates/multiproc/src with a
# function that ran at least once per trip (200 trips: setup code runs a few times,
# the trip's code 200 times or more). Needs rustup's llvm-tools component
# (`rustup component add llvm-tools`).
#
# Usage: scripts/trip_files.sh            prints the files, put side then get side
#        TRIP_VERBOSE=1 scripts/trip_files.sh   and the functions in each (demangled
#                                        when rustfilt is installed)
set -euo pipefail
cd "$(dirname "$0")/.."
target=${TRIP_TARGET_DIR:-target/trip-coverage}
sysroot=$(rustc --print sysroot)
bin=$(ls "$sysroot"/lib/rustlib/*/bin/llvm-profdata 2>/dev/null | head -1)
[ -n "$bin" ] || { echo "trip_files: needs llvm-tools (rustup component add llvm-tools)" >&2; exit 2; }
tools=$(dirname "$bin")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Build scripts and proc macros are instrumented too: their profiles go to $work.
CARGO_TARGET_DIR=$target RUSTFLAGS="-Cinstrument-coverage" LLVM_PROFILE_FILE="$work/build-%p-%m.profraw" \
  cargo build --release -q -p multiproc --example one_trip
exe=$target/release/examples/one_trip
for side in put get; do
  arg=""; [ "$side" = put ] && arg=put
  LLVM_PROFILE_FILE="$work/$side-%p.profraw" "$exe" $arg >/dev/null
  "$tools/llvm-profdata" merge -sparse "$work"/$side-*.profraw -o "$work/$side.profdata"
  "$tools/llvm-cov" export -format=text -summary-only=false -skip-expansions \
    -instr-profile="$work/$side.profdata" "$exe" > "$work/$side.json"
  python3 - "$work/$side.json" "$side" <<'PY'
import collections, json, os, subprocess, sys
data = json.load(open(sys.argv[1]))
files = collections.defaultdict(set)
for fn in data["data"][0]["functions"]:
    if fn["count"] < 200:
        continue
    for f in fn["filenames"]:
        if "/crates/multiproc/src/" in f:
            files[f.split("/crates/multiproc/src/", 1)[1]].add(fn["name"])
print(f"{sys.argv[2]} side: {len(files)} files")
verbose = bool(os.environ.get("TRIP_VERBOSE"))
for f in sorted(files):
    print(f"  {f} ({len(files[f])} functions)")
    if verbose:
        names = "\n".join(sorted(files[f]))
        try:
            names = subprocess.run(["rustfilt"], input=names, capture_output=True, text=True).stdout
        except FileNotFoundError:
            pass
        for name in names.splitlines():
            print(f"      {name}")
PY
done
