//! [`Barrier`]: a process-shared barrier for a fixed number of parties, like
//! `multiprocessing.Barrier`. Its block holds the parties, the arrivals, the
//! generation (what waiters futex-wait on) and the broken flag.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::sys::deadline_after;
use crate::sys::futex;

const BARRIER_KIND: u32 = 0x4241_5252; // "BARR"
const BAR_PARTIES: usize = 1;
const BAR_ARRIVED: usize = 2;
const BAR_GENERATION: usize = 3;
const BAR_BROKEN: usize = 4;

/// A process-shared barrier for a fixed number of parties, like
/// `multiprocessing.Barrier`: each [`wait`](Self::wait) blocks until all parties wait.
///
/// # Examples
///
/// ```
/// let barrier = multiproc::Barrier::new(1)?;
/// assert_eq!(barrier.wait()?, 0); // the only party is the last to arrive
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone)]
pub struct Barrier {
    block: Arc<SharedWords>,
}

impl Barrier {
    /// A barrier for `parties` processes (or threads).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 parties or more than `u32::MAX`; when the
    /// shared page cannot be made.
    pub fn new(parties: usize) -> Result<Self> {
        if parties == 0 {
            return Err(Error::InvalidArgument(
                "a barrier needs at least 1 party".into(),
            ));
        }
        let parties = u32::try_from(parties).map_err(|_| {
            Error::InvalidArgument(format!(
                "a barrier holds at most {} parties (its count is a shared 32-bit word), \
                 got {parties}",
                u32::MAX
            ))
        })?;
        let block = SharedWords::new(BARRIER_KIND)?;
        block.word(BAR_PARTIES).store(parties, Ordering::Release);
        Ok(Self {
            block: Arc::new(block),
        })
    }

    /// The number of parties.
    pub fn parties(&self) -> usize {
        self.parties_word() as usize
    }

    fn parties_word(&self) -> u32 {
        self.block.word(BAR_PARTIES).load(Ordering::Acquire)
    }

    /// Waits until every party has called `wait`, as long as it takes. Returns this
    /// party's arrival index (`0..parties`, the last to arrive gets `parties - 1`).
    ///
    /// # Errors
    /// [`Error::Closed`] when the barrier is broken (a party's
    /// [`wait_timeout`](Self::wait_timeout) timed out).
    pub fn wait(&self) -> Result<usize> {
        self.wait_until(None)
    }

    /// Waits until every party has called `wait`, at most `timeout`; returns this
    /// party's arrival index as [`wait`](Self::wait) does.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the timeout passed; the barrier is then broken and every
    /// later or current wait fails with [`Error::Closed`], as in Python.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<usize> {
        self.wait_until(Some(timeout))
    }

    /// Breaks the barrier, as Python's `Barrier.abort`: every current and later
    /// [`wait`](Self::wait) fails with [`Error::Closed`]. For a party that gives up (an
    /// interrupted wait) without leaving the others waiting for it forever.
    pub fn abort(&self) {
        self.block.word(BAR_BROKEN).store(1, Ordering::Release);
        futex::wake_all(self.block.word(BAR_GENERATION));
    }

    /// Whether the barrier is broken (a wait timed out, or [`abort`](Self::abort)).
    pub fn is_broken(&self) -> bool {
        self.block.word(BAR_BROKEN).load(Ordering::Acquire) != 0
    }

    /// How many parties are waiting now, as Python's `Barrier.n_waiting`.
    pub fn n_waiting(&self) -> usize {
        self.block.word(BAR_ARRIVED).load(Ordering::Acquire) as usize
    }

    fn check_broken(&self) -> Result<()> {
        if self.is_broken() {
            Err(Error::Closed(
                "the barrier is broken (a party timed out or aborted it)".into(),
            ))
        } else {
            Ok(())
        }
    }

    /// Arrives at the barrier: `Ok(index)` for the last party (it releases the others),
    /// else the arrival to wait on with [`await_arrival`](Self::await_arrival). For a
    /// caller that waits in slices (the Python package, which checks for Ctrl-C between
    /// them); [`wait`](Self::wait) is both steps.
    ///
    /// # Errors
    /// [`Error::Closed`] when the barrier is broken.
    #[doc(hidden)]
    pub fn arrive(&self) -> Result<std::result::Result<usize, BarrierArrival>> {
        self.check_broken()?;
        let generation = self.block.word(BAR_GENERATION);
        let gen_now = generation.load(Ordering::Acquire);
        let index = self.block.word(BAR_ARRIVED).fetch_add(1, Ordering::AcqRel);
        if index.wrapping_add(1) == self.parties_word() {
            self.block.word(BAR_ARRIVED).store(0, Ordering::Release);
            generation.fetch_add(1, Ordering::AcqRel);
            futex::wake_all(generation);
            return Ok(Ok(index as usize));
        }
        Ok(Err(BarrierArrival {
            generation: gen_now,
            index: index as usize,
        }))
    }

    /// Waits until every party has arrived (`Some(index)`) or `until` passes (`None`:
    /// the caller may wait again, or give up with [`abort`](Self::abort)).
    ///
    /// # Errors
    /// [`Error::Closed`] when the barrier is broken.
    #[doc(hidden)]
    pub fn await_arrival(
        &self,
        arrival: &BarrierArrival,
        until: Option<Instant>,
    ) -> Result<Option<usize>> {
        let generation = self.block.word(BAR_GENERATION);
        loop {
            if generation.load(Ordering::Acquire) != arrival.generation {
                return Ok(Some(arrival.index));
            }
            self.check_broken()?;
            if !futex::wait(generation, arrival.generation, until)? {
                if generation.load(Ordering::Acquire) != arrival.generation {
                    return Ok(Some(arrival.index));
                }
                return Ok(None);
            }
        }
    }

    fn wait_until(&self, timeout: Option<Duration>) -> Result<usize> {
        let deadline = deadline_after(timeout);
        let arrival = match self.arrive()? {
            Ok(index) => return Ok(index),
            Err(arrival) => arrival,
        };
        if let Some(index) = self.await_arrival(&arrival, deadline)? {
            return Ok(index);
        }
        Err(self.time_out(timeout))
    }

    /// Breaks the barrier for a wait whose `timeout` passed, as Python's does, and says
    /// so.
    #[doc(hidden)]
    pub fn time_out(&self, timeout: Option<Duration>) -> Error {
        let arrived = self.n_waiting();
        self.abort();
        Error::timeout(
            format!(
                "a barrier wait with {arrived} of {} parties arrived",
                self.parties_word()
            ),
            timeout,
        )
    }
}

/// A party's arrival at a [`Barrier`], waited on with [`Barrier::await_arrival`].
#[doc(hidden)]
#[derive(Debug)]
pub struct BarrierArrival {
    generation: u32,
    index: usize,
}

impl fmt::Debug for Barrier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Barrier")
            .field("parties", &self.parties())
            .finish()
    }
}

shared_block_serde!(Barrier, BARRIER_KIND, "a Barrier", |block| Barrier {
    block
});
