//! A value sealed into one file descriptor, for a process this library did not start.
//!
//! [`seal`] encodes a value — queues, events, locks and tensors inside it travel as
//! handles, as through any channel — and sends it into a socket pair of its own, keeping
//! only the receiving end: that one fd *is* the value. Hand it to another process by
//! any fd-passing means (an inherited fd of an `exec`'d program, Python's
//! `multiprocessing.reduction.DupFd` when a handle is pickled for a
//! `multiprocessing.Process`), and [`open`] it there, once.
//!
//! The message sits in the socket's buffer, so the sealing process may exit at once. A
//! parcel closed unopened drops its message and the fds in it; the references it took
//! for a receiver (a tensor block's use) are not given back until the blocks' owners
//! exit.
//!
//! ```
//! use multiproc::{Event, parcel};
//! let ready = Event::new()?;
//! let fd = parcel::seal(&ready)?; // pass `fd` to another process
//! let there: Event = parcel::open(fd)?;
//! there.set();
//! assert!(ready.is_set());
//! # let again = parcel::seal(&ready)?;
//! # let copy = again.try_clone().unwrap();
//! # parcel::open::<Event>(again)?;
//! # assert!(matches!(parcel::open::<Event>(copy), Err(multiproc::Error::InvalidArgument(_))));
//! # Ok::<(), multiproc::Error>(())
//! ```

use std::os::fd::{AsFd, OwnedFd};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::sys::socket::{is_seqpacket, seqpacket_pair};
use crate::wire;

/// Seals `value` into a new fd (the receiving end of a socket pair that holds it as
/// one message). Open it with [`open`], in this process or another.
///
/// # Errors
///
/// As a queue's `put`: [`Error::Encode`] for a value that cannot travel,
/// [`Error::FdLimit`] or [`Error::Os`] when the socket pair cannot be made.
pub fn seal<T: Serialize + ?Sized>(value: &T) -> Result<OwnedFd> {
    let mut message = wire::encode(value)?;
    let (sender, receiver) = seqpacket_pair()?;
    // The pair is new and its buffer empty: the message fits at once.
    message.send(sender.as_fd(), None)?;
    Ok(receiver)
}

/// Opens a parcel that [`seal`] made, taking the value out of it (a parcel opens once).
///
/// # Errors
///
/// [`Error::InvalidArgument`] when `fd` is not a parcel (not a `SOCK_SEQPACKET` socket)
/// or holds no message (opened already); [`Error::InvalidMessage`] when its bytes are
/// not a value of type `T`; [`Error::FdLimit`] when this process cannot take the fds.
pub fn open<T: DeserializeOwned>(fd: OwnedFd) -> Result<T> {
    match is_seqpacket(fd.as_fd()) {
        Ok(true) => {}
        Ok(false) => {
            return Err(Error::InvalidArgument(
                "a parcel is a SOCK_SEQPACKET socket; this fd is another kind of socket".into(),
            ));
        }
        Err(e) => {
            return Err(Error::InvalidArgument(format!(
                "a parcel is a SOCK_SEQPACKET socket; this fd is not a socket ({e})"
            )));
        }
    }
    let opened_already =
        || Error::InvalidArgument("the parcel holds no message: it was opened already".into());
    // Its sending end is closed, so an empty parcel reads as a closed channel.
    match wire::try_recv_packet(fd.as_fd()) {
        Ok(Some(packet)) => wire::decode(packet, &crate::shm::Returns::plain()),
        Ok(None) | Err(Error::Closed(_)) => Err(opened_already()),
        Err(e) => Err(e),
    }
}
