#!/usr/bin/env python3
"""Python to Python: multiproc's Python package vs torch.multiprocessing
(file_descriptor strategy, spawn context), the same scenarios in one run.

    pip install ./crates/multiproc-py torch numpy
    python3 scripts/compare_torch_python.py [--scale 0.2] [--runs 3]

With ``--runs N`` (default 3) both implementations run N times, alternating, and the
table gives each one's median and the median ratio with its range over the runs (a
ratio is always of two runs made one right after the other).

| scenario | what is timed |
|---|---|
| fresh 4 KiB, fresh 64 MiB | a producer process makes new float32 tensors and puts them on a bounded queue (4); the parent gets each and sums it: tensors/s |
| fresh-copy | the same, the producer's tensors made by `torch.empty` (multiproc copies each once into shared memory on `put`, as torch's `share_memory_` does) |
| small | fresh with 64 float32 (256 bytes): the per-message cost |
| ping 4 KiB | one tensor sent there and back through two queues: µs per round trip |
| spawn 4 | `spawn(noop, nprocs=4)`: ms until all four have exited (a Python interpreter each) |

Not a timed test: the machine may be shared, so compare the ratios. Each
implementation runs in a process of its own.
"""
import argparse
import json
import os
import subprocess
import sys
import time

FRESH = [("fresh", 4 << 10, 20000), ("fresh", 64 << 20, 40), ("fresh-copy", 4 << 10, 20000),
         ("fresh-copy", 64 << 20, 40), ("small", 256, 20000)]
PING = (4 << 10, 2000)
SPAWN_RUNS = 3


def producer(impl, q, floats, count, made_in_block, done):
    import torch

    new = torch.empty
    if impl == "multiproc" and made_in_block:
        import multiproc

        new = multiproc.empty
    q.put("ready")
    for i in range(count):
        t = new(floats, dtype=torch.float32)
        t.fill_(i % 7)
        q.put(t)
    done.wait()  # torch: the producer must outlive the consumer's use of its tensors


def ponger(inbox, outbox, count, done):
    import torch  # noqa: F401  (imported before the clock starts, as on torch's side)

    outbox.put("ready")
    for _ in range(count):
        outbox.put(inbox.get())
    done.wait()


def noop(rank):
    pass


def lib(impl):
    """What makes the queues and events (torch: the spawn context's own), the context
    that starts processes, and the module whose ``spawn`` is timed."""
    if impl == "torch":
        import torch.multiprocessing as mp

        mp.set_sharing_strategy("file_descriptor")
        ctx = mp.get_context("spawn")
        return ctx, ctx, mp
    import multiprocessing

    import multiproc as mp

    return mp, multiprocessing.get_context("spawn"), mp


def fresh(impl, scenario, nbytes, count):
    mp, ctx, _ = lib(impl)
    q, done = mp.Queue(4), mp.Event()
    p = ctx.Process(target=producer,
                    args=(impl, q, nbytes // 4, count, scenario != "fresh-copy", done))
    p.start()
    assert q.get() == "ready"
    start = time.perf_counter()
    total = 0.0
    for _ in range(count):
        total += float(q.get().sum())
    s = time.perf_counter() - start
    done.set()
    p.join()
    return dict(scenario=scenario, bytes=nbytes, count=count, per_s=count / s,
                GB_s=nbytes * count / s / 1e9)


def ping(impl, nbytes, count):
    import torch

    mp, ctx, _ = lib(impl)
    there, back, done = mp.Queue(4), mp.Queue(4), mp.Event()
    p = ctx.Process(target=ponger, args=(there, back, count, done))
    p.start()
    assert back.get() == "ready"
    if impl == "torch":
        t = torch.zeros(nbytes // 4)
        t.share_memory_()
    else:
        import multiproc

        t = multiproc.zeros(nbytes // 4)
    start = time.perf_counter()
    for _ in range(count):
        there.put(t)
        t = back.get()
    s = time.perf_counter() - start
    done.set()
    p.join()
    return dict(scenario="ping", bytes=nbytes, count=count, us_per_roundtrip=s * 1e6 / count)


def spawn4(impl, runs):
    _, _, mp = lib(impl)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mp.spawn(noop, nprocs=4, join=True)
        times.append(time.perf_counter() - start)
    times.sort()
    return dict(scenario="spawn", count=4, ms=times[len(times) // 2] * 1e3)


def run_one(impl, scale):
    import torch  # noqa: F401  (the receiver's first tensor must not pay for the import)

    n = lambda c: max(2, round(c * scale))  # noqa: E731
    for scenario, nbytes, count in FRESH:
        print(json.dumps(dict(fresh(impl, scenario, nbytes, n(count)), impl=impl)), flush=True)
    print(json.dumps(dict(ping(impl, PING[0], n(PING[1])), impl=impl)), flush=True)
    print(json.dumps(dict(spawn4(impl, max(1, round(SPAWN_RUNS * max(scale, 1)))), impl=impl)),
          flush=True)


def size(b):
    return "%d MiB" % (b >> 20) if b >= 1 << 20 else "%d KiB" % (b >> 10) if b >= 1 << 10 else "%d B" % b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:
        run_one(args.impl, args.scale)
        return
    runs = []  # one {(scenario, bytes, impl): figures} per run
    for _ in range(args.runs):
        results = {}
        for impl in ("multiproc", "torch"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--impl", impl,
                                  "--scale", str(args.scale)],
                                 check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                f = json.loads(line)
                results[(f["scenario"], f.get("bytes"), impl)] = f
        runs.append(results)
    print(f"{len(runs)} run(s); medians, and the ratio's range over the runs")
    print("| scenario | size | multiproc | torch.multiprocessing | ratio (min–max) |")
    print("|---|---|---|---|---|")
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    for (scenario, nbytes, impl) in runs[0]:
        if impl != "multiproc":
            continue
        ms, ts, ratios = [], [], []
        for results in runs:
            f, t = results[(scenario, nbytes, "multiproc")], results[(scenario, nbytes, "torch")]
            if scenario == "ping":
                m, tv, unit = f["us_per_roundtrip"], t["us_per_roundtrip"], "µs/round trip"
                ratio = tv / m
            elif scenario == "spawn":
                m, tv, unit = f["ms"], t["ms"], "ms"
                ratio = tv / m
            else:
                m, tv, unit = f["per_s"], t["per_s"], "tensors/s"
                ratio = m / tv
            ms.append(m)
            ts.append(tv)
            ratios.append(ratio)
        label = size(nbytes) if nbytes else "4 workers"
        print(f"| {scenario} | {label} | {median(ms):,.1f} {unit} | {median(ts):,.1f} {unit} "
              f"| {median(ratios):.1f}x ({min(ratios):.1f}–{max(ratios):.1f}) |")


if __name__ == "__main__":
    main()
