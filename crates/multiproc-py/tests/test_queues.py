"""torch.multiprocessing's queue, pipe and synchronisation API, in one process and
across threads (blocking calls release the GIL)."""

import pickle
import queue
import threading
import time
from collections import OrderedDict, namedtuple
from fractions import Fraction

import pytest
import torch

import multiproc as mp


def test_plain_values_and_nesting_round_trip():
    q = mp.Queue()
    msg = {"s": "é", "i": -(2**63), "big": 2**100, "f": 1.5, "b": True, "n": None,
           "bytes": b"\x00\xff", "ba": bytearray(b"ab"), "l": [1, [2, (3, {"k": "v"})]],
           "t": (), 7: "int key", (1, 2): "tuple key", "other": Fraction(1, 3)}
    q.put(msg)
    got = q.get()
    expected = dict(msg, ba=b"ab")
    assert got == expected
    assert type(got["l"][1][1]) is tuple and type(got["bytes"]) is bytes


Point = namedtuple("Point", "x y")


def test_subclasses_keep_their_type_by_pickle():
    q = mp.Queue()
    q.put([Point(1, 2), OrderedDict(a=1), True, 1])
    p, od, b, i = q.get()
    assert type(p) is Point and p == (1, 2) and type(od) is OrderedDict
    assert b is True and type(i) is int


def test_a_message_that_contains_itself_is_an_error():
    q = mp.Queue()
    loop = []
    loop.append(loop)
    with pytest.raises(RecursionError):
        q.put(loop)
    assert q.empty()


def test_unpicklable_objects_are_a_python_error():
    q = mp.Queue()
    with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
        q.put(lambda: 1)
    assert q.empty()


def test_get_timeout_and_nowait_raise_queue_empty():
    q = mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(block=False)


def test_maxsize_full_put_nowait_qsize():
    q = mp.Queue(maxsize=2)
    assert q.empty() and not q.full() and q.qsize() == 0
    q.put(1)
    q.put_nowait(2)
    assert q.full() and q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.05)
    assert [q.get(), q.get_nowait()] == [1, 2]
    assert q.empty()


def test_close():
    q = mp.Queue()
    q.close()
    with pytest.raises(mp.ClosedError):
        q.put(1)


def test_simple_queue():
    q = mp.SimpleQueue()
    assert q.empty()
    q.put(("a", mp.zeros(2)))
    assert not q.empty()
    name, t = q.get()
    assert name == "a" and t.shape == (2,)


def test_joinable_queue_task_done_and_join():
    q = mp.JoinableQueue()
    for i in range(3):
        q.put(i)
    assert q.join(timeout=0.05) is False
    for _ in range(3):
        q.get()
        q.task_done()
    assert q.join(timeout=5) is True
    with pytest.raises(ValueError):
        q.task_done()


def test_a_blocked_get_releases_the_gil():
    q = mp.Queue()
    out = []
    t = threading.Thread(target=lambda: out.append(q.get(timeout=30)))
    t.start()
    # This thread runs Python while the other waits inside get.
    total = sum(range(100_000))
    q.put(total)
    t.join()
    assert out == [total]


def test_pipe_send_recv_poll_and_eof():
    a, b = mp.Pipe()
    assert not b.poll()
    a.send({"x": mp.full((3,), 1.0)})
    assert b.poll(5)
    assert b.recv()["x"].sum().item() == 3
    b.send("back")
    assert a.recv() == "back"
    assert isinstance(a.fileno(), int)
    a.close()
    assert a.closed
    with pytest.raises(EOFError):
        b.recv()
    with pytest.raises(OSError):
        a.send(1)
    b.close()


def test_event():
    e = mp.Event()
    assert not e.is_set() and e.wait(0.01) is False
    e.set()
    assert e.is_set() and e.wait() is True
    e.clear()
    assert not e.is_set()


def test_locks_and_semaphore():
    lock = mp.Lock()
    assert lock.acquire()
    assert lock.acquire(timeout=0.01) is False
    assert lock.acquire(block=False) is False
    lock.release()
    with lock:
        pass
    rlock = mp.RLock()
    with rlock:
        with rlock:
            pass
    s = mp.Semaphore(2)
    assert s.acquire() and s.acquire() and s.acquire(timeout=0.01) is False
    assert s.get_value() == 0
    s.release()
    assert s.get_value() == 1


def test_condition_wait_for_across_threads():
    c = mp.Condition()
    box = []

    def producer():
        with c:
            box.append(1)
            c.notify_all()

    with c:
        t = threading.Thread(target=producer)
        t.start()
        assert c.wait_for(lambda: box, timeout=30)
    t.join()
    with c:
        assert c.wait(0.01) is False
    with pytest.raises(TypeError):
        mp.Condition(threading.Lock())


@pytest.mark.parametrize("make_lock", [None, mp.Lock, mp.RLock])
def test_condition_over_a_lock_across_threads(make_lock):
    lock = make_lock() if make_lock else None
    c = mp.Condition(lock)
    box, woke = [], []

    def waiter():
        with c:
            box.append("waiting")
            woke.append(c.wait_for(lambda: len(box) > 2, timeout=30))

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:
        with c:
            if len(box) == 2:
                box.append("go")
                c.notify_all()
                break
        assert time.monotonic() < deadline
        time.sleep(0.001)
    for t in threads:
        t.join(30)
    assert woke == [True, True]
    with c:
        assert c.wait(0.01) is False
        if make_lock is mp.RLock:
            with c:  # re-entered: wait lets go of both levels, and takes both back
                assert c.wait(0.01) is False
            assert lock.acquire(block=False) is True  # still this thread's
            lock.release()
    if make_lock is not None:
        with pytest.raises(RuntimeError, match="not held"):
            c.wait(0.01)


def test_barrier_across_threads():
    b = mp.Barrier(2)
    assert b.parties == 2
    got = []
    t = threading.Thread(target=lambda: got.append(b.wait(30)))
    t.start()
    got.append(b.wait(30))
    t.join()
    assert sorted(got) == [0, 1]


def test_sharing_strategies():
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    assert mp.get_sharing_strategy() == "file_descriptor"
    mp.set_sharing_strategy("file_descriptor")
    with pytest.raises(ValueError, match="file_system"):
        mp.set_sharing_strategy("file_sistem")


def test_plain_pickle_refuses_handles():
    with pytest.raises(RuntimeError, match="multiprocessing"):
        pickle.dumps(mp.Queue())
