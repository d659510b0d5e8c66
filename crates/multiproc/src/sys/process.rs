//! Processes at the system level: re-executing ourselves, forking, pidfds, waiting,
//! signals, the parent-death signal, the few environment and name changes a new
//! worker makes to itself, and who we are (pid, parent's pid, uid, thread id) and whether another
//! process still lives (`/proc`). (The pid a hot path asks for, cached, and the fork
//! generation are `fork_local`'s: an atfork handler keeps both.)
//!
//! # Safety
//!
//! `fork` (only where the process is single-threaded, or followed at once by
//! `exec`/`_exit` with async-signal-safe calls in between), `setenv` while
//! single-threaded, and
//! taking ownership of an inherited fd number after checking it is open and claimed by
//! nothing else.
//!
//! Every child made here gets `PR_SET_PDEATHSIG(SIGKILL)` before it runs any of our
//! code, then checks that its parent is still the process that made it (the parent may
//! have died between `fork` and `prctl`, in which case the signal would never come).
//! The death signal fires when the *thread* that forked exits, so callers fork from a
//! thread that lives as long as the process (see `process::launch`).
//!
//! Children are identified by pidfd from the moment they exist: signals go through
//! `pidfd_send_signal` and exits are observed by polling the pidfd, so a recycled pid
//! can never be signalled or waited on by mistake.

use std::ffi::{CStr, OsString};
use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Instant;

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal, WaitId, WaitIdOptions};

use super::Deadline;
use crate::error::{Error, Result};

/// How a child ended, as `waitid` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawExit {
    /// The exit code, when it exited.
    pub code: Option<i32>,
    /// The signal number, when a signal ended it.
    pub signal: Option<i32>,
    /// Whether it dumped core.
    pub core_dumped: bool,
}

/// Re-executes this program (`/proc/self/exe`, same argv) with `env` added, keeping
/// `keep_fd` open across `exec` (every other fd of ours is close-on-exec). The child
/// gets the parent-death signal. Returns its pid.
///
/// Call only from a thread that lives as long as the process: the death signal is tied
/// to the forking thread.
pub(crate) fn spawn_self(env: &[(String, String)], keep_fd: BorrowedFd<'_>) -> Result<i32> {
    let mut args = std::env::args_os();
    let argv0 = args
        .next()
        .unwrap_or_else(|| OsString::from("multiproc-worker"));
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg0(&argv0).args(args);
    for (key, value) in env {
        cmd.env(key, value);
    }
    let parent = rustix::process::getpid();
    let fd: RawFd = keep_fd.as_raw_fd();
    let in_child = move || {
        guard_against_orphaning(parent);
        // Clear close-on-exec on the job socket only, and only in the child.
        // SAFETY: fcntl on an fd number the parent keeps open until spawn returns;
        // F_SETFD takes an int argument.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } == -1 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: `in_child` runs between fork and exec and makes only async-signal-safe
    // system calls (prctl, getppid, fcntl, _exit); it allocates nothing.
    unsafe { cmd.pre_exec(in_child) };
    let child = cmd.spawn().map_err(|e| {
        Error::os(
            format!(
                "re-executing /proc/self/exe ({}) as a worker",
                argv0.to_string_lossy()
            ),
            e,
        )
    })?;
    // Dropping `std::process::Child` neither waits nor kills: the caller owns the pid
    // from here and reaps it through its pidfd.
    Ok(child.id() as i32)
}

/// Sets the parent-death signal and makes sure the parent it refers to is `parent`.
/// Async-signal-safe; for the child side of a fork.
fn guard_against_orphaning(parent: Pid) {
    if rustix::process::set_parent_process_death_signal(Some(Signal::KILL)).is_err()
        || rustix::process::getppid() != Some(parent)
    {
        exit_immediately(3);
    }
}

/// Forks. The child sets its death signal, runs `child` and leaves with `_exit` and the
/// code it returned (101 if it panicked), never returning here; the parent gets the
/// child's pid.
///
/// In a multithreaded process the child has only the calling thread, and locks that
/// other threads held at the moment of the fork stay locked forever in it: `child`
/// should avoid shared locks (the allocator is fork-safe in glibc).
pub(crate) fn fork_child(child: impl FnOnce() -> i32) -> Result<i32> {
    let parent = rustix::process::getpid();
    // SAFETY: fork has no memory-safety preconditions of its own; in the child we only
    // run `child` (whose caveats are documented above) and then `_exit`, never
    // returning into the caller's frames.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(Error::os("fork", std::io::Error::last_os_error())),
        0 => {
            guard_against_orphaning(parent);
            let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
            flush_stdio();
            exit_immediately(code)
        }
        pid => Ok(pid),
    }
}

/// Flushes Rust's stdout and stderr (best effort: a closed terminal must not turn a
/// clean exit into a failure).
pub(crate) fn flush_stdio() {
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
}

/// `_exit`: ends the process now, without running atexit handlers or destructors.
pub(crate) fn exit_immediately(code: i32) -> ! {
    // SAFETY: `_exit` is always safe to call; it does not return.
    unsafe { libc::_exit(code) }
}

/// A pidfd for `pid`. For our own children this cannot race with pid reuse: an
/// unreaped child keeps its pid.
pub(crate) fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    let p = Pid::from_raw(pid)
        .ok_or_else(|| Error::InvalidArgument(format!("{pid} is not a process id")))?;
    rustix::process::pidfd_open(p, PidfdFlags::empty()).map_err(|e| match e {
        Errno::NOSYS => Error::os(
            format!("pidfd_open({pid}): multiproc needs Linux 5.4 or newer"),
            e,
        ),
        _ => Error::os(format!("pidfd_open({pid})"), e),
    })
}

/// SIGKILLs and reaps our child `pid`, for the rare path where it exists but could not
/// be given a pidfd (so nothing else will ever reap it).
pub(crate) fn kill_and_reap_by_pid(pid: i32) {
    if let Some(p) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, Signal::KILL);
        let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::empty());
    }
}

/// Sends signal `sig` through a pidfd. `Ok(false)` when the process has already exited.
pub(crate) fn send_signal(pidfd: BorrowedFd<'_>, sig: i32) -> Result<bool> {
    let signal = Signal::from_named_raw(sig)
        .ok_or_else(|| Error::InvalidArgument(format!("{sig} is not a signal number")))?;
    match rustix::process::pidfd_send_signal(pidfd, signal) {
        Ok(()) => Ok(true),
        Err(Errno::SRCH) => Ok(false),
        Err(e) => Err(Error::os(
            format!("sending {} to a worker", signal_name(sig)),
            e,
        )),
    }
}

/// Reaps our child `pidfd` refers to if it has exited; `Ok(None)` while it runs.
pub(crate) fn try_reap(pidfd: BorrowedFd<'_>) -> Result<Option<RawExit>> {
    loop {
        match rustix::process::waitid(
            WaitId::PidFd(pidfd),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
        ) {
            Ok(None) => return Ok(None),
            Ok(Some(status)) => {
                return Ok(Some(RawExit {
                    code: status.exit_status(),
                    signal: status.terminating_signal(),
                    core_dumped: status.dumped(),
                }));
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(Error::os("waitid(P_PIDFD) on a worker", e)),
        }
    }
}

/// Whether the process behind `pidfd` has exited (its pidfd is readable), without
/// reaping it.
pub(crate) fn has_exited(pidfd: BorrowedFd<'_>) -> bool {
    super::wait_fd(pidfd, super::Readiness::Readable, Some(Instant::now())).unwrap_or(false)
}

/// Waits until at least one of `fds` is ready for reading (a hang-up counts) or the
/// deadline passes; `Ok(false)` on timeout. An empty set only waits out the deadline.
pub(crate) fn wait_any_readable(fds: &[BorrowedFd<'_>], deadline: Deadline) -> Result<bool> {
    Ok(super::socket::poll_readable(fds, deadline)?.contains(&true))
}

/// Takes ownership of fd number `raw`, inherited across `exec` from the process that
/// started us, after checking that it is an open unix socket; marks it close-on-exec
/// again so that processes the worker starts do not inherit it.
pub(crate) fn take_inherited_socket(raw: RawFd, var: &str) -> Result<OwnedFd> {
    if raw < 0 {
        return Err(Error::InvalidArgument(format!(
            "{var}={raw} is not an fd number"
        )));
    }
    // SAFETY: F_GETFD only inspects the descriptor table; an unused number gives EBADF.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFD) };
    if flags == -1 {
        return Err(Error::InvalidArgument(format!(
            "{var}={raw} names no open file descriptor: this process was not started by multiproc"
        )));
    }
    // SAFETY: the fd is open (checked above) and nothing else in this process claims it:
    // it was handed to us across exec and its number is known only through `var`,
    // which the caller removes from the environment.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    rustix::net::sockopt::socket_type(&fd)
        .map_err(|e| Error::InvalidArgument(format!("{var}={raw} is not a socket ({e})")))?;
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
        .map_err(|e| Error::os(format!("marking inherited fd {raw} close-on-exec"), e))?;
    Ok(fd)
}

/// Sets an environment variable in a process that has a single thread: a fresh fork
/// child, or a worker before its job starts.
pub(crate) fn set_env_single_threaded(key: &str, value: &str) {
    // SAFETY: callers run with one thread (documented at each call site), so no other
    // thread can read the environment concurrently.
    unsafe { std::env::set_var(key, value) }
}

/// Removes an environment variable, under the same condition as
/// [`set_env_single_threaded`].
pub(crate) fn remove_env_single_threaded(key: &str) {
    // SAFETY: as in `set_env_single_threaded`.
    unsafe { std::env::remove_var(key) }
}

/// Names the calling thread (and, for a single-threaded process, the process as `ps`
/// shows it). Best effort.
pub(crate) fn set_process_name(name: &CStr) {
    let _ = rustix::thread::set_name(name);
}

/// The name of signal `sig` (`SIGKILL`), or `SIGRTMIN+n` / `signal n`.
pub(crate) fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSTKFLT => "SIGSTKFLT",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        libc::SIGTTOU => "SIGTTOU",
        libc::SIGURG => "SIGURG",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGIO => "SIGIO",
        libc::SIGPWR => "SIGPWR",
        libc::SIGSYS => "SIGSYS",
        // glibc reserves 32 and 33 for itself; SIGRTMIN is 34.
        34..=64 => return format!("SIGRTMIN+{}", sig - 34),
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// A pid as the public API carries it: `u32`, as `std::process::Child::id` (the
/// kernel's pids are positive, so nothing is lost).
pub(crate) fn public_pid(pid: i32) -> u32 {
    pid.unsigned_abs()
}

/// The pid of this process.
pub(crate) fn current_pid() -> i32 {
    rustix::process::getpid().as_raw_nonzero().get()
}

/// The pid of this process's parent (0 when it has none, or it is outside our pid
/// namespace).
pub(crate) fn parent_pid() -> i32 {
    rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get())
}

/// The real user id of this process (whose peers the shm manager accepts).
pub(crate) fn current_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// The kernel's id of the calling thread (`gettid`), unique among live threads of
/// every process (a lock records it as its holder).
pub(crate) fn current_tid() -> u32 {
    rustix::thread::gettid().as_raw_nonzero().get() as u32
}

/// The start time of process `pid` (clock ticks since boot, `/proc/<pid>/stat` field
/// 22), or `None` when it does not exist or is a zombie.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether process `pid` has ended (gone, or a zombie waiting to be reaped), as its
/// `/proc/<pid>/stat` says.
pub(crate) fn process_is_dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the command name, which is in parentheses and may
            // itself contain spaces or parentheses.
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].trim_start().chars().next());
            matches!(state, Some('Z') | Some('X') | Some('x'))
        }
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

/// Registers `f` to run when this process exits normally (`exit`, or returning from
/// `main`); not on `_exit`, signals or `abort`.
pub(crate) fn at_exit(f: extern "C" fn()) {
    // SAFETY: `f` is a plain function that lives as long as the program.
    let _ = unsafe { libc::atexit(f) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    #[cfg_attr(miri, ignore = "getppid is a foreign function Miri cannot run")]
    fn a_forked_child_knows_its_parent() {
        assert!(parent_pid() > 0, "the test runner has a parent");
        let me = current_pid();
        let pid = fork_child(move || i32::from(parent_pid() == me)).unwrap();
        let pidfd = pidfd_open(pid).unwrap();
        assert!(wait_any_readable(&[pidfd.as_fd()], None).unwrap());
        let exit = try_reap(pidfd.as_fd()).unwrap().unwrap();
        assert_eq!(exit.code, Some(1), "the child's parent is this process");
    }

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(libc::SIGABRT), "SIGABRT");
        assert_eq!(signal_name(36), "SIGRTMIN+2");
        assert_eq!(signal_name(99), "signal 99");
    }

    #[test]
    #[cfg_attr(miri, ignore = "fork is a foreign function Miri cannot run")]
    fn the_cached_pid_is_reset_in_a_fork_child() {
        use crate::sys::fork_local::cached_pid;
        let parent = cached_pid();
        assert_eq!(parent, std::process::id());
        let pid = fork_child(|| i32::from(cached_pid() == std::process::id())).unwrap();
        assert_ne!(pid, parent as i32);
        let pidfd = pidfd_open(pid).unwrap();
        assert!(wait_any_readable(&[pidfd.as_fd()], None).unwrap());
        let exit = try_reap(pidfd.as_fd()).unwrap().unwrap();
        assert_eq!(exit.code, Some(1), "the child sees its own pid");
    }

    #[test]
    fn fork_reap_and_exit_code() {
        let pid = fork_child(|| 7).unwrap();
        let pidfd = pidfd_open(pid).unwrap();
        assert!(wait_any_readable(&[pidfd.as_fd()], None).unwrap());
        let exit = try_reap(pidfd.as_fd()).unwrap().unwrap();
        assert_eq!(exit.code, Some(7));
        assert_eq!(exit.signal, None);
    }
}
