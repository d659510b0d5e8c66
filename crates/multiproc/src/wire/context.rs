//! The context of the message being encoded or decoded on this thread, which handle
//! types' serde impls talk to: [`Encoder`] and [`Decoder`].
//!
//! A handle (a tensor's segment, a queue, an event) cannot serialize its fd as a
//! number, nor the references it takes for its receiver as bytes. While [`encode`]
//! runs, [`Encoder::current`] gives its `Serialize` impl the message's side of things:
//! the fd side table ([`Encoder::attach_fd`] writes an index into the bytes, the fd
//! goes with the packet), the references the message carries ([`Encoder::carry`]:
//! handed to the receiver when the message is sent, released when it is dropped
//! unsent; [`Encoder::carry_reference`] also lists a block use in the packet's
//! references section, below), and the slot for the reason it failed
//! ([`Encoder::fail`]: postcard keeps only "custom error", so the caller of `encode`
//! gets the typed error recorded here). [`Decoder::current`] is the same for
//! `Deserialize` impls while [`decode`] runs.
//!
//! **A decode adopts nothing until it has succeeded.** A handle that adopts a block use
//! of its message ([`Decoder::adopt`]) gets the decode's id; a use dropped while that
//! same decode still runs (a partial value dropped on an error, or a use this process
//! held already) is not given back at once but deferred ([`defer_give_back`]). When the
//! decode succeeds the deferred ones are given back; when it fails they are forgotten
//! and the packet's references section says what to give back — or, for a packet kept
//! for another try, nothing, since the packet still carries every use.
//!
//! Outside `encode`/`decode` (a tensor given to serde_json, say) there is no context,
//! and `current` says that the value can only travel through a multiproc channel.
//!
//! Invariant: the thread-local tables are set for exactly the duration of one
//! `encode`/`decode` (reset on every exit path, panics included), and each method
//! borrows them only for its own duration, so nested values' impls may call them in
//! any order. A table lives on the stack of the `encode` or `decode` that made it; the
//! thread-local only lends it (`scoped_tls`), so a message's table is never moved in
//! and out of thread-local storage.
//!
//! # The references section
//!
//! A message's references are the uses of shared blocks it carries for its receiver,
//! listed in the packet itself so that a packet nobody decodes can still give them back.
//!
//! Every block handle in a message stands for one use of its block that the sender took
//! for the receiver (see `shm::reference`). The packet lists them in its *references
//! section*, one entry per use, each saying how the block is found: by an fd of the
//! packet, by device and inode in the custody of the channel it travels through, or by
//! name. A handle in the payload names its entry by index.
//!
//! That list is what makes a message that is never decoded — a queue dropped with
//! messages in it, a pool result nobody reads, an [`Opaque`](super::Opaque) dropped, a
//! packet refused as malformed — give back what it carried: [`give_back_unread`] reads
//! the section alone (never the payload, which only the receiver's type can read) and
//! hands each entry to a [`GiveBack`], which the layer that owns blocks provides.
//!
//! Section layout (after the payload, or after the header when the payload is in a
//! memfd): a `u32` count, then that many postcard-encoded [`Reference`]s. Its length in
//! bytes is the header's bytes 16..20.
//!
//! Invariant: each entry is given back at most once — by the value that adopted it, by
//! the decode that failed (which adopted nothing it kept), or by the holder that drops
//! the packet unread — and a packet kept for another try gives back nothing.
//!
//! [`encode`]: super::encode
//! [`decode`]: super::decode

use std::borrow::Cow;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::Custody;
use crate::error::{Error, Result};
use crate::sys::socket::Packet;

/// A reference a message carries for its receiver (a use of a block, a name's
/// in-flight reference). Dropping it gives the reference back, as happens to the
/// references of a message that is never sent.
pub(crate) trait Carried: Send {
    /// The message went out: its receiver adopts the reference, so this value lets
    /// go of it without giving it back.
    fn sent(self: Box<Self>);
}

/// A shared block whose uses messages carry for their receivers (`shm`'s blocks). A
/// message holds the block itself with each use ([`InFlightUse`]), so carrying the use
/// of a tensor's block costs no allocation.
pub(crate) trait InFlightBlock: Send + Sync {
    /// Takes a use for a message about to be sent (counted as in flight until its
    /// receiver's decode succeeds).
    fn take_in_flight_use(&self);
    /// Gives back a use taken for a message that was never received.
    fn give_back_in_flight_use(&self);
}

/// One use of a block that a message carries for its receiver: given back if the
/// message is dropped unsent — in the process that took it only, since a `fork` child
/// inherits unsent messages but not their uses.
pub(crate) struct InFlightUse {
    block: Arc<dyn InFlightBlock>,
    /// The process that took it, 0 once it was sent.
    owner: u32,
}

impl InFlightUse {
    /// Takes a use of `block` for a message.
    pub(crate) fn take(block: Arc<dyn InFlightBlock>) -> InFlightUse {
        block.take_in_flight_use();
        InFlightUse {
            block,
            owner: crate::sys::fork_local::cached_pid(),
        }
    }
}

impl Drop for InFlightUse {
    fn drop(&mut self) {
        if self.owner == crate::sys::fork_local::cached_pid() {
            self.block.give_back_in_flight_use();
        }
    }
}

/// A reference a message carries: a block's use (every tensor's), held inline, or
/// any other [`Carried`], boxed.
pub(crate) enum CarriedRef {
    Use(InFlightUse),
    Other(Box<dyn Carried>),
}

impl CarriedRef {
    /// The message went out: the receiver adopts the reference (see [`Carried::sent`]).
    pub(crate) fn sent(self) {
        match self {
            CarriedRef::Use(mut used) => used.owner = 0,
            CarriedRef::Other(other) => other.sent(),
        }
    }
}

/// The references one message carries: one or two inline, so a message with a tensor
/// or two allocates nothing for them.
pub(crate) type CarriedList = SmallVec<[CarriedRef; 2]>;

/// An fd in a message's side table: a duplicate the message owns, or a shared
/// reference to the fd of a value that outlives nothing (a segment keeps its memfd in an
/// `Arc` so that sending it costs no `dup` and no `close`).
pub(crate) enum AttachedFd {
    /// A duplicate owned by the message.
    Owned(OwnedFd),
    /// The holder's own fd, kept open by the `Arc` while the message lives.
    Shared(Arc<OwnedFd>),
}

impl AttachedFd {
    pub(super) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            AttachedFd::Owned(fd) => fd.as_fd(),
            AttachedFd::Shared(fd) => fd.as_fd(),
        }
    }

    /// An fd of its own (a `dup` for a shared one).
    pub(super) fn into_owned(self) -> std::io::Result<OwnedFd> {
        match self {
            AttachedFd::Owned(fd) => Ok(fd),
            AttachedFd::Shared(fd) => fd.try_clone(),
        }
    }
}

/// What an encode collects.
#[derive(Default)]
pub(super) struct EncodeTable {
    /// The first error a handle reported.
    pub(super) error: Option<Box<Error>>,
    pub(super) fds: Vec<AttachedFd>,
    /// Which index each attached fd got (a message carries a handful: a list is
    /// cheaper than a hash map).
    index_of: Vec<(RawFd, u32)>,
    pub(super) carried: CarriedList,
    /// The packet's references section so far, and its number of entries.
    pub(super) references: Section,
    reference_count: u32,
    /// The custody of the channel the message goes through, if it keeps its blocks'
    /// fds (see `custody`).
    pub(super) custody: Option<Arc<dyn Custody>>,
}

impl EncodeTable {
    /// The table of an encode for a channel with `custody` (if it keeps its blocks' fds).
    pub(super) fn new(custody: Option<Arc<dyn Custody>>) -> EncodeTable {
        EncodeTable {
            custody,
            ..EncodeTable::default()
        }
    }
}

/// What a decode lends out.
pub(super) struct DecodeTable {
    /// The first error a handle reported.
    pub(super) error: Option<Box<Error>>,
    /// `None` only while [`Decoder::with_fd`] lends the fd out.
    pub(super) fds: Vec<Option<OwnedFd>>,
    pub(super) used: Vec<bool>,
    /// The packet's references section, and whether a handle adopted each entry.
    pub(super) references: Entries<(Reference<'static>, bool)>,
    /// This decode's id (see the module docs).
    id: u64,
    /// Uses adopted by this decode and dropped while it ran (see the module docs).
    pub(super) deferred: Vec<Box<dyn Carried>>,
    /// What the adopting handles do once the decode has succeeded (a block's use then
    /// stops being in flight: see [`Decoder::adopt`]).
    pub(super) landed: SmallVec<[Arc<dyn Landing>; 2]>,
    /// What gives back the references of a packet that will not be decoded: lent to
    /// the nested messages this decode makes ([`Decoder::give_back_to`]).
    pub(super) returns: Arc<dyn GiveBack>,
    /// How long a lookup in the channel's custody may wait (see [`Custody::find`]).
    patience: Duration,
}

impl DecodeTable {
    pub(super) fn new(
        fds: Vec<OwnedFd>,
        references: Entries<(Reference<'static>, bool)>,
        returns: Arc<dyn GiveBack>,
        patience: Duration,
    ) -> DecodeTable {
        static IDS: AtomicU64 = AtomicU64::new(1);
        DecodeTable {
            error: None,
            used: vec![false; fds.len()],
            fds: fds.into_iter().map(Some).collect(),
            references,
            id: IDS.fetch_add(1, Ordering::Relaxed),
            deferred: Vec::new(),
            landed: SmallVec::new(),
            returns,
            patience,
        }
    }

    /// The fds, all back in the table once the decode has ended.
    pub(super) fn take_fds(&mut self) -> Vec<OwnedFd> {
        std::mem::take(&mut self.fds)
            .into_iter()
            .flatten()
            .collect()
    }
}

/// What holds a use that a message brought (a block), told once the decode that
/// adopted it has succeeded (see [`Decoder::adopt`]). A trait object rather than a
/// closure: the holder is already shared, so telling it costs no allocation.
pub(crate) trait Landing: Send + Sync {
    /// The decode that adopted the use succeeded: the use is this process's now.
    fn landed(&self);
}

scoped_tls::scoped_thread_local!(static ENCODER: RefCell<EncodeTable>);
scoped_tls::scoped_thread_local!(static DECODER: RefCell<DecodeTable>);

/// The error a handle type gives when it is serialized outside a multiproc channel.
fn outside_channel(what: &str) -> String {
    format!(
        "{what} can only be serialized by a multiproc channel (Queue, SimpleQueue, pipe, Pool, \
         worker arguments): it carries a file descriptor"
    )
}

/// Runs `f` with `table` as this thread's encode context, and returns what `f`
/// returned. The context is reset on every exit path, panics included.
pub(super) fn encoding<R>(table: &RefCell<EncodeTable>, f: impl FnOnce() -> R) -> R {
    ENCODER.set(table, f)
}

/// [`encoding`] for a decode.
pub(super) fn decoding<R>(table: &RefCell<DecodeTable>, f: impl FnOnce() -> R) -> R {
    DECODER.set(table, f)
}

/// Whether the decode with id `id` is running on this thread (see the module docs).
pub(crate) fn is_decoding(id: u64) -> bool {
    DECODER.is_set() && DECODER.with(|d| d.try_borrow().is_ok_and(|t| t.id == id))
}

/// Defers giving back `reference`, a use adopted by the decode with id `id`, to that
/// decode's end (see the module docs). Hands it back when that decode is not running
/// on this thread: the caller gives it back now.
pub(crate) fn defer_give_back(id: u64, reference: Box<dyn Carried>) -> Option<Box<dyn Carried>> {
    if !DECODER.is_set() {
        return Some(reference);
    }
    DECODER.with(|d| match d.try_borrow_mut() {
        Ok(mut table) if table.id == id => {
            table.deferred.push(reference);
            None
        }
        _ => Some(reference),
    })
}

/// Whether every fd and every reference the message carried was named by a handle;
/// what was not, as the error of a malformed message. Run at the end of a decode,
/// inside it.
pub(super) fn check_all_used() -> Result<(), Error> {
    if !DECODER.is_set() {
        return Ok(());
    }
    DECODER.with(|d| {
        let table = d.borrow();
        if let Some(i) = table.used.iter().position(|u| !u) {
            return Err(Error::InvalidMessage(format!(
                "the message carried {} fds but fd #{i} is not referred to by its payload",
                table.used.len()
            )));
        }
        if let Some(i) = table.references.iter().position(|(_, adopted)| !adopted) {
            return Err(Error::InvalidMessage(format!(
                "the message lists {} references but #{i} is not named by its payload",
                table.references.len()
            )));
        }
        Ok(())
    })
}

/// Whether this thread is encoding a message right now.
pub(super) fn is_encoding() -> bool {
    ENCODER.is_set()
}

/// Records `err` as why the current encode or decode fails (the first one counts) and
/// returns its text, for `serde::ser::Error::custom` / `serde::de::Error::custom`.
fn record<T: ErrorSlot>(key: &'static scoped_tls::ScopedKey<RefCell<T>>, err: Error) -> String {
    let message = err.to_string();
    if key.is_set() {
        key.with(|t| {
            if let Ok(mut table) = t.try_borrow_mut() {
                let slot = table.slot();
                if slot.is_none() {
                    *slot = Some(Box::new(err));
                }
            }
        });
    }
    message
}

/// Boxed, so that a table (made on every message) stays small.
trait ErrorSlot: 'static {
    fn slot(&mut self) -> &mut Option<Box<Error>>;
}

impl ErrorSlot for EncodeTable {
    fn slot(&mut self) -> &mut Option<Box<Error>> {
        &mut self.error
    }
}

impl ErrorSlot for DecodeTable {
    fn slot(&mut self) -> &mut Option<Box<Error>> {
        &mut self.error
    }
}

/// The message being encoded on this thread, as one handle's `Serialize` impl sees it
/// (`what` the handle is, for error texts). Not `Send`: it stands for this thread's
/// encode.
pub(crate) struct Encoder<'w> {
    what: &'w str,
    _this_thread: PhantomData<*const ()>,
}

impl<'w> Encoder<'w> {
    /// The encode running on this thread, for a handle that is `what` ("a queue");
    /// outside one, the error that it can only be serialized by a multiproc channel.
    pub(crate) fn current(what: &'w str) -> std::result::Result<Encoder<'w>, String> {
        if is_encoding() {
            Ok(Encoder {
                what,
                _this_thread: PhantomData,
            })
        } else {
            Err(outside_channel(what))
        }
    }

    /// Adds a duplicate of `fd` to the message's side table and returns its index. The
    /// same fd attached twice gets the same index.
    pub(crate) fn attach_fd(&self, fd: BorrowedFd<'_>) -> std::result::Result<u32, String> {
        let what = self.what;
        let attached = self.with_table(|table| {
            if let Some(i) = table.index(fd.as_raw_fd()) {
                return Ok(i);
            }
            let dup = fd
                .try_clone_to_owned()
                .map_err(|e| Error::Encode(format!("cannot duplicate the fd of {what}: {e}")))?;
            Ok(table.push(fd.as_raw_fd(), AttachedFd::Owned(dup)))
        });
        attached.map_err(|e| self.fail(e))
    }

    /// Like [`attach_fd`](Self::attach_fd), for an fd held in an `Arc`: the message
    /// keeps the `Arc` instead of a duplicate, which saves a `dup` and a `close` per
    /// handle (the tensor hot path).
    pub(crate) fn attach_shared_fd(&self, fd: &Arc<OwnedFd>) -> u32 {
        self.with_table(|table| {
            let raw = fd.as_raw_fd();
            match table.index(raw) {
                Some(i) => i,
                None => table.push(raw, AttachedFd::Shared(Arc::clone(fd))),
            }
        })
    }

    /// Gives the message a reference it carries for its receiver (see [`Carried`]).
    pub(crate) fn carry(&self, reference: Box<dyn Carried>) {
        self.with_table(|table| table.carried.push(CarriedRef::Other(reference)));
    }

    /// The custody of the channel the message goes through, if it keeps its blocks'
    /// fds (see `custody`).
    pub(crate) fn custody(&self) -> Option<Arc<dyn Custody>> {
        self.with_table(|table| table.custody.clone())
    }

    /// Gives the message a block use it carries for its receiver (`carried`), listed
    /// in the packet's references section as `reference`; returns the entry's index,
    /// which the handle writes.
    pub(crate) fn carry_reference(&self, reference: &Reference<'_>, carried: CarriedRef) -> u32 {
        self.with_table(|table| {
            let index = table.reference_count;
            push(&mut table.references, &mut table.reference_count, reference);
            table.carried.push(carried);
            index
        })
    }

    /// Records `err` as why this encode fails (the caller of `encode` gets it, variant
    /// and all) and returns its text, for `serde::ser::Error::custom`.
    pub(crate) fn fail(&self, err: Error) -> String {
        record(&ENCODER, err)
    }

    /// An `Encoder` exists only while its table is set on this thread, and each
    /// method borrows it for its own duration only.
    fn with_table<R>(&self, f: impl FnOnce(&mut EncodeTable) -> R) -> R {
        ENCODER.with(|e| f(&mut e.borrow_mut()))
    }
}

impl EncodeTable {
    fn index(&self, raw: RawFd) -> Option<u32> {
        self.index_of
            .iter()
            .find(|(r, _)| *r == raw)
            .map(|&(_, i)| i)
    }

    fn push(&mut self, raw: RawFd, fd: AttachedFd) -> u32 {
        let i = self.fds.len() as u32;
        self.index_of.push((raw, i));
        self.fds.push(fd);
        i
    }
}

/// The message being decoded on this thread, as one handle's `Deserialize` impl sees
/// it (`what` the handle is, for error texts). Not `Send`: it stands for this thread's
/// decode.
pub(crate) struct Decoder<'w> {
    what: &'w str,
    _this_thread: PhantomData<*const ()>,
}

impl<'w> Decoder<'w> {
    /// The decode running on this thread, for a handle that is `what`; outside one, the
    /// error that it can only be deserialized by a multiproc channel.
    pub(crate) fn current(what: &'w str) -> std::result::Result<Decoder<'w>, String> {
        if DECODER.is_set() {
            Ok(Decoder {
                what,
                _this_thread: PhantomData,
            })
        } else {
            Err(format!(
                "{what} can only be deserialized by a multiproc channel"
            ))
        }
    }

    /// What the handle being decoded is.
    pub(crate) fn what(&self) -> &'w str {
        self.what
    }

    /// The same decode, for a part of the handle that is `what` ("a queue's ring"), so
    /// that errors name the part.
    pub(crate) fn about<'p>(&self, what: &'p str) -> Decoder<'p> {
        Decoder {
            what,
            _this_thread: PhantomData,
        }
    }

    /// Takes (a duplicate of) fd number `index` of the message.
    pub(crate) fn take_fd(&self, index: u32) -> std::result::Result<OwnedFd, String> {
        let what = self.what;
        let taken = self.with_table(|table| {
            let fd = table.lend(index, what)?;
            let dup = fd.try_clone().map_err(|e| {
                Error::InvalidMessage(format!(
                    "cannot duplicate received fd #{index} of {what}: {e}"
                ))
            });
            table.fds[index as usize] = Some(fd);
            dup
        });
        taken.map_err(|e| self.fail(e))
    }

    /// Lends fd number `index` of the message to `f`, without duplicating it (the tensor
    /// hot path: a segment already mapped here needs only an `fstat` of it; `f`
    /// duplicates it only to map a new one). `f` may record errors with
    /// [`fail`](Self::fail) but must not take another received fd.
    pub(crate) fn with_fd<R>(
        &self,
        index: u32,
        f: impl FnOnce(BorrowedFd<'_>) -> R,
    ) -> std::result::Result<R, String> {
        let what = self.what;
        let fd = self
            .with_table(|table| table.lend(index, what))
            .map_err(|e| self.fail(e))?;
        // The table is not borrowed while `f` runs, so `f` may record an error.
        let result = f(fd.as_fd());
        self.with_table(|table| table.fds[index as usize] = Some(fd));
        Ok(result)
    }

    /// Records `err` as why this decode fails (the caller of `decode` gets it, variant
    /// and all) and returns its text, for `serde::de::Error::custom`.
    pub(crate) fn fail(&self, err: Error) -> String {
        record(&DECODER, err)
    }

    /// Entry `index` of the packet's references section (a handle's).
    pub(crate) fn reference(&self, index: u32) -> std::result::Result<Reference<'static>, String> {
        let what = self.what;
        self.with_table(|table| match table.references.get(index as usize) {
            Some((reference, _)) => Ok(reference.clone()),
            None => Err(Error::InvalidMessage(format!(
                "{what} names reference #{index}, but the message lists {}",
                table.references.len()
            ))),
        })
        .map_err(|e| self.fail(e))
    }

    /// Records that the handle being decoded adopted entry `index` of the references
    /// section; returns this decode's id, for the adopted use (see the module docs).
    /// `landed` is told once the whole decode has succeeded (never when it fails: the
    /// packet then still carries the use). An entry is adopted once: a second handle
    /// naming it is malformed.
    pub(crate) fn adopt(
        &self,
        index: u32,
        landed: Arc<dyn Landing>,
    ) -> std::result::Result<u64, String> {
        let what = self.what;
        self.with_table(|table| {
            let id = table.id;
            match table.references.get_mut(index as usize) {
                Some((_, adopted @ false)) => {
                    *adopted = true;
                    table.landed.push(landed);
                    Ok(id)
                }
                Some(_) => Err(Error::InvalidMessage(format!(
                    "{what} names reference #{index}, which another handle of the message named \
                     already"
                ))),
                None => Err(Error::InvalidMessage(format!(
                    "{what} names reference #{index}, which the message does not list"
                ))),
            }
        })
        .map_err(|e| self.fail(e))
    }

    /// The custody of the channel the packet came through, if it keeps its blocks'
    /// fds (see `custody`), with how long a lookup in it may wait for this decode.
    pub(crate) fn custody(&self) -> Option<(Arc<dyn Custody>, Duration)> {
        self.with_table(|table| Some((table.returns.custody()?.clone(), table.patience)))
    }

    /// What gives back the references of a packet this decode makes but does not
    /// decode (a nested message's).
    pub(crate) fn give_back_to(&self) -> Arc<dyn GiveBack> {
        self.with_table(|table| Arc::clone(&table.returns))
    }

    /// As `Encoder::with_table`.
    fn with_table<R>(&self, f: impl FnOnce(&mut DecodeTable) -> R) -> R {
        DECODER.with(|d| f(&mut d.borrow_mut()))
    }
}

impl DecodeTable {
    /// Takes fd `index` out of the table (to be put back) and marks it used.
    fn lend(&mut self, index: u32, what: &str) -> Result<OwnedFd, Error> {
        let count = self.fds.len();
        let slot = self.fds.get_mut(index as usize).ok_or_else(|| {
            Error::InvalidMessage(format!(
                "{what} refers to file descriptor #{index}, but the message carried {count}"
            ))
        })?;
        let fd = slot.take().ok_or_else(|| {
            Error::InvalidMessage(format!("received fd #{index} of {what} is in use"))
        })?;
        self.used[index as usize] = true;
        Ok(fd)
    }
}

// The references section (see the module docs).

/// How a message's block is found (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Reference<'a> {
    /// A block whose memfd is fd number `.0` of the packet.
    Fd(u32),
    /// A block named by its memfd's device and inode, its fd in the custody of the
    /// channel the packet travels through.
    Inode { dev: u64, ino: u64 },
    /// A named block (the `file_system` strategy).
    Name(#[serde(borrow)] Cow<'a, str>),
}

impl Reference<'_> {
    /// The same reference, owning its name.
    pub(crate) fn into_owned(self) -> Reference<'static> {
        match self {
            Reference::Fd(i) => Reference::Fd(i),
            Reference::Inode { dev, ino } => Reference::Inode { dev, ino },
            Reference::Name(n) => Reference::Name(Cow::Owned(n.into_owned())),
        }
    }
}

/// Gives back the use a reference of an unread message stands for. Implemented by the
/// layer that owns blocks, one per channel; `fds` are the packet's.
pub(crate) trait GiveBack: Send + Sync {
    fn give_back(&self, reference: &Reference<'_>, fds: &[OwnedFd]);

    /// The custody of the channel whose packets these are, if it keeps its blocks'
    /// fds: a decode of them finds blocks named by inode there (see `custody`).
    fn custody(&self) -> Option<&Arc<dyn Custody>> {
        None
    }
}

impl std::fmt::Debug for dyn GiveBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GiveBack")
    }
}

/// A section being built: the count and a few entries are kept inline (an inode
/// entry is at most 21 bytes), so a message with a tensor or two allocates none.
pub(crate) type Section = SmallVec<[u8; 64]>;

/// A section's entries as a decode keeps them: one or two inline.
pub(crate) type Entries<R> = SmallVec<[R; 2]>;

/// Most entries one section may declare: a section is read from a packet of at most
/// a few hundred KiB, and an entry takes at least two bytes.
const MAX_ENTRIES: usize = 1 << 20;

/// The entries of a references section (`section`: the bytes the header says it
/// spans). Untrusted: every count and entry is checked.
pub(crate) fn parse(section: &[u8]) -> Result<Entries<Reference<'_>>> {
    parse_into(section, |r| r)
}

/// [`parse`], each entry made into what `into` returns, with no allocation for one or
/// two (a decode keeps owned entries with a flag each).
pub(crate) fn parse_into<'a, R>(
    section: &'a [u8],
    mut into: impl FnMut(Reference<'a>) -> R,
) -> Result<Entries<R>> {
    if section.is_empty() {
        return Ok(Entries::new());
    }
    let bad = |what: String| Error::InvalidMessage(format!("the references section {what}"));
    let Some((count, mut rest)) = section.split_first_chunk::<4>() else {
        return Err(bad(format!(
            "is {} bytes, too short for its count",
            section.len()
        )));
    };
    let count = u32::from_le_bytes(*count) as usize;
    if count > MAX_ENTRIES.min(rest.len() / 2) {
        return Err(bad(format!(
            "declares {count} entries in {} bytes",
            rest.len()
        )));
    }
    let mut entries = Entries::with_capacity(count);
    for i in 0..count {
        let (entry, after) = postcard::take_from_bytes::<Reference<'_>>(rest)
            .map_err(|e| bad(format!("has a malformed entry #{i}: {e}")))?;
        entries.push(into(entry));
        rest = after;
    }
    if !rest.is_empty() {
        return Err(bad(format!("has {} bytes after its entries", rest.len())));
    }
    Ok(entries)
}

/// Appends one entry to a section being built (`count` entries so far).
pub(crate) fn push(section: &mut Section, count: &mut u32, reference: &Reference<'_>) {
    if section.is_empty() {
        section.extend_from_slice(&[0; 4]);
    }
    // Written into a buffer on the stack, then copied in one go: postcard's extending
    // writer checks the section's room byte by byte. Only a long name needs more.
    let mut entry = [0u8; 48];
    match postcard::to_slice(reference, &mut entry) {
        Ok(bytes) => section.extend_from_slice(bytes),
        // Writing into a growable buffer cannot fail for these types.
        Err(_) => {
            if let Ok(out) = postcard::to_extend(reference, std::mem::take(section)) {
                *section = out;
            }
        }
    }
    *count += 1;
    section[..4].copy_from_slice(&count.to_le_bytes());
}

/// Gives back every reference `packet` carries, without decoding its payload: for a
/// packet dropped unread. A packet too malformed to list its references gives back
/// nothing (it is not one of ours).
pub(crate) fn give_back_unread(packet: Packet, to: &dyn GiveBack) {
    let Packet { bytes, mut fds } = packet;
    let Some(section) = super::references_section(&bytes, &mut fds) else {
        return;
    };
    match parse(&section) {
        Ok(entries) => {
            for entry in &entries {
                to.give_back(entry, &fds);
            }
        }
        Err(e) => tracing::debug!("an unread packet's references cannot be read: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_round_trips_and_refuses_garbage() {
        let entries = [
            Reference::Fd(3),
            Reference::Inode {
                dev: 7,
                ino: 1 << 40,
            },
            Reference::Name(Cow::Borrowed("mp-1-2-3")),
            // Longer than the stack buffer an entry is first written into.
            Reference::Name(Cow::Owned("n".repeat(100))),
        ];
        let (mut section, mut count) = (Section::new(), 0);
        for e in &entries {
            push(&mut section, &mut count, e);
        }
        assert_eq!(parse(&section).unwrap().as_slice(), entries);
        assert!(parse(&[]).unwrap().is_empty());
        assert!(parse(&[1, 0]).is_err());
        assert!(parse(&[9, 0, 0, 0, 0]).is_err());
        let mut longer = section.clone();
        longer.push(0);
        assert!(parse(&longer).is_err());
        assert!(parse(&section[..section.len() - 1]).is_err());
    }
}
