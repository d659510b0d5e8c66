//! The shm manager: the daemon that removes `file_system` segments a crashed process
//! tree left in `/dev/shm` (torch's `torch_shm_manager`). Its clients' side — the
//! connection, the request codec, starting the daemon — is `crate::shm::registry`, and
//! the tree naming it relies on is `crate::shm::tree`; this module is only the daemon,
//! and depends on shm, never the other way.
//!
//! **What it owns.** A set of segment names per process tree. Every process that creates
//! or maps a named segment is a client: it connects to the manager and sends
//! `Register(name)` *before* creating a segment and `Unregister(name)` after unlinking
//! one (one-way packets, nothing waits for a reply on the hot path). The manager learns of
//! a client's death by socket hang-up. When its last client has gone it waits a grace
//! period (2 s, `MULTIPROC_SHM_MANAGER_GRACE_MS` to change it), and if nobody connected
//! meanwhile unlinks every name still registered — even if every client was SIGKILLed —
//! then exits.
//!
//! **One per tree.** The address is an abstract Unix `SOCK_SEQPACKET` socket named
//! `multiproc-shm-<uid>-<root pid>-<root start time>-<random>`, chosen by the first process that needs it
//! and passed to every process multiproc starts in `MULTIPROC_SHM_MANAGER`
//! (`process::child_env`), so all processes of a tree share one manager.
//! Only the same user can use it: the manager checks `SO_PEERCRED` on every connection.
//!
//! **Started on demand**, the first time a process registers a name: the client
//! re-executes `/proc/self/exe` with `MULTIPROC_ROLE=shm-manager` (every binary whose
//! `main` starts with `multiproc::init()` can serve), never `fork`s itself. The new
//! process binds the socket, forks once more (so the manager is no one's child) and calls
//! `setsid`; the intermediate reports `ready` on its stdout pipe and exits. Two starters
//! racing: the loser's bind fails with `EADDRINUSE` and it reports `in-use`; both connect
//! to the winner. It can also be started by hand with `multiproc shm-manager`
//! ([`run_shm_manager_from_env`]).
//!
//! **A killed manager** is noticed by the next send (`EPIPE`): the client starts a new one
//! at the same address and registers its live names again, or fails with
//! [`Error::Manager`](crate::Error::Manager) saying why.
//!
//! **Knowledge that survives the manager.** Names that only an in-flight message held
//! (its queue dropped), or that a worker leaving by `std::process::exit` still held, are
//! not re-registered by anyone after a restart. So every name carries its tree (see
//! `shm::tree`): when the tree's root has exited, the manager's cleanup removes every name
//! of the tree, registered or not; when no manager is left (it was SIGKILLed and nobody
//! restarted it), the root removes them as it exits; and `multiproc gc` removes them
//! once the root is gone (`crate::maintenance` makes that judgement). `gc` also asks
//! live managers (`Q`, `shm::registry::query`) whether they hold a name of a dead
//! creator, instead of leaving all such names alone while any manager of the user
//! runs. Left for gc: a root killed by SIGKILL while its manager was dead
//! too.

mod daemon;

use std::time::Duration;

pub use daemon::run_shm_manager_from_env;
// Called by `init()` (the process module) when MULTIPROC_ROLE=shm-manager.
pub(crate) use daemon::serve_from_env;

/// Overrides the grace period (milliseconds), for tests.
pub(crate) const GRACE_ENV: &str = "MULTIPROC_SHM_MANAGER_GRACE_MS";
/// How long the manager waits after its last client left before cleaning up.
const DEFAULT_GRACE: Duration = Duration::from_secs(2);

/// The grace period: [`GRACE_ENV`] if set and valid, else 2 s.
fn grace() -> Duration {
    std::env::var(GRACE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(DEFAULT_GRACE, Duration::from_millis)
}

/// Makes this process start its managers on a thread of its own instead of
/// re-executing the binary (see `shm::registry`): unit tests call it before they use
/// `file_system`, since their binary, the test harness, cannot serve.
#[cfg(test)]
pub(crate) fn serve_in_this_process() {
    fn start(addr: &str) -> crate::error::Result<()> {
        if let Some(listener) = daemon::bind(addr)? {
            let grace = grace();
            std::thread::spawn(move || daemon::serve(listener, grace, None));
        }
        Ok(())
    }
    let _ = crate::shm::registry::START_IN_PROCESS.set(start);
}

#[cfg(test)]
mod tests;
