//! # multiproc
//!
//! torch.multiprocessing for Rust (crate docs are written as the modules land).

#![deny(unsafe_code)]

mod error;
mod manager;
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
pub use queue::{Connection, JoinableQueue, Queue, SimpleQueue, pipe};
pub use sharing::{
    SharingStrategy, get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy,
};
pub use sync::Event;
pub use tensor::{DType, Element, Storage, Tensor};
