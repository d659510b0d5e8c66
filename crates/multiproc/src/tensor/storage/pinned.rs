//! Page-locked shared storages (feature `cuda`): registering the segment under a
//! storage with the CUDA driver once, and holding a storage's bytes for a copy that
//! completes later.
//!
//! A registration is kept with the segment's mapping (`Segment::attach_once`), so it
//! is made once per mapping however many storages (batches) live in it, and undone
//! when the mapping goes — the segment drops it just before unmapping (the last tensor
//! on a received block gone and the map cache letting it go, or the recycler dropping
//! one of this process's own blocks). A block that is recycled stays mapped, and so
//! stays registered: the next batch in it is page-locked with no driver call.
//!
//! # Safety
//!
//! A segment's data is mapped for [`Segment::len`] bytes at [`Segment::data_ptr`] while
//! the segment lives; both the registration (made over that range while the segment is
//! borrowed) and [`HeldSegmentBytes`] (which owns an `Arc` of the segment) rely on it.

use std::sync::Arc;

use super::Storage;
use super::backing::Backing;
use crate::error::{Error, Result};
use crate::shm::Segment;
use crate::sys::cuda_driver::{self as driver, HeldHostBytes, Transfer};
use crate::sys::shared_bytes::SharedBytes;

/// The whole data range of `segment`, for as long as it is borrowed.
fn segment_bytes(segment: &Segment) -> SharedBytes<'_> {
    // SAFETY: the segment's data is mapped for `len` bytes while it lives, which the
    // borrow guarantees; it is only read through the pointer.
    unsafe { SharedBytes::from_raw(segment.data_ptr(), segment.len(), false) }
}

/// `len` bytes at `offset` of a segment, kept mapped by holding the segment, and kept
/// from being reused by holding the storage (whose block use stops the block's creator
/// from recycling it and writing the next batch there while a copy still reads it).
pub(crate) struct HeldSegmentBytes {
    _storage: Storage,
    segment: Arc<Segment>,
    offset: usize,
    len: usize,
}

impl HeldHostBytes for HeldSegmentBytes {
    fn bytes(&self) -> SharedBytes<'_> {
        // SAFETY: `offset + len <= segment.len()` (checked in `Storage::held_bytes`) and
        // the segment, held by `self`, stays mapped while `self` is borrowed.
        unsafe {
            SharedBytes::from_raw(
                self.segment.data_ptr().wrapping_add(self.offset),
                self.len,
                false,
            )
        }
    }
}

impl Storage {
    /// Page-locks the segment under this shared storage for every CUDA context of this
    /// process (registered with `device`'s context current), unless it is already.
    /// Returns whether a registration was made now; `false` for a storage that is not in
    /// a shared segment (private, CUDA, a read-only file: nothing to register).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`], or what the driver says (the memory limit for
    /// page-locked memory, pages registered already by someone else).
    pub(crate) fn pin_shared(&self, device: u32) -> Result<bool> {
        let Some((segment, _)) = self.segment() else {
            return Ok(false);
        };
        if segment.len() == 0 {
            return Ok(false);
        }
        let d = driver::driver()?;
        segment.attach_once(|| {
            let registration = d.register_host(device, segment_bytes(&segment))?;
            Ok::<_, Error>(Box::new(registration))
        })
    }

    /// Whether this storage's bytes are page-locked host memory the CUDA driver knows
    /// (registered by anyone in this process, as the driver reports). `false` without
    /// CUDA initialised: nothing can be registered then.
    pub(crate) fn is_pinned(&self) -> bool {
        if !driver::initialised() || self.nbytes() == 0 {
            return false;
        }
        let Some((segment, offset)) = self.segment() else {
            return false;
        };
        let Ok(d) = driver::driver() else {
            return false;
        };
        d.is_registered_host(segment.data_ptr().wrapping_add(offset))
    }

    /// `len` bytes at `offset` of this shared storage, held (the segment stays mapped
    /// while the value lives), for a copy that completes after the call issuing it.
    ///
    /// # Errors
    /// [`Error::Tensor`] for a storage that is not in a shared segment, or a range
    /// past its end.
    pub(crate) fn held_bytes(&self, offset: usize, len: usize) -> Result<HeldSegmentBytes> {
        let Some((segment, start)) = self.segment() else {
            return Err(Error::Tensor(
                "an asynchronous copy needs a storage in shared memory (share_memory_ it \
                 first)"
                    .into(),
            ));
        };
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.nbytes())
        {
            return Err(Error::Tensor(format!(
                "{len} bytes at offset {offset} reach past a storage of {} bytes",
                self.nbytes()
            )));
        }
        Ok(HeldSegmentBytes {
            _storage: self.clone(),
            segment,
            offset: start + offset,
            len,
        })
    }
}

impl Storage {
    /// Starts copying `src` to byte `offset` of this CUDA storage on `transfer`'s
    /// stream; `src` is held until the transfer is waited for.
    ///
    /// # Errors
    /// [`Error::Tensor`] when this storage is not CUDA memory or the range reaches past
    /// it; what the driver reports.
    pub(crate) fn copy_from_host_async(
        &self,
        offset: usize,
        src: Box<dyn HeldHostBytes>,
        transfer: &mut Transfer,
    ) -> Result<()> {
        let len = src.bytes().len();
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.nbytes())
        {
            return Err(Error::Tensor(format!(
                "{len} bytes at offset {offset} reach past a CUDA storage of {} bytes",
                self.nbytes()
            )));
        }
        match &*self.backing() {
            Backing::Cuda {
                memory,
                offset: start,
            } => memory.copy_from_host_async(start + offset, src, transfer),
            _ => Err(Error::Tensor(
                "an asynchronous host-to-device copy into memory that is not CUDA memory".into(),
            )),
        }
    }
}
