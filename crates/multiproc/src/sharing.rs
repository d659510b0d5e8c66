//! The sharing strategy: how a storage is put in shared memory (torch's
//! `torch.multiprocessing.{get,set}_sharing_strategy`).
//!
//! The setting is process-global and read at the moment a storage moves to shared
//! memory ([`Storage::share_memory_`](crate::Storage::share_memory_), or implicitly when a
//! tensor is sent). Storages already shared keep the strategy they were made with, and a
//! receiver always accepts both kinds.
//!
//! **Inheritance (differs from torch).** A process started by multiproc inherits its
//! parent's strategy at the time it was started: the start code passes
//! `MULTIPROC_SHARING_STRATEGY` in the child's environment ([`env_for_child`]), and a
//! process reads that variable the first time it needs the strategy. torch's workers
//! start with the default and must call `set_sharing_strategy` themselves. Setting the
//! variable by hand in a shell works too (`MULTIPROC_SHARING_STRATEGY=file_system`).

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The environment variable a process reads its initial strategy from.
pub(crate) const STRATEGY_ENV: &str = "MULTIPROC_SHARING_STRATEGY";

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

const ALL: [SharingStrategy; 2] = [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem];

impl SharingStrategy {
    /// torch's name: `file_descriptor` or `file_system`.
    pub const fn name(self) -> &'static str {
        match self {
            SharingStrategy::FileDescriptor => "file_descriptor",
            SharingStrategy::FileSystem => "file_system",
        }
    }

    fn code(self) -> u8 {
        match self {
            SharingStrategy::FileDescriptor => 1,
            SharingStrategy::FileSystem => 2,
        }
    }

    fn from_code(code: u8) -> Option<SharingStrategy> {
        ALL.into_iter().find(|s| s.code() == code)
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
        ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "unknown sharing strategy {s:?}; the valid strategies are {}",
                ALL.map(SharingStrategy::name).join(", ")
            ))
        })
    }
}

/// 0 until the first read, then a [`SharingStrategy::code`].
static CURRENT: AtomicU8 = AtomicU8::new(0);

/// The strategies this platform supports (both, on Linux), like torch's
/// `get_all_sharing_strategies()`.
pub fn get_all_sharing_strategies() -> &'static [SharingStrategy] {
    &ALL
}

/// The strategy this process uses for storages it shares from now on.
///
/// The first call reads `MULTIPROC_SHARING_STRATEGY` (set for workers by their parent);
/// without it the default is [`SharingStrategy::FileDescriptor`]. An unusable value is
/// reported with a warning and ignored.
pub fn get_sharing_strategy() -> SharingStrategy {
    if let Some(s) = SharingStrategy::from_code(CURRENT.load(Ordering::Acquire)) {
        return s;
    }
    let from_env = match std::env::var(STRATEGY_ENV) {
        Ok(v) => match v.parse::<SharingStrategy>() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("ignoring {STRATEGY_ENV}={v:?}: {e}");
                SharingStrategy::FileDescriptor
            }
        },
        Err(_) => SharingStrategy::FileDescriptor,
    };
    match CURRENT.compare_exchange(0, from_env.code(), Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => from_env,
        Err(set) => SharingStrategy::from_code(set).unwrap_or(from_env),
    }
}

/// Sets the strategy for storages this process shares from now on. Storages already
/// shared are not moved. Processes started afterwards inherit it.
///
/// ```
/// # fn main() -> multiproc::Result<()> {
/// use multiproc::{SharingStrategy, set_sharing_strategy, get_sharing_strategy};
/// set_sharing_strategy("file_system".parse()?);
/// assert_eq!(get_sharing_strategy(), SharingStrategy::FileSystem);
/// # set_sharing_strategy(SharingStrategy::FileDescriptor);
/// # Ok(()) }
/// ```
pub fn set_sharing_strategy(strategy: SharingStrategy) {
    CURRENT.store(strategy.code(), Ordering::Release);
}

/// The environment a process started by multiproc needs to share memory the way its
/// parent does: the sharing strategy and the address of the shm manager of this
/// process tree. The process-start code adds these to every child's environment.
///
/// With `file_system`, the starting process also connects to the manager now: a parent
/// that only receives tensors from its workers must count as a live client, or the
/// manager could clean up segments still in flight to it once the workers have exited.
pub(crate) fn env_for_child() -> Vec<(&'static str, String)> {
    if get_sharing_strategy() == SharingStrategy::FileSystem {
        crate::manager::connect();
    }
    vec![
        (STRATEGY_ENV, get_sharing_strategy().name().to_owned()),
        (
            crate::manager::ADDRESS_ENV,
            crate::manager::address().to_owned(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        for s in get_all_sharing_strategies() {
            assert_eq!(s.to_string().parse::<SharingStrategy>().unwrap(), *s);
        }
        assert_eq!(
            SharingStrategy::FileDescriptor.to_string(),
            "file_descriptor"
        );
        assert_eq!(SharingStrategy::FileSystem.to_string(), "file_system");
        let err = "shm".parse::<SharingStrategy>().unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert_eq!(
            err.to_string(),
            "unknown sharing strategy \"shm\"; the valid strategies are file_descriptor, file_system"
        );
    }

    #[test]
    fn child_environment_carries_strategy_and_manager() {
        let env = env_for_child();
        assert_eq!(env[0].0, STRATEGY_ENV);
        assert!(env[0].1.parse::<SharingStrategy>().is_ok());
        assert_eq!(env[1].0, crate::manager::ADDRESS_ENV);
        assert!(env[1].1.starts_with("multiproc-shm-"));
    }
}
