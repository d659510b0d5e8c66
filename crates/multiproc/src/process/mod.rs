//! Worker processes: [`init`], [`Process`], the start methods, [`spawn`] and
//! [`ProcessContext`].
//!
//! This module owns every process multiproc creates, from the request to the reaping.
//! Its files, lowest first (each uses only those above it in this list):
//!
//! - `start_method` — [`StartMethod`]; `exit_status` — [`ExitStatus`];
//!   `worker_outcome` — [`IntoWorkerOutcome`], what a worker function may return.
//! - `current` — [`current_process`], [`active_children`], [`cpu_count`].
//! - `logs` — workers' `tracing` events, forwarded to the parent's subscriber.
//! - `error_file` — torchelastic's error file, written by a failed worker.
//! - `code` — [`Code`](code::Code) and [`CodeCall`](code::CodeCall), functions of
//!   this executable named across `exec` by code offset (from an anchor, checked
//!   against the executable), behind a safe typed API: for jobs, the pool's tasks, the
//!   data loader's hooks; the only file here that turns an offset back into a
//!   function, so unsafe is allowed here (and in `test_init`'s macro).
//! - `job` — which worker function a new worker runs, as a [`CodeCall`](code::CodeCall)
//!   through a trampoline for its argument and result types.
//! - `panic_hook` — what a worker's panics said, for its report.
//! - `worker` — the job loop every start method ends in, and the worker's report.
//! - `launch` — the long-lived launcher thread that forks every direct child; it runs
//!   what its caller hands it, so it depends on nothing above it.
//! - `forkserver` — the single-threaded fork server and its client.
//! - `child_env` — the environment every child inherits: the sharing strategy and the
//!   shm manager's address.
//! - `child` — a started worker as the parent tracks it: its exit, its report, its
//!   failure.
//! - `handle` — [`Process`], the public handle of one worker, and its
//!   [`ProcessBuilder`].
//! - `context` — [`spawn`], [`start_processes`], [`SpawnOptions`], [`ProcessContext`].
//! - `init` — [`init`]: a started process's role (see `crate::role`) chooses its job.
//! - `test_init` — [`test_init!`](crate::test_init), `init` for integration tests.
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

mod child;
mod child_env;
#[allow(unsafe_code)]
pub(crate) mod code;
mod context;
mod current;
mod error_file;
mod exit_status;
mod forkserver;
mod handle;
mod init;
mod job;
mod launch;
mod logs;
mod panic_hook;
mod start_method;
mod test_init;
mod worker;
mod worker_outcome;

pub(crate) use context::LAUNCHER_VAR;
pub use context::{ProcessContext, SpawnOptions, spawn, start_processes};
pub use current::{ChildProcess, CurrentProcess, active_children, cpu_count, current_process};
pub use exit_status::ExitStatus;
pub use forkserver::ensure_running;
pub use handle::{Process, ProcessBuilder};
pub use init::init;
pub(crate) use panic_hook::panic_text;
pub use start_method::StartMethod;
pub use worker_outcome::IntoWorkerOutcome;
