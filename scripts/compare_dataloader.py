#!/usr/bin/env python3
"""multiproc's DataLoader beside torch's, on the same PNG files, in one run.

Batches/s of 64 x 3 x 224 x 224 uint8 images decoded from PNG, with 0, 1 and 2 worker
processes. The Rust side is the `dataloader_bench` example (feature `image`), which
writes the PNG files into a temporary directory; torch's DataLoader then loads the same
files (PIL decode, `permute` to CHW, torch's default collate, which stacks into shared
memory in workers, as multiproc's does). Both run one warm-up epoch with persistent
workers, then the same number of timed epochs; settings alternate between the two so
that both see the same machine load. torch is optional (`pip install torch pillow`);
without it only multiproc's figures are printed. Not part of CI.

    python3 scripts/compare_dataloader.py [--images 512] [--epochs 3] [--workers 0,1,2]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_bench():
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "multiproc", "--features", "image",
         "--example", "dataloader_bench"],
        cwd=ROOT, check=True)
    return os.path.join(ROOT, "target", "release", "examples", "dataloader_bench")


def run_multiproc(bench, folder, images, workers, batch_size, epochs):
    """Batches/s with `workers` workers, or decoding alone when `workers` is None."""
    mode = ["--decode-only"] if workers is None else ["--workers", str(workers)]
    out = subprocess.run(
        [bench, "--dir", folder, "--images", str(images), "--batch-size", str(batch_size),
         "--epochs", str(epochs), "--json"] + mode,
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return row["batches_per_s"]


def run_torch(folder, workers, batch_size, epochs):
    """Batches/s with `workers` workers, or decoding alone when `workers` is None."""
    import numpy as np
    import torch
    from PIL import Image

    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".png"))

    class Folder(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            with Image.open(files[i]) as im:
                hwc = np.array(im.convert("RGB"))
            return torch.from_numpy(hwc).permute(2, 0, 1), 0

    if workers is None:
        ds = Folder()
        start = time.perf_counter()
        for _ in range(epochs):
            for i in range(len(ds)):
                image, label = ds[i]
                image.numel() + label
        return len(ds) * epochs / batch_size / (time.perf_counter() - start)

    loader = torch.utils.data.DataLoader(
        Folder(), batch_size=batch_size, num_workers=workers, drop_last=True,
        persistent_workers=workers > 0)
    for _ in loader:  # warm-up: workers start, page cache fills
        pass
    start = time.perf_counter()
    batches = 0
    for _ in range(epochs):
        for images, labels in loader:
            assert tuple(images.shape) == (batch_size, 3, 224, 224)
            float(images[0].sum()) + float(labels.sum())
            batches += 1
    secs = time.perf_counter() - start
    del loader
    return batches / secs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", default="0,1,2")
    args = p.parse_args()
    try:
        import torch  # noqa: F401
        import PIL  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
        print("torch or pillow is not installed: multiproc only", file=sys.stderr)

    bench = build_bench()
    folder = tempfile.mkdtemp(prefix="multiproc-compare-dataloader-")
    try:
        rows = []
        for w in [None] + [int(x) for x in args.workers.split(",")]:
            ours = run_multiproc(bench, folder, args.images, w, args.batch_size, args.epochs)
            theirs = run_torch(folder, w, args.batch_size, args.epochs) if have_torch else None
            rows.append((w, ours, theirs))
        version = f"torch {__import__('torch').__version__}" if have_torch else "no torch"
        print(f"{args.batch_size}x3x224x224 u8 from {args.images} PNG files, "
              f"{args.epochs} timed epochs, {os.cpu_count()} CPUs, {version}")
        print(f"{'workers':>7} {'multiproc b/s':>14} {'torch b/s':>10} {'ratio':>6}")
        for w, ours, theirs in rows:
            t = f"{theirs:10.2f}" if theirs else f"{'-':>10}"
            r = f"{ours / theirs:5.2f}x" if theirs else f"{'-':>6}"
            label = "decode" if w is None else str(w)
            print(f"{label:>7} {ours:14.2f} {t} {r}")
        print("decode: each side's decoder alone in one process (no loader), in batches/s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
