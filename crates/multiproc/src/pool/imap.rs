//! [`Imap`]: the lazy iterator of [`Pool::imap`] and [`Pool::imap_unordered`], which
//! keeps a window of tasks submitted ahead of what it has yielded.

use std::collections::BTreeMap;
use std::fmt::{self, Display};
use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::handle::Pool;
use super::outcomes::{ChunkOutcome, OutcomeReceiver};
use super::state::{dispatcher_gone, with_index};
use crate::error::{Error, Result};
use crate::wire::Opaque;

/// Pulls at most `room` items from the caller's iterator and queues them on `pool` as
/// tasks `first..` of `job`; returns how many it queued (0: the items are exhausted).
/// It holds the task function and the items, so [`Imap`] needs neither's type.
type Submit<'p> = Box<dyn FnMut(&Pool, u64, usize, usize) -> Result<usize> + Send + 'p>;

/// The iterator of [`Pool::imap`] and [`Pool::imap_unordered`]: yields `Result<R>` per
/// item (a failed task is an `Err` with its index; the others still come).
///
/// Only the result type shows: the task function and the argument iterator (which must
/// be `Send`) are held type-erased. An `Imap` is `Send`, and so is `next_async`'s
/// future (feature `async`): a task of a multi-thread runtime may await it.
pub struct Imap<'p, R> {
    pool: &'p Pool,
    submit: Submit<'p>,
    ordered: bool,
    job: Option<(u64, OutcomeReceiver)>,
    submitted: usize,
    yielded: usize,
    /// Results that arrived, by index, not yet yielded.
    ready: BTreeMap<usize, Result<Opaque>>,
    window: usize,
    failed: Option<Error>,
    _result: PhantomData<fn() -> R>,
}

impl<'p, R: DeserializeOwned> Imap<'p, R> {
    pub(super) fn new<A, E, I>(
        pool: &'p Pool,
        f: fn(A) -> std::result::Result<R, E>,
        mut items: I,
        ordered: bool,
        chunksize: usize,
    ) -> Self
    where
        A: Serialize + DeserializeOwned + 'p,
        R: Serialize + 'p,
        E: Display + 'p,
        I: Iterator<Item = A> + Send + 'p,
    {
        let chunksize = chunksize.max(1);
        let (job, failed) = match pool.new_job(None) {
            Ok(j) => (Some(j), None),
            Err(e) => (None, Some(e)),
        };
        let submit: Submit<'p> = Box::new(move |pool, job, first, room| {
            let batch: Vec<A> = items.by_ref().take(room).collect();
            let n = batch.len();
            if n > 0 {
                pool.enqueue(job, f, batch, first, chunksize)?;
            }
            Ok(n)
        });
        Self {
            pool,
            submit,
            ordered,
            job,
            submitted: 0,
            yielded: 0,
            ready: BTreeMap::new(),
            // A few chunks per worker ahead.
            window: pool.processes * 4 * chunksize,
            failed,
            _result: PhantomData,
        }
    }

    /// Keeps up to `window` tasks submitted ahead of what has been yielded.
    fn top_up(&mut self, job: u64) -> Result<()> {
        let room = self.window.saturating_sub(self.submitted - self.yielded);
        if room > 0 {
            self.submitted += (self.submit)(self.pool, job, self.submitted, room)?;
        }
        Ok(())
    }
}

impl<R: DeserializeOwned> Iterator for Imap<'_, R> {
    type Item = Result<R>;

    fn next(&mut self) -> Option<Result<R>> {
        if let Some(e) = self.failed.take() {
            return Some(Err(e));
        }
        let job = self.job.as_ref()?.0;
        if let Err(e) = self.top_up(job) {
            return Some(Err(e));
        }
        loop {
            if let Some(item) = self.take_next() {
                return item;
            }
            let rx = &self.job.as_ref()?.1;
            match rx.recv() {
                Ok(outcome) => self.take_in(outcome),
                Err(_) => return Some(Err(dispatcher_gone())),
            }
        }
    }
}

impl<R: DeserializeOwned> Imap<'_, R> {
    /// The next result, as [`Iterator::next`] gives it, without blocking a thread while
    /// it is on its way (feature `async`; any executor): `while let Some(r) =
    /// imap.next_async().await`. The dispatcher's hand-over wakes the task: no thread
    /// per wait, no timer.
    ///
    /// Cancel-safe: a future dropped before it completes has taken nothing; what
    /// arrived meanwhile is kept in the `Imap` for the next call. The future is `Send`.
    ///
    /// # Errors
    /// Per item, as [`Pool::imap`].
    #[cfg(feature = "async")]
    pub async fn next_async(&mut self) -> Option<Result<R>> {
        if let Some(e) = self.failed.take() {
            return Some(Err(e));
        }
        let job = self.job.as_ref()?.0;
        if let Err(e) = self.top_up(job) {
            return Some(Err(e));
        }
        loop {
            if let Some(item) = self.take_next() {
                return item;
            }
            // The outcome goes into `self` in the poll that received it (nothing is
            // awaited in between), so a dropped future holds none.
            let got = std::future::poll_fn(|cx| match &self.job {
                Some((_, rx)) => rx.poll_recv(cx),
                None => std::task::Poll::Ready(Err(std::sync::mpsc::RecvError)),
            })
            .await;
            match got {
                Ok(outcome) => self.take_in(outcome),
                Err(_) => return Some(Err(dispatcher_gone())),
            }
        }
    }

    /// Files a chunk's results by task index.
    fn take_in(&mut self, (first, results): ChunkOutcome) {
        for (k, r) in results.into_iter().enumerate() {
            self.ready.insert(first + k, r);
        }
    }

    /// What `next` returns when it need not wait: `Some(None)` when every submitted
    /// task was yielded (the items are exhausted, `top_up` having run), `Some(item)`
    /// when the next result (in order, or any when unordered) has arrived; `None` when
    /// it has to wait for an outcome.
    fn take_next(&mut self) -> Option<Option<Result<R>>> {
        if self.yielded == self.submitted {
            return Some(None);
        }
        let pick = if self.ordered {
            self.ready
                .contains_key(&self.yielded)
                .then_some(self.yielded)
        } else {
            self.ready.keys().next().copied()
        };
        if let Some(index) = pick {
            let r = self
                .ready
                .remove(&index)
                .unwrap_or_else(|| Err(dispatcher_gone()));
            self.yielded += 1;
            return Some(Some(
                r.and_then(|o| o.decode::<R>(&crate::shm::Returns::plain()))
                    .map_err(|e| with_index(e, index)),
            ));
        }
        None
    }
}

impl<R> Drop for Imap<'_, R> {
    fn drop(&mut self) {
        if let Some((job, _)) = &self.job {
            self.pool.end_job(*job);
        }
    }
}

impl<R> fmt::Debug for Imap<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imap")
            .field("ordered", &self.ordered)
            .field("submitted", &self.submitted)
            .field("yielded", &self.yielded)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Runs `f` on every item and yields the results in order, as they become
    /// available. Items are submitted as the iterator is consumed, a few per worker
    /// ahead.
    ///
    /// # Errors
    ///
    /// Not here, but per item: a task that panicked, returned `Err` or whose worker
    /// died yields [`Error::TaskFailed`] with its index (the others still come);
    /// [`Error::Closed`] (once) when the pool is closed or terminated.
    pub fn imap<'p, A, R, E, I>(
        &'p self,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
    ) -> Imap<'p, R>
    where
        A: Serialize + DeserializeOwned + 'p,
        R: Serialize + DeserializeOwned + 'p,
        E: Display + 'p,
        I: IntoIterator<Item = A>,
        I::IntoIter: Send + 'p,
    {
        Imap::new(self, f, items.into_iter(), true, 1)
    }

    /// [`imap`](Self::imap) with tasks sent to workers `chunksize` at a time (as
    /// [`map_chunked`](Self::map_chunked) does for `map`, and Python's
    /// `imap(func, iterable, chunksize)`): fewer round trips for many small tasks.
    /// Results still come one per item, in order; a few chunks per worker are
    /// submitted ahead. A `chunksize` of 0 counts as 1.
    ///
    /// # Errors
    ///
    /// Per item, as [`imap`](Self::imap).
    pub fn imap_chunked<'p, A, R, E, I>(
        &'p self,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
        chunksize: usize,
    ) -> Imap<'p, R>
    where
        A: Serialize + DeserializeOwned + 'p,
        R: Serialize + DeserializeOwned + 'p,
        E: Display + 'p,
        I: IntoIterator<Item = A>,
        I::IntoIter: Send + 'p,
    {
        Imap::new(self, f, items.into_iter(), true, chunksize)
    }

    /// As [`imap`](Self::imap), yielding results in the order they complete. A failed
    /// task's error carries its index ([`Error::TaskFailed`]).
    ///
    /// # Errors
    ///
    /// Per item, as [`imap`](Self::imap).
    pub fn imap_unordered<'p, A, R, E, I>(
        &'p self,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
    ) -> Imap<'p, R>
    where
        A: Serialize + DeserializeOwned + 'p,
        R: Serialize + DeserializeOwned + 'p,
        E: Display + 'p,
        I: IntoIterator<Item = A>,
        I::IntoIter: Send + 'p,
    {
        Imap::new(self, f, items.into_iter(), false, 1)
    }

    /// [`imap_unordered`](Self::imap_unordered) with tasks sent to workers
    /// `chunksize` at a time (see [`imap_chunked`](Self::imap_chunked)).
    ///
    /// # Errors
    ///
    /// Per item, as [`imap`](Self::imap).
    pub fn imap_unordered_chunked<'p, A, R, E, I>(
        &'p self,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
        chunksize: usize,
    ) -> Imap<'p, R>
    where
        A: Serialize + DeserializeOwned + 'p,
        R: Serialize + DeserializeOwned + 'p,
        E: Display + 'p,
        I: IntoIterator<Item = A>,
        I::IntoIter: Send + 'p,
    {
        Imap::new(self, f, items.into_iter(), false, chunksize)
    }
}
