//! Becoming a daemon: `fork` (only while single-threaded), a session of its own, and
//! pointing stdio at `/dev/null`.
//!
//! # Safety
//!
//! `fork` while the process has exactly one thread (checked first), and `dup2` of an fd
//! that is open for the call onto 0..=2: neither touches Rust-owned memory.

use std::os::fd::AsRawFd;

use crate::error::{Error, Result};

/// Which side of a [`fork_single_threaded`] we are on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Forked {
    /// The original process; the child's pid.
    Parent(i32),
    /// The new process.
    Child,
}

/// How many threads this process has.
pub(crate) fn thread_count() -> Result<usize> {
    std::fs::read_dir("/proc/self/task")
        .map(Iterator::count)
        .map_err(|e| Error::os("counting threads in /proc/self/task", e))
}

/// `fork()`, refused while the process has more than one thread (a forked copy of a
/// multithreaded process may inherit locks held by threads that do not exist in it).
pub(crate) fn fork_single_threaded() -> Result<Forked> {
    let threads = thread_count()?;
    if threads != 1 {
        return Err(Error::InvalidArgument(format!(
            "cannot fork a process that has {threads} threads; start the shm manager from a \
             fresh process (re-exec), not from a running program"
        )));
    }
    // SAFETY: the process has exactly one thread (checked above), so the child is a
    // complete copy with no lock held by a vanished thread.
    match unsafe { libc::fork() } {
        -1 => Err(Error::os("fork", std::io::Error::last_os_error())),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(pid)),
    }
}

/// Makes this process the leader of a new session (`setsid`): no controlling terminal,
/// not in its starter's process group. Fails only in a process that already leads a
/// process group (a fork child never does).
pub(crate) fn start_new_session() -> Result<()> {
    rustix::process::setsid()
        .map(drop)
        .map_err(|e| Error::os("setsid", e))
}

/// Points stdin, stdout and stderr at `/dev/null`, so a daemon holds no pipe or
/// terminal of the process that started it.
pub(crate) fn redirect_stdio_to_null() -> Result<()> {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| Error::os("opening /dev/null", e))?;
    for target in 0..=2 {
        // SAFETY: `null` is an open fd for the duration of the call; dup2 onto 0..=2
        // replaces the standard streams, which this process owns and uses only through
        // std's handles that tolerate the swap.
        if unsafe { libc::dup2(null.as_raw_fd(), target) } == -1 {
            return Err(Error::os(
                format!("dup2(/dev/null, {target})"),
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}
