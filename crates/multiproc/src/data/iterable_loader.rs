//! [`IterableDataLoader`] and [`IterableEpoch`]: batches of an [`IterableDataset`],
//! each worker batching its own stream (torch's `DataLoader` over an
//! `IterableDataset`).
//!
//! Batches are numbered in the order they are requested, round-robin over the workers
//! that still have samples; with `in_order` they are yielded in that order (torch's
//! order), otherwise as they finish. A worker that answers "exhausted" gets no more
//! requests this epoch; the epoch ends when every worker is exhausted. A failure ends
//! the epoch: a fresh worker could not resume its predecessor's stream, so
//! `restart_workers` does not apply here. There is no sampler, so no `len`.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::collate::Collate;
use super::dataset::IterableDataset;
use super::options::Options;
use super::worker::{Outcome, Task, next_batch, run_iterable_worker};
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
}

impl<D, C> IterableDataLoader<D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    pub(crate) fn new(dataset: D, collate: C, options: Options) -> Self {
        IterableDataLoader {
            dataset,
            collate,
            options,
            workers: None,
            next_epoch: 0,
        }
    }

    /// The pids of the running workers, by worker id.
    pub fn worker_pids(&self) -> Vec<i32> {
        self.workers
            .as_ref()
            .map(WorkerSet::pids)
            .unwrap_or_default()
    }

    /// Sets the number of the next epoch (passed to [`IterableDataset::iter`]).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
    }

    /// One epoch.
    pub fn iter(&mut self) -> IterableEpoch<'_, D, C> {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let in_process = (self.options.num_workers == 0).then(|| self.dataset.iter(epoch));
        IterableEpoch {
            loader: self,
            epoch,
            next_send: 0,
            next_yield: 0,
            round_robin: 0,
            exhausted: Vec::new(),
            ready: BTreeMap::new(),
            failed: None,
            finished: false,
            in_process,
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
    next_send: usize,
    next_yield: usize,
    round_robin: usize,
    /// By worker id: whether its stream has ended this epoch.
    exhausted: Vec<bool>,
    /// With `in_order`: answered requests ahead of `next_yield` (`None`: exhausted).
    ready: BTreeMap<usize, Option<C::Batch>>,
    failed: Option<(usize, Error)>,
    finished: bool,
    in_process: Option<D::Iter>,
}

impl<D, C> IterableEpoch<'_, D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// The pids of the running workers, by worker id.
    pub fn worker_pids(&self) -> Vec<i32> {
        self.loader.worker_pids()
    }

    fn fail(&mut self, error: Error) -> Option<Result<C::Batch>> {
        self.finished = true;
        self.loader.stop_workers();
        Some(Err(error))
    }

    fn next_in_process(&mut self) -> Option<Result<C::Batch>> {
        let o = &self.loader.options;
        let batch = self.next_yield;
        match next_batch(
            &mut self.in_process,
            &self.loader.collate,
            o.batch_size,
            o.drop_last,
        ) {
            Outcome::Batch(b) => {
                self.next_yield += 1;
                Some(Ok(b))
            }
            Outcome::Exhausted => {
                self.finished = true;
                None
            }
            Outcome::Failed(what) => {
                let pid = std::process::id() as i32;
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
    fn fill(&mut self) -> Result<()> {
        let o = &self.loader.options;
        if self.loader.workers.is_none() {
            let (dataset, collate) = (&self.loader.dataset, &self.loader.collate);
            let set = WorkerSet::start(o.num_workers, &|id, generation, tasks, results| {
                super::worker::launch(
                    run_iterable_worker::<D, C>,
                    dataset,
                    collate,
                    o,
                    id,
                    generation,
                    tasks,
                    results,
                )
            })?;
            self.loader.workers = Some(set);
        }
        let Some(set) = self.loader.workers.as_mut() else {
            return Ok(());
        };
        if self.exhausted.len() != set.len() {
            self.exhausted = vec![false; set.len()];
        }
        let window = o.num_workers * o.prefetch_factor;
        while self.failed.is_none() && set.in_flight() + self.ready.len() < window {
            let n = set.len();
            let Some(id) = (0..n)
                .map(|k| (self.round_robin + k) % n)
                .find(|&w| !self.exhausted[w] && set.outstanding_of(w) < o.prefetch_factor)
            else {
                break;
            };
            let task = Task {
                epoch: self.epoch,
                batch: self.next_send,
                indices: Vec::new(),
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
            .map_or(0, |s| s.in_flight_of(self.epoch));
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
        if self.finished {
            return None;
        }
        if self.loader.options.num_workers == 0 {
            return self.next_in_process();
        }
        let in_order = self.loader.options.in_order;
        loop {
            if let Err(e) = self.fill() {
                return self.fail(e);
            }
            if in_order {
                while let Some(answer) = self.ready.remove(&self.next_yield) {
                    self.next_yield += 1;
                    if let Some(batch) = answer {
                        return Some(Ok(batch));
                    }
                }
                let next = self.next_yield;
                if let Some((_, e)) = self.failed.take_if(|(b, _)| *b == next) {
                    return self.fail(e);
                }
            }
            if self.all_done() {
                self.finished = true;
                return None;
            }
            let deadline = self.loader.options.timeout.map(|t| Instant::now() + t);
            let epoch = self.epoch;
            let Some(set) = self.loader.workers.as_mut() else {
                return self.fail(Error::Closed("data loader: the workers are gone".into()));
            };
            match set.wait(epoch, deadline) {
                Err(e) => return self.fail(e),
                Ok(None) => {
                    let timeout = self.loader.options.timeout.unwrap_or_default();
                    let who = set
                        .oldest(epoch)
                        .map(|(w, p, s)| {
                            format!(": worker {w} (pid {p}) still holds batch {}", s.task.batch)
                        })
                        .unwrap_or_default();
                    return self.fail(Error::timeout(
                        format!("data loader: the next batch{who}"),
                        Some(timeout),
                    ));
                }
                Ok(Some(Arrival::Loaded { batch, data })) => {
                    if !in_order {
                        return Some(Ok(data));
                    }
                    self.ready.insert(batch, Some(data));
                }
                Ok(Some(Arrival::Exhausted { worker, batch })) => {
                    if let Some(e) = self.exhausted.get_mut(worker) {
                        *e = true;
                    }
                    if in_order {
                        self.ready.insert(batch, None);
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
                            "data loader worker {worker} (pid {pid}) failed on batch {batch} \
                             of its iterable data set: {what}"
                        ),
                    };
                    if !in_order {
                        return self.fail(error);
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
