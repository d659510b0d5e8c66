//! The fd side table of the message being encoded or decoded on this thread: how a
//! handle's `Serialize` impl hands its fd to the message ([`attach_fd`],
//! [`attach_shared_fd`]) and its `Deserialize` impl takes it back ([`received_fd`],
//! [`with_received_fd`]), and how an impl reports why it failed ([`fail`],
//! [`fail_with`]: postcard keeps only "custom error").

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;

use crate::error::Error;

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

#[derive(Default)]
pub(super) struct EncodeTable {
    /// The first error a handle's `Serialize` reported (postcard keeps only "custom error").
    pub(super) error: Option<String>,
    /// The first error a handle reported with [`fail_with`], kept with its variant.
    pub(super) typed: Option<Error>,
    pub(super) fds: Vec<AttachedFd>,
    pub(super) index_of: HashMap<RawFd, u32>,
    pub(super) on_unsent: Vec<Box<dyn FnOnce() + Send>>,
}

pub(super) struct DecodeTable {
    /// The first error a handle's `Deserialize` reported.
    pub(super) error: Option<String>,
    /// The first error a handle reported with [`fail_with`], kept with its variant.
    pub(super) typed: Option<Error>,
    /// `None` only while [`with_received_fd`] lends the fd out.
    pub(super) fds: Vec<Option<OwnedFd>>,
    pub(super) used: Vec<bool>,
}

thread_local! {
    pub(super) static ENCODER: RefCell<Option<EncodeTable>> = const { RefCell::new(None) };
    pub(super) static DECODER: RefCell<Option<DecodeTable>> = const { RefCell::new(None) };
}

/// The error a handle type gives when it is serialized outside a multiproc channel.
pub(crate) fn outside_channel(what: &str) -> String {
    format!(
        "{what} can only be serialized by a multiproc channel (Queue, SimpleQueue, pipe, Pool, \
         worker arguments): it carries a file descriptor"
    )
}

/// Records `message` as the reason the current encode or decode fails, so the error
/// the caller sees says what was wrong (postcard itself keeps only "custom error").
/// Returns it, for `serde::ser::Error::custom` / `serde::de::Error::custom`.
pub(crate) fn fail(message: String) -> String {
    let record = |slot: &mut Option<String>| {
        if slot.is_none() {
            *slot = Some(message.clone());
        }
    };
    ENCODER.with(|e| e.borrow_mut().as_mut().map(|t| record(&mut t.error)));
    DECODER.with(|d| d.borrow_mut().as_mut().map(|t| record(&mut t.error)));
    message
}

/// Like [`fail`], but keeps the error's variant: the caller of [`encode`] or [`decode`]
/// gets `err` itself (an `OutOfSharedMemory` stays one) instead of a generic
/// `Encode`/`InvalidMessage`. Returns its text, for `serde::ser::Error::custom` /
/// `serde::de::Error::custom`.
pub(crate) fn fail_with(err: Error) -> String {
    let message = err.to_string();
    let record = |slot: &mut Option<Error>| {
        if slot.is_none() {
            *slot = Some(err.clone());
        }
    };
    ENCODER.with(|e| e.borrow_mut().as_mut().map(|t| record(&mut t.typed)));
    DECODER.with(|d| d.borrow_mut().as_mut().map(|t| record(&mut t.typed)));
    fail(message)
}

/// Adds `fd` to the side table of the message being encoded on this thread and
/// returns its index. The same fd attached twice gets the same index. For use in
/// `Serialize` impls; fails outside [`encode`].
pub(crate) fn attach_fd(fd: BorrowedFd<'_>, what: &str) -> std::result::Result<u32, String> {
    attach_fd_inner(fd, what).map_err(fail)
}

fn attach_fd_inner(fd: BorrowedFd<'_>, what: &str) -> std::result::Result<u32, String> {
    ENCODER.with(|e| {
        let mut e = e.borrow_mut();
        let table = e.as_mut().ok_or_else(|| outside_channel(what))?;
        if let Some(&i) = table.index_of.get(&fd.as_raw_fd()) {
            return Ok(i);
        }
        let i = table.fds.len() as u32;
        let dup = fd
            .try_clone_to_owned()
            .map_err(|err| format!("cannot duplicate the fd of {what}: {err}"))?;
        table.index_of.insert(fd.as_raw_fd(), i);
        table.fds.push(AttachedFd::Owned(dup));
        Ok(i)
    })
}

/// Like [`attach_fd`], for an fd held in an `Arc`: the message keeps the `Arc` instead
/// of a duplicate, which saves a `dup` and a `close` per handle (the tensor hot path).
pub(crate) fn attach_shared_fd(fd: &Arc<OwnedFd>, what: &str) -> std::result::Result<u32, String> {
    ENCODER
        .with(|e| {
            let mut e = e.borrow_mut();
            let table = e.as_mut().ok_or_else(|| outside_channel(what))?;
            let raw = fd.as_raw_fd();
            if let Some(&i) = table.index_of.get(&raw) {
                return Ok(i);
            }
            let i = table.fds.len() as u32;
            table.index_of.insert(raw, i);
            table.fds.push(AttachedFd::Shared(Arc::clone(fd)));
            Ok(i)
        })
        .map_err(fail)
}

/// Registers work to undo if the message being encoded is never sent.
pub(crate) fn on_unsent(undo: Box<dyn FnOnce() + Send>) -> std::result::Result<(), String> {
    ENCODER.with(|e| match e.borrow_mut().as_mut() {
        Some(table) => {
            table.on_unsent.push(undo);
            Ok(())
        }
        None => {
            undo();
            Err(outside_channel("this value"))
        }
    })
}

/// Whether this thread is encoding a message right now.
pub(crate) fn is_encoding() -> bool {
    ENCODER.with(|e| e.borrow().is_some())
}

/// Whether this thread is decoding a message right now.
pub(crate) fn is_decoding() -> bool {
    DECODER.with(|d| d.borrow().is_some())
}

/// Takes (a duplicate of) fd number `index` of the message being decoded on this
/// thread. For use in `Deserialize` impls.
pub(crate) fn received_fd(index: u32, what: &str) -> std::result::Result<OwnedFd, String> {
    received_fd_inner(index, what).map_err(fail)
}

fn received_fd_inner(index: u32, what: &str) -> std::result::Result<OwnedFd, String> {
    DECODER.with(|d| {
        let mut d = d.borrow_mut();
        let table = d
            .as_mut()
            .ok_or_else(|| format!("{what} can only be deserialized by a multiproc channel"))?;
        let i = index as usize;
        let fd = table.fds.get(i).ok_or_else(|| {
            format!(
                "{what} refers to file descriptor #{index}, but the message carried {}",
                table.fds.len()
            )
        })?;
        let fd = fd
            .as_ref()
            .ok_or_else(|| format!("received fd #{index} of {what} is in use"))?;
        let dup = fd
            .try_clone()
            .map_err(|err| format!("cannot duplicate received fd #{index} of {what}: {err}"));
        table.used[i] = true;
        dup
    })
}

/// Lends fd number `index` of the message being decoded on this thread to `f`, without
/// duplicating it (the tensor hot path: a segment already mapped here needs only an
/// `fstat` of it; `f` duplicates it only to map a new one). `f` may report errors with
/// [`fail`]/[`fail_with`] but must not take another received fd.
pub(crate) fn with_received_fd<R>(
    index: u32,
    what: &str,
    f: impl FnOnce(BorrowedFd<'_>) -> R,
) -> std::result::Result<R, String> {
    let i = index as usize;
    let fd = DECODER
        .with(|d| {
            let mut d = d.borrow_mut();
            let table = d
                .as_mut()
                .ok_or_else(|| format!("{what} can only be deserialized by a multiproc channel"))?;
            let count = table.fds.len();
            let slot = table.fds.get_mut(i).ok_or_else(|| {
                format!(
                    "{what} refers to file descriptor #{index}, but the message carried {count}"
                )
            })?;
            let fd = slot
                .take()
                .ok_or_else(|| format!("received fd #{index} of {what} is in use"))?;
            table.used[i] = true;
            Ok(fd)
        })
        .map_err(fail)?;
    // The table is not borrowed while `f` runs, so `f` may record an error.
    let result = f(fd.as_fd());
    DECODER.with(|d| {
        if let Some(table) = d.borrow_mut().as_mut() {
            table.fds[i] = Some(fd);
        }
    });
    Ok(result)
}

/// Resets a thread-local table on every exit path, panics included.
pub(super) struct TableGuard<'a, T: 'static>(
    pub(super) &'static std::thread::LocalKey<RefCell<Option<T>>>,
    pub(super) std::marker::PhantomData<&'a ()>,
);

impl<T: 'static> Drop for TableGuard<'_, T> {
    fn drop(&mut self) {
        let _ = self.0.try_with(|t| t.borrow_mut().take());
    }
}
