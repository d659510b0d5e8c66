"""A file_system tree whose shm manager is SIGKILLed (run by test_file_system.py): the
next named block starts a manager again (the library runs this interpreter on the
manager's entry point, as `multiproc.set_sharing_strategy` arranged), and a child still
gets tensors by name."""
import json
import multiprocessing
import os
import signal
import sys
import time

import multiproc as mp


def manager_pids(addr):
    """Processes whose command line or environment names the tree's manager address and
    that run the manager's entry point."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if b"_run_shm_manager" in cmd and addr.encode() in cmd + env:
            found.append(int(pid))
    return found


def child(q_in, q_out):
    t = q_in.get()
    q_out.put(float(t.sum()))


if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    addr = os.environ["MULTIPROC_SHM_MANAGER"]
    first = mp.full((1 << 16,), 1.0)
    killed = manager_pids(addr)
    assert killed, "no manager found for " + addr
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"
              for p in killed):
        assert time.monotonic() < deadline, "the manager did not die"
        time.sleep(0.01)
    ctx = multiprocessing.get_context("spawn")
    q_in, q_out = mp.Queue(), mp.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    second = mp.full((1 << 16,), 2.0)  # a new name, with the manager gone
    q_in.put(second)
    assert q_out.get(timeout=60) == 2.0 * (1 << 16)
    p.join(60)
    assert p.exitcode == 0
    print(json.dumps({"addr": addr, "killed": killed, "again": manager_pids(addr)}))
