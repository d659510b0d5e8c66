//! [`Pool`]: the caller's handle, which starts the workers and the dispatcher, queues
//! jobs in chunks and collects their outcomes.

use std::fmt::{self, Display};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::async_result::AsyncResult;
use super::builder::PoolBuilder;
use super::dispatcher::Dispatcher;
use super::dispatcher::Worker;
use super::outcomes::{self, OutcomeReceiver};
use super::protocol::ChunkCall;
use super::state::{Job, Pending, Shared, State, dispatcher_gone, with_index};
use super::worker::run_chunk;
use crate::error::{Error, Result};
use crate::process::StartMethod;
use crate::process::code::CodeCall;
use crate::queue::pipe;
use crate::wire::Opaque;

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
    pub(super) shared: Arc<Shared>,
    pub(super) dispatcher: Option<JoinHandle<()>>,
    pub(super) processes: usize,
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

    pub(super) fn start(options: PoolBuilder) -> Result<Self> {
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

    /// Registers a new job; its chunk outcomes arrive on the receiver. With `tasks`,
    /// the dispatcher forgets the job after that many outcomes; without, the caller
    /// ends it ([`end_job`](Self::end_job)).
    pub(super) fn new_job(&self, tasks: Option<usize>) -> Result<(u64, OutcomeReceiver)> {
        let job = self.shared.next_job.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = outcomes::channel();
        let mut state = self.lock();
        if state.closed || state.terminate {
            return Err(Error::Closed(
                "the pool is closed: no new tasks are accepted".into(),
            ));
        }
        if tasks != Some(0) {
            state.jobs.insert(job, Job { tx, left: tasks });
        }
        Ok((job, rx))
    }

    /// Queues `items` (task indices `first..`) of `job` in chunks of `chunksize`.
    pub(super) fn enqueue<A, R, E>(
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
        let call = CodeCall::new(f, run_chunk::<A, R, E>);
        self.enqueue_code(job, call, items, first, chunksize)
    }

    /// Queues `items` to be run by `call` (a task function with the chunk trampoline
    /// for its type).
    pub(super) fn enqueue_code<A: Serialize>(
        &self,
        job: u64,
        call: ChunkCall,
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
                call,
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

    /// How many jobs wait for outcomes (tests: a job is not kept past its last one).
    #[cfg(feature = "testing-internals")]
    pub(crate) fn jobs_waiting(&self) -> usize {
        self.lock().jobs.len()
    }

    /// Forgets a job whose caller no longer waits for it.
    pub(super) fn end_job(&self, job: u64) {
        self.lock().jobs.remove(&job);
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
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
        let (job, rx) = self.new_job(None)?;
        let queued = self.enqueue(job, f, items, 0, chunksize);
        let result = queued.and_then(|()| self.collect_all::<R>(&rx, n));
        self.end_job(job);
        result
    }

    pub(super) fn collect_all<R: DeserializeOwned>(
        &self,
        rx: &OutcomeReceiver,
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
                        r.and_then(|o| o.decode::<R>(&crate::shm::Returns::plain()))
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
        let (job, rx) = self.new_job(Some(1))?;
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
    /// [`terminate`](Self::terminate), as long as it takes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the pool is still open.
    pub fn join(&mut self) -> Result<()> {
        self.join_within(None)
    }

    /// Waits until the workers have exited, at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when workers still run at the deadline; otherwise as
    /// [`join`](Self::join).
    pub fn join_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.join_within(Some(timeout))
    }

    fn join_within(&mut self, timeout: Option<Duration>) -> Result<()> {
        {
            let state = self.lock();
            if !state.closed && !state.terminate {
                return Err(Error::InvalidArgument(
                    "join() on a pool that is still open: call close() or terminate() first".into(),
                ));
            }
        }
        let deadline = crate::sys::socket::deadline_after(timeout);
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

impl PoolBuilder {
    /// Starts the workers.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for 0 processes; any error starting a worker.
    pub fn build(self) -> Result<Pool> {
        Pool::start(self)
    }
}
