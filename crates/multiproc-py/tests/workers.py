"""Worker functions for the tests' child processes (importable by the spawn and
forkserver start methods)."""

import os
import signal
import sys



import multiproc


def put_and_exit(q, n):
    """Puts ``n`` tensors and leaves at once (os._exit: no cleanup at all)."""
    for i in range(n):
        q.put((i, multiproc.full((256,), float(i))))
    os._exit(0)


def add_one(rank, t, lock, done):
    with lock:
        t += 1
    done.put(rank)


def echo(q_in, q_out):
    while True:
        item = q_in.get()
        if item is None:
            return
        q_out.put(item)


def write_and_signal(t, ev, value):
    t.fill_(value)
    ev.set()


def raise_on(rank, bad_rank, q):
    q.put(rank)
    if rank == bad_rank:
        raise ValueError(f"rank {rank} found a NaN")


def kill_self_on(rank, bad_rank, q):
    q.put(rank)
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)


def exit_with(rank, code):
    os._exit(code)


def sys_exit_with(rank, code):
    sys.exit(code)


def block_forever(rank, started, ev):
    started.put((rank, os.getpid()))
    ev.wait()


def get_from(rank, q, out):
    out.put(q.get())


def receive_tensor(t, q):
    q.put((t.sum().item(), t.shape, t.dtype))
    t.zero_()


def print_pid_and_wait(rank, ev):
    # One write: two workers' lines never interleave.
    os.write(1, b"%d\n" % os.getpid())
    ev.wait()


def barrier_then_put(rank, barrier, q):
    q.put((rank, barrier.wait(60)))


def consume_joinable(rank, q):
    while True:
        item = q.get()
        q.task_done()
        if item is None:
            return


def wait_on_condition(rank, cond, flag, ready):
    with cond:
        ready.put(rank)
        assert cond.wait_for(lambda: flag.is_set(), timeout=60)


def count_with_lock(rank, lock, counter, n):
    for _ in range(n):
        with lock:
            counter += 1


def wait_then_report(cond, ready, out, rank):
    """Waits on ``cond`` once (the ``ready`` put is made with the lock held, so the
    parent knows this waiter waits once it can take the lock), then reports."""
    with cond:
        ready.put(rank)
        notified = cond.wait(timeout=60)
    out.put((rank, notified))


def hold_lock_until(lock, taken, done):
    """Holds ``lock`` from ``taken`` until ``done`` is set."""
    with lock:
        taken.set()
        assert done.wait(60)


def wait_for_count(cond, counter, target, out):
    with cond:
        ok = cond.wait_for(lambda: int(counter.item()) >= target, timeout=60)
        out.put((ok, int(counter.item())))


KEPT = []


def keep_until_exit(t, q_in, q):
    """Keeps a tensor argument and one received tensor in a global until the process
    ends (a fork/forkserver child ends with os._exit, which frees nothing)."""
    KEPT.append(t)
    KEPT.append(q_in.get())
    q.put(float(t[0]) + float(KEPT[1][0]))


def add_one_from_queue(rank, q, done):
    msg = q.get(timeout=60)
    msg["t"] += 1
    done.put("added")


def add_one_to(rank, t):
    with torch_no_grad():
        t += 1


def torch_no_grad():
    import torch

    return torch.no_grad()


def put_one(q, item):
    q.put(item)


def put_when_told(q, go):
    go.wait(60)
    for i in range(3):
        q.put(("from the fork child", i))
