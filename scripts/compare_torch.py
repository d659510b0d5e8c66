#!/usr/bin/env python3
"""Side-by-side figures: multiproc, torch.multiprocessing and the raw floor, in one run.

    python3 scripts/compare_torch.py [--scale 0.2] [--torch-python PATH]

Runs `multiproc bench --json` and `multiproc bench-floor --json` (release build), then
the same scenarios in torch.multiprocessing (spawn context, file_descriptor strategy)
when torch can be imported, and prints one table with the ratios multiproc/torch and
multiproc/floor. `ping` has two floors: the SEQPACKET + SCM_RIGHTS round trip (the
"floor" column) and the futex round trip over one shared word ("futex"); the spinning
round trip (no system call) is printed below the table. torch is optional:
`pip install torch` (CPU is enough). Keep it out of CI. Ratios, not absolute figures,
are what to compare: the machine is shared.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# As `multiproc bench`, but a tenth of its 200,000 4 KiB and small tensors: torch takes
# a hundred times longer per tensor, and 20,000 of them already run for seconds.
FRESH = [(4 << 10, 20000), (1 << 20, 500), (64 << 20, 40), (256 << 20, 40)]


def run_json(args):
    out = subprocess.run(args, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def multiproc_figures(scale):
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "multiproc-cli"], cwd=ROOT, check=True)
    exe = os.path.join(ROOT, "target", "release", "multiproc")
    return (run_json([exe, "bench", "--json", "--scale", str(scale)]),
            run_json([exe, "bench-floor", "--json", "--scale", str(scale)]))


# ---- torch.multiprocessing, the same scenarios -------------------------------------

TORCH_CODE = r'''
import json, sys, time
import torch, torch.multiprocessing as mp

def producer(q, floats, count, done):
    q.put("ready")
    for i in range(count):
        t = torch.empty(floats, dtype=torch.float32)
        t.fill_(i % 7)
        q.put(t)
    done.wait()  # torch: the producer must outlive the consumer's use of its tensors

def ponger(inbox, outbox, count, done):
    outbox.put("ready")
    for _ in range(count):
        outbox.put(inbox.get())
    done.wait()  # the same trap: the parent's last get needs this process alive

def noop(rank):
    pass

def fresh(ctx, nbytes, count, scenario):
    q, done = ctx.Queue(4), ctx.Event()
    p = ctx.Process(target=producer, args=(q, nbytes // 4, count, done)); p.start()
    assert q.get() == "ready"
    start = time.perf_counter(); total = 0.0
    for _ in range(count):
        total += float(q.get().sum())
    s = time.perf_counter() - start
    done.set(); p.join()
    return dict(scenario=scenario, strategy="file_descriptor", bytes=nbytes, count=count,
                per_s=count / s, GB_s=nbytes * count / s / 1e9, seconds=s, impl="torch")

def ping(ctx, nbytes, count):
    there, back, done = ctx.Queue(4), ctx.Queue(4), ctx.Event()
    p = ctx.Process(target=ponger, args=(there, back, count, done)); p.start()
    assert back.get() == "ready"
    t = torch.zeros(nbytes // 4); t.share_memory_()
    start = time.perf_counter()
    for _ in range(count):
        there.put(t); t = back.get()
    s = time.perf_counter() - start
    done.set(); p.join()
    return dict(scenario="ping", strategy="file_descriptor", bytes=nbytes, count=count,
                per_s=count / s, us_per_roundtrip=s * 1e6 / count, seconds=s, impl="torch")

if __name__ == "__main__":
    scale = float(sys.argv[1])
    n = lambda c: max(2, round(c * scale))
    mp.set_sharing_strategy("file_descriptor")
    ctx = mp.get_context("spawn")
    for nbytes, count in FRESH:
        print(json.dumps(fresh(ctx, nbytes, n(count), "fresh")), flush=True)
    print(json.dumps(fresh(ctx, 256, n(20000), "small")), flush=True)
    for nbytes in (4 << 10, 64 << 20):
        print(json.dumps(ping(ctx, nbytes, n(2000))), flush=True)
    runs = []
    for _ in range(max(1, n(3))):
        start = time.perf_counter(); mp.spawn(noop, nprocs=4, join=True); runs.append(time.perf_counter() - start)
    runs.sort()
    print(json.dumps(dict(scenario="spawn", count=4, seconds=runs[len(runs) // 2], impl="torch")), flush=True)
'''


def torch_figures(python, scale):
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        print("torch is not installed for %s: `%s -m pip install torch` (CPU is enough) "
              "to include it; showing multiproc and the floor only." % (python, python), file=sys.stderr)
        return []
    path = os.path.join(ROOT, "target", "compare_torch_worker.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("FRESH = %r\n" % (FRESH,) + TORCH_CODE)
    return run_json([python, path, str(scale)])


# ---- the table ----------------------------------------------------------------------

def key(f):
    return (f["scenario"], f.get("strategy"), f.get("bytes"))


def value(f):
    """The figure that scenario is judged by, and whether higher is better."""
    if f["scenario"] == "ping":
        return f["us_per_roundtrip"], False
    if f["scenario"] in ("spawn", "disconnect"):
        return f["seconds"] * 1e3, False
    return f["per_s"], True


def size(b):
    if b is None:
        return "-"
    if b == 0:
        return "a number"  # multiproc's ping of a message without a tensor
    return "%d MiB" % (b >> 20) if b >= 1 << 20 else "%d KiB" % (b >> 10) if b >= 1 << 10 else "%d B" % b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="scale every count (0.1 for a quick look)")
    ap.add_argument("--torch-python", default=sys.executable, help="the python that has torch")
    args = ap.parse_args()

    mine, floor = multiproc_figures(args.scale)
    torch = {key(f): f for f in torch_figures(args.torch_python, args.scale)}
    round_trip = {f["scenario"]: f["us_per_roundtrip"] for f in floor if "us_per_roundtrip" in f}
    floor_ping, futex_ping = round_trip.get("ping"), round_trip.get("futex-ping")
    floor_fill = {f["bytes"]: f for f in floor if f["scenario"] == "fill+sum"}

    print("%-6s %-16s %8s  %14s %14s %9s %14s %9s %8s %9s" % (
        "scen.", "strategy", "size", "multiproc", "torch", "mp/torch", "floor", "mp/floor",
        "futex", "mp/futex"))
    for f in mine:
        v, higher = value(f)
        unit = "us/rt" if f["scenario"] == "ping" else "ms" if f["scenario"] in ("spawn", "disconnect") else "/s"
        t = torch.get((f["scenario"], "file_descriptor" if f.get("strategy") else None, f.get("bytes")))
        tv = value(t)[0] if t else None
        fx = None
        if f["scenario"] == "ping":
            fl, fx = floor_ping, futex_ping
        elif f["scenario"] in ("fresh", "small") and f.get("bytes") in floor_fill:
            fl = floor_fill[f["bytes"]]["per_s"]
        else:
            fl = None
        ratio = lambda a, b: "-" if not b else "%.2fx" % ((a / b) if higher else (b / a))
        print("%-6s %-16s %8s  %8.1f %-5s %14s %9s %14s %9s %8s %9s" % (
            f["scenario"], f.get("strategy") or "-", size(f.get("bytes")), v, unit,
            "-" if tv is None else "%.1f" % tv, ratio(v, tv), "-" if fl is None else "%.1f" % fl,
            ratio(v, fl), "-" if fx is None else "%.1f" % fx, ratio(v, fx)))
    print("\nratios: >1 means multiproc is better (faster, or lower latency).")
    print("round-trip floors of this run (us): %s" % ", ".join(
        "%s %.2f" % (name, round_trip[scen]) for name, scen in (
            ("SEQPACKET+SCM_RIGHTS", "ping"), ("futex", "futex-ping"), ("spin", "spin-ping"))
        if scen in round_trip))
    print("(spin needs two free cores: on a loaded machine each hop waits for a scheduler tick)")
    print("date: %s; machine: %s, %d cores" % (time.strftime("%Y-%m-%d"), os.uname().machine, os.cpu_count()))


if __name__ == "__main__":
    main()
