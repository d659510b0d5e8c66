//! Bulk copies into tensors: one `memcpy` (or one pass of relaxed atomic stores) from
//! a slice or an iterator, into a new tensor — private, or straight into shared memory —
//! or into an existing one, shared or not. The interop constructors (`from_ndarray`,
//! `from_candle`) are built on these.

use super::layout::numel_of;
use super::raw::{self, Region};
use super::{Element, Storage, Tensor};
use crate::error::{Error, Result};

/// The bytes of a slice of elements (for writers such as `safetensors::save`).
#[cfg_attr(not(feature = "safetensors"), allow(dead_code))]
pub(crate) fn element_bytes<T: Element>(values: &[T]) -> &[u8] {
    raw::as_bytes(values)
}

impl Tensor {
    /// [`from_slice`](Self::from_slice) straight into shared memory (with the current
    /// sharing strategy): one copy, where `from_slice` then
    /// [`share_memory_`](Self::share_memory_) makes two.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let t = Tensor::from_slice_shared(&[1u32, 2, 3, 4], &[2, 2])?;
    /// assert!(t.is_shared());
    /// assert_eq!(t.to_vec::<u32>()?, [1, 2, 3, 4]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`from_slice`](Self::from_slice) and [`zeros_shared`](Self::zeros_shared).
    pub fn from_slice_shared<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::contiguous_copy_of(data, shape, true)
    }

    /// A contiguous tensor of `shape` holding a copy of `data` (one memcpy), private or
    /// shared.
    pub(crate) fn contiguous_copy_of<T: Element>(
        data: &[T],
        shape: &[usize],
        shared: bool,
    ) -> Result<Tensor> {
        let numel = numel_of(shape)?;
        if numel != data.len() {
            return Err(Error::Tensor(format!(
                "{} values cannot fill shape {shape:?} ({numel} elements)",
                data.len()
            )));
        }
        Tensor::contiguous_on(shape, T::DTYPE, |_| {
            Storage::copy_of(raw::as_bytes(data), shared)
        })
    }

    /// A contiguous tensor of `shape` and `dtype`, private or shared, whose elements
    /// `values` yields in row-major order (one copy).
    #[cfg_attr(not(any(feature = "ndarray", feature = "candle")), allow(dead_code))]
    pub(crate) fn contiguous_from_iter<T: Element>(
        values: impl ExactSizeIterator<Item = T>,
        shape: &[usize],
        shared: bool,
    ) -> Result<Tensor> {
        let t = if shared {
            Tensor::empty_shared(shape, T::DTYPE)?
        } else {
            Tensor::zeros(shape, T::DTYPE)?
        };
        let read = t.storage.read();
        raw::write_iter(&Region::<T>::new(&read, &t.layout)?, values)?;
        drop(read);
        Ok(t)
    }

    /// Overwrites this tensor's elements (in row-major order, whatever its strides) with
    /// `data`, in one copy, shared or not: the way to write into a tensor that workers
    /// already hold.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::{DType, Tensor};
    /// let t = Tensor::zeros_shared(&[2, 2], DType::F32)?;
    /// t.copy_from_slice(&[1.0f32, 2.0, 3.0, 4.0])?;
    /// assert_eq!(t.transpose(0, 1)?.contiguous()?.to_vec::<f32>()?, [1.0, 3.0, 2.0, 4.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not the dtype, `data.len()` is not
    /// [`numel`](Self::numel), or the tensor is read-only.
    pub fn copy_from_slice<T: Element>(&self, data: &[T]) -> Result<()> {
        self.copy_from_iter("copy_from_slice", data.iter().copied())
    }

    /// [`copy_from_slice`](Self::copy_from_slice) from any exact-size source.
    pub(crate) fn copy_from_iter<T: Element>(
        &self,
        op: &str,
        values: impl ExactSizeIterator<Item = T>,
    ) -> Result<()> {
        self.storage.check_writable(op)?;
        if T::DTYPE != self.dtype {
            return Err(Error::Tensor(format!(
                "{op}: {} values into a tensor of dtype {}",
                T::DTYPE,
                self.dtype
            )));
        }
        if values.len() != self.numel() {
            return Err(Error::Tensor(format!(
                "{op}: {} values into a tensor of shape {:?} ({} elements)",
                values.len(),
                self.shape(),
                self.numel()
            )));
        }
        let read = self.storage.read();
        raw::write_iter(&Region::<T>::new(&read, &self.layout)?, values)
    }
}
