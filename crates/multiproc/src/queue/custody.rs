//! A channel's custody: the fds of the blocks sent through it, kept where every holder
//! of the channel can take a duplicate, so that a message names a block by inode alone
//! (see `shm::custody` for why).
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
//! Words of the ring's block: the custody lock (`RawLock`, words 16..20; rotations and
//! sweeps hold it, publishing does not), `ENTRIES` (about how many packets are queued)
//! and `BYTES` (about how many bytes of blocks they hold).
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
//! Each process remembers which blocks it has put into this custody (a `Weak` per
//! block, so a block freed and an inode number reused are told apart) and puts a block
//! in once.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::shm::SharedWords;
use crate::shm::custody::BlockCustody;
use crate::shm::{CacheKey, Segment, cached};
use crate::sync::lock::{Acquired, RawLock};
use crate::sys::socket::{self, Attempt, Packet, seqpacket_pair};

const LOCK_BASE: usize = 16;
const ENTRIES: usize = 20;
const BYTES: usize = 22;
/// Sweep thresholds before any sweep has run (see the module docs).
const SWEEP_ENTRIES: u32 = 64;
const SWEEP_BYTES: u64 = 512 << 20;
/// How long a rotation waits for another process's rotation to end (its holder may be
/// stopped: a lookup that gives up keeps its message for another try, see
/// `Channel::decode`).
const LOCK_WAIT: Duration = Duration::from_millis(500);
/// The bytes of one entry: device and inode.
const ENTRY_LEN: usize = 16;
/// Ticks of the idle thread without a publication or a lookup before a sweep.
const QUIET_TICKS: u32 = 2;
/// Most sweeps of one quiet period.
const IDLE_SWEEPS: u32 = 10;

/// The custody of one channel (see the module docs).
pub(crate) struct Custody {
    block: Arc<SharedWords>,
    lock: RawLock,
    tx: OwnedFd,
    rx: OwnedFd,
    /// The blocks this process has put into custody, by device and inode.
    published: Mutex<Published>,
    /// When to sweep next: entries, bytes.
    sweep_at: Mutex<(u32, u64)>,
    /// Publications and lookups so far (the idle job tells a quiet custody by it).
    activity: AtomicU64,
    /// Whether this value's idle job is registered.
    idle_job: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Custody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Custody")
            .field("entries", &self.entries().load(Ordering::Relaxed))
            .finish()
    }
}

/// Frees the custody lock on drop.
struct Held<'a>(&'a RawLock);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _ = self.0.release();
    }
}

/// The blocks this process has put into a custody, by device and inode.
#[derive(Default)]
struct Published {
    blocks: HashMap<(u64, u64), Weak<Segment>>,
    /// The block published or found last, compared before `blocks` is hashed: a
    /// stream of tensors from one arena names the same block again and again.
    last: Weak<Segment>,
}

impl Published {
    fn is_last(&self, block: &Arc<Segment>) -> bool {
        std::ptr::eq(self.last.as_ptr(), Arc::as_ptr(block))
    }
}

impl Custody {
    /// A new, empty custody in the words of `block` (a ring's).
    pub(crate) fn new(block: Arc<SharedWords>) -> Result<Self> {
        let (tx, rx) = seqpacket_pair()?;
        Ok(Self::from_parts(block, tx, rx))
    }

    /// A custody received with its channel: `tx` and `rx` checked to be seqpacket
    /// sockets by the caller.
    pub(crate) fn from_parts(block: Arc<SharedWords>, tx: OwnedFd, rx: OwnedFd) -> Self {
        Self {
            lock: RawLock::new(Arc::clone(&block), LOCK_BASE),
            block,
            tx,
            rx,
            published: Mutex::new(Published::default()),
            sweep_at: Mutex::new((SWEEP_ENTRIES, SWEEP_BYTES)),
            activity: AtomicU64::new(0),
            idle_job: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The two sockets, for serializing the channel.
    pub(crate) fn sockets(&self) -> (BorrowedFd<'_>, BorrowedFd<'_>) {
        (self.tx.as_fd(), self.rx.as_fd())
    }

    fn entries(&self) -> &AtomicU32 {
        self.block.word(ENTRIES)
    }

    fn bytes(&self) -> &AtomicU64 {
        self.block.word64(BYTES)
    }

    /// Runs `f` with the custody's lock held (tests: a holder that stops while it holds
    /// the lock).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn while_locked<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let _held = self.hold()?;
        Ok(f())
    }

    fn hold(&self) -> Result<Held<'_>> {
        match self.lock.acquire(Some(Instant::now() + LOCK_WAIT))? {
            Acquired::Yes | Acquired::FromDeadOwner(_) => Ok(Held(&self.lock)),
            Acquired::TimedOut => Err(Error::timeout(
                "waiting for another process to finish looking through a queue's blocks",
                Some(LOCK_WAIT),
            )),
        }
    }

    /// The first entry, still queued: its device and inode (from the bytes: untrusted)
    /// and its fd. `None` when the custody is empty.
    fn peek(&self) -> Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
        let mut buf = [0u8; ENTRY_LEN + 1];
        match socket::try_peek_packet(self.rx.as_fd(), &mut buf)? {
            Attempt::Done(Packet { bytes, mut fds }) => Ok(Some((bytes, fds.pop()))),
            Attempt::WouldBlock => Ok(None),
        }
    }

    /// Drops the first entry (a duplicate of it is at the end, or it is not wanted).
    fn dequeue(&self) {
        let mut buf = [0u8; ENTRY_LEN + 1];
        // Its fds are closed when the packet is dropped.
        let _ = socket::try_recv_packet(self.rx.as_fd(), &mut buf);
    }

    /// Appends an entry; `false` when the custody's buffer is full.
    fn append(&self, bytes: &[u8], fd: BorrowedFd<'_>) -> bool {
        matches!(
            socket::try_send_packet(self.tx.as_fd(), bytes, &[], &[fd]),
            Ok(Attempt::Done(()))
        )
    }

    /// Looks at every entry once, keeping those `keep` accepts (in their order) and
    /// dropping the others; stops early when `stop` says so, leaving that entry first.
    /// Lock held. Returns the fd `stop` chose, if any.
    ///
    /// One pass ends at a sentinel: a packet without fd, unique to this pass, appended
    /// first. (Counting entries instead would go round twice when the count is high,
    /// and see the copies it made.) A sentinel left behind by a pass that stopped early
    /// or was killed is dropped by the next pass, as is anything else without an fd.
    fn rotate(
        &self,
        mut stop: impl FnMut(u64, u64, &OwnedFd) -> bool,
        mut keep: impl FnMut(u64, u64, &OwnedFd) -> bool,
    ) -> Result<Option<OwnedFd>> {
        static PASSES: AtomicU64 = AtomicU64::new(0);
        let mut sentinel = [0u8; ENTRY_LEN];
        sentinel[..4].copy_from_slice(&std::process::id().to_le_bytes());
        sentinel[8..].copy_from_slice(&PASSES.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        let appended = matches!(
            socket::try_send_packet(self.tx.as_fd(), &sentinel, &[], &[]),
            Ok(Attempt::Done(()))
        );
        // Without a sentinel (a full buffer), one pass over the counted entries.
        let mut left = if appended {
            usize::MAX
        } else {
            self.entries().load(Ordering::Acquire) as usize
        };
        while left > 0 {
            left -= 1;
            let Some((bytes, fd)) = self.peek()? else {
                break;
            };
            let Some(fd) = fd.filter(|_| bytes.len() == ENTRY_LEN) else {
                // A sentinel, or not an entry of ours (something else wrote to the
                // socket).
                self.dequeue();
                if bytes == sentinel {
                    break;
                }
                continue;
            };
            let (dev, ino) = identity(&fd);
            if stop(dev, ino, &fd) {
                return Ok(Some(fd));
            }
            if keep(dev, ino, &fd) {
                // The copy at the end first: a process killed between these two steps
                // leaves an entry twice, never lost.
                if !self.append(&bytes, fd.as_fd()) {
                    // The buffer is full: nothing more can be rotated now.
                    break;
                }
            } else {
                dec(self.entries());
            }
            self.dequeue();
        }
        Ok(None)
    }

    /// Makes sure the idle job sweeps this custody once it goes quiet (see the module
    /// docs), when it holds entries. Cheap when the job runs already.
    pub(crate) fn wake_idle_job(self: &Arc<Self>) {
        if self.entries().load(Ordering::Relaxed) == 0
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
                    if let Ok(_held) = custody.hold() {
                        if let Err(e) = custody.sweep() {
                            tracing::debug!("an idle sweep of a queue's block custody failed: {e}");
                        }
                    }
                    sweeps += 1;
                }
                let more = custody.entries().load(Ordering::Acquire) > 0 && sweeps < IDLE_SWEEPS;
                if !more {
                    custody.idle_job.store(false, Ordering::Release);
                }
                more
            })
        });
    }

    /// Drops duplicates and dead blocks (see the module docs). Lock held.
    fn sweep(&self) -> Result<()> {
        let mut seen = HashSet::new();
        let (mut live, mut live_bytes) = (0u32, 0u64);
        self.rotate(
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
        self.entries().store(live, Ordering::Release);
        self.bytes().store(live_bytes, Ordering::Release);
        let mut at = self.sweep_at.lock().unwrap_or_else(PoisonError::into_inner);
        *at = (
            SWEEP_ENTRIES.max(live.saturating_mul(2)),
            SWEEP_BYTES.max(live_bytes.saturating_mul(2)),
        );
        tracing::debug!(live, live_bytes, "swept a queue's block custody");
        Ok(())
    }
}

impl BlockCustody for Custody {
    fn publish(&self, block: &Arc<Segment>) -> bool {
        self.activity.fetch_add(1, Ordering::Relaxed);
        let (Some((dev, ino)), Some(fd)) = (block.inode(), block.shared_fd()) else {
            return false;
        };
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if published.is_last(block) {
            return true;
        }
        let known = published
            .blocks
            .get(&(dev, ino))
            .and_then(Weak::upgrade)
            .is_some_and(|s| Arc::ptr_eq(&s, block));
        if known {
            published.last = Arc::downgrade(block);
            return true;
        }
        let mut entry = [0u8; ENTRY_LEN];
        entry[..8].copy_from_slice(&dev.to_le_bytes());
        entry[8..].copy_from_slice(&ino.to_le_bytes());
        if !self.append(&entry, fd.as_fd()) {
            return false;
        }
        let entries = self.entries().fetch_add(1, Ordering::AcqRel) + 1;
        let bytes =
            self.bytes().fetch_add(block.len() as u64, Ordering::AcqRel) + block.len() as u64;
        published.blocks.retain(|_, w| w.strong_count() > 0);
        published.blocks.insert((dev, ino), Arc::downgrade(block));
        published.last = Arc::downgrade(block);
        drop(published);
        let (at_entries, at_bytes) = *self.sweep_at.lock().unwrap_or_else(PoisonError::into_inner);
        if entries >= at_entries || bytes >= at_bytes {
            // Best effort: a sweep that cannot run now runs at the next publication.
            if let Ok(_held) = self.hold() {
                if let Err(e) = self.sweep() {
                    tracing::debug!("a sweep of a queue's block custody failed: {e}");
                }
            }
        }
        true
    }

    fn find(&self, dev: u64, ino: u64) -> Result<Option<OwnedFd>> {
        self.activity.fetch_add(1, Ordering::Relaxed);
        let _held = self.hold()?;
        self.rotate(|d, i, _| (d, i) == (dev, ino), |_, _, _| true)
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
