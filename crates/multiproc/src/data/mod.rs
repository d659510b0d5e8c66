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
//! - `iterable_loader` — [`IterableDataLoader`] and [`IterableEpoch`], for streams.
//! - `worker` — the worker process: its messages and its body.
//! - `worker_set` — the loader's side of its workers: dispatch, replies, deaths,
//!   restarts, stopping.
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
mod state;
mod worker;
mod worker_set;

pub use builder::DataLoaderBuilder;
pub use collate::{Collate, DefaultCollate, Stack};
pub use dataset::{Dataset, IterableDataset, WorkerInfo, worker_info};
pub use epoch::Epoch;
pub use from_fn::FromFn;
#[cfg(feature = "image")]
pub use image_folder::ImageFolder;
pub use iterable_loader::{IterableDataLoader, IterableEpoch};
pub use loader::DataLoader;
pub use sampler::{
    DistributedSampler, RandomSampler, Sampler, SequentialSampler, WeightedRandomSampler,
};
pub use state::{LoaderState, StreamState, worker_seed};
