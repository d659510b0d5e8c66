//! The job loop every start method ends in ([`run_worker`]): what a worker does with the
//! job socket it was given.
//!
//! A worker reads its [`JobHeader`] and then its arguments from the job socket, runs the
//! function under `catch_unwind` with the panic hook of `panic_hook` (which records the
//! message, location and, when `RUST_BACKTRACE` asks for it, the backtrace), sends one
//! [`Report`] back on the same socket, and returns its exit code: 0 after success, 1
//! after a panic or an `Err` (the report says which and why), 2 when it never got a
//! job. The caller flushes stdout and stderr and exits.

use std::os::fd::{AsFd, OwnedFd};
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error_file;
use super::job::{Failed, JobHeader};
use super::panic_hook::{
    install_panic_hook, payload_text, take_helper_panics, take_recorded_backtrace,
    take_recorded_panic,
};
use crate::error::Error;
use crate::sys::deadline_after;
use crate::sys::process as sys;
use crate::wire;

/// The number of the inherited job socket of a spawned worker.
pub(crate) const WORKER_FD_VAR: &str = "MULTIPROC_WORKER_FD";

/// Exit code of a worker whose job raised (the report carries the details).
pub(crate) const EXIT_RAISED: i32 = 1;
/// Exit code of a worker that never received a job.
pub(super) const EXIT_NO_JOB: i32 = 2;

/// Sets what torchrun gives a worker: `RANK`, `LOCAL_RANK`, `WORLD_SIZE`. For forked
/// children, which are single-threaded (spawned workers get these from `exec`).
pub(crate) fn set_worker_env<K: AsRef<str>>(env: &[(K, String)]) {
    for (key, value) in env {
        sys::set_env_single_threaded(key.as_ref(), value);
    }
}

/// What a worker tells its parent before it exits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Report {
    /// The function returned normally.
    Ok,
    /// It panicked, returned `Err`, or could not start: the full message for the user,
    /// starting with the worker as `job::describe` names it.
    Raised {
        /// "transformer-1 (rank 1, pid 4242) raised: ..." (or "process 1 (pid 4242)
        /// raised: ..." for a worker without a name) with location and backtrace when
        /// there are some.
        message: String,
    },
}

/// Runs the job that arrives on `sock` and reports its outcome there. Returns the exit
/// code; the caller flushes and exits.
pub(crate) fn run_worker(sock: OwnedFd) -> i32 {
    let header: JobHeader = match wire::recv_packet(sock.as_fd(), None)
        .and_then(|p| p.ok_or_else(|| Error::Closed("no job arrived".into())))
        .and_then(|p| wire::decode(p, &crate::shm::Returns::plain()))
    {
        Ok(h) => h,
        Err(e) => {
            eprintln!(
                "multiproc worker (pid {}): cannot read its job: {e}",
                sys::current_pid()
            );
            return EXIT_NO_JOB;
        }
    };
    let rank = header.rank;
    let who = super::job::describe(rank, &header.name, std::process::id());
    super::current::set_identity(rank, header.name.clone());
    let _forwarding = header
        .log
        .clone()
        .and_then(|sink| super::logs::install_in_worker(sink, rank));
    install_panic_hook();
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| header.run(sock.as_fd())));
    // The worker leaves with `_exit`: give back its shared-memory references now,
    // before the parent can learn that it has finished.
    crate::shm::release_before_exit();
    let helpers = take_helper_panics();
    let report = match outcome {
        Ok(Ok(())) => Report::Ok,
        Ok(Err(Failed::Returned(text))) => Report::Raised {
            message: format!("{who} returned an error: {text}"),
        },
        Ok(Err(Failed::Setup(text))) => Report::Raised {
            message: format!("{who} could not start its job: {text}"),
        },
        Err(payload) => {
            let text = take_recorded_panic().unwrap_or_else(|| payload_text(&*payload));
            Report::Raised {
                message: format!("{who} raised: {text}"),
            }
        }
    };
    let report = match report {
        Report::Raised { mut message } if !helpers.is_empty() => {
            for (thread, text) in &helpers {
                message.push_str(&format!(
                    "\n(before that, thread '{thread}' panicked: {text})"
                ));
            }
            Report::Raised { message }
        }
        other => other,
    };
    let code = match &report {
        Report::Ok => 0,
        Report::Raised { message } => {
            error_file::write_if_asked(message, take_recorded_backtrace());
            EXIT_RAISED
        }
    };
    let sent = wire::encode(&report)
        .and_then(|mut m| m.send(sock.as_fd(), deadline_after(Some(Duration::from_secs(10)))));
    if let Err(e) = sent {
        // The parent is gone or not listening: say it here so it is not lost.
        match &report {
            Report::Raised { message } => eprintln!("{message}\n(and its report failed: {e})"),
            Report::Ok => eprintln!("multiproc worker {rank}: cannot report success: {e}"),
        }
    }
    code
}
