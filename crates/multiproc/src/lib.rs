//! # multiproc
//!
//! torch.multiprocessing for Rust: tensors whose storage lives in shared memory and
//! crosses process boundaries by handle, never by copy; worker processes that report
//! exactly which one failed and why; queues, pipes, a pool and process-shared locks and
//! events that carry tensors.
//!
//! ## Start here
//!
//! Call [`init`] first thing in `main`: a worker process is a new run of your program,
//! and `init` is where it picks up its job (in the parent it returns at once).
//!
//! ```no_run
//! use multiproc::{DType, Queue, Tensor};
//!
//! fn worker(rank: usize, (params, results): (Tensor, Queue<(usize, f64)>)) -> multiproc::Result<()> {
//!     params.add_scalar_(1.0)?; // writes the parent's memory: no copy was made
//!     results.put((rank, params.sum()))?;
//!     Ok(())
//! }
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init();
//!     let params = Tensor::zeros(&[1024], DType::F32)?;
//!     params.share_memory_()?;
//!     let results = Queue::new()?;
//!     multiproc::spawn(worker, (params.clone(), results.clone()), 4)?;
//!     for _ in 0..4 {
//!         let (rank, sum) = results.get()?;
//!         println!("worker {rank} saw {sum}");
//!     }
//!     assert_eq!(params.sum(), 4096.0);
//!     Ok(())
//! }
//! ```
//!
//! In `cargo test` integration tests, where libtest owns `main`, put
//! [`test_init!()`](test_init) at the top of the test file instead.
//!
//! ## Tensors and sharing
//!
//! A [`Tensor`] is a dtype, shape, strides and offset over a [`Storage`]. `Clone` is a
//! cheap handle copy; [`Tensor::deep_clone`] copies the data. [`Tensor::share_memory_`]
//! moves the storage into a shared segment in place (every view follows), and any tensor
//! sent through a channel is shared first, as torch does. Memory another process can
//! write is never handed out as `&[T]`: reads copy ([`Tensor::to_vec`]) and the in-place
//! ops use relaxed atomics, so Hogwild-style concurrent updates are defined behaviour.
//!
//! Two [sharing strategies](SharingStrategy), with torch's names:
//! - `file_descriptor` (default): an anonymous, sealed memfd whose fd is the handle. It
//!   is not bounded by `/dev/shm`'s size and cannot leak: the kernel frees it with its
//!   last fd or mapping.
//! - `file_system`: a named segment `/dev/shm/multiproc_<pid>_<random>` with a
//!   cross-process refcount; a shm manager daemon removes whatever a crashed process tree
//!   left behind.
//!
//! Unlike torch, a process started by multiproc inherits its parent's strategy.
//!
//! ## Processes
//!
//! [`spawn`] starts `nprocs` workers `fn(rank, args)` and joins them; [`start_processes`]
//! returns a [`ProcessContext`] to join later. The first failure is
//! [`Error::ProcessRaised`] (a panic or an `Err`, with rank, pid, message and location)
//! or [`Error::ProcessExited`] (exit code or signal); the other ranks that failed ride
//! along, and the survivors are terminated. [`StartMethod`] picks `Spawn` (re-execute
//! this program), `Fork` or `Forkserver`; every worker dies with its parent.
//!
//! ## Channels, pool, synchronisation
//!
//! [`Queue`], [`SimpleQueue`], [`JoinableQueue`] and [`pipe`] carry any
//! `Serialize + DeserializeOwned` value; tensors, queues, events and locks inside it
//! travel as handles. A message is one packet, so a producer may exit right after
//! `put`. [`Pool`] runs tasks on worker processes; a task that panics, or whose worker
//! is killed, fails alone. [`Event`], [`Lock`], [`RLock`], [`Semaphore`],
//! [`BoundedSemaphore`], [`Condition`], [`Barrier`] and [`Value`] are process-shared
//! (futexes in shared memory); a lock whose holder died reports [`Error::OwnerDied`]
//! instead of deadlocking.
//!
//! ## Beyond one machine
//!
//! [`dist::Env::detect`] reads who this process is from torchrun, Open MPI, MPICH, SLURM
//! or [`spawn`] (which sets torchrun's variables for its workers), and
//! [`dist::ProcessGroup`] runs collectives (`all_reduce_`, `broadcast_`, `all_gather`,
//! `reduce_scatter`, `send`/`recv`) among a node's ranks through shared memory; the `mpi`
//! feature adds `dist::MpiGroup` across nodes.
//!
//! ## Errors
//!
//! Everything fallible returns [`Result`]; [`Error`] says what happened, to what, and
//! what to do. A failed `put`/`send` hands the item back in a [`PutError`].

#![deny(unsafe_code)]

#[doc(hidden)]
#[path = "bench_api.rs"]
pub mod __bench;
/// Not public API: the wire decoder's fuzzing entry points (see `fuzz/`). May change or
/// vanish in any release.
#[doc(hidden)]
#[path = "fuzzing.rs"]
pub mod __fuzz;
pub mod dist;
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
