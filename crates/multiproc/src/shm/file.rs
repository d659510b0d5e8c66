//! Read-only file segments: the pages of a regular file (a safetensors weights file)
//! mapped shared and read-only, with the file's fd as the handle that travels.
//!
//! This is a third kind of segment beside the anonymous and named ones of
//! [`segment`](super::segment), kept apart because it differs in every respect that
//! matters: the bytes belong to a file on disk (N processes that map it share one
//! page-cache copy and add no private memory), nothing can write them (`PROT_READ`; every
//! in-place operation on a read-only storage is refused above, so none reaches the
//! kernels), and there is no header, refcount or pool: the kernel counts fds and mappings,
//! and the file outlives us all.
//!
//! What a segment is comes from the handle, never from bytes in the file: the wire form
//! [`FileHandle`] is its own variant. A received fd is checked with `fstat` before it is
//! mapped: a regular file, at least as long as the handle claims. A process maps each
//! file once (cache keyed by device+inode), so the same weights received twice, or by two
//! tensors, alias.
//!
//! Residual risk, as for named segments: a process of the same user that truncates the
//! file while it is mapped makes a later read of the lost pages a SIGBUS. The library's
//! own writer ([`crate::safetensors::save`]) writes a new file and renames it over the
//! old one, which leaves every existing mapping intact.

use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::identity_cache::IdentityCache;
use crate::sys;
use crate::sys::file_map::ReadOnlyMapping;
use crate::wire::{Decoder, Encoder};

/// A regular file mapped read-only and shared, whole.
pub(crate) struct FileSegment {
    mapping: Option<ReadOnlyMapping>,
    fd: Arc<OwnedFd>,
    /// How the file is known here, for errors: its path, or "a received file".
    origin: String,
}

impl fmt::Debug for FileSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileSegment")
            .field("origin", &self.origin)
            .field("len", &self.len())
            .finish()
    }
}

/// This process's mapped files, by (device, inode).
static FILES: crate::sys::fork_local::ForkLocal<IdentityCache<(u64, u64), FileSegment>> =
    crate::sys::fork_local::ForkLocal::new();

impl FileSegment {
    /// Maps an opened file read-only (once per process: the same file mapped twice is
    /// one mapping). It must be a regular file of at least `len` bytes (its size as the
    /// caller read it, before parsing what it maps); `origin` names it in errors.
    #[cfg_attr(not(feature = "safetensors"), allow(dead_code))]
    pub(crate) fn from_fd(fd: BorrowedFd<'_>, len: u64, origin: &str) -> Result<Arc<FileSegment>> {
        FileSegment::map(fd, len, origin)
    }

    /// Maps a received fd that must be a regular file of at least `claimed` bytes, or
    /// finds it already mapped here.
    pub(crate) fn receive(fd: BorrowedFd<'_>, claimed: u64) -> Result<Arc<FileSegment>> {
        FileSegment::map(fd, claimed, "a received read-only file")
    }

    fn map(fd: BorrowedFd<'_>, claimed: u64, origin: &str) -> Result<Arc<FileSegment>> {
        let st = sys::fs::status(fd, origin)?;
        if !st.is_regular_file {
            return Err(Error::InvalidMessage(format!(
                "{origin} is not a regular file (mode {:o}); refusing to map it",
                st.mode
            )));
        }
        let size = st.size;
        if size < claimed {
            return Err(Error::InvalidMessage(format!(
                "a read-only tensor's handle claims {claimed} bytes but {origin} holds {size}"
            )));
        }
        let key = (st.dev, st.ino);
        let mut files = FILES.lock();
        if let Some(live) = files.get(&key) {
            if claimed > live.len() as u64 {
                return Err(Error::InvalidMessage(format!(
                    "a read-only tensor's handle claims {claimed} bytes but {} was mapped here \
                     with {} (was it changed in place?)",
                    live.origin,
                    live.len()
                )));
            }
            return Ok(live);
        }
        let len = usize::try_from(size).map_err(|_| {
            Error::InvalidMessage(format!("{origin} of {size} bytes cannot be mapped"))
        })?;
        let mapping = if len == 0 {
            None
        } else {
            Some(ReadOnlyMapping::map(fd, len)?)
        };
        let owned = fd
            .try_clone_to_owned()
            .map_err(|e| Error::os(format!("duplicating the fd of {origin}"), e))?;
        let segment = Arc::new(FileSegment {
            mapping,
            fd: Arc::new(owned),
            origin: origin.to_owned(),
        });
        files.insert(key, &segment);
        Ok(segment)
    }

    /// The first byte of the file (dangling when it is empty). Valid for
    /// [`len`](Self::len) bytes while `self` lives; never written.
    pub(crate) fn data_ptr(&self) -> *const u8 {
        self.mapping
            .as_ref()
            .map_or(std::ptr::NonNull::<u64>::dangling().as_ptr().cast(), |m| {
                m.as_ptr()
            })
    }

    /// Bytes mapped (the file's size when it was mapped).
    pub(crate) fn len(&self) -> usize {
        self.mapping.as_ref().map_or(0, ReadOnlyMapping::len)
    }

    /// Its path, or "a received read-only file".
    pub(crate) fn origin(&self) -> &str {
        &self.origin
    }
}

/// The wire form of a read-only file storage.
#[derive(Serialize, Deserialize)]
struct FileHandleWire {
    /// Index of the file's fd in the message's fd table.
    index: u32,
    /// Where the storage's bytes start in the file.
    offset: u64,
    /// How many bytes the storage uses.
    nbytes: u64,
    /// The tensor's name (for errors: a write to it names it in every process).
    name: String,
}

/// A read-only file storage as a value inside a message: serializing attaches the
/// file's fd; deserializing checks and maps it (through the cache).
pub(crate) struct FileHandle {
    /// The file.
    pub(crate) file: Arc<FileSegment>,
    /// Where the storage's bytes start in it.
    pub(crate) offset: u64,
    /// How many bytes the storage uses.
    pub(crate) nbytes: u64,
    /// The tensor's name.
    pub(crate) name: String,
}

impl Serialize for FileHandle {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let index = Encoder::current("a read-only tensor")
            .map_err(S::Error::custom)?
            .attach_shared_fd(&self.file.fd);
        FileHandleWire {
            index,
            offset: self.offset,
            nbytes: self.nbytes,
            name: self.name.clone(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for FileHandle {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let w = FileHandleWire::deserialize(d)?;
        let dec = Decoder::current("a read-only tensor").map_err(D::Error::custom)?;
        let fail = |e: Error| D::Error::custom(dec.fail(e));
        let end = w.offset.checked_add(w.nbytes).ok_or_else(|| {
            fail(Error::InvalidMessage(format!(
                "read-only tensor {:?} claims {} bytes at offset {}, past any file",
                w.name, w.nbytes, w.offset
            )))
        })?;
        let file = dec
            .with_fd(w.index, |fd| FileSegment::receive(fd, end))
            .map_err(D::Error::custom)?
            .map_err(fail)?;
        Ok(FileHandle {
            file,
            offset: w.offset,
            nbytes: w.nbytes,
            name: w.name,
        })
    }
}
