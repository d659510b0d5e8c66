//! The element kernels: every read and write of tensor data happens here.
//!
//! # Safety
//!
//! Tensor memory may be written at any moment by other threads (handles are cheap
//! clones) and other processes (shared segments), so it is never seen as `&[T]`. Each
//! element is read and written with a relaxed atomic of its width (`AtomicU32` for an
//! `f32`…), which makes concurrent Hogwild-style updates defined behaviour (a racing
//! update may be lost, never torn or undefined). The bits are turned back into `T` with
//! a total conversion, so any pattern is a valid value.
//!
//! A [`Region`] is the only way into the kernels. Building one checks, once, that every
//! element it addresses lies inside the storage and is aligned; it borrows the storage's
//! read guard, so the memory stays mapped while it lives. The kernels then index without
//! further checks, which keeps contiguous loops at memory speed.
//!
//! **Whole vectors.** The compiler never vectorises atomics, so a contiguous `fill` and
//! an `f32` `sum` — the two kernels a producer and a consumer of fresh tensors run on
//! every tensor — move 16 bytes per instruction through inline assembly instead
//! (`lanes`, x86-64 only; an `f64` sum gains little over the element loop's eight
//! accumulators). Each such access is one `MOVAPS` or `MOVDQA` of 16 aligned bytes (the ends are done element by element), which a processor with AVX
//! carries out atomically (Intel SDM vol. 3A §9.1.1, "Guaranteed Atomic Operations";
//! AMD APM vol. 2 §7.3.2, "Access Atomicity"): every element in it is read or written
//! whole, exactly as the relaxed atomic of its width would be, so the assembly does
//! nothing the atomic loop does not. The only other memory instruction is a
//! `PREFETCHT0` a few lines ahead of a sum, inside the run it sums: a hint that reads
//! nothing the program sees and never faults. Without AVX, under Miri, or on
//! another architecture the element loop runs.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU8, AtomicU16, AtomicU32, AtomicU64, Ordering::Relaxed};

use super::dtype::{DType, Element};
use super::layout::Layout;
use super::storage::StorageRead;
use crate::error::{Error, Result};

/// The elements of one tensor, checked to lie inside a read-locked storage.
pub(crate) struct Region<'a, T> {
    base: *mut u8,
    layout: &'a Layout,
    numel: usize,
    contiguous: bool,
    _borrow: PhantomData<(&'a StorageRead<'a>, T)>,
}

impl<'a, T: Element> Region<'a, T> {
    /// Checks `layout` against the storage behind `read` for elements of type `T`.
    pub(crate) fn new(read: &'a StorageRead<'_>, layout: &'a Layout) -> Result<Self> {
        if !read.is_host() {
            return Err(Error::Tensor(
                "this operation runs on the CPU and the tensor is in CUDA memory: copy it with \
                 .to(Device::Cpu) first"
                    .into(),
            ));
        }
        let size = std::mem::size_of::<T>();
        layout.check_bounds(size, read.len())?;
        if (read.ptr() as usize) % std::mem::align_of::<T>() != 0 {
            return Err(Error::Tensor(format!(
                "storage at {:p} is not aligned for {}",
                read.ptr(),
                T::DTYPE
            )));
        }
        Ok(Region {
            base: read.ptr(),
            layout,
            numel: layout.numel(),
            contiguous: layout.is_contiguous(),
            _borrow: PhantomData,
        })
    }

    /// Reads element `index` (in elements from the storage start).
    ///
    /// # Safety
    ///
    /// `index` must be one the region's layout addresses.
    #[inline(always)]
    unsafe fn load(&self, index: usize) -> T {
        // SAFETY: the caller guarantees `index` is addressed by the layout, which `new`
        // checked to be in bounds and aligned; the guard keeps the memory alive.
        let p = unsafe { self.base.add(index * std::mem::size_of::<T>()) };
        // SAFETY: `p` is in bounds, aligned for T (hence for the atomic of T's width),
        // and only ever accessed atomically.
        let bits = unsafe {
            match std::mem::size_of::<T>() {
                1 => AtomicU8::from_ptr(p).load(Relaxed) as u64,
                2 => AtomicU16::from_ptr(p.cast()).load(Relaxed) as u64,
                4 => AtomicU32::from_ptr(p.cast()).load(Relaxed) as u64,
                _ => AtomicU64::from_ptr(p.cast()).load(Relaxed),
            }
        };
        T::from_bits(bits)
    }

    /// Writes element `index`.
    ///
    /// # Safety
    ///
    /// As for [`load`](Self::load).
    #[inline(always)]
    unsafe fn store(&self, index: usize, value: T) {
        let bits = value.to_bits();
        // SAFETY: as in `load`.
        let p = unsafe { self.base.add(index * std::mem::size_of::<T>()) };
        // SAFETY: as in `load`; the truncating casts keep exactly T's bytes.
        unsafe {
            match std::mem::size_of::<T>() {
                1 => AtomicU8::from_ptr(p).store(bits as u8, Relaxed),
                2 => AtomicU16::from_ptr(p.cast()).store(bits as u16, Relaxed),
                4 => AtomicU32::from_ptr(p.cast()).store(bits as u32, Relaxed),
                _ => AtomicU64::from_ptr(p.cast()).store(bits, Relaxed),
            }
        }
    }

    /// The shape.
    pub(crate) fn shape(&self) -> &[usize] {
        &self.layout.shape
    }
}

/// Calls `f` with the element index in each of `N` layouts of one shape, for every
/// position in row-major order. Index arithmetic wraps: a dimension of size 1 may have
/// any stride, and indices are only used when the position exists.
#[inline(always)]
fn walk<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    offsets: [usize; N],
    mut f: impl FnMut([usize; N]),
) {
    if shape.contains(&0) {
        return;
    }
    let Some(last) = shape.len().checked_sub(1) else {
        f(offsets);
        return;
    };
    let inner = shape[last];
    let inner_strides: [usize; N] = std::array::from_fn(|k| strides[k][last]);
    let mut index = vec![0usize; last];
    let mut base = offsets;
    loop {
        let mut pos = base;
        for _ in 0..inner {
            f(pos);
            for k in 0..N {
                pos[k] = pos[k].wrapping_add(inner_strides[k]);
            }
        }
        let mut d = last;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            for k in 0..N {
                base[k] = base[k].wrapping_add(strides[k][d]);
            }
            if index[d] < shape[d] {
                break;
            }
            for k in 0..N {
                base[k] = base[k].wrapping_sub(strides[k][d].wrapping_mul(shape[d]));
            }
            index[d] = 0;
        }
    }
}

/// Calls `f` with every element index of `r`, in row-major order.
#[inline(always)]
fn each_index<T: Element>(r: &Region<'_, T>, mut f: impl FnMut(usize)) {
    if r.contiguous {
        let start = r.layout.offset;
        for i in start..start + r.numel {
            f(i);
        }
    } else {
        walk(
            &r.layout.shape,
            [&r.layout.strides],
            [r.layout.offset],
            |[i]| f(i),
        );
    }
}

/// Calls `f` with the element indices of the same position in `a` and `b` (same shape).
#[inline(always)]
fn each_index_pair<T: Element, U: Element>(
    a: &Region<'_, T>,
    b: &Region<'_, U>,
    mut f: impl FnMut(usize, usize),
) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::Tensor(format!(
            "shapes {:?} and {:?} differ",
            a.shape(),
            b.shape()
        )));
    }
    if a.contiguous && b.contiguous {
        let (sa, sb) = (a.layout.offset, b.layout.offset);
        for i in 0..a.numel {
            f(sa + i, sb + i);
        }
    } else {
        walk(
            &a.layout.shape,
            [&a.layout.strides, &b.layout.strides],
            [a.layout.offset, b.layout.offset],
            |[i, j]| f(i, j),
        );
    }
    Ok(())
}

/// Sets every element to `value`.
pub(crate) fn fill<T: Element>(r: &Region<'_, T>, value: T) {
    if r.contiguous && lanes::available() {
        let size = std::mem::size_of::<T>();
        let (start, end) = (r.layout.offset, r.layout.offset + r.numel);
        let (head, body) = lanes::aligned_body(r.base, start, end, size);
        // SAFETY: indices in `start..end` are the contiguous layout's.
        (start..head).for_each(|i| unsafe { r.store(i, value) });
        let mut bits = value.to_bits();
        let mut width = size * 8;
        while width < 64 {
            bits |= bits << width;
            width *= 2;
        }
        // SAFETY: `aligned_body` gives the 16-byte aligned chunks that lie inside
        // `start..end`, which the layout addresses; the guard keeps them mapped.
        unsafe { lanes::fill(r.base.add(head * size), body, bits) };
        let tail = head + body * 16 / size;
        // SAFETY: as the head.
        (tail..end).for_each(|i| unsafe { r.store(i, value) });
        return;
    }
    // SAFETY: `each_index` yields only indices the layout addresses.
    each_index(r, |i| unsafe { r.store(i, value) });
}

/// Replaces every element `x` by `f(x)` (a load then a store: a racing writer's update
/// may be lost, as in Hogwild).
pub(crate) fn map<T: Element>(r: &Region<'_, T>, f: impl Fn(T) -> T) {
    // SAFETY: `each_index` yields only indices the layout addresses.
    each_index(r, |i| unsafe { r.store(i, f(r.load(i))) });
}

/// Replaces every element `x` of `dst` by `f(x, y)`, `y` the element of `src` at the
/// same position.
pub(crate) fn zip_map<T: Element, U: Element>(
    dst: &Region<'_, T>,
    src: &Region<'_, U>,
    f: impl Fn(T, U) -> T,
) -> Result<()> {
    // SAFETY: `each_index_pair` yields indices each layout addresses.
    each_index_pair(dst, src, |i, j| unsafe {
        dst.store(i, f(dst.load(i), src.load(j)))
    })
}

/// Sets every element of `dst` to `f(y)`, `y` the element of `src` at the same position.
pub(crate) fn convert<T: Element, U: Element>(
    dst: &Region<'_, T>,
    src: &Region<'_, U>,
    f: impl Fn(U) -> T,
) -> Result<()> {
    // SAFETY: `each_index_pair` yields indices each layout addresses.
    each_index_pair(dst, src, |i, j| unsafe { dst.store(i, f(src.load(j))) })
}

/// Copies the values `values` yields into the elements of `dst`, in row-major order;
/// an error unless it yields exactly as many as `dst` has.
pub(crate) fn write_iter<T: Element>(
    dst: &Region<'_, T>,
    values: impl ExactSizeIterator<Item = T>,
) -> Result<()> {
    if values.len() != dst.numel {
        return Err(Error::Tensor(format!(
            "{} values for a tensor of {} elements",
            values.len(),
            dst.numel
        )));
    }
    let mut it = values;
    each_index(dst, |i| {
        if let Some(v) = it.next() {
            // SAFETY: `each_index` yields only indices the layout addresses.
            unsafe { dst.store(i, v) }
        }
    });
    Ok(())
}

/// The elements of `r`, copied out in row-major order.
pub(crate) fn read_all<T: Element>(r: &Region<'_, T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(r.numel);
    let spare = out.spare_capacity_mut().as_mut_ptr();
    let mut n = 0;
    each_index(r, |i| {
        // SAFETY: `each_index` yields exactly `numel` indices the layout addresses, and
        // the vector has room for `numel` elements: `n < numel` here.
        unsafe { spare.add(n).write(std::mem::MaybeUninit::new(r.load(i))) };
        n += 1;
    });
    debug_assert_eq!(n, r.numel);
    // SAFETY: the first `n <= capacity` elements were written above.
    unsafe { out.set_len(n) };
    out
}

/// The bytes of a slice of elements (plain values without padding: every element type
/// is an integer, a float or a one-byte bool).
pub(crate) fn as_bytes<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: `values` is `size_of_val` readable bytes, initialised (no padding in any
    // element type); `u8` has alignment 1; the borrow keeps `values` alive.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), size_of_val(values)) }
}

/// Calls `f` on every element (row-major), stopping at the first `false`; returns
/// whether all returned `true`.
pub(crate) fn all_pairs<T: Element, U: Element>(
    a: &Region<'_, T>,
    b: &Region<'_, U>,
    mut f: impl FnMut(T, U) -> bool,
) -> Result<bool> {
    let mut all = true;
    each_index_pair(a, b, |i, j| {
        if all {
            // SAFETY: `each_index_pair` yields indices each layout addresses.
            let (x, y) = unsafe { (a.load(i), b.load(j)) };
            all = f(x, y);
        }
    })?;
    Ok(all)
}

/// The sum of all elements, accumulated in f64. Contiguous regions use eight
/// independent accumulators so the loop runs at memory speed rather than at the
/// latency of one floating-point add.
pub(crate) fn sum<T: Element>(r: &Region<'_, T>) -> f64 {
    if r.contiguous && T::DTYPE == DType::F32 && lanes::available() {
        let (start, end) = (r.layout.offset, r.layout.offset + r.numel);
        let (head, chunks) = lanes::aligned_body(r.base, start, end, 4);
        // Whole pairs of chunks (32 bytes, 8 elements); what is left joins the tail.
        let pairs = chunks / 2;
        let tail = head + pairs * 8;
        let mut total = 0.0;
        // SAFETY: indices in `start..end` are the contiguous layout's.
        (start..head).for_each(|i| total += unsafe { r.load(i) }.to_f64());
        // SAFETY: as in `fill`; the elements are `f32`s, as asked.
        total += unsafe { lanes::sum_f32(r.base.add(head * 4), pairs) };
        // SAFETY: as the head.
        (tail..end).for_each(|i| total += unsafe { r.load(i) }.to_f64());
        return total;
    }
    if r.contiguous {
        let start = r.layout.offset;
        let mut acc = [0f64; 8];
        let chunks = r.numel / 8;
        for c in 0..chunks {
            let i = start + c * 8;
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: `i + k < start + numel`, addressed by the contiguous layout.
                *a += unsafe { r.load(i + k) }.to_f64();
            }
        }
        for i in start + chunks * 8..start + r.numel {
            // SAFETY: `i < start + numel`, addressed by the contiguous layout.
            acc[0] += unsafe { r.load(i) }.to_f64();
        }
        acc.iter().sum()
    } else {
        let mut total = 0.0;
        // SAFETY: `each_index` yields only indices the layout addresses.
        each_index(r, |i| total += unsafe { r.load(i) }.to_f64());
        total
    }
}

/// Whole 16-byte vectors of elements (see the module docs): one aligned load or store
/// per instruction, which a processor with AVX carries out atomically.
mod lanes {
    /// Whether this processor's aligned 16-byte accesses are atomic (it has AVX). Never
    /// under Miri, which runs no assembly.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx")
    }

    #[cfg(any(not(target_arch = "x86_64"), miri))]
    pub(super) fn available() -> bool {
        false
    }

    /// Splits elements `start..end` (of `size` bytes, from `base`) into a head done
    /// element by element and whole 16-byte aligned chunks: returns the first element of
    /// the chunks and how many chunks (0 when the elements do not reach one).
    pub(super) fn aligned_body(
        base: *mut u8,
        start: usize,
        end: usize,
        size: usize,
    ) -> (usize, usize) {
        let at = base as usize + start * size;
        // Elements are aligned to their size (every element type's alignment is its
        // size), which divides 16: a whole number of them reaches the next 16-byte
        // boundary. Checked all the same: a misaligned chunk would fault.
        let head = start + (at.next_multiple_of(16) - at) / size;
        if head >= end || at % size != 0 {
            return (end, 0);
        }
        (head, (end - head) * size / 16)
    }

    /// Writes `bits` (the element pattern repeated over 8 bytes) to `chunks` 16-byte
    /// chunks from `at`.
    ///
    /// # Safety
    ///
    /// `at` is 16-byte aligned and `chunks * 16` bytes from it are mapped memory of
    /// elements the caller's region addresses; [`available`] said yes.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    pub(super) unsafe fn fill(at: *mut u8, chunks: usize, bits: u64) {
        // SAFETY: plain bits into a register type.
        let v: std::arch::x86_64::__m128i = unsafe { std::mem::transmute([bits, bits]) };
        for k in 0..chunks {
            // SAFETY: the caller's contract: chunk `k` is aligned, in bounds and mapped;
            // one aligned 16-byte store, atomic with AVX (see the module docs).
            unsafe {
                std::arch::asm!(
                    "movdqa xmmword ptr [{p}], {v}",
                    p = in(reg) at.add(k * 16),
                    v = in(xmm_reg) v,
                    options(nostack, preserves_flags),
                );
            }
        }
    }

    #[cfg(any(not(target_arch = "x86_64"), miri))]
    pub(super) unsafe fn fill(_: *mut u8, _: usize, _: u64) {
        unreachable!("no lanes on this architecture")
    }

    /// The sum, in `f64`, of the `f32`s in `pairs` pairs of 16-byte chunks from `at`.
    ///
    /// # Safety
    ///
    /// As [`fill`], for reading.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    pub(super) unsafe fn sum_f32(at: *const u8, pairs: usize) -> f64 {
        use std::arch::x86_64::__m128d;
        // Four independent pairs of sums, two chunks a step: the adds overlap instead of
        // waiting on one another.
        // SAFETY: plain bits into a register type.
        let mut acc: [__m128d; 4] = unsafe { std::mem::transmute([0f64; 8]) };
        for k in 0..pairs {
            // SAFETY: as in `fill`: two aligned 16-byte loads, each atomic with AVX; the
            // rest works on registers.
            unsafe {
                std::arch::asm!(
                    "prefetcht0 byte ptr [{ahead}]",
                    "movaps {t}, xmmword ptr [{p}]",
                    "movaps {u}, xmmword ptr [{p} + 16]",
                    "cvtps2pd {x}, {t}",
                    "movhlps {t}, {t}",
                    "cvtps2pd {t}, {t}",
                    "addpd {a0}, {x}",
                    "addpd {a1}, {t}",
                    "cvtps2pd {x}, {u}",
                    "movhlps {u}, {u}",
                    "cvtps2pd {u}, {u}",
                    "addpd {a2}, {x}",
                    "addpd {a3}, {u}",
                    p = in(reg) at.add(k * 32),
                    ahead = in(reg) at.add(ahead(k, pairs)),
                    t = out(xmm_reg) _,
                    u = out(xmm_reg) _,
                    x = out(xmm_reg) _,
                    a0 = inout(xmm_reg) acc[0],
                    a1 = inout(xmm_reg) acc[1],
                    a2 = inout(xmm_reg) acc[2],
                    a3 = inout(xmm_reg) acc[3],
                    options(nostack, preserves_flags, readonly),
                );
            }
        }
        // SAFETY: register bits back into plain values.
        let sums: [f64; 8] = unsafe { std::mem::transmute(acc) };
        sums.iter().sum()
    }

    /// Where the sum's step `k` (of 32 bytes) prefetches: 512 bytes ahead, but never
    /// past the last of its `pairs` steps. Past them lie other tensors' bytes — the
    /// next ones a producer writes into the same arena — and pulling their lines here
    /// would make that producer take them back.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    fn ahead(k: usize, pairs: usize) -> usize {
        (k * 32 + 512).min((pairs - 1) * 32)
    }

    #[cfg(any(not(target_arch = "x86_64"), miri))]
    pub(super) unsafe fn sum_f32(_: *const u8, _: usize) -> f64 {
        unreachable!("no lanes on this architecture")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
        let mut out = Vec::new();
        walk(shape, [strides], [offset], |[i]| out.push(i));
        out
    }

    #[test]
    fn walk_visits_row_major() {
        assert_eq!(positions(&[2, 3], &[3, 1], 0), [0, 1, 2, 3, 4, 5]);
        assert_eq!(positions(&[3, 2], &[1, 3], 1), [1, 4, 2, 5, 3, 6]);
        assert_eq!(positions(&[], &[], 7), [7]);
        assert_eq!(positions(&[2, 0], &[1, 1], 0), [0usize; 0]);
        assert_eq!(positions(&[1, 2], &[usize::MAX, 1], 0), [0, 1]);
        assert_eq!(
            positions(&[2, 2, 2], &[4, 1, 2], 0),
            [0, 2, 1, 3, 4, 6, 5, 7]
        );
    }
}
