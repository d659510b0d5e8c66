//! A started worker as its parent tracks it ([`Child`]); the public
//! [`Process`](crate::Process) wraps one.
//!
//! A [`Child`] owns the pidfd of the worker, the parent end of its job socket (where the
//! worker's [`Report`] arrives) and, for a fork-server worker, the socket on which the
//! server delivers its exit status. Its exit is observed by polling: the pidfd for a
//! direct child (then `waitid(P_PIDFD)` reaps it), the status socket for a fork-server
//! child (the server reaps it). Dropping a `Child` that still runs kills it first if it
//! is a daemon, then waits for it and reaps it.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use super::exit_status::ExitStatus;
use super::job::JobHeader;
use super::launch::{self, Launch};
use super::start_method::StartMethod;
use super::worker::{self, Report, WORKER_FD_VAR};
use super::{current, forkserver};
use crate::error::{Error, Failure, Result};
use crate::role::{ROLE_VAR, Role};
use crate::sys::process as sys;
use crate::sys::socket::seqpacket_pair;
use crate::sys::{Deadline, deadline_after};
use crate::wire::{self, Encoded};

/// How long sending a job may wait for room in the job socket (a fresh socket holds the
/// two small packets of a job at once, so this only bounds a pathological case).
const JOB_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a worker's exit is observed.
#[derive(Debug)]
enum ExitSource {
    /// Our own child: poll the pidfd, then reap with `waitid`.
    Direct,
    /// The fork server's child: it sends the status on this socket once it has reaped
    /// the worker. `None` once the server hung up without sending it (then the pidfd
    /// tells us when the worker is gone, and the status is unknown).
    Server(Option<OwnedFd>),
}

/// Everything the parent knows and holds about one started worker.
#[derive(Debug)]
pub(crate) struct Child {
    pub rank: usize,
    pub pid: u32,
    /// Its name (`Process-RANK` unless it was given one).
    name: String,
    /// What holds it, for the message of a drop that waits for it.
    pub owner: Owner,
    pidfd: OwnedFd,
    exit_source: ExitSource,
    /// The parent end of the job socket, while a report may still arrive on it.
    channel: Option<OwnedFd>,
    report: Option<Report>,
    status: Option<ExitStatus>,
    /// Whether we sent it a signal (a death by that signal is ours, not its failure).
    pub signalled: bool,
    pub daemon: bool,
    /// Its entry in [`active_children`](crate::active_children).
    registration: std::sync::Arc<super::current::Registration>,
    /// How it was started: says why a worker may exit 0 without a report.
    method: StartMethod,
}

/// What holds a [`Child`]: the handle a user drops, named in the message of a drop that
/// has to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A [`Process`](crate::Process).
    Process,
    /// A [`ProcessContext`](crate::ProcessContext).
    Context,
}

/// How long dropping a running non-daemon worker waits before it says what it waits
/// for, and then how often it says so again.
const DROP_WARN_AFTER: Duration = Duration::from_secs(3);
const DROP_WARN_EVERY: Duration = Duration::from_secs(30);

/// What a worker needs to start.
pub(crate) struct JobSpec {
    pub header: JobHeader,
    pub args: Encoded,
    pub method: StartMethod,
    /// `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, …
    pub env: Vec<(String, String)>,
    pub daemon: bool,
}

/// The environment torchrun gives a worker, plus `MASTER_ADDR`/`MASTER_PORT` when the
/// caller has them (a fork server started earlier would not otherwise see them).
pub(crate) fn worker_env(rank: usize, world_size: Option<usize>) -> Vec<(String, String)> {
    let mut env = vec![
        ("RANK".to_string(), rank.to_string()),
        ("LOCAL_RANK".to_string(), rank.to_string()),
    ];
    if let Some(n) = world_size {
        env.push(("WORLD_SIZE".to_string(), n.to_string()));
    }
    for key in ["MASTER_ADDR", "MASTER_PORT"] {
        if let Ok(value) = std::env::var(key) {
            env.push((key.to_string(), value));
        }
    }
    // The sharing strategy and the shm manager of this process tree.
    env.extend(
        super::child_env::env_for_child()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
    );
    env
}

/// A process that multiproc started as a worker, but whose `main` did not call
/// [`init`](crate::init), runs the parent's `main` again: if that starts workers, each
/// of them would do the same, without end. The role variable that `init` removes is
/// still set in such a process, so refuse here, with the fix.
fn refuse_in_uninitialized_worker() -> Result<()> {
    match std::env::var_os(ROLE_VAR) {
        None => Ok(()),
        Some(role) => Err(Error::InvalidArgument(format!(
            "this process was started by multiproc ({ROLE_VAR}={}) but did not call \
             multiproc::init(): call it first thing in main (in integration tests, put \
             `multiproc::test_init!();` at the top of the test file); refusing to start \
             workers, which would do the same",
            role.to_string_lossy()
        ))),
    }
}

impl Child {
    /// Sends the job into a fresh socket and starts the worker that will read it.
    pub(crate) fn start(spec: JobSpec) -> Result<Child> {
        let JobSpec {
            mut header,
            mut args,
            method,
            env,
            daemon,
        } = spec;
        let rank = header.rank;
        let name = header.name.clone();
        refuse_in_uninitialized_worker()?;
        header.log = super::logs::sink_for_child();
        method.check_usable()?;
        let (channel, job_end) = seqpacket_pair()?;
        let deadline = deadline_after(Some(JOB_SEND_TIMEOUT));
        wire::encode(&header)?.send(channel.as_fd(), deadline)?;
        args.send(channel.as_fd(), deadline)?;
        let (pid, pidfd, exit_source) = match method {
            StartMethod::Spawn => {
                let mut exec_env = vec![Role::Worker.env_entry()];
                exec_env.extend(env);
                let l = launch::launch(Launch::Exec {
                    env: exec_env,
                    fd_var: WORKER_FD_VAR,
                    fd: job_end,
                })?;
                (l.pid, l.pidfd, ExitSource::Direct)
            }
            StartMethod::Fork => {
                let run = Box::new(move || {
                    // The child is single-threaded: only the launcher thread was copied.
                    worker::set_worker_env(&env);
                    worker::run_worker(job_end)
                });
                let l = launch::launch(Launch::Fork { run })?;
                (l.pid, l.pidfd, ExitSource::Direct)
            }
            StartMethod::Forkserver => {
                let c = forkserver::start(job_end, env)?;
                (c.pid, c.pidfd, ExitSource::Server(Some(c.status)))
            }
        };
        let pid = sys::public_pid(pid);
        let span = tracing::debug_span!("multiproc::spawn", rank, pid, %method, name = %name);
        span.in_scope(|| tracing::debug!("worker started"));
        Ok(Child {
            registration: super::current::register(rank, pid, name.clone()),
            rank,
            pid,
            name,
            owner: Owner::Process,
            pidfd,
            exit_source,
            channel: Some(channel),
            report: None,
            status: None,
            signalled: false,
            daemon,
            method,
        })
    }

    /// The pidfd: readable once the worker has exited (Python's `Process.sentinel`).
    pub(crate) fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// The exit status, once observed.
    pub(crate) fn status(&self) -> Option<ExitStatus> {
        self.status
    }

    pub(crate) fn has_exited(&self) -> bool {
        self.status.is_some()
    }

    /// Whether it still runs (without reaping it).
    pub(crate) fn is_alive(&self) -> bool {
        self.status.is_none() && !sys::has_exited(self.pidfd.as_fd())
    }

    /// Duplicates of [`watch_fds`](Self::watch_fds), for the async reactor to watch
    /// (feature `async`).
    #[cfg(feature = "async")]
    pub(crate) fn watch_fds_owned(&self) -> Result<Vec<std::os::fd::OwnedFd>> {
        let mut fds = Vec::new();
        self.watch_fds(&mut fds);
        fds.into_iter()
            .map(|fd| {
                fd.try_clone_to_owned()
                    .map_err(|e| Error::os("duplicating a worker's fd to wait on it", e))
            })
            .collect()
    }

    /// The fds whose readiness means news about this worker: its report, its exit.
    pub(crate) fn watch_fds<'a>(&'a self, out: &mut Vec<BorrowedFd<'a>>) {
        if self.report.is_none() {
            if let Some(ch) = &self.channel {
                out.push(ch.as_fd());
            }
        }
        if self.status.is_none() {
            match &self.exit_source {
                ExitSource::Direct | ExitSource::Server(None) => out.push(self.pidfd.as_fd()),
                ExitSource::Server(Some(status)) => out.push(status.as_fd()),
            }
        }
    }

    /// Takes in whatever has happened, without waiting: the report, the exit (reaping).
    pub(crate) fn collect(&mut self) -> Result<()> {
        let was_running = self.status.is_none();
        if was_running {
            self.status = match &mut self.exit_source {
                ExitSource::Direct => match sys::try_reap(self.pidfd.as_fd()) {
                    Ok(raw) => raw.map(ExitStatus::from_raw),
                    // Someone else in this program reaped it (`waitpid(-1)`).
                    Err(e) if e.errno() == Some(libc::ECHILD) => Some(ExitStatus::unknown()),
                    Err(e) => return Err(e),
                },
                ExitSource::Server(source) => match source {
                    Some(status) => match forkserver::try_read_status(status.as_fd()) {
                        Ok(s) => s,
                        Err(_) => {
                            // The server hung up without a status (it died): wait on
                            // the pidfd instead.
                            *source = None;
                            sys::has_exited(self.pidfd.as_fd()).then(ExitStatus::unknown)
                        }
                    },
                    None => sys::has_exited(self.pidfd.as_fd()).then(ExitStatus::unknown),
                },
            };
        }
        // After the exit, whatever the worker sent is already in the socket: this read
        // is final.
        self.read_report();
        if self.status.is_some() {
            self.registration.mark_exited();
            self.channel = None;
            if was_running {
                // A worker that reports has given its shared memory back; one that
                // ended without a report has not.
                crate::shm::worker_ended(self.pid, self.report.is_some());
            }
        }
        Ok(())
    }

    fn read_report(&mut self) {
        if self.report.is_some() {
            return;
        }
        let Some(channel) = &self.channel else {
            return;
        };
        match wire::try_recv_packet(channel.as_fd()) {
            Ok(None) => {}
            Ok(Some(packet)) => {
                self.report = Some(
                    match wire::decode::<Report>(packet, &crate::shm::Returns::plain()) {
                        Ok(report) => report,
                        Err(e) => Report::Raised {
                            message: format!("{} sent a malformed report: {e}", self.describe()),
                        },
                    },
                );
                self.channel = None;
            }
            // Closed: it exited without reporting (e.g. `process::exit`); the status
            // tells how. Other errors: the same, nothing more can come.
            Err(_) => self.channel = None,
        }
    }

    /// Waits until the worker has exited (and is reaped) or the deadline passes;
    /// `Ok(false)` on timeout.
    pub(crate) fn wait(&mut self, deadline: Deadline) -> Result<bool> {
        loop {
            self.collect()?;
            if self.status.is_some() {
                return Ok(true);
            }
            let mut fds = Vec::with_capacity(2);
            self.watch_fds(&mut fds);
            if !sys::wait_any_readable(&fds, deadline)? {
                return Ok(false);
            }
        }
    }

    /// Sends `sig` unless the worker is known to have exited.
    pub(crate) fn signal(&mut self, sig: i32) -> Result<()> {
        if self.status.is_none() && sys::send_signal(self.pidfd.as_fd(), sig)? {
            self.signalled = true;
        }
        Ok(())
    }

    /// Whether the worker failed on its own: it raised (whatever happened next), it
    /// exited unsuccessfully without having been signalled by us, or it exited 0
    /// without reporting (its job never ran to the end).
    pub(crate) fn failed_on_its_own(&self) -> bool {
        match (&self.report, self.status) {
            (Some(Report::Raised { .. }), _) => true,
            (_, Some(status)) if self.exited_without_report(status) => true,
            (_, Some(status)) => !status.success() && !self.signalled,
            (_, None) => false,
        }
    }

    /// Whether it has ended badly in any way (including by our signal).
    pub(crate) fn failed(&self) -> bool {
        matches!(self.report, Some(Report::Raised { .. }))
            || self
                .status
                .is_some_and(|s| !s.success() || self.exited_without_report(s))
    }

    /// A worker that exits 0 has returned from its job only if it said so first: a
    /// program that did not call `init` runs its `main` instead and exits 0, and a job
    /// that calls `std::process::exit(0)` never finished either.
    fn exited_without_report(&self, status: ExitStatus) -> bool {
        status.success() && self.report.is_none()
    }

    /// This worker's failure as a [`Failure`](Failure) record.
    pub(crate) fn failure(&self) -> Option<Failure> {
        if let Some(Report::Raised { message }) = &self.report {
            return Some(Failure {
                error_index: self.rank,
                pid: self.pid,
                exit_code: None,
                signal_name: None,
                message: message.clone(),
            });
        }
        let status = self
            .status
            .filter(|s| !s.success() || self.exited_without_report(*s))?;
        Some(Failure {
            error_index: self.rank,
            pid: self.pid,
            exit_code: status.code(),
            signal_name: status.signal_name(),
            message: self.exit_message(status),
        })
    }

    /// The worker as messages name it: `transformer-1 (rank 1, pid 4242)`, or
    /// `process 1 (pid 4242)` without a name of its own.
    pub(crate) fn describe(&self) -> String {
        super::job::describe(self.rank, &self.name, self.pid)
    }

    fn exit_message(&self, status: ExitStatus) -> String {
        let who = self.describe();
        if self.exited_without_report(status) {
            return self.unreported_exit_message();
        }
        match (status.code(), status.signal()) {
            (Some(code), _) => format!("{who} terminated with exit code {code}"),
            (None, Some(sig)) => {
                let mut m = format!("{who} terminated with signal {}", sys::signal_name(sig));
                if status.core_dumped() {
                    m.push_str(" (core dumped)");
                }
                if sig == libc::SIGKILL && !self.signalled {
                    m.push_str(&format!(
                        "; an unexplained SIGKILL is usually the Linux OOM killer: check `dmesg` \
                         or `journalctl -k` for \"Killed process {}\" and give the workers more \
                         memory or fewer/smaller batches",
                        self.pid
                    ));
                }
                m
            }
            (None, None) => format!(
                "{who} terminated with an unknown status (it was reaped outside \
                 multiproc, or the fork server died)"
            ),
        }
    }

    /// Why a worker exited 0 without reporting, by start method.
    fn unreported_exit_message(&self) -> String {
        let who = self.describe();
        match self.method {
            StartMethod::Spawn => format!(
                "{who} exited with code 0 without reporting a result: the program \
                 {} ran its main again instead of the worker's job, so its main does not call \
                 multiproc::init() first thing (in integration tests, put \
                 `multiproc::test_init!();` at the top of the test file); or the job called \
                 std::process::exit",
                current::program_name()
            ),
            StartMethod::Fork | StartMethod::Forkserver => format!(
                "{who} exited with code 0 without reporting a result: its job called \
                 std::process::exit (or exited another way) before returning"
            ),
        }
    }

    /// The error for this worker alone, with `others` attached.
    pub(crate) fn error(&self, others: Vec<Failure>) -> Option<Error> {
        let f = self.failure()?;
        Some(match &self.report {
            Some(Report::Raised { .. }) => Error::ProcessRaised {
                error_index: f.error_index,
                pid: f.pid,
                message: f.message,
                others,
            },
            _ => Error::ProcessExited {
                error_index: f.error_index,
                pid: f.pid,
                exit_code: f.exit_code,
                signal_name: f.signal_name,
                message: f.message,
                others,
            },
        })
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        if self.daemon {
            let _ = self.signal(libc::SIGKILL);
        }
        match self.wait_saying_why() {
            Ok(_) => {}
            Err(e) => {
                // Cannot wait (should not happen): make sure it dies, and try once more.
                tracing::warn!(
                    pid = self.pid,
                    "multiproc: waiting for a dropped worker failed: {e}"
                );
                let _ = self.signal(libc::SIGKILL);
                let _ = self.wait(None);
            }
        }
    }
}

impl Child {
    /// Waits for a dropped worker without limit, as Python joins a non-daemon child,
    /// but not silently: after [`DROP_WARN_AFTER`], and every [`DROP_WARN_EVERY`]
    /// after that, says on stderr and through `tracing` which worker it waits for and
    /// how not to (a worker blocked for good, say on a full queue whose readers are
    /// gone, would otherwise hang its parent's exit without a word).
    fn wait_saying_why(&mut self) -> Result<bool> {
        let started = std::time::Instant::now();
        let mut slice = DROP_WARN_AFTER;
        loop {
            if self.wait(deadline_after(Some(slice)))? {
                return Ok(true);
            }
            let message = self.drop_wait_message(started.elapsed());
            tracing::warn!(pid = self.pid, rank = self.rank, name = %self.name, "{message}");
            eprintln!("{message}");
            slice = DROP_WARN_EVERY;
        }
    }

    fn drop_wait_message(&self, waited: Duration) -> String {
        let who = self.describe();
        let waited = waited.as_secs();
        let advice = match self.owner {
            Owner::Process => {
                "to not wait, join it with a timeout (`join_timeout(..)`) and then \
                 `terminate()` or `kill()` it, or make it a daemon (`.daemon(true)`), \
                 which dropping kills"
            }
            Owner::Context => {
                "to not wait, join the context with a timeout (`join_timeout(..)`), or start \
                 it with `SpawnOptions::daemon(true)`, whose workers dropping kills"
            }
        };
        let holder = match self.owner {
            Owner::Process => "its Process",
            Owner::Context => "its ProcessContext",
        };
        format!(
            "multiproc: {holder} was dropped while {who} still runs; waiting for it to \
             exit (it is not a daemon), {waited} s so far. If it is blocked (on a full \
             queue whose readers are gone, say), this waits forever: {advice}"
        )
    }
}
