//! [`JoinableQueue`]'s taking and inspecting operations. The type, its `put`s (which
//! count an unfinished task) and its `task_done`/`join` live with [`Queue`](super::Queue) in
//! `bounded`, whose shared block holds the unfinished-task count; the operations here
//! are a [`Queue`](super::Queue)'s own, forwarded to the queue inside (a `JoinableQueue` is not a
//! `Queue`, so it does not deref to one: a plain `put` through one would skip the
//! count).

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::bounded::{JoinableQueue, QueueIter, QueueTryIter};
use crate::error::Result;

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

    /// Takes the next item if one is waiting: `Ok(None)` when none is.
    ///
    /// # Errors
    /// As [`Queue::try_get`](super::Queue::try_get).
    pub fn try_get(&self) -> Result<Option<T>> {
        self.queue.try_get()
    }

    /// Python's name for [`try_get`](Self::try_get).
    ///
    /// # Errors
    /// As [`Queue::try_get`](super::Queue::try_get).
    pub fn get_nowait(&self) -> Result<Option<T>> {
        self.queue.get_nowait()
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

    /// The number of items put and not yet taken: [`qsize`](Self::qsize).
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no item is waiting right now: [`empty`](Self::empty).
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The most items the queue holds (`None` for an unbounded queue).
    pub fn capacity(&self) -> Option<usize> {
        self.queue.capacity()
    }

    /// The number of items put and not yet taken, as [`Queue::qsize`](super::Queue::qsize). Not the number
    /// of unfinished tasks: an item taken but not yet marked done is not counted here.
    pub fn qsize(&self) -> usize {
        self.queue.qsize()
    }

    /// Whether no item is waiting right now, as [`Queue::empty`](super::Queue::empty).
    pub fn empty(&self) -> bool {
        self.queue.empty()
    }

    /// Whether the queue holds its capacity (never for an unbounded queue).
    pub fn full(&self) -> bool {
        self.queue.full()
    }

    /// Closes this process's handles, as [`Queue::close`](super::Queue::close).
    pub fn close(&self) {
        self.queue.close()
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
        assert!(q.empty() && q.is_empty());
        assert_eq!(q.capacity(), Some(2));
        q.put(1u32).unwrap();
        q.put(2u32).unwrap();
        assert!(q.full());
        assert_eq!((q.qsize(), q.len()), (2, 2));
        assert_eq!(q.get_timeout(Duration::from_secs(30)).unwrap(), 1);
        assert_eq!(q.try_get().unwrap(), Some(2));
        assert_eq!(q.get_nowait().unwrap(), None);
        assert_eq!(q.qsize(), 0);
        // Both items were taken but neither is done: the join still waits.
        assert!(q.join(Some(Duration::ZERO)).unwrap_err().is_timeout());
        q.task_done().unwrap();
        q.task_done().unwrap();
        q.join(Some(Duration::ZERO)).unwrap();
        q.close();
        assert!(q.get().is_err());
    }
}
