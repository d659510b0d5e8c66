//! [`Event`]: a process-shared flag that processes can wait on.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::block::SharedBlock;
use super::futex;
use crate::Result;
use crate::sys::deadline_after;

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
/// assert!(!done.wait(Some(std::time::Duration::from_millis(1)))?);
/// done.set();
/// assert!(done.is_set() && done.wait(None)?);
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone)]
pub struct Event {
    block: Arc<SharedBlock>,
}

impl Event {
    /// A new, clear event.
    ///
    /// # Errors
    /// When the shared page cannot be made (out of memory or file descriptors).
    pub fn new() -> Result<Self> {
        Ok(Self {
            block: Arc::new(SharedBlock::new(KIND)?),
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

    /// Waits until the flag is set or the timeout passes (`None`: forever). Returns
    /// whether the flag is set.
    ///
    /// # Errors
    /// Only when the kernel refuses the wait, which does not happen on a valid event.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = deadline_after(timeout);
        let flag = self.block.word(FLAG);
        loop {
            if flag.load(Ordering::Acquire) != 0 {
                return Ok(true);
            }
            if !futex::wait(flag, 0, deadline)? {
                return Ok(self.is_set());
            }
        }
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
            block: Arc::new(SharedBlock::deserialize_as(KIND, "an Event", d)?),
        })
    }
}
