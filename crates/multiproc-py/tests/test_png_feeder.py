"""Rust decodes, Python trains, through one queue, started from either side: the Rust
example `png_feeder` (a `multiproc::data::DataLoader` decoding PNG files in worker
processes) and `examples/train_from_rust.py`. The same files through torch's
DataLoader (PIL) give the same batches: the same final loss, step for step."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TRAINER = os.path.join(REPO, "crates", "multiproc-py", "examples", "train_from_rust.py")


@pytest.fixture(scope="module")
def feeder():
    # The features .ci/run's data tests build the library with (.ci/run removes its Rust
    # builds before the Python step to make room for torch, so there this builds again).
    subprocess.run(["cargo", "build", "-q", "-p", "multiproc", "--features", "image,progress",
                    "--example", "png_feeder"], cwd=REPO, check=True, timeout=900)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
    path = os.path.join(target, "debug", "examples", "png_feeder")
    assert os.access(path, os.X_OK), path
    return path


@pytest.fixture
def pngs(tmp_path):
    sys.path.insert(0, os.path.dirname(TRAINER))
    try:
        import train_from_rust
    finally:
        sys.path.pop(0)
    train_from_rust.write_images(str(tmp_path), 24, side=32)
    return str(tmp_path)


def test_python_starts_the_rust_feeder_and_matches_torchs_loader(feeder, pngs):
    out = subprocess.run(
        [sys.executable, TRAINER, "--dir", pngs, "--mode", "both", "--workers", "2",
         "--batch-size", "4", "--epochs", "2", "--feeder", feeder, "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rust, torch_row = [json.loads(line) for line in out.stdout.splitlines()]
    assert rust["batches"] == torch_row["batches"] == 11  # 12 batches, the first starts the clock
    # The same images and labels in the same order: the same training, step for step.
    assert rust["final_loss"] == pytest.approx(torch_row["final_loss"], rel=1e-5)


def test_the_rust_feeder_starts_the_python_trainer(feeder, pngs):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    out = subprocess.run(
        [feeder, "--dir", pngs, "--workers", "2", "--batch-size", "4", "--epochs", "1",
         "--trainer", sys.executable, TRAINER],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "trainer started by Rust: 5 batches" in out.stdout, out.stdout
