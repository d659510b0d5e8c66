//! [`Queue`]: the public face of a channel with counters, its iterators, and the
//! counters themselves ([`Shared`], below). [`JoinableQueue`](super::JoinableQueue) is
//! in `joinable`.
//!
//! # Counters
//!
//! What [`Queue`] and [`JoinableQueue`](super::JoinableQueue) share: a channel plus
//! counters in the block of its ring (where: `layout`, which also says which cache line
//! each is on and why).
//!
//! Words (their offsets in `layout`): `FREE_PLACES` — free places left (a semaphore; only when bounded),
//! `ITEMS` — messages put and not yet taken, of an unbounded queue (approximate: `len`;
//! a bounded queue's `len` is its places not free, so that a put and a get each write
//! one count the other side writes too, not two), `UNFINISHED` — items
//! put and not yet marked done (for `JoinableQueue::join`), `CAPACITY` (0 = unbounded),
//! `PLACE_DEBT` — places given back for packets that turned out not to have taken one.
//!
//! Capacity is exact under hostile input: a `put` marks its packet as counted (a header
//! flag, see `wire`), and a getter gives a place back only for a packet with a
//! well-formed, counted header. A forged packet that carries the flag but does not
//! decode had its place given back before decoding (see below); the getter then takes
//! that place again — a free one at once, or, when none is free, as a debt that the
//! next place given back pays instead of freeing it.
//!
//! A `put` on a full queue and a `get` on an empty one spin for a few tens of
//! microseconds (`futex::spin_until`, `MULTIPROC_SPIN_US`) before they sleep: a producer
//! and a consumer handing items over through a short queue would otherwise pay a sleep,
//! a wake-up and two context switches for nearly every item.
//!
//! A process killed between taking a slot and sending (or between receiving and giving
//! the slot back) costs the queue one place of capacity, never a message or a hang of
//! others beyond their own deadlines. The getter gives the place back right after it
//! took the message off the ring (or the socket), before decoding. For a message in
//! the ring the window is the few instructions between moving the ring's head and
//! giving the place back; for one on the socket it is the `recvmsg` itself (the kernel
//! has dequeued the packet and the process dies on the way back to user space). The
//! soak (`cargo test -p multiproc --test faults_queue -- --ignored soak`, the `slots_lost`
//! count of `scenario_consumer_mid_get`) loses about one place per 100 kills of a busy
//! consumer. The loss is bounded and reported: a later `put`
//! waits for room and a `put_timeout` says it timed out. (Closing the ring's window
//! would mean giving the place back in the same compare-and-swap as the take, which the
//! ring's slot protocol does not couple to the count.)

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::channel::{Channel, Flavor, OthersHere, busy_custody_with_time_left, lookup_patience};
use super::layout::{CAPACITY, FREE_PLACES, ITEMS, PLACE_DEBT, PLACE_WAITERS, UNFINISHED};
use crate::error::{Error, PutError, Result};
use crate::shm::SharedWords;
use crate::sync::counter::FutexCount;
use crate::sys::futex;
use crate::sys::socket::Packet;
use crate::sys::{Deadline, deadline_after};
use crate::wire;

/// A multi-producer, multi-consumer queue between processes, like
/// `torch.multiprocessing.Queue`: optionally bounded, with timeouts and an approximate
/// size.
///
/// Every [`Tensor`](crate::Tensor) inside an item travels as a handle to its shared
/// memory (a tensor not yet shared is moved to shared memory when put). Putting and
/// getting on the same queue in one process works. `Clone` gives another handle; pass
/// the queue to other processes as a worker argument or through another queue.
///
/// # Examples
///
/// ```
/// let q = multiproc::Queue::with_capacity(2)?;
/// q.put(vec![1u8, 2, 3])?;
/// assert_eq!(q.get()?, vec![1, 2, 3]);
/// # Ok::<(), multiproc::Error>(())
/// ```
pub struct Queue<T> {
    pub(super) shared: Arc<Shared>,
    _items: PhantomData<fn(T) -> T>,
}

impl<T> Clone for Queue<T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            _items: PhantomData,
        }
    }
}

impl<T: Serialize + DeserializeOwned> Queue<T> {
    /// An unbounded queue: `put` waits only when the queue's ring and the kernel's
    /// socket buffer behind it are both full.
    ///
    /// # Errors
    /// When the socket pair or the shared counters cannot be made (fd or memory limits).
    pub fn new() -> Result<Self> {
        Self::build(None)
    }

    /// A queue holding at most `capacity` items: `put` waits for room.
    ///
    /// # Errors
    /// As [`new`](Self::new), and [`Error::InvalidArgument`] for a capacity of 0.
    pub fn with_capacity(capacity: usize) -> Result<Self> {
        Self::build(Some(capacity))
    }

    fn build(capacity: Option<usize>) -> Result<Self> {
        Self::build_as(capacity, Flavor::Queue)
    }

    /// A queue of `capacity` whose channel says it was made by a `flavor` (a
    /// `JoinableQueue` is a `Queue` inside).
    pub(super) fn build_as(capacity: Option<usize>, flavor: Flavor) -> Result<Self> {
        let shared = Shared::new(capacity)?;
        shared.channel.set_flavor(flavor);
        Ok(Self {
            shared: Arc::new(shared),
            _items: PhantomData,
        })
    }

    /// Puts `item`, waiting for room as long as it takes.
    ///
    /// # Errors
    /// When the item cannot be encoded or sent; the item comes back in the error.
    pub fn put(&self, item: T) -> Result<(), PutError<T>> {
        self.shared.put(item, Wait::Forever, false)
    }

    /// Puts `item`, waiting for room at most `timeout`.
    ///
    /// # Errors
    /// As [`put`](Self::put); [`Error::Timeout`] when no room came in time. The item
    /// comes back in the error.
    pub fn put_timeout(&self, item: T, timeout: Duration) -> Result<(), PutError<T>> {
        self.shared.put(item, Wait::For(timeout), false)
    }

    /// Puts `item` if there is room right now, without waiting.
    ///
    /// # Errors
    /// [`Error::Full`] when the queue holds its capacity (or the socket buffer is
    /// full); otherwise as [`put`](Self::put). The item comes back in the error.
    ///
    /// # Examples
    ///
    /// ```
    /// let q = multiproc::Queue::with_capacity(1)?;
    /// q.try_put(1u8)?;
    /// let full = q.try_put(2).unwrap_err();
    /// assert!(matches!(full.error, multiproc::Error::Full(_)));
    /// assert_eq!(full.into_inner(), 2);
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    #[doc(alias = "put_nowait")]
    pub fn try_put(&self, item: T) -> Result<(), PutError<T>> {
        self.shared.put(item, Wait::Never, false)
    }

    /// Takes the next item, waiting as long as it takes.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a malformed message (the queue stays usable),
    /// [`Error::Closed`] after [`close`](Self::close), [`Error::Disconnected`] when the
    /// queue is empty and no other handle of it is left anywhere — in another process,
    /// in another thread of this one, or inside a message in flight — so nothing can
    /// arrive (within 100 ms of the last other handle's end; items already queued come
    /// first).
    pub fn get(&self) -> Result<T> {
        self.shared
            .get(None, &|| self.others_here())?
            .ok_or_else(|| Error::timeout("a get on a queue without deadline", None))
    }

    /// Takes the next item, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no item came in time; otherwise as [`get`](Self::get).
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        // An item already there is taken without reading the clock for a deadline.
        if let Some(item) = self.try_get()? {
            return Ok(item);
        }
        self.shared
            .get(deadline_after(Some(timeout)), &|| self.others_here())?
            .ok_or_else(|| Error::timeout("a get on an empty queue", Some(timeout)))
    }

    /// Takes the next item if one is waiting: `Ok(None)` when none is (not a timeout:
    /// nothing waited). It never waits, and when nothing is there it makes no system
    /// call (see [`SimpleQueue::try_get`](crate::SimpleQueue::try_get)).
    ///
    /// # Errors
    /// As [`get`](Self::get).
    #[doc(alias = "get_nowait")]
    pub fn try_get(&self) -> Result<Option<T>> {
        self.shared.try_get(&|| self.others_here())
    }

    /// Runs `f` while this process holds the lock of one shelf of the queue's block
    /// custody (the tests' stopped-holder cases).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn while_custody_locked<R>(&self, shelf: usize, f: impl FnOnce() -> R) -> Result<R> {
        self.shared.channel.while_custody_locked(shelf, f)
    }

    /// Whether another handle of this queue (or of the joinable queue around it) exists
    /// in this process.
    pub(super) fn others_here(&self) -> bool {
        Arc::strong_count(&self.shared) > 1
    }

    /// A blocking iterator over the items: each `next` waits for one, as
    /// [`get`](Self::get) does. It ends when this handle is [closed](Self::close) or the
    /// queue is disconnected (empty, with no other handle left); any other error is
    /// yielded (the queue stays usable after a malformed message).
    ///
    /// # Examples
    ///
    /// ```
    /// let q = multiproc::Queue::new()?;
    /// for i in 0..3u32 {
    ///     q.put(i)?;
    /// }
    /// let got: Vec<u32> = q.iter().take(3).collect::<multiproc::Result<_>>()?;
    /// assert_eq!(got, [0, 1, 2]);
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn iter(&self) -> QueueIter<'_, T> {
        QueueIter { queue: self }
    }

    /// A non-blocking iterator over the items waiting right now, as
    /// [`try_get`](Self::try_get) finds them; it ends at the first empty look.
    pub fn try_iter(&self) -> QueueTryIter<'_, T> {
        QueueTryIter { queue: self }
    }

    /// The number of items put and not yet taken, across all processes. Approximate:
    /// others may put or get at the same moment.
    #[doc(alias = "qsize")]
    pub fn len(&self) -> usize {
        self.shared.items()
    }

    /// Whether no item is waiting right now: `len() == 0` (approximate, like
    /// [`len`](Self::len): others may put or get at the same moment).
    #[doc(alias = "empty")]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most items the queue holds (`None` for an unbounded queue).
    pub fn capacity(&self) -> Option<usize> {
        match self.shared.block.word(CAPACITY).load(Ordering::Acquire) {
            0 => None,
            c => Some(c as usize),
        }
    }

    /// Whether the queue holds its capacity (never for an unbounded queue).
    #[doc(alias = "full")]
    pub fn is_full(&self) -> bool {
        self.shared.bounded() && self.shared.block.word(FREE_PLACES).load(Ordering::Acquire) == 0
    }

    /// Closes this process's handles: later puts and gets through them fail with
    /// [`Error::Closed`]. Items already put stay on the queue for other processes.
    pub fn close(&self) {
        self.shared.channel.close();
    }
}

/// The blocking iterator of [`Queue::iter`].
#[derive(Debug)]
pub struct QueueIter<'a, T> {
    queue: &'a Queue<T>,
}

impl<T: Serialize + DeserializeOwned> Iterator for QueueIter<'_, T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        match self.queue.get() {
            Err(Error::Closed(_) | Error::Disconnected(_)) => None,
            other => Some(other),
        }
    }
}

/// The non-blocking iterator of [`Queue::try_iter`].
#[derive(Debug)]
pub struct QueueTryIter<'a, T> {
    queue: &'a Queue<T>,
}

impl<T: Serialize + DeserializeOwned> Iterator for QueueTryIter<'_, T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        match self.queue.try_get() {
            Ok(None) | Err(Error::Closed(_) | Error::Disconnected(_)) => None,
            Ok(Some(item)) => Some(Ok(item)),
            Err(e) => Some(Err(e)),
        }
    }
}

impl<'a, T: Serialize + DeserializeOwned> IntoIterator for &'a Queue<T> {
    type Item = Result<T>;
    type IntoIter = QueueIter<'a, T>;

    fn into_iter(self) -> QueueIter<'a, T> {
        self.iter()
    }
}

impl<T> fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("len", &self.shared.items())
            .field(
                "capacity",
                &self.shared.block.word(CAPACITY).load(Ordering::Relaxed),
            )
            .finish()
    }
}

impl<T> Serialize for Queue<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.shared.serialize(s)
    }
}

impl<T> Queue<T> {
    /// A received queue, which must have been made as a `flavor`.
    pub(super) fn deserialize_as<'de, D: Deserializer<'de>>(
        d: D,
        flavor: Flavor,
    ) -> std::result::Result<Self, D::Error> {
        let shared = Shared::deserialize(d)?;
        shared.channel.check_flavor(flavor)?;
        Ok(Self {
            shared: Arc::new(shared),
            _items: PhantomData,
        })
    }
}

impl<'de, T> Deserialize<'de> for Queue<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Self::deserialize_as(d, Flavor::Queue)
    }
}

// The counters (see the module docs).

/// What [`Queue`] and [`JoinableQueue`] share.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) channel: Channel,
    /// The channel's ring block, where the counters live.
    pub(super) block: Arc<SharedWords>,
    /// Whether the queue has a capacity, read once: `CAPACITY` never changes, and its
    /// line is the one the putters and getters keep writing.
    bounded: bool,
}

impl Shared {
    pub(super) fn new(capacity: Option<usize>) -> Result<Self> {
        let capacity = match capacity {
            None => 0,
            Some(0) => {
                return Err(Error::InvalidArgument(
                    "a queue's capacity must be at least 1 (use Queue::new for an unbounded queue)"
                        .into(),
                ));
            }
            Some(c) => u32::try_from(c).map_err(|_| {
                Error::InvalidArgument(format!("a queue's capacity must be below 2^32, got {c}"))
            })?,
        };
        let channel = Channel::new()?;
        let block = Arc::clone(channel.block());
        block.word(CAPACITY).store(capacity, Ordering::Release);
        block.word(FREE_PLACES).store(capacity, Ordering::Release);
        Ok(Self {
            channel,
            block,
            bounded: capacity != 0,
        })
    }

    pub(super) fn bounded(&self) -> bool {
        self.bounded
    }

    /// Messages put and not yet taken (approximate: see the module docs). A bounded
    /// queue's are its places not free (less the places owed): its putters and getters
    /// then write one shared count per message, not two.
    pub(super) fn items(&self) -> usize {
        if !self.bounded {
            return self.block.word(ITEMS).load(Ordering::Acquire) as usize;
        }
        let capacity = self.block.word(CAPACITY).load(Ordering::Acquire);
        let free = self.block.word(FREE_PLACES).load(Ordering::Acquire);
        let owed = self.block.word(PLACE_DEBT).load(Ordering::Acquire);
        capacity.saturating_sub(free.saturating_sub(owed)) as usize
    }

    /// Takes one free place, waiting until the deadline. `Ok(false)` on timeout.
    pub(super) fn acquire_slot(&self, deadline: Deadline) -> Result<bool> {
        self.slots().take(deadline)
    }

    /// The free places: a futex counter shared with every holder of the queue.
    fn slots(&self) -> FutexCount<'_> {
        FutexCount::new(self.block.word(FREE_PLACES), self.block.word(PLACE_WAITERS))
    }

    pub(super) fn release_slot(&self) {
        // A place owed (given back for a forged packet) is paid before one is freed.
        // (Read first: a debt is rare, and the read finds the line here.)
        let debt = self.block.word(PLACE_DEBT);
        if debt.load(Ordering::Acquire) > 0 && saturating_dec(debt) > 0 {
            return;
        }
        self.slots().give(None);
    }

    pub(super) fn put<T: Serialize>(
        &self,
        item: T,
        wait: Wait,
        joinable: bool,
    ) -> Result<(), PutError<T>> {
        let _span = tracing::trace_span!("multiproc::put", queue = "Queue", ?wait).entered();
        let deadline = wait.deadline();
        // Encode before taking a place, so that the place is held only across the send:
        // a putter killed while encoding (which may make shared segments) leaks none.
        let mut encoded = match self.channel.encode(&item) {
            Ok(e) => e,
            Err(error) => return Err(PutError { error, item }),
        };
        encoded.mark_counted();
        if self.bounded() {
            match self.acquire_slot(deadline) {
                Ok(true) => {}
                Ok(false) => {
                    let capacity = self.block.word(CAPACITY).load(Ordering::Relaxed);
                    let error = wait.no_room(&format!("a full queue (capacity {capacity})"));
                    return Err(PutError { error, item });
                }
                Err(error) => return Err(PutError { error, item }),
            }
        }
        if joinable {
            self.block.word(UNFINISHED).fetch_add(1, Ordering::AcqRel);
        }
        if !self.bounded() {
            self.block.word(ITEMS).fetch_add(1, Ordering::AcqRel);
        }
        match self.channel.send(&mut encoded, deadline) {
            Ok(()) => Ok(()),
            Err(error) => {
                let error = match error {
                    Error::Timeout { .. } => wait.no_room("a queue whose socket buffer is full"),
                    other => other,
                };
                if !self.bounded() {
                    saturating_dec(self.block.word(ITEMS));
                }
                if joinable {
                    self.task_done_unchecked();
                }
                if self.bounded() {
                    self.release_slot();
                }
                Err(PutError { error, item })
            }
        }
    }

    /// Frees the place of a packet taken off the socket. Called as soon as the packet
    /// is off the socket, before decoding it, so that a getter killed while decoding
    /// (mapping segments, registering names) leaks no place. A SIGKILL that lands
    /// while `recvmsg` itself runs (the packet is dequeued, the process dies on the way
    /// back from the kernel) still loses one place (how often: the module docs), as in
    /// Python's `multiprocessing.Queue`, whose getter frees
    /// its semaphore after receiving. A later `put` then waits for room (and a
    /// `put_timeout` says it timed out); nothing hangs without a deadline the caller
    /// chose.
    ///
    /// Only a packet whose header says a `put` counted it gives anything back (see the
    /// module docs); the result says what was given back, for [`untake`](Self::untake).
    pub(super) fn taken(&self, got: &Result<Option<Packet>>) -> Taken {
        let counted = match got {
            Ok(Some(packet)) => wire::is_counted(packet),
            // No room for its fds: the packet stays queued for the next get, with its
            // place. (Only if another thread took the room between the check and the
            // receive is it lost, and its place with it.)
            _ => false,
        };
        if !counted {
            return Taken::default();
        }
        if self.bounded() {
            self.release_slot();
            return Taken {
                item: false,
                slot: true,
            };
        }
        let item = saturating_dec(self.block.word(ITEMS)) > 0;
        Taken { item, slot: false }
    }

    /// Takes back what [`taken`](Self::taken) gave for a packet that then failed to
    /// decode as a message (forged: a real `put` never sends one).
    pub(super) fn untake(&self, taken: Taken) {
        if taken.item {
            self.block.word(ITEMS).fetch_add(1, Ordering::AcqRel);
        }
        if taken.slot && !self.slots().try_take() {
            self.block.word(PLACE_DEBT).fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Decodes a taken packet, taking back its place if it turns out to be forged.
    /// `patience`: how long a lookup in the custody may wait (see `Channel::decode`).
    pub(super) fn finish_get<T: DeserializeOwned>(
        &self,
        packet: Result<Option<Packet>>,
        taken: Taken,
        patience: Duration,
    ) -> Result<Option<T>> {
        let Some(packet) = packet? else {
            return Ok(None);
        };
        let value = self.channel.decode(packet, patience);
        if let Err(Error::InvalidMessage(_)) = &value {
            self.untake(taken);
        }
        value.map(Some)
    }

    pub(super) fn get<T: DeserializeOwned>(
        &self,
        deadline: Deadline,
        others_here: OthersHere<'_>,
    ) -> Result<Option<T>> {
        let _span = tracing::trace_span!("multiproc::get", queue = "Queue").entered();
        loop {
            // (The channel spins briefly for an item before it sleeps.)
            let packet = self.channel.recv(deadline, others_here);
            let taken = self.taken(&packet);
            match self.finish_get(packet, taken, lookup_patience(deadline)) {
                // Kept as this process's next message (uncounted): try again.
                Err(e) if busy_custody_with_time_left(&e, deadline) => continue,
                other => return other,
            }
        }
    }

    pub(super) fn try_get<T: DeserializeOwned>(
        &self,
        others_here: OthersHere<'_>,
    ) -> Result<Option<T>> {
        self.try_get_as(others_here, false)
    }

    /// [`try_get`](Self::try_get), or a thorough try (see `Channel::try_get_as`).
    pub(super) fn try_get_as<T: DeserializeOwned>(
        &self,
        others_here: OthersHere<'_>,
        thorough: bool,
    ) -> Result<Option<T>> {
        let packet = self.channel.try_recv_as(others_here, thorough);
        let taken = self.taken(&packet);
        match self.finish_get(packet, taken, wire::TRY_PATIENCE) {
            // Kept for the next get: nothing is ready now.
            Err(Error::Timeout { .. }) => Ok(None),
            other => other,
        }
    }

    pub(super) fn task_done_unchecked(&self) {
        let unfinished = self.block.word(UNFINISHED);
        if saturating_dec(unfinished) == 1 {
            futex::wake_all(unfinished);
        }
    }
}

/// How long a put may wait for room.
#[derive(Debug, Clone, Copy)]
pub(super) enum Wait {
    /// As long as it takes (`put`).
    Forever,
    /// At most this long (`put_timeout`): then [`Error::Timeout`].
    For(Duration),
    /// Not at all (`try_put`): then [`Error::Full`].
    Never,
}

impl Wait {
    pub(super) fn deadline(self) -> Deadline {
        match self {
            Wait::Forever => None,
            Wait::For(t) => deadline_after(Some(t)),
            Wait::Never => Some(std::time::Instant::now()),
        }
    }

    /// The error for a put that found no room in `what` by its deadline.
    pub(super) fn no_room(self, what: &str) -> Error {
        match self {
            Wait::Never => Error::Full(format!(
                "no room in {what}; get some items, or use put/put_timeout to wait for room"
            )),
            Wait::For(t) => Error::timeout(format!("a put on {what}"), Some(t)),
            Wait::Forever => Error::timeout(format!("a put on {what}"), None),
        }
    }
}

/// What a getter gave back for a taken packet.
#[derive(Clone, Copy, Default)]
pub(super) struct Taken {
    /// It counted the packet off `ITEMS`.
    item: bool,
    /// It gave back a place.
    slot: bool,
}

/// Decrements without going below zero; returns the previous value.
pub(super) fn saturating_dec(word: &AtomicU32) -> u32 {
    crate::shm::update_word(word, |v| v.checked_sub(1)).unwrap_or(0)
}

impl Serialize for Shared {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.channel.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Shared {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let channel = Channel::deserialize(d)?;
        let block = Arc::clone(channel.block());
        let bounded = block.word(CAPACITY).load(Ordering::Acquire) != 0;
        Ok(Self {
            channel,
            block,
            bounded,
        })
    }
}
