//! [`SharedBytes`]: a checked range of host memory that others — other processes, or
//! other threads through another handle — may write at any moment: a process group's
//! slots, a shared tensor's bytes, a private buffer lent for one copy. It is the form in
//! which such memory reaches the code that copies it (the collectives' kernels in
//! `tensor::bulk`, the CUDA driver's host copies).
//!
//! # Safety
//!
//! A [`SharedBytes`] is made by [`SharedBytes::from_raw`], whose caller vouches that the
//! range is mapped (readable, and writable when it says so) for the borrow's lifetime
//! (a mapping's owner, a storage's read guard), or from a slice it borrows. It is never
//! turned into a reference: others may write it at any moment, so it is only copied (a
//! copy racing with a writer that breaks its protocol gives wrong bytes, never an
//! access outside the ranges), and its users read and write elements through raw
//! pointers. A copy checks both lengths and the destination's writability once, and
//! uses `memmove` when the two ranges overlap (two views of one mapping).

use std::marker::PhantomData;

use crate::error::{Error, Result};

/// A range of mapped host bytes that others may write at any moment, valid for `'a`:
/// checked, never a reference (see the module's safety section).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedBytes<'a> {
    ptr: *mut u8,
    len: usize,
    writable: bool,
    _mapped: PhantomData<&'a ()>,
}

impl<'a> SharedBytes<'a> {
    /// The range `ptr..ptr + len`.
    ///
    /// # Safety
    /// The range must be mapped and readable for `'a` (and writable when `writable`),
    /// and never be the target of a Rust reference while this lives.
    pub(crate) unsafe fn from_raw(ptr: *mut u8, len: usize, writable: bool) -> Self {
        SharedBytes {
            ptr,
            len,
            writable,
            _mapped: PhantomData,
        }
    }

    /// The bytes of `slice`, read-only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn of_slice(slice: &'a [u8]) -> Self {
        // SAFETY: the slice is readable for `'a`, which the result borrows it for; it is
        // only read through the pointer while that borrow lasts.
        unsafe { Self::from_raw(slice.as_ptr().cast_mut(), slice.len(), false) }
    }

    /// The bytes of `slice`, writable.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn of_mut_slice(slice: &'a mut [u8]) -> Self {
        // SAFETY: the slice is readable and writable for `'a`, and borrowed exclusively
        // by the result for that long, so no reference to it is used meanwhile.
        unsafe { Self::from_raw(slice.as_mut_ptr(), slice.len(), true) }
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether it may be written.
    pub(crate) fn is_writable(&self) -> bool {
        self.writable
    }

    /// The first byte: valid for [`len`](Self::len) bytes during `'a`, to be read and
    /// written only through raw pointers.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes `at..at + len` of this range.
    pub(crate) fn range(&self, at: usize, len: usize) -> Result<SharedBytes<'a>> {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(out_of_range(at, len, self.len));
        }
        Ok(SharedBytes {
            ptr: self.ptr.wrapping_add(at),
            len,
            ..*self
        })
    }

    /// Copies all of `src` over this range, which must be as long and writable.
    pub(crate) fn copy_from(&self, src: &SharedBytes<'_>) -> Result<()> {
        if src.len != self.len || !self.writable {
            return Err(Error::InvalidArgument(format!(
                "internal error: a copy of {} bytes into a {}-byte {} range",
                src.len,
                self.len,
                if self.writable { "shared" } else { "read-only" }
            )));
        }
        let (s, d) = (src.ptr as usize, self.ptr as usize);
        let overlap = s < d.wrapping_add(self.len) && d < s.wrapping_add(self.len);
        // SAFETY: both ranges are mapped for their lifetimes (how every `SharedBytes` is
        // made), `self.len` bytes long (checked above) and the destination writable
        // (checked above); neither is a Rust reference. Overlapping ranges (two views
        // of one mapping) take `copy`, which allows it.
        unsafe {
            if overlap {
                std::ptr::copy(src.ptr, self.ptr, self.len);
            } else {
                std::ptr::copy_nonoverlapping(src.ptr, self.ptr, self.len);
            }
        }
        Ok(())
    }
}

fn out_of_range(at: usize, len: usize, of: usize) -> Error {
    Error::InvalidArgument(format!(
        "internal error: {len} bytes at byte {at} of a {of}-byte shared range"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_copies_are_checked() {
        let mut a = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let b = [9u8; 4];
        let src = SharedBytes::of_slice(&b);
        let dst = SharedBytes::of_mut_slice(&mut a);
        assert!(dst.range(4, 4).is_ok());
        assert!(dst.range(5, 4).is_err());
        assert!(dst.range(usize::MAX, 2).is_err());
        dst.range(2, 4).unwrap().copy_from(&src).unwrap();
        assert!(dst.range(0, 3).unwrap().copy_from(&src).is_err());
        assert!(
            src.copy_from(&dst.range(0, 4).unwrap()).is_err(),
            "read-only"
        );
        // Overlapping: bytes 0..6 onto 2..8.
        dst.range(2, 6)
            .unwrap()
            .copy_from(&dst.range(0, 6).unwrap())
            .unwrap();
        assert_eq!(a, [1, 2, 1, 2, 9, 9, 9, 9]);
    }
}
