//! The pool's other call forms, after Python's `multiprocessing.Pool`: [`Pool::apply`],
//! [`Pool::starmap`] and [`Pool::map_async`] (with its [`MapResult`]).
//!
//! Each is built on the pool's own job machinery; `starmap`, which runs a new function
//! shape in the worker (`fn(A, B)`), brings its own trampoline, monomorphized for that
//! shape, as `run_chunk` is for `fn(A)`.

use std::fmt::{self, Display};
use std::marker::PhantomData;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::handle::Pool;
use super::outcomes::{ChunkOutcome, OutcomeReceiver};
use super::protocol::{ChunkInput, Report};
use super::state::{dispatcher_gone, with_index};
use super::worker::run_task;
use crate::error::{Error, Result};
use crate::process::code::CodeCall;
use crate::wire::Opaque;

impl Pool {
    /// Runs `f(arg)` on some worker and waits for its result, like Python's
    /// `Pool.apply`.
    ///
    /// # Errors
    /// [`Error::TaskFailed`] when the task panicked, returned `Err` or its worker died;
    /// otherwise as [`apply_async`](Self::apply_async).
    pub fn apply<A, R, E>(&self, f: fn(A) -> std::result::Result<R, E>, arg: A) -> Result<R>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        self.apply_async(f, arg)?.get()
    }

    /// Runs `f(a, b)` for every pair and returns the results in order, like Python's
    /// `Pool.starmap` (whose argument tuples Rust spells as a two-argument function).
    ///
    /// # Errors
    /// As [`map`](Self::map).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// fn power(base: u64, exp: u32) -> Result<u64, String> {
    ///     base.checked_pow(exp).ok_or_else(|| format!("{base}^{exp} overflows"))
    /// }
    /// # fn main() -> multiproc::Result<()> {
    /// multiproc::init();
    /// let pool = multiproc::Pool::new(2)?;
    /// assert_eq!(pool.starmap(power, [(2, 10), (3, 3)])?, vec![1024, 27]);
    /// # Ok(()) }
    /// ```
    pub fn starmap<A, B, R, E>(
        &self,
        f: fn(A, B) -> std::result::Result<R, E>,
        items: impl IntoIterator<Item = (A, B)>,
    ) -> Result<Vec<R>>
    where
        A: Serialize + DeserializeOwned,
        B: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let items: Vec<(A, B)> = items.into_iter().collect();
        let n = items.len();
        let chunksize = n.div_ceil(self.processes * 4).max(1);
        let call = CodeCall::new(f, run_star_chunk::<A, B, R, E>);
        let _span = tracing::debug_span!("multiproc::pool_starmap", tasks = n, chunksize).entered();
        let (job, rx) = self.new_job(None)?;
        let queued = self.enqueue_code(job, call, items, 0, chunksize);
        let result = queued.and_then(|()| self.collect_all::<R>(&rx, n));
        self.end_job(job);
        result
    }

    /// Submits `f` over every item and returns at once, like Python's
    /// `Pool.map_async`: the results come in order from [`MapResult::get`].
    ///
    /// # Errors
    /// [`Error::Closed`] after [`close`](Self::close); an encoding error for an item.
    pub fn map_async<A, R, E>(
        &self,
        f: fn(A) -> std::result::Result<R, E>,
        items: impl IntoIterator<Item = A>,
    ) -> Result<MapResult<R>>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
        E: Display,
    {
        let items: Vec<A> = items.into_iter().collect();
        let n = items.len();
        let chunksize = n.div_ceil(self.processes * 4).max(1);
        let (job, rx) = self.new_job(Some(n))?;
        if let Err(e) = self.enqueue(job, f, items, 0, chunksize) {
            self.end_job(job);
            return Err(e);
        }
        Ok(MapResult {
            rx,
            results: (0..n).map(|_| None).collect(),
            total: n,
            taken: false,
            arrived: 0,
            _results: PhantomData,
        })
    }
}

/// Decodes a chunk of `(A, B)`, runs `f(a, b)` on each, encodes the results.
fn run_star_chunk<A, B, R, E>(
    f: fn(A, B) -> std::result::Result<R, E>,
    (args, skip): ChunkInput,
    report: Report<'_>,
) -> std::result::Result<(), String>
where
    A: Serialize + DeserializeOwned,
    B: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
{
    let items: Vec<(A, B)> = args
        .decode(&crate::shm::Returns::plain())
        .map_err(|e| format!("cannot decode the task's arguments: {e}"))?;
    for (k, (a, b)) in items.into_iter().enumerate().skip(skip) {
        if !report((k, run_task(|| f(a, b)))) {
            break;
        }
    }
    Ok(())
}

/// The results of [`Pool::map_async`], in the order of the items.
pub struct MapResult<R> {
    rx: OutcomeReceiver,
    results: Vec<Option<Result<Opaque>>>,
    total: usize,
    /// Whether [`get`](Self::get) has handed the results out.
    taken: bool,
    arrived: usize,
    _results: PhantomData<fn() -> R>,
}

impl<R: DeserializeOwned> MapResult<R> {
    fn take_in(&mut self, (first, outcomes): ChunkOutcome) {
        for (i, r) in outcomes.into_iter().enumerate() {
            if let Some(slot) = self.results.get_mut(first + i) {
                if slot.is_none() {
                    self.arrived += 1;
                }
                *slot = Some(r);
            }
        }
    }

    /// Whether every result has arrived.
    pub fn ready(&mut self) -> bool {
        while let Ok(outcome) = self.rx.try_recv() {
            self.take_in(outcome);
        }
        self.arrived == self.total
    }

    /// Waits for every result, as long as it takes, and returns them in order.
    ///
    /// # Errors
    /// The first failed task, as [`Error::TaskFailed`] with its index;
    /// [`Error::InvalidArgument`] when an earlier call already returned the results.
    pub fn get(&mut self) -> Result<Vec<R>> {
        self.get_within(None)
    }

    /// Waits at most `timeout` for every result and returns them in order.
    ///
    /// # Errors
    /// [`Error::Timeout`] when some had not finished in time (call again to keep
    /// waiting; what arrived is kept); otherwise as [`get`](Self::get).
    pub fn get_timeout(&mut self, timeout: Duration) -> Result<Vec<R>> {
        self.get_within(Some(timeout))
    }

    fn get_within(&mut self, timeout: Option<Duration>) -> Result<Vec<R>> {
        self.not_taken()?;
        let deadline = crate::sys::socket::deadline_after(timeout);
        while self.arrived < self.results.len() {
            let outcome = match deadline {
                None => self.rx.recv().map_err(|_| dispatcher_gone())?,
                Some(d) => match self
                    .rx
                    .recv_timeout(d.saturating_duration_since(Instant::now()))
                {
                    Ok(o) => o,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        return Err(Error::timeout(
                            format!(
                                "waiting for a map_async ({} of {} results arrived)",
                                self.arrived,
                                self.results.len()
                            ),
                            timeout,
                        ));
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return Err(dispatcher_gone()),
                },
            };
            self.take_in(outcome);
        }
        self.take_all()
    }

    /// Waits for every result, as [`get(None)`](Self::get) does, without blocking a
    /// thread (feature `async`; any executor), and returns them in order.
    ///
    /// Cancel-safe: what arrived before the future was dropped is kept in the
    /// `MapResult`, so a later [`get`](Self::get) or `get_async` returns every result.
    ///
    /// # Errors
    /// As [`get`](Self::get) (there is no timeout here: wrap the future in your
    /// runtime's timeout).
    #[cfg(feature = "async")]
    pub async fn get_async(&mut self) -> Result<Vec<R>> {
        self.not_taken()?;
        while self.arrived < self.results.len() {
            // The outcome goes into `self` in the same poll that received it (nothing
            // is awaited in between), so a dropped future holds none.
            let outcome = std::future::poll_fn(|cx| self.rx.poll_recv(cx))
                .await
                .map_err(|_| dispatcher_gone())?;
            self.take_in(outcome);
        }
        self.take_all()
    }

    fn not_taken(&self) -> Result<()> {
        if self.taken {
            return Err(Error::InvalidArgument(
                "the results of this map_async were already taken by an earlier get".into(),
            ));
        }
        Ok(())
    }

    /// Hands out every result, decoded, in order (all have arrived).
    fn take_all(&mut self) -> Result<Vec<R>> {
        self.taken = true;
        std::mem::take(&mut self.results)
            .into_iter()
            .enumerate()
            .map(|(index, r)| {
                r.unwrap_or_else(|| Err(dispatcher_gone()))
                    .and_then(|o| o.decode::<R>(&crate::shm::Returns::plain()))
                    .map_err(|e| with_index(e, index))
            })
            .collect()
    }
}

impl<R> fmt::Debug for MapResult<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MapResult")
            .field("arrived", &self.arrived)
            .field("of", &self.total)
            .finish()
    }
}
