"""Queues, pipes and synchronisation primitives, and how they (and tensors) are pickled
for processes that Python's own ``multiprocessing`` starts.

Every blocking call releases the GIL and waits in short slices, so Ctrl-C raises
``KeyboardInterrupt`` within about 50 ms (``Barrier.wait`` excepted: it sees Ctrl-C
when it returns).

Pickling: ``multiprocessing``'s ``ForkingPickler`` (used for a ``Process``'s arguments
with the spawn and forkserver start methods, and by its queues) gets reducers for
these types and for CPU ``torch.Tensor``s, the way torch registers its own: the object
is sealed into one fd (a socket holding it as a message) that travels with
``multiprocessing.reduction.DupFd``, and the receiver opens it. A plain ``pickle.dumps``
refuses them: a handle is a kernel object, not bytes.
"""

import multiprocessing.context
import multiprocessing.reduction
import multiprocessing.resource_sharer
import operator
import os
import sys
import threading
import time

from . import _native
from ._tensors import _torch_module


class _Handle:
    """A Python object over a native handle ``_h``."""

    __slots__ = ("_h",)

    def __reduce__(self):
        raise RuntimeError(
            f"a multiproc {type(self).__name__} cannot be pickled or put in a message (a "
            "queue's or pipe's message carries tensors and plain values): pass it to the "
            "other process when it starts, as an argument of multiproc.spawn or of a "
            "multiprocessing.Process (spawn or forkserver), or hand it over with "
            "multiproc.parcel_for_child"
        )


class Queue(_Handle):
    """torch.multiprocessing's ``Queue(maxsize=0)``: ``maxsize`` <= 0 is unbounded."""

    __slots__ = ()
    _kind = "queue"

    def __init__(self, maxsize=0):
        self._h = _native.NativeQueue(self._kind, maxsize)

    def put(self, obj, block=True, timeout=None):
        """Puts ``obj``; raises ``queue.Full`` when no place came free in time."""
        self._h.put(obj, block, timeout)

    def get(self, block=True, timeout=None):
        """Takes the oldest item; raises ``queue.Empty`` when none came in time."""
        return self._h.get(block, timeout)

    def put_nowait(self, obj):
        self._h.put(obj, False, None)

    def get_nowait(self):
        return self._h.get(False, None)

    def qsize(self):
        return self._h.qsize()

    def empty(self):
        return self._h.empty()

    def full(self):
        return self._h.full()

    def close(self):
        self._h.close()

    def join_thread(self):
        """Nothing to wait for: a put is in the queue when it returns."""

    def cancel_join_thread(self):
        """Nothing to cancel: a put is in the queue when it returns."""


class JoinableQueue(Queue):
    """A ``Queue`` whose ``join`` waits until every item put was ``task_done``."""

    __slots__ = ()
    _kind = "joinable"

    def task_done(self):
        self._h.task_done()

    def join(self, timeout=None):
        """Waits until every item was processed; False if ``timeout`` passed first."""
        return self._h.join(timeout)


class SimpleQueue(_Handle):
    """An unbounded queue with ``put``, ``get``, ``empty`` and ``close``."""

    __slots__ = ()

    def __init__(self):
        self._h = _native.NativeQueue("simple", 0)

    def put(self, obj):
        self._h.put(obj, True, None)

    def get(self):
        return self._h.get(True, None)

    def empty(self):
        return self._h.empty()

    def close(self):
        self._h.close()


class Connection(_Handle):
    """One end of a ``Pipe``: ``send``, ``recv``, ``poll``, ``fileno``, ``close``."""

    __slots__ = ()

    def send(self, obj):
        self._h.send(obj)

    def recv(self):
        """The next object; ``EOFError`` when the other end is closed and nothing is left."""
        return self._h.recv()

    def poll(self, timeout=0.0):
        """Whether something can be received within ``timeout`` seconds (None: wait)."""
        return self._h.poll(timeout)

    def fileno(self):
        return self._h.fileno()

    def close(self):
        self._h.close()

    @property
    def closed(self):
        return self._h.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def Pipe(duplex=True):
    """Two connected ``Connection`` ends (always duplex underneath)."""
    a, b = _native.native_pipe()
    ends = []
    for h in (a, b):
        c = Connection.__new__(Connection)
        c._h = h
        ends.append(c)
    return ends[0], ends[1]


class _Lockish(_Handle):
    __slots__ = ()

    def acquire(self, block=True, timeout=None):
        return self._h.acquire(block, timeout)

    def release(self):
        self._h.release()

    def __enter__(self):
        return self._h.acquire(True, None)

    def __exit__(self, *exc):
        self._h.release()


class Lock(_Lockish):
    """A process-shared lock; a holder that dies is reported to the next acquirer."""

    __slots__ = ()

    def __init__(self):
        self._h = _native.Lock()


class RLock(_Lockish):
    """A process-shared re-entrant lock."""

    __slots__ = ()

    def __init__(self):
        self._h = _native.RLock()


class Semaphore(_Lockish):
    """A process-shared counting semaphore."""

    __slots__ = ()

    def __init__(self, value=1):
        if operator.index(value) < 0:
            raise ValueError(f"semaphore initial value must be >= 0, not {value}")
        self._h = _native.Semaphore(value)

    def get_value(self):
        return self._h.get_value()


class Condition(_Lockish):
    """A process-shared condition variable, ``multiprocessing.Condition(lock=None)``.

    Without ``lock`` it is the library's own condition (``multiproc::Condition``, which
    a Rust process can open too), with a lock of its own that is not re-entrant. With a
    multiproc ``Lock`` or ``RLock`` it waits on that lock the way CPython's
    ``multiprocessing.Condition`` does: three semaphores count the sleepers, wake them
    and confirm that they woke (see ``_ConditionOverLock``); ``wait``, ``wait_for``,
    ``notify`` and ``notify_all`` raise ``RuntimeError`` unless this thread holds the
    lock (either kind), as CPython's do.
    """

    __slots__ = ()

    def __init__(self, lock=None):
        if lock is None:
            self._h = _native.Condition()
        elif isinstance(lock, (Lock, RLock)):
            self._h = _ConditionOverLock(lock, Semaphore(0), Semaphore(0), Semaphore(0))
        else:
            raise TypeError(
                f"a multiproc Condition waits on a multiproc Lock or RLock, not a "
                f"{type(lock).__name__}")

    def wait(self, timeout=None):
        """Releases the lock, waits for a notify, and takes the lock again: True when
        notified, False when ``timeout`` seconds passed first."""
        return self._h.wait(timeout)

    def wait_for(self, predicate, timeout=None):
        """Waits until ``predicate()`` is true (checked with the lock held), at most
        ``timeout`` seconds; returns the predicate's last value."""
        if isinstance(self._h, _ConditionOverLock):
            self._h.check_owned("wait on")
        elif not self._h._is_mine():
            raise RuntimeError(
                "cannot wait_for on a Condition whose lock is not held by this thread (it "
                "is free, or another thread or process holds it); acquire the lock first")
        end = None if timeout is None else time.monotonic() + timeout
        result = predicate()
        while not result:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._h.wait(left)
            result = predicate()
        return result

    def notify(self, n=1):
        """Wakes up to ``n`` waiters (the lock held); none for ``n`` <= 0."""
        self._h.notify(max(operator.index(n), 0))

    def notify_all(self):
        self._h.notify_all()


class _ConditionOverLock:
    """CPython's ``multiprocessing.synchronize.Condition`` over a multiproc ``Lock`` or
    ``RLock`` and three multiproc semaphores (all process-shared, so the condition is).

    A waiter counts itself in ``sleeping`` before it lets go of the lock, so a notifier
    (which holds the lock) always sees it; the notifier then releases ``wake`` once per
    sleeper it wakes and waits on ``woken`` until each has taken its ``wake``, so that a
    later waiter cannot take a wake-up meant for an earlier one. ``woken`` also counts
    waiters that timed out, which the next notify subtracts from ``sleeping``.

    All of that holds only while the caller holds the lock: ``wait`` and ``notify``
    first check that this thread of this process does (the lock's ``_is_mine``, as
    CPython asserts its ``SemLock._is_mine``), and raise ``RuntimeError`` otherwise —
    a ``Lock`` may be released by anyone, so without the check a wait would let go of
    another holder's lock.
    """

    __slots__ = ("lock", "sleeping", "woken", "wake")

    def __init__(self, lock, sleeping, woken, wake):
        self.lock, self.sleeping, self.woken, self.wake = lock, sleeping, woken, wake

    def acquire(self, block=True, timeout=None):
        return self.lock.acquire(block, timeout)

    def release(self):
        self.lock.release()

    def __enter__(self):
        return self.lock.acquire(True, None)

    def __exit__(self, *exc):
        self.lock.release()

    def check_owned(self, what):
        """Raises ``RuntimeError`` unless this thread of this process holds the lock."""
        if not self.lock._h._is_mine():
            raise RuntimeError(
                f"cannot {what} a Condition whose {type(self.lock).__name__} is not held "
                f"by this thread (it is free, or another thread or process holds it); "
                f"acquire the lock first, as with multiprocessing.Condition")

    def _let_go(self):
        """Releases every level of the lock this thread holds; how many."""
        levels = 1
        self.lock.release()
        if isinstance(self.lock, RLock):
            while self.lock._h._is_mine():
                self.lock.release()
                levels += 1
        return levels

    def wait(self, timeout=None):
        self.check_owned("wait on")
        self.sleeping.release()
        levels = self._let_go()
        try:
            return self.wake.acquire(True, timeout)
        finally:
            self.woken.release()
            for _ in range(levels):
                self.lock.acquire(True, None)

    def notify(self, n=1):
        self.check_owned("notify")
        # Waiters that timed out since the last notify are counted in both.
        while self.woken.acquire(False):
            self.sleeping.acquire(False)
        sleepers = 0
        while sleepers < n and self.sleeping.acquire(False):
            self.wake.release()
            sleepers += 1
        if sleepers:
            for _ in range(sleepers):
                self.woken.acquire(True, None)
            # A waiter that timed out meanwhile left its wake-up unused.
            while self.wake.acquire(False):
                pass

    def notify_all(self):
        self.notify(sys.maxsize)


class Event(_Handle):
    """A process-shared event: ``set``, ``clear``, ``is_set``, ``wait(timeout)``."""

    __slots__ = ()

    def __init__(self):
        self._h = _native.Event()

    def set(self):
        self._h.set()

    def clear(self):
        self._h.clear()

    def is_set(self):
        return self._h.is_set()

    def wait(self, timeout=None):
        return self._h.wait(timeout)


class BrokenBarrierError(_native.MultiprocError, threading.BrokenBarrierError):
    """A ``Barrier`` wait that timed out, or found (or was in) a broken barrier. It is
    a ``threading.BrokenBarrierError``, what code ported from torch catches."""


class Barrier(_Handle):
    """A process-shared barrier for ``parties`` processes. ``wait`` raises
    ``BrokenBarrierError`` when it times out (breaking the barrier, as
    ``threading.Barrier`` does) or the barrier is broken; Ctrl-C during a wait breaks
    it too, so the other parties do not wait forever for this one."""

    __slots__ = ()

    def __init__(self, parties):
        if operator.index(parties) < 1:
            raise ValueError(f"a barrier needs at least 1 party, not {parties}")
        self._h = _native.Barrier(parties)

    def wait(self, timeout=None):
        try:
            return self._h.wait(timeout)
        except _native.MultiprocError as e:
            if isinstance(e, _native.OwnerDiedError):
                raise
            raise BrokenBarrierError(str(e)) from None

    def abort(self):
        """Breaks the barrier: current and later waits raise ``BrokenBarrierError``."""
        self._h.abort()

    @property
    def broken(self):
        return self._h.broken

    @property
    def n_waiting(self):
        return self._h.n_waiting

    @property
    def parties(self):
        return self._h.parties


# --- pickling for multiprocessing ---------------------------------------------------

def _wrap(cls, handle):
    obj = cls.__new__(cls)
    obj._h = handle
    return obj


def _pass_fd(parcel):
    """A ``DupFd`` for the parcel's fd, keeping the parcel open as long as needed."""
    popen = multiprocessing.context.get_spawning_popen()
    if popen is not None:
        # The fd goes to the child when the process starts, after pickling: the popen
        # object keeps the parcel open until then (and is dropped with the Process).
        popen.__dict__.setdefault("_multiproc_parcels", []).append(parcel)
        return multiprocessing.reduction.DupFd(parcel.fileno())
    # Pickled for another purpose (a multiprocessing.Queue): the resource sharer takes a
    # duplicate now and hands it to whichever process unpickles it.
    dup = multiprocessing.resource_sharer.DupFd(parcel.fileno())
    parcel.close()
    return dup


def _rebuild_handle(cls, dupfd):
    return _wrap(cls, _native.open_parcel(dupfd.detach()))


def _reduce_handle(obj):
    return _rebuild_handle, (type(obj), _pass_fd(_native.seal(obj._h)))


def _rebuild_tensor(dupfd, requires_grad):
    t = _native.to_python(_native.open_parcel(dupfd.detach()))
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t):
    s = t.untyped_storage() if t.is_cpu and t.layout is _torch_module().strided else None
    if s is None or not _native.is_shared_block(s.data_ptr(), s.nbytes()):
        # Not in a multiproc block: as torch.multiprocessing sends it (its storage
        # moved into shared memory in place, so the child's writes reach this process;
        # a tensor torch shares already stays shared), whether or not multiproc is used
        # here: importing it does not change what torch's own processes do.
        from torch.multiprocessing import reductions

        return reductions.reduce_tensor(t)
    native = _native.as_native(t.detach())
    return _rebuild_tensor, (_pass_fd(_native.seal(native)), t.requires_grad)


def _rebuild_condition_over(lock, sleeping, woken, wake):
    c = Condition.__new__(Condition)
    c._h = _ConditionOverLock(lock, sleeping, woken, wake)
    return c


def _reduce_condition(c):
    h = c._h
    if isinstance(h, _ConditionOverLock):
        # Its four handles go as handles of their own (ForkingPickler reduces them).
        return _rebuild_condition_over, (h.lock, h.sleeping, h.woken, h.wake)
    return _reduce_handle(c)


for _cls in (Queue, JoinableQueue, SimpleQueue, Connection, Lock, RLock, Semaphore, Event,
             Barrier):
    multiprocessing.reduction.ForkingPickler.register(_cls, _reduce_handle)
multiprocessing.reduction.ForkingPickler.register(Condition, _reduce_condition)


def register_torch_reducers():
    """Makes multiprocessing pickle CPU ``torch.Tensor``s by multiproc handle (a tensor
    in a multiproc block by handle, any other copied once into one). Done when
    ``multiproc`` is imported after torch; call it again after importing
    ``torch.multiprocessing``, which registers torch's own."""
    torch = sys.modules.get("torch")
    if torch is not None:
        multiprocessing.reduction.ForkingPickler.register(torch.Tensor, _reduce_tensor)


register_torch_reducers()


# --- processes this package did not start -------------------------------------------

_KINDS = {}  # class -> the kind name open_bare takes


def parcel_for_child(obj):
    """Seals a queue, pipe end, lock or event into an fd for a program you start
    yourself (``subprocess.Popen(..., pass_fds=[fd])``); the child opens it with
    ``multiproc.open_parcel(fd, multiproc.Queue)`` (Python) or
    ``multiproc::parcel::open::<Queue<Dynamic>>`` (Rust). Returns ``(fd, parcel)``: keep
    ``parcel`` until the child has started, then ``parcel.close()``. A parcel opens
    once."""
    if isinstance(obj, Condition) and isinstance(obj._h, _ConditionOverLock):
        raise TypeError("a Condition over a lock of yours is four handles, which a parcel "
                        "cannot hold; pass it as an argument of a multiprocessing.Process")
    parcel = _native.seal_bare(obj._h)
    return parcel.fileno(), parcel


def open_parcel(fd, cls):
    """Opens an fd that ``parcel_for_child`` (or a Rust program's
    ``multiproc::parcel::seal``) made, as an object of ``cls`` (``multiproc.Queue``,
    ``multiproc.Event``…). Takes ownership of ``fd``."""
    kind = _KINDS.get(cls)
    if kind is None:
        raise TypeError(f"open_parcel cannot make a {cls!r}")
    return _wrap(cls, _native.open_bare(fd, kind))


_KINDS.update({
    Queue: "queue", JoinableQueue: "joinable", SimpleQueue: "simple",
    Connection: "connection", Event: "event", Lock: "lock", RLock: "rlock",
    Semaphore: "semaphore", Condition: "condition", Barrier: "barrier",
})
