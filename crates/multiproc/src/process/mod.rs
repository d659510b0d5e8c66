//! Worker processes: [`init`], [`Process`], the start methods, [`spawn`] and
//! [`ProcessContext`].
//!
//! This module owns every process multiproc creates, from the request to the reaping:
//!
//! - `worker` — the worker side: [`init`], the job loop, the panic hook, the report.
//! - `job` — how a job names its function across `exec` (code offsets from an anchor,
//!   checked against the executable; unsafe allowed here).
//! - `code` — [`CodeRef`](code::CodeRef), a function named by code offset for other
//!   modules (the pool's task functions); unsafe allowed here too.
//! - `launch` — the long-lived launcher thread that forks every direct child.
//! - `forkserver` — the single-threaded fork server and its client.
//! - `child` — a started worker as the parent tracks it, and [`Process`].
//! - `current` — [`current_process`], [`active_children`], [`cpu_count`].
//! - `logs` — workers' `tracing` events, forwarded to the parent's subscriber.
//! - `context` — [`spawn`], [`start_processes`], [`SpawnOptions`], [`ProcessContext`].
//! - `error_file` — torchelastic's error file, written by a failed worker.
//!
//! Invariants:
//!
//! - Every child gets `PR_SET_PDEATHSIG(SIGKILL)` (tied to the launcher thread, which
//!   lives as long as the process), so no worker outlives its parent.
//! - Every child is tracked by a pidfd from the moment it exists; signals go through it,
//!   so a recycled pid is never signalled.
//! - Every child we start is reaped by us (or, for the fork server's children, by the
//!   server): joining reaps, and dropping a [`Process`] or [`ProcessContext`] waits for
//!   (non-daemon) or kills (daemon) and reaps whatever still runs. No zombies remain.
//! - Waiting never spins: it polls pidfds, status sockets and report sockets together,
//!   with the caller's deadline, and no SIGCHLD handler is installed.
//! - A worker reports its outcome on its job socket before it exits; a failed worker is
//!   described by rank, pid, and its panic message (with location, and backtrace when
//!   `RUST_BACKTRACE` is set) or its exit code / signal name.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::sys::process::{RawExit, signal_name};

mod child;
#[allow(unsafe_code)]
pub(crate) mod code;
mod context;
mod current;
mod error_file;
mod forkserver;
#[allow(unsafe_code)]
mod job;
mod launch;
mod logs;
mod worker;

pub use child::Process;
pub(crate) use context::LAUNCHER_VAR;
pub use context::{ProcessContext, SpawnOptions, spawn, start_processes};
pub use current::{ChildProcess, CurrentProcess, active_children, cpu_count, current_process};
pub use forkserver::ensure_forkserver_running;
pub use job::WorkerResult;
pub use worker::init;
pub(crate) use worker::panic_text;

/// How a worker process is started (torch's `start_method`).
///
/// | method | how | use it when |
/// |---|---|---|
/// | `Spawn` (default) | re-executes this program (`/proc/self/exe`) | always safe; ~1 ms per worker |
/// | `Fork` | `fork()` of this process | the parent is single-threaded, or its threads hold no locks the worker needs |
/// | `Forkserver` | `fork()` of a single-threaded server started on first use | many short workers from a multithreaded parent |
///
/// With `Fork`, the child is a copy of a possibly multithreaded parent that contains only
/// the forking thread: a lock another thread held at that moment (stdout, a logger, a
/// user `Mutex`) stays locked forever in the child. The child also inherits every open
/// fd of the parent. `Spawn` and `Forkserver` have neither problem; the worker function
/// and its arguments are the same for all three.
///
/// The fork server is started on first use (or by [`ensure_forkserver_running`]) and
/// lives as long as this process; `ps` shows it as `multiproc-fsrv`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StartMethod {
    /// Re-execute the current program in worker mode (torch's `spawn`).
    #[default]
    Spawn,
    /// Fork the current process (torch's `fork`).
    Fork,
    /// Fork from a single-threaded fork server (torch's `forkserver`).
    Forkserver,
}

impl StartMethod {
    /// Every start method, like `multiprocessing.get_all_start_methods()`.
    pub const ALL: [StartMethod; 3] = [
        StartMethod::Spawn,
        StartMethod::Fork,
        StartMethod::Forkserver,
    ];

    /// torch's name: `spawn`, `fork` or `forkserver`.
    pub fn name(self) -> &'static str {
        match self {
            StartMethod::Spawn => "spawn",
            StartMethod::Fork => "fork",
            StartMethod::Forkserver => "forkserver",
        }
    }
}

impl fmt::Display for StartMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for StartMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        StartMethod::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown start method {s:?}: expected spawn, fork or forkserver"
                ))
            })
    }
}

/// How a worker process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExitStatus {
    code: Option<i32>,
    signal: Option<i32>,
    core_dumped: bool,
}

impl ExitStatus {
    pub(crate) fn from_raw(raw: RawExit) -> Self {
        ExitStatus {
            code: raw.code,
            signal: raw.signal,
            core_dumped: raw.core_dumped,
        }
    }

    /// A status for a worker whose end we could not observe (another part of the
    /// program reaped it, or the fork server died first).
    pub(crate) fn unknown() -> Self {
        ExitStatus {
            code: None,
            signal: None,
            core_dumped: false,
        }
    }

    /// The exit code, when the process exited (rather than being killed by a signal).
    pub fn code(&self) -> Option<i32> {
        self.code
    }

    /// The number of the signal that ended the process.
    pub fn signal(&self) -> Option<i32> {
        self.signal
    }

    /// The name of the signal that ended the process (`SIGKILL`).
    pub fn signal_name(&self) -> Option<String> {
        self.signal.map(signal_name)
    }

    /// Whether the process exited with code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Whether the process dumped core.
    pub fn core_dumped(&self) -> bool {
        self.core_dumped
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.code, self.signal) {
            (Some(code), _) => write!(f, "exit code {code}"),
            (None, Some(sig)) => {
                write!(f, "signal {}", signal_name(sig))?;
                if self.core_dumped {
                    f.write_str(" (core dumped)")?;
                }
                Ok(())
            }
            (None, None) => f.write_str("an unknown status"),
        }
    }
}

/// Makes a `cargo test` integration-test binary able to start workers.
///
/// A spawned worker is a new run of the same executable, and it finds its job in
/// [`init`]. In a test binary, `main` belongs to libtest, so there is nowhere to call
/// `init`. Put this macro at the top of the test file instead:
///
/// ```ignore
/// multiproc::test_init!();
///
/// fn worker(rank: usize, n: u64) {
///     assert!(rank < 2 && n == 7);
/// }
///
/// #[test]
/// fn two_workers() {
///     multiproc::spawn(worker, 7u64, 2).unwrap();
/// }
/// ```
///
/// It registers a function in the executable's `.init_array`, which the C runtime calls
/// before `main` (the technique of the `ctor` crate), and that function calls [`init`]:
/// in a worker it runs the job and exits, so libtest never starts there; in the test
/// process itself it returns at once. Use it once per test binary (once per file under
/// `tests/`). Ordinary programs should call [`init`] first thing in `main` instead.
#[macro_export]
macro_rules! test_init {
    () => {
        const _: () = {
            extern "C" fn __multiproc_test_init() {
                $crate::init();
            }
            #[used]
            #[allow(unsafe_code)]
            #[unsafe(link_section = ".init_array")]
            static __MULTIPROC_TEST_INIT: extern "C" fn() = __multiproc_test_init;
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_method_names_round_trip() {
        for m in StartMethod::ALL {
            assert_eq!(m.to_string().parse::<StartMethod>().unwrap(), m);
        }
        assert!("thread".parse::<StartMethod>().is_err());
        assert_eq!(StartMethod::default(), StartMethod::Spawn);
    }

    #[test]
    fn exit_status_describes_itself() {
        let killed = ExitStatus::from_raw(RawExit {
            code: None,
            signal: Some(libc::SIGKILL),
            core_dumped: false,
        });
        assert_eq!(killed.to_string(), "signal SIGKILL");
        assert_eq!(killed.signal_name().as_deref(), Some("SIGKILL"));
        assert!(!killed.success());
        let ok = ExitStatus::from_raw(RawExit {
            code: Some(0),
            signal: None,
            core_dumped: false,
        });
        assert!(ok.success());
        assert_eq!(ok.to_string(), "exit code 0");
    }
}
