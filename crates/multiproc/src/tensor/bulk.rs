//! The bulk kernels of the collectives: a contiguous tensor's bytes as a checked view
//! ([`HostBytes`]), elementwise reductions of several ranks' copies of a tensor (sum,
//! mean, max, min of f32, f64, i32, i64), and copies of claimed pieces into several
//! tensors. Their operands are [`SharedBytes`]: memory that other processes write (a
//! group's slots, peers' shared tensors), which is why they live here, beside `raw`,
//! and not with the collectives' protocol.
//!
//! # Safety
//!
//! Every operand is a [`SharedBytes`], checked to be mapped for its lifetime; a kernel
//! checks once per call (per piece, for claimed pieces) that every range it touches
//! lies inside its operand, is aligned for the element type and, when written, is
//! writable, and then loops over raw pointers without further checks, which keeps the
//! loops at memory speed. The memory is never viewed as `&[T]`: elements are read and
//! written through raw pointers, and the only slices are this process's own buffers.
//!
//! What the kernels rely on beyond bounds is the collectives' protocol (see
//! `dist::arena` and `dist::zero_copy`): while a kernel runs, no one else writes the
//! ranges it reads, and no one else reads or writes the ranges it writes. A process
//! that breaks the protocol can make values wrong; it cannot make this process touch
//! memory outside the checked ranges. Every element type here is an integer or a float,
//! for which every bit pattern is a value.

use std::ops::Range;

use super::dtype::DType;
use super::storage::StorageRead;
use super::{Storage, Tensor};
use crate::cuda::Device;
use crate::error::{Error, Result};
use crate::sys::shared_bytes::SharedBytes;

/// The bytes of a contiguous host tensor, or of a range of a host storage, with the
/// storage's read guard held so they stay mapped.
pub(crate) struct HostBytes<'a> {
    _guard: StorageRead<'a>,
    ptr: *mut u8,
    len: usize,
    writable: bool,
}

impl<'a> HostBytes<'a> {
    /// The bytes of `t` (contiguous, on the host); writable when `t`'s storage is.
    pub(crate) fn of_tensor(t: &'a Tensor, what: &str) -> Result<Self> {
        if !t.is_contiguous() {
            return Err(Error::Tensor(format!(
                "{what} needs a contiguous tensor (shape {:?}, strides {:?}): call \
                 .contiguous() first",
                t.shape(),
                t.strides()
            )));
        }
        let size = t.dtype().size();
        Self::of_storage(
            t.storage(),
            t.storage_offset() * size,
            t.numel() * size,
            what,
        )
    }

    /// Bytes `offset..offset + len` of `storage`, which must be host memory.
    pub(crate) fn of_storage(
        storage: &'a Storage,
        offset: usize,
        len: usize,
        what: &str,
    ) -> Result<Self> {
        if storage.device() != Device::Cpu {
            return Err(Error::Tensor(format!(
                "{what} moves host tensors through shared memory, not one on {}: copy it to \
                 the CPU first",
                storage.device()
            )));
        }
        // Asked before the guard is taken: the backing's lock is not re-entrant.
        let writable = !storage.is_read_only();
        let guard = storage.read();
        if !guard.is_host() || offset.checked_add(len).is_none_or(|end| end > guard.len()) {
            return Err(Error::Tensor(format!(
                "{what}: the tensor's {len} bytes at offset {offset} overrun its {}-byte \
                 storage",
                guard.len()
            )));
        }
        let ptr = guard.ptr().wrapping_add(offset);
        Ok(HostBytes {
            _guard: guard,
            ptr,
            len,
            writable,
        })
    }

    /// The bytes, as the kernels take them.
    pub(crate) fn bytes(&self) -> SharedBytes<'_> {
        // SAFETY: `ptr..ptr + len` lies inside the storage (checked in `of_storage`),
        // which the read guard keeps mapped while `self`, and so the result, lives;
        // writable unless the storage is read-only; no reference into it is made.
        unsafe { SharedBytes::from_raw(self.ptr, self.len, self.writable) }
    }
}

/// The elementwise operation of a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Combine {
    /// The sum (integers wrap).
    Sum,
    /// The sum divided by the number of operands (integers: truncating division).
    Mean,
    /// The largest.
    Max,
    /// The smallest.
    Min,
}

/// Whether the kernels reduce `dtype`.
pub(crate) fn reduces(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::I32 | DType::I64)
}

/// An element type the kernels reduce.
trait Reducible: Copy + Default + PartialOrd {
    fn add(self, other: Self) -> Self;
    fn div_count(self, count: usize) -> Self;
}

macro_rules! reducible {
    ($($t:ty: $add:expr, $div:expr;)*) => {$(
        impl Reducible for $t {
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                $add(self, other)
            }
            #[inline(always)]
            fn div_count(self, count: usize) -> Self {
                $div(self, count)
            }
        }
    )*};
}

reducible! {
    f32: |a: f32, b| a + b, |x: f32, p: usize| x / p as f32;
    f64: |a: f64, b| a + b, |x: f64, p: usize| x / p as f64;
    i32: i32::wrapping_add, |x: i32, p: usize| x.wrapping_div(p as i32);
    i64: i64::wrapping_add, |x: i64, p: usize| x.wrapping_div(p as i64);
}

/// Binds `$op` (and `$finish`, the optional last step) to a monomorphic function for
/// `$combine` on `$ty` and evaluates `$body`: one loop per op, so each inlines and
/// vectorises.
macro_rules! with_op {
    ($ty:ty, $combine:expr, $count:expr, |$op:ident, $finish:ident| $body:expr) => {{
        let count = $count;
        let none: Option<fn($ty) -> $ty> = None;
        match $combine {
            Combine::Sum => {
                let ($op, $finish) = (<$ty as Reducible>::add, none);
                $body
            }
            Combine::Mean => {
                let $op = <$ty as Reducible>::add;
                let $finish = Some(move |x: $ty| x.div_count(count));
                $body
            }
            Combine::Max => {
                let ($op, $finish) = (|a: $ty, b: $ty| if b > a { b } else { a }, none);
                $body
            }
            Combine::Min => {
                let ($op, $finish) = (|a: $ty, b: $ty| if b < a { b } else { a }, none);
                $body
            }
        }
    }};
}

/// [`with_op!`] with `$t` the element type of `$dtype`; returns an error for a dtype
/// the kernels do not reduce.
macro_rules! by_dtype_and_op {
    ($dtype:expr, $combine:expr, $count:expr, |$t:ident, $op:ident, $finish:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                with_op!(f32, $combine, $count, |$op, $finish| $body)
            }
            DType::F64 => {
                type $t = f64;
                with_op!(f64, $combine, $count, |$op, $finish| $body)
            }
            DType::I32 => {
                type $t = i32;
                with_op!(i32, $combine, $count, |$op, $finish| $body)
            }
            DType::I64 => {
                type $t = i64;
                with_op!(i64, $combine, $count, |$op, $finish| $body)
            }
            other => Err(Error::Tensor(format!(
                "collectives reduce f32, f64, i32 and i64 tensors, not {other}"
            ))),
        }
    };
}

/// Checks that elements `elements` of `T` lie inside `b` and are aligned (and, when
/// `write`, that `b` is writable): the one check before a kernel's loop.
fn check_elements<T>(b: &SharedBytes<'_>, elements: &Range<usize>, write: bool) -> Result<()> {
    let size = size_of::<T>();
    let fits = elements.start <= elements.end
        && elements
            .end
            .checked_mul(size)
            .is_some_and(|end| end <= b.len());
    if !fits || (b.as_ptr() as usize) % align_of::<T>() != 0 || (write && !b.is_writable()) {
        return Err(Error::InvalidArgument(format!(
            "internal error: elements {elements:?} of {size} bytes do not lie, aligned{}, in \
             a {}-byte range at {:p}",
            if write { " and writable" } else { "" },
            b.len(),
            b.as_ptr()
        )));
    }
    Ok(())
}

/// Reduces elements `elements` (of `dtype`) of every range of `sources` with
/// `combine` (a mean divides by `sources.len()`) into the same elements of `result`.
///
/// The caller (the arena's protocol) keeps the ranges free of other writers, and
/// `result` of other readers, while this runs.
pub(crate) fn reduce(
    dtype: DType,
    combine: Combine,
    sources: &[SharedBytes<'_>],
    result: SharedBytes<'_>,
    elements: Range<usize>,
) -> Result<()> {
    by_dtype_and_op!(dtype, combine, sources.len(), |T, op, finish| {
        reduce_typed::<T>(sources, result, elements, op, finish)
    })
}

fn reduce_typed<T: Reducible>(
    sources: &[SharedBytes<'_>],
    result: SharedBytes<'_>,
    elements: Range<usize>,
    op: impl Fn(T, T) -> T,
    finish: Option<impl Fn(T) -> T>,
) -> Result<()> {
    check_elements::<T>(&result, &elements, true)?;
    for s in sources {
        check_elements::<T>(s, &elements, false)?;
    }
    let Range { start, end } = elements;
    let n = end - start;
    let at = |b: &SharedBytes<'_>| b.as_ptr().cast::<T>().wrapping_add(start);
    let out = at(&result);
    // SAFETY: every pointer below addresses elements `start..end` of its operand, which
    // are inside it and aligned (checked above); no one else writes the sources or
    // touches the result now (the caller's protocol), and nothing here is a reference.
    unsafe {
        match sources {
            [] => {}
            [only] => std::ptr::copy(at(only), out, n),
            [a, b, rest @ ..] => {
                // The first two in one pass: one write of the result, not two.
                let (a, b) = (at(a), at(b));
                for i in 0..n {
                    out.add(i).write(op(a.add(i).read(), b.add(i).read()));
                }
                for s in rest {
                    let s = at(s);
                    for i in 0..n {
                        out.add(i).write(op(out.add(i).read(), s.add(i).read()));
                    }
                }
            }
        }
        if let Some(finish) = finish {
            for i in 0..n {
                out.add(i).write(finish(out.add(i).read()));
            }
        }
    }
    Ok(())
}

/// Bytes of the buffer a claimed piece is reduced into: the sources' pieces and the
/// buffer stay in cache.
pub(crate) const PIECE_BYTES: usize = 64 << 10;

/// Reduces each piece that `claim` hands out (`(start, len)` in elements, `len` at
/// most [`PIECE_BYTES`] worth) of every tensor of `tensors` (of `dtype`) with
/// `combine` (a mean divides by `tensors.len()`), and writes the result into all of
/// them.
///
/// The caller (the zero-copy protocol) makes each claimed piece this rank's alone in
/// every tensor while this runs.
pub(crate) fn reduce_into_all(
    dtype: DType,
    combine: Combine,
    tensors: &[SharedBytes<'_>],
    claim: impl FnMut() -> Option<(usize, usize)>,
) -> Result<()> {
    by_dtype_and_op!(dtype, combine, tensors.len(), |T, op, finish| {
        reduce_into_all_typed::<T>(tensors, claim, op, finish)
    })
}

fn reduce_into_all_typed<T: Reducible>(
    tensors: &[SharedBytes<'_>],
    mut claim: impl FnMut() -> Option<(usize, usize)>,
    op: impl Fn(T, T) -> T,
    finish: Option<impl Fn(T) -> T>,
) -> Result<()> {
    let piece = (PIECE_BYTES / size_of::<T>()).max(1);
    let numel = tensors.iter().map(|t| t.len()).min().unwrap_or(0) / size_of::<T>();
    for t in tensors {
        check_elements::<T>(t, &(0..numel), true)?;
    }
    let mut buf = vec![T::default(); piece];
    while let Some((at, len)) = claim() {
        let elements = at..at.saturating_add(len.min(piece));
        if elements.end > numel {
            return Err(Error::InvalidArgument(format!(
                "internal error: a claimed piece {elements:?} past the tensors' {numel} elements"
            )));
        }
        let acc = &mut buf[..elements.len()];
        let src = |t: &SharedBytes<'_>| t.as_ptr().cast::<T>().cast_const().wrapping_add(at);
        // SAFETY: `at..at + acc.len()` lies inside every tensor, aligned (checked against
        // `numel` above); the piece is this rank's alone in every tensor now (the
        // caller's protocol); the sources are read through raw pointers and `acc` is
        // this process's own buffer; each tensor is writable (checked above).
        unsafe {
            match tensors {
                [] => {}
                [only] => {
                    let s = src(only);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = s.add(i).read();
                    }
                }
                [x, y, rest @ ..] => {
                    let (x, y) = (src(x), src(y));
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = op(x.add(i).read(), y.add(i).read());
                    }
                    for t in rest {
                        let s = src(t);
                        for (i, a) in acc.iter_mut().enumerate() {
                            *a = op(*a, s.add(i).read());
                        }
                    }
                }
            }
            if let Some(finish) = &finish {
                for a in acc.iter_mut() {
                    *a = finish(*a);
                }
            }
            for t in tensors {
                let dst = t.as_ptr().cast::<T>().add(at);
                std::ptr::copy_nonoverlapping(acc.as_ptr(), dst, acc.len());
            }
        }
    }
    Ok(())
}

/// Copies each piece that `claim` hands out (`(start, len)` in bytes) from tensor
/// `src` of `tensors` into the same bytes of the others.
///
/// The caller (the zero-copy protocol) makes each claimed piece this rank's alone in
/// every tensor while this runs.
pub(crate) fn copy_into_all(
    tensors: &[SharedBytes<'_>],
    src: usize,
    mut claim: impl FnMut() -> Option<(usize, usize)>,
) -> Result<()> {
    let Some(source) = tensors.get(src) else {
        return Err(Error::InvalidArgument(format!(
            "internal error: source tensor {src} of {}",
            tensors.len()
        )));
    };
    while let Some((at, len)) = claim() {
        let from = source.range(at, len)?;
        for (r, dst) in tensors.iter().enumerate() {
            if r != src {
                dst.range(at, len)?.copy_from(&from)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: &[f32]) -> Tensor {
        Tensor::from_slice(values, &[values.len()]).unwrap()
    }

    fn claims(total: usize, piece: usize) -> impl FnMut() -> Option<(usize, usize)> {
        let mut next = 0;
        move || {
            let at = next * piece;
            next += 1;
            (at < total).then(|| (at, piece.min(total - at)))
        }
    }

    #[test]
    fn reductions_combine_every_operand() {
        let ts = [
            tensor(&[1.0, 5.0, -2.0]),
            tensor(&[3.0, 1.0, 4.0]),
            tensor(&[2.0, 0.0, 1.0]),
        ];
        let views: Vec<HostBytes<'_>> = ts
            .iter()
            .map(|t| HostBytes::of_tensor(t, "test").unwrap())
            .collect();
        let bytes: Vec<SharedBytes<'_>> = views.iter().map(HostBytes::bytes).collect();
        let out = tensor(&[0.0; 3]);
        let o = HostBytes::of_tensor(&out, "test").unwrap();
        for (combine, want) in [
            (Combine::Sum, [6.0, 6.0, 3.0]),
            (Combine::Mean, [2.0, 2.0, 1.0]),
            (Combine::Max, [3.0, 5.0, 4.0]),
            (Combine::Min, [1.0, 0.0, -2.0]),
        ] {
            reduce(DType::F32, combine, &bytes, o.bytes(), 0..3).unwrap();
            assert_eq!(out.to_vec::<f32>().unwrap(), want, "{combine:?}");
        }
        assert!(reduce(DType::F32, Combine::Sum, &bytes, o.bytes(), 0..4).is_err());
        assert!(reduce(DType::U8, Combine::Sum, &bytes, o.bytes(), 0..3).is_err());
        drop(views);

        let ts = [
            tensor(&[1.0, 2.0, 3.0, 4.0, 5.0]),
            tensor(&[10.0, 20.0, 30.0, 40.0, 50.0]),
        ];
        let views: Vec<HostBytes<'_>> = ts
            .iter()
            .map(|t| HostBytes::of_tensor(t, "test").unwrap())
            .collect();
        let bytes: Vec<SharedBytes<'_>> = views.iter().map(HostBytes::bytes).collect();
        reduce_into_all(DType::F32, Combine::Sum, &bytes, claims(5, 2)).unwrap();
        // A piece past the end is refused, not written.
        let mut past = claims(6, 2);
        past();
        past();
        assert!(reduce_into_all(DType::F32, Combine::Sum, &bytes, past).is_err());
        drop(views);
        for t in &ts {
            assert_eq!(t.to_vec::<f32>().unwrap(), [11.0, 22.0, 33.0, 44.0, 55.0]);
        }
    }

    #[test]
    fn copies_reach_every_other_tensor() {
        let ts = [
            tensor(&[0.0; 4]),
            tensor(&[1.0, 2.0, 3.0, 4.0]),
            tensor(&[0.0; 4]),
        ];
        let views: Vec<HostBytes<'_>> = ts
            .iter()
            .map(|t| HostBytes::of_tensor(t, "test").unwrap())
            .collect();
        let bytes: Vec<SharedBytes<'_>> = views.iter().map(HostBytes::bytes).collect();
        copy_into_all(&bytes, 1, claims(16, 6)).unwrap();
        assert!(copy_into_all(&bytes, 3, claims(16, 6)).is_err());
        drop(views);
        for t in &ts {
            assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
        }
    }
}
