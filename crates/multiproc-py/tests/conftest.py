"""Every test runs under a deadline (a hang dumps every thread's stack and fails the
run) and a leak check: no new open fd, no new multiproc segment in /dev/shm and no
child process left when it ends."""

import faulthandler
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_sharer
import multiprocessing.resource_tracker
import os
import sys
import time

import pytest

import multiproc
from multiproc import _native

DEADLINE_S = 120


def open_fds():
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the listing's own fd, gone already
    return fds


def shm_segments(pids):
    """multiproc's segments in /dev/shm made by one of ``pids`` or by a process tree
    rooted at one of them (other programs on the machine make and remove segments of
    their own meanwhile)."""
    return {name for name, creator, tree in multiproc.shm_segments()
            if str(creator) in pids or (tree is not None and str(tree[0]) in pids)}


def descendants():
    """The pids of this process and of every process below it, now."""
    found, todo = {str(os.getpid())}, [str(os.getpid())]
    by_parent = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    by_parent.setdefault(f.read().rsplit(")", 1)[1].split()[1], []).append(pid)
            except OSError:
                pass
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def children(ignore):
    me = str(os.getpid())
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and int(pid) not in ignore and fields[0] != "Z":
            found.append(int(pid))
    return found


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


@pytest.fixture(scope="session", autouse=True)
def _helpers_started():
    # multiprocessing's own helpers live as long as the test session: start them
    # first, so that they do not count as leaks of the first test that needs them.
    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.forkserver.ensure_running()
    # The resource sharer's listener (which passes fds pickled outside a process
    # start) stays open once started.
    fd = os.open("/dev/null", os.O_RDONLY)
    os.close(multiprocessing.resource_sharer.DupFd(fd).detach())
    os.close(fd)
    yield


def _settle(before_fds):
    """Drops what the test left for the garbage collector and the library's caches,
    then waits (bounded) for exiting children to be reaped."""
    gc.collect()
    _native._release_cached_blocks()


@pytest.fixture(autouse=True)
def leak_check(request):
    helpers = set()
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    if tracker:
        helpers.add(tracker)
    fs = multiprocessing.forkserver._forkserver._forkserver_pid
    if fs:
        helpers.add(fs)
    _settle(None)
    fds = open_fds()
    tree = descendants()
    shm = shm_segments(tree)
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    # Processes that ran during the test, as far as they can still be seen.
    tree |= descendants() | {str(p.pid) for p in multiprocessing.active_children()}
    for p in multiprocessing.active_children():
        p.join(5)
    _settle(fds)
    new_fds = {fd: target for fd, target in open_fds().items() if fd not in fds}
    assert not new_fds, f"the test leaked fds: {new_fds}"
    assert shm_segments(tree) - shm == set(), "the test left segments in /dev/shm"
    left = children(helpers)
    assert not left, f"the test left child processes: {[(p, cmdline(p)) for p in left]}"
