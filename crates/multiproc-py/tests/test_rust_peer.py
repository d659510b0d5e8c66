"""Python and Rust through the same queues: the Rust example `python_peer` takes
``Queue<multiproc::Dynamic>`` from sealed fds, answers every message, writes the
tensors it received in place, and sends tensors it made."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import multiproc as mp

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(scope="module")
def peer_binary():
    """The example, built with cargo (a no-op when .ci/run's tests built it)."""
    path = os.environ.get("MULTIPROC_PYTHON_PEER")
    if not path:
        subprocess.run(["cargo", "build", "-q", "-p", "multiproc", "--example", "python_peer"],
                       cwd=REPO, check=True, timeout=900)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
        path = os.path.join(target, "debug", "examples", "python_peer")
    assert os.access(path, os.X_OK), f"no python_peer binary at {path}"
    return path


def start(peer_binary):
    to_rust, to_python = mp.Queue(), mp.Queue()
    fd_in, parcel_in = mp.parcel_for_child(to_rust)
    fd_out, parcel_out = mp.parcel_for_child(to_python)
    proc = subprocess.Popen([peer_binary, str(fd_in), str(fd_out)], pass_fds=[fd_in, fd_out])
    parcel_in.close()
    parcel_out.close()
    return proc, to_rust, to_python


def test_python_and_rust_exchange_messages_both_ways(peer_binary):
    proc, to_rust, to_python = start(peer_binary)
    try:
        batch = mp.full((4, 8), 2.0)
        view = batch[1:3, ::2]
        plain = np.arange(6, dtype=np.int64).reshape(2, 3)
        msg = {"step": 1, "batch": batch, "view": view, "label": "cat", "raw": b"\x00\x01",
               "nested": [1.5, None, (True, -7)], "set": {1, 2}, "np": plain}
        to_rust.put(msg)
        kind, echoed, total, made = to_python.get(timeout=60)
        assert kind == "seen"
        # Everything came back as it went (the set by pickle, untouched by Rust).
        assert echoed["step"] == 1 and echoed["label"] == "cat" and echoed["raw"] == b"\x00\x01"
        assert echoed["nested"] == [1.5, None, (True, -7)] and echoed["set"] == {1, 2}
        assert total == 2.0 * 32 + 2.0 * 8 + plain.sum()
        # Rust wrote the shared blocks in place: the Python tensors see it.
        assert torch.equal(batch[0], torch.full((8,), 3.0))
        assert torch.equal(batch[1, ::2], torch.full((4,), 4.0))  # in the view too
        assert echoed["batch"].data_ptr() == batch.data_ptr()
        assert echoed["view"].stride() == view.stride()
        assert echoed["view"].storage_offset() == view.storage_offset()
        # A tensor Rust made arrives as a torch.Tensor over its block.
        assert isinstance(made, torch.Tensor) and made.dtype == torch.float32
        assert torch.equal(made, torch.full((2, 2), 1.0))
        to_rust.put(None)
        # The peer exits right after its last put; the answer is there all the same.
        assert proc.wait(timeout=60) == 0
        assert to_python.get(timeout=10) == ("bye", 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_many_messages(peer_binary):
    proc, to_rust, to_python = start(peer_binary)
    try:
        for i in range(200):
            to_rust.put((i, mp.full((16,), float(i))))
        for i in range(200):
            kind, (j, t), total, made = to_python.get(timeout=60)
            assert j == i and total == 16.0 * i and t[0].item() == i + 1
            assert made[0, 0].item() == i + 1
        to_rust.put(None)
        assert proc.wait(timeout=60) == 0
        assert to_python.get(timeout=10) == ("bye", 200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
