//! [`Semaphore`], [`BoundedSemaphore`], [`Condition`], [`Barrier`] and [`Value`]: the
//! rest of `multiprocessing`'s synchronisation primitives, each in its own shared block.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::block::SharedBlock;
use super::futex;
use super::lock::{Lock, OnTimeout, RAW_LOCK_WORDS, RawLock, expect_guard, guarded};
use crate::sys::deadline_after;
use crate::{Error, LockError, Result};

macro_rules! shared_block_serde {
    ($ty:ident $(<$g:ident>)?, $kind:expr, $what:literal, |$block:ident| $build:expr) => {
        impl$(<$g>)? Serialize for $ty$(<$g>)? {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                self.block.serialize_as($what, s)
            }
        }

        impl<'de, $($g: SharedValue)?> Deserialize<'de> for $ty$(<$g>)? {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let $block = Arc::new(SharedBlock::deserialize_as($kind, $what, d)?);
                Ok($build)
            }
        }
    };
}

const SEM_KIND: u32 = 0x5345_4d41; // "SEMA"
const SEM_VALUE: usize = 1;
const SEM_WAITERS: usize = 2;
/// 0 for a plain semaphore; the initial value + 1 for a bounded one.
const SEM_BOUND: usize = 3;

/// A process-shared counting semaphore, like `multiprocessing.Semaphore`.
#[derive(Clone)]
pub struct Semaphore {
    block: Arc<SharedBlock>,
}

impl Semaphore {
    /// A semaphore with `value` permits.
    ///
    /// # Errors
    /// When the shared page cannot be made, or `value` does not fit in 31 bits.
    pub fn new(value: u32) -> Result<Self> {
        Self::build(value, false)
    }

    fn build(value: u32, bounded: bool) -> Result<Self> {
        if value > i32::MAX as u32 {
            return Err(Error::InvalidArgument(format!(
                "a semaphore's value must be below 2^31, got {value}"
            )));
        }
        let block = SharedBlock::new(SEM_KIND)?;
        block.word(SEM_VALUE).store(value, Ordering::Release);
        if bounded {
            block.word(SEM_BOUND).store(value + 1, Ordering::Release);
        }
        Ok(Self {
            block: Arc::new(block),
        })
    }

    /// Takes one permit, waiting at most `timeout` (`None`: as long as it takes).
    /// Give it back with [`release`](Self::release), or use [`permit`](Self::permit)
    /// for a guard that does.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no permit came in time.
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<()> {
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
        self.acquire(None)?;
        Ok(SemaphoreGuard { semaphore: self })
    }

    /// Takes one permit if one is free: `Ok(None)` when none is.
    ///
    /// # Errors
    /// As [`permit`](Self::permit).
    pub fn try_permit(&self) -> Result<Option<SemaphoreGuard<'_>>> {
        let got = self.acquire_until(Some(std::time::Instant::now()))?;
        // `then`, not `then_some`: a guard made and dropped would give back a permit
        // that was never taken.
        Ok(got.then(|| SemaphoreGuard { semaphore: self }))
    }

    /// Takes one permit, waiting at most `timeout`, and returns a guard.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no permit came in time.
    pub fn permit_timeout(&self, timeout: Duration) -> Result<SemaphoreGuard<'_>> {
        self.acquire(Some(timeout))?;
        Ok(SemaphoreGuard { semaphore: self })
    }

    fn acquire_until(&self, deadline: crate::sys::Deadline) -> Result<bool> {
        let value = self.block.word(SEM_VALUE);
        loop {
            let v = value.load(Ordering::Acquire);
            if v > 0 {
                if value
                    .compare_exchange_weak(v, v - 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return Ok(true);
                }
                continue;
            }
            self.block.word(SEM_WAITERS).fetch_add(1, Ordering::AcqRel);
            let woke = futex::wait(value, 0, deadline);
            self.block.word(SEM_WAITERS).fetch_sub(1, Ordering::AcqRel);
            if !woke? {
                return Ok(false);
            }
        }
    }

    /// Gives one permit back.
    ///
    /// # Errors
    /// For a [`BoundedSemaphore`], [`Error::InvalidArgument`] when that would exceed
    /// its initial value.
    pub fn release(&self) -> Result<()> {
        let value = self.block.word(SEM_VALUE);
        let bound = self.block.word(SEM_BOUND).load(Ordering::Acquire);
        let released = value.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            (bound == 0 || v + 1 < bound).then_some(v + 1)
        });
        if released.is_err() {
            return Err(Error::InvalidArgument(format!(
                "a BoundedSemaphore was released more times than acquired (its value is at its bound of {})",
                bound - 1
            )));
        }
        if self.block.word(SEM_WAITERS).load(Ordering::Acquire) > 0 {
            futex::wake(value, 1);
        }
        Ok(())
    }

    /// The number of permits free right now (approximate).
    pub fn value(&self) -> u32 {
        self.block.word(SEM_VALUE).load(Ordering::Acquire)
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
    block: Arc<SharedBlock>,
    lock: Lock,
}

impl Condition {
    /// A new condition with a new lock.
    ///
    /// # Errors
    /// When the shared page cannot be made.
    pub fn new() -> Result<Self> {
        Ok(Self::from_block(Arc::new(SharedBlock::new(COND_KIND)?)))
    }

    fn from_block(block: Arc<SharedBlock>) -> Self {
        let lock = Lock::from_raw(RawLock::new(Arc::clone(&block), COND_LOCK));
        Self { block, lock }
    }

    /// Acquires the condition's lock.
    ///
    /// # Errors
    /// As [`Lock::acquire`].
    pub fn acquire(&self, timeout: Option<Duration>) -> Result<()> {
        self.lock.acquire(timeout)
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
    /// let err = held.wait(Some(Duration::from_millis(1))).unwrap_err();
    /// assert!(err.is_timeout()); // nobody notified; the lock is held again
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn lock(&self) -> std::result::Result<ConditionGuard<'_>, LockError<ConditionGuard<'_>>> {
        let got = self.lock.raw().acquire(None);
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
        let got = self.lock.raw().acquire(Some(std::time::Instant::now()));
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
        let got = self.lock.raw().acquire(deadline_after(Some(timeout)));
        let t = OnTimeout::Fail(Some(timeout));
        expect_guard(
            guarded(got, "condition's lock", t, || self.guard()),
            "condition's lock",
        )
    }

    /// Releases the condition's lock.
    ///
    /// # Errors
    /// As [`Lock::release`].
    pub fn release(&self) -> Result<()> {
        self.lock.release()
    }

    /// Releases the lock, waits for a notification or the timeout, and re-acquires the
    /// lock (also when it times out). A wake-up may come without a notification.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the timeout passed (the lock is held again);
    /// [`Error::InvalidArgument`] when the lock is not held; [`Error::OwnerDied`] when
    /// re-acquiring took the lock over from a dead holder (the lock is held).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = deadline_after(timeout);
        let seq = self.block.word(COND_SEQ);
        let seen = seq.load(Ordering::Acquire);
        self.lock.release()?;
        let woke = futex::wait(seq, seen, deadline);
        self.lock.acquire(None)?;
        if woke? {
            Ok(())
        } else {
            Err(Error::timeout("a wait on a condition", timeout))
        }
    }

    /// Waits until `predicate()` holds, at most `timeout`; the lock is held when
    /// `predicate` runs and when this returns.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the timeout passed with `predicate()` still false;
    /// otherwise as [`wait`](Self::wait).
    pub fn wait_for(
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
            match self.wait(left) {
                Err(e) if e.is_timeout() => {}
                other => other?,
            }
        }
        Ok(())
    }

    /// Wakes up to `n` waiters.
    pub fn notify(&self, n: u32) {
        let seq = self.block.word(COND_SEQ);
        seq.fetch_add(1, Ordering::AcqRel);
        futex::wake(seq, n);
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
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.condition.wait(timeout)
    }

    /// [`Condition::wait_for`] with the lock this guard holds.
    ///
    /// # Errors
    /// As [`Condition::wait_for`].
    pub fn wait_for(
        &mut self,
        predicate: impl FnMut() -> bool,
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.condition.wait_for(predicate, timeout)
    }

    /// [`Condition::notify`].
    pub fn notify(&self, n: u32) {
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

const BARRIER_KIND: u32 = 0x4241_5252; // "BARR"
const BAR_PARTIES: usize = 1;
const BAR_ARRIVED: usize = 2;
const BAR_GENERATION: usize = 3;
const BAR_BROKEN: usize = 4;

/// A process-shared barrier for a fixed number of parties, like
/// `multiprocessing.Barrier`: each [`wait`](Self::wait) blocks until all parties wait.
#[derive(Clone)]
pub struct Barrier {
    block: Arc<SharedBlock>,
}

impl Barrier {
    /// A barrier for `parties` processes (or threads).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 parties; when the shared page cannot be made.
    pub fn new(parties: u32) -> Result<Self> {
        if parties == 0 {
            return Err(Error::InvalidArgument(
                "a barrier needs at least 1 party".into(),
            ));
        }
        let block = SharedBlock::new(BARRIER_KIND)?;
        block.word(BAR_PARTIES).store(parties, Ordering::Release);
        Ok(Self {
            block: Arc::new(block),
        })
    }

    /// The number of parties.
    pub fn parties(&self) -> u32 {
        self.block.word(BAR_PARTIES).load(Ordering::Acquire)
    }

    /// Waits until every party has called `wait`, at most `timeout`. Returns this
    /// party's arrival index (`0..parties`, the last to arrive gets `parties - 1`).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the timeout passed; the barrier is then broken and every
    /// later or current `wait` fails with [`Error::Closed`], as in Python.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<u32> {
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
        let parties = self.parties();
        if index + 1 == parties {
            self.block.word(BAR_ARRIVED).store(0, Ordering::Release);
            generation.fetch_add(1, Ordering::AcqRel);
            futex::wake_all(generation);
            return Ok(index);
        }
        loop {
            if generation.load(Ordering::Acquire) != gen_now {
                return Ok(index);
            }
            check_broken()?;
            if !futex::wait(generation, gen_now, deadline)? {
                if generation.load(Ordering::Acquire) != gen_now {
                    return Ok(index);
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

/// Plain data that a [`Value`] can hold: it round-trips through 64 bits.
pub trait SharedValue: Copy + Send + Sync + 'static {
    /// The value as bits.
    fn to_bits(self) -> u64;
    /// The value back from [`to_bits`](Self::to_bits).
    fn from_bits(bits: u64) -> Self;
}

macro_rules! shared_value_int {
    ($($t:ty),*) => {$(
        impl SharedValue for $t {
            fn to_bits(self) -> u64 { self as u64 }
            fn from_bits(bits: u64) -> Self { bits as $t }
        }
    )*};
}
shared_value_int!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize);

impl SharedValue for bool {
    fn to_bits(self) -> u64 {
        self as u64
    }
    fn from_bits(bits: u64) -> Self {
        bits != 0
    }
}

impl SharedValue for f32 {
    fn to_bits(self) -> u64 {
        f32::to_bits(self) as u64
    }
    fn from_bits(bits: u64) -> Self {
        f32::from_bits(bits as u32)
    }
}

impl SharedValue for f64 {
    fn to_bits(self) -> u64 {
        f64::to_bits(self)
    }
    fn from_bits(bits: u64) -> Self {
        f64::from_bits(bits)
    }
}

const VALUE_KIND: u32 = 0x5641_4c55; // "VALU"
const VALUE_LOCK: usize = 1;
const VALUE_BITS: usize = 8;

/// A value in shared memory with a lock, like `multiprocessing.Value`.
///
/// [`get`](Self::get) and [`set`](Self::set) are each atomic; a read-modify-write
/// needs the lock: [`update`](Self::update) does it for you, or hold
/// [`get_lock`](Self::get_lock) yourself.
///
/// # Examples
///
/// ```
/// let counter = multiproc::Value::new(0u64)?;
/// counter.update(|n| n + 1)?;
/// assert_eq!(counter.get(), 1);
/// # Ok::<(), multiproc::Error>(())
/// ```
pub struct Value<T> {
    block: Arc<SharedBlock>,
    lock: Lock,
    _value: PhantomData<T>,
}

impl<T> Clone for Value<T> {
    fn clone(&self) -> Self {
        Self {
            block: Arc::clone(&self.block),
            lock: self.lock.clone(),
            _value: PhantomData,
        }
    }
}

impl<T: SharedValue> Value<T> {
    /// A new shared value.
    ///
    /// # Errors
    /// When the shared page cannot be made.
    pub fn new(value: T) -> Result<Self> {
        let block = Arc::new(SharedBlock::new(VALUE_KIND)?);
        block
            .word64(VALUE_BITS)
            .store(value.to_bits(), Ordering::Release);
        Ok(Self::from_block(block))
    }

    fn from_block(block: Arc<SharedBlock>) -> Self {
        let lock = Lock::from_raw(RawLock::new(Arc::clone(&block), VALUE_LOCK));
        Self {
            block,
            lock,
            _value: PhantomData,
        }
    }

    /// The current value.
    pub fn get(&self) -> T {
        T::from_bits(self.block.word64(VALUE_BITS).load(Ordering::Acquire))
    }

    /// Stores `value`.
    pub fn set(&self, value: T) {
        self.block
            .word64(VALUE_BITS)
            .store(value.to_bits(), Ordering::Release);
    }

    /// The lock that guards read-modify-write sequences.
    pub fn get_lock(&self) -> &Lock {
        &self.lock
    }

    /// Replaces the value with `f(value)` under the lock; returns the new value.
    ///
    /// # Errors
    /// [`Error::OwnerDied`] when the lock was taken over from a dead holder; the update
    /// is still made.
    pub fn update(&self, f: impl FnOnce(T) -> T) -> Result<T> {
        let died = match self.lock.acquire(None) {
            Ok(_) => None,
            Err(e @ Error::OwnerDied { .. }) => Some(e),
            Err(e) => return Err(e),
        };
        let new = f(self.get());
        self.set(new);
        self.lock.release()?;
        match died {
            Some(e) => Err(e),
            None => Ok(new),
        }
    }
}

impl<T: SharedValue + fmt::Debug> fmt::Debug for Value<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Value").field("value", &self.get()).finish()
    }
}

shared_block_serde!(Value<T>, VALUE_KIND, "a Value", |block| Value::from_block(
    block
));
