//! Interop with [`ndarray`] (feature `ndarray`): copies in and out in one pass, and
//! zero-copy views.
//!
//! # Safety
//!
//! A view is an `ndarray` borrow of tensor memory, which other threads and processes
//! may write at any time, so the general form ([`Tensor::as_array_view`]) is `unsafe`
//! with a stated contract. Two things are checked here rather than left to the caller:
//!
//! - The bytes never move while a view lives. A private storage's bytes move when it is
//!   shared (`share_memory_` copies them into a segment and frees the heap buffer), so
//!   the `&self` views refuse a private storage, and the safe `&mut self` views hold the
//!   only handle on it (nothing else can share it while the view borrows the tensor).
//! - The layout is in bounds and aligned for `T` (the same check the kernels make), and
//!   a mutable view addresses no element twice.
//!
//! The safe views are sound without a contract: a private storage whose only handle is
//! borrowed mutably cannot be reached by any other thread or process, and a read-only
//! file's pages are never written by this library (see `shm::file` for the file itself).

use std::ptr::NonNull;

use ndarray::{
    ArrayBase, ArrayD, ArrayViewD, ArrayViewMutD, Data, Dimension, IxDyn, ShapeBuilder, StrideShape,
};

use super::raw::Region;
use super::{Element, Tensor};
use crate::error::{Error, Result};

impl Tensor {
    /// A private tensor holding a copy of `array` (any dimension, any strides: the
    /// elements are taken in logical row-major order), in one copy — a `memcpy` when the
    /// array is in standard layout.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let a = ndarray::array![[1.0f32, 2.0], [3.0, 4.0]];
    /// let t = Tensor::from_ndarray(&a.t())?; // a transposed view: strides honoured
    /// assert_eq!(t.to_vec::<f32>()?, [1.0, 3.0, 2.0, 4.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the tensor cannot be allocated.
    pub fn from_ndarray<A, S, D>(array: &ArrayBase<S, D>) -> Result<Tensor>
    where
        A: Element,
        S: Data<Elem = A>,
        D: Dimension,
    {
        Tensor::from_ndarray_with(array, false)
    }

    /// [`from_ndarray`](Self::from_ndarray) straight into shared memory (with the current
    /// sharing strategy): one copy, ready to send, with no private buffer in between.
    ///
    /// # Errors
    ///
    /// As [`zeros_shared`](Self::zeros_shared).
    pub fn from_ndarray_shared<A, S, D>(array: &ArrayBase<S, D>) -> Result<Tensor>
    where
        A: Element,
        S: Data<Elem = A>,
        D: Dimension,
    {
        Tensor::from_ndarray_with(array, true)
    }

    fn from_ndarray_with<A, S, D>(array: &ArrayBase<S, D>, shared: bool) -> Result<Tensor>
    where
        A: Element,
        S: Data<Elem = A>,
        D: Dimension,
    {
        match array.as_slice() {
            Some(slice) => Tensor::contiguous_copy_of(slice, array.shape(), shared),
            None => Tensor::contiguous_from_iter(array.iter().copied(), array.shape(), shared),
        }
    }

    /// The elements as an owned `ndarray` of this tensor's shape (one copy).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not this tensor's dtype.
    pub fn to_ndarray<T: Element>(&self) -> Result<ArrayD<T>> {
        let values = self.to_vec::<T>()?;
        ArrayD::from_shape_vec(IxDyn(self.shape()), values)
            .map_err(|e| Error::Tensor(format!("to_ndarray of shape {:?}: {e}", self.shape())))
    }

    /// Overwrites this tensor's elements with `array`'s (same shape; any strides on
    /// either side), in one copy, whether the tensor is shared or not: the way to write
    /// an ndarray result into parameters that workers hold.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::{DType, Tensor};
    /// let params = Tensor::zeros_shared(&[2, 2], DType::F64)?;
    /// params.copy_from_ndarray(&ndarray::Array2::<f64>::eye(2))?;
    /// assert_eq!(params.to_vec::<f64>()?, [1.0, 0.0, 0.0, 1.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the shapes or dtypes differ, or the tensor is read-only.
    pub fn copy_from_ndarray<A, S, D>(&self, array: &ArrayBase<S, D>) -> Result<()>
    where
        A: Element,
        S: Data<Elem = A>,
        D: Dimension,
    {
        if array.shape() != self.shape() {
            return Err(Error::Tensor(format!(
                "copy_from_ndarray: an array of shape {:?} into a tensor of shape {:?}",
                array.shape(),
                self.shape()
            )));
        }
        self.copy_from_iter("copy_from_ndarray", array.iter().copied())
    }

    /// A zero-copy `ndarray` view of the elements, when that is sound without a contract:
    /// the tensor is private to this process and this is the only handle on its storage
    /// (`&mut self` then keeps every other thread out and the bytes in place).
    ///
    /// A read-only tensor is refused too: it maps a file (a `safetensors` weight, or
    /// read-only storage received from a peer) that this process cannot write, but any
    /// process that can open the file can, and a borrow over memory that changes under
    /// it is undefined behaviour. Read it with [`to_ndarray`](Self::to_ndarray) (a
    /// copy), or through the `unsafe` [`as_array_view`](Self::as_array_view) when
    /// nothing writes the file while the view lives.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// assert_eq!(t.array_view::<f32>()?.sum(), 10.0);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not the dtype, or when the tensor is shared,
    /// read-only or has other handles (use [`to_ndarray`](Self::to_ndarray), or the
    /// `unsafe` [`as_array_view`](Self::as_array_view)).
    pub fn array_view<T: Element>(&mut self) -> Result<ArrayViewD<'_, T>> {
        let Some(base) = self.storage.unique_private_ptr() else {
            return Err(self.not_exclusive("array_view"));
        };
        let (shape, ptr) = self.view_parts::<T>(base, false)?;
        // SAFETY: `view_parts` checked bounds, alignment and strides; the bytes cannot
        // move or be written by anyone while `&mut self` is borrowed (the only handle on
        // a private storage).
        Ok(unsafe { ArrayViewD::from_shape_ptr(shape, ptr.as_ptr()) })
    }

    /// A zero-copy mutable `ndarray` view, when the tensor is private to this process
    /// and this is the only handle on its storage (so nothing else can read or write it
    /// while the view lives).
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::{DType, Tensor};
    /// let mut t = Tensor::zeros(&[3], DType::I64)?;
    /// t.array_view_mut::<i64>()?.fill(7);
    /// t.share_memory_()?; // now it can travel; views are over
    /// assert_eq!(t.to_vec::<i64>()?, [7, 7, 7]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not the dtype, the view would address an element
    /// twice, or the tensor is shared, read-only or has other handles (use
    /// [`copy_from_ndarray`](Self::copy_from_ndarray), or the `unsafe`
    /// [`as_array_view_mut`](Self::as_array_view_mut)).
    pub fn array_view_mut<T: Element>(&mut self) -> Result<ArrayViewMutD<'_, T>> {
        self.storage.check_writable("array_view_mut")?;
        let Some(base) = self.storage.unique_private_ptr() else {
            return Err(self.not_exclusive("array_view_mut"));
        };
        let (shape, ptr) = self.view_parts::<T>(base, true)?;
        // SAFETY: `view_parts` checked bounds, alignment and that no element is addressed
        // twice; this is the only handle on a private storage and it is borrowed mutably
        // for the view's lifetime, so nothing else reads, writes or moves the bytes.
        Ok(unsafe { ArrayViewMutD::from_shape_ptr(shape, ptr.as_ptr()) })
    }

    /// A zero-copy `ndarray` view of a shared (or read-only) tensor's elements.
    ///
    /// The bytes cannot move while the view lives (a shared storage never moves; a
    /// private one is refused, since sharing it later would move it), and bounds and
    /// alignment are checked.
    ///
    /// # Safety
    ///
    /// While the view lives, no other thread or process may write the elements it
    /// covers: an `ndarray` view is a Rust borrow, and a concurrent write to borrowed
    /// memory is undefined behaviour (even the relaxed atomics of this crate's in-place
    /// operations, and even from a worker process that holds the same tensor). Typical
    /// sound uses: reading weights that every worker only reads, or reading parameters
    /// after a [`Barrier`](crate::Barrier) or [`Event`](crate::Event) that orders all
    /// writers before the view and none after it.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not the dtype, or the tensor is private (share it
    /// first, or use the safe [`array_view`](Self::array_view)).
    pub unsafe fn as_array_view<T: Element>(&self) -> Result<ArrayViewD<'_, T>> {
        let base = self.stable_base("as_array_view")?;
        let (shape, ptr) = self.view_parts::<T>(base, false)?;
        // SAFETY: bounds, alignment and strides checked; the bytes stay mapped and in
        // place while `&self` keeps the storage alive; the caller promises no writes.
        Ok(unsafe { ArrayViewD::from_shape_ptr(shape, ptr.as_ptr()) })
    }

    /// A zero-copy mutable `ndarray` view of a shared tensor's elements.
    ///
    /// # Safety
    ///
    /// While the view lives, no other thread or process may read or write the elements
    /// it covers, and no other view of them may exist in this process (a mutable view is
    /// an exclusive Rust borrow). Hogwild-style concurrent updates therefore go through
    /// the in-place operations ([`add_`](Self::add_) …), not through this view.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not the dtype, the tensor is private or read-only,
    /// or the view would address an element twice (a stride of 0).
    pub unsafe fn as_array_view_mut<T: Element>(&self) -> Result<ArrayViewMutD<'_, T>> {
        self.storage.check_writable("as_array_view_mut")?;
        let base = self.stable_base("as_array_view_mut")?;
        let (shape, ptr) = self.view_parts::<T>(base, true)?;
        // SAFETY: bounds, alignment and non-overlap checked; the bytes stay mapped and in
        // place while `&self` keeps the storage alive; the caller promises exclusivity.
        Ok(unsafe { ArrayViewMutD::from_shape_ptr(shape, ptr.as_ptr()) })
    }

    /// The storage's base pointer when it cannot move (not private).
    fn stable_base(&self, op: &str) -> Result<*mut u8> {
        self.storage.stable_ptr().ok_or_else(|| {
            Error::Tensor(format!(
                "{op}: the tensor is private to this process, and its bytes move when it is \
                 shared, which would leave the view dangling; call share_memory_() first, or \
                 use the safe array_view()/array_view_mut() on the only handle"
            ))
        })
    }

    fn not_exclusive(&self, op: &str) -> Error {
        let why = if self.storage.is_read_only() {
            "the tensor maps a read-only file, which any process that can open the file may \
             write"
        } else if self.storage.is_shared() {
            "the tensor is shared, so another process may write it"
        } else {
            "other handles (clones) of its storage exist, so another thread may write it"
        };
        Error::Tensor(format!(
            "{op}: {why}; copy with to_ndarray() or copy_from_ndarray(), or use the unsafe \
             as_array_view()/as_array_view_mut() and uphold their contract"
        ))
    }

    /// The view's shape and strides, and the first element's address, for elements of
    /// type `T` at `base` (the storage's first byte): checks the dtype, bounds and
    /// alignment, and, for a mutable view, that no element is addressed twice.
    fn view_parts<T: Element>(
        &self,
        base: *mut u8,
        mutable: bool,
    ) -> Result<(StrideShape<IxDyn>, NonNull<T>)> {
        if T::DTYPE != self.dtype {
            return Err(Error::Tensor(format!(
                "an ndarray view of {} elements on a tensor of dtype {}",
                T::DTYPE,
                self.dtype
            )));
        }
        // The kernels' own check: every element in bounds and aligned for T.
        let read = self.storage.read();
        Region::<T>::new(&read, &self.layout)?;
        drop(read);
        let shape = self.shape().to_vec();
        // ndarray's own precondition: the sizes other than 0 multiply to at most
        // isize::MAX (an empty tensor's other sizes may not: [0, 2^33, 2^33]).
        let nonzero = shape
            .iter()
            .filter(|&&n| n != 0)
            .try_fold(1usize, |acc, &n| acc.checked_mul(n));
        if nonzero.is_none_or(|n| n > isize::MAX as usize) {
            return Err(Error::Tensor(format!(
                "an ndarray view of shape {shape:?}: ndarray cannot hold sizes whose \
                 product passes isize::MAX, even in an empty array"
            )));
        }
        if self.numel() == 0 {
            let strides = vec![0; shape.len()];
            return Ok((IxDyn(&shape).strides(IxDyn(&strides)), NonNull::dangling()));
        }
        // A dimension of size 1 may carry any stride (views keep what they had);
        // ndarray wants one it can use, and 0 addresses the same element.
        let strides: Vec<usize> = shape
            .iter()
            .zip(self.strides())
            .map(|(&n, &s)| if n == 1 { 0 } else { s })
            .collect();
        if mutable && overlaps(&shape, &strides) {
            return Err(Error::Tensor(format!(
                "a mutable view of shape {shape:?} and strides {:?} would address an element \
                 twice",
                self.strides()
            )));
        }
        let first = base.wrapping_add(self.layout.offset * std::mem::size_of::<T>());
        let first = NonNull::new(first.cast::<T>())
            .ok_or_else(|| Error::Tensor("a tensor at address 0".into()))?;
        Ok((IxDyn(&shape).strides(IxDyn(&strides)), first))
    }
}

/// Whether two positions of a layout can address the same element (sufficient test:
/// sorted by stride, each dimension must step past everything the smaller ones reach).
fn overlaps(shape: &[usize], strides: &[usize]) -> bool {
    let mut dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n > 1)
        .map(|(&n, &s)| (s, n))
        .collect();
    dims.sort_unstable();
    let mut reach = 0usize; // the largest index offset the smaller dimensions reach
    for (stride, n) in dims {
        if stride <= reach {
            return true;
        }
        reach = reach.saturating_add(stride.saturating_mul(n - 1));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::overlaps;

    #[test]
    fn overlap_test_accepts_disjoint_layouts_and_refuses_aliasing_ones() {
        assert!(!overlaps(&[2, 3], &[3, 1]));
        assert!(!overlaps(&[3, 2], &[1, 3]));
        assert!(!overlaps(&[2, 2], &[10, 1]));
        assert!(overlaps(&[3], &[0]));
        assert!(overlaps(&[2, 3], &[2, 1]));
        assert!(!overlaps(&[1, 4], &[0, 1]));
    }
}
