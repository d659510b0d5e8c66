//! Blocks: segments that their creator recycles (see `recycler`). A block's data starts
//! with a [`BLOCK_HEADER_LEN`]-byte header that counts its *uses* across processes;
//! either backend can hold one (a memfd block, or a named block whose block header
//! follows the named header).
//!
//! Uses: one per process holding a storage on the block, plus one per message in
//! flight that names it. The creator hands the block out again only at 0 uses, so a
//! process that crashes while holding a use pins the block (never corrupts it).
//!
//! A named block's *name* lives exactly as long as the block can be reached: its named
//! header's reference count is one for the creator's pool (while `pooled` is 1) plus
//! one per use, taken before the use and dropped after it. Whoever drops the last one
//! unlinks the name. So a receiver that keeps a block mapped for reuse (see `cache`)
//! holds no reference: once no tensor anywhere uses the block and its creator no longer
//! pools it, nothing can name it again, and its name goes.
//!
//! # Safety
//!
//! The header lies in memory every process that maps the block may write at any time:
//! it is only ever seen as atomics (see the parent module).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::named::{drop_reference, take_reference};
use super::{Backing, Segment, pid};
use crate::error::Result;
use crate::shm::SegmentName;

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
    /// Pid of the creator.
    creator_pid: AtomicU32,
    _reserved: [AtomicU32; 11],
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
            super::named::HEADER_LEN + BLOCK_HEADER_LEN,
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
    /// uses, and its creator no longer pools it or has exited. Keeping such a mapping
    /// only holds memory.
    pub(crate) fn is_dead_block(&self) -> bool {
        let Some(h) = self.block() else {
            return false;
        };
        if h.uses.load(Ordering::Acquire) != 0 {
            return false;
        }
        if h.pooled.load(Ordering::Acquire) == 0 {
            return true;
        }
        let creator = h.creator_pid.load(Ordering::Relaxed);
        creator == 0 || crate::sys::process::process_is_dead(creator)
    }
}
