//! # multiproc
//!
//! torch.multiprocessing for Rust: tensors whose storage lives in shared memory and
//! crosses process boundaries by handle, never by copy; worker processes that report
//! exactly which one failed and why; queues, pipes, a pool and process-shared locks and
//! events that carry tensors. Linux only.
//!
//! This page is a tutorial, one section per thing a multi-process program does:
//!
//! 1. [Start here](#start-here): `init`, and the first program
//! 2. [Tensors in shared memory](#tensors-in-shared-memory), and
//!    [the rules for memory other processes write](#the-rules-for-memory-other-processes-write)
//! 3. [Sharing strategies](#sharing-strategies): `file_descriptor` and `file_system`
//! 4. [Processes](#processes): `spawn`, `start_processes`, `Process`, failures
//! 5. [Queues and pipes](#queues-and-pipes) that carry tensors
//! 6. [The pool](#the-pool)
//! 7. [Synchronisation](#synchronisation): locks and their guards, events, barriers
//! 8. [Errors and timeouts](#errors-and-timeouts)
//! 9. [Logs from workers](#logs-from-workers)
//! 10. [Other frameworks](#interop-ndarray-candle-burn-safetensors-dlpack): ndarray,
//!     candle, burn, safetensors, DLPack
//! 11. [Tests](#tests) that start workers
//! 12. [Python](#python): the same queues from Python processes
//!
//! ## Start here
//!
//! Call [`init`] first thing in `main`: a worker process is a new run of your program,
//! and `init` is where it picks up its job (in the parent it returns at once).
//!
//! ```no_run
//! use multiproc::{DType, Queue, Tensor};
//!
//! fn worker(rank: usize, (params, done): (Tensor, Queue<usize>)) -> multiproc::Result<()> {
//!     params.add_scalar_(1.0)?; // writes the parent's memory: no copy was made
//!     done.put(rank)?;
//!     Ok(())
//! }
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init();
//!     let params = Tensor::zeros(&[1024], DType::F32)?;
//!     params.share_memory_()?;
//!     let done = Queue::new()?;
//!     multiproc::spawn(worker, (params.clone(), done.clone()), 4)?;
//!     let mut ranks: Vec<usize> = done.try_iter().collect::<multiproc::Result<_>>()?;
//!     ranks.sort();
//!     assert_eq!(ranks, [0, 1, 2, 3]);
//!     assert!(params.to_vec::<f32>()?.iter().all(|&x| x == 4.0));
//!     Ok(())
//! }
//! ```
//!
//! A worker is a plain `fn(rank, args)` of this executable (a closure that captures
//! nothing works too); `args` is any `Serialize + DeserializeOwned` value, and every
//! tensor, queue, lock or event inside it travels as a handle. It returns `()` or
//! `Result<(), E>` with `E: Display` ([`IntoWorkerOutcome`]).
//!
//! ## Tensors in shared memory
//!
//! A [`Tensor`] is a [`DType`], a shape, strides and an offset over a [`Storage`].
//! `Clone` is a cheap handle copy that shares the data; [`Tensor::deep_clone`] copies
//! it (torch's `.clone()`). Views ([`Tensor::narrow`], [`Tensor::select`],
//! [`Tensor::transpose`], [`Tensor::reshape`]) share the storage and keep their offset,
//! shape and strides when they cross a process.
//!
//! [`Tensor::share_memory_`] moves the storage into a shared segment in place (every
//! view follows); a tensor sent through a channel is shared first, as torch does. A
//! process maps each segment once: the same storage sent twice, or two views of it,
//! arrive sharing memory.
//!
//! ```
//! use multiproc::{DType, Tensor};
//! let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
//! let row = t.select(0, 1)?; // [3, 4, 5], a view
//! t.share_memory_()?;
//! assert!(row.is_shared(), "views follow their storage into shared memory");
//! row.fill_(9.0)?;
//! assert_eq!(t.to_vec::<f32>()?, [0., 1., 2., 9., 9., 9.]);
//! # Ok::<(), multiproc::Error>(())
//! ```
//!
//! ### The rules for memory other processes write
//!
//! - **No `&[T]` over shared memory.** Another process may write a shared tensor at any
//!   moment, so multiproc never hands its memory out as `&[T]`/`&mut [T]` (a data race
//!   the compiler may miscompile). Reads copy ([`Tensor::to_vec`]); the element-wise
//!   operations ([`Tensor::fill_`], [`Tensor::copy_`], [`Tensor::add_`],
//!   [`Tensor::mul_`], the `_scalar_` forms) read and write each element with a relaxed
//!   atomic of its width.
//! - **Hogwild is defined behaviour.** Workers that update the same parameters at once,
//!   without a lock, as Hogwild training does, never tear an element or invoke
//!   undefined behaviour; an update racing with another may be lost (the last writer
//!   wins), which Hogwild accepts. Where every update must count, hold a [`Lock`].
//! - **No ordering between elements.** Relaxed atomics order nothing: to publish "these
//!   elements are ready", write them, then signal with an [`Event`], a [`Queue`] message
//!   or a lock, whose operations order the writes before the other side's reads.
//! - **Any bit pattern is a value.** A `bool` element another process set to `2` reads
//!   as `true`; a received tensor whose layout points outside its storage is refused
//!   when it arrives.
//!
//! ### Scalars
//!
//! Scalars (`full`, `fill_`, `add_scalar_`, `mul_scalar_`, the `alpha` of `add_`) are
//! `f64`. On an integer or bool tensor a scalar must be representable exactly (integral
//! and in range; 0 or 1 for bool), otherwise the operation is an [`Error::Tensor`] — as
//! torch refuses `int_tensor.add_(1.5)`. `i64` values beyond 2^53 are not exact as
//! scalars; integer arithmetic itself is exact (wrapping), and bool `add_`/`mul_` are
//! logical or/and.
//!
//! ```
//! use multiproc::{DType, Tensor};
//! let counts = Tensor::zeros(&[3], DType::I32)?;
//! counts.add_scalar_(2.0)?;
//! assert!(matches!(counts.add_scalar_(0.5), Err(multiproc::Error::Tensor(_))));
//! assert_eq!(counts.to_vec::<i32>()?, [2, 2, 2]);
//! # Ok::<(), multiproc::Error>(())
//! ```
//!
//! ## Sharing strategies
//!
//! Two [sharing strategies](SharingStrategy), with torch's names:
//!
//! - `file_descriptor` (default): an anonymous, sealed memfd whose fd is the handle. It
//!   is not bounded by `/dev/shm`'s size and cannot leak: the kernel frees it with its
//!   last fd or mapping. Each shared storage above 64 KiB costs an fd in every process
//!   that holds it (small ones share 1 MiB arenas); `multiproc doctor` shows the limit.
//! - `file_system`: a named segment `/dev/shm/multiproc_<pid>_<random>_<tree>` with a
//!   cross-process refcount, so a process holds no fd per storage; a shm manager daemon
//!   removes whatever a crashed process tree left behind (and `multiproc gc`, built on
//!   [`maintenance`], what even the daemon could not).
//!
//! The strategy is read when a storage moves to shared memory; storages already shared
//! keep theirs, and a receiver accepts both. Unlike torch, a process started by
//! multiproc inherits its parent's strategy.
//!
//! ```no_run
//! use multiproc::{DType, SharingStrategy, Tensor};
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init(); // the shm manager of `file_system` is this program, re-executed
//!     multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
//!     let t = Tensor::ones(&[16], DType::F64)?;
//!     t.share_memory_()?;
//!     assert!(t.storage().shm_name().is_some_and(|n| n.starts_with("multiproc_")));
//!     multiproc::set_sharing_strategy("file_descriptor".parse()?);
//!     Ok(())
//! }
//! ```
//!
//! ## Processes
//!
//! [`spawn`] starts `nprocs` workers and joins them; [`start_processes`] returns a
//! [`ProcessContext`] to join later; a [`Process`] is one worker with a name. The
//! [`StartMethod`] is `Spawn` (re-execute this program, the default), `Fork` or
//! `Forkserver`; every worker dies with its parent. In a worker,
//! [`current_process`] says its rank, pid and name; in the parent,
//! [`active_children`] lists the workers that still run, and [`cpu_count`] how many
//! CPUs there are to run them on.
//!
//! The first failure is [`Error::ProcessRaised`] (a panic or an `Err`, with rank, pid,
//! message and location) or [`Error::ProcessExited`] (exit code or signal); the other
//! ranks that failed ride along ([`Error::failures`]), and the survivors are
//! terminated. Where torch's `join(timeout)` returns `False` because workers still run,
//! [`ProcessContext::join`] returns `Err(Error::Timeout { .. })`: join again.
//!
//! ```no_run
//! use std::time::Duration;
//! use multiproc::{Error, StartMethod};
//!
//! fn shard(rank: usize, shards: usize) -> Result<(), String> {
//!     let me = multiproc::current_process();
//!     assert_eq!(me.rank, Some(rank));
//!     if rank == 2 {
//!         return Err(format!("shard {rank} of {shards} is corrupt"));
//!     }
//!     Ok(())
//! }
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init();
//!     let mut ctx = multiproc::start_processes(shard, 4, 4, StartMethod::Spawn)?;
//!     loop {
//!         match ctx.join_timeout(Duration::from_secs(1)) {
//!             Ok(()) => break,
//!             Err(e) if e.is_timeout() => println!("{} still running", multiproc::active_children().len()),
//!             Err(Error::ProcessRaised { error_index, message, .. }) => {
//!                 eprintln!("rank {error_index} failed: {message}");
//!                 break;
//!             }
//!             Err(e) => return Err(e),
//!         }
//!     }
//!     Ok(())
//! }
//! ```
//!
//! ## Queues and pipes
//!
//! [`Queue`], [`SimpleQueue`], [`JoinableQueue`] and [`pipe`] carry any
//! `Serialize + DeserializeOwned` value; tensors, queues, events and locks inside it,
//! at any depth, travel as handles. A message is one packet, so a producer may exit
//! right after `put`. Each operation has one spelling per way of waiting: `put`/`get`
//! wait as long as it takes, `put_timeout`/`get_timeout` at most a `Duration`, and
//! `try_put`/`try_get` not at all (`try_get` on an empty queue makes no system call);
//! `iter`, `try_iter`, `len`, `is_empty`, `is_full` and `capacity` look. Python's names
//! (`put_nowait`, `get_nowait`, `qsize`, `empty`, `full`) find the Rust method when
//! searched for in these docs.
//!
//! ```
//! use std::time::Duration;
//! use multiproc::{DType, Queue, Tensor};
//!
//! let batches: Queue<(usize, Tensor)> = Queue::with_capacity(2)?;
//! for i in 0..2 {
//!     batches.put((i, Tensor::full(&[4, 4], i as f64, DType::F32)?))?;
//! }
//! // Full: `try_put` hands the batch back instead of waiting.
//! let back = batches.try_put((2, Tensor::zeros(&[1], DType::F32)?)).unwrap_err();
//! assert!(matches!(back.error, multiproc::Error::Full(_)));
//! let (i, batch) = back.into_inner();
//! assert_eq!((i, batch.numel()), (2, 1));
//! for got in batches.try_iter() {
//!     let (i, batch) = got?;
//!     assert!(batch.is_shared() && batch.to_vec::<f32>()?.iter().all(|&x| x == i as f32));
//! }
//! // Empty, and no other handle of it is left anywhere: nothing can ever arrive.
//! assert!(batches.get_timeout(Duration::from_secs(60)).unwrap_err().is_disconnected());
//! # Ok::<(), multiproc::Error>(())
//! ```
//!
//! A [`pipe`] gives two [`Connection`] ends; [`connection::wait`] waits on several at
//! once — pipe ends, queues and processes mixed, until one has an item or has exited —
//! as Python's `multiprocessing.connection.wait` does.
//!
//! ## The pool
//!
//! A [`Pool`] runs tasks `fn(A) -> Result<R, E>` on worker processes: [`Pool::map`],
//! [`Pool::imap`] (ordered, lazy), [`Pool::imap_unordered`], [`Pool::starmap`],
//! [`Pool::apply`], [`Pool::apply_async`], [`Pool::map_async`], with an initializer
//! ([`PoolBuilder::initializer_with`]) and worker recycling
//! ([`PoolBuilder::max_tasks_per_child`]). A task that panics, or whose worker is
//! killed, fails alone ([`Error::TaskFailed`] with its index and a [`TaskFailure`]
//! saying why: returned `Err`, panicked, worker died, never ran); the pool replaces
//! the worker and carries on.
//!
//! ```no_run
//! use multiproc::{DType, Pool, Tensor};
//!
//! fn normalize(t: Tensor) -> multiproc::Result<f32> {
//!     let v = t.to_vec::<f32>()?;
//!     let max = v.iter().cloned().fold(f32::MIN, f32::max);
//!     t.mul_scalar_(1.0 / f64::from(max))?; // in place, in the parent's memory
//!     Ok(max)
//! }
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init();
//!     let pool = Pool::new(multiproc::cpu_count())?;
//!     let images: Vec<Tensor> = (1..=8)
//!         .map(|i| Tensor::full(&[64, 64], f64::from(i), DType::F32))
//!         .collect::<multiproc::Result<_>>()?;
//!     let maxima = pool.map(normalize, images.clone())?;
//!     assert_eq!(maxima, [1., 2., 3., 4., 5., 6., 7., 8.]);
//!     assert!(images[7].to_vec::<f32>()?.iter().all(|&x| x == 1.0));
//!     Ok(())
//! }
//! ```
//!
//! ## Synchronisation
//!
//! [`Event`], [`Lock`], [`RLock`], [`Semaphore`], [`BoundedSemaphore`], [`Condition`],
//! [`Barrier`] and [`Value`] are process-shared (futexes in shared memory) and travel
//! to workers like tensors. Locks keep Python's `acquire`/`release` and add Rust's
//! guards: [`Lock::lock`], [`Lock::try_lock`] and [`Lock::lock_timeout`] return a
//! [`LockGuard`] that releases the lock when dropped (likewise [`RLockGuard`],
//! [`ConditionGuard`], and [`SemaphoreGuard`] from [`Semaphore::permit`]).
//!
//! A lock whose holder died while holding it does not deadlock: the next `acquire`
//! takes it over and reports [`Error::OwnerDied`] with the dead holder's pid, and the
//! next `lock` returns a [`LockError`] that carries the guard, so the caller can repair
//! what the dead holder left half-done and go on.
//!
//! ```
//! use multiproc::{Lock, Value};
//!
//! let lock = Lock::new()?;
//! let total = Value::new(0u64)?;
//! {
//!     let _held = lock.lock()?;
//!     total.set(total.get() + 1); // a read-modify-write: only the lock makes it exact
//! } // released here
//! let held = match lock.lock() {
//!     Ok(held) => held,
//!     // The previous holder died mid-update: repair, then keep the lock.
//!     Err(e) => e.into_guard().ok_or(multiproc::Error::InvalidArgument("no guard".into()))?,
//! };
//! assert!(lock.try_lock()?.is_none());
//! drop(held);
//! assert_eq!(total.get(), 1);
//! # Ok::<(), multiproc::Error>(())
//! ```
//!
//! ## CUDA tensors (feature `cuda`)
//!
//! [`Tensor::to`]`(`[`Device::Cuda`]`(0))`, [`Tensor::zeros_on`] and friends put a
//! tensor in GPU memory that crosses every channel by handle (a VMM allocation exported
//! as an fd): the producer may exit after `put`, a killed consumer releases its share,
//! and a received CUDA tensor can be sent on. A data loader page-locks the shared
//! memory its batches arrive in ([`pin_memory`](data::DataLoaderBuilder::pin_memory))
//! or hands them over on a device, copied ahead on a side stream
//! ([`prefetch_to`](data::DataLoaderBuilder::prefetch_to)). See the [`cuda`] module.
//! Without the feature the same API builds and answers [`Error::CudaUnavailable`].
//!
//! ## Async (feature `async`)
//!
//! Async services (tokio, axum, tonic) await multiproc's waits without a blocked
//! thread per wait: `Queue::get_async` / `put_async`, `SimpleQueue::get_async`,
//! `JoinableQueue::get_async` / `join_async`, `Connection::recv_async`,
//! `Event::wait_async`, `Semaphore::acquire_async`, `Process::join_async` and
//! `ProcessContext::join_async`. They work on any executor
//! (the crate has no runtime dependency). Producers wake consumers with a futex on a
//! shared word, which epoll cannot watch, so one reactor thread per process sleeps in
//! `futex_waitv` on every word a parked future waits on (and a second one `poll`s the
//! pidfds and sockets that the joins, `recv_async` and a `put_async` on a full socket
//! wait for):
//! a parked future costs no CPU, apart from a parked get's look every second (for a
//! packet written on the queue's socket without a `put`). A parked get hears at once of
//! the last other holder leaving, a SIGKILLed one too: the kernel closes a dead
//! process's fds, and the fd reactor watches the queue's holder lease file for closes
//! (inotify). Every future is cancel-safe: it takes a message (or a bounded queue's place,
//! or a permit) only in a synchronous step whose result it returns at once, so a future
//! dropped at any point loses nothing and leaks nothing. Kernels before 5.16 (no
//! `futex_waitv`) fall back to looking every 10 ms.
//!
//! A [`Pool`]'s results are awaitable too: `AsyncResult::get_async` (of
//! [`Pool::apply_async`]), `MapResult::get_async` (of [`Pool::map_async`]) and
//! `Imap::next_async` (of [`Pool::imap`] / [`Pool::imap_unordered`]: `while let
//! Some(r) = it.next_async().await`). Those need no reactor: the pool's dispatcher
//! thread wakes the awaiting task itself when it hands a result over. They are
//! cancel-safe in the same way: a dropped future took nothing, and a later `get` or
//! `get_async` returns the result; errors are those of the blocking `get`.
//!
//! A [`DataLoader`](data::DataLoader)'s epoch is also a `futures_core::Stream` of
//! batches: `DataLoader::stream` yields what [`iter`](data::DataLoader::iter) does
//! (same order, failures naming the worker, timeout), parking on the workers' results
//! queue (and its busy workers' pidfds, so a worker killed without a reply wakes it at
//! once) instead of blocking a thread; the loader's timeout wakes it at its deadline.
//! With `prefetch_to` (feature `cuda`), the copies of the batches pulled ahead run on
//! the device while the stream is parked, and the driver's callback wakes it when the
//! oldest batch is on the device (see `data::EpochStream`).
//!
//! ```
//! # #[cfg(feature = "async")]
//! # fn main() -> multiproc::Result<()> {
//! let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
//! rt.block_on(async {
//!     let q = multiproc::Queue::<u32>::with_capacity(1)?;
//!     let producer = q.clone(); // in practice another process's handle
//!     producer.put_async(7).await?;
//!     assert_eq!(q.get_async().await?, 7);
//!     Ok(())
//! })
//! # }
//! # #[cfg(not(feature = "async"))]
//! # fn main() {}
//! ```
//!
//! ## Data loading
//!
//! [`data`] is torch's `DataLoader`: a [`data::Dataset`] or [`data::IterableDataset`]
//! loaded in batches by worker processes, which stack samples straight into batch
//! tensors in shared memory; a worker that fails, panics or dies is named with its pid,
//! batch and samples ([`Error::LoaderFailed`]) and can be replaced.
//!
//! ## Beyond one machine
//!
//! [`dist::Env::detect`] reads who this process is from torchrun, Open MPI, MPICH, SLURM
//! or [`spawn`] (which sets torchrun's variables for its workers), and
//! [`dist::ProcessGroup`] runs collectives (`all_reduce_`, `broadcast_`, `all_gather`,
//! `reduce_scatter`, `send`/`recv`) among a node's ranks through shared memory; the `mpi`
//! feature adds `dist::MpiGroup` across nodes.
//!
//! ## Errors and timeouts
//!
//! Everything fallible returns [`Result`]; [`Error`] says what happened, to what, and
//! what to do, and is `Serialize`, so a worker can send its errors through a queue. A
//! system call's failure is [`Error::Os`], whose `source()` is the [`std::io::Error`]
//! (and `From<std::io::Error>` lets `?` turn one into an `Error`); your own errors fit
//! in [`Error::User`] ([`Error::user`]).
//!
//! A failed `put`/`send` hands the item back in a [`PutError`]. A wait with a timeout
//! that runs out is always `Err(Error::Timeout { .. })` ([`Error::is_timeout`]); the
//! `try_` forms never wait and answer `Ok(None)` when there is nothing to take. The
//! whole convention is on [`Error`](Error#one-timeout-convention).
//!
//! ```
//! use std::time::Duration;
//! let ready = multiproc::Event::new()?;
//! match ready.wait_timeout(Duration::from_millis(1)) {
//!     Ok(()) => unreachable!("nobody set it"),
//!     Err(e) if e.is_timeout() => assert_eq!(e.to_string(), "a wait on an event timed out after 1ms"),
//!     Err(e) => return Err(e),
//! }
//! let io = std::fs::read("/nonexistent").unwrap_err();
//! let err = multiproc::Error::from(io);
//! assert!(std::error::Error::source(&err).is_some());
//! # Ok::<(), multiproc::Error>(())
//! ```
//!
//! ## Logs from workers
//!
//! multiproc emits [`tracing`](https://docs.rs/tracing) spans and events: a span per
//! worker started (`multiproc::spawn`, with rank, pid, start method and name), per
//! `put`/`get` (`multiproc::put`, `multiproc::get`, with the message's size and
//! handle count at `TRACE`), per pool task, and for the shm manager. When the parent
//! has a global subscriber, a worker started afterwards forwards its own events at the
//! levels that subscriber wants: they arrive in the parent with target
//! `multiproc::worker` and the fields `rank`, `pid` and `worker_target` (the event's own
//! target). Nothing to configure; without a subscriber nothing is forwarded.
//!
//! ```no_run
//! fn work(rank: usize, _: ()) {
//!     tracing::info!(rank, "loaded my shard"); // shows up in the parent's subscriber
//! }
//!
//! fn main() -> multiproc::Result<()> {
//!     multiproc::init();
//!     // tracing_subscriber::fmt::init(); — any global subscriber
//!     multiproc::spawn(work, (), 2)
//! }
//! ```
//!
//! ## Interop: ndarray, candle, burn, safetensors, DLPack
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
//! | `burn` | `Tensor::to_burn` (one copy, any tensor) and `Tensor::into_burn` (zero-copy on the only handle of a private tensor, one copy otherwise) give burn's `TensorData`; the `unsafe` `Tensor::as_burn` borrows a shared tensor's mapping without a copy, which burn's NdArray backend takes as it is; `Tensor::from_burn` / `from_burn_shared` (one copy); all thirteen dtypes, burn's `qfloat` refused by name |
//! | `safetensors` | `safetensors::load`: tensors backed by the file's own pages, mapped shared and read-only, that travel to workers as the file's fd (N workers, one page-cache copy); `safetensors::save` |
//! | `dlpack` | `Tensor::to_dlpack` / `Tensor::from_dlpack` (through the `dlpark` crate): zero-copy, the capsule keeps the storage alive |
//!
//! Toolchains: the crate, `ndarray` and `safetensors` build with Rust 1.85; `dlpack`
//! needs 1.88 (dlpark), `candle` 1.89 (candle's own dependencies) and `burn` 1.95
//! (burn 0.22).
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
//!   it, and nothing can share it (which would move its bytes) while the view lives.
//!   A read-only tensor (a safetensors weight) is refused: this process cannot write
//!   the file it maps, but any process that can open the file can.
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
//! **burn: which backends borrow.** burn's `TensorData` holds its bytes in a `Bytes`
//! that may borrow memory it does not own; multiproc's borrowed bytes keep the tensor's
//! storage, and so its shared mapping, alive for as long as burn holds them (after the
//! tensor itself is dropped), and burn never writes them (a mutation copies first).
//! burn's NdArray backend (the one the feature builds) takes them without a copy, but in
//! burn 0.22 nearly every NdArray operation copies a borrowed input into its own array
//! first (one copy per operation, freed after it); burn's Flex backend reads them in
//! place. GPU backends (wgpu, CUDA, ROCm, Metal) upload the bytes, one copy that any host
//! data pays. Make the burn tensor with the data's own dtype,
//! `burn_tensor::Tensor::<2>::from_data(data, (&device, data.dtype()))`, or burn converts
//! it first (a copy). Which route, by the same rule as the ndarray views:
//!
//! - `Tensor::to_burn` copies once: the safe route for a tensor that other
//!   processes may write (a Hogwild parameter, anything received).
//! - `Tensor::into_burn` takes the tensor and borrows it when it is the only handle on
//!   private memory (nobody else can write or share those bytes any more), and copies
//!   otherwise.
//! - `Tensor::as_burn` (`unsafe`) borrows a shared or read-only tensor: you promise
//!   that nobody writes those elements until burn has dropped every tensor and
//!   `TensorData` made from them, e.g. weights that every worker only reads
//!   (`examples/burn_inference.rs`).
//!
//! **DLPack is one-process.** A capsule is a pointer into this process plus a deleter:
//! hand it to a library in this process (a PyO3 extension's `torch.from_dlpack`), and
//! send the multiproc [`Tensor`] itself to other processes. A private tensor is moved
//! into shared memory before export (once), so the capsule's pointer stays valid.
//!
//! ## Python
//!
//! The Python package (`pip install ./crates/multiproc-py` from a checkout) has
//! torch.multiprocessing's API over these queues, locks and tensors. A Python message
//! is a [`Dynamic`] on the wire: a Rust process that talks to Python uses
//! `Queue<Dynamic>` and matches on its variants (the table is on [`Dynamic`]'s page).
//! A process multiproc did not start — a Rust program that a Python script runs, or
//! the reverse — gets its queues as [`parcel`]s: a value sealed into one fd, passed
//! by fd inheritance, opened once.
//!
//! ```
//! use multiproc::{Dynamic, Queue, parcel};
//! let q: Queue<Dynamic> = Queue::new()?;
//! let fd = parcel::seal(&q)?; // Python: multiproc.parcel_for_child(q)
//! let there: Queue<Dynamic> = parcel::open(fd)?; // in the other program
//! there.put(Dynamic::Tuple(vec!["step".into(), 1i64.into()]))?;
//! assert_eq!(q.get()?.as_slice().and_then(|v| v[1].as_int()), Some(1));
//! # Ok::<(), multiproc::Error>(())
//! ```
//!
//! ## Tests
//!
//! In `cargo test` integration tests, where libtest owns `main`, put
//! [`test_init!()`](test_init) at the top of the test file instead of calling [`init`]:
//! workers started from its tests then find their job.
//!
//! ## Platform
//!
//! Linux only (kernel 5.3 or newer for pidfds): multiproc is built on `memfd_create`,
//! `SCM_RIGHTS` over `SOCK_SEQPACKET`, pidfds and process-shared futexes. On other
//! targets the crate does not compile, and says so.

#![deny(unsafe_code)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "multiproc supports Linux only: it is built on memfd_create, SCM_RIGHTS over \
     SOCK_SEQPACKET, pidfds and process-shared futexes, which this target does not have"
);

// Every item is Linux-only: on other targets only the `compile_error!` above is
// reported, not a cascade of missing Linux APIs.
#[cfg(target_os = "linux")]
/// Not public API: the micro-benchmarks' entry points (`benches/`), behind the
/// `bench-internals` feature. May change or vanish in any release.
#[cfg(feature = "bench-internals")]
#[doc(hidden)]
#[path = "bench_api.rs"]
pub mod __bench;
#[cfg(target_os = "linux")]
/// Not public API: the wire decoder's fuzzing entry points (see `fuzz/`), behind the
/// `fuzzing` feature. May change or vanish in any release.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
#[path = "fuzzing.rs"]
pub mod __fuzz;
#[cfg(target_os = "linux")]
/// Not public API: hooks for the integration tests' leak checks, behind the
/// `testing-internals` feature. May change or vanish in any release.
#[cfg(feature = "testing-internals")]
#[doc(hidden)]
#[path = "testing.rs"]
pub mod __testing;
#[cfg(target_os = "linux")]
pub mod cuda;
#[cfg(target_os = "linux")]
pub mod data;
#[cfg(target_os = "linux")]
pub mod dist;
#[cfg(target_os = "linux")]
mod dynamic;
#[cfg(target_os = "linux")]
mod error;
#[cfg(target_os = "linux")]
mod identity_cache;
#[cfg(target_os = "linux")]
mod idle;
#[cfg(target_os = "linux")]
pub mod maintenance;
#[cfg(target_os = "linux")]
mod manager;
#[cfg(all(test, target_os = "linux"))]
mod model_check;
#[cfg(target_os = "linux")]
pub mod parcel;
#[cfg(target_os = "linux")]
mod pool;
#[cfg(target_os = "linux")]
mod process;
#[cfg(target_os = "linux")]
mod queue;
#[cfg(target_os = "linux")]
mod role;
#[cfg(target_os = "linux")]
#[cfg(feature = "safetensors")]
pub mod safetensors;
#[cfg(target_os = "linux")]
mod sharing;
#[cfg(target_os = "linux")]
mod shm;
#[cfg(target_os = "linux")]
mod sync;
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod sys;
#[cfg(target_os = "linux")]
mod tensor;
#[cfg(target_os = "linux")]
mod wire;

#[cfg(target_os = "linux")]
pub use cuda::Device;
#[cfg(target_os = "linux")]
pub use dynamic::Dynamic;
#[cfg(target_os = "linux")]
pub use error::{Error, Failure, LockError, OsError, PutError, Result, TaskFailure, UserError};
#[cfg(target_os = "linux")]
pub use pool::{AsyncResult, Imap, MapResult, Pool, PoolBuilder};
#[cfg(target_os = "linux")]
pub use process::{ChildProcess, CurrentProcess, active_children, cpu_count, current_process};
#[cfg(target_os = "linux")]
pub use process::{
    ExitStatus, IntoWorkerOutcome, Process, ProcessBuilder, ProcessContext, SpawnOptions,
    StartMethod, init, spawn, start_processes,
};
#[cfg(target_os = "linux")]
pub use queue::{Connection, JoinableQueue, Queue, QueueIter, QueueTryIter, SimpleQueue, pipe};

/// Python's `multiprocessing.forkserver`: [`ensure_running`](forkserver::ensure_running)
/// starts this program's fork server ahead of its first use.
#[cfg(target_os = "linux")]
pub mod forkserver {
    pub use crate::process::ensure_running;
}

#[cfg(target_os = "linux")]
/// Python's `multiprocessing.connection`: [`Connection`] and [`wait`](connection::wait)
/// on several queues, pipe ends and processes at once.
pub mod connection {
    pub use crate::queue::{Connection, Waitable, wait};
}
#[cfg(target_os = "linux")]
pub use sharing::{
    SharingStrategy, get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy,
};
/// A party's arrival at a [`Barrier`], for a caller that waits in slices (the Python
/// package): see `Barrier::arrive`.
#[cfg(target_os = "linux")]
#[doc(hidden)]
pub use sync::BarrierArrival;
#[cfg(target_os = "linux")]
pub use sync::{
    Barrier, Bits64, BoundedSemaphore, Condition, ConditionGuard, Event, Lock, LockGuard, RLock,
    RLockGuard, Semaphore, SemaphoreGuard, Value,
};
#[cfg(target_os = "linux")]
pub use tensor::{DType, Element, Storage, Tensor};
