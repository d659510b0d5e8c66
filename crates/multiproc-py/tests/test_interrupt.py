"""Ctrl-C in the parent: a blocking wait raises KeyboardInterrupt, and no worker and
no segment is left behind."""

import contextlib
import os
import signal
import subprocess
import select
import sys

import pytest

HERE = os.path.dirname(__file__)


@contextlib.contextmanager
def start(mode):
    """The parent script in a process group of its own; whatever the test's outcome,
    the group is gone afterwards."""
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "interrupt_parent.py"), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        yield p
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()


def test_ctrl_c_interrupts_a_blocking_get():
    with start("get") as p:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=30)
        assert p.returncode != 0 and "KeyboardInterrupt" in err


@pytest.mark.parametrize("whole_group", [False, True], ids=["parent", "process-group"])
def test_ctrl_c_in_spawn_leaves_no_worker(whole_group):
    with start("spawn") as p:
        lines = [p.stdout.readline() for _ in range(2)]
        assert all(line.strip().isdigit() for line in lines), lines
        pids = [int(line) for line in lines]
        # pidfds, taken while the workers surely live: readable once a worker exited.
        pidfds = [os.pidfd_open(pid) for pid in pids]
        if whole_group:
            os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches every process
        else:
            os.kill(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode != 0 and "KeyboardInterrupt" in err
        # The workers were stopped before the parent left.
        try:
            for pid, fd in zip(pids, pidfds):
                ready, _, _ = select.select([fd], [], [], 10)
                assert ready, f"worker {pid} outlived the interrupted parent"
        finally:
            for fd in pidfds:
                os.close(fd)
