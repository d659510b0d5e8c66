"""Across processes: handles as arguments of Python's own multiprocessing.Process
(spawn and forkserver), the producer that exits right after put, spawn's failure
reports."""

import gc
import multiprocessing
import os
import queue
import signal

import pytest
import torch

import multiproc as mp
import workers

METHODS = ["spawn", "forkserver"]


@pytest.mark.parametrize("method", METHODS)
def test_handles_and_tensors_as_process_arguments(method):
    ctx = multiprocessing.get_context(method)
    t = mp.zeros(4)
    lock, done = mp.Lock(), mp.Queue()
    procs = [ctx.Process(target=workers.add_one, args=(r, t, lock, done)) for r in range(3)]
    for p in procs:
        p.start()
    assert sorted(done.get(timeout=60) for _ in procs) == [0, 1, 2]
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert torch.equal(t, torch.full((4,), 3.0))  # every child wrote the parent's block


@pytest.mark.parametrize("method", METHODS)
def test_a_plain_torch_tensor_argument_arrives(method):
    ctx = multiprocessing.get_context(method)
    x = torch.arange(6.0).reshape(2, 3)
    q = mp.SimpleQueue()
    p = ctx.Process(target=workers.receive_tensor, args=(x, q))
    p.start()
    assert q.get() == (15.0, (2, 3), torch.float32)
    p.join()
    assert p.exitcode == 0


def test_event_and_tensor_through_a_child():
    ctx = multiprocessing.get_context("spawn")
    t, ev = mp.zeros(3), mp.Event()
    p = ctx.Process(target=workers.write_and_signal, args=(t, ev, 7.0))
    p.start()
    assert ev.wait(60)
    p.join()
    assert torch.equal(t, torch.full((3,), 7.0))


@pytest.mark.parametrize("method", METHODS)
def test_the_producer_may_exit_right_after_put(method):
    ctx = multiprocessing.get_context(method)
    q = mp.Queue()
    p = ctx.Process(target=workers.put_and_exit, args=(q, 50))
    p.start()
    p.join()  # gone before anything was taken
    assert p.exitcode == 0
    for i in range(50):
        j, t = q.get(timeout=10)
        assert j == i and torch.equal(t, torch.full((256,), float(i)))
    assert q.empty()


@pytest.mark.parametrize("method", METHODS)
def test_a_consumer_whose_producers_all_exited_is_told_so(method):
    # torch.multiprocessing's get waits forever here.
    ctx = multiprocessing.get_context(method)
    q = mp.Queue()
    procs = [ctx.Process(target=workers.put_and_exit, args=(q, 5)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    got = sorted(q.get(timeout=30)[0] for _ in range(10))
    assert got == sorted(list(range(5)) * 2), "every message first"
    with pytest.raises(mp.DisconnectedError) as info:
        q.get()  # no timeout: it would wait forever without the error
    assert isinstance(info.value, EOFError) and isinstance(info.value, queue.Empty)
    with pytest.raises(queue.Empty):
        q.get_nowait()


def test_a_queue_that_never_left_the_process_waits_for_its_threads():
    q = mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert not isinstance(_raised(lambda: q.get(timeout=0.05)), mp.DisconnectedError)


def _raised(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 - the test looks at which one
        return e
    return None


def test_handles_through_a_multiprocessing_queue():
    # Pickled outside a process start: the resource sharer hands the fd over.
    ctx = multiprocessing.get_context("spawn")
    carrier = ctx.SimpleQueue()
    inner = mp.Queue()
    carrier.put(inner)
    got = carrier.get()
    got.put("through a parcel")
    assert inner.get(timeout=10) == "through a parcel"
    carrier.close()


def test_spawn_joins_workers():
    q = mp.Queue()
    assert mp.spawn(workers.raise_on, args=(-1, q), nprocs=3) is None
    assert sorted(q.get(timeout=10) for _ in range(3)) == [0, 1, 2]


def test_a_worker_that_raises_is_reported_with_rank_pid_and_traceback():
    q = mp.Queue()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(workers.raise_on, args=(1, q), nprocs=3)
    e = info.value
    assert e.error_index == 1 and e.rank == 1 and e.pid > 0 and e.pid != os.getpid()
    assert "ValueError: rank 1 found a NaN" in e.traceback
    assert "raise_on" in str(e)


def test_a_killed_worker_is_reported_with_rank_pid_and_signal():
    q = mp.Queue()
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(workers.kill_self_on, args=(2, q), nprocs=3)
    e = info.value
    assert e.error_index == 2 and e.pid > 0
    assert e.exit_code == -signal.SIGKILL and e.signal_name == "SIGKILL"
    # What it put before dying arrived: it lost nothing but what it held.
    ranks = set()
    while not q.empty():
        ranks.add(q.get())
    assert 2 in ranks


def test_an_exit_code_is_reported():
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(workers.exit_with, args=(3,), nprocs=1)
    assert info.value.exit_code == 3 and info.value.error_index == 0


def test_process_context_join_timeout():
    started, ev = mp.Queue(), mp.Event()
    ctx = mp.spawn(workers.block_forever, args=(started, ev), nprocs=2, join=False)
    assert len(ctx.pids()) == 2
    assert sorted(started.get(timeout=60)[0] for _ in range(2)) == [0, 1]
    assert ctx.join(timeout=0.05) is False
    ev.set()
    while not ctx.join(timeout=30):
        pass


@pytest.mark.parametrize("method", METHODS)
def test_an_exited_receiver_does_not_pin_its_blocks(method):
    """A child that still holds received tensors when it ends gives their blocks' uses
    back: the creator hands the same blocks out again (a pinned block never is)."""
    ctx = multiprocessing.get_context(method)
    arg, sent = mp.full((1 << 20,), 1.0), mp.full((1 << 20,), 2.0)  # 4 MiB: own blocks
    addrs = {arg.data_ptr(), sent.data_ptr()}
    q_in, q = mp.Queue(), mp.Queue()
    p = ctx.Process(target=workers.keep_until_exit, args=(arg, q_in, q))
    p.start()
    q_in.put(sent)
    assert q.get(timeout=60) == 3.0
    p.join(60)
    assert p.exitcode == 0
    del arg, sent
    gc.collect()
    again = [mp.empty((1 << 20,)) for _ in range(2)]
    assert {t.data_ptr() for t in again} == addrs
