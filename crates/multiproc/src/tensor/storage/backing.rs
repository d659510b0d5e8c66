//! Where a storage's bytes are ([`Backing`]: nothing, the heap, a shared segment, CUDA
//! memory, a read-only file, a foreign owner), and [`StorageInner`], the shared state
//! every clone of a [`Storage`](super::Storage) handle points to (the bytes' backing and
//! the use of their block it keeps).

#[cfg(feature = "dlpack")]
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, RwLock};

use super::private_buf::PrivateBuf;
use crate::cuda::CudaUse;
use crate::shm::file::FileSegment;
use crate::shm::{BlockUse, Segment};

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
    /// The use of the backing block (see `shm::recycler`) this storage keeps, taken when
    /// its bytes were allocated here or brought by the handle it was received from;
    /// `None` for bytes that are not in a block. Dropping the storage drops it, which
    /// gives the use back in the process that holds it (a `fork` child inherits the
    /// value, not the use: see `shm::BlockUse`). Its own lock, never held while another
    /// is taken, so the received-storage cache may replace it without locking the
    /// backing.
    pub(super) block_use: Mutex<Option<BlockUse>>,
}
