//! [`DataLoader`]: a data set, a sampler, a collate function and the settings, and the
//! worker processes that persist between epochs; each [`iter`](DataLoader::iter) is
//! one [`Epoch`](super::Epoch), made in `epoch` (which also says how an epoch runs).

use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::batch_plan::batch_plan;
use super::collate::{Collate, DefaultCollate};
use super::dataset::Dataset;
use super::device_stage::DeviceStage;
use super::options::Options;
use super::sampler::Sampler;
use super::state::{Done, EpochState, LoaderState, MapProgress, MapState, fingerprint};
use super::stats::LoaderStats;
use super::worker_set::{STOP_GRACE, WorkerSet};
use crate::error::{Error, Result};

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
    pub(super) dataset: D,
    pub(super) collate: C,
    pub(super) sampler: Box<dyn Sampler>,
    pub(super) options: Options,
    /// The running workers: started by an epoch, kept between epochs when persistent.
    pub(super) workers: Option<WorkerSet<C::Batch>>,
    /// The number the next [`iter`](Self::iter) gives its epoch.
    pub(super) next_epoch: u64,
    /// The number of the next `iter()` (tasks carry it).
    pub(super) next_run: u64,
    /// The epoch running, or the last one run: what `state_dict` reports.
    pub(super) progress: Option<MapProgress>,
    /// Where the next `iter()` resumes, from `load_state_dict`.
    pub(super) resume: Option<MapProgress>,
    /// Where the epoch's time went.
    pub(super) stats: LoaderStats,
    /// What happens to each batch in this process before it is yielded (`pin_memory`,
    /// `prefetch_to`).
    pub(super) stage: Option<Arc<DeviceStage<C::Batch>>>,
}

impl<D, C> DataLoader<D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    pub(super) fn new(
        dataset: D,
        collate: C,
        sampler: Box<dyn Sampler>,
        options: Options,
        stage: Option<DeviceStage<C::Batch>>,
    ) -> Self {
        DataLoader {
            dataset,
            collate,
            sampler,
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

    /// The pids of the running workers, by worker id (empty when none run; thread
    /// workers give their thread ids).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers
            .as_ref()
            .map(WorkerSet::pids)
            .unwrap_or_default()
    }

    /// Sets the number of the next epoch (torch's `sampler.set_epoch`); epochs count
    /// from 0 and each [`iter`](Self::iter) takes the next. The epoch reaches the
    /// sampler and, through [`Dataset::set_epoch`], every copy of the data set —
    /// persistent workers' included.
    ///
    /// A state loaded and not yet run is kept when it is of this epoch (a training loop
    /// that calls `set_epoch(e)` before each epoch resumes mid-epoch as it should), and
    /// dropped for another epoch.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
        if self.resume.as_ref().is_some_and(|r| r.epoch != epoch) {
            self.resume = None;
        }
        if self.progress.as_ref().is_some_and(|p| p.epoch != epoch) {
            self.progress = None;
        }
    }

    /// Where the time of the epoch running (or the last one run) went: the caller's
    /// waiting, the workers' loading and collating, the hand-over.
    pub fn stats(&self) -> LoaderStats {
        self.stats
    }

    /// Where the loader stands: the epoch in progress and the batches of it yielded so
    /// far (batches loading or waiting are not counted: a resume loads them again), or
    /// the next epoch between epochs. While an epoch runs, [`Epoch::state_dict`](super::Epoch::state_dict) gives
    /// the same.
    ///
    /// The cost is a copy of a few numbers (and of the batch numbers yielded out of
    /// order); keeping it current costs a counter per batch.
    pub fn state_dict(&self) -> LoaderState {
        let p = match (&self.resume, &self.progress) {
            (Some(p), _) => p,
            (None, Some(p)) if p.done.prefix < p.batches => p,
            _ => return LoaderState::at_epoch(self.next_epoch),
        };
        let taken = (p.done.prefix * self.options.batch_size).min(p.samples);
        LoaderState::within(
            p.epoch,
            EpochState::Map(MapState {
                start: p.start,
                position: self.sampler.position_after(p.start, taken),
                prefix: p.done.prefix,
                beyond: p.done.beyond.iter().copied().collect(),
                shard: self.sampler.shard().unwrap_or((0, 1)),
                batch_size: self.options.batch_size,
                drop_last: self.options.drop_last,
                dataset_len: self.dataset.len(),
                fingerprint: p.fingerprint,
                order: p.order,
            }),
        )
    }

    /// Resumes from `state` (taken by [`state_dict`](Self::state_dict) of a loader
    /// built the same way): the next [`iter`](Self::iter) runs the state's epoch, less
    /// the batches it says were yielded, and the epochs after it follow.
    ///
    /// Elastic resume: when the state was taken with another sampler shard (another
    /// rank or world size of a [`DistributedSampler`](super::DistributedSampler)), batch size or `drop_last`, the
    /// epoch continues from the state's global [`position`](LoaderState::position) —
    /// the samples every rank took together — sharded anew: over all ranks, no sample
    /// of the epoch is repeated or skipped. Ranks must have taken the same number of
    /// batches (as data-parallel training does), and the global order must be the same
    /// (same data set, same seed; [`RandomSampler`](super::RandomSampler) and a
    /// shuffled `DistributedSampler` of one seed share it).
    ///
    /// Running workers (persistent ones) are kept.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], and the loader unchanged, when the state is of
    /// another format version, of an iterable loader, of a data set of another length,
    /// of a sampler that orders the epoch otherwise (another seed), past this epoch's
    /// batches, or taken out of order with batches yielded early at
    /// another shard or batch size (those cannot be carried over: take states in order
    /// for elastic resumes).
    pub fn load_state_dict(&mut self, state: &LoaderState) -> Result<()> {
        let Some(progress) = state.checked()? else {
            self.progress = None;
            self.resume = None;
            self.next_epoch = state.epoch();
            return Ok(());
        };
        let EpochState::Map(m) = progress else {
            return Err(Error::InvalidArgument(
                "data loader state: this state is of an iterable data set's loader; load it \
                 with IterableDataLoader::load_state_dict"
                    .into(),
            ));
        };
        let len = self.dataset.len();
        if m.dataset_len != len {
            return Err(Error::InvalidArgument(format!(
                "data loader state: it was taken over a data set of {} samples, this loader's \
                 has {len}: resume with the same data set",
                m.dataset_len
            )));
        }
        let (batch_size, drop_last) = (self.options.batch_size, self.options.drop_last);
        let shard = self.sampler.shard().unwrap_or((0, 1));
        let exact = m.shard == shard && m.batch_size == batch_size && m.drop_last == drop_last;
        let (start, done) = if exact {
            let mut done = Done {
                prefix: m.prefix,
                ..Done::default()
            };
            for &b in &m.beyond {
                done.mark(b);
            }
            (m.start, done)
        } else if m.beyond.is_empty() {
            (m.position, Done::default())
        } else {
            return Err(Error::InvalidArgument(format!(
                "data loader state: it was taken out of order, with batches {:?} yielded \
                 early, by rank {} of {} with batch size {}; this loader is rank {} of {} with \
                 batch size {batch_size}: only a state whose yielded batches are a prefix can \
                 move to another shard or batch size (take it with in_order(true))",
                m.beyond, m.shard.0, m.shard.1, m.batch_size, shard.0, shard.1
            )));
        };
        let plan = batch_plan(
            self.sampler.indices_from(state.epoch(), start),
            batch_size,
            drop_last,
        );
        let print = fingerprint(&plan);
        let order = self.sampler.global_order_hash(state.epoch());
        if (exact && print != m.fingerprint) || (m.order != 0 && order != m.order) {
            return Err(Error::InvalidArgument(format!(
                "data loader state: this loader's sampler orders epoch {} otherwise than the \
                 one the state was taken with (another seed, sampler or data set?): resume \
                 with the same ones",
                state.epoch()
            )));
        }
        if let Some(&b) = done.beyond.iter().next_back() {
            if b >= plan.len() {
                return Err(Error::InvalidArgument(format!(
                    "data loader state: batch {b} was yielded, but epoch {} has {} batches \
                     here: resume with the same sampler and data set",
                    state.epoch(),
                    plan.len()
                )));
            }
        }
        if done.prefix > plan.len() {
            return Err(Error::InvalidArgument(format!(
                "data loader state: {} batches were yielded, but epoch {} has {} here: \
                 resume with the same sampler and data set",
                done.prefix,
                state.epoch(),
                plan.len()
            )));
        }
        self.next_epoch = state.epoch();
        self.progress = None;
        self.resume = Some(MapProgress {
            epoch: state.epoch(),
            start,
            batches: plan.len(),
            samples: plan.iter().map(Vec::len).sum(),
            done,
            fingerprint: print,
            order,
        });
        Ok(())
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
    /// The pids of the running workers (for `Debug` and [`Epoch::worker_pids`]).
    pub(super) fn worker_pids_inner(&self) -> Vec<u32> {
        self.workers
            .as_ref()
            .map(WorkerSet::pids)
            .unwrap_or_default()
    }

    /// Stops the running workers, if any.
    pub(super) fn stop_workers(&mut self) {
        if let Some(set) = self.workers.take() {
            set.stop(STOP_GRACE);
        }
    }
}
