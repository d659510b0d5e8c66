//! [`BoundedSemaphore`]: a [`Semaphore`] that refuses to be released above its initial
//! value, like `multiprocessing.BoundedSemaphore`.


use serde::{Deserialize, Serialize};

use super::semaphore::Semaphore;
use crate::error::Result;

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
}

impl std::ops::Deref for BoundedSemaphore {
    type Target = Semaphore;

    fn deref(&self) -> &Semaphore {
        &self.0
    }
}
