//! What the caller's side of a [`Pool`](super::Pool) and its dispatcher thread share: the queue of
//! chunks not yet on a worker, the jobs waiting for outcomes, and the pool's state
//! flags, under one mutex.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::outcomes::OutcomeSender;
use super::protocol::ChunkCall;
use crate::error::{Error, TaskFailure};
use crate::queue::Connection;
use crate::wire::Opaque;

/// One chunk that is waiting for, or running on, a worker.
pub(super) struct Pending {
    pub(super) job: u64,
    pub(super) first: usize,
    pub(super) len: usize,
    /// Items of the chunk already run (by a worker that died running the next one).
    pub(super) skip: usize,
    /// The task function and its chunk trampoline.
    pub(super) call: ChunkCall,
    pub(super) args: Opaque,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) queue: VecDeque<Pending>,
    pub(super) jobs: HashMap<u64, Job>,
    pub(super) closed: bool,
    pub(super) terminate: bool,
    /// Set by the dispatcher when it has stopped every worker and exited.
    pub(super) finished: bool,
}

/// A job waiting for outcomes.
pub(super) struct Job {
    pub(super) tx: OutcomeSender,
    /// Outcomes still to come, for a job the dispatcher forgets after its last one
    /// (`apply_async`, `map_async`: their handles may be dropped unread, and nothing
    /// else would end them); `None` for a job its caller ends (`end_job`).
    pub(super) left: Option<usize>,
}

pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) changed: Condvar,
    pub(super) wake_tx: Connection<u8>,
    pub(super) next_job: AtomicU64,
}

impl Shared {
    pub(super) fn wake(&self) {
        // A full wake pipe already means "wake up"; nothing to do if this fails.
        let _ = self.wake_tx.send_timeout(0, Duration::ZERO);
    }
}

pub(super) fn dispatcher_gone() -> Error {
    Error::Closed("the pool was terminated before the task finished".into())
}

pub(super) fn with_index(e: Error, index: usize) -> Error {
    match e {
        Error::TaskFailed { .. } => e,
        other => Error::TaskFailed {
            index,
            reason: TaskFailure::Result,
            message: other.to_string(),
        },
    }
}
