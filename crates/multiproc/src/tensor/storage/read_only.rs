//! The storages whose bytes are not this crate's to move or write: read-only file
//! pages (`safetensors`) and foreign memory (DLPack imports), and the two questions
//! every in-place operation and zero-copy view asks — may I write, and can the bytes
//! move? See the parent module's `# Safety` for the lock discipline this relies on.

use std::ptr::NonNull;
use std::sync::{Arc, PoisonError};

use super::Storage;
use super::backing::Backing;
use super::{StorageKey, with_storage_cache};
use crate::error::{Error, Result};
use crate::shm::file::FileSegment;

impl Storage {
    /// The storage over `nbytes` bytes at `offset` of a read-only mapped file, named
    /// `name` (the tensor's name, for errors): the one this process already has there, or
    /// a new one.
    pub(crate) fn from_file(
        file: Arc<FileSegment>,
        offset: usize,
        nbytes: usize,
        name: &str,
    ) -> Result<Storage> {
        if offset
            .checked_add(nbytes)
            .is_none_or(|end| end > file.len())
        {
            return Err(Error::InvalidMessage(format!(
                "read-only tensor {name:?} of {nbytes} bytes at offset {offset} does not fit in \
                 {} of {} bytes",
                file.origin(),
                file.len()
            )));
        }
        // An empty tensor of the file is read-only too (like its neighbours), so it keeps
        // its backing rather than becoming an ordinary empty storage.
        let key = StorageKey(Arc::as_ptr(&file) as usize, offset, nbytes);
        with_storage_cache(|c| {
            if let Some(inner) = c.get(&key) {
                return Ok(Storage { inner });
            }
            let storage = Storage::with_backing(
                nbytes,
                Backing::ReadOnlyFile {
                    file,
                    offset,
                    name: Arc::from(name),
                },
            );
            c.insert(key, &storage.inner);
            Ok(storage)
        })
    }

    /// A storage over `nbytes` bytes at `ptr` that another library owns in this process,
    /// kept alive by `owner` (dropped with the storage, or when the bytes are copied
    /// into shared memory by [`share_memory_`](Self::share_memory_)).
    ///
    /// # Safety
    ///
    /// `ptr..ptr+nbytes` must stay valid (and writable unless `read_only`) while `owner`
    /// lives, be aligned for the dtype it will be viewed as, and be accessed by others
    /// only in ways that tolerate racing atomic accesses.
    #[cfg(feature = "dlpack")]
    pub(crate) unsafe fn from_foreign(
        owner: Box<dyn Send + Sync>,
        ptr: NonNull<u8>,
        nbytes: usize,
        read_only: bool,
    ) -> Storage {
        if nbytes == 0 {
            return Storage::with_backing(0, Backing::Empty { shared: false });
        }
        Storage::with_backing(
            nbytes,
            Backing::Foreign {
                _owner: owner,
                ptr,
                read_only,
            },
        )
    }

    /// Whether the bytes can only be read (a tensor loaded with
    /// `multiproc::safetensors::load`, or a read-only DLPack import): every in-place
    /// operation on it is an error. Make a writable copy with `Tensor::deep_clone`.
    pub fn is_read_only(&self) -> bool {
        match &*self.backing() {
            Backing::ReadOnlyFile { .. } => true,
            #[cfg(feature = "dlpack")]
            Backing::Foreign { read_only, .. } => *read_only,
            _ => false,
        }
    }

    /// `Ok` when the bytes may be written; the error names the tensor and the operation
    /// `op`. Every in-place operation calls this before it writes.
    pub(crate) fn check_writable(&self, op: &str) -> Result<()> {
        match &*self.backing() {
            Backing::ReadOnlyFile { file, name, .. } => Err(Error::Tensor(format!(
                "{op}: tensor {name:?} is read-only (its bytes are the pages of {}, mapped \
                 read-only and shared); make a writable copy with deep_clone()",
                file.origin()
            ))),
            #[cfg(feature = "dlpack")]
            Backing::Foreign {
                read_only: true, ..
            } => Err(Error::Tensor(format!(
                "{op}: the tensor is a read-only DLPack import; make a writable copy with \
                 deep_clone()"
            ))),
            _ => Ok(()),
        }
    }

    /// The base pointer of a private storage that nobody else can reach: this is the
    /// only handle (no clone, no weak reference), so no other thread can write it and
    /// nothing can share it (which would move the bytes) while `&mut self` is borrowed.
    /// `None` for a shared, read-only or foreign storage, or one with other handles.
    #[cfg_attr(not(feature = "ndarray"), allow(dead_code))]
    pub(crate) fn unique_private_ptr(&mut self) -> Option<*mut u8> {
        let inner = Arc::get_mut(&mut self.inner)?;
        match inner
            .backing
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
        {
            Backing::Empty { .. } => Some(NonNull::<u64>::dangling().as_ptr().cast()),
            Backing::Private(buf) => Some(buf.ptr.as_ptr()),
            _ => None,
        }
    }

    /// The base pointer when the bytes can never move while the storage lives (shared or
    /// a read-only file), `None` while private or foreign: those bytes move when
    /// [`share_memory_`](Self::share_memory_) copies them into a segment.
    #[cfg_attr(not(any(feature = "ndarray", feature = "dlpack")), allow(dead_code))]
    pub(crate) fn stable_ptr(&self) -> Option<*mut u8> {
        let read = self.read();
        match &*read._guard {
            Backing::Shared { .. }
            | Backing::ReadOnlyFile { .. }
            | Backing::Empty { shared: true } => Some(read.ptr()),
            _ => None,
        }
    }
}
