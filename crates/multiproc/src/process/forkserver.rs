//! The fork server behind [`StartMethod::Forkserver`](crate::StartMethod): a
//! single-threaded copy of this program, started on first use by re-execution, that
//! forks workers on request. Forking a single-threaded process is safe in a way forking
//! a multithreaded parent is not (no lock can be held by a thread that vanishes).
//!
//! Protocol, over one seqpacket socket per client process (wire messages):
//!
//! - request [`ForkRequest`]: the worker's job socket and a status socket (both as
//!   fds), and the environment the worker gets;
//! - reply [`ForkReply`]: the worker's pid and a pidfd for it, opened by the server
//!   before it could reap the child, so the client's signals can never hit a recycled pid.
//!
//! The server reaps its children as their pidfds become readable and writes each exit
//! status ([`ExitStatus`]) on that child's status socket, then closes it: the client
//! cannot `waitpid` a grandchild. The server exits when the client's socket closes; its
//! children have the parent-death signal, so they follow it.
//!
//! Invariants: requests are answered in order, one at a time (the client holds a lock
//! from request to reply); the server never blocks on a client write (sockets are
//! non-blocking and a status that does not fit is dropped with its socket, which the
//! client sees as a hang-up).

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::ExitStatus;
use super::launch::{self, Launch, Launched};
use super::worker::{self, ROLE_VAR};
use crate::sys::process as sys;
use crate::sys::socket::seqpacket_pair;
use crate::sys::{Readiness, deadline_after, wait_fd};
use crate::{Error, Result, wire};

/// The number of the inherited request socket of the fork server.
const SERVER_FD_VAR: &str = "MULTIPROC_FORKSERVER_FD";
/// The fork server's process name, as `ps` and `/proc/<pid>/comm` show it.
pub(crate) const SERVER_NAME: &str = "multiproc-fsrv";

/// An fd carried by a wire message.
#[derive(Debug)]
struct PassedFd(OwnedFd);

impl Serialize for PassedFd {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        wire::attach_fd(self.0.as_fd(), "a fork-server socket")
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for PassedFd {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        wire::received_fd(index, "a fork-server socket")
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
    sock: OwnedFd,
    server: Launched,
}

static CLIENT: Mutex<Option<Client>> = Mutex::new(None);

/// How long a request may wait for the server's reply (it forks, so it is quick unless
/// the machine is in trouble).
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// Starts this process's fork server if it is not running. Forking from it is cheaper
/// and safer when the server starts while the program is still small and
/// single-threaded: call this early, like Python's `forkserver.ensure_running()`.
///
/// # Errors
/// When the server cannot be started (see [`Error::Os`]).
pub fn ensure_forkserver_running() -> Result<()> {
    let mut slot = lock_client()?;
    connected(&mut slot).map(|_| ())
}

fn lock_client() -> Result<std::sync::MutexGuard<'static, Option<Client>>> {
    CLIENT
        .lock()
        .map_err(|_| Error::InvalidArgument("the fork-server client lock is poisoned".into()))
}

/// The live client in `slot`, (re)starting the server when there is none, it belongs
/// to the process we were forked from, or it has exited.
fn connected(slot: &mut Option<Client>) -> Result<&Client> {
    let me = sys::current_pid();
    let alive = slot
        .as_ref()
        .is_some_and(|c| c.owner == me && !sys::has_exited(c.server.pidfd.as_fd()));
    if !alive {
        if let Some(old) = slot.take() {
            if old.owner == me {
                // Our own server died: reap it (it is our child).
                let _ = sys::send_signal(old.server.pidfd.as_fd(), libc::SIGKILL);
                let _ = sys::wait_any_readable(&[old.server.pidfd.as_fd()], None);
                let _ = sys::try_reap(old.server.pidfd.as_fd());
            }
            // A parent's client in a forked child: its fds are ours to close, its
            // server is not ours to touch.
        }
        let (sock, server_end) = seqpacket_pair()?;
        let server = launch::launch(Launch::Exec {
            env: vec![(ROLE_VAR, "forkserver".to_string())],
            fd_var: SERVER_FD_VAR,
            fd: server_end,
        })?;
        *slot = Some(Client {
            owner: me,
            sock,
            server,
        });
    }
    slot.as_ref()
        .ok_or_else(|| Error::Closed("the fork server is not running".into()))
}

/// Asks the fork server to start a worker that runs the job arriving on `job`.
pub(crate) fn start(job: OwnedFd, env: Vec<(String, String)>) -> Result<ServerChild> {
    let mut slot = lock_client()?;
    let (status, status_server_end) = seqpacket_pair()?;
    let request = ForkRequest {
        job: PassedFd(job),
        status: PassedFd(status_server_end),
        env,
    };
    let mut message = wire::encode(&request)?;
    drop(request); // the message holds duplicates of the fds
    let mut tries = 0;
    let client = loop {
        let client = connected(&mut slot)?;
        match message.send(client.sock.as_fd(), deadline_after(Some(REPLY_TIMEOUT))) {
            Ok(()) => break client,
            // The server died since we last used it: start another, once.
            Err(Error::Closed(_)) if tries == 0 => {
                tries += 1;
                if let Some(c) = slot.as_mut() {
                    c.owner = -1;
                }
            }
            Err(e) => return Err(e),
        }
    };
    let packet = wire::recv_packet(client.sock.as_fd(), deadline_after(Some(REPLY_TIMEOUT)))?
        .ok_or_else(|| {
            Error::Timeout(format!(
                "the fork server (pid {}) did not answer within {REPLY_TIMEOUT:?}",
                client.server.pid
            ))
        })?;
    match wire::decode::<ForkReply>(packet)? {
        ForkReply::Started { pid, pidfd } => Ok(ServerChild {
            pid,
            pidfd: pidfd.0,
            status,
        }),
        ForkReply::Failed(why) => Err(Error::Os {
            context: format!("the fork server (pid {}) could not fork", client.server.pid),
            message: why,
            errno: None,
        }),
    }
}

/// Reads the exit status the server sent for one worker. `Ok(None)` while none has
/// arrived; [`Error::Closed`] when the server hung up without sending one.
pub(crate) fn try_read_status(status: BorrowedFd<'_>) -> Result<Option<ExitStatus>> {
    match wire::try_recv_packet(status)? {
        Some(packet) => wire::decode(packet).map(Some),
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
        let now = Some(std::time::Instant::now());
        if !wait_fd(sock.as_fd(), Readiness::Readable, now)? {
            continue;
        }
        let packet = match wire::try_recv_packet(sock.as_fd()) {
            Ok(Some(p)) => p,
            Ok(None) => continue,
            // The client is gone: so are we (our children follow by their death signal).
            Err(Error::Closed(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let reply = match wire::decode::<ForkRequest>(packet) {
            Ok(request) => match server.fork_worker(request) {
                Ok((pid, pidfd)) => ForkReply::Started {
                    pid,
                    pidfd: PassedFd(pidfd),
                },
                Err(e) => ForkReply::Failed(e.to_string()),
            },
            Err(e) => ForkReply::Failed(format!("a malformed fork request: {e}")),
        };
        let Some(sock) = server.sock.as_ref() else {
            return Ok(());
        };
        wire::encode(&reply)?.send(sock.as_fd(), deadline_after(Some(REPLY_TIMEOUT)))?;
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

    /// Forks a worker for `request`; returns its pid and a pidfd for the client.
    fn fork_worker(&mut self, request: ForkRequest) -> Result<(i32, OwnedFd)> {
        let ForkRequest { job, status, env } = request;
        let mut job = Some(job.0);
        let mut status = Some(status.0);
        let server = &mut *self;
        let pid = sys::fork_child(|| {
            // In the child (single-threaded, like the server): close the server's
            // sockets, so that their peers see hang-ups when the server goes, not when
            // this worker does.
            server.sock = None;
            server.children.clear();
            status = None;
            let Some(job) = job.take() else {
                return 2;
            };
            worker::set_worker_env(&env);
            let code = worker::run_worker(job);
            sys::flush_stdio();
            code
        })?;
        drop(job); // the worker has its copy
        let status = status.ok_or_else(|| Error::Closed("lost a worker's status socket".into()))?;
        let pidfd = match sys::pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => {
                sys::kill_and_reap_by_pid(pid);
                return Err(e);
            }
        };
        let for_client = pidfd
            .try_clone()
            .map_err(|e| Error::os("duplicating a worker's pidfd", e))?;
        self.children.insert(pid, Running { pidfd, status });
        Ok((pid, for_client))
    }
}
