//! Unix `SOCK_SEQPACKET` sockets that carry bytes and file descriptors together.
//!
//! # Safety
//!
//! one `setsockopt` through libc on a socket that is valid for the call; everything
//! else is rustix. Received fds are `OwnedFd` from the moment they arrive.
//!
//! One `sendmsg` carries one whole packet and its fds (`SCM_RIGHTS`); the kernel
//! delivers each packet whole to exactly one reader, which is what makes a socket shared
//! by many processes a correct multi-producer multi-consumer channel without locks.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType, recvmsg,
    sendmsg, socketpair,
};

use crate::error::{Error, Result};

/// The most fds one packet can carry (the kernel's `SCM_MAX_FD`).
pub(crate) const MAX_FDS_PER_PACKET: usize = 253;

/// When a blocking operation gives up: `None` waits forever.
pub(crate) type Deadline = Option<Instant>;

/// Turns an optional timeout into a deadline measured from now. A timeout too long for
/// the clock to represent (`Duration::MAX`, say) waits forever, as `None` does.
pub(crate) fn deadline_after(timeout: Option<Duration>) -> Deadline {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

/// What [`wait_fd`] waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// Data to read (or a hang-up).
    Readable,
    /// Room to write.
    Writable,
}

/// Waits until `fd` is ready or the deadline passes. Returns `false` on timeout.
/// A hang-up or error condition counts as ready: the following operation reports it.
pub(crate) fn wait_fd(
    fd: BorrowedFd<'_>,
    readiness: Readiness,
    deadline: Deadline,
) -> Result<bool> {
    let flags = match readiness {
        Readiness::Readable => PollFlags::IN,
        Readiness::Writable => PollFlags::OUT,
    };
    Ok(poll_until(&[fd], flags, deadline)?.is_some())
}

/// Waits until any of `fds` is readable (or hung up) or the deadline passes; returns
/// which are ready (all `false` on timeout).
pub(crate) fn poll_readable(fds: &[BorrowedFd<'_>], deadline: Deadline) -> Result<Vec<bool>> {
    Ok(poll_until(fds, PollFlags::IN, deadline)?.unwrap_or_else(|| vec![false; fds.len()]))
}

/// The one poll loop: waits until one of `fds` has `flags` (or a hang-up or error) or
/// the deadline passes, through interruptions and early wake-ups. `None` on timeout,
/// else which fds are ready. An empty set only waits out the deadline.
fn poll_until(
    fds: &[BorrowedFd<'_>],
    flags: PollFlags,
    deadline: Deadline,
) -> Result<Option<Vec<bool>>> {
    let mut polled: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::from_borrowed_fd(*fd, flags))
        .collect();
    loop {
        let timeout = deadline.map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as _,
            }
        });
        match poll(&mut polled, timeout.as_ref()) {
            Ok(0) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(None);
                }
            }
            Ok(_) => {
                return Ok(Some(
                    polled.iter().map(|p| !p.revents().is_empty()).collect(),
                ));
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(Error::os("poll", e)),
        }
    }
}

/// A connected pair of non-blocking, close-on-exec `SOCK_SEQPACKET` sockets.
pub(crate) fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd)> {
    let (a, b) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| Error::os("socketpair(AF_UNIX, SOCK_SEQPACKET)", e))?;
    grow_send_buffer(&a);
    grow_send_buffer(&b);
    Ok((a, b))
}

/// How much data may wait in a socket before a sender blocks. Larger than the
/// default (~208 KiB) so that a producer can run ahead of its consumers by thousands of
/// small messages. `SO_SNDBUFFORCE` needs CAP_NET_ADMIN; without it the kernel caps
/// `SO_SNDBUF` at `net.core.wmem_max`, which is still correct, only less buffered.
const SEND_BUFFER_BYTES: usize = 32 << 20;

fn grow_send_buffer(fd: &OwnedFd) {
    // Both calls are best effort: a smaller buffer only means earlier back-pressure.
    let forced = {
        let value = SEND_BUFFER_BYTES as libc::c_int;
        // SAFETY: `fd` is a valid socket for the duration of the call, and we pass a
        // pointer to a live c_int together with its exact size.
        unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(fd),
                libc::SOL_SOCKET,
                libc::SO_SNDBUFFORCE,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            ) == 0
        }
    };
    if !forced {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(fd, SEND_BUFFER_BYTES);
    }
}

/// Outcome of a non-blocking send or receive.
pub(crate) enum Attempt<T> {
    /// It happened.
    Done(T),
    /// The socket was not ready; wait and try again.
    WouldBlock,
}

/// Sends one packet (`header` then `body`, gathered) with `fds` attached. Non-blocking.
/// A closed peer is [`Error::Closed`].
pub(crate) fn try_send_packet(
    sock: BorrowedFd<'_>,
    header: &[u8],
    body: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<Attempt<()>> {
    if fds.len() > MAX_FDS_PER_PACKET {
        return Err(Error::Encode(format!(
            "a message carries {} file descriptors; one message can carry at most {MAX_FDS_PER_PACKET} — \
             send fewer tensors per message, or use the file_system sharing strategy",
            fds.len()
        )));
    }
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len().max(1)))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::Encode(format!(
            "cannot attach {} fds to one packet",
            fds.len()
        )));
    }
    let iov = [IoSlice::new(header), IoSlice::new(body)];
    match sendmsg(
        sock,
        &iov,
        &mut control,
        SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
    ) {
        Ok(n) if n == header.len() + body.len() => Ok(Attempt::Done(())),
        Ok(n) => Err(Error::Encode(format!(
            "the kernel accepted {n} of {} bytes of one packet",
            header.len() + body.len()
        ))),
        Err(Errno::AGAIN) | Err(Errno::INTR) => Ok(Attempt::WouldBlock),
        Err(Errno::PIPE) | Err(Errno::CONNRESET) | Err(Errno::NOTCONN) => Err(Error::Closed(
            "the other end of the channel is closed (every receiver has gone)".into(),
        )),
        Err(Errno::MSGSIZE) => Err(Error::Encode(format!(
            "a packet of {} bytes is larger than the socket allows",
            header.len() + body.len()
        ))),
        Err(Errno::TOOMANYREFS) => Err(Error::fd_limit(
            "too many file descriptors are in flight on unix sockets (the kernel counts them \
             against RLIMIT_NOFILE); receive pending messages first",
        )),
        Err(e) => Err(Error::os("sendmsg on a multiproc channel", e)),
    }
}

/// One received packet.
#[derive(Debug)]
pub(crate) struct Packet {
    /// The bytes of the packet.
    pub bytes: Vec<u8>,
    /// The fds that came with it, owned and close-on-exec.
    pub fds: Vec<OwnedFd>,
}

/// Receives one packet of at most `max_len` bytes. Non-blocking. End of stream (every
/// sender gone) is [`Error::Closed`]. A packet that was truncated is
/// [`Error::InvalidMessage`] (it is consumed, so the channel stays usable). A packet
/// whose fds would not fit under `RLIMIT_NOFILE` is [`Error::FdLimit`] and stays queued
/// (see `ensure_fd_room`).
pub(crate) fn try_recv_packet(sock: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Attempt<Packet>> {
    receive(sock, buf, RecvFlags::empty())
}

/// [`try_recv_packet`] that leaves the packet queued: the bytes are copied and the fds
/// duplicated into this process (`MSG_PEEK`), and the next receive gets the same
/// packet again.
pub(crate) fn try_peek_packet(sock: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Attempt<Packet>> {
    receive(sock, buf, RecvFlags::PEEK)
}

fn receive(sock: BorrowedFd<'_>, buf: &mut [u8], extra: RecvFlags) -> Result<Attempt<Packet>> {
    // The kernel installs a packet's fds as it dequeues it and drops the ones that do
    // not fit: check for room first, so a receiver at its fd limit keeps the message.
    ensure_fd_room(sock)?;
    let mut space =
        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_PACKET))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(buf)];
    let flags = RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC | extra;
    let msg = match recvmsg(sock, &mut iov, &mut control, flags) {
        Ok(m) => m,
        Err(Errno::AGAIN) | Err(Errno::INTR) => return Ok(Attempt::WouldBlock),
        Err(Errno::CONNRESET) => {
            return Err(Error::Closed(
                "the other end of the channel is closed".into(),
            ));
        }
        Err(e) => return Err(Error::os("recvmsg on a multiproc channel", e)),
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        // End of stream and an empty packet both read as 0 bytes with no fds. Before
        // the peer hangs up it can only have been a packet; after, the queue only
        // shrinks, so a packet still queued proves this was one too (a forged empty
        // packet must not make the receiver give up with messages still queued).
        if !peer_hung_up(sock) || packet_queued(sock) {
            return Err(Error::InvalidMessage(
                "an empty packet arrived (not a multiproc message)".into(),
            ));
        }
        return Err(Error::Closed(
            "the other end of the channel is closed (every sender has gone)".into(),
        ));
    }
    if msg.flags.contains(ReturnFlags::TRUNC) {
        return Err(Error::InvalidMessage(format!(
            "a packet larger than {} bytes arrived; it was dropped",
            buf.len()
        )));
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        // Only when another thread took the room between the check and the receive.
        return Err(Error::fd_limit(format!(
            "a message's file descriptors did not all arrive ({} did) and the message is lost",
            fds.len()
        )));
    }
    Ok(Attempt::Done(Packet {
        bytes: buf[..msg.bytes].to_vec(),
        fds,
    }))
}

/// Fds a received packet may need beyond the ones it brings: each new segment it names
/// is duplicated once while it is mapped.
const FDS_PER_RECEIVED_FD: u64 = 2;
/// With at least this many fd numbers free above the lowest free one, any packet fits
/// (fds are handed out lowest first) and the exact count is skipped.
const FD_ROOM_FAST: u64 = FDS_PER_RECEIVED_FD * MAX_FDS_PER_PACKET as u64 + 64;

/// Fails with [`Error::FdLimit`], leaving the packet queued, when the next packet on
/// `sock` would need more fds than this process may still open. Cheap when far from
/// the limit (`getrlimit` and the lowest free fd number); near it, the packet's header
/// is peeked (without its fds) and the open fds are counted.
fn ensure_fd_room(sock: BorrowedFd<'_>) -> Result<()> {
    let Some(soft) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current else {
        return Ok(());
    };
    let lowest_free = match rustix::io::fcntl_dupfd_cloexec(sock, 0) {
        // Dropped at once: the probe only learns the number.
        Ok(probe) => std::os::fd::AsRawFd::as_raw_fd(&probe) as u64,
        Err(Errno::MFILE) => soft,
        Err(_) => return Ok(()),
    };
    if soft.saturating_sub(lowest_free) >= FD_ROOM_FAST {
        return Ok(());
    }
    let mut header = [0u8; 16];
    let declared =
        match rustix::net::recv(sock, &mut header[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            // A multiproc header declares its fds (plus the payload memfd of kind 1); a
            // forged packet may carry undeclared ones, which only the kernel can count.
            Ok((_, n)) if n >= 16 && header[0..4] == *b"MPW\x01" => {
                u64::from(u32::from_le_bytes([
                    header[8], header[9], header[10], header[11],
                ])) + u64::from(header[5] == 1)
            }
            _ => return Ok(()),
        };
    if declared == 0 {
        return Ok(());
    }
    let (_, _, in_use) = super::os_errors::fd_usage();
    let free = soft.saturating_sub(in_use as u64);
    if free < declared * FDS_PER_RECEIVED_FD {
        return Err(Error::fd_limit(format!(
            "cannot receive a message that carries {declared} file descriptors ({} free); it \
             stays queued: drop received tensors (or other files) and get again",
            free
        )));
    }
    Ok(())
}

/// Takes the next packet off `sock` and drops it with its fds, without installing them
/// (no room for ancillary data: the kernel releases them). For a server that must not
/// stall on a request it cannot receive at its fd limit.
pub(crate) fn discard_packet(sock: BorrowedFd<'_>) {
    let mut byte = [0u8; 1];
    let _ = rustix::net::recv(sock, &mut byte[..], RecvFlags::DONTWAIT | RecvFlags::TRUNC);
}

/// Sends one packet, waiting for room until the deadline.
pub(crate) fn send_packet(
    sock: BorrowedFd<'_>,
    header: &[u8],
    body: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Deadline,
) -> Result<()> {
    loop {
        match try_send_packet(sock, header, body, fds)? {
            Attempt::Done(()) => return Ok(()),
            Attempt::WouldBlock => {
                if !wait_fd(sock, Readiness::Writable, deadline)? {
                    return Err(Error::timeout(
                        "waiting for room in the channel (no receiver is reading)",
                        None,
                    ));
                }
            }
        }
    }
}

/// Receives one packet, waiting until the deadline. Several processes may wait on one
/// socket: whoever loses the race for a packet goes back to waiting.
pub(crate) fn recv_packet(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    deadline: Deadline,
) -> Result<Option<Packet>> {
    loop {
        match try_recv_packet(sock, buf)? {
            Attempt::Done(p) => return Ok(Some(p)),
            Attempt::WouldBlock => {
                if !wait_fd(sock, Readiness::Readable, deadline)? {
                    return Ok(None);
                }
            }
        }
    }
}

/// Whether the peer of a connected socket has gone (every holder of the other end
/// closed it): `poll` reports a hang-up then.
pub(crate) fn peer_hung_up(sock: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::from_borrowed_fd(
        sock,
        PollFlags::IN | PollFlags::RDHUP,
    )];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::HUP | PollFlags::RDHUP),
        // Cannot tell: keep the old reading (end of stream).
        Err(_) => true,
    }
}

/// Whether a packet of any kind (empty, bytes only, fds only) waits on `sock`, peeked
/// and not taken. A 0-byte peek cannot tell an empty packet from the end of stream, but
/// with `SO_PASSCRED` on, the kernel attaches credentials to every packet it hands out,
/// and to nothing at the end. The option is set here, on the rare path that needs it,
/// so the hot path pays nothing for credentials; it stays set on the shared socket.
fn packet_queued(sock: BorrowedFd<'_>) -> bool {
    if rustix::net::sockopt::set_socket_passcred(sock, true).is_err() {
        // Cannot tell: the end of stream, as a hung-up peer suggests.
        return false;
    }
    // Room for the credentials only: fds a peek would duplicate are left out (CTRUNC).
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmCredentials(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let flags = RecvFlags::PEEK | RecvFlags::DONTWAIT | RecvFlags::TRUNC;
    match recvmsg(sock, &mut iov, &mut control, flags) {
        Ok(msg) => {
            msg.bytes > 0
                || control
                    .drain()
                    .any(|m| matches!(m, RecvAncillaryMessage::ScmCredentials(_)))
        }
        Err(_) => false,
    }
}

/// Whether `fd` is a `SOCK_SEQPACKET` socket; an error (the kernel's reason) when it is
/// not a socket at all. (`O_NONBLOCK` lives in the open file description, so a received
/// one arrives already set.)
pub(crate) fn is_seqpacket(fd: BorrowedFd<'_>) -> std::result::Result<bool, String> {
    rustix::net::sockopt::socket_type(fd)
        .map(|t| t == SocketType::SEQPACKET)
        .map_err(|e| e.to_string())
}
