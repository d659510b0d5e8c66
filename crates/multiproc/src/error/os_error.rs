//! [`OsError`], the system error inside [`Error::Os`](super::Error::Os), and the advice
//! an [`Error::FdLimit`](super::Error::FdLimit) gives. Turning a failed system call into
//! an [`Error`](super::Error) (`Error::os`, `Error::fd_limit`) is the system layer's
//! part: see `crate::sys::os_errors`.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The [`std::io::Error`] inside [`Error::Os`](super::Error::Os): `Clone` (shared),
/// compared and serialized as its errno and text; deserialized, it is rebuilt from the
/// errno.
#[derive(Clone)]
pub struct OsError(Arc<std::io::Error>);

impl OsError {
    /// Wraps `err`.
    pub(crate) fn new(err: std::io::Error) -> Self {
        OsError(Arc::new(err))
    }

    /// The system's error.
    pub fn io_error(&self) -> &std::io::Error {
        &self.0
    }
}

impl fmt::Debug for OsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for OsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for OsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl PartialEq for OsError {
    fn eq(&self, other: &Self) -> bool {
        self.0.raw_os_error() == other.0.raw_os_error() && self.0.to_string() == other.0.to_string()
    }
}

impl Serialize for OsError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        (self.0.raw_os_error(), self.0.to_string()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for OsError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let (errno, text) = <(Option<i32>, String)>::deserialize(d)?;
        Ok(OsError(Arc::new(match errno {
            Some(errno) => std::io::Error::from_raw_os_error(errno),
            None => std::io::Error::other(text),
        })))
    }
}

/// The figures and the ways out of an [`Error::FdLimit`](super::Error::FdLimit).
pub(super) fn fd_limit_advice(soft: Option<u64>, hard: Option<u64>, in_use: usize) -> String {
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |v| v.to_string());
    format!(
        "too many open files: this process has {in_use} open, its RLIMIT_NOFILE soft limit is {} \
         (hard {}); raise it (`ulimit -n {}`; multiproc::init raises the soft limit to the \
         hard one unless MULTIPROC_KEEP_NOFILE_LIMIT=1), drop received tensors sooner, or use \
         the file_system sharing strategy (one fd per tensor only while it is being sent)",
        show(soft),
        show(hard),
        show(hard),
    )
}
