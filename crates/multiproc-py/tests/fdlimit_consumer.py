"""A consumer at a low fd limit: receives N tensors from the queue sealed in fd argv[1]
and keeps every one alive; on FdLimitError it checks and lets go of the oldest half,
then goes on. Prints one JSON line: what it saw."""

import json
import resource
import sys

limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

import torch  # noqa: E402

import multiproc as mp  # noqa: E402

q = mp.open_parcel(int(sys.argv[1]), mp.Queue)
n = int(sys.argv[2])
kept = {}
fd_limit_errors = 0
seen = set()
max_kept = 0
while len(seen) < n:
    try:
        i, t = q.get(timeout=60)
    except mp.FdLimitError:
        fd_limit_errors += 1
        if not kept:
            raise
        for j in sorted(kept)[: max(1, len(kept) // 2)]:
            assert kept.pop(j)[0].item() == j
        continue
    assert i not in seen, f"tensor {i} arrived twice"
    seen.add(i)
    kept[i] = t
    max_kept = max(max_kept, len(kept))
wrong = [i for i, t in kept.items() if not (t[0].item() == i and t[-1].item() == i)]
print(json.dumps({"received": len(seen), "kept_at_once": max_kept,
                  "fd_limit_errors": fd_limit_errors, "wrong": wrong}))
# Gives every block's use back before leaving (interpreter teardown may not free
# every tensor).
del kept, t
import gc  # noqa: E402

gc.collect()
