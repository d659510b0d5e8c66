//! [`init`]: where a process that multiproc started takes its job.
//!
//! The process's [`Role`] (from [`ROLE_VAR`]) chooses the job: a spawned worker runs the
//! job loop ([`run_worker`]) on the socket it inherited, the fork server and the shm
//! manager run their servers. A process multiproc did not start returns from `init`
//! after raising its fd limit and arranging the tree's cleanup at exit.

use std::sync::Once;

use super::forkserver;
use super::worker::{EXIT_NO_JOB, WORKER_FD_VAR, run_worker};
use crate::error::Error;
use crate::role::{ROLE_VAR, Role};
use crate::sys::process as sys;

/// Runs the job of a process that multiproc started, then exits; returns at once
/// (after one environment lookup) in any other process. Call it first thing in `main`.
///
/// multiproc starts workers ([`StartMethod::Spawn`](crate::StartMethod)), its fork
/// server and its shm manager by executing the current program again with
/// `MULTIPROC_ROLE` set; `init` is where such a process takes its job instead of running
/// your `main`. It must run before your program starts any thread: it edits the
/// environment (removing multiproc's variables so that processes the job starts do not
/// inherit them).
///
/// ```no_run
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     multiproc::spawn(|rank, greeting: String| println!("{greeting} from {rank}"), "hello".to_string(), 2)
/// }
/// ```
///
/// In `cargo test` integration tests, libtest owns `main`: use [`test_init!`](crate::test_init)
/// instead.
///
/// `init` also raises this process's soft `RLIMIT_NOFILE` to its hard limit, as the Go
/// runtime does: every received large tensor and every queue end is an open fd, and the
/// usual soft limit of 1024 is far below what the kernel allows. Workers inherit the
/// raised limit. Set `MULTIPROC_KEEP_NOFILE_LIMIT=1` to keep the soft limit as it is
/// (for a program that still uses `select(2)`, whose fd sets stop at 1024).
pub fn init() {
    raise_nofile_limit();
    let Some(value) = std::env::var_os(ROLE_VAR) else {
        // A process multiproc did not start may be the root of a tree: it cleans up
        // after a killed shm manager as it exits (see `shm::tree`).
        static AT_EXIT: Once = Once::new();
        AT_EXIT.call_once(|| sys::at_exit(clean_up_at_exit));
        return;
    };
    // The process is single-threaded here: it was just executed by multiproc and `init`
    // runs first in `main` (or before it, from `test_init!`).
    sys::remove_env_single_threaded(ROLE_VAR);
    match value.to_str().and_then(Role::from_name) {
        Some(Role::Worker) => {
            let code = run_spawned_worker();
            sys::flush_stdio();
            std::process::exit(code)
        }
        Some(Role::Forkserver) => forkserver::serve_from_env(),
        Some(Role::ShmManager) => crate::manager::serve_from_env(),
        None => {
            let expected = Role::ALL.map(Role::name).join(", ");
            eprintln!(
                "multiproc: unknown {ROLE_VAR}={value:?} (expected one of {expected}); \
                 unset it to run this program normally"
            );
            std::process::exit(EXIT_NO_JOB)
        }
    }
}

extern "C" fn clean_up_at_exit() {
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(crate::shm::registry::clean_up_at_root_exit);
}

/// Turns `init`'s raising of the soft fd limit off.
pub(crate) const KEEP_NOFILE_VAR: &str = "MULTIPROC_KEEP_NOFILE_LIMIT";

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, unless [`KEEP_NOFILE_VAR`] is set
/// to something other than `0` or empty. Best effort: a failure leaves the limit as it was.
fn raise_nofile_limit() {
    if std::env::var_os(KEEP_NOFILE_VAR).is_some_and(|v| !v.is_empty() && v != "0") {
        return;
    }
    crate::sys::fd_limit::raise_soft_to_hard();
}

/// A spawned worker: take the socket named in the environment and run its job.
fn run_spawned_worker() -> i32 {
    let var = std::env::var(WORKER_FD_VAR).unwrap_or_default();
    sys::remove_env_single_threaded(WORKER_FD_VAR);
    let sock = var
        .parse::<i32>()
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "{WORKER_FD_VAR}={var:?} is not an fd number: this process was not started by multiproc"
            ))
        })
        .and_then(|raw| sys::take_inherited_socket(raw, WORKER_FD_VAR));
    match sock {
        Ok(sock) => run_worker(sock),
        Err(e) => {
            eprintln!("multiproc worker (pid {}): {e}", sys::current_pid());
            EXIT_NO_JOB
        }
    }
}
