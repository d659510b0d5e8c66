//! `SOCK_SEQPACKET` unix sockets at abstract addresses (Linux's names that live in no
//! file system and vanish with their last holder): binding and listening, accepting,
//! connecting, and asking who is at the other end (`SO_PEERCRED`).
//!
//! # Safety
//!
//! No unsafe code: `socket`, `bind`, `listen`, `accept4`, `connect` and `getsockopt`
//! through rustix, on fds this module creates or borrows; every socket is an `OwnedFd`
//! from the moment it exists.
//!
//! Every socket made here is close-on-exec, and every accepted one non-blocking (a
//! listener reads its clients from one poll loop). Anyone of any user can connect to an
//! abstract address, so whoever serves one checks [`peer_credentials`] before trusting
//! a client, and a client checks the listener's the same way.

use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

/// An abstract unix socket address (`@name`).
#[derive(Clone, Debug)]
pub(crate) struct AbstractAddress(SocketAddrUnix);

impl AbstractAddress {
    /// The address `@name`; an error when `name` is too long for one.
    pub(crate) fn new(name: &str) -> Result<AbstractAddress, Errno> {
        SocketAddrUnix::new_abstract_name(name.as_bytes()).map(AbstractAddress)
    }
}

/// A new close-on-exec `AF_UNIX`, `SOCK_SEQPACKET` socket, neither bound nor connected;
/// non-blocking when `nonblocking` is set.
pub(crate) fn seqpacket_socket(nonblocking: bool) -> Result<OwnedFd, Errno> {
    let flags = if nonblocking {
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK
    } else {
        SocketFlags::CLOEXEC
    };
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)
}

/// Connects `sock` to `addr`, through interruptions: `Ok(false)` when nobody listens
/// there (refused, or no such address).
pub(crate) fn connect(sock: BorrowedFd<'_>, addr: &AbstractAddress) -> Result<bool, Errno> {
    loop {
        match rustix::net::connect(sock, &addr.0) {
            Ok(()) => return Ok(true),
            Err(Errno::INTR) => {}
            Err(Errno::CONNREFUSED) | Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}

/// Binds `sock` to `addr`: `Ok(false)` when another socket already holds the address.
pub(crate) fn bind(sock: BorrowedFd<'_>, addr: &AbstractAddress) -> Result<bool, Errno> {
    match rustix::net::bind(sock, &addr.0) {
        Ok(()) => Ok(true),
        Err(Errno::ADDRINUSE) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Makes a bound `sock` accept connections, with up to `backlog` of them waiting to be
/// accepted.
pub(crate) fn listen(sock: BorrowedFd<'_>, backlog: i32) -> Result<(), Errno> {
    rustix::net::listen(sock, backlog)
}

/// Accepts one waiting connection on a non-blocking listener, as a close-on-exec,
/// non-blocking socket; `Ok(None)` when none waits. Interruptions and connections that
/// were aborted before they were accepted are skipped.
pub(crate) fn accept(listener: BorrowedFd<'_>) -> Result<Option<OwnedFd>, Errno> {
    loop {
        match rustix::net::accept_with(listener, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK) {
            Ok(sock) => return Ok(Some(sock)),
            Err(Errno::INTR) | Err(Errno::CONNABORTED) => {}
            Err(Errno::AGAIN) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

/// Who holds the other end of a connected unix socket, as the kernel recorded it when
/// the connection was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PeerCredentials {
    /// The peer's pid.
    pub pid: i32,
    /// The peer's user id.
    pub uid: u32,
}

/// The credentials of the process at the other end of `sock` (`SO_PEERCRED`).
pub(crate) fn peer_credentials(sock: BorrowedFd<'_>) -> Result<PeerCredentials, Errno> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    Ok(PeerCredentials {
        pid: cred.pid.as_raw_nonzero().get(),
        uid: cred.uid.as_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    #[cfg_attr(miri, ignore = "sockets are foreign functions Miri cannot run")]
    fn a_client_meets_the_listener_and_both_see_the_same_user() {
        let name = format!("multiproc-sys-test-{}", std::process::id());
        let addr = AbstractAddress::new(&name).unwrap();
        let listener = seqpacket_socket(true).unwrap();
        assert_eq!(bind(listener.as_fd(), &addr), Ok(true));
        let squatter = seqpacket_socket(true).unwrap();
        assert_eq!(
            bind(squatter.as_fd(), &addr),
            Ok(false),
            "the address is taken"
        );

        let early = seqpacket_socket(false).unwrap();
        assert_eq!(
            connect(early.as_fd(), &addr),
            Ok(false),
            "nobody listens yet"
        );
        listen(listener.as_fd(), 4).unwrap();
        assert!(
            matches!(accept(listener.as_fd()), Ok(None)),
            "nobody has connected"
        );

        let client = seqpacket_socket(false).unwrap();
        assert_eq!(connect(client.as_fd(), &addr), Ok(true));
        let served = accept(listener.as_fd()).unwrap().expect("the client waits");
        let me = crate::sys::process::current_uid();
        let pid = std::process::id() as i32;
        assert_eq!(
            peer_credentials(served.as_fd()),
            Ok(PeerCredentials { pid, uid: me })
        );
        assert_eq!(
            peer_credentials(client.as_fd()),
            Ok(PeerCredentials { pid, uid: me })
        );
    }

    #[test]
    fn a_name_too_long_is_no_address() {
        assert!(AbstractAddress::new(&"x".repeat(200)).is_err());
    }
}
