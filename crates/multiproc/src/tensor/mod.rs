//! Tensors: [`DType`], [`Element`], [`Storage`] and [`Tensor`] — n-dimensional views over
//! bytes that can move to shared memory and travel between processes by handle.
//!
//! What this module owns: the element types, the layout arithmetic of views (shape,
//! strides and offset, all in elements), and the few operations a multi-process
//! program needs (constructors, views, in-place `fill_`/`copy_`/`add_`/`mul_`, `sum`,
//! `allclose`). It is not a numerics library: for real math, cross into `ndarray` or
//! `candle` (features of the same names, `interop_*` below: one copy, or a zero-copy
//! view where that is sound) or use [`Tensor::to_vec`] / [`Tensor::copy_from_slice`].
//!
//! Invariants:
//!
//! - A tensor's layout never addresses a byte outside its storage. This is checked
//!   when a tensor is made (constructors, views, [`Tensor::from_storage`], decoding a
//!   received message), and every kernel re-checks it once, up front.
//! - Tensor memory is never exposed as `&[T]`/`&mut [T]` by a safe function unless no
//!   one else can write it (the `ndarray` feature's `array_view` on the only handle of a
//!   private tensor, or on a read-only file): other threads and processes may write it
//!   at any time.
//! - A read-only storage (a `safetensors` file's pages) is never written: every
//!   in-place operation calls `Storage::check_writable` before it touches a byte. Reads copy ([`Tensor::to_vec`]); element-wise operations
//!   use relaxed atomics, so concurrent Hogwild updates are defined behaviour (an update
//!   racing with another may be lost, never torn).
//! - `Clone` is a cheap handle copy sharing the storage (like `Arc`);
//!   [`Tensor::deep_clone`] copies the data (torch's `.clone()`).
//!
//! Scalars (`full`, `fill_`, `add_scalar_`, `mul_scalar_`, `alpha`) are `f64`. On an
//! integer or bool tensor a scalar must be representable exactly (integral and in range;
//! 0 or 1 for bool), otherwise the operation is an [`Error::Tensor`] — as torch refuses
//! `int_tensor.add_(1.5)`. `i64` values beyond 2^53 are not exact as scalars; integer
//! arithmetic itself is exact (wrapping), and bool `add_`/`mul_` are logical or/and.

pub(crate) mod copy_in;
mod device;
pub(crate) mod dtype;
#[cfg(feature = "candle")]
mod interop_candle;
#[cfg(feature = "dlpack")]
#[allow(unsafe_code)]
mod interop_dlpack;
#[cfg(feature = "ndarray")]
#[allow(unsafe_code)]
mod interop_ndarray;
mod layout;
#[allow(unsafe_code)]
mod raw;
#[allow(unsafe_code)]
mod storage;
#[cfg(test)]
mod tests;

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub(crate) use dtype::dispatch;
use dtype::sealed::Sealed;
pub use dtype::{DType, Element};
use layout::{Layout, MAX_DIMS, numel_of};
use raw::Region;
#[cfg(feature = "fuzzing")]
pub(crate) use storage::ForgedStorageWire;
pub use storage::Storage;
pub(crate) use storage::StorageRead;
pub(crate) use storage::WeakStorage;

use crate::{Error, Result, wire};

/// An n-dimensional array: a [`DType`], a shape, strides and an offset (in elements)
/// over a [`Storage`].
///
/// Cloning is cheap and shares the data; every method takes `&self` (in-place
/// operations write through the shared storage, as every torch tensor does). What holds
/// when other processes write the same memory — no `&[T]`, relaxed atomics, Hogwild —
/// and how scalars convert: [the crate docs](crate#the-rules-for-memory-other-processes-write).
///
/// ```
/// # fn main() -> multiproc::Result<()> {
/// use multiproc::{DType, Tensor};
/// let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
/// let col = t.select(1, 1)?; // a view: [1, 4]
/// col.add_scalar_(10.0)?;
/// assert_eq!(t.to_vec::<f32>()?, [0., 11., 2., 3., 14., 5.]);
/// assert_eq!(t.transpose(0, 1)?.contiguous()?.to_vec::<f32>()?, [0., 3., 11., 14., 2., 5.]);
/// assert_eq!(t.sum()?, 35.0);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Tensor {
    storage: Storage,
    dtype: DType,
    layout: Layout,
}

fn not_representable(value: f64, dtype: DType) -> Error {
    Error::Tensor(format!(
        "the scalar {value} cannot be represented as {dtype} without loss"
    ))
}

fn scalar<T: Element>(value: f64) -> Result<T> {
    T::from_f64_exact(value).ok_or_else(|| not_representable(value, T::DTYPE))
}

/// Read-locks two storages in a fixed order (by address), so two threads locking the
/// same pair in opposite roles cannot deadlock behind a waiting writer.
fn read_two<'a>(a: &'a Storage, b: &'a Storage) -> (StorageRead<'a>, StorageRead<'a>) {
    if a.addr() <= b.addr() {
        let ra = a.read();
        (ra, b.read())
    } else {
        let rb = b.read();
        (a.read(), rb)
    }
}

impl Tensor {
    // ----- construction -----

    /// A contiguous tensor of `shape` on a storage that `make` allocates with the
    /// byte size the shape needs.
    fn contiguous_on(
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

    /// A tensor that takes `data` as its elements, in row-major order.
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
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
        };
        layout.check_bounds(dtype.size(), storage.nbytes())?;
        Ok(Tensor {
            storage,
            dtype,
            layout,
        })
    }

    /// A new tensor on the same storage with another layout (checked).
    fn with_layout(&self, layout: Layout) -> Result<Tensor> {
        layout.check_bounds(self.dtype.size(), self.storage.nbytes())?;
        Ok(Tensor {
            storage: self.storage.clone(),
            dtype: self.dtype,
            layout,
        })
    }

    // ----- accessors -----

    /// The size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    /// The step, in elements, between neighbours along each dimension.
    pub fn strides(&self) -> &[usize] {
        &self.layout.strides
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of dimensions.
    pub fn dim(&self) -> usize {
        self.layout.shape.len()
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Where the first element is in the storage, in elements.
    pub fn storage_offset(&self) -> usize {
        self.layout.offset
    }

    /// Whether the elements are consecutive in row-major order.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The storage under this tensor.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The address of the first element: for identity checks (tensors in two processes
    /// or two views alias when their pointers say so) and FFI. It changes when
    /// [`share_memory_`](Self::share_memory_) moves the storage. Dereferencing it is
    /// `unsafe` and races with other threads and processes. For a CUDA tensor it is the
    /// device address (as torch's `data_ptr`), for the user's own kernels.
    pub fn data_ptr(&self) -> *mut u8 {
        self.storage
            .data_ptr()
            .wrapping_add(self.layout.offset.wrapping_mul(self.dtype.size()))
    }

    /// The elements, copied out in row-major order.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not this tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::Tensor(format!(
                "to_vec::<{}>() on a tensor of dtype {}; use to_dtype({:?}) first",
                T::DTYPE,
                self.dtype,
                T::DTYPE
            )));
        }
        let read = self.storage.read();
        Ok(raw::read_all(&Region::<T>::new(&read, &self.layout)?))
    }

    // ----- views -----

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
            shape: shape.to_vec(),
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
        if length > 0 {
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
        layout.offset += index * layout.strides[dim];
        layout.shape.remove(dim);
        layout.strides.remove(dim);
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

    // ----- in-place operations -----

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
        if self.device() != crate::Device::Cpu || src.device() != crate::Device::Cpu {
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

    // ----- reductions -----

    /// The sum of all elements, accumulated in `f64` whatever the dtype (bool counts
    /// `true`s; `i64`/`u64` values beyond 2^53 are rounded). torch returns a 0-d tensor; a
    /// plain `f64` is what Rust callers want.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the elements cannot be read (a storage not aligned for the
    /// dtype, e.g. a DLPack import at an odd address) — never a silent `NaN`.
    pub fn sum(&self) -> Result<f64> {
        let read = self.storage.read();
        dispatch!(self.dtype, T => Ok(raw::sum(&Region::<T>::new(&read, &self.layout)?)))
    }

    /// Whether every element satisfies `|self - other| <= atol + rtol * |other|`
    /// (torch's `allclose`, `equal_nan=False`; torch's defaults are `rtol = 1e-5`,
    /// `atol = 1e-8`). Compared as `f64`, so any two dtypes can be compared.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the shapes differ (torch raises too) or the elements cannot
    /// be read — never a silent `false`.
    pub fn allclose(&self, other: &Tensor, rtol: f64, atol: f64) -> Result<bool> {
        if self.shape() != other.shape() {
            return Err(Error::Tensor(format!(
                "allclose: shapes {:?} and {:?} differ",
                self.shape(),
                other.shape()
            )));
        }
        let close = |a: f64, b: f64| (a - b).abs() <= atol + rtol * b.abs();
        if self.dtype == other.dtype && !Storage::ptr_eq(&self.storage, &other.storage) {
            let (ra, rb) = read_two(&self.storage, &other.storage);
            dispatch!(self.dtype, T => {
                let (a, b) = (Region::<T>::new(&ra, &self.layout)?, Region::<T>::new(&rb, &other.layout)?);
                raw::all_pairs(&a, &b, |x, y| close(x.to_f64(), y.to_f64()))
            })
        } else {
            let (a, b) = (self.to_f64_vec()?, other.to_f64_vec()?);
            Ok(a.iter().zip(&b).all(|(&x, &y)| close(x, y)))
        }
    }

    /// The elements as `f64`, row-major.
    fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let read = self.storage.read();
        dispatch!(self.dtype, T => Ok(raw::read_all(&Region::<T>::new(&read, &self.layout)?)
            .into_iter()
            .map(Sealed::to_f64)
            .collect()))
    }

    // ----- sharing -----

    /// Moves the storage into shared memory (in place: every tensor and view on it
    /// follows), with the current sharing strategy. Does nothing if already shared.
    /// Sending a tensor through a multiproc channel does this implicitly.
    ///
    /// # Errors
    ///
    /// As [`Storage::share_memory_`]; the tensor stays usable (private) after an error.
    pub fn share_memory_(&self) -> Result<()> {
        self.storage.share_memory_()
    }

    /// Whether the storage is in shared memory (a read-only file's pages count: they
    /// travel by handle too).
    pub fn is_shared(&self) -> bool {
        self.storage.is_shared()
    }

    /// Whether the tensor can only be read (see [`Storage::is_read_only`]): loaded with
    /// `multiproc::safetensors::load`, or a read-only DLPack import. Every in-place
    /// operation on it is an [`Error::Tensor`] naming it.
    pub fn is_read_only(&self) -> bool {
        self.storage.is_read_only()
    }
}

#[derive(Clone, Copy)]
enum BinaryOp {
    Add { alpha: f64 },
    Mul,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        let mut d = f.debug_struct("Tensor");
        d.field("dtype", &self.dtype)
            .field("shape", &self.layout.shape)
            .field("strides", &self.layout.strides)
            .field("offset", &self.layout.offset)
            .field("storage", &self.storage);
        // Values are shown for host tensors only (a CUDA tensor's would need a copy).
        let values = if self.device() == crate::Device::Cpu {
            self.narrowed_for_debug(SHOWN).and_then(|t| t.to_f64_vec())
        } else {
            Err(Error::Tensor("on a device".into()))
        };
        if let Ok(values) = values {
            if self.numel() > values.len() {
                d.field("first_values", &values);
            } else {
                d.field("values", &values);
            }
        }
        d.finish()
    }
}

impl Tensor {
    /// The first `n` elements (row-major) as a 1-D tensor, for `Debug`.
    fn narrowed_for_debug(&self, n: usize) -> Result<Tensor> {
        let flat = self.reshape(&[self.numel()])?;
        flat.narrow(0, 0, n.min(self.numel()))
    }
}

/// What a tensor looks like on the wire: its storage's handle and its layout.
#[derive(Serialize)]
struct TensorWireOut<'a> {
    dtype: u8,
    shape: &'a [usize],
    strides: &'a [usize],
    offset: usize,
    storage: &'a Storage,
}

#[derive(Deserialize)]
struct TensorWireIn {
    dtype: u8,
    shape: Vec<u64>,
    strides: Vec<u64>,
    offset: u64,
    storage: Storage,
}

impl Serialize for Tensor {
    /// Inside a multiproc channel (`Queue::put`, `Connection::send`, worker arguments):
    /// moves the storage to shared memory if needed (as torch does), then writes its
    /// handle (fd or segment name) and the layout. The receiver's tensor aliases this
    /// one. Outside a channel (JSON…) it is an error: a tensor is a reference to memory.
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        TensorWireOut {
            dtype: self.dtype.code(),
            shape: &self.layout.shape,
            strides: &self.layout.strides,
            offset: self.layout.offset,
            storage: &self.storage,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tensor {
    /// Maps the storage (once per process: the same storage received twice aliases) and
    /// validates everything: an unknown dtype, a layout that overflows or reaches past
    /// the storage, is [`Error::InvalidMessage`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let w = TensorWireIn::deserialize(d)?;
        let invalid = |why: String| D::Error::custom(wire::fail_with(Error::InvalidMessage(why)));
        let dtype = DType::from_code(w.dtype)
            .ok_or_else(|| invalid(format!("a tensor has unknown dtype code {}", w.dtype)))?;
        if w.shape.len() > MAX_DIMS || w.shape.len() != w.strides.len() {
            return Err(invalid(format!(
                "a tensor has {} dimensions and {} strides (at most {MAX_DIMS})",
                w.shape.len(),
                w.strides.len()
            )));
        }
        let to_usize = |v: &[u64]| -> std::result::Result<Vec<usize>, D::Error> {
            v.iter()
                .map(|&x| {
                    usize::try_from(x).map_err(|_| invalid(format!("{x} does not fit usize")))
                })
                .collect()
        };
        let shape = to_usize(&w.shape)?;
        let strides = to_usize(&w.strides)?;
        let offset = usize::try_from(w.offset)
            .map_err(|_| invalid(format!("offset {} does not fit usize", w.offset)))?;
        Tensor::from_storage(w.storage, dtype, &shape, &strides, offset).map_err(|e| {
            invalid(format!(
                "a received tensor's layout is invalid: {}",
                match e {
                    Error::Tensor(m) => m,
                    other => other.to_string(),
                }
            ))
        })
    }
}
