"""The synchronisation primitives across processes started by spawn."""

import torch

import multiproc as mp
import workers


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
