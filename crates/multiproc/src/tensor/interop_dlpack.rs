//! DLPack export and import (feature `dlpack`, through the `dlpark` crate): zero-copy
//! hand-off of a tensor to another library *in this process* — a PyO3 extension handing
//! a multiproc tensor to `torch.from_dlpack`, or a C library — and back.
//!
//! # Scope: one process
//!
//! A DLPack capsule is a pointer into this process's address space plus a deleter. It
//! cannot cross a process boundary: send the multiproc [`Tensor`] itself through a
//! queue (it travels by handle), and make the capsule on the receiving side.
//!
//! # Safety
//!
//! An exported capsule owns a clone of the tensor (so the storage lives as long as the
//! capsule, whatever happens to the original) and points at bytes that never move: a
//! private tensor is moved into shared memory first, because a private storage's bytes
//! move when it is shared later. A read-only tensor is exported with DLPack's
//! `READ_ONLY` flag. An imported capsule becomes a storage that owns it (its deleter
//! runs when the last tensor on it is dropped, or when the bytes are copied into shared
//! memory to be sent); its layout is checked (CPU device, known dtype, non-negative
//! strides, alignment) before any byte is touched.

use std::ffi::c_void;
use std::ptr::NonNull;

use dlpark::DlpackFlags;
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use dlpark::versioned::Dlpack;

use super::{DType, Storage, Tensor};
use crate::error::{Error, Result};

fn dl_dtype(dtype: DType) -> DLDataType {
    let code = match dtype {
        DType::F32 | DType::F64 | DType::F16 => DLDataTypeCode::FLOAT,
        DType::BF16 => DLDataTypeCode::BFLOAT,
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => DLDataTypeCode::INT,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => DLDataTypeCode::UINT,
        DType::Bool => DLDataTypeCode::BOOL,
    };
    DLDataType {
        code,
        bits: (dtype.size() * 8) as u8,
        lanes: 1,
    }
}

fn our_dtype(dt: DLDataType) -> Option<DType> {
    DType::ALL.into_iter().find(|d| dl_dtype(*d) == dt)
}

fn dlpack_error(op: &str, e: impl std::fmt::Display) -> Error {
    Error::Tensor(format!("{op}: {e}"))
}

impl Tensor {
    /// Exports the tensor as a DLPack capsule (versioned ABI) without copying: the
    /// capsule's data pointer is this tensor's memory, and the capsule keeps the storage
    /// alive until its deleter runs. A private tensor is moved into shared memory first
    /// (once; see the module docs), so the capsule's pointer can never dangle. For a
    /// C or Python consumer, hand over [`Dlpack::into_raw`].
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::{DType, Tensor};
    /// let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
    /// let capsule = t.to_dlpack()?;
    /// let back = Tensor::from_dlpack(capsule)?; // zero-copy both ways
    /// assert_eq!(back.data_ptr(), t.data_ptr());
    /// back.fill_(1.0)?;
    /// assert_eq!(t.sum()?, 6.0);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`share_memory_`](Self::share_memory_) for a private tensor (a read-only
    /// DLPack import is refused), or [`Error::Tensor`] when the capsule cannot be
    /// allocated.
    pub fn to_dlpack(&self) -> Result<Dlpack> {
        if self.storage.stable_ptr().is_none() {
            self.storage.share_memory_()?;
        }
        let base = self.storage.stable_ptr().ok_or_else(|| {
            Error::Tensor("to_dlpack: the storage's bytes are not in place".into())
        })?;
        let shape: Vec<i64> = self.shape().iter().map(|&n| n as i64).collect();
        let strides: Vec<i64> = self.strides().iter().map(|&s| s as i64).collect();
        let mut init = Dynamic::new(shape, strides)
            .initialize(Box::new(self.clone()))
            .map_err(|e| dlpack_error("to_dlpack", e))?;
        let (data, byte_offset) = if self.numel() == 0 {
            (std::ptr::null_mut(), 0)
        } else {
            (
                base.cast::<c_void>(),
                (self.storage_offset() * self.dtype.size()) as u64,
            )
        };
        init.set_data(data)
            .set_device(DLDevice::CPU)
            .set_dtype(dl_dtype(self.dtype))
            .set_byte_offset(byte_offset);
        if self.is_read_only() {
            init.set_flags(DlpackFlags::READ_ONLY)
                .map_err(|e| dlpack_error("to_dlpack", e))?;
        }
        // SAFETY: the data pointer is the storage's first byte, which never moves (the
        // storage is not private) and lives as long as the context (a clone of this
        // tensor); shape and strides were copied in and describe a layout checked to lie
        // inside the storage; the flags say READ_ONLY exactly when it is.
        Ok(unsafe { init.finish() })
    }

    /// Imports a DLPack capsule without copying: the tensor's storage is the capsule's
    /// memory and owns the capsule (its deleter runs when the last tensor on it is
    /// dropped). A capsule flagged `READ_ONLY` gives a read-only tensor. Sending the
    /// tensor to another process copies it into shared memory once (and releases the
    /// capsule), as for any private tensor; a read-only import cannot be sent or
    /// re-exported (its copy would be writable): `deep_clone` it first.
    ///
    /// The producer must not write the memory non-atomically while multiproc reads or
    /// writes it (as with any memory two libraries share).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] for a capsule that is not on the CPU, has a dtype multiproc does
    /// not have (complex, fp8, vector lanes…), negative strides, or data not aligned for
    /// its dtype.
    pub fn from_dlpack(capsule: Dlpack) -> Result<Tensor> {
        let op = "from_dlpack";
        let t = capsule.validate().map_err(|e| dlpack_error(op, e))?;
        if t.device().device_type != DLDeviceType::CPU {
            return Err(Error::Tensor(format!(
                "{op}: the capsule is on device type {}, not the CPU",
                t.device().device_type.0
            )));
        }
        let dtype = our_dtype(t.dtype()).ok_or_else(|| {
            Error::Tensor(format!(
                "{op}: multiproc has no dtype for DLPack code {} with {} bits and {} lanes",
                t.dtype().code.0,
                t.dtype().bits,
                t.dtype().lanes
            ))
        })?;
        let to_usize = |v: i64, what: &str| {
            usize::try_from(v).map_err(|_| {
                Error::Tensor(format!("{op}: a negative {what} ({v}) is not supported"))
            })
        };
        let shape = t
            .shape()
            .iter()
            .map(|&v| to_usize(v, "dimension"))
            .collect::<Result<Vec<_>>>()?;
        let strides = t
            .strides_or_compact()
            .map_err(|e| dlpack_error(op, e))?
            .iter()
            .map(|&v| to_usize(v, "stride"))
            .collect::<Result<Vec<_>>>()?;
        let read_only = capsule.flags().contains(DlpackFlags::READ_ONLY);
        let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let span = if numel == Some(0) {
            Some(0)
        } else {
            shape
                .iter()
                .zip(&strides)
                .try_fold(1usize, |end, (&n, &s)| {
                    end.checked_add((n - 1).checked_mul(s)?)
                })
                .and_then(|elements| elements.checked_mul(dtype.size()))
        };
        let nbytes = span.ok_or_else(|| {
            Error::Tensor(format!(
                "{op}: shape {shape:?} with strides {strides:?} overflows"
            ))
        })?;
        let first = (t.data_ptr() as *mut u8).wrapping_add(t.byte_offset() as usize);
        let storage = match NonNull::new(first) {
            Some(ptr) if nbytes > 0 => {
                if (ptr.as_ptr() as usize) % dtype.size() != 0 {
                    return Err(Error::Tensor(format!(
                        "{op}: the data at {ptr:p} is not aligned for {dtype}"
                    )));
                }
                // SAFETY: a valid capsule's memory holds every element its layout
                // addresses (`nbytes` from the first one) while the capsule lives, and
                // the storage owns the capsule; alignment was checked just above.
                unsafe { Storage::from_foreign(Box::new(capsule), ptr, nbytes, read_only) }
            }
            Some(_) => Storage::new(0)?,
            None if nbytes == 0 => Storage::new(0)?,
            None => return Err(Error::Tensor(format!("{op}: a null data pointer"))),
        };
        Tensor::from_storage(storage, dtype, &shape, &strides, 0)
    }
}
