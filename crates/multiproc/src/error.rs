//! The error types.
//!
//! [`Error`] is the umbrella every fallible operation converts into, so `?` works in a
//! user's `main`. Each variant carries what is needed to act on it: the segment, the
//! size, the pid, the rank, the limit. Errors are `Serialize`, so a worker's failure can
//! cross a queue like any other value.
//!
//! Operations that take ownership of an item hand it back when they fail
//! ([`PutError`]), so nothing the user sent is lost.

use std::fmt;

use serde::{Deserialize, Serialize};

/// `Result<T, multiproc::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in multiproc.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A worker panicked or returned `Err`.
    #[error("{message}")]
    ProcessRaised {
        /// Rank of the first worker that failed.
        error_index: usize,
        /// Its process id.
        pid: i32,
        /// What it raised: rank, panic text and location (and the backtrace when
        /// `RUST_BACKTRACE` is set), or the `Display` of the returned error.
        message: String,
        /// Every other rank that failed, in the order their failures were seen.
        others: Vec<Failure>,
    },
    /// A worker exited with a non-zero code or was killed by a signal.
    #[error("{message}")]
    ProcessExited {
        /// Rank of the first worker that failed.
        error_index: usize,
        /// Its process id.
        pid: i32,
        /// The exit code, when it exited.
        exit_code: Option<i32>,
        /// The signal's name (`SIGKILL`), when a signal ended it.
        signal_name: Option<String>,
        /// "process 0 terminated with exit code 123" and advice where there is some.
        message: String,
        /// Every other rank that failed, in the order their failures were seen.
        others: Vec<Failure>,
    },
    /// A system call failed.
    #[error("{context}: {message}")]
    Os {
        /// What multiproc was doing, with the values involved.
        context: String,
        /// The system's error text.
        message: String,
        /// The raw `errno`, where there is one.
        errno: Option<i32>,
    },
    /// The channel (queue, pipe, event, process) is closed, or its other end is gone.
    #[error("{0}")]
    Closed(String),
    /// A wait ran past its deadline.
    #[error("{0}")]
    Timeout(String),
    /// A message, handle or job that arrived was malformed or hostile.
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    /// A value could not be encoded for sending.
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// Shared memory could not be reserved (a full `/dev/shm`, a memory limit).
    #[error("{0}")]
    OutOfSharedMemory(String),
    /// Too many file descriptors.
    #[error("{0}")]
    FdLimit(String),
    /// A tensor operation got arguments it cannot work with (shape, dtype, bounds).
    #[error("{0}")]
    Tensor(String),
    /// The shm manager could not be reached or started.
    #[error("shm manager: {0}")]
    Manager(String),
    /// A lock's previous owner died while holding it; the protected state may be
    /// inconsistent. The lock is now held by the caller.
    #[error("{0}")]
    OwnerDied(String),
    /// One task of a [`Pool`](crate::Pool) failed: it panicked, returned `Err`, or its
    /// worker process died while running it. The pool and its other tasks carry on.
    #[error("task {index} failed: {message}")]
    TaskFailed {
        /// The task's index in the submitted items.
        index: usize,
        /// What happened (the panic text, the error, or how the worker died).
        message: String,
    },
    /// An argument was out of range or otherwise unusable.
    #[error("{0}")]
    InvalidArgument(String),
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
        pid: Option<i32>,
        /// What the caller was doing and what to do.
        message: String,
    },
}

/// One failed worker, as carried in [`Error::ProcessRaised`] and [`Error::ProcessExited`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// The worker's rank.
    pub rank: usize,
    /// Its process id.
    pub pid: i32,
    /// The exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal's name, when a signal ended it.
    pub signal_name: Option<String>,
    /// The panic or error text, when it raised.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error {
    /// An [`Error::Os`] from a system error and what we were doing.
    pub(crate) fn os(context: impl Into<String>, err: impl Into<std::io::Error>) -> Self {
        let err = err.into();
        Error::Os {
            context: context.into(),
            message: err.to_string(),
            errno: err.raw_os_error(),
        }
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
                    rank: *error_index,
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
                    rank: *error_index,
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

/// A failed `put`/`send`: the error, and the item, handed back.
#[derive(thiserror::Error)]
#[error("{error}")]
pub struct PutError<T> {
    /// Why it failed.
    pub error: Error,
    /// The item the caller tried to send.
    pub item: T,
}

impl<T> PutError<T> {
    /// The item that was not sent.
    pub fn into_inner(self) -> T {
        self.item
    }
}

impl<T> fmt::Debug for PutError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PutError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<T> From<PutError<T>> for Error {
    fn from(e: PutError<T>) -> Self {
        e.error
    }
}
