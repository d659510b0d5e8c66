"""The shm manager of a process tree that uses the ``file_system`` strategy, from Python.

The library starts the tree's manager itself, the first time a process of the tree
makes a named block, and starts it again if it was killed: the native module told it
at import how (``multiproc::set_shm_manager_command``: this interpreter on
``multiproc._native._run_shm_manager()``, since a Python interpreter run again as a
program does not serve). Nothing of the manager's start-up is done here.

What the library cannot do is what only this package sees: the processes that
Python's own ``multiprocessing`` starts. They belong to the tree, and find its
manager, through ``MULTIPROC_SHM_MANAGER`` in their environment, so the address goes
into this process's environment before any of them starts (the library reads it from
there too, so both agree on one tree).

The address is chosen here, in the library's format: the library keeps its address
(``shm::tree::address``) to itself, with no public function that returns it or the
environment a child it did not start needs. Once it has one, ``tree_address`` asks it
instead, and this copy of the format goes.
"""

import os
import secrets

ADDRESS_ENV = "MULTIPROC_SHM_MANAGER"
_PREFIX = "multiproc-shm-"


def _is_address(a):
    return (a.startswith(_PREFIX) and len(a) < 100
            and all(c.isascii() and (c.isalnum() or c == "-") for c in a))


def tree_address():
    """This tree's manager address, in this process's environment: inherited (this
    process is not the root), or chosen now with this process as the root (its pid and
    start time, as the library does). Returns ``(address, chosen_now)``."""
    a = os.environ.get(ADDRESS_ENV, "")
    if _is_address(a):
        return a, False
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time
    a = f"{_PREFIX}{os.getuid()}-{os.getpid()}-{start}-{secrets.token_hex(8)}"
    os.environ[ADDRESS_ENV] = a
    return a, True
