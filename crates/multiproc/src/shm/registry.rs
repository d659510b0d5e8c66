//! The registry client: how a process tells its tree's shm manager (`crate::manager`,
//! the daemon) which named segments it holds — one connection per process, the names
//! this process holds, the request codec both sides speak, and starting (or
//! restarting) the daemon by re-executing this binary; and, for `crate::maintenance`,
//! asking a manager whether it holds a name ([`query`]) and finding the live managers
//! of this user.
//!
//! Invariant: `live` holds every named segment this process maps (created or
//! received); after any (re)connection all of them are registered again, so a manager
//! started after a crash of the previous one knows every name a living process uses.
//! A name is registered *before* its file is created, and unregistered after it is
//! unlinked; requests are one-way packets (nothing waits for a reply on the hot path).
//!
//! This module sits below the daemon: the daemon decodes [`Request`]s and the process
//! start code asks for [`connect`], and nothing here depends on either.

use std::collections::HashSet;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use super::name::{SegmentName, remove_names_of};
use super::tree::{ADDRESS_ENV, Tree, address, address_if_used, is_valid_address};
use crate::error::{Error, Result};
use crate::role::{ROLE_VAR, Role};
use crate::sys::abstract_socket::{self, AbstractAddress, IoMode};
use crate::sys::process::current_uid;
use crate::sys::socket::send_packet;
use crate::sys::{Readiness, deadline_after, wait_fd};

/// The role of a process that serves as the shm manager.
const ROLE: &str = Role::ShmManager.name();
/// How long a request may wait for room in the manager's socket.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a starting manager has to report that it listens.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// This process's connection to its tree's manager and the names it holds (a `fork`
/// child starts with neither: see `sys::fork_local`).
#[derive(Default)]
struct Client {
    sock: Option<OwnedFd>,
    live: HashSet<SegmentName>,
}

static CLIENT: crate::sys::fork_local::ForkLocal<Client> = crate::sys::fork_local::ForkLocal::new();

fn lock() -> std::sync::MutexGuard<'static, Client> {
    CLIENT.lock()
}

/// Tells the manager (starting it if needed) about `name` before the segment exists,
/// and remembers it as live in this process.
pub(crate) fn register(name: &SegmentName) -> Result<()> {
    let mut c = lock();
    c.live.insert(name.clone());
    let request = Request::Register(name.as_str().to_owned());
    // Two rounds: the second one follows a restart of a manager that was gone.
    let mut last = None;
    for _ in 0..2 {
        if let Err(e) = c.ensure_connected() {
            c.live.remove(name);
            return Err(e);
        }
        match c.send(&request) {
            Ok(()) => return Ok(()),
            Err(e @ Error::Closed(_)) => {
                c.sock = None;
                last = Some(e);
            }
            Err(e) => {
                c.sock = None;
                c.live.remove(name);
                return Err(manager_error("cannot send to", &e));
            }
        }
    }
    c.live.remove(name);
    Err(manager_error(
        "the connection keeps closing at",
        &last.unwrap_or_else(|| Error::Closed("closed".into())),
    ))
}

/// Tells the manager that `name` was unlinked. Best effort: the manager only uses the
/// name for cleanup, where a missing file is not an error.
pub(crate) fn unregister(name: &SegmentName) {
    let mut c = lock();
    c.live.remove(name);
    if c.sock.is_some() {
        if let Err(e) = c.send(&Request::Unregister(name.as_str().to_owned())) {
            tracing::debug!(segment = %name, "cannot unregister from the shm manager: {e}");
            c.sock = None;
        }
    }
}

/// Connects this process to the manager (starting one if needed), so that it counts
/// as a live client. Best effort: a failure is logged, and the next registration
/// reports it.
pub(crate) fn connect() {
    if let Err(e) = lock().ensure_connected() {
        tracing::warn!("cannot connect to the shm manager: {e}");
    }
}

/// Reconnects when the manager this process is connected to has gone (SIGKILLed, say):
/// a new one is started and told every name live here, so that it can clean up if the
/// tree crashes later. One `poll` of the connection. For the moments a process hands a
/// named block out again: with blocks recycled, a new name (which reconnects anyway)
/// may not come for a long time.
pub(crate) fn reconnect_if_gone() {
    let mut c = lock();
    let gone = c
        .sock
        .as_ref()
        .is_some_and(|sock| crate::sys::socket::peer_hung_up(sock.as_fd()));
    if gone {
        c.sock = None;
        if let Err(e) = c.ensure_connected() {
            tracing::warn!("cannot reconnect to the shm manager: {e}");
        }
    }
}

/// Forgets `name` as live in this process (its mapping here is gone) without telling
/// the manager.
pub(crate) fn forget(name: &SegmentName) {
    lock().live.remove(name);
}

fn manager_error(what: &str, e: &Error) -> Error {
    Error::Manager(format!("{what} the shm manager at @{}: {e}", address()))
}

impl Client {
    fn send(&self, request: &Request) -> Result<()> {
        let Some(sock) = &self.sock else {
            return Err(Error::Closed("not connected".into()));
        };
        send_packet(
            sock.as_fd(),
            &request.encode(),
            &[],
            &[],
            deadline_after(Some(SEND_TIMEOUT)),
        )
    }

    /// Connects, starting a manager when none listens, and registers every live name
    /// (again).
    fn ensure_connected(&mut self) -> Result<()> {
        if self.sock.is_some() {
            return Ok(());
        }
        let addr = address();
        let _span = tracing::debug_span!("multiproc::shm_manager_connect", addr).entered();
        let sock = match connect_to(addr)? {
            Some(s) => s,
            None => {
                tracing::debug!("no shm manager listens: starting one");
                start(addr)?;
                connect_after_start(addr)?
            }
        };
        tracing::debug!(live = self.live.len(), "connected to the shm manager");
        self.sock = Some(sock);
        let names: Vec<String> = self.live.iter().map(|n| n.as_str().to_owned()).collect();
        for name in names {
            if let Err(e) = self.send(&Request::Register(name)) {
                self.sock = None;
                return Err(manager_error("cannot register live segments with", &e));
            }
        }
        Ok(())
    }
}

/// Connects to the manager at `addr`; `None` when nobody listens there.
pub(crate) fn connect_to(addr: &str) -> Result<Option<OwnedFd>> {
    let sock = abstract_socket::seqpacket_socket(IoMode::Blocking)
        .map_err(|e| Error::os("socket(AF_UNIX, SOCK_SEQPACKET) for the shm manager", e))?;
    let sockaddr = AbstractAddress::new(addr)
        .map_err(|e| Error::Manager(format!("bad manager address @{addr}: {e}")))?;
    match abstract_socket::connect(sock.as_fd(), &sockaddr) {
        Ok(()) => {
            // The manager checks our uid; we check its, so that names are never
            // handed to another user's process squatting on the address.
            let me = current_uid();
            match abstract_socket::peer_credentials(sock.as_fd()) {
                Ok(cred) if cred.uid == me => Ok(Some(sock)),
                Ok(cred) => Err(Error::Manager(format!(
                    "the process listening at @{addr} (pid {}) belongs to uid {}, not to us \
                     (uid {me}); unset {ADDRESS_ENV} or choose another address",
                    cred.pid, cred.uid,
                ))),
                Err(e) => Err(Error::Manager(format!(
                    "cannot check who listens at @{addr}: {e}"
                ))),
            }
        }
        Err(e) if abstract_socket::nobody_listens(e) => Ok(None),
        Err(e) => Err(Error::Manager(format!(
            "cannot connect to the shm manager at @{addr}: {e}"
        ))),
    }
}

/// Connects to a manager that just reported it listens (allowing for a short race
/// with a manager that is exiting at the same address).
fn connect_after_start(addr: &str) -> Result<OwnedFd> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(s) = connect_to(addr)? {
            return Ok(s);
        }
        if Instant::now() >= deadline {
            return Err(Error::Manager(format!(
                "the shm manager reported it listens at @{addr}, but nothing accepts connections there"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The command that starts a manager in place of this program run again, for hosts
/// whose program cannot serve (a Python interpreter): set once, before the first
/// `file_system` storage (see `crate::maintenance::set_shm_manager_command`).
static COMMAND: std::sync::OnceLock<(std::ffi::OsString, Vec<std::ffi::OsString>)> =
    std::sync::OnceLock::new();

/// Sets [`COMMAND`]; an error when it was set before (to another command).
pub(crate) fn set_command(
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
) -> Result<()> {
    let wanted = (program, args);
    if *COMMAND.get_or_init(|| wanted.clone()) == wanted {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "set_shm_manager_command: the command that starts the shm manager is set already \
             (to {:?}); it can be set once per process",
            COMMAND.get().map(|(p, _)| p)
        )))
    }
}

/// Starts a manager at `addr` by re-executing this binary in manager mode (or by
/// [`COMMAND`] where one is set), and waits until it reports that it listens (or that
/// another one already does).
#[cfg(not(test))]
fn start(addr: &str) -> Result<()> {
    use std::process::{Command, Stdio};

    if std::env::var(ROLE_VAR).is_ok_and(|r| r == ROLE) {
        return Err(Error::Manager(
            "this process was started to be the shm manager but is running the program instead: \
             does main() call multiproc::init() first?"
                .into(),
        ));
    }
    let (program, args) = match COMMAND.get() {
        Some((program, args)) => (program.clone(), args.clone()),
        None => ("/proc/self/exe".into(), Vec::new()),
    };
    let exe = std::fs::read_link(&program).map_or_else(
        |_| program.to_string_lossy().into_owned(),
        |p| p.display().to_string(),
    );
    let mut child = Command::new(&program)
        .args(&args)
        .env(ROLE_VAR, ROLE)
        .env(ADDRESS_ENV, addr)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| Error::Manager(format!("cannot start {exe} as the shm manager: {e}")))?;
    let line = child
        .stdout
        .take()
        .ok_or_else(|| Error::Manager("the manager's stdout pipe is missing".into()))
        .and_then(|out| read_status_line(out, START_TIMEOUT));
    let line = match line {
        Ok(l) => l,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Manager(format!(
                "{exe} did not start as the shm manager ({e}); does main() call multiproc::init() first?"
            )));
        }
    };
    // The process we started exits right after reporting (its forked child serves).
    let status = child.wait();
    interpret_status_line(&line, &exe).map_err(|e| match status {
        Ok(s) if !s.success() => Error::Manager(format!("{e} ({exe} {s})")),
        _ => e,
    })
}

/// In unit tests the binary is the test harness, which cannot serve: the manager's
/// tests install [`START_IN_PROCESS`] (`crate::manager::serve_in_this_process`), which
/// runs the daemon's loop on a thread of this process.
#[cfg(test)]
fn start(addr: &str) -> Result<()> {
    let _ = (ADDRESS_ENV, ROLE, ROLE_VAR);
    match START_IN_PROCESS.get() {
        Some(start) => start(addr),
        None => Err(Error::Manager(
            "a unit test uses file_system without a manager: call \
             crate::manager::serve_in_this_process() first"
                .into(),
        )),
    }
}

/// How unit tests start a manager (see `start`): set once by the manager module, which
/// sits above this one.
#[cfg(test)]
pub(crate) static START_IN_PROCESS: std::sync::OnceLock<fn(&str) -> Result<()>> =
    std::sync::OnceLock::new();

/// Reads the one line a starting manager writes, waiting at most `timeout`.
#[cfg_attr(test, allow(dead_code))]
fn read_status_line(mut out: std::process::ChildStdout, timeout: Duration) -> Result<String> {
    let deadline = deadline_after(Some(timeout));
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 4096 {
        if !wait_fd(out.as_fd(), Readiness::Readable, deadline)? {
            return Err(Error::timeout(
                "waiting for the shm manager's answer",
                Some(timeout),
            ));
        }
        match out.read(&mut byte) {
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::os("reading the shm manager's status", e)),
        }
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

/// `ready …` or `in-use …` is success; `error: …` is the manager's own explanation.
pub(crate) fn interpret_status_line(line: &str, exe: &str) -> Result<()> {
    if line.starts_with("ready") || line.starts_with("in-use") {
        Ok(())
    } else if let Some(why) = line.strip_prefix("error: ") {
        Err(Error::Manager(why.to_owned()))
    } else if line.is_empty() {
        Err(Error::Manager(format!(
            "{exe} exited without starting the shm manager; does main() call multiproc::init() first?"
        )))
    } else {
        Err(Error::Manager(format!(
            "{exe} answered {line:?} instead of starting the shm manager; does main() call \
             multiproc::init() first?"
        )))
    }
}

/// A client request: one packet, `R`, `U` or `Q` followed by the segment name. `Q`
/// (query, [`query`]'s, for `multiproc gc`) is answered with one packet on the same
/// connection: [`HOLDS`] when the manager holds the name, [`DOES_NOT_HOLD`] when not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Request {
    Register(String),
    Unregister(String),
    Query(String),
}

impl Request {
    pub(crate) fn encode(&self) -> Vec<u8> {
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
    pub(crate) fn decode(bytes: &[u8]) -> Option<Request> {
        let (&tag, name) = bytes.split_first()?;
        let name = std::str::from_utf8(name).ok()?;
        if !SegmentName::is_valid(name) {
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

/// The manager's answer to a query for a name it holds.
pub(crate) const HOLDS: &[u8] = b"Y";
/// The manager's answer to a query for a name it does not hold.
pub(crate) const DOES_NOT_HOLD: &[u8] = b"N";
/// How long [`query`] waits for the manager's answer.
const QUERY_TIMEOUT: Duration = Duration::from_millis(500);

/// Asks the manager at `addr` whether it holds `name` (a `Query` on a connection of
/// its own, answered at once: the daemon never blocks on a client). An error when
/// nobody listens there, the listener is another user's, or no clear answer came
/// within [`QUERY_TIMEOUT`] (a manager of an older multiproc ignores queries).
pub(crate) fn query(addr: &str, name: &SegmentName) -> Result<bool> {
    let sock = connect_to(addr)?.ok_or_else(|| {
        Error::Manager(format!("nobody listens at @{addr}: the manager has gone"))
    })?;
    let deadline = deadline_after(Some(QUERY_TIMEOUT));
    send_packet(
        sock.as_fd(),
        &Request::Query(name.as_str().to_owned()).encode(),
        &[],
        &[],
        deadline,
    )
    .map_err(|e| Error::Manager(format!("cannot ask the shm manager at @{addr}: {e}")))?;
    let mut answer = [0u8; 8];
    match crate::sys::socket::recv_packet(sock.as_fd(), &mut answer, deadline) {
        Ok(Some(p)) if p.bytes == HOLDS => Ok(true),
        Ok(Some(p)) if p.bytes == DOES_NOT_HOLD => Ok(false),
        Ok(Some(p)) => Err(Error::Manager(format!(
            "the shm manager at @{addr} answered {:?} to a query, not Y or N",
            String::from_utf8_lossy(&p.bytes)
        ))),
        Ok(None) => Err(Error::timeout(
            format!("the shm manager at @{addr} to answer a query (an older multiproc?)"),
            Some(QUERY_TIMEOUT),
        )),
        Err(e) => Err(Error::Manager(format!(
            "no answer to a query from the shm manager at @{addr}: {e}"
        ))),
    }
}

/// The addresses of the live shm managers of this user: the processes whose
/// environment has the role and the address [`start`] gives a manager
/// (`MULTIPROC_ROLE=shm-manager`, `MULTIPROC_SHM_MANAGER=<address>`). Another user's
/// manager cannot remove our files, so it is not listed.
pub(crate) fn live_manager_addresses() -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = crate::sys::fs::effective_uid();
    let role = format!("{ROLE_VAR}={ROLE}");
    let address = format!("{ADDRESS_ENV}=");
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|p| p.parse().ok())
                .is_some_and(|pid| !crate::sys::process::process_is_dead(pid))
                && std::fs::metadata(e.path()).is_ok_and(|m| m.uid() == me)
        })
        .filter_map(|e| {
            let env = std::fs::read(e.path().join("environ")).ok()?;
            let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
            if !vars.contains(&role.as_bytes()) {
                return None;
            }
            vars.iter().find_map(|v| {
                v.strip_prefix(address.as_bytes())
                    .and_then(|a| std::str::from_utf8(a).ok())
                    .filter(|a| is_valid_address(a))
                    .map(str::to_owned)
            })
        })
        .collect()
}

/// Run as this process exits (registered by `init` in a process that is not one
/// multiproc started): when this process is the root of its tree and no manager of
/// the tree is left to clean up after it (it was killed), removes the tree's names
/// itself. With a live manager, nothing: the manager does it once the root is gone.
pub(crate) fn clean_up_at_root_exit() {
    let Some(addr) = address_if_used() else {
        return;
    };
    let Some(tree) = Tree::of_address(addr) else {
        return;
    };
    if tree.root != std::process::id() || !tree.root_alive() {
        return; // not the root (its start time would differ)
    }
    if matches!(connect_to(addr), Ok(None)) {
        remove_names_of(&tree);
    }
}
