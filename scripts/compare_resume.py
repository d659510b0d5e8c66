#!/usr/bin/env python3
"""What resumability costs per batch: multiproc's DataLoader beside torch's DataLoader and
torchdata's StatefulDataLoader, on the same synthetic data, in one run.

The data: 8,192 samples of a 3 x 32 x 32 float32 image filled with its index and its
index as label, batches of 64, shuffled, 2 persistent worker processes; one warm-up epoch,
then 3 timed epochs. For each loader: microseconds per batch without snapshots, and with
`state_dict()` taken after every batch (torchdata's snapshots are what issue
meta-pytorch/data#1317 measured at 10 ms -> 2 s per iteration); then the cost of one
`state_dict()` mid-epoch. The Rust side is the `dataloader_resume_cost` example. torch and
torchdata are optional (`pip install torch torchdata`); without them only multiproc's
figures are printed. Not part of CI.

    python3 scripts/compare_resume.py
"""

import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES, BATCH, WORKERS, EPOCHS = 8192, 64, 2, 3


def run_multiproc():
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "multiproc",
         "--example", "dataloader_resume_cost"],
        cwd=ROOT, check=True)
    exe = os.path.join(ROOT, "target", "release", "examples", "dataloader_resume_cost")
    print(subprocess.run([exe], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout)


def run_torch():
    import torch
    from torch.utils.data import DataLoader, Dataset

    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        StatefulDataLoader = None

    class Images(Dataset):
        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return torch.full((3, 32, 32), float(i)), i

    def make(cls):
        return cls(Images(), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                   persistent_workers=True, generator=torch.Generator().manual_seed(1))

    def per_batch(loader, snapshot):
        for _ in loader:
            pass
        batches, start = 0, time.perf_counter()
        for _ in range(EPOCHS):
            for x, _ in loader:
                x.numel()
                if snapshot:
                    loader.state_dict()
                batches += 1
        return (time.perf_counter() - start) / batches * 1e6

    def state_alone(loader):
        it = iter(loader)
        for _ in range(40):
            next(it)
        n = 200
        start = time.perf_counter()
        for _ in range(n):
            loader.state_dict()
        return (time.perf_counter() - start) / n * 1e6

    print(f"torch {torch.__version__}: {BATCH} x 3x32x32 f32 batches, {WORKERS} workers, "
          f"{EPOCHS} epochs of {SAMPLES // BATCH} batches")
    print(f"{'loader':>20} {'plain us/b':>12} {'+state us/b':>12} {'state us':>10}")
    print(f"{'DataLoader':>20} {per_batch(make(DataLoader), False):>12.1f} {'-':>12} {'-':>10}")
    if StatefulDataLoader is None:
        print("torchdata is not installed: no StatefulDataLoader row")
        return
    plain = per_batch(make(StatefulDataLoader), False)
    snap = per_batch(make(StatefulDataLoader), True)
    alone = state_alone(make(StatefulDataLoader))
    print(f"{'StatefulDataLoader':>20} {plain:>12.1f} {snap:>12.1f} {alone:>10.1f}")
    print(f"{'':>20} state_dict per batch = {alone / plain * 100:.2f}% of a batch's time")


def main():
    run_multiproc()
    try:
        run_torch()
    except ImportError:
        print("torch is not installed (pip install torch torchdata): multiproc's figures only")


if __name__ == "__main__":
    main()
