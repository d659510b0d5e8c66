//! [`DataLoader`]: a data set, a sampler, a collate function and the settings, and the
//! worker processes that persist between epochs; each [`iter`](DataLoader::iter) is
//! one [`Epoch`](super::Epoch), made in `epoch` (which also says how an epoch runs).

use std::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::collate::{Collate, DefaultCollate};
use super::dataset::Dataset;
use super::options::Options;
use super::sampler::Sampler;
use super::worker_set::{STOP_GRACE, WorkerSet};

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
    pub(super) fn worker_pids_inner(&self) -> Vec<i32> {
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
