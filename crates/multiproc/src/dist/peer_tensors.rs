//! One rank's side of the zero-copy collectives' caches (see `zero_copy`): the socket
//! its peers send their storages to, which of its storages each slot holds in the
//! peers' caches, and the peers' storages it keeps mapped, by rank and slot.
//!
//! Invariant: a rank's `mine` and every peer's `theirs[rank]` hold the same slots —
//! peers receive exactly what the notes announce — so no rank asks for what it lacks.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::arena::Arena;
use super::rendezvous;
use crate::error::{Error, Result};
use crate::sys::abstract_socket::{self, Errno, IoMode};
use crate::sys::fs;
use crate::tensor::{Storage, Tensor, WeakStorage};
use crate::wire;

/// Slots of a rank's storages that its peers keep mapped.
pub(crate) const SLOTS: usize = 32; // one bit each in `Note::Evicted`

/// One rank's side of the zero-copy protocol: its socket, and both sides of the slot
/// caches.
#[derive(Default)]
pub(crate) struct PeerTensors {
    /// Where peers send their storages; bound on first use.
    pub(super) listener: Option<OwnedFd>,
    /// Binding failed once: not retried on every call.
    unlistenable: bool,
    /// Which of this rank's storages each slot holds in the peers' caches.
    pub(super) mine: Vec<Option<WeakStorage>>,
    /// The peers' storages, by rank and slot.
    pub(super) theirs: Vec<Vec<Option<Storage>>>,
    /// The next live slot to reuse when every slot is live.
    next_victim: usize,
}

impl PeerTensors {
    pub(super) fn sized(&mut self, p: usize) {
        if self.mine.len() != SLOTS {
            self.mine = vec![None; SLOTS];
        }
        if self.theirs.len() != p {
            self.theirs = (0..p).map(|_| vec![None; SLOTS]).collect();
        }
    }

    /// Binds this rank's socket once; `false` when it cannot be.
    pub(super) fn listen(&mut self, arena: &Arena, me: usize) -> bool {
        if self.listener.is_none() && !self.unlistenable {
            match bind(arena, me) {
                Ok(fd) => self.listener = Some(fd),
                Err(e) => {
                    tracing::debug!(error = %e, "zero-copy all-reduce off for this group");
                    self.unlistenable = true;
                }
            }
        }
        self.listener.is_some()
    }

    /// Clears the slots whose storage is gone; their bits, for the note.
    pub(super) fn sweep(&mut self) -> u32 {
        let mut evicted = 0;
        for (i, slot) in self.mine.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|w| !w.is_alive()) {
                *slot = None;
                evicted |= 1 << i;
            }
        }
        evicted
    }

    /// The slot of `storage`, and whether it is new to the peers.
    pub(super) fn slot_of(&mut self, storage: &Storage) -> (usize, bool) {
        if let Some(i) = self
            .mine
            .iter()
            .position(|w| w.as_ref().is_some_and(|w| w.is(storage)))
        {
            return (i, false);
        }
        let free = self.mine.iter().position(Option::is_none);
        let i = free.unwrap_or_else(|| {
            let i = self.next_victim % SLOTS;
            self.next_victim = i + 1;
            i
        });
        (i, true)
    }
}

/// The abstract socket name of rank `rank` of the group whose segment is `arena`'s.
pub(super) fn socket_name(arena: &Arena, rank: usize) -> Result<String> {
    let fs::FileStatus { dev, ino, .. } = fs::status(arena.fd(), "the group segment")?;
    Ok(format!("multiproc-pg/{dev:x}.{ino:x}/zc{rank}"))
}

fn bind(arena: &Arena, me: usize) -> Result<OwnedFd> {
    let name = socket_name(arena, me)?;
    let fd = abstract_socket::seqpacket_socket(IoMode::NonBlocking)
        .map_err(|e| Error::os("creating a zero-copy socket", e))?;
    abstract_socket::bind(fd.as_fd(), &rendezvous::address(&name)?)
        .map_err(|e| Error::os(format!("binding the zero-copy socket @{name}"), e))?;
    abstract_socket::listen(fd.as_fd(), arena.world_size())
        .map_err(|e| Error::os("listening on the zero-copy socket", e))?;
    Ok(fd)
}

/// How long a sender retries a peer's socket whose backlog is full.
const CONNECT_PATIENCE: Duration = Duration::from_secs(1);

/// A storage sent to a peer: who, in which exchange, for which slot.
#[derive(Serialize, Deserialize)]
pub(super) struct Offer {
    pub(super) rank: u32,
    pub(super) epoch: u32,
    pub(super) slot: u32,
    pub(super) tensor: Tensor,
}

/// Connects to rank `q`'s socket and sends it `offer`.
pub(super) fn send_offer(
    arena: &Arena,
    q: usize,
    offer: &Offer,
    deadline: crate::sys::Deadline,
) -> Result<()> {
    let name = socket_name(arena, q)?;
    let addr = rendezvous::address(&name)?;
    let sock = abstract_socket::seqpacket_socket(IoMode::NonBlocking)
        .map_err(|e| Error::os("creating a zero-copy socket", e))?;
    // A full backlog (only a process flooding the socket can fill it: each exchange
    // makes at most one connection per peer) is waited out briefly, then given up:
    // every rank then takes the arena path, rather than this one blocking.
    let give_up = Instant::now() + CONNECT_PATIENCE;
    loop {
        match abstract_socket::connect(sock.as_fd(), &addr) {
            Ok(()) => break,
            Err(Errno::AGAIN) if Instant::now() < give_up => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => {
                return Err(Error::os(
                    format!("connecting to rank {q}'s zero-copy socket @{name}"),
                    e,
                ));
            }
        }
    }
    wire::encode(offer)?.send(sock.as_fd(), deadline)
}
