//! In-place operations: `fill_`, `copy_`, `add_`, `mul_` and their scalar forms. Each
//! checks that the storage is writable before it touches a byte, and writes with relaxed
//! atomics (see the module docs of `tensor`).

use super::dtype::dispatch;
use super::dtype::sealed::Sealed;
use super::raw::{self, Region};
use super::storage::Storage;
use super::{Tensor, read_two, scalar};
use crate::error::{Error, Result};

impl Tensor {
    /// Sets every element to `value`.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `value` is not representable in the dtype.
    pub fn fill_(&self, value: f64) -> Result<()> {
        self.storage.check_writable("fill_")?;
        dispatch!(self.dtype, T => {
            let v: T = scalar(value)?;
            let read = self.storage.read();
            raw::fill(&Region::<T>::new(&read, &self.layout)?, v);
            Ok(())
        })
    }

    /// Copies `src`'s elements into this tensor (same shape; dtypes may differ and are
    /// converted as by [`to_dtype`](Self::to_dtype)). Either may be a CUDA tensor; a
    /// CUDA destination must be contiguous.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when this tensor is read-only (a file's pages, a foreign
    /// buffer), the shapes differ, or a CUDA destination is not contiguous; a CUDA
    /// error when either side is CUDA memory and the copy fails.
    pub fn copy_(&self, src: &Tensor) -> Result<()> {
        self.storage.check_writable("copy_")?;
        self.check_same_shape(src, "copy_")?;
        if self.device() != crate::cuda::Device::Cpu || src.device() != crate::cuda::Device::Cpu {
            return self.copy_across_devices_(src);
        }
        if let Some(snapshot) = self.snapshot_if_aliased(src)? {
            return self.copy_(&snapshot);
        }
        let (dst_read, src_read) = read_two(&self.storage, &src.storage);
        if self.dtype == src.dtype {
            dispatch!(self.dtype, T => raw::convert(
                &Region::<T>::new(&dst_read, &self.layout)?,
                &Region::<T>::new(&src_read, &src.layout)?,
                |x| x,
            ))
        } else {
            dispatch!(self.dtype, T => dispatch!(src.dtype, U => raw::convert(
                &Region::<T>::new(&dst_read, &self.layout)?,
                &Region::<U>::new(&src_read, &src.layout)?,
                |x: U| T::from_f64_lossy(x.to_f64()),
            )))
        }
    }

    /// `self += alpha * other`, element-wise (same shape and dtype).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] on a shape or dtype mismatch, or an `alpha` the dtype cannot
    /// represent.
    pub fn add_(&self, other: &Tensor, alpha: f64) -> Result<()> {
        self.binary_(other, BinaryOp::Add { alpha })
    }

    /// `self *= other`, element-wise (same shape and dtype).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] on a shape or dtype mismatch.
    pub fn mul_(&self, other: &Tensor) -> Result<()> {
        self.binary_(other, BinaryOp::Mul)
    }

    /// `self += value`.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `value` is not representable in the dtype.
    pub fn add_scalar_(&self, value: f64) -> Result<()> {
        self.storage.check_writable("add_scalar_")?;
        dispatch!(self.dtype, T => {
            let v: T = scalar(value)?;
            let read = self.storage.read();
            raw::map(&Region::<T>::new(&read, &self.layout)?, |x| x.add(v));
            Ok(())
        })
    }

    /// `self *= value`.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `value` is not representable in the dtype.
    pub fn mul_scalar_(&self, value: f64) -> Result<()> {
        self.storage.check_writable("mul_scalar_")?;
        dispatch!(self.dtype, T => {
            let v: T = scalar(value)?;
            let read = self.storage.read();
            raw::map(&Region::<T>::new(&read, &self.layout)?, |x| x.mul(v));
            Ok(())
        })
    }

    fn binary_(&self, other: &Tensor, op: BinaryOp) -> Result<()> {
        let name = match op {
            BinaryOp::Add { .. } => "add_",
            BinaryOp::Mul => "mul_",
        };
        self.storage.check_writable(name)?;
        self.check_same_shape(other, name)?;
        if self.dtype != other.dtype {
            return Err(Error::Tensor(format!(
                "{name}: dtypes {} and {} differ; convert one with to_dtype()",
                self.dtype, other.dtype
            )));
        }
        if let Some(snapshot) = self.snapshot_if_aliased(other)? {
            return self.binary_(&snapshot, op);
        }
        let (dst_read, src_read) = read_two(&self.storage, &other.storage);
        dispatch!(self.dtype, T => {
            let dst = Region::<T>::new(&dst_read, &self.layout)?;
            let src = Region::<T>::new(&src_read, &other.layout)?;
            match op {
                BinaryOp::Add { alpha: 1.0 } => raw::zip_map(&dst, &src, |a, b| a.add(b)),
                BinaryOp::Add { alpha } => {
                    let alpha: T = scalar(alpha)?;
                    raw::zip_map(&dst, &src, |a, b| a.add(alpha.mul(b)))
                }
                BinaryOp::Mul => raw::zip_map(&dst, &src, |a, b| a.mul(b)),
            }
        })
    }

    fn check_same_shape(&self, other: &Tensor, op: &str) -> Result<()> {
        if self.shape() != other.shape() {
            return Err(Error::Tensor(format!(
                "{op}: shapes {:?} and {:?} differ (only same-shape operands are supported)",
                self.shape(),
                other.shape()
            )));
        }
        Ok(())
    }

    /// A private copy of `src` when its bytes may overlap this tensor's (the same
    /// storage, or two storages over the same shared memory): reading and writing the
    /// same bytes in one pass would give order-dependent results (and the same storage
    /// would be locked twice).
    fn snapshot_if_aliased(&self, src: &Tensor) -> Result<Option<Tensor>> {
        let overlap = |a: &Storage, b: &Storage| {
            let (pa, pb) = (a.data_ptr() as usize, b.data_ptr() as usize);
            pa < pb.wrapping_add(b.nbytes()) && pb < pa.wrapping_add(a.nbytes())
        };
        if Storage::ptr_eq(&self.storage, &src.storage) || overlap(&self.storage, &src.storage) {
            let copy = Tensor::zeros(src.shape(), src.dtype)?;
            let (dst_read, src_read) = (copy.storage.read(), src.storage.read());
            dispatch!(src.dtype, T => raw::convert(
                &Region::<T>::new(&dst_read, &copy.layout)?,
                &Region::<T>::new(&src_read, &src.layout)?,
                |x| x,
            ))?;
            drop((dst_read, src_read));
            Ok(Some(copy))
        } else {
            Ok(None)
        }
    }
}

#[derive(Clone, Copy)]
enum BinaryOp {
    Add { alpha: f64 },
    Mul,
}
