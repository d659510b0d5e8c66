//! The shared-memory ring under every queue's channel: a message that carries no fds
//! goes from `put` to `get` through it without a single system call; the socket stays
//! for messages with fds (their place in the order is a marker in the ring), for
//! overflow, and for packets that did not come through a `put` (forged ones, which a
//! getter still receives and reports).
//!
//! **Layout.** One [`SharedWords`] (kind `RING`) with a byte area of [`RING_BYTES`]
//! after its page of words. Words: the ring lock (a [`RawLock`], words 1..5), `HEAD`
//! and `TAIL` (64-bit byte positions, only ever growing; a position's place in the
//! area is the position modulo [`RING_BYTES`]), `SEQ` (bumped by every publication;
//! sleeping getters wait on it), `GET_WAITERS`, `OVERFLOW`. A record is an 8-byte header
//! (length, tag) and its bytes, padded to 8. Tags: `PACKET` (the bytes are a whole
//! packet, wire header and inline payload), `MARKER` (the message is the next packet
//! on the socket), `WRAP` (the rest of the area is unused; go on at its start).
//!
//! **Invariants**, each kept under the ring lock:
//! - *Order.* A message's place is its record. A marker is pushed right after its
//!   packet went into the socket, in the same hold of the lock, so the socket's
//!   packets are in marker order and a getter that pops a marker receives the next
//!   packet.
//! - *Overflow.* A message that finds no room in the ring sets `OVERFLOW`; while it is
//!   set, every message goes to the socket as a whole packet without a marker, and a
//!   getter takes socket packets only once the ring is empty; a getter that finds both
//!   empty clears it. So whatever is in the ring is older than every unmarked packet,
//!   and a queue stays first-in first-out per producer whatever the mix.
//! - *Crashes.* A writer publishes by moving `TAIL` once its record is complete; a
//!   reader consumes by moving `HEAD` once it holds the bytes (or the packet). A
//!   process killed at any point leaves a consistent ring behind, and the next process
//!   to want the lock takes it over from the dead holder (see [`RawLock`]). A getter
//!   killed between receiving a marker's packet and moving `HEAD` leaves the marker for
//!   the next getter, which receives the next packet instead; the last marker then
//!   finds the socket empty and is dropped: the killed getter's message is the one
//!   lost, nobody else's, and nothing waits for it.
//! - *Untrusted bytes.* Every process holding the queue can write the area, so a
//!   record header is checked before anything is read, the bytes are copied out
//!   (never borrowed) and decoded as any packet; a ring found corrupt is emptied and
//!   the getter gets [`Error::InvalidMessage`] saying so, never a panic.
//!
//! **Waking.** A getter that finds nothing spins on `SEQ` for a short adaptive while
//! ([`futex::spin_until`]) and then sleeps on it; a putter wakes one sleeper, and only
//! when `GET_WAITERS` says there is one: a hand-over to a spinning getter costs no
//! system call on either side. A sleeping getter also looks at the socket every
//! [`SOCKET_RECHECK`], because a packet that did not come through a `put` wakes nobody.

use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::sync::lock::{Acquired, RawLock};
use crate::sys::futex;
use crate::sys::socket::{Attempt, Packet};
use crate::sys::{Deadline, Readiness, wait_fd};
use crate::wire::{self, Decoder, Encoder};

const KIND: u32 = 0x5249_4e47; // "RING"
/// Bytes of a ring's record area.
const RING_BYTES: usize = 64 << 10;
/// The largest packet that travels through the ring; a larger one goes on the socket,
/// in its place behind a marker.
const RECORD_MAX: usize = 16 << 10;

/// Words of the block (word 0 is the block's kind; the lock takes words 1..5; words
/// 16..32 belong to the channel's custody, 32 and up to a queue's counters).
const LOCK_BASE: usize = 1;
const HEAD: usize = 8;
const TAIL: usize = 10;
const SEQ: usize = 12;
const GET_WAITERS: usize = 13;
const OVERFLOW: usize = 14;

const TAG_PACKET: u32 = 1;
const TAG_MARKER: u32 = 2;
const TAG_WRAP: u32 = 3;
const RECORD_HEADER: usize = 8;

/// How long a sleeping getter waits before it looks at the socket again.
const SOCKET_RECHECK: Duration = Duration::from_millis(20);
/// How long a `try_` operation waits for the ring lock (whose holders keep it for
/// well under a microsecond, unless they died holding it).
const TRY_LOCK: Duration = Duration::from_millis(5);

/// The ring of one channel (see the module docs).
pub(crate) struct Ring {
    block: Arc<SharedWords>,
    lock: RawLock,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("head", &self.position(HEAD).load(Ordering::Relaxed))
            .field("tail", &self.position(TAIL).load(Ordering::Relaxed))
            .finish()
    }
}

/// The ring lock, held; released on drop.
struct Held<'a>(&'a Ring);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _ = self.0.lock.release();
    }
}

/// The oldest message of the ring, found but not yet consumed.
enum Oldest {
    /// A whole packet, copied out of the ring.
    Packet(Vec<u8>),
    /// The message is the next packet on the socket.
    Marker,
}

impl Ring {
    /// A new, empty ring.
    pub(crate) fn new() -> Result<Self> {
        Ok(Self::from_block(SharedWords::with_bytes(KIND, RING_BYTES)?))
    }

    fn from_block(block: SharedWords) -> Self {
        let block = Arc::new(block);
        Self {
            lock: RawLock::new(Arc::clone(&block), LOCK_BASE),
            block,
        }
    }

    /// The block the ring lives in (its words past the ring's own serve the channel's
    /// custody).
    pub(crate) fn block(&self) -> &Arc<SharedWords> {
        &self.block
    }

    fn word(&self, index: usize) -> &AtomicU32 {
        self.block.word(index)
    }

    fn position(&self, index: usize) -> &AtomicU64 {
        self.block.word64(index)
    }

    /// Takes the ring lock, waiting until the deadline (`None` when it passed).
    fn hold(&self, deadline: Deadline) -> Result<Option<Held<'_>>> {
        match self.lock.acquire(deadline)? {
            Acquired::Yes => Ok(Some(Held(self))),
            Acquired::FromDeadOwner(pid) => {
                // The ring is consistent at every instant (see the module docs).
                tracing::debug!(pid, "took a queue's ring lock over from a dead process");
                Ok(Some(Held(self)))
            }
            Acquired::TimedOut => Ok(None),
        }
    }

    /// Free bytes of the area, or `None` when the positions make no sense (a corrupt
    /// ring, which the next getter resets).
    fn free(&self) -> Option<usize> {
        let used = self
            .position(TAIL)
            .load(Ordering::Acquire)
            .wrapping_sub(self.position(HEAD).load(Ordering::Acquire));
        usize::try_from(used)
            .ok()
            .and_then(|u| RING_BYTES.checked_sub(u))
    }

    fn write_header(&self, at: usize, tag: u32, len: u32) {
        let mut header = [0u8; RECORD_HEADER];
        header[..4].copy_from_slice(&len.to_le_bytes());
        header[4..].copy_from_slice(&tag.to_le_bytes());
        self.block.write_bytes(at, &header);
    }

    /// Appends a record made of `parts`; `false` (nothing written) when it does not fit.
    /// Lock held.
    fn push(&self, tag: u32, parts: &[&[u8]]) -> bool {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let record = RECORD_HEADER + len.next_multiple_of(RECORD_HEADER);
        let Some(free) = self.free() else {
            return false;
        };
        let tail = self.position(TAIL).load(Ordering::Acquire);
        let at = (tail % RING_BYTES as u64) as usize;
        let to_end = RING_BYTES - at;
        // A record never straddles the end: the rest of the area becomes a WRAP record
        // (at least a header's worth, as every position is a multiple of 8).
        let skip = if record <= to_end { 0 } else { to_end };
        if skip + record > free {
            return false;
        }
        if skip > 0 {
            self.write_header(at, TAG_WRAP, (skip - RECORD_HEADER) as u32);
        }
        let start = (at + skip) % RING_BYTES;
        let mut offset = start + RECORD_HEADER;
        for part in parts {
            self.block.write_bytes(offset, part);
            offset += part.len();
        }
        self.write_header(start, tag, len as u32);
        // Publication: the record is complete before TAIL covers it.
        self.position(TAIL)
            .store(tail + (skip + record) as u64, Ordering::Release);
        self.word(SEQ).fetch_add(1, Ordering::SeqCst);
        true
    }

    /// The oldest message and the position after it, without consuming it; `None`
    /// when the ring is empty. Lock held.
    fn oldest(&self) -> Result<Option<(Oldest, u64)>> {
        let tail = self.position(TAIL).load(Ordering::Acquire);
        let mut head = self.position(HEAD).load(Ordering::Acquire);
        loop {
            if head == tail {
                return Ok(None);
            }
            let used = tail.wrapping_sub(head);
            if used > RING_BYTES as u64 || head % RECORD_HEADER as u64 != 0 {
                return Err(self.reset("its positions are inconsistent"));
            }
            let at = (head % RING_BYTES as u64) as usize;
            let mut header = [0u8; RECORD_HEADER];
            self.block.read_bytes(at, &mut header);
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
            let tag = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
            let record = RECORD_HEADER + len.next_multiple_of(RECORD_HEADER);
            if record as u64 > used || at + record > RING_BYTES {
                return Err(self.reset("a record runs past the queued bytes"));
            }
            let next = head + record as u64;
            match tag {
                TAG_WRAP if at + record == RING_BYTES => head = next,
                TAG_MARKER if len == 0 => return Ok(Some((Oldest::Marker, next))),
                TAG_PACKET if len <= RECORD_MAX => {
                    let mut bytes = vec![0u8; len];
                    self.block.read_bytes(at + RECORD_HEADER, &mut bytes);
                    return Ok(Some((Oldest::Packet(bytes), next)));
                }
                _ => return Err(self.reset("a record has an unknown tag or length")),
            }
        }
    }

    /// Consumes everything up to `next`. Lock held.
    fn consume(&self, next: u64) {
        self.position(HEAD).store(next, Ordering::Release);
    }

    /// Empties a ring found corrupt; the error for the getter that found it.
    fn reset(&self, why: &str) -> Error {
        let tail = self.position(TAIL).load(Ordering::Acquire);
        self.position(HEAD).store(tail, Ordering::Release);
        Error::InvalidMessage(format!(
            "a queue's shared ring is corrupt ({why}): the messages in it were dropped; \
             something other than multiproc wrote into the queue's memory"
        ))
    }

    /// Wakes a sleeping getter, if there is one. After the lock is released.
    fn wake_getter(&self) {
        if self.word(GET_WAITERS).load(Ordering::SeqCst) > 0 {
            futex::wake(self.word(SEQ), 1);
        }
    }

    /// Sends `msg` (see the module docs for which way), waiting for room on the
    /// socket until the deadline; [`Error::Timeout`] when none came.
    pub(crate) fn send(
        &self,
        msg: &mut wire::Encoded,
        tx: BorrowedFd<'_>,
        deadline: Deadline,
    ) -> Result<()> {
        loop {
            let Some(held) = self.hold(deadline)? else {
                return Err(Error::timeout("a put waiting for a queue's lock", None));
            };
            // Through the ring, or on the socket with a marker in the ring, or (after
            // an overflow) on the socket alone.
            let mut marked = false;
            if self.word(OVERFLOW).load(Ordering::Acquire) == 0 {
                let plain = msg
                    .as_plain_bytes()
                    .filter(|(h, p)| h.len() + p.len() <= RECORD_MAX);
                if let Some((header, payload)) = plain {
                    if self.push(TAG_PACKET, &[header, payload]) {
                        msg.mark_sent();
                        drop(held);
                        self.wake_getter();
                        return Ok(());
                    }
                } else {
                    marked = self.free().is_some_and(|f| f >= RECORD_HEADER);
                }
                if !marked {
                    self.word(OVERFLOW).store(1, Ordering::Release);
                }
            }
            match msg.try_send(tx)? {
                Attempt::Done(()) => {
                    if !marked {
                        self.word(SEQ).fetch_add(1, Ordering::SeqCst);
                    } else if !self.push(TAG_MARKER, &[]) {
                        // Only a corrupt ring refuses a marker that fits: the packet
                        // then waits on the socket as an unmarked one.
                        self.word(OVERFLOW).store(1, Ordering::Release);
                    }
                    drop(held);
                    self.wake_getter();
                    return Ok(());
                }
                Attempt::WouldBlock => {
                    drop(held);
                    wait_for_room(tx, deadline)?;
                }
            }
        }
    }

    /// Takes the oldest message, from the ring or the socket. Lock held. With the ring
    /// empty, the socket is looked at only when `look_at_socket` says so or the ring
    /// overflowed: otherwise it holds nothing that a `put` sent (packets with fds have
    /// their markers), only what came some other way.
    fn take(&self, rx: BorrowedFd<'_>, look_at_socket: bool) -> Result<Option<Packet>> {
        loop {
            match self.oldest()? {
                Some((Oldest::Packet(bytes), next)) => {
                    self.consume(next);
                    return Ok(Some(Packet {
                        bytes,
                        fds: Vec::new(),
                    }));
                }
                Some((Oldest::Marker, next)) => match wire::try_recv_packet(rx) {
                    Ok(Some(packet)) => {
                        self.consume(next);
                        return Ok(Some(packet));
                    }
                    // Its packet went with a getter killed mid-get (see the module
                    // docs): drop the marker and look further.
                    Ok(None) => self.consume(next),
                    // No room for its fds: the packet stays queued, and so does its
                    // place.
                    Err(e @ Error::FdLimit { .. }) => return Err(e),
                    Err(e) => {
                        self.consume(next);
                        return Err(e);
                    }
                },
                None => {
                    if !look_at_socket && self.word(OVERFLOW).load(Ordering::Acquire) == 0 {
                        return Ok(None);
                    }
                    let packet = wire::try_recv_packet(rx)?;
                    if packet.is_none() {
                        self.word(OVERFLOW).store(0, Ordering::Release);
                    }
                    return Ok(packet);
                }
            }
        }
    }

    /// Receives the oldest message, waiting until the deadline; `Ok(None)` when none
    /// came. `disconnected()` says whether no other holder of the channel is left; it is
    /// asked on the first look and after each sleep, *before* the ring and the socket
    /// are looked at, and when both are empty the answer is [`Error::Disconnected`].
    pub(crate) fn recv(
        &self,
        rx: BorrowedFd<'_>,
        deadline: Deadline,
        disconnected: &dyn Fn() -> bool,
    ) -> Result<Option<Packet>> {
        // The socket is looked at only after a sleep that ended without a publication
        // (see `take`): a packet that did not come through a `put` waits at most one
        // SOCKET_RECHECK.
        let mut look_at_socket = false;
        let mut ask = true;
        loop {
            // Asked first: a holder that put and then left is gone before its messages
            // are looked for, so they are found.
            let alone = ask && disconnected();
            let seen = {
                let Some(_held) = self.hold(deadline)? else {
                    return Ok(None);
                };
                if let Some(packet) = self.take(rx, look_at_socket || alone)? {
                    return Ok(Some(packet));
                }
                if alone {
                    return Err(disconnected_error());
                }
                self.word(SEQ).load(Ordering::SeqCst)
            };
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            look_at_socket = false;
            ask = false;
            let seq = self.word(SEQ);
            if futex::spin_until(deadline, || seq.load(Ordering::Acquire) != seen) {
                continue;
            }
            let slice = now + SOCKET_RECHECK;
            let until = deadline.map_or(slice, |d| d.min(slice));
            self.word(GET_WAITERS).fetch_add(1, Ordering::SeqCst);
            let slept = futex::wait(seq, seen, Some(until));
            self.word(GET_WAITERS).fetch_sub(1, Ordering::SeqCst);
            slept?;
            look_at_socket = seq.load(Ordering::Acquire) == seen;
            ask = look_at_socket;
        }
    }

    /// Receives the oldest message if one is there now; [`Error::Disconnected`] when
    /// there is none and no other holder is left (as in [`recv`](Self::recv)).
    pub(crate) fn try_recv(
        &self,
        rx: BorrowedFd<'_>,
        disconnected: &dyn Fn() -> bool,
    ) -> Result<Option<Packet>> {
        let alone = disconnected();
        let Some(_held) = self.hold(Some(Instant::now() + TRY_LOCK))? else {
            return Ok(None);
        };
        match self.take(rx, true)? {
            None if alone => Err(disconnected_error()),
            other => Ok(other),
        }
    }

    /// Whether the ring holds a message right now (the socket is the caller's to ask).
    pub(crate) fn holds_messages(&self) -> bool {
        self.position(TAIL).load(Ordering::Acquire) != self.position(HEAD).load(Ordering::Acquire)
    }

    /// Puts the ring's fd into the side table of the message `enc` encodes; its index.
    pub(crate) fn attach(&self, enc: &Encoder<'_>) -> std::result::Result<u32, String> {
        self.block.attach(enc)
    }

    /// The ring sent as fd `index` of the message `dec` decodes.
    pub(crate) fn open_received(
        dec: &Decoder<'_>,
        index: u32,
    ) -> std::result::Result<Self, String> {
        SharedWords::open_received(&dec.about("queue ring"), index, KIND, RING_BYTES)
            .map(Self::from_block)
    }
}

/// What a get on an empty channel with no other holder left gets.
fn disconnected_error() -> Error {
    Error::Disconnected(
        "the queue is empty and no other handle of it is left (in another process, another \
         thread of this one, or a message in flight), so nothing can arrive any more"
            .into(),
    )
}

/// Waits until the socket takes more bytes; [`Error::Timeout`] at the deadline.
fn wait_for_room(tx: BorrowedFd<'_>, deadline: Deadline) -> Result<()> {
    if wait_fd(tx, Readiness::Writable, deadline)? {
        Ok(())
    } else {
        Err(Error::timeout(
            "a put on a queue whose socket buffer is full",
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::time::Duration;

    use super::*;
    use crate::sys::socket::seqpacket_pair;

    #[derive(serde::Serialize, serde::Deserialize)]
    enum Item {
        Plain(u32),
        WithFd(u32, crate::Event),
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn order_holds_across_ring_markers_and_overflow() {
        let ring = Ring::new().unwrap();
        let (tx, rx) = seqpacket_pair().unwrap();
        let event = crate::Event::new().unwrap();
        // More plain items than the ring holds (it overflows onto the socket), with
        // every 100th carrying an fd (a marker while the ring has room).
        let n = 2100u32;
        for i in 0..n {
            let item = if i % 100 == 0 {
                Item::WithFd(i, event.clone())
            } else {
                Item::Plain(i)
            };
            let mut msg = wire::encode(&item).unwrap();
            ring.send(
                &mut msg,
                tx.as_fd(),
                Some(Instant::now() + Duration::from_secs(5)),
            )
            .unwrap();
        }
        assert_eq!(
            ring.word(OVERFLOW).load(Ordering::Acquire),
            1,
            "the test meant to overflow the ring"
        );
        for i in 0..n {
            let packet = ring.recv(rx.as_fd(), None, &|| false).unwrap().unwrap();
            match wire::decode::<Item>(packet).unwrap() {
                Item::Plain(j) => assert_eq!((j, i % 100 != 0), (i, true)),
                Item::WithFd(j, _) => assert_eq!((j, i % 100), (i, 0)),
            }
        }
        assert!(ring.try_recv(rx.as_fd(), &|| false).unwrap().is_none());
        assert_eq!(ring.word(OVERFLOW).load(Ordering::Acquire), 0);
        // After an overflow the ring is used again.
        let mut msg = wire::encode(&Item::Plain(7)).unwrap();
        ring.send(&mut msg, tx.as_fd(), None).unwrap();
        assert!(ring.holds_messages());
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn a_corrupt_ring_is_an_error_then_usable_again() {
        let ring = Ring::new().unwrap();
        let (tx, rx) = seqpacket_pair().unwrap();
        let bad_records: [fn(&Ring, u64); 3] = [
            // Positions that claim more bytes than the area holds.
            |r, head| r.position(TAIL).store(head + (1 << 40), Ordering::Release),
            // An unknown tag.
            |r, head| {
                r.write_header((head % RING_BYTES as u64) as usize, 99, 8);
                r.position(TAIL).store(head + 16, Ordering::Release);
            },
            // A length past the queued bytes.
            |r, head| {
                r.write_header((head % RING_BYTES as u64) as usize, TAG_PACKET, 1 << 30);
                r.position(TAIL).store(head + 64, Ordering::Release);
            },
        ];
        for bad in bad_records {
            bad(&ring, ring.position(HEAD).load(Ordering::Acquire));
            let Err(err) = ring.recv(rx.as_fd(), None, &|| false) else {
                panic!("a corrupt ring gave a packet");
            };
            assert!(
                matches!(&err, Error::InvalidMessage(m) if m.contains("corrupt")),
                "{err}"
            );
            let mut msg = wire::encode(&5u8).unwrap();
            ring.send(&mut msg, tx.as_fd(), None).unwrap();
            let got: u8 =
                wire::decode(ring.recv(rx.as_fd(), None, &|| false).unwrap().unwrap()).unwrap();
            assert_eq!(got, 5);
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn a_getter_sleeping_on_an_empty_ring_is_woken() {
        let ring = Arc::new(Ring::new().unwrap());
        let (tx, rx) = seqpacket_pair().unwrap();
        let getter = {
            let ring = Arc::clone(&ring);
            std::thread::spawn(move || {
                let packet = ring
                    .recv(
                        rx.as_fd(),
                        Some(Instant::now() + Duration::from_secs(20)),
                        &|| false,
                    )
                    .unwrap()
                    .expect("woken before the deadline");
                wire::decode::<String>(packet).unwrap()
            })
        };
        // Whether the getter is spinning or asleep by now, the put must reach it.
        while ring.word(GET_WAITERS).load(Ordering::Acquire) == 0 && !getter.is_finished() {
            std::thread::yield_now();
        }
        let mut msg = wire::encode(&"hello".to_string()).unwrap();
        ring.send(&mut msg, tx.as_fd(), None).unwrap();
        assert_eq!(getter.join().unwrap(), "hello");
    }
}
