#!/usr/bin/env python3
"""Rust decodes, PyTorch trains: the Rust example ``png_feeder`` (a
``multiproc::data::DataLoader`` whose worker processes decode PNG files into shared
batch tensors) feeds this training loop through one multiproc queue, by handle. With
``--mode both`` the same loop also runs on ``torch.utils.data.DataLoader`` (PIL decode,
the same files, the same number of workers), and the batches/s of both are printed.

    cargo build --release -p multiproc --features image --example png_feeder
    pip install ./crates/multiproc-py torch pillow numpy
    python3 crates/multiproc-py/examples/train_from_rust.py --mode both

Or the Rust side starts this trainer: ``png_feeder --dir DIR --trainer python3
crates/multiproc-py/examples/train_from_rust.py`` runs it with ``--queue-fd FD --classes N``
(the queue sealed into an fd it inherits), and it trains on what arrives.

Without ``--dir`` it writes 512 PNG images (224 x 224, two classes) into a temporary
directory first. Throughput is counted from the first batch to the last, over
``--epochs`` passes (the workers' start-up is not counted, for either loader).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import multiproc as mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def write_images(folder, count, side=224):
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side]
    for i in range(count):
        label = i % 2
        os.makedirs(os.path.join(folder, f"class{label}"), exist_ok=True)
        base = ((x * (label + 1) + y * (2 - label) + i * 7) % 224).astype(np.uint8)
        img = np.stack([base, base[::-1], base.T], axis=-1)
        img = img + rng.integers(0, 32, img.shape, dtype=np.uint8)
        Image.fromarray(img).save(os.path.join(folder, f"class{label}", f"{i:05}.png"))


def model_and_step(classes, train=True):
    if not train:
        # Loader throughput alone: touch the batch as a trainer would, no model.
        return lambda images, labels: float(images[0].float().mean()) + float(labels.sum())
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, kernel_size=8, stride=8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, classes))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def step(images, labels):
        x = images.float().div_(255.0)
        loss = torch.nn.functional.cross_entropy(net(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def train_rust(feeder, folder, workers, batch_size, epochs, classes, train, queue_fd=None):
    """Trains on the batches the Rust feeder puts on a queue: a feeder started here, or
    (``queue_fd``) the one that started this process."""
    step = model_and_step(classes, train)
    if queue_fd is None:
        batches = mp.Queue(maxsize=2 * max(1, workers))
        fd, parcel = mp.parcel_for_child(batches)
        proc = subprocess.Popen(
            [feeder, "--dir", folder, "--queue", str(fd), "--workers", str(workers),
             "--batch-size", str(batch_size), "--epochs", str(epochs)], pass_fds=[fd])
        parcel.close()
    else:
        batches, proc = mp.open_parcel(queue_fd, mp.Queue), None
    n, received, loss, start = 0, 0, None, None
    try:
        while True:
            msg = batches.get(timeout=300)
            if msg[0] == "done":
                assert msg[1] == received, (msg, received)
                break
            _, images, labels = msg
            received += 1
            if start is None:
                start = time.perf_counter()
            else:
                n += 1  # the first batch starts the clock
            loss = step(images, labels)
        seconds = time.perf_counter() - start
        assert proc is None or proc.wait(timeout=60) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    return dict(loader="multiproc (Rust)", workers=workers, batches=n,
                batches_per_s=n / seconds, final_loss=loss)


class PngFolder(torch.utils.data.Dataset):
    def __init__(self, folder):
        classes = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
        self.files = [(os.path.join(folder, c, f), i) for i, c in enumerate(classes)
                      for f in sorted(os.listdir(os.path.join(folder, c))) if f.endswith(".png")]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        from PIL import Image

        path, label = self.files[i]
        with Image.open(path) as im:
            img = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        return img, label


def train_torch(folder, workers, batch_size, epochs, classes, train):
    step = model_and_step(classes, train)
    loader = torch.utils.data.DataLoader(
        PngFolder(folder), batch_size=batch_size, drop_last=True, num_workers=workers,
        persistent_workers=workers > 0)
    n, loss, start = 0, None, None
    for _ in range(epochs):
        for images, labels in loader:
            if start is None:
                start = time.perf_counter()
            else:
                n += 1
            loss = step(images, labels)
    seconds = time.perf_counter() - start
    return dict(loader="torch DataLoader (PIL)", workers=workers, batches=n,
                batches_per_s=n / seconds, final_loss=loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="PNG files, one subdirectory per class")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--mode", choices=["rust", "torch", "both"], default="rust")
    ap.add_argument("--feeder", default=os.path.join(ROOT, "target", "release", "examples",
                                                     "png_feeder"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--queue-fd", type=int,
                    help="train on the queue in this inherited fd (png_feeder --trainer)")
    ap.add_argument("--classes", type=int, default=2, help="with --queue-fd: the classes")
    ap.add_argument("--no-train", dest="train", action="store_false",
                    help="no model: the loaders' throughput alone")
    args = ap.parse_args()
    if args.queue_fd is not None:
        r = train_rust(None, None, 0, 0, 0, args.classes, args.train, queue_fd=args.queue_fd)
        print(f"trainer started by Rust: {r['batches']} batches, "
              f"{r['batches_per_s']:.2f} batches/s, last step {r['final_loss']:.3f}")
        return
    folder, temporary = args.dir, False
    if folder is None:
        folder, temporary = tempfile.mkdtemp(prefix="multiproc-png-"), True
        write_images(folder, args.images)
    try:
        classes = len([d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))])
        rows = []
        if args.mode in ("rust", "both"):
            if not os.access(args.feeder, os.X_OK):
                sys.exit(f"no feeder at {args.feeder}: cargo build --release -p multiproc "
                         "--features image --example png_feeder")
            rows.append(train_rust(args.feeder, folder, args.workers, args.batch_size,
                                   args.epochs, max(classes, 1), args.train))
        if args.mode in ("torch", "both"):
            rows.append(train_torch(folder, args.workers, args.batch_size, args.epochs,
                                    max(classes, 1), args.train))
        for r in rows:
            if args.json:
                print(json.dumps(r))
            else:
                print(f"{r['loader']:>24}: {r['workers']} workers, {r['batches']} batches, "
                      f"{r['batches_per_s']:.2f} batches/s, last step {r['final_loss']:.3f}")
        if len(rows) == 2 and not args.json:
            print(f"{'ratio':>24}: {rows[0]['batches_per_s'] / rows[1]['batches_per_s']:.2f}x")
    finally:
        if temporary:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
