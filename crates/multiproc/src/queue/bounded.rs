//! [`Queue`]: the public face of a channel with counters (see `counted`), and its
//! iterators. [`JoinableQueue`](super::JoinableQueue) is in `joinable`.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::counted::{Shared, Wait};
use super::layout::{CAPACITY, FREE_PLACES, ITEMS};
use crate::error::{Error, PutError, Result};
use crate::sys::deadline_after;

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
        self.shared.block.word(ITEMS).load(Ordering::Acquire) as usize
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
            .field(
                "len",
                &self.shared.block.word(ITEMS).load(Ordering::Relaxed),
            )
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

impl<'de, T> Deserialize<'de> for Queue<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(Self {
            shared: Arc::new(Shared::deserialize(d)?),
            _items: PhantomData,
        })
    }
}
