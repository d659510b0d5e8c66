//! The worker side: what [`init`] does in a process that multiproc started, and the
//! job loop every start method ends in ([`run_worker`]).
//!
//! A worker reads its [`JobHeader`] and then its arguments from the job socket, runs the
//! function under `catch_unwind` with a panic hook that records the message, location
//! and (when `RUST_BACKTRACE` asks for it) the backtrace, sends one [`Report`] back on
//! the same socket, flushes stdout and stderr, and exits: 0 after success, 1 after a
//! panic or an `Err` (the report says which and why), 2 when it never got a job.

use std::backtrace::{Backtrace, BacktraceStatus};
use std::os::fd::{AsFd, OwnedFd};
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::sync::{Mutex, Once, OnceLock};
use std::thread::{self, ThreadId};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::job::{Failed, JobHeader};
use super::{error_file, forkserver};
use crate::sys::deadline_after;
use crate::sys::process as sys;
use crate::wire;

/// Which job a process started by multiproc has: `worker`, `forkserver`, `shm-manager`.
pub(crate) const ROLE_VAR: &str = "MULTIPROC_ROLE";
/// The number of the inherited job socket of a spawned worker.
pub(crate) const WORKER_FD_VAR: &str = "MULTIPROC_WORKER_FD";

/// Exit code of a worker whose job raised (the report carries the details).
pub(crate) const EXIT_RAISED: i32 = 1;
/// Exit code of a worker that never received a job.
const EXIT_NO_JOB: i32 = 2;

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
    let Some(role) = std::env::var_os(ROLE_VAR) else {
        // A process multiproc did not start may be the root of a tree: it cleans up
        // after a killed shm manager as it exits (see `manager::tree`).
        static AT_EXIT: Once = Once::new();
        AT_EXIT.call_once(|| sys::at_exit(clean_up_at_exit));
        return;
    };
    // The process is single-threaded here: it was just executed by multiproc and `init`
    // runs first in `main` (or before it, from `test_init!`).
    sys::remove_env_single_threaded(ROLE_VAR);
    match role.to_str() {
        Some("worker") => {
            let code = run_spawned_worker();
            sys::flush_stdio();
            std::process::exit(code)
        }
        Some("forkserver") => forkserver::serve_from_env(),
        Some("shm-manager") => crate::manager::serve_from_env(),
        _ => {
            eprintln!(
                "multiproc: unknown {ROLE_VAR}={role:?} (expected worker, forkserver or shm-manager); \
                 unset it to run this program normally"
            );
            std::process::exit(EXIT_NO_JOB)
        }
    }
}

extern "C" fn clean_up_at_exit() {
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(crate::manager::tree::clean_up_at_root_exit);
}

/// Turns `init`'s raising of the soft fd limit off.
pub(crate) const KEEP_NOFILE_VAR: &str = "MULTIPROC_KEEP_NOFILE_LIMIT";

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, unless [`KEEP_NOFILE_VAR`] is set
/// to something other than `0` or empty. Best effort: a failure leaves the limit as it was.
fn raise_nofile_limit() {
    if std::env::var_os(KEEP_NOFILE_VAR).is_some_and(|v| !v.is_empty() && v != "0") {
        return;
    }
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        );
    }
}

/// A spawned worker: take the socket named in the environment and run its job.
fn run_spawned_worker() -> i32 {
    let var = std::env::var(WORKER_FD_VAR).unwrap_or_default();
    sys::remove_env_single_threaded(WORKER_FD_VAR);
    let sock = var
        .parse::<i32>()
        .map_err(|_| {
            crate::Error::InvalidArgument(format!(
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
    /// starting with "process RANK".
    Raised {
        /// "process 1 raised: ..." with location and backtrace when there are some.
        message: String,
    },
}

/// Runs the job that arrives on `sock` and reports its outcome there. Returns the exit
/// code; the caller flushes and exits.
pub(crate) fn run_worker(sock: OwnedFd) -> i32 {
    let header: JobHeader = match wire::recv_packet(sock.as_fd(), None)
        .and_then(|p| p.ok_or_else(|| crate::Error::Closed("no job arrived".into())))
        .and_then(wire::decode)
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
            message: format!("process {rank} returned an error: {text}"),
        },
        Ok(Err(Failed::Setup(text))) => Report::Raised {
            message: format!("process {rank} could not start its job: {text}"),
        },
        Err(payload) => {
            let text = take_recorded_panic().unwrap_or_else(|| payload_text(&*payload));
            Report::Raised {
                message: format!("process {rank} raised: {text}"),
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

/// The panic being recorded on the worker's thread: text and location, and the
/// backtrace when enabled.
static RECORDED_PANIC: Mutex<Option<String>> = Mutex::new(None);
/// The panic's backtrace, captured even without `RUST_BACKTRACE` when torchelastic
/// asked for an error file (its `py_callstack`).
static RECORDED_BACKTRACE: Mutex<Option<String>> = Mutex::new(None);
/// The thread that runs the job; panics on other threads keep the default report.
static JOB_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// Panics of the job's helper threads (thread name, text and location), the first few:
/// a job that unwraps a helper's `join` only sees an opaque `Any` payload, so the
/// report adds what the helper itself said.
static HELPER_PANICS: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
/// How many helper panics a report carries.
const HELPER_PANICS_KEPT: usize = 4;

fn install_panic_hook() {
    static ONCE: Once = Once::new();
    let _ = JOB_THREAD.set(thread::current().id());
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if JOB_THREAD.get() == Some(&thread::current().id()) {
                let text = describe_panic(info);
                if error_file::requested() {
                    if let Ok(mut slot) = RECORDED_BACKTRACE.lock() {
                        *slot = Some(Backtrace::force_capture().to_string());
                    }
                }
                if let Ok(mut slot) = RECORDED_PANIC.lock() {
                    *slot = Some(text);
                    return;
                }
            } else if JOB_THREAD.get().is_some() {
                if let Ok(mut helpers) = HELPER_PANICS.lock() {
                    if helpers.len() < HELPER_PANICS_KEPT {
                        let name = thread::current().name().unwrap_or("<unnamed>").to_string();
                        helpers.push((name, describe_panic(info)));
                    }
                }
            }
            previous(info)
        }));
    });
}

fn describe_panic(info: &PanicHookInfo<'_>) -> String {
    let mut text = payload_text(info.payload());
    if let Some(loc) = info.location() {
        text.push_str(&format!(
            " (at {}:{}:{})",
            loc.file(),
            loc.line(),
            loc.column()
        ));
    }
    let backtrace = Backtrace::capture();
    if backtrace.status() == BacktraceStatus::Captured {
        let full = backtrace.to_string();
        let shown = if std::env::var("RUST_BACKTRACE").as_deref() == Ok("full") {
            full
        } else {
            trim_backtrace(&full)
        };
        text.push_str(&format!("\n\nstack backtrace:\n{shown}"));
    }
    text
}

/// Keeps the frames between the panic machinery and multiproc's job trampoline: the
/// user's code. `RUST_BACKTRACE=full` keeps everything.
fn trim_backtrace(full: &str) -> String {
    let mut frames: Vec<String> = Vec::new();
    for line in full.lines() {
        let starts_frame = line
            .trim_start()
            .split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        match frames.last_mut() {
            Some(frame) if !starts_frame => {
                frame.push('\n');
                frame.push_str(line);
            }
            _ => frames.push(line.to_string()),
        }
    }
    let end = frames
        .iter()
        .position(|f| f.contains("multiproc::process::job::trampoline"))
        .unwrap_or(frames.len());
    let start = frames[..end]
        .iter()
        .rposition(|f| {
            f.contains("core::panicking::")
                || f.contains("rust_begin_unwind")
                || f.contains("std::panicking::")
        })
        .map_or(0, |i| i + 1);
    if start >= end {
        return full.to_string();
    }
    let mut out = frames[start..end].join("\n");
    out.push_str(
        "\n(panic machinery and multiproc's worker frames omitted; RUST_BACKTRACE=full shows them)",
    );
    out
}

fn take_helper_panics() -> Vec<(String, String)> {
    HELPER_PANICS
        .lock()
        .map(|mut h| std::mem::take(&mut *h))
        .unwrap_or_default()
}

fn take_recorded_backtrace() -> Option<String> {
    RECORDED_BACKTRACE
        .lock()
        .ok()
        .and_then(|mut slot| slot.take())
}

fn take_recorded_panic() -> Option<String> {
    RECORDED_PANIC.lock().ok().and_then(|mut slot| slot.take())
}

fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

/// The text of a panic caught on the job thread: the recorded message with its
/// location (and backtrace when enabled), else the payload's text.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    take_recorded_panic().unwrap_or_else(|| payload_text(payload))
}
