//! [`StartMethod`]: how a worker process is started (torch's `start_method`), and its
//! names.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// How a worker process is started (torch's `start_method`).
///
/// | method | how | use it when |
/// |---|---|---|
/// | `Spawn` (default) | re-executes this program (`/proc/self/exe`) | always safe; ~1 ms per worker |
/// | `Fork` | `fork()` of this process | the worker needs no lock of the parent's own code or of other crates that another thread may hold |
/// | `Forkserver` | `fork()` of a single-threaded server started on first use | many short workers from a multithreaded parent |
///
/// With `Fork`, the child is a copy of a possibly multithreaded parent that contains only
/// the forking thread: a lock another thread held at that moment stays locked forever
/// in the child. multiproc's own process-wide state (its map cache, block pools,
/// manager connection, launcher) is rebuilt in a fork child, so its queues, tensors
/// and workers work there whatever the parent's threads were doing
/// (`tests/fork_safety.rs`); a lock of yours or of another crate (stdout, a logger, a
/// user `Mutex`) is not. The child also inherits every open fd of the parent. `Spawn`
/// and `Forkserver` have neither problem; the worker function and its arguments are the
/// same for all three.
///
/// The fork server is started on first use (or by [`forkserver::ensure_running`](crate::forkserver::ensure_running)) and
/// lives as long as this process; `ps` shows it as `multiproc-fsrv`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StartMethod {
    /// Re-execute the current program in worker mode (torch's `spawn`).
    #[default]
    Spawn,
    /// Fork the current process (torch's `fork`).
    Fork,
    /// Fork from a single-threaded fork server (torch's `forkserver`).
    Forkserver,
}

impl StartMethod {
    /// Every start method, like `multiprocessing.get_all_start_methods()`.
    pub const ALL: [StartMethod; 3] = [
        StartMethod::Spawn,
        StartMethod::Fork,
        StartMethod::Forkserver,
    ];

    /// torch's name: `spawn`, `fork` or `forkserver`.
    pub fn name(self) -> &'static str {
        match self {
            StartMethod::Spawn => "spawn",
            StartMethod::Fork => "fork",
            StartMethod::Forkserver => "forkserver",
        }
    }
}

impl StartMethod {
    /// Refuses `Fork` once CUDA is initialised here: a forked child inherits a CUDA
    /// state it cannot use (the driver's contexts do not survive `fork`).
    pub(crate) fn check_usable(self) -> Result<(), Error> {
        self.check_usable_with(crate::cuda::initialised())
    }

    fn check_usable_with(self, cuda_initialised: bool) -> Result<(), Error> {
        if self == StartMethod::Fork && cuda_initialised {
            return Err(Error::InvalidArgument(
                "cannot start a worker with the fork start method: this process has initialised \
                 CUDA, which does not survive fork; use StartMethod::Spawn or StartMethod::Forkserver"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for StartMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for StartMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        StartMethod::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown start method {s:?}: expected spawn, fork or forkserver"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_method_names_round_trip() {
        for m in StartMethod::ALL {
            assert_eq!(m.to_string().parse::<StartMethod>().unwrap(), m);
        }
        assert!("thread".parse::<StartMethod>().is_err());
        assert_eq!(StartMethod::default(), StartMethod::Spawn);
    }

    #[test]
    fn fork_is_refused_once_cuda_is_initialised() {
        let err = StartMethod::Fork.check_usable_with(true).unwrap_err();
        assert!(err.to_string().contains("initialised CUDA"), "{err}");
        assert!(err.to_string().contains("Spawn"), "{err}");
        for m in [StartMethod::Spawn, StartMethod::Forkserver] {
            m.check_usable_with(true).unwrap();
        }
        StartMethod::Fork.check_usable_with(false).unwrap();
        // Without a driver (this machine, or a build without the feature) nothing was
        // initialised, so fork stays allowed.
        if !crate::cuda::is_available() {
            StartMethod::Fork.check_usable().unwrap();
        }
    }
}
