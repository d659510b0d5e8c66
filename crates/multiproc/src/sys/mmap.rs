//! Shared mappings of a file, unmapped on drop.
//!
//! # Safety
//!
//! `sysconf`, and `mmap`/`madvise`/`munmap` of the shared mappings this module owns. A
//! mapping is handed out only as a raw pointer and its length: other processes may
//! write it at any moment, so no Rust reference into it is ever made here.

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// The system's page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// A `MAP_SHARED` read-write mapping of `len` bytes of a file.
///
/// The memory may be written by other processes at any time, so this type never hands
/// out references to it: only a raw pointer.
#[derive(Debug)]
pub(crate) struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; moving or sharing the owner
// between threads does not change what the pointer refers to. Access to the bytes is
// through raw pointers whose users uphold their own synchronisation.
unsafe impl Send for SharedMapping {}
// SAFETY: as above; `&SharedMapping` only exposes the pointer and length.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps the first `len` bytes of `fd` (`len > 0`). The caller has checked that the
    /// file is at least `len` bytes long and cannot shrink (or accepts that it is ours).
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot map a segment of 0 bytes".into(),
            ));
        }
        // SAFETY: a fresh mapping at an address the kernel chooses cannot alias any Rust
        // object; the result is only used through raw pointers.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| Error::os(format!("mmap of a {len}-byte shared segment"), e))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::os("mmap", std::io::Error::other("returned null")))?;
        Ok(Self { ptr, len })
    }

    /// Maps every page of the mapping now, in one pass (`MADV_POPULATE_WRITE`), instead
    /// of one page fault per page on first touch: several times cheaper for a large
    /// segment that will be written or read whole. Best effort: a kernel without it
    /// (before 5.14) faults pages in on demand as usual.
    pub(crate) fn populate(&self) {
        // SAFETY: the range is exactly this mapping; populating changes no contents.
        let _ = unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        };
    }

    /// Leaves the mapping out of a `fork` child's address space (`MADV_DONTFORK`): for a
    /// mapping whose only job is to keep this process's mark alive (see `sys::lease`),
    /// which a child must not keep alive after this process dies.
    pub(crate) fn exclude_from_fork(&self) -> Result<()> {
        // SAFETY: the range is exactly this mapping; the advice changes no contents.
        unsafe {
            rustix::mm::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                rustix::mm::Advice::LinuxDontFork,
            )
        }
        .map_err(|e| Error::os("madvise(MADV_DONTFORK) of a mark's mapping", e))
    }

    /// The start of the mapping.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping this value created and owns;
        // nothing refers to it once its owner is dropped.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
