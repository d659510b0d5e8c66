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
//!     results.put((rank, params.sum()?))?;
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
//!     assert_eq!(params.sum()?, 4096.0);
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
//! ## Interop: ndarray, candle, safetensors, DLPack
//!
//! Optional features, off by default (the items below exist only with their feature;
//! their own docs have the details and examples), connect tensors to the Rust ML ecosystem. The
//! rule throughout: zero-copy where the other side can borrow memory soundly, one
//! `memcpy` where it cannot, and never a safe Rust borrow of memory another process may
//! write.
//!
//! | feature | what you get |
//! |---|---|
//! | `ndarray` | `Tensor::from_ndarray` / `from_ndarray_shared` (one copy, any strides, straight into shared memory for the `_shared` form), `Tensor::to_ndarray` (one copy), `Tensor::copy_from_ndarray` (into an existing tensor, shared or not), zero-copy views: the safe `Tensor::array_view` / `array_view_mut` and the `unsafe` `Tensor::as_array_view` / `as_array_view_mut` |
//! | `candle` | `Tensor::to_candle`, `Tensor::from_candle` / `from_candle_shared`: one copy each, every dtype both sides know (`u8 u32 i16 i32 i64 bf16 f16 f32 f64`), an error naming the dtype otherwise |
//! | `safetensors` | `safetensors::load`: tensors backed by the file's own pages, mapped shared and read-only, that travel to workers as the file's fd (N workers, one page-cache copy); `safetensors::save` |
//! | `dlpack` | `Tensor::to_dlpack` / `Tensor::from_dlpack` (through the `dlpark` crate): zero-copy, the capsule keeps the storage alive |
//!
//! Toolchains: the crate, `ndarray` and `safetensors` build with Rust 1.85; `dlpack`
//! needs 1.88 (dlpark) and `candle` 1.89 (candle's own dependencies).
//!
//! Without any feature, [`Tensor::copy_from_slice`] writes a slice into an existing
//! tensor (shared or not) in one copy, and [`Tensor::from_slice_shared`] makes a shared
//! tensor from a slice in one copy (not `from_slice` then `share_memory_`, which is two).
//!
//! **Which ndarray view?** A view is a Rust borrow, and a borrow of memory that someone
//! else writes is undefined behaviour. So:
//!
//! - `Tensor::array_view` / `array_view_mut` (safe, take
//!   `&mut self`) work on the only handle of a private tensor — nothing else can reach
//!   it, and nothing can share it (which would move its bytes) while the view lives —
//!   and `array_view` also on a read-only tensor (a safetensors weight).
//! - `Tensor::as_array_view` / `as_array_view_mut`
//!   (`unsafe`, take `&self`) work on shared tensors; you promise that no other thread
//!   or process writes (or, for the mutable view, touches) the elements while the view
//!   lives — e.g. after a [`Barrier`] that orders every writer before it. They refuse a
//!   private tensor: its bytes move when it is shared, which would leave the view
//!   dangling (the use-after-free of `ArrayView::from_shape_ptr(t.data_ptr())`).
//! - Hogwild updates go through the in-place operations ([`Tensor::add_`] …), which
//!   are relaxed atomics, and results come back with `Tensor::copy_from_ndarray`.
//!
//! ```ignore
//! // [features = ["ndarray", "candle"]] A Hogwild worker: gradients in ndarray,
//! // evaluation in candle, no unsafe.
//! fn train(rank: usize, (params, barrier): (Tensor, Barrier)) -> multiproc::Result<()> {
//!     let grad = Tensor::from_ndarray(&compute_gradient(&params.to_ndarray::<f32>()?))?;
//!     params.add_(&grad, -0.01)?;              // atomic, shared with every worker
//!     barrier.wait()?;
//!     let logits = model.forward(&params.to_candle()?)?; // one memcpy
//!     let best = Tensor::from_candle(&logits.argmax(1)?)?; // u32
//!     Ok(())
//! }
//! ```
//!
//! **Read-only tensors.** A tensor from `safetensors::load`
//! (or a DLPack capsule flagged read-only) refuses every in-place operation with an
//! [`Error::Tensor`] naming it ([`Tensor::is_read_only`]); [`Tensor::deep_clone`] makes
//! a writable copy. Inference workers that receive such weights add no private memory
//! for them: `examples/inference_workers.rs` shows it from `/proc/PID/smaps_rollup`.
//!
//! **DLPack is one-process.** A capsule is a pointer into this process plus a deleter:
//! hand it to a library in this process (a PyO3 extension's `torch.from_dlpack`), and
//! send the multiproc [`Tensor`] itself to other processes. A private tensor is moved
//! into shared memory before export (once), so the capsule's pointer stays valid.
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
mod error;
mod manager;
#[allow(unsafe_code)]
mod pool;
mod process;
mod queue;
#[cfg(feature = "safetensors")]
pub mod safetensors;
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
