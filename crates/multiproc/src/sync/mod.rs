//! Process-shared synchronisation: state lives in a [`SharedWords`](crate::shm::SharedWords)
//! of atomic words that every process holding the primitive maps, and waiting is a
//! futex on one of those words (no busy-waiting, no helper process).
//!
//! Every primitive is `Clone` (another handle in this process) and `Serialize` through
//! multiproc channels (a handle in another process).

pub(crate) mod counter;
mod event;
pub(crate) mod lock;
pub(crate) mod word;

/// `Serialize`/`Deserialize` for a primitive that is one [`SharedWords`](crate::shm::SharedWords)
/// (a field named `block`): the block's handle travels, checked against `$kind` on
/// arrival. Defined before the modules that use it (textual macro scope).
macro_rules! shared_block_serde {
    ($ty:ident $(<$g:ident>)?, $kind:expr, $what:literal, |$block:ident| $build:expr) => {
        impl$(<$g>)? Serialize for $ty$(<$g>)? {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                self.block.serialize_as($what, s)
            }
        }

        impl<'de, $($g: Bits64)?> Deserialize<'de> for $ty$(<$g>)? {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let $block = Arc::new(SharedWords::deserialize_as($kind, $what, d)?);
                Ok($build)
            }
        }
    };
}

mod barrier;
mod bounded_semaphore;
mod condition;
mod semaphore;
mod value;

pub use barrier::Barrier;
pub use bounded_semaphore::BoundedSemaphore;
pub use condition::{Condition, ConditionGuard};
pub use event::Event;
pub use lock::{Lock, LockGuard, RLock, RLockGuard};
pub use semaphore::{Semaphore, SemaphoreGuard};
#[allow(deprecated)]
pub use value::SharedValue;
pub use value::{Bits64, Value};

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use super::*;
    use crate::error::Error;

    #[test]
    fn lock_excludes_threads_and_value_counts_exactly() {
        let counter = Value::new(0u64).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let c = counter.clone();
                std::thread::spawn(move || {
                    for _ in 0..2_000 {
                        let _g = c.get_lock().lock().unwrap();
                        c.set(c.get() + 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(counter.get(), 8_000);
    }

    #[test]
    fn a_dead_holder_is_reported_not_waited_for() {
        let lock = Lock::new().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        // Pretend the child took the lock and died holding it.
        lock.raw_for_tests()
            .block_word_owner()
            .store(dead_pid, Ordering::Release);
        let err = lock.acquire(Some(Duration::from_secs(5))).unwrap_err();
        assert!(
            matches!(err, Error::OwnerDied { pid, .. } if pid == dead_pid),
            "{err}"
        );
        assert!(err.to_string().contains(&dead_pid.to_string()), "{err}");
        assert!(
            lock.is_locked(),
            "the caller holds the lock after OwnerDied"
        );
        lock.release().unwrap();
    }

    #[test]
    fn bounded_semaphore_refuses_extra_release() {
        let s = BoundedSemaphore::new(2).unwrap();
        s.acquire(None).unwrap();
        s.acquire(None).unwrap();
        assert!(
            s.acquire(Some(Duration::from_millis(10)))
                .unwrap_err()
                .is_timeout()
        );
        s.release().unwrap();
        s.release().unwrap();
        assert!(s.release().is_err());
    }

    #[test]
    fn rlock_reenters_and_barrier_releases_all() {
        let r = RLock::new().unwrap();
        r.acquire(None).unwrap();
        r.acquire(None).unwrap();
        r.release().unwrap();
        r.release().unwrap();
        assert!(r.release().is_err());

        let b = Barrier::new(3).unwrap();
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || b.wait(Some(Duration::from_secs(10))).unwrap())
            })
            .collect();
        let mut idx: Vec<u32> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        idx.sort();
        assert_eq!(idx, [0, 1, 2]);
    }

    #[test]
    fn condition_wakes_a_waiter() {
        let c = Condition::new().unwrap();
        let flag = Value::new(false).unwrap();
        let (c2, f2) = (c.clone(), flag.clone());
        let waiter = std::thread::spawn(move || {
            c2.acquire(None).unwrap();
            let ok = c2.wait_for(|| f2.get(), Some(Duration::from_secs(10)));
            c2.release().unwrap();
            ok
        });
        c.acquire(None).unwrap();
        flag.set(true);
        c.notify_all();
        c.release().unwrap();
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn guards_release_on_drop_and_try_forms_do_not_wait() {
        let r = RLock::new().unwrap();
        {
            let _outer = r.lock().unwrap();
            let inner = r.try_lock().unwrap().expect("reentrant for its thread");
            drop(inner);
            let r2 = r.clone();
            let other = std::thread::spawn(move || r2.try_lock().map(|g| g.is_some()).unwrap());
            assert!(!other.join().unwrap(), "another thread cannot take it");
        }
        assert!(
            r.release().is_err(),
            "both levels were released by the guards"
        );

        let c = Condition::new().unwrap();
        let g = c.lock().unwrap();
        assert!(c.try_lock().unwrap().is_none());
        assert!(
            c.lock_timeout(Duration::from_millis(5))
                .unwrap_err()
                .error
                .is_timeout()
        );
        drop(g);
        drop(c.try_lock().unwrap().expect("free again"));

        let s = Semaphore::new(2).unwrap();
        let (a, b) = (s.permit().unwrap(), s.try_permit().unwrap().unwrap());
        assert_eq!(s.value(), 0);
        assert!(
            s.try_permit().unwrap().is_none(),
            "a refused try_permit gives nothing back"
        );
        assert_eq!(s.value(), 0);
        drop((a, b));
        assert_eq!(s.value(), 2);

        let ev = Event::new().unwrap();
        let err = ev.wait(Some(Duration::from_millis(5))).unwrap_err();
        assert!(
            matches!(err, Error::Timeout { after: Some(t), .. } if t == Duration::from_millis(5))
        );
    }
}
