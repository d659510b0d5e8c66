//! The context of the message being encoded or decoded on this thread, which handle
//! types' serde impls talk to: [`Encoder`] and [`Decoder`].
//!
//! A handle (a tensor's segment, a queue, an event) cannot serialize its fd as a
//! number, nor the references it takes for its receiver as bytes. While [`encode`]
//! runs, [`Encoder::current`] gives its `Serialize` impl the message's side of things:
//! the fd side table ([`Encoder::attach_fd`] writes an index into the bytes, the fd
//! goes with the packet), the references the message carries ([`Encoder::carry`]:
//! handed to the receiver when the message is sent, released when it is dropped
//! unsent), and the slot for the reason it failed ([`Encoder::fail`]: postcard keeps
//! only "custom error", so the caller of `encode` gets the typed error recorded here).
//! [`Decoder::current`] is the same for `Deserialize` impls while [`decode`] runs.
//!
//! Outside `encode`/`decode` (a tensor given to serde_json, say) there is no context,
//! and `current` says that the value can only travel through a multiproc channel.
//!
//! Invariant: the thread-local tables are set for exactly the duration of one
//! `encode`/`decode` (reset on every exit path, panics included), and each method
//! borrows them only for its own duration, so nested values' impls may call them in
//! any order.
//!
//! [`encode`]: super::encode
//! [`decode`]: super::decode

use std::cell::RefCell;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::error::Error;

/// A reference a message carries for its receiver (a use of a block, a name's
/// in-flight reference). Dropping it gives the reference back, as happens to the
/// references of a message that is never sent.
pub(crate) trait Carried: Send {
    /// The message went out: its receiver adopts the reference, so this value lets
    /// go of it without giving it back.
    fn sent(self: Box<Self>);
}

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
    pub(super) carried: Vec<Box<dyn Carried>>,
}

/// What a decode lends out.
pub(super) struct DecodeTable {
    /// The first error a handle reported.
    pub(super) error: Option<Box<Error>>,
    /// `None` only while [`Decoder::with_fd`] lends the fd out.
    pub(super) fds: Vec<Option<OwnedFd>>,
    pub(super) used: Vec<bool>,
    /// `Some` while the packet is kept for another try if this decode fails with
    /// [`Error::FdLimit`] (see [`Decoder::adopted`]): the references the decode holds
    /// for that try.
    pub(super) held: Option<Vec<Box<dyn Carried>>>,
    /// What the handles decoded so far adopted (tracked only when `held` is `Some`).
    adopted: Vec<Arc<dyn Readopt>>,
}

/// A reference a received message brought and a handle adopted, which the decode can
/// take once more for a packet kept for another try (see [`Decoder::adopted`]).
pub(crate) trait Readopt: Send + Sync {
    /// Another reference of the same kind on the same memory.
    fn take_again(self: Arc<Self>) -> Result<Box<dyn Carried>, Error>;
}

thread_local! {
    /// The `adopted` list of the last decode, kept for its capacity: the ring path
    /// decodes every packet as one that may be kept, and should not allocate for it.
    static ADOPTED: RefCell<Vec<Arc<dyn Readopt>>> = const { RefCell::new(Vec::new()) };
}

impl DecodeTable {
    pub(super) fn new(fds: Vec<OwnedFd>) -> DecodeTable {
        DecodeTable {
            error: None,
            used: vec![false; fds.len()],
            fds: fds.into_iter().map(Some).collect(),
            held: None,
            adopted: Vec::new(),
        }
    }

    /// A table for a decode whose packet is kept for another try when it fails.
    pub(super) fn keeping_packet(fds: Vec<OwnedFd>) -> DecodeTable {
        DecodeTable {
            held: Some(Vec::new()),
            adopted: ADOPTED.with(|a| std::mem::take(&mut *a.borrow_mut())),
            ..DecodeTable::new(fds)
        }
    }

    /// The references held for the packet's next try; gives the `adopted` list's
    /// capacity back for the next decode.
    pub(super) fn into_held(mut self) -> Vec<Box<dyn Carried>> {
        let mut adopted = std::mem::take(&mut self.adopted);
        adopted.clear();
        let _ = ADOPTED.try_with(|a| *a.borrow_mut() = adopted);
        self.held.take().unwrap_or_default()
    }
}

thread_local! {
    static ENCODER: RefCell<Option<EncodeTable>> = const { RefCell::new(None) };
    static DECODER: RefCell<Option<DecodeTable>> = const { RefCell::new(None) };
}

/// The error a handle type gives when it is serialized outside a multiproc channel.
fn outside_channel(what: &str) -> String {
    format!(
        "{what} can only be serialized by a multiproc channel (Queue, SimpleQueue, pipe, Pool, \
         worker arguments): it carries a file descriptor"
    )
}

/// Runs `f` with `table` as this thread's encode context; returns what `f` returned and
/// the table. The context is reset on every exit path, panics included.
pub(super) fn encoding<R>(table: EncodeTable, f: impl FnOnce() -> R) -> (R, EncodeTable) {
    with_table(&ENCODER, table, f)
}

/// [`encoding`] for a decode.
pub(super) fn decoding<R>(table: DecodeTable, f: impl FnOnce() -> R) -> (R, DecodeTable) {
    with_table(&DECODER, table, f)
}

fn with_table<T: 'static, R>(
    key: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    table: T,
    f: impl FnOnce() -> R,
) -> (R, T) {
    struct Reset<T: 'static>(&'static std::thread::LocalKey<RefCell<Option<T>>>);
    impl<T: 'static> Drop for Reset<T> {
        fn drop(&mut self) {
            let _ = self.0.try_with(|t| t.borrow_mut().take());
        }
    }
    key.with(|t| *t.borrow_mut() = Some(table));
    let reset = Reset(key);
    let result = f();
    let table = key.with(|t| t.borrow_mut().take());
    drop(reset);
    // `f` cannot take the table away: only this function sets or takes it.
    match table {
        Some(table) => (result, table),
        None => unreachable!("the context table is set for the whole of `f`"),
    }
}

/// Whether this thread is encoding a message right now.
pub(super) fn is_encoding() -> bool {
    ENCODER.with(|e| e.borrow().is_some())
}

/// Records `err` as why the current encode or decode fails (the first one counts) and
/// returns its text, for `serde::ser::Error::custom` / `serde::de::Error::custom`.
fn record(
    key: &'static std::thread::LocalKey<RefCell<Option<impl ErrorSlot>>>,
    err: Error,
) -> String {
    let message = err.to_string();
    key.with(|t| {
        if let Some(table) = t.borrow_mut().as_mut() {
            let slot = table.slot();
            if slot.is_none() {
                *slot = Some(Box::new(err));
            }
        }
    });
    message
}

/// Boxed, so that a table (moved in and out of its thread-local on every message)
/// stays small.
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
        self.with_table(|table| table.carried.push(reference));
    }

    /// Records `err` as why this encode fails (the caller of `encode` gets it, variant
    /// and all) and returns its text, for `serde::ser::Error::custom`.
    pub(crate) fn fail(&self, err: Error) -> String {
        record(&ENCODER, err)
    }

    fn with_table<R>(&self, f: impl FnOnce(&mut EncodeTable) -> R) -> R {
        ENCODER.with(|e| match e.borrow_mut().as_mut() {
            Some(table) => f(table),
            // An `Encoder` exists only while its table is set on this thread.
            None => unreachable!("an Encoder outlived its encode"),
        })
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
        if DECODER.with(|d| d.borrow().is_some()) {
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

    /// The same decode, for a part of the handle that is `what` ("queue ring"), so
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
        if matches!(err, Error::FdLimit { .. }) {
            self.hold_adopted();
        }
        record(&DECODER, err)
    }

    /// Records that the handle being decoded adopted a reference its message brought.
    ///
    /// A packet without fds whose decode runs into the fd limit stays queued for another
    /// try (see `queue::channel`). The partial value the failed decode drops gives the
    /// references it adopted back, but the packet's next try must find them again: so
    /// when such a decode fails with [`Error::FdLimit`] ([`fail`](Self::fail)), it
    /// first takes each adopted reference once more, while the partial value still
    /// holds it, and keeps those for the next try. A decode that succeeds pays only for
    /// this list.
    pub(crate) fn adopted(&self, reference: Arc<dyn Readopt>) {
        self.with_table(|table| {
            if table.held.is_some() {
                table.adopted.push(reference);
            }
        });
    }

    /// Takes every adopted reference once more, for the packet's next try.
    fn hold_adopted(&self) {
        let adopted = self.with_table(|table| std::mem::take(&mut table.adopted));
        let mut taken = Vec::with_capacity(adopted.len());
        for reference in &adopted {
            match Arc::clone(reference).take_again() {
                Ok(r) => taken.push(r),
                // Only a name being removed refuses: the next try then fails to map it,
                // as it would have without the limit.
                Err(e) => tracing::debug!("a reference kept for a retried message: {e}"),
            }
        }
        self.with_table(|table| {
            if let Some(held) = &mut table.held {
                held.append(&mut taken);
            }
            table.adopted = adopted;
            table.adopted.clear();
        });
    }

    fn with_table<R>(&self, f: impl FnOnce(&mut DecodeTable) -> R) -> R {
        DECODER.with(|d| match d.borrow_mut().as_mut() {
            Some(table) => f(table),
            // A `Decoder` exists only while its table is set on this thread.
            None => unreachable!("a Decoder outlived its decode"),
        })
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
