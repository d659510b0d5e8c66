//! [`PoolBuilder`]: the options a [`Pool`](super::Pool) is started with.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::init_call::InitWith;
use crate::process::StartMethod;

/// Options for a [`Pool`](super::Pool); [`build`](Self::build) starts it.
#[derive(Debug, Clone)]
pub struct PoolBuilder {
    pub(super) processes: usize,
    pub(super) initializer: Option<fn()>,
    pub(super) init_with: Option<InitWith>,
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

    /// A function each worker runs once with `arg` when it starts, like Python's
    /// `Pool(initializer=f, initargs=(arg,))` (several arguments: a tuple). `arg` is
    /// sent to every worker, replacements included; tensors, queues and events in it
    /// travel by handle.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// fn set_up(config: (String, u32)) {
    ///     println!("worker {} ready with {} threads", config.0, config.1);
    /// }
    /// # fn main() -> multiproc::Result<()> {
    /// multiproc::init();
    /// let pool = multiproc::Pool::builder()
    ///     .processes(2)
    ///     .initializer_with(set_up, ("model-a".to_string(), 4))
    ///     .build()?;
    /// # drop(pool); Ok(()) }
    /// ```
    pub fn initializer_with<A>(mut self, f: fn(A), arg: A) -> Self
    where
        A: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        self.init_with = Some(InitWith::new(f, arg));
        self
    }
}
