//! Entry points for the criterion micro-benchmarks in `benches/`. **Not public API**:
//! hidden from the docs, exempt from semver, and may change or vanish in any release.
//!
//! Built only with the `bench-internals` feature (off by default; this package's benches
//! turn it on).
//!
//! Each function wraps one step of the data path so it can be timed on its own. A
//! tensor sent on a queue is encoded (its storage becomes a segment handle: an fd in
//! `file_descriptor` mode, a name in `file_system` mode), the message goes out as one
//! `SOCK_SEQPACKET` write with the fds attached as `SCM_RIGHTS`, and the receiver
//! checks the segment (size, seals) and maps it once per process (a cache keyed by the
//! segment's identity, so a second tensor on the same storage is a cache hit). The
//! steps timed: encoding and decoding a message, making and mapping a segment, passing
//! an fd over a socket, a map-cache hit.
//!
//! `multiproc bench-floor` takes its shared word from here too (`SharedWord`): the
//! floor turns raw futexes over it, and the page's mapping stays the library's.

#![allow(missing_docs)]

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU32;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::sys::socket::{self, Attempt};
use crate::{shm, wire};

/// A connected pair of `SOCK_SEQPACKET` sockets, as under every queue.
pub struct SocketPair {
    tx: OwnedFd,
    rx: OwnedFd,
}

/// A new socket pair.
pub fn socket_pair() -> Result<SocketPair> {
    let (tx, rx) = socket::seqpacket_pair()?;
    Ok(SocketPair { tx, rx })
}

/// Encodes `value` (tensors become handles, their fds go to the side table) and drops
/// the result unsent.
pub fn encode<T: Serialize>(value: &T) -> Result<()> {
    wire::encode(value).map(drop)
}

/// Encodes `value` and sends it on the pair.
pub fn send<T: Serialize>(pair: &SocketPair, value: &T) -> Result<()> {
    wire::encode(value)?.send(pair.tx.as_fd(), None)
}

/// Receives one message from the pair and decodes it (mapping segments through the
/// cache).
pub fn recv<T: DeserializeOwned>(pair: &SocketPair) -> Result<T> {
    let packet = wire::recv_packet(pair.rx.as_fd(), None)?
        .ok_or_else(|| Error::timeout("a bench recv without deadline", None))?;
    wire::decode(packet, &crate::shm::Returns::plain())
}

/// An anonymous shared-memory segment's fd (a sealed memfd, pages reserved).
pub struct Memfd {
    fd: OwnedFd,
    len: usize,
}

/// Creates a block of `len` bytes (memfd, reserve, seal, map) and keeps only its fd.
pub fn memfd(len: usize) -> Result<Memfd> {
    let segment = shm::Segment::create_anonymous_block(len)?;
    let fd = segment
        .fd()
        .ok_or_else(|| Error::InvalidArgument("no fd".into()))?
        .try_clone_to_owned()
        .map_err(|e| Error::os("dup", e))?;
    Ok(Memfd { fd, len })
}

/// Creates a segment of `len` bytes and drops it (create, map, unmap, close).
pub fn segment_create(len: usize) -> Result<()> {
    shm::Segment::create_anonymous(len).map(drop)
}

/// Opens the segment behind `memfd` afresh (checks, `mmap`) and drops it (`munmap`).
pub fn segment_open(memfd: &Memfd) -> Result<()> {
    let fd = memfd.fd.try_clone().map_err(|e| Error::os("dup", e))?;
    shm::Segment::open_block(fd, memfd.len as u64).map(drop)
}

/// Sends `memfd` over the pair (one packet, `SCM_RIGHTS`) and receives it back.
pub fn fd_round_trip(pair: &SocketPair, memfd: &Memfd) -> Result<()> {
    let header = [0u8; 16];
    loop {
        if let Attempt::Done(()) =
            socket::try_send_packet(pair.tx.as_fd(), &header, &[], &[memfd.fd.as_fd()])?
        {
            break;
        }
    }
    let mut buf = [0u8; 64];
    loop {
        if let Attempt::Done(packet) = socket::try_recv_packet(pair.rx.as_fd(), &mut buf)? {
            drop(packet);
            return Ok(());
        }
    }
}

/// Looks the segment behind `memfd` up the way a received handle does (`fstat`, then
/// the map cache), mapping it the first time; keep the result alive to make later
/// calls hits.
pub fn map_cache_lookup(memfd: &Memfd) -> Result<impl Drop> {
    shm::receive_fd_for_bench(memfd.fd.as_fd(), memfd.len as u64)
}

/// One process-shared 32-bit word, on a page of shared words of its own (a sealed
/// memfd, the page every lock and queue keeps its state in), for `multiproc
/// bench-floor`'s futex and spin ping-pongs between two processes. One process makes
/// it and hands [`fd`](Self::fd) to a process it starts (as its stdin, say); that one
/// [`open`](Self::open)s it.
pub struct SharedWord(SharedWords);

/// The page's kind tag ("FLOR"), so that a child never takes another page for it.
const FLOOR_KIND: u32 = 0x464c_4f52;
/// The word both processes turn on (word 0 is the page's kind tag).
const FLOOR_WORD: usize = 1;

impl SharedWord {
    /// A new page, its word 0.
    pub fn new() -> Result<SharedWord> {
        SharedWords::new(FLOOR_KIND).map(SharedWord)
    }

    /// Maps the page made by [`new`](Self::new) in another process, whose fd this
    /// process inherited; refused unless it is a sealed memfd of one page of this kind.
    pub fn open(fd: OwnedFd) -> Result<SharedWord> {
        SharedWords::open_inherited(fd, FLOOR_KIND, "bench-floor shared word").map(SharedWord)
    }

    /// The page's fd, to hand to another process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.fd()
    }

    /// The word, for atomics and process-shared (not `PRIVATE`) futex calls.
    pub fn word(&self) -> &AtomicU32 {
        self.0.word(FLOOR_WORD)
    }
}
