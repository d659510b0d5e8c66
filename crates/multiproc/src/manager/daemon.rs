//! The daemon side: detaching, the accept/read loop, and the bookkeeping that decides
//! when to clean up.

use std::collections::HashSet;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use super::grace;
use crate::error::{Error, Result};
use crate::shm::name::remove_names_of;
use crate::shm::registry::{DOES_NOT_HOLD, HOLDS, Request};
use crate::shm::tree::{ADDRESS_ENV, Tree, is_valid_address};
use crate::sys::abstract_socket::{self, AbstractAddress, Errno, IoMode};
use crate::sys::daemon::{Forked, fork_single_threaded, redirect_stdio_to_null, start_new_session};
use crate::sys::fs::unlink_if_present;
use crate::sys::process::current_uid;
use crate::sys::socket::{Attempt, poll_readable, try_recv_packet, try_send_packet};

/// How many connecting clients may wait for the manager to accept them.
const LISTEN_BACKLOG: usize = 128;
/// How long a new manager waits for its first client before giving up.
const STARTUP_WINDOW: Duration = Duration::from_secs(10);

/// What the manager knows: registered names and connected clients.
#[derive(Debug)]
pub(super) struct Registry {
    names: HashSet<String>,
    clients: usize,
    /// Since when no client has been connected, and how long that may last.
    idle: Option<(Instant, Duration)>,
    grace: Duration,
}

impl Registry {
    /// A registry that gives up if no client arrives within `max(grace, 10 s)`.
    pub(super) fn new(now: Instant, grace: Duration) -> Registry {
        Registry {
            names: HashSet::new(),
            clients: 0,
            idle: Some((now, grace.max(STARTUP_WINDOW))),
            grace,
        }
    }

    pub(super) fn connected(&mut self) {
        self.clients += 1;
        self.idle = None;
    }

    pub(super) fn disconnected(&mut self, now: Instant) {
        self.clients = self.clients.saturating_sub(1);
        if self.clients == 0 {
            self.idle = Some((now, self.grace));
        }
    }

    pub(super) fn apply(&mut self, request: Request) {
        match request {
            Request::Register(name) => {
                self.names.insert(name);
            }
            Request::Unregister(name) => {
                self.names.remove(&name);
            }
            // Answered by `drain`, which has the connection.
            Request::Query(_) => {}
        }
    }

    /// Whether `name` is registered.
    pub(super) fn holds(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// When the manager should clean up and exit, if no client comes.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.idle.map(|(since, wait)| since + wait)
    }

    pub(super) fn expired(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|d| now >= d)
    }

    /// The names still registered.
    pub(super) fn leftovers(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }
}

/// The entry point of a process started with `MULTIPROC_ROLE=shm-manager` (called by
/// `init()`): becomes the manager at `MULTIPROC_SHM_MANAGER` and exits.
pub(crate) fn serve_from_env() -> ! {
    let code = match run_shm_manager_from_env() {
        Ok(_) => 0,
        Err(_) => 1,
    };
    std::process::exit(code)
}

/// Starts the shm manager for the process tree whose address is in the environment
/// variable `MULTIPROC_SHM_MANAGER` (what `multiproc shm-manager` runs; a program that
/// uses the `file_system` strategy starts one on its own, so this is rarely needed).
///
/// The manager detaches (a forked child in its own session, stdio on `/dev/null`); this
/// call returns in the calling process once it listens: `Ok(true)` when it started one,
/// `Ok(false)` when one already listened at that address. It also writes one status
/// line on stdout (`ready @<address>`, `in-use @<address>` or `error: <why>`), which is
/// how a process that started it learns the outcome.
///
/// # Errors
///
/// [`Error::Manager`] when the variable is missing or invalid, or the socket cannot be
/// bound; [`Error::InvalidArgument`] when called from a multithreaded process (the
/// manager forks to detach, which is only sound single-threaded).
pub fn run_shm_manager_from_env() -> Result<bool> {
    let outcome = detach_and_serve();
    let mut out = std::io::stdout();
    let _ = match &outcome {
        Ok((true, addr)) => writeln!(out, "ready @{addr}"),
        Ok((false, addr)) => writeln!(out, "in-use @{addr}"),
        Err(e) => writeln!(out, "error: {e}"),
    };
    let _ = out.flush();
    outcome.map(|(started, _)| started)
}

fn detach_and_serve() -> Result<(bool, String)> {
    let addr = std::env::var(ADDRESS_ENV).map_err(|_| {
        Error::Manager(format!(
            "{ADDRESS_ENV} is not set: it names the abstract socket the manager listens on \
             (multiproc-shm-<uid>-<root pid>-<root start time>-<random>)"
        ))
    })?;
    if !is_valid_address(&addr) {
        return Err(Error::Manager(format!(
            "{ADDRESS_ENV}={addr:?} is not a manager address (multiproc-shm-<uid>-<root pid>-<root start time>-<random>)"
        )));
    }
    let Some(listener) = bind(&addr)? else {
        return Ok((false, addr));
    };
    match fork_single_threaded()? {
        Forked::Parent(_) => Ok((true, addr)),
        Forked::Child => {
            // A new session: no controlling terminal, not in the starter's process group,
            // so signals aimed at the program's group do not reach the manager.
            let _ = start_new_session();
            let _ = std::env::set_current_dir("/");
            let _ = redirect_stdio_to_null();
            serve(listener, grace(), Tree::of_address(&addr));
            std::process::exit(0)
        }
    }
}

/// Binds and listens at abstract address `addr`; `None` when another process already
/// listens there.
pub(super) fn bind(addr: &str) -> Result<Option<OwnedFd>> {
    let sock = abstract_socket::seqpacket_socket(IoMode::NonBlocking)
        .map_err(|e| Error::os("socket for the shm manager", e))?;
    let sockaddr = AbstractAddress::new(addr)
        .map_err(|e| Error::Manager(format!("bad manager address @{addr}: {e}")))?;
    let cannot_listen = |e| Error::Manager(format!("cannot listen at @{addr}: {e}"));
    match abstract_socket::bind(sock.as_fd(), &sockaddr) {
        Ok(()) => {}
        Err(Errno::ADDRINUSE) => return Ok(None),
        Err(e) => return Err(cannot_listen(e)),
    }
    abstract_socket::listen(sock.as_fd(), LISTEN_BACKLOG).map_err(cannot_listen)?;
    Ok(Some(sock))
}

/// The manager's loop: accepts clients of our uid, applies their requests, and returns
/// after unlinking every leftover name once no client has been connected for the grace
/// period — and, when its tree's root has exited, every name of the tree, registered
/// or not (see `shm::tree`).
pub(super) fn serve(listener: OwnedFd, grace: Duration, tree: Option<Tree>) {
    let uid = current_uid();
    let _span = tracing::info_span!("multiproc::shm_manager", pid = std::process::id()).entered();
    tracing::info!(?grace, "shm manager serving");
    let mut registry = Registry::new(Instant::now(), grace);
    let mut clients: Vec<OwnedFd> = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let now = Instant::now();
        if registry.expired(now) {
            break;
        }
        let fds: Vec<BorrowedFd<'_>> = std::iter::once(&listener)
            .chain(clients.iter())
            .map(AsFd::as_fd)
            .collect();
        let ready = match poll_readable(&fds, registry.deadline()) {
            Ok(ready) => ready,
            Err(e) => {
                tracing::warn!("shm manager poll failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        for i in (0..clients.len()).rev() {
            if ready[i + 1] && !drain(clients[i].as_fd(), &mut registry, &mut buf) {
                clients.swap_remove(i);
                registry.disconnected(Instant::now());
                tracing::debug!(
                    clients = clients.len(),
                    "a client of the shm manager hung up"
                );
            }
        }
        if ready[0] {
            accept_all(&listener, uid, &mut clients, &mut registry);
        }
    }
    let leftovers: Vec<_> = registry.leftovers().collect();
    tracing::info!(
        leftovers = leftovers.len(),
        "shm manager: no client for the grace period; unlinking what is left and exiting"
    );
    for name in leftovers {
        match unlink_if_present(format!("/dev/shm/{name}")) {
            Ok(true) => tracing::debug!(segment = name, "unlinked a leftover segment"),
            Ok(false) => {}
            Err(e) => tracing::warn!(segment = name, "shm manager cannot unlink: {e}"),
        }
    }
    if let Some(tree) = tree.filter(|t| !t.root_alive()) {
        remove_names_of(&tree);
    }
}

fn accept_all(listener: &OwnedFd, uid: u32, clients: &mut Vec<OwnedFd>, registry: &mut Registry) {
    // Until none waits (`EAGAIN`), or accepting fails: the next poll tries again.
    // Clients are read from the poll loop, so their sockets are non-blocking.
    while let Ok(sock) = abstract_socket::accept(listener.as_fd(), IoMode::NonBlocking) {
        match abstract_socket::peer_credentials(sock.as_fd()) {
            Ok(cred) if cred.uid == uid => {
                clients.push(sock);
                registry.connected();
                tracing::debug!(
                    pid = cred.pid,
                    clients = clients.len(),
                    "a client connected to the shm manager"
                );
            }
            Ok(cred) => tracing::warn!(
                "shm manager refused a client of uid {} (pid {})",
                cred.uid,
                cred.pid
            ),
            Err(e) => tracing::warn!("shm manager cannot check a client's credentials: {e}"),
        }
    }
}

/// Applies every request waiting on `sock`; false once the client has gone.
fn drain(sock: BorrowedFd<'_>, registry: &mut Registry, buf: &mut [u8]) -> bool {
    loop {
        match try_recv_packet(sock, buf) {
            Ok(Attempt::Done(packet)) => match Request::decode(&packet.bytes) {
                Some(Request::Query(name)) => {
                    let answer = if registry.holds(&name) {
                        HOLDS
                    } else {
                        DOES_NOT_HOLD
                    };
                    // Best effort and never blocking: one loop serves every client,
                    // and one that cannot take its answer must not stall the others.
                    let _ = try_send_packet(sock, answer, &[], &[]);
                }
                Some(request) => registry.apply(request),
                None => {}
            },
            Ok(Attempt::WouldBlock) => return true,
            Err(Error::InvalidMessage(_)) | Err(Error::FdLimit { .. }) => {}
            Err(_) => return false,
        }
    }
}
