//! Framing: an encoded message ([`Encoded`]) as the bytes and fds of one packet, its
//! sending and receiving, the header flag a queue's `put` sets, and the payload memfd
//! of a large message.

use std::cell::{Cell, RefCell};
use std::os::fd::BorrowedFd;

use super::context::{AttachedFd, CarriedList};
use super::{FLAG_COUNTED, HEADER_LEN, INLINE_MAX, MAGIC, MEMFD_PAYLOAD_MAX, VERSION};
use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::socket::{self, Attempt, Deadline, Packet};

/// A value encoded and ready to send, possibly several times.
pub(crate) struct Encoded {
    pub(super) header: [u8; HEADER_LEN],
    /// The inline payload (empty when it is in the memfd).
    pub(super) payload: Vec<u8>,
    /// The handles, the payload memfd last when there is one.
    pub(super) fds: Vec<AttachedFd>,
    /// The references taken for the receiver: handed over when the message is sent,
    /// given back when it is dropped unsent.
    pub(super) carried: CarriedList,
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
        self.hand_over();
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
        self.hand_over();
    }

    /// The message went out: its receiver adopts the references it carries.
    fn hand_over(&mut self) {
        for reference in self.carried.drain(..) {
            reference.sent();
        }
    }

    /// Sends the packet if the socket has room now.
    pub(crate) fn try_send(&mut self, sock: BorrowedFd<'_>) -> Result<Attempt<()>> {
        let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(AttachedFd::as_fd).collect();
        let sent = socket::try_send_packet(sock, &self.header, &self.payload, &fds)?;
        if matches!(sent, Attempt::Done(())) {
            self.hand_over();
        }
        Ok(sent)
    }

    /// Sends the packet, waiting for room until the deadline.
    pub(crate) fn send(&mut self, sock: BorrowedFd<'_>, deadline: Deadline) -> Result<()> {
        let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(AttachedFd::as_fd).collect();
        socket::send_packet(sock, &self.header, &self.payload, &fds, deadline)?;
        self.hand_over();
        Ok(())
    }
}

impl Drop for Encoded {
    fn drop(&mut self) {
        recycle(std::mem::take(&mut self.payload));
    }
}

thread_local! {
    static RECV_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0; HEADER_LEN + INLINE_MAX + 1]);
    /// The bytes of the last message this thread encoded or took off a ring, kept for
    /// the next one: a stream of puts and gets then costs no allocation for its bytes.
    static SPARE: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

/// The largest buffer [`recycle`] keeps: a thread that once sent a large message
/// does not keep its memory.
const SPARE_MAX: usize = 64 << 10;

/// An empty buffer with room for `capacity` bytes: the thread's spare one when it has
/// it (see [`recycle`]).
pub(crate) fn buffer(capacity: usize) -> Vec<u8> {
    let mut bytes = SPARE.try_with(Cell::take).unwrap_or_default();
    bytes.clear();
    bytes.reserve(capacity);
    bytes
}

/// Keeps `bytes`, a message's that is done with, as the thread's spare buffer.
pub(crate) fn recycle(bytes: Vec<u8>) {
    if bytes.capacity() != 0 && bytes.capacity() <= SPARE_MAX {
        // During the thread's exit the spare is gone: the buffer is freed instead.
        let _ = SPARE.try_with(|spare| spare.set(bytes));
    }
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

pub(super) fn read_sealed_payload(fd: BorrowedFd<'_>, len: usize) -> Result<Vec<u8>> {
    let sealed = memfd::is_content_sealed(fd).map_err(|e| {
        Error::InvalidMessage(format!("the payload fd is not a sealed memfd ({e})"))
    })?;
    if !sealed {
        return Err(Error::InvalidMessage(
            "the payload memfd is not sealed against writing and shrinking".into(),
        ));
    }
    let (size, written) = memfd::size_and_allocated(fd)?;
    if (len as u64) > size || size > MEMFD_PAYLOAD_MAX {
        return Err(Error::InvalidMessage(format!(
            "the header declares a {len}-byte payload but its memfd holds {size} bytes"
        )));
    }
    // A sender writes its whole payload, so every page of it is allocated; a sparse
    // file claims bytes nobody paid for, and reading them would make this process
    // commit that memory (a hole reads as zeros into a buffer of the full length).
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
    let done = memfd::read_at_start(fd, &mut out)?;
    if done < len {
        return Err(Error::InvalidMessage(format!(
            "the payload memfd ended after {done} of {len} bytes"
        )));
    }
    Ok(out)
}
