//! How failed system calls become [`Error`]s: [`Error::os`] (where "too many open
//! files" becomes an [`Error::FdLimit`], whatever call ran into it),
//! [`Error::fd_limit`] with this process's figures, and `From<std::io::Error>`.
//!
//! # Safety
//!
//! One `fcntl(F_GETFD)` through libc, which only reads the flags of an fd number (open
//! or not), to count open fds where `/proc/self/fd` cannot be listed.
//!
//! These live in the system layer, not beside the error types, because measuring the
//! fd usage is a system call of its own ([`fd_usage`]).

use crate::error::{Error, OsError};

impl Error {
    /// An [`Error::FdLimit`] for `context`, with this process's limits and fd count.
    pub(crate) fn fd_limit(context: impl Into<String>) -> Self {
        let (soft, hard, in_use) = fd_usage();
        Error::FdLimit {
            soft,
            hard,
            in_use,
            context: context.into(),
        }
    }

    /// An [`Error::Os`] from a system error and what we were doing; "too many open
    /// files" (`EMFILE`, `ENFILE`) is an [`Error::FdLimit`] instead, wherever it comes
    /// from.
    pub(crate) fn os(context: impl Into<String>, err: impl Into<std::io::Error>) -> Self {
        let err = err.into();
        if matches!(err.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) {
            return Error::fd_limit(format!("{} ({err})", context.into()));
        }
        Error::Os {
            context: context.into(),
            message: err.to_string(),
            errno: err.raw_os_error(),
            source: OsError::new(err),
        }
    }
}

impl From<std::io::Error> for Error {
    /// An [`Error::Os`] with the io error as its source; the context is its kind.
    fn from(err: std::io::Error) -> Self {
        Error::os(format!("i/o error ({:?})", err.kind()), err)
    }
}

/// This process's `RLIMIT_NOFILE` (soft, hard; `None` for unlimited) and its open fds.
pub(super) fn fd_usage() -> (Option<u64>, Option<u64>, usize) {
    let (soft, hard) = super::fd_limit::soft_and_hard();
    (soft, hard, open_fd_count(soft))
}

/// How many fds this process has open. Lists `/proc/self/fd` (which takes an fd
/// itself); at the fd limit, where that fails, probes every number below the soft
/// limit `soft` (up to 65,536 of them) instead.
fn open_fd_count(soft: Option<u64>) -> usize {
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        // The listing's own fd is in it.
        return dir.count().saturating_sub(1);
    }
    let probe_to = soft.unwrap_or(1 << 16).min(1 << 16) as i32;
    (0..probe_to)
        // SAFETY: F_GETFD only reads the flags of an fd number, open or not.
        .filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1)
        .count()
}
