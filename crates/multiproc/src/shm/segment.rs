//! A mapped shared-memory segment: anonymous (a sealed memfd) or named (a file in
//! `/dev/shm` with a 64-byte header holding a cross-process refcount).
//!
//! # Safety
//!
//! The mapping is memory other processes may write at any time. This module never makes
//! a Rust reference to the data; the only references it makes into the mapping are to the
//! header's atomics (`&AtomicU32`/`&AtomicU64`), which are defined for memory written
//! concurrently by atomics elsewhere. Every header access is in bounds because a named
//! segment's mapping is always at least [`HEADER_LEN`] bytes (checked before mapping).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

use super::name::{SegmentName, shm_path};
use super::strategy::SharingStrategy;
use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::mmap::SharedMapping;

/// Bytes before the data of a named segment.
pub(crate) const HEADER_LEN: usize = 64;
/// `b"MPSHMSEG"` as a little-endian u64.
const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"MPSHMSEG");
/// The header layout version; a segment of another version is refused.
const HEADER_VERSION: u32 = 1;

/// The header at the start of a named segment. All fields are atomics because every
/// process that maps the segment may read or write them at any time.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    /// How many processes hold a reference (one per process that maps it, plus one per
    /// message in flight). Whoever takes it to zero unlinks the name.
    refcount: AtomicU32,
    /// Bytes of data after the header.
    data_len: AtomicU64,
    /// Pid of the creator (for diagnostics and `multiproc gc`).
    creator_pid: AtomicU32,
    _reserved: [AtomicU32; 9],
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_LEN);

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
}

fn pid() -> i32 {
    crate::sys::process::cached_pid() as i32
}

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

    /// Creates the named segment `name` with `len` bytes of data, refcount 1 (ours).
    /// On failure nothing is left in `/dev/shm`.
    pub(crate) fn create_named(name: SegmentName, len: usize) -> Result<Segment> {
        let path = shm_path(&name);
        let total = HEADER_LEN
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument(format!("a {len}-byte segment is too large")))?;
        let fd = rustix::fs::open(
            &path,
            OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(|e| Error::os(format!("creating shared-memory segment {path}"), e))?;
        let made = memfd::reserve(
            fd.as_fd(),
            total as u64,
            &format!("the shared-memory segment {path}"),
            memfd::Place::DevShm {
                header: HEADER_LEN as u64,
            },
        )
        .and_then(|()| SharedMapping::map(fd.as_fd(), total));
        let mapping = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = rustix::fs::unlink(&path);
                return Err(e);
            }
        };
        let segment = Segment {
            mapping,
            data_offset: HEADER_LEN,
            len,
            backing: Backing::Named {
                name,
                owner_pid: AtomicI32::new(pid()),
            },
            is_block: false,
        };
        if let Some(h) = segment.header() {
            h.data_len.store(len as u64, Ordering::Relaxed);
            h.version.store(HEADER_VERSION, Ordering::Relaxed);
            h.creator_pid.store(pid() as u32, Ordering::Relaxed);
            h.refcount.store(1, Ordering::Relaxed);
            h.magic.store(HEADER_MAGIC, Ordering::Release);
        }
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

    /// Maps the named segment `name` after checking it (a regular file of ours, mode
    /// 0600, with our header, holding at least `claimed` bytes of data). The
    /// in-flight reference the sender took becomes this process's reference.
    pub(crate) fn open_named(name: SegmentName, claimed: u64) -> Result<Segment> {
        let path = shm_path(&name);
        let fd = match rustix::fs::open(
            &path,
            OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                return Err(Error::InvalidMessage(format!(
                    "shared-memory segment {path} no longer exists: its last user released it, or the \
                     shm manager removed it after every process that used it had exited"
                )));
            }
            Err(Errno::LOOP) => {
                return Err(Error::InvalidMessage(format!(
                    "{path} is a symbolic link, not a shared-memory segment; refusing to open it"
                )));
            }
            Err(e) => {
                return Err(Error::os(
                    format!("opening shared-memory segment {path}"),
                    e,
                ));
            }
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::os(format!("fstat of {path}"), e))?;
        let me = rustix::process::geteuid().as_raw();
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
            || st.st_uid != me
            || st.st_mode & 0o077 != 0
        {
            return Err(Error::InvalidMessage(format!(
                "{path} is not a private shared-memory segment of this user (uid {}, mode {:o}); \
                 refusing to map it",
                st.st_uid,
                st.st_mode & 0o7777
            )));
        }
        let size = st.st_size.max(0) as u64;
        let needed = claimed.checked_add(HEADER_LEN as u64);
        if needed.is_none_or(|n| size < n) {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle claims {claimed} bytes but segment {path} holds {}",
                size.saturating_sub(HEADER_LEN as u64)
            )));
        }
        // The whole file is mapped (the size is known to cover the claim and the header);
        // the header then says how much of it is data.
        let total = usize::try_from(size).map_err(|_| {
            Error::InvalidMessage(format!("segment {path} of {size} bytes cannot be mapped"))
        })?;
        let mapping = SharedMapping::map(fd.as_fd(), total)?;
        let mut segment = Segment {
            mapping,
            data_offset: HEADER_LEN,
            len: 0,
            // No reference yet: if a check below fails, dropping must not release the
            // sender's in-flight reference on our behalf.
            backing: Backing::Named {
                name,
                owner_pid: AtomicI32::new(0),
            },
            is_block: false,
        };
        let h = segment
            .header()
            .ok_or_else(|| Error::InvalidMessage(format!("{path} has no header")))?;
        let magic = h.magic.load(Ordering::Acquire);
        let version = h.version.load(Ordering::Relaxed);
        let data_len = h.data_len.load(Ordering::Relaxed);
        if magic != HEADER_MAGIC || version != HEADER_VERSION {
            return Err(Error::InvalidMessage(format!(
                "{path} does not carry a multiproc segment header of version {HEADER_VERSION}"
            )));
        }
        if data_len < claimed || data_len > size - HEADER_LEN as u64 {
            return Err(Error::InvalidMessage(format!(
                "a received tensor's handle claims {claimed} bytes; the header of {path} says {data_len} \
                 and the file holds {}",
                size - HEADER_LEN as u64
            )));
        }
        if h.refcount.load(Ordering::Acquire) == 0 {
            return Err(Error::InvalidMessage(format!(
                "{path} has no references left (it is being removed); the message that named it \
                 was probably sent twice or forged"
            )));
        }
        segment.len = data_len as usize;
        segment.adopt_reference();
        Ok(segment)
    }

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

    /// The name of a named segment.
    pub(crate) fn name(&self) -> Option<&SegmentName> {
        match &self.backing {
            Backing::Named { name, .. } => Some(name),
            Backing::Anonymous { .. } => None,
        }
    }

    fn header(&self) -> Option<&Header> {
        match self.backing {
            Backing::Named { .. } if self.mapping.len() >= HEADER_LEN => {
                let ptr = self.mapping.as_ptr().cast::<Header>();
                // SAFETY: the mapping is page-aligned and at least HEADER_LEN bytes long and
                // lives as long as `&self`; Header is all atomics, valid for any bit pattern
                // and for concurrent access from other processes.
                Some(unsafe { &*ptr })
            }
            _ => None,
        }
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

    /// Maps the pages of `offset..offset + len` of the data now (clamped to the
    /// mapping): for a received segment, only what the tensor covers.
    pub(crate) fn populate_range(&self, offset: u64, len: u64) {
        self.mapping.populate_range(offset, len);
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

    /// The current cross-process refcount of a named segment (tests).
    #[cfg(test)]
    pub(crate) fn refcount(&self) -> Option<u32> {
        self.header().map(|h| h.refcount.load(Ordering::Acquire))
    }

    /// Makes the in-flight reference a message carried this process's own reference.
    fn adopt_reference(&self) {
        if let Backing::Named { owner_pid, .. } = &self.backing {
            owner_pid.store(pid(), Ordering::Release);
        }
    }

    /// Called when a received named handle finds the segment already mapped here:
    /// the message's in-flight reference is not needed, unless this value holds no
    /// reference for this process, in which case it adopts it. (The map cache does not
    /// hand a `fork` child its parent's segments, so that case is defensive.)
    pub(crate) fn absorb_in_flight(&self) {
        if let Backing::Named { owner_pid, .. } = &self.backing {
            let me = pid();
            let held = owner_pid.load(Ordering::Acquire);
            if held != me
                && owner_pid
                    .compare_exchange(held, me, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return;
            }
            self.release_reference();
        }
    }

    /// Takes a reference on behalf of a message about to carry this named segment's
    /// name. Fails when no reference is left (the name is being removed).
    pub(crate) fn acquire_in_flight(&self) -> Result<()> {
        let Some(h) = self.header() else {
            return Ok(());
        };
        take_reference(&h.refcount).map_err(|cur| {
            Error::Encode(format!(
                "shared-memory segment {} cannot be sent: its reference count is {cur}",
                self.name().map_or_else(String::new, shm_path)
            ))
        })
    }

    /// Drops one reference of a named segment; the last one unlinks the name and tells
    /// the shm manager. Never goes below zero (a forged count is left alone).
    pub(crate) fn release_reference(&self) {
        let (Some(h), Some(name)) = (self.header(), self.name()) else {
            return;
        };
        let Some(last) = drop_reference(&h.refcount) else {
            tracing::warn!(segment = %name, "released a segment whose refcount is already 0");
            return;
        };
        if last {
            match rustix::fs::unlink(shm_path(name)) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => tracing::warn!(segment = %name, "cannot unlink: {e}"),
            }
            super::registry::unregister(name);
        }
    }
}

/// Takes one more reference on a cross-process count, unless none is left (the name is
/// being removed) or the count is saturated; `Err(count)` then.
pub(super) fn take_reference(refcount: &AtomicU32) -> std::result::Result<(), u32> {
    let mut cur = refcount.load(Ordering::Acquire);
    loop {
        if cur == 0 || cur == u32::MAX {
            return Err(cur);
        }
        match refcount.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok(()),
            Err(v) => cur = v,
        }
    }
}

/// Drops one reference; `Some(true)` when it was the last one, `None` when the count
/// was already 0 (a forged or doubly released count is left alone, never wrapped).
pub(super) fn drop_reference(refcount: &AtomicU32) -> Option<bool> {
    let mut cur = refcount.load(Ordering::Acquire);
    loop {
        if cur == 0 {
            return None;
        }
        match refcount.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(cur == 1),
            Err(v) => cur = v,
        }
    }
}

impl Segment {
    /// Releases the reference this process holds, if any, so that a process about to
    /// end without running destructors (a worker leaving with `_exit`, whose memory
    /// still holds copies of its parent's handles after a `fork`) leaves no count
    /// behind. The mapping stays valid until the process ends.
    pub(crate) fn release_before_exit(&self) {
        if let Backing::Named { owner_pid, .. } = &self.backing {
            let me = pid();
            if owner_pid
                .compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.release_reference();
            }
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

/// The cross-process refcount's logic on process-local memory (runs under Miri).
#[cfg(test)]
mod refcount_tests {
    use super::*;

    #[test]
    fn references_are_counted_and_never_wrap() {
        let count = AtomicU32::new(1);
        assert_eq!(take_reference(&count), Ok(()));
        assert_eq!(drop_reference(&count), Some(false));
        assert_eq!(drop_reference(&count), Some(true), "the last one");
        assert_eq!(drop_reference(&count), None, "never below zero");
        assert_eq!(
            take_reference(&count),
            Err(0),
            "a removed name is not revived"
        );
        let full = AtomicU32::new(u32::MAX);
        assert_eq!(take_reference(&full), Err(u32::MAX), "never wraps");
    }

    #[test]
    fn concurrent_takes_and_drops_balance_and_one_drop_is_the_last() {
        let count = std::sync::Arc::new(AtomicU32::new(1));
        let rounds = if cfg!(miri) { 20 } else { 10_000 };
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let count = std::sync::Arc::clone(&count);
                std::thread::spawn(move || {
                    for _ in 0..rounds {
                        take_reference(&count).unwrap();
                        assert_eq!(drop_reference(&count), Some(false));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(count.load(Ordering::Acquire), 1);
        assert_eq!(drop_reference(&count), Some(true));
    }
}
