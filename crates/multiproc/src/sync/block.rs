//! # Safety
//!
//! A [`SharedBlock`] is one page of shared memory holding 32-bit atomic words that
//! several processes update together. The only unsafe code turns a word's address into
//! `&AtomicU32`: the address is in bounds and 4-byte aligned (checked at map time), the
//! mapping lives as long as the block (the reference borrows the block), and atomics
//! may be written concurrently by anyone, other processes included.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::sys::memfd;
use crate::sys::mmap::SharedMapping;
use crate::{Error, Result, wire};

/// Size of a block in bytes; it holds [`WORDS`] atomic words.
const BLOCK_BYTES: usize = 4096;
/// The number of `AtomicU32` words in a block.
pub(crate) const WORDS: usize = BLOCK_BYTES / 4;
/// First word: identifies the block's kind so a handle of one kind is never taken for another.
const KIND_WORD: usize = 0;

/// One page of process-shared atomic words, backed by a sealed memfd.
///
/// Sync primitives and queue counters live in these. The block travels between
/// processes as its fd ([`Serialize`] through a multiproc channel only).
#[derive(Debug)]
pub(crate) struct SharedBlock {
    fd: OwnedFd,
    map: SharedMapping,
}

impl SharedBlock {
    /// A new zeroed block tagged with `kind` (a nonzero constant of the owner type).
    pub(crate) fn new(kind: u32) -> Result<Self> {
        let fd = memfd::create("multiproc-sync", BLOCK_BYTES as u64)?;
        memfd::seal_size(fd.as_fd())?;
        let map = SharedMapping::map(fd.as_fd(), BLOCK_BYTES)?;
        let block = Self { fd, map };
        block
            .word(KIND_WORD)
            .store(kind, std::sync::atomic::Ordering::Release);
        Ok(block)
    }

    /// Maps a received block, checking that it is a sealed memfd of the right size and
    /// kind.
    fn open(fd: OwnedFd, kind: u32, what: &str) -> Result<Self> {
        if !memfd::is_shrink_sealed(fd.as_fd()) {
            return Err(Error::InvalidMessage(format!(
                "the {what} handle is not a sealed multiproc memfd"
            )));
        }
        let size = memfd::file_size(fd.as_fd())?;
        if size < BLOCK_BYTES as u64 {
            return Err(Error::InvalidMessage(format!(
                "the {what} segment holds {size} bytes, fewer than the {BLOCK_BYTES} it needs"
            )));
        }
        let map = SharedMapping::map(fd.as_fd(), BLOCK_BYTES)?;
        let block = Self { fd, map };
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

    /// Serializes the block as an fd in the wire's side table.
    pub(crate) fn serialize_as<S: Serializer>(
        &self,
        what: &str,
        s: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        let index = wire::attach_fd(self.fd.as_fd(), what).map_err(serde::ser::Error::custom)?;
        index.serialize(s)
    }

    /// Deserializes a block sent with [`serialize_as`](Self::serialize_as).
    pub(crate) fn deserialize_as<'de, D: Deserializer<'de>>(
        kind: u32,
        what: &str,
        d: D,
    ) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        let fd = wire::received_fd(index, what).map_err(serde::de::Error::custom)?;
        Self::open(fd, kind, what).map_err(|e| serde::de::Error::custom(wire::fail_with(e)))
    }
}
