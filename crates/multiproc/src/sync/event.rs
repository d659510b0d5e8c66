//! [`Event`]: a process-shared flag that processes can wait on.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::sys::deadline_after;
use crate::sys::futex;

const KIND: u32 = 0x4556_4e54; // "EVNT"
const FLAG: usize = 1;

/// A flag shared by processes: `set` wakes every process waiting for it, like
/// `multiprocessing.Event`.
///
/// `Clone` gives another handle to the same event; it can be a worker argument or
/// travel through a queue.
///
/// # Examples
///
/// ```
/// let done = multiproc::Event::new()?;
/// let err = done.wait_timeout(std::time::Duration::from_millis(1)).unwrap_err();
/// assert!(err.is_timeout());
/// done.set();
/// done.wait()?;
/// assert!(done.is_set());
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone)]
pub struct Event {
    block: Arc<SharedWords>,
}

impl Event {
    /// A new, clear event.
    ///
    /// # Errors
    /// When the shared page cannot be made (out of memory or file descriptors).
    pub fn new() -> Result<Self> {
        Ok(Self {
            block: Arc::new(SharedWords::new(KIND)?),
        })
    }

    /// Sets the flag and wakes every waiter.
    pub fn set(&self) {
        let flag = self.block.word(FLAG);
        if flag.swap(1, Ordering::Release) == 0 {
            futex::wake_all(flag);
        }
    }

    /// Clears the flag.
    pub fn clear(&self) {
        self.block.word(FLAG).store(0, Ordering::Release);
    }

    /// Whether the flag is set.
    pub fn is_set(&self) -> bool {
        self.block.word(FLAG).load(Ordering::Acquire) != 0
    }

    /// Waits until the flag is set, as long as it takes. [`is_set`](Self::is_set) is
    /// the look that never waits.
    ///
    /// # Errors
    /// An [`Error::Os`] only when the kernel refuses the wait.
    pub fn wait(&self) -> Result<()> {
        self.wait_until(None)
    }

    /// Waits until the flag is set, at most `timeout` (Python's `wait(timeout)`).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the flag was still clear at the deadline.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        self.wait_until(Some(timeout))
    }

    fn wait_until(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = deadline_after(timeout);
        let flag = self.block.word(FLAG);
        loop {
            if flag.load(Ordering::Acquire) != 0 {
                return Ok(());
            }
            if !futex::wait(flag, 0, deadline)? {
                return if self.is_set() {
                    Ok(())
                } else {
                    Err(Error::timeout("a wait on an event", timeout))
                };
            }
        }
    }

    /// Waits until the flag is set, as [`wait`](Self::wait) does, without blocking a
    /// thread (feature `async`; any executor). Cancel-safe: it takes nothing.
    ///
    /// # Errors
    /// When the async reactor's thread cannot be started.
    #[cfg(feature = "async")]
    pub async fn wait_async(&self) -> Result<()> {
        use crate::sys::reactor::{self, Parked, Step, WordWait};
        let mut parked: Option<Parked> = None;
        std::future::poll_fn(|cx| {
            reactor::poll_step(
                cx,
                &mut parked,
                || match self.block.word(FLAG).load(Ordering::SeqCst) {
                    0 => Step::Word(WordWait {
                        host: Arc::clone(&self.block) as _,
                        index: FLAG,
                        expected: 0,
                        counted_in: None,
                        recheck: false,
                        wake_by: None,
                    }),
                    _ => Step::Done(Ok(())),
                },
                Err,
            )
        })
        .await
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("is_set", &self.is_set())
            .finish()
    }
}

impl Serialize for Event {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.block.serialize_as("an Event", s)
    }
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(Self {
            block: Arc::new(SharedWords::deserialize_as(KIND, "an Event", d)?),
        })
    }
}
