//! Views: tensors over the same storage with another layout (`view`, `reshape`,
//! `narrow`, `select`, `transpose`), and the copies that give a fresh layout
//! (`contiguous`, `deep_clone`, `to_dtype`).

use super::Tensor;
use super::dtype::DType;
use super::layout::{Dims, Layout, MAX_DIMS, numel_of};
use crate::error::{Error, Result};

impl Tensor {
    /// The same elements with another shape, without copying.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the number of elements differs, or the layout cannot be
    /// viewed that way (use [`reshape`](Self::reshape), which copies when needed).
    pub fn view(&self, shape: &[usize]) -> Result<Tensor> {
        self.check_same_numel(shape)?;
        let strides = self.layout.view_strides(shape).ok_or_else(|| {
            Error::Tensor(format!(
                "a tensor of shape {:?} and strides {:?} cannot be viewed as {shape:?} without a copy; \
                 use reshape()",
                self.shape(),
                self.strides()
            ))
        })?;
        self.with_layout(Layout {
            shape: Dims::from_slice(shape),
            strides,
            offset: self.layout.offset,
        })
    }

    /// The same elements with another shape: a view when possible, else a copy.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `shape` has more than 64 dimensions or another number of
    /// elements than the tensor; as [`contiguous`](Self::contiguous) when a copy is
    /// needed.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        self.check_same_numel(shape)?;
        match self.view(shape) {
            Ok(t) => Ok(t),
            Err(_) => self.contiguous()?.view(shape),
        }
    }

    fn check_same_numel(&self, shape: &[usize]) -> Result<()> {
        if shape.len() > MAX_DIMS {
            return Err(Error::Tensor(format!(
                "a tensor may have at most {MAX_DIMS} dimensions, not {}",
                shape.len()
            )));
        }
        let n = numel_of(shape)?;
        if n != self.numel() {
            return Err(Error::Tensor(format!(
                "shape {shape:?} has {n} elements but the tensor of shape {:?} has {}",
                self.shape(),
                self.numel()
            )));
        }
        Ok(())
    }

    fn check_dim(&self, dim: usize, op: &str) -> Result<()> {
        if dim >= self.dim() {
            return Err(Error::Tensor(format!(
                "{op}: dimension {dim} is out of range for a tensor of {} dimensions",
                self.dim()
            )));
        }
        Ok(())
    }

    /// The view of `length` elements starting at `start` along `dim`.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `dim` is not a dimension of the tensor or
    /// `start..start + length` runs past that dimension's size.
    pub fn narrow(&self, dim: usize, start: usize, length: usize) -> Result<Tensor> {
        self.check_dim(dim, "narrow")?;
        let size = self.layout.shape[dim];
        if start.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::Tensor(format!(
                "narrow: elements {start}..{start}+{length} are out of range for dimension {dim} of size {size}"
            )));
        }
        let mut layout = self.layout.clone();
        layout.shape[dim] = length;
        // An empty view keeps the offset, as no element of it is ever addressed: the
        // start may lie past the end of an empty tensor's storage (torch accepts
        // `narrow(0, 1, 1)` of a 2×0 tensor). A non-empty one lies inside this
        // tensor's elements, so the sum cannot overflow.
        if layout.numel() > 0 {
            layout.offset += start * layout.strides[dim];
        }
        self.with_layout(layout)
    }

    /// The view at `index` along `dim`, with that dimension removed.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `dim` is not a dimension of the tensor or `index` is not
    /// below that dimension's size.
    pub fn select(&self, dim: usize, index: usize) -> Result<Tensor> {
        self.check_dim(dim, "select")?;
        let size = self.layout.shape[dim];
        if index >= size {
            return Err(Error::Tensor(format!(
                "select: index {index} is out of range for dimension {dim} of size {size}"
            )));
        }
        let mut layout = self.layout.clone();
        let stride = layout.strides.remove(dim);
        layout.shape.remove(dim);
        // As in `narrow`: an empty view (another dimension is 0) keeps the offset.
        if layout.numel() > 0 {
            layout.offset += index * stride;
        }
        self.with_layout(layout)
    }

    /// The view with dimensions `dim0` and `dim1` swapped.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `dim0` or `dim1` is not a dimension of the tensor.
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<Tensor> {
        self.check_dim(dim0, "transpose")?;
        self.check_dim(dim1, "transpose")?;
        let mut layout = self.layout.clone();
        layout.shape.swap(dim0, dim1);
        layout.strides.swap(dim0, dim1);
        self.with_layout(layout)
    }

    /// This tensor if it is contiguous, else a contiguous copy.
    ///
    /// # Errors
    ///
    /// As [`deep_clone`](Self::deep_clone) when a copy is needed.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            Ok(self.clone())
        } else {
            self.deep_clone()
        }
    }

    /// A copy of the data in a new, private, contiguous storage (torch's `.clone()`).
    ///
    /// # Errors
    ///
    /// As [`to_dtype`](Self::to_dtype).
    pub fn deep_clone(&self) -> Result<Tensor> {
        self.to_dtype(self.dtype)
    }

    /// A copy converted to `dtype` (as Rust's `as` converts: floats to integers round
    /// toward zero and saturate; anything non-zero is `true`).
    ///
    /// # Errors
    ///
    /// An allocation error for the new storage (on a CUDA tensor's device, a CUDA
    /// error); as [`copy_`](Self::copy_).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        // On the tensor's own device (a CUDA tensor's copy stays on its GPU, as in torch).
        let out = Tensor::empty_on(self.shape(), dtype, self.device())?;
        out.copy_(self)?;
        Ok(out)
    }
}
