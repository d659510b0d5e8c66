//! The transport under every queue: a shared-memory [`Ring`] plus a socket pair. What
//! goes in comes out once, whole, to exactly one reader, whichever process it is in,
//! first in first out; a message without fds goes through the ring with no system
//! call, one with fds through the socket in its place behind a marker (see `ring`).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use std::sync::{Arc, Mutex, PoisonError};

use super::custody::Custody;
use super::ring::Ring;
use crate::error::{Error, PutError, Result};
use crate::shm::custody::{self, BlockCustody};
use crate::sys::Deadline;
use crate::sys::socket::{Packet, seqpacket_pair};
use crate::wire::{self, Decoder, Encoder};

/// A ring and both ends of one `SOCK_SEQPACKET` pair. Every process holding the queue
/// holds all three, so none of them ever sees end-of-stream: a getter waits (with its
/// deadline) until some holder puts.
#[derive(Debug)]
pub(crate) struct Channel {
    ring: Ring,
    /// The fds of the blocks sent through the channel (see `custody`).
    custody: Arc<Custody>,
    tx: OwnedFd,
    rx: OwnedFd,
    /// A message taken off the ring that could not be decoded for lack of fds (its
    /// blocks had to come out of custody): it is this process's next message, so that
    /// an fd limit loses nothing (see [`decode`](Self::decode)).
    pending: Mutex<Option<Packet>>,
    /// The references the failed decode of the pending packet holds for its next try,
    /// with the packet's bytes (address, length) to know it again by.
    held_for_retry: Mutex<Option<((usize, usize), wire::HeldReferences)>>,
    closed: AtomicBool,
}

impl Channel {
    pub(crate) fn new() -> Result<Self> {
        let (tx, rx) = seqpacket_pair()?;
        let ring = Ring::new()?;
        Ok(Self {
            custody: Arc::new(Custody::new(Arc::clone(ring.block()))?),
            ring,
            tx,
            rx,
            pending: Mutex::new(None),
            held_for_retry: Mutex::new(None),
            closed: AtomicBool::new(false),
        })
    }

    fn check_open(&self, what: &str) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed(format!(
                "{what} on a queue that this process closed"
            )))
        } else {
            Ok(())
        }
    }

    /// Marks this handle closed: later puts and gets through it fail.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Encodes and sends `item`, waiting for room until the deadline. On failure the
    /// item comes back.
    pub(crate) fn put<T: Serialize>(&self, item: T, deadline: Deadline) -> Result<(), PutError<T>> {
        let _span = tracing::trace_span!("multiproc::put", queue = "SimpleQueue").entered();
        let result = self
            .check_open("put")
            .and_then(|()| self.encode(&item))
            .and_then(|mut encoded| self.ring.send(&mut encoded, self.tx.as_fd(), deadline));
        match result {
            Ok(()) => Ok(()),
            Err(error) => Err(PutError { error, item }),
        }
    }

    /// Receives and decodes one message; `Ok(None)` at the deadline. A malformed message
    /// is consumed and reported; the queue stays usable.
    pub(crate) fn get<T: DeserializeOwned>(&self, deadline: Deadline) -> Result<Option<T>> {
        let _span = tracing::trace_span!("multiproc::get", queue = "SimpleQueue").entered();
        self.recv(deadline)?.map(|p| self.decode(p)).transpose()
    }

    /// Receives one message if one is waiting.
    pub(crate) fn try_get<T: DeserializeOwned>(&self) -> Result<Option<T>> {
        self.try_recv()?.map(|p| self.decode(p)).transpose()
    }

    /// The block the channel's ring lives in (a queue keeps its counters there too).
    pub(crate) fn block(&self) -> &Arc<crate::shm::SharedWords> {
        self.ring.block()
    }

    /// Decodes a packet received from this channel (its block handles may name blocks
    /// in the channel's custody).
    ///
    /// A packet without fds that fails with [`Error::FdLimit`] (a block it names had to
    /// be taken out of custody, with no fd left to take it) is kept, uncounted, as this
    /// process's next message: like a socket packet whose fds do not fit, it waits for
    /// fds to be closed instead of being lost. The references its handles adopted
    /// before the failure are taken once more and kept with it (see
    /// `wire::Decoder::adopted`), so that each is given back once however many tries
    /// the packet takes.
    pub(crate) fn decode<T: DeserializeOwned>(&self, mut packet: Packet) -> Result<T> {
        if !packet.fds.is_empty() {
            return custody::scope(self.custody_handle(), || wire::decode(packet));
        }
        let this = (packet.bytes.as_ptr() as usize, packet.bytes.len());
        let earlier = {
            let mut held = self
                .held_for_retry
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match held.take() {
                Some((of, refs)) if of == this => Some(refs),
                other => {
                    *held = other;
                    None
                }
            }
        };
        let (result, held) = custody::scope(self.custody_handle(), || {
            wire::decode_keeping(&packet.bytes)
        });
        // What an earlier try held for this packet, this one has adopted (or, failing,
        // holds anew).
        if let Some(earlier) = earlier {
            earlier.forget();
        }
        if let Err(Error::FdLimit { .. }) = &result {
            wire::uncount(&mut packet);
            *self
                .held_for_retry
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some((this, held));
            *self.pending.lock().unwrap_or_else(PoisonError::into_inner) = Some(packet);
        }
        result
    }

    fn take_pending(&self) -> Option<Packet> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn custody_handle(&self) -> Arc<dyn BlockCustody> {
        Arc::clone(&self.custody) as Arc<dyn BlockCustody>
    }

    /// Encodes `item` for [`send`](Self::send), without sending it.
    pub(crate) fn encode<T: Serialize>(&self, item: &T) -> Result<wire::Encoded> {
        self.check_open("put")?;
        custody::scope(self.custody_handle(), || wire::encode(item))
    }

    /// Sends a message made by [`encode`](Self::encode), waiting for room until the
    /// deadline.
    pub(crate) fn send(&self, encoded: &mut wire::Encoded, deadline: Deadline) -> Result<()> {
        self.ring.send(encoded, self.tx.as_fd(), deadline)
    }

    /// Receives one packet without decoding it; `Ok(None)` at the deadline. An
    /// `InvalidMessage` error here means a packet was consumed anyway; an `FdLimit` one
    /// that it stays queued (no room for its fds).
    pub(crate) fn recv(&self, deadline: Deadline) -> Result<Option<Packet>> {
        self.check_open("get")?;
        if let Some(packet) = self.take_pending() {
            return Ok(Some(packet));
        }
        self.ring.recv(self.rx.as_fd(), deadline)
    }

    /// Receives one packet if one is waiting, without decoding it.
    pub(crate) fn try_recv(&self) -> Result<Option<Packet>> {
        self.check_open("get")?;
        if let Some(packet) = self.take_pending() {
            return Ok(Some(packet));
        }
        self.ring.try_recv(self.rx.as_fd())
    }

    /// Whether a message is waiting right now.
    pub(crate) fn has_waiting(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
            || self.ring.holds_messages()
            || crate::sys::wait_fd(
                self.rx.as_fd(),
                crate::sys::Readiness::Readable,
                Some(std::time::Instant::now()),
            )
            .unwrap_or(false)
    }

    /// The sending socket, for tests that inject raw packets.
    #[cfg(test)]
    pub(crate) fn tx_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tx.as_fd()
    }
}

impl Serialize for Channel {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = Encoder::current("a queue").map_err(S::Error::custom)?;
        let (ctx, crx) = self.custody.sockets();
        let indices = (
            enc.attach_fd(self.tx.as_fd()).map_err(S::Error::custom)?,
            enc.attach_fd(self.rx.as_fd()).map_err(S::Error::custom)?,
            self.ring.attach(&enc).map_err(S::Error::custom)?,
            enc.attach_fd(ctx).map_err(S::Error::custom)?,
            enc.attach_fd(crx).map_err(S::Error::custom)?,
        );
        indices.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Channel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let (tx, rx, ring, ctx, crx) = <(u32, u32, u32, u32, u32)>::deserialize(d)?;
        let dec = Decoder::current("a queue").map_err(D::Error::custom)?;
        let socket = |index| {
            let fd = dec.take_fd(index).map_err(D::Error::custom)?;
            check_seqpacket(&fd)
                .map_err(|e| D::Error::custom(dec.fail(Error::InvalidMessage(e))))?;
            Ok(fd)
        };
        let (tx, rx, ctx, crx) = (socket(tx)?, socket(rx)?, socket(ctx)?, socket(crx)?);
        let ring = Ring::open_received(&dec, ring).map_err(D::Error::custom)?;
        Ok(Self {
            custody: Arc::new(Custody::from_parts(Arc::clone(ring.block()), ctx, crx)),
            ring,
            tx,
            rx,
            pending: Mutex::new(None),
            held_for_retry: Mutex::new(None),
            closed: AtomicBool::new(false),
        })
    }
}

/// A received queue or pipe end must be a unix seqpacket socket; anything else would
/// make every later get fail in confusing ways.
pub(crate) fn check_seqpacket(fd: &OwnedFd) -> std::result::Result<(), String> {
    crate::sys::socket::is_seqpacket(fd.as_fd())
        .map_err(|e| format!("a received queue end is not a socket ({e})"))?
        .then_some(())
        .ok_or_else(|| {
            "a received queue end is a socket of another type, not SEQPACKET".to_string()
        })
}
