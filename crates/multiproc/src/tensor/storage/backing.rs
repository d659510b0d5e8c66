//! Where a storage's bytes are ([`Backing`]: nothing, the heap, a shared segment, CUDA
//! memory, a read-only file, a foreign owner), and [`StorageInner`], the shared state
//! every clone of a [`Storage`](super::Storage) handle points to.

#[cfg(feature = "dlpack")]
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use super::private_buf::PrivateBuf;
use crate::cuda::CudaUse;
use crate::shm::Segment;
use crate::shm::file::FileSegment;

/// Where a storage's bytes are.
pub(super) enum Backing {
    /// No bytes. `shared` is what `is_shared` reports (an empty storage that was
    /// "shared" or received needs no segment).
    Empty { shared: bool },
    /// Bytes on this process's heap.
    Private(PrivateBuf),
    /// Bytes in a shared segment, `offset` bytes into its data (small storages share
    /// arena segments).
    Shared {
        segment: Arc<Segment>,
        offset: usize,
    },
    /// Bytes in CUDA device memory, `offset` bytes into the allocation.
    Cuda { memory: Arc<CudaUse>, offset: usize },
    /// Bytes of a regular file mapped read-only and shared (`safetensors::load`), `offset`
    /// bytes into it; `name` is the tensor's, for errors.
    ReadOnlyFile {
        file: Arc<FileSegment>,
        offset: usize,
        name: Arc<str>,
    },
    /// Memory owned by another library in this process (a DLPack capsule), kept alive
    /// by `owner` until this backing is dropped or replaced.
    #[cfg(feature = "dlpack")]
    Foreign {
        /// Never read: holding it is the point (dropping it runs the capsule's deleter).
        _owner: Box<dyn Send + Sync>,
        ptr: NonNull<u8>,
        read_only: bool,
    },
}

// SAFETY: the foreign pointer is only dereferenced through the storage's lock discipline
// and atomics, like the others; its owner is `Send + Sync`.
#[cfg(feature = "dlpack")]
unsafe impl Send for Backing {}
// SAFETY: as above.
#[cfg(feature = "dlpack")]
unsafe impl Sync for Backing {}

pub(super) struct StorageInner {
    pub(super) nbytes: usize,
    pub(super) backing: RwLock<Backing>,
    /// The pid of the process whose use of the backing block (see `shm::recycler`) this
    /// storage holds; 0 for none. A `fork` child inherits the value but not the use, so
    /// it must not give it back.
    pub(super) use_owner: AtomicU32,
}

impl Drop for StorageInner {
    fn drop(&mut self) {
        if self.use_owner.load(Ordering::Acquire) == crate::sys::process::cached_pid() {
            if let Backing::Shared { segment, .. } = self
                .backing
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
            {
                segment.release_use();
            }
        }
    }
}
