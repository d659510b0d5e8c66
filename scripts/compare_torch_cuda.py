#!/usr/bin/env python3
"""torch.multiprocessing's CUDA sharing, the scenarios of multiproc's `cuda_bench`, side by side.

    python3 scripts/compare_torch_cuda.py [--multiproc-json FILE] [--scale 1.0]

Runs, on cuda:0 with the spawn start method, for 4 KiB, 64 MiB and 1 GiB:

- cuda_fresh: the parent makes `torch.zeros(n, dtype=uint8, device="cuda")` and puts it;
  a child gets it, reads `x[0].item()`, deletes it and acknowledges;
- cuda_ping: the parent puts one CUDA tensor, the child gets it and acknowledges with a
  small message (torch forbids sending a received CUDA tensor on, so this is one way
  plus an ack, where multiproc's ping sends the tensor itself back);
- d2d_copy: `dst.copy_(src)` then `torch.cuda.synchronize()` (the device's floor);
- h2d_pinned, h2d_pageable (64 MiB): `x.to("cuda")` then `torch.cuda.synchronize()`,
  from a tensor made with `pin_memory()` or from ordinary (pageable) host memory. The
  best case for torch: its DataLoader first copies each batch out of shared memory into
  pinned memory (the pin-memory thread), which is not timed here; multiproc's figures
  are from the received batch itself.

Prints one JSON object per line (`impl` = torch). With --multiproc-json (the output of
`cuda_bench --json` from the same machine, same run), also prints a table of both and
the ratio torch / multiproc of the time per operation (above 1: multiproc is faster).
"""
import argparse
import json
import sys
import time

SIZES = [(4 << 10, 2000), (64 << 20, 200), (1 << 30, 20)]
BUDGET = 4.0


def consumer(q, acks):
    import torch
    i = 0
    while True:
        x = q.get()
        if x is None:
            break
        first = int(x[0].item())
        del x
        acks.put(first + i)
        i += 1


def ponger(q, acks):
    while True:
        x = q.get()
        if x is None:
            break
        del x
        acks.put(1)


def timed(count, warm, step):
    for i in range(warm):
        step(i)
    start = time.perf_counter()
    done = 0
    while done < count and (done == 0 or time.perf_counter() - start < BUDGET):
        step(warm + done)
        done += 1
    return done, time.perf_counter() - start


def figure(scenario, nbytes, count, seconds):
    per = seconds / count
    return {
        "scenario": scenario,
        "strategy": "torch_cuda_ipc",
        "bytes": nbytes,
        "count": count,
        "per_s": round(1.0 / per, 1),
        "GB_s": round(nbytes / per / 1e9, 3),
        "us_per_roundtrip": round(per * 1e6, 2),
        "seconds": round(seconds, 4),
        "impl": "torch",
    }


def torch_figures(scale):
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = []
    count_of = lambda c: max(3, int(c * scale))

    q, acks = ctx.Queue(), ctx.Queue()
    # Daemonic, so that a failed assertion here ends the run instead of waiting on them.
    p = ctx.Process(target=consumer, args=(q, acks), daemon=True)
    p.start()
    sent = [0]  # the consumer counts across sizes, so the expected ack does too
    for nbytes, count in SIZES:
        def step(_):
            x = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
            q.put(x)
            ack = acks.get(timeout=30)
            assert ack == sent[0], (ack, sent[0])
            sent[0] += 1
        done, seconds = timed(count_of(count), 3, step)
        out.append(figure("cuda_fresh", nbytes, done, seconds))
    q.put(None)
    p.join()

    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=ponger, args=(q, acks), daemon=True)
    p.start()
    for nbytes, count in SIZES:
        x = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

        def step(_):
            q.put(x)
            acks.get(timeout=30)
        done, seconds = timed(count_of(count * 2), 3, step)
        out.append(figure("cuda_ping", nbytes, done, seconds))
    q.put(None)
    p.join()  # torch: the producer must outlive the consumer's use of its tensors

    for nbytes, count in SIZES:
        src = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def step(_):
            dst.copy_(src)
            torch.cuda.synchronize()
        done, seconds = timed(count_of(count * 2), 3, step)
        out.append(figure("d2d_copy", nbytes, done, seconds))

    nbytes = 64 << 20
    for scenario, host in [
        ("h2d_pinned", torch.ones(nbytes, dtype=torch.uint8).pin_memory()),
        ("h2d_pageable", torch.ones(nbytes, dtype=torch.uint8)),
    ]:
        def step(_):
            y = host.to("cuda")
            torch.cuda.synchronize()
            del y
        done, seconds = timed(count_of(20), 2, step)
        out.append(figure(scenario, nbytes, done, seconds))
    return out


def human(n):
    if n >= 1 << 30:
        return f"{n >> 30} GiB"
    if n >= 1 << 20:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--multiproc-json", help="cuda_bench --json output of this run")
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is not installed: no torch figures", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("torch sees no CUDA device: no torch figures", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    theirs = torch_figures(args.scale)
    for f in theirs:
        print(json.dumps(f), flush=True)
    if not args.multiproc_json:
        return 0
    ours = {}
    with open(args.multiproc_json) as fh:
        for line in fh:
            if line.startswith("{"):
                f = json.loads(line)
                ours[(f["scenario"], f["bytes"])] = f
    print()
    print(f"{'scenario':<12} {'size':>7} {'multiproc us':>13} {'GB/s':>8} {'torch us':>11} {'GB/s':>8} {'torch/multiproc':>16}")
    for t in theirs:
        m = ours.get((t["scenario"], t["bytes"]))
        if m is None:
            continue
        ratio = t["us_per_roundtrip"] / m["us_per_roundtrip"] if m["us_per_roundtrip"] else float("nan")
        print(f"{t['scenario']:<12} {human(t['bytes']):>7} {m['us_per_roundtrip']:>13.1f} {m['GB_s']:>8.2f} "
              f"{t['us_per_roundtrip']:>11.1f} {t['GB_s']:>8.2f} {ratio:>15.2f}x")
    print("(cuda_ping: multiproc sends the tensor there and back; torch one way plus an ack,"
          " since it cannot send a received CUDA tensor on)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
