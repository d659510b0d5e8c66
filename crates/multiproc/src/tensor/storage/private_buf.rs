//! [`PrivateBuf`]: a private storage's bytes on this process's heap, 64-byte aligned
//! and zero-initialised.

use std::alloc::Layout;
use std::ptr::NonNull;

use super::ALIGN;
use crate::error::{Error, Result};

/// A 64-byte-aligned, zero-initialised heap buffer of `len > 0` bytes.
pub(super) struct PrivateBuf {
    pub(super) ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; it is only accessed through
// raw pointers under the storage's lock discipline and atomics.
unsafe impl Send for PrivateBuf {}
// SAFETY: as above: `&PrivateBuf` exposes only the pointer.
unsafe impl Sync for PrivateBuf {}

impl PrivateBuf {
    pub(super) fn zeroed(len: usize) -> Result<PrivateBuf> {
        let layout = Layout::from_size_align(len, ALIGN).map_err(|_| {
            Error::Tensor(format!(
                "a storage of {len} bytes is larger than memory can hold"
            ))
        })?;
        // SAFETY: `layout` has a non-zero size (callers never ask for 0 bytes).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Tensor(format!(
                "cannot allocate {} for a tensor: out of memory",
                crate::sys::memfd::human_bytes(len as u64)
            ))
        })?;
        Ok(PrivateBuf { ptr, layout })
    }

    /// A buffer holding a copy of `bytes` (`len > 0`): one memcpy, no zeroing first.
    pub(super) fn copy_of(bytes: &[u8]) -> Result<PrivateBuf> {
        let len = bytes.len();
        let layout = Layout::from_size_align(len, ALIGN).map_err(|_| {
            Error::Tensor(format!(
                "a storage of {len} bytes is larger than memory can hold"
            ))
        })?;
        // SAFETY: `layout` has a non-zero size (callers never ask for 0 bytes).
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Tensor(format!(
                "cannot allocate {} for a tensor: out of memory",
                crate::sys::memfd::human_bytes(len as u64)
            ))
        })?;
        // SAFETY: the new allocation holds `len` bytes and cannot overlap `bytes`; every
        // byte is written before the buffer is used.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr.as_ptr(), len) };
        Ok(PrivateBuf { ptr, layout })
    }
}

impl Drop for PrivateBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated with exactly `layout` and is freed once, here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
