//! A mapped shared-memory segment, one backend per file: `anonymous` (a sealed memfd)
//! and `named` (a file in `/dev/shm` with a 64-byte header holding a cross-process
//! refcount). This file holds what both share: the type, its accessors and its drop,
//! and what makes either a *block* that its creator recycles (a use-counting header of
//! two cache lines at the start of the data, see `recycler`), which every tensor's trip
//! reads and writes.
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
//! **Two lines of counts.** The header is two cache lines: the creator's process writes
//! only the first, every other process only the second. A producer makes tensors on an
//! arena while its consumer drops the ones before; with one line of counts both would
//! write it for every tensor, and it would cross between their cores twice per message
//! (the largest cost of a 4 KiB trip after the bytes themselves). So each line holds
//! counts that only grow — uses taken and given back, messages sent and settled
//! (received or given back unread) — and `uses` is the sum of what both sides took
//! less the sum of what both gave back, the given-back counts read first. A use is
//! given back after it was taken, so any use whose giving back that read sees has its
//! taking in the counts read after it: the difference is never below what is held, and
//! 0 means that nothing was held when the given-back counts were read. (Counts that
//! can go down, one per side, would not do: a use taken on one side and given back on
//! the other can make the two reads add up to 0 while a use is held.) The readers that
//! act on 0 — the creator's recycler, a receiver or a custody letting a dead block go —
//! read the other side's line when they decide, once per arena handed out again, not
//! per tensor.
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
    /// The pid of a block's creator, as its header said when this value was made (0
    /// for other segments): whether this process writes the creator's counts or the
    /// others' (see the module docs' blocks) is decided without reading the header's
    /// line, which the creator keeps writing.
    creator: u32,
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

/// Bytes at the start of a block's data (its header: two cache lines).
pub(crate) const BLOCK_HEADER_LEN: usize = 128;
/// Size of one arena block (header included; see `recycler`). A received block no
/// larger than this may be an arena, so it is mapped whole.
pub(crate) const ARENA_LEN: usize = 1 << 20;
/// The first bytes of a block.
pub(crate) const BLOCK_MAGIC_BYTES: [u8; 8] = *b"MPBLOCK2";
/// [`BLOCK_MAGIC_BYTES`] as a little-endian u64.
const BLOCK_MAGIC: u64 = u64::from_le_bytes(BLOCK_MAGIC_BYTES);

/// One side's counts of a block (see the module docs' blocks): four counters that only
/// ever grow, so that a sum over both sides read in the right order is never too low.
/// Generic over the atomic so that the model checker runs this code (`model`, below).
#[repr(C)]
struct Counts<C = AtomicU64> {
    /// Uses taken (a storage made or received, a message sent).
    taken: C,
    /// Uses given back.
    given: C,
    /// Messages sent that name the block.
    sent: C,
    /// Messages that named it and were received (their use became a storage) or given
    /// back unread.
    settled: C,
}

/// What [`Counts`] needs of a 64-bit atomic.
trait Count {
    fn load(&self, order: Ordering) -> u64;
}

impl Count for AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }
}

impl<C: Count> Counts<C> {
    /// Uses taken and not given back on both sides (`[creator, others]`). The given-back
    /// counts are read first: a use given back was taken before, so its taking is in the
    /// counts read after; 0 means that no use was held when the given-back counts were
    /// read (and none can be taken but by a holder). A peer that wrote the counts makes
    /// it anything, never less than 0.
    fn uses(sides: [&Self; 2]) -> u64 {
        Self::difference(sides, |c| &c.taken, |c| &c.given)
    }

    /// Messages in flight that name the block, on both sides (read as [`uses`](Self::uses)).
    fn in_flight(sides: [&Self; 2]) -> u64 {
        Self::difference(sides, |c| &c.sent, |c| &c.settled)
    }

    /// `up` less `down`, summed over both sides, every `down` read before any `up`.
    fn difference(sides: [&Self; 2], up: impl Fn(&Self) -> &C, down: impl Fn(&Self) -> &C) -> u64 {
        let [a, b] = sides;
        let down = (down(a).load(Ordering::Acquire)).wrapping_add(down(b).load(Ordering::Acquire));
        let up = (up(a).load(Ordering::Acquire)).wrapping_add(up(b).load(Ordering::Acquire));
        up.saturating_sub(down)
    }
}

/// The header of a block: the creator's line (what never changes, `pooled`, and the
/// creator's counts), then the others' line (every other process's counts). All
/// fields are atomics; a process that lies about them can only make its creator keep a
/// block too long or reuse a block whose bytes that process still reads.
#[repr(C, align(64))]
struct BlockHeader {
    magic: AtomicU64,
    /// Pid of the creator (who made it, for `multiproc gc` and diagnostics; whether it
    /// lives is told by its mark).
    creator_pid: AtomicU32,
    /// 1 while the creator keeps the block for reuse: receivers then keep it mapped too.
    pooled: AtomicU32,
    /// Written by the creator's process only.
    creator: Counts,
    _creator_line: [AtomicU64; 2],
    /// Written by every other process (a `fork` child of the creator included).
    others: Counts,
    _others_line: [AtomicU64; 4],
}

const _: () = assert!(std::mem::size_of::<BlockHeader>() == BLOCK_HEADER_LEN);
const _: () = assert!(std::mem::offset_of!(BlockHeader, others) == 64);

impl BlockHeader {
    fn uses(&self) -> u64 {
        Counts::uses([&self.creator, &self.others])
    }

    fn in_flight(&self) -> u64 {
        Counts::in_flight([&self.creator, &self.others])
    }
}

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
        self.creator = pid() as u32;
        if let Some(h) = self.block() {
            for counts in [&h.creator, &h.others] {
                for count in [&counts.taken, &counts.given, &counts.sent, &counts.settled] {
                    count.store(0, Ordering::Relaxed);
                }
            }
            h.pooled.store(1, Ordering::Relaxed);
            h.creator_pid.store(self.creator, Ordering::Relaxed);
            h.magic.store(BLOCK_MAGIC, Ordering::Release);
        }
        self.mapping.populate();
    }

    /// Reads the header of a segment received by a block handle: whether it carries the
    /// block magic, and its creator. Once per value: the header's first line is the
    /// one its creator keeps writing.
    fn read_block_header(&mut self) -> bool {
        let Some(h) = self.block() else {
            return false;
        };
        if h.magic.load(Ordering::Acquire) != BLOCK_MAGIC {
            return false;
        }
        self.creator = h.creator_pid.load(Ordering::Relaxed);
        true
    }

    /// The block header, when this value was made as a block here or received by a
    /// block handle (whose header carried the block magic when it was mapped: see
    /// `read_block_header`). The magic is not read again on each use: a peer that
    /// rewrote it could do no more than write the counts.
    fn block(&self) -> Option<&BlockHeader> {
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

    /// The counts this process writes: the creator's in the creator's process, the
    /// others' anywhere else (see the module docs' blocks).
    fn own_counts(&self) -> Option<&Counts> {
        let h = self.block()?;
        Some(if self.is_own_block() {
            &h.creator
        } else {
            &h.others
        })
    }

    /// Whether this is a block.
    pub(crate) fn is_block(&self) -> bool {
        self.block().is_some()
    }

    /// Takes one use of a block (nothing for other segments). A named block's name
    /// gains a reference first, so it outlives the use.
    pub(crate) fn acquire_use(&self) {
        let Some(counts) = self.own_counts() else {
            return;
        };
        if let Some(named) = self.named_refcount() {
            if take_reference(named).is_err() {
                // Only a peer that wrote the header could have emptied a count we hold
                // a use or the pool's reference on; the block is left pinned.
                tracing::warn!("a named block has no references left while in use");
            }
        }
        counts.taken.fetch_add(1, Ordering::AcqRel);
    }

    /// Gives one use of a block back (nothing for other segments). A named block's name
    /// then loses the use's reference, and the last one unlinks it.
    pub(crate) fn release_use(&self) {
        let Some(counts) = self.own_counts() else {
            return;
        };
        counts.given.fetch_add(1, Ordering::AcqRel);
        self.drop_block_reference();
    }

    /// Takes a use for a value of this process (a storage): counted in the block and
    /// here.
    pub(crate) fn acquire_local_use(&self) {
        self.acquire_use();
        self.local_uses.fetch_add(1, Ordering::AcqRel);
    }

    /// A use a message brought becomes this process's: counted here (the block counts
    /// it already). Its message counts as received once the decode has succeeded
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
        self.local_uses_forget();
        self.release_use();
    }

    /// Takes a use for a message about to be sent: counted as in flight until its
    /// receiver's decode succeeds ([`use_landed`](Self::use_landed)) or it is given
    /// back unread ([`give_back_in_flight_use`](Self::give_back_in_flight_use)).
    pub(crate) fn take_in_flight_use(&self) {
        let Some(counts) = self.own_counts() else {
            return;
        };
        // Sent before taken: `reclaim_stale_uses` reads the taken counts before the
        // sent ones, so a use a message took is never seen there without its message.
        counts.sent.fetch_add(1, Ordering::AcqRel);
        self.acquire_use();
    }

    /// The use a message brought has been adopted by a decode that succeeded here.
    pub(crate) fn use_landed(&self) {
        if let Some(counts) = self.own_counts() {
            counts.settled.fetch_add(1, Ordering::AcqRel);
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
    /// its message received — so the checks below, in this order, can never miss a use
    /// that someone alive still holds.
    pub(crate) fn reclaim_stale_uses(&self) -> u32 {
        let Some(h) = self.block() else {
            return 0;
        };
        let given = h.creator.given.load(Ordering::Acquire);
        let uses = h.uses();
        if uses == 0 || !self.is_own_block() || h.in_flight() != 0 {
            return 0;
        }
        if self.holders_elsewhere() || self.local_uses.load(Ordering::Acquire) != 0 {
            return 0;
        }
        // Given back on the creator's side, unless a count moved meanwhile.
        if h.uses() != uses
            || h.creator
                .given
                .compare_exchange(given, given + uses, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return 0;
        }
        let uses = u32::try_from(uses).unwrap_or(u32::MAX);
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
        self.block()
            .map(|h| u32::try_from(h.uses()).unwrap_or(u32::MAX))
    }

    /// Whether this process created the block.
    pub(crate) fn is_own_block(&self) -> bool {
        self.is_block && self.creator == pid() as u32
    }

    /// The pid of the block's creator, as its header said when this value was made.
    pub(crate) fn block_creator(&self) -> Option<u32> {
        self.is_block.then_some(self.creator)
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
        if h.uses() != 0 {
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

/// The block counts under the loom model checker, over process-local words: threads
/// stand for processes, an `UnsafeCell` for the block's bytes. The creator hands the
/// block out again (writes its bytes) only when [`Counts::uses`] and
/// [`Counts::in_flight`] say 0, so a use that is still held when it does is a data race
/// that loom reports. `.ci/run` runs it in release:
/// `cargo test --release -p multiproc --lib segment::model -- --ignored --nocapture`.
#[cfg(test)]
mod model {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicU64 as LoomU64};

    use crate::model_check::explore;

    impl Count for LoomU64 {
        fn load(&self, order: Ordering) -> u64 {
            LoomU64::load(self, order)
        }
    }

    fn counts(taken: u64, given: u64, sent: u64, settled: u64) -> Counts<LoomU64> {
        Counts {
            taken: LoomU64::new(taken),
            given: LoomU64::new(given),
            sent: LoomU64::new(sent),
            settled: LoomU64::new(settled),
        }
    }

    /// Two sides' counts, the block's bytes, and a mailbox for one message.
    struct Block {
        creator: Counts<LoomU64>,
        others: Counts<LoomU64>,
        bytes: UnsafeCell<u64>,
        mailbox: AtomicBool,
    }

    impl Block {
        fn sides(&self) -> [&Counts<LoomU64>; 2] {
            [&self.creator, &self.others]
        }

        /// A holder reads the bytes.
        fn read(&self) -> u64 {
            // SAFETY: loom checks this access against the creator's write below.
            self.bytes.with(|p| unsafe { *p })
        }

        /// The creator's recycler: hands the block out again when nothing uses it.
        fn recycle_if_free(&self) -> bool {
            let free = Counts::uses(self.sides()) == 0 && Counts::in_flight(self.sides()) == 0;
            if free {
                // SAFETY: as in `read`.
                self.bytes.with_mut(|p| unsafe { *p = 1 });
            }
            free
        }
    }

    fn add(c: &LoomU64) {
        c.fetch_add(1, Ordering::AcqRel);
    }

    /// A use moves from a consumer back to the creator while the creator's recycler
    /// looks: the consumer (`others`) holds the use its message brought, sends the
    /// tensor back (a message taken on its side) and drops its own; the creator receives
    /// it (settled on its side), reads it and drops it. A use taken on one side and
    /// given back on the other: summed in the other order (taken first), the recycler
    /// can read 0 while the creator still holds the tensor, and loom finds the race.
    #[test]
    #[ignore = "model checker: .ci/run runs it in release (cargo test --release --lib segment::model -- --ignored)"]
    fn a_block_goes_back_to_its_creator_while_its_recycler_looks() {
        let runs = explore(3, || {
            // The creator sent one message; the consumer received it.
            let block = Arc::new(Block {
                creator: counts(1, 0, 1, 0),
                others: counts(0, 0, 0, 1),
                bytes: UnsafeCell::new(0),
                mailbox: AtomicBool::new(false),
            });
            let consumer = {
                let b = Arc::clone(&block);
                loom::thread::spawn(move || {
                    b.read();
                    add(&b.others.sent);
                    add(&b.others.taken);
                    b.mailbox.store(true, Ordering::Release);
                    b.read();
                    add(&b.others.given);
                })
            };
            let receiver = {
                let b = Arc::clone(&block);
                loom::thread::spawn(move || {
                    while !b.mailbox.load(Ordering::Acquire) {
                        loom::thread::yield_now();
                    }
                    add(&b.creator.settled);
                    b.read();
                    add(&b.creator.given);
                })
            };
            block.recycle_if_free();
            consumer.join().unwrap();
            receiver.join().unwrap();
            assert!(block.recycle_if_free(), "every use was given back");
        });
        eprintln!("block counts model, a use back to its creator: {runs} interleavings");
        assert!(runs > 1);
    }

    /// The fresh-tensor trip: the creator makes a tensor on the block, sends it and
    /// drops its own; two consumers each receive one such message, read and drop it;
    /// the recycler looks meanwhile. It may hand the block out again only after both.
    #[test]
    #[ignore = "model checker: .ci/run runs it in release (cargo test --release --lib segment::model -- --ignored)"]
    fn two_consumers_drop_what_one_producer_sent_while_its_recycler_looks() {
        let runs = explore(3, || {
            let block = Arc::new(Block {
                creator: counts(0, 0, 0, 0),
                others: counts(0, 0, 0, 0),
                bytes: UnsafeCell::new(0),
                mailbox: AtomicBool::new(false),
            });
            // The producer's two tensors, sent: a use each for the messages.
            for _ in 0..2 {
                add(&block.creator.taken);
                add(&block.creator.sent);
                add(&block.creator.taken);
                add(&block.creator.given);
            }
            let consumers: Vec<_> = (0..2)
                .map(|_| {
                    let b = Arc::clone(&block);
                    loom::thread::spawn(move || {
                        add(&b.others.settled);
                        b.read();
                        add(&b.others.given);
                    })
                })
                .collect();
            block.recycle_if_free();
            for c in consumers {
                c.join().unwrap();
            }
            assert!(block.recycle_if_free(), "every use was given back");
        });
        eprintln!("block counts model, 1 producer x 2 consumers: {runs} interleavings");
        assert!(runs > 1);
    }
}
