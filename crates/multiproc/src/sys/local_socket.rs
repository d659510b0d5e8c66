//! Unix `SOCK_SEQPACKET` sockets with names in the abstract namespace, the way ranks
//! of one node find each other (a process group's rendezvous, and the zero-copy
//! collectives' exchange of tensors): create, bind, listen, accept, connect, ask who
//! is at the other end, and the identity of the shared file such names derive from.
//!
//! # Safety
//!
//! This file has no unsafe code: everything is rustix. Every socket made here is
//! close-on-exec, and so is every accepted connection.
//!
//! Errors are handed back as the kernel's [`Errno`], untranslated: callers retry on
//! some (a peer that has not bound yet, a full backlog) and word the others for their
//! context.

use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::net::{AddressFamily, SocketFlags, SocketType};

pub(crate) use rustix::io::Errno;
pub(crate) use rustix::net::SocketAddrUnix;

/// A new `SOCK_SEQPACKET` Unix socket, close-on-exec, and non-blocking when
/// `nonblocking`. A blocking one is for the rendezvous, which waits with
/// [`wait_fd`](super::wait_fd) before each accept and receives with a deadline.
pub(crate) fn seqpacket(nonblocking: bool) -> Result<OwnedFd, Errno> {
    let mut flags = SocketFlags::CLOEXEC;
    if nonblocking {
        flags |= SocketFlags::NONBLOCK;
    }
    rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)
}

/// The address of `name` in the abstract namespace (at most 107 bytes).
pub(crate) fn abstract_address(name: &str) -> Result<SocketAddrUnix, Errno> {
    SocketAddrUnix::new_abstract_name(name.as_bytes())
}

/// Binds `sock` to `addr`.
pub(crate) fn bind(sock: BorrowedFd<'_>, addr: &SocketAddrUnix) -> Result<(), Errno> {
    rustix::net::bind(sock, addr)
}

/// Makes `sock` listen, with room for `backlog` pending connections.
pub(crate) fn listen(sock: BorrowedFd<'_>, backlog: usize) -> Result<(), Errno> {
    rustix::net::listen(sock, i32::try_from(backlog).unwrap_or(i32::MAX))
}

/// The next pending connection of `listener`, close-on-exec.
pub(crate) fn accept(listener: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    rustix::net::accept_with(listener, SocketFlags::CLOEXEC)
}

/// Connects `sock` to `addr`.
pub(crate) fn connect(sock: BorrowedFd<'_>, addr: &SocketAddrUnix) -> Result<(), Errno> {
    rustix::net::connect(sock, addr)
}

/// The pid of the process at the other end of the connected socket `sock`, as the
/// kernel recorded it when the connection was made.
pub(crate) fn peer_pid(sock: BorrowedFd<'_>) -> Result<u32, Errno> {
    let cred = rustix::net::sockopt::socket_peercred(sock)?;
    Ok(cred.pid.as_raw_nonzero().get() as u32)
}

/// The device and inode of the file behind `fd`: what names derived from a shared file
/// (a process group's segment) are made of, the same in every process that holds it.
pub(crate) fn file_identity(fd: BorrowedFd<'_>) -> Result<(u64, u64), Errno> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// The pid of this process's parent (0 when it has none, or it is outside our pid
/// namespace).
pub(crate) fn parent_pid() -> i32 {
    rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_named_listener_is_found_and_knows_its_peer() {
        let name = format!("multiproc-test/local-socket/{}", std::process::id());
        let addr = abstract_address(&name).unwrap();
        let listener = seqpacket(false).unwrap();
        bind(listener.as_fd(), &addr).unwrap();
        listen(listener.as_fd(), 1).unwrap();
        let client = seqpacket(false).unwrap();
        connect(client.as_fd(), &addr).unwrap();
        let conn = accept(listener.as_fd()).unwrap();
        assert_eq!(peer_pid(conn.as_fd()).unwrap(), std::process::id());
        let other = seqpacket(true).unwrap();
        assert_eq!(bind(other.as_fd(), &addr), Err(Errno::ADDRINUSE));
        assert!(parent_pid() > 0);
    }
}
