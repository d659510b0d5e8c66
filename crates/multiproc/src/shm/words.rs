//! [`SharedWords`]: a page of process-shared 32-bit atomic words in a sealed memfd,
//! optionally followed by a byte area — the state of every sync primitive, and of a
//! queue's ring, custody and counters.
//!
//! # Safety
//!
//! A [`SharedWords`] is one page of shared memory holding 32-bit atomic words that
//! several processes update together, optionally followed by a byte area (a queue's
//! ring of messages). The unsafe code turns a word's address into `&AtomicU32`, and
//! copies bytes between the byte area and process-local buffers: addresses are in
//! bounds (checked on every call) and words 4-byte aligned (the mapping is
//! page-aligned), the mapping lives as long as the block (the reference borrows the
//! block), and atomics may be written concurrently by anyone, other processes
//! included. The byte area is never handed out as a reference: other processes may
//! write it at any moment, so it is only copied in and out, and what is copied out is
//! untrusted bytes that the caller validates.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::mmap::SharedMapping;
use crate::wire::{Decoder, Encoder};

/// Size of a block's page of words in bytes; it holds [`WORDS`] atomic words.
const BLOCK_BYTES: usize = 4096;
/// The number of `AtomicU32` words in a block.
pub(crate) const WORDS: usize = BLOCK_BYTES / 4;
/// First word: identifies the block's kind so a handle of one kind is never taken for another.
const KIND_WORD: usize = 0;
/// The last word: the next *holder id* of the page (see [`SharedWords::holder_id`]).
const NEXT_HOLDER: usize = WORDS - 1;
/// Entries of the table of recent holder ids and their pids (two words each), below
/// [`NEXT_HOLDER`]: for the error that names a dead lock holder.
const HOLDER_PIDS: usize = 64;
/// The first word of the holder table; every owner of the page's words stays below it.
pub(crate) const FIRST_RESERVED_WORD: usize = NEXT_HOLDER - 2 * HOLDER_PIDS;

/// This process's mark on a page (see [`SharedWords::holder_id`]): a second mapping of
/// the page through a description of its own that carries an open-file-description
/// lock on byte `id`, so that the mark lasts exactly as long as this process maps it.
#[derive(Default)]
struct Marker {
    /// The holder id (0: none made yet).
    id: u32,
    /// The values of the page in this process (the mark goes with the last: a lock
    /// taken through one value stays held through the others).
    values: usize,
    /// The mapping that keeps the mark.
    mapping: Option<SharedMapping>,
}

type Markers = Option<HashMap<(u64, u64), Marker>>;

/// The markers of this process, by the page's file identity (a page received twice is
/// two values but one holder, so a lock held through one is held through the other);
/// rebuilt in a `fork` child (its parent's marks are its parent's).
static MARKERS: crate::sys::fork_local::ForkLocal<Markers> =
    crate::sys::fork_local::ForkLocal::new();

/// `AtomicU32::fetch_update` for a word that other cores write: its first read is a
/// read-modify-write (`fetch_add(0)`), not a load. A word another core wrote last is a
/// cache miss either way, but a load then a compare-and-swap fetches its line twice —
/// shared to read it, then exclusive to write it — while a read-modify-write fetches it
/// once, exclusive, so the compare-and-swap after it finds the line here. (A use count
/// or a queue's count that the putter and the getter both write pays this on every
/// message.)
pub(crate) fn update_word(
    word: &AtomicU32,
    mut f: impl FnMut(u32) -> Option<u32>,
) -> std::result::Result<u32, u32> {
    let mut current = word.fetch_add(0, Ordering::AcqRel);
    while let Some(next) = f(current) {
        match word.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(previous) => return Ok(previous),
            Err(actual) => current = actual,
        }
    }
    Err(current)
}

/// One page of process-shared atomic words, backed by a sealed memfd.
///
/// Sync primitives and queue counters live in these. The block travels between
/// processes as its fd ([`Serialize`] through a multiproc channel only).
#[derive(Debug)]
pub(crate) struct SharedWords {
    fd: OwnedFd,
    map: SharedMapping,
    /// Bytes of the byte area after the page of words.
    bytes: usize,
    /// The page's file identity (`dev`, `ino`): the same for every value of the page.
    identity: (u64, u64),
    /// The pid of the process that counts this value among the page's values in its
    /// marks (0: none yet; a `fork` child sees its parent's and counts it again).
    counted_by: AtomicU32,
    /// This process's holder id on the page, tagged with its pid (`pid << 32 | id`; 0
    /// for none yet): a `fork` child sees its parent's pid and makes its own.
    holder: AtomicU64,
}

impl SharedWords {
    /// A new zeroed block tagged with `kind` (a nonzero constant of the owner type).
    pub(crate) fn new(kind: u32) -> Result<Self> {
        Self::with_bytes(kind, 0)
    }

    /// A new zeroed block tagged with `kind`, with a byte area of `bytes` bytes after
    /// its page of words.
    pub(crate) fn with_bytes(kind: u32, bytes: usize) -> Result<Self> {
        let total = BLOCK_BYTES + bytes;
        let fd = memfd::create("multiproc-sync", total as u64)?;
        memfd::seal_size(fd.as_fd())?;
        let map = SharedMapping::map(fd.as_fd(), total)?;
        let st = crate::sys::fs::status(fd.as_fd(), "a new page of shared words")?;
        let block = Self::counted(fd, map, bytes, (st.dev, st.ino));
        block
            .word(KIND_WORD)
            .store(kind, std::sync::atomic::Ordering::Release);
        Ok(block)
    }

    /// Maps a received block, checking that it is a sealed memfd of the right size
    /// (a page of words and `bytes` more) and kind.
    fn open(fd: OwnedFd, kind: u32, bytes: usize, what: &str) -> Result<Self> {
        if !memfd::is_shrink_sealed(fd.as_fd()) {
            return Err(Error::InvalidMessage(format!(
                "the handle received as {what} is not a sealed multiproc memfd: did the \
                 sender send another type?"
            )));
        }
        let total = BLOCK_BYTES + bytes;
        let st = crate::sys::fs::status(fd.as_fd(), &format!("the handle received as {what}"))?;
        let size = st.size;
        if size < total as u64 {
            return Err(Error::InvalidMessage(format!(
                "the handle received as {what} is {size} bytes, fewer than the {total} it needs"
            )));
        }
        let map = SharedMapping::map(fd.as_fd(), total)?;
        let block = Self::counted(fd, map, bytes, (st.dev, st.ino));
        let found = block
            .word(KIND_WORD)
            .load(std::sync::atomic::Ordering::Acquire);
        if found != kind {
            return Err(Error::InvalidMessage(format!(
                "the handle sent as {what} is a shared block of another kind ({found:#x})"
            )));
        }
        Ok(block)
    }

    /// Maps a block whose fd came another way than in a message (a benchmark's child
    /// inherits it), checked as a received one is: a sealed memfd of a page, of `kind`.
    #[cfg(feature = "bench-internals")]
    pub(crate) fn open_inherited(fd: OwnedFd, kind: u32, what: &str) -> Result<Self> {
        Self::open(fd, kind, 0, what)
    }

    /// The block's fd, to hand to a process another way than in a message.
    #[cfg(feature = "bench-internals")]
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The value, counted among this process's values of the page (see [`Marker`]).
    fn counted(fd: OwnedFd, map: SharedMapping, bytes: usize, identity: (u64, u64)) -> Self {
        let block = Self {
            fd,
            map,
            bytes,
            identity,
            counted_by: AtomicU32::new(0),
            holder: AtomicU64::new(0),
        };
        block.count_in(&mut MARKERS.lock());
        block
    }

    /// This process's *holder id* on the page: a number no other process of the page
    /// ever had, which a lock word holds while this process holds the lock, and which
    /// the kernel vouches for (see `sys::lease`, marks): this process marks byte `id` of
    /// the page's file for as long as it lives and holds a value of the page, so
    /// [`holder_lives`] tells a dead holder without a pid, which could have been reused.
    /// Every value of one page in a process has the same id. The first ask in a process
    /// costs an `open`, an `fcntl` and an `mmap`; later ones none.
    ///
    /// [`holder_lives`]: Self::holder_lives
    pub(crate) fn holder_id(&self) -> Result<u32> {
        if let Some(id) = self.cached_id() {
            return Ok(id);
        }
        let mut markers = MARKERS.lock();
        let mark = self.count_in(&mut markers);
        if mark.id == 0 {
            // Never 0 (a free lock word); a page that hands out 2^32 ids wraps.
            let id = match self.word(NEXT_HOLDER).fetch_add(1, Ordering::AcqRel) {
                u32::MAX => self.word(NEXT_HOLDER).fetch_add(1, Ordering::AcqRel),
                n => n,
            } + 1;
            let entry = FIRST_RESERVED_WORD + 2 * (id as usize % HOLDER_PIDS);
            self.word(entry + 1)
                .store(crate::sys::fork_local::cached_pid(), Ordering::Release);
            self.word(entry).store(id, Ordering::Release);
            let marked =
                crate::sys::lease::marked_description(self.fd.as_fd(), i64::from(id), false)?;
            let mapping = SharedMapping::map(marked.as_fd(), BLOCK_BYTES)?;
            // A fork child would keep the mark alive after this process died.
            mapping.exclude_from_fork()?;
            mark.id = id;
            mark.mapping = Some(mapping);
        }
        let id = mark.id;
        self.cache_id(id);
        Ok(id)
    }

    /// This process's holder id on the page, if it has one (without making it).
    pub(crate) fn holder_id_if_any(&self) -> Option<u32> {
        if let Some(id) = self.cached_id() {
            return Some(id);
        }
        let mut markers = MARKERS.lock();
        let id = self.count_in(&mut markers).id;
        (id != 0).then(|| {
            self.cache_id(id);
            id
        })
    }

    /// The holder id this value remembers from this process, if any.
    fn cached_id(&self) -> Option<u32> {
        let tagged = self.holder.load(Ordering::Acquire);
        (tagged >> 32 == u64::from(crate::sys::fork_local::cached_pid()) && tagged as u32 != 0)
            .then_some(tagged as u32)
    }

    fn cache_id(&self, id: u32) {
        let pid = u64::from(crate::sys::fork_local::cached_pid());
        self.holder
            .store(pid << 32 | u64::from(id), Ordering::Release);
    }

    /// This process's mark entry for the page, with this value counted in it (once per
    /// process: a value a `fork` child inherited is counted there on its first use).
    fn count_in<'m>(&self, markers: &'m mut Markers) -> &'m mut Marker {
        let pid = crate::sys::fork_local::cached_pid();
        let mark = markers
            .get_or_insert_with(HashMap::new)
            .entry(self.identity)
            .or_default();
        if self.counted_by.swap(pid, Ordering::AcqRel) != pid {
            mark.values += 1;
        }
        mark
    }

    /// Whether the process with holder id `id` on this page still lives (and maps the
    /// page): its mark is held. `true` when the kernel cannot tell.
    pub(crate) fn holder_lives(&self, id: u32) -> bool {
        // The page's fd is the one messages carry: nobody marks it.
        crate::sys::lease::is_marked(self.fd.as_fd(), i64::from(id))
    }

    /// The pid of holder `id`, when the page's table still has it (0: unknown).
    pub(crate) fn holder_pid(&self, id: u32) -> u32 {
        let entry = FIRST_RESERVED_WORD + 2 * (id as usize % HOLDER_PIDS);
        if self.word(entry).load(Ordering::Acquire) == id {
            self.word(entry + 1).load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// Word `index` of the block (`1..WORDS`; word 0 is the kind tag).
    pub(crate) fn word(&self, index: usize) -> &AtomicU32 {
        assert!(index < WORDS, "shared block word {index} out of range");
        // SAFETY: `index < WORDS` keeps the address inside the BLOCK_BYTES mapping, which
        // is page-aligned so every word is 4-aligned; the mapping outlives `&self`.
        unsafe { &*self.map.as_ptr().cast::<AtomicU32>().add(index) }
    }

    /// The 64-bit word made of 32-bit words `index` and `index + 1` (`index` even).
    pub(crate) fn word64(&self, index: usize) -> &AtomicU64 {
        assert!(
            index % 2 == 0 && index + 1 < WORDS,
            "shared block word64 {index} out of range"
        );
        // SAFETY: an even `index` below WORDS-1 keeps 8 bytes inside the page-aligned
        // mapping at an 8-aligned address; the mapping outlives `&self`.
        unsafe {
            &*self
                .map
                .as_ptr()
                .cast::<AtomicU32>()
                .add(index)
                .cast::<AtomicU64>()
        }
    }

    /// The 64-bit atomic word at byte `offset` of the byte area (a multiple of 8, inside
    /// the area): the per-record state words of a ring. `None` when out of range or
    /// misaligned.
    pub(crate) fn area_word64(&self, offset: usize) -> Option<&AtomicU64> {
        if offset % 8 != 0 || offset.checked_add(8).is_none_or(|end| end > self.bytes) {
            return None;
        }
        // SAFETY: the 8 bytes lie inside the byte area, which starts at a page boundary
        // of the mapping, so an offset that is a multiple of 8 is 8-aligned; the mapping
        // outlives `&self`, and atomics may be written by anyone (see the module docs).
        Some(unsafe {
            &*self
                .map
                .as_ptr()
                .add(BLOCK_BYTES + offset)
                .cast::<AtomicU64>()
        })
    }

    /// Copies `out.len()` bytes of the byte area, from `offset` on, into `out`; `false`
    /// (nothing copied) when that range is not inside the area. The bytes are whatever
    /// the area holds at that moment: the caller validates them.
    pub(crate) fn read_bytes(&self, offset: usize, out: &mut [u8]) -> bool {
        if offset
            .checked_add(out.len())
            .is_none_or(|end| end > self.bytes)
        {
            return false;
        }
        // SAFETY: `offset..offset + out.len()` lies inside the byte area, which follows
        // the page of words inside the mapping; `out` is a distinct local buffer. The
        // source may be written concurrently by other processes (a copy, never a
        // reference: the worst outcome is garbage bytes, which the caller checks).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(BLOCK_BYTES + offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        true
    }

    /// Copies `data` into the byte area at `offset`; `false` (nothing copied) when that
    /// range is not inside the area.
    pub(crate) fn write_bytes(&self, offset: usize, data: &[u8]) -> bool {
        if offset
            .checked_add(data.len())
            .is_none_or(|end| end > self.bytes)
        {
            return false;
        }
        // SAFETY: as in `read_bytes`, the range is inside the byte area and `data` is a
        // distinct buffer; nothing in this process holds a reference into the area.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_ptr().add(BLOCK_BYTES + offset),
                data.len(),
            );
        }
        true
    }

    /// Serializes the block as an fd in the wire's side table.
    pub(crate) fn serialize_as<S: Serializer>(
        &self,
        what: &str,
        s: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        let index = Encoder::current(what)
            .and_then(|enc| self.attach(&enc))
            .map_err(serde::ser::Error::custom)?;
        index.serialize(s)
    }

    /// Puts the block's fd into the side table of the message `enc` encodes; its index.
    pub(crate) fn attach(&self, enc: &Encoder<'_>) -> std::result::Result<u32, String> {
        enc.attach_fd(self.fd.as_fd())
    }

    /// Maps the block sent as fd `index` of the message being decoded (see
    /// [`attach`](Self::attach)), checked to be a sealed memfd of the right size and kind.
    pub(crate) fn open_received(
        dec: &Decoder<'_>,
        index: u32,
        kind: u32,
        bytes: usize,
    ) -> std::result::Result<Self, String> {
        let fd = dec.take_fd(index)?;
        Self::open(fd, kind, bytes, dec.what()).map_err(|e| dec.fail(e))
    }

    /// Deserializes a block sent with [`serialize_as`](Self::serialize_as).
    pub(crate) fn deserialize_as<'de, D: Deserializer<'de>>(
        kind: u32,
        what: &str,
        d: D,
    ) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        Decoder::current(what)
            .and_then(|dec| Self::open_received(&dec, index, kind, 0))
            .map_err(serde::de::Error::custom)
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        if *self.counted_by.get_mut() != crate::sys::fork_local::cached_pid() {
            return;
        }
        let gone = {
            let mut markers = MARKERS.lock();
            let markers = markers.get_or_insert_with(HashMap::new);
            match markers.get_mut(&self.identity) {
                Some(mark) if mark.values > 1 => {
                    mark.values -= 1;
                    None
                }
                Some(_) => markers.remove(&self.identity),
                None => None,
            }
        };
        // Unmapped outside the lock.
        drop(gone);
    }
}
