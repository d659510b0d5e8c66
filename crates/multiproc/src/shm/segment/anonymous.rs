//! The anonymous backend: a sealed memfd, created here or received (checked before it
//! is mapped), and blocks — memfds whose first [`BLOCK_HEADER_LEN`] bytes count their
//! uses across processes (see `recycler`).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use rustix::io::Errno;

use super::{Backing, Segment, pid};
use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::mmap::SharedMapping;

/// Bytes at the start of a pooled anonymous segment (a *block*, see `recycler`).
pub(crate) const BLOCK_HEADER_LEN: usize = 64;
/// Size of one arena block (header included; see `recycler`). A received block no
/// larger than this may be an arena, so it is mapped whole.
pub(crate) const ARENA_LEN: usize = 1 << 20;
/// The first bytes of a block.
pub(crate) const BLOCK_MAGIC_BYTES: [u8; 8] = *b"MPBLOCK1";
/// [`BLOCK_MAGIC_BYTES`] as a little-endian u64.
const BLOCK_MAGIC: u64 = u64::from_le_bytes(BLOCK_MAGIC_BYTES);

/// The header of a block: a memfd segment that its creator recycles once nobody uses
/// it. Every process that maps the block may read or write it at any time, so all
/// fields are atomics; a process that lies about them can only make its creator keep a
/// block too long or reuse a block whose bytes that process still reads.
#[repr(C)]
struct BlockHeader {
    magic: AtomicU64,
    /// Uses: one per process holding a storage on the block, plus one per message in
    /// flight that names it. The creator reuses the block only at 0, so a process that
    /// crashes while holding a use pins the block (never corrupts it).
    uses: AtomicU32,
    /// 1 while the creator keeps the block for reuse: receivers then keep it mapped too.
    pooled: AtomicU32,
    /// Pid of the creator.
    creator_pid: AtomicU32,
    _reserved: [AtomicU32; 11],
}

const _: () = assert!(std::mem::size_of::<BlockHeader>() == BLOCK_HEADER_LEN);

impl Segment {
    /// Creates an anonymous segment of `len > 0` bytes: a memfd whose pages are
    /// reserved and whose size is sealed.
    pub(crate) fn create_anonymous(len: usize) -> Result<Segment> {
        let fd = memfd::create("multiproc-tensor", len as u64)?;
        memfd::seal_size(fd.as_fd())?;
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::os("fstat of a new memfd", e))?;
        let mapping = SharedMapping::map(fd.as_fd(), len)?;
        Ok(Segment {
            mapping,
            data_offset: 0,
            len,
            backing: Backing::Anonymous {
                fd: Arc::new(fd),
                dev: st.st_dev,
                ino: st.st_ino,
            },
            is_block: false,
        })
    }

    /// Creates a block: an anonymous segment of `len > BLOCK_HEADER_LEN` bytes whose first
    /// [`BLOCK_HEADER_LEN`] bytes are a [`BlockHeader`] with no uses, pooled by this
    /// process.
    pub(crate) fn create_block(len: usize) -> Result<Segment> {
        let mut segment = Segment::create_anonymous(len.max(BLOCK_HEADER_LEN + 1))?;
        segment.is_block = true;
        let ptr = segment.mapping.as_ptr().cast::<BlockHeader>();
        // SAFETY: the mapping is page-aligned, longer than BLOCK_HEADER_LEN and lives as
        // long as `segment`; BlockHeader is all atomics, valid for any bit pattern.
        let h = unsafe { &*ptr };
        h.uses.store(0, Ordering::Relaxed);
        h.pooled.store(1, Ordering::Relaxed);
        h.creator_pid.store(pid() as u32, Ordering::Relaxed);
        h.magic.store(BLOCK_MAGIC, Ordering::Release);
        // Its pages are reserved already (fallocate); map them all now rather than
        // fault them in one by one as the first tensor is written.
        segment.mapping.populate();
        Ok(segment)
    }

    /// Maps a received memfd after checking it: it must be sealed against shrinking and
    /// hold at least `claimed` bytes. Only the claimed range is mapped (rounded up to a
    /// page): a peer that sends a huge sparse file and claims a little of it costs
    /// this process no more than the claim. The segment is plain, never a block,
    /// whatever its first bytes say.
    pub(crate) fn open_anonymous(fd: OwnedFd, claimed: u64) -> Result<Segment> {
        Segment::open_received(fd, claimed, false)
    }

    /// [`open_anonymous`](Self::open_anonymous) for a handle that names a block: the
    /// file must also start with a block header. An arena-sized block is mapped whole
    /// (later storages are carved anywhere in it); a larger one holds one storage and
    /// only the claimed range is mapped.
    pub(crate) fn open_block(fd: OwnedFd, claimed: u64) -> Result<Segment> {
        Segment::open_received(fd, claimed, true)
    }

    fn open_received(fd: OwnedFd, claimed: u64, as_block: bool) -> Result<Segment> {
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::os("fstat of a received segment", e))?;
        if !memfd::is_shrink_sealed(fd.as_fd()) {
            return Err(Error::InvalidMessage(
                "a received tensor's segment is not a memfd sealed against shrinking; \
                 refusing to map it (it could shrink under us and crash this process)"
                    .into(),
            ));
        }
        let size = st.st_size.max(0) as u64;
        if size < claimed || size == 0 {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle claims {claimed} bytes but its segment holds {size}"
            )));
        }
        if as_block && size <= BLOCK_HEADER_LEN as u64 {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle names a pooled block, but its segment of {size} \
                 bytes is too short for a block header"
            )));
        }
        let page = crate::sys::mmap::page_size() as u64;
        let wanted = if as_block && size <= ARENA_LEN as u64 {
            size
        } else {
            claimed.max(1).next_multiple_of(page).min(size)
        };
        let len = usize::try_from(wanted).map_err(|_| {
            Error::InvalidMessage(format!(
                "a received segment of {wanted} bytes cannot be mapped"
            ))
        })?;
        let mapping = SharedMapping::map(fd.as_fd(), len)?;
        let segment = Segment {
            mapping,
            data_offset: 0,
            len,
            backing: Backing::Anonymous {
                fd: Arc::new(fd),
                dev: st.st_dev,
                ino: st.st_ino,
            },
            is_block: as_block,
        };
        if as_block && segment.block().is_none() {
            return Err(Error::InvalidMessage(
                "a received tensor's handle names a pooled block, but its segment has no \
                 block header"
                    .into(),
            ));
        }
        Ok(segment)
    }

    /// The block header, when this is a block: made as one here, or received by a block
    /// handle, and still carrying the block magic.
    fn block(&self) -> Option<&BlockHeader> {
        match self.backing {
            Backing::Anonymous { .. } if self.is_block && self.mapping.len() > BLOCK_HEADER_LEN => {
                let ptr = self.mapping.as_ptr().cast::<BlockHeader>();
                // SAFETY: the mapping is page-aligned and longer than BLOCK_HEADER_LEN and
                // lives as long as `&self`; BlockHeader is all atomics, valid for any bit
                // pattern and for concurrent access from other processes.
                let h = unsafe { &*ptr };
                (h.magic.load(Ordering::Acquire) == BLOCK_MAGIC).then_some(h)
            }
            _ => None,
        }
    }

    /// Whether this is a block (a pooled anonymous segment with a use count).
    pub(crate) fn is_block(&self) -> bool {
        self.block().is_some()
    }

    /// Takes one use of a block (saturating; nothing for other segments).
    pub(crate) fn acquire_use(&self) {
        if let Some(h) = self.block() {
            let _ = h
                .uses
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_add(1));
        }
    }

    /// Gives one use of a block back (never below zero; nothing for other segments).
    pub(crate) fn release_use(&self) {
        if let Some(h) = self.block() {
            let _ = h
                .uses
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
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

    /// Says whether the creator keeps the block for reuse.
    pub(crate) fn set_pooled(&self, pooled: bool) {
        if let Some(h) = self.block() {
            h.pooled.store(u32::from(pooled), Ordering::Release);
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
        let creator = h.creator_pid.load(Ordering::Relaxed) as i32;
        match rustix::process::Pid::from_raw(creator) {
            Some(p) => rustix::process::test_kill_process(p) == Err(Errno::SRCH),
            None => true,
        }
    }
}
