//! `SOCK_SEQPACKET` unix sockets at abstract addresses (Linux's names that live in no
//! file system and vanish with their last holder), the way processes of one node find
//! each other: the shm manager and its clients, a process group's rendezvous, and the
//! zero-copy collectives' exchange of tensors.
//!
//! # Safety
//!
//! No unsafe code: `socket`, `bind`, `listen`, `accept4`, `connect` and `getsockopt`
//! through rustix, on fds this module creates or borrows; every socket is an `OwnedFd`
//! from the moment it exists.
//!
//! This module owns creating such sockets (blocking or not, as the caller says),
//! their addresses, binding and listening, accepting, connecting, and asking who is at
//! the other end (`SO_PEERCRED`). Every socket made here is close-on-exec, accepted
//! ones included. Anyone of any user can connect to an abstract address, so whoever
//! serves one checks [`peer_credentials`] before trusting a client (and a client that
//! hands out what another user must not see checks the listener's the same way).
//!
//! Errors are the kernel's [`Errno`], untranslated (interruptions retried where
//! noted): callers retry on some (nobody listens yet, a full backlog, no connection
//! waiting) and word the others for their context.

use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

pub(crate) use rustix::io::Errno;

/// Whether calls on a socket wait (block) or answer `EAGAIN` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoMode {
    /// Calls wait: for sockets read with a deadline after a wait for readiness.
    Blocking,
    /// Calls answer `EAGAIN` instead of waiting: for sockets served from a poll loop.
    NonBlocking,
}

impl IoMode {
    fn flags(self) -> SocketFlags {
        match self {
            IoMode::Blocking => SocketFlags::CLOEXEC,
            IoMode::NonBlocking => SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        }
    }
}

/// An abstract unix socket address (`@name`).
#[derive(Clone, Debug)]
pub(crate) struct AbstractAddress(SocketAddrUnix);

impl AbstractAddress {
    /// The address `@name`; an error when `name` is too long for one (over 107 bytes).
    pub(crate) fn new(name: &str) -> Result<AbstractAddress, Errno> {
        SocketAddrUnix::new_abstract_name(name.as_bytes()).map(AbstractAddress)
    }
}

/// A new close-on-exec `AF_UNIX`, `SOCK_SEQPACKET` socket, neither bound nor connected,
/// in `mode`.
pub(crate) fn seqpacket_socket(mode: IoMode) -> Result<OwnedFd, Errno> {
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        mode.flags(),
        None,
    )
}

/// Binds `sock` to `addr`; `EADDRINUSE` when another socket already holds the address.
pub(crate) fn bind(sock: BorrowedFd<'_>, addr: &AbstractAddress) -> Result<(), Errno> {
    rustix::net::bind(sock, &addr.0)
}

/// Makes a bound `sock` accept connections, with up to `backlog` of them waiting to be
/// accepted (the kernel caps it at `somaxconn`).
pub(crate) fn listen(sock: BorrowedFd<'_>, backlog: usize) -> Result<(), Errno> {
    rustix::net::listen(sock, i32::try_from(backlog).unwrap_or(i32::MAX))
}

/// Accepts one waiting connection on `listener`, as a close-on-exec socket in `mode`
/// (whatever the listener's own mode). Interruptions and connections that were aborted
/// before they were accepted are skipped; `EAGAIN` when none waits on a non-blocking
/// listener.
pub(crate) fn accept(listener: BorrowedFd<'_>, mode: IoMode) -> Result<OwnedFd, Errno> {
    loop {
        match rustix::net::accept_with(listener, mode.flags()) {
            Err(Errno::INTR) | Err(Errno::CONNABORTED) => {}
            done => return done,
        }
    }
}

/// Connects `sock` to `addr`, through interruptions. When nobody listens there the
/// error is one that [`nobody_listens`] recognises; `EAGAIN` when the listener's
/// backlog is full and `sock` is non-blocking.
pub(crate) fn connect(sock: BorrowedFd<'_>, addr: &AbstractAddress) -> Result<(), Errno> {
    loop {
        match rustix::net::connect(sock, &addr.0) {
            Err(Errno::INTR) => {}
            done => return done,
        }
    }
}

/// Whether `e`, from [`connect`], means that nobody listens at the address (refused,
/// or no such address): one that may appear later is worth another try.
pub(crate) fn nobody_listens(e: Errno) -> bool {
    matches!(e, Errno::CONNREFUSED | Errno::NOENT)
}

/// Who holds the other end of a connected unix socket, as the kernel recorded it when
/// the connection was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerCredentials {
    /// The peer's pid.
    pub pid: u32,
    /// The peer's user id.
    pub uid: u32,
}

/// The credentials of the process at the other end of `sock` (`SO_PEERCRED`).
pub(crate) fn peer_credentials(sock: BorrowedFd<'_>) -> Result<PeerCredentials, Errno> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    Ok(PeerCredentials {
        pid: cred.pid.as_raw_nonzero().get() as u32,
        uid: cred.uid.as_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    #[cfg_attr(miri, ignore = "sockets are foreign functions Miri cannot run")]
    fn a_client_meets_the_listener_and_both_see_the_same_process() {
        let name = format!("multiproc-test/abstract-socket/{}", std::process::id());
        let addr = AbstractAddress::new(&name).unwrap();
        let listener = seqpacket_socket(IoMode::NonBlocking).unwrap();
        assert_eq!(bind(listener.as_fd(), &addr), Ok(()));
        let squatter = seqpacket_socket(IoMode::NonBlocking).unwrap();
        assert_eq!(
            bind(squatter.as_fd(), &addr),
            Err(Errno::ADDRINUSE),
            "the address is taken"
        );

        let early = seqpacket_socket(IoMode::Blocking).unwrap();
        let refused = connect(early.as_fd(), &addr).unwrap_err();
        assert!(nobody_listens(refused), "nobody listens yet: {refused:?}");
        listen(listener.as_fd(), 4).unwrap();
        assert_eq!(
            accept(listener.as_fd(), IoMode::NonBlocking).unwrap_err(),
            Errno::AGAIN,
            "nobody has connected"
        );

        let me = PeerCredentials {
            pid: std::process::id(),
            uid: crate::sys::process::current_uid(),
        };
        for mode in [IoMode::NonBlocking, IoMode::Blocking] {
            let client = seqpacket_socket(IoMode::Blocking).unwrap();
            assert_eq!(connect(client.as_fd(), &addr), Ok(()));
            let served = accept(listener.as_fd(), mode).unwrap();
            let flags = rustix::fs::fcntl_getfl(&served).unwrap();
            assert_eq!(
                flags.contains(rustix::fs::OFlags::NONBLOCK),
                mode == IoMode::NonBlocking,
                "an accepted socket is in the mode asked for ({mode:?})"
            );
            let fd_flags = rustix::io::fcntl_getfd(&served).unwrap();
            assert!(fd_flags.contains(rustix::io::FdFlags::CLOEXEC));
            assert_eq!(peer_credentials(served.as_fd()), Ok(me));
            assert_eq!(peer_credentials(client.as_fd()), Ok(me));
        }
    }

    #[test]
    fn a_name_too_long_is_no_address() {
        assert!(AbstractAddress::new(&"x".repeat(200)).is_err());
    }
}
