//! [`BoundedSemaphore`]: a [`Semaphore`] that refuses to be released above its initial
//! value, like `multiprocessing.BoundedSemaphore`.

use serde::{Deserialize, Serialize};

use super::semaphore::{Semaphore, SemaphoreGuard};
use crate::error::Result;
use std::time::Duration;

/// A semaphore that refuses to be released above its initial value, like
/// `multiprocessing.BoundedSemaphore`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BoundedSemaphore(Semaphore);

impl BoundedSemaphore {
    /// A bounded semaphore with `value` permits.
    ///
    /// # Errors
    /// As [`Semaphore::new`].
    pub fn new(value: u32) -> Result<Self> {
        Ok(Self(Semaphore::build(value, true)?))
    }

    /// Takes one permit, waiting at most `timeout` (`None`: as long as it takes).
    /// Give it back with [`release`](Self::release), or use [`permit`](Self::permit)
    /// for a guard that does.
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout) when no permit came in time.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<()> {
        self.0.acquire(timeout)
    }

    /// Takes one permit, waiting as long as it takes, and returns a guard that gives it
    /// back when dropped.
    ///
    /// # Errors
    /// As [`Semaphore::permit`].
    pub fn permit(&self) -> Result<SemaphoreGuard<'_>> {
        self.0.permit()
    }

    /// Takes one permit if one is free: `Ok(None)` when none is.
    ///
    /// # Errors
    /// As [`permit`](Self::permit).
    pub fn try_permit(&self) -> Result<Option<SemaphoreGuard<'_>>> {
        self.0.try_permit()
    }

    /// Takes one permit, waiting at most `timeout`, and returns a guard.
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout) when no permit came in time.
    pub fn permit_timeout(&self, timeout: Duration) -> Result<SemaphoreGuard<'_>> {
        self.0.permit_timeout(timeout)
    }

    /// Gives one permit back.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when that would make
    /// more permits free than the semaphore started with (a release without an
    /// acquire).
    pub fn release(&self) -> Result<()> {
        self.0.release()
    }

    /// The number of permits free right now (approximate).
    pub fn value(&self) -> u32 {
        self.0.value()
    }
}
