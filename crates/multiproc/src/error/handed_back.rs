//! Errors that hand back what the caller would otherwise lose: the item of a failed put
//! ([`PutError`]), the guard of a lock whose holder died ([`LockError`]).

use std::fmt;

use super::Error;

/// A failed `put`/`send`: the error, and the item, handed back.
#[derive(thiserror::Error)]
#[error("{error}")]
pub struct PutError<T> {
    /// Why it failed.
    pub error: Error,
    /// The item the caller tried to send.
    pub item: T,
}

impl<T> PutError<T> {
    /// The item that was not sent.
    pub fn into_inner(self) -> T {
        self.item
    }
}

impl<T> fmt::Debug for PutError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PutError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<T> From<PutError<T>> for Error {
    fn from(e: PutError<T>) -> Self {
        e.error
    }
}

/// A failed `lock()`/`permit()` (and their timeout forms): the error and, when the
/// previous holder died while holding the lock ([`Error::OwnerDied`]), the guard that
/// now holds it.
///
/// With the guard in hand the caller can repair the state the lock protects and go on
/// ([`into_guard`](Self::into_guard)), as with std's `PoisonError`. Propagating the
/// error with `?` drops the guard, which releases the lock: the next holder is not told
/// again, so repair first where the state matters.
#[derive(thiserror::Error)]
#[error("{error}")]
pub struct LockError<G> {
    /// Why the lock was not cleanly taken.
    pub error: Error,
    /// The guard, when the lock is held all the same (after [`Error::OwnerDied`]).
    pub guard: Option<G>,
}

impl<G> LockError<G> {
    /// The guard, when the lock is held despite the error (the holder died).
    pub fn into_guard(self) -> Option<G> {
        self.guard
    }
}

impl<G> fmt::Debug for LockError<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockError")
            .field("error", &self.error)
            .field("holds_lock", &self.guard.is_some())
            .finish()
    }
}

impl<G> From<LockError<G>> for Error {
    fn from(e: LockError<G>) -> Self {
        e.error
    }
}

impl<G> From<Error> for LockError<G> {
    fn from(error: Error) -> Self {
        LockError { error, guard: None }
    }
}
