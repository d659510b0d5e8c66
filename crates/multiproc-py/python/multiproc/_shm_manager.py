"""The shm manager of a process tree that uses the ``file_system`` strategy, started
from Python.

The library starts its manager by running its own program again in manager mode; a
Python interpreter run again does not serve, so from Python the manager is started
here instead, before the library would need it: a short-lived interpreter runs
``multiproc._native._run_shm_manager()`` (the library's ``run_shm_manager_from_env``),
which forks the manager off, detached, and reports on stdout that it listens. This
process then connects to it at once (it stays connected as long as it lives), so the
manager never finds itself without clients before the tree ends.

The tree is named as the library names it (``multiproc-shm-<uid>-<root pid>-<root
start time>-<random>`` in ``MULTIPROC_SHM_MANAGER``); the address goes into this
process's environment, so that the processes it starts afterwards (``multiprocessing``
ones included) belong to the tree and find its manager.
"""

import os
import secrets
import socket
import subprocess
import sys

from . import _native

ADDRESS_ENV = "MULTIPROC_SHM_MANAGER"
_PREFIX = "multiproc-shm-"
_connected = set()  # the addresses this process started (or found) a manager at


def _is_address(a):
    return (a.startswith(_PREFIX) and len(a) < 100
            and all(c.isascii() and (c.isalnum() or c == "-") for c in a))


def tree_address():
    """This tree's manager address: inherited, or chosen now with this process as the
    root (its pid and start time, as the library does)."""
    a = os.environ.get(ADDRESS_ENV, "")
    if _is_address(a):
        return a
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time
    a = f"{_PREFIX}{os.getuid()}-{os.getpid()}-{start}-{secrets.token_hex(8)}"
    os.environ[ADDRESS_ENV] = a
    return a


def _listens(addr):
    """Whether a manager listens at ``addr`` (an abstract socket; it accepts and
    forgets a client that leaves without a word)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect("\0" + addr)
        return True
    except OSError:
        return False
    finally:
        s.close()


def ensure_running():
    """Makes sure this tree's manager listens, starting it if needed: whether it was
    started here. Raises ``MultiprocError`` saying why when it cannot be started."""
    addr = tree_address()
    if addr in _connected or _listens(addr):
        _connected.add(addr)
        return False
    # The address is also an argument, only so that the manager's command line names it.
    cmd = [sys.executable, "-c",
           "from multiproc import _native; _native._run_shm_manager()", addr]
    try:
        # Without the strategy in its environment: its import of multiproc must not
        # start a manager in turn.
        env = {k: v for k, v in os.environ.items() if k != "MULTIPROC_SHARING_STRATEGY"}
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              env=env, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _native.MultiprocError(f"cannot start the shm manager with {cmd}: {e}") from e
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    status = lines[-1] if lines else ""
    if not (status.startswith("ready @") or status.startswith("in-use @")):
        raise _native.MultiprocError(
            f"the shm manager did not start ({status or 'no status line'}; "
            f"{sys.executable} exited with {done.returncode})")
    _connected.add(addr)
    return True
