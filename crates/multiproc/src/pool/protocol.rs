//! The pool's message protocol: what travels between the dispatcher and a worker
//! process, and the shape of the chunk trampolines that run tasks there.

use serde::{Deserialize, Serialize};

use super::forms::InitCall;
use crate::process::code::CodeRef;
use crate::queue::Connection;
use crate::wire::Opaque;

/// What travels between the dispatcher and a worker (one type, both directions).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum PoolMsg {
    /// Run `function` over the decoded chunk of arguments, from its item `skip` on
    /// (the earlier ones ran on a worker that died).
    Chunk {
        job: u64,
        first: usize,
        skip: usize,
        trampoline: CodeRef,
        function: CodeRef,
        args: Opaque,
    },
    /// The outcome of task `index` (of the whole job): its encoded result or the
    /// failure text. Sent as soon as the task finishes.
    TaskDone {
        job: u64,
        index: usize,
        outcome: std::result::Result<Opaque, String>,
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

/// Where a chunk trampoline reports each finished task: `(position in the chunk,
/// outcome)`; `false` back means stop (the parent is gone).
pub(super) type Report<'a> = &'a mut dyn FnMut(usize, std::result::Result<Opaque, String>) -> bool;

pub(super) type ChunkTrampoline =
    fn(CodeRef, Opaque, usize, Report<'_>) -> std::result::Result<(), String>;

#[derive(Serialize, Deserialize)]
pub(super) struct WorkerArgs {
    pub(super) conn: Connection<PoolMsg>,
    pub(super) initializer: Option<CodeRef>,
    /// The initializer with arguments ([`PoolBuilder::initializer_with`](super::PoolBuilder::initializer_with)).
    pub(super) init_with: Option<InitCall>,
    pub(super) max_tasks: Option<u64>,
}
