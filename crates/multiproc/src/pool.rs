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
//! run the same executable. The other call forms ([`forms`]: `starmap`, an initializer
//! with arguments) follow the same rule with their own trampolines.

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

mod forms;

use forms::InitCall;
pub use forms::MapResult;

/// How often the dispatcher checks on workers when nothing else wakes it.
const TICK: Duration = Duration::from_millis(100);

/// What travels between the dispatcher and a worker (one type, both directions).
#[derive(Debug, Serialize, Deserialize)]
enum PoolMsg {
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
type Report<'a> = &'a mut dyn FnMut(usize, std::result::Result<Opaque, String>) -> bool;

type ChunkTrampoline = fn(CodeRef, Opaque, usize, Report<'_>) -> std::result::Result<(), String>;

/// Decodes a chunk of `A`, runs `f` under `catch_unwind` on each from item `skip` on,
/// and reports each result as it comes.
fn run_chunk<A, R, E>(
    function: CodeRef,
    args: Opaque,
    skip: usize,
    report: Report<'_>,
) -> std::result::Result<(), String>
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
    for (k, a) in items.into_iter().enumerate().skip(skip) {
        let outcome = run_task(|| f(a));
        if !report(k, outcome) {
            break;
        }
    }
    Ok(())
}

/// Runs one task under `catch_unwind` and encodes its result or says how it failed.
fn run_task<R: Serialize, E: Display>(
    task: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<Opaque, String> {
    let _task = tracing::debug_span!("multiproc::pool_task").entered();
    match std::panic::catch_unwind(AssertUnwindSafe(task)) {
        Ok(Ok(r)) => Opaque::encode(&r).map_err(|e| format!("cannot encode its result: {e}")),
        Ok(Err(e)) => Err(format!("returned an error: {e}")),
        Err(payload) => Err(format!(
            "panicked: {}",
            crate::process::panic_text(&*payload)
        )),
    }
}

#[derive(Serialize, Deserialize)]
struct WorkerArgs {
    conn: Connection<PoolMsg>,
    initializer: Option<CodeRef>,
    /// The initializer with arguments ([`PoolBuilder::initializer_with`]).
    init_with: Option<InitCall>,
    max_tasks: Option<u64>,
}

/// The body of every pool worker process.
fn pool_worker(_rank: usize, args: WorkerArgs) -> std::result::Result<(), String> {
    if let Some(init) = args.initializer {
        // SAFETY: the offset was taken from a `fn()` in the same executable.
        let init = unsafe { init.resolve::<fn()>() }?;
        init();
    }
    if let Some(call) = args.init_with {
        call.run()?;
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
            skip,
            trampoline,
            function,
            args: chunk,
        } = msg
        else {
            return Ok(());
        };
        let mut parent_gone = false;
        let mut report = |k: usize, outcome| {
            let sent = args.conn.send(PoolMsg::TaskDone {
                job,
                index: first + k,
                outcome,
            });
            parent_gone = sent.is_err();
            !parent_gone
        };
        let outcome = match unsafe_resolve_trampoline(trampoline) {
            Ok(t) => t(function, chunk, skip, &mut report),
            Err(e) => Err(e),
        };
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
    init_with: Option<forms::InitWith>,
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
    /// Items of the chunk already run (by a worker that died running the next one).
    skip: usize,
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
            init_with: None,
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
        first: usize,
        chunksize: usize,
    ) -> Result<()>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let trampoline = CodeRef::of(run_chunk::<A, R, E> as ChunkTrampoline as usize);
        let function = CodeRef::of(f as usize);
        self.enqueue_code(job, trampoline, function, items, first, chunksize)
    }

    /// Queues `items` to be run by `trampoline` (a [`ChunkTrampoline`] monomorphized
    /// for `function`'s exact type).
    fn enqueue_code<A: Serialize>(
        &self,
        job: u64,
        trampoline: CodeRef,
        function: CodeRef,
        items: Vec<A>,
        mut first: usize,
        chunksize: usize,
    ) -> Result<()> {
        let mut chunks = Vec::new();
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            let chunk: Vec<A> = items.by_ref().take(chunksize.max(1)).collect();
            let len = chunk.len();
            chunks.push(Pending {
                job,
                first,
                len,
                skip: 0,
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
        let _span = tracing::debug_span!("multiproc::pool_map", tasks = n, chunksize).entered();
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
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the pool is still open; [`Error::Timeout`] when
    /// workers still run at the deadline.
    pub fn join(&mut self, timeout: Option<Duration>) -> Result<()> {
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
                        return Err(Error::timeout(
                            format!("a join of a pool of {} workers", self.processes),
                            timeout,
                        ));
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
        Ok(())
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
                    return Err(Error::timeout("waiting for a pool task's result", Some(t)));
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

/// A chunk on a worker, and how far it got.
struct Running {
    job: u64,
    first: usize,
    len: usize,
    /// The next task of the chunk to report (its index in the job): the one running.
    next: usize,
    /// What it takes to rerun the chunk's unstarted tasks elsewhere, when its
    /// arguments are plain data (see the module docs).
    retry: Option<(CodeRef, CodeRef, Opaque)>,
}

/// One worker process and the parent's end of its pipe.
struct Worker {
    process: Process,
    conn: Connection<PoolMsg>,
    /// The chunk it is running.
    running: Option<Running>,
    chunks_done: u64,
    rank: usize,
}

impl Worker {
    fn start(rank: usize, options: &PoolBuilder) -> Result<Self> {
        let (here, there) = pipe::<PoolMsg>()?;
        let args = WorkerArgs {
            conn: there,
            initializer: options.initializer.map(|f| CodeRef::of(f as usize)),
            init_with: options.init_with.as_ref().map(|i| i.call()).transpose()?,
            max_tasks: options.max_tasks_per_child,
        };
        let mut process = Process::new(pool_worker, rank, args)
            .with_name(format!("PoolWorker-{rank}"))
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
            Ok(status) => match self.process.error() {
                // It exited 0 without a report: say why (a missing `init`).
                Some(e) if status.success() => format!("pool worker (pid {pid}): {e}"),
                _ => format!("pool worker (pid {pid}) {status} while running it"),
            },
            Err(e) if e.is_timeout() => {
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
            let running = Running {
                job: chunk.job,
                first: chunk.first,
                len: chunk.len,
                next: chunk.first + chunk.skip,
                retry: chunk
                    .args
                    .try_clone_plain()
                    .map(|a| (chunk.trampoline, chunk.function, a)),
            };
            let msg = PoolMsg::Chunk {
                job: chunk.job,
                first: chunk.first,
                skip: chunk.skip,
                trampoline: chunk.trampoline,
                function: chunk.function,
                args: chunk.args,
            };
            match self.workers[i].conn.send(msg) {
                Ok(()) => self.workers[i].running = Some(running),
                Err(back) => {
                    // The worker is gone; requeue the chunk and let the death be handled.
                    if let PoolMsg::Chunk {
                        job,
                        first,
                        skip,
                        trampoline,
                        function,
                        args,
                    } = back.item
                    {
                        self.lock().queue.push_front(Pending {
                            job,
                            first,
                            len: running.len,
                            skip,
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
            while let Ok(Some(_)) = self.wake_rx.try_recv() {}
        }
        for i in 0..self.workers.len() {
            if ready.get(i + 1).copied().unwrap_or(false) {
                self.collect(i);
            } else if !self.workers[i].process.is_alive() {
                // Forked workers share fds with their siblings, so a death may not
                // close the pipe: the liveness check catches it. Take in what it
                // reported before it died first.
                self.collect(i);
                if self.workers[i].process.is_alive() {
                    continue; // `collect` replaced it (its pipe closed)
                }
                let cause = self.workers[i].death_cause();
                self.replace(i, Some(cause));
            }
        }
    }

    /// Reads everything worker `i` has sent: results, the end of a chunk, or the end of
    /// its pipe (then it is replaced).
    fn collect(&mut self, i: usize) {
        loop {
            match self.workers[i].conn.try_recv() {
                Ok(Some(PoolMsg::TaskDone {
                    job,
                    index,
                    outcome,
                })) => {
                    let Some(running) = self.workers[i].running.as_mut() else {
                        continue;
                    };
                    let in_chunk = running.first..running.first + running.len;
                    if job != running.job || index != running.next || !in_chunk.contains(&index) {
                        tracing::warn!(
                            "pool worker {} reported task {index} of job {job}, which it was not running",
                            self.workers[i].rank
                        );
                        continue;
                    }
                    running.next += 1;
                    let result = outcome.map_err(|message| Error::TaskFailed { index, message });
                    self.route(job, index, vec![result]);
                }
                Ok(Some(PoolMsg::Done {
                    job,
                    first,
                    outcome,
                })) => {
                    let Some(running) = self.workers[i].running.take() else {
                        continue;
                    };
                    if (running.job, running.first) != (job, first) {
                        tracing::warn!(
                            "pool worker {} ended a chunk it was not running",
                            self.workers[i].rank
                        );
                    }
                    // Tasks it never reported: the chunk could not run (`Err`), or a
                    // worker that lost track of them.
                    let message = outcome
                        .err()
                        .unwrap_or_else(|| "its pool worker never reported it".into());
                    self.fail_rest(&running, running.next, &message);
                    self.workers[i].chunks_done += 1;
                    if self
                        .options
                        .max_tasks_per_child
                        .is_some_and(|m| self.workers[i].chunks_done >= m)
                    {
                        // It exits by itself after this chunk; start its successor.
                        let _ = self.workers[i].process.join(Some(Duration::from_secs(5)));
                        self.replace(i, None);
                        return;
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return,
                Err(Error::Closed(_)) => {
                    let cause = self.workers[i].death_cause();
                    self.replace(i, Some(cause));
                    return;
                }
                Err(e) => {
                    tracing::warn!("pool worker {}: {e}", self.workers[i].rank);
                    return;
                }
            }
        }
    }

    /// Fails tasks `from..` of a chunk with `message`.
    fn fail_rest(&self, running: &Running, from: usize, message: &str) {
        let end = running.first + running.len;
        if from >= end {
            return;
        }
        let results = (from..end)
            .map(|index| {
                Err(Error::TaskFailed {
                    index,
                    message: message.to_string(),
                })
            })
            .collect();
        self.route(running.job, from, results);
    }

    fn route(&self, job: u64, first: usize, results: Vec<Result<Opaque>>) {
        if let Some(tx) = self.lock().jobs.get(&job) {
            let _ = tx.send((first, results));
        }
    }

    /// Replaces worker `i` by a fresh process. Of the chunk it was running, the task
    /// it was running fails with `cause`; the ones after it are queued again from
    /// there, or fail when their arguments cannot be sent twice.
    fn replace(&mut self, i: usize, cause: Option<String>) {
        if let Some(running) = self.workers[i].running.take() {
            let end = running.first + running.len;
            if running.next < end {
                let message = cause.unwrap_or_else(|| "its pool worker was lost".into());
                let index = running.next;
                self.route(
                    running.job,
                    index,
                    vec![Err(Error::TaskFailed { index, message })],
                );
                let rest = index + 1;
                if rest < end {
                    match &running.retry {
                        Some((trampoline, function, args)) => {
                            if let Some(args) = args.try_clone_plain() {
                                self.lock().queue.push_front(Pending {
                                    job: running.job,
                                    first: running.first,
                                    len: running.len,
                                    skip: rest - running.first,
                                    trampoline: *trampoline,
                                    function: *function,
                                    args,
                                });
                            }
                        }
                        None => self.fail_rest(
                            &running,
                            rest,
                            &format!(
                                "not run: its pool worker died while running task {index} of \
                                 the same chunk, and its arguments hold shared handles, which \
                                 cannot be sent twice (submit it again)"
                            ),
                        ),
                    }
                }
            }
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
