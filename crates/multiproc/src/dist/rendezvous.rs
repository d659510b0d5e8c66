//! How ranks that a launcher started (torchrun, mpirun, srun, spawn) find each other on
//! one node without a parent to hand them a group: local rank 0 creates the group's
//! segment and listens on an abstract Unix socket whose name every local rank derives
//! from the same launcher variables (the run id and restart count, else
//! `MASTER_ADDR:MASTER_PORT`, else the launcher's pid, which all local ranks share as
//! their parent); the others connect and receive the segment's fd over it. Only the
//! rendezvous uses a socket: the collectives' data never does.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use super::env::Env;
use crate::error::{Error, Result};
use crate::sys::abstract_socket::{self, AbstractAddress, Errno, IoMode};
use crate::sys::process::parent_pid;
use crate::sys::{Deadline, Readiness, deadline_after, wait_fd};
use crate::wire;

/// How long local ranks wait for each other to arrive.
pub(crate) const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The abstract socket name of this node's group in this run.
pub(crate) fn socket_name(env: &Env) -> String {
    let run = match (&env.run_id, &env.master_addr, env.master_port) {
        (Some(id), _, _) => format!("{id}.{}", env.restart_count),
        (None, Some(addr), Some(port)) => format!("{addr}:{port}"),
        _ => format!("ppid{}", parent_pid()),
    };
    let mut name = format!("multiproc-pg/{run}/node{}", env.node_rank);
    name.truncate(100); // the abstract namespace takes at most 107 bytes
    name
}

fn socket() -> Result<OwnedFd> {
    abstract_socket::seqpacket_socket(IoMode::Blocking)
        .map_err(|e| Error::os("creating the process group's rendezvous socket", e))
}

pub(crate) fn address(name: &str) -> Result<AbstractAddress> {
    AbstractAddress::new(name)
        .map_err(|e| Error::os(format!("the rendezvous socket name {name:?}"), e))
}

/// Local rank 0: hands `handle` (an encodable group) to the `peers` other local ranks.
pub(crate) fn serve<T: serde::Serialize>(name: &str, handle: &T, peers: usize) -> Result<()> {
    let listener = socket()?;
    abstract_socket::bind(listener.as_fd(), &address(name)?).map_err(|e| {
        Error::os(
            format!(
                "binding the rendezvous socket @{name} (another run with the same launcher \
                 variables on this node?)"
            ),
            e,
        )
    })?;
    abstract_socket::listen(listener.as_fd(), peers)
        .map_err(|e| Error::os("listening on the rendezvous socket", e))?;
    let deadline = deadline_after(Some(RENDEZVOUS_TIMEOUT));
    for served in 0..peers {
        if !wait_fd(listener.as_fd(), Readiness::Readable, deadline)? {
            return Err(Error::timeout(
                format!(
                    "process group rendezvous @{name}: {served} of {peers} local ranks arrived \
                 within {RENDEZVOUS_TIMEOUT:?}: start every local rank"
                ),
                None,
            ));
        }
        let peer = abstract_socket::accept(listener.as_fd(), IoMode::Blocking)
            .map_err(|e| Error::os("accepting a rank at the rendezvous socket", e))?;
        wire::encode(handle)?.send(peer.as_fd(), deadline)?;
    }
    Ok(())
}

/// Another local rank: connects (retrying until rank 0 listens) and decodes the handle.
pub(crate) fn join<T: serde::de::DeserializeOwned>(name: &str) -> Result<T> {
    let deadline: Deadline = deadline_after(Some(RENDEZVOUS_TIMEOUT));
    let addr = address(name)?;
    let sock = loop {
        let sock = socket()?;
        match abstract_socket::connect(sock.as_fd(), &addr) {
            Ok(()) => break sock,
            // Rank 0 has not bound yet, or its backlog is full: try again shortly.
            Err(e) if abstract_socket::nobody_listens(e) || e == Errno::AGAIN => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(Error::timeout(
                        format!(
                            "process group rendezvous @{name}: local rank 0 did not appear within \
                         {RENDEZVOUS_TIMEOUT:?}: did it start, and call ProcessGroup::from_env?"
                        ),
                        None,
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                return Err(Error::os(
                    format!("connecting to the rendezvous @{name}"),
                    e,
                ));
            }
        }
    };
    let packet = wire::recv_packet(sock.as_fd(), deadline)?.ok_or_else(|| {
        Error::Closed(format!(
            "the rendezvous @{name} closed before sending the group"
        ))
    })?;
    wire::decode(packet, &crate::shm::Returns::plain())
}
