//! The roles of the processes multiproc starts by executing this program again, and the
//! one environment variable that carries a role.
//!
//! A process started with [`ROLE_VAR`] set takes the job its [`Role`] names in
//! [`init`](crate::init) instead of running the program's `main`. The process module
//! sets the variable for spawned workers and the fork server and dispatches on it; the
//! shm manager's client sets it for the manager. This module sits below both, so that
//! neither depends on the other for the name.

use std::fmt;

/// The environment variable that selects the role of a process multiproc started.
pub(crate) const ROLE_VAR: &str = "MULTIPROC_ROLE";

/// The job of a process that multiproc started by executing this program again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// A worker started with [`StartMethod::Spawn`](crate::StartMethod): it reads its
    /// job from the socket named by `MULTIPROC_WORKER_FD`.
    Worker,
    /// The fork server behind [`StartMethod::Forkserver`](crate::StartMethod).
    Forkserver,
    /// The shm manager, which cleans up the segments of a crashed process tree.
    ShmManager,
}

impl Role {
    /// Every role, in the order error messages list them.
    pub(crate) const ALL: [Role; 3] = [Role::Worker, Role::Forkserver, Role::ShmManager];

    /// The value of [`ROLE_VAR`] that selects this role.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Forkserver => "forkserver",
            Role::ShmManager => "shm-manager",
        }
    }

    /// The role a value of [`ROLE_VAR`] selects, if any.
    pub(crate) fn from_name(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The environment entry that gives a new process this role.
    pub(crate) fn env_entry(self) -> (String, String) {
        (ROLE_VAR.to_string(), self.name().to_string())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_round_trip() {
        for role in Role::ALL {
            assert_eq!(Role::from_name(role.name()), Some(role));
            assert_eq!(role.env_entry(), (ROLE_VAR.to_string(), role.to_string()));
        }
        assert_eq!(Role::from_name("shm_manager"), None);
    }
}
