//! Storages in CUDA memory: making one, finding the one a received handle names, and
//! the byte copies between host and device that `Tensor::copy_` and `Tensor::to` use.
//!
//! # Safety
//!
//! The copies reach host memory as a checked [`SharedBytes`] of a storage's read guard
//! (`StorageRead::host_bytes`), whose pointer is valid for the storage's length while
//! the guard lives; device memory only through the driver, with every range checked
//! first.

use std::sync::Arc;

use super::backing::Backing;
use super::{Storage, StorageRead};
use super::{StorageKey, with_storage_cache};
use crate::cuda::{self, CudaUse};
use crate::error::{Error, Result};
use crate::sys::shared_bytes::SharedBytes;

impl Storage {
    /// A storage of `nbytes` in CUDA memory on `device`: zeroed, or with unspecified
    /// bytes (a recycled allocation holds what this process last stored there).
    pub(crate) fn new_cuda(nbytes: usize, device: u32, zero: bool) -> Result<Storage> {
        let (memory, offset) = cuda::allocate(device, nbytes)?;
        if zero && nbytes > 0 {
            memory.zero(offset, nbytes)?;
        }
        let key = StorageKey(Arc::as_ptr(&memory) as usize, offset, nbytes);
        let storage = Storage::with_backing(nbytes, Backing::Cuda { memory, offset });
        with_storage_cache(|c| c.insert(key, &storage.inner));
        Ok(storage)
    }

    /// The storage over `nbytes` at `offset` in received CUDA memory: the one this
    /// process already has there, or a new one.
    pub(super) fn from_cuda(memory: Arc<CudaUse>, offset: usize, nbytes: usize) -> Storage {
        let key = StorageKey(Arc::as_ptr(&memory) as usize, offset, nbytes);
        with_storage_cache(|c| {
            if let Some(inner) = c.get(&key) {
                return Storage { inner };
            }
            let storage = Storage::with_backing(nbytes, Backing::Cuda { memory, offset });
            c.insert(key, &storage.inner);
            storage
        })
    }
}

impl StorageRead<'_> {
    /// Bytes `offset..offset + len` of the storage, which must be host memory; writable
    /// unless the storage is read-only. They stay mapped while this guard lives.
    pub(crate) fn host_bytes(&self, offset: usize, len: usize) -> Result<SharedBytes<'_>> {
        if !self.host || offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::Tensor(format!(
                "{len} bytes at offset {offset} are not host memory of this {}-byte storage",
                self.len
            )));
        }
        let writable = match &*self._guard {
            Backing::ReadOnlyFile { .. } => false,
            #[cfg(feature = "dlpack")]
            Backing::Foreign { read_only, .. } => !*read_only,
            _ => true,
        };
        // SAFETY: the range lies inside the storage's host memory (checked above), which
        // the read guard `self` keeps mapped while the result borrows it; writable unless
        // the backing is read-only (checked above); no reference into it is made.
        Ok(unsafe { SharedBytes::from_raw(self.ptr.add(offset), len, writable) })
    }
}

/// Copies `len` bytes from `src` at byte `src_offset` to `dst` at byte `dst_offset`,
/// where at least one of them is CUDA memory (host-to-host copies are the element
/// kernels' business).
///
/// # Errors
///
/// [`Error::Tensor`] when a range reaches past its storage or neither is CUDA memory;
/// what the driver reports otherwise.
pub(crate) fn copy_bytes(
    dst: &Storage,
    dst_offset: usize,
    src: &Storage,
    src_offset: usize,
    len: usize,
) -> Result<()> {
    for (s, off, what) in [
        (dst, dst_offset, "destination"),
        (src, src_offset, "source"),
    ] {
        if off.checked_add(len).is_none_or(|end| end > s.nbytes()) {
            return Err(Error::Tensor(format!(
                "a copy of {len} bytes at offset {off} reaches past its {what} storage of {} bytes",
                s.nbytes()
            )));
        }
    }
    if len == 0 {
        return Ok(());
    }
    let (dst_read, src_read) = if dst.addr() <= src.addr() {
        let d = dst.read();
        (d, src.read())
    } else {
        let s = src.read();
        (dst.read(), s)
    };
    let (dst_backing, src_backing) = (&*dst_read._guard, &*src_read._guard);
    match (dst_backing, src_backing) {
        (
            Backing::Cuda {
                memory: d,
                offset: o,
            },
            Backing::Cuda {
                memory: s,
                offset: so,
            },
        ) => d.copy_from(o + dst_offset, s, so + src_offset, len),
        (Backing::Cuda { memory, offset }, _) => {
            memory.copy_from_host(offset + dst_offset, src_read.host_bytes(src_offset, len)?)
        }
        // Private heap memory, which no other process can reach; this thread's kernels
        // hold read locks like ours, and copies into private memory only come from
        // fresh tensors.
        (Backing::Private(_), Backing::Cuda { memory, offset }) => {
            memory.copy_to_host(dst_read.host_bytes(dst_offset, len)?, offset + src_offset)
        }
        (_, Backing::Cuda { .. }) => Err(Error::Tensor(
            "a copy from CUDA memory goes into a private host tensor only (copy into a fresh \
             tensor, then share it)"
                .into(),
        )),
        _ => Err(Error::Tensor(
            "copy_bytes between two host storages (use the element kernels)".into(),
        )),
    }
}
