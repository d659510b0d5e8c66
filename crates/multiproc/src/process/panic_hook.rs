//! The worker's panic hook: what a panic on the job thread said (message, location,
//! backtrace when `RUST_BACKTRACE` asks for it, trimmed to the user's frames), and what
//! the job's helper threads said before it, for the worker's report.
//!
//! The hook is installed once per worker, on the thread that runs the job; panics on
//! other threads are recorded as helper panics (the first few) and then reported as
//! usual by the previous hook.

use std::backtrace::{Backtrace, BacktraceStatus};
use std::panic::PanicHookInfo;
use std::sync::{Mutex, Once, OnceLock};
use std::thread::{self, ThreadId};

use super::error_file;

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

/// Records panics from now on (the calling thread is the job thread).
pub(super) fn install_panic_hook() {
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

/// The helper threads' panics recorded so far: (thread name, text).
pub(super) fn take_helper_panics() -> Vec<(String, String)> {
    HELPER_PANICS
        .lock()
        .map(|mut h| std::mem::take(&mut *h))
        .unwrap_or_default()
}

/// The job thread's panic backtrace, captured for the error file.
pub(super) fn take_recorded_backtrace() -> Option<String> {
    RECORDED_BACKTRACE
        .lock()
        .ok()
        .and_then(|mut slot| slot.take())
}

/// The job thread's recorded panic text, if a panic was recorded.
pub(super) fn take_recorded_panic() -> Option<String> {
    RECORDED_PANIC.lock().ok().and_then(|mut slot| slot.take())
}

/// The text of a panic payload (`&str` or `String`).
pub(super) fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
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
