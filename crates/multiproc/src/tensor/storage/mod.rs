//! [`Storage`]: the bytes under tensors, private or in a shared segment.
//!
//! # Safety
//!
//! A storage's bytes are reachable from other threads (every clone of the handle) and,
//! once shared, from other processes, so this module never makes a Rust reference to
//! them: it hands out the base pointer inside a [`StorageRead`] guard, and all element
//! access goes through `raw`'s relaxed atomics. The pointer is stable while a read guard
//! lives: only [`Storage::share_memory_`] replaces the backing, and it holds the write
//! lock. The byte length never changes after creation.
//!
//! A CUDA storage's bytes are device memory (see `crate::cuda`): its read guard says so
//! ([`StorageRead::is_host`]), and the element kernels refuse it; only the copies in
//! [`copy_bytes`] reach it, through the driver.
//! A *read-only* storage (the pages of a file, `Backing::ReadOnlyFile`, mapped
//! `PROT_READ`) is never written: every in-place operation asks
//! [`Storage::check_writable`] first, so a write is an error naming the tensor, never a
//! SIGSEGV. A storage is read-only from creation to drop (no backing change makes it so
//! or undoes it), so the check needs no lock held across the write.
//!
//! Files: `backing` (where the bytes are, and the state every handle shares),
//! `private_buf` (heap bytes), `initial_bytes` (how new shared bytes start out),
//! `read_only` (a file's pages), `device_memory` (CUDA memory and the copies that reach
//! it); this file: the [`Storage`] handle, its read guard, its wire form, and this
//! process's shared storages by where their bytes are (a received handle naming bytes
//! this process already has finds the same [`Storage`], so aliasing survives a round
//! trip).

mod backing;
mod device_memory;
mod initial_bytes;
#[cfg(feature = "cuda")]
mod pinned;
mod private_buf;
mod read_only;

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, Weak};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use backing::{Backing, StorageInner};
pub(crate) use device_memory::copy_bytes;
use initial_bytes::{Init, write_shared};
use private_buf::PrivateBuf;

use crate::cuda::{self, CudaHandle, Device};
use crate::error::{Error, Result};
use crate::identity_cache::IdentityCache;
use crate::sharing::{SharingStrategy, get_sharing_strategy};
use crate::shm::file::FileHandle;
use crate::shm::{self, BlockUse, Segment, SegmentHandle};
use crate::wire::{Decoder, Encoder};

/// Alignment of private storage (a cache line; at least every element's alignment).
pub(crate) const ALIGN: usize = 64;

/// The bytes under one or more tensors: a cheap handle (cloning shares the bytes, like
/// an `Arc`).
///
/// The bytes live on this process's heap until [`share_memory_`](Self::share_memory_)
/// moves them into a shared segment — in place, so every tensor and view on this storage
/// follows. A storage never changes size.
#[derive(Clone)]
pub struct Storage {
    inner: Arc<StorageInner>,
}

/// A read lock on a storage's backing: the base pointer is valid for
/// [`len`](Self::len) bytes while this lives.
pub(crate) struct StorageRead<'a> {
    _guard: RwLockReadGuard<'a, Backing>,
    ptr: *mut u8,
    len: usize,
    host: bool,
}

impl StorageRead<'_> {
    /// Whether the pointer is host memory (not a CUDA device address).
    pub(crate) fn is_host(&self) -> bool {
        self.host
    }

    /// The first byte (dangling but aligned when the storage is empty).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The byte length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Storage {
    /// A private, zero-filled storage of `nbytes` bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the memory cannot be allocated.
    pub fn new(nbytes: usize) -> Result<Storage> {
        let backing = if nbytes == 0 {
            Backing::Empty { shared: false }
        } else {
            Backing::Private(PrivateBuf::zeroed(nbytes)?)
        };
        Ok(Storage::with_backing(nbytes, backing))
    }

    /// A zero-filled storage of `nbytes` bytes that lives in shared memory from the
    /// start (with the current [`get_sharing_strategy`]): no private buffer, and no copy
    /// when it is later sent. What a producer that makes tensors only to send them wants.
    ///
    /// # Errors
    ///
    /// As [`share_memory_`](Self::share_memory_).
    pub fn new_shared(nbytes: usize) -> Result<Storage> {
        Storage::new_shared_with(nbytes, get_sharing_strategy())
    }

    /// [`new_shared`](Self::new_shared) with an explicit strategy.
    pub(crate) fn new_shared_with(nbytes: usize, strategy: SharingStrategy) -> Result<Storage> {
        Storage::shared_with(nbytes, strategy, Init::Zero)
    }

    /// A storage holding a copy of `bytes`, in one memcpy: private, or in shared memory
    /// with the current strategy when `shared` (then no private buffer is made at all).
    pub(crate) fn copy_of(bytes: &[u8], shared: bool) -> Result<Storage> {
        if shared {
            Storage::shared_with(bytes.len(), get_sharing_strategy(), Init::Copy(bytes))
        } else if bytes.is_empty() {
            Ok(Storage::with_backing(0, Backing::Empty { shared: false }))
        } else {
            Ok(Storage::with_backing(
                bytes.len(),
                Backing::Private(PrivateBuf::copy_of(bytes)?),
            ))
        }
    }

    /// Like [`new_shared`](Self::new_shared), but the bytes are unspecified: a recycled
    /// block (see `shm::recycler`) is not zeroed. For storages that will be overwritten
    /// whole. Reading them is still defined (every bit pattern is a value of every
    /// dtype); they hold whatever this process last stored in recycled shared memory.
    ///
    /// # Errors
    ///
    /// As [`new_shared`](Self::new_shared).
    pub fn new_shared_uninit(nbytes: usize) -> Result<Storage> {
        Storage::shared_with(nbytes, get_sharing_strategy(), Init::Uninit)
    }

    fn shared_with(nbytes: usize, strategy: SharingStrategy, init: Init<'_>) -> Result<Storage> {
        if nbytes == 0 {
            return Ok(Storage::with_backing(0, Backing::Empty { shared: true }));
        }
        let slice = shm::allocate(strategy, nbytes)?;
        let dst = slice.block.block().data_ptr().wrapping_add(slice.offset);
        match init {
            Init::Zero if !slice.zeroed => {
                // SAFETY: the slice holds `nbytes` bytes at `offset` (allocate's
                // contract), 64-byte aligned.
                unsafe { write_shared(dst, None, nbytes) };
            }
            Init::Copy(bytes) if slice.zeroed => {
                debug_assert_eq!(bytes.len(), nbytes);
                // SAFETY: fresh bytes no other process has been told about, `nbytes`
                // long (allocate's contract); `bytes` is as long and cannot overlap a
                // fresh mapping.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, nbytes) };
            }
            Init::Copy(bytes) => {
                // SAFETY: as above, 64-byte aligned; a recycled block is written
                // atomically (see `write_shared`).
                unsafe { write_shared(dst, Some(bytes.as_ptr()), nbytes) };
            }
            Init::Zero | Init::Uninit => {}
        }
        let segment = Arc::clone(slice.block.block());
        let key = StorageKey::new(&segment, slice.offset, nbytes);
        let storage = Storage::with_use(
            nbytes,
            Backing::Shared {
                segment,
                offset: slice.offset,
            },
            Some(slice.block),
        );
        with_storage_cache(|c| c.insert(key, &storage.inner));
        Ok(storage)
    }

    fn with_backing(nbytes: usize, backing: Backing) -> Storage {
        Storage::with_use(nbytes, backing, None)
    }

    /// A storage over `backing` that keeps `block_use`, the use of the block its bytes
    /// are in.
    fn with_use(nbytes: usize, backing: Backing, block_use: Option<BlockUse>) -> Storage {
        Storage {
            inner: Arc::new(StorageInner {
                nbytes,
                backing: RwLock::new(backing),
                block_use: Mutex::new(block_use),
            }),
        }
    }

    /// The storage over `nbytes` bytes at `offset` in a received segment: the one this
    /// process already has there (so the same storage received twice, or sent and
    /// received in one process, is one `Storage`, as in torch), or a new one.
    ///
    /// `brought`: the use of the segment's block the handle brought (see `shm::recycler`);
    /// a new storage keeps it, an existing one keeps it unless it holds a use of this
    /// process already (then `brought` is dropped, which gives it back). On an error it
    /// is dropped too: every use this process was handed is given back once.
    pub(crate) fn from_segment(
        segment: Arc<Segment>,
        offset: usize,
        nbytes: usize,
        brought: Option<BlockUse>,
    ) -> Result<Storage> {
        if offset
            .checked_add(nbytes)
            .is_none_or(|end| end > segment.len())
        {
            return Err(Error::InvalidMessage(format!(
                "a storage of {nbytes} bytes at offset {offset} cannot live in a segment of {}",
                segment.len()
            )));
        }
        let key = StorageKey::new(&segment, offset, nbytes);
        // The use given back (or the inherited one let go) after the cache's lock is
        // released: the last use of a named block unlinks its name.
        let mut unneeded = None;
        let mut brought = brought;
        let storage = with_storage_cache(|c| {
            let inner = c.get_or_insert_with(key, || {
                Storage::with_use(nbytes, Backing::Shared { segment, offset }, brought.take()).inner
            });
            // Still here only when the storage was found (a new one took it).
            if let Some(brought) = brought.take() {
                let mut held = inner
                    .block_use
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                // Keep the brought use unless this process holds one already (a storage
                // inherited through `fork` holds its parent's, not ours).
                unneeded = if held.as_ref().is_some_and(BlockUse::is_held_here) {
                    Some(brought)
                } else {
                    held.replace(brought)
                };
            }
            Storage { inner }
        });
        drop(unneeded);
        Ok(storage)
    }

    /// Where the bytes live.
    pub fn device(&self) -> Device {
        match &*self.backing() {
            Backing::Cuda { memory, .. } => Device::Cuda(memory.device()),
            _ => Device::Cpu,
        }
    }

    /// An empty storage that reports itself shared (received from another process).
    pub(crate) fn empty_shared() -> Storage {
        Storage::with_backing(0, Backing::Empty { shared: true })
    }

    /// The byte length.
    pub fn nbytes(&self) -> usize {
        self.inner.nbytes
    }

    /// Whether the bytes live in shared memory (every storage received from another
    /// process does).
    pub fn is_shared(&self) -> bool {
        matches!(
            *self.backing(),
            Backing::Shared { .. }
                | Backing::Cuda { .. }
                | Backing::ReadOnlyFile { .. }
                | Backing::Empty { shared: true }
        )
    }

    /// The strategy of the segment the bytes live in; `None` while private or empty, and
    /// for a read-only file (which travels by its fd whatever the strategy).
    pub fn sharing_strategy(&self) -> Option<SharingStrategy> {
        match &*self.backing() {
            Backing::Shared { segment, .. } => Some(segment.strategy()),
            _ => None,
        }
    }

    /// The `/dev/shm` name of a `file_system` segment (torch's `_share_filename_`), e.g.
    /// `multiproc_1234_…`; `None` otherwise.
    pub fn shm_name(&self) -> Option<String> {
        match &*self.backing() {
            Backing::Shared { segment, .. } => segment.name().map(|n| n.as_str().to_owned()),
            _ => None,
        }
    }

    /// The address of the first byte, for identity checks (two tensors alias when they
    /// point into the same bytes) and FFI. It changes when
    /// [`share_memory_`](Self::share_memory_) moves the bytes. Reading or writing through
    /// it is `unsafe` and races with other threads and processes.
    pub fn data_ptr(&self) -> *mut u8 {
        self.read().ptr()
    }

    /// Whether two handles are the same storage.
    pub fn ptr_eq(a: &Storage, b: &Storage) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    /// Moves the bytes into shared memory, with the current
    /// [`get_sharing_strategy`](crate::get_sharing_strategy). Does nothing if already
    /// shared. Every tensor on this storage follows (torch's `share_memory_`).
    ///
    /// # Errors
    ///
    /// [`Error::OutOfSharedMemory`] (with the size asked, the free space and how to grow
    /// `/dev/shm`), [`Error::Manager`] (`file_system` needs the shm manager) or
    /// [`Error::Os`]. The storage is unchanged and usable (private) after an error.
    pub fn share_memory_(&self) -> Result<()> {
        self.share_memory_with(get_sharing_strategy())
    }

    /// [`share_memory_`](Self::share_memory_) with an explicit strategy.
    pub(crate) fn share_memory_with(&self, strategy: SharingStrategy) -> Result<()> {
        if self.is_shared() {
            return Ok(());
        }
        let mut backing = self
            .inner
            .backing
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let src: *const u8 = match &*backing {
            Backing::Shared { .. }
            | Backing::Empty { shared: true }
            | Backing::Cuda { .. }
            | Backing::ReadOnlyFile { .. } => return Ok(()),
            Backing::Empty { shared: false } => {
                *backing = Backing::Empty { shared: true };
                return Ok(());
            }
            Backing::Private(buf) => buf.ptr.as_ptr(),
            // A DLPack import is copied into shared memory, and its capsule released;
            // unless it is read-only, which a copy in a writable segment would undo.
            #[cfg(feature = "dlpack")]
            Backing::Foreign {
                read_only: true, ..
            } => {
                return Err(Error::Tensor(
                    "a read-only DLPack import cannot be shared or sent (a shared copy would \
                     be writable); make a writable copy with deep_clone() first"
                        .into(),
                ));
            }
            #[cfg(feature = "dlpack")]
            Backing::Foreign { ptr, .. } => ptr.as_ptr(),
        };
        let slice = shm::allocate(strategy, self.inner.nbytes)?;
        let segment = Arc::clone(slice.block.block());
        let dst = segment.data_ptr().wrapping_add(slice.offset);
        if slice.zeroed {
            // SAFETY: the slice holds `nbytes` bytes at `offset` (allocate's contract) and
            // the source `nbytes`; they cannot overlap (a fresh mapping vs the heap or a
            // foreign buffer); we hold the write lock, so no thread of this process touches
            // the source through this storage, and no other process has ever been told
            // about these fresh bytes.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, self.inner.nbytes) };
        } else {
            // SAFETY: as above, and `dst` is 64-byte aligned; the bytes of a recycled
            // block are written atomically (see `write_shared`).
            unsafe { write_shared(dst, Some(src), self.inner.nbytes) };
        }
        let key = StorageKey::new(&segment, slice.offset, self.inner.nbytes);
        *backing = Backing::Shared {
            segment,
            offset: slice.offset,
        };
        // A private storage keeps no use, so there is none to give back here.
        let none = self
            .inner
            .block_use
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(slice.block);
        // The write lock is released before the cache's lock is taken (the cache never
        // locks a backing, so the two locks are never nested).
        drop(backing);
        drop(none);
        with_storage_cache(|c| c.insert(key, &self.inner));
        Ok(())
    }

    fn backing(&self) -> RwLockReadGuard<'_, Backing> {
        self.inner
            .backing
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Read-locks the backing for element access.
    pub(crate) fn read(&self) -> StorageRead<'_> {
        let guard = self.backing();
        let (ptr, host) = match &*guard {
            Backing::Empty { .. } => (NonNull::<u64>::dangling().as_ptr().cast(), true),
            Backing::Private(buf) => (buf.ptr.as_ptr(), true),
            Backing::Shared { segment, offset } => (segment.data_ptr().wrapping_add(*offset), true),
            // A device address, as torch's `data_ptr` gives for CUDA tensors: never
            // dereferenced on the host (`is_host` is false).
            Backing::Cuda { memory, offset } => (
                (memory.device_ptr() as usize).wrapping_add(*offset) as *mut u8,
                false,
            ),
            // Never written through: every writer calls `check_writable` first.
            Backing::ReadOnlyFile { file, offset, .. } => {
                (file.data_ptr().wrapping_add(*offset).cast_mut(), true)
            }
            #[cfg(feature = "dlpack")]
            Backing::Foreign { ptr, .. } => (ptr.as_ptr(), true),
        };
        StorageRead {
            _guard: guard,
            ptr,
            len: self.inner.nbytes,
            host,
        }
    }

    /// The segment under a shared storage and where in it the bytes start.
    pub(crate) fn segment(&self) -> Option<(Arc<Segment>, usize)> {
        match &*self.backing() {
            Backing::Shared { segment, offset } => Some((Arc::clone(segment), *offset)),
            _ => None,
        }
    }

    /// A handle that does not keep the bytes alive, for caches keyed by storage
    /// identity.
    pub(crate) fn downgrade(&self) -> WeakStorage {
        WeakStorage(Arc::downgrade(&self.inner))
    }

    /// An order on storages, to lock two of them without deadlock.
    pub(crate) fn addr(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }
}

/// A storage that does not keep its bytes alive (see [`Storage::downgrade`]).
#[derive(Clone)]
pub(crate) struct WeakStorage(Weak<StorageInner>);

impl WeakStorage {
    /// Whether `storage` is this one (an address that a weak handle keeps from reuse).
    pub(crate) fn is(&self, storage: &Storage) -> bool {
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(&storage.inner))
    }

    /// Whether the storage still exists.
    pub(crate) fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Storage");
        d.field("nbytes", &self.nbytes());
        match &*self.backing() {
            Backing::Empty { shared } => d.field("shared", shared),
            Backing::Private(_) => d.field("shared", &false),
            Backing::Shared { segment, .. } => d.field("shared", &segment.strategy().name()),
            Backing::Cuda { memory, .. } => d.field("device", &Device::Cuda(memory.device())),
            Backing::ReadOnlyFile { file, name, .. } => d
                .field("read_only_file", &file.origin())
                .field("name", name),
            #[cfg(feature = "dlpack")]
            Backing::Foreign { read_only, .. } => d
                .field("shared", &false)
                .field("dlpack_read_only", read_only),
        };
        d.finish()
    }
}

/// The wire form of a storage.
#[derive(Serialize, Deserialize)]
enum StorageWire {
    Empty,
    Segment(SegmentHandle),
    Cuda(CudaHandle),
    /// A read-only file's fd (see `shm::file`); appended, so older codes keep their index.
    ReadOnlyFile(FileHandle),
}

/// A storage's wire form built from parts, for the fuzzing entry points that forge
/// handles (`crate::__fuzz`).
#[cfg(feature = "fuzzing")]
#[derive(Serialize)]
pub(crate) struct ForgedStorageWire(StorageWire);

#[cfg(feature = "fuzzing")]
impl ForgedStorageWire {
    /// A CUDA storage's handle.
    pub(crate) fn cuda(handle: CudaHandle) -> Self {
        ForgedStorageWire(StorageWire::Cuda(handle))
    }
}

impl Serialize for Storage {
    /// Inside a multiproc channel: moves the storage to shared memory if it is not yet
    /// (torch does the same), then writes its handle. Anywhere else: an error (a storage
    /// is a reference to memory, not data).
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = Encoder::current("a tensor").map_err(S::Error::custom)?;
        // One look at the backing says what the message names. Bytes still private (put,
        // not yet shared) move to shared memory first, like torch, and are looked at again.
        for _ in 0..2 {
            let nbytes = self.nbytes();
            // (The backing's lock is let go at the end of this statement: sharing takes it
            // to write.)
            let wire = match &*self.backing() {
                Backing::Cuda { memory, offset } => Some(StorageWire::Cuda(
                    cuda::send(&enc, memory, *offset, nbytes).map_err(S::Error::custom)?,
                )),
                Backing::ReadOnlyFile { file, offset, name } => {
                    Some(StorageWire::ReadOnlyFile(FileHandle {
                        file: Arc::clone(file),
                        offset: *offset as u64,
                        nbytes: nbytes as u64,
                        name: name.to_string(),
                    }))
                }
                Backing::Empty { shared: true } => Some(StorageWire::Empty),
                Backing::Shared { .. } if nbytes == 0 => Some(StorageWire::Empty),
                Backing::Shared { segment, offset } => Some(StorageWire::Segment(SegmentHandle {
                    segment: Arc::clone(segment),
                    offset: *offset as u64,
                    nbytes: nbytes as u64,
                    brought: None,
                })),
                _ => None,
            };
            match wire {
                Some(wire) => return wire.serialize(s),
                None => self
                    .share_memory_()
                    .map_err(|e| S::Error::custom(enc.fail(e)))?,
            }
        }
        Err(S::Error::custom(enc.fail(Error::Encode(
            "a storage that stays private after share_memory_".into(),
        ))))
    }
}

impl<'de> Deserialize<'de> for Storage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let wire = StorageWire::deserialize(d)?;
        if let StorageWire::Empty = wire {
            return Ok(Storage::empty_shared());
        }
        let dec = Decoder::current("a tensor").map_err(D::Error::custom)?;
        let fail = |e: Error| D::Error::custom(dec.fail(e));
        match wire {
            StorageWire::Empty => Ok(Storage::empty_shared()),
            StorageWire::Segment(SegmentHandle {
                segment,
                offset,
                nbytes,
                brought,
            }) => {
                let (Ok(offset), Ok(nbytes)) = (usize::try_from(offset), usize::try_from(nbytes))
                else {
                    return Err(fail(Error::InvalidMessage(format!(
                        "a storage of {nbytes} bytes at offset {offset} does not fit this machine"
                    ))));
                };
                Storage::from_segment(segment, offset, nbytes, brought).map_err(fail)
            }
            StorageWire::Cuda(handle) => {
                let (memory, offset, nbytes) =
                    cuda::receive(&dec, &handle).map_err(D::Error::custom)?;
                Ok(Storage::from_cuda(memory, offset, nbytes))
            }
            StorageWire::ReadOnlyFile(FileHandle {
                file,
                offset,
                nbytes,
                name,
            }) => {
                let (Ok(offset), Ok(nbytes)) = (usize::try_from(offset), usize::try_from(nbytes))
                else {
                    return Err(fail(Error::InvalidMessage(format!(
                        "read-only tensor {name:?} of {nbytes} bytes at offset {offset} does \
                         not fit this machine"
                    ))));
                };
                Storage::from_file(file, offset, nbytes, &name).map_err(fail)
            }
        }
    }
}

/// Where a shared storage's bytes are: its segment (by address: an entry is alive only
/// while its storage, and so its segment, is), offset and length.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct StorageKey(usize, usize, usize);

impl StorageKey {
    fn new(segment: &Arc<Segment>, offset: usize, nbytes: usize) -> StorageKey {
        StorageKey(Arc::as_ptr(segment) as usize, offset, nbytes)
    }
}

/// This process's shared storages, so a received handle finds the `Storage` it names.
type StorageCache = IdentityCache<StorageKey, StorageInner>;

static STORAGES: crate::sys::fork_local::ForkLocal<StorageCache> =
    crate::sys::fork_local::ForkLocal::new();

fn with_storage_cache<R>(f: impl FnOnce(&mut StorageCache) -> R) -> R {
    f(&mut STORAGES.lock())
}
