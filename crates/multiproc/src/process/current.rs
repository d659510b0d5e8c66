//! What a process knows about itself and the workers it started, as Python's
//! `multiprocessing` tells it: [`current_process`], [`active_children`], [`cpu_count`].
//!
//! A worker learns its rank and name from its job header ([`set_identity`], called by
//! the job loop before the worker function runs). Every [`Child`](super::child::Child)
//! registers itself here while it lives ([`register`]); the registry holds only weak
//! references, so it never keeps a child's record alive, and a child marks itself
//! exited once it is reaped, so a recycled pid is never reported as ours.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::sys::process as sys;

/// The identity of the running process ([`current_process`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurrentProcess {
    /// The worker's rank, in a worker that multiproc started; `None` in the main
    /// process.
    pub rank: Option<usize>,
    /// Its process id.
    pub pid: u32,
    /// Its name: `MainProcess` in the main process; in a worker, the name its
    /// [`Process`](crate::Process) was given ([`ProcessBuilder::name`](crate::ProcessBuilder::name)),
    /// else `Process-RANK` (`PoolWorker-RANK` in a [`Pool`](crate::Pool)).
    pub name: String,
}

/// One running worker that this process started ([`active_children`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildProcess {
    /// Its rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Its name.
    pub name: String,
}

static IDENTITY: crate::sys::fork_local::ForkLocal<Option<(usize, String)>> =
    crate::sys::fork_local::ForkLocal::new();

/// Records the rank and name of this worker process.
pub(crate) fn set_identity(rank: usize, name: String) {
    *IDENTITY.lock() = Some((rank, name));
}

/// The running process: its rank (in a worker), pid and name, like Python's
/// `multiprocessing.current_process()`.
///
/// # Examples
///
/// ```
/// let me = multiproc::current_process();
/// assert_eq!((me.rank, me.name.as_str()), (None, "MainProcess"));
/// assert_eq!(me.pid, std::process::id());
/// ```
pub fn current_process() -> CurrentProcess {
    let identity = IDENTITY.lock().clone();
    let (rank, name) = match identity {
        Some((rank, name)) => (Some(rank), name),
        None => (None, "MainProcess".to_string()),
    };
    CurrentProcess {
        rank,
        pid: std::process::id(),
        name,
    }
}

/// The number of CPUs this process may run on (its affinity mask and cgroup quota
/// taken into account), like `os.process_cpu_count()`; at least 1. Python's
/// `multiprocessing.cpu_count()` counts the machine's CPUs instead, which
/// oversubscribes a container.
pub fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// What the registry knows of one child.
#[derive(Debug)]
pub(crate) struct Registration {
    rank: usize,
    pid: u32,
    name: String,
    exited: AtomicBool,
}

impl Registration {
    /// The child was reaped: its pid may be recycled from now on.
    pub(crate) fn mark_exited(&self) {
        self.exited.store(true, Ordering::Release);
    }
}

static CHILDREN: crate::sys::fork_local::ForkLocal<Vec<Weak<Registration>>> =
    crate::sys::fork_local::ForkLocal::new();

/// Registers a started child; it stays listed while the returned record lives and is
/// not marked exited.
pub(crate) fn register(rank: usize, pid: u32, name: String) -> Arc<Registration> {
    let entry = Arc::new(Registration {
        rank,
        pid,
        name,
        exited: AtomicBool::new(false),
    });
    let mut children = CHILDREN.lock();
    children.retain(|w| w.strong_count() > 0);
    children.push(Arc::downgrade(&entry));
    entry
}

/// The workers this process started that still run (not exited, not a zombie awaiting
/// its join), like Python's `multiprocessing.active_children()`. Unlike Python's, it
/// does not join finished ones: joining stays with their [`Process`](crate::Process) or
/// [`ProcessContext`](crate::ProcessContext).
pub fn active_children() -> Vec<ChildProcess> {
    let mut children = CHILDREN.lock();
    children.retain(|w| w.strong_count() > 0);
    children
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|c| !c.exited.load(Ordering::Acquire))
        .filter(|c| !sys::process_is_dead(c.pid))
        .map(|c| ChildProcess {
            rank: c.rank,
            pid: c.pid,
            name: c.name.clone(),
        })
        .collect()
}

/// This executable, for messages about running it again.
pub(crate) fn program_name() -> String {
    std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| {
            std::env::args()
                .next()
                .unwrap_or_else(|| "this program".into())
        })
}
