//! Where a storage's shared bytes come from: *blocks* that this process recycles, memfd
//! blocks for `file_descriptor` storages and named blocks for `file_system` ones (one
//! pool each, alike).
//!
//! Creating, mapping, faulting in and unmapping a fresh memfd costs tens of
//! microseconds for a small one and milliseconds for a large one (the kernel zeroes and
//! maps every page, on each side), far more than sending a tensor should. So:
//!
//! - A storage of at most [`SMALL_MAX`] bytes is carved (64-byte aligned, so neighbours
//!   never share a cache line) out of the current [`ARENA_LEN`]-byte arena block of this
//!   process; a receiver maps each arena once, and later tensors from it cost no system
//!   call beyond the message itself.
//! - A larger storage gets a block of its own (its size plus the header).
//!
//! Every block starts with a header (see `segment::BlockHeader`) that counts its *uses*
//! across processes: one per process holding a storage on it, one per message in
//! flight naming it. When a block's uses reach 0 — every storage on it, in every
//! process, is dropped — this process reuses it for the next storage of that size (a
//! full arena: for a new arena). Its pages are then already allocated and mapped here,
//! and receivers keep recently received blocks mapped (see `cache`), so a recycled
//! block costs no page fault and no `mmap` on either side. A process that crashes while
//! holding uses cannot give them back: once no live process maps the block and no
//! message names it, this process takes them back (on its idle ticks, and before it lets
//! a block go; see `segment`'s blocks), so a crash never pins a block for good.
//!
//! Bounds: at most [`MAX_RETIRED`] full arenas and [`MAX_LARGE`] large blocks are kept
//! waiting for their uses to end, and idle large blocks (no uses) are kept only up to
//! [`idle_bytes_limit`](super::idle_bytes_limit) in total; beyond that the oldest is released (its memory goes
//! back to the system when the last process unmaps it). An arena lives while any
//! storage carved from it lives, in any process, so one long-lived small tensor keeps
//! its whole arena (1 MiB) alive.
//!
//! A named block's name stays in `/dev/shm` while the block is pooled or used (see
//! `segment`'s blocks): it goes with the last tensor on it once its creator stops
//! pooling it — when the pool lets it go (the bounds above, or a full `/dev/shm`), when
//! a worker ends, and when this process exits through `exit` (an `atexit` handler).
//! After a crash the shm manager removes what is left; a killed manager is restarted
//! (and told every live name) when a new name is made or a named block is handed out
//! again. Named blocks are bounded also by
//! `/dev/shm`: idle ones are kept up to a quarter of its size, and a creation that finds
//! it full lets every idle one go and tries again once.
//!
//! **Decay.** A process that stops allocating lets its idle blocks go: when the pools
//! have seen no allocation for [`QUIET_TICKS`] ticks of the idle thread (see
//! `crate::idle`), every block nobody uses is released, so an idle process keeps no
//! shared memory it does not use (a `DataLoader` worker between epochs, a producer
//! whose consumer has gone quiet). Busy processes never see it: the blocks they cycle
//! through are handed out again long before.
//!
//! Invariant: blocks are only handed out by the process that created them (a `fork`
//! child starts its own recycler), so two processes never hand out the same bytes; and a
//! block is handed out again only when its uses are 0, so no storage anywhere still
//! refers to those bytes.

use std::collections::VecDeque;
use std::sync::Arc;

use super::Segment;
use super::reference::BlockUse;
use super::segment::{ARENA_LEN, BLOCK_HEADER_LEN};
use super::strategy::SharingStrategy;
use crate::error::{Error, Result};

/// Largest storage carved from an arena.
pub(crate) const SMALL_MAX: usize = 64 << 10;
/// Alignment of carved slices (a cache line).
const SLICE_ALIGN: usize = 64;
/// Full arenas kept waiting for their uses to end.
const MAX_RETIRED: usize = 16;
/// Large blocks kept (in use elsewhere or idle).
const MAX_LARGE: usize = 32;

/// [`idle_bytes_limit`](super::idle_bytes_limit) for `strategy`: named blocks also at most a quarter of
/// `/dev/shm`, whose space they take.
fn idle_limit(strategy: SharingStrategy) -> usize {
    static DEV_SHM_QUARTER: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    match strategy {
        SharingStrategy::FileDescriptor => super::idle_bytes_limit(),
        SharingStrategy::FileSystem => {
            super::idle_bytes_limit().min(*DEV_SHM_QUARTER.get_or_init(|| {
                crate::sys::memfd::dev_shm_size()
                    .and_then(|b| usize::try_from(b / 4).ok())
                    .unwrap_or(usize::MAX)
            }))
        }
    }
}

/// Shared bytes for one storage: `len` bytes at `offset` in a block, and the use of the
/// block taken on behalf of the storage (which the storage keeps as long as it lives).
pub(crate) struct Slice {
    pub(crate) block: BlockUse,
    pub(crate) offset: usize,
    /// Whether the bytes are known to be zero (fresh pages, not a recycled block).
    pub(crate) zeroed: bool,
}

struct Arena {
    segment: Arc<Segment>,
    next: usize,
    /// Whether the arena is fresh (its uncarved bytes are zero).
    fresh: bool,
}

/// The blocks of one strategy.
struct Pool {
    strategy: SharingStrategy,
    arena: Option<Arena>,
    /// Full arenas, oldest first.
    retired: VecDeque<Arc<Segment>>,
    /// Large blocks, oldest first.
    large: VecDeque<Arc<Segment>>,
}

/// This process's pools.
struct Pools {
    pid: u32,
    fd: Pool,
    named: Pool,
    /// Allocations so far (the idle job tells a quiet pool by it).
    allocations: u64,
}

/// Ticks of the idle thread without an allocation after which idle blocks are let go.
const QUIET_TICKS: u32 = 2;

static POOLS: crate::sys::fork_local::ForkLocal<Option<Pools>> =
    crate::sys::fork_local::ForkLocal::new();

/// The largest storage carved from an arena (for tests elsewhere in the crate).
#[cfg(test)]
pub(crate) fn small_max() -> usize {
    SMALL_MAX
}

/// Whether nobody uses the block any more, here or elsewhere.
fn is_free(block: &Segment) -> bool {
    block.uses() == Some(0)
}

/// Stops keeping a block: receivers may now unmap it once it has no uses, and a named
/// block's name goes with its last use. Uses that only dead processes held are taken
/// back first, so that they do not keep the name.
fn release(block: Arc<Segment>) {
    block.reclaim_stale_uses();
    block.unpool();
}

/// Runs `f` on this process's pool for `strategy`.
fn with_pool<R>(strategy: SharingStrategy, f: impl FnOnce(&mut Pool) -> R) -> R {
    let pid = crate::sys::fork_local::cached_pid();
    let mut guard = POOLS.lock();
    let pools = match guard.as_mut() {
        Some(p) if p.pid == pid => p,
        _ => {
            // First use, or a `fork` child: the parent's blocks are the parent's to
            // hand out. (Dropping the inherited handles only unmaps them here.)
            guard.insert(Pools {
                pid,
                fd: Pool::new(SharingStrategy::FileDescriptor),
                named: Pool::new(SharingStrategy::FileSystem),
                allocations: 0,
            })
        }
    };
    pools.allocations += 1;
    f(match strategy {
        SharingStrategy::FileDescriptor => &mut pools.fd,
        SharingStrategy::FileSystem => &mut pools.named,
    })
}

/// Shared bytes for a storage of `len > 0` bytes with `strategy`.
pub(crate) fn allocate(strategy: SharingStrategy, len: usize) -> Result<Slice> {
    let take = |pool: &mut Pool| {
        if len > SMALL_MAX {
            pool.large_block(len)
        } else {
            pool.carve(len)
        }
    };
    match with_pool(strategy, take) {
        Err(e @ Error::OutOfSharedMemory { .. }) if strategy == SharingStrategy::FileSystem => {
            // `/dev/shm` is full: what this process keeps idle there may be the reason.
            if release_idle_of(strategy) + super::cache::flush_retained() == 0 {
                return Err(e);
            }
            with_pool(strategy, take)
        }
        other => other,
    }
}

/// The idle job of the pools (see the module docs): lets the idle blocks go once the
/// pools have been quiet for [`QUIET_TICKS`] ticks; runs as long as they hold blocks.
fn decay_job() -> Box<dyn FnMut() -> bool + Send> {
    let (mut seen, mut quiet) = (u64::MAX, 0u32);
    Box::new(move || {
        let (idle, left) = {
            let mut guard = POOLS.lock();
            let Some(pools) = guard.as_mut() else {
                return false;
            };
            if pools.allocations != seen {
                (seen, quiet) = (pools.allocations, 0);
                return true;
            }
            quiet += 1;
            if quiet < QUIET_TICKS {
                return true;
            }
            let mut idle = pools.fd.take_idle();
            idle.extend(pools.named.take_idle());
            let left = pools.fd.blocks().next().is_some() || pools.named.blocks().next().is_some();
            (idle, left)
        };
        // Released outside the pool lock: the last reference unmaps and closes.
        idle.into_iter().for_each(release);
        left
    })
}

/// Lets go of this process's idle blocks: arenas and large blocks nobody uses; for
/// leak checks that count fds and names exactly, and to make room in a full
/// `/dev/shm`. Returns how many were let go.
#[cfg(feature = "testing-internals")]
pub(crate) fn release_idle() -> usize {
    release_idle_of(SharingStrategy::FileDescriptor) + release_idle_of(SharingStrategy::FileSystem)
}

fn release_idle_of(strategy: SharingStrategy) -> usize {
    let idle = with_pool(strategy, Pool::take_idle);
    let n = idle.len();
    // Released outside the pool lock: the last reference unmaps and closes.
    idle.into_iter().for_each(release);
    n
}

/// Stops pooling this process's named blocks, so that their names go with their last
/// tensors: for a process about to end (a worker before `_exit`, or the `atexit`
/// handler). Never waits for the pool's lock: a process that ends while another thread
/// holds it leaves the names to the shm manager.
pub(crate) fn unpool_named_before_exit() {
    let Some(guard) = POOLS.try_lock() else {
        return;
    };
    if let Some(pools) = guard.as_ref() {
        if pools.pid == crate::sys::fork_local::cached_pid() {
            pools.named.blocks().for_each(|b| b.unpool());
        }
    }
}

extern "C" fn unpool_named_at_exit() {
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(unpool_named_before_exit);
}

/// Registers the `atexit` handler that lets named blocks go, once per process.
fn unpool_named_at_exit_once() {
    // A `fork` child inherits the handler with the rest of its parent's memory; it
    // then finds the child's own pool.
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| crate::sys::process::at_exit(unpool_named_at_exit));
}

impl Pool {
    fn new(strategy: SharingStrategy) -> Pool {
        Pool {
            strategy,
            arena: None,
            retired: VecDeque::new(),
            large: VecDeque::new(),
        }
    }

    fn create_block(&self, len: usize) -> Result<Arc<Segment>> {
        if self.strategy == SharingStrategy::FileSystem {
            unpool_named_at_exit_once();
        }
        // The pools hold a block from now on: their idle job must run.
        crate::idle::wake(std::ptr::addr_of!(POOLS) as usize, decay_job);
        super::create_block(self.strategy, len)
    }

    /// A recycled block is handed out again: for named ones, the shm manager that
    /// would clean up after a crash must still be there (see
    /// `registry::reconnect_if_gone`), since no new name may come for a long time.
    fn handing_out_again(&self) {
        if self.strategy == SharingStrategy::FileSystem {
            super::registry::reconnect_if_gone();
        }
    }

    /// Every block of the pool.
    fn blocks(&self) -> impl Iterator<Item = &Arc<Segment>> {
        self.arena
            .iter()
            .map(|a| &a.segment)
            .chain(self.retired.iter())
            .chain(self.large.iter())
    }

    /// Removes the blocks nobody uses, the current arena included. The uses of
    /// processes that died holding them are taken back first (see
    /// `Segment::reclaim_stale_uses`; the pool's lock keeps this process from carving
    /// the current arena meanwhile).
    fn take_idle(&mut self) -> Vec<Arc<Segment>> {
        for block in self.blocks() {
            block.reclaim_stale_uses();
        }
        let mut idle = Vec::new();
        if self.arena.as_ref().is_some_and(|a| is_free(&a.segment)) {
            idle.extend(self.arena.take().map(|a| a.segment));
        }
        for list in [&mut self.retired, &mut self.large] {
            let (free, used): (VecDeque<_>, VecDeque<_>) = list.drain(..).partition(|s| is_free(s));
            *list = used;
            idle.extend(free);
        }
        idle
    }

    fn carve(&mut self, len: usize) -> Result<Slice> {
        if let Some(a) = self.arena.as_mut() {
            if a.next + len <= a.segment.len() {
                let offset = a.next;
                a.next = (offset + len).next_multiple_of(SLICE_ALIGN);
                return Ok(Slice {
                    block: BlockUse::take(&a.segment),
                    offset,
                    zeroed: a.fresh,
                });
            }
        }
        if let Some(full) = self.arena.take() {
            self.retired.push_back(full.segment);
        }
        let free = self.retired.iter().position(|s| is_free(s));
        let (segment, fresh) = match free.and_then(|i| self.retired.remove(i)) {
            Some(segment) => {
                self.handing_out_again();
                (segment, false)
            }
            None => {
                let segment = self.create_block(ARENA_LEN)?;
                if self.retired.len() > MAX_RETIRED {
                    if let Some(oldest) = self.retired.pop_front() {
                        release(oldest);
                    }
                }
                (segment, true)
            }
        };
        let offset = BLOCK_HEADER_LEN;
        self.arena = Some(Arena {
            segment: Arc::clone(&segment),
            next: (offset + len).next_multiple_of(SLICE_ALIGN),
            fresh,
        });
        Ok(Slice {
            block: BlockUse::take(&segment),
            offset,
            zeroed: fresh,
        })
    }

    fn large_block(&mut self, len: usize) -> Result<Slice> {
        let total = len
            .checked_add(BLOCK_HEADER_LEN)
            .ok_or_else(|| Error::InvalidArgument(format!("a {len}-byte segment is too large")))?;
        let reuse = self
            .large
            .iter()
            .position(|s| s.len() == total && is_free(s));
        let (segment, zeroed) = match reuse.and_then(|i| self.large.remove(i)) {
            Some(segment) => {
                self.handing_out_again();
                (segment, false)
            }
            None => (self.create_block(total)?, true),
        };
        let block = BlockUse::take(&segment);
        self.large.push_back(segment);
        self.trim_large();
        Ok(Slice {
            block,
            offset: BLOCK_HEADER_LEN,
            zeroed,
        })
    }

    /// Keeps at most [`MAX_LARGE`] large blocks and [`idle_limit`] bytes of idle ones.
    fn trim_large(&mut self) {
        while self.large.len() > MAX_LARGE {
            if let Some(oldest) = self.large.pop_front() {
                release(oldest);
            }
        }
        let limit = idle_limit(self.strategy);
        let mut idle: usize = self
            .large
            .iter()
            .filter(|s| is_free(s))
            .map(|s| s.len())
            .sum();
        while idle > limit {
            let Some(i) = self.large.iter().position(|s| is_free(s)) else {
                break;
            };
            if let Some(block) = self.large.remove(i) {
                idle -= block.len();
                release(block);
            }
        }
    }
}
