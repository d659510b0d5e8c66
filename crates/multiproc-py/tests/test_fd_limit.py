"""5,000 received tensors kept alive by a process at ``ulimit -n 256``: they work, or
the library raises FdLimitError and nothing is lost (every tensor arrives once, with
its contents)."""

import json
import os
import subprocess
import sys

import multiproc as mp

N = 5000
# Above the library's small-tensor size (64 KiB): every tensor is a block of its own.
ELEMENTS = 16 * 1024 + 16


def test_five_thousand_tensors_at_ulimit_256():
    q = mp.Queue()
    fd, parcel = mp.parcel_for_child(q)
    here = os.path.dirname(__file__)
    child = subprocess.Popen(
        [sys.executable, os.path.join(here, "fdlimit_consumer.py"), str(fd), str(N), "256"],
        pass_fds=[fd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parcel.close()
    try:
        for i in range(N):
            q.put((i, mp.full((ELEMENTS,), float(i))))
        out, err = child.communicate(timeout=100)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    print(result)
    assert result["received"] == N and result["wrong"] == []
    # Kept them all at once, or was told why not (FdLimitError) and went on.
    assert result["kept_at_once"] == N or result["fd_limit_errors"] > 0
