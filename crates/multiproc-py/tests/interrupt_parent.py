"""A parent that Ctrl-C interrupts: in ``spawn`` (mode "spawn") or in a blocking
``Queue.get`` (mode "get"). Prints its workers' pids, then "ready"."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import multiproc as mp  # noqa: E402
import workers  # noqa: E402


def main(mode):
    if mode == "get":
        q = mp.Queue()
        print("ready", flush=True)
        q.get()
        return
    mp.spawn(workers.print_pid_and_wait, args=(mp.Event(),), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1])
