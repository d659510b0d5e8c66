//! The two ways a storage's bytes can live in shared memory ([`SharingStrategy`]).
//! The type is shm's, because a segment knows which kind it is; which one a process
//! uses from now on is a process-global setting owned by `crate::sharing` (torch's
//! `{get,set}_sharing_strategy`), which re-exports this type as
//! `multiproc::SharingStrategy`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How CPU storages are shared between processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SharingStrategy {
    /// `file_descriptor` (the default): an anonymous memfd whose fd travels with each
    /// message. Nothing can leak, but every shared storage a process holds is an open
    /// fd; with low fd limits prefer [`FileSystem`](Self::FileSystem).
    FileDescriptor,
    /// `file_system`: a named segment in `/dev/shm` whose name travels with each
    /// message. Needs no fds, but a name can outlive crashed processes, so multiproc runs
    /// the shm manager, which removes what is left when the process tree is gone.
    FileSystem,
}

impl SharingStrategy {
    /// Every strategy, in torch's order.
    pub(crate) const ALL: [SharingStrategy; 2] =
        [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem];

    /// torch's name: `file_descriptor` or `file_system`.
    pub const fn name(self) -> &'static str {
        match self {
            SharingStrategy::FileDescriptor => "file_descriptor",
            SharingStrategy::FileSystem => "file_system",
        }
    }

    /// A nonzero code for an atomic.
    pub(crate) fn code(self) -> u8 {
        match self {
            SharingStrategy::FileDescriptor => 1,
            SharingStrategy::FileSystem => 2,
        }
    }

    /// The strategy of a [`code`](Self::code).
    pub(crate) fn from_code(code: u8) -> Option<SharingStrategy> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }
}

impl fmt::Display for SharingStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SharingStrategy {
    type Err = Error;

    /// Parses torch's names. An unknown name is [`Error::InvalidArgument`] listing the
    /// valid ones.
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown sharing strategy {s:?}; the valid strategies are {}",
                    Self::ALL.map(SharingStrategy::name).join(", ")
                ))
            })
    }
}
