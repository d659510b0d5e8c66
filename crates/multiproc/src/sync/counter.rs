//! [`FutexCount`]: a count of free places in two shared words — the count and its
//! sleepers — that takers wait on with a futex. The one mechanism under
//! [`Semaphore`](super::Semaphore) (its permits) and a bounded queue (its places).

use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::Result;
use crate::sys::Deadline;
use crate::sys::futex;

/// The count and sleeper words of one counter, borrowed from a shared block.
pub(crate) struct FutexCount<'a> {
    value: &'a AtomicU32,
    sleepers: &'a AtomicU32,
}

impl<'a> FutexCount<'a> {
    /// The counter made of these two words.
    pub(crate) fn new(value: &'a AtomicU32, sleepers: &'a AtomicU32) -> Self {
        Self { value, sleepers }
    }

    /// Takes one place if one is free now.
    pub(crate) fn try_take(&self) -> bool {
        self.value
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1))
            .is_ok()
    }

    /// Takes one place, waiting until the deadline; `false` when none came. Spins
    /// briefly before it sleeps: most waits end within microseconds (another process
    /// is giving a place back right now), and a sleep and a wake-up cost far more.
    pub(crate) fn take(&self, deadline: Deadline) -> Result<bool> {
        loop {
            if self.try_take() {
                return Ok(true);
            }
            if futex::spin_until(deadline, || self.value.load(Ordering::Acquire) > 0) {
                continue;
            }
            self.sleepers.fetch_add(1, Ordering::AcqRel);
            let woke = futex::wait(self.value, 0, deadline);
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
            if !woke? {
                return Ok(false);
            }
        }
    }

    /// Gives one place back and wakes a sleeper, unless the count would reach `bound`
    /// (`false` then, nothing changed).
    pub(crate) fn give(&self, bound: Option<u32>) -> bool {
        let given = self
            .value
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                let next = v.checked_add(1)?;
                bound.is_none_or(|b| next < b).then_some(next)
            })
            .is_ok();
        if given && self.sleepers.load(Ordering::Acquire) > 0 {
            futex::wake(self.value, 1);
        }
        given
    }

    /// The free places right now.
    pub(crate) fn value(&self) -> u32 {
        self.value.load(Ordering::Acquire)
    }
}
