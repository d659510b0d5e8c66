//! The environment every process multiproc starts inherits, so that it shares memory
//! the way its parent does: the sharing strategy (`crate::sharing`) and the address of
//! the shm manager of this process tree (`crate::shm::tree`).

use crate::sharing::{STRATEGY_ENV, SharingStrategy, get_sharing_strategy};
use crate::shm::registry;
use crate::shm::tree::{ADDRESS_ENV, address};

/// The environment a process started by multiproc needs to share memory the way its
/// parent does: the sharing strategy and the address of the shm manager of this
/// process tree. The process-start code adds these to every child's environment.
///
/// With `file_system`, the starting process also connects to the manager now: a parent
/// that only receives tensors from its workers must count as a live client, or the
/// manager could clean up segments still in flight to it once the workers have exited.
pub(crate) fn env_for_child() -> Vec<(&'static str, String)> {
    if get_sharing_strategy() == SharingStrategy::FileSystem {
        registry::connect();
    }
    vec![
        (STRATEGY_ENV, get_sharing_strategy().name().to_owned()),
        (ADDRESS_ENV, address().to_owned()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_environment_carries_strategy_and_manager() {
        let env = env_for_child();
        assert_eq!(env[0].0, STRATEGY_ENV);
        assert!(env[0].1.parse::<SharingStrategy>().is_ok());
        assert_eq!(env[1].0, ADDRESS_ENV);
        assert!(env[1].1.starts_with("multiproc-shm-"));
    }
}
