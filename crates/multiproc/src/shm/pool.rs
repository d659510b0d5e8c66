//! Where a storage's shared bytes come from: small `file_descriptor` storages share
//! arena segments, everything else gets a segment of its own.
//!
//! Creating, mapping and unmapping a memfd costs tens of microseconds on each side, far
//! more than sending a small tensor should. So a storage of at most [`SMALL_MAX`] bytes
//! shared with the `file_descriptor` strategy is carved (64-byte aligned, so neighbours
//! never share a cache line) out of the current [`ARENA_LEN`]-byte arena of this
//! process; a receiver maps each arena once, and later tensors from it cost no system
//! call beyond the message itself. It also means far fewer open fds.
//!
//! The price: an arena lives while any storage carved from it lives, in any process,
//! so one long-lived small tensor keeps its whole arena (1 MiB) alive; and the current
//! arena stays allocated in its creator until it is full.
//!
//! `file_system` storages are never pooled: a name must disappear from `/dev/shm` when
//! the last tensor using it is dropped, which a shared arena would prevent.
//!
//! Invariant: an arena is only carved by the process that created it (a `fork` child
//! starts its own), so two processes never hand out the same bytes.

use std::sync::{Arc, Mutex, PoisonError};

use super::Segment;
use crate::{Result, SharingStrategy};

/// Largest storage carved from an arena.
pub(crate) const SMALL_MAX: usize = 64 << 10;
/// Size of one arena segment.
pub(crate) const ARENA_LEN: usize = 1 << 20;
/// Alignment of carved slices (a cache line).
const SLICE_ALIGN: usize = 64;

/// Shared bytes for one storage: `len` bytes at `offset` in `segment`.
pub(crate) struct Slice {
    pub(crate) segment: Arc<Segment>,
    pub(crate) offset: usize,
}

struct Arena {
    pid: u32,
    segment: Arc<Segment>,
    next: usize,
}

static ARENA: Mutex<Option<Arena>> = Mutex::new(None);

/// The largest storage carved from an arena (for tests elsewhere in the crate).
#[cfg(test)]
pub(crate) fn small_max() -> usize {
    SMALL_MAX
}

/// Shared bytes for a storage of `len > 0` bytes with `strategy`.
pub(crate) fn allocate(strategy: SharingStrategy, len: usize) -> Result<Slice> {
    if strategy != SharingStrategy::FileDescriptor || len > SMALL_MAX {
        return Ok(Slice {
            segment: super::create(strategy, len)?,
            offset: 0,
        });
    }
    let pid = std::process::id();
    let mut arena = ARENA.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(a) = arena.as_mut().filter(|a| a.pid == pid) {
        if a.next + len <= a.segment.len() {
            let offset = a.next;
            a.next = (offset + len).next_multiple_of(SLICE_ALIGN);
            return Ok(Slice {
                segment: Arc::clone(&a.segment),
                offset,
            });
        }
    }
    let segment = super::create(SharingStrategy::FileDescriptor, ARENA_LEN)?;
    *arena = Some(Arena {
        pid,
        segment: Arc::clone(&segment),
        next: len.next_multiple_of(SLICE_ALIGN),
    });
    Ok(Slice { segment, offset: 0 })
}
