//! [`Pool`]: a pool of worker processes that run tasks, like `multiprocessing.Pool`.
//!
//! The parent owns a dispatcher thread and, per worker, a process and a pipe. The
//! dispatcher hands each worker one chunk of tasks at a time and remembers which chunk
//! is where, so when a worker dies mid-task (a signal, the OOM killer, `exit`) exactly
//! that chunk fails with the cause and the worker is replaced — the pool never hangs,
//! unlike Python's and torch's. A task that panics or returns `Err` fails alone.
//!
//! Task functions are plain `fn(A) -> Result<R, E>`: they cross the process boundary as
//! code offsets (see [`CodeRef`]); arguments and results are wire values, so tensors in
//! them travel by handle through shared memory.
//!
//! # Safety
//!
//! The only unsafe code turns a received [`CodeRef`] back into a function pointer. Each
//! call names the exact pointer type the parent took the offset from: the chunk
//! trampoline is `run_chunk::<A, R, E>` as a `ChunkTrampoline`, and that trampoline
//! alone resolves the task function, as the `fn(A) -> Result<R, E>` it was
//! monomorphized for; the initializer is a `fn()`. `CodeRef` checks that both sides
//! run the same executable.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::{self, Display};
use std::os::fd::AsFd;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::process::code::CodeRef;
use crate::process::{Process, StartMethod};
use crate::queue::{Connection, pipe};
use crate::wire::Opaque;
use crate::{Error, Result};

/// How often the dispatcher checks on workers when nothing else wakes it.
const TICK: Duration = Duration::from_millis(100);

/// What travels between the dispatcher and a worker (one type, both directions).
#[derive(Debug, Serialize, Deserialize)]
enum PoolMsg {
    /// Run `function` over the decoded chunk of arguments.
    Chunk {
        job: u64,
        first: usize,
        trampoline: CodeRef,
        function: CodeRef,
        args: Opaque,
    },
    /// The outcome of a chunk: per task, the encoded result or the failure text; or a
    /// failure of the whole chunk (its arguments could not be decoded).
    Done {
        job: u64,
        first: usize,
        outcome: std::result::Result<Opaque, String>,
    },
    /// Finish: exit once this is read.
    Stop,
}

type ChunkTrampoline = fn(CodeRef, Opaque) -> std::result::Result<Opaque, String>;

/// Decodes a chunk of `A`, runs `f` on each under `catch_unwind`, encodes the results.
fn run_chunk<A, R, E>(function: CodeRef, args: Opaque) -> std::result::Result<Opaque, String>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
{
    let items: Vec<A> = args
        .decode()
        .map_err(|e| format!("cannot decode the task's arguments: {e}"))?;
    // SAFETY: the parent took this offset from a `fn(A) -> Result<R, E>` for exactly
    // these types (this trampoline is the one monomorphized for them) in the same
    // executable, which `CodeRef` checks.
    let f = unsafe { function.resolve::<fn(A) -> std::result::Result<R, E>>() }?;
    let results: Vec<std::result::Result<Opaque, String>> = items
        .into_iter()
        .map(
            |a| match std::panic::catch_unwind(AssertUnwindSafe(|| f(a))) {
                Ok(Ok(r)) => {
                    Opaque::encode(&r).map_err(|e| format!("cannot encode its result: {e}"))
                }
                Ok(Err(e)) => Err(format!("returned an error: {e}")),
                Err(payload) => Err(format!(
                    "panicked: {}",
                    crate::process::panic_text(&*payload)
                )),
            },
        )
        .collect();
    Opaque::encode(&results).map_err(|e| format!("cannot encode the task's results: {e}"))
}

#[derive(Serialize, Deserialize)]
struct WorkerArgs {
    conn: Connection<PoolMsg>,
    initializer: Option<CodeRef>,
    max_tasks: Option<u64>,
}

/// The body of every pool worker process.
fn pool_worker(_rank: usize, args: WorkerArgs) -> std::result::Result<(), String> {
    if let Some(init) = args.initializer {
        // SAFETY: the offset was taken from a `fn()` in the same executable.
        let init = unsafe { init.resolve::<fn()>() }?;
        init();
    }
    let mut done = 0u64;
    loop {
        let msg = match args.conn.recv() {
            Ok(m) => m,
            // The pool is gone: nothing more to do.
            Err(Error::Closed(_)) => return Ok(()),
            Err(e) => return Err(format!("pool worker cannot read its next task: {e}")),
        };
        let PoolMsg::Chunk {
            job,
            first,
            trampoline,
            function,
            args: chunk,
        } = msg
        else {
            return Ok(());
        };
        let outcome = match unsafe_resolve_trampoline(trampoline) {
            Ok(t) => t(function, chunk),
            Err(e) => Err(e),
        };
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

fn unsafe_resolve_trampoline(t: CodeRef) -> std::result::Result<ChunkTrampoline, String> {
    // SAFETY: the parent took this offset from a `ChunkTrampoline` (`run_chunk` for some
    // types) in the same executable, which `CodeRef` checks.
    unsafe { t.resolve::<ChunkTrampoline>() }
}

/// Options for a [`Pool`].
#[derive(Debug, Clone)]
pub struct PoolBuilder {
    processes: usize,
    initializer: Option<fn()>,
    max_tasks_per_child: Option<u64>,
    start_method: StartMethod,
}

impl PoolBuilder {
    /// The number of worker processes (default: the number of CPUs).
    pub fn processes(mut self, n: usize) -> Self {
        self.processes = n;
        self
    }

    /// A function each worker runs once when it starts.
    pub fn initializer(mut self, f: fn()) -> Self {
        self.initializer = Some(f);
        self
    }

    /// Replace a worker by a fresh process after it ran this many chunks of tasks.
    pub fn max_tasks_per_child(mut self, n: u64) -> Self {
        self.max_tasks_per_child = Some(n.max(1));
        self
    }

    /// How workers are started (default [`StartMethod::Spawn`]).
    pub fn start_method(mut self, method: StartMethod) -> Self {
        self.start_method = method;
        self
    }

    /// Starts the workers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 processes; any error starting a worker.
    pub fn build(self) -> Result<Pool> {
        Pool::start(self)
    }
}

/// One chunk that is waiting for, or running on, a worker.
struct Pending {
    job: u64,
    first: usize,
    len: usize,
    trampoline: CodeRef,
    function: CodeRef,
    args: Opaque,
}

/// A chunk's outcome on its way to the caller: `(first index, per-task results)`.
type ChunkOutcome = (usize, Vec<Result<Opaque>>);

#[derive(Default)]
struct State {
    queue: VecDeque<Pending>,
    jobs: HashMap<u64, mpsc::Sender<ChunkOutcome>>,
    closed: bool,
    terminate: bool,
    /// Set by the dispatcher when it has stopped every worker and exited.
    finished: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    wake_tx: Connection<u8>,
    next_job: AtomicU64,
}

impl Shared {
    fn wake(&self) {
        // A full wake pipe already means "wake up"; nothing to do if this fails.
        let _ = self.wake_tx.send_timeout(0, Duration::ZERO);
    }
}

/// A pool of worker processes, like `multiprocessing.Pool`.
///
/// Dropping the pool terminates its workers; call [`close`](Self::close) and
/// [`join`](Self::join) to let queued tasks finish first.
///
/// # Examples
///
/// ```
/// fn square(x: u64) -> Result<u64, String> { Ok(x * x) }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     let pool = multiproc::Pool::new(2)?;
///     assert_eq!(pool.map(square, 0..5u64)?, vec![0, 1, 4, 9, 16]);
///     Ok(())
/// }
/// ```
pub struct Pool {
    shared: Arc<Shared>,
    dispatcher: Option<JoinHandle<()>>,
    processes: usize,
}

impl Pool {
    /// A pool of `processes` workers started with [`StartMethod::Spawn`].
    ///
    /// # Errors
    /// As [`PoolBuilder::build`].
    pub fn new(processes: usize) -> Result<Self> {
        Self::builder().processes(processes).build()
    }

    /// Options for a pool.
    pub fn builder() -> PoolBuilder {
        PoolBuilder {
            processes: std::thread::available_parallelism().map_or(1, |n| n.get()),
            initializer: None,
            max_tasks_per_child: None,
            start_method: StartMethod::Spawn,
        }
    }

    fn start(options: PoolBuilder) -> Result<Self> {
        if options.processes == 0 {
            return Err(Error::InvalidArgument(
                "a pool needs at least 1 process".into(),
            ));
        }
        let (wake_tx, wake_rx) = pipe::<u8>()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            wake_tx,
            next_job: AtomicU64::new(1),
        });
        let mut workers = Vec::with_capacity(options.processes);
        for rank in 0..options.processes {
            workers.push(Worker::start(rank, &options)?);
        }
        let processes = options.processes;
        let dispatcher_shared = Arc::clone(&shared);
        let dispatcher = std::thread::Builder::new()
            .name("multiproc-pool".into())
            .spawn(move || {
                Dispatcher {
                    shared: dispatcher_shared,
                    wake_rx,
                    workers,
                    options,
                }
                .run()
            })
            .map_err(|e| Error::os("starting the pool's dispatcher thread", e))?;
        Ok(Self {
            shared,
            dispatcher: Some(dispatcher),
            processes,
        })
    }

    /// The number of worker processes.
    pub fn processes(&self) -> usize {
        self.processes
    }

    /// Registers a new job; its chunk outcomes arrive on the receiver.
    fn new_job(&self) -> Result<(u64, mpsc::Receiver<ChunkOutcome>)> {
        let job = self.shared.next_job.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let mut state = self.lock();
        if state.closed || state.terminate {
            return Err(Error::Closed(
                "the pool is closed: no new tasks are accepted".into(),
            ));
        }
        state.jobs.insert(job, tx);
        Ok((job, rx))
    }

    /// Queues `items` (task indices `first..`) of `job` in chunks of `chunksize`.
    fn enqueue<A, R, E>(
        &self,
        job: u64,
        f: fn(A) -> std::result::Result<R, E>,
        items: Vec<A>,
        mut first: usize,
        chunksize: usize,
    ) -> Result<()>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let trampoline = CodeRef::of(run_chunk::<A, R, E> as ChunkTrampoline as usize);
        let function = CodeRef::of(f as usize);
        let mut chunks = Vec::new();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            let chunk: Vec<A> = items.by_ref().take(chunksize.max(1)).collect();
            let len = chunk.len();
            chunks.push(Pending {
                job,
                first,
                len,
                trampoline,
                function,
                args: Opaque::encode(&chunk)?,
            });
            first += len;
        }
        let mut state = self.lock();
        if state.terminate {
            return Err(dispatcher_gone());
        }
        state.queue.extend(chunks);
        drop(state);
        self.shared.wake();
        Ok(())
    }

    /// Forgets a job whose caller no longer waits for it.
    fn end_job(&self, job: u64) {
        self.lock().jobs.remove(&job);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on every item and returns the results in order.
    ///
    /// # Errors
    /// The first failed task, as [`Error::TaskFailed`] with its index (every other task
    /// still ran); [`Error::Closed`] after [`close`](Self::close).
    pub fn map<A, R, E>(
        &self,
        f: fn(A) -> std::result::Result<R, E>,
        items: impl IntoIterator<Item = A>,
    ) -> Result<Vec<R>>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let items: Vec<A> = items.into_iter().collect();
        let chunksize = items.len().div_ceil(self.processes * 4).max(1);
        self.map_chunked(f, items, chunksize)
    }

    /// [`map`](Self::map) with tasks sent to workers `chunksize` at a time.
    ///
    /// # Errors
    /// As [`map`](Self::map).
    pub fn map_chunked<A, R, E>(
        &self,
        f: fn(A) -> std::result::Result<R, E>,
        items: impl IntoIterator<Item = A>,
        chunksize: usize,
    ) -> Result<Vec<R>>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let items: Vec<A> = items.into_iter().collect();
        let n = items.len();
        let (job, rx) = self.new_job()?;
        let queued = self.enqueue(job, f, items, 0, chunksize);
        let result = queued.and_then(|()| self.collect_all::<R>(&rx, n));
        self.end_job(job);
        result
    }

    fn collect_all<R: DeserializeOwned>(
        &self,
        rx: &mpsc::Receiver<ChunkOutcome>,
        n: usize,
    ) -> Result<Vec<R>> {
        let mut out: Vec<Option<Result<R>>> = (0..n).map(|_| None).collect();
        let mut got = 0;
        while got < n {
            let (first, results) = rx.recv().map_err(|_| dispatcher_gone())?;
            for (i, r) in results.into_iter().enumerate() {
                let index = first + i;
                if let Some(slot) = out.get_mut(index) {
                    *slot = Some(
                        r.and_then(|o| o.decode::<R>())
                            .map_err(|e| with_index(e, index)),
                    );
                    got += 1;
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(dispatcher_gone())))
            .collect()
    }

    /// Runs `f` on every item and yields the results in order, as they become
    /// available. Items are submitted as the iterator is consumed, a few per worker
    /// ahead.
    pub fn imap<A, R, E, I>(
        &self,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
    ) -> Imap<'_, A, R, E, I::IntoIter>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
        I: IntoIterator<Item = A>,
    {
        Imap::new(self, f, items.into_iter(), true)
    }

    /// As [`imap`](Self::imap), yielding results in the order they complete. A failed
    /// task's error carries its index ([`Error::TaskFailed`]).
    pub fn imap_unordered<A, R, E, I>(
        &self,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
    ) -> Imap<'_, A, R, E, I::IntoIter>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
        I: IntoIterator<Item = A>,
    {
        Imap::new(self, f, items.into_iter(), false)
    }

    /// Runs `f(arg)` on some worker; returns a handle to its result.
    ///
    /// # Errors
    /// [`Error::Closed`] after [`close`](Self::close); an encoding error for `arg`.
    pub fn apply_async<A, R, E>(
        &self,
        f: fn(A) -> std::result::Result<R, E>,
        arg: A,
    ) -> Result<AsyncResult<R>>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let (job, rx) = self.new_job()?;
        if let Err(e) = self.enqueue(job, f, vec![arg], 0, 1) {
            self.end_job(job);
            return Err(e);
        }
        Ok(AsyncResult {
            rx,
            value: None,
            _r: std::marker::PhantomData,
        })
    }

    /// Accepts no more tasks; queued ones still run. Follow with [`join`](Self::join).
    pub fn close(&self) {
        self.lock().closed = true;
        self.shared.wake();
    }

    /// Stops every worker now; queued and running tasks fail with [`Error::Closed`].
    pub fn terminate(&self) {
        self.lock().terminate = true;
        self.shared.wake();
    }

    /// Waits until the workers have exited, after [`close`](Self::close) or
    /// [`terminate`](Self::terminate), at most `timeout` (`None`: as long as it takes).
    /// Returns whether they have.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the pool is still open.
    pub fn join(&mut self, timeout: Option<Duration>) -> Result<bool> {
        {
            let state = self.lock();
            if !state.closed && !state.terminate {
                return Err(Error::InvalidArgument(
                    "join() on a pool that is still open: call close() or terminate() first".into(),
                ));
            }
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut state = self.lock();
        while !state.finished {
            match deadline {
                None => {
                    state = self
                        .shared
                        .changed
                        .wait(state)
                        .unwrap_or_else(|p| p.into_inner())
                }
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(false);
                    }
                    state = self
                        .shared
                        .changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        drop(state);
        if let Some(d) = self.dispatcher.take() {
            let _ = d.join();
        }
        Ok(true)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.terminate();
        if let Some(d) = self.dispatcher.take() {
            let _ = d.join();
        }
    }
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("processes", &self.processes)
            .finish()
    }
}

fn dispatcher_gone() -> Error {
    Error::Closed("the pool was terminated before the task finished".into())
}

/// The result of [`Pool::apply_async`].
pub struct AsyncResult<R> {
    rx: mpsc::Receiver<ChunkOutcome>,
    value: Option<Result<R>>,
    _r: std::marker::PhantomData<R>,
}

impl<R: Serialize + DeserializeOwned> AsyncResult<R> {
    /// Whether the result has arrived.
    pub fn ready(&mut self) -> bool {
        if self.value.is_none() {
            if let Ok(outcome) = self.rx.try_recv() {
                self.value = Some(first_result(outcome));
            }
        }
        self.value.is_some()
    }

    /// Waits at most `timeout` (`None`: as long as it takes) for the result.
    ///
    /// # Errors
    /// [`Error::TaskFailed`] when the task panicked, returned `Err` or its worker died;
    /// [`Error::Timeout`] when it did not finish in time (call again to keep waiting).
    pub fn get(&mut self, timeout: Option<Duration>) -> Result<R> {
        if let Some(v) = self.value.take() {
            return v;
        }
        let outcome = match timeout {
            None => self.rx.recv().map_err(|_| dispatcher_gone())?,
            Some(t) => match self.rx.recv_timeout(t) {
                Ok(o) => o,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout(format!(
                        "the task did not finish within {t:?}"
                    )));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(dispatcher_gone()),
            },
        };
        first_result(outcome)
    }
}

fn first_result<R: DeserializeOwned>((_, results): ChunkOutcome) -> Result<R> {
    results
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(dispatcher_gone()))
        .and_then(|o| o.decode::<R>())
}

/// The iterator of [`Pool::imap`] and [`Pool::imap_unordered`]: yields `Result<R>` per
/// item (a failed task is an `Err` with its index; the others still come).
pub struct Imap<'p, A, R, E, I> {
    pool: &'p Pool,
    f: fn(A) -> std::result::Result<R, E>,
    items: I,
    ordered: bool,
    job: Option<(u64, mpsc::Receiver<ChunkOutcome>)>,
    submitted: usize,
    yielded: usize,
    /// Results that arrived, by index, not yet yielded.
    ready: BTreeMap<usize, Result<Opaque>>,
    window: usize,
    failed: Option<Error>,
}

impl<'p, A, R, E, I> Imap<'p, A, R, E, I>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
    I: Iterator<Item = A>,
{
    fn new(pool: &'p Pool, f: fn(A) -> std::result::Result<R, E>, items: I, ordered: bool) -> Self {
        let (job, failed) = match pool.new_job() {
            Ok(j) => (Some(j), None),
            Err(e) => (None, Some(e)),
        };
        Self {
            pool,
            f,
            items,
            ordered,
            job,
            submitted: 0,
            yielded: 0,
            ready: BTreeMap::new(),
            window: pool.processes * 4,
            failed,
        }
    }

    /// Keeps up to `window` tasks submitted ahead of what has been yielded.
    fn top_up(&mut self, job: u64) -> Result<()> {
        let mut batch = Vec::new();
        while self.submitted + batch.len() - self.yielded < self.window {
            match self.items.next() {
                Some(item) => batch.push(item),
                None => break,
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let n = batch.len();
        self.pool.enqueue(job, self.f, batch, self.submitted, 1)?;
        self.submitted += n;
        Ok(())
    }
}

impl<A, R, E, I> Iterator for Imap<'_, A, R, E, I>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
    I: Iterator<Item = A>,
{
    type Item = Result<R>;

    fn next(&mut self) -> Option<Result<R>> {
        if let Some(e) = self.failed.take() {
            return Some(Err(e));
        }
        let job = self.job.as_ref()?.0;
        if let Err(e) = self.top_up(job) {
            return Some(Err(e));
        }
        loop {
            if self.yielded == self.submitted {
                return None;
            }
            let pick = if self.ordered {
                self.ready
                    .contains_key(&self.yielded)
                    .then_some(self.yielded)
            } else {
                self.ready.keys().next().copied()
            };
            if let Some(index) = pick {
                let r = self
                    .ready
                    .remove(&index)
                    .unwrap_or_else(|| Err(dispatcher_gone()));
                self.yielded += 1;
                return Some(
                    r.and_then(|o| o.decode::<R>())
                        .map_err(|e| with_index(e, index)),
                );
            }
            let rx = &self.job.as_ref()?.1;
            match rx.recv() {
                Ok((first, results)) => {
                    for (k, r) in results.into_iter().enumerate() {
                        self.ready.insert(first + k, r);
                    }
                }
                Err(_) => return Some(Err(dispatcher_gone())),
            }
        }
    }
}

impl<A, R, E, I> Drop for Imap<'_, A, R, E, I> {
    fn drop(&mut self) {
        if let Some((job, _)) = &self.job {
            self.pool.end_job(*job);
        }
    }
}

fn with_index(e: Error, index: usize) -> Error {
    match e {
        Error::TaskFailed { .. } => e,
        other => Error::TaskFailed {
            index,
            message: other.to_string(),
        },
    }
}

/// One worker process and the parent's end of its pipe.
struct Worker {
    process: Process,
    conn: Connection<PoolMsg>,
    /// The chunk it is running: `(job, first, len)`.
    running: Option<(u64, usize, usize)>,
    chunks_done: u64,
    rank: usize,
}

impl Worker {
    fn start(rank: usize, options: &PoolBuilder) -> Result<Self> {
        let (here, there) = pipe::<PoolMsg>()?;
        let args = WorkerArgs {
            conn: there,
            initializer: options.initializer.map(|f| CodeRef::of(f as usize)),
            max_tasks: options.max_tasks_per_child,
        };
        let mut process = Process::new(pool_worker, rank, args)
            .start_method(options.start_method)
            .daemon(true);
        process.start()?;
        // `process` dropped its copy of the worker's end when it started, so the pipe
        // closes the moment the worker dies.
        Ok(Self {
            process,
            conn: here,
            running: None,
            chunks_done: 0,
            rank,
        })
    }

    /// Why the worker ended, for the error of the chunk it was running.
    fn death_cause(&mut self) -> String {
        let pid = self.process.pid().unwrap_or(0);
        match self.process.join(Some(Duration::from_secs(5))) {
            Ok(Some(status)) => match self.process.error() {
                // It exited 0 without a report: say why (a missing `init`).
                Some(e) if status.success() => format!("pool worker (pid {pid}): {e}"),
                _ => format!("pool worker (pid {pid}) {status} while running it"),
            },
            Ok(None) => {
                let _ = self.process.kill();
                let _ = self.process.join(Some(Duration::from_secs(5)));
                format!("pool worker (pid {pid}) stopped answering while running it and was killed")
            }
            Err(e) => format!("pool worker (pid {pid}) was lost while running it: {e}"),
        }
    }
}

/// The parent's thread that feeds workers and routes results.
struct Dispatcher {
    shared: Arc<Shared>,
    wake_rx: Connection<u8>,
    workers: Vec<Worker>,
    options: PoolBuilder,
}

impl Dispatcher {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(mut self) {
        loop {
            let (terminate, closed) = {
                let s = self.lock();
                (s.terminate, s.closed)
            };
            if terminate {
                self.shutdown(true);
                break;
            }
            if let Err(e) = self.feed() {
                tracing::warn!("pool dispatcher: {e}");
            }
            if closed
                && self.lock().queue.is_empty()
                && self.workers.iter().all(|w| w.running.is_none())
            {
                self.shutdown(false);
                break;
            }
            self.wait_and_collect();
        }
        let mut state = self.lock();
        // Fail whatever is still queued or waited for.
        state.queue.clear();
        state.jobs.clear();
        state.finished = true;
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Gives every idle worker the next queued chunk.
    fn feed(&mut self) -> Result<()> {
        for i in 0..self.workers.len() {
            if self.workers[i].running.is_some() {
                continue;
            }
            let Some(chunk) = self.lock().queue.pop_front() else {
                return Ok(());
            };
            let meta = (chunk.job, chunk.first, chunk.len);
            let msg = PoolMsg::Chunk {
                job: chunk.job,
                first: chunk.first,
                trampoline: chunk.trampoline,
                function: chunk.function,
                args: chunk.args,
            };
            match self.workers[i].conn.send(msg) {
                Ok(()) => self.workers[i].running = Some(meta),
                Err(back) => {
                    // The worker is gone; requeue the chunk and let the death be handled.
                    if let PoolMsg::Chunk {
                        job,
                        first,
                        trampoline,
                        function,
                        args,
                    } = back.item
                    {
                        self.lock().queue.push_front(Pending {
                            job,
                            first,
                            len: meta.2,
                            trampoline,
                            function,
                            args,
                        });
                    }
                    self.replace(i, None);
                }
            }
        }
        Ok(())
    }

    /// Sleeps until a worker answers, a worker dies, a caller submits, or a tick.
    fn wait_and_collect(&mut self) {
        let mut fds = vec![self.wake_rx.as_fd()];
        fds.extend(self.workers.iter().map(|w| w.conn.as_fd()));
        let ready = crate::sys::socket::poll_readable(&fds, Some(Instant::now() + TICK));
        drop(fds);
        let ready = match ready {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("pool dispatcher poll: {e}");
                vec![false; self.workers.len() + 1]
            }
        };
        if ready.first().copied().unwrap_or(false) {
            while let Ok(Some(_)) = self.wake_rx.recv_timeout(Duration::ZERO) {}
        }
        for i in 0..self.workers.len() {
            if ready.get(i + 1).copied().unwrap_or(false) {
                self.collect(i);
            } else if !self.workers[i].process.is_alive() {
                // Forked workers share fds with their siblings, so a death may not
                // close the pipe: the liveness check catches it.
                let cause = self.workers[i].death_cause();
                self.replace(i, Some(cause));
            }
        }
    }

    /// Reads what worker `i` sent: a result, or the end of its pipe.
    fn collect(&mut self, i: usize) {
        match self.workers[i].conn.recv_timeout(Duration::ZERO) {
            Ok(Some(PoolMsg::Done {
                job,
                first,
                outcome,
            })) => {
                let Some((rjob, rfirst, len)) = self.workers[i].running.take() else {
                    return;
                };
                if (rjob, rfirst) != (job, first) {
                    tracing::warn!(
                        "pool worker {} answered for a chunk it was not running",
                        self.workers[i].rank
                    );
                }
                let results = match outcome.and_then(|o| {
                    o.decode::<Vec<std::result::Result<Opaque, String>>>()
                        .map_err(|e| format!("cannot decode the results: {e}"))
                }) {
                    Ok(rs) => rs
                        .into_iter()
                        .enumerate()
                        .map(|(k, r)| {
                            r.map_err(|message| Error::TaskFailed {
                                index: rfirst + k,
                                message,
                            })
                        })
                        .collect(),
                    Err(message) => (0..len)
                        .map(|k| {
                            Err(Error::TaskFailed {
                                index: rfirst + k,
                                message: message.clone(),
                            })
                        })
                        .collect(),
                };
                self.route(rjob, rfirst, results);
                self.workers[i].chunks_done += 1;
                if self
                    .options
                    .max_tasks_per_child
                    .is_some_and(|m| self.workers[i].chunks_done >= m)
                {
                    // It exits by itself after this chunk; start its successor.
                    let _ = self.workers[i].process.join(Some(Duration::from_secs(5)));
                    self.replace(i, None);
                }
            }
            Ok(Some(_)) | Ok(None) => {}
            Err(Error::Closed(_)) => {
                let cause = self.workers[i].death_cause();
                self.replace(i, Some(cause));
            }
            Err(e) => tracing::warn!("pool worker {}: {e}", self.workers[i].rank),
        }
    }

    fn route(&self, job: u64, first: usize, results: Vec<Result<Opaque>>) {
        if let Some(tx) = self.lock().jobs.get(&job) {
            let _ = tx.send((first, results));
        }
    }

    /// Replaces worker `i` by a fresh process; fails the chunk it was running with
    /// `cause`.
    fn replace(&mut self, i: usize, cause: Option<String>) {
        if let Some((job, first, len)) = self.workers[i].running.take() {
            let message = cause.unwrap_or_else(|| "its pool worker was lost".into());
            let results = (0..len)
                .map(|k| {
                    Err(Error::TaskFailed {
                        index: first + k,
                        message: message.clone(),
                    })
                })
                .collect();
            self.route(job, first, results);
        }
        let _ = self.workers[i].process.kill();
        let _ = self.workers[i].process.join(Some(Duration::from_secs(5)));
        if self.lock().terminate {
            return;
        }
        let rank = self.workers[i].rank;
        match Worker::start(rank, &self.options) {
            Ok(w) => self.workers[i] = w,
            Err(e) => tracing::error!("cannot replace pool worker {rank}: {e}"),
        }
    }

    /// Stops every worker: politely (a `Stop` message, then a grace period) unless
    /// `now`, then by SIGKILL.
    fn shutdown(&mut self, now: bool) {
        if !now {
            for w in &self.workers {
                let _ = w.conn.send_timeout(PoolMsg::Stop, Duration::from_secs(1));
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            for w in &mut self.workers {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = w.process.join(Some(left));
            }
        }
        for w in &mut self.workers {
            if w.process.is_alive() {
                let _ = w.process.kill();
            }
            let _ = w.process.join(Some(Duration::from_secs(5)));
        }
    }
}
