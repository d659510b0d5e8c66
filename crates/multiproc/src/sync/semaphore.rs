//! [`Semaphore`] (and its [`SemaphoreGuard`]): a process-shared counting semaphore,
//! like `multiprocessing.Semaphore`. Its block holds the count, the number of waiters
//! and, for a [`BoundedSemaphore`](super::BoundedSemaphore), the bound.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::counter::FutexCount;
use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::sys::deadline_after;

const SEM_KIND: u32 = 0x5345_4d41; // "SEMA"
const SEM_VALUE: usize = 1;
const SEM_WAITERS: usize = 2;
/// 0 for a plain semaphore; the initial value + 1 for a bounded one.
const SEM_BOUND: usize = 3;

/// A process-shared counting semaphore, like `multiprocessing.Semaphore`.
#[derive(Clone)]
pub struct Semaphore {
    block: Arc<SharedWords>,
}

impl Semaphore {
    /// A semaphore with `value` permits.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `value` is 2^31 or more (the count is a shared
    /// 32-bit word the kernel's futex reads as signed); when the shared page cannot be
    /// made.
    pub fn new(value: usize) -> Result<Self> {
        Self::build(value, false)
    }

    pub(super) fn build(value: usize, bounded: bool) -> Result<Self> {
        let value = u32::try_from(value)
            .ok()
            .filter(|&v| v <= i32::MAX as u32)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "a semaphore's value must be below 2^31 (a shared 32-bit count), got \
                     {value}"
                ))
            })?;
        let block = SharedWords::new(SEM_KIND)?;
        block.word(SEM_VALUE).store(value, Ordering::Release);
        if bounded {
            block.word(SEM_BOUND).store(value + 1, Ordering::Release);
        }
        Ok(Self {
            block: Arc::new(block),
        })
    }

    /// Takes one permit, waiting as long as it takes. Give it back with
    /// [`release`](Self::release), or use [`permit`](Self::permit) for a guard that
    /// does.
    ///
    /// # Errors
    /// An [`Error::Os`] only when the kernel refuses the wait.
    pub fn acquire(&self) -> Result<()> {
        self.acquire_within(None)
    }

    /// Takes one permit, waiting at most `timeout` (Python's `acquire(timeout=…)`).
    ///
    /// # Errors
    /// [`Error::Timeout`] when no permit came in time.
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<()> {
        self.acquire_within(Some(timeout))
    }

    /// Takes one permit if one is free, without waiting or a system call: `Ok(false)`
    /// when none is (Python's `acquire(block=False)`).
    ///
    /// # Errors
    /// Never, today: a `Result` so that every `try_acquire` reads alike.
    #[doc(alias = "acquire_nowait")]
    pub fn try_acquire(&self) -> Result<bool> {
        Ok(self.count().try_take())
    }

    fn acquire_within(&self, timeout: Option<Duration>) -> Result<()> {
        if self.acquire_until(deadline_after(timeout))? {
            Ok(())
        } else {
            Err(Error::timeout("an acquire of a semaphore", timeout))
        }
    }

    /// Takes one permit, waiting as long as it takes, and returns a guard that gives it
    /// back when dropped. A semaphore has no owner, so a holder that dies keeps its
    /// permit: size a semaphore shared with workers that may crash accordingly.
    ///
    /// # Errors
    /// An [`Error::Os`] only when the kernel refuses the wait.
    ///
    /// # Examples
    ///
    /// ```
    /// let slots = multiproc::Semaphore::new(1)?;
    /// let held = slots.permit()?;
    /// assert!(slots.try_permit()?.is_none());
    /// drop(held);
    /// assert!(slots.try_permit()?.is_some());
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn permit(&self) -> Result<SemaphoreGuard<'_>> {
        self.acquire()?;
        Ok(SemaphoreGuard { semaphore: self })
    }

    /// Takes one permit if one is free: `Ok(None)` when none is.
    ///
    /// # Errors
    /// As [`permit`](Self::permit).
    pub fn try_permit(&self) -> Result<Option<SemaphoreGuard<'_>>> {
        let got = self.try_acquire()?;
        // `then`, not `then_some`: a guard made and dropped would give back a permit
        // that was never taken.
        Ok(got.then(|| SemaphoreGuard { semaphore: self }))
    }

    /// Takes one permit, waiting at most `timeout`, and returns a guard.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no permit came in time.
    pub fn permit_timeout(&self, timeout: Duration) -> Result<SemaphoreGuard<'_>> {
        self.acquire_timeout(timeout)?;
        Ok(SemaphoreGuard { semaphore: self })
    }

    /// Takes one permit, as [`acquire`](Self::acquire) does, without
    /// blocking a thread (feature `async`; any executor). Cancel-safe: a future
    /// dropped before it completes has taken no permit.
    ///
    /// # Errors
    /// When the async reactor's thread cannot be started.
    #[cfg(feature = "async")]
    pub async fn acquire_async(&self) -> Result<()> {
        use crate::sys::reactor::{self, Parked, Step, WordWait};
        let mut parked: Option<Parked> = None;
        std::future::poll_fn(|cx| {
            reactor::poll_step(
                cx,
                &mut parked,
                || {
                    let seen = self.block.word(SEM_VALUE).load(Ordering::SeqCst);
                    if self.count().try_take() {
                        return Step::Done(Ok(()));
                    }
                    Step::Word(WordWait {
                        host: Arc::clone(&self.block) as _,
                        index: SEM_VALUE,
                        expected: seen,
                        counted_in: Some(SEM_WAITERS),
                        recheck: false,
                        wake_by: None,
                    })
                },
                Err,
            )
        })
        .await
    }

    fn acquire_until(&self, deadline: crate::sys::Deadline) -> Result<bool> {
        self.count().take(deadline)
    }

    fn count(&self) -> FutexCount<'_> {
        FutexCount::new(self.block.word(SEM_VALUE), self.block.word(SEM_WAITERS))
    }

    /// Gives one permit back.
    ///
    /// # Errors
    /// For a [`BoundedSemaphore`](super::BoundedSemaphore), [`Error::InvalidArgument`] when that would exceed
    /// its initial value.
    pub fn release(&self) -> Result<()> {
        let bound = self.block.word(SEM_BOUND).load(Ordering::Acquire);
        if !self.count().give((bound != 0).then_some(bound)) {
            return Err(Error::InvalidArgument(format!(
                "a BoundedSemaphore was released more times than acquired (its value is at its bound of {})",
                bound.saturating_sub(1)
            )));
        }
        Ok(())
    }

    /// The number of permits free right now (approximate).
    pub fn value(&self) -> usize {
        self.count().value() as usize
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("value", &self.value())
            .finish()
    }
}

shared_block_serde!(Semaphore, SEM_KIND, "a Semaphore", |block| Semaphore {
    block
});

/// Holds one permit of a [`Semaphore`] until dropped (see [`Semaphore::permit`]).
#[must_use = "the permit is given back when the guard is dropped"]
pub struct SemaphoreGuard<'a> {
    semaphore: &'a Semaphore,
}

impl Drop for SemaphoreGuard<'_> {
    fn drop(&mut self) {
        let _ = self.semaphore.release();
    }
}

impl fmt::Debug for SemaphoreGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SemaphoreGuard")
            .field("semaphore", self.semaphore)
            .finish()
    }
}
