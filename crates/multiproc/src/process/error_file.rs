//! torchelastic's error file: when a worker fails and `TORCHELASTIC_ERROR_FILE` is set
//! (torchrun sets it per worker), the worker writes the failure there in the JSON that
//! torch's `record` decorator writes, so torchrun's failure summary shows our message:
//!
//! ```json
//! {"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "1700000000"}}}
//! ```
//!
//! The backtrace (of the panic; where the worker returned `Err`, the message alone) goes
//! in `py_callstack`.

use std::time::{SystemTime, UNIX_EPOCH};

/// The variable torchrun sets to the path each worker writes its error to.
pub(crate) const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Whether this worker should write an error file when it fails.
pub(crate) fn requested() -> bool {
    std::env::var_os(ERROR_FILE_VAR).is_some_and(|p| !p.is_empty())
}

/// torch's JSON for a failure `message` with its `backtrace`.
pub(crate) fn render(message: &str, backtrace: Option<&str>, timestamp: u64) -> String {
    let doc = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": backtrace.unwrap_or(message),
                "timestamp": timestamp.to_string(),
            },
        },
    });
    doc.to_string()
}

/// Writes the error file when `TORCHELASTIC_ERROR_FILE` asks for one; a failure to
/// write is said on stderr (the worker is exiting, there is no one else to tell).
pub(crate) fn write_if_asked(message: &str, backtrace: Option<String>) {
    let Some(path) = std::env::var_os(ERROR_FILE_VAR).filter(|p| !p.is_empty()) else {
        return;
    };
    let timestamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let json = render(message, backtrace.as_deref(), timestamp);
    if let Err(e) = std::fs::write(&path, json) {
        eprintln!(
            "multiproc worker: cannot write the error file {ERROR_FILE_VAR}={}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}
