//! # multiproc
//!
//! torch.multiprocessing for Rust (crate docs are written as the modules land).

#![deny(unsafe_code)]

mod error;
mod manager;
#[allow(unsafe_code)]
mod pool;
mod process;
mod queue;
mod sharing;
mod shm;
mod sync;
#[allow(unsafe_code)]
mod sys;
mod tensor;
mod wire;

pub use error::{Error, Failure, PutError, Result};
pub use manager::run_shm_manager_from_env;
pub use pool::{AsyncResult, Imap, Pool, PoolBuilder};
pub use process::{
    ExitStatus, Process, ProcessContext, SpawnOptions, StartMethod, WorkerResult,
    ensure_forkserver_running, init, spawn, start_processes,
};
pub use queue::{Connection, JoinableQueue, Queue, SimpleQueue, pipe};
pub use sharing::{
    SharingStrategy, get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy,
};
pub use sync::{
    Barrier, BoundedSemaphore, Condition, Event, Lock, LockGuard, RLock, Semaphore, SharedValue,
    Value,
};
pub use tensor::{DType, Element, Storage, Tensor};
