//! A mapped shared-memory segment, one backend per file: `anonymous` (a sealed memfd)
//! and `named` (a file in `/dev/shm` with a 64-byte header holding a cross-process
//! refcount). This file holds what both share: the type, its accessors and its drop,
//! and what makes either a *block* that its creator recycles (a use-counting header at
//! the start of the data, see `recycler`), which every tensor's trip reads and writes.
//!
//! # Blocks
//!
//! Blocks are segments that their creator recycles (see `recycler`). A block's data starts
//! with a [`BLOCK_HEADER_LEN`]-byte header that counts its *uses* across processes;
//! either backend can hold one (a memfd block, or a named block whose block header
//! follows the named header).
//!
//! Uses: one per storage on the block, in any process, plus one per message in flight
//! that names it (those are also counted apart, `in_flight`). The creator hands the
//! block out again only at 0 uses.
//!
//! **Who still maps a block is the kernel's to say** (see `sys::lease`, marks): every
//! process that maps a block maps it through a description of its own that carries a
//! mark — the creator's on one byte, each holder's on another — and the kernel drops a
//! mark when its process unmaps the block or dies. The counts are the fast path; the
//! marks are the truth when a process dies holding uses. Its uses can then never be
//! given back by it, so the creator takes them back ([`Segment::reclaim_stale_uses`])
//! once no other process marks the block, no message in flight names it and it holds
//! no use itself: every use left is a dead process's. And a receiver lets a block go
//! when its creator's mark is gone (the creator exited or was killed), never by a pid
//! that may have been reused.
//!
//! A named block's *name* lives exactly as long as the block can be reached: its named
//! header's reference count is one for the creator's pool (while `pooled` is 1) plus
//! one per use, taken before the use and dropped after it (a reclaimed use drops its
//! reference too). Whoever drops the last one unlinks the name. So a receiver that
//! keeps a block mapped for reuse (see `cache`) holds no reference: once no tensor
//! anywhere uses the block and its creator no longer pools it, nothing can name it
//! again, and its name goes.
//!
//! # Safety
//!
//! The mapping is memory other processes may write at any time. This module never makes
//! a Rust reference to the data; the only references it makes into the mapping are to the
//! header's atomics (`&AtomicU32`/`&AtomicU64`), which are defined for memory written
//! concurrently by atomics elsewhere: a block's header is only ever seen as atomics.
//! Every header access is in bounds because a named segment's mapping is always at
//! least [`HEADER_LEN`] bytes (checked before mapping), and a block's at least
//! [`BLOCK_HEADER_LEN`].

use std::any::Any;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use super::name::SegmentName;
use super::strategy::SharingStrategy;
use crate::error::Result;
use crate::sys::lease;
use crate::sys::mmap::SharedMapping;
use named::{drop_reference, take_reference};

mod anonymous;
mod named;

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
    /// The block's uses held by values of this process (its storages; see the module docs' blocks).
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
    crate::sys::fork_local::cached_pid() as i32
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

// Blocks (see the module docs).

/// Bytes at the start of a block's data (its header).
pub(crate) const BLOCK_HEADER_LEN: usize = 64;
/// Size of one arena block (header included; see `recycler`). A received block no
/// larger than this may be an arena, so it is mapped whole.
pub(crate) const ARENA_LEN: usize = 1 << 20;
/// The first bytes of a block.
pub(crate) const BLOCK_MAGIC_BYTES: [u8; 8] = *b"MPBLOCK1";
/// [`BLOCK_MAGIC_BYTES`] as a little-endian u64.
const BLOCK_MAGIC: u64 = u64::from_le_bytes(BLOCK_MAGIC_BYTES);

/// The header of a block. All fields are atomics; a process that lies about them can
/// only make its creator keep a block too long or reuse a block whose bytes that
/// process still reads.
#[repr(C)]
struct BlockHeader {
    magic: AtomicU64,
    /// Uses (see the module docs).
    uses: AtomicU32,
    /// 1 while the creator keeps the block for reuse: receivers then keep it mapped too.
    pooled: AtomicU32,
    /// Pid of the creator (who made it, for `multiproc gc` and diagnostics; whether it
    /// lives is told by its mark).
    creator_pid: AtomicU32,
    /// The uses held by messages in flight (counted in `uses` too).
    in_flight: AtomicU32,
    _reserved: [AtomicU32; 10],
}

const _: () = assert!(std::mem::size_of::<BlockHeader>() == BLOCK_HEADER_LEN);

impl Segment {
    /// Creates the named block `name` of `len > BLOCK_HEADER_LEN` bytes of data (block
    /// header included): a named segment whose one reference is its creator's pool's
    /// (this value holds none).
    pub(crate) fn create_named_block(name: SegmentName, len: usize) -> Result<Segment> {
        let mut segment = Segment::create_named_with(
            name,
            len.max(BLOCK_HEADER_LEN + 1),
            named::HEADER_LEN + BLOCK_HEADER_LEN,
        )?;
        segment.mark_named_block();
        segment.init_block();
        Ok(segment)
    }

    /// Makes a segment this process just created (longer than [`BLOCK_HEADER_LEN`]) a
    /// block with no uses, pooled by this process, and maps all its pages (reserved
    /// already by `fallocate`) rather than fault them in one by one as the first tensor
    /// is written.
    pub(super) fn init_block(&mut self) {
        debug_assert!(self.len > BLOCK_HEADER_LEN);
        self.is_block = true;
        if let Some(h) = self.header_unchecked() {
            h.uses.store(0, Ordering::Relaxed);
            h.in_flight.store(0, Ordering::Relaxed);
            h.pooled.store(1, Ordering::Relaxed);
            h.creator_pid.store(pid() as u32, Ordering::Relaxed);
            h.magic.store(BLOCK_MAGIC, Ordering::Release);
        }
        self.mapping.populate();
    }

    /// The block header's place, when this value was made or received as a block.
    fn header_unchecked(&self) -> Option<&BlockHeader> {
        if !self.is_block || self.len <= BLOCK_HEADER_LEN {
            return None;
        }
        let ptr = self.data_ptr().cast::<BlockHeader>();
        // SAFETY: the data starts at a 64-byte aligned offset of a page-aligned mapping
        // (0, or the named header's 64 bytes), is longer than BLOCK_HEADER_LEN and lives
        // as long as `&self`; BlockHeader is all atomics, valid for any bit pattern and
        // for concurrent access from other processes.
        Some(unsafe { &*ptr })
    }

    /// The block header, when this is a block: made as one here, or received by a block
    /// handle, and still carrying the block magic.
    fn block(&self) -> Option<&BlockHeader> {
        self.header_unchecked()
            .filter(|h| h.magic.load(Ordering::Acquire) == BLOCK_MAGIC)
    }

    /// Whether this is a block.
    pub(crate) fn is_block(&self) -> bool {
        self.block().is_some()
    }

    /// Takes one use of a block (saturating; nothing for other segments). A named
    /// block's name gains a reference first, so it outlives the use.
    pub(crate) fn acquire_use(&self) {
        let Some(h) = self.block() else {
            return;
        };
        if let Some(named) = self.named_refcount() {
            if take_reference(named).is_err() {
                // Only a peer that wrote the header could have emptied a count we hold
                // a use or the pool's reference on; the block is left pinned.
                tracing::warn!("a named block has no references left while in use");
            }
        }
        let _ = h
            .uses
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_add(1));
    }

    /// Gives one use of a block back (never below zero; nothing for other segments). A
    /// named block's name then loses the use's reference, and the last one unlinks it.
    pub(crate) fn release_use(&self) {
        let Some(h) = self.block() else {
            return;
        };
        let released = h
            .uses
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1))
            .is_ok();
        if released {
            self.drop_block_reference();
        }
    }

    /// Takes a use for a value of this process (a storage): counted in the block and
    /// here.
    pub(crate) fn acquire_local_use(&self) {
        self.acquire_use();
        self.local_uses.fetch_add(1, Ordering::AcqRel);
    }

    /// A use a message brought becomes this process's: counted here (the block counts
    /// it already). Its `in_flight` count goes once the decode has succeeded
    /// ([`use_landed`](Self::use_landed)).
    pub(crate) fn adopt_local_use(&self) {
        self.local_uses.fetch_add(1, Ordering::AcqRel);
    }

    /// A use adopted here goes back to the message that brought it (its decode
    /// failed, and the packet is kept for another try): no longer counted here.
    pub(crate) fn local_uses_forget(&self) {
        let _ = self
            .local_uses
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
    }

    /// Gives back a use taken or adopted by a value of this process.
    pub(crate) fn release_local_use(&self) {
        // Before the block's count: `uses` never reads below what this process holds
        // (see `reclaim_stale_uses`).
        let _ = self
            .local_uses
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
        self.release_use();
    }

    /// Takes a use for a message about to be sent: counted as in flight until its
    /// receiver's decode succeeds ([`use_landed`](Self::use_landed)) or it is given
    /// back unread ([`give_back_in_flight_use`](Self::give_back_in_flight_use)).
    pub(crate) fn take_in_flight_use(&self) {
        if let Some(h) = self.block() {
            h.in_flight.fetch_add(1, Ordering::AcqRel);
        }
        self.acquire_use();
    }

    /// The use a message brought has been adopted by a decode that succeeded here.
    pub(crate) fn use_landed(&self) {
        if let Some(h) = self.block() {
            let _ = h
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
        }
    }

    /// Gives back the use of a message that is never received (dropped unread or
    /// unsent, or refused as malformed).
    pub(crate) fn give_back_in_flight_use(&self) {
        self.use_landed();
        self.release_use();
    }

    /// The creator's part (see the module docs): when this process created the block,
    /// holds no use of it, no message in flight names it and no other process marks it
    /// as a holder, every use left is one a dead process can never give back: they are
    /// taken back, with the name references they held. Returns how many. Cheap when
    /// there are none (no system call).
    ///
    /// Nothing in this process may take a new use of the block meanwhile except by
    /// receiving a message that names it (the caller keeps it out of its pool's
    /// allocations): such a message is counted in flight until its use has become
    /// local, and another process's holder mark is in place before its decode counts
    /// its message landed — so the checks below, in this order, can never miss a use
    /// that someone alive still holds.
    pub(crate) fn reclaim_stale_uses(&self) -> u32 {
        let Some(h) = self.block() else {
            return 0;
        };
        let uses = h.uses.load(Ordering::Acquire);
        if uses == 0 || !self.is_own_block() || h.in_flight.load(Ordering::Acquire) != 0 {
            return 0;
        }
        if self.holders_elsewhere() || self.local_uses.load(Ordering::Acquire) != 0 {
            return 0;
        }
        if h.uses
            .compare_exchange(uses, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return 0;
        }
        tracing::debug!(
            uses,
            "took back the uses of a block that only dead processes held"
        );
        for _ in 0..uses {
            self.drop_block_reference();
        }
        uses
    }

    /// Whether any other process maps the block as a holder (its mark; see the module
    /// docs). Asked from a description with no mark. `true` when unsure.
    fn holders_elsewhere(&self) -> bool {
        self.ask_marks(lease::MARK_HOLDER)
    }

    /// Whether the block's creator still maps it (its mark). `true` when unsure.
    pub(crate) fn creator_lives(&self) -> bool {
        self.ask_marks(lease::MARK_CREATOR)
    }

    /// Whether `byte` of the block's file is marked, asked from a description that
    /// holds no mark: a memfd's fd (the one messages carry), or the name opened anew.
    fn ask_marks(&self, byte: i64) -> bool {
        match &self.backing {
            Backing::Anonymous { fd, .. } => lease::is_marked(fd.as_fd(), byte),
            Backing::Named { name, .. } => {
                let path = crate::shm::name::shm_path(name);
                match crate::sys::fs::open_shm_file(&path, false) {
                    Ok(fd) => lease::is_marked(fd.as_fd(), byte),
                    // The name is gone: nobody can map it any more.
                    Err(rustix::io::Errno::NOENT) => false,
                    Err(_) => true,
                }
            }
        }
    }

    /// The uses of a block (`None` for other segments).
    pub(crate) fn uses(&self) -> Option<u32> {
        self.block().map(|h| h.uses.load(Ordering::Acquire))
    }

    /// Whether this process created the block.
    pub(crate) fn is_own_block(&self) -> bool {
        self.block()
            .is_some_and(|h| h.creator_pid.load(Ordering::Relaxed) == pid() as u32)
    }

    /// The pid of the block's creator, as its header says.
    pub(crate) fn block_creator(&self) -> Option<u32> {
        self.block().map(|h| h.creator_pid.load(Ordering::Relaxed))
    }

    /// Says the creator no longer keeps the block for reuse (once: later calls do
    /// nothing). A named block's name loses the pool's reference.
    pub(crate) fn unpool(&self) {
        if let Some(h) = self.block() {
            if h.pooled.swap(0, Ordering::AcqRel) == 1 {
                self.drop_block_reference();
            }
        }
    }

    /// Drops one reference of a named block's name (nothing for a memfd block), and
    /// unlinks the name when it was the last.
    fn drop_block_reference(&self) {
        if let Some(named) = self.named_refcount() {
            if drop_reference(named) == Some(true) {
                self.unlink_name();
            }
        }
    }

    /// The named header's reference count of a named block.
    fn named_refcount(&self) -> Option<&AtomicU32> {
        match self.backing {
            Backing::Named { .. } => self.named_header().map(|h| &h.refcount),
            Backing::Anonymous { .. } => None,
        }
    }

    /// Whether a block mapped here (not by its creator) can never be used again: no
    /// uses, and its creator no longer pools it or no longer maps it (exited, or was
    /// killed: its mark is gone). Keeping such a mapping only holds memory.
    pub(crate) fn is_dead_block(&self) -> bool {
        let Some(h) = self.block() else {
            return false;
        };
        if h.uses.load(Ordering::Acquire) != 0 {
            return false;
        }
        h.pooled.load(Ordering::Acquire) == 0 || !self.creator_lives()
    }
}

impl crate::wire::Landing for Segment {
    /// A decode adopted the use a message brought ([`Segment::use_landed`]).
    fn landed(&self) {
        self.use_landed();
    }
}

impl crate::wire::InFlightBlock for Segment {
    fn take_in_flight_use(&self) {
        Segment::take_in_flight_use(self);
    }

    fn give_back_in_flight_use(&self) {
        Segment::give_back_in_flight_use(self);
    }
}
