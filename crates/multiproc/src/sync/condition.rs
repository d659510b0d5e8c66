//! [`Condition`] (and its [`ConditionGuard`]): a process-shared condition variable
//! with its own lock, like `multiprocessing.Condition`. Its block holds the lock's
//! words and the notification sequence number waiters futex-wait on.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::lock::{Lock, OnTimeout, RAW_LOCK_WORDS, RawLock, expect_guard, guarded};
use crate::error::{Error, LockError, Result};
use crate::shm::SharedWords;
use crate::sys::deadline_after;
use crate::sys::futex;

const COND_KIND: u32 = 0x434f_4e44; // "COND"
const COND_LOCK: usize = 1;
const COND_SEQ: usize = COND_LOCK + RAW_LOCK_WORDS;

/// A process-shared condition variable with its own lock, like
/// `multiprocessing.Condition`.
///
/// Hold the lock ([`acquire`](Self::acquire)) around [`wait`](Self::wait) and
/// [`notify`](Self::notify). A waiter may wake without a notification; check the
/// condition in a loop, or use [`wait_for`](Self::wait_for).
#[derive(Clone)]
pub struct Condition {
    block: Arc<SharedWords>,
    lock: Lock,
}

impl Condition {
    /// A new condition with a new lock.
    ///
    /// # Errors
    /// When the shared page cannot be made.
    pub fn new() -> Result<Self> {
        Ok(Self::from_block(Arc::new(SharedWords::new(COND_KIND)?)))
    }

    fn from_block(block: Arc<SharedWords>) -> Self {
        let lock = Lock::from_raw(RawLock::new(Arc::clone(&block), COND_LOCK));
        Self { block, lock }
    }

    /// Acquires the condition's lock, waiting as long as it takes.
    ///
    /// # Errors
    /// As [`Lock::acquire`].
    pub fn acquire(&self) -> Result<()> {
        self.lock.acquire()
    }

    /// Acquires the condition's lock, waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`Lock::acquire_timeout`].
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<()> {
        self.lock.acquire_timeout(timeout)
    }

    /// Acquires the condition's lock if it is free, without waiting: `Ok(false)` when
    /// it is held.
    ///
    /// # Errors
    /// As [`Lock::try_acquire`].
    pub fn try_acquire(&self) -> Result<bool> {
        self.lock.try_acquire()
    }

    fn guard(&self) -> ConditionGuard<'_> {
        ConditionGuard { condition: self }
    }

    /// Acquires the condition's lock, waiting as long as it takes, and returns a guard
    /// to [`wait`](ConditionGuard::wait) on that releases the lock when dropped.
    ///
    /// # Errors
    /// As [`Lock::lock`].
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// let ready = multiproc::Condition::new()?;
    /// let mut held = ready.lock()?;
    /// let err = held.wait_timeout(Duration::from_millis(1)).unwrap_err();
    /// assert!(err.is_timeout()); // nobody notified; the lock is held again
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn lock(&self) -> std::result::Result<ConditionGuard<'_>, LockError<ConditionGuard<'_>>> {
        let got = self.lock.acquire_raw(None);
        expect_guard(
            guarded(got, "condition's lock", OnTimeout::Fail(None), || {
                self.guard()
            }),
            "condition's lock",
        )
    }

    /// Acquires the condition's lock if it is free: `Ok(None)` when it is held.
    ///
    /// # Errors
    /// As [`Lock::lock`].
    pub fn try_lock(
        &self,
    ) -> std::result::Result<Option<ConditionGuard<'_>>, LockError<ConditionGuard<'_>>> {
        let got = self.lock.acquire_raw(Some(std::time::Instant::now()));
        guarded(got, "condition's lock", OnTimeout::Nothing, || self.guard())
    }

    /// Acquires the condition's lock, waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`Lock::lock_timeout`].
    pub fn lock_timeout(
        &self,
        timeout: Duration,
    ) -> std::result::Result<ConditionGuard<'_>, LockError<ConditionGuard<'_>>> {
        let got = self.lock.acquire_raw(deadline_after(Some(timeout)));
        let t = OnTimeout::Fail(Some(timeout));
        expect_guard(
            guarded(got, "condition's lock", t, || self.guard()),
            "condition's lock",
        )
    }

    /// Whether this thread of this process holds the condition's lock; a snapshot, as
    /// [`Lock::is_owned_by_current_thread`].
    pub fn is_owned_by_current_thread(&self) -> bool {
        self.lock.is_owned_by_current_thread()
    }

    /// Releases the condition's lock.
    ///
    /// # Errors
    /// As [`Lock::release`].
    pub fn release(&self) -> Result<()> {
        self.lock.release()
    }

    /// Releases the lock, waits for a notification, and re-acquires the lock. A wake-up
    /// may come without a notification.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when this thread does not hold the lock (it is free,
    /// or another thread or process holds it: nothing is released then);
    /// [`Error::OwnerDied`] when re-acquiring took the lock over from a dead holder (the
    /// lock is held).
    pub fn wait(&self) -> Result<()> {
        self.wait_within(None)
    }

    /// Releases the lock, waits for a notification or the timeout, and re-acquires the
    /// lock (also when it times out).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the timeout passed (the lock is held again); otherwise as
    /// [`wait`](Self::wait).
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        self.wait_within(Some(timeout))
    }

    fn wait_within(&self, timeout: Option<Duration>) -> Result<()> {
        if !self.lock.is_owned_by_current_thread() {
            return Err(Error::InvalidArgument(
                "a wait on a condition whose lock this thread does not hold (it is free, or \
                 another thread or process holds it); acquire the lock first"
                    .into(),
            ));
        }
        let deadline = deadline_after(timeout);
        let seq = self.block.word(COND_SEQ);
        let seen = seq.load(Ordering::Acquire);
        self.lock.release()?;
        let woke = futex::wait(seq, seen, deadline);
        self.lock.acquire()?;
        if woke? {
            Ok(())
        } else {
            Err(Error::timeout("a wait on a condition", timeout))
        }
    }

    /// Waits until `predicate()` holds, as long as it takes; the lock is held when
    /// `predicate` runs and when this returns.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_for(&self, predicate: impl FnMut() -> bool) -> Result<()> {
        self.wait_for_within(predicate, None)
    }

    /// Waits until `predicate()` holds, at most `timeout`; the lock is held when
    /// `predicate` runs and when this returns.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the timeout passed with `predicate()` still false;
    /// otherwise as [`wait`](Self::wait).
    pub fn wait_for_timeout(
        &self,
        predicate: impl FnMut() -> bool,
        timeout: Duration,
    ) -> Result<()> {
        self.wait_for_within(predicate, Some(timeout))
    }

    fn wait_for_within(
        &self,
        mut predicate: impl FnMut() -> bool,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let deadline = deadline_after(timeout);
        while !predicate() {
            let left = match deadline {
                None => None,
                Some(d) => {
                    let now = std::time::Instant::now();
                    if now >= d {
                        return Err(Error::timeout(
                            "a wait on a condition for its predicate",
                            timeout,
                        ));
                    }
                    Some(d - now)
                }
            };
            match self.wait_within(left) {
                Err(e) if e.is_timeout() => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Wakes up to `n` waiters (`usize::MAX`: every one, as
    /// [`notify_all`](Self::notify_all)).
    pub fn notify(&self, n: usize) {
        let seq = self.block.word(COND_SEQ);
        seq.fetch_add(1, Ordering::AcqRel);
        // The kernel takes a signed count: anything above its largest wakes all.
        futex::wake(seq, n.min(i32::MAX as usize) as u32);
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        let seq = self.block.word(COND_SEQ);
        seq.fetch_add(1, Ordering::AcqRel);
        futex::wake_all(seq);
    }
}

impl fmt::Debug for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Condition")
            .field("lock", &self.lock)
            .finish()
    }
}

shared_block_serde!(Condition, COND_KIND, "a Condition", |block| {
    Condition::from_block(block)
});

/// Holds a [`Condition`]'s lock until dropped (see [`Condition::lock`]); wait and
/// notify through it.
#[must_use = "the condition's lock is released when the guard is dropped"]
pub struct ConditionGuard<'a> {
    condition: &'a Condition,
}

impl ConditionGuard<'_> {
    /// [`Condition::wait`] with the lock this guard holds.
    ///
    /// # Errors
    /// As [`Condition::wait`].
    pub fn wait(&mut self) -> Result<()> {
        self.condition.wait()
    }

    /// [`Condition::wait_timeout`] with the lock this guard holds.
    ///
    /// # Errors
    /// As [`Condition::wait_timeout`].
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.condition.wait_timeout(timeout)
    }

    /// [`Condition::wait_for`] with the lock this guard holds.
    ///
    /// # Errors
    /// As [`Condition::wait_for`].
    pub fn wait_for(&mut self, predicate: impl FnMut() -> bool) -> Result<()> {
        self.condition.wait_for(predicate)
    }

    /// [`Condition::wait_for_timeout`] with the lock this guard holds.
    ///
    /// # Errors
    /// As [`Condition::wait_for_timeout`].
    pub fn wait_for_timeout(
        &mut self,
        predicate: impl FnMut() -> bool,
        timeout: Duration,
    ) -> Result<()> {
        self.condition.wait_for_timeout(predicate, timeout)
    }

    /// [`Condition::notify`].
    pub fn notify(&self, n: usize) {
        self.condition.notify(n);
    }

    /// [`Condition::notify_all`].
    pub fn notify_all(&self) {
        self.condition.notify_all();
    }
}

impl Drop for ConditionGuard<'_> {
    fn drop(&mut self) {
        let _ = self.condition.release();
    }
}

impl fmt::Debug for ConditionGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConditionGuard")
            .field("condition", self.condition)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_without_the_lock_is_refused_and_releases_nothing() {
        let cond = Condition::new().unwrap();
        // Free: refused.
        let err = cond.wait_timeout(Duration::from_millis(1)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // Held by another thread (through a guard, which records its holder too).
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let other = cond.clone();
            s.spawn(move || {
                let guard = other.lock().unwrap();
                assert!(other.is_owned_by_current_thread());
                held_tx.send(()).unwrap();
                done_rx.recv_timeout(Duration::from_secs(30)).unwrap();
                drop(guard);
            });
            held_rx.recv_timeout(Duration::from_secs(30)).unwrap();
            assert!(!cond.is_owned_by_current_thread());
            let err = cond.wait_timeout(Duration::from_millis(1)).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
            assert!(
                cond.lock.is_locked(),
                "the other thread's lock was released"
            );
            done_tx.send(()).unwrap();
        });
        // Held by this thread: waits (and times out, holding the lock again).
        cond.acquire().unwrap();
        assert!(cond.is_owned_by_current_thread());
        assert!(
            cond.wait_timeout(Duration::from_millis(1))
                .unwrap_err()
                .is_timeout()
        );
        assert!(cond.is_owned_by_current_thread());
        cond.release().unwrap();
    }
}
