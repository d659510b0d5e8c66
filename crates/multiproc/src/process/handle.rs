//! [`Process`]: one worker process, like `multiprocessing.Process` — the public handle
//! over a [`Child`] once started.

use std::fmt;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::child::{Child, JobSpec, worker_env};
use super::exit_status::ExitStatus;
use super::job::{JobHeader, default_name};
use super::start_method::StartMethod;
use super::worker_outcome::IntoWorkerOutcome;
use crate::error::{Error, Result};
use crate::queue::WaitSource;
use crate::sys::deadline_after;
use crate::wire::{self, Encoded};

/// One worker process, like `multiprocessing.Process`.
///
/// Build it with [`Process::new`], choose a [`StartMethod`] and whether it is a daemon,
/// then [`start`](Process::start) it and [`join`](Process::join) it:
///
/// ```no_run
/// use multiproc::{Process, StartMethod};
///
/// fn work(rank: usize, name: String) {
///     println!("{name} runs as rank {rank}");
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     let mut p = Process::new(work, 0, "worker".to_string()).start_method(StartMethod::Spawn);
///     p.start()?;
///     let status = p.join()?;
///     assert!(status.success());
///     Ok(())
/// }
/// ```
///
/// # Dropping a running process
///
/// Dropping a `Process` that still runs: a daemon is killed (SIGKILL); a non-daemon is
/// waited for, as Python joins non-daemonic children at exit. Either way it is reaped:
/// no zombie remains. Whatever happens to the parent, the worker dies with it (its
/// parent-death signal is SIGKILL).
///
/// A non-daemon that never ends — a reader blocked on a full queue whose consumers
/// died, say — makes that drop wait forever, and with it an early `return Err(..)`
/// from `main`. So the drop does not wait silently: after 3 s, and every 30 s after
/// that, it says on stderr (and as a `tracing` warning) which process it waits for, by
/// name and pid. To not wait at all, end what you start before you drop it:
///
/// - [`join`](Self::join) it with a timeout, and [`terminate`](Self::terminate) or
///   [`kill`](Self::kill) it when the timeout passes;
/// - or make it a [`daemon`](Self::daemon), which dropping kills.
///
/// A [`ProcessContext`](crate::ProcessContext) drops its workers the same way.
pub struct Process {
    rank: usize,
    method: StartMethod,
    daemon: bool,
    world_size: Option<usize>,
    name: String,
    pending: Option<(JobHeader, Result<Encoded>)>,
    child: Option<Child>,
}

impl Process {
    /// A process that will run `worker(rank, args)`. The arguments are encoded now (any
    /// queue, event or tensor inside travels as a handle); an encoding error is returned
    /// by [`start`](Self::start).
    ///
    /// `worker` must be a function (or a closure capturing nothing) of this executable.
    pub fn new<A, R>(worker: fn(usize, A) -> R, rank: usize, args: A) -> Process
    where
        A: Serialize + DeserializeOwned,
        R: IntoWorkerOutcome,
    {
        Process {
            rank,
            method: StartMethod::default(),
            daemon: false,
            world_size: None,
            name: default_name(rank),
            pending: Some((JobHeader::new(worker, rank), wire::encode(&args))),
            child: None,
        }
    }

    /// Sets the start method (default [`StartMethod::Spawn`]).
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.method = method;
        self
    }

    /// Makes it a daemon: killed when its `Process` is dropped (default: waited for).
    pub fn daemon(mut self, daemon: bool) -> Self {
        self.daemon = daemon;
        self
    }

    /// Names the process (default `Process-RANK`); the worker sees it as
    /// [`current_process().name`](crate::current_process), and
    /// [`active_children`](crate::active_children) lists it under it.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        if let Some((header, _)) = &mut self.pending {
            header.name.clone_from(&self.name);
        }
        self
    }

    /// Its name (see [`with_name`](Self::with_name)).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets `WORLD_SIZE` in the worker's environment (`RANK` and `LOCAL_RANK` are always
    /// set to its rank).
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.world_size = Some(world_size);
        self
    }

    /// Starts the worker.
    ///
    /// # Errors
    /// When the arguments could not be encoded, the process could not be created (fd or
    /// process limits), or it was already started ([`Error::InvalidArgument`]).
    pub fn start(&mut self) -> Result<()> {
        let Some((header, args)) = self.pending.take() else {
            return Err(Error::InvalidArgument(format!(
                "{} was already started; a Process starts once",
                self.describe()
            )));
        };
        self.child = Some(Child::start(JobSpec {
            header,
            args: args?,
            method: self.method,
            env: worker_env(self.rank, self.world_size),
            daemon: self.daemon,
        })?);
        Ok(())
    }

    /// Its rank (the worker's first argument).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether it is a daemon.
    pub fn is_daemon(&self) -> bool {
        self.daemon
    }

    /// Its process id, once started.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.pid)
    }

    /// Python's `Process.sentinel`: once started, a descriptor (its pidfd) that becomes
    /// readable when the process exits, to wait on together with pipes through
    /// [`connection::wait`](crate::connection::wait) (which also takes the `Process`
    /// itself, beside queues). Waiting on it does not reap the process:
    /// [`join`](Self::join) does.
    pub fn sentinel(&self) -> Option<BorrowedFd<'_>> {
        self.child.as_ref().map(|c| c.pidfd())
    }

    /// Whether it has been started and has not exited yet.
    pub fn is_alive(&self) -> bool {
        self.child.as_ref().is_some_and(Child::is_alive)
    }

    /// Waits until it exits, as long as it takes, and returns its exit status. Joining
    /// an exited process again returns the same status.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it was never started; an [`Error::Os`] when
    /// waiting failed.
    pub fn join(&mut self) -> Result<ExitStatus> {
        self.join_within(None)
    }

    /// Waits until it exits, at most `timeout`, and returns its exit status (Python's
    /// `join(timeout)`, which returns with the process still running where this is an
    /// error).
    ///
    /// # Errors
    /// [`Error::Timeout`] when it still runs at the deadline; otherwise as
    /// [`join`](Self::join).
    pub fn join_timeout(&mut self, timeout: Duration) -> Result<ExitStatus> {
        self.join_within(Some(timeout))
    }

    fn join_within(&mut self, timeout: Option<Duration>) -> Result<ExitStatus> {
        let child = self.started_mut("join")?;
        child.wait(deadline_after(timeout))?;
        child.status().ok_or_else(|| {
            Error::timeout(
                format!("a join of {}, which still runs", child.describe()),
                timeout,
            )
        })
    }

    /// Waits until it exits, as [`join`](Self::join) does, without
    /// blocking a thread (feature `async`; any executor): the fd reactor watches its
    /// pidfd (and its report). Cancel-safe.
    ///
    /// # Errors
    /// As [`join`](Self::join), and when the fd reactor cannot be started.
    #[cfg(feature = "async")]
    pub async fn join_async(&mut self) -> Result<ExitStatus> {
        use crate::sys::reactor::{self, Parked, Ready, Step};
        self.started_mut("join")?;
        let mut parked: Option<Parked> = None;
        std::future::poll_fn(|cx| {
            reactor::poll_step(
                cx,
                &mut parked,
                || {
                    if let Some(status) = self.exit_status() {
                        return Step::Done(Ok(status));
                    }
                    // Its report and its exit (the future's own copies: the next
                    // step reaps through `self`).
                    match self.child.as_ref().map(Child::watch_fds_owned) {
                        Some(Ok(fds)) => Step::Fds(fds, Ready::Readable),
                        Some(Err(e)) => Step::Done(Err(e)),
                        None => Step::Done(Err(Error::InvalidArgument(
                            "join of a process not started".into(),
                        ))),
                    }
                },
                Err,
            )
        })
        .await
    }

    /// Its exit status if it has exited (reaping it), without waiting.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        if let Err(e) = child.collect() {
            tracing::warn!(pid = child.pid, "multiproc: checking a worker failed: {e}");
        }
        child.status()
    }

    /// Sends SIGTERM (a no-op once it has exited).
    ///
    /// # Errors
    /// When it was never started, or the signal could not be sent.
    pub fn terminate(&mut self) -> Result<()> {
        self.started_mut("terminate")?.signal(libc::SIGTERM)
    }

    /// Sends SIGKILL (a no-op once it has exited).
    ///
    /// # Errors
    /// As [`terminate`](Self::terminate).
    pub fn kill(&mut self) -> Result<()> {
        self.started_mut("kill")?.signal(libc::SIGKILL)
    }

    /// Once it has exited: `None` if it succeeded, else the error that says how it
    /// failed ([`Error::ProcessRaised`] with its panic message, or
    /// [`Error::ProcessExited`] with its exit code or signal). `None` while it runs.
    ///
    /// It looks for the exit itself, without waiting (reaping the process as
    /// [`exit_status`](Self::exit_status) does), so a loop that polls `error()` sees a
    /// failure as soon as [`is_alive`](Self::is_alive) would.
    pub fn error(&mut self) -> Option<Error> {
        self.exit_status();
        let child = self.child.as_ref()?;
        if !child.has_exited() || !child.failed() {
            return None;
        }
        child.error(Vec::new())
    }

    fn started_mut(&mut self, what: &str) -> Result<&mut Child> {
        let who = self.describe();
        self.child.as_mut().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "cannot {what} {who}: it was not started (call start first)"
            ))
        })
    }

    /// It as messages name it (see `job::describe`): with its pid once started.
    fn describe(&self) -> String {
        match &self.child {
            Some(child) => child.describe(),
            None if self.name == default_name(self.rank) => format!("process {}", self.rank),
            None => format!("{} (rank {})", self.name, self.rank),
        }
    }
}

impl crate::queue::Waitable for Process {
    /// Ready once it has exited (its [`sentinel`](Process::sentinel)); never, before it
    /// is started.
    fn wait_source(&self) -> WaitSource<'_> {
        match &self.child {
            Some(child) => WaitSource::fd(child.pidfd()),
            None => WaitSource::never(),
        }
    }
}

impl fmt::Debug for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Process")
            .field("rank", &self.rank)
            .field("name", &self.name)
            .field("start_method", &self.method)
            .field("daemon", &self.daemon)
            .field("pid", &self.pid())
            .field("status", &self.child.as_ref().and_then(Child::status))
            .finish()
    }
}
