//! [`Barrier`]: a process-shared barrier for a fixed number of parties, like
//! `multiprocessing.Barrier`. Its block holds the parties, the arrivals, the
//! generation (what waiters futex-wait on) and the broken flag.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

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

    fn wait_until(&self, timeout: Option<Duration>) -> Result<usize> {
        let deadline = deadline_after(timeout);
        let broken = self.block.word(BAR_BROKEN);
        let generation = self.block.word(BAR_GENERATION);
        let check_broken = || -> Result<()> {
            if broken.load(Ordering::Acquire) != 0 {
                Err(Error::Closed(
                    "the barrier is broken (a party timed out)".into(),
                ))
            } else {
                Ok(())
            }
        };
        check_broken()?;
        let gen_now = generation.load(Ordering::Acquire);
        let index = self.block.word(BAR_ARRIVED).fetch_add(1, Ordering::AcqRel);
        let parties = self.parties_word();
        let arrived = index as usize;
        if index.wrapping_add(1) == parties {
            self.block.word(BAR_ARRIVED).store(0, Ordering::Release);
            generation.fetch_add(1, Ordering::AcqRel);
            futex::wake_all(generation);
            return Ok(arrived);
        }
        loop {
            if generation.load(Ordering::Acquire) != gen_now {
                return Ok(arrived);
            }
            check_broken()?;
            if !futex::wait(generation, gen_now, deadline)? {
                if generation.load(Ordering::Acquire) != gen_now {
                    return Ok(arrived);
                }
                broken.store(1, Ordering::Release);
                futex::wake_all(generation);
                return Err(Error::timeout(
                    format!(
                        "a barrier wait with {} of {parties} parties arrived",
                        self.block.word(BAR_ARRIVED).load(Ordering::Acquire)
                    ),
                    timeout,
                ));
            }
        }
    }
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
