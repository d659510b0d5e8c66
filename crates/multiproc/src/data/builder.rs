//! [`DataLoaderBuilder`]: torch's `DataLoader(...)` keyword arguments, as a builder.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::collate::{Collate, DefaultCollate, Stack};
use super::dataset::{Dataset, IterableDataset};
use super::device_stage::DeviceStage;
use super::iterable_loader::IterableDataLoader;
use super::loader::DataLoader;
use super::options::Options;
use super::sampler::{RandomSampler, Sampler, SequentialSampler};
use super::worker_kind::WorkerKind;
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::process::StartMethod;

/// How to order the samples, as chosen on the builder.
enum Order {
    Sequential,
    Shuffle(u64),
    Custom(Box<dyn Sampler>),
}

/// Builds a [`DataLoader`]; made by [`DataLoader::builder`].
///
/// Defaults (torch's): batch size 1, sequential order, no `drop_last`, 0 workers
/// (loading in this process), prefetch factor 2, workers stopped at the end of each
/// epoch, no timeout, batches in sampler order, [`StartMethod::Spawn`].
pub struct DataLoaderBuilder<D, C = DefaultCollate> {
    dataset: D,
    collate: C,
    order: Order,
    options: Options,
    /// The rank set by [`rank`](Self::rank), over the sampler's.
    rank: Option<usize>,
}

impl<D> DataLoaderBuilder<D, DefaultCollate> {
    /// A builder for a loader of `dataset` with the defaults; the same as
    /// [`DataLoader::builder`], which is for samples the default collate can stack.
    pub fn new(dataset: D) -> Self {
        DataLoaderBuilder {
            dataset,
            collate: DefaultCollate,
            order: Order::Sequential,
            rank: None,
            options: Options {
                batch_size: 1,
                drop_last: false,
                num_workers: 0,
                prefetch_factor: 2,
                persistent_workers: false,
                timeout: None,
                in_order: true,
                restart_workers: false,
                start_method: StartMethod::Spawn,
                kind: WorkerKind::Process,
                seed: 0x6d75_6c74_6970_726f,
                rank: 0,
                worker_init: None,
                pin_memory: false,
                prefetch_to: None,
                #[cfg(feature = "progress")]
                progress: false,
            },
        }
    }
}

impl<D, C> DataLoaderBuilder<D, C> {
    /// Samples per batch (default 1).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.options.batch_size = batch_size;
        self
    }

    /// Shuffle every epoch: the order is a function of `seed` and the epoch number, so
    /// a run repeats and epochs differ (torch's `shuffle=True` with a seeded generator).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.order = Order::Shuffle(seed);
        self
    }

    /// Which indices to load, in which order (replaces [`shuffle`](Self::shuffle)).
    pub fn sampler(mut self, sampler: impl Sampler + 'static) -> Self {
        self.order = Order::Custom(Box::new(sampler));
        self
    }

    /// Drop the last batch when it is short (default: keep it).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.options.drop_last = drop_last;
        self
    }

    /// Worker processes (default 0: load in this process, like torch).
    pub fn num_workers(mut self, num_workers: usize) -> Self {
        self.options.num_workers = num_workers;
        self
    }

    /// Batches each worker may have in flight (default 2): at most
    /// `num_workers × prefetch_factor` batches are loading or waiting to be taken.
    pub fn prefetch_factor(mut self, prefetch_factor: usize) -> Self {
        self.options.prefetch_factor = prefetch_factor;
        self
    }

    /// Keep the workers between epochs (default: stop them at the end of each epoch).
    pub fn persistent_workers(mut self, persistent: bool) -> Self {
        self.options.persistent_workers = persistent;
        self
    }

    /// A function each worker runs with its id when it starts (torch's
    /// `worker_init_fn`); [`worker_info`](super::worker_info) works there.
    pub fn worker_init(mut self, init: fn(usize)) -> Self {
        self.options.worker_init = Some(init);
        self
    }

    /// The base of the workers' seeds: [`WorkerInfo::seed`](super::WorkerInfo) is
    /// [`worker_seed`](super::worker_seed)`(seed, epoch, rank, worker id)`.
    pub fn seed(mut self, seed: u64) -> Self {
        self.options.seed = seed;
        self
    }

    /// This loader's rank among data-parallel ranks, for the workers' seeds
    /// ([`WorkerInfo::rank`](super::WorkerInfo)); default: the sampler's rank when it
    /// shards ([`DistributedSampler`](super::DistributedSampler)), else 0.
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// The longest wait for one batch; past it, the iteration yields
    /// [`Error::Timeout`] naming the worker that holds the batch (default: no limit).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = Some(timeout);
        self
    }

    /// `true` (default): batches come in sampler order. `false`: as they finish, so a
    /// slow batch does not hold up the others.
    pub fn in_order(mut self, in_order: bool) -> Self {
        self.options.in_order = in_order;
        self
    }

    /// On a worker failure (an `Err`, a panic, a death), restart that worker and retry
    /// the batch once instead of stopping (default: stop with the error).
    pub fn restart_workers(mut self, restart: bool) -> Self {
        self.options.restart_workers = restart;
        self
    }

    /// Worker processes (the default) or threads: see [`WorkerKind`] for what
    /// isolation each gives. The API, the batches and the failure report are the same.
    pub fn workers(mut self, kind: WorkerKind) -> Self {
        self.options.kind = kind;
        self
    }

    /// How worker processes are started (default [`StartMethod::Spawn`]).
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.options.start_method = method;
        self
    }

    /// Show a progress bar on stderr with batches/s and samples/s (feature `progress`).
    #[cfg(feature = "progress")]
    pub fn progress(mut self, show: bool) -> Self {
        self.options.progress = show;
        self
    }

    /// Page-lock the shared memory batches arrive in (torch's `pin_memory=True`; feature
    /// `cuda`). Each shared block a batch's tensors live in is registered with the CUDA
    /// driver once, in this process (`cuMemHostRegister`, portable: pinned for every
    /// context), so the batch is page-locked where the worker wrote it, with no copy
    /// (torch copies every batch into pinned memory in a thread instead), and its
    /// copies to a device run at the bus's speed. A block stays registered while this
    /// process maps it: the worker recycles blocks, so after the first few batches no
    /// batch costs a registration; a block is unregistered when this process unmaps
    /// it. Tensors a collate makes in private memory are moved into shared memory first.
    /// [`Tensor::is_pinned`](crate::Tensor::is_pinned) tells.
    ///
    /// Errors at [`build`](Self::build): without the `cuda` feature or a CUDA device,
    /// with a collate that does not say how to reach its batch's tensors
    /// ([`Collate::batch_tensors`]; the default collate does), or with `Fork` worker
    /// processes. Iterable data sets too ([`build_iterable`](Self::build_iterable)).
    pub fn pin_memory(mut self, pin: bool) -> Self {
        self.options.pin_memory = pin;
        self
    }

    /// Hand over batches already on `device`, copied there on a stream of the loader's
    /// own, `n` batches ahead (feature `cuda`): while the caller works on batch `k`, the
    /// copies of batches `k + 1 ..= k + n` run. Each tensor of the batch is replaced by
    /// a contiguous copy on the device (tensors there already stay); the host blocks are
    /// pinned first, as with [`pin_memory`](Self::pin_memory), so the copies run while
    /// the caller goes on. A batch's copy is **complete** when the iterator returns it
    /// (its event was waited for), so the batch can be used on any stream. Pulling a
    /// batch ahead waits for the workers as the next batch would; the state
    /// ([`DataLoader::state_dict`](super::DataLoader::state_dict)) counts only the
    /// batches handed over. The device tensors come from this process's CUDA pool,
    /// which waits for the device before it hands a recycled allocation out again
    /// (see [`crate::cuda`]): a batch's copy starts after the work queued before the
    /// `next` that pulls it, so a loop that waits for each step (reads its loss)
    /// overlaps each step with the next batches' copies, and one that never waits
    /// overlaps less.
    ///
    /// Errors at [`build`](Self::build): as `pin_memory`, and for `n == 0`, a CPU
    /// device, or a device index this process does not see. Iterable data sets too: the
    /// state ([`IterableDataLoader::state_dict`](super::IterableDataLoader::state_dict))
    /// then also counts only the batches handed over.
    pub fn prefetch_to(mut self, device: Device, n: usize) -> Self {
        self.options.prefetch_to = Some((device, n));
        self
    }

    /// Collate with `collate` instead of [`DefaultCollate`].
    pub fn collate<C2>(self, collate: C2) -> DataLoaderBuilder<D, C2> {
        DataLoaderBuilder {
            dataset: self.dataset,
            collate,
            order: self.order,
            options: self.options,
            rank: self.rank,
        }
    }
}

impl<D, C> DataLoaderBuilder<D, C>
where
    D: Dataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// The loader.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a batch size or prefetch factor of 0, or a
    /// sampler that would visit an index outside the data set; for
    /// [`pin_memory`](Self::pin_memory) and [`prefetch_to`](Self::prefetch_to), what
    /// they say.
    pub fn build(mut self) -> Result<DataLoader<D, C>> {
        self.options.check()?;
        let stage = DeviceStage::new(&self.options, self.collate.batch_tensors())?;
        let len = self.dataset.len();
        let sampler: Box<dyn Sampler> = match self.order {
            Order::Sequential => Box::new(SequentialSampler::new(len)),
            Order::Shuffle(seed) => Box::new(RandomSampler::new(len, seed)),
            Order::Custom(s) => s,
        };
        self.options.rank = self
            .rank
            .or_else(|| sampler.shard().map(|(rank, _)| rank))
            .unwrap_or(0);
        Ok(DataLoader::new(
            self.dataset,
            self.collate,
            sampler,
            self.options,
            stage,
        ))
    }
}

impl<D, C> DataLoaderBuilder<D, C>
where
    D: IterableDataset + Serialize + DeserializeOwned + Clone + 'static,
    C: Collate<D::Item> + 'static,
{
    /// A loader of an iterable data set: each worker batches its own stream.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a batch size or prefetch factor of 0, when a
    /// sampler or shuffle was set (a stream has no indices: shuffle inside the data
    /// set, seeded by [`WorkerInfo::seed`](super::WorkerInfo)); the errors of
    /// [`pin_memory`](Self::pin_memory) and [`prefetch_to`](Self::prefetch_to).
    pub fn build_iterable(mut self) -> Result<IterableDataLoader<D, C>> {
        self.options.check()?;
        self.options.rank = self.rank.unwrap_or(0);
        if !matches!(self.order, Order::Sequential) {
            return Err(Error::InvalidArgument(
                "data loader: an iterable data set has no indices to sample or shuffle; \
                 shuffle inside the data set (seed it with worker_info().seed)"
                    .into(),
            ));
        }
        let stage = DeviceStage::new(&self.options, self.collate.batch_tensors())?;
        Ok(IterableDataLoader::new(
            self.dataset,
            self.collate,
            self.options,
            stage,
        ))
    }
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
