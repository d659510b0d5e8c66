//! Leases: who still holds a resource another process may be using, as the kernel
//! counts it, with nothing to clean up after a crash.
//!
//! # Safety
//!
//! One `fcntl(F_OFD_GETLK/F_OFD_SETLK)` through libc, on an fd that is valid for the
//! call, with a pointer to a live, fully initialised `struct flock`.
//!
//! Two shapes, both on an empty memfd (the lease file) and both released by the kernel
//! when the last fd of a description closes — a holder dropping the resource, a message
//! that is never received being closed with its socket, a holder being SIGKILLed — so
//! a dead holder can never pin anything:
//!
//! - **Owner and holders** ([`create`], [`take`], [`is_unheld`]). Every holder (a
//!   process that maps the resource, a message in flight naming it) has an open file
//!   description of its own on that file, made by re-opening it through
//!   `/proc/self/fd`, with a shared `flock` on it. The resource's owner keeps the
//!   original description, which holds no lock: an exclusive, non-blocking `flock` on it
//!   succeeds exactly when no holder is left. Invariant: a new lease is only made from
//!   an fd of a description that is already a lease, or by the owner; so once the owner
//!   sees no holder, none can appear until the owner hands the resource out again.
//! - **Peers** ([`create_peer`], [`another_peer`], [`others_hold`]), for a resource
//!   with no owner (a queue: every holder is alike). Each peer's description holds an
//!   open-file-description read lock (`F_OFD_SETLK`) on byte 0. A peer asks whether any
//!   *other* description holds one with `F_OFD_GETLK` for a write lock from its own
//!   description: its own read lock never conflicts with that, every other peer's does.
//!   The question takes nothing and changes nothing, so two peers asking at once cannot
//!   mislead each other (a `flock` upgrade would drop the asker's lock first). The
//!   same invariant holds: a new peer is only made from a peer's description.
//! - **Marks** ([`marked_description`], [`is_marked`]), for a file that processes map
//!   (a pooled block). A process that maps the file does so through a description of
//!   its own (opened anew, never sent to anyone) on which it holds an
//!   open-file-description read lock on one byte, its *mark*: [`MARK_HOLDER`] for a
//!   process that maps the block to use it, [`MARK_CREATOR`] for the process that
//!   created it and hands it out. The fd is closed once the file is mapped: the
//!   mapping keeps the description, and with it the mark, until it is unmapped —
//!   when the process lets the block go, or dies. Anyone asks whether a byte is marked
//!   from a description that holds no mark (the fd that travels in messages, or one
//!   opened for the question). A mark is never placed on a description that is sent,
//!   so a message in flight or a queue's custody never keeps a dead process's mark.

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

/// A new lease file for a resource with no owner, with the creator's peer lease on it
/// (the returned description).
pub(crate) fn create_peer(name: &str) -> Result<OwnedFd> {
    let fd = super::memfd::create(name, 0)?;
    hold_peer(fd.as_fd())?;
    Ok(fd)
}

/// A new peer lease on the file `peer` refers to (for a message that carries the
/// resource, whose receiver adopts it): a description of its own, read-locked.
pub(crate) fn another_peer(peer: BorrowedFd<'_>) -> Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", peer.as_raw_fd());
    let fd = rustix::fs::open(&path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| Error::os(format!("re-opening a lease file ({path})"), e))?;
    hold_peer(fd.as_fd())?;
    Ok(fd)
}

/// Makes the description `fd` refers to a peer lease (a received one already is: this
/// makes sure, whatever the sender did). Taking it again changes nothing. The file
/// must be a regular file (a lease file is an empty memfd), never a socket or a pipe.
pub(crate) fn hold_peer(fd: BorrowedFd<'_>) -> Result<()> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::os("fstat of a lease file", e))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(Error::InvalidMessage(
            "a lease handle is not a regular file (a lease file is an empty memfd)".into(),
        ));
    }
    ofd_lock(fd, libc::F_OFD_SETLK, libc::F_RDLCK as libc::c_short, 0)
        .map(drop)
        .map_err(|e| Error::os("taking an open-file-description lock on a lease file", e))
}

/// Lets go of the peer lease `fd` holds (its holder is going away, and asks next
/// whether any other is left: two holders that go at once then both see none).
pub(crate) fn release_peer(fd: BorrowedFd<'_>) -> Result<()> {
    ofd_lock(fd, libc::F_OFD_SETLK, libc::F_UNLCK as libc::c_short, 0)
        .map(drop)
        .map_err(|e| Error::os("releasing an open-file-description lock on a lease file", e))
}

/// Whether a description other than `mine` (a peer lease) holds a peer lease on the
/// same file: another process's, or one inside a message in flight. `true` when the
/// kernel cannot tell (the resource is then assumed to be held).
pub(crate) fn others_hold(mine: BorrowedFd<'_>) -> bool {
    ofd_lock(mine, libc::F_OFD_GETLK, libc::F_WRLCK as libc::c_short, 0)
        != Ok(libc::F_UNLCK as libc::c_short)
}

/// The byte a process that maps a block to use it marks.
pub(crate) const MARK_HOLDER: i64 = 0;
/// The byte the creator of a block marks while it maps it (and may hand it out).
pub(crate) const MARK_CREATOR: i64 = 1;

/// A description of its own of the file `fd` refers to (opened anew through
/// `/proc/self/fd`, read-write), carrying this process's mark on `byte`: map the file
/// through it, then close it (the mapping keeps the mark). With `fresh` the file was
/// just opened here by name and `fd` is such a description already: it is marked as
/// it is.
pub(crate) fn marked_description(fd: BorrowedFd<'_>, byte: i64, fresh: bool) -> Result<OwnedFd> {
    let own = if fresh {
        fd.try_clone_to_owned()
            .map_err(|e| Error::os("duplicating a block's fd to mark it", e))?
    } else {
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| Error::os(format!("re-opening a block to mark it ({path})"), e))?
    };
    ofd_lock(
        own.as_fd(),
        libc::F_OFD_SETLK,
        libc::F_RDLCK as libc::c_short,
        byte,
    )
    .map_err(|e| Error::os("marking a block with an open-file-description lock", e))?;
    Ok(own)
}

/// Whether any description marks `byte` of the file `unmarked` refers to; `unmarked`
/// must hold no mark itself (its own would not count). `true` when the kernel cannot
/// tell (a mark is then assumed, which keeps a block rather than reuse it).
pub(crate) fn is_marked(unmarked: BorrowedFd<'_>, byte: i64) -> bool {
    ofd_lock(
        unmarked,
        libc::F_OFD_GETLK,
        libc::F_WRLCK as libc::c_short,
        byte,
    ) != Ok(libc::F_UNLCK as libc::c_short)
}

/// `fcntl(fd, cmd, {type, SEEK_SET, byte, 1})` for an open-file-description lock on
/// one byte; returns the `l_type` the kernel leaves (for `F_OFD_GETLK`, `F_UNLCK` when
/// the lock could be placed).
fn ofd_lock(
    fd: BorrowedFd<'_>,
    cmd: libc::c_int,
    kind: libc::c_short,
    byte: i64,
) -> std::result::Result<libc::c_short, rustix::io::Errno> {
    // SAFETY: `flock` is plain data; all-zero is a valid value (l_pid must be 0 for
    // the F_OFD_* commands).
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = byte;
    lock.l_len = 1;
    loop {
        // SAFETY: `fd` is valid for the call; `lock` is a live, initialised `flock`
        // that the kernel reads and (for GETLK) writes.
        let r = unsafe { libc::fcntl(fd.as_raw_fd(), cmd, &mut lock as *mut libc::flock) };
        if r != -1 {
            return Ok(lock.l_type);
        }
        let errno = rustix::io::Errno::from_raw_os_error(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        );
        if errno != rustix::io::Errno::INTR {
            return Err(errno);
        }
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

    #[test]
    #[cfg_attr(miri, ignore = "memfds and fcntl")]
    fn a_peer_sees_other_peers_until_their_descriptions_close() {
        let a = create_peer("peer-test").unwrap();
        assert!(!others_hold(a.as_fd()), "alone");
        let b = another_peer(a.as_fd()).unwrap();
        assert!(others_hold(a.as_fd()) && others_hold(b.as_fd()));
        // A duplicate of a description is the same peer: it does not count twice, nor
        // against itself.
        let b_dup = b.try_clone().unwrap();
        drop(b);
        assert!(others_hold(a.as_fd()), "the duplicate keeps b's lease");
        assert!(others_hold(b_dup.as_fd()), "b's duplicate sees a");
        drop(b_dup);
        assert!(!others_hold(a.as_fd()), "b's last fd closed");
        // Asking took nothing: a new peer still sees a as held, and a sees it.
        let c = another_peer(a.as_fd()).unwrap();
        assert!(others_hold(c.as_fd()) && others_hold(a.as_fd()));
        drop(a);
        assert!(!others_hold(c.as_fd()));
    }

    #[test]
    #[cfg_attr(miri, ignore = "memfds and fcntl")]
    fn a_mark_lasts_as_long_as_the_mapping_of_its_description() {
        let file = crate::sys::memfd::create("mark-test", 4096).unwrap();
        assert!(!is_marked(file.as_fd(), MARK_HOLDER));
        let own = marked_description(file.as_fd(), MARK_HOLDER, false).unwrap();
        let map = crate::sys::mmap::SharedMapping::map(own.as_fd(), 4096).unwrap();
        drop(own);
        assert!(
            is_marked(file.as_fd(), MARK_HOLDER),
            "the mapping keeps the mark"
        );
        assert!(!is_marked(file.as_fd(), MARK_CREATOR), "one byte only");
        // A duplicate of the unmarked fd (as a message carries it) holds no mark.
        let sent = file.try_clone().unwrap();
        drop(map);
        assert!(
            !is_marked(file.as_fd(), MARK_HOLDER),
            "unmapped: the mark is gone"
        );
        assert!(!is_marked(sent.as_fd(), MARK_HOLDER));
    }
}
