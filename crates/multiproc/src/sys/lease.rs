//! Leases: who still holds a resource another process may be using, as the kernel
//! counts it, with nothing to clean up after a crash.
//!
//! # Safety
//!
//! No unsafe code.
//!
//! A lease file is an empty memfd. Every holder (a process that maps the resource, a
//! message in flight naming it) has an open file description of its own on that file,
//! made by re-opening it through `/proc/self/fd`, with a shared `flock` on it. The
//! resource's owner keeps the original description, which holds no lock: an exclusive,
//! non-blocking `flock` on it succeeds exactly when no holder is left. The kernel drops
//! a description's lock when its last fd closes — a holder dropping the resource, a
//! message that is never received being closed with its socket, a holder being
//! SIGKILLed — so a dead holder can never pin the resource.
//!
//! Invariant: a new lease is only made from an fd of a description that is already a
//! lease, or by the owner; so once the owner sees no holder, none can appear until the
//! owner hands the resource out again.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::fs::{FlockOperation, Mode, OFlags};

use crate::error::{Error, Result};

/// A new lease file, held by nobody yet (the owner's description).
pub(crate) fn create(name: &str) -> Result<OwnedFd> {
    super::memfd::create(name, 0)
}

/// A new lease on the file `fd` refers to: a description of its own, share-locked. The
/// lease lasts until every fd of the returned description is closed.
pub(crate) fn take(fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let lease = rustix::fs::open(&path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| Error::os(format!("re-opening a lease file ({path})"), e))?;
    // Blocks at most for the owner's momentary exclusive probe (see `is_unheld`).
    rustix::fs::flock(lease.as_fd(), FlockOperation::LockShared)
        .map_err(|e| Error::os("taking a shared flock on a lease file", e))?;
    Ok(lease)
}

/// Whether no lease on the file is held (by any process). `owner` must be the owner's
/// own description, which never holds a lease.
pub(crate) fn is_unheld(owner: BorrowedFd<'_>) -> bool {
    match rustix::fs::flock(owner, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {
            // Nothing can be done about an unlock that fails but retrying it later;
            // report "held" so the resource is not reused while we are unsure.
            rustix::fs::flock(owner, FlockOperation::Unlock).is_ok()
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "memfds and flock")]
    fn a_lease_is_held_until_its_last_fd_closes() {
        let owner = create("lease-test").unwrap();
        assert!(is_unheld(owner.as_fd()));
        let a = take(owner.as_fd()).unwrap();
        assert!(!is_unheld(owner.as_fd()));
        // A lease made from a lease (forwarding) is a second holder.
        let b = take(a.as_fd()).unwrap();
        let a_dup = a.try_clone().unwrap();
        drop(a);
        assert!(!is_unheld(owner.as_fd()), "a duplicate keeps the lease");
        drop(a_dup);
        assert!(!is_unheld(owner.as_fd()), "the second lease is still held");
        drop(b);
        assert!(is_unheld(owner.as_fd()));
        // The probe left no lock behind.
        let c = take(owner.as_fd()).unwrap();
        drop(c);
        assert!(is_unheld(owner.as_fd()));
    }
}
