//! [`Queue`] and [`JoinableQueue`]: a [`Channel`] plus counters in the block of its
//! ring (words 32 and up, which the ring and the custody leave free).
//!
//! Words: `SLOTS` — free places left (a semaphore; only when bounded),
//! `ITEMS` — messages put and not yet taken (approximate `qsize`), `UNFINISHED` — items
//! put and not yet marked done (for `JoinableQueue::join`), `CAPACITY` (0 = unbounded),
//! `SLOT_DEBT` — places given back for packets that turned out not to have taken one.
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
//! the ring the take is a user-space step under the ring lock, so a getter killed at
//! any instant either left the message in the ring or holds it with its place given
//! back (the soak in `tests/faults.rs` loses no place any more). For a message on the
//! socket the old window stays: a SIGKILL while `recvmsg` itself runs (the kernel has
//! dequeued the packet and the process dies on the way back to user space) loses that
//! place, bounded and reported: a later `put` waits for room and a `put_timeout` says
//! it timed out.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::channel::Channel;
use crate::error::{Error, PutError, Result};
use crate::sync::block::SharedBlock;
use crate::sync::futex;
use crate::sys::socket::Packet;
use crate::sys::{Deadline, deadline_after};
use crate::wire;

const SLOTS: usize = 33;
const ITEMS: usize = 34;
const UNFINISHED: usize = 35;
const CAPACITY: usize = 36;
const SLOT_WAITERS: usize = 37;
const SLOT_DEBT: usize = 38;

/// What [`Queue`] and [`JoinableQueue`] share.
#[derive(Debug)]
struct Shared {
    channel: Channel,
    /// The channel's ring block, where the counters live.
    block: Arc<SharedBlock>,
}

impl Shared {
    fn new(capacity: Option<usize>) -> Result<Self> {
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
        block.word(SLOTS).store(capacity, Ordering::Release);
        Ok(Self { channel, block })
    }

    fn bounded(&self) -> bool {
        self.block.word(CAPACITY).load(Ordering::Relaxed) != 0
    }

    /// Takes one free place, waiting until the deadline. `Ok(false)` on timeout.
    fn acquire_slot(&self, deadline: Deadline) -> Result<bool> {
        let slots = self.block.word(SLOTS);
        let waiters = self.block.word(SLOT_WAITERS);
        loop {
            let free = slots.load(Ordering::Acquire);
            if free > 0 {
                if slots
                    .compare_exchange_weak(free, free - 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(true);
                }
                continue;
            }
            // Most waits end within microseconds (a consumer is taking an item right
            // now): spin briefly before paying for a futex sleep and wake.
            if futex::spin_until(deadline, || slots.load(Ordering::Acquire) > 0) {
                continue;
            }
            waiters.fetch_add(1, Ordering::AcqRel);
            let woke = futex::wait(slots, 0, deadline);
            waiters.fetch_sub(1, Ordering::AcqRel);
            if !woke? {
                return Ok(false);
            }
        }
    }

    fn release_slot(&self) {
        // A place owed (given back for a forged packet) is paid before one is freed.
        if saturating_dec(self.block.word(SLOT_DEBT)) > 0 {
            return;
        }
        let slots = self.block.word(SLOTS);
        slots.fetch_add(1, Ordering::AcqRel);
        if self.block.word(SLOT_WAITERS).load(Ordering::Acquire) > 0 {
            futex::wake(slots, 1);
        }
    }

    fn put<T: Serialize>(&self, item: T, wait: Wait, joinable: bool) -> Result<(), PutError<T>> {
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
        self.block.word(ITEMS).fetch_add(1, Ordering::AcqRel);
        match self.channel.send(&mut encoded, deadline) {
            Ok(()) => Ok(()),
            Err(error) => {
                let error = match error {
                    Error::Timeout { .. } => wait.no_room("a queue whose socket buffer is full"),
                    other => other,
                };
                saturating_dec(self.block.word(ITEMS));
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
    /// back from the kernel) still loses one place — about 2 kills in 100 in
    /// `tests/faults.rs` — as in Python's `multiprocessing.Queue`, whose getter frees
    /// its semaphore after receiving. A later `put` then waits for room (and a
    /// `put_timeout` says it timed out); nothing hangs without a deadline the caller
    /// chose.
    ///
    /// Only a packet whose header says a `put` counted it gives anything back (see the
    /// module docs); the result says what was given back, for [`untake`](Self::untake).
    fn taken(&self, got: &Result<Option<Packet>>) -> Taken {
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
        let item = saturating_dec(self.block.word(ITEMS)) > 0;
        let slot = self.bounded();
        if slot {
            self.release_slot();
        }
        Taken { item, slot }
    }

    /// Takes back what [`taken`](Self::taken) gave for a packet that then failed to
    /// decode as a message (forged: a real `put` never sends one).
    fn untake(&self, taken: Taken) {
        if taken.item {
            self.block.word(ITEMS).fetch_add(1, Ordering::AcqRel);
        }
        if taken.slot {
            let slots = self.block.word(SLOTS);
            let took = slots
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1))
                .is_ok();
            if !took {
                self.block.word(SLOT_DEBT).fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// Decodes a taken packet, taking back its place if it turns out to be forged.
    fn finish_get<T: DeserializeOwned>(
        &self,
        packet: Result<Option<Packet>>,
        taken: Taken,
    ) -> Result<Option<T>> {
        let Some(packet) = packet? else {
            return Ok(None);
        };
        let value = self.channel.decode(packet);
        if let Err(Error::InvalidMessage(_)) = &value {
            self.untake(taken);
        }
        value.map(Some)
    }

    fn get<T: DeserializeOwned>(&self, deadline: Deadline) -> Result<Option<T>> {
        let _span = tracing::trace_span!("multiproc::get", queue = "Queue").entered();
        // (The channel spins briefly for an item before it sleeps.)
        let packet = self.channel.recv(deadline);
        let taken = self.taken(&packet);
        self.finish_get(packet, taken)
    }

    fn try_get<T: DeserializeOwned>(&self) -> Result<Option<T>> {
        let packet = self.channel.try_recv();
        let taken = self.taken(&packet);
        self.finish_get(packet, taken)
    }

    fn task_done_unchecked(&self) {
        let unfinished = self.block.word(UNFINISHED);
        if saturating_dec(unfinished) == 1 {
            futex::wake_all(unfinished);
        }
    }
}

/// How long a put may wait for room.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// As long as it takes (`put`).
    Forever,
    /// At most this long (`put_timeout`): then [`Error::Timeout`].
    For(Duration),
    /// Not at all (`try_put`): then [`Error::Full`].
    Never,
}

impl Wait {
    fn deadline(self) -> Deadline {
        match self {
            Wait::Forever => None,
            Wait::For(t) => deadline_after(Some(t)),
            Wait::Never => Some(std::time::Instant::now()),
        }
    }

    /// The error for a put that found no room in `what` by its deadline.
    fn no_room(self, what: &str) -> Error {
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
struct Taken {
    /// It counted the packet off `ITEMS`.
    item: bool,
    /// It gave back a place.
    slot: bool,
}

/// Decrements without going below zero; returns the previous value.
fn saturating_dec(word: &AtomicU32) -> u32 {
    word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1))
        .unwrap_or(0)
}

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
/// q.put(vec![1u8, 2, 3]).map_err(multiproc::Error::from)?;
/// assert_eq!(q.get()?, vec![1, 2, 3]);
/// # Ok::<(), multiproc::Error>(())
/// ```
pub struct Queue<T> {
    shared: Arc<Shared>,
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
        Ok(Self {
            shared: Arc::new(Shared::new(capacity)?),
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
    /// q.try_put(1u8).map_err(multiproc::Error::from)?;
    /// let full = q.try_put(2).unwrap_err();
    /// assert!(matches!(full.error, multiproc::Error::Full(_)));
    /// assert_eq!(full.into_inner(), 2);
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn try_put(&self, item: T) -> Result<(), PutError<T>> {
        self.shared.put(item, Wait::Never, false)
    }

    /// Python's name for [`try_put`](Self::try_put).
    ///
    /// # Errors
    /// As [`try_put`](Self::try_put).
    pub fn put_nowait(&self, item: T) -> Result<(), PutError<T>> {
        self.try_put(item)
    }

    /// Takes the next item, waiting as long as it takes.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a malformed message (the queue stays usable),
    /// [`Error::Closed`] after [`close`](Self::close).
    pub fn get(&self) -> Result<T> {
        self.shared
            .get(None)?
            .ok_or_else(|| Error::timeout("a get on a queue without deadline", None))
    }

    /// Takes the next item, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no item came in time; otherwise as [`get`](Self::get).
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        self.shared
            .get(deadline_after(Some(timeout)))?
            .ok_or_else(|| Error::timeout("a get on an empty queue", Some(timeout)))
    }

    /// Takes the next item if one is waiting: `Ok(None)` when none is (not a timeout:
    /// nothing waited).
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub fn try_get(&self) -> Result<Option<T>> {
        self.shared.try_get()
    }

    /// Python's name for [`try_get`](Self::try_get).
    ///
    /// # Errors
    /// As [`try_get`](Self::try_get).
    pub fn get_nowait(&self) -> Result<Option<T>> {
        self.try_get()
    }

    /// A blocking iterator over the items: each `next` waits for one, as
    /// [`get`](Self::get) does. It ends when this handle is [closed](Self::close); any
    /// other error is yielded (the queue stays usable after a malformed message).
    ///
    /// # Examples
    ///
    /// ```
    /// let q = multiproc::Queue::new()?;
    /// for i in 0..3u32 {
    ///     q.put(i).map_err(multiproc::Error::from)?;
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

    /// The number of items put and not yet taken: [`qsize`](Self::qsize).
    pub fn len(&self) -> usize {
        self.qsize()
    }

    /// Whether no item is waiting right now: [`empty`](Self::empty).
    pub fn is_empty(&self) -> bool {
        self.empty()
    }

    /// The most items the queue holds (`None` for an unbounded queue).
    pub fn capacity(&self) -> Option<usize> {
        match self.shared.block.word(CAPACITY).load(Ordering::Acquire) {
            0 => None,
            c => Some(c as usize),
        }
    }

    /// The number of items put and not yet taken, across all processes. Approximate:
    /// others may put or get at the same moment.
    pub fn qsize(&self) -> usize {
        self.shared.block.word(ITEMS).load(Ordering::Acquire) as usize
    }

    /// Whether no item is waiting right now (approximate, like [`qsize`](Self::qsize)).
    pub fn empty(&self) -> bool {
        !self.shared.channel.has_waiting()
    }

    /// Whether the queue holds its capacity (never for an unbounded queue).
    pub fn full(&self) -> bool {
        self.shared.bounded() && self.shared.block.word(SLOTS).load(Ordering::Acquire) == 0
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
            Err(Error::Closed(_)) => None,
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
            Ok(None) | Err(Error::Closed(_)) => None,
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
            .field(
                "qsize",
                &self.shared.block.word(ITEMS).load(Ordering::Relaxed),
            )
            .field(
                "capacity",
                &self.shared.block.word(CAPACITY).load(Ordering::Relaxed),
            )
            .finish()
    }
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
        Ok(Self { channel, block })
    }
}

impl<T> Serialize for Queue<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.shared.serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for Queue<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(Self {
            shared: Arc::new(Shared::deserialize(d)?),
            _items: PhantomData,
        })
    }
}

/// A [`Queue`] that also counts unfinished tasks, like `multiprocessing.JoinableQueue`:
/// every `put` adds one, every [`task_done`](Self::task_done) takes one away, and
/// [`join`](Self::join) waits until none is left.
pub struct JoinableQueue<T> {
    /// The queue the forwarded operations (`get`, `qsize`, `close`, ...: `joinable`)
    /// act on.
    pub(super) queue: Queue<T>,
}

impl<T> Clone for JoinableQueue<T> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
        }
    }
}

impl<T: Serialize + DeserializeOwned> JoinableQueue<T> {
    /// An unbounded joinable queue.
    ///
    /// # Errors
    /// As [`Queue::new`].
    pub fn new() -> Result<Self> {
        Ok(Self {
            queue: Queue::new()?,
        })
    }

    /// A joinable queue holding at most `capacity` items.
    ///
    /// # Errors
    /// As [`Queue::with_capacity`].
    pub fn with_capacity(capacity: usize) -> Result<Self> {
        Ok(Self {
            queue: Queue::with_capacity(capacity)?,
        })
    }

    /// Puts `item` and counts it as an unfinished task.
    ///
    /// # Errors
    /// As [`Queue::put`].
    pub fn put(&self, item: T) -> Result<(), PutError<T>> {
        self.queue.shared.put(item, Wait::Forever, true)
    }

    /// Puts `item` waiting at most `timeout` for room.
    ///
    /// # Errors
    /// As [`Queue::put_timeout`].
    pub fn put_timeout(&self, item: T, timeout: Duration) -> Result<(), PutError<T>> {
        self.queue.shared.put(item, Wait::For(timeout), true)
    }

    /// Puts `item` if there is room right now, counting it as an unfinished task.
    ///
    /// # Errors
    /// As [`Queue::try_put`].
    pub fn try_put(&self, item: T) -> Result<(), PutError<T>> {
        self.queue.shared.put(item, Wait::Never, true)
    }

    /// Python's name for [`try_put`](Self::try_put).
    ///
    /// # Errors
    /// As [`Queue::try_put`].
    pub fn put_nowait(&self, item: T) -> Result<(), PutError<T>> {
        self.try_put(item)
    }

    /// Marks one task taken from the queue as done.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when called more times than items were put.
    pub fn task_done(&self) -> Result<()> {
        let unfinished = self.queue.shared.block.word(UNFINISHED);
        match unfinished.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1)) {
            Ok(1) => {
                futex::wake_all(unfinished);
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(_) => Err(Error::InvalidArgument(
                "task_done() called more times than items were put on the JoinableQueue".into(),
            )),
        }
    }

    /// Waits until every item put has been marked done, at most `timeout` (`None`:
    /// forever).
    ///
    /// # Errors
    /// [`Error::Timeout`] (with the number of tasks left) when the timeout passed first.
    pub fn join(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = deadline_after(timeout);
        let unfinished = self.queue.shared.block.word(UNFINISHED);
        loop {
            let left = unfinished.load(Ordering::Acquire);
            if left == 0 {
                return Ok(());
            }
            if !futex::wait(unfinished, left, deadline)? {
                return match unfinished.load(Ordering::Acquire) {
                    0 => Ok(()),
                    left => Err(Error::timeout(
                        format!("a join on a JoinableQueue with {left} unfinished tasks"),
                        timeout,
                    )),
                };
            }
        }
    }
}

impl<T> fmt::Debug for JoinableQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinableQueue")
            .field("queue", &self.queue)
            .field(
                "unfinished",
                &self
                    .queue
                    .shared
                    .block
                    .word(UNFINISHED)
                    .load(Ordering::Relaxed),
            )
            .finish()
    }
}

impl<T> Serialize for JoinableQueue<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.queue.serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for JoinableQueue<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(Self {
            queue: Queue::deserialize(d)?,
        })
    }
}
