//! [`Options`]: a data loader's settings, as its builder leaves them (checked there),
//! read by the loaders and their workers.

use std::time::Duration;

use super::from_fn::InitFn;
use super::worker_kind::WorkerKind;
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::process::StartMethod;

/// The loader's settings, as the builder leaves them.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub batch_size: usize,
    pub drop_last: bool,
    pub num_workers: usize,
    pub prefetch_factor: usize,
    pub persistent_workers: bool,
    pub timeout: Option<Duration>,
    pub in_order: bool,
    pub restart_workers: bool,
    pub start_method: StartMethod,
    pub kind: WorkerKind,
    pub seed: u64,
    /// The rank in worker seeds (the sampler's, the builder's, or 0).
    pub rank: usize,
    pub worker_init: Option<fn(usize)>,
    /// Page-lock each batch's shared blocks in the trainer (`pin_memory`).
    pub pin_memory: bool,
    /// Copy each batch to this device, this many batches ahead (`prefetch_to`).
    pub prefetch_to: Option<(Device, usize)>,
    #[cfg(feature = "progress")]
    pub progress: bool,
}

impl Options {
    /// Refuses settings no loader can run with.
    pub(super) fn check(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(Error::InvalidArgument(
                "data loader: batch_size must be at least 1".into(),
            ));
        }
        if self.prefetch_factor == 0 {
            return Err(Error::InvalidArgument(
                "data loader: prefetch_factor must be at least 1 (it is the number of \
                 batches each worker may have in flight)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The hook as it travels.
    pub(crate) fn init_fn(&self) -> Option<InitFn> {
        self.worker_init.map(InitFn)
    }
}
