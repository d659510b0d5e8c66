#!/usr/bin/env python3
"""all_reduce of a 64 MiB f32 tensor across 2 local ranks: torch.distributed's gloo
beside `multiproc bench --collectives` (and its memcpy floor), in one run.

    cargo build --release -p multiproc-cli && python3 scripts/compare_gloo.py

Needs torch (`pip install torch`); not run in CI.
"""
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BYTES = 64 << 20
COUNT = 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.ones(BYTES // 4, dtype=torch.float32)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(COUNT):
        dist.all_reduce(t)
    dist.barrier()
    if rank == 0:
        out.put(time.perf_counter() - start)
    dist.destroy_process_group()


def main():
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(rank_main, args=(2, free_port(), out), nprocs=2)
    seconds = out.get()
    gloo = BYTES * COUNT / seconds / 1e9
    exe = os.path.join(os.path.dirname(__file__), "..", "target", "release", "multiproc")
    lines = subprocess.run(
        [exe, "bench", "--collectives", "--json"], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    figures = {f["scenario"]: f for f in map(json.loads, lines)}
    ours, floor = figures["allreduce"]["GB_s"], figures["memcpy"]["GB_s"]
    print(f"torch {torch.__version__} gloo all_reduce 64 MiB f32, 2 ranks: {gloo:6.2f} GB/s")
    print(f"multiproc all_reduce_  64 MiB f32, 2 ranks: {ours:6.2f} GB/s")
    print(f"memcpy 64 MiB floor:                      {floor:6.2f} GB/s")
    print(f"multiproc / gloo: {ours / gloo:.2f}x   multiproc / floor: {ours / floor:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
