//! Process-local state that a `fork` child rebuilds instead of inheriting.
//!
//! # Safety
//!
//! Dereferences a pointer that came from `Box::into_raw` and is never freed (a slot
//! lives for the rest of the process), so it is valid for `'static`; registers a
//! `pthread_atfork` child handler that only stores to atomics.
//!
//! A child forked from a multithreaded parent holds copies of the parent's mutexes in
//! whatever state the parent's *other* threads left them: one that another thread held
//! at the fork stays locked in the child forever, and the child's first put or get
//! hangs on it. And what those mutexes guard (the map cache, the pools of blocks this
//! process recycles, its connection to the shm manager, its launcher thread) belongs
//! to the parent anyway. A [`ForkLocal`] therefore keys its state by the fork
//! generation ([`fork_generation`], counted by an atfork handler): the first use
//! in a new generation puts a fresh, default value in a new slot, and the parent's
//! slot is left untouched (it may be locked, and its contents are the parent's) and
//! never freed: one small leak per fork generation that uses it, never a hang.

use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

/// This process's pid, without a system call after the first: the hot path asks for it
/// several times per message (whose reference a value holds, which pool is whose).
/// A `fork` child resets the cache (a `pthread_atfork` handler), so it never sees its
/// parent's pid. A child made by a raw `clone` system call, bypassing libc, would; none
/// is made here.
pub(crate) fn cached_pid() -> u32 {
    let cached = CACHED_PID.load(std::sync::atomic::Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    watch_forks();
    let pid = std::process::id();
    CACHED_PID.store(pid, std::sync::atomic::Ordering::Relaxed);
    pid
}

/// How many `fork`s separate this process from the first process of its line that
/// asked (0 there; a `fork` child sees one more than its parent did). Process-local
/// state keyed by it is rebuilt in a child (see `fork_local`), which would otherwise
/// inherit mutexes that other threads of its parent held at the fork, and hang.
pub(crate) fn fork_generation() -> u64 {
    watch_forks();
    FORK_GENERATION.load(std::sync::atomic::Ordering::Acquire)
}

/// Registers (once) the `fork` child handler that forgets the cached pid and counts the
/// fork.
fn watch_forks() {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        // SAFETY: registers a handler that only stores to atomics, which is
        // async-signal-safe as the child side of fork requires.
        let _ = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

static CACHED_PID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
static FORK_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

extern "C" fn after_fork_in_child() {
    CACHED_PID.store(0, std::sync::atomic::Ordering::Relaxed);
    FORK_GENERATION.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
}

/// A `Mutex<T>` whose value a `fork` child starts afresh (`T::default()`).
pub(crate) struct ForkLocal<T> {
    slot: AtomicPtr<Slot<T>>,
}

struct Slot<T> {
    generation: u64,
    value: Mutex<T>,
}

impl<T: Default> ForkLocal<T> {
    /// An empty state; the value is made on first use.
    pub(crate) const fn new() -> Self {
        Self {
            slot: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Locks this process's value (a poisoned lock is taken over: the value is plain
    /// bookkeeping that every user keeps consistent between calls).
    pub(crate) fn lock(&'static self) -> MutexGuard<'static, T> {
        self.current()
            .value
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks this process's value if no other thread holds it.
    pub(crate) fn try_lock(&'static self) -> Option<MutexGuard<'static, T>> {
        match self.current().value.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    fn current(&'static self) -> &'static Slot<T> {
        let generation = fork_generation();
        let mut seen = self.slot.load(Ordering::Acquire);
        loop {
            // SAFETY: a non-null slot came from `Box::into_raw` below and is never
            // freed (see the module docs), so it is valid for 'static.
            if let Some(slot) = unsafe { seen.as_ref() } {
                if slot.generation == generation {
                    return slot;
                }
            }
            let fresh = Box::into_raw(Box::new(Slot {
                generation,
                value: Mutex::new(T::default()),
            }));
            match self
                .slot
                .compare_exchange(seen, fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                // The old slot (the parent's) is left as it is: it may be locked.
                // SAFETY: `fresh` came from `Box::into_raw` just above and is never
                // freed.
                Ok(_) => return unsafe { &*fresh },
                Err(now) => {
                    // Another thread of this process installed one first.
                    // SAFETY: `fresh` was never shared: take it back and drop it.
                    drop(unsafe { Box::from_raw(fresh) });
                    seen = now;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static STATE: ForkLocal<Vec<u32>> = ForkLocal::new();

    #[test]
    #[cfg_attr(miri, ignore = "fork")]
    fn a_fork_child_starts_afresh_even_when_another_thread_holds_the_lock() {
        STATE.lock().push(1);
        // Another thread holds the lock across the fork.
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let guard = STATE.lock();
            held_tx.send(()).unwrap();
            release_rx.recv().unwrap();
            drop(guard);
        });
        held_rx.recv().unwrap();
        // SAFETY: the child only touches `STATE` (a fresh slot: an allocation, which
        // glibc makes fork-safe) and calls `_exit`.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let fresh = STATE.try_lock().is_some_and(|v| v.is_empty());
            // SAFETY: `_exit` is async-signal-safe and ends the child at once.
            unsafe { libc::_exit(if fresh { 0 } else { 1 }) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: waits for the child just forked, with a valid pointer for its status.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child found the parent's locked or filled state ({status})"
        );
        assert_eq!(*STATE.lock(), [1], "the parent keeps its own");
    }
}
