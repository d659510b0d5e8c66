//! The pool's message protocol: what travels between the dispatcher and a worker
//! process, and the shape of the chunk calls that run tasks there.

use serde::{Deserialize, Serialize};

use super::init_call::InitCall;
use crate::error::TaskFailure;
use crate::process::code::{Code, CodeCall, Sink};
use crate::queue::Connection;
use crate::wire::Opaque;

/// What travels between the dispatcher and a worker (one type, both directions).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum PoolMsg {
    /// Run `call` (a task function and its chunk trampoline) over the decoded chunk of
    /// arguments, from its item `skip` on
    /// (the earlier ones ran on a worker that died).
    Chunk {
        job: u64,
        first: usize,
        skip: usize,
        call: ChunkCall,
        args: Opaque,
    },
    /// The outcome of task `index` (of the whole job): its encoded result or why it
    /// failed. Sent as soon as the task finishes.
    TaskDone {
        job: u64,
        index: usize,
        outcome: TaskOutcome,
    },
    /// The chunk is over: every task reported, or (`Err`) the chunk could not run (its
    /// arguments could not be decoded) and the unreported tasks fail with the text.
    Done {
        job: u64,
        first: usize,
        outcome: std::result::Result<(), String>,
    },
    /// Finish: exit once this is read.
    Stop,
}

/// One task's encoded result, or why it failed and the text that says how.
pub(super) type TaskOutcome = std::result::Result<Opaque, (TaskFailure, String)>;

/// One finished task as a chunk trampoline reports it: `(position in the chunk,
/// outcome)`.
pub(super) type TaskReport = (usize, TaskOutcome);

/// Where a chunk trampoline reports each finished task; `false` back means stop (the
/// parent is gone).
pub(super) type Report<'a> = Sink<'a, TaskReport>;

/// What a chunk trampoline gets: the chunk's encoded arguments, and how many of its
/// items to skip (they ran on a worker that died).
pub(super) type ChunkInput = (Opaque, usize);

/// A task function and the trampoline that runs a chunk of its tasks (`run_chunk` for
/// `fn(A) -> Result<R, E>`, `run_star_chunk` for `starmap`'s `fn(A, B)`): `Err` when
/// the chunk could not run.
pub(super) type ChunkCall = CodeCall<ChunkInput, TaskReport, std::result::Result<(), String>>;

#[derive(Serialize, Deserialize)]
pub(super) struct WorkerArgs {
    pub(super) conn: Connection<PoolMsg>,
    pub(super) initializer: Option<Code<fn()>>,
    /// The initializer with arguments ([`PoolBuilder::initializer_with`](super::PoolBuilder::initializer_with)).
    pub(super) init_with: Option<InitCall>,
    pub(super) max_tasks: Option<u64>,
}
