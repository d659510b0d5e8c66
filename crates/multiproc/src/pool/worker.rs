//! The body of a pool worker process: run the initializer, then decode chunks of
//! tasks, run each under `catch_unwind` and report its outcome as soon as it finishes.
//!
//! The task functions arrive as [`ChunkCall`]s: calling one runs the trampoline the
//! parent chose for the function's type (see `process::code`).

use std::fmt::Display;
use std::panic::AssertUnwindSafe;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::protocol::{ChunkCall, ChunkInput, PoolMsg, Report, TaskOutcome, WorkerArgs};
use crate::error::{Error, TaskFailure};
use crate::wire::Opaque;

/// Decodes a chunk of `A`, runs `f` under `catch_unwind` on each from item `skip` on,
/// and reports each result as it comes.
pub(super) fn run_chunk<A, R, E>(
    f: fn(A) -> std::result::Result<R, E>,
    (args, skip): ChunkInput,
    report: Report<'_>,
) -> std::result::Result<(), String>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
{
    let items: Vec<A> = args
        .decode(&crate::shm::Returns::plain())
        .map_err(|e| format!("cannot decode the task's arguments: {e}"))?;
    for (k, a) in items.into_iter().enumerate().skip(skip) {
        let outcome = run_task(|| f(a));
        if !report((k, outcome)) {
            break;
        }
    }
    Ok(())
}

/// Runs one task under `catch_unwind` and encodes its result or says how it failed.
pub(super) fn run_task<R: Serialize, E: Display>(
    task: impl FnOnce() -> std::result::Result<R, E>,
) -> TaskOutcome {
    let _task = tracing::debug_span!("multiproc::pool_task").entered();
    match std::panic::catch_unwind(AssertUnwindSafe(task)) {
        Ok(Ok(r)) => Opaque::encode(&r).map_err(|e| {
            (
                TaskFailure::Result,
                format!("cannot encode its result: {e}"),
            )
        }),
        Ok(Err(e)) => Err((TaskFailure::Returned, format!("returned an error: {e}"))),
        Err(payload) => Err((
            TaskFailure::Panicked,
            format!("panicked: {}", crate::process::panic_text(&*payload)),
        )),
    }
}

/// The body of every pool worker process.
pub(super) fn pool_worker(_rank: usize, args: WorkerArgs) -> std::result::Result<(), String> {
    // An initializer's panic is this worker's error, said to be the initializer's: the
    // pool reports it for the task the worker had taken (the task itself never ran).
    let initializer_panicked = |payload: Box<dyn std::any::Any + Send>| {
        format!(
            "the pool's initializer panicked: {}",
            crate::process::panic_text(&*payload)
        )
    };
    if let Some(init) = args.initializer {
        std::panic::catch_unwind(init.get()?).map_err(initializer_panicked)?;
    }
    if let Some(call) = args.init_with {
        std::panic::catch_unwind(AssertUnwindSafe(|| call.run()))
            .map_err(initializer_panicked)??;
    }
    let mut done = 0u64;
    loop {
        let msg = match args.conn.recv() {
            Ok(m) => m,
            // The pool is gone: nothing more to do.
            Err(Error::Closed(_) | Error::Disconnected(_)) => return Ok(()),
            Err(e) => return Err(format!("pool worker cannot read its next task: {e}")),
        };
        let PoolMsg::Chunk {
            job,
            first,
            skip,
            call,
            args: chunk,
        } = msg
        else {
            return Ok(());
        };
        let mut parent_gone = false;
        let mut report = |(k, outcome): (usize, _)| {
            let sent = args.conn.send(PoolMsg::TaskDone {
                job,
                index: first + k,
                outcome,
            });
            parent_gone = sent.is_err();
            !parent_gone
        };
        let outcome = run_call(&call, (chunk, skip), &mut report);
        if parent_gone {
            return Ok(());
        }
        if args
            .conn
            .send(PoolMsg::Done {
                job,
                first,
                outcome,
            })
            .is_err()
        {
            return Ok(());
        }
        done += 1;
        if args.max_tasks.is_some_and(|m| done >= m) {
            return Ok(());
        }
    }
}

/// Runs a chunk call: `Err` when the chunk could not run (another build, arguments that
/// do not decode).
fn run_call(
    call: &ChunkCall,
    input: ChunkInput,
    report: Report<'_>,
) -> std::result::Result<(), String> {
    call.call(input, report).and_then(|outcome| outcome)
}
