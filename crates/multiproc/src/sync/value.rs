//! [`Value`]: plain data in shared memory with a lock, like `multiprocessing.Value`,
//! and [`Bits64`], the types it can hold (plain data that round-trips through 64 bits).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::lock::{Lock, RawLock};
use crate::error::{LockError, Result};
use crate::shm::SharedWords;

/// Plain data that fits in 64 bits — the types a [`Value`] can hold: each round-trips
/// through a `u64` ([`to_bits`](Self::to_bits), [`from_bits`](Self::from_bits)), which
/// is what the shared word stores.
pub trait Bits64: Copy + Send + Sync + 'static {
    /// The value as bits.
    fn to_bits(self) -> u64;
    /// The value back from [`to_bits`](Self::to_bits).
    fn from_bits(bits: u64) -> Self;
}

macro_rules! bits64_int {
    ($($t:ty),*) => {$(
        impl Bits64 for $t {
            fn to_bits(self) -> u64 { self as u64 }
            fn from_bits(bits: u64) -> Self { bits as $t }
        }
    )*};
}
bits64_int!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize);

impl Bits64 for bool {
    fn to_bits(self) -> u64 {
        self as u64
    }
    fn from_bits(bits: u64) -> Self {
        bits != 0
    }
}

impl Bits64 for f32 {
    fn to_bits(self) -> u64 {
        f32::to_bits(self) as u64
    }
    fn from_bits(bits: u64) -> Self {
        f32::from_bits(bits as u32)
    }
}

impl Bits64 for f64 {
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
    block: Arc<SharedWords>,
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

impl<T: Bits64> Value<T> {
    /// A new shared value.
    ///
    /// # Errors
    /// When the shared page cannot be made.
    pub fn new(value: T) -> Result<Self> {
        let block = Arc::new(SharedWords::new(VALUE_KIND)?);
        block
            .word64(VALUE_BITS)
            .store(value.to_bits(), Ordering::Release);
        Ok(Self::from_block(block))
    }

    fn from_block(block: Arc<SharedWords>) -> Self {
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
    /// [`Error::OwnerDied`](crate::Error::OwnerDied) when the lock was taken over from a dead holder; the update
    /// is still made.
    ///
    /// A panic in `f` releases the lock as it unwinds and leaves the value as it was
    /// (`f` runs before anything is stored), so a caught panic does not leave every
    /// other updater waiting.
    pub fn update(&self, f: impl FnOnce(T) -> T) -> Result<T> {
        let (guard, died) = match self.lock.lock() {
            Ok(guard) => (guard, None),
            Err(LockError {
                error,
                guard: Some(guard),
            }) => (guard, Some(error)),
            Err(e) => return Err(e.error),
        };
        let new = f(self.get());
        self.set(new);
        drop(guard);
        match died {
            Some(e) => Err(e),
            None => Ok(new),
        }
    }
}

impl<T: Bits64 + fmt::Debug> fmt::Debug for Value<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Value").field("value", &self.get()).finish()
    }
}

shared_block_serde!(Value<T>, VALUE_KIND, "a Value", |block| Value::from_block(
    block
));
