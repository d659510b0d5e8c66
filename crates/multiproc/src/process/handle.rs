//! [`Process`]: one worker process, like `multiprocessing.Process` — made by its
//! [`ProcessBuilder`], which starts it, so a `Process` is always a started worker.

use std::fmt;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::child::{Child, JobSpec, worker_env};
use super::exit_status::ExitStatus;
use super::job::JobHeader;
use super::start_method::StartMethod;
use super::worker_outcome::IntoWorkerOutcome;
use crate::error::{Error, Result};
use crate::queue::WaitSource;
use crate::sys::deadline_after;
use crate::wire::{self, Encoded};

/// The settings of one worker process, ending in [`start`](Self::start), which makes
/// the [`Process`]; from [`Process::builder`].
#[must_use = "a ProcessBuilder starts nothing until `.start()` is called"]
pub struct ProcessBuilder {
    header: JobHeader,
    args: Result<Encoded>,
    method: StartMethod,
    daemon: bool,
    world_size: Option<usize>,
}

impl ProcessBuilder {
    /// Names the process (default `Process-RANK`); the worker sees it as
    /// [`current_process().name`](crate::current_process), and
    /// [`active_children`](crate::active_children) lists it under it.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.header.name = name.into();
        self
    }

    /// Makes it a daemon: killed when its `Process` is dropped (default: waited for).
    pub fn daemon(mut self, daemon: bool) -> Self {
        self.daemon = daemon;
        self
    }

    /// Sets the start method (default [`StartMethod::Spawn`]).
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.method = method;
        self
    }

    /// Sets `WORLD_SIZE` in the worker's environment (`RANK` and `LOCAL_RANK` are always
    /// set to its rank).
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.world_size = Some(world_size);
        self
    }

    /// Starts the worker and returns its [`Process`].
    ///
    /// # Errors
    /// When the arguments could not be encoded, or the process could not be created (fd
    /// or process limits).
    pub fn start(self) -> Result<Process> {
        let ProcessBuilder {
            header,
            args,
            method,
            daemon,
            world_size,
        } = self;
        let rank = header.rank;
        let name = header.name.clone();
        let child = Child::start(JobSpec {
            header,
            args: args?,
            method,
            env: worker_env(rank, world_size),
            daemon,
        })?;
        Ok(Process {
            rank,
            method,
            daemon,
            name,
            child,
        })
    }
}

impl fmt::Debug for ProcessBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessBuilder")
            .field("rank", &self.header.rank)
            .field("name", &self.header.name)
            .field("start_method", &self.method)
            .field("daemon", &self.daemon)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

/// One worker process, like `multiprocessing.Process`.
///
/// [`Process::builder`] sets it up — its name, whether it is a daemon, its
/// [`StartMethod`] — and [`start`](ProcessBuilder::start)s it; then
/// [`join`](Process::join) it:
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
///     let mut p = Process::builder(work, 0, "worker".to_string())
///         .start_method(StartMethod::Spawn)
///         .start()?;
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
/// - or make it a [`daemon`](ProcessBuilder::daemon), which dropping kills.
///
/// A [`ProcessContext`](crate::ProcessContext) drops its workers the same way.
pub struct Process {
    rank: usize,
    method: StartMethod,
    daemon: bool,
    name: String,
    child: Child,
}

impl Process {
    /// The builder of a process that will run `worker(rank, args)`. The arguments are
    /// encoded now (any queue, event or tensor inside travels as a handle); an encoding
    /// error is returned by [`start`](ProcessBuilder::start).
    ///
    /// `worker` must be a function (or a closure capturing nothing) of this executable.
    pub fn builder<A, R>(worker: fn(usize, A) -> R, rank: usize, args: A) -> ProcessBuilder
    where
        A: Serialize + DeserializeOwned,
        R: IntoWorkerOutcome,
    {
        ProcessBuilder {
            header: JobHeader::new(worker, rank),
            args: wire::encode(&args),
            method: StartMethod::default(),
            daemon: false,
            world_size: None,
        }
    }

    /// Its name (see [`ProcessBuilder::name`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its rank (the worker's first argument).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether it is a daemon.
    pub fn is_daemon(&self) -> bool {
        self.daemon
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.pid
    }

    /// Python's `Process.sentinel`: a descriptor (its pidfd) that becomes readable when
    /// the process exits, to wait on together with pipes through
    /// [`connection::wait`](crate::connection::wait) (which also takes the `Process`
    /// itself, beside queues). Waiting on it does not reap the process:
    /// [`join`](Self::join) does.
    pub fn sentinel(&self) -> BorrowedFd<'_> {
        self.child.pidfd()
    }

    /// Whether it has not exited yet.
    pub fn is_alive(&self) -> bool {
        self.child.is_alive()
    }

    /// Waits until it exits, as long as it takes, and returns its exit status. Joining
    /// an exited process again returns the same status.
    ///
    /// # Errors
    /// An [`Error::Os`] when waiting failed.
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
        let child = &mut self.child;
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
                    match self.child.watch_fds_owned() {
                        Ok(fds) => Step::Fds(fds, Ready::Readable),
                        Err(e) => Step::Done(Err(e)),
                    }
                },
                Err,
            )
        })
        .await
    }

    /// Its exit status if it has exited (reaping it), without waiting.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if let Err(e) = self.child.collect() {
            tracing::warn!(
                pid = self.child.pid,
                "multiproc: checking a worker failed: {e}"
            );
        }
        self.child.status()
    }

    /// Sends SIGTERM (a no-op once it has exited).
    ///
    /// # Errors
    /// When the signal could not be sent.
    pub fn terminate(&mut self) -> Result<()> {
        self.child.signal(libc::SIGTERM)
    }

    /// Sends SIGKILL (a no-op once it has exited).
    ///
    /// # Errors
    /// As [`terminate`](Self::terminate).
    pub fn kill(&mut self) -> Result<()> {
        self.child.signal(libc::SIGKILL)
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
        if !self.child.has_exited() || !self.child.failed() {
            return None;
        }
        self.child.error(Vec::new())
    }
}

impl crate::queue::Waitable for Process {
    /// Ready once it has exited (its [`sentinel`](Process::sentinel)).
    fn wait_source(&self) -> WaitSource<'_> {
        WaitSource::fd(self.child.pidfd())
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
            .field("status", &self.child.status())
            .finish()
    }
}
