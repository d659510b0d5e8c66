//! [`PoolBuilder`]: the options a [`Pool`] is started with.

use super::forms::{self};
use super::handle::Pool;
use crate::error::Result;
use crate::process::StartMethod;

/// Options for a [`Pool`].
#[derive(Debug, Clone)]
pub struct PoolBuilder {
    pub(super) processes: usize,
    pub(super) initializer: Option<fn()>,
    pub(super) init_with: Option<forms::InitWith>,
    pub(super) max_tasks_per_child: Option<u64>,
    pub(super) start_method: StartMethod,
}

impl PoolBuilder {
    /// The number of worker processes (default: the number of CPUs).
    pub fn processes(mut self, n: usize) -> Self {
        self.processes = n;
        self
    }

    /// A function each worker runs once when it starts.
    pub fn initializer(mut self, f: fn()) -> Self {
        self.initializer = Some(f);
        self
    }

    /// Replace a worker by a fresh process after it ran this many chunks of tasks.
    pub fn max_tasks_per_child(mut self, n: u64) -> Self {
        self.max_tasks_per_child = Some(n.max(1));
        self
    }

    /// How workers are started (default [`StartMethod::Spawn`]).
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.start_method = method;
        self
    }

    /// Starts the workers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for 0 processes; any error starting a worker.
    pub fn build(self) -> Result<Pool> {
        Pool::start(self)
    }
}
