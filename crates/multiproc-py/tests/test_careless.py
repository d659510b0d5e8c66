"""What a careless or porting user meets: timeouts of every odd value, a daemon thread
left waiting at exit, `sys.exit` in a worker, shapes and fill values, masked arrays,
odd strings, a barrier that breaks, handles put in a message."""

import math
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy
import pytest
import torch

import multiproc as mp
import workers

HERE = os.path.dirname(__file__)


def sleeping_state(pid):
    """The one-letter state of process `pid` ('S' while it sleeps in a wait)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def run_script(source, timeout=60):
    """Runs `source` in a fresh interpreter; its exit status, stdout and stderr."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], cwd=HERE,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


# ----- timeouts -----

def test_a_negative_timeout_is_one_try_as_in_multiprocessing():
    q = mp.Queue()
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=-1)
    full = mp.Queue(1)
    full.put(1)
    with pytest.raises(queue.Full):
        full.put(2, timeout=-5)
    lock = mp.Lock()
    lock.acquire()
    assert lock.acquire(timeout=-1) is False
    lock.release()
    assert mp.Event().wait(-1) is False
    assert mp.Semaphore(0).acquire(timeout=-0.5) is False
    assert time.monotonic() - started < 5, "a negative timeout waited"
    assert full.get(timeout=-1) == 1


def test_a_nan_timeout_is_a_value_error():
    with pytest.raises(ValueError, match="NaN"):
        mp.Queue().get(timeout=math.nan)
    with pytest.raises(ValueError, match="NaN"):
        mp.Event().wait(math.nan)
    with pytest.raises(ValueError, match="NaN"):
        mp.Barrier(2).wait(math.nan)


@pytest.mark.parametrize("huge", [math.inf, 1e300, 1e19])
def test_a_timeout_too_long_for_the_clock_waits_without_a_deadline(huge):
    q = mp.Queue()
    q.put("x")
    assert q.get(timeout=huge) == "x"
    e = mp.Event()
    e.set()
    assert e.wait(huge) is True
    lock = mp.Lock()
    assert lock.acquire(timeout=huge) is True
    lock.release()
    assert mp.Barrier(1).wait(huge) == 0
    a, b = mp.Pipe()
    a.send(1)
    assert b.poll(huge) and b.recv() == 1
    a.close()
    b.close()


# ----- a thread left waiting when the interpreter ends -----

@pytest.mark.parametrize("wait", ["q.get()", "mp.SimpleQueue().get()", "mp.Event().wait()",
                                  "held.acquire()", "mp.Pipe()[1].recv()"])
def test_a_daemon_thread_left_waiting_does_not_abort_the_exit(wait):
    status, out, err = run_script(f"""
        import threading, time
        import multiproc as mp
        q = mp.Queue()
        held = mp.Lock()
        held.acquire()
        threading.Thread(target=lambda: {wait}, daemon=True).start()
        time.sleep(0.3)
        print("done", flush=True)
    """)
    assert (status, out.strip()) == (0, "done"), err


def test_daemon_threads_spinning_on_short_waits_do_not_abort_the_exit():
    # Each short wait takes the GIL back: without the package's exit hook, one of them
    # takes it during finalization (an abort in every run of this script).
    status, out, err = run_script("""
        import threading, time
        import multiproc as mp
        q, ev = mp.Queue(), mp.Event()
        def on_queue():
            while True:
                try:
                    q.get(timeout=0.001)
                except Exception:
                    pass
        def on_event():
            while True:
                ev.wait(0.0005)
        for _ in range(3):
            threading.Thread(target=on_queue, daemon=True).start()
            threading.Thread(target=on_event, daemon=True).start()
        time.sleep(0.2)
        print("done", flush=True)
    """)
    assert (status, out.strip()) == (0, "done"), err


# ----- spawn -----

@pytest.mark.parametrize("code", [0, None])
def test_sys_exit_0_in_a_worker_is_a_success(code):
    assert mp.spawn(workers.sys_exit_with, args=(code,), nprocs=2) is None


def test_sys_exit_3_in_a_worker_is_an_exit_code_not_a_raise():
    with pytest.raises(mp.ProcessExitedException) as e:
        mp.spawn(workers.sys_exit_with, args=(3,), nprocs=1)
    assert e.value.exit_code == 3


# ----- tensors -----

def test_full_stores_integers_exactly_and_infers_the_dtype_as_torch():
    for v in (2**53 + 1, 2**63 - 1, -2**63):
        t = mp.full((2,), v, dtype=torch.int64)
        assert t.tolist() == [v, v]
    assert mp.full((1,), 7).dtype == torch.int64
    assert mp.full((1,), True).dtype == torch.bool
    assert mp.full((1,), 0.5).dtype == torch.float32
    with pytest.raises(RuntimeError):
        mp.full((1,), 2**63, dtype=torch.int64)


def test_bad_shapes_are_refused_as_torch_refuses_them():
    for bad in ("12", b"12", [2.7, 3.9], 1e3, [2, "3"]):
        with pytest.raises(TypeError, match="shape"):
            mp.zeros(bad)
    with pytest.raises(ValueError, match="negative"):
        mp.empty(3, -2)
    with pytest.raises(ValueError, match="negative"):
        mp.full((-1,), 1.0)
    assert mp.zeros(numpy.int64(3), 2).shape == (3, 2)
    assert mp.zeros(torch.Size([2, 3])).shape == (2, 3)


def test_a_masked_array_keeps_its_mask():
    q = mp.Queue()
    a = numpy.ma.masked_array([1, 2, 3], mask=[False, True, False])
    q.put(a)
    got = q.get(timeout=30)
    assert isinstance(got, numpy.ma.MaskedArray)
    assert got.mask.tolist() == [False, True, False] and got.sum() == 4


def test_a_string_that_is_not_utf8_travels_exactly():
    name = os.fsdecode(b"caf\xe9.txt")  # a lone surrogate
    q = mp.Queue()
    q.put({"file": name})
    assert q.get(timeout=30) == {"file": name}


def test_a_tensor_torch_shares_stays_shared_as_with_torch():
    # `share_memory_()` of torch's own, then sent in a message and as an argument: the
    # workers' writes reach this process (a copy would lose them).
    t = torch.zeros(2)
    t.share_memory_()
    q, done = mp.Queue(), mp.Queue()
    q.put({"t": t})
    ctx = mp.spawn(workers.add_one_from_queue, args=(q, done), nprocs=1, join=False)
    assert done.get(timeout=60) == "added"
    while not ctx.join(30):
        pass
    assert t.tolist() == [1.0, 1.0]
    mp.spawn(workers.add_one_to, args=(t,), nprocs=1)
    assert t.tolist() == [2.0, 2.0]


def test_a_parameter_and_requires_grad_survive_a_queue_as_with_torch():
    q = mp.Queue()
    p = torch.nn.Parameter(torch.ones(3))
    leaf = torch.zeros(2, requires_grad=True)
    q.put((p, leaf, torch.ones(2)))
    got_p, got_leaf, plain = q.get(timeout=30)
    assert type(got_p) is torch.nn.Parameter and got_p.requires_grad
    assert got_leaf.requires_grad and not plain.requires_grad
    assert got_p.tolist() == [1.0, 1.0, 1.0]


# ----- barrier -----

def test_a_barrier_timeout_is_a_broken_barrier_error():
    b = mp.Barrier(2)
    with pytest.raises(threading.BrokenBarrierError):
        b.wait(0.1)
    assert b.broken
    with pytest.raises(mp.BrokenBarrierError):
        b.wait(5)
    fresh = mp.Barrier(3)
    assert (fresh.broken, fresh.n_waiting, fresh.parties) == (False, 0, 3)
    fresh.abort()
    with pytest.raises(threading.BrokenBarrierError):
        fresh.wait()


def test_ctrl_c_interrupts_a_barrier_wait_and_breaks_it():
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import multiproc as mp
        b = mp.Barrier(2)
        print("ready", flush=True)
        try:
            b.wait()
        except KeyboardInterrupt:
            print("interrupted", b.broken, flush=True)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        # Interrupt it once it sleeps in the wait (its state 'S' in /proc), not before.
        until = time.monotonic() + 30
        while sleeping_state(p.pid) != "S":
            assert time.monotonic() < until, "the barrier wait never started"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.communicate()
    assert out.strip() == "interrupted True", err


# ----- handles in messages -----

def test_a_handle_put_in_a_message_is_refused_with_what_to_do():
    q = mp.Queue()
    for handle in (mp.Lock(), mp.Event(), mp.Queue()):
        with pytest.raises(RuntimeError, match="pass it to the other process when it starts"):
            q.put(handle)


# ----- parcels and porting -----

def test_a_parcel_opened_as_another_queue_type_is_refused_saying_which():
    jq = mp.JoinableQueue()
    fd, parcel = mp.parcel_for_child(jq)
    try:
        with pytest.raises(mp.InvalidMessageError, match="received as a Queue is a JoinableQueue"):
            mp.open_parcel(os.dup(fd), mp.Queue)
    finally:
        parcel.close()
    fd, parcel = mp.parcel_for_child(mp.Queue())
    try:
        with pytest.raises(mp.InvalidMessageError, match="received as an Event is not"):
            mp.open_parcel(os.dup(fd), mp.Event)
    finally:
        parcel.close()
    fd, parcel = mp.parcel_for_child(jq)
    try:
        view = mp.open_parcel(os.dup(fd), mp.JoinableQueue)
    finally:
        parcel.close()
    view.put("job")
    assert jq.get(timeout=30) == "job"
    jq.task_done()
    assert jq.join(30) is not False


def test_the_rest_of_multiprocessing_is_there_as_in_torch():
    for name in ("Process", "Pool", "Manager", "get_context", "set_start_method",
                 "cpu_count", "current_process", "active_children"):
        assert getattr(mp, name) is getattr(multiprocessing, name), name
        assert name in mp.__all__
    assert mp.Queue is not multiprocessing.Queue  # multiproc's own stay


def test_a_message_may_nest_as_deep_as_a_rust_receiver_accepts():
    q = mp.Queue()
    deep = 7
    for _ in range(128):
        deep = [deep]
    q.put(deep)
    got = q.get(timeout=30)
    for _ in range(128):
        got = got[0]
    assert got == 7
    with pytest.raises(RecursionError, match="deeper than 128"):
        q.put([deep])


def test_negative_counts_are_clear_errors_or_nothing_as_in_threading():
    with pytest.raises(ValueError, match="semaphore initial value must be >= 0"):
        mp.Semaphore(-1)
    for parties in (0, -1):
        with pytest.raises(ValueError, match="at least 1 party"):
            mp.Barrier(parties)
    for cond in (mp.Condition(), mp.Condition(mp.Lock())):
        with cond:
            cond.notify(-1)  # wakes nobody, as threading's
            assert cond.wait(0) is False


def test_share_memory_moves_parameters_and_tensors_torch_shares():
    model = torch.nn.Linear(2, 2)
    leaf = torch.ones(3, requires_grad=True)
    shared = torch.zeros(2)
    shared.share_memory_()
    for t in (*model.parameters(), leaf, shared):
        kind, grad = type(t), t.requires_grad
        assert mp.share_memory_(t) is t
        s = t.untyped_storage()
        assert mp._native.is_shared_block(s.data_ptr(), s.nbytes())
        assert (type(t), t.requires_grad) == (kind, grad)
    q = mp.Queue()
    q.put(leaf.detach())  # now by handle
    got = q.get(timeout=30)
    assert got.data_ptr() == leaf.data_ptr()


def test_a_plain_tensor_passed_to_a_process_is_shared_as_torch_shares_it():
    # As torch.multiprocessing does: moved into shared memory in place, so the
    # worker's writes reach this process (importing multiproc changes nothing there).
    t = torch.zeros(3)
    view = t[1:]
    mp.spawn(workers.add_one_to, args=(t,), nprocs=1)
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert view.tolist() == [1.0, 1.0], "the storage itself moved: views follow"


def test_a_fork_child_that_inherited_a_queue_holds_it_as_its_own():
    # The queue went to a spawn worker (so it is not this process's alone any more),
    # which exited; a fork child inherits it (not pickled: a copy of this memory) and
    # puts once told to. The get below must wait for it, not raise DisconnectedError.
    q, go = mp.Queue(), mp.Event()
    s = multiprocessing.get_context("spawn").Process(target=workers.put_one, args=(q, "s"))
    s.start()
    s.join(60)
    assert q.get(timeout=30) == "s"
    f = multiprocessing.get_context("fork").Process(target=workers.put_when_told,
                                                    args=(q, go))
    f.start()
    threading.Timer(0.3, go.set).start()  # late: the get below is already waiting
    assert q.get() == ("from the fork child", 0)
    f.join(60)
    assert [q.get(timeout=30) for _ in range(2)] == [("from the fork child", 1),
                                                      ("from the fork child", 2)]
    with pytest.raises(mp.DisconnectedError):
        q.get()
