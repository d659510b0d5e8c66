//! The transport under every queue: a shared-memory [`Ring`] plus a socket pair. What
//! goes in comes out once, whole, to exactly one reader, whichever process it is in,
//! first in first out for each producer; a message without fds that fits a slot goes
//! through the ring with no system call, one with fds (or too large, or meeting a full
//! ring) through the socket, and the lane's flag keeps each producer's order across the
//! two (see `ring`).
//!
//! **Who still holds the queue.** Every channel value holds a peer lease (see
//! `sys::lease`): the creator's, or the one a received message brought, which the
//! sender made for it. So the kernel counts the channel's holders in other processes
//! and in messages in flight (a lease inside an unreceived message, a worker's
//! arguments), and forgets a holder the moment its last fd closes, a SIGKILL included.
//! A `fork` child, which inherits the value rather than receiving it, gets a lease of
//! its own at the fork (`sys::peer_lease`).
//! Handles in this process share one channel value; the queue types say whether
//! another exists (`others_here`). A get that finds the queue empty with neither is
//! [`Error::Disconnected`]: nothing can ever arrive. The holders are asked before the
//! ring and the socket are looked at for the last time (a holder that put and left is
//! gone before its messages are looked for, so they are found): by a `try_get` that
//! found nothing, and by a waiting get whose first look, or first after a sleep, found
//! nothing (a message waiting is taken without asking). Both
//! trust a sighting of other holders for [`HOLDERS_RECHECK`] (the answer costs a
//! system call, and a get that finds the queue empty is on the hot path) unless a
//! channel value was dropped since (the ring's `LEFT` word): so a `try_get` on an
//! empty queue asks the kernel at most once per 10 ms, and hears of a holder that
//! dropped its handle at once, of one that was killed within 10 ms. An awaited get
//! asks afresh before it parks, and hears of a holder that leaves (a killed one
//! included) through a watch of the closes of this lease file (see `queue::awaiting`).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use std::sync::{Arc, Mutex, PoisonError};

use super::custody::Custody;
use super::ring::{Ring, TryLook};
use crate::error::{Error, PutError, Result};
use crate::sys::Deadline;
use crate::sys::lease;
use crate::sys::peer_lease::PeerLease;
use crate::sys::socket::{Packet, seqpacket_pair};
use crate::wire::{self, Decoder, Encoder};

/// Which queue type made a channel (its block's `FLAVOR` word): a `Queue`, a
/// `JoinableQueue` and a `SimpleQueue` share a wire form, but not their counts (a
/// `JoinableQueue` counts each put as a task, a `Queue` does not), so a receiver
/// expecting another type refuses the handle instead of miscounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flavor {
    Queue = 1,
    Joinable = 2,
    Simple = 3,
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::Queue => "a Queue",
            Flavor::Joinable => "a JoinableQueue",
            Flavor::Simple => "a SimpleQueue",
        }
    }

    fn of_word(word: u32) -> Option<Flavor> {
        [Flavor::Queue, Flavor::Joinable, Flavor::Simple]
            .into_iter()
            .find(|f| *f as u32 == word)
    }
}

/// How long a get trusts an answer that other holders exist before it asks again.
const HOLDERS_RECHECK: Duration = Duration::from_millis(10);

/// Whether another handle of the channel exists in this process (a clone, in this
/// thread or another): asked by a get that finds the channel empty.
pub(crate) type OthersHere<'a> = &'a dyn Fn() -> bool;

/// A ring and both ends of one `SOCK_SEQPACKET` pair. Every process holding the queue
/// holds all three, so none of them ever sees end-of-stream: a getter waits (with its
/// deadline) until some holder puts, or until no holder but itself is left (see the
/// module docs).
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
    /// What gives back the block uses of a packet dropped unread (see
    /// `wire::context`), with the custody to find their blocks in.
    returns: Arc<dyn wire::GiveBack>,
    closed: AtomicBool,
    /// This value's peer lease on the channel's holder file (a `fork` child's copy of
    /// the value gets a lease of its own: see `sys::peer_lease`).
    holder: PeerLease,
    /// The watch of the holder file's closes that awaited gets wait on (see
    /// `queue::awaiting`), made when one is first polled; `None` inside when refused.
    #[cfg(feature = "async")]
    holder_watch: std::sync::OnceLock<Option<crate::sys::reactor::CloseWatch>>,
    /// When other holders were last seen, in nanoseconds after [`epoch`] (0: never).
    others_seen_at: AtomicU64,
    /// The ring's count of departures when other holders were last seen.
    others_seen_left: AtomicU32,
}

/// Whether a decode failed only because the channel's custody stayed busy (its packet
/// is kept as this process's next message) and the caller's deadline leaves time to try
/// again. A decode waits for nothing else.
pub(crate) fn busy_custody_with_time_left(e: &Error, deadline: Deadline) -> bool {
    e.is_timeout() && deadline.is_none_or(|d| Instant::now() < d)
}

/// How long the decode of a get that may block waits for the custody's shelves (see
/// `wire::Custody::find`): `wire::LOOKUP_PATIENCE`, or less when the get's deadline
/// comes sooner. A get that must not block passes `wire::TRY_PATIENCE` instead.
pub(crate) fn lookup_patience(deadline: Deadline) -> Duration {
    match deadline {
        None => wire::LOOKUP_PATIENCE,
        Some(d) => d
            .saturating_duration_since(Instant::now())
            .min(wire::LOOKUP_PATIENCE),
    }
}

/// The instant `Channel::others_seen_at` counts from.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Channel {
    pub(crate) fn new() -> Result<Self> {
        let (tx, rx) = seqpacket_pair()?;
        let ring = Ring::new()?;
        let custody = Arc::new(Custody::new(Arc::clone(ring.block()))?);
        Ok(Self {
            returns: crate::shm::Returns::with_custody(Arc::clone(&custody) as _),
            custody,
            ring,
            tx,
            rx,
            pending: Mutex::new(None),
            closed: AtomicBool::new(false),
            holder: PeerLease::new(lease::create_peer("multiproc-queue-holders")?),
            others_seen_at: AtomicU64::new(0),
            others_seen_left: AtomicU32::new(0),
            #[cfg(feature = "async")]
            holder_watch: std::sync::OnceLock::new(),
        })
    }

    /// Whether nothing can ever arrive: no other handle here (`others_here`), none in
    /// another process and none in a message in flight (no other peer lease). Trusts a
    /// sighting of other holders for [`HOLDERS_RECHECK`], unless `fresh` or a channel
    /// value was dropped since.
    fn disconnected(&self, others_here: OthersHere<'_>, fresh: bool) -> bool {
        if others_here() {
            return false;
        }
        let now = u64::try_from(epoch().elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        // Read before the kernel is asked: a holder that leaves after this changes it.
        let left = self.ring.departures();
        let seen = self.others_seen_at.load(Ordering::Relaxed);
        if !fresh
            && seen != 0
            && now.saturating_sub(seen) < HOLDERS_RECHECK.as_nanos() as u64
            && self.others_seen_left.load(Ordering::Relaxed) == left
        {
            return false;
        }
        if lease::others_hold(self.holder.as_fd()) {
            self.others_seen_left.store(left, Ordering::Relaxed);
            self.others_seen_at.store(now, Ordering::Relaxed);
            return false;
        }
        true
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
    pub(crate) fn get<T: DeserializeOwned>(
        &self,
        deadline: Deadline,
        others_here: OthersHere<'_>,
    ) -> Result<Option<T>> {
        let _span = tracing::trace_span!("multiproc::get", queue = "SimpleQueue").entered();
        loop {
            let Some(packet) = self.recv(deadline, others_here)? else {
                return Ok(None);
            };
            match self.decode(packet, lookup_patience(deadline)) {
                Err(e) if busy_custody_with_time_left(&e, deadline) => continue,
                other => return other.map(Some),
            }
        }
    }

    /// Receives one message if one is waiting, without waiting and, when none is,
    /// without a system call (see `ring`'s module docs, "Tries").
    pub(crate) fn try_get<T: DeserializeOwned>(
        &self,
        others_here: OthersHere<'_>,
    ) -> Result<Option<T>> {
        self.try_get_as(others_here, false)
    }

    /// [`try_get`](Self::try_get), or, when `thorough`, a try that also looks at the
    /// socket whatever the lane says and asks afresh whether other holders are left:
    /// an awaited get's last try before it parks (and its re-checks, see
    /// [`needs_recheck`](Self::needs_recheck)), which is how it hears of a packet
    /// written on the socket without a `put` and of a last other holder that was
    /// killed.
    pub(crate) fn try_get_as<T: DeserializeOwned>(
        &self,
        others_here: OthersHere<'_>,
        thorough: bool,
    ) -> Result<Option<T>> {
        match self
            .try_recv_as(others_here, thorough)?
            .map(|p| self.decode(p, wire::TRY_PATIENCE))
        {
            // Kept for the next get: nothing is ready now.
            Some(Err(Error::Timeout { .. })) => Ok(None),
            other => other.transpose(),
        }
    }

    /// Marks the channel as made by a queue of type `flavor` (once, when it is made).
    pub(super) fn set_flavor(&self, flavor: Flavor) {
        self.block()
            .word(super::layout::FLAVOR)
            .store(flavor as u32, Ordering::Release);
    }

    /// Checks that a received channel was made by a queue of type `expected`.
    pub(super) fn check_flavor<E: serde::de::Error>(
        &self,
        expected: Flavor,
    ) -> std::result::Result<(), E> {
        let word = self
            .block()
            .word(super::layout::FLAVOR)
            .load(Ordering::Acquire);
        if word == expected as u32 {
            return Ok(());
        }
        let why = match Flavor::of_word(word) {
            Some(found) => format!(
                "the queue received as {} is {}: receive it as that type (the two count \
                 their items differently)",
                expected.name(),
                found.name()
            ),
            None => format!(
                "the queue received as {} names no queue type ({word}): was it made by \
                 another multiproc build?",
                expected.name()
            ),
        };
        let err = Error::InvalidMessage(why);
        Err(E::custom(match Decoder::current("a queue") {
            Ok(dec) => dec.fail(err),
            Err(_) => err.to_string(),
        }))
    }

    /// The block the channel's ring lives in (a queue keeps its counters there too).
    pub(crate) fn block(&self) -> &Arc<crate::shm::SharedWords> {
        self.ring.block()
    }

    /// Decodes a packet received from this channel (its block handles may name blocks
    /// in the channel's custody).
    ///
    /// A packet without fds that fails with [`Error::FdLimit`] (a block it names had to
    /// be taken out of custody, with no fd left to take it) or with [`Error::Timeout`]
    /// (both shelves of the custody stayed taken: their holders are stopped — a
    /// debugger, Ctrl-Z — or slow) is kept, uncounted, as this process's next message:
    /// like a socket packet whose fds do not fit, it waits instead of being lost. The
    /// failed decode adopted none of the uses the packet carries, so its next try finds
    /// them all. [`get`](Self::get) tries again until its deadline. A lookup in the
    /// custody waits `patience` at most (see [`lookup_patience`]).
    pub(crate) fn decode<T: DeserializeOwned>(
        &self,
        packet: Packet,
        patience: Duration,
    ) -> Result<T> {
        // Once this holder goes quiet, the custody is swept of dead blocks.
        self.custody.wake_idle_job();
        let mut kept = None;
        let decoded = wire::decode_or_keep(packet, &self.returns, &mut kept, patience);
        if let Some(mut packet) = kept {
            wire::uncount(&mut packet);
            *self.pending.lock().unwrap_or_else(PoisonError::into_inner) = Some(packet);
        }
        decoded
    }

    fn take_pending(&self) -> Option<Packet> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Encodes `item` for [`send`](Self::send), without sending it.
    pub(crate) fn encode<T: Serialize>(&self, item: &T) -> Result<wire::Encoded> {
        self.check_open("put")?;
        let custody: Arc<dyn wire::Custody> = Arc::clone(&self.custody) as _;
        let encoded = wire::encode_in(item, Some(&custody));
        self.custody.wake_idle_job();
        encoded
    }

    /// Sends a message made by [`encode`](Self::encode), waiting for room until the
    /// deadline.
    pub(crate) fn send(&self, encoded: &mut wire::Encoded, deadline: Deadline) -> Result<()> {
        self.ring.send(encoded, self.tx.as_fd(), deadline)
    }

    /// Receives one packet without decoding it; `Ok(None)` at the deadline. An
    /// `InvalidMessage` error here means a packet was consumed anyway; an `FdLimit` one
    /// that it stays queued (no room for its fds); a `Disconnected` one that the channel
    /// is empty and nothing can ever arrive.
    pub(crate) fn recv(
        &self,
        deadline: Deadline,
        others_here: OthersHere<'_>,
    ) -> Result<Option<Packet>> {
        self.check_open("get")?;
        if let Some(packet) = self.take_pending() {
            return Ok(Some(packet));
        }
        self.ring.recv(self.rx.as_fd(), deadline, &|| {
            self.disconnected(others_here, false)
        })
    }

    /// Receives one packet if one is waiting, without decoding it; `thorough`: see
    /// [`try_get_as`](Self::try_get_as).
    pub(crate) fn try_recv_as(
        &self,
        others_here: OthersHere<'_>,
        thorough: bool,
    ) -> Result<Option<Packet>> {
        self.check_open("get")?;
        if let Some(packet) = self.take_pending() {
            return Ok(Some(packet));
        }
        let how = if thorough {
            TryLook::Thorough
        } else {
            TryLook::Quick
        };
        self.ring.try_recv(
            self.rx.as_fd(),
            &|| self.disconnected(others_here, thorough),
            how,
        )
    }

    /// Whether a get would not wait now: a message is waiting, nothing can ever arrive
    /// (a get says [`Error::Disconnected`]), or this handle was closed (a get says
    /// [`Error::Closed`]). Asks afresh whether other holders are left.
    pub(crate) fn get_would_not_wait(&self, others_here: OthersHere<'_>) -> bool {
        self.closed.load(Ordering::Acquire)
            || self.has_waiting()
            || self.disconnected(others_here, true)
    }

    /// See [`Ring::get_words`]: read `SEQ` *before* asking
    /// [`get_would_not_wait`](Self::get_would_not_wait), then sleep on the value read.
    pub(crate) fn get_words(
        &self,
    ) -> (&std::sync::atomic::AtomicU32, &std::sync::atomic::AtomicU32) {
        self.ring.get_words()
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

    /// What an awaited get parks on: see `Ring::get_wait`. Read before the get's try.
    #[cfg(feature = "async")]
    pub(crate) fn get_wait(&self) -> crate::sys::reactor::WordWait {
        self.ring.get_wait()
    }

    /// Whether an awaited get that found nothing must look again after
    /// `reactor::RECHECK` even if nothing wakes it: when this value keeps a message
    /// back (its decode met a busy custody, whose holders wake nobody when they let
    /// go). Asked after the get's tries.
    #[cfg(feature = "async")]
    pub(crate) fn needs_recheck(&self) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// The watch of this value's holder lease file, whose closes (any holder leaving,
    /// a killed one included) awaited gets wait on (see `queue::awaiting`): made on
    /// first use, kept as long as the value; `None` when the kernel refused it, and in
    /// a `fork` child that inherited this value with its parent's watch (its gets rely
    /// on their re-checks).
    #[cfg(feature = "async")]
    pub(crate) fn holder_watch(&self) -> Option<&crate::sys::reactor::CloseWatch> {
        self.holder_watch
            .get_or_init(|| crate::sys::reactor::watch_closes(self.holder.as_fd()))
            .as_ref()
            .filter(|w| w.is_here())
    }

    /// The sending socket: an awaited put whose packet found it full waits until it
    /// takes more.
    #[cfg(feature = "async")]
    pub(crate) fn tx(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tx.as_fd()
    }

    /// Runs `f` while this process holds the lock of the custody's `shelf` (tests).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn while_custody_locked<R>(&self, shelf: usize, f: impl FnOnce() -> R) -> Result<R> {
        self.custody.while_locked(shelf, f)
    }

    /// Puts `item` without a deadline, running `pause` while its ring slot is claimed
    /// and not yet written (tests).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn put_pausing_in_ring<T: Serialize>(
        &self,
        item: &T,
        pause: impl FnOnce(),
    ) -> Result<()> {
        let mut encoded = self.encode(item)?;
        self.ring
            .send_pausing(&mut encoded, self.tx.as_fd(), None, pause)
    }

    /// Gets one item without a deadline, running `pause` the first time a record has
    /// been copied out of the ring and not yet taken (tests).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn get_pausing_in_ring<T: DeserializeOwned>(
        &self,
        others_here: OthersHere<'_>,
        pause: impl FnOnce(),
    ) -> Result<T> {
        self.check_open("get")?;
        let packet = self
            .ring
            .recv_pausing(
                self.rx.as_fd(),
                None,
                &|| self.disconnected(others_here, false),
                pause,
            )?
            .ok_or_else(|| Error::timeout("a get without deadline", None))?;
        self.decode(packet, wire::LOOKUP_PATIENCE)
    }

    /// The sending socket, for tests that inject raw packets.
    #[cfg(test)]
    pub(crate) fn tx_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.tx.as_fd()
    }
}

/// Most packets the last holder gives back when it drops the channel (a bound, in case
/// something keeps writing to the sockets).
const GIVE_BACK_AT_MOST: usize = 1 << 20;

impl Drop for Channel {
    /// Gives back the block uses of what can no longer be received: this process's
    /// pending packet, and — when no other holder is left anywhere (none in another
    /// process, none in a message in flight) — every message still queued.
    fn drop(&mut self) {
        if let Some(packet) = self.take_pending() {
            wire::give_back_unread(packet, &*self.returns);
        }
        let holder = self.holder.as_fd();
        let released = lease::release_peer(holder).is_ok();
        // Getters that wait ask again whether anybody is left (awaited ones hear of a
        // killed holder through the holder watch instead).
        self.ring.holder_left();
        if !released || lease::others_hold(holder) {
            return;
        }
        for _ in 0..GIVE_BACK_AT_MOST {
            let packet = match self.ring.try_recv(self.rx.as_fd(), &|| true, TryLook::Last) {
                Ok(Some(packet)) => packet,
                _ => match wire::try_recv_packet(self.rx.as_fd()) {
                    Ok(Some(packet)) => packet,
                    _ => break,
                },
            };
            wire::give_back_unread(packet, &*self.returns);
        }
    }
}

impl Serialize for Channel {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = Encoder::current("a queue").map_err(S::Error::custom)?;
        let (ctx, crx) = self.custody.sockets();
        // The receiver's lease, held from now on by the message (its description lives
        // in the message's fd table, then in the socket, then in the receiver). The
        // table keeps this very fd open until the message is gone, so its number cannot
        // be reused (and mistaken for it) by another handle of the same message.
        let holder = Arc::new(
            lease::another_peer(self.holder.as_fd()).map_err(|e| S::Error::custom(enc.fail(e)))?,
        );
        let indices = (
            enc.attach_fd(self.tx.as_fd()).map_err(S::Error::custom)?,
            enc.attach_fd(self.rx.as_fd()).map_err(S::Error::custom)?,
            self.ring.attach(&enc).map_err(S::Error::custom)?,
            enc.attach_fd(ctx).map_err(S::Error::custom)?,
            enc.attach_fd(crx).map_err(S::Error::custom)?,
            enc.attach_shared_fd(&holder),
        );
        indices.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Channel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let (tx, rx, ring, ctx, crx, holder) = <(u32, u32, u32, u32, u32, u32)>::deserialize(d)?;
        let dec = Decoder::current("a queue").map_err(D::Error::custom)?;
        let socket = |index| {
            let fd = dec.take_fd(index).map_err(D::Error::custom)?;
            check_seqpacket(&fd)
                .map_err(|e| D::Error::custom(dec.fail(Error::InvalidMessage(e))))?;
            Ok(fd)
        };
        let (tx, rx, ctx, crx) = (socket(tx)?, socket(rx)?, socket(ctx)?, socket(crx)?);
        let ring = Ring::open_received(&dec, ring).map_err(D::Error::custom)?;
        let holder = dec.take_fd(holder).map_err(D::Error::custom)?;
        // Whatever the sender did, this value's lease is held from here on.
        lease::hold_peer(holder.as_fd()).map_err(|e| {
            D::Error::custom(dec.fail(Error::InvalidMessage(format!(
                "a received queue's holder lease cannot be held: {e}"
            ))))
        })?;
        let custody = Arc::new(Custody::from_parts(Arc::clone(ring.block()), ctx, crx));
        Ok(Self {
            returns: crate::shm::Returns::with_custody(Arc::clone(&custody) as _),
            custody,
            ring,
            tx,
            rx,
            pending: Mutex::new(None),
            closed: AtomicBool::new(false),
            holder: PeerLease::new(holder),
            others_seen_at: AtomicU64::new(0),
            others_seen_left: AtomicU32::new(0),
            #[cfg(feature = "async")]
            holder_watch: std::sync::OnceLock::new(),
        })
    }
}

/// A received queue or pipe end must be a unix seqpacket socket; anything else would
/// make every later get fail in confusing ways.
pub(crate) fn check_seqpacket(fd: &OwnedFd) -> std::result::Result<(), String> {
    crate::sys::socket::is_seqpacket(fd.as_fd())
        .map_err(|e| {
            format!(
                "a handle received as a queue or pipe end is not a socket ({e}): did the \
                 sender send another type?"
            )
        })?
        .then_some(())
        .ok_or_else(|| {
            "a handle received as a queue or pipe end is a socket of another type, not \
             SEQPACKET"
                .to_string()
        })
}
