//! [`Pool`]: a pool of worker processes that run tasks, like `multiprocessing.Pool`.
//!
//! The parent owns a dispatcher thread and, per worker, a process and a pipe. The
//! dispatcher hands each worker one chunk of tasks at a time and remembers which chunk
//! is where; the worker reports each task's result as soon as it finishes. So when a
//! worker dies mid-task (a signal, the OOM killer, `exit`) exactly the task it was
//! running fails, with the cause, and the worker is replaced — the pool never hangs,
//! unlike Python's and torch's. The tasks of that chunk that had finished keep their
//! results; the ones after it, not yet started, are rerun on the fresh worker when
//! their arguments are plain data, and fail (saying they never ran) when they hold
//! shared handles (tensors, queues), whose references only one receiver may adopt. A
//! task that panics or returns `Err` fails alone.
//!
//! Task functions are plain `fn(A) -> Result<R, E>`: they cross the process boundary as
//! code offsets (see `process::code`'s [`CodeCall`](crate::process::code::CodeCall));
//! arguments and results
//! are wire values, so tensors in them travel by handle through shared memory.
//!
//! The files, lowest first (each uses only files above it): [`init_call`] (an
//! initializer with an argument, as it travels), [`protocol`] (what travels between
//! the dispatcher and a worker), [`outcomes`] (the channel that carries a job's
//! outcomes from the dispatcher to its result handle, awaitable under feature
//! `async`), [`state`] (what `Pool` and the dispatcher share),
//! [`worker`] (the worker process's body), [`builder`] ([`PoolBuilder`]),
//! [`dispatcher`] (the parent's thread that owns the workers), [`async_result`]
//! ([`AsyncResult`]), [`handle`] ([`Pool`], and [`PoolBuilder::build`]), [`imap`]
//! ([`Imap`] and the `imap` methods) and [`forms`] (the other call forms and
//! [`MapResult`]).
//!
//! # No unsafe code
//!
//! Task functions travel as [`CodeCall`](crate::process::code::CodeCall)s and the
//! initializer as a [`Code<fn()>`](crate::process::code::Code): `process::code` turns
//! them back into function pointers, each as the type it was taken from (the chunk
//! trampoline `run_chunk::<A, R, E>` is the one that gets the `fn(A) -> Result<R, E>`
//! it was monomorphized for; `starmap` and an initializer with arguments bring their
//! own trampolines), so this module needs no `unsafe`.

mod async_result;
mod builder;
mod dispatcher;
mod forms;
mod handle;
mod imap;
mod init_call;
mod outcomes;
mod protocol;
mod state;
mod worker;

pub use async_result::AsyncResult;
pub use builder::PoolBuilder;
pub use forms::MapResult;
pub use handle::Pool;
pub use imap::Imap;
