//! [`SimpleQueue`]: the smallest multi-process queue.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::channel::{Channel, Flavor};
use crate::error::{Error, PutError, Result};
use crate::sys::deadline_after;

/// An unbounded multi-producer, multi-consumer queue between processes, like
/// `multiprocessing.SimpleQueue`.
///
/// Any number of processes may put and get: each message goes whole to exactly one
/// getter. Every [`Tensor`](crate::Tensor) inside a message travels as a handle to its
/// shared memory. `Clone` gives another handle in this process; to use the queue in
/// another process, pass it as a worker argument or through another queue.
///
/// `put` returns once the message is in the queue's shared ring (or, with fds, in the
/// kernel's socket buffer): the putter may exit at once and nothing is lost. When both
/// are full (a few thousand small messages, or fewer large ones), `put` waits for a
/// getter.
pub struct SimpleQueue<T> {
    pub(super) channel: Arc<Channel>,
    _items: PhantomData<fn(T) -> T>,
}

impl<T> Clone for SimpleQueue<T> {
    fn clone(&self) -> Self {
        Self {
            channel: Arc::clone(&self.channel),
            _items: PhantomData,
        }
    }
}

impl<T: Serialize + DeserializeOwned> SimpleQueue<T> {
    /// A new, empty queue.
    ///
    /// # Errors
    /// When the socket pair cannot be made (usually the fd limit).
    pub fn new() -> Result<Self> {
        let channel = Channel::new()?;
        channel.set_flavor(Flavor::Simple);
        Ok(Self {
            channel: Arc::new(channel),
            _items: PhantomData,
        })
    }

    /// Puts `item` on the queue.
    ///
    /// # Errors
    /// When it cannot be encoded or sent; the item comes back in the error.
    pub fn put(&self, item: T) -> Result<(), PutError<T>> {
        self.channel.put(item, None)
    }

    /// Takes the next item, waiting for one.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a malformed message (the queue stays usable),
    /// [`Error::Closed`] after [`close`](Self::close), [`Error::Disconnected`] when the
    /// queue is empty and no other handle of it is left anywhere (nothing can arrive).
    pub fn get(&self) -> Result<T> {
        self.channel
            .get(None, &|| self.others_here())?
            .ok_or_else(|| Error::timeout("a get on a SimpleQueue without deadline", None))
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
        self.channel
            .get(deadline_after(Some(timeout)), &|| self.others_here())?
            .ok_or_else(|| Error::timeout("a get on an empty SimpleQueue", Some(timeout)))
    }

    /// Takes the next item if one is waiting: `Ok(None)` when none is (not a timeout:
    /// nothing waited).
    ///
    /// It never waits (no sleep, no spin, no yield) and, when nothing is there, makes
    /// no system call: it reads the queue's shared ring, and looks at the socket behind
    /// it only when the ring says a producer used it. A record another producer has
    /// claimed and not yet written (it may be stopped) is "nothing ready now"; once the
    /// head has stayed so for half a millisecond, counted across calls, the next try
    /// passes it, so a caller that only ever tries still gets the later items. Whether
    /// any other holder is left (for [`Error::Disconnected`]; with none left, a claimed
    /// record's writer is dead and is passed at once) is asked only when nothing is
    /// ready, and answered without the kernel while another handle lives in this
    /// process, or from the last sighting of other holders when that is under 10 ms old
    /// and no handle was dropped since; otherwise it costs one system call.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    #[doc(alias = "get_nowait")]
    pub fn try_get(&self) -> Result<Option<T>> {
        self.channel.try_get(&|| self.others_here())
    }

    /// [`put`](Self::put), running `pause` while the item's slot in the queue's ring is
    /// claimed and not yet written (the tests' stopped-writer cases).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn put_pausing_in_ring(&self, item: &T, pause: impl FnOnce()) -> Result<()> {
        self.channel.put_pausing_in_ring(item, pause)
    }

    /// [`get`](Self::get), running `pause` once a record has been copied out of the
    /// queue's ring and before it is taken (the tests' stopped-reader cases).
    #[cfg(feature = "fuzzing")]
    pub(crate) fn get_pausing_in_ring(&self, pause: impl FnOnce()) -> Result<T> {
        self.channel
            .get_pausing_in_ring(&|| self.others_here(), pause)
    }

    /// Whether another handle of this queue exists in this process.
    pub(super) fn others_here(&self) -> bool {
        Arc::strong_count(&self.channel) > 1
    }

    /// Whether no item is waiting right now (another process may put or get at once).
    #[doc(alias = "empty")]
    pub fn is_empty(&self) -> bool {
        !self.channel.has_waiting()
    }

    /// Closes this process's handles: later puts and gets through any clone of this
    /// handle fail with [`Error::Closed`]. Other processes are not affected.
    pub fn close(&self) {
        self.channel.close();
    }
}

impl<T> fmt::Debug for SimpleQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimpleQueue").finish_non_exhaustive()
    }
}

impl<T> Serialize for SimpleQueue<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.channel.serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for SimpleQueue<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let channel = Channel::deserialize(d)?;
        channel.check_flavor(Flavor::Simple)?;
        Ok(Self {
            channel: Arc::new(channel),
            _items: PhantomData,
        })
    }
}
