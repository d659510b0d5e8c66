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
    pub fn new(value: usize) -> Result<Self> {
        Ok(Self(Semaphore::build(value, true)?))
    }

    /// Takes one permit, waiting as long as it takes. Give it back with
    /// [`release`](Self::release), or use [`permit`](Self::permit) for a guard that
    /// does.
    ///
    /// # Errors
    /// As [`Semaphore::acquire`].
    pub fn acquire(&self) -> Result<()> {
        self.0.acquire()
    }

    /// Takes one permit, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout) when no permit came in time.
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<()> {
        self.0.acquire_timeout(timeout)
    }

    /// Takes one permit if one is free, without waiting or a system call: `Ok(false)`
    /// when none is.
    ///
    /// # Errors
    /// As [`Semaphore::try_acquire`].
    #[doc(alias = "acquire_nowait")]
    pub fn try_acquire(&self) -> Result<bool> {
        self.0.try_acquire()
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
    pub fn value(&self) -> usize {
        self.0.value()
    }
}
