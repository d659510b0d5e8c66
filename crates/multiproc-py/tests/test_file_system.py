"""The file_system strategy from Python: blocks are files in /dev/shm that cross by
name, the tree's shm manager is started (by the library, running this interpreter on
the manager's entry point), and nothing of the tree is left
in /dev/shm once it ends. Each tree is a program of its own (``fs_tree.py``), the root
of a fresh tree, so that its end can be watched from here."""

import json
import os
import subprocess
import sys
import time

import pytest

import multiproc as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def manager_running(addr):
    """Whether a process of the tree at ``addr`` is left: one that names the address in
    its command line or in its environment (the manager the library started, and any
    other member of the tree)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if addr.encode() in cmd + env:
                return True
    return False


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_tensors_cross_by_name_and_the_tree_leaves_nothing(method):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MULTIPROC_SHM_MANAGER", "MULTIPROC_SHARING_STRATEGY")}
    env["MULTIPROC_SHM_MANAGER_GRACE_MS"] = "200"
    done = subprocess.run([sys.executable, os.path.join(HERE, "fs_tree.py"), method],
                          env=env, cwd=HERE, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout.strip().splitlines()[-1])
    assert tree["names"] > 0  # the root's blocks were files in /dev/shm
    deadline = time.monotonic() + 30
    while True:
        left = [n for n, _, t in mp.shm_segments() if t is not None and t[0] == tree["root"]]
        running = manager_running(tree["addr"])
        if not left and not running:
            break
        assert time.monotonic() < deadline, (
            f"after the tree ended: {left} in /dev/shm, manager running: {running}")
        time.sleep(0.05)


def test_a_killed_manager_is_started_again():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MULTIPROC_SHM_MANAGER", "MULTIPROC_SHARING_STRATEGY")}
    env["MULTIPROC_SHM_MANAGER_GRACE_MS"] = "200"
    done = subprocess.run([sys.executable, os.path.join(HERE, "fs_restart.py")],
                          env=env, cwd=HERE, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout.strip().splitlines()[-1])
    assert tree["killed"], tree
    deadline = time.monotonic() + 30
    while manager_running(tree["addr"]):
        assert time.monotonic() < deadline, "a manager outlived its tree"
        time.sleep(0.05)
