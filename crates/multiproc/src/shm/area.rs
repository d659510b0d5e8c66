//! [`SharedArea`]: a mapping of a shared file laid out by its owner (a process group's
//! segment: control words, slots, mailboxes), with bounds-checked atomic words and
//! byte ranges; and [`SharedBytes`], a checked range of memory that other processes may
//! write, the form in which such memory reaches the copy and reduction kernels
//! (`tensor::bulk`).
//!
//! # Safety
//!
//! The unsafe code turns an offset of the mapping into `&AtomicU32`, and copies bytes
//! between two [`SharedBytes`]. Invariants:
//!
//! - A word's offset is checked on every call to lie inside the mapping and be 4-byte
//!   aligned (the mapping is page-aligned); the reference borrows the area, so the
//!   mapping outlives it; atomics may be written concurrently by anyone, other
//!   processes included.
//! - A [`SharedBytes`] is made only by [`SharedArea::bytes`] (checked against the
//!   mapping) or by [`SharedBytes::from_raw`], whose caller vouches that the range is
//!   mapped for the borrow's lifetime (the tensor kernels, from a storage's read guard).
//!   It is never turned into a reference: other processes may write it at any moment,
//!   so it is only copied (a copy racing with a writer that breaks its protocol gives
//!   wrong bytes, never an access outside the ranges), and its users read and write
//!   elements through raw pointers.
//! - A copy checks both lengths and the destination's writability once, and uses
//!   `memmove` when the two ranges overlap (two views of one mapping).

use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::sync::atomic::AtomicU32;

use crate::error::{Error, Result};
use crate::sys::mmap::SharedMapping;

/// A `MAP_SHARED` read-write mapping of the first bytes of a shared file, addressed by
/// byte offsets that its owner's layout defines.
#[derive(Debug)]
pub(crate) struct SharedArea {
    map: SharedMapping,
}

impl SharedArea {
    /// Maps the first `len > 0` bytes of `fd`, which the caller has checked to be at
    /// least that long and sealed against shrinking.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        Ok(Self {
            map: SharedMapping::map(fd, len)?,
        })
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The 32-bit atomic word at byte `offset`.
    ///
    /// # Panics
    /// When `offset` is not a 4-aligned offset inside the mapping: offsets come from the
    /// owner's fixed layout, so that is a bug in the owner, not a runtime condition.
    pub(crate) fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset % 4 == 0 && offset.checked_add(4).is_some_and(|end| end <= self.len()),
            "shared area word at byte {offset} outside the {}-byte mapping",
            self.len()
        );
        // SAFETY: `offset..offset + 4` lies inside the mapping (checked above), 4-aligned
        // (the mapping is page-aligned, `offset` a multiple of 4); the word is only ever
        // used atomically, and the reference borrows `self`, which owns the mapping.
        unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// Bytes `offset..offset + len` of the mapping, writable.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> Result<SharedBytes<'_>> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(out_of_range(offset, len, self.len()));
        }
        Ok(SharedBytes {
            ptr: self.map.as_ptr().wrapping_add(offset),
            len,
            writable: true,
            _mapped: PhantomData,
        })
    }
}

/// A range of mapped bytes that other processes may write at any moment, valid for
/// `'a`: checked, never a reference (see the module's safety section).
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
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;

    fn area(len: usize) -> (std::os::fd::OwnedFd, SharedArea) {
        let fd = crate::sys::memfd::create("multiproc-test-area", len as u64).unwrap();
        let area = SharedArea::map(fd.as_fd(), len).unwrap();
        (fd, area)
    }

    #[test]
    fn words_and_ranges_stay_inside_the_mapping() {
        let (_fd, a) = area(8192);
        a.atomic_u32(8188).store(7, Ordering::Relaxed);
        assert_eq!(a.atomic_u32(8188).load(Ordering::Relaxed), 7);
        assert!(a.bytes(8000, 192).is_ok());
        assert!(a.bytes(8000, 193).is_err());
        assert!(a.bytes(usize::MAX, 2).is_err());
        let r = a.bytes(4096, 100).unwrap();
        assert!(r.range(50, 50).is_ok());
        assert!(r.range(51, 50).is_err());
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_word_past_the_end_is_a_bug() {
        let (_fd, a) = area(4096);
        a.atomic_u32(4096);
    }

    #[test]
    fn copies_check_lengths_and_allow_overlap() {
        let (_fd, a) = area(4096);
        let src = a.bytes(0, 8).unwrap();
        for (i, w) in [0u32, 4].iter().enumerate() {
            a.atomic_u32(*w as usize)
                .store(0x0101_0101 * (i as u32 + 1), Ordering::Relaxed);
        }
        a.bytes(100, 8).unwrap().copy_from(&src).unwrap();
        // Overlapping: bytes 0..8 onto 4..12.
        a.bytes(4, 8).unwrap().copy_from(&src).unwrap();
        assert_eq!(a.atomic_u32(4).load(Ordering::Relaxed), 0x0101_0101);
        assert_eq!(a.atomic_u32(8).load(Ordering::Relaxed), 0x0202_0202);
        assert!(a.bytes(200, 7).unwrap().copy_from(&src).is_err());
        // SAFETY: the range is inside the mapping `a`, which outlives `ro`.
        let ro = unsafe { SharedBytes::from_raw(a.bytes(300, 8).unwrap().as_ptr(), 8, false) };
        assert!(ro.copy_from(&src).is_err());
    }
}
