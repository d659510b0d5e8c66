//! [`ExitStatus`]: how a worker process ended (exit code, or signal and core dump).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::sys::process::{RawExit, signal_name};

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

#[cfg(test)]
mod tests {
    use super::*;

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
