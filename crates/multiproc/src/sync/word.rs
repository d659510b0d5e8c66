//! [`Word`]: what the process-shared protocols of this module need of a shared 32-bit
//! word — atomic operations and a futex — so that each protocol is written once and
//! runs over two kinds of word: in a process, a `std` atomic in shared memory and the
//! kernel's futex; in the model checker ([`model`], the `loom` tests of `counter` and
//! `lock`), a loom atomic and a futex emulated with a loom mutex and condition variable,
//! over process-local words. So the code that runs is the code that is checked.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::Result;
use crate::sys::Deadline;
use crate::sys::futex;

/// What the protocols need of a shared word.
pub(crate) trait Word: Sync {
    /// Whether busy-waiting on the word makes sense (not in a model, where every load
    /// is a step to explore).
    const SPINS: bool = true;
    /// The value.
    fn load(&self, order: Ordering) -> u32;
    /// `AtomicU32::fetch_update` with `AcqRel` on success and `Acquire` on failure,
    /// what every protocol here needs (so there are no orders to pass and ignore).
    fn update(&self, f: impl FnMut(u32) -> Option<u32>) -> std::result::Result<u32, u32>;
    /// `AtomicU32::fetch_add`.
    fn fetch_add(&self, n: u32, order: Ordering) -> u32;
    /// `AtomicU32::fetch_sub`.
    fn fetch_sub(&self, n: u32, order: Ordering) -> u32;
    /// `AtomicU32::compare_exchange` (strong; the orders of success and failure).
    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> std::result::Result<u32, u32>;
    /// `AtomicU32::swap`.
    fn swap(&self, value: u32, order: Ordering) -> u32;
    /// Sleeps while the value is `expected`, until woken or the deadline (`false`).
    fn wait(&self, expected: u32, deadline: Deadline) -> Result<bool>;
    /// Wakes one sleeper.
    fn wake_one(&self);
    /// Spins briefly until `ready`; whether it became ready (a model never spins).
    fn spin_until(&self, deadline: Deadline, ready: impl FnMut() -> bool) -> bool;
}

impl Word for AtomicU32 {
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }

    fn update(&self, f: impl FnMut(u32) -> Option<u32>) -> std::result::Result<u32, u32> {
        // A read-modify-write first, not a load (see `shm::update_word`), with these
        // orders.
        crate::shm::update_word(self, f)
    }

    fn fetch_add(&self, n: u32, order: Ordering) -> u32 {
        AtomicU32::fetch_add(self, n, order)
    }

    fn fetch_sub(&self, n: u32, order: Ordering) -> u32 {
        AtomicU32::fetch_sub(self, n, order)
    }

    fn compare_exchange(
        &self,
        current: u32,
        new: u32,
        success: Ordering,
        failure: Ordering,
    ) -> std::result::Result<u32, u32> {
        AtomicU32::compare_exchange(self, current, new, success, failure)
    }

    fn swap(&self, value: u32, order: Ordering) -> u32 {
        AtomicU32::swap(self, value, order)
    }

    fn wait(&self, expected: u32, deadline: Deadline) -> Result<bool> {
        futex::wait(self, expected, deadline)
    }

    fn wake_one(&self) {
        futex::wake(self, 1);
    }

    fn spin_until(&self, deadline: Deadline, ready: impl FnMut() -> bool) -> bool {
        futex::spin_until(deadline, ready)
    }
}

/// The model checker's word (tests only; the driver is `crate::model_check`).
#[cfg(test)]
pub(crate) mod model {
    use super::*;
    use loom::sync::atomic::AtomicU32 as LoomU32;
    use loom::sync::{Condvar, Mutex};

    /// A shared word in the model: a loom atomic, and a futex emulated with a mutex and
    /// a condition variable (a waiter checks the value under the mutex, a waker takes
    /// the mutex before it notifies, so a wake-up between the check and the sleep cannot
    /// be lost — the futex's own guarantee). The model has no clock: a wait with a
    /// deadline does not sleep (it stands for one that timed out at once), a wait
    /// without one sleeps until woken.
    pub(crate) struct ModelWord {
        value: LoomU32,
        lock: Mutex<()>,
        sleeping: Condvar,
    }

    impl ModelWord {
        pub(crate) fn new(v: u32) -> Self {
            Self {
                value: LoomU32::new(v),
                lock: Mutex::new(()),
                sleeping: Condvar::new(),
            }
        }
    }

    impl Word for ModelWord {
        const SPINS: bool = false;

        fn load(&self, order: Ordering) -> u32 {
            self.value.load(order)
        }

        fn update(&self, f: impl FnMut(u32) -> Option<u32>) -> std::result::Result<u32, u32> {
            self.value
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, f)
        }

        fn fetch_add(&self, n: u32, order: Ordering) -> u32 {
            self.value.fetch_add(n, order)
        }

        fn fetch_sub(&self, n: u32, order: Ordering) -> u32 {
            self.value.fetch_sub(n, order)
        }

        fn compare_exchange(
            &self,
            current: u32,
            new: u32,
            success: Ordering,
            failure: Ordering,
        ) -> std::result::Result<u32, u32> {
            self.value.compare_exchange(current, new, success, failure)
        }

        fn swap(&self, value: u32, order: Ordering) -> u32 {
            self.value.swap(value, order)
        }

        fn wait(&self, expected: u32, deadline: Deadline) -> Result<bool> {
            if deadline.is_some() {
                loom::thread::yield_now();
                return Ok(false);
            }
            let guard = self.lock.lock().unwrap();
            if self.value.load(Ordering::Acquire) == expected {
                drop(self.sleeping.wait(guard).unwrap());
            }
            Ok(true)
        }

        fn wake_one(&self) {
            let _guard = self.lock.lock().unwrap();
            self.sleeping.notify_one();
        }

        fn spin_until(&self, _deadline: Deadline, _ready: impl FnMut() -> bool) -> bool {
            false
        }
    }
}
