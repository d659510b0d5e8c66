//! Multi-process data loading: torch's `DataLoader` as a library type.
//!
//! - `dataset` — the [`Dataset`] (map-style) and [`IterableDataset`] traits, and
//!   [`WorkerInfo`] / [`worker_info`].
//! - `from_fn` — [`FromFn`], a data set built in each worker instead of sent (and the
//!   `worker_init` hook as it travels; the one unsafe corner of this module).
//! - `sampler` — [`Sampler`] and the sequential, random, weighted and distributed ones.
//! - `collate` — [`Collate`], [`DefaultCollate`] and [`Stack`]: samples into batch
//!   tensors made directly in shared memory.
//! - `builder` — [`DataLoaderBuilder`], torch's keyword arguments.
//! - `loader` — [`DataLoader`] and its per-epoch iterator [`Epoch`].
//! - `epoch` — [`Epoch`], one pass over the batch plan (and, feature `async`,
//!   `EpochStream`, the same pass as a `Stream`).
//! - `iterable_loader` — [`IterableDataLoader`] and [`IterableEpoch`], for streams.
//! - `worker` — the worker process: its messages and its body.
//! - `worker_kind` — [`WorkerKind`]: processes or threads, behind one handle.
//! - `worker_set` — the loader's side of its workers: dispatch, replies, deaths,
//!   restarts, stopping.
//! - `state` — [`LoaderState`] and [`StreamState`] (resuming mid-epoch), and
//!   [`worker_seed`].
//! - `stats` — [`LoaderStats`]: where an epoch's time went.
//! - `tensors` — [`Tensors`]: a batch that hands over its tensors, for `pin_memory` and
//!   `prefetch_to`.
//! - `device_stage` — what the trainer does to each batch before yielding it with
//!   `pin_memory` or `prefetch_to` (feature `cuda`).
//! - `shared_rows` — [`SharedRows`]: a data set's big read-only table, in shared
//!   memory once, reaching the workers by handle.
//! - `progress` — the optional progress bar (feature `progress`).
//! - `image_folder` — `ImageFolder`, PNG files decoded in the workers (feature
//!   `image`).
//!
//! A batch is made once, in a worker, in shared memory, and crosses to the caller by
//! handle. A worker that returns `Err`, panics or is killed is reported as
//! [`Error::LoaderFailed`](crate::Error::LoaderFailed) with its id, pid, the batch and
//! its sample indices; with [`restart_workers`](DataLoaderBuilder::restart_workers) the
//! worker is replaced and the batch retried once.
//!
//! # Epochs, runs and the global order
//!
//! An epoch is a number (0, 1, … or [`set_epoch`](DataLoader::set_epoch)). For a
//! map-style data set, the epoch's *global order* is the sampler's function of its seed
//! and the epoch alone — never of the world size or the number of workers: a
//! [`DistributedSampler`] takes every `world_size`-th position of it from its rank,
//! [`RandomSampler`] of the same seed is all of it, and the workers only load the
//! batches they are sent. Positions in that order are what resuming counts.
//!
//! Each [`iter`](DataLoader::iter) is a *run* of one epoch, numbered apart from the
//! epoch: every task and reply carries its run, so what workers still hold of an
//! abandoned run (an epoch dropped mid-way, then resumed on the same persistent
//! workers) is recognised and dropped, never yielded twice.
//!
//! The epoch reaches the data set everywhere it is loaded: each task carries it, and a
//! worker whose epoch changes calls [`Dataset::set_epoch`] on its copy and updates its
//! [`WorkerInfo`] — so persistent workers follow epochs like fresh ones.
//!
//! # Resuming mid-epoch
//!
//! [`DataLoader::state_dict`] (and [`Epoch::state_dict`] while an epoch runs) returns
//! a [`LoaderState`]: the epoch and which of its batches were *yielded* (a prefix, and
//! out of order the few past it). [`load_state_dict`](DataLoader::load_state_dict)
//! on a loader built the same way makes the next `iter` yield exactly the batches the
//! uninterrupted run would have: the rest of that epoch, then the next epochs.
//! Batches loading or waiting when the state was taken are not in it; they are
//! loaded again. Keeping the state current costs a counter per batch; taking it, a copy
//! of a few numbers.
//!
//! An [`IterableDataset`] resumes through the state it reports of its iterator
//! ([`IterableDataset::state`], [`IterableDataset::iter_from`]): each worker's reply
//! carries its stream's state after the batch, and the loader keeps, per worker, the
//! state after its last yielded batch and whose turn is next.
//!
//! **Elastic resume.** A map-style state also holds its global position: the samples
//! all ranks took together (ranks advance in lockstep). Loaded by a loader of another
//! shard (another rank or world size), batch size or `drop_last`, the epoch continues
//! from that position, sharded anew: over all ranks, no sample is repeated or skipped.
//!
//! # Workers
//!
//! Workers are processes or threads ([`WorkerKind`]: the API, the batches and the
//! failure report are the same; its docs say what isolation each gives). They start one
//! at a time between dispatches: worker 0 is sent its first batch before worker 1 is
//! started, and what has arrived is taken in between two starts, so a fresh loader's
//! first batch waits for one worker's start, not for all of them. Until a worker has
//! answered, at most as many workers start as the machine has cores (so the first
//! one's start does not share the cores with all the others'); the rest start then.
//!
//! A worker that dies is reported with the batch it held, the sample it was loading
//! (each worker writes the index it loads into a shared word), whether its memory
//! cgroup counted an OOM kill while it ran (`memory.events` or `memory.oom_control`,
//! readable without root), and its resident memory when last seen.
//!
//! A data set's big read-only state (an index, offsets, labels) belongs in a
//! [`SharedRows`] table: built once, in shared memory, it reaches every worker by
//! handle, so workers add no private memory for it.
//!
//! [`DataLoader::stats`] says where an epoch's time went: the caller waiting, the
//! workers loading and collating, the hand-over.
//!
//! # Async (feature `async`)
//!
//! `DataLoader::stream` (or `Epoch::into_stream`) is an epoch as a
//! `futures_core::Stream<Item = Result<Batch>>`, for a loader fed from an async
//! service: the same batches, order, failures and timeout as the iterator, through the
//! same code (`Epoch::next_inner`); only the wait differs — where `next` blocks on
//! the workers' results queue, `poll_next` parks on it with the crate's reactor
//! (`Queue::get_async`'s machinery). Dropping the stream is dropping the epoch. See
//! `EpochStream` for its limits (documented with the feature on).
//!
//! # Batches for a GPU (feature `cuda`)
//!
//! [`pin_memory`](DataLoaderBuilder::pin_memory) page-locks the shared blocks batches
//! arrive in, in this process, once per block, so a batch is pinned where the worker
//! wrote it (torch copies it into pinned memory instead).
//! [`prefetch_to`](DataLoaderBuilder::prefetch_to) hands over batches already on a
//! device, copied on a side stream `n` batches ahead, complete when handed over. Both
//! reach a batch's tensors through [`Collate::batch_tensors`]: the default collate's
//! batches (tensors, tuples of them) say how; a batch type of your own implements
//! [`Tensors`]. Both serve map-style and iterable data sets, through the iterator and
//! the async stream alike (the stream awaits the copies without blocking its thread);
//! a loader's state counts only the batches handed over, not those pulled ahead.
//!
//! # Seeds
//!
//! A worker's seed ([`WorkerInfo::seed`]) is [`worker_seed`]`(base, epoch, rank,
//! worker id)`, from the builder's [`seed`](DataLoaderBuilder::seed), the epoch of the
//! batch, the loader's rank (its sampler's, or [`rank`](DataLoaderBuilder::rank)) and
//! the worker id, each mixed in by splitmix64: no two workers, ranks or epochs share a
//! stream, and a run repeats.
//!
//! ```no_run
//! use multiproc::data::{DataLoader, Dataset};
//! use multiproc::{DType, Tensor};
//!
//! #[derive(Clone, serde::Serialize, serde::Deserialize)]
//! struct Ramp(usize);
//!
//! impl Dataset for Ramp {
//!     type Item = (Tensor, usize);
//!     fn len(&self) -> usize { self.0 }
//!     fn get(&self, i: usize) -> multiproc::Result<(Tensor, usize)> {
//!         Ok((Tensor::full(&[8], i as f64, DType::F32)?, i % 3))
//!     }
//! }
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init();
//!     let mut loader = DataLoader::builder(Ramp(100)).batch_size(10).num_workers(2).build()?;
//!     assert_eq!(loader.len(), 10);
//!     for batch in &mut loader {
//!         let (x, y) = batch?;
//!         assert_eq!((x.shape(), y.shape()), (&[10, 8][..], &[10][..]));
//!     }
//!     Ok(())
//! }
//! ```

mod batch_plan;
mod builder;
mod collate;
mod dataset;
mod device_stage;
mod epoch;
mod from_fn;
#[cfg(feature = "image")]
mod image_folder;
mod iterable_loader;
mod loader;
mod options;
#[cfg(feature = "progress")]
mod progress;
mod sampler;
mod shared_rows;
mod state;
mod stats;
mod tensors;
mod worker;
mod worker_kind;
mod worker_set;

pub use builder::DataLoaderBuilder;
pub use collate::{Collate, DefaultCollate, Stack};
pub use dataset::{Dataset, IterableDataset, WorkerInfo, worker_info};
pub use epoch::Epoch;
#[cfg(feature = "async")]
pub use epoch::EpochStream;
pub use from_fn::FromFn;
#[cfg(feature = "image")]
pub use image_folder::ImageFolder;
#[cfg(feature = "async")]
pub use iterable_loader::IterableEpochStream;
pub use iterable_loader::{IterableDataLoader, IterableEpoch};
pub use loader::DataLoader;
pub use sampler::{
    DistributedSampler, RandomSampler, Sampler, SequentialSampler, WeightedRandomSampler,
};
pub use shared_rows::SharedRows;
pub use state::{LoaderState, StreamState, worker_seed};
pub use stats::LoaderStats;
pub use tensors::{Tensors, VisitTensors};
pub use worker_kind::WorkerKind;
