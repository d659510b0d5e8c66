#!/usr/bin/env bash
# The instructions and heap allocations one tensor's put+get costs, counted (not
# timed) with callgrind: deterministic where `multiproc bench` on a shared machine
# varies by a fifth from run to run, so a change of a few percent shows.
#
# Builds examples/trip_cost, runs it under callgrind with 1,000 and 3,000 trips (spin
# waits off: nothing waits in one process), and prints the difference per trip: the
# trip alone, start-up excluded. One process plays both sides (see the example's doc
# for what that leaves out). It does so for a tensor, then for a `u64`: what any
# message costs, so that the difference is what the tensor adds. Needs valgrind
# (`apt install valgrind`).
#
# Usage: scripts/trip_cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "trip_cost: needs valgrind (apt install valgrind)" >&2; exit 2; }
cargo build --release -q -p multiproc --example trip_cost
exe=target/release/examples/trip_cost
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for message in tensor u64; do
  for n in 1000 3000; do
    MESSAGE=$message MULTIPROC_SPIN_US=0 TRIPS=$n valgrind --tool=callgrind \
      --callgrind-out-file="$work/$message-$n.out" "$exe" >/dev/null 2>"$work/$message-$n.log"
  done
done
python3 - "$work" <<'PY'
import re, sys
work = sys.argv[1]
def totals(message, n):
    """Instructions, and calls into the allocator, of the run with n trips."""
    names = {}  # callgrind names a function once, then by its number
    def name(spec):
        m = re.match(r"\((\d+)\)(?: (.*))?", spec.strip())
        if not m:
            return spec.strip()
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "")
    ir = calls = 0
    cfn = None
    for line in open(f"{work}/{message}-{n}.out"):
        if line.startswith("summary:"):
            ir = int(line.split()[1])
        elif line.startswith("fn="):
            name(line[3:])
        elif line.startswith("cfn="):
            cfn = name(line[4:])
        elif line.startswith("calls=") and cfn is not None:
            if cfn in ("malloc", "calloc", "realloc"):
                calls += int(line[6:].split()[0])
            cfn = None
    return ir, calls
per = {}
for message in ("tensor", "u64"):
    (ir1, a1), (ir3, a3) = totals(message, 1000), totals(message, 3000)
    per[message] = ((ir3 - ir1) / 2000, (a3 - a1) / 2000)
print(f"per put+get of a fresh 256-byte tensor: {per['tensor'][0]:,.0f} instructions, "
      f"{per['tensor'][1]:.1f} allocations")
print(f"per put+get of a u64:                   {per['u64'][0]:,.0f} instructions, "
      f"{per['u64'][1]:.1f} allocations")
print(f"what the tensor adds:                   {per['tensor'][0] - per['u64'][0]:,.0f} instructions")
PY
