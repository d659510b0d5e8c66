//! The per-process map cache: which segments this process has mapped.
//!
//! The table is an [`IdentityCache`]: it never keeps a segment alive, a dead entry is
//! replaced when its key comes back (inode numbers are reused once a memfd is freed),
//! dead entries are swept when the table has doubled, and the entry found last is
//! compared before the table is hashed. Lookup,
//! mapping and insertion happen under one lock, so two threads receiving the same new
//! segment at once still end up with one mapping.
//!
//! Memfd segments and blocks a process receives from another process are also kept mapped
//! for a while after their last tensor is dropped: the [`RECENT`] most recently
//! received ones, at most as many bytes in all as the pool keeps idle (`idle_bytes_limit`). A consumer that handles one tensor
//! at a time would otherwise map and unmap the same arena for every small tensor, and
//! — since the producer recycles its blocks (see `recycler`) — map, fault in and unmap
//! the same large block for every large one. A retained block that can never come
//! back (no uses, and its creator no longer pools it or has exited) is let go when the
//! worker that made it is joined (`release_dead_retained`), or else at the idle
//! thread's next tick (see `decay_job`, which also lets a quiet receiver's other kept
//! segments go). Mappings are let go outside the cache lock: freeing a
//! large block's pages takes milliseconds, which no receiving thread should wait for.
//! Plain named segments are never retained (the
//! mapping holds a reference, and their name must go away with their last tensor); a
//! named block's mapping holds none (see `segment`'s blocks), so keeping it does not keep
//! its name. Blocks this process created are kept by its recycler instead.
//!
//! A `fork` child does not inherit the table (it is a `ForkLocal`): the segments in the
//! parent's hold the parent's references (and the parent's handles keep them alive
//! forever in the child, so they would never be released there), so a child maps what
//! it receives afresh, with references of its own.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{Segment, SegmentName};
use crate::error::Result;
use crate::identity_cache::IdentityCache;

/// What identifies a segment across processes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CacheKey {
    /// A memfd: its device and inode.
    Inode {
        /// `st_dev`.
        dev: u64,
        /// `st_ino`.
        ino: u64,
    },
    /// A named segment.
    Name(SegmentName),
}

impl CacheKey {
    /// The key of a segment.
    pub(crate) fn of(segment: &Segment) -> Option<CacheKey> {
        if let Some((dev, ino)) = segment.inode() {
            Some(CacheKey::Inode { dev, ino })
        } else {
            segment.name().cloned().map(CacheKey::Name)
        }
    }
}

#[derive(Default)]
struct MapCache {
    /// The segments mapped here.
    entries: IdentityCache<CacheKey, Segment>,
    /// Received segments kept mapped, most recent last.
    recent: VecDeque<Arc<Segment>>,
    /// Segments kept so far (the idle job tells a quiet receiver by it).
    retained: u64,
}

/// Ticks of the idle thread without a received segment after which the kept ones are
/// let go (but for blocks their creator still pools, see [`decay_job`]).
const QUIET_TICKS: u32 = 2;

/// The idle job of the retention list, run as long as the list holds any segment. Each
/// tick it lets go of the blocks that can never come back (no uses, and their creator
/// stopped pooling them or exited): the creator's own pool decays, and the memory
/// comes back a tick later. Once no segment has been received for [`QUIET_TICKS`]
/// ticks it also lets go of everything else but blocks their creator still pools:
/// those pages stay committed by the creator whatever this process does, so unmapping
/// them frees nothing, and would cost a consumer whose steps take longer than the
/// quiet period (a slow training step behind a data loader) a fresh map, fault-in and
/// — with `pin_memory` — a CUDA registration for every batch.
fn decay_job() -> Box<dyn FnMut() -> bool + Send> {
    let (mut seen, mut quiet) = (u64::MAX, 0u32);
    Box::new(move || {
        let (released, more) = {
            let mut cache = CACHE.lock();
            if cache.recent.is_empty() {
                return false;
            }
            let mut released = cache.take_dead();
            if cache.retained != seen {
                (seen, quiet) = (cache.retained, 0);
            } else {
                quiet = quiet.saturating_add(1);
            }
            if quiet >= QUIET_TICKS {
                let (kept, gone): (Vec<_>, Vec<_>) = cache
                    .recent
                    .drain(..)
                    .partition(|s| s.is_block() && !s.is_dead_block());
                cache.recent = kept.into();
                released.extend(gone);
            }
            (released, !cache.recent.is_empty())
        };
        // Dropped outside the cache lock: the last reference unmaps and closes.
        drop(released);
        more
    })
}

/// Segments mapped on receipt so far (a miss of the cache; for the diagnostics in
/// `__testing`).
pub(crate) static MAPPED_ON_RECEIPT: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// How many received segments stay mapped after their last tensor is dropped. A data
/// loader cycles through about `num_workers * (prefetch_factor + 1)` blocks (each
/// worker recycles its own), and with a least-recently-used list a cycle even one
/// longer than the list misses every time: each batch then maps its block afresh,
/// faults its pages in, and with `pin_memory` registers it with the CUDA driver again.
/// So the list is long enough for 8 workers with a prefetch factor of 4, or 16 with
/// the default of 2; the byte bound ([`recent_bytes`]) still caps what it keeps.
pub(crate) const RECENT: usize = 64;
/// How many bytes of received segments stay mapped after their last tensor is dropped.
fn recent_bytes() -> usize {
    super::idle_bytes_limit()
}

static CACHE: crate::sys::fork_local::ForkLocal<MapCache> =
    crate::sys::fork_local::ForkLocal::new();

fn with_cache<R>(f: impl FnOnce(&mut MapCache) -> R) -> R {
    f(&mut CACHE.lock())
}

impl MapCache {
    /// Keeps a received memfd segment or block mapped (see the module docs). Returns
    /// the mappings it let go, for the caller to drop outside the cache lock: the last
    /// reference to a large block unmaps it and frees its pages, which takes
    /// milliseconds that no other receiving thread should wait for.
    fn retain_recent(&mut self, segment: &Arc<Segment>) -> Vec<Arc<Segment>> {
        let mut evicted = Vec::new();
        let small = segment.len() <= super::segment::ARENA_LEN;
        if (segment.fd().is_none() && !segment.is_block())
            || segment.len() > recent_bytes()
            || segment.is_own_block()
            || !(small || segment.is_block())
        {
            return evicted;
        }
        self.retained += 1;
        if self.recent.back().is_some_and(|s| Arc::ptr_eq(s, segment)) {
            return evicted;
        }
        if self.recent.is_empty() {
            // The list holds a segment from now on: its idle job must run.
            crate::idle::wake(std::ptr::addr_of!(CACHE) as usize, decay_job);
        }
        if let Some(i) = self.recent.iter().position(|s| Arc::ptr_eq(s, segment)) {
            evicted.extend(self.recent.remove(i));
        } else {
            evicted.extend(self.take_dead());
            let mut bytes: usize = self.recent.iter().map(|s| s.len()).sum();
            while self.recent.len() >= RECENT || bytes + segment.len() > recent_bytes() {
                match self.recent.pop_front() {
                    Some(old) => {
                        bytes -= old.len();
                        evicted.push(old);
                    }
                    None => break,
                }
            }
        }
        self.recent.push_back(Arc::clone(segment));
        evicted
    }

    /// Takes the retained blocks that can never be used again out of the list.
    fn take_dead(&mut self) -> Vec<Arc<Segment>> {
        let (dead, kept): (Vec<_>, Vec<_>) = self.recent.drain(..).partition(|s| s.is_dead_block());
        self.recent = kept.into();
        dead
    }
}

/// Records a segment this process created.
pub(crate) fn insert(segment: &Arc<Segment>) {
    if let Some(key) = CacheKey::of(segment) {
        with_cache(|c| c.entries.insert(key, segment));
    }
}

/// The live segment under `key`, or the one `open` maps (then cached). The flag is true
/// when `open` ran.
pub(crate) fn get_or_try_insert(
    key: CacheKey,
    open: impl FnOnce() -> Result<Segment>,
) -> Result<(Arc<Segment>, bool)> {
    let (found, evicted) = with_cache(|c| {
        if let Some(live) = c.entries.get(&key) {
            let evicted = c.retain_recent(&live);
            return (Ok((live, false)), evicted);
        }
        let segment = match open() {
            Ok(s) => {
                MAPPED_ON_RECEIPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Arc::new(s)
            }
            Err(e) => return (Err(e), Vec::new()),
        };
        c.entries.insert(key, &segment);
        let evicted = c.retain_recent(&segment);
        (Ok((segment, true)), evicted)
    });
    // Unmapped (and, for the last mapping, freed) outside the cache lock.
    drop(evicted);
    found
}

/// Lets go of the retained blocks that can never be used again: no uses left, and
/// their creator has stopped pooling them. Called when a worker ends, so that the
/// memory of the blocks it made is freed then (by the parent that joins it) rather
/// than in the middle of the next receive. Returns how many were let go.
pub(crate) fn release_dead_retained() -> usize {
    let dead = with_cache(|c| c.take_dead());
    // Dropped outside the cache lock, as in `get_or_try_insert`.
    dead.len()
}

/// Releases every named-segment reference this process holds (see
/// [`Segment::release_before_exit`]); for a worker about to `_exit`.
pub(crate) fn release_before_exit() {
    let live: Vec<Arc<Segment>> = with_cache(|c| c.entries.live());
    for segment in live {
        segment.release_before_exit();
    }
}

/// Lets go of every retained segment (those still used by a tensor stay mapped); for
/// leak checks that count fds exactly. Returns how many were let go.
pub(crate) fn flush_retained() -> usize {
    let flushed: Vec<Arc<Segment>> = with_cache(|c| c.recent.drain(..).collect());
    // Dropped outside the cache lock: the last reference unmaps and closes.
    flushed.len()
}

/// The named segment found or made last, if it is `name` and still mapped here (kept
/// in the retention list as any hit is). The name was checked when the entry was made.
pub(crate) fn last_named(name: &str) -> Option<Arc<Segment>> {
    let (found, evicted) = with_cache(|c| {
        let live = match c.entries.last()? {
            (CacheKey::Name(last), live) if last.as_str() == name => live,
            _ => return None,
        };
        let evicted = c.retain_recent(&live);
        Some((live, evicted))
    })
    .map_or((None, Vec::new()), |(live, evicted)| (Some(live), evicted));
    // Unmapped outside the cache lock, as in `get_or_try_insert`.
    drop(evicted);
    found
}

/// The live segment under `key`, if this process maps it.
pub(crate) fn lookup(key: &CacheKey) -> Option<Arc<Segment>> {
    with_cache(|c| c.entries.get(key))
}
