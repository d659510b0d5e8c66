//! The fork server behind [`StartMethod::Forkserver`](crate::StartMethod): a
//! single-threaded copy of this program, started on first use by re-execution, that
//! forks workers on request. Forking a single-threaded process is safe in a way forking
//! a multithreaded parent is not (no lock can be held by a thread that vanishes).
//!
//! Protocol (wire messages):
//!
//! - request [`ForkRequest`], on the one request socket of the client process: the
//!   worker's job socket and a fresh status socket (both as fds), and the environment
//!   the worker gets;
//! - reply [`ForkReply`], on that worker's status socket: its pid and a pidfd for it,
//!   opened by the server before it could reap the child, so the client's signals can
//!   never hit a recycled pid;
//! - later, on the same status socket, the worker's [`ExitStatus`]: the server reaps
//!   its children as their pidfds become readable, sends the status and closes the
//!   socket (the client cannot `waitpid` a grandchild).
//!
//! Because each reply has its own socket, client threads need no lock from request to
//! reply. The server exits when the client's request socket closes; its children have
//! the parent-death signal, so they follow it.
//!
//! Invariant: the server never blocks on a client (its sends do not wait; a fresh
//! status socket always has room for its two small packets).

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::exit_status::ExitStatus;
use super::launch::{self, Launch, Launched};
use super::worker;
use crate::error::{Error, Result};
use crate::role::Role;
use crate::sys::deadline_after;
use crate::sys::process as sys;
use crate::sys::socket::seqpacket_pair;
use crate::wire::{self, Decoder, Encoder};

/// The number of the inherited request socket of the fork server.
const SERVER_FD_VAR: &str = "MULTIPROC_FORKSERVER_FD";
/// The fork server's process name, as `ps` and `/proc/<pid>/comm` show it.
pub(crate) const SERVER_NAME: &str = "multiproc-fsrv";

/// An fd carried by a wire message.
#[derive(Debug)]
struct PassedFd(OwnedFd);

impl Serialize for PassedFd {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        Encoder::current("a fork-server socket")
            .and_then(|enc| enc.attach_fd(self.0.as_fd()))
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for PassedFd {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        Decoder::current("a fork-server socket")
            .and_then(|dec| dec.take_fd(index))
            .map(PassedFd)
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct ForkRequest {
    job: PassedFd,
    status: PassedFd,
    env: Vec<(String, String)>,
}

#[derive(Debug, Serialize, Deserialize)]
enum ForkReply {
    Started { pid: i32, pidfd: PassedFd },
    Failed(String),
}

/// A worker the fork server started for us.
pub(crate) struct ServerChild {
    pub pid: i32,
    /// Readable once the worker has exited (not reaped: the server does that).
    pub pidfd: OwnedFd,
    /// Delivers the worker's [`ExitStatus`] once the server has reaped it.
    pub status: OwnedFd,
}

/// This process's connection to its fork server.
struct Client {
    /// The process that started the server: a forked child must start its own.
    owner: i32,
    /// Shared with requests in flight, so the lock is held only to look it up.
    sock: Arc<OwnedFd>,
    server: Launched,
}

impl Client {
    /// Makes sure the server is gone and reaped (it is our child).
    fn shut_down(self) {
        let _ = sys::send_signal(self.server.pidfd.as_fd(), libc::SIGKILL);
        let _ = sys::wait_any_readable(&[self.server.pidfd.as_fd()], None);
        let _ = sys::try_reap(self.server.pidfd.as_fd());
    }
}

/// Held only to look up or replace the client, never across a request: a `Fork`
/// child made while another thread holds it would find it locked forever.
static CLIENT: crate::sys::fork_local::ForkLocal<Option<Client>> =
    crate::sys::fork_local::ForkLocal::new();

/// How long a request may wait for the server's reply (it forks, so it is quick unless
/// the machine is in trouble).
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Starts this process's fork server if it is not running. Forking from it is cheaper
/// and safer when the server starts while the program is still small and
/// single-threaded: call this early, like Python's `forkserver.ensure_running()`.
///
/// # Errors
/// When the server cannot be started (see [`Error::Os`]).
pub fn ensure_running() -> Result<()> {
    connect().map(|_| ())
}

fn lock_client() -> Result<std::sync::MutexGuard<'static, Option<Client>>> {
    Ok(CLIENT.lock())
}

/// The request socket of a live server and the server's pid, (re)starting the server
/// when there is none, it belongs to the process we were forked from, or it has exited.
fn connect() -> Result<(Arc<OwnedFd>, i32)> {
    let mut slot = lock_client()?;
    let me = sys::current_pid();
    let alive = slot
        .as_ref()
        .is_some_and(|c| c.owner == me && !sys::has_exited(c.server.pidfd.as_fd()));
    if !alive {
        if let Some(old) = slot.take() {
            if old.owner == me {
                old.shut_down();
            }
            // Otherwise it is the client of the process we were forked from: its fds
            // are copies for us to close, its server is not ours to touch.
        }
        let (sock, server_end) = seqpacket_pair()?;
        let server = launch::launch(Launch::Exec {
            env: vec![Role::Forkserver.env_entry()],
            fd_var: SERVER_FD_VAR,
            fd: server_end,
        })?;
        *slot = Some(Client {
            owner: me,
            sock: Arc::new(sock),
            server,
        });
    }
    slot.as_ref()
        .map(|c| (Arc::clone(&c.sock), c.server.pid))
        .ok_or_else(|| Error::Closed("the fork server is not running".into()))
}

/// Forgets the server behind `sock` (it hung up), so that the next request starts
/// another.
fn forget(sock: &Arc<OwnedFd>) -> Result<()> {
    let mut slot = lock_client()?;
    if slot.as_ref().is_some_and(|c| Arc::ptr_eq(&c.sock, sock)) {
        if let Some(old) = slot.take() {
            old.shut_down();
        }
    }
    Ok(())
}

/// Asks the fork server to start a worker that runs the job arriving on `job`.
///
/// The reply comes on the worker's own status socket, so requests from several
/// threads need no lock between request and reply.
pub(crate) fn start(job: OwnedFd, env: Vec<(String, String)>) -> Result<ServerChild> {
    let (status, status_server_end) = seqpacket_pair()?;
    let request = ForkRequest {
        job: PassedFd(job),
        status: PassedFd(status_server_end),
        env,
    };
    let mut message = wire::encode(&request)?;
    drop(request); // the message holds duplicates of the fds
    let mut tries = 0;
    let server_pid = loop {
        let (sock, server_pid) = connect()?;
        match message.send(sock.as_fd(), deadline_after(Some(REPLY_TIMEOUT))) {
            Ok(()) => break server_pid,
            // The server died since we last used it: start another, once.
            Err(Error::Closed(_)) if tries == 0 => {
                tries += 1;
                forget(&sock)?;
            }
            Err(Error::Closed(why)) => {
                return Err(Error::Closed(format!(
                    "{why}: the fork server (pid {server_pid}) exited at once twice; it is the \
                     program {} run again, so check that its main calls multiproc::init() \
                     first thing",
                    super::current::program_name()
                )));
            }
            Err(e) => return Err(e),
        }
    };
    drop(message); // our copies of the worker's fds: the server has its own now
    let packet = match wire::recv_packet(status.as_fd(), deadline_after(Some(REPLY_TIMEOUT))) {
        Ok(Some(packet)) => packet,
        Ok(None) => {
            return Err(Error::timeout(
                format!("waiting for the fork server (pid {server_pid}) to answer"),
                Some(REPLY_TIMEOUT),
            ));
        }
        Err(Error::Closed(_)) => {
            return Err(Error::Closed(format!(
                "the fork server (pid {server_pid}) exited before it started the worker: the \
                 server is the program {} run again, so check that its main calls \
                 multiproc::init() first thing",
                super::current::program_name()
            )));
        }
        Err(e) => return Err(e),
    };
    match wire::decode::<ForkReply>(packet, &crate::shm::Returns::plain())? {
        ForkReply::Started { pid, pidfd } => Ok(ServerChild {
            pid,
            pidfd: pidfd.0,
            status,
        }),
        ForkReply::Failed(why) => Err(Error::os(
            format!("the fork server (pid {server_pid}) could not fork"),
            std::io::Error::other(why),
        )),
    }
}

/// Reads the exit status the server sent for one worker. `Ok(None)` while none has
/// arrived; [`Error::Closed`] when the server hung up without sending one.
pub(crate) fn try_read_status(status: BorrowedFd<'_>) -> Result<Option<ExitStatus>> {
    match wire::try_recv_packet(status)? {
        Some(packet) => wire::decode(packet, &crate::shm::Returns::plain()).map(Some),
        None => Ok(None),
    }
}

// ---------------------------------------------------------------------------------------
// The server.

struct Running {
    pidfd: OwnedFd,
    status: OwnedFd,
}

/// The fork server's main loop: `init()` calls it when `MULTIPROC_ROLE=forkserver`.
pub(crate) fn serve_from_env() -> ! {
    let var = std::env::var(SERVER_FD_VAR).unwrap_or_default();
    sys::remove_env_single_threaded(SERVER_FD_VAR);
    let sock = match var
        .parse::<i32>()
        .map_err(|_| Error::InvalidArgument(format!("{SERVER_FD_VAR}={var:?} is not an fd number")))
        .and_then(|raw| sys::take_inherited_socket(raw, SERVER_FD_VAR))
    {
        Ok(sock) => sock,
        Err(e) => {
            eprintln!("multiproc fork server: {e}");
            std::process::exit(2)
        }
    };
    if let Ok(name) = std::ffi::CString::new(SERVER_NAME) {
        sys::set_process_name(&name);
    }
    let code = match serve(sock) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("multiproc fork server (pid {}): {e}", sys::current_pid());
            1
        }
    };
    sys::flush_stdio();
    std::process::exit(code)
}

/// The server's state. Everything is owned here so that a forked child can close what
/// it must not keep (see [`Server::fork_worker`]).
struct Server {
    /// The client connection (`None` only in a freshly forked child).
    sock: Option<OwnedFd>,
    children: HashMap<i32, Running>,
}

fn serve(sock: OwnedFd) -> Result<()> {
    let mut server = Server {
        sock: Some(sock),
        children: HashMap::new(),
    };
    loop {
        {
            let Some(sock) = server.sock.as_ref() else {
                return Ok(());
            };
            let mut fds: Vec<BorrowedFd<'_>> = vec![sock.as_fd()];
            fds.extend(server.children.values().map(|c| c.pidfd.as_fd()));
            sys::wait_any_readable(&fds, None)?;
        }
        server.reap()?;
        let Some(sock) = server.sock.as_ref() else {
            return Ok(());
        };
        let packet = match wire::try_recv_packet(sock.as_fd()) {
            Ok(Some(p)) => p,
            Ok(None) => continue,
            // The client is gone: so are we (our children follow by their death signal).
            Err(Error::Closed(_)) => return Ok(()),
            // A bad packet is consumed; the next one may be fine.
            Err(e @ Error::InvalidMessage(_)) => {
                eprintln!("multiproc fork server: dropped a request: {e}");
                continue;
            }
            // At its fd limit the request stays queued: drop it (its client sees its
            // status socket close) rather than spin on it.
            Err(e @ Error::FdLimit { .. }) => {
                eprintln!("multiproc fork server: dropped a request: {e}");
                crate::sys::socket::discard_packet(sock.as_fd());
                continue;
            }
            Err(e) => return Err(e),
        };
        match wire::decode::<ForkRequest>(packet, &crate::shm::Returns::plain()) {
            Ok(request) => server.handle(request),
            // Nothing to answer on: the status socket is inside the malformed message.
            Err(e) => eprintln!("multiproc fork server: a malformed fork request: {e}"),
        }
    }
}

impl Server {
    /// Reaps every child that has exited and sends its status to the client.
    fn reap(&mut self) -> Result<()> {
        let exited: Vec<i32> = self
            .children
            .iter()
            .filter(|(_, c)| sys::has_exited(c.pidfd.as_fd()))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in exited {
            let Some(child) = self.children.get(&pid) else {
                continue;
            };
            if let Some(raw) = sys::try_reap(child.pidfd.as_fd())? {
                let status = ExitStatus::from_raw(raw);
                if let Ok(mut m) = wire::encode(&status) {
                    // Without waiting: a fresh socket always has room for one small
                    // packet, and a client that went away must not stall the server.
                    let _ = m.send(child.status.as_fd(), Some(std::time::Instant::now()));
                }
                // Dropping closes the status socket: the client sees the status, then
                // the hang-up.
                self.children.remove(&pid);
            }
        }
        Ok(())
    }

    /// Forks a worker for `request` and answers on its status socket.
    fn handle(&mut self, request: ForkRequest) {
        let ForkRequest { job, status, env } = request;
        let mut status = Some(status.0);
        let result = self.fork_worker(job.0, &mut status, &env);
        let Some(status) = status else {
            return; // only a forked child gets here without it, and it never returns
        };
        let (reply, running) = match result {
            Ok((pid, pidfd)) => match pidfd.try_clone() {
                Ok(for_client) => (
                    ForkReply::Started {
                        pid,
                        pidfd: PassedFd(for_client),
                    },
                    Some((pid, pidfd)),
                ),
                Err(e) => {
                    // The client cannot track it: stop it (it is still reaped below).
                    let _ = sys::send_signal(pidfd.as_fd(), libc::SIGKILL);
                    let reply = ForkReply::Failed(format!("cannot duplicate a pidfd: {e}"));
                    (reply, Some((pid, pidfd)))
                }
            },
            Err(e) => (ForkReply::Failed(e.to_string()), None),
        };
        // Without waiting: the status socket is fresh, so one small packet always
        // fits, and a client that went away must not stall the server.
        if let Ok(mut m) = wire::encode(&reply) {
            let _ = m.send(status.as_fd(), Some(std::time::Instant::now()));
        }
        if let Some((pid, pidfd)) = running {
            self.children.insert(pid, Running { pidfd, status });
        }
    }

    /// Forks a worker that runs the job arriving on `job`; returns its pid and a pidfd
    /// for it. The child closes `status` and every socket of the server.
    fn fork_worker(
        &mut self,
        job: OwnedFd,
        status: &mut Option<OwnedFd>,
        env: &[(String, String)],
    ) -> Result<(i32, OwnedFd)> {
        let mut job = Some(job);
        let server = &mut *self;
        let pid = sys::fork_child(|| {
            // In the child (single-threaded, like the server): close the server's
            // sockets, so that their peers see hang-ups when the server goes, not when
            // this worker does.
            server.sock = None;
            server.children.clear();
            *status = None;
            let Some(job) = job.take() else {
                return 2;
            };
            worker::set_worker_env(env);
            worker::run_worker(job)
        })?;
        drop(job); // the worker has its copy
        match sys::pidfd_open(pid) {
            Ok(pidfd) => Ok((pid, pidfd)),
            Err(e) => {
                sys::kill_and_reap_by_pid(pid);
                Err(e)
            }
        }
    }
}
