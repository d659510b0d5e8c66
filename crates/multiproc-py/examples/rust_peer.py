#!/usr/bin/env python3
"""Python and Rust on the same queues: starts the Rust example ``python_peer`` with two
queues sealed into fds, sends it a message with tensors, and prints its answers.

    cargo build -p multiproc --example python_peer
    python3 crates/multiproc-py/examples/rust_peer.py target/debug/examples/python_peer
"""

import subprocess
import sys

import multiproc as mp

to_rust, to_python = mp.Queue(), mp.Queue()
fd_in, parcel_in = mp.parcel_for_child(to_rust)
fd_out, parcel_out = mp.parcel_for_child(to_python)
peer = subprocess.Popen([sys.argv[1], str(fd_in), str(fd_out)], pass_fds=[fd_in, fd_out])
parcel_in.close()
parcel_out.close()

batch = mp.zeros(2, 3)
to_rust.put({"step": 1, "batch": batch, "note": "from Python", "extra": {1, 2}})
kind, echoed, total, made = to_python.get(timeout=60)
print("Rust answered:", kind, echoed, "sum before:", total)
print("the batch after Rust's in-place +1 (shared memory):", batch)
print("a tensor Rust made:", made)
to_rust.put(None)
print("last word:", to_python.get(timeout=60), "exit code:", peer.wait())
