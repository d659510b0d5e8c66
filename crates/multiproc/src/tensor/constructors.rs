//! How tensors are made: zero-filled, filled, ranges, from host data, on an existing
//! storage, in shared memory from the start.

use super::Tensor;
use super::dtype::sealed::Sealed;
use super::dtype::{DType, Element, dispatch};
use super::layout::{Dims, Layout, numel_of};
use super::storage::Storage;
use crate::error::{Error, Result};

impl Tensor {
    /// A contiguous tensor of `shape` on a storage that `make` allocates with the
    /// byte size the shape needs.
    pub(super) fn contiguous_on(
        shape: &[usize],
        dtype: DType,
        make: impl FnOnce(usize) -> Result<Storage>,
    ) -> Result<Tensor> {
        let layout = Layout::contiguous(shape)?;
        let nbytes = numel_of(shape)?.checked_mul(dtype.size()).ok_or_else(|| {
            Error::Tensor(format!(
                "a {dtype} tensor of shape {shape:?} is larger than memory can hold"
            ))
        })?;
        Ok(Tensor {
            storage: make(nbytes)?,
            dtype,
            layout,
        })
    }

    /// A zero-filled tensor.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the shape is too large to allocate.
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::contiguous_on(shape, dtype, Storage::new)
    }

    /// A zero-filled tensor whose storage is in shared memory from the start (with the
    /// current sharing strategy), as `zeros` followed by
    /// [`share_memory_`](Self::share_memory_) but without the private buffer and the
    /// copy. Use it for tensors made to be sent: a producer that fills a new tensor and
    /// puts it on a queue writes its bytes once, where the receiver will read them.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::{DType, Tensor};
    /// let t = Tensor::zeros_shared(&[1024], DType::F32)?;
    /// assert!(t.is_shared());
    /// t.fill_(2.0)?;
    /// assert_eq!(t.sum()?, 2048.0);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the shape is too large; the errors of
    /// [`Storage::share_memory_`] when the segment cannot be made.
    pub fn zeros_shared(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::contiguous_on(shape, dtype, Storage::new_shared)
    }

    /// A tensor in shared memory whose contents are unspecified, like torch's `empty`
    /// after `share_memory_`: [`zeros_shared`](Self::zeros_shared) without zeroing the
    /// recycled shared memory it may get (which then holds values this process stored
    /// there before). For a tensor that will be overwritten whole — a producer that
    /// fills a new tensor and sends it writes each byte exactly once. Reading it before
    /// writing is defined (every bit pattern is a value of every dtype), only not
    /// meaningful.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::{DType, Tensor};
    /// let t = Tensor::empty_shared(&[1024], DType::F32)?;
    /// t.fill_(1.0)?;
    /// assert_eq!(t.sum()?, 1024.0);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`zeros_shared`](Self::zeros_shared).
    pub fn empty_shared(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Self::contiguous_on(shape, dtype, Storage::new_shared_uninit)
    }

    /// A tensor of ones.
    ///
    /// # Errors
    ///
    /// As [`full`](Self::full).
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype)
    }

    /// A tensor filled with `value`.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `value` is not representable in `dtype` (see the module
    /// docs) or the shape is too large.
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        let t = Tensor::zeros(shape, dtype)?;
        if value != 0.0 {
            t.fill_(value)?;
        }
        Ok(t)
    }

    /// The 1-D tensor `start, start + step, …` up to but excluding `end` (torch's
    /// `arange(start, end, step)`); values are rounded toward zero for integer dtypes.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `step` is zero or not finite, or the range is too long.
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::Tensor(format!(
                "arange({start}, {end}, {step}) needs finite bounds and a non-zero finite step"
            )));
        }
        let count = ((end - start) / step).ceil().max(0.0);
        if count > (isize::MAX as f64) / 8.0 {
            return Err(Error::Tensor(format!(
                "arange({start}, {end}, {step}) has {count} elements, more than memory can hold"
            )));
        }
        let n = count as usize;
        dispatch!(dtype, T => {
            let values: Vec<T> =
                (0..n).map(|i| T::from_f64_lossy(start + i as f64 * step)).collect();
            Tensor::from_vec(values, &[n])
        })
    }

    /// A tensor with the elements of `data`, in row-major order: one copy into the
    /// tensor's own storage (a storage is memory multiproc allocates so that it can be
    /// shared, never a `Vec`'s), after which `data` is dropped. The same as
    /// [`from_slice`](Self::from_slice)`(&data, shape)`; to make a shared tensor in one
    /// copy, use [`from_slice_shared`](Self::from_slice_shared).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `data.len()` is not the number of elements of `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice(&data, shape)
    }

    /// A tensor with a copy of `data` as its elements, in row-major order.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `data.len()` is not the number of elements of `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        let numel = numel_of(shape)?;
        if numel != data.len() {
            return Err(Error::Tensor(format!(
                "{} values cannot fill shape {shape:?} ({numel} elements)",
                data.len()
            )));
        }
        Tensor::contiguous_copy_of(data, shape, false)
    }

    /// A tensor over an existing storage (torch's `set_`): `dtype`, `shape`, `strides`
    /// and `offset` in elements.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `shape` and `strides` have different lengths or the layout
    /// reaches outside the storage.
    pub fn from_storage(
        storage: Storage,
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Tensor> {
        let layout = Layout {
            shape: Dims::from_slice(shape),
            strides: Dims::from_slice(strides),
            offset,
        };
        Tensor::from_storage_and_layout(storage, dtype, layout)
    }
}
