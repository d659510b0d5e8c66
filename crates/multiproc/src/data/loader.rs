//! [`DataLoader`] and its per-epoch iterator [`Epoch`]: the batch plan, dispatch with a
//! bounded number of batches in flight, reordering, failures and the worker lifecycle.
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
use std::fmt;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::builder::{DataLoaderBuilder, Options};
use super::collate::{Collate, DefaultCollate, Stack};
use super::dataset::Dataset;
use super::sampler::Sampler;
use super::worker::{Task, load_batch, run_worker};
use super::worker_set::{Arrival, STOP_GRACE, Sent, WorkerSet};
use crate::{Error, Result};

/// torch's `DataLoader`: batches of a [`Dataset`], loaded by worker processes and
/// handed over as shared-memory tensors, with no copy between worker and caller.
///
/// ```no_run
/// use multiproc::data::{DataLoader, Dataset};
/// use multiproc::{DType, Tensor};
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct Noise(usize);
///
/// impl Dataset for Noise {
///     type Item = (Tensor, i64);
///     fn len(&self) -> usize { self.0 }
///     fn get(&self, i: usize) -> multiproc::Result<(Tensor, i64)> {
///         Ok((Tensor::full(&[3, 32, 32], i as f64, DType::F32)?, (i % 10) as i64))
///     }
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     let mut loader = DataLoader::builder(Noise(1000))
///         .batch_size(64)
///         .shuffle(42)
///         .num_workers(2)
///         .build()?;
///     for epoch in 0..2 {
///         for batch in &mut loader {
///             let (images, labels) = batch?; // [64, 3, 32, 32] and [64]
///             let _ = (epoch, images.sum(), labels.shape());
///         }
///     }
///     Ok(())
/// }
/// ```
pub struct DataLoader<D: Dataset, C: Collate<D::Item> = DefaultCollate> {
    dataset: D,
    collate: C,
    sampler: Box<dyn Sampler>,
    options: Options,
    workers: Option<WorkerSet<C::Batch>>,
    next_epoch: u64,
}

impl<D> DataLoader<D, DefaultCollate>
where
    D: Dataset,
    D::Item: Stack,
{
    /// A builder for a loader of `dataset` (torch's `DataLoader(dataset, ...)`).
    ///
    /// The data set travels to each worker as a value (tensors inside as handles); for
    /// one that should be built in each worker instead, pass a
    /// [`FromFn`](super::FromFn). For samples the default collate cannot stack, start
    /// from [`DataLoaderBuilder::new`] and set a [`collate`](DataLoaderBuilder::collate).
    pub fn builder(dataset: D) -> DataLoaderBuilder<D> {
        DataLoaderBuilder::new(dataset)
    }
}

impl<D, C> DataLoader<D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    pub(crate) fn new(dataset: D, collate: C, sampler: Box<dyn Sampler>, options: Options) -> Self {
        DataLoader {
            dataset,
            collate,
            sampler,
            options,
            workers: None,
            next_epoch: 0,
        }
    }

    /// Batches per epoch.
    pub fn len(&self) -> usize {
        let n = self.sampler.len();
        if self.options.drop_last {
            n / self.options.batch_size
        } else {
            n.div_ceil(self.options.batch_size)
        }
    }

    /// Whether an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The data set (this process's copy).
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The number of worker processes (0: loading in this process).
    pub fn num_workers(&self) -> usize {
        self.options.num_workers
    }

    /// The pids of the running workers, by worker id (empty when none run).
    pub fn worker_pids(&self) -> Vec<i32> {
        self.workers
            .as_ref()
            .map(WorkerSet::pids)
            .unwrap_or_default()
    }

    /// Sets the number of the next epoch (torch's `sampler.set_epoch`); epochs count
    /// from 0 and each [`iter`](Self::iter) takes the next.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
    }

    /// One epoch: the batches in sampler order (or as they finish, without
    /// `in_order`). Workers start on the first `next`, unless persistent ones run.
    pub fn iter(&mut self) -> Epoch<'_, D, C> {
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let plan = batch_plan(
            self.sampler.indices(epoch),
            self.options.batch_size,
            self.options.drop_last,
        );
        #[cfg(feature = "progress")]
        let bar = self
            .options
            .progress
            .then(|| super::progress::Bar::new(plan.len(), epoch));
        Epoch {
            loader: self,
            epoch,
            plan,
            next_send: 0,
            next_yield: 0,
            yielded: 0,
            ready: BTreeMap::new(),
            failed: None,
            finished: false,
            #[cfg(feature = "progress")]
            bar,
        }
    }
}

impl<D: Dataset, C: Collate<D::Item>> Drop for DataLoader<D, C> {
    fn drop(&mut self) {
        if let Some(set) = self.workers.take() {
            set.stop(STOP_GRACE);
        }
    }
}

impl<D: Dataset, C: Collate<D::Item>> fmt::Debug for DataLoader<D, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataLoader")
            .field("options", &self.options)
            .field("workers", &self.worker_pids_inner())
            .finish_non_exhaustive()
    }
}

impl<D: Dataset, C: Collate<D::Item>> DataLoader<D, C> {
    fn worker_pids_inner(&self) -> Vec<i32> {
        self.workers
            .as_ref()
            .map(WorkerSet::pids)
            .unwrap_or_default()
    }

    fn stop_workers(&mut self) {
        if let Some(set) = self.workers.take() {
            set.stop(STOP_GRACE);
        }
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

/// The sampler's indices cut into batches.
fn batch_plan(indices: Vec<usize>, batch_size: usize, drop_last: bool) -> Vec<Vec<usize>> {
    indices
        .chunks(batch_size)
        .filter(|c| !drop_last || c.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// An error when the sampler gave an index outside the data set's `len` samples.
fn check_in_range(indices: &[usize], len: usize) -> Result<()> {
    match indices.iter().find(|&&i| i >= len) {
        None => Ok(()),
        Some(i) => Err(Error::InvalidArgument(format!(
            "data loader: the sampler gave index {i}, but the data set has {len} samples \
             (0..{len}): the sampler's length or indices do not match the data set"
        ))),
    }
}

/// A batch's sample indices for a message (the first 16, then how many more).
fn show_indices(indices: &[usize]) -> String {
    const SHOWN: usize = 16;
    if indices.len() <= SHOWN {
        format!("{indices:?}")
    } else {
        let head: Vec<String> = indices[..SHOWN].iter().map(usize::to_string).collect();
        format!("[{}, … {} more]", head.join(", "), indices.len() - SHOWN)
    }
}

/// One epoch of a [`DataLoader`]: yields `Result<Batch>`; made by
/// [`DataLoader::iter`] or `for batch in &mut loader`.
pub struct Epoch<'a, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    loader: &'a mut DataLoader<D, C>,
    epoch: u64,
    plan: Vec<Vec<usize>>,
    /// The next batch to send to a worker.
    next_send: usize,
    /// With `in_order`, the next batch to yield.
    next_yield: usize,
    yielded: usize,
    /// Batches that arrived ahead of `next_yield`.
    ready: BTreeMap<usize, C::Batch>,
    /// With `in_order`, the failure of the earliest batch that failed for good: yielded
    /// at its turn, and no batch is sent meanwhile.
    failed: Option<(usize, Error)>,
    finished: bool,
    #[cfg(feature = "progress")]
    bar: Option<super::progress::Bar>,
}

impl<D, C> Epoch<'_, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// This epoch's number (what the sampler was given).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The pids of the running workers, by worker id (as [`DataLoader::worker_pids`]).
    pub fn worker_pids(&self) -> Vec<i32> {
        self.loader.worker_pids_inner()
    }

    /// Ends the epoch with `error`: its workers are stopped.
    fn fail(&mut self, error: Error) -> Option<Result<C::Batch>> {
        self.finished = true;
        self.loader.stop_workers();
        Some(Err(error))
    }

    fn yield_batch(&mut self, batch: usize, data: C::Batch) -> Option<Result<C::Batch>> {
        self.yielded += 1;
        #[cfg(feature = "progress")]
        if let Some(bar) = &self.bar {
            bar.batch_done(self.plan[batch].len());
        }
        let _ = batch;
        Some(Ok(data))
    }

    /// The next batch loaded in this process (`num_workers(0)`).
    fn next_in_process(&mut self) -> Option<Result<C::Batch>> {
        let batch = self.next_yield;
        self.next_yield += 1;
        let indices = &self.plan[batch];
        if let Err(e) = check_in_range(indices, self.loader.dataset.len()) {
            return self.fail(e);
        }
        match load_batch(&self.loader.dataset, &self.loader.collate, indices) {
            Ok(data) => self.yield_batch(batch, data),
            Err(e) => {
                let error = Error::LoaderFailed {
                    worker: None,
                    pid: std::process::id() as i32,
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

    /// Sends batches to workers while the in-flight bound allows.
    fn fill(&mut self) -> Result<()> {
        let o = &self.loader.options;
        let window = o.num_workers * o.prefetch_factor;
        let per_worker = o.prefetch_factor;
        if self.loader.workers.is_none() {
            let (dataset, collate) = (&self.loader.dataset, &self.loader.collate);
            let set = WorkerSet::start(o.num_workers, &|id, generation, tasks, results| {
                super::worker::launch(
                    run_worker::<D, C>,
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
                tasks,
                results,
            )
        };
        let Some(set) = workers.as_mut() else {
            return Ok(());
        };
        while self.next_send < self.plan.len() && self.failed.is_none() {
            if set.in_flight() + self.ready.len() >= window {
                break;
            }
            let Some(id) = set.least_busy(per_worker) else {
                break;
            };
            set.ensure_alive(id, options.restart_workers, &launch)?;
            let batch = self.next_send;
            check_in_range(&self.plan[batch], len)?;
            let task = Task {
                epoch: self.epoch,
                batch,
                indices: self.plan[batch].clone(),
            };
            let retried = false;
            set.send(id, Sent { task, retried })?;
            self.next_send += 1;
        }
        Ok(())
    }

    /// What to do about a failed batch: retry it on a fresh worker, or end with it.
    fn on_failure(&mut self, worker: usize, pid: i32, sent: Sent, what: String) -> Option<Error> {
        let batch = sent.task.batch;
        let indices = sent.task.indices.clone();
        let again = if sent.retried {
            " again, after a restart"
        } else {
            ""
        };
        let message = format!(
            "data loader worker {worker} (pid {pid}) failed{again} on batch {batch} (samples {}): {what}",
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
        let set = workers.as_mut()?;
        let launch = |id, generation, tasks, results| {
            super::worker::launch(
                run_worker::<D, C>,
                dataset,
                collate,
                options,
                id,
                generation,
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
            set.and_then(|s| s.holder(self.epoch, self.next_yield))
                .map(|(w, p)| (w, p, self.next_yield))
        } else {
            set.and_then(|s| s.oldest(self.epoch))
                .map(|(w, p, sent)| (w, p, sent.task.batch))
        };
        match held {
            Some((worker, pid, batch)) => Error::timeout(
                format!(
                    "data loader: batch {batch} (samples {}), which worker {worker} (pid {pid}) \
                     still holds (raise the timeout or look at what that worker is doing),",
                    show_indices(&self.plan[batch])
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
        if self.finished || self.yielded == self.plan.len() {
            self.finished = true;
            return None;
        }
        if self.loader.options.num_workers == 0 {
            return self.next_in_process();
        }
        loop {
            if let Err(e) = self.fill() {
                return self.fail(e);
            }
            if self.loader.options.in_order {
                if let Some(data) = self.ready.remove(&self.next_yield) {
                    let batch = self.next_yield;
                    self.next_yield += 1;
                    return self.yield_batch(batch, data);
                }
                let next = self.next_yield;
                if let Some((_, e)) = self.failed.take_if(|(b, _)| *b == next) {
                    return self.fail(e);
                }
            }
            let deadline = self.loader.options.timeout.map(|t| Instant::now() + t);
            let Some(set) = self.loader.workers.as_mut() else {
                return self.fail(Error::Closed(
                    "data loader: the workers are gone (this is a multiproc bug)".into(),
                ));
            };
            match set.wait(self.epoch, deadline) {
                Err(e) => return self.fail(e),
                Ok(None) => {
                    let e = self.timeout_error();
                    return self.fail(e);
                }
                Ok(Some(Arrival::Exhausted { .. })) => {
                    return self.fail(Error::InvalidMessage(
                        "data loader: a map-style worker reported an exhausted iterator".into(),
                    ));
                }
                Ok(Some(Arrival::Loaded { batch, data })) => {
                    if self.loader.options.in_order {
                        self.ready.insert(batch, data);
                    } else {
                        return self.yield_batch(batch, data);
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
                            return self.fail(e);
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

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.finished {
            0
        } else {
            self.plan.len() - self.yielded
        };
        (0, Some(left))
    }
}

impl<D, C> Drop for Epoch<'_, D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    fn drop(&mut self) {
        #[cfg(feature = "progress")]
        if let Some(bar) = self.bar.take() {
            bar.finish(self.yielded == self.plan.len());
        }
        if !self.loader.options.persistent_workers {
            self.loader.stop_workers();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_cuts_batches_and_drops_the_short_tail_on_request() {
        assert_eq!(
            batch_plan((0..5).collect(), 2, false),
            [vec![0, 1], vec![2, 3], vec![4]]
        );
        assert_eq!(
            batch_plan((0..5).collect(), 2, true),
            [vec![0, 1], vec![2, 3]]
        );
    }

    #[test]
    fn long_index_lists_are_shortened_in_messages() {
        assert_eq!(show_indices(&[1, 2]), "[1, 2]");
        let long: Vec<usize> = (0..20).collect();
        assert!(show_indices(&long).ends_with("… 4 more]"));
    }
}
