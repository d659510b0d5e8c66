//! The wire: how a value becomes one packet on a socket, and back.
//!
//! A message is a serde value encoded with postcard. Values that stand for kernel
//! objects — tensors' shared segments, queues, events, locks — do not serialize their
//! fds as numbers: their `Serialize` impls hand the fd to the encoder's side table with
//! [`attach_fd`] and write the table index instead; on the other side, their
//! `Deserialize` impls take the fd back with [`received_fd`] (a duplicate) or borrow it
//! with [`with_received_fd`]. Tensors' segments use the cheap forms on both sides —
//! [`attach_shared_fd`] keeps the segment's `Arc`'d fd instead of a `dup`, and a
//! received segment that is already mapped needs only an `fstat` of the lent fd — so
//! a tensor costs no `dup`/`close` pair per message on either side. The table travels as
//! `SCM_RIGHTS` in the same `sendmsg` as the bytes, so a message and its handles arrive
//! together or not at all, and the sender may exit as soon as the send returns.
//!
//! Packet layout (all little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `b"MPW\x01"` |
//! | 4 | version ([`VERSION`]) |
//! | 5 | kind: 0 inline payload, 1 payload in a sealed memfd (the last fd) |
//! | 6 | flags: bit 0 set by a queue's `put`, which counted the message in the queue's size and (bounded) took a place for it |
//! | 7 | zero |
//! | 8..12 | number of fds the payload uses (not counting the payload memfd) |
//! | 12..16 | payload length in bytes |
//!
//! Payloads above [`INLINE_MAX`] go into a sealed memfd so every message is a single
//! packet whatever its size: one packet is delivered whole to exactly one reader, which
//! is what lets many processes put and get on one socket without locks.
//!
//! Invariant: decoding never panics and never trusts the sender. Every length, count
//! and index is checked; anything malformed is [`Error::InvalidMessage`] saying what.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::socket::{self, Attempt, Deadline, MAX_FDS_PER_PACKET, Packet};

/// The packet magic.
const MAGIC: [u8; 4] = *b"MPW\x01";
/// The wire format version; a packet of another version is refused.
pub(crate) const VERSION: u8 = 1;
const HEADER_LEN: usize = 16;
const KIND_INLINE: u8 = 0;
const KIND_MEMFD: u8 = 1;
/// Header flag: a queue's `put` counted this message (see [`Encoded::mark_counted`]).
const FLAG_COUNTED: u8 = 1;
/// Largest payload sent inside the packet itself.
pub(crate) const INLINE_MAX: usize = 60 * 1024;
/// Largest payload accepted from a memfd (a sanity bound against hostile lengths).
const MEMFD_PAYLOAD_MAX: u64 = 1 << 40;

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
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            AttachedFd::Owned(fd) => fd.as_fd(),
            AttachedFd::Shared(fd) => fd.as_fd(),
        }
    }

    /// An fd of its own (a `dup` for a shared one).
    fn into_owned(self) -> std::io::Result<OwnedFd> {
        match self {
            AttachedFd::Owned(fd) => Ok(fd),
            AttachedFd::Shared(fd) => fd.try_clone(),
        }
    }
}

/// A value encoded and ready to send, possibly several times.
pub(crate) struct Encoded {
    header: [u8; HEADER_LEN],
    /// The inline payload (empty when it is in the memfd).
    payload: Vec<u8>,
    /// The handles, the payload memfd last when there is one.
    fds: Vec<AttachedFd>,
    /// Run if the message is dropped without being sent: releases references that
    /// were taken on behalf of the receiver.
    on_unsent: Vec<Box<dyn FnOnce() + Send>>,
    sent: bool,
}

impl Drop for Encoded {
    fn drop(&mut self) {
        if !self.sent {
            for undo in self.on_unsent.drain(..) {
                undo();
            }
        }
    }
}

#[derive(Default)]
struct EncodeTable {
    /// The first error a handle's `Serialize` reported (postcard keeps only "custom error").
    error: Option<String>,
    /// The first error a handle reported with [`fail_with`], kept with its variant.
    typed: Option<Error>,
    fds: Vec<AttachedFd>,
    index_of: HashMap<RawFd, u32>,
    on_unsent: Vec<Box<dyn FnOnce() + Send>>,
}

struct DecodeTable {
    /// The first error a handle's `Deserialize` reported.
    error: Option<String>,
    /// The first error a handle reported with [`fail_with`], kept with its variant.
    typed: Option<Error>,
    /// `None` only while [`with_received_fd`] lends the fd out.
    fds: Vec<Option<OwnedFd>>,
    used: Vec<bool>,
}

thread_local! {
    static ENCODER: RefCell<Option<EncodeTable>> = const { RefCell::new(None) };
    static DECODER: RefCell<Option<DecodeTable>> = const { RefCell::new(None) };
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
struct TableGuard<'a, T: 'static>(
    &'static std::thread::LocalKey<RefCell<Option<T>>>,
    std::marker::PhantomData<&'a ()>,
);

impl<T: 'static> Drop for TableGuard<'_, T> {
    fn drop(&mut self) {
        let _ = self.0.try_with(|t| t.borrow_mut().take());
    }
}

/// Encodes `value` into a packet, attaching the fds of every handle inside it.
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded> {
    if is_encoding() {
        return Err(Error::Encode(
            "a value is being sent from inside the serialization of another message".into(),
        ));
    }
    ENCODER.with(|e| *e.borrow_mut() = Some(EncodeTable::default()));
    let guard = TableGuard(&ENCODER, std::marker::PhantomData);
    let bytes = postcard::to_stdvec(value);
    let table = ENCODER.with(|e| e.borrow_mut().take()).unwrap_or_default();
    drop(guard);
    let EncodeTable {
        mut fds,
        on_unsent,
        error,
        typed,
        ..
    } = table;
    let mut encoded = Encoded {
        header: [0; HEADER_LEN],
        payload: Vec::new(),
        fds: Vec::new(),
        on_unsent,
        sent: false,
    };
    let payload = bytes.map_err(|e| {
        typed.unwrap_or_else(|| Error::Encode(error.unwrap_or_else(|| e.to_string())))
    })?;
    let nfds = fds.len();
    if nfds > MAX_FDS_PER_PACKET - 1 {
        return Err(Error::Encode(format!(
            "a message would carry {nfds} file descriptors but one message carries at most {}: \
             send fewer unshared-storage tensors or queues per message, or use the file_system sharing strategy",
            MAX_FDS_PER_PACKET - 1
        )));
    }
    let payload_len = payload.len();
    if payload_len > u32::MAX as usize {
        return Err(Error::Encode(format!(
            "a message of {payload_len} bytes is larger than 4 GiB; put large data in tensors"
        )));
    }
    let kind = if payload_len > INLINE_MAX {
        let fd = memfd::create("multiproc-message", payload.len() as u64)?;
        write_all_at(fd.as_fd(), &payload)?;
        rustix::fs::fcntl_add_seals(
            &fd,
            rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::WRITE
                | rustix::fs::SealFlags::SEAL,
        )
        .map_err(|e| Error::os("sealing a message memfd", e))?;
        fds.push(AttachedFd::Owned(fd));
        KIND_MEMFD
    } else {
        encoded.payload = payload;
        KIND_INLINE
    };
    encoded.header[0..4].copy_from_slice(&MAGIC);
    encoded.header[4] = VERSION;
    encoded.header[5] = kind;
    encoded.header[8..12].copy_from_slice(&(nfds as u32).to_le_bytes());
    encoded.header[12..16].copy_from_slice(&(payload_len as u32).to_le_bytes());
    tracing::trace!(
        bytes = payload_len,
        handles = nfds,
        inline = kind == KIND_INLINE,
        "encoded a message"
    );
    encoded.fds = fds;
    Ok(encoded)
}

fn write_all_at(fd: BorrowedFd<'_>, mut bytes: &[u8]) -> Result<()> {
    let mut offset = 0u64;
    while !bytes.is_empty() {
        match rustix::io::pwrite(fd, bytes, offset) {
            Ok(0) => return Err(Error::Encode("a message memfd accepted no bytes".into())),
            Ok(n) => {
                bytes = &bytes[n..];
                offset += n as u64;
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::os("writing a message into a memfd", e)),
        }
    }
    Ok(())
}

/// Clears a received packet's [`FLAG_COUNTED`]: its places were given back already,
/// and it is to be received again (see `queue::channel`).
pub(crate) fn uncount(packet: &mut Packet) {
    if packet.bytes.len() >= HEADER_LEN {
        packet.bytes[6] &= !FLAG_COUNTED;
    }
}

/// Whether a received packet claims to have been counted by a queue's `put`: a
/// well-formed header of this version with [`FLAG_COUNTED`]. Random bytes, another
/// version or a forged header without the flag do not, so the getter gives back no
/// place for them.
pub(crate) fn is_counted(packet: &Packet) -> bool {
    let b = &packet.bytes;
    b.len() >= HEADER_LEN && b[0..4] == MAGIC && b[4] == VERSION && b[6] & FLAG_COUNTED != 0
}

impl Encoded {
    /// Marks the packet as counted by a queue's `put` (it took a place, or at least
    /// counted in the queue's size): only such a packet gives a place back when taken.
    pub(crate) fn mark_counted(&mut self) {
        self.header[6] |= FLAG_COUNTED;
    }

    /// The packet as a receiver would get it (bytes and fds), without sending it; for
    /// the fuzz target's seeds. The references taken for a receiver stay taken.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn into_packet(mut self) -> Packet {
        self.sent = true;
        let mut bytes = self.header.to_vec();
        bytes.extend_from_slice(&self.payload);
        // A shared fd becomes a duplicate; one that cannot be duplicated (fd limit) is
        // left out, and the packet then decodes as malformed — fine for a seed.
        let fds = std::mem::take(&mut self.fds)
            .into_iter()
            .filter_map(|fd| fd.into_owned().ok())
            .collect();
        Packet { bytes, fds }
    }

    /// The packet's header and inline payload when it carries no fds (then it is
    /// only bytes, and may travel through a queue's shared ring instead of a socket).
    pub(crate) fn as_plain_bytes(&self) -> Option<(&[u8], &[u8])> {
        self.fds
            .is_empty()
            .then_some((&self.header[..], &self.payload[..]))
    }

    /// Records that the packet went out some other way than [`send`](Self::send) (a
    /// queue's ring): the references taken for its receiver are the receiver's now.
    pub(crate) fn mark_sent(&mut self) {
        self.sent = true;
    }

    /// Sends the packet if the socket has room now.
    pub(crate) fn try_send(&mut self, sock: BorrowedFd<'_>) -> Result<Attempt<()>> {
        let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(AttachedFd::as_fd).collect();
        let sent = socket::try_send_packet(sock, &self.header, &self.payload, &fds)?;
        if matches!(sent, Attempt::Done(())) {
            self.sent = true;
        }
        Ok(sent)
    }

    /// Sends the packet, waiting for room until the deadline.
    pub(crate) fn send(&mut self, sock: BorrowedFd<'_>, deadline: Deadline) -> Result<()> {
        let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(AttachedFd::as_fd).collect();
        socket::send_packet(sock, &self.header, &self.payload, &fds, deadline)?;
        self.sent = true;
        Ok(())
    }
}

thread_local! {
    static RECV_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0; HEADER_LEN + INLINE_MAX + 1]);
}

/// Receives one packet (without decoding it), waiting until the deadline;
/// `Ok(None)` on timeout.
pub(crate) fn recv_packet(sock: BorrowedFd<'_>, deadline: Deadline) -> Result<Option<Packet>> {
    RECV_BUF.with(|b| socket::recv_packet(sock, &mut b.borrow_mut(), deadline))
}

/// Receives one packet without waiting; `Ok(None)` when none is there.
pub(crate) fn try_recv_packet(sock: BorrowedFd<'_>) -> Result<Option<Packet>> {
    RECV_BUF.with(
        |b| match socket::try_recv_packet(sock, &mut b.borrow_mut())? {
            Attempt::Done(p) => Ok(Some(p)),
            Attempt::WouldBlock => Ok(None),
        },
    )
}

/// Decodes a received packet. Never panics; a malformed packet is an error that says
/// what was wrong with it.
pub(crate) fn decode<T: DeserializeOwned>(packet: Packet) -> Result<T> {
    let Packet { bytes, fds } = packet;
    decode_from(&bytes, fds)
}

/// [`decode`] of a packet's bytes and fds, the bytes borrowed (a packet without fds
/// stays the caller's, to keep when decoding fails for a reason that may pass).
pub(crate) fn decode_from<T: DeserializeOwned>(bytes: &[u8], mut fds: Vec<OwnedFd>) -> Result<T> {
    tracing::trace!(
        bytes = bytes.len(),
        handles = fds.len(),
        "decoding a message"
    );
    let bad = |what: String| Err(Error::InvalidMessage(what));
    if bytes.len() < HEADER_LEN {
        return bad(format!(
            "a packet of {} bytes is shorter than the {HEADER_LEN}-byte header",
            bytes.len()
        ));
    }
    if bytes[0..4] != MAGIC {
        return bad(
            "the packet does not start with multiproc's magic bytes (not a multiproc message)"
                .into(),
        );
    }
    if bytes[4] != VERSION {
        return bad(format!(
            "wire version {} is not supported (this build speaks version {VERSION}): \
             are both processes running the same multiproc?",
            bytes[4]
        ));
    }
    let kind = bytes[5];
    let nfds = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    let len = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]) as usize;
    let from_memfd;
    let payload: &[u8] = match kind {
        KIND_INLINE => {
            if nfds != fds.len() {
                return bad(format!(
                    "the header declares {nfds} fds but {} arrived",
                    fds.len()
                ));
            }
            if bytes.len() - HEADER_LEN != len {
                return bad(format!(
                    "the header declares a {len}-byte payload but {} bytes arrived",
                    bytes.len() - HEADER_LEN
                ));
            }
            &bytes[HEADER_LEN..]
        }
        KIND_MEMFD => {
            if fds.len() != nfds + 1 {
                return bad(format!(
                    "the header declares {nfds} fds plus a payload memfd but {} fds arrived",
                    fds.len()
                ));
            }
            if bytes.len() != HEADER_LEN {
                return bad("an out-of-band message carries inline bytes".into());
            }
            let Some(fd) = fds.pop() else {
                return bad("the payload memfd is missing".into());
            };
            from_memfd = read_sealed_payload(fd.as_fd(), len)?;
            &from_memfd
        }
        other => return bad(format!("unknown packet kind {other}")),
    };
    let used = vec![false; fds.len()];
    DECODER.with(|d| {
        *d.borrow_mut() = Some(DecodeTable {
            error: None,
            typed: None,
            fds: fds.into_iter().map(Some).collect(),
            used,
        })
    });
    let guard = TableGuard(&DECODER, std::marker::PhantomData);
    let result = postcard::take_from_bytes::<T>(payload);
    let table = DECODER.with(|d| d.borrow_mut().take());
    drop(guard);
    let (value, rest) = match result {
        Ok(v) => v,
        Err(e) => {
            let (typed, error) = table.map_or((None, None), |t| (t.typed, t.error));
            return Err(typed.unwrap_or_else(|| {
                Error::InvalidMessage(
                    error.unwrap_or_else(|| format!("cannot decode the payload: {e}")),
                )
            }));
        }
    };
    if !rest.is_empty() {
        return bad(format!("{} bytes follow the end of the value", rest.len()));
    }
    if let Some(table) = table {
        if let Some(i) = table.used.iter().position(|u| !u) {
            return bad(format!(
                "the message carried {} fds but fd #{i} is not referred to by its payload",
                table.fds.len()
            ));
        }
    }
    Ok(value)
}

fn read_sealed_payload(fd: BorrowedFd<'_>, len: usize) -> Result<Vec<u8>> {
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| {
        Error::InvalidMessage(format!("the payload fd is not a sealed memfd ({e})"))
    })?;
    use rustix::fs::SealFlags;
    if !seals.contains(SealFlags::SHRINK | SealFlags::WRITE) {
        return Err(Error::InvalidMessage(
            "the payload memfd is not sealed against writing and shrinking".into(),
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| Error::os("fstat of a message memfd", e))?;
    let size = st.st_size.max(0) as u64;
    if (len as u64) > size || size > MEMFD_PAYLOAD_MAX {
        return Err(Error::InvalidMessage(format!(
            "the header declares a {len}-byte payload but its memfd holds {size} bytes"
        )));
    }
    // A sender writes its whole payload, so every page of it is allocated; a sparse
    // file claims bytes nobody paid for, and reading them would make this process
    // commit that memory (a hole reads as zeros into a buffer of the full length).
    let written = (st.st_blocks.max(0) as u64).saturating_mul(512);
    if written < len as u64 {
        return Err(Error::InvalidMessage(format!(
            "the header declares a {len}-byte payload but only {written} bytes of its memfd \
             were ever written (a sparse file); refusing to read it"
        )));
    }
    // The length is the sender's word: allocating must fail as an error, never abort.
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| {
        Error::InvalidMessage(format!(
            "cannot allocate {len} bytes for a message payload (out of memory)"
        ))
    })?;
    out.resize(len, 0);
    let mut done = 0;
    while done < len {
        match rustix::io::pread(fd, &mut out[done..], done as u64) {
            Ok(0) => {
                return Err(Error::InvalidMessage(format!(
                    "the payload memfd ended after {done} of {len} bytes"
                )));
            }
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::os("reading a message memfd", e)),
        }
    }
    Ok(out)
}

/// A message inside a message: a value encoded on its own, to be decoded later by code
/// that knows its type (a pool worker that receives tasks of many types through one
/// channel).
///
/// Its handles ride in the outer message's fd table, so a tensor inside an `Opaque`
/// travels by handle like any other.
pub(crate) struct Opaque {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// References taken for the eventual receiver. Serializing the `Opaque` into an
    /// outer message lends them to that message: if it is sent, the receiver adopts
    /// them; if it is not (a failed send hands the `Opaque` back to its caller, who may
    /// send it again), they come back here. Dropping an `Opaque` that holds them
    /// releases them.
    on_unsent: Arc<Mutex<Vec<Undo>>>,
}

/// Work that gives back a reference taken for a receiver.
type Undo = Box<dyn FnOnce() + Send>;

impl Opaque {
    /// Encodes `value` now.
    pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Self> {
        let mut inner = encode(value)?;
        // The inner packet: header plus inline payload, or header alone with the
        // payload memfd as its last fd; either way it decodes with `decode`.
        let mut bytes = inner.header.to_vec();
        bytes.extend_from_slice(&inner.payload);
        let fds = std::mem::take(&mut inner.fds)
            .into_iter()
            .map(AttachedFd::into_owned)
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| Error::os("duplicating the fds of a nested message", e))?;
        Ok(Self {
            bytes,
            fds,
            on_unsent: {
                inner.sent = true; // ownership of the undo work moves to the Opaque
                Arc::new(Mutex::new(std::mem::take(&mut inner.on_unsent)))
            },
        })
    }

    /// Decodes the value.
    pub(crate) fn decode<T: DeserializeOwned>(mut self) -> Result<T> {
        // Decoding here adopts the references taken for the receiver.
        self.undo_list().clear();
        decode(Packet {
            bytes: std::mem::take(&mut self.bytes),
            fds: std::mem::take(&mut self.fds),
        })
    }
}

impl Opaque {
    /// A copy that can be sent independently, when the value holds no handles (no fds,
    /// no references taken for a receiver): then it is only bytes. `None` otherwise —
    /// a handle's references can be handed to one receiver only.
    pub(crate) fn try_clone_plain(&self) -> Option<Opaque> {
        if !self.fds.is_empty() || !self.undo_list().is_empty() {
            return None;
        }
        Some(Opaque {
            bytes: self.bytes.clone(),
            fds: Vec::new(),
            on_unsent: Arc::new(Mutex::new(Vec::new())),
        })
    }

    fn undo_list(&self) -> MutexGuard<'_, Vec<Undo>> {
        self.on_unsent.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Opaque {
    fn drop(&mut self) {
        for undo in self.undo_list().drain(..) {
            undo();
        }
    }
}

impl Serialize for Opaque {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let mut indices = Vec::with_capacity(self.fds.len());
        for fd in &self.fds {
            indices.push(attach_fd(fd.as_fd(), "a nested message").map_err(S::Error::custom)?);
        }
        // The outer message now carries the receiver's references; if it is never
        // sent they return to this `Opaque` (or, if it is gone, are released).
        let undos: Vec<Undo> = self.undo_list().drain(..).collect();
        if !undos.is_empty() {
            let home = Arc::downgrade(&self.on_unsent);
            on_unsent(Box::new(move || match home.upgrade() {
                Some(list) => list.lock().unwrap_or_else(|p| p.into_inner()).extend(undos),
                None => undos.into_iter().for_each(|undo| undo()),
            }))
            .map_err(S::Error::custom)?;
        }
        (&self.bytes, indices).serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for Opaque {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let (bytes, indices) = <(Vec<u8>, Vec<u32>)>::deserialize(d)?;
        let fds = indices
            .into_iter()
            .map(|i| received_fd(i, "a nested message"))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(D::Error::custom)?;
        Ok(Self {
            bytes,
            fds,
            on_unsent: Arc::new(Mutex::new(Vec::new())),
        })
    }
}

impl std::fmt::Debug for Opaque {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opaque")
            .field("bytes", &self.bytes.len())
            .field("fds", &self.fds.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip<T: Serialize + DeserializeOwned>(v: &T) -> Result<T> {
        let (a, b) = socket::seqpacket_pair()?;
        let mut enc = encode(v)?;
        enc.send(a.as_fd(), None)?;
        let p = recv_packet(b.as_fd(), None)?.expect("no deadline");
        decode(p)
    }

    #[test]
    fn plain_values_round_trip_without_a_socket() {
        fn again<T: Serialize + DeserializeOwned>(v: &T) -> Result<T> {
            decode(encode(v)?.into_packet())
        }
        let v = (
            7u8,
            "text".to_string(),
            vec![(1u64, Some(-2i32)), (3, None)],
        );
        assert_eq!(again(&v).unwrap(), v);
        let err = Error::timeout("a test wait", Some(std::time::Duration::from_millis(5)));
        assert_eq!(again(&err).unwrap(), err);
        // A packet cut short or with bytes added is refused.
        let mut p = encode(&v).unwrap().into_packet();
        p.bytes.pop();
        assert!(matches!(
            decode::<(u8, String)>(p),
            Err(Error::InvalidMessage(_))
        ));
        let mut p = encode(&v).unwrap().into_packet();
        p.bytes.push(0);
        assert!(matches!(
            decode::<(u8, String)>(p),
            Err(Error::InvalidMessage(_))
        ));
    }

    #[test]
    #[cfg_attr(miri, ignore = "sockets and memfds")]
    fn small_and_large_values_round_trip() {
        assert_eq!(
            roundtrip(&(1u32, "x".to_string())).unwrap(),
            (1, "x".to_string())
        );
        let big: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        assert_eq!(roundtrip(&big).unwrap(), big);
    }

    #[test]
    #[cfg_attr(miri, ignore = "sockets and memfds")]
    fn nested_messages_carry_their_fds() {
        let (a, b) = socket::seqpacket_pair().unwrap();
        let inner = Opaque::encode(&crate::sync::Event::new().unwrap()).unwrap();
        let outer: (u8, Opaque) = roundtrip(&(7u8, inner)).unwrap();
        let ev: crate::sync::Event = outer.1.decode().unwrap();
        ev.set();
        assert!(ev.is_set());
        drop((a, b));
    }

    #[test]
    #[cfg_attr(miri, ignore = "sockets and named segments")]
    fn a_nested_message_that_fails_to_send_keeps_its_references() {
        let t = crate::tensor::Tensor::full(&[256], 3.0, crate::tensor::DType::F32).unwrap();
        t.storage()
            .share_memory_with(crate::shm::strategy::SharingStrategy::FileSystem)
            .unwrap();
        let name = t.storage().shm_name().unwrap();
        let inner = Opaque::encode(&t).unwrap();
        drop(t); // the Opaque's in-flight reference is all that keeps the segment now
        let path = format!("/dev/shm/{name}");
        // The outer send fails (nobody receives): the reference must stay with the
        // Opaque, which comes back to the sender, not be released.
        let (a, b) = socket::seqpacket_pair().unwrap();
        drop(b);
        let mut outer = encode(&(1u8, &inner)).unwrap();
        assert!(outer.send(a.as_fd(), None).is_err());
        drop(outer);
        assert!(
            std::path::Path::new(&path).exists(),
            "a failed send released the nested message's reference"
        );
        // Sent again, it arrives and decodes.
        let (c, d) = socket::seqpacket_pair().unwrap();
        let mut again = encode(&(2u8, &inner)).unwrap();
        again.send(c.as_fd(), None).unwrap();
        drop((again, inner));
        let back: (u8, Opaque) = decode(recv_packet(d.as_fd(), None).unwrap().unwrap()).unwrap();
        let t: crate::tensor::Tensor = back.1.decode().unwrap();
        assert_eq!(t.sum().unwrap(), 768.0);
        drop(t);
        assert!(
            !std::path::Path::new(&path).exists(),
            "the last user unlinked it"
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bytes in [
            vec![],
            vec![1, 2, 3],
            b"MPW\x01\x09\0\0\0\0\0\0\0\0\0\0\0".to_vec(),
        ] {
            let err = decode::<String>(Packet { bytes, fds: vec![] }).unwrap_err();
            assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
        }
        let mut header = MAGIC.to_vec();
        header.extend([VERSION, KIND_INLINE, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
        let err = decode::<()>(Packet {
            bytes: header,
            fds: vec![],
        })
        .unwrap_err();
        assert!(err.to_string().contains("declares 1 fds"), "{err}");
    }
}
