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
//! `MULTIPROC_SHARING_STRATEGY` in the child's environment (`process::child_env`), and a
//! process reads that variable the first time it needs the strategy. torch's workers
//! start with the default and must call `set_sharing_strategy` themselves. Setting the
//! variable by hand in a shell works too (`MULTIPROC_SHARING_STRATEGY=file_system`).

use std::sync::atomic::{AtomicU8, Ordering};

pub use crate::shm::strategy::SharingStrategy;

/// The environment variable a process reads its initial strategy from.
pub(crate) const STRATEGY_ENV: &str = "MULTIPROC_SHARING_STRATEGY";

/// 0 until the first read, then a [`SharingStrategy::code`].
static CURRENT: AtomicU8 = AtomicU8::new(0);

/// The strategies this platform supports (both, on Linux), like torch's
/// `get_all_sharing_strategies()`.
pub fn get_all_sharing_strategies() -> &'static [SharingStrategy] {
    &SharingStrategy::ALL
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

/// Names the command that starts a process tree's shm manager (the `file_system`
/// strategy's daemon), for a host whose own program cannot serve as it: by default the
/// library runs this program again in manager mode, which works for any Rust `main`
/// that calls [`init`](crate::init) first, but not for, say, a Python interpreter. The
/// command must call [`run_shm_manager_from_env`](crate::maintenance::run_shm_manager_from_env) (it
/// finds its address and role in the environment the library gives it).
///
/// Set it once per process, before the first `file_system` storage; setting the same
/// command again is allowed, another one is [`Error::InvalidArgument`](crate::Error).
/// Processes started afterwards do not inherit it: each host sets it for itself.
pub fn set_shm_manager_command<P, A>(program: P, args: &[A]) -> crate::error::Result<()>
where
    P: AsRef<std::ffi::OsStr>,
    A: AsRef<std::ffi::OsStr>,
{
    crate::shm::registry::set_command(
        program.as_ref().to_owned(),
        args.iter().map(|a| a.as_ref().to_owned()).collect(),
    )
}

/// The environment variable and value that a process this tree starts *without*
/// multiproc (Python's own `multiprocessing`, a shell command) needs to share
/// `file_system` storages with it: the address of the tree's shm manager. A process
/// started by multiproc gets it by itself.
///
/// The address is inherited (from this variable in this process's environment) or
/// chosen now, with this process as the tree's root; choosing it starts nothing (the
/// manager starts with the first `file_system` storage). Put it in the child's
/// environment, or in this process's own before the child starts.
///
/// ```
/// let (name, value) = multiproc::maintenance::shm_manager_env();
/// assert_eq!(name, "MULTIPROC_SHM_MANAGER");
/// let child = std::process::Command::new("true").env(name, value).status().unwrap();
/// assert!(child.success());
/// ```
pub fn shm_manager_env() -> (&'static str, &'static str) {
    (crate::shm::tree::ADDRESS_ENV, crate::shm::tree::address())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn the_manager_env_names_one_address_for_the_whole_process() {
        let (name, first) = shm_manager_env();
        assert_eq!(name, "MULTIPROC_SHM_MANAGER");
        assert!(crate::shm::tree::is_valid_address(first), "{first}");
        assert_eq!(shm_manager_env().1, first, "chosen once per process");
    }

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
}
