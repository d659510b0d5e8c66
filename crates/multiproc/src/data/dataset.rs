//! What a loader loads from: the [`Dataset`] trait (torch's map-style data set) and
//! [`WorkerInfo`], which a data set reads in a worker to know where it runs (torch's
//! `get_worker_info`).
//!
//! A data set reaches the workers in one of two ways: as a value (it is
//! `Serialize + DeserializeOwned + Clone`, and each worker decodes its own copy;
//! tensors inside travel as handles, so a data set over a big shared tensor is not
//! copied), or built in each worker by a `fn` (for data sets holding open files,
//! decoders, or anything else that should not travel).

use std::cell::Cell;

use super::state::StreamState;
use crate::error::Result;

/// A map-style data set: `len` samples, sample `i` by [`get`](Self::get).
///
/// ```
/// use multiproc::data::Dataset;
/// use multiproc::{DType, Tensor};
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct Squares {
///     n: usize,
/// }
///
/// impl Dataset for Squares {
///     type Item = (Tensor, i64);
///     fn len(&self) -> usize {
///         self.n
///     }
///     fn get(&self, index: usize) -> multiproc::Result<(Tensor, i64)> {
///         let x = Tensor::full(&[4], (index * index) as f64, DType::F32)?;
///         Ok((x, index as i64))
///     }
/// }
/// ```
pub trait Dataset {
    /// One sample, as [`get`](Self::get) returns it and the collate function takes it.
    type Item;

    /// The number of samples.
    fn len(&self) -> usize;

    /// Whether the data set has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (`0..len()`).
    ///
    /// # Errors
    /// Whatever loading the sample can fail with; the loader reports it with the
    /// worker, its pid, the batch and the sample indices.
    fn get(&self, index: usize) -> Result<Self::Item>;

    /// Told the epoch before the epoch's first sample is loaded from this copy of the
    /// data set: in every worker (persistent ones included: the epoch travels with
    /// each batch, so a worker kept between epochs learns it too) and, with
    /// `num_workers(0)`, in the loader's own process. The default does nothing; a data
    /// set whose augmentations change with the epoch keeps it.
    fn set_epoch(&mut self, epoch: u64) {
        let _ = epoch;
    }
}

/// A stream of samples (torch's `IterableDataset`): each worker iterates its own
/// [`iter`](Self::iter), so a data set read from a stream, a socket or a sharded file
/// set splits the work itself, by [`worker_info`] (the worker's id and the number of
/// workers), as in torch. Without workers, `worker_info()` is `None`: iterate all.
///
/// ```
/// use multiproc::data::{IterableDataset, worker_info};
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct Range(usize);
///
/// impl IterableDataset for Range {
///     type Item = i64;
///     type Iter = Box<dyn Iterator<Item = multiproc::Result<i64>>>;
///     fn iter(&self, _epoch: u64) -> Self::Iter {
///         // Worker k of n takes k, k + n, k + 2n, …
///         let (k, n) = worker_info().map_or((0, 1), |w| (w.id, w.num_workers));
///         Box::new((k..self.0).step_by(n).map(|i| Ok(i as i64)))
///     }
/// }
/// ```
pub trait IterableDataset {
    /// One sample.
    type Item;
    /// The iterator of one worker's samples for one epoch.
    type Iter: Iterator<Item = Result<Self::Item>>;

    /// This worker's samples for epoch `epoch` (an `Err` item is reported with the
    /// worker and ends the epoch).
    fn iter(&self, epoch: u64) -> Self::Iter;

    /// Where `iter` stands (after the samples it has given), for a loader's
    /// [`state_dict`](super::IterableDataLoader::state_dict); `None` (the default): this
    /// data set cannot be resumed mid-epoch. The loader asks after every batch, so keep
    /// it cheap: a position, not data.
    fn state(&self, iter: &Self::Iter) -> Option<StreamState> {
        let _ = iter;
        None
    }

    /// This worker's samples for epoch `epoch`, continuing from `state` (what
    /// [`state`](Self::state) reported in the same worker of an earlier run).
    ///
    /// # Errors
    /// When the state cannot be resumed from; the default: always (the data set does
    /// not report states).
    fn iter_from(&self, epoch: u64, state: &StreamState) -> Result<Self::Iter> {
        let _ = (epoch, state);
        Err(crate::error::Error::InvalidArgument(format!(
            "the iterable data set {} cannot resume mid-epoch: implement \
             IterableDataset::state and iter_from",
            std::any::type_name::<Self>()
        )))
    }
}

/// Where the current code runs, inside a loader worker: torch's `get_worker_info()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerInfo {
    /// This worker's id, `0..num_workers`.
    pub id: usize,
    /// How many workers the loader has.
    pub num_workers: usize,
    /// The epoch of the batch being loaded (in `worker_init`: the epoch the worker
    /// was started for).
    pub epoch: u64,
    /// The loader's rank: its sampler's ([`DistributedSampler`](super::DistributedSampler))
    /// or the builder's [`rank`](super::DataLoaderBuilder::rank), else 0.
    pub rank: usize,
    /// This worker's seed for this epoch:
    /// [`worker_seed`](super::worker_seed)`(base seed, epoch, rank, id)`. Seed the
    /// worker's augmentations with it: workers, ranks and epochs differ, runs repeat.
    pub seed: u64,
}

thread_local! {
    static CURRENT: Cell<Option<WorkerInfo>> = const { Cell::new(None) };
}

/// The [`WorkerInfo`] of this process when it is a loader worker; `None` in the
/// loader's own process (`num_workers(0)` included), as in torch.
pub fn worker_info() -> Option<WorkerInfo> {
    CURRENT.with(Cell::get)
}

/// Records that this thread runs loader worker `info`.
pub(crate) fn set_worker_info(info: WorkerInfo) {
    CURRENT.with(|c| c.set(Some(info)));
}
