//! [`spawn`], [`start_processes`], [`SpawnOptions`] and [`ProcessContext`]: a group of
//! workers started together and joined together, with torch's error propagation.
//!
//! Joining waits on every worker at once (one `poll` over all their pidfds, status
//! sockets and report sockets), so an out-of-order failure is seen as soon as it happens.
//! On the first failure the context tears the group down: an optional pre-termination
//! grace for the others to finish, SIGTERM to the survivors, the grace period, SIGKILL,
//! then reaping every worker, and returns the error of the first failure with every
//! other rank that failed on its own (not the ones it killed itself).

use std::fmt;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::child::{Child, JobSpec, Owner, worker_env};
use super::job::JobHeader;
use super::worker_outcome::IntoWorkerOutcome;
use super::{ExitStatus, StartMethod};
use crate::error::{Error, Result};
use crate::sys::process as sys;
use crate::sys::{Deadline, deadline_after};
use crate::wire;

/// The default time between SIGTERM and SIGKILL when a group is torn down (torch's 30 s).
pub(crate) const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// Set to `spawn` in a group's workers beside torchrun's variables, so that
/// [`Env::detect`](crate::dist::Env::detect) can tell multiproc from torchrun.
pub(crate) const LAUNCHER_VAR: &str = "MULTIPROC_LAUNCHER";

/// A caller's per-rank environment: rank in, variables out.
type EnvPerRank = Arc<dyn Fn(usize) -> Vec<(String, String)> + Send + Sync>;

/// Options for starting a group of workers: start method, daemon flag, the grace
/// periods of the tear-down after a failure, and the workers' environment.
///
/// ```no_run
/// use std::time::Duration;
/// use multiproc::{SpawnOptions, StartMethod};
///
/// fn work(rank: usize, steps: u32) {
///     let _ = (rank, steps);
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     SpawnOptions::new()
///         .start_method(StartMethod::Forkserver)
///         .grace_period(Duration::from_secs(5))
///         .env("OMP_NUM_THREADS", "1")
///         .env_per_rank(|rank| vec![("CUDA_VISIBLE_DEVICES", rank.to_string())])
///         .spawn(work, 100u32, 4)
/// }
/// ```
#[derive(Clone)]
pub struct SpawnOptions {
    start_method: StartMethod,
    daemon: bool,
    grace_period: Duration,
    pre_termination_grace: Option<Duration>,
    env: Vec<(String, String)>,
    env_per_rank: Option<EnvPerRank>,
}

impl fmt::Debug for SpawnOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpawnOptions")
            .field("start_method", &self.start_method)
            .field("daemon", &self.daemon)
            .field("grace_period", &self.grace_period)
            .field("pre_termination_grace", &self.pre_termination_grace)
            .field("env", &self.env)
            .field(
                "env_per_rank",
                &self.env_per_rank.as_ref().map(|_| "Fn(rank)"),
            )
            .finish()
    }
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            start_method: StartMethod::Spawn,
            daemon: false,
            grace_period: DEFAULT_GRACE_PERIOD,
            pre_termination_grace: None,
            env: Vec::new(),
            env_per_rank: None,
        }
    }
}

impl SpawnOptions {
    /// The defaults: [`StartMethod::Spawn`], not daemon, a 30 s grace period and no
    /// pre-termination grace.
    pub fn new() -> Self {
        Self::default()
    }

    /// How the workers are started.
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.start_method = method;
        self
    }

    /// Daemon workers are killed when the [`ProcessContext`] is dropped; others are
    /// waited for (default).
    pub fn daemon(mut self, daemon: bool) -> Self {
        self.daemon = daemon;
        self
    }

    /// After a failure, how long the survivors have between SIGTERM and SIGKILL
    /// (default 30 s).
    pub fn grace_period(mut self, grace: Duration) -> Self {
        self.grace_period = grace;
        self
    }

    /// After a failure, how long the survivors may keep running to finish on their own
    /// before they get SIGTERM (torch's `join(grace_period=…)`; default none: SIGTERM at
    /// once).
    pub fn pre_termination_grace(mut self, grace: Option<Duration>) -> Self {
        self.pre_termination_grace = grace;
        self
    }

    /// Sets `key=value` in every worker's environment (after torchrun's variables, so
    /// `MASTER_PORT` set here wins). The parent's environment is not touched: this is
    /// the safe form of `std::env::set_var` before spawning.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets variables that differ by rank, such as `CUDA_VISIBLE_DEVICES`: `vars(rank)`
    /// is called in the parent for each worker and set in that worker's environment
    /// (after [`env`](Self::env)'s), with every start method. A variable named twice
    /// takes its last value.
    pub fn env_per_rank<F, I, K, V>(mut self, vars: F) -> Self
    where
        F: Fn(usize) -> I + Send + Sync + 'static,
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.env_per_rank = Some(Arc::new(move |rank| {
            vars(rank)
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect()
        }));
        self
    }

    /// Every variable a worker of rank `rank` in a group of `nprocs` gets, in order:
    /// torchrun's contract, multiproc's own, then the caller's.
    fn worker_env(
        &self,
        rank: usize,
        nprocs: usize,
        rendezvous: &Rendezvous,
    ) -> Vec<(String, String)> {
        let mut env = worker_env(rank, Some(nprocs));
        // `worker_env` passes on the parent's MASTER_ADDR/MASTER_PORT: ours replace them.
        env.retain(|(k, _)| k != "MASTER_ADDR" && k != "MASTER_PORT");
        let n = nprocs.to_string();
        let r = rank.to_string();
        for (key, value) in [
            ("LOCAL_WORLD_SIZE", n.as_str()),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_NAME", "default"),
            ("ROLE_RANK", r.as_str()),
            ("ROLE_WORLD_SIZE", n.as_str()),
            ("MASTER_ADDR", rendezvous.addr.as_str()),
            ("MASTER_PORT", rendezvous.port.as_str()),
            ("TORCHELASTIC_RUN_ID", rendezvous.run_id.as_str()),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            // torch's rank 0 hosts the rendezvous store itself: there is no agent's.
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            (LAUNCHER_VAR, "spawn"),
        ] {
            env.push((key.to_string(), value.to_string()));
        }
        env.extend(self.env.iter().cloned());
        if let Some(per_rank) = &self.env_per_rank {
            env.extend(per_rank(rank));
        }
        env
    }

    /// Starts `nprocs` workers running `worker(rank, args)`, ranks `0..nprocs`, and
    /// returns without waiting for them.
    ///
    /// Each worker gets its own copy of `args` (handles inside, such as queues, are
    /// shared) and torchrun's environment: `RANK`, `LOCAL_RANK`, `ROLE_RANK` (its
    /// rank), `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `ROLE_WORLD_SIZE` (`nprocs`),
    /// `GROUP_RANK=0`, `MASTER_ADDR`/`MASTER_PORT` (this process's when set, else
    /// 127.0.0.1 and a free port), `TORCHELASTIC_RUN_ID` (unique to this group),
    /// `TORCHELASTIC_RESTART_COUNT=0`, then what [`env`](Self::env) and
    /// [`env_per_rank`](Self::env_per_rank) add.
    ///
    /// # Errors
    /// When the arguments cannot be encoded or a worker cannot be started; the workers
    /// already started are then killed and reaped.
    pub fn start<A, R>(
        &self,
        worker: fn(usize, A) -> R,
        args: A,
        nprocs: usize,
    ) -> Result<ProcessContext>
    where
        A: Serialize + DeserializeOwned,
        R: IntoWorkerOutcome,
    {
        let rendezvous = Rendezvous::choose()?;
        let mut children: Vec<Child> = Vec::with_capacity(nprocs);
        for rank in 0..nprocs {
            let started = wire::encode(&args).and_then(|encoded| {
                Child::start(JobSpec {
                    header: JobHeader::new(worker, rank),
                    args: encoded,
                    method: self.start_method,
                    env: self.worker_env(rank, nprocs, &rendezvous),
                    daemon: self.daemon,
                })
            });
            match started {
                Ok(mut child) => {
                    child.owner = Owner::Context;
                    children.push(child);
                }
                Err(e) => {
                    for child in &mut children {
                        child.daemon = true; // dropping kills and reaps
                    }
                    return Err(e);
                }
            }
        }
        Ok(ProcessContext {
            children,
            options: self.clone(),
            failures: Vec::new(),
            state: State::Running,
        })
    }

    /// Starts `nprocs` workers and joins them: `Ok(())` once all succeeded, or the error
    /// of the first failure (the others torn down, see [`ProcessContext::join`]).
    ///
    /// # Errors
    /// [`Error::ProcessRaised`] or [`Error::ProcessExited`] for a failed worker; the
    /// errors of [`start`](Self::start).
    pub fn spawn<A, R>(&self, worker: fn(usize, A) -> R, args: A, nprocs: usize) -> Result<()>
    where
        A: Serialize + DeserializeOwned,
        R: IntoWorkerOutcome,
    {
        let mut context = self.start(worker, args, nprocs)?;
        context.join()
    }
}

/// Where a group's workers meet (torchrun's `MASTER_ADDR:MASTER_PORT`) and the run id
/// that names the group.
struct Rendezvous {
    addr: String,
    port: String,
    run_id: String,
}

impl Rendezvous {
    /// The parent's `MASTER_ADDR`/`MASTER_PORT` when set, else 127.0.0.1 and a port that
    /// is free now (as torch's `spawn` callers pick one: the kernel's choice for port 0).
    fn choose() -> Result<Rendezvous> {
        static GROUPS: AtomicU64 = AtomicU64::new(0);
        let run_id = format!(
            "multiproc-{}-{}",
            sys::current_pid(),
            GROUPS.fetch_add(1, Ordering::Relaxed)
        );
        let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
        let port = match std::env::var("MASTER_PORT") {
            Ok(port) => port,
            Err(_) => std::net::TcpListener::bind(("127.0.0.1", 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| Error::os("choosing a free MASTER_PORT on 127.0.0.1", e))?
                .port()
                .to_string(),
        };
        Ok(Rendezvous { addr, port, run_id })
    }
}

/// Starts `nprocs` workers running `worker(rank, args)` with [`StartMethod::Spawn`]
/// and waits for all of them, like `torch.multiprocessing.spawn`.
///
/// `worker` is a function of this executable (or a closure that captures nothing);
/// `args` is any serde value, and every queue, event or tensor inside it travels as a
/// handle, so all workers share it. A worker that panics or returns `Err` makes this
/// return [`Error::ProcessRaised`]; one that exits non-zero or is killed,
/// [`Error::ProcessExited`]. The program must call [`init`](crate::init) first thing in
/// `main` (or use [`test_init!`](crate::test_init) in integration tests).
///
/// ```no_run
/// fn work(rank: usize, scale: f64) -> Result<(), String> {
///     if scale > 0.0 { Ok(()) } else { Err(format!("rank {rank}: bad scale")) }
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     multiproc::spawn(work, 0.5, 4)
/// }
/// ```
///
/// For other start methods, grace periods or daemon workers use [`SpawnOptions`].
///
/// # Errors
/// As [`SpawnOptions::spawn`].
pub fn spawn<A, R>(worker: fn(usize, A) -> R, args: A, nprocs: usize) -> Result<()>
where
    A: Serialize + DeserializeOwned,
    R: IntoWorkerOutcome,
{
    SpawnOptions::new().spawn(worker, args, nprocs)
}

/// Starts `nprocs` workers with `start_method` and returns without waiting, like
/// `torch.multiprocessing.start_processes(..., join=False)`.
///
/// # Errors
/// As [`SpawnOptions::start`].
pub fn start_processes<A, R>(
    worker: fn(usize, A) -> R,
    args: A,
    nprocs: usize,
    start_method: StartMethod,
) -> Result<ProcessContext>
where
    A: Serialize + DeserializeOwned,
    R: IntoWorkerOutcome,
{
    SpawnOptions::new()
        .start_method(start_method)
        .start(worker, args, nprocs)
}

#[derive(Debug)]
enum State {
    Running,
    Joined,
    Failed(Error),
}

/// A group of workers started by [`start_processes`] or [`SpawnOptions::start`], like
/// torch's `ProcessContext`.
///
/// Dropping it without joining: daemon workers are killed, others are waited for; all
/// are reaped.
#[derive(Debug)]
pub struct ProcessContext {
    children: Vec<Child>,
    options: SpawnOptions,
    /// Indices into `children` of workers that failed on their own, in the order seen.
    failures: Vec<usize>,
    state: State,
}

impl ProcessContext {
    /// The workers' process ids, by rank.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.pid).collect()
    }

    /// Each worker's exit status, by rank: `None` while it runs (as last observed; call
    /// [`join`](Self::join) to observe).
    pub fn exit_statuses(&self) -> Vec<Option<ExitStatus>> {
        self.children.iter().map(Child::status).collect()
    }

    /// The number of workers.
    pub fn nprocs(&self) -> usize {
        self.children.len()
    }

    /// Waits for the workers, as long as it takes.
    ///
    /// - `Ok(())`: every worker has exited successfully (and stays so: later calls
    ///   return `Ok(())` at once).
    /// - `Err(..)`: a worker failed. The others were torn down (pre-termination grace if
    ///   set, SIGTERM, the grace period, SIGKILL) and all are reaped; later calls return
    ///   the same error.
    ///
    /// # Errors
    /// [`Error::ProcessRaised`] when the first failed worker panicked or returned `Err`,
    /// with its message; [`Error::ProcessExited`] when it exited non-zero or was killed
    /// by a signal. Both carry every other rank that failed on its own in `others`.
    pub fn join(&mut self) -> Result<()> {
        self.join_within(None)
    }

    /// Waits for the workers, at most `timeout` (torch's `join(timeout)`), as
    /// [`join`](Self::join) does; `Err(Error::Timeout { .. })` when the timeout passed
    /// and some still run: join again later (torch's `join()` returning `False`). The
    /// tear-down after a failure is not bounded by `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the workers still run at the deadline; otherwise as
    /// [`join`](Self::join).
    pub fn join_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.join_within(Some(timeout))
    }

    fn join_within(&mut self, timeout: Option<Duration>) -> Result<()> {
        match &self.state {
            State::Joined => return Ok(()),
            State::Failed(e) => return Err(e.clone()),
            State::Running => {}
        }
        let deadline = deadline_after(timeout);
        loop {
            self.collect()?;
            if !self.failures.is_empty() {
                let error = self.tear_down();
                self.state = State::Failed(error.clone());
                return Err(error);
            }
            if self.children.iter().all(Child::has_exited) {
                self.state = State::Joined;
                return Ok(());
            }
            if !self.wait(deadline)? {
                let running = self.children.iter().filter(|c| !c.has_exited()).count();
                return Err(Error::timeout(
                    format!(
                        "a join of {} workers, {running} of which still run",
                        self.children.len()
                    ),
                    timeout,
                ));
            }
        }
    }

    /// Waits for the workers as [`join`](Self::join) does, without
    /// blocking a thread while they run (feature `async`; any executor): the fd reactor
    /// watches their pidfds and reports. Cancel-safe.
    ///
    /// A worker's failure tears the others down as `join` does, inside the poll that
    /// notices it: that poll blocks its thread for the tear-down (the grace periods),
    /// so give an executor that must stay responsive a short grace.
    ///
    /// # Errors
    /// As [`join`](Self::join), and when the fd reactor cannot be started.
    #[cfg(feature = "async")]
    pub async fn join_async(&mut self) -> Result<()> {
        use crate::sys::reactor::{self, Parked, Ready, Step};
        let mut parked: Option<Parked> = None;
        std::future::poll_fn(|cx| {
            reactor::poll_step(
                cx,
                &mut parked,
                || match self.join_within(Some(Duration::ZERO)) {
                    Err(e) if e.is_timeout() => {
                        let fds: Result<Vec<_>> = self
                            .children
                            .iter()
                            .map(Child::watch_fds_owned)
                            .collect::<Result<Vec<_>>>()
                            .map(|v| v.into_iter().flatten().collect());
                        match fds {
                            Ok(fds) => Step::Fds(fds, Ready::Readable),
                            Err(e) => Step::Done(Err(e)),
                        }
                    }
                    done => Step::Done(done),
                },
                Err,
            )
        })
        .await
    }

    /// Takes in every worker's news and records new failures.
    fn collect(&mut self) -> Result<()> {
        for (i, child) in self.children.iter_mut().enumerate() {
            child.collect()?;
            if child.failed_on_its_own() && !self.failures.contains(&i) {
                self.failures.push(i);
            }
        }
        Ok(())
    }

    /// Waits for news from any worker; `Ok(false)` at the deadline.
    fn wait(&self, deadline: Deadline) -> Result<bool> {
        let mut fds: Vec<BorrowedFd<'_>> = Vec::with_capacity(2 * self.children.len());
        for child in &self.children {
            child.watch_fds(&mut fds);
        }
        sys::wait_any_readable(&fds, deadline)
    }

    /// Waits until every worker has exited or the deadline passes. Errors end the
    /// wait early (the caller escalates).
    fn wait_all_exited(&mut self, deadline: Deadline) {
        loop {
            if let Err(e) = self.collect() {
                tracing::warn!("multiproc: collecting workers during tear-down: {e}");
                return;
            }
            if self.children.iter().all(Child::has_exited) {
                return;
            }
            match self.wait(deadline) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!("multiproc: waiting for workers during tear-down: {e}");
                    return;
                }
            }
        }
    }

    fn signal_survivors(&mut self, sig: i32) {
        for child in &mut self.children {
            if !child.has_exited() {
                if let Err(e) = child.signal(sig) {
                    tracing::warn!(pid = child.pid, "multiproc: cannot signal a worker: {e}");
                }
            }
        }
    }

    /// Stops every survivor after a failure and returns the error to report.
    fn tear_down(&mut self) -> Error {
        if let Some(grace) = self.options.pre_termination_grace {
            self.wait_all_exited(deadline_after(Some(grace)));
        } else {
            // Failures that happened together (both ranks raise) are reported
            // together: take in what is already there before signalling.
            self.wait_all_exited(Some(std::time::Instant::now()));
        }
        self.signal_survivors(libc::SIGTERM);
        self.wait_all_exited(deadline_after(Some(self.options.grace_period)));
        self.signal_survivors(libc::SIGKILL);
        self.wait_all_exited(None);
        self.error()
    }

    fn error(&self) -> Error {
        let Some((&first, rest)) = self.failures.split_first() else {
            return Error::InvalidArgument(
                "a process group was torn down without a failure (this is a multiproc bug)".into(),
            );
        };
        let others = rest
            .iter()
            .filter_map(|&i| self.children[i].failure())
            .collect();
        self.children[first].error(others).unwrap_or_else(|| {
            Error::InvalidArgument(format!(
                "process {} failed but its failure was lost (this is a multiproc bug)",
                self.children[first].rank
            ))
        })
    }
}
