//! [`PeerLease`]: a value's peer lease on a resource's lease file (see `lease`'s peers:
//! a queue's holders), which a `fork` child makes its own.
//!
//! # Safety
//!
//! Registers `pthread_atfork` handlers. The child handler only swaps fds in atomics,
//! closes fds and stores to atomics, which is async-signal-safe as the child of a
//! multithreaded `fork` requires. The registry's entries are reached only under its
//! spin lock, which the prepare handler takes and the parent and child handlers release.
//! A lease's fd is borrowed only while the lease lives; it is replaced only in a `fork`
//! child's handler, when no other thread exists and the forking one is inside `fork`.
//!
//! Why. A `fork` child inherits its parent's values, and their fds refer to the parent's
//! open file descriptions: the same descriptions, so the child holds no lease of its
//! own. Another peer that asks whether anyone else holds the resource sees the child as
//! the parent, and once the parent has let go not at all: a parent whose queue had gone
//! to a worker that exited got `Disconnected` at once while a `fork` child that was
//! about to put still ran. And the child, asking from the parent's description, counts
//! the parent's lock as its own. So before every `fork` the process makes one more
//! description of each live lease (the prepare handler, which may allocate and open
//! files); the child swaps each lease to its new description and closes its copy of
//! the parent's (the child handler); the parent closes the new ones (the parent
//! handler). A child that never uses the value holds it until it exits or execs (the
//! descriptions are close-on-exec), as a child holding an inherited pipe end does.

use std::cell::UnsafeCell;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use super::lease;

/// A value's peer lease: the fd of its own description of the lease file, which holds
/// the peer lock (see `lease::hold_peer`). Closed when dropped.
#[derive(Debug)]
pub(crate) struct PeerLease {
    fd: Arc<AtomicI32>,
}

impl PeerLease {
    /// Takes over `fd`, a description that holds a peer lock, registered so that a
    /// `fork` child gets a description of its own.
    pub(crate) fn new(fd: OwnedFd) -> PeerLease {
        watch_forks();
        let fd = Arc::new(AtomicI32::new(fd.into_raw_fd()));
        REGISTRY.with(|entries| {
            entries.push(Entry {
                fd: Arc::clone(&fd),
                prepared: -1,
            })
        });
        PeerLease { fd }
    }
}

impl AsFd for PeerLease {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd is open while the lease lives (closed only by its drop, or,
        // replaced by another open one, in a fork child's handler while no other code
        // runs: see the module docs).
        unsafe { BorrowedFd::borrow_raw(self.fd.load(Ordering::Acquire)) }
    }
}

impl Drop for PeerLease {
    fn drop(&mut self) {
        REGISTRY.with(|entries| {
            if let Some(i) = entries.iter().position(|e| Arc::ptr_eq(&e.fd, &self.fd)) {
                entries.swap_remove(i);
            }
        });
        // SAFETY: the lease owns the fd, which nothing else closes; unregistered above,
        // no fork handler touches it any more.
        drop(unsafe { OwnedFd::from_raw_fd(self.fd.load(Ordering::Acquire)) });
    }
}

/// One live lease, and the description made for a `fork` child (-1 outside a fork).
struct Entry {
    fd: Arc<AtomicI32>,
    prepared: RawFd,
}

/// The live leases of this process, behind a spin lock that the fork handlers can hold
/// across `fork` (a `Mutex` could not be released by the child's handler).
struct Registry {
    locked: AtomicBool,
    entries: UnsafeCell<Vec<Entry>>,
}

// SAFETY: `entries` is reached only while `locked` is held (see `with`, `hold` and
// `release`).
unsafe impl Sync for Registry {}

static REGISTRY: Registry = Registry {
    locked: AtomicBool::new(false),
    entries: UnsafeCell::new(Vec::new()),
};

impl Registry {
    fn hold(&self) {
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    fn release(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// The entries, to be used only between `hold` and `release`.
    ///
    /// # Safety
    /// The caller holds the lock.
    #[allow(clippy::mut_from_ref)]
    unsafe fn entries(&self) -> &mut Vec<Entry> {
        // SAFETY: the lock makes this the only access (see the caller's contract).
        unsafe { &mut *self.entries.get() }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Vec<Entry>) -> R) -> R {
        self.hold();
        // SAFETY: held just above, released just below.
        let out = f(unsafe { self.entries() });
        self.release();
        out
    }
}

/// Registers the fork handlers (once).
fn watch_forks() {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        // SAFETY: `prepare` and `in_parent` run in the forking thread in a normal
        // context; `in_child` only does what is async-signal-safe (see the module docs).
        let _ = unsafe { libc::pthread_atfork(Some(prepare), Some(in_parent), Some(in_child)) };
    });
}

/// Before a fork: a new description for each live lease, for the child. The lock stays
/// held until the parent's and the child's handlers have run.
extern "C" fn prepare() {
    REGISTRY.hold();
    // SAFETY: held just above; released by `in_parent` and `in_child`.
    for e in unsafe { REGISTRY.entries() } {
        // SAFETY: the entry's lease is alive (it unregisters before closing its fd,
        // under the lock held here).
        let fd = unsafe { BorrowedFd::borrow_raw(e.fd.load(Ordering::Acquire)) };
        // A lease that cannot be duplicated (fd limit) leaves the child sharing the
        // parent's description, as before this existed.
        e.prepared = lease::another_peer(fd).map_or(-1, IntoRawFd::into_raw_fd);
    }
}

/// After a fork, in the parent: the child's descriptions are the child's.
extern "C" fn in_parent() {
    // SAFETY: `prepare` holds the lock.
    for e in unsafe { REGISTRY.entries() } {
        if e.prepared != -1 {
            // SAFETY: made by `prepare` for the child, owned by nothing else here.
            unsafe { libc::close(e.prepared) };
            e.prepared = -1;
        }
    }
    REGISTRY.release();
}

/// After a fork, in the child: each lease moves to its own description, and the copy
/// of the parent's is closed (its lock stays the parent's).
extern "C" fn in_child() {
    // SAFETY: `prepare` held the lock in the parent, and this child's only thread is
    // the one that took it.
    for e in unsafe { REGISTRY.entries() } {
        if e.prepared != -1 {
            let parents = e.fd.swap(e.prepared, Ordering::AcqRel);
            // SAFETY: the child's copy of the parent's description, which nothing in
            // the child uses any more (the lease now names the new one).
            unsafe { libc::close(parents) };
            e.prepared = -1;
        }
    }
    REGISTRY.release();
}
