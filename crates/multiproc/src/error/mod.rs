//! The error types.
//!
//! [`Error`] is the umbrella every fallible operation converts into, so `?` works in a
//! user's `main`. Each variant carries what is needed to act on it: the segment, the
//! size, the pid, the rank, the limit. Errors are `Serialize`, so a worker's failure can
//! cross a queue like any other value.
//!
//! Operations that take ownership of an item hand it back when they fail
//! ([`PutError`]), so nothing the user sent is lost.
//!
//! The timeout convention is documented once, on [`Error`].

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod failure;
mod handed_back;
mod os_error;
mod user_error;

pub use failure::Failure;
pub use handed_back::{LockError, PutError};
pub use os_error::OsError;
pub use user_error::UserError;

/// `Result<T, multiproc::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in multiproc.
///
/// # One timeout convention
///
/// Modelled on `std::sync::Condvar::wait_timeout` and crossbeam-channel's
/// `recv_timeout`, every operation that can wait comes in one spelling per way of
/// waiting:
///
/// - `op()` waits as long as it takes and never returns `Timeout`: `get`, `recv`,
///   `poll`, `acquire`, `wait`, `wait_for`, `join`, `lock`, `permit`.
/// - `op_timeout(d: Duration)` waits at most `d`; one that runs past its deadline is
///   always an `Err` whose error is [`Error::Timeout`] ([`Error::is_timeout`] says so),
///   never `Ok(None)` or `Ok(false)`: `get_timeout`, `recv_timeout`, `poll_timeout`,
///   `acquire_timeout`, `wait_timeout`, `wait_for_timeout`, `join_timeout`,
///   `lock_timeout`, `permit_timeout`, and
///   [`connection::wait`](crate::connection::wait) with a timeout.
/// - A put or send with a deadline that runs out hands the item back:
///   `Err(PutError { error: Error::Timeout { .. }, item })`.
/// - `try_op()` never waits (no sleep, no spin) and so never times out: `try_get` and
///   `try_recv` answer `Ok(None)` when nothing is waiting, `try_lock`/`try_permit`
///   `Ok(None)` and `try_acquire` `Ok(false)` when the lock or permit is taken,
///   `try_poll` `Ok(false)` when nothing can be received, and `try_put` fails with
///   [`Error::Full`] (the item handed back) when there is no room. (`Event::is_set`
///   and `AsyncResult::ready` are the looks of their kind.)
/// - Python's and torch's names (`put_nowait`, `qsize`, `empty`, `acquire(timeout=…)`)
///   are search aliases of the Rust method in these docs.
/// - A get or recv on an empty queue or pipe that no other handle can ever feed (none
///   left in any process, thread or message in flight) is [`Error::Disconnected`], from
///   the blocking and the non-blocking forms alike, instead of a wait that never ends.
///
/// ```
/// use std::time::Duration;
/// let q = multiproc::Queue::<u32>::new()?;
/// let producer = q.clone(); // another handle: something may still arrive
/// assert_eq!(q.try_get()?, None); // empty: not a timeout
/// let err = q.get_timeout(Duration::from_millis(1)).unwrap_err();
/// assert!(err.is_timeout(), "{err}");
/// drop(producer); // the last other handle: nothing can arrive any more
/// assert!(q.get().unwrap_err().is_disconnected());
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A worker panicked or returned `Err`.
    #[error("{message}")]
    ProcessRaised {
        /// The index of the first worker that failed, as torch's `error_index`: its rank
        /// (the first argument its function got).
        error_index: usize,
        /// Its process id.
        pid: u32,
        /// What it raised, after who raised it ("transformer-1 (rank 1, pid 4242)
        /// raised: …", or "process 1 (pid 4242) raised: …" for a process without a
        /// name): the panic text and location (and the backtrace when `RUST_BACKTRACE`
        /// is set), or the `Display` of the returned error.
        message: String,
        /// Every other rank that failed, in the order their failures were seen.
        others: Vec<Failure>,
    },
    /// A worker exited with a non-zero code or was killed by a signal.
    #[error("{message}")]
    ProcessExited {
        /// The index of the first worker that failed, as torch's `error_index`: its rank
        /// (the first argument its function got).
        error_index: usize,
        /// Its process id.
        pid: u32,
        /// The exit code, when it exited.
        exit_code: Option<i32>,
        /// The signal's name (`SIGKILL`), when a signal ended it.
        signal_name: Option<String>,
        /// "process 0 (pid 4242) terminated with exit code 123" (a named process:
        /// "transformer-1 (rank 1, pid 4242) terminated …") and advice where there is
        /// some.
        message: String,
        /// Every other rank that failed, in the order their failures were seen.
        others: Vec<Failure>,
    },
    /// A system call failed. The [`std::io::Error`] is this error's
    /// [`source()`](std::error::Error::source); it survives a trip through a queue as
    /// its errno (or its text, when it had none).
    #[error("{context}: {message}")]
    Os {
        /// What multiproc was doing, with the values involved.
        context: String,
        /// The system's error text.
        message: String,
        /// The raw `errno`, where there is one.
        errno: Option<i32>,
        /// The system's error itself.
        #[source]
        source: OsError,
    },
    /// The channel (queue, pipe, event, process) is closed, or its other end is gone.
    #[error("{0}")]
    Closed(String),
    /// A get or recv found its queue or pipe empty, with no other handle of it left
    /// anywhere — none in another process, none in another thread of this process (a
    /// clone), none inside a message in flight or in a worker's arguments — so nothing
    /// can ever arrive (crossbeam's `RecvError`, Python's `EOFError`). Messages already
    /// queued are received first; [`Error::is_disconnected`] says so.
    #[error("{0}")]
    Disconnected(String),
    /// A wait ran past its deadline (see [the timeout convention](Error#one-timeout-convention)).
    #[error("{what} timed out{}", after_suffix(*.after))]
    Timeout {
        /// What waited, and for what ("get on a queue", "barrier wait with 2 of 3
        /// parties arrived").
        what: String,
        /// How long it waited, when the caller gave a timeout.
        after: Option<Duration>,
    },
    /// A message, handle or job that arrived was malformed or hostile.
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    /// A value could not be encoded for sending.
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// Shared memory could not be reserved (a full `/dev/shm`, a memory limit).
    #[error("{message}")]
    OutOfSharedMemory {
        /// The bytes asked for.
        size: u64,
        /// The bytes that were left under the limit, where known.
        limit: Option<u64>,
        /// Which limit: `"cgroup memory.max"`, `"MemAvailable"`, `"/dev/shm"`.
        limit_source: String,
        /// What was being made, the figures, and what to do.
        message: String,
    },
    /// Too many file descriptors: the process is at its `RLIMIT_NOFILE` soft limit (or
    /// the system at its file table limit).
    #[error("{context}: {}", os_error::fd_limit_advice(*.soft, *.hard, *.in_use))]
    FdLimit {
        /// The `RLIMIT_NOFILE` soft limit (`None`: unlimited or unknown).
        soft: Option<u64>,
        /// The hard limit (`None`: unlimited or unknown).
        hard: Option<u64>,
        /// The fds this process had open.
        in_use: usize,
        /// What multiproc was doing, with the values involved.
        context: String,
    },
    /// A tensor operation got arguments it cannot work with (shape, dtype, bounds).
    #[error("{0}")]
    Tensor(String),
    /// The shm manager could not be reached or started.
    #[error("shm manager: {0}")]
    Manager(String),
    /// A lock's previous owner died while holding it; the protected state may be
    /// inconsistent. The lock is now held by the caller (through `acquire`) or by the
    /// guard in the [`LockError`](crate::LockError) (through `lock`).
    #[error("{message}")]
    OwnerDied {
        /// The process id of the holder that died; 0 when no longer known (the lock's
        /// page remembers the pids of its 64 most recent holders).
        pid: u32,
        /// What was held, who holds it now, and what to check.
        message: String,
    },
    /// One task of a [`Pool`](crate::Pool) failed: it panicked, returned `Err`, or its
    /// worker process died while running it. The pool and its other tasks carry on.
    #[error("task {index} failed: {message}")]
    TaskFailed {
        /// The task's index in the submitted items.
        index: usize,
        /// Why, to match on: the task's `Err` and a panic are told apart from a dead
        /// worker and from a task that never ran.
        reason: TaskFailure,
        /// What happened: the text of the task's error (a user's error type crosses
        /// from the worker as its `Display` text), the panic text and place, or how the
        /// worker died.
        message: String,
    },
    /// An argument was out of range or otherwise unusable.
    #[error("{0}")]
    InvalidArgument(String),
    /// A non-blocking put ([`Queue::try_put`](crate::Queue::try_put)) found no room.
    #[error("{0}")]
    Full(String),
    /// A user's own error, carried through multiproc's `Result` (see [`Error::user`]).
    /// It crosses a queue as its text.
    #[error("{0}")]
    User(#[source] UserError),
    /// A [`DataLoader`](crate::data::DataLoader) could not load a batch: its worker
    /// returned `Err`, panicked or died while loading it.
    #[error("{message}")]
    LoaderFailed {
        /// The loader worker's id (`0..num_workers`); `None` for a batch loaded in the
        /// calling process (`num_workers(0)`).
        worker: Option<usize>,
        /// The process that loaded it.
        pid: u32,
        /// The batch's index in the epoch (sampler order).
        batch: usize,
        /// The data set indices of the batch's samples.
        indices: Vec<usize>,
        /// What happened: "data loader worker 1 (pid 4242) failed on batch 3 (samples
        /// [6, 7]): ..." with the panic text, the error or the signal.
        message: String,
    },
    /// CUDA cannot be used here: no driver library, no device, a driver too old, or a
    /// build without the `cuda` feature.
    #[error("CUDA is not available: {reason}")]
    CudaUnavailable {
        /// Why, and what to do about it.
        reason: String,
    },
    /// A CUDA driver call failed (out of device memory included: the message names the
    /// device, the size asked and the free memory).
    #[error("{0}")]
    Cuda(String),
    /// The launcher's environment variables (torchrun, MPI, SLURM) are missing some of
    /// a set, unparsable, or contradict each other; the message names them.
    #[error("{0}")]
    Env(String),
    /// A rank of a [`ProcessGroup`](crate::dist::ProcessGroup) died (or left the
    /// group after a failure) while the others waited for it in a collective.
    #[error("{message}")]
    RankDied {
        /// The rank that is gone.
        rank: usize,
        /// Its process id, when known.
        pid: Option<u32>,
        /// What the caller was doing and what to do.
        message: String,
    },
}

/// The end of a timeout's message: how long it waited, when there was a limit.
fn after_suffix(after: Option<Duration>) -> String {
    match after {
        Some(d) => format!(" after {d:?}"),
        None => String::new(),
    }
}

impl From<Box<dyn std::error::Error + Send + Sync>> for Error {
    /// An [`Error::User`], so `?` on a boxed error works in a function returning
    /// [`multiproc::Result`](Result).
    fn from(err: Box<dyn std::error::Error + Send + Sync>) -> Self {
        Error::User(UserError::new(Arc::from(err)))
    }
}

/// Why a pool task failed ([`Error::TaskFailed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TaskFailure {
    /// The task returned `Err`.
    Returned,
    /// The task panicked.
    Panicked,
    /// Its worker process died while running it (killed, crashed, or exited).
    WorkerDied,
    /// It never ran: its chunk's arguments could not be decoded in the worker, or could
    /// not be sent again after the worker running the chunk died.
    NotRun,
    /// It ran, but its result could not be encoded, sent or decoded.
    Result,
}

impl Error {
    /// An [`Error::OutOfSharedMemory`].
    pub(crate) fn out_of_shared_memory(
        size: u64,
        limit: Option<u64>,
        limit_source: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::OutOfSharedMemory {
            size,
            limit,
            limit_source: limit_source.into(),
            message: message.into(),
        }
    }

    /// An [`Error::Timeout`]: `what` waited, for `after` when the caller gave a timeout.
    pub(crate) fn timeout(what: impl Into<String>, after: Option<Duration>) -> Self {
        Error::Timeout {
            what: what.into(),
            after,
        }
    }

    /// Wraps a user's own error as [`Error::User`], so that a function returning
    /// [`multiproc::Result`](Result) can use `?` on it: `parse(s).map_err(Error::user)?`.
    /// Anything that converts into a boxed error works: every error type (kept as it
    /// is, to downcast through [`UserError::get_ref`]), a `Box<dyn Error>`, a `String`
    /// or a `&str` (see also [`Error::msg`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use multiproc::Error;
    ///
    /// fn width(s: &str) -> multiproc::Result<usize> {
    ///     let w = s.parse::<usize>().map_err(Error::user)?;
    ///     if w > 80 {
    ///         return Err(Error::user(format!("width {w} is over 80")));
    ///     }
    ///     Ok(w)
    /// }
    /// let err = width("wide").unwrap_err();
    /// assert!(matches!(err, Error::User(_)));
    /// assert_eq!(err.to_string(), "invalid digit found in string");
    /// assert_eq!(width("81").unwrap_err().to_string(), "width 81 is over 80");
    /// ```
    pub fn user(err: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error::User(UserError::new(Arc::from(err.into())))
    }

    /// An [`Error::User`] that says `message`: anything [`Display`](std::fmt::Display),
    /// like `anyhow!`. `Error::msg(format!(..))` is `Error::user(format!(..))`; `msg`
    /// also takes a value that is `Display` without being an error.
    ///
    /// # Examples
    ///
    /// ```
    /// use multiproc::Error;
    ///
    /// fn check(rows: usize) -> multiproc::Result<()> {
    ///     if rows == 0 {
    ///         return Err(Error::msg(format!("shard has {rows} rows")));
    ///     }
    ///     Ok(())
    /// }
    /// assert_eq!(check(0).unwrap_err().to_string(), "shard has 0 rows");
    /// assert_eq!(Error::msg(42).to_string(), "42");
    /// ```
    pub fn msg(message: impl std::fmt::Display) -> Self {
        Error::user(message.to_string())
    }

    /// Whether this is an [`Error::Timeout`]: a wait ran past the deadline its caller
    /// gave, and trying again may succeed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// Whether this is an [`Error::Disconnected`]: the queue or pipe is empty and no
    /// other handle of it exists, so waiting longer can never help.
    pub fn is_disconnected(&self) -> bool {
        matches!(self, Error::Disconnected(_))
    }

    /// The raw `errno` of an [`Error::Os`].
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Os { errno, .. } => *errno,
            _ => None,
        }
    }

    /// Every failed worker this error reports (the first one included), for process
    /// errors; empty otherwise.
    pub fn failures(&self) -> Vec<Failure> {
        match self {
            Error::ProcessRaised {
                error_index,
                pid,
                message,
                others,
            } => {
                let mut all = vec![Failure {
                    error_index: *error_index,
                    pid: *pid,
                    exit_code: None,
                    signal_name: None,
                    message: message.clone(),
                }];
                all.extend(others.iter().cloned());
                all
            }
            Error::ProcessExited {
                error_index,
                pid,
                exit_code,
                signal_name,
                message,
                others,
            } => {
                let mut all = vec![Failure {
                    error_index: *error_index,
                    pid: *pid,
                    exit_code: *exit_code,
                    signal_name: signal_name.clone(),
                    message: message.clone(),
                }];
                all.extend(others.iter().cloned());
                all
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(e: &Error) -> Error {
        serde_json::from_str(&serde_json::to_string(e).unwrap()).unwrap()
    }

    #[test]
    fn an_os_error_keeps_its_io_error_as_source_across_serde() {
        let io = std::io::Error::from_raw_os_error(libc::ENOENT);
        let err = Error::os("opening a segment", io);
        assert_eq!(err.errno(), Some(libc::ENOENT));
        let again = round_trip(&err);
        assert_eq!(again, err);
        let source = std::error::Error::source(&again).expect("a source");
        assert_eq!(
            source.to_string(),
            err.to_string().split(": ").nth(1).unwrap()
        );
        let Error::Os { source, .. } = again else {
            panic!()
        };
        assert_eq!(source.io_error().raw_os_error(), Some(libc::ENOENT));
        // Without an errno the text survives.
        let other = Error::from(std::io::Error::other("no such widget"));
        assert!(other.to_string().ends_with("no such widget"), "{other}");
        assert_eq!(round_trip(&other), other);
    }

    #[test]
    fn a_user_error_travels_as_its_text_and_keeps_its_type_here() {
        let err = Error::user(std::fmt::Error);
        let Error::User(inner) = &err else { panic!() };
        assert!(inner.get_ref().downcast_ref::<std::fmt::Error>().is_some());
        let again = round_trip(&err);
        assert_eq!(again, err, "compared by text");
        assert_eq!(again.to_string(), std::fmt::Error.to_string());
        let boxed: Box<dyn std::error::Error + Send + Sync> = "bad shard".into();
        assert_eq!(Error::from(boxed).to_string(), "bad shard");
        // Text and boxed errors are user errors too, without a wrapper of their own.
        assert_eq!(Error::user("bad row").to_string(), "bad row");
        assert_eq!(Error::user(format!("row {}", 3)).to_string(), "row 3");
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(std::fmt::Error);
        let Error::User(inner) = Error::user(boxed) else {
            panic!()
        };
        assert!(inner.get_ref().downcast_ref::<std::fmt::Error>().is_some());
        assert_eq!(Error::msg(7).to_string(), "7");
    }

    #[test]
    fn a_timeout_says_what_waited_and_how_long() {
        let err = Error::timeout("a get on an empty queue", Some(Duration::from_millis(250)));
        assert!(err.is_timeout());
        assert_eq!(
            err.to_string(),
            "a get on an empty queue timed out after 250ms"
        );
        assert_eq!(round_trip(&err), err);
        let forever = Error::timeout("a send", None);
        assert_eq!(forever.to_string(), "a send timed out");
        assert!(!Error::Full("no room".into()).is_timeout());
    }
}
