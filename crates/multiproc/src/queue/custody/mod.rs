//! A channel's custody: the fds of the blocks sent through it, kept where every holder
//! of the channel can take a duplicate, so that a message names a block by inode alone
//! (see `wire::custody` for why).
//!
//! The custody is a `SOCK_SEQPACKET` pair that every holder of the channel holds, like
//! the channel's own socket. Each block in custody is one packet queued on it: the
//! block's device and inode (16 bytes) with its fd attached. Nobody dequeues an entry
//! to use it: a process that needs a block *peeks* at the first packet (`MSG_PEEK`
//! installs a duplicate of the fd and leaves the packet queued), and to look further it
//! rotates the queue — peeks at the first entry, sends that duplicate back to the end,
//! and only then dequeues the first. A process killed at any step leaves at worst a
//! second copy of an entry, never one fewer, so a block that a message in flight names
//! is always in custody, whoever exits or is killed.
//!
//! **Two shelves, so that nobody waits for a stopped peer.** A socket pair queues
//! packets both ways, so the custody's one pair holds two queues of entries, its
//! *shelves*: shelf 0 is written on one end and read on the other, shelf 1 the reverse.
//! Every block goes on both. Each shelf has a lock of its own (`RawLock`: rotations and
//! sweeps hold it, appending does not), and nobody ever holds both: a process stopped
//! (a debugger, Ctrl-Z, a frozen container) or slow while it rotates one shelf leaves
//! the other free, and a lookup that finds one shelf taken looks on the other instead
//! of waiting. A lookup reports a block missing only after it has looked through both
//! shelves, since a block whose second append failed (a full buffer) is on one only.
//!
//! Each shelf has words in the ring's block (their offsets in `queue::layout`): the
//! lock, `ENTRIES` (about how many packets are queued) and `BYTES` (about how many
//! bytes of blocks they hold).
//!
//! **Sweeps.** An entry costs its block's memory as long as it is queued. When the
//! entries or their bytes pass a threshold (which doubles with what a sweep keeps), the
//! publisher sweeps: it rotates every entry once and drops duplicates and dead blocks —
//! no uses anywhere, and a creator that no longer pools the block or has exited. Such a
//! block can never be named again (only storages on it can be sent, and only its
//! creator hands out storages, when it still pools it), so no message can need it.
//!
//! **Idle sweeps.** A queue that goes quiet would keep its entries — and their blocks'
//! memory — until the next publication passes a threshold, which may never come (the
//! producers have exited). So a holder that publishes or takes from the custody wakes
//! an idle job (see `crate::idle`): once the custody has been quiet for
//! [`QUIET_TICKS`] ticks it sweeps, and again each tick (at most
//! [`IDLE_SWEEPS`] times) while entries are left, since the blocks' creators let them go
//! on their own idle ticks.
//!
//! The rotation and the lookup are written once, in `protocol`, over the [`Shelves`]
//! they act on: this module's socket queues, or the model checker's stand-ins, with
//! which `protocol::model` explores them (participants stopped for good or killed at
//! every step).
//!
//! Each process remembers which blocks it has put into this custody (an
//! `IdentityCache` entry per block, compared by identity, so a block freed and an
//! inode number reused are told apart) and puts a block in once.

use std::any::Any;
use std::collections::HashSet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::layout::{SHELF_BASE, SHELF_BYTES, SHELF_ENTRIES};
use crate::error::{Error, Result};
use crate::identity_cache::IdentityCache;
use crate::shm::SharedWords;
use crate::shm::{CacheKey, Segment, cached};
use crate::sync::lock::{Acquired, RawLock};
use crate::sys::socket::{self, Attempt, Packet, seqpacket_pair};
use crate::wire::{Custody as WireCustody, KeptBlock};

mod protocol;

use protocol::{ENTRY_LEN, Lookup, SHELVES, Shelves};

/// Sweep thresholds before any sweep has run (see the module docs).
const SWEEP_ENTRIES: u32 = 64;
const SWEEP_BYTES: u64 = 512 << 20;
/// How long a test holding a shelf (`while_locked`) waits for it. A lookup waits as
/// its decode says (`wire::LOOKUP_PATIENCE` or `wire::TRY_PATIENCE`) for both shelves'
/// rotations by other processes to end (a holder of each stopped or slow), and one that
/// gives up keeps its message for another try, see `Channel::decode`. One stopped
/// process holds one shelf at most.
#[cfg(any(test, feature = "fuzzing"))]
const LOCK_WAIT: Duration = crate::wire::LOOKUP_PATIENCE;
/// How long a lookup waits on one taken shelf before it looks at the other again.
const SHELF_SLICE: Duration = Duration::from_millis(2);
/// Ticks of the idle thread without a publication or a lookup before a sweep.
const QUIET_TICKS: u32 = 2;
/// Most sweeps of one quiet period.
const IDLE_SWEEPS: u32 = 10;

/// One of a custody's two queues of entries (see the module docs).
struct Shelf {
    lock: RawLock,
    /// The end of the pair entries are appended on ([`Custody::ends`]).
    write: usize,
    /// The end they are queued at (peeked and dequeued).
    read: usize,
    base: usize,
}

/// The custody of one channel (see the module docs).
pub(crate) struct Custody {
    block: Arc<SharedWords>,
    /// The socket pair: the custody's own two fds, which every holder holds.
    ends: [OwnedFd; 2],
    shelves: [Shelf; SHELVES],
    /// The blocks this process has put into custody, by device and inode.
    published: Mutex<Published>,
    /// When to sweep next, per shelf: entries, bytes.
    sweep_at: Mutex<[(u32, u64); SHELVES]>,
    /// Publications and lookups so far (the idle job tells a quiet custody by it).
    activity: AtomicU64,
    /// Whether this value's idle job is registered.
    idle_job: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Custody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Custody")
            .field("entries", &self.entries(0).load(Ordering::Relaxed))
            .finish()
    }
}

/// Frees a shelf's lock on drop.
struct Held<'a>(&'a RawLock);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _ = self.0.release();
    }
}

/// The blocks this process has put into a custody, by device and inode.
type Published = IdentityCache<(u64, u64), dyn Any + Send + Sync>;

impl Custody {
    /// A new, empty custody in the words of `block` (a ring's).
    pub(crate) fn new(block: Arc<SharedWords>) -> Result<Self> {
        let (tx, rx) = seqpacket_pair()?;
        Ok(Self::from_parts(block, tx, rx))
    }

    /// A custody received with its channel: `tx` and `rx` checked to be seqpacket
    /// sockets by the caller. Shelf 0 is written on `tx` and read on `rx`, shelf 1 the
    /// reverse.
    pub(crate) fn from_parts(block: Arc<SharedWords>, tx: OwnedFd, rx: OwnedFd) -> Self {
        let shelf = |i: usize| Shelf {
            lock: RawLock::new(Arc::clone(&block), SHELF_BASE[i]),
            write: i,
            read: 1 - i,
            base: SHELF_BASE[i],
        };
        Self {
            shelves: [shelf(0), shelf(1)],
            ends: [tx, rx],
            block,
            published: Mutex::new(Published::default()),
            sweep_at: Mutex::new([(SWEEP_ENTRIES, SWEEP_BYTES); SHELVES]),
            activity: AtomicU64::new(0),
            idle_job: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The two sockets, for serializing the channel.
    pub(crate) fn sockets(&self) -> (BorrowedFd<'_>, BorrowedFd<'_>) {
        (self.ends[0].as_fd(), self.ends[1].as_fd())
    }

    fn writing(&self, shelf: usize) -> BorrowedFd<'_> {
        self.ends[self.shelves[shelf].write].as_fd()
    }

    fn reading(&self, shelf: usize) -> BorrowedFd<'_> {
        self.ends[self.shelves[shelf].read].as_fd()
    }

    fn entries(&self, shelf: usize) -> &AtomicU32 {
        self.block.word(self.shelves[shelf].base + SHELF_ENTRIES)
    }

    fn bytes(&self, shelf: usize) -> &AtomicU64 {
        self.block.word64(self.shelves[shelf].base + SHELF_BYTES)
    }

    /// Runs `f` with the lock of `shelf` (0 or 1) held (tests: a holder that stops
    /// while it holds it).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn while_locked<R>(&self, shelf: usize, f: impl FnOnce() -> R) -> Result<R> {
        if shelf >= SHELVES {
            return Err(Error::InvalidArgument(format!(
                "a queue's custody has shelves 0 and 1, not {shelf}"
            )));
        }
        let _held = self.hold(shelf, Some(Instant::now() + LOCK_WAIT))?;
        Ok(f())
    }

    /// Takes the lock of `shelf`, waiting until `deadline` at most.
    fn hold(&self, shelf: usize, deadline: Option<Instant>) -> Result<Held<'_>> {
        let lock = &self.shelves[shelf].lock;
        let start = Instant::now();
        match lock.acquire(deadline)? {
            Acquired::Yes | Acquired::FromDeadOwner(_) => Ok(Held(lock)),
            Acquired::TimedOut => Err(Error::timeout(
                "waiting for other processes to finish looking through a queue's blocks",
                Some(start.elapsed()),
            )),
        }
    }

    /// Appends an entry to `shelf`; `false` when its buffer is full.
    fn append_entry(&self, shelf: usize, bytes: &[u8], fd: BorrowedFd<'_>) -> bool {
        matches!(
            socket::try_send_packet(self.writing(shelf), bytes, &[], &[fd]),
            Ok(Attempt::Done(()))
        )
    }

    /// One pass over `shelf` (see [`protocol::rotate`]). Its lock held.
    fn rotate(
        &self,
        shelf: usize,
        stop: impl FnMut(u64, u64, &OwnedFd) -> bool,
        keep: impl FnMut(u64, u64, &OwnedFd) -> bool,
    ) -> Result<Option<OwnedFd>> {
        protocol::rotate(self, shelf, &sentinel(), stop, keep, &mut || true)
    }

    /// Makes sure the idle job sweeps this custody once it goes quiet (see the module
    /// docs), when it holds entries. Cheap when the job runs already.
    pub(crate) fn wake_idle_job(self: &Arc<Self>) {
        if self.entries(0).load(Ordering::Relaxed) == 0
            && self.entries(1).load(Ordering::Relaxed) == 0
            || self.idle_job.load(Ordering::Relaxed)
            || self.idle_job.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let custody = Arc::downgrade(self);
        crate::idle::wake(Arc::as_ptr(self) as usize, move || {
            let (mut seen, mut quiet, mut sweeps) = (u64::MAX, 0u32, 0u32);
            Box::new(move || {
                let Some(custody) = custody.upgrade() else {
                    return false;
                };
                let activity = custody.activity.load(Ordering::Relaxed);
                if activity != seen {
                    (seen, quiet) = (activity, 0);
                    return true;
                }
                quiet += 1;
                if quiet >= QUIET_TICKS {
                    for shelf in 0..SHELVES {
                        // A shelf whose lock is taken (its holder may be stopped) is
                        // swept on a later tick.
                        if let Ok(_held) = custody.hold(shelf, Some(Instant::now())) {
                            if let Err(e) = custody.sweep(shelf) {
                                tracing::debug!(
                                    "an idle sweep of a queue's block custody failed: {e}"
                                );
                            }
                        }
                    }
                    sweeps += 1;
                }
                let more = (0..SHELVES).any(|s| custody.entries(s).load(Ordering::Acquire) > 0)
                    && sweeps < IDLE_SWEEPS;
                if !more {
                    custody.idle_job.store(false, Ordering::Release);
                }
                more
            })
        });
    }

    /// Drops duplicates and dead blocks from `shelf` (see the module docs). Its lock
    /// held.
    fn sweep(&self, shelf: usize) -> Result<()> {
        let mut seen = HashSet::new();
        let (mut live, mut live_bytes) = (0u32, 0u64);
        self.rotate(
            shelf,
            |_, _, _| false,
            |dev, ino, fd| {
                if !seen.insert((dev, ino)) || is_dead(dev, ino, fd) {
                    return false;
                }
                live += 1;
                live_bytes += crate::sys::memfd::file_size(fd.as_fd()).unwrap_or(0);
                true
            },
        )?;
        self.entries(shelf).store(live, Ordering::Release);
        self.bytes(shelf).store(live_bytes, Ordering::Release);
        let mut at = self.sweep_at.lock().unwrap_or_else(PoisonError::into_inner);
        at[shelf] = (
            SWEEP_ENTRIES.max(live.saturating_mul(2)),
            SWEEP_BYTES.max(live_bytes.saturating_mul(2)),
        );
        tracing::debug!(shelf, live, live_bytes, "swept a queue's block custody");
        Ok(())
    }

    /// Puts an entry on `shelf`; `false` when its buffer is full. Sweeps the shelf when
    /// it has passed its threshold and its lock is free.
    fn put_on(&self, shelf: usize, entry: &[u8], fd: BorrowedFd<'_>, len: u64) -> bool {
        if !self.append_entry(shelf, entry, fd) {
            return false;
        }
        let entries = self.entries(shelf).fetch_add(1, Ordering::AcqRel) + 1;
        let bytes = self.bytes(shelf).fetch_add(len, Ordering::AcqRel) + len;
        let (at_entries, at_bytes) =
            self.sweep_at.lock().unwrap_or_else(PoisonError::into_inner)[shelf];
        if entries >= at_entries || bytes >= at_bytes {
            // Best effort, and never a wait: a sweep that cannot run now runs at a
            // later publication, or on the idle job's tick.
            if let Ok(_held) = self.hold(shelf, Some(Instant::now())) {
                if let Err(e) = self.sweep(shelf) {
                    tracing::debug!("a sweep of a queue's block custody failed: {e}");
                }
            }
        }
        true
    }
}

impl WireCustody for Custody {
    fn keep(&self, block: &KeptBlock<'_>) -> bool {
        self.activity.fetch_add(1, Ordering::Relaxed);
        let (dev, ino) = (block.dev, block.ino);
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if published.holds(&(dev, ino), block.identity) {
            return true;
        }
        let mut entry = [0u8; ENTRY_LEN];
        entry[..8].copy_from_slice(&dev.to_le_bytes());
        entry[8..].copy_from_slice(&ino.to_le_bytes());
        // On one shelf at least; a lookup looks through both before it gives up.
        let on_first = self.put_on(0, &entry, block.fd, block.len);
        let on_second = self.put_on(1, &entry, block.fd, block.len);
        if !(on_first || on_second) {
            return false;
        }
        published.insert((dev, ino), block.identity);
        true
    }

    fn find(&self, dev: u64, ino: u64, patience: Duration) -> Result<Option<OwnedFd>> {
        self.activity.fetch_add(1, Ordering::Relaxed);
        let give_up = Instant::now() + patience;
        let patient = || Instant::now() < give_up;
        match protocol::find(self, (dev, ino), sentinel, patient, &mut || true)? {
            Lookup::Found(fd) => Ok(Some(fd)),
            Lookup::Missing => Ok(None),
            Lookup::GaveUp | Lookup::Stopped => Err(Error::timeout(
                "waiting for other processes to finish looking through a queue's blocks",
                Some(patience),
            )),
        }
    }
}

/// The sentinel of one pass: this process's pid and a number of its own.
fn sentinel() -> [u8; ENTRY_LEN] {
    static PASSES: AtomicU64 = AtomicU64::new(0);
    let mut sentinel = [0u8; ENTRY_LEN];
    sentinel[..4].copy_from_slice(&std::process::id().to_le_bytes());
    sentinel[8..].copy_from_slice(&PASSES.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    sentinel
}

/// The real shelves: the custody pair's two directions, locked by the ring block's
/// words.
impl Shelves for Custody {
    type Fd = OwnedFd;

    fn try_hold(&self, shelf: usize) -> bool {
        self.hold(shelf, Some(Instant::now()))
            .map(std::mem::forget)
            .is_ok()
    }

    fn hold_a_while(&self, shelf: usize) -> bool {
        self.hold(shelf, Some(Instant::now() + SHELF_SLICE))
            .map(std::mem::forget)
            .is_ok()
    }

    fn release(&self, shelf: usize) {
        let _ = self.shelves[shelf].lock.release();
    }

    fn peek(&self, shelf: usize) -> Result<Option<protocol::Peeked<OwnedFd>>> {
        let mut buf = [0u8; ENTRY_LEN + 1];
        match socket::try_peek_packet(self.reading(shelf), &mut buf)? {
            Attempt::Done(Packet { bytes, mut fds }) => Ok(Some((bytes, fds.pop()))),
            Attempt::WouldBlock => Ok(None),
        }
    }

    fn dequeue(&self, shelf: usize) {
        let mut buf = [0u8; ENTRY_LEN + 1];
        // Its fds are closed when the packet is dropped.
        let _ = socket::try_recv_packet(self.reading(shelf), &mut buf);
    }

    fn append(&self, shelf: usize, bytes: &[u8], fd: Option<&OwnedFd>) -> bool {
        let one;
        let fds: &[BorrowedFd<'_>] = match fd {
            Some(fd) => {
                one = [fd.as_fd()];
                &one
            }
            None => &[],
        };
        matches!(
            socket::try_send_packet(self.writing(shelf), bytes, &[], fds),
            Ok(Attempt::Done(()))
        )
    }

    fn identity(&self, fd: &OwnedFd) -> (u64, u64) {
        identity(fd)
    }

    fn count(&self, shelf: usize) -> usize {
        self.entries(shelf).load(Ordering::Acquire) as usize
    }

    fn dropped(&self, shelf: usize) {
        dec(self.entries(shelf));
    }
}

/// The device and inode of an entry's fd (what the kernel says, not the entry's bytes).
fn identity(fd: &OwnedFd) -> (u64, u64) {
    crate::sys::memfd::identity(fd.as_fd()).unwrap_or((0, 0))
}

/// Whether the block of an entry can never be named again (see the module docs).
fn is_dead(dev: u64, ino: u64, fd: &OwnedFd) -> bool {
    if let Some(mapped) = cached(&CacheKey::Inode { dev, ino }) {
        return mapped.is_dead_block();
    }
    let header = (crate::shm::BLOCK_HEADER_LEN + 1) as u64;
    match fd
        .try_clone()
        .map_err(|e| Error::os("duplicating a custody fd", e))
        .and_then(|fd| Segment::open_block(fd, header))
    {
        Ok(block) => block.is_dead_block(),
        // Not a block at all: nothing can use it.
        Err(_) => true,
    }
}

fn dec(word: &AtomicU32) {
    let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
}
