//! Interop with [`candle_core`] (feature `candle`): one `memcpy` each way.
//!
//! candle's CPU storage owns a `Vec` behind a lock of its own, so neither side can borrow
//! the other's memory: [`Tensor::to_candle`] copies the elements out once (the `Vec`
//! then moves into candle without another copy) and [`Tensor::from_candle`] copies
//! candle's slice once, straight into shared memory for
//! [`from_candle_shared`](Tensor::from_candle_shared).
//!
//! Dtypes both sides know: `u8 u32 i16 i32 i64 bf16 f16 f32 f64`. multiproc's `i8`,
//! `u16`, `u64` and `bool`, and candle's 8-, 6- and 4-bit float formats, have no
//! counterpart: converting them is an error naming the dtype (convert with
//! [`Tensor::to_dtype`] or candle's `to_dtype` first).

use candle_core::{CpuStorage, Device};

use super::{DType, Element, Tensor};
use crate::error::{Error, Result};

fn candle_error(op: &str, e: candle_core::Error) -> Error {
    Error::Tensor(format!("{op}: candle refused the tensor: {e}"))
}

impl Tensor {
    /// A candle CPU tensor with a copy of the elements, in this tensor's shape (one copy,
    /// whatever the strides).
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let t = Tensor::from_slice(&[1.0f32, 5.0, 2.0], &[3])?;
    /// let c = t.to_candle()?;
    /// let best = c.argmax(0).unwrap(); // candle answers in u32
    /// assert_eq!(Tensor::from_candle(&best)?.to_vec::<u32>()?, [1]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] naming the dtype when candle has no such dtype (`int8`, `uint16`,
    /// `uint64`, `bool`).
    pub fn to_candle(&self) -> Result<candle_core::Tensor> {
        fn make<T: Element + candle_core::WithDType>(t: &Tensor) -> Result<candle_core::Tensor> {
            candle_core::Tensor::from_vec(t.to_vec::<T>()?, t.shape(), &Device::Cpu)
                .map_err(|e| candle_error("to_candle", e))
        }
        match self.dtype {
            DType::U8 => make::<u8>(self),
            DType::U32 => make::<u32>(self),
            DType::I16 => make::<i16>(self),
            DType::I32 => make::<i32>(self),
            DType::I64 => make::<i64>(self),
            DType::BF16 => make::<half::bf16>(self),
            DType::F16 => make::<half::f16>(self),
            DType::F32 => make::<f32>(self),
            DType::F64 => make::<f64>(self),
            DType::I8 | DType::U16 | DType::U64 | DType::Bool => Err(Error::Tensor(format!(
                "to_candle: candle has no dtype {}; convert first, e.g. with to_dtype(DType::{})",
                self.dtype,
                match self.dtype {
                    DType::Bool => "U8",
                    DType::U64 => "I64",
                    _ => "I32",
                }
            ))),
        }
    }

    /// A private multiproc tensor with a copy of a candle CPU tensor's elements (one
    /// copy; any layout, taken in logical row-major order).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] naming the dtype when multiproc has no such dtype (candle's
    /// `f8e4m3`, `f6e2m3`, `f6e3m2`, `f4`, `f8e8m0`), or naming the device when the
    /// tensor is not on the CPU (move it with `to_device(&Device::Cpu)` first).
    pub fn from_candle(tensor: &candle_core::Tensor) -> Result<Tensor> {
        Tensor::from_candle_with(tensor, false)
    }

    /// [`from_candle`](Self::from_candle) straight into shared memory (one copy, no
    /// private buffer in between).
    ///
    /// # Errors
    ///
    /// As [`from_candle`](Self::from_candle) and [`zeros_shared`](Self::zeros_shared).
    pub fn from_candle_shared(tensor: &candle_core::Tensor) -> Result<Tensor> {
        Tensor::from_candle_with(tensor, true)
    }

    fn from_candle_with(tensor: &candle_core::Tensor, shared: bool) -> Result<Tensor> {
        let (storage, layout) = tensor.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(Error::Tensor(format!(
                "from_candle: the tensor is on {:?}, not the CPU; move it with \
                 to_device(&Device::Cpu) first",
                tensor.device().location()
            )));
        };
        match cpu {
            CpuStorage::U8(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::U32(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::I16(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::I32(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::I64(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::BF16(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::F16(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::F32(v) => copy_candle(v, tensor, layout, shared),
            CpuStorage::F64(v) => copy_candle(v, tensor, layout, shared),
            _ => Err(Error::Tensor(format!(
                "from_candle: multiproc has no dtype {}; convert it in candle first, e.g. \
                 with to_dtype(DType::F32)",
                tensor.dtype().as_str()
            ))),
        }
    }
}

/// The tensor over candle's elements `data` laid out by `layout` (one copy).
fn copy_candle<T: Element>(
    data: &[T],
    tensor: &candle_core::Tensor,
    layout: &candle_core::Layout,
    shared: bool,
) -> Result<Tensor> {
    let dims = layout.dims();
    match layout.contiguous_offsets() {
        Some((start, end)) => {
            let slice = data.get(start..end).ok_or_else(|| {
                Error::Tensor(format!(
                    "from_candle: elements {start}..{end} of a storage of {}",
                    data.len()
                ))
            })?;
            Tensor::contiguous_copy_of(slice, dims, shared)
        }
        None => {
            if tensor.strided_index().any(|i| i >= data.len()) {
                return Err(Error::Tensor(format!(
                    "from_candle: a layout that reaches past its storage of {} elements",
                    data.len()
                )));
            }
            Tensor::contiguous_from_iter(tensor.strided_index().map(|i| data[i]), dims, shared)
        }
    }
}
