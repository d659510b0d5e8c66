//! A mapped shared-memory segment, one backend per file: `anonymous` (a sealed memfd)
//! and `named` (a file in `/dev/shm` with a 64-byte header holding a cross-process
//! refcount); `block` is what makes either a *block* that its creator recycles (a
//! use-counting header at the start of the data, see `recycler`). This file holds what
//! all share: the type, its accessors and its drop.
//!
//! # Safety
//!
//! The mapping is memory other processes may write at any time. This module never makes
//! a Rust reference to the data; the only references it makes into the mapping are to the
//! header's atomics (`&AtomicU32`/`&AtomicU64`), which are defined for memory written
//! concurrently by atomics elsewhere. Every header access is in bounds because a named
//! segment's mapping is always at least [`HEADER_LEN`] bytes (checked before mapping).

use std::any::Any;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::name::SegmentName;
use super::strategy::SharingStrategy;
use crate::sys::mmap::SharedMapping;

mod anonymous;
mod block;
mod named;

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use block::BLOCK_MAGIC_BYTES;
pub(crate) use block::{ARENA_LEN, BLOCK_HEADER_LEN};
#[cfg(test)]
pub(crate) use named::HEADER_LEN;

/// What backs a segment.
#[derive(Debug)]
enum Backing {
    /// A sealed memfd; the fd is the handle, the kernel counts the references. In an
    /// `Arc` so a message can carry it without a `dup`.
    Anonymous {
        fd: Arc<OwnedFd>,
        dev: u64,
        ino: u64,
    },
    /// A named `/dev/shm` file.
    Named {
        name: SegmentName,
        /// The pid whose reference this value holds, 0 for none. A child created by
        /// `fork` inherits the value but not the reference, so it must not release it.
        owner_pid: AtomicI32,
    },
}

/// A shared-memory segment mapped into this process. Unmapped (and, for the last
/// user of a named one, unlinked) on drop.
#[derive(Debug)]
pub(crate) struct Segment {
    /// What a higher layer keeps with this mapping (a CUDA host registration of its
    /// pages). The first field, so it is dropped before `mapping` is unmapped.
    attachment: Attachment,
    mapping: SharedMapping,
    /// Offset of the data in the mapping: 0 anonymous, [`HEADER_LEN`] named.
    data_offset: usize,
    /// Bytes of data.
    len: usize,
    backing: Backing,
    /// Whether this is a block (see `recycler`): decided by whoever made the value — its
    /// creator, or a receiver from the *handle's* kind — never from bytes in the
    /// mapping, which a peer may have written.
    is_block: bool,
    /// The block's uses held by values of this process (its storages; see `block`).
    local_uses: AtomicU32,
}

/// A value a higher layer keeps with a mapping, set once (see [`Segment::attach_once`]).
/// This layer only holds and drops it; it never looks inside.
#[derive(Default)]
pub(crate) struct Attachment(Mutex<Option<Box<dyn Any + Send + Sync>>>);

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        f.write_str(if set {
            "Attachment(set)"
        } else {
            "Attachment(none)"
        })
    }
}

fn pid() -> i32 {
    crate::sys::process::cached_pid() as i32
}

impl Segment {
    /// The first data byte. Valid for [`len`](Self::len) bytes while `self` lives.
    pub(crate) fn data_ptr(&self) -> *mut u8 {
        self.mapping.as_ptr().wrapping_add(self.data_offset)
    }

    /// Bytes of data.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Which strategy made it.
    pub(crate) fn strategy(&self) -> SharingStrategy {
        match self.backing {
            Backing::Anonymous { .. } => SharingStrategy::FileDescriptor,
            Backing::Named { .. } => SharingStrategy::FileSystem,
        }
    }

    /// The memfd of an anonymous segment.
    pub(crate) fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.shared_fd().map(|fd| fd.as_fd())
    }

    /// The memfd of an anonymous segment, for a message to keep while it is sent.
    pub(crate) fn shared_fd(&self) -> Option<&Arc<OwnedFd>> {
        match &self.backing {
            Backing::Anonymous { fd, .. } => Some(fd),
            Backing::Named { .. } => None,
        }
    }

    /// Device and inode of an anonymous segment (its identity in the map cache).
    pub(crate) fn inode(&self) -> Option<(u64, u64)> {
        match &self.backing {
            Backing::Anonymous { dev, ino, .. } => Some((*dev, *ino)),
            Backing::Named { .. } => None,
        }
    }

    /// Keeps what `make` returns with this mapping, unless a value is kept already:
    /// `make` runs at most once per mapping (under a lock, so two threads cannot both
    /// run it). The value is dropped just before the mapping is unmapped. Whether
    /// `make` ran.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn attach_once<E>(
        &self,
        make: impl FnOnce() -> std::result::Result<Box<dyn Any + Send + Sync>, E>,
    ) -> std::result::Result<bool, E> {
        let mut slot = self
            .attachment
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return Ok(false);
        }
        *slot = Some(make()?);
        Ok(true)
    }

    /// The name of a named segment.
    pub(crate) fn name(&self) -> Option<&SegmentName> {
        match &self.backing {
            Backing::Named { name, .. } => Some(name),
            Backing::Anonymous { .. } => None,
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if let Backing::Named { owner_pid, name } = &self.backing {
            if owner_pid.load(Ordering::Acquire) == pid() {
                self.release_reference();
            }
            super::registry::forget(name);
        }
    }
}
