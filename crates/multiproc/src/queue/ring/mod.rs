//! The shared-memory ring under every queue's channel: a message that carries no fds
//! goes from `put` to `get` through it without a system call and without a lock; the
//! socket is the *lane* for what the ring cannot take (a message with fds, one larger
//! than a slot, any message while the ring is full) and for packets that did not come
//! through a `put` (forged ones, which a getter still receives and reports).
//!
//! **Layout.** One [`SharedWords`] (kind `RNG4`) whose byte area is `SLOTS` slots: each
//! a 64-bit state word, a 32-bit length and the record (a whole packet: wire header and
//! inline payload, at most [`RECORD_MAX`] bytes). Words of the page: `HEAD` and `TAIL`
//! (64-bit positions), `SEQ` (bumped by every publication; sleeping getters wait on
//! it), `GET_WAITERS`, `LANE` (64 bits: a generation and a flag). Every offset is in
//! `queue::layout`, the block's one map (the custody and a queue's counters have words
//! in it too). The slots follow the lock-free protocol of [`slots`]: nobody ever waits for
//! another participant, so one stopped or killed anywhere costs the others at most one
//! [`REVOKE_AFTER`] (a writer stopped mid-record is revoked and writes again when it
//! resumes) and never a message.
//!
//! **Order.** Each producer's messages come out in the order it put them, whichever
//! way each went, by one rule: *while the lane's flag is set, every message goes on
//! the socket; a getter takes from the socket only when the ring is empty, and clears
//! the flag only when the socket is empty too.* A producer sets the flag (bumping the
//! generation) before its packet goes on the socket and again after, so a getter's
//! clearing — a compare-and-swap against the generation it read before it looked at
//! the ring and the socket — fails if any packet may have gone on meanwhile. So a
//! producer's later messages reach the ring only once its earlier socket packets were
//! taken. A getter that finds a record still being written at the head waits for it
//! (or revokes it) rather than look at the socket, since a later record of another
//! producer may be behind it.
//!
//! **Crashes and forgery.** A process killed at any point leaves a ring that the others
//! go on using (see [`slots`]; a killed writer costs one slot of capacity until the
//! ring block is dropped). Every process holding the queue can write the ring, so
//! lengths are checked, records are copied out (never borrowed) and decoded as any
//! packet; a forged record is an [`Error::InvalidMessage`] for the getter that met it.
//!
//! **Waking.** A getter that finds nothing spins on `SEQ` for a short adaptive while
//! ([`futex::spin_until`]) and then sleeps on it; a putter wakes one sleeper, and only
//! when `GET_WAITERS` says there is one: a hand-over to a spinning getter costs no
//! system call on either side. A sleeping getter also looks at the socket every
//! [`SOCKET_RECHECK`], because a packet that did not come through a `put` wakes nobody.
//! A channel value that is dropped wakes every sleeper ([`Ring::holder_left`], which
//! also bumps `LEFT`), so a getter left alone hears of it (an awaited get at once, see
//! `sys::reactor`).
//!
//! **Tries.** [`Ring::try_recv`] never waits and, when nothing is there, makes no
//! system call: it reads the ring, and looks at the socket only when the lane's flag
//! says a producer used it, or (thorough tries, see [`TryLook`]) when told to — and
//! always once more, socket included, before it declares the end. A record being
//! written at the head is nothing ready *now*; each channel value remembers since
//! when its head has been busy, and the first try after [`REVOKE_AFTER`] of that
//! revokes the writer, so a consumer that only ever tries gets past a producer
//! stopped for good.

pub(crate) mod slots;

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use self::slots::{Popped, Pushed, SlotMemory};
use super::layout::{
    GET_WAITERS, HEAD, LANE, LEFT, LENGTH_AT, RECORD_AT, SEQ, SLOT_BYTES, SLOTS, TAIL,
};
use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::sys::futex;
use crate::sys::socket::{Attempt, Packet};
use crate::sys::{Deadline, Readiness, wait_fd};
use crate::wire::{self, Decoder, Encoder};

/// The kind word of a ring's block (the fuzzer's seeds recognise rings by it).
pub(crate) const KIND: u32 = 0x524e_4734; // "RNG4": `HEAD` moved (see `layout`)
/// The largest packet that travels through the ring (a tensor's message is 30 to 60
/// bytes); a larger one goes on the lane.
const RECORD_MAX: usize = SLOT_BYTES - RECORD_AT;

/// How long a sleeping getter waits before it looks at the socket again.
pub(crate) const SOCKET_RECHECK: Duration = Duration::from_millis(20);
/// How long a getter waits for a record being written at the head before it revokes
/// the writer (which writes it again when it runs: a writer that is merely slow loses
/// nothing but its place).
const REVOKE_AFTER: Duration = Duration::from_micros(500);

/// The ring of one channel (see the module docs).
pub(crate) struct Ring {
    block: Arc<SharedWords>,
    /// The position a try last found being written at the head, and since when (see
    /// [`Ring::try_recv`]); this process's own, shared by its handles of the channel.
    busy_head: Mutex<Option<(u64, Instant)>>,
}

/// How thoroughly [`Ring::try_recv`] looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TryLook {
    /// A `try_get`: no system call when nothing is there (the socket only when the
    /// lane is flagged, or before the end is declared); a busy head is revoked once it
    /// has stayed busy for [`REVOKE_AFTER`] across tries.
    Quick,
    /// An awaited get about to park: the socket too, for packets written on it without
    /// a `put`, which flag nothing; and a busy head is waited for (yielding) until
    /// [`REVOKE_AFTER`] and revoked, as a blocking get does: the future would otherwise
    /// park on a word a stopped writer never changes.
    Thorough,
    /// The last holder giving back what is queued: the socket too, and a busy head is
    /// revoked at once (no holder is left to write it).
    Last,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("head", &self.position(HEAD).load(Ordering::Relaxed))
            .field("tail", &self.position(TAIL).load(Ordering::Relaxed))
            .finish()
    }
}

impl SlotMemory for Ring {
    type Word = AtomicU64;

    fn slots(&self) -> usize {
        SLOTS
    }

    fn head(&self) -> &AtomicU64 {
        self.position(HEAD)
    }

    fn tail(&self) -> &AtomicU64 {
        self.position(TAIL)
    }

    fn state(&self, slot: usize) -> &AtomicU64 {
        // A slot below SLOTS starts inside the area at a multiple of 8.
        self.block
            .area_word64(slot * SLOT_BYTES)
            .expect("a ring slot's state word lies inside the ring's area")
    }

    fn write(&self, slot: usize, parts: &[&[u8]]) {
        let at = slot * SLOT_BYTES;
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.block
            .write_bytes(at + LENGTH_AT, &(len as u32).to_le_bytes());
        let mut offset = at + RECORD_AT;
        for part in parts {
            self.block.write_bytes(offset, part);
            offset += part.len();
        }
    }

    fn read(&self, slot: usize) -> Option<Vec<u8>> {
        let at = slot * SLOT_BYTES;
        let mut len = [0u8; 4];
        self.block.read_bytes(at + LENGTH_AT, &mut len);
        let len = u32::from_le_bytes(len) as usize;
        if len > RECORD_MAX {
            return None;
        }
        // The thread's spare packet buffer, which the decode gives back.
        let mut bytes = crate::wire::packet_buffer(len);
        bytes.resize(len, 0);
        self.block.read_bytes(at + RECORD_AT, &mut bytes);
        Some(bytes)
    }
}

/// What one look at the ring and the lane found.
enum Look {
    Packet(Packet),
    /// Nothing anywhere.
    Nothing,
    /// A record is being written at this position of the ring.
    Busy(u64),
}

impl Ring {
    /// A new, empty ring.
    pub(crate) fn new() -> Result<Self> {
        Ok(Self::from_block(SharedWords::with_bytes(
            KIND,
            SLOTS * SLOT_BYTES,
        )?))
    }

    fn from_block(block: SharedWords) -> Self {
        Self {
            block: Arc::new(block),
            busy_head: Mutex::new(None),
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

    /// Sets the lane's flag with a new generation (see the module docs).
    fn flag_lane(&self) {
        let lane = self.position(LANE);
        let _ = lane.fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
            Some(((l >> 1) + 1) << 1 | 1)
        });
    }

    /// Wakes a sleeping getter, if there is one, after a publication.
    fn published(&self) {
        self.word(SEQ).fetch_add(1, Ordering::SeqCst);
        if self.word(GET_WAITERS).load(Ordering::SeqCst) > 0 {
            futex::wake(self.word(SEQ), 1);
        }
    }

    /// Wakes every sleeping getter (a holder of the channel is leaving: a getter left
    /// alone asks again whether anything can still arrive, see `channel`).
    pub(crate) fn holder_left(&self) {
        self.word(LEFT).fetch_add(1, Ordering::SeqCst);
        self.word(SEQ).fetch_add(1, Ordering::SeqCst);
        if self.word(GET_WAITERS).load(Ordering::SeqCst) > 0 {
            futex::wake_all(self.word(SEQ));
        }
    }

    /// The word a getter sleeps on (`SEQ`, which every publication and every holder
    /// that leaves bumps) and the count of sleepers a publication wakes only when it is
    /// above 0 (`GET_WAITERS`): what `connection::wait` sleeps on, counted in like a
    /// sleeping get.
    pub(crate) fn get_words(&self) -> (&AtomicU32, &AtomicU32) {
        (self.word(SEQ), self.word(GET_WAITERS))
    }

    /// How many channel values have been dropped, anywhere: a sighting of other holders
    /// made before this changed may be out of date (see `channel`).
    pub(crate) fn departures(&self) -> u32 {
        self.word(LEFT).load(Ordering::SeqCst)
    }

    /// What an awaited get parks on (feature `async`): `SEQ` as it is now, read before
    /// the get's try, counted in `GET_WAITERS` like a sleeping getter. Not re-checked:
    /// the caller asks for that after its try when it needs it (a message kept back,
    /// see `Channel::needs_recheck`).
    #[cfg(feature = "async")]
    pub(crate) fn get_wait(&self) -> crate::sys::reactor::WordWait {
        crate::sys::reactor::WordWait {
            expected: self.word(SEQ).load(Ordering::SeqCst),
            host: Arc::clone(&self.block) as _,
            index: SEQ,
            counted_in: Some(GET_WAITERS),
            recheck: false,
            wake_by: None,
        }
    }

    /// Sends `msg` (through the ring, or on the lane: see the module docs), waiting for
    /// room on the socket until the deadline; [`Error::Timeout`] when none came.
    pub(crate) fn send(
        &self,
        msg: &mut wire::Encoded,
        tx: BorrowedFd<'_>,
        deadline: Deadline,
    ) -> Result<()> {
        self.send_pausing(msg, tx, deadline, || {})
    }

    /// [`send`](Self::send), running `pause` once its record's slot is claimed and
    /// before the record is written (the tests' stopped-writer cases; `send` passes a
    /// closure that does nothing).
    pub(crate) fn send_pausing(
        &self,
        msg: &mut wire::Encoded,
        tx: BorrowedFd<'_>,
        deadline: Deadline,
        pause: impl FnOnce(),
    ) -> Result<()> {
        if self.position(LANE).load(Ordering::Acquire) & 1 == 0 {
            let plain = msg
                .as_plain_bytes()
                .filter(|(h, p)| h.len() + p.len() <= RECORD_MAX);
            if let Some((header, payload)) = plain {
                let mut pause = Some(pause);
                let go_on = || {
                    if let Some(pause) = pause.take() {
                        pause();
                    }
                    true
                };
                if slots::push(self, &[header, payload], go_on) == Pushed::Done {
                    msg.mark_sent();
                    self.published();
                    return Ok(());
                }
            }
        }
        self.flag_lane();
        let sent = loop {
            match msg.try_send(tx) {
                Ok(Attempt::Done(())) => break Ok(()),
                Ok(Attempt::WouldBlock) => {
                    if let Err(e) = wait_for_room(tx, deadline) {
                        break Err(e);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        // Again after the packet is on: a getter that cleared the flag in between
        // (having found the socket empty just before) must not leave it cleared.
        self.flag_lane();
        self.published();
        sent
    }

    /// One look for the oldest message: the ring, then (when the lane is flagged, or
    /// `look_at_socket` says so) the socket. `revoke`: see [`slots::pop`].
    /// `go_on`: see [`slots::pop`].
    fn look(
        &self,
        rx: BorrowedFd<'_>,
        look_at_socket: bool,
        revoke: Option<u64>,
        go_on: &mut dyn FnMut() -> bool,
    ) -> Result<Look> {
        loop {
            // Read before the ring is looked at: a packet put on the lane after this
            // changes the generation (see the module docs).
            let lane = self.position(LANE).load(Ordering::Acquire);
            match slots::pop(self, revoke, &mut *go_on) {
                Popped::Record(bytes) => {
                    return Ok(Look::Packet(Packet {
                        bytes,
                        fds: Vec::new(),
                    }));
                }
                Popped::Forged => {
                    return Err(Error::InvalidMessage(
                        "a queue's shared ring held a record of impossible length: it was \
                         dropped; something other than multiproc wrote into the queue's memory"
                            .into(),
                    ));
                }
                Popped::Busy(pos) => return Ok(Look::Busy(pos)),
                Popped::Empty | Popped::Stopped => {}
            }
            if lane & 1 == 0 && !look_at_socket {
                return Ok(Look::Nothing);
            }
            if self.position(LANE).load(Ordering::Acquire) != lane {
                continue; // a producer used the lane meanwhile: the ring first again
            }
            if let Some(packet) = wire::try_recv_packet(rx)? {
                return Ok(Look::Packet(packet));
            }
            if lane & 1 == 1
                && self
                    .position(LANE)
                    .compare_exchange(
                        lane,
                        ((lane >> 1) + 1) << 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_err()
            {
                continue;
            }
            return Ok(Look::Nothing);
        }
    }

    /// Receives the oldest message, waiting until the deadline; `Ok(None)` when none
    /// came. `disconnected()` says whether no other holder of the channel is left; it is
    /// asked when the first look, or the first after a sleep, finds nothing, and the
    /// answer is [`Error::Disconnected`] only when a look at the ring and the socket
    /// *after* it finds nothing too (as in [`try_recv`](Self::try_recv)).
    pub(crate) fn recv(
        &self,
        rx: BorrowedFd<'_>,
        deadline: Deadline,
        disconnected: &dyn Fn() -> bool,
    ) -> Result<Option<Packet>> {
        self.recv_pausing(rx, deadline, disconnected, || {})
    }

    /// [`recv`](Self::recv), running `pause` once, the first time a record has been
    /// copied out of the ring and before it is taken (the tests' stopped-reader cases;
    /// `recv` passes a closure that does nothing).
    pub(crate) fn recv_pausing(
        &self,
        rx: BorrowedFd<'_>,
        deadline: Deadline,
        disconnected: &dyn Fn() -> bool,
        pause: impl FnOnce(),
    ) -> Result<Option<Packet>> {
        let mut pause = Some(pause);
        let mut go_on = || {
            if let Some(pause) = pause.take() {
                pause();
            }
            true
        };
        // The socket is looked at only after a sleep that ended without a publication
        // (see `look`): a packet that did not come through a `put` waits at most one
        // SOCKET_RECHECK.
        let mut look_at_socket = false;
        let mut ask = true;
        let mut busy: Option<(u64, Instant)> = None;
        let mut revoke = None;
        loop {
            let seen = self.word(SEQ).load(Ordering::SeqCst);
            let mut until = None;
            // A message waiting is taken without asking who else holds the queue (the
            // ask reads the clock and, now and then, asks the kernel).
            let mut found = self.look(rx, look_at_socket, revoke.take(), &mut go_on)?;
            if ask && matches!(found, Look::Nothing) && disconnected() {
                // Looked at again, ring and socket, after the answer: a holder that put
                // and then left is gone before its messages are looked for, so they
                // are found.
                match self.look(rx, true, None, &mut go_on)? {
                    Look::Nothing => return Err(disconnected_error()),
                    other => found = other,
                }
            }
            match found {
                Look::Packet(packet) => return Ok(Some(packet)),
                Look::Nothing => busy = None,
                Look::Busy(pos) => {
                    let since = match busy {
                        Some((p, since)) if p == pos => since,
                        _ => Instant::now(),
                    };
                    busy = Some((pos, since));
                    if since.elapsed() >= REVOKE_AFTER {
                        revoke = Some(pos);
                        continue;
                    }
                    until = Some(since + REVOKE_AFTER);
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            look_at_socket = false;
            ask = false;
            let seq = self.word(SEQ);
            let spin_deadline = match (deadline, until) {
                (Some(d), Some(u)) => Some(d.min(u)),
                (d, None) => d,
                (None, u) => u,
            };
            if futex::spin_until(spin_deadline, || seq.load(Ordering::Acquire) != seen) {
                continue;
            }
            if until.is_some() {
                continue; // time to revoke, or the deadline: the next round tells
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

    /// Receives the oldest message if one is there now, without waiting;
    /// [`Error::Disconnected`] when there is none and no other holder is left (as in
    /// [`recv`](Self::recv)). `how`: see [`TryLook`] and the module docs.
    ///
    /// `disconnected()` is asked only when a look found nothing ready (nothing, or a
    /// record being written at the head: with no other holder left its writer is dead,
    /// and it is passed at once), and the end is declared only after a later look, at
    /// the ring and the socket, that follows the answer: a holder that put and then left
    /// is gone before its messages are looked for, so they are found.
    pub(crate) fn try_recv(
        &self,
        rx: BorrowedFd<'_>,
        disconnected: &dyn Fn() -> bool,
        how: TryLook,
    ) -> Result<Option<Packet>> {
        let mut revoke = None;
        let mut alone = false;
        // Each round returns, or revokes a busy head (which moves the head on), or
        // learns that no other holder is left (once): a try ends within a few rounds
        // unless a last holder passes many dead writers, and a forged ring that keeps
        // one busy costs a bounded number.
        for _ in 0..64 {
            let at_socket = alone || how != TryLook::Quick;
            match self.look(rx, at_socket, revoke.take(), &mut || true)? {
                Look::Packet(packet) => return Ok(Some(packet)),
                Look::Busy(pos) => {
                    if how == TryLook::Last || self.busy_for_long(pos) {
                        revoke = Some(pos);
                        continue;
                    }
                    if how == TryLook::Thorough {
                        self.wait_out_busy(pos);
                        revoke = Some(pos);
                        continue;
                    }
                    // With no other holder left, its writer is dead (a stopped one
                    // still holds the queue): pass it now, and the end can be told.
                    if !alone && disconnected() {
                        alone = true;
                        revoke = Some(pos);
                        continue;
                    }
                    return Ok(None);
                }
                Look::Nothing if alone => return Err(disconnected_error()),
                Look::Nothing => {
                    if !disconnected() {
                        return Ok(None);
                    }
                    alone = true;
                }
            }
        }
        Ok(None)
    }

    /// Yields until the head has been busy at `pos` for [`REVOKE_AFTER`] (or is not
    /// busy there any more).
    fn wait_out_busy(&self, pos: u64) {
        while !self.busy_for_long(pos) {
            if !slots::is_writing(self, pos) {
                return;
            }
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }

    /// Whether the head has been busy at `pos` for [`REVOKE_AFTER`], as this process's
    /// tries saw it; a head busy at another position starts the count again.
    fn busy_for_long(&self, pos: u64) -> bool {
        let mut busy = self
            .busy_head
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match *busy {
            Some((p, since)) if p == pos => since.elapsed() >= REVOKE_AFTER,
            _ => {
                *busy = Some((pos, Instant::now()));
                false
            }
        }
    }

    /// Whether the ring holds a message right now (the socket is the caller's to ask).
    pub(crate) fn holds_messages(&self) -> bool {
        slots::holds_records(self)
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
        SharedWords::open_received(
            &dec.about("a queue's ring"),
            index,
            KIND,
            SLOTS * SLOT_BYTES,
        )
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

    fn lane_flagged(ring: &Ring) -> bool {
        ring.position(LANE).load(Ordering::Acquire) & 1 == 1
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn order_holds_across_the_ring_and_the_lane() {
        let ring = Ring::new().unwrap();
        let (tx, rx) = seqpacket_pair().unwrap();
        let event = crate::Event::new().unwrap();
        // More plain items than the ring holds (the rest go on the lane), with every
        // 100th carrying an fd (the lane, whatever room the ring has).
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
        assert!(lane_flagged(&ring), "the test meant to use the lane");
        for i in 0..n {
            let packet = ring.recv(rx.as_fd(), None, &|| false).unwrap().unwrap();
            match wire::decode::<Item>(packet, &crate::shm::Returns::plain()).unwrap() {
                Item::Plain(j) => assert_eq!((j, i % 100 != 0), (i, true)),
                Item::WithFd(j, _) => assert_eq!((j, i % 100), (i, 0)),
            }
        }
        assert!(
            ring.try_recv(rx.as_fd(), &|| false, TryLook::Quick)
                .unwrap()
                .is_none()
        );
        assert!(!lane_flagged(&ring), "an empty queue clears the lane");
        // With the lane clear, the ring is used again.
        let mut msg = wire::encode(&Item::Plain(7)).unwrap();
        ring.send(&mut msg, tx.as_fd(), None).unwrap();
        assert!(ring.holds_messages());
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn a_forged_ring_is_an_error_then_usable_again() {
        let ring = Ring::new().unwrap();
        let (tx, rx) = seqpacket_pair().unwrap();
        let forgeries: [fn(&Ring); 3] = [
            // A producers' position far past anything claimed.
            |r| {
                let head = r.position(HEAD).load(Ordering::Acquire);
                r.position(TAIL).store(head + (1 << 40), Ordering::Release);
            },
            // A published record of impossible length.
            |r| {
                let head = r.position(HEAD).load(Ordering::Acquire);
                let slot = (head % SLOTS as u64) as usize;
                r.block
                    .write_bytes(slot * SLOT_BYTES + LENGTH_AT, &u32::MAX.to_le_bytes());
                r.state(slot)
                    .store((head / SLOTS as u64) << 2 | 2, Ordering::Release);
                r.position(TAIL).store(head + 1, Ordering::Release);
            },
            // A consumers' position far past the producers'.
            |r| {
                let tail = r.position(TAIL).load(Ordering::Acquire);
                r.position(HEAD).store(tail + (1 << 40), Ordering::Release);
            },
        ];
        for forge in forgeries {
            forge(&ring);
            let Err(err) = ring.recv(rx.as_fd(), None, &|| false) else {
                panic!("a forged ring gave a packet");
            };
            assert!(
                matches!(&err, Error::InvalidMessage(m) if m.contains("queue's memory")),
                "{err}"
            );
            for v in 0..3u8 {
                let mut msg = wire::encode(&v).unwrap();
                ring.send(&mut msg, tx.as_fd(), None).unwrap();
            }
            for v in 0..3u8 {
                let got: u8 = wire::decode(
                    ring.recv(rx.as_fd(), None, &|| false).unwrap().unwrap(),
                    &crate::shm::Returns::plain(),
                )
                .unwrap();
                assert_eq!(got, v);
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn a_writer_stopped_mid_record_is_revoked_and_loses_nothing() {
        let ring = Ring::new().unwrap();
        let (tx, rx) = seqpacket_pair().unwrap();
        // A producer that claimed the next slot and stopped there (what a SIGSTOP
        // between its claim and its publication leaves).
        let stalled = std::cell::Cell::new(None);
        let first = wire::encode(&1u8).unwrap();
        let (h, p) = first.as_plain_bytes().unwrap();
        assert_eq!(
            slots::push(&ring, &[h, p], || {
                stalled.set(Some(ring.position(TAIL).load(Ordering::Acquire) - 1));
                false
            }),
            Pushed::Stopped
        );
        let mut second = wire::encode(&2u8).unwrap();
        ring.send(&mut second, tx.as_fd(), None).unwrap();
        // The getter revokes the stalled record and gets the later one.
        let got: u8 = wire::decode(
            ring.recv(
                rx.as_fd(),
                Some(Instant::now() + Duration::from_secs(5)),
                &|| false,
            )
            .unwrap()
            .expect("the record behind a stalled writer"),
            &crate::shm::Returns::plain(),
        )
        .unwrap();
        assert_eq!(got, 2);
        // The stalled writer, resumed, finds its slot revoked and writes again.
        let pos = stalled.get().unwrap();
        let slot = (pos % SLOTS as u64) as usize;
        let word = ring.state(slot);
        assert_eq!(word.load(Ordering::Acquire) & 3, 3, "revoked");
        assert!(!slots::SlotWord::swap_if(
            word,
            (pos / SLOTS as u64) << 2 | 1,
            (pos / SLOTS as u64) << 2 | 2
        ));
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and sockets")]
    fn a_try_passes_a_stalled_writer_after_a_while_or_at_once_when_alone() {
        let ring = Ring::new().unwrap();
        let (tx, rx) = seqpacket_pair().unwrap();
        let stall = |ring: &Ring| {
            let record = wire::encode(&0u8).unwrap();
            let (h, p) = record.as_plain_bytes().unwrap();
            assert_eq!(slots::push(ring, &[h, p], || false), Pushed::Stopped);
        };
        let put = |ring: &Ring, v: u8| {
            let mut msg = wire::encode(&v).unwrap();
            ring.send(&mut msg, tx.as_fd(), None).unwrap();
        };
        let value =
            |packet: Packet| -> u8 { wire::decode(packet, &crate::shm::Returns::plain()).unwrap() };
        stall(&ring);
        put(&ring, 1);
        // Other holders left: nothing ready now, until the claim has been seen for
        // REVOKE_AFTER; then a try passes it (tries only, no blocking get).
        let others = &|| false;
        assert!(
            ring.try_recv(rx.as_fd(), others, TryLook::Quick)
                .unwrap()
                .is_none()
        );
        let got = loop {
            if let Some(packet) = ring.try_recv(rx.as_fd(), others, TryLook::Quick).unwrap() {
                break value(packet);
            }
            std::thread::yield_now();
        };
        assert_eq!(got, 1);
        // No other holder left: the writer is dead, passed at once, and then the end.
        stall(&ring);
        put(&ring, 2);
        let alone = &|| true;
        let packet = ring.try_recv(rx.as_fd(), alone, TryLook::Quick).unwrap();
        assert_eq!(packet.map(value), Some(2));
        let end = ring.try_recv(rx.as_fd(), alone, TryLook::Quick);
        assert!(matches!(end, Err(Error::Disconnected(_))), "{end:?}");
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
                wire::decode::<String>(packet, &crate::shm::Returns::plain()).unwrap()
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
