"""The synchronisation primitives across processes started by spawn."""

import multiprocessing
import queue
import threading

import pytest
import torch

import multiproc as mp
import workers

METHODS = ["spawn", "forkserver"]
LOCKS = [None, mp.Lock, mp.RLock]


def test_barrier_across_processes():
    b, q = mp.Barrier(3), mp.Queue()
    ctx = mp.spawn(workers.barrier_then_put, args=(b, q), nprocs=2, join=False)
    mine = b.wait(60)
    got = [q.get(timeout=60) for _ in range(2)]
    while not ctx.join(30):
        pass
    assert sorted([mine] + [i for _, i in got]) == [0, 1, 2]


def test_joinable_queue_join_waits_for_workers():
    q = mp.JoinableQueue()
    ctx = mp.spawn(workers.consume_joinable, args=(q,), nprocs=2, join=False)
    for i in range(20):
        q.put(i)
    q.put(None)
    q.put(None)
    assert q.join(timeout=60) is True
    while not ctx.join(30):
        pass


def test_condition_notify_across_processes():
    cond, flag, ready = mp.Condition(), mp.Event(), mp.Queue()
    ctx = mp.spawn(workers.wait_on_condition, args=(cond, flag, ready), nprocs=2, join=False)
    assert sorted(ready.get(timeout=60) for _ in range(2)) == [0, 1]
    with cond:
        flag.set()
        cond.notify_all()
    while not ctx.join(30):
        pass


def test_a_lock_serialises_writers_of_a_shared_tensor():
    lock, counter = mp.Lock(), mp.zeros(1, dtype=torch.int64)
    mp.spawn(workers.count_with_lock, args=(lock, counter, 200), nprocs=3)
    assert counter.item() == 600


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("make_lock", LOCKS, ids=["own", "Lock", "RLock"])
def test_condition_notify_wakes_n_waiters_of_python_processes(method, make_lock):
    """Condition handed to multiprocessing.Process (spawn, forkserver): notify(1) wakes
    one of two waiting processes, notify_all the rest. (The library's own condition may
    also wake a waiter without a notify, as its docs say: "exactly one" is checked over
    a lock, CPython's way.)"""
    ctx = multiprocessing.get_context(method)
    cond = mp.Condition(make_lock() if make_lock else None)
    ready, out = mp.Queue(), mp.Queue()
    procs = [ctx.Process(target=workers.wait_then_report, args=(cond, ready, out, r))
             for r in range(2)]
    for p in procs:
        p.start()
    assert sorted(ready.get(timeout=60) for _ in procs) == [0, 1]
    with cond:  # taken only once both let go of it in wait
        cond.notify(1)
    first = out.get(timeout=60)
    assert first[1] is True
    if make_lock is not None:
        with pytest.raises(queue.Empty):
            out.get(timeout=0.3)  # the other still waits
    with cond:
        cond.notify_all()
    second = out.get(timeout=60)
    assert second == (1 - first[0], True)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("make_lock", LOCKS, ids=["own", "Lock", "RLock"])
def test_condition_wait_for_a_shared_counter(method, make_lock):
    ctx = multiprocessing.get_context(method)
    cond = mp.Condition(make_lock() if make_lock else None)
    counter, out = mp.zeros(1, dtype=torch.int64), mp.Queue()
    p = ctx.Process(target=workers.wait_for_count, args=(cond, counter, 5, out))
    p.start()
    for _ in range(5):
        with cond:
            counter += 1
            cond.notify()
    assert out.get(timeout=60) == (True, 5)
    p.join(60)
    assert p.exitcode == 0


def test_a_condition_over_a_lock_refuses_a_parcel():
    with pytest.raises(TypeError, match="four handles"):
        mp.parcel_for_child(mp.Condition(mp.Lock()))


def _refuse_everything_but_holding(cond, lock):
    """Every wait and notify of ``cond`` raises RuntimeError, and leaves ``lock`` as it
    was: held by its other holder."""
    calls = [lambda: cond.wait(0.01), lambda: cond.wait(), lambda: cond.wait_for(lambda: True),
             lambda: cond.wait_for(lambda: False, 0.01), lambda: cond.notify(),
             lambda: cond.notify(2), lambda: cond.notify_all()]
    for call in calls:
        with pytest.raises(RuntimeError, match="not held by this thread"):
            call()
        assert lock.acquire(block=False) is False, "the other holder's lock was let go"


def _refused_while_another_thread_holds(cond, lock):
    """While another thread of this process holds ``lock``, ``cond`` refuses every
    wait and notify (see ``_refuse_everything_but_holding``)."""
    taken, done = threading.Event(), threading.Event()
    t = threading.Thread(target=workers.hold_lock_until, args=(lock, taken, done))
    t.start()
    try:
        assert taken.wait(60)
        _refuse_everything_but_holding(cond, lock)
    finally:
        done.set()
        t.join(60)
    assert not t.is_alive()


@pytest.mark.parametrize("make_lock", [mp.Lock, mp.RLock], ids=["Lock", "RLock"])
def test_a_condition_refuses_a_lock_another_process_holds(make_lock):
    lock = make_lock()
    cond = mp.Condition(lock)
    taken, done = mp.Event(), mp.Event()
    p = multiprocessing.get_context("forkserver").Process(
        target=workers.hold_lock_until, args=(lock, taken, done))
    p.start()
    try:
        assert taken.wait(60)
        _refuse_everything_but_holding(cond, lock)
    finally:
        done.set()
        p.join(60)
    assert p.exitcode == 0
    with cond:  # the caller's own: as before
        cond.notify_all()
        assert cond.wait(0.01) is False
        assert cond.wait_for(lambda: True) is True


@pytest.mark.parametrize("make_lock", [mp.Lock, mp.RLock], ids=["Lock", "RLock"])
def test_a_condition_refuses_a_lock_another_thread_holds(make_lock):
    lock = make_lock()
    cond = mp.Condition(lock)
    _refused_while_another_thread_holds(cond, lock)
    # Free: refused too (nothing to let go of), and the lock stays free.
    with pytest.raises(RuntimeError, match="not held by this thread"):
        cond.notify()
    assert lock.acquire(block=False) is True
    lock.release()
    with cond:
        cond.notify()
        assert cond.wait(0.01) is False


def test_the_library_condition_refuses_a_lock_another_thread_holds():
    """``Condition()`` with its own lock refuses as one over a given lock does: held by
    another thread, or free."""
    cond = mp.Condition()
    _refused_while_another_thread_holds(cond, cond)
    with pytest.raises(RuntimeError, match="not held by this thread"):
        cond.notify_all()
    with cond:
        cond.notify()
        assert cond.wait(0.01) is False
