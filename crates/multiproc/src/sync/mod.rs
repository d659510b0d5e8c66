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

pub use barrier::{Barrier, BarrierArrival};
pub use bounded_semaphore::BoundedSemaphore;
pub use condition::{Condition, ConditionGuard};
pub use event::Event;
pub use lock::{Lock, LockGuard, RLock, RLockGuard};
pub use semaphore::{Semaphore, SemaphoreGuard};
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
        // A child takes the lock and dies holding it.
        let holder = lock.clone();
        let dead_pid = crate::sys::process::fork_child(move || {
            std::mem::forget(holder.lock().unwrap());
            0
        })
        .unwrap() as u32;
        rustix::process::waitpid(
            rustix::process::Pid::from_raw(dead_pid as i32),
            rustix::process::WaitOptions::empty(),
        )
        .unwrap();
        assert!(lock.is_locked());
        let err = lock.acquire_timeout(Duration::from_secs(5)).unwrap_err();
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

        // A lock word naming a holder id nobody marks (written by a process that lies,
        // or corrupt) is a dead holder too, whose pid is unknown.
        lock.raw_for_tests()
            .block_word_owner()
            .store(u32::MAX - 7, Ordering::Release);
        let err = lock.acquire_timeout(Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, Error::OwnerDied { pid: 0, .. }), "{err}");
        assert!(err.to_string().contains("pid unknown"), "{err}");
        lock.release().unwrap();
    }

    #[test]
    fn a_holder_that_died_is_dead_though_its_fork_child_lives() {
        // A child takes the lock, forks a grandchild that outlives it, and dies holding
        // the lock: the grandchild inherits the child's memory but not its mark.
        let lock = Lock::new().unwrap();
        let (forked, release) = (super::Event::new().unwrap(), super::Event::new().unwrap());
        let (holder, forked_c, release_c) = (lock.clone(), forked.clone(), release.clone());
        let dead_pid = crate::sys::process::fork_child(move || {
            std::mem::forget(holder.lock().unwrap());
            let forked_gc = forked_c.clone();
            let grandchild = crate::sys::process::fork_child(move || {
                // Outlives its parent (`fork_child` asks for its parent's death signal).
                if rustix::process::set_parent_process_death_signal(None).is_err() {
                    return 1;
                }
                forked_gc.set();
                // Lives until the test is done with it (at most 20 s).
                i32::from(release_c.wait_timeout(Duration::from_secs(20)).is_err())
            });
            // Dies only once the grandchild has settled in.
            let settled = forked_c.wait_timeout(Duration::from_secs(10));
            i32::from(grandchild.is_err() || settled.is_err())
        })
        .unwrap() as u32;
        let status = rustix::process::waitpid(
            rustix::process::Pid::from_raw(dead_pid as i32),
            rustix::process::WaitOptions::empty(),
        )
        .unwrap()
        .unwrap()
        .1;
        assert_eq!(status.exit_status(), Some(0));
        forked.wait_timeout(Duration::from_secs(10)).unwrap();
        let err = lock.acquire_timeout(Duration::from_secs(5)).unwrap_err();
        release.set();
        assert!(
            matches!(err, Error::OwnerDied { pid, .. } if pid == dead_pid),
            "{err}"
        );
        lock.release().unwrap();
    }

    #[test]
    fn a_lock_received_twice_is_one_lock_to_its_process() {
        // Two values of one lock in one process (received twice): what one holds, the
        // other holds too, so an RLock re-enters through either and waits for no one.
        let q = crate::Queue::new().unwrap();
        let rlock = super::RLock::new().unwrap();
        q.put(rlock.clone()).unwrap();
        q.put(rlock.clone()).unwrap();
        let (a, b): (super::RLock, super::RLock) = (q.get().unwrap(), q.get().unwrap());
        drop(rlock);
        a.acquire_timeout(Duration::from_secs(5)).unwrap();
        assert!(b.is_owned_by_current_thread());
        b.acquire_timeout(Duration::from_secs(5)).unwrap();
        b.release().unwrap();
        a.release().unwrap();
        assert!(!a.is_owned_by_current_thread());
        // And a lock taken through a value since dropped is still this process's.
        let lock = Lock::new().unwrap();
        let locks = crate::Queue::new().unwrap();
        locks.put(lock.clone()).unwrap();
        let other: Lock = locks.get().unwrap();
        lock.acquire().unwrap();
        drop(lock);
        assert!(other.is_owned_by_current_thread());
        other.release().unwrap();
    }

    #[test]
    fn bounded_semaphore_refuses_extra_release() {
        let s = BoundedSemaphore::new(2).unwrap();
        s.acquire().unwrap();
        s.acquire().unwrap();
        assert!(
            s.acquire_timeout(Duration::from_millis(10))
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
        r.acquire().unwrap();
        r.acquire().unwrap();
        r.release().unwrap();
        r.release().unwrap();
        assert!(r.release().is_err());

        let b = Barrier::new(3).unwrap();
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || b.wait_timeout(Duration::from_secs(10)).unwrap())
            })
            .collect();
        let mut idx: Vec<usize> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        idx.sort();
        assert_eq!(idx, [0, 1, 2]);
    }

    #[test]
    fn condition_wakes_a_waiter() {
        let c = Condition::new().unwrap();
        let flag = Value::new(false).unwrap();
        let (c2, f2) = (c.clone(), flag.clone());
        let waiter = std::thread::spawn(move || {
            c2.acquire().unwrap();
            let ok = c2.wait_for_timeout(|| f2.get(), Duration::from_secs(10));
            c2.release().unwrap();
            ok
        });
        c.acquire().unwrap();
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
        let err = ev.wait_timeout(Duration::from_millis(5)).unwrap_err();
        assert!(
            matches!(err, Error::Timeout { after: Some(t), .. } if t == Duration::from_millis(5))
        );
    }
}
