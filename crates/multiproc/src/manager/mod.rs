//! The shm manager: the daemon that removes `file_system` segments a crashed process
//! tree left in `/dev/shm` (torch's `torch_shm_manager`), and its client.
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
//! ([`crate::sharing::env_for_child`]), so all processes of a tree share one manager.
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
//! [`tree`]): when the tree's root has exited, the manager's cleanup removes every name
//! of the tree, registered or not; when no manager is left (it was SIGKILLed and nobody
//! restarted it), the root removes them as it exits; and `multiproc gc` removes them
//! once the root is gone. `gc` also asks live managers (`Q`) whether they hold a
//! name of a dead creator, instead of leaving all such names alone while any manager
//! of the user runs. Left for gc: a root killed by SIGKILL while its manager was dead
//! too.

mod client;
mod daemon;
pub(crate) mod tree;

use std::sync::OnceLock;
use std::time::Duration;

pub(crate) use client::{connect, forget, register, unregister};
pub use daemon::run_shm_manager_from_env;
// Called by `init()` (the process module) when MULTIPROC_ROLE=shm-manager.
pub(crate) use daemon::serve_from_env;

/// The environment variable that holds the manager's address.
pub(crate) const ADDRESS_ENV: &str = "MULTIPROC_SHM_MANAGER";
/// The environment variable that selects a process's role; the manager's is
/// [`ROLE`].
pub(crate) use crate::role::ROLE_VAR as ROLE_ENV;
/// The role of a process that serves as the shm manager.
pub(crate) const ROLE: &str = crate::role::Role::ShmManager.name();
/// Overrides the grace period (milliseconds), for tests.
pub(crate) const GRACE_ENV: &str = "MULTIPROC_SHM_MANAGER_GRACE_MS";
/// How long the manager waits after its last client left before cleaning up.
const DEFAULT_GRACE: Duration = Duration::from_secs(2);
const ADDRESS_PREFIX: &str = "multiproc-shm-";

/// The grace period: [`GRACE_ENV`] if set and valid, else 2 s.
fn grace() -> Duration {
    std::env::var(GRACE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(DEFAULT_GRACE, Duration::from_millis)
}

/// Whether `a` can be a manager address (our prefix, fits an abstract socket name,
/// printable).
fn is_valid_address(a: &str) -> bool {
    a.starts_with(ADDRESS_PREFIX)
        && a.len() < 100
        && a.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The manager address of this process tree: inherited from `MULTIPROC_SHM_MANAGER`,
/// or chosen now (`multiproc-shm-<uid>-<pid>-<start time>-<random>`). Choosing it starts nothing.
pub(crate) fn address() -> &'static str {
    ADDRESS.get_or_init(|| {
        if let Ok(a) = std::env::var(ADDRESS_ENV) {
            if is_valid_address(&a) {
                return a;
            }
            tracing::warn!("ignoring {ADDRESS_ENV}={a:?}: not a multiproc shm manager address");
        }
        new_address()
    })
}

static ADDRESS: OnceLock<String> = OnceLock::new();

/// The address, if this process has used one.
pub(crate) fn address_if_used() -> Option<&'static str> {
    ADDRESS.get().map(String::as_str)
}

fn new_address() -> String {
    let mut random = [0u8; 8];
    let random = match getrandom::fill(&mut random) {
        Ok(()) => u64::from_le_bytes(random),
        // The address need not be secret (the manager checks the peer's uid); it only
        // has to differ between trees.
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    // The root's start time makes the tree's name survive pid reuse (see `tree`).
    let pid = std::process::id();
    // (Miri, whose isolation forbids reading /proc, runs the codec tests with 0.)
    let start = if cfg!(miri) {
        0
    } else {
        crate::sys::process::start_time(pid).unwrap_or(0)
    };
    format!(
        "{ADDRESS_PREFIX}{}-{pid}-{start}-{random:016x}",
        rustix::process::getuid().as_raw(),
    )
}

/// A client request: one packet, `R`, `U` or `Q` followed by the segment name. `Q`
/// (query, used by `multiproc gc`) is answered with one packet on the same
/// connection: `Y` when the manager holds the name, `N` when not.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Request {
    Register(String),
    Unregister(String),
    Query(String),
}

impl Request {
    fn encode(&self) -> Vec<u8> {
        let (tag, name) = match self {
            Request::Register(n) => (b'R', n),
            Request::Unregister(n) => (b'U', n),
            Request::Query(n) => (b'Q', n),
        };
        let mut bytes = Vec::with_capacity(1 + name.len());
        bytes.push(tag);
        bytes.extend_from_slice(name.as_bytes());
        bytes
    }

    /// Parses a packet; `None` for anything that is not a request naming one of our
    /// segments.
    fn decode(bytes: &[u8]) -> Option<Request> {
        let (&tag, name) = bytes.split_first()?;
        let name = std::str::from_utf8(name).ok()?;
        if !crate::shm::name::SegmentName::is_valid(name) {
            return None;
        }
        match tag {
            b'R' => Some(Request::Register(name.to_owned())),
            b'U' => Some(Request::Unregister(name.to_owned())),
            b'Q' => Some(Request::Query(name.to_owned())),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
