//! [`IterableDataLoader`] and [`IterableEpoch`]: batches of an [`IterableDataset`],
//! each worker batching its own stream (torch's `DataLoader` over an
//! `IterableDataset`).
//!
//! Batches are numbered in the order they are requested, round-robin over the workers
//! that still have samples; with `in_order` they are yielded in that order (torch's
//! order), otherwise as they finish. In order, the round-robin is strict — the worker
//! whose turn it is gets the next request, and none is sent until it has room — so the
//! order does not depend on timing (which a resume relies on); out of order, a busy
//! worker is passed over. Only the current run's tasks count against a worker's room
//! (a persistent worker may still hold an abandoned run's). A worker that answers "exhausted" gets no more
//! requests this epoch; the epoch ends when every worker is exhausted. A failure ends
//! the epoch: a fresh worker could not resume its predecessor's stream, so
//! `restart_workers` does not apply here. There is no sampler, so no `len`.
//!
//! Resuming: each reply carries where its worker's stream stands after the batch
//! (the data set's [`StreamState`]); the loader keeps, per worker, the cursor of the
//! last batch it *yielded*, and, in order, the worker whose turn comes next. A resumed
//! run starts each worker's stream from its cursor (`iter_from`), skips those that
//! ended, and takes up the round-robin at that worker: the batches that follow are
//! those of the uninterrupted run.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::collate::Collate;
use super::dataset::IterableDataset;
use super::device_stage::{DeviceStage, Staged};
use super::epoch::{WaitFn, may_start};
use super::options::Options;
use super::state::{Cursor, EpochState, LoaderState, StreamEpochState, StreamState};
use super::stats::LoaderStats;
use super::worker::{Outcome, Task, Timing, next_batch, run_iterable_worker, stream_cursor};
use super::worker_set::{Arrival, STOP_GRACE, Sent, WorkerSet};
use crate::error::{Error, Result};

/// A loader of an [`IterableDataset`]; made by
/// [`DataLoaderBuilder::build_iterable`](super::DataLoaderBuilder::build_iterable).
pub struct IterableDataLoader<D: IterableDataset, C: Collate<D::Item>> {
    dataset: D,
    collate: C,
    options: Options,
    workers: Option<WorkerSet<C::Batch>>,
    next_epoch: u64,
    next_run: u64,
    /// The epoch running or last run: what `state_dict` reports.
    progress: Option<StreamProgress>,
    /// Where the next `iter()` resumes, from `load_state_dict`.
    resume: Option<StreamProgress>,
    /// Where the epoch's time went.
    stats: LoaderStats,
    /// `pin_memory` and `prefetch_to`: what is done to each batch before it is handed
    /// over (see `device_stage`).
    stage: Option<Arc<DeviceStage<C::Batch>>>,
}

/// An iterable epoch's standing: per worker, the cursor after its last yielded batch.
#[derive(Clone, Debug)]
struct StreamProgress {
    epoch: u64,
    cursors: Vec<Cursor>,
    next_worker: usize,
    ended: bool,
}

impl StreamProgress {
    fn fresh(epoch: u64, streams: usize) -> Self {
        StreamProgress {
            epoch,
            cursors: vec![Cursor::Start; streams],
            next_worker: 0,
            ended: false,
        }
    }

    /// Worker `worker`'s batch (or its end) was handed over.
    fn passed(&mut self, worker: usize, cursor: Cursor) {
        if let Some(c) = self.cursors.get_mut(worker) {
            *c = cursor;
        }
        self.next_worker = (worker + 1) % self.cursors.len().max(1);
    }
}

impl<D, C> IterableDataLoader<D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    pub(super) fn new(
        dataset: D,
        collate: C,
        options: Options,
        stage: Option<DeviceStage<C::Batch>>,
    ) -> Self {
        IterableDataLoader {
            dataset,
            collate,
            options,
            workers: None,
            next_epoch: 0,
            next_run: 0,
            progress: None,
            resume: None,
            stats: LoaderStats::default(),
            stage: stage.map(Arc::new),
        }
    }

    /// The pids of the running workers, by worker id (thread workers: their thread ids).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers
            .as_ref()
            .map(WorkerSet::pids)
            .unwrap_or_default()
    }

    /// Sets the number of the next epoch (passed to [`IterableDataset::iter`], in
    /// persistent workers too). A state loaded and not yet run is kept when it is of
    /// this epoch, and dropped for another.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
        if self.resume.as_ref().is_some_and(|r| r.epoch != epoch) {
            self.resume = None;
        }
        if self.progress.as_ref().is_some_and(|p| p.epoch != epoch) {
            self.progress = None;
        }
    }

    /// The number of streams: one per worker, or one in this process.
    fn streams(&self) -> usize {
        self.options.num_workers.max(1)
    }

    /// Where the time of the epoch running (or the last one run) went
    /// ([`LoaderStats`]).
    pub fn stats(&self) -> LoaderStats {
        self.stats
    }

    /// Where the loader stands: the epoch in progress and, per worker, the
    /// [`StreamState`] its data set reported after its last batch that was yielded
    /// (batches loading or waiting are not counted), or the next epoch between epochs.
    /// While an epoch runs, [`IterableEpoch::state_dict`] gives the same.
    pub fn state_dict(&self) -> LoaderState {
        let p = match (&self.resume, &self.progress) {
            (Some(p), _) => p,
            (None, Some(p)) if !p.ended => p,
            _ => return LoaderState::at_epoch(self.next_epoch),
        };
        LoaderState::within(
            p.epoch,
            EpochState::Stream(StreamEpochState {
                cursors: p.cursors.clone(),
                next_worker: p.next_worker,
                batch_size: self.options.batch_size,
                drop_last: self.options.drop_last,
            }),
        )
    }

    /// Resumes from `state` (taken by [`state_dict`](Self::state_dict) of a loader
    /// built the same way): the next [`iter`](Self::iter) continues each worker's
    /// stream from the state the data set reported
    /// ([`IterableDataset::iter_from`]), and the epochs after it follow.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], and the loader unchanged, when the state is of
    /// another format version, of a map-style loader, of another number of workers
    /// (each worker's stream is its own), batch size or `drop_last`, or mid-stream
    /// where the data set reported no state ([`IterableDataset::state`]).
    pub fn load_state_dict(&mut self, state: &LoaderState) -> Result<()> {
        let Some(progress) = state.checked()? else {
            self.progress = None;
            self.resume = None;
            self.next_epoch = state.epoch();
            return Ok(());
        };
        let EpochState::Stream(st) = progress else {
            return Err(Error::InvalidArgument(
                "data loader state: this state is of a map-style data set's loader; load it \
                 with DataLoader::load_state_dict"
                    .into(),
            ));
        };
        let o = &self.options;
        if st.cursors.len() != self.streams() {
            return Err(Error::InvalidArgument(format!(
                "data loader state: it was taken with {} streams (workers), this loader has \
                 {} (num_workers {}): an iterable data set splits its stream by worker, so \
                 resume with the same num_workers",
                st.cursors.len(),
                self.streams(),
                o.num_workers
            )));
        }
        if (st.batch_size, st.drop_last) != (o.batch_size, o.drop_last) {
            return Err(Error::InvalidArgument(format!(
                "data loader state: it was taken with batch size {} and drop_last {}, this \
                 loader has {} and {}: resume with the same settings",
                st.batch_size, st.drop_last, o.batch_size, o.drop_last
            )));
        }
        if let Some(w) = st.cursors.iter().position(|c| *c == Cursor::Unknown) {
            return Err(Error::InvalidArgument(format!(
                "data loader state: worker {w}'s stream was mid-epoch, but the data set {} \
                 reports no state to resume it from: implement IterableDataset::state and \
                 iter_from",
                std::any::type_name::<D>()
            )));
        }
        self.next_epoch = state.epoch();
        self.progress = None;
        self.resume = Some(StreamProgress {
            epoch: state.epoch(),
            cursors: st.cursors.clone(),
            next_worker: st.next_worker % self.streams(),
            ended: false,
        });
        Ok(())
    }

    /// One epoch (after a [`load_state_dict`](Self::load_state_dict): the rest of the
    /// state's epoch).
    pub fn iter(&mut self) -> IterableEpoch<'_, D, C> {
        let run = self.next_run;
        self.next_run += 1;
        let progress = match self.resume.take() {
            Some(p) => p,
            None => StreamProgress::fresh(self.next_epoch, self.streams()),
        };
        let epoch = progress.epoch;
        self.next_epoch = epoch.wrapping_add(1);
        let mut open_error = None;
        let in_process = if self.options.num_workers == 0 {
            match &progress.cursors[0] {
                Cursor::At(s) => match self.dataset.iter_from(epoch, s) {
                    Ok(it) => Some(it),
                    Err(e) => {
                        open_error = Some(e);
                        None
                    }
                },
                Cursor::Done => None,
                Cursor::Start | Cursor::Unknown => Some(self.dataset.iter(epoch)),
            }
        } else {
            None
        };
        let exhausted: Vec<bool> = progress
            .cursors
            .iter()
            .map(|c| *c == Cursor::Done)
            .collect();
        let round_robin = progress.next_worker;
        self.stats = LoaderStats::new(epoch);
        let resume_from = progress
            .cursors
            .iter()
            .map(|c| match c {
                Cursor::At(s) if self.options.num_workers > 0 => Some(s.clone()),
                _ => None,
            })
            .collect();
        self.progress = Some(progress);
        IterableEpoch {
            loader: self,
            epoch,
            run,
            next_send: 0,
            next_yield: 0,
            round_robin,
            exhausted,
            ready: BTreeMap::new(),
            failed: None,
            finished: false,
            delivered: false,
            in_process,
            open_error,
            resume_from,
            deadline: None,
            staged: Staged::new(),
            deferred: None,
            tail: Vec::new(),
        }
    }
}

impl<D: IterableDataset, C: Collate<D::Item>> IterableDataLoader<D, C> {
    fn stop_workers(&mut self) {
        if let Some(set) = self.workers.take() {
            set.stop(STOP_GRACE);
        }
    }
}

impl<D: IterableDataset, C: Collate<D::Item>> Drop for IterableDataLoader<D, C> {
    fn drop(&mut self) {
        self.stop_workers();
    }
}

impl<D: IterableDataset, C: Collate<D::Item>> fmt::Debug for IterableDataLoader<D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IterableDataLoader")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<'a, D, C> IntoIterator for &'a mut IterableDataLoader<D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    type Item = Result<C::Batch>;
    type IntoIter = IterableEpoch<'a, D, C>;

    fn into_iter(self) -> IterableEpoch<'a, D, C> {
        self.iter()
    }
}

/// One epoch of an [`IterableDataLoader`]: yields `Result<Batch>`.
pub struct IterableEpoch<'a, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    loader: &'a mut IterableDataLoader<D, C>,
    epoch: u64,
    run: u64,
    next_send: usize,
    next_yield: usize,
    round_robin: usize,
    /// By worker id: whether its stream has ended this epoch.
    exhausted: Vec<bool>,
    /// With `in_order`: answered requests ahead of `next_yield`, with the worker and
    /// its cursor after the answer (the batch `None`: exhausted).
    ready: BTreeMap<usize, (usize, Option<C::Batch>, Cursor)>,
    failed: Option<(usize, Error)>,
    finished: bool,
    /// Whether this run has handed the caller a batch yet (past that, every worker may
    /// start).
    delivered: bool,
    in_process: Option<D::Iter>,
    /// Resuming the in-process stream failed: yielded first.
    open_error: Option<Error>,
    /// By worker id: where its stream resumes, until its first task is sent.
    resume_from: Vec<Option<StreamState>>,
    /// When the wait for the next arrival times out, kept across a stream's polls
    /// that found nothing (as `Epoch`'s).
    deadline: Option<Option<Instant>>,
    /// With `prefetch_to`: the batches pulled ahead, each with the state changes to
    /// make when it is handed over (the state counts only batches handed over).
    staged: Staged<C::Batch, Vec<Passage>>,
    /// While a batch is being pulled ahead (across a stream's pending polls): the state
    /// changes met meanwhile, which wait for its hand-over.
    deferred: Option<Vec<Passage>>,
    /// The state changes met by the pull that found the end: made once every staged
    /// batch has been handed over.
    tail: Vec<Passage>,
}

/// A batch pulled ahead (or the error in its place), with the state changes that wait
/// for its hand-over.
type Pulled<B> = (Vec<Passage>, Result<B>);

/// A change to an iterable epoch's state (`StreamProgress`), made when the batch it
/// came with is handed over (see `IterableEpoch::deferred`).
enum Passage {
    /// A worker's answer (a batch, or its stream's end) was passed.
    Passed(usize, Cursor),
    /// Every stream ended.
    Ended,
}

impl<D, C> IterableEpoch<'_, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// The pids of the running workers, by worker id.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.loader.worker_pids()
    }

    /// This epoch's number (what the data set's `iter` was given).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Where the loader stands, counting the batches this epoch has yielded so far
    /// (as [`IterableDataLoader::state_dict`]).
    pub fn state_dict(&self) -> LoaderState {
        self.loader.state_dict()
    }

    /// Worker `worker`'s answer was handed over (or skipped, for an end of stream).
    fn passed(&mut self, worker: usize, cursor: Cursor) {
        self.record(Passage::Passed(worker, cursor));
    }

    /// The epoch ended with every stream.
    fn ended(&mut self) -> Option<Result<C::Batch>> {
        self.finished = true;
        self.record(Passage::Ended);
        None
    }

    /// Makes `passage` in the state, or keeps it for the hand-over of the batch being
    /// pulled ahead.
    fn record(&mut self, passage: Passage) {
        match &mut self.deferred {
            Some(kept) => kept.push(passage),
            None => self.make(passage),
        }
    }

    /// Makes `passage` in the loader's state (what `state_dict` reports).
    fn make(&mut self, passage: Passage) {
        if let Some(p) = self.loader.progress.as_mut() {
            match passage {
                Passage::Passed(worker, cursor) => p.passed(worker, cursor),
                Passage::Ended => p.ended = true,
            }
        }
    }

    /// What `pull` (the next batch, from the workers or in this process) found, with
    /// the state changes it met kept for its hand-over (see [`staged`](Self::staged)),
    /// or, at the end, for after the last one.
    fn pull_ahead(
        &mut self,
        pull: impl FnOnce(&mut Self) -> Poll<Option<Result<C::Batch>>>,
    ) -> Poll<Option<Pulled<C::Batch>>> {
        // Changes met by a pull that was pending are still kept: they go with the
        // batch this one finds.
        self.deferred.get_or_insert_with(Vec::new);
        match pull(self) {
            Poll::Ready(Some(batch)) => {
                Poll::Ready(Some((self.deferred.take().unwrap_or_default(), batch)))
            }
            Poll::Ready(None) => {
                let kept = self.deferred.take().unwrap_or_default();
                self.tail.extend(kept);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// A batch the stage hands over (with its state changes); after the last, the
    /// changes of the end. An error of the stage (a failed copy) ends the epoch like
    /// a worker's.
    fn hand_over(&mut self, next: Option<Pulled<C::Batch>>) -> Option<Result<C::Batch>> {
        let Some((passages, batch)) = next else {
            for p in std::mem::take(&mut self.tail) {
                self.make(p);
            }
            return None;
        };
        for p in passages {
            self.make(p);
        }
        match batch {
            Ok(batch) => Some(Ok(batch)),
            Err(e) if self.finished => Some(Err(e)),
            Err(e) => self.fail(e),
        }
    }

    fn fail(&mut self, error: Error) -> Option<Result<C::Batch>> {
        self.finished = true;
        self.loader.stop_workers();
        Some(Err(error))
    }

    /// A batch `next_inner` produced, page-locked when the loader pins
    /// (`pin_memory`): a failure to pin ends the epoch like a worker's.
    fn pinned(&mut self, next: Option<Result<C::Batch>>) -> Option<Result<C::Batch>> {
        let Some(stage) = self.loader.stage.clone() else {
            return next;
        };
        match next? {
            Ok(mut batch) => match stage.pin(&mut batch) {
                Ok(()) => Some(Ok(batch)),
                Err(e) => self.fail(e),
            },
            Err(e) => Some(Err(e)),
        }
    }

    fn next_in_process(&mut self) -> Option<Result<C::Batch>> {
        if let Some(e) = self.open_error.take() {
            return self.fail(e);
        }
        let o = &self.loader.options;
        let batch = self.next_yield;
        let mut timing = Timing::default();
        let outcome = next_batch(
            &mut self.in_process,
            &self.loader.collate,
            o.batch_size,
            o.drop_last,
            &mut timing,
        );
        self.loader.stats.add(&timing);
        match outcome {
            Outcome::Batch(b) => {
                self.next_yield += 1;
                self.loader.stats.batches += 1;
                let cursor = stream_cursor(&self.loader.dataset, &self.in_process);
                self.passed(0, cursor);
                Some(Ok(b))
            }
            Outcome::Exhausted => self.ended(),
            Outcome::Failed(what) => {
                let pid = std::process::id();
                self.fail(Error::LoaderFailed {
                    worker: None,
                    pid,
                    batch,
                    indices: Vec::new(),
                    message: format!(
                        "data loader (in this process, pid {pid}) failed on batch {batch}: {what}"
                    ),
                })
            }
        }
    }

    /// Requests batches from the workers that have samples left, round-robin, within
    /// the in-flight bound.
    ///
    /// Workers not started yet start one per call, in id order (the round-robin's
    /// order): a request waits for its worker's start, not for all of them.
    fn fill(&mut self) -> Result<()> {
        let epoch = self.epoch;
        if self.loader.workers.is_none() {
            self.loader.workers = Some(WorkerSet::empty()?);
        }
        let IterableDataLoader {
            dataset,
            collate,
            options: o,
            workers,
            ..
        } = &mut *self.loader;
        let (dataset, collate, o) = (&*dataset, &*collate, &*o);
        let launch = |id, generation, tasks, results| {
            super::worker::launch(
                run_iterable_worker::<D, C>,
                dataset,
                collate,
                o,
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
        let n = o.num_workers;
        if self.exhausted.len() != n {
            self.exhausted = vec![false; n];
        }
        if set.len() < n && may_start(set.len(), self.delivered, set.in_flight_of(self.run)) {
            set.grow(&launch)?;
        }
        // Only this run's tasks count: a persistent worker may still hold an abandoned
        // run's, which it answers first and which are dropped.
        let window = n.saturating_mul(o.prefetch_factor);
        let run = self.run;
        let busy = |set: &WorkerSet<C::Batch>, w: usize| {
            set.outstanding_in_run(w, run) >= o.prefetch_factor
        };
        while self.failed.is_none() && set.in_flight_of(run) + self.ready.len() < window {
            // In order, requests go strictly round-robin over the streams still running
            // (torch's order, whatever the timing): the worker whose turn it is gets the
            // next request, or none is sent until it has room. Out of order, a busy
            // worker is passed over.
            let candidates = (0..n)
                .map(|k| (self.round_robin + k) % n)
                .filter(|&w| !self.exhausted[w]);
            let next = if o.in_order {
                candidates.take(1).find(|&w| !busy(set, w))
            } else {
                candidates.take(n).find(|&w| !busy(set, w))
            };
            let Some(id) = next else {
                break;
            };
            if id >= set.len() {
                // Its turn, but it has not started yet: the next call starts it.
                break;
            }
            // Where this worker's stream resumes: sent with its first task of the run.
            let from = self.resume_from.get_mut(id).and_then(Option::take);
            let task = Task {
                run: self.run,
                epoch: self.epoch,
                batch: self.next_send,
                indices: Vec::new(),
                from,
            };
            set.send(
                id,
                Sent {
                    task,
                    retried: false,
                },
            )?;
            self.next_send += 1;
            self.round_robin = id + 1;
        }
        Ok(())
    }

    fn all_done(&self) -> bool {
        let streams_ended = !self.exhausted.is_empty() && self.exhausted.iter().all(|&e| e);
        let in_flight = self
            .loader
            .workers
            .as_ref()
            .map_or(0, |s| s.in_flight_of(self.run));
        streams_ended && in_flight == 0 && self.ready.is_empty()
    }
}

impl<D, C> Iterator for IterableEpoch<'_, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    type Item = Result<C::Batch>;

    fn next(&mut self) -> Option<Result<C::Batch>> {
        let start = Instant::now();
        let next = match self.loader.stage.clone() {
            Some(stage) if stage.ahead() > 0 => {
                let mut staged = std::mem::take(&mut self.staged);
                let next = stage.next(&mut staged, || {
                    match self.pull_ahead(|epoch| Poll::Ready(epoch.next_blocking())) {
                        Poll::Ready(next) => next,
                        Poll::Pending => None, // a blocking pull is always ready
                    }
                });
                self.staged = staged;
                self.hand_over(next)
            }
            _ => {
                let next = self.next_blocking();
                self.pinned(next)
            }
        };
        self.loader.stats.waiting += start.elapsed();
        next
    }
}

impl<D, C> IterableEpoch<'_, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
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
}

impl<D, C> IterableEpoch<'_, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// The next batch (the iterator's `next` and the stream's `poll_next`, less their
    /// accounting), waiting for the workers through `wait`; `Pending` only when `wait`
    /// is (as `Epoch::next_inner`).
    fn next_inner(&mut self, wait: &mut WaitFn<'_, C::Batch>) -> Poll<Option<Result<C::Batch>>> {
        Poll::Ready(match self.next_loop(wait) {
            Some(next) => next,
            None => return Poll::Pending,
        })
    }

    /// `next_inner`'s body: `None` when `wait` is pending.
    fn next_loop(&mut self, wait: &mut WaitFn<'_, C::Batch>) -> Option<Option<Result<C::Batch>>> {
        if self.finished {
            return Some(None);
        }
        if self.loader.options.num_workers == 0 {
            return Some(self.next_in_process());
        }
        let in_order = self.loader.options.in_order;
        loop {
            if let Err(e) = self.fill() {
                return Some(self.fail(e));
            }
            if in_order {
                while let Some((worker, answer, cursor)) = self.ready.remove(&self.next_yield) {
                    self.next_yield += 1;
                    self.passed(worker, cursor);
                    if let Some(batch) = answer {
                        self.loader.stats.batches += 1;
                        self.delivered = true;
                        return Some(Some(Ok(batch)));
                    }
                }
                let next = self.next_yield;
                if let Some((_, e)) = self.failed.take_if(|(b, _)| *b == next) {
                    return Some(self.fail(e));
                }
            }
            if self.all_done() {
                return Some(self.ended());
            }
            let epoch = self.run;
            let Some(set) = self.loader.workers.as_mut() else {
                return Some(self.fail(Error::Closed("data loader: the workers are gone".into())));
            };
            // While workers are still to start, only look at what has arrived, and go
            // on starting them.
            let starting = set.len() < self.loader.options.num_workers
                && may_start(set.len(), self.delivered, set.in_flight_of(epoch));
            let deadline = if starting {
                Some(Instant::now())
            } else {
                let timeout = self.loader.options.timeout;
                *self
                    .deadline
                    .get_or_insert_with(|| crate::sys::socket::deadline_after(timeout))
            };
            let arrival = match wait(set, epoch, deadline) {
                Poll::Ready(arrival) => arrival,
                Poll::Pending => return None,
            };
            if !starting {
                self.deadline = None;
            }
            match arrival {
                Err(e) => return Some(self.fail(e)),
                Ok(None) if starting => {}
                Ok(None) => {
                    let timeout = self.loader.options.timeout.unwrap_or_default();
                    let who = set
                        .oldest(epoch)
                        .map(|(w, p, s)| {
                            format!(
                                ": worker {w} ({} {p}) still holds batch {}",
                                self.loader.options.kind.label(),
                                s.task.batch
                            )
                        })
                        .unwrap_or_default();
                    return Some(self.fail(Error::timeout(
                        format!("data loader: the next batch{who}"),
                        Some(timeout),
                    )));
                }
                Ok(Some(Arrival::Loaded {
                    worker,
                    batch,
                    data,
                    cursor,
                    timing,
                })) => {
                    self.loader.stats.add(&timing);
                    let cursor = cursor.unwrap_or(Cursor::Unknown);
                    if !in_order {
                        self.passed(worker, cursor);
                        self.loader.stats.batches += 1;
                        self.delivered = true;
                        return Some(Some(Ok(data)));
                    }
                    self.ready.insert(batch, (worker, Some(data), cursor));
                }
                Ok(Some(Arrival::Exhausted { worker, batch })) => {
                    if let Some(e) = self.exhausted.get_mut(worker) {
                        *e = true;
                    }
                    if in_order {
                        self.ready.insert(batch, (worker, None, Cursor::Done));
                    } else {
                        self.passed(worker, Cursor::Done);
                    }
                }
                Ok(Some(Arrival::Failed {
                    worker,
                    pid,
                    sent,
                    what,
                })) => {
                    let batch = sent.task.batch;
                    let error = Error::LoaderFailed {
                        worker: Some(worker),
                        pid,
                        batch,
                        indices: Vec::new(),
                        message: format!(
                            "data loader worker {worker} ({} {pid}) failed on batch {batch} \
                             of its iterable data set: {what}",
                            self.loader.options.kind.label()
                        ),
                    };
                    if !in_order {
                        return Some(self.fail(error));
                    }
                    if self.failed.as_ref().is_none_or(|(b, _)| batch < *b) {
                        self.failed = Some((batch, error));
                    }
                }
            }
        }
    }
}

impl<D, C> Drop for IterableEpoch<'_, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    fn drop(&mut self) {
        if !self.loader.options.persistent_workers {
            self.loader.stop_workers();
        }
    }
}

#[cfg(feature = "async")]
pub use stream::IterableEpochStream;

/// The iterable epoch as a `futures_core::Stream` (feature `async`).
#[cfg(feature = "async")]
mod stream {
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Instant;

    use serde::Serialize;
    use serde::de::DeserializeOwned;

    use super::{IterableDataLoader, IterableEpoch};
    use crate::data::collate::Collate;
    use crate::data::dataset::IterableDataset;
    use crate::data::worker_set::WorkerSet;
    use crate::error::Result;
    use crate::sys::reactor::Parked;

    /// One epoch of an [`IterableDataLoader`] as a [`futures_core::Stream`] of
    /// `Result<Batch>` (feature `async`), made by [`IterableDataLoader::stream`] or
    /// [`IterableEpoch::into_stream`]: what the iterator yields, parking on the
    /// workers' results queue where the iterator blocks. As
    /// [`EpochStream`](crate::data::EpochStream): a worker's death wakes it at once, the
    /// timeout wakes it at its deadline, `num_workers(0)` loads in `poll_next`,
    /// `pin_memory` and `prefetch_to` are applied as by the iterator (the copies awaited
    /// as `EpochStream` awaits them), and dropping the stream is dropping the epoch.
    pub struct IterableEpochStream<'a, D, C>
    where
        D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// The registration while a poll is pending.
        parked: Option<Parked>,
        epoch: IterableEpoch<'a, D, C>,
        /// When the caller started waiting for the item being polled.
        since: Option<Instant>,
    }

    // Nothing in the stream is pinned in place: the epoch's state and the reactor
    // registration may move between polls.
    impl<D, C> Unpin for IterableEpochStream<'_, D, C>
    where
        D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
    }

    impl<'a, D, C> IterableEpoch<'a, D, C>
    where
        D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// This epoch as a [`futures_core::Stream`] (feature `async`): see
        /// [`IterableEpochStream`].
        pub fn into_stream(self) -> IterableEpochStream<'a, D, C> {
            IterableEpochStream {
                parked: None,
                epoch: self,
                since: None,
            }
        }
    }

    impl<'a, D, C> IterableEpochStream<'a, D, C>
    where
        D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// The epoch behind the stream (its number, state, workers' pids).
        pub fn epoch(&self) -> &IterableEpoch<'a, D, C> {
            &self.epoch
        }
    }

    impl<D, C> futures_core::Stream for IterableEpochStream<'_, D, C>
    where
        D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        type Item = Result<C::Batch>;

        fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let this = self.get_mut();
            let start = *this.since.get_or_insert_with(Instant::now);
            let parked = &mut this.parked;
            let epoch = &mut this.epoch;
            let next = match epoch.loader.stage.clone() {
                Some(stage) if stage.ahead() > 0 => {
                    let mut staged = std::mem::take(&mut epoch.staged);
                    let next = stage.poll_next(&mut staged, cx, |cx| {
                        let mut wait = |set: &mut WorkerSet<C::Batch>, run, deadline| {
                            set.poll_wait(cx, parked, run, deadline)
                        };
                        epoch.pull_ahead(|epoch| epoch.next_inner(&mut wait))
                    });
                    epoch.staged = staged;
                    match next {
                        Poll::Ready(next) => epoch.hand_over(next),
                        Poll::Pending => return Poll::Pending,
                    }
                }
                _ => {
                    let mut wait = |set: &mut WorkerSet<C::Batch>, run, deadline| {
                        set.poll_wait(cx, parked, run, deadline)
                    };
                    match epoch.next_inner(&mut wait) {
                        Poll::Ready(next) => epoch.pinned(next),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            };
            this.since = None;
            this.epoch.loader.stats.waiting += start.elapsed();
            Poll::Ready(next)
        }
    }

    impl<D, C> IterableDataLoader<D, C>
    where
        D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
        C: Collate<D::Item> + 'static,
    {
        /// One epoch as a [`futures_core::Stream`] of batches (feature `async`): what
        /// [`iter`](Self::iter) yields, awaited without blocking a thread (see
        /// [`IterableEpochStream`]).
        pub fn stream(&mut self) -> IterableEpochStream<'_, D, C> {
            self.iter().into_stream()
        }
    }
}
