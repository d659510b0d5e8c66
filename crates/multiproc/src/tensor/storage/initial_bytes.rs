//! How a new shared storage's bytes start out ([`Init`]), and the relaxed atomic writes
//! that put them into shared memory ([`write_shared`]).

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// How a new shared storage's bytes start out.
#[derive(Clone, Copy)]
pub(super) enum Init<'a> {
    /// Zeros.
    Zero,
    /// Whatever a recycled block held.
    Uninit,
    /// A copy of these bytes (as many as the storage has).
    Copy(&'a [u8]),
}

/// Writes `len` bytes at `dst` (8-byte aligned) with relaxed atomic stores: a copy of
/// `src` (private memory, not shared), or zeros when `src` is `None`. For a recycled
/// block, whose bytes another process mapped before: no process may use them now (the
/// block had no uses), but the stores are atomic so that even a misbehaving one could
/// only see stale values, never undefined behaviour.
///
/// # Safety
///
/// `dst..dst+len` must be mapped, writable and 8-byte aligned; `src..src+len`, when
/// given, readable and not written concurrently.
pub(super) unsafe fn write_shared(dst: *mut u8, src: Option<*const u8>, len: usize) {
    let words = len / 8;
    for i in 0..words {
        // SAFETY: `i * 8 + 8 <= len`, so both words are in bounds (the caller's
        // contract); `src` is private memory read unaligned.
        let value = src.map_or(0, |p| unsafe {
            p.add(i * 8).cast::<u64>().read_unaligned()
        });
        // SAFETY: in bounds and 8-byte aligned (dst is); shared memory is only ever
        // accessed atomically.
        unsafe { AtomicU64::from_ptr(dst.add(i * 8).cast()) }.store(value, Ordering::Relaxed);
    }
    for i in words * 8..len {
        // SAFETY: `i < len`, in bounds of both ranges.
        let value = src.map_or(0, |p| unsafe { *p.add(i) });
        // SAFETY: in bounds; a byte is always aligned.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(value, Ordering::Relaxed);
    }
}
