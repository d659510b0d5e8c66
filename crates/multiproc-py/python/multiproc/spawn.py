"""``spawn(fn, args, nprocs)``: torch.multiprocessing's, with the failed worker's rank,
pid and traceback in the exception.

Workers are Python processes started by ``multiprocessing`` (the ``spawn`` start
method by default); a worker that raises sends its traceback through a multiproc
``SimpleQueue`` before it exits (a put is delivered once it returns, so exiting right
after loses nothing), and one that dies of a signal or ``os._exit`` is reported with
its exit code or signal name.
"""

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import traceback

from ._handles import SimpleQueue

__all__ = [
    "ProcessContext", "ProcessException", "ProcessExitedException",
    "ProcessRaisedException", "spawn", "start_processes",
]


class ProcessException(Exception):
    """A worker failed: ``error_index`` (its rank) and ``pid`` say which one."""

    def __init__(self, msg, error_index, pid):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.pid = pid

    @property
    def rank(self):
        return self.error_index

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """A worker raised an exception; ``traceback`` is its formatted traceback (also in
    the message)."""

    def __init__(self, msg, error_index, error_pid, traceback=None):
        super().__init__(msg, error_index, error_pid)
        self.traceback = traceback

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid, self.traceback)


class ProcessExitedException(ProcessException):
    """A worker exited with a non-zero code or was killed by a signal."""

    def __init__(self, msg, error_index, error_pid, exit_code, signal_name=None):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid, self.exit_code,
                            self.signal_name)


def _wrap(fn, i, args, error_queue):
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the parent was interrupted too, and stops every worker
    except Exception:
        # As torch's: `sys.exit(n)` is not an error raised but an exit (code 0 a
        # success, another code a `ProcessExitedException`), so `SystemExit` passes.
        error_queue.put((i, os.getpid(), traceback.format_exc()))
        sys.exit(1)


class ProcessContext:
    """The workers of one ``start_processes`` call."""

    def __init__(self, processes, error_queue):
        self.error_queue = error_queue
        self.processes = processes
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}

    def pids(self):
        return [int(p.pid) for p in self.processes]

    def _stop_all(self):
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()

    def join(self, timeout=None):
        """Waits for the workers: True when all have exited cleanly, False when
        ``timeout`` passed with some still running. On the first failure stops the
        others and raises ``ProcessRaisedException`` or ``ProcessExitedException``."""
        if not self.sentinels:
            return True
        ready = multiprocessing.connection.wait(list(self.sentinels), timeout=timeout)
        error_index = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                error_index = index
                break
        if error_index is None:
            return not self.sentinels
        self._stop_all()
        self.sentinels.clear()
        raised = {}
        while not self.error_queue.empty():
            rank, pid, tb = self.error_queue.get()
            raised[rank] = (pid, tb)
        failed = self.processes[error_index]
        if error_index in raised:
            pid, tb = raised[error_index]
            msg = f"\n\n-- Process {error_index} (pid {pid}) terminated with the following error:\n{tb}"
            raise ProcessRaisedException(msg, error_index, pid, tb)
        code = failed.exitcode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"<unknown signal {-code}>"
            raise ProcessExitedException(
                f"process {error_index} (pid {failed.pid}) terminated with signal {name}",
                error_index, failed.pid, code, name)
        raise ProcessExitedException(
            f"process {error_index} (pid {failed.pid}) terminated with exit code {code}",
            error_index, failed.pid, code)


def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """Starts ``nprocs`` processes running ``fn(rank, *args)``; joins them when
    ``join``, else returns a ``ProcessContext``."""
    mp = multiprocessing.get_context(start_method)
    error_queue = SimpleQueue()
    processes = []
    context = None
    try:
        for i in range(nprocs):
            p = mp.Process(target=_wrap, args=(fn, i, args, error_queue), daemon=daemon)
            p.start()
            processes.append(p)
        context = ProcessContext(processes, error_queue)
        if not join:
            return context
        while not context.join():
            pass
    except BaseException:
        # Ctrl-C or a failure to start: no worker outlives this call.
        ProcessContext(processes, error_queue)._stop_all()
        raise
    return None


def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """torch.multiprocessing.spawn: ``fn(rank, *args)`` in ``nprocs`` new processes."""
    return start_processes(fn, args, nprocs, join, daemon, start_method)
