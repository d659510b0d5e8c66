//! [`JoinableQueue`]: a [`Queue`](super::Queue) that also counts unfinished tasks. Its
//! `put`s count a task, `task_done`/`join` use the count in the channel's block (see
//! `bounded`'s counters); its taking and inspecting operations are a `Queue`'s own, forwarded to
//! the queue inside (a `JoinableQueue` is not a `Queue`, so it does not deref to one:
//! a plain `put` through one would skip the count).

use std::fmt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::bounded::Wait;
use super::bounded::{Queue, QueueIter, QueueTryIter};
use super::channel::Flavor;
use super::layout::UNFINISHED;
use crate::error::{Error, PutError, Result};
use crate::sys::deadline_after;
use crate::sys::futex;

impl<T: Serialize + DeserializeOwned> JoinableQueue<T> {
    /// Takes the next item, waiting as long as it takes. Mark it done with
    /// [`task_done`](Self::task_done) once it is handled.
    ///
    /// # Errors
    /// As [`Queue::get`](super::Queue::get).
    pub fn get(&self) -> Result<T> {
        self.queue.get()
    }

    /// Takes the next item, waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`Queue::get_timeout`](super::Queue::get_timeout).
    pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
        self.queue.get_timeout(timeout)
    }

    /// Takes the next item if one is waiting: `Ok(None)` when none is. It never waits,
    /// as [`Queue::try_get`](super::Queue::try_get).
    ///
    /// # Errors
    /// As [`Queue::try_get`](super::Queue::try_get).
    #[doc(alias = "get_nowait")]
    pub fn try_get(&self) -> Result<Option<T>> {
        self.queue.try_get()
    }

    /// A blocking iterator over the items, as [`Queue::iter`](super::Queue::iter).
    pub fn iter(&self) -> QueueIter<'_, T> {
        self.queue.iter()
    }

    /// A non-blocking iterator over the items waiting right now, as
    /// [`Queue::try_iter`](super::Queue::try_iter).
    pub fn try_iter(&self) -> QueueTryIter<'_, T> {
        self.queue.try_iter()
    }

    /// The number of items put and not yet taken, as [`Queue::len`](super::Queue::len).
    /// Not the number of unfinished tasks: an item taken but not yet marked done is not
    /// counted here.
    #[doc(alias = "qsize")]
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no item is waiting right now, as
    /// [`Queue::is_empty`](super::Queue::is_empty).
    #[doc(alias = "empty")]
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The most items the queue holds (`None` for an unbounded queue).
    pub fn capacity(&self) -> Option<usize> {
        self.queue.capacity()
    }

    /// Whether the queue holds its capacity (never for an unbounded queue).
    #[doc(alias = "full")]
    pub fn is_full(&self) -> bool {
        self.queue.is_full()
    }

    /// Closes this process's handles, as [`Queue::close`](super::Queue::close).
    pub fn close(&self) {
        self.queue.close()
    }
}

/// A [`Queue`] that also counts unfinished tasks, like `multiprocessing.JoinableQueue`:
/// every `put` adds one, every [`task_done`](Self::task_done) takes one away, and
/// [`join`](Self::join) waits until none is left.
pub struct JoinableQueue<T> {
    /// The queue the forwarded operations (`get`, `len`, `close`, ...: `joinable`)
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
            queue: Queue::build_as(None, Flavor::Joinable)?,
        })
    }

    /// A joinable queue holding at most `capacity` items.
    ///
    /// # Errors
    /// As [`Queue::with_capacity`].
    pub fn with_capacity(capacity: usize) -> Result<Self> {
        Ok(Self {
            queue: Queue::build_as(Some(capacity), Flavor::Joinable)?,
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
    #[doc(alias = "put_nowait")]
    pub fn try_put(&self, item: T) -> Result<(), PutError<T>> {
        self.queue.shared.put(item, Wait::Never, true)
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

    /// Waits until every item put has been marked done, as long as it takes.
    ///
    /// # Errors
    /// An [`Error::Os`] only when the kernel refuses the wait.
    pub fn join(&self) -> Result<()> {
        self.join_within(None)
    }

    /// Waits until every item put has been marked done, at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] (with the number of tasks left) when the timeout passed first.
    pub fn join_timeout(&self, timeout: Duration) -> Result<()> {
        self.join_within(Some(timeout))
    }

    fn join_within(&self, timeout: Option<Duration>) -> Result<()> {
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
            queue: Queue::deserialize_as(d, Flavor::Joinable)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The forwarded operations reach the queue inside, and `put`/`get`/`task_done`
    /// keep the two counts apart.
    #[test]
    fn forwarded_operations_see_the_same_queue() {
        let q = JoinableQueue::with_capacity(2).unwrap();
        let _producer = q.clone();
        assert!(q.is_empty() && q.is_empty());
        assert_eq!(q.capacity(), Some(2));
        q.put(1u32).unwrap();
        q.put(2u32).unwrap();
        assert!(q.is_full());
        assert_eq!((q.len(), q.len()), (2, 2));
        assert_eq!(q.get_timeout(Duration::from_secs(30)).unwrap(), 1);
        assert_eq!(q.try_get().unwrap(), Some(2));
        assert_eq!(q.try_get().unwrap(), None);
        assert_eq!(q.len(), 0);
        // Both items were taken but neither is done: the join still waits.
        assert!(q.join_timeout(Duration::ZERO).unwrap_err().is_timeout());
        q.task_done().unwrap();
        q.task_done().unwrap();
        q.join_timeout(Duration::ZERO).unwrap();
        q.close();
        assert!(q.get().is_err());
    }
}
