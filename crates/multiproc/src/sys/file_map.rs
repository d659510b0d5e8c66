//! Read-only shared mappings of a regular file (the pages of a weights file that many
//! processes read through one page-cache copy), unmapped on drop.
//!
//! # Safety
//!
//! `mmap`/`munmap` of a read-only shared mapping this module owns; the mapping is only
//! ever read through raw pointers (the file's pages may change under it), never as a
//! Rust reference.
//!
//! # Safety
//!
//! The mapping is `PROT_READ`: a store through it would be a SIGSEGV, so the layers above
//! refuse every write to a read-only storage before it reaches the kernels. The pages
//! belong to a file that another process may change (`write(2)` to it), so this type never
//! hands out references to them, only a raw pointer. A file that shrinks while mapped
//! makes an access past its new end a SIGBUS: callers check the size with `fstat` before
//! mapping, and document that a mapped file must not be truncated in place.

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// A `MAP_SHARED`, `PROT_READ` mapping of the first `len` bytes of a file.
#[derive(Debug)]
pub(crate) struct ReadOnlyMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain read-only memory owned by this value; moving or sharing the
// owner between threads does not change what the pointer refers to.
unsafe impl Send for ReadOnlyMapping {}
// SAFETY: as above; `&ReadOnlyMapping` only exposes the pointer and length.
unsafe impl Sync for ReadOnlyMapping {}

impl ReadOnlyMapping {
    /// Maps the first `len > 0` bytes of `fd`, which the caller has checked (`fstat`) to
    /// be a regular file at least `len` bytes long.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot map a file of 0 bytes".into(),
            ));
        }
        // SAFETY: a fresh mapping at an address the kernel chooses cannot alias any Rust
        // object; the result is only used through raw pointers, and only read.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| Error::os(format!("mmap of {len} bytes of a file, read-only"), e))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::os("mmap", std::io::Error::other("returned null")))?;
        Ok(Self { ptr, len })
    }

    /// The start of the mapping.
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for ReadOnlyMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping this value created and owns;
        // nothing refers to it once its owner is dropped.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
