"""multiproc: torch.multiprocessing's API over shared-memory queues that carry tensors
by handle, between Python processes and Rust processes alike.

Porting is renaming an import::

    import multiproc as mp          # was: import torch.multiprocessing as mp

    q = mp.Queue()
    q.put({"step": 1, "batch": mp.zeros((64, 3, 224, 224))})   # by handle, no copy
    msg = q.get()                   # a torch.Tensor over the same shared block

A message is one packet on a socket or a shared-memory ring, so a producer may exit as
soon as ``put`` returns. Messages nest tuples, lists and dicts of tensors and plain
values (str, int, float, bool, None, bytes); any other object goes by pickle. A Rust
process reads the same queue as ``Queue<multiproc::Dynamic>``.
"""

import atexit
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue as _queue
import sys

from . import _native
from ._native import (
    ClosedError,
    FdLimitError,
    InvalidMessageError,
    MultiprocError,
    OutOfSharedMemoryError,
    OwnerDiedError,
)
from ._tensors import empty, full, share_memory_, zeros
from ._tensors import _decode_tensor, _encode_other, _view_tensor
from ._handles import (
    Barrier,
    BrokenBarrierError,
    Condition,
    Connection,
    Event,
    JoinableQueue,
    Lock,
    Pipe,
    Queue,
    RLock,
    Semaphore,
    SimpleQueue,
    parcel_for_child,
    open_parcel,
)
from .spawn import (
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    spawn,
    start_processes,
)

_native._set_hooks(_encode_other, _decode_tensor, _view_tensor)
# Before the interpreter finalizes: a thread still waiting in a multiproc call (a daemon
# thread in `get`, say) then stays parked when its wait ends, instead of taking the GIL
# back during finalization, which would abort the process.
atexit.register(_native._interpreter_ending)


def _give_back_before_os_exit():
    """Run by ``multiprocessing`` as one of its processes ends. A ``fork`` or
    ``forkserver`` child then leaves with ``os._exit``, freeing nothing: its received
    tensors (its ``Process`` arguments among them) would keep their blocks' uses, and
    their creators could never reuse them. This gives them back, when nothing can read
    the tensors any more: no other thread runs, and ``os._exit`` follows. A ``spawn``
    child and the main process finalize instead, and give back whatever is still alive
    after that from a C ``atexit`` handler (the native module's)."""
    import threading

    if multiprocessing.parent_process() is None or threading.active_count() != 1:
        return
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "spawn_main":
            return  # spawn: the interpreter finalizes after this
        frame = frame.f_back
    _native._give_back_at_exit()


def _register_give_back(_anchor=None):
    # The lowest priority: after every other finalizer, which may still use tensors.
    multiprocessing.util.Finalize(None, _give_back_before_os_exit, exitpriority=-(1 << 30))


class _AfterFork:
    """An anchor for ``register_after_fork`` (which holds it weakly)."""


_after_fork = _AfterFork()
_register_give_back()
# A child's bootstrap clears the finalizers registered before it (when multiproc was
# imported to unpickle the child's arguments), then runs the after-fork hooks.
multiprocessing.util.register_after_fork(_after_fork, _register_give_back)


class DisconnectedError(MultiprocError, EOFError, _queue.Empty):
    """A get or recv found its queue or pipe empty with no other handle of it left
    anywhere — in another process (exited or killed), another thread, or a message in
    flight — so nothing can ever arrive. torch.multiprocessing's queues wait forever
    there. It is an ``EOFError`` (what ``Connection.recv`` raises at the end) and a
    ``queue.Empty`` (what code ported from torch catches around ``get``); a
    non-blocking ``get`` raises plain ``queue.Empty``."""

__all__ = [
    "Barrier", "BrokenBarrierError", "ClosedError", "Condition", "Connection",
    "DisconnectedError", "Event",
    "FdLimitError",
    "InvalidMessageError", "JoinableQueue", "Lock", "MultiprocError",
    "OutOfSharedMemoryError", "OwnerDiedError", "Pipe", "ProcessContext",
    "ProcessException", "ProcessExitedException", "ProcessRaisedException", "Queue",
    "RLock", "Semaphore", "SimpleQueue", "empty", "full", "get_all_sharing_strategies",
    "get_sharing_strategy", "open_parcel", "parcel_for_child", "set_sharing_strategy",
    "share_memory_", "shm_segments", "spawn", "start_processes", "zeros",
]

# As torch.multiprocessing does: the rest of multiprocessing's names (Process, Pool,
# Manager, get_context, set_start_method, cpu_count...), so that porting stays renaming
# an import. Handles and tensors travel as arguments of its processes (see _handles).
for _name in multiprocessing.__all__:
    if _name not in globals():
        globals()[_name] = getattr(multiprocessing, _name)
        __all__.append(_name)
del _name


def shm_segments():
    """multiproc's segments in /dev/shm (blocks and queue rings of file_system trees
    and their headers), read as the ``multiproc gc`` command reads them: a list of
    ``(name, creator_pid, tree)``, where ``tree`` is ``(root_pid, root_start_time,
    random)`` for a segment that belongs to a process tree, else ``None``. For
    monitoring and tests; the names' format is the library's to change."""
    return _native.shm_segments()


def get_all_sharing_strategies():
    """The sharing strategies this process can use (torch's names)."""
    return {"file_descriptor", "file_system"}


def get_sharing_strategy():
    """The strategy new shared blocks are made with."""
    return _native.get_sharing_strategy()


def set_sharing_strategy(new_strategy):
    """Sets the strategy new shared blocks are made with: ``"file_descriptor"`` (the
    default: blocks are memfds, passed as fds) or ``"file_system"`` (blocks are files
    in /dev/shm, passed by name; the tree's shm manager removes what a crashed tree
    left). Processes started afterwards inherit it, as the library's own do.

    ``"file_system"`` puts this process in a tree (the one it inherited, or a new one
    it is the root of) and connects it to the tree's shm manager, which the library
    starts if it does not run yet.
    """
    if new_strategy not in get_all_sharing_strategies():
        raise ValueError(
            f"no sharing strategy {new_strategy!r}; the available ones are "
            f"{sorted(get_all_sharing_strategies())}"
        )
    if new_strategy == "file_system":
        _join_shm_tree()
    _native.set_sharing_strategy(new_strategy)
    os.environ["MULTIPROC_SHARING_STRATEGY"] = new_strategy
    if new_strategy == "file_system":
        _connect_to_shm_manager()


def _join_shm_tree():
    """Puts this process tree's shm manager address (the library's: inherited, or chosen
    now with this process as the root) into this process's environment, for the
    processes Python's own ``multiprocessing`` starts, which the library does not: they
    belong to the tree and find its manager through it. Whether this process is the
    tree's root.

    The library starts the manager itself (the native module told it how at import:
    ``multiproc::maintenance::set_shm_manager_command``, this interpreter on
    ``multiproc._native._run_shm_manager()``), and starts it again if it was killed."""
    name, address = _native.shm_manager_env()
    root = os.environ.get(name) != address
    os.environ[name] = address
    return root


def _connect_to_shm_manager():
    # A first named block connects this process to the manager (the library starts one
    # if none listens), which then lives as long as this process: a manager without
    # clients ends after a grace period, removing the tree's names.
    _native.new_tensor([1], "uint8", None)


# Started with file_system in the environment: joins the tree it names, or becomes the
# root of a new one (started by hand, say). A root connects at once, as the library's
# own processes connect before they start workers, so that the manager outlives the
# workers that name blocks for it; a process that inherited the tree (the manager the
# library starts among them) connects when it first names a block.
if os.environ.get("MULTIPROC_SHARING_STRATEGY") == "file_system" and _join_shm_tree():
    _connect_to_shm_manager()
