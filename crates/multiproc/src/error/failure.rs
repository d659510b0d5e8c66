//! [`Failure`]: one failed worker, as process errors carry it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One failed worker, as carried in [`Error::ProcessRaised`] and [`Error::ProcessExited`].
///
/// [`Error::ProcessRaised`]: super::Error::ProcessRaised
/// [`Error::ProcessExited`]: super::Error::ProcessExited
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// The worker's index, as torch's `error_index` (and [`Error::ProcessRaised`]'s
    /// field of that name): its rank, the first argument its function got.
    ///
    /// [`Error::ProcessRaised`]: super::Error::ProcessRaised
    pub error_index: usize,
    /// Its process id.
    pub pid: u32,
    /// The exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal's name, when a signal ended it.
    pub signal_name: Option<String>,
    /// The panic or error text, when it raised.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}
