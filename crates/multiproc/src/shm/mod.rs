//! Shared-memory segments: how storage bytes come to live where other processes can map
//! them, how a segment travels as a handle, and the per-process map cache.
//!
//! Two backends, one per [`SharingStrategy`] (defined in [`strategy`]; which one a
//! process uses is `crate::sharing`'s setting):
//!
//! - **`file_descriptor`** — an anonymous memfd, pages reserved with `fallocate`, sealed
//!   against shrinking and growing. The fd is the handle; the kernel counts references
//!   (open fds and mappings), so nothing can leak. A memfd is charged to the memory
//!   cgroup like any shmem page but is **not** bounded by the size of the `/dev/shm`
//!   mount: docker's `--shm-size` does not limit it. This is deliberate — the commonest
//!   torch DataLoader failure ("bus error, insufficient shared memory") cannot happen.
//! - **`file_system`** — a named file `/dev/shm/multiproc_<pid>_<random>_<tree>` (0600, created
//!   with `O_EXCL | O_NOFOLLOW`), pages reserved with `fallocate` so a full `/dev/shm` is
//!   an [`Error::OutOfSharedMemory`] now rather than a SIGBUS later. A 64-byte header
//!   holds a cross-process refcount: one reference per process that maps it plus one per
//!   message in flight; the last user unlinks the name. Names are registered with the
//!   [shm manager](crate::manager) *before* the file is created, so a SIGKILLed tree
//!   leaves nothing behind.
//!
//! A third kind, **read-only file segments** ([`file`]), maps a regular file's pages
//! `PROT_READ` and shared (`safetensors::load`); its fd is the handle, its kind comes
//! from its own handle variant, and it has no header, refcount or pool (see there).
//!
//! Received handles are checked before anything is mapped (memfd seals include
//! `SHRINK`; a named file is a regular 0600 file of ours; sizes cover what the handle
//! claims), so a short or forged segment is [`Error::InvalidMessage`], never a SIGBUS.
//! A receiver never commits memory because of bytes a peer wrote: whether a memfd is a
//! block comes from the handle's kind (`HandleWire::Block`), never from magic bytes in
//! the file; a plain segment and a large block are mapped only over the claimed range
//! (an arena-sized block, at most 1 MiB, whole), and pages are faulted in only as the
//! tensor touches them.
//!
//! **Residual risk (named segments).** A memfd is sealed, so once checked it can never
//! shrink. A named segment cannot be sealed: its size is checked when it is mapped, but
//! a hostile process *of the same user* that truncates `/dev/shm/multiproc_…` after a
//! receiver mapped it makes the receiver's next access to the lost pages a SIGBUS. Only
//! the same user can do this (the files are 0600), and that user can already ptrace
//! our processes; `file_descriptor` (the default) has no such window. A malformed
//! message that names segments also leaves their in-flight references unadopted: those
//! names stay until the tree's shm manager removes them when the tree has exited.
//!
//! `file_descriptor` storages live in *blocks* (see `recycler`): memfd segments with a
//! 64-byte header counting their uses across processes, which their creator recycles
//! once no process uses them any more. Small storages are carved out of shared 1 MiB
//! arena blocks, so a handle names a segment *and* an offset in it; a large storage has
//! a block of its own. A handle to a block (`HandleWire::Block`) carries one use, as a
//! `wire::InFlightUse` the message holds (see `reference`), which the receiving storage adopts
//! and keeps as long as it lives. A recycled block that both sides keep mapped costs a
//! tensor no zeroing, faulting in or unmapping of its pages on either side.
//! `file_system` storages live in named blocks, alike (see `segment`'s blocks).
//!
//! Invariant of the map cache: a process maps each segment at most once while it is
//! alive (keyed by device+inode for memfds, by name for named segments), so the same
//! storage sent twice, or two views of one storage, alias on the receiving side (and
//! `Storage` keeps a table on top, so they are even the same `Storage`, as in torch).
//!
//! Known limits: a message that is sent but never received (its queue dropped with it
//! inside, its receiver killed before `get`) keeps the in-flight reference of each named
//! segment it carries, so those names live until the shm manager cleans up after the
//! whole tree has exited. A received named segment is registered with the manager as
//! soon as it is mapped; between a producer's exit and that moment the manager's grace
//! period (2 s) is what keeps an unreceived segment alive when no other process of the
//! tree is connected.
//!
//! Files, lowest first (each uses only those above it): `strategy` — the two kinds;
//! `tree` — the manager address and the process tree it names; `name` — segment names,
//! which carry their tree; `registry` — the client of the tree's manager (the names
//! this process holds, the request codec, starting the daemon); `segment` — one
//! mapped segment and its header; `recycler` — the blocks this process recycles;
//! `cache`, `file`; `reference` — block uses as values; `words` — pages of shared atomic words (the state of
//! sync primitives and queues); `area` — a mapping laid out by its owner (a process
//! group's segment), with checked atomic words and byte ranges. The manager daemon (`crate::manager`) sits above shm
//! and speaks `registry`'s codec; nothing here depends on it.

#[allow(unsafe_code)]
pub(crate) mod area;
mod cache;
pub(crate) mod file;
pub(crate) mod name;
mod recycler;
mod reference;
pub(crate) mod registry;
#[allow(unsafe_code)]
mod segment;
pub(crate) mod strategy;
pub(crate) mod tree;
#[allow(unsafe_code)]
mod words;
// Shared words as the async reactor waits on them (feature `async`).
#[cfg(feature = "async")]
mod awaiting;

use std::any::Any;
use std::borrow::Cow;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub(crate) use area::SharedArea;
pub(crate) use cache::{CacheKey, lookup as cached, release_before_exit};
#[cfg(feature = "testing-internals")]
pub(crate) use cache::{MAPPED_ON_RECEIPT, flush_retained};
pub(crate) use name::SegmentName;
pub(crate) use recycler::allocate;
#[cfg(feature = "testing-internals")]
pub(crate) use recycler::release_idle as release_idle_blocks;
#[cfg(test)]
pub(crate) use recycler::small_max as allocate_small_max;
pub(crate) use reference::{BlockUse, Returns};
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use segment::BLOCK_MAGIC_BYTES;
pub(crate) use segment::{BLOCK_HEADER_LEN, Segment};
#[cfg(test)]
pub(crate) use words::WORDS;
pub(crate) use words::{FIRST_RESERVED_WORD, SharedWords, update_word};

use self::strategy::SharingStrategy;
use crate::error::{Error, Result};
use crate::wire::{self, Custody, Decoder, Encoder, KeptBlock, Reference};

/// Creates a plain segment (not a block) of `len > 0` bytes with `strategy`, already in
/// this process's map cache. Storages live in blocks (see `recycler`); only tests make
/// plain segments, and the wire accepts them.
#[cfg(test)]
pub(crate) fn create(strategy: SharingStrategy, len: usize) -> Result<Arc<Segment>> {
    let segment = match strategy {
        SharingStrategy::FileDescriptor => Segment::create_anonymous(len)?,
        SharingStrategy::FileSystem => {
            let name = SegmentName::generate()?;
            // Registered before it exists, so that no crash can leave it unknown to the
            // manager; unregistered again if creation fails.
            registry::register(&name)?;
            match Segment::create_named(name.clone(), len) {
                Ok(s) => s,
                Err(e) => {
                    registry::unregister(&name);
                    return Err(e);
                }
            }
        }
    };
    let segment = Arc::new(segment);
    cache::insert(&segment);
    Ok(segment)
}

/// Most bytes of idle blocks kept for reuse (see [`idle_bytes_limit`]).
const IDLE_LARGE_BYTES: usize = 2 << 30;

/// How many bytes of idle blocks a process keeps for reuse (and of received blocks
/// mapped after their last tensor, see `cache`): 2 GiB, or an eighth of
/// what this process may still commit (the memory cgroup's limit, or the machine's
/// available memory) when that is less, but at least 64 MiB. A producer of 256 MiB
/// tensors through a queue of 4 cycles through about six blocks; keeping them all
/// saves zeroing and mapping 256 MiB per tensor on both sides.
pub(crate) fn idle_bytes_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let room = crate::sys::memlimit::headroom()
            .map_or(u64::MAX, |h| h.bytes / 8)
            .min(IDLE_LARGE_BYTES as u64);
        usize::try_from(room)
            .unwrap_or(IDLE_LARGE_BYTES)
            .max(64 << 20)
    })
}

/// What the parent that collected the exit of worker `pid` does for shared memory:
/// when the worker ended without giving its blocks back itself (`gave_back` false:
/// killed, or crashed), it stops pooling the worker's named blocks; and it lets go of
/// its own retained mappings of blocks that can never come back (the worker's, once
/// their last tensor is gone), so that their memory is freed now, not in the middle
/// of a later receive.
pub(crate) fn worker_ended(pid: u32, gave_back: bool) {
    if !gave_back {
        unpool_blocks_of_ended(pid);
    }
    cache::release_dead_retained();
}

/// Stops pooling the named blocks that process `pid` of this tree made, now that it has
/// ended without doing so itself (killed, or crashed): their names then go with their
/// last tensors (at once for idle ones) instead of staying until the shm manager
/// cleans up after the whole tree. Anything that is not such a block is left alone.
fn unpool_blocks_of_ended(pid: u32) {
    for name in name::names_made_by(pid) {
        if let Ok(block) = Segment::open_named(name, 0, true) {
            if block.block_creator() == Some(pid) {
                block.unpool();
            }
        }
    }
}

/// Creates a block (see `recycler`) of `len` bytes, header included, with `strategy`,
/// already in this process's map cache.
fn create_block(strategy: SharingStrategy, len: usize) -> Result<Arc<Segment>> {
    let segment = match strategy {
        SharingStrategy::FileDescriptor => Segment::create_anonymous_block(len)?,
        SharingStrategy::FileSystem => {
            let name = SegmentName::generate()?;
            // Registered before it exists, as in `create`.
            registry::register(&name)?;
            match Segment::create_named_block(name.clone(), len) {
                Ok(s) => s,
                Err(e) => {
                    registry::unregister(&name);
                    return Err(e);
                }
            }
        }
    };
    let segment = Arc::new(segment);
    cache::insert(&segment);
    Ok(segment)
}

/// The wire form of a segment: always a block (never bytes in the file), named by its
/// entry in the message's references section (`wire::Reference`: an fd of the packet,
/// an inode in the channel's custody, or a name), which stands for the one use of the
/// block the message carries for its receiver. Plain segments do not travel: a peer
/// cannot make a receiver map a block as something else, nor hold one name or inode
/// under two kinds.
#[derive(Serialize, Deserialize)]
struct HandleWire {
    /// Index of the block's entry in the references section.
    reference: u32,
    /// Where the storage's bytes start in the block.
    offset: u64,
    /// How many bytes the storage uses.
    nbytes: u64,
}

/// A segment as a value inside a message: serializing lists its block in the message's
/// references (by fd, by inode when the channel keeps its fd, or by name) with a
/// [`BlockUse`] for the receiver; deserializing maps it (through the cache) and adopts
/// that use.
pub(crate) struct SegmentHandle {
    /// The segment.
    pub(crate) segment: Arc<Segment>,
    /// Where the storage's bytes start in it.
    pub(crate) offset: u64,
    /// How many bytes the storage uses.
    pub(crate) nbytes: u64,
    /// The use of its block a received handle brought, which the storage made from it
    /// adopts (or drops, giving it back, when this process holds one already). Always
    /// `None` on the sending side.
    pub(crate) brought: Option<BlockUse>,
}

impl Serialize for SegmentHandle {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = Encoder::current("a shared tensor").map_err(S::Error::custom)?;
        if !self.segment.is_block() {
            return Err(S::Error::custom(enc.fail(Error::Encode(
                "only pooled blocks travel between processes, and this segment is not one".into(),
            ))));
        }
        let name;
        let reference = if let Some(fd) = self.segment.shared_fd() {
            // A block by inode when the channel keeps its fd (see `wire::Custody`), else
            // with it.
            let by_inode = self.segment.inode().filter(|&(dev, ino)| {
                enc.custody().is_some_and(|custody| {
                    let identity: Arc<dyn Any + Send + Sync> = self.segment.clone();
                    custody.keep(&KeptBlock {
                        dev,
                        ino,
                        fd: fd.as_fd(),
                        len: self.segment.len() as u64,
                        identity: &identity,
                    })
                })
            });
            match by_inode {
                Some((dev, ino)) => Reference::Inode { dev, ino },
                None => Reference::Fd(enc.attach_shared_fd(fd)),
            }
        } else if let Some(n) = self.segment.name() {
            name = n;
            Reference::Name(Cow::Borrowed(name.as_str()))
        } else {
            return Err(S::Error::custom(
                enc.fail(Error::Encode("a segment with neither fd nor name".into())),
            ));
        };
        // The receiver adopts this use (or gives it back when it already holds one).
        let carried = wire::InFlightUse::take(Arc::clone(&self.segment) as _);
        let reference = enc.carry_reference(&reference, wire::CarriedRef::Use(carried));
        HandleWire {
            reference,
            offset: self.offset,
            nbytes: self.nbytes,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for SegmentHandle {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let HandleWire {
            reference,
            offset,
            nbytes,
        } = HandleWire::deserialize(d)?;
        let dec = Decoder::current("a shared tensor").map_err(D::Error::custom)?;
        let fail = |e: Error| D::Error::custom(dec.fail(e));
        let end = claimed_end(offset, nbytes).map_err(fail)?;
        if offset < segment::BLOCK_HEADER_LEN as u64 {
            return Err(fail(Error::InvalidMessage(format!(
                "a received tensor's handle names a pooled block, but offset {offset} is inside \
                 the block header"
            ))));
        }
        let segment = match dec.reference(reference).map_err(D::Error::custom)? {
            Reference::Fd(index) => dec
                .with_fd(index, |fd| receive_fd(fd, end))
                .map_err(D::Error::custom)?
                .map_err(fail)?,
            Reference::Inode { dev, ino } => {
                let custody = dec.custody();
                let custody = custody.as_ref().map(|(c, patience)| (&**c, *patience));
                receive_by_inode(custody, dev, ino, end).map_err(fail)?
            }
            Reference::Name(name) => named_handle(&name, end).map_err(fail)?,
        };
        // The block's use came with the message; adopted only once it is mapped.
        let decode = dec
            .adopt(
                reference,
                Arc::clone(&segment) as Arc<dyn crate::wire::Landing>,
            )
            .map_err(D::Error::custom)?;
        Ok(SegmentHandle {
            brought: Some(BlockUse::adopt(Arc::clone(&segment), decode)),
            segment,
            offset,
            nbytes,
        })
    }
}

/// The named block a `Reference::Name` names, whose data must reach `end`.
fn named_handle(name: &str, end: u64) -> Result<Arc<Segment>> {
    // The segment named last is found by comparing the name (checked when it first
    // came): a stream of tensors from one arena costs no parse and no hash.
    if let Some(segment) = cache::last_named(name) {
        return received_again(segment, end);
    }
    receive_named(SegmentName::parse(name)?, end)
}

/// Where a handle's bytes end (`offset + nbytes`), refusing overflow.
fn claimed_end(offset: u64, nbytes: u64) -> Result<u64> {
    offset.checked_add(nbytes).ok_or_else(|| {
        Error::InvalidMessage(format!(
            "a received tensor's handle claims {nbytes} bytes at offset {offset}, past any segment"
        ))
    })
}

/// Maps a received block's memfd that must hold at least `end` bytes, or finds it
/// already mapped here. Only a new mapping keeps (a duplicate of) the fd; a hit costs
/// one `fstat`. Nothing is faulted in here: pages are mapped as the tensor touches
/// them, so a peer's file costs no more than is read.
fn receive_fd(fd: BorrowedFd<'_>, end: u64) -> Result<Arc<Segment>> {
    let st = crate::sys::fs::status(fd, "a received segment")?;
    let key = CacheKey::Inode {
        dev: st.dev,
        ino: st.ino,
    };
    let (segment, _) = cache::get_or_try_insert(key, || {
        let fd = fd
            .try_clone_to_owned()
            .map_err(|e| Error::os("duplicating a received segment's fd", e))?;
        // Not populated: the creator has faulted every page in already, and the first
        // touch here (fault-around maps 16 pages per read fault) costs a third of what
        // `MADV_POPULATE_WRITE` does for pages that exist (measured: 256 MiB in 17 ms
        // against 56 ms).
        Segment::open_block(fd, end)
    })?;
    check_block(&segment, end)?;
    Ok(segment)
}

/// Finds the block a `Reference::Inode` names: mapped here already (no system call), or
/// mapped from the duplicate of its fd that the channel's custody holds (looked for
/// with the given patience, see `wire::Custody::find`). Like a `Block` handle's, it must
/// cover the claimed range.
fn receive_by_inode(
    custody: Option<(&dyn Custody, std::time::Duration)>,
    dev: u64,
    ino: u64,
    end: u64,
) -> Result<Arc<Segment>> {
    let Some((custody, patience)) = custody else {
        return Err(Error::InvalidMessage(
            "a received tensor's handle names a block by inode, which only a queue that keeps \
             its blocks' fds can resolve, but it did not arrive through one"
                .into(),
        ));
    };
    let (segment, _) = cache::get_or_try_insert(CacheKey::Inode { dev, ino }, || {
        let fd = custody.find(dev, ino, patience)?.ok_or_else(|| {
            Error::InvalidMessage(format!(
                "a received tensor names block {dev}:{ino}, which its queue does not hold: \
                 the message was not made by a multiproc put (or the queue's sockets were \
                 written by something else); it is dropped, and the queue stays usable"
            ))
        })?;
        // Not populated, as in `receive_fd`.
        Segment::open_block(fd, end)
    })?;
    check_block(&segment, end)?;
    Ok(segment)
}

/// Maps a received named block (whose data must be at least `end` bytes long), or
/// finds it mapped here already. Its reference comes with the message's use, which the
/// storage adopts.
fn receive_named(name: SegmentName, end: u64) -> Result<Arc<Segment>> {
    let key = CacheKey::Name(name.clone());
    let (segment, fresh) = cache::get_or_try_insert(key, || Segment::open_named(name, end, true))?;
    if !fresh {
        return received_again(segment, end);
    }
    check_block(&segment, end)?;
    if let Some(name) = segment.name() {
        // This process now maps it: connect to the manager, so it does not clean up
        // while we live, and so a restarted manager learns of the name again.
        if let Err(e) = registry::register(name) {
            tracing::warn!(segment = %name, "cannot register a received segment: {e}");
        }
    }
    Ok(segment)
}

/// A named block mapped here already, received again: the claim must fit it.
fn received_again(segment: Arc<Segment>, end: u64) -> Result<Arc<Segment>> {
    check_block(&segment, end)?;
    Ok(segment)
}

/// A received handle names a block (only blocks travel): what it names must be one
/// (something this process made itself and mapped as a plain segment is not), and
/// must hold the claimed range.
fn check_block(segment: &Segment, end: u64) -> Result<()> {
    if !segment.is_block() {
        return Err(Error::InvalidMessage(format!(
            "a received tensor's handle names a pooled block but segment {} is mapped here \
             as a plain segment",
            segment.name().map_or("?", |n| n.as_str()),
        )));
    }
    check_claim(segment, end)
}

/// [`receive_fd`] for the micro-benchmarks (`crate::__bench`).
#[cfg(feature = "bench-internals")]
pub(crate) fn receive_fd_for_bench(fd: BorrowedFd<'_>, nbytes: u64) -> Result<Arc<Segment>> {
    receive_fd(fd, nbytes)
}

fn check_claim(segment: &Segment, nbytes: u64) -> Result<()> {
    if nbytes > segment.len() as u64 {
        return Err(Error::InvalidMessage(format!(
            "a received tensor's handle claims {nbytes} bytes but its segment holds {}",
            segment.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
