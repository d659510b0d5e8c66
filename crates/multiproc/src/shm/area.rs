//! [`SharedArea`]: a mapping of a shared file laid out by its owner (a process group's
//! segment: control words, slots, mailboxes), with bounds-checked atomic words and
//! byte ranges ([`SharedBytes`], the form in which memory other processes write reaches
//! the copy and reduction kernels of `tensor::bulk`).
//!
//! # Safety
//!
//! The unsafe code turns an offset of the mapping into `&AtomicU32`, and a range of it
//! into a [`SharedBytes`]:
//!
//! - A word's offset is checked on every call to lie inside the mapping and be 4-byte
//!   aligned (the mapping is page-aligned); the reference borrows the area, so the
//!   mapping outlives it; atomics may be written concurrently by anyone, other
//!   processes included.
//! - A range is checked to lie inside the mapping and borrows the area; the bytes are
//!   never a reference (see `sys::shared_bytes`).

use std::os::fd::BorrowedFd;
use std::sync::atomic::AtomicU32;

use crate::error::{Error, Result};
use crate::sys::mmap::SharedMapping;
use crate::sys::shared_bytes::SharedBytes;

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
        // SAFETY: `offset..offset + len` lies inside the mapping (checked above), which
        // is readable and writable and lives as long as `self`, which the result
        // borrows; this module makes no reference into it.
        Ok(unsafe { SharedBytes::from_raw(self.map.as_ptr().add(offset), len, true) })
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
