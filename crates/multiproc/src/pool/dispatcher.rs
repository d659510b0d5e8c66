//! The dispatcher: the parent's thread that owns the worker processes, hands each
//! one chunk at a time, routes task outcomes to their jobs and replaces a worker
//! that died (failing exactly the task it was running).

use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::builder::PoolBuilder;
use super::protocol::{ChunkCall, PoolMsg, WorkerArgs};
use super::state::{Pending, Shared, State};
use super::worker::pool_worker;
use crate::error::{Error, Result, TaskFailure};
use crate::process::Process;
use crate::process::code::Code;
use crate::queue::{Connection, pipe};
use crate::wire::Opaque;

/// How often the dispatcher checks on workers when nothing else wakes it.
pub(super) const TICK: Duration = Duration::from_millis(100);

/// A chunk on a worker, and how far it got.
pub(super) struct Running {
    pub(super) job: u64,
    pub(super) first: usize,
    pub(super) len: usize,
    /// The next task of the chunk to report (its index in the job): the one running.
    pub(super) next: usize,
    /// What it takes to rerun the chunk's unstarted tasks elsewhere, when its
    /// arguments are plain data (see the module docs).
    pub(super) retry: Option<(ChunkCall, Opaque)>,
}

/// One worker process and the parent's end of its pipe.
pub(super) struct Worker {
    pub(super) process: Process,
    pub(super) conn: Connection<PoolMsg>,
    /// The chunk it is running.
    pub(super) running: Option<Running>,
    pub(super) chunks_done: u64,
    pub(super) rank: usize,
}

impl Worker {
    pub(super) fn start(rank: usize, options: &PoolBuilder) -> Result<Self> {
        let (here, there) = pipe::<PoolMsg>()?;
        let args = WorkerArgs {
            conn: there,
            initializer: options.initializer.map(Code::of),
            init_with: options.init_with.as_ref().map(|i| i.call()).transpose()?,
            max_tasks: options.max_tasks_per_child,
        };
        let process = Process::builder(pool_worker, rank, args)
            .name(format!("PoolWorker-{rank}"))
            .start_method(options.start_method)
            .daemon(true)
            .start()?;
        // The builder dropped its copy of the worker's end when it started, so the pipe
        // closes the moment the worker dies.
        Ok(Self {
            process,
            conn: here,
            running: None,
            chunks_done: 0,
            rank,
        })
    }

    /// Why the worker ended, for the error of the chunk it was running.
    pub(super) fn death_cause(&mut self) -> String {
        let pid = self.process.pid();
        match self.process.join_timeout(Duration::from_secs(5)) {
            Ok(status) => match self.process.error() {
                // It exited 0 without a report: say why (a missing `init`).
                Some(e) if status.success() => format!("pool worker (pid {pid}): {e}"),
                // What it raised says what it was doing (the task, or its initializer).
                Some(e) => format!("pool worker (pid {pid}) {status}: {e}"),
                None => format!("pool worker (pid {pid}) {status} while running it"),
            },
            Err(e) if e.is_timeout() => {
                let _ = self.process.kill();
                let _ = self.process.join_timeout(Duration::from_secs(5));
                format!("pool worker (pid {pid}) stopped answering while running it and was killed")
            }
            Err(e) => format!("pool worker (pid {pid}) was lost while running it: {e}"),
        }
    }
}

/// The parent's thread that feeds workers and routes results.
pub(super) struct Dispatcher {
    pub(super) shared: Arc<Shared>,
    pub(super) wake_rx: Connection<u8>,
    pub(super) workers: Vec<Worker>,
    pub(super) options: PoolBuilder,
}

impl Dispatcher {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn run(mut self) {
        loop {
            let (terminate, closed) = {
                let s = self.lock();
                (s.terminate, s.closed)
            };
            if terminate {
                self.shutdown(true);
                break;
            }
            if let Err(e) = self.feed() {
                tracing::warn!("pool dispatcher: {e}");
            }
            if closed
                && self.lock().queue.is_empty()
                && self.workers.iter().all(|w| w.running.is_none())
            {
                self.shutdown(false);
                break;
            }
            self.wait_and_collect();
        }
        let mut state = self.lock();
        // Fail whatever is still queued or waited for.
        state.queue.clear();
        state.jobs.clear();
        state.finished = true;
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Gives every idle worker the next queued chunk.
    pub(super) fn feed(&mut self) -> Result<()> {
        for i in 0..self.workers.len() {
            if self.workers[i].running.is_some() {
                continue;
            }
            let Some(chunk) = self.lock().queue.pop_front() else {
                return Ok(());
            };
            let running = Running {
                job: chunk.job,
                first: chunk.first,
                len: chunk.len,
                next: chunk.first + chunk.skip,
                retry: chunk.args.try_clone_plain().map(|a| (chunk.call, a)),
            };
            let msg = PoolMsg::Chunk {
                job: chunk.job,
                first: chunk.first,
                skip: chunk.skip,
                call: chunk.call,
                args: chunk.args,
            };
            match self.workers[i].conn.send(msg) {
                Ok(()) => self.workers[i].running = Some(running),
                Err(back) => {
                    // The worker is gone; requeue the chunk and let the death be handled.
                    if let PoolMsg::Chunk {
                        job,
                        first,
                        skip,
                        call,
                        args,
                    } = back.item
                    {
                        self.lock().queue.push_front(Pending {
                            job,
                            first,
                            len: running.len,
                            skip,
                            call,
                            args,
                        });
                    }
                    self.replace(i, None);
                }
            }
        }
        Ok(())
    }

    /// Sleeps until a worker answers, a worker dies, a caller submits, or a tick.
    pub(super) fn wait_and_collect(&mut self) {
        let mut fds = vec![self.wake_rx.as_fd()];
        fds.extend(self.workers.iter().map(|w| w.conn.as_fd()));
        let ready = crate::sys::socket::poll_readable(&fds, Some(Instant::now() + TICK));
        drop(fds);
        let ready = match ready {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("pool dispatcher poll: {e}");
                vec![false; self.workers.len() + 1]
            }
        };
        if ready.first().copied().unwrap_or(false) {
            while let Ok(Some(_)) = self.wake_rx.try_recv() {}
        }
        for i in 0..self.workers.len() {
            if ready.get(i + 1).copied().unwrap_or(false) {
                self.collect(i);
            } else if !self.workers[i].process.is_alive() {
                // Forked workers share fds with their siblings, so a death may not
                // close the pipe: the liveness check catches it. Take in what it
                // reported before it died first.
                self.collect(i);
                if self.workers[i].process.is_alive() {
                    continue; // `collect` replaced it (its pipe closed)
                }
                let cause = self.workers[i].death_cause();
                self.replace(i, Some(cause));
            }
        }
    }

    /// Reads everything worker `i` has sent: results, the end of a chunk, or the end of
    /// its pipe (then it is replaced).
    pub(super) fn collect(&mut self, i: usize) {
        loop {
            match self.workers[i].conn.try_recv() {
                Ok(Some(PoolMsg::TaskDone {
                    job,
                    index,
                    outcome,
                })) => {
                    let Some(running) = self.workers[i].running.as_mut() else {
                        continue;
                    };
                    let in_chunk = running.first..running.first + running.len;
                    if job != running.job || index != running.next || !in_chunk.contains(&index) {
                        tracing::warn!(
                            "pool worker {} reported task {index} of job {job}, which it was not running",
                            self.workers[i].rank
                        );
                        continue;
                    }
                    running.next += 1;
                    let result = outcome.map_err(|(reason, message)| Error::TaskFailed {
                        index,
                        reason,
                        message,
                    });
                    self.route(job, index, vec![result]);
                }
                Ok(Some(PoolMsg::Done {
                    job,
                    first,
                    outcome,
                })) => {
                    let Some(running) = self.workers[i].running.take() else {
                        continue;
                    };
                    if (running.job, running.first) != (job, first) {
                        tracing::warn!(
                            "pool worker {} ended a chunk it was not running",
                            self.workers[i].rank
                        );
                    }
                    // Tasks it never reported: the chunk could not run (`Err`), or a
                    // worker that lost track of them.
                    let message = outcome
                        .err()
                        .unwrap_or_else(|| "its pool worker never reported it".into());
                    self.fail_rest(&running, running.next, TaskFailure::NotRun, &message);
                    self.workers[i].chunks_done += 1;
                    if self
                        .options
                        .max_tasks_per_child
                        .is_some_and(|m| self.workers[i].chunks_done >= m)
                    {
                        // It exits by itself after this chunk; start its successor.
                        let _ = self.workers[i].process.join_timeout(Duration::from_secs(5));
                        self.replace(i, None);
                        return;
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(Error::Disconnected(_)) => {
                    let cause = self.workers[i].death_cause();
                    self.replace(i, Some(cause));
                    return;
                }
                Err(e) => {
                    tracing::warn!("pool worker {}: {e}", self.workers[i].rank);
                    return;
                }
            }
        }
    }

    /// Fails tasks `from..` of a chunk with `reason` and `message`.
    pub(super) fn fail_rest(
        &self,
        running: &Running,
        from: usize,
        reason: TaskFailure,
        message: &str,
    ) {
        let end = running.first + running.len;
        if from >= end {
            return;
        }
        let results = (from..end)
            .map(|index| {
                Err(Error::TaskFailed {
                    index,
                    reason,
                    message: message.to_string(),
                })
            })
            .collect();
        self.route(running.job, from, results);
    }

    pub(super) fn route(&self, job: u64, first: usize, results: Vec<Result<Opaque>>) {
        let mut state = self.lock();
        let Some(entry) = state.jobs.get_mut(&job) else {
            return;
        };
        let n = results.len();
        entry.tx.send((first, results));
        if let Some(left) = &mut entry.left {
            *left = left.saturating_sub(n);
            if *left == 0 {
                // Its last outcome is with the receiver (or freed with it, if the
                // handle was dropped unread).
                state.jobs.remove(&job);
            }
        }
    }

    /// Replaces worker `i` by a fresh process. Of the chunk it was running, the task
    /// it was running fails with `cause`; the ones after it are queued again from
    /// there, or fail when their arguments cannot be sent twice.
    pub(super) fn replace(&mut self, i: usize, cause: Option<String>) {
        if let Some(running) = self.workers[i].running.take() {
            let end = running.first + running.len;
            if running.next < end {
                let message = cause.unwrap_or_else(|| "its pool worker was lost".into());
                let index = running.next;
                self.route(
                    running.job,
                    index,
                    vec![Err(Error::TaskFailed {
                        index,
                        reason: TaskFailure::WorkerDied,
                        message,
                    })],
                );
                let rest = index + 1;
                if rest < end {
                    match &running.retry {
                        Some((call, args)) => {
                            if let Some(args) = args.try_clone_plain() {
                                self.lock().queue.push_front(Pending {
                                    job: running.job,
                                    first: running.first,
                                    len: running.len,
                                    skip: rest - running.first,
                                    call: *call,
                                    args,
                                });
                            }
                        }
                        None => self.fail_rest(
                            &running,
                            rest,
                            TaskFailure::NotRun,
                            &format!(
                                "not run: its pool worker died while running task {index} of \
                                 the same chunk, and its arguments hold shared handles, which \
                                 cannot be sent twice (submit it again)"
                            ),
                        ),
                    }
                }
            }
        }
        let _ = self.workers[i].process.kill();
        let _ = self.workers[i].process.join_timeout(Duration::from_secs(5));
        if self.lock().terminate {
            return;
        }
        let rank = self.workers[i].rank;
        match Worker::start(rank, &self.options) {
            Ok(w) => self.workers[i] = w,
            Err(e) => tracing::error!("cannot replace pool worker {rank}: {e}"),
        }
    }

    /// Stops every worker: politely (a `Stop` message, then a grace period) unless
    /// `now`, then by SIGKILL.
    pub(super) fn shutdown(&mut self, now: bool) {
        if !now {
            for w in &self.workers {
                let _ = w.conn.send_timeout(PoolMsg::Stop, Duration::from_secs(1));
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            for w in &mut self.workers {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = w.process.join_timeout(left);
            }
        }
        for w in &mut self.workers {
            if w.process.is_alive() {
                let _ = w.process.kill();
            }
            let _ = w.process.join_timeout(Duration::from_secs(5));
        }
    }
}
