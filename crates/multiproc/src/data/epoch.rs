//! [`Epoch`]: one pass of a [`DataLoader`](super::DataLoader) over its batch plan —
//! dispatch with a bounded number of batches in flight, reordering, failures and
//! retries, and stopping the workers when it ends.
//!
//! Invariants:
//!
//! - At most `num_workers × prefetch_factor` batches of an epoch are loading or
//!   waiting to be taken (and at most `prefetch_factor` per worker).
//! - With `in_order`, batch `k` is yielded after batches `0..k`, whatever order they
//!   finish in.
//! - After an error is yielded (and not retried), the epoch ends and its workers are
//!   stopped; a later epoch starts fresh ones.
//! - Dropping an epoch stops its workers unless they are persistent; dropping the
//!   loader always does, within [`STOP_GRACE`] plus the time to kill and reap.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::batch_plan::{batch_plan, check_in_range, show_indices};
use super::collate::Collate;
use super::dataset::Dataset;
use super::device_stage::{DeviceStage, Staged};
use super::loader::DataLoader;
use super::state::{Done, LoaderState, MapProgress, fingerprint};
use super::stats::LoaderStats;
use super::worker::{Task, Timing, load_batch, run_worker};
use super::worker_set::{Arrival, Sent, WorkerSet, eager_starts};
use crate::error::{Error, Result};

/// One epoch of a [`DataLoader`]: yields `Result<Batch>`; made by
/// [`DataLoader::iter`] or `for batch in &mut loader`.
pub struct Epoch<'a, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    loader: &'a mut DataLoader<D, C>,
    epoch: u64,
    /// This `iter()`'s number: tasks and replies of other runs are not this one's.
    run: u64,
    /// The epoch's batches, numbered by their place here.
    plan: Vec<Vec<usize>>,
    /// The numbers of the batches this run loads (all of them, but for those a
    /// resumed state says were yielded), in order.
    todo: Vec<usize>,
    /// The next batch (its place in `todo`) to send to a worker.
    next_send: usize,
    /// With `in_order`, the next batch (its place in `todo`) to yield.
    next_yield: usize,
    yielded: usize,
    /// Batches that arrived ahead of `next_yield`.
    ready: BTreeMap<usize, C::Batch>,
    /// With `in_order`, the failure of the earliest batch that failed for good: yielded
    /// at its turn, and no batch is sent meanwhile.
    failed: Option<(usize, Error)>,
    finished: bool,
    /// Whether this run has handed the caller a batch yet (past that, every worker may
    /// start).
    delivered: bool,
    /// The loader's stage (`pin_memory`, `prefetch_to`), and the batches it has pulled
    /// ahead. With copies ahead, a batch counts as yielded in the state only when it is
    /// handed over (`last_pulled` carries its number there).
    stage: Option<Arc<DeviceStage<C::Batch>>>,
    staged: Staged<C::Batch, Option<usize>>,
    last_pulled: Option<usize>,
    /// When the wait for the next arrival times out: kept across the polls of a
    /// stream that found nothing (so a re-poll does not push the timeout back), and
    /// cleared by each arrival, as the iterator's wait restarts its timeout then.
    deadline: Option<Option<Instant>>,
    #[cfg(feature = "progress")]
    bar: Option<super::progress::Bar>,
}

/// How [`Epoch::next_inner`] waits for the workers: blocking (the iterator, always
/// `Ready`) or polled (the stream, `Pending` while parked). Everything else about an
/// epoch is the one code path both share.
pub(super) type WaitFn<'w, B> =
    dyn FnMut(&mut WorkerSet<B>, u64, Option<Instant>) -> Poll<Result<Option<Arrival<B>>>> + 'w;

impl<'a, D, C> Epoch<'a, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// The epoch `epoch` of `loader`, over the batches of `plan`.
    pub(super) fn new(
        loader: &'a mut DataLoader<D, C>,
        epoch: u64,
        run: u64,
        plan: Vec<Vec<usize>>,
        todo: Vec<usize>,
        #[cfg(feature = "progress")] bar: Option<super::progress::Bar>,
    ) -> Self {
        let stage = loader.stage.clone();
        Epoch {
            loader,
            epoch,
            run,
            plan,
            todo,
            next_send: 0,
            next_yield: 0,
            yielded: 0,
            ready: BTreeMap::new(),
            failed: None,
            finished: false,
            delivered: false,
            stage,
            staged: Staged::new(),
            last_pulled: None,
            deadline: None,
            #[cfg(feature = "progress")]
            bar,
        }
    }

    /// This epoch's number (what the sampler was given).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The pids of the running workers, by worker id (as [`DataLoader::worker_pids`]).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.loader.worker_pids_inner()
    }

    /// Where the loader stands, counting the batches this epoch has yielded so far:
    /// the same as [`DataLoader::state_dict`], callable while the epoch borrows the
    /// loader.
    pub fn state_dict(&self) -> LoaderState {
        self.loader.state_dict()
    }

    /// Ends the epoch with `error`: its workers are stopped.
    fn fail(&mut self, error: Error) -> Option<Result<C::Batch>> {
        self.finished = true;
        self.loader.stop_workers();
        Some(Err(error))
    }

    fn yield_batch(&mut self, batch: usize, data: C::Batch) -> Option<Result<C::Batch>> {
        self.yielded += 1;
        self.delivered = true;
        self.loader.stats.batches += 1;
        if self.stage.as_ref().is_some_and(|s| s.ahead() > 0) {
            // Counted when the stage hands it over (`next_staged`).
            self.last_pulled = Some(batch);
        } else if let Some(p) = self.loader.progress.as_mut() {
            p.done.mark(batch);
        }
        #[cfg(feature = "progress")]
        if let Some(bar) = &self.bar {
            bar.batch_done(self.plan[batch].len(), &self.loader.stats);
        }
        Some(Ok(data))
    }

    /// The next batch loaded in this process (`num_workers(0)`).
    fn next_in_process(&mut self) -> Option<Result<C::Batch>> {
        let batch = self.todo[self.next_yield];
        self.next_yield += 1;
        let indices = &self.plan[batch];
        if let Err(e) = check_in_range(indices, self.loader.dataset.len()) {
            return self.fail(e);
        }
        let mut timing = Timing::default();
        let loaded = load_batch(
            &self.loader.dataset,
            &self.loader.collate,
            indices,
            None,
            &mut timing,
        );
        self.loader.stats.add(&timing);
        match loaded {
            Ok(data) => self.yield_batch(batch, data),
            Err(e) => {
                let error = Error::LoaderFailed {
                    worker: None,
                    pid: std::process::id(),
                    batch,
                    indices: indices.clone(),
                    message: format!(
                        "data loader (in this process, pid {}) failed on batch {batch} (samples {}): {e}",
                        std::process::id(),
                        show_indices(indices)
                    ),
                };
                self.fail(error)
            }
        }
    }

    /// Sends batches to workers while the in-flight bound allows, and starts at most
    /// one more worker if some are not started yet: worker 0 gets its first batch
    /// before worker 1 is started, and the caller takes in what has arrived between two
    /// starts, so the first batch waits for one start, not `num_workers`. (While
    /// workers start, each gets one batch: batches go to workers round-robin as if all
    /// had started at once.)
    fn fill(&mut self) -> Result<()> {
        let o = &self.loader.options;
        let window = o.num_workers.saturating_mul(o.prefetch_factor);
        let per_worker = o.prefetch_factor;
        let epoch = self.epoch;
        if self.loader.workers.is_none() {
            self.loader.workers = Some(WorkerSet::empty()?);
        }
        let len = self.loader.dataset.len();
        let DataLoader {
            dataset,
            collate,
            options,
            workers,
            ..
        } = &mut *self.loader;
        let (dataset, collate, options) = (&*dataset, &*collate, &*options);
        let launch = |id, generation, tasks, results| {
            super::worker::launch(
                run_worker::<D, C>,
                dataset,
                collate,
                options,
                id,
                generation,
                epoch,
                tasks,
                results,
            )
        };
        let Some(set) = workers.as_mut() else {
            return Ok(());
        };
        let mut grown = false;
        let delivered = self.delivered;
        loop {
            let starting = set.len() < options.num_workers;
            let limit = if starting { 1 } else { per_worker };
            while self.next_send < self.todo.len() && self.failed.is_none() {
                if set.in_flight() + self.ready.len() >= window {
                    break;
                }
                let Some(id) = set.least_busy(limit) else {
                    break;
                };
                set.ensure_alive(id, options.restart_workers, &launch)?;
                let batch = self.todo[self.next_send];
                check_in_range(&self.plan[batch], len)?;
                let task = Task {
                    run: self.run,
                    epoch: self.epoch,
                    batch,
                    indices: self.plan[batch].clone(),
                    from: None,
                };
                let retried = false;
                set.send(id, Sent { task, retried })?;
                self.next_send += 1;
            }
            if !starting || grown || !may_start(set.len(), delivered, set.in_flight_of(self.run)) {
                break;
            }
            set.grow(&launch)?;
            grown = true;
        }
        Ok(())
    }

    /// What to do about a failed batch: retry it on a fresh worker, or end with it.
    fn on_failure(&mut self, worker: usize, pid: u32, sent: Sent, what: String) -> Option<Error> {
        let batch = sent.task.batch;
        let indices = sent.task.indices.clone();
        let again = if sent.retried {
            " again, after a restart"
        } else {
            ""
        };
        let message = format!(
            "data loader worker {worker} ({} {pid}) failed{again} on batch {batch} (samples {}): {what}",
            self.loader.options.kind.label(),
            show_indices(&indices)
        );
        let error = Error::LoaderFailed {
            worker: Some(worker),
            pid,
            batch,
            indices,
            message,
        };
        // No restart once the epoch is ending on an earlier failure: it would only
        // load batches nobody will take.
        if !self.loader.options.restart_workers || sent.retried || self.failed.is_some() {
            return Some(error);
        }
        tracing::warn!("multiproc: {error}; restarting the worker and retrying the batch");
        let DataLoader {
            dataset,
            collate,
            options,
            workers,
            ..
        } = &mut *self.loader;
        let (dataset, collate, options) = (&*dataset, &*collate, &*options);
        let epoch = self.epoch;
        let set = workers.as_mut()?;
        let launch = |id, generation, tasks, results| {
            super::worker::launch(
                run_worker::<D, C>,
                dataset,
                collate,
                options,
                id,
                generation,
                epoch,
                tasks,
                results,
            )
        };
        let retry = Sent {
            task: sent.task,
            retried: true,
        };
        let e = set.restart(worker, retry, &launch).err()?;
        Some(match error {
            Error::LoaderFailed {
                worker,
                pid,
                batch,
                indices,
                message,
            } => Error::LoaderFailed {
                worker,
                pid,
                batch,
                indices,
                message: format!("{message}; restarting the worker failed: {e}"),
            },
            other => other,
        })
    }

    fn timeout_error(&self) -> Error {
        let timeout = self.loader.options.timeout.unwrap_or_default();
        let set = self.loader.workers.as_ref();
        let held = if self.loader.options.in_order {
            let next = self.todo.get(self.next_yield).copied();
            next.and_then(|next| {
                set.and_then(|s| s.holder(self.run, next))
                    .map(|(w, p)| (w, p, next))
            })
        } else {
            set.and_then(|s| s.oldest(self.run))
                .map(|(w, p, sent)| (w, p, sent.task.batch))
        };
        match held {
            Some((worker, pid, batch)) => Error::timeout(
                format!(
                    "data loader: batch {batch} (samples {}), which worker {worker} ({} {pid}) \
                     still holds (raise the timeout or look at what that worker is doing),",
                    show_indices(&self.plan[batch]),
                    self.loader.options.kind.label()
                ),
                Some(timeout),
            ),
            None => Error::timeout("data loader: the next batch", Some(timeout)),
        }
    }
}

impl<D, C> Iterator for Epoch<'_, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    type Item = Result<C::Batch>;

    fn next(&mut self) -> Option<Result<C::Batch>> {
        let start = Instant::now();
        let next = match self.stage.clone() {
            None => self.next_blocking(),
            Some(stage) => self.next_staged(&stage),
        };
        self.loader.stats.waiting += start.elapsed();
        next
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.finished {
            0
        } else {
            self.todo.len() - self.yielded
        };
        (0, Some(left + self.staged.len()))
    }
}

impl<D, C> Epoch<'_, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// The next batch through the loader's stage: pinned, or copied to the device
    /// (pulled ahead; counted in the state when handed over). An error of the stage
    /// ends the epoch like a worker's.
    fn next_staged(&mut self, stage: &DeviceStage<C::Batch>) -> Option<Result<C::Batch>> {
        if stage.ahead() == 0 {
            let next = self.next_blocking();
            return self.pinned(stage, next);
        }
        let mut staged = std::mem::take(&mut self.staged);
        let next = stage.next(&mut staged, || {
            let batch = self.next_blocking()?;
            Some((self.last_pulled.take(), batch))
        });
        self.staged = staged;
        self.hand_over(next)
    }

    /// A batch the stage hands over, counted as yielded; its error (a failed copy)
    /// ends the epoch like a worker's.
    fn hand_over(
        &mut self,
        next: Option<(Option<usize>, Result<C::Batch>)>,
    ) -> Option<Result<C::Batch>> {
        match next? {
            (number, Ok(batch)) => {
                if let (Some(b), Some(p)) = (number, self.loader.progress.as_mut()) {
                    p.done.mark(b);
                }
                Some(Ok(batch))
            }
            (_, Err(e)) if self.finished => Some(Err(e)),
            (_, Err(e)) => self.fail(e),
        }
    }

    /// A batch `next_inner` produced, through a pinning stage (`pin_memory` without
    /// copies ahead): a failure to pin ends the epoch like a worker's.
    fn pinned(
        &mut self,
        stage: &DeviceStage<C::Batch>,
        next: Option<Result<C::Batch>>,
    ) -> Option<Result<C::Batch>> {
        match next? {
            Ok(mut batch) => match stage.pin(&mut batch) {
                Ok(()) => Some(Ok(batch)),
                Err(e) => self.fail(e),
            },
            Err(e) => Some(Err(e)),
        }
    }

    /// `next_inner` waiting on the workers' replies in this thread.
    fn next_blocking(&mut self) -> Option<Result<C::Batch>> {
        let mut wait =
            |set: &mut WorkerSet<C::Batch>, run, deadline| Poll::Ready(set.wait(run, deadline));
        match self.next_inner(&mut wait) {
            Poll::Ready(next) => next,
            // The blocking wait is always ready.
            Poll::Pending => self.fail(Error::Closed(
                "data loader: a blocking wait came back empty (this is a multiproc bug)".into(),
            )),
        }
    }

    /// The next batch (the iterator's `next` and the stream's `poll_next`, less their
    /// accounting), waiting for the workers through `wait`. `Pending` only when `wait`
    /// is: nothing is lost then, and the next call goes on where this one stopped
    /// (sending is bounded by what is in flight, arrivals are kept in `ready`).
    fn next_inner(&mut self, wait: &mut WaitFn<'_, C::Batch>) -> Poll<Option<Result<C::Batch>>> {
        if self.finished || self.yielded == self.todo.len() {
            self.finished = true;
            return Poll::Ready(None);
        }
        if self.loader.options.num_workers == 0 {
            return Poll::Ready(self.next_in_process());
        }
        loop {
            if let Err(e) = self.fill() {
                return Poll::Ready(self.fail(e));
            }
            if self.loader.options.in_order {
                let next = self.todo[self.next_yield];
                if let Some(data) = self.ready.remove(&next) {
                    self.next_yield += 1;
                    return Poll::Ready(self.yield_batch(next, data));
                }
                if let Some((_, e)) = self.failed.take_if(|(b, _)| *b == next) {
                    return Poll::Ready(self.fail(e));
                }
            }
            let Some(set) = self.loader.workers.as_mut() else {
                return Poll::Ready(self.fail(Error::Closed(
                    "data loader: the workers are gone (this is a multiproc bug)".into(),
                )));
            };
            // While workers are still to start, only look at what has arrived, and go
            // on starting them.
            let starting = set.len() < self.loader.options.num_workers
                && may_start(set.len(), self.delivered, set.in_flight_of(self.run));
            let deadline = if starting {
                Some(Instant::now())
            } else {
                let timeout = self.loader.options.timeout;
                *self
                    .deadline
                    .get_or_insert_with(|| crate::sys::socket::deadline_after(timeout))
            };
            let arrival = match wait(set, self.run, deadline) {
                Poll::Ready(arrival) => arrival,
                Poll::Pending => return Poll::Pending,
            };
            if !starting {
                self.deadline = None;
            }
            match arrival {
                Err(e) => return Poll::Ready(self.fail(e)),
                Ok(None) if starting => {}
                Ok(None) => {
                    let e = self.timeout_error();
                    return Poll::Ready(self.fail(e));
                }
                Ok(Some(Arrival::Exhausted { .. })) => {
                    return Poll::Ready(self.fail(Error::InvalidMessage(
                        "data loader: a map-style worker reported an exhausted iterator".into(),
                    )));
                }
                Ok(Some(Arrival::Loaded {
                    batch,
                    data,
                    timing,
                    ..
                })) => {
                    self.loader.stats.add(&timing);
                    if self.loader.options.in_order {
                        self.ready.insert(batch, data);
                    } else {
                        return Poll::Ready(self.yield_batch(batch, data));
                    }
                }
                Ok(Some(Arrival::Failed {
                    worker,
                    pid,
                    sent,
                    what,
                })) => {
                    let batch = sent.task.batch;
                    if let Some(e) = self.on_failure(worker, pid, sent, what) {
                        if !self.loader.options.in_order {
                            return Poll::Ready(self.fail(e));
                        }
                        // Yield the batches before it first, as torch does.
                        if self.failed.as_ref().is_none_or(|(b, _)| batch < *b) {
                            self.failed = Some((batch, e));
                        }
                    }
                }
            }
        }
    }
}

/// Whether one more worker may start now, `started` being started: freely up to the
/// machine's cores, the rest once the run has handed the caller a batch — or when no
/// worker has a task of the run, so none could answer (an iterable run resumed at a
/// worker not started).
pub(super) fn may_start(started: usize, delivered: bool, in_flight: usize) -> bool {
    delivered || started < eager_starts() || in_flight == 0
}

impl<D, C> Drop for Epoch<'_, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    fn drop(&mut self) {
        #[cfg(feature = "progress")]
        if let Some(bar) = self.bar.take() {
            bar.finish(self.yielded == self.todo.len());
        }
        if !self.loader.options.persistent_workers {
            self.loader.stop_workers();
        }
    }
}

impl<D, C> DataLoader<D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// One epoch: the batches in sampler order (or as they finish, without
    /// `in_order`). Workers start on the first `next`, unless persistent ones run.
    ///
    /// After a [`load_state_dict`](Self::load_state_dict), the epoch is the state's,
    /// less the batches it says were yielded.
    pub fn iter(&mut self) -> Epoch<'_, D, C> {
        let run = self.next_run;
        self.next_run += 1;
        let (epoch, start, done) = match self.resume.take() {
            Some(p) => (p.epoch, p.start, p.done),
            None => (self.next_epoch, 0, Done::default()),
        };
        self.next_epoch = epoch.wrapping_add(1);
        self.dataset.set_epoch(epoch);
        let plan = batch_plan(
            self.sampler.indices_from(epoch, start),
            self.options.batch_size,
            self.options.drop_last,
        );
        let todo: Vec<usize> = (0..plan.len()).filter(|&b| !done.contains(b)).collect();
        self.stats = LoaderStats::new(epoch);
        self.progress = Some(MapProgress {
            epoch,
            start,
            batches: plan.len(),
            samples: plan.iter().map(Vec::len).sum(),
            done,
            fingerprint: fingerprint(&plan),
            order: self.sampler.global_order_hash(epoch),
        });
        #[cfg(feature = "progress")]
        let bar = self
            .options
            .progress
            .then(|| super::progress::Bar::new(todo.len(), epoch));
        Epoch::new(
            self,
            epoch,
            run,
            plan,
            todo,
            #[cfg(feature = "progress")]
            bar,
        )
    }
}

impl<'a, D, C> IntoIterator for &'a mut DataLoader<D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    type Item = Result<C::Batch>;
    type IntoIter = Epoch<'a, D, C>;

    fn into_iter(self) -> Epoch<'a, D, C> {
        self.iter()
    }
}

#[cfg(feature = "async")]
pub use stream::EpochStream;

/// The epoch as a `futures_core::Stream` (feature `async`).
#[cfg(feature = "async")]
mod stream {
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Instant;

    use serde::Serialize;
    use serde::de::DeserializeOwned;

    use super::{DataLoader, Epoch};
    use crate::data::collate::Collate;
    use crate::data::dataset::Dataset;
    use crate::data::worker_set::WorkerSet;
    use crate::error::Result;
    use crate::sys::reactor::Parked;

    /// One epoch of a [`DataLoader`] as a [`futures_core::Stream`] of
    /// `Result<Batch>` (feature `async`), made by [`DataLoader::stream`] or
    /// [`Epoch::into_stream`]: the same batches, in the same order, with the same
    /// failures and timeout as the [`Epoch`] iterator, but where `next` blocks the
    /// thread on the workers' replies, `poll_next` parks on the results queue with the
    /// async reactor and returns `Pending`.
    ///
    /// - A worker's `Err` or panic arrives as a reply, and a worker process that dies
    ///   while it holds tasks wakes the stream through its pidfd: both at once. The
    ///   loader's [`timeout`](crate::data::DataLoaderBuilder::timeout) wakes the parked
    ///   stream at its deadline, as the iterator gives up at it.
    /// - With `num_workers(0)` batches are loaded in `poll_next` itself, on the
    ///   executor's thread, as the iterator loads them in `next`.
    /// - `pin_memory` and `prefetch_to` are applied as by the iterator. With
    ///   `prefetch_to`, the copies of the batches pulled ahead run on the device while
    ///   the stream is parked, and the driver wakes it when the oldest batch's copies
    ///   are done (no thread waits on them); a batch is handed over complete on the
    ///   device. Dropping the stream with copies in flight waits for those copies (they
    ///   read the batches' host memory), as dropping the iterator does.
    /// - Cancel-safe: dropping the stream (mid-epoch, or while a poll is pending) is
    ///   dropping the `Epoch`: its workers stop unless persistent, and a later epoch
    ///   starts afresh. A batch that arrived and was not yet yielded is dropped with it.
    pub struct EpochStream<'a, D, C>
    where
        D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// The registration while a poll is pending (dropped first: it only passes on a
        /// wake-up it did not use).
        parked: Option<Parked>,
        epoch: Epoch<'a, D, C>,
        /// When the caller started waiting for the item being polled (the
        /// `waiting` of [`LoaderStats`](crate::data::LoaderStats)).
        since: Option<Instant>,
    }

    // Nothing in the stream is pinned in place: the epoch's state and the reactor
    // registration may move between polls.
    impl<D, C> Unpin for EpochStream<'_, D, C>
    where
        D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
    }

    impl<'a, D, C> Epoch<'a, D, C>
    where
        D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// This epoch as a [`futures_core::Stream`] (feature `async`): see
        /// [`EpochStream`]. The batches it has yielded so far stay yielded.
        pub fn into_stream(self) -> EpochStream<'a, D, C> {
            EpochStream {
                parked: None,
                epoch: self,
                since: None,
            }
        }
    }

    impl<'a, D, C> EpochStream<'a, D, C>
    where
        D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// The epoch behind the stream (its number, state, workers' pids).
        pub fn epoch(&self) -> &Epoch<'a, D, C> {
            &self.epoch
        }
    }

    impl<D, C> futures_core::Stream for EpochStream<'_, D, C>
    where
        D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        type Item = Result<C::Batch>;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let this = self.get_mut();
            let start = *this.since.get_or_insert_with(Instant::now);
            let epoch = &mut this.epoch;
            let stage = epoch.stage.clone();
            let parked = &mut this.parked;
            let next = if let Some(stage) = stage.as_ref().filter(|s| s.ahead() > 0) {
                let mut staged = std::mem::take(&mut epoch.staged);
                let next = stage.poll_next(&mut staged, cx, |cx| {
                    let mut wait = |set: &mut WorkerSet<C::Batch>, run, deadline| {
                        set.poll_wait(cx, parked, run, deadline)
                    };
                    epoch
                        .next_inner(&mut wait)
                        .map(|next| Some((epoch.last_pulled.take(), next?)))
                });
                epoch.staged = staged;
                match next {
                    Poll::Ready(next) => epoch.hand_over(next),
                    Poll::Pending => return Poll::Pending,
                }
            } else {
                let mut wait = |set: &mut WorkerSet<C::Batch>, run, deadline| {
                    set.poll_wait(cx, parked, run, deadline)
                };
                let next = match epoch.next_inner(&mut wait) {
                    Poll::Ready(next) => next,
                    Poll::Pending => return Poll::Pending,
                };
                match stage {
                    Some(stage) => epoch.pinned(&stage, next),
                    None => next,
                }
            };
            this.since = None;
            epoch.loader.stats.waiting += start.elapsed();
            Poll::Ready(next)
        }

        fn size_hint(&self) -> (usize, Option<usize>) {
            Iterator::size_hint(&self.epoch)
        }
    }

    impl<D, C> DataLoader<D, C>
    where
        D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// One epoch as a [`futures_core::Stream`] of batches (feature `async`): what
        /// [`iter`](Self::iter) yields, awaited without blocking a thread (see
        /// [`EpochStream`]).
        ///
        /// ```no_run
        /// # async fn run<D, C>(loader: &mut multiproc::data::DataLoader<D, C>) -> multiproc::Result<()>
        /// # where
        /// #     D: multiproc::data::Dataset + serde::Serialize + serde::de::DeserializeOwned + Clone + 'static,
        /// #     C: multiproc::data::Collate<D::Item> + 'static,
        /// # {
        /// use std::future::poll_fn;
        /// use std::pin::Pin;
        /// use futures_core::Stream;
        ///
        /// let mut batches = loader.stream();
        /// while let Some(batch) = poll_fn(|cx| Pin::new(&mut batches).poll_next(cx)).await {
        ///     let _batch = batch?;
        /// }
        /// # Ok(())
        /// # }
        /// ```
        pub fn stream(&mut self) -> EpochStream<'_, D, C> {
            self.iter().into_stream()
        }
    }
}
