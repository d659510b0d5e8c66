//! [`pipe`] and [`Connection`]: a duplex channel between two ends.

use std::fmt;
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::channel::check_seqpacket;
use crate::error::{Error, PutError, Result};
use crate::sys::socket::seqpacket_pair;
use crate::sys::{Deadline, Readiness, deadline_after, wait_fd};
use crate::wire::{self, Decoder, Encoder};

/// Two connected ends, like `multiprocessing.Pipe()`: what one end sends, the other
/// receives, in both directions.
///
/// # Errors
/// When the socket pair cannot be made (usually the fd limit).
///
/// # Examples
///
/// ```
/// let (a, b) = multiproc::pipe::<String>()?;
/// a.send("hello".to_string())?;
/// assert_eq!(b.recv()?, "hello");
/// # Ok::<(), multiproc::Error>(())
/// ```
pub fn pipe<T: Serialize + DeserializeOwned>() -> Result<(Connection<T>, Connection<T>)> {
    let (a, b) = seqpacket_pair()?;
    Ok((Connection::from_fd(a), Connection::from_fd(b)))
}

/// One end of a [`pipe`]. Send it to another process as a worker argument or through a
/// queue; when every holder of the other end has gone (dropped it, exited or were
/// killed, with no copy of it left in a message in flight), `recv` reports
/// [`Error::Disconnected`] once everything sent before has been received.
pub struct Connection<T> {
    sock: OwnedFd,
    _items: PhantomData<fn(T) -> T>,
}

impl<T> Connection<T> {
    fn from_fd(sock: OwnedFd) -> Self {
        Self {
            sock,
            _items: PhantomData,
        }
    }
}

impl<T: Serialize + DeserializeOwned> Connection<T> {
    /// Sends `item` to the other end, waiting for room as long as it takes.
    ///
    /// # Errors
    /// [`Error::Closed`] when the other end is gone, or an encoding error; the item
    /// comes back in the error.
    pub fn send(&self, item: T) -> Result<(), PutError<T>> {
        self.send_until(item, None)
    }

    /// Sends `item`, waiting for room at most `timeout`.
    ///
    /// # Errors
    /// As [`send`](Self::send), and [`Error::Timeout`] when no room came in time; the
    /// item comes back in the error.
    pub fn send_timeout(&self, item: T, timeout: Duration) -> Result<(), PutError<T>> {
        self.send_until(item, deadline_after(Some(timeout)))
            .map_err(|PutError { error, item }| PutError {
                error: match error {
                    Error::Timeout { .. } => Error::timeout(
                        "a send on a pipe whose buffer is full (the other end is not reading)",
                        Some(timeout),
                    ),
                    other => other,
                },
                item,
            })
    }

    fn send_until(&self, item: T, deadline: Deadline) -> Result<(), PutError<T>> {
        let _span = tracing::trace_span!("multiproc::put", queue = "Connection").entered();
        match wire::encode(&item).and_then(|mut e| e.send(self.sock.as_fd(), deadline)) {
            Ok(()) => Ok(()),
            Err(error) => Err(PutError { error, item }),
        }
    }

    /// Receives the next item, waiting as long as it takes.
    ///
    /// # Errors
    /// [`Error::Disconnected`] when the other end is gone and nothing is left to read;
    /// [`Error::InvalidMessage`] for a malformed message (the connection stays usable).
    pub fn recv(&self) -> Result<T> {
        self.recv_until(None)?
            .ok_or_else(|| Error::timeout("a recv on a pipe without deadline", None))
    }

    /// Receives the next item, waiting at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing came in time; otherwise as [`recv`](Self::recv).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<T> {
        self.recv_until(deadline_after(Some(timeout)))?
            .ok_or_else(|| Error::timeout("a recv on a pipe", Some(timeout)))
    }

    /// Receives the next item if one is waiting: `Ok(None)` when none is (not a
    /// timeout: nothing waited).
    ///
    /// # Errors
    /// As [`recv`](Self::recv).
    pub fn try_recv(&self) -> Result<Option<T>> {
        match wire::try_recv_packet(self.sock.as_fd()).map_err(disconnected_at_end)? {
            Some(packet) => wire::decode(packet, &crate::shm::Returns::plain()).map(Some),
            None => Ok(None),
        }
    }

    /// Receives the next item, as [`recv`](Self::recv) does, without blocking a thread
    /// (feature `async`; any executor): the fd reactor watches the socket. Cancel-safe:
    /// an item is only taken by the synchronous receive that returns it.
    ///
    /// # Errors
    /// As [`recv`](Self::recv), and when the fd reactor cannot be started.
    #[cfg(feature = "async")]
    pub async fn recv_async(&self) -> Result<T> {
        use crate::sys::reactor::{self, Parked, Ready, Step};
        let mut parked: Option<Parked> = None;
        std::future::poll_fn(|cx| {
            reactor::poll_step(
                cx,
                &mut parked,
                || match self.try_recv() {
                    Ok(Some(item)) => Step::Done(Ok(item)),
                    Ok(None) => Step::Fd(self.sock.as_fd(), Ready::Readable),
                    Err(e) => Step::Done(Err(e)),
                },
                Err,
            )
        })
        .await
    }

    fn recv_until(&self, deadline: Deadline) -> Result<Option<T>> {
        let _span = tracing::trace_span!("multiproc::get", queue = "Connection").entered();
        match wire::recv_packet(self.sock.as_fd(), deadline).map_err(disconnected_at_end)? {
            Some(packet) => wire::decode(packet, &crate::shm::Returns::plain()).map(Some),
            None => Ok(None),
        }
    }

    /// Waits until an item (or the end of the stream) can be received, as long as it
    /// takes.
    ///
    /// Python's `poll()` without a timeout looks without waiting: that is
    /// [`try_poll`](Self::try_poll); its `poll(timeout)` is
    /// [`poll_timeout`](Self::poll_timeout), and its `poll(None)` is this.
    ///
    /// # Errors
    /// An [`Error::Os`] when the kernel refuses the wait.
    pub fn poll(&self) -> Result<()> {
        self.poll_within(None)
    }

    /// Waits until an item (or the end of the stream) can be received, at most
    /// `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nothing came in time; otherwise as [`poll`](Self::poll).
    pub fn poll_timeout(&self, timeout: Duration) -> Result<()> {
        self.poll_within(Some(timeout))
    }

    /// Whether an item (or the end of the stream) can be received right now, without
    /// waiting: `Ok(false)` when nothing is there (Python's `poll()`). One `poll(2)`
    /// with a zero timeout: a pipe's items live in the kernel's socket buffer.
    ///
    /// # Errors
    /// An [`Error::Os`] when the kernel refuses the look.
    ///
    /// # Examples
    ///
    /// ```
    /// let (a, b) = multiproc::pipe::<u8>()?;
    /// assert!(!b.try_poll()?);
    /// a.send(1)?;
    /// assert!(b.try_poll()?);
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn try_poll(&self) -> Result<bool> {
        wait_fd(self.sock.as_fd(), Readiness::Readable, Some(Instant::now()))
    }

    fn poll_within(&self, timeout: Option<Duration>) -> Result<()> {
        if wait_fd(
            self.sock.as_fd(),
            Readiness::Readable,
            deadline_after(timeout),
        )? {
            Ok(())
        } else {
            Err(Error::timeout("a poll on a pipe", timeout))
        }
    }
}

/// The socket's end of stream (every holder of the other end gone, nothing left to read)
/// is what a pipe end calls disconnected.
fn disconnected_at_end(e: Error) -> Error {
    match e {
        Error::Closed(_) => Error::Disconnected(
            "the other end of the pipe is gone (every holder dropped it or exited) and \
             nothing is left to receive"
                .into(),
        ),
        other => other,
    }
}

/// The socket, for waiting on several connections at once (`poll`/`epoll`), as
/// Python's `Connection.fileno()` allows. Reading or writing it directly bypasses the
/// framing: the other end reports such bytes as [`Error::InvalidMessage`].
impl<T> AsFd for Connection<T> {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl<T> fmt::Debug for Connection<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("fd", &self.sock)
            .finish()
    }
}

impl<T> Serialize for Connection<T> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        Encoder::current("a Connection")
            .and_then(|enc| enc.attach_fd(self.sock.as_fd()))
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for Connection<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        let dec = Decoder::current("a Connection").map_err(serde::de::Error::custom)?;
        let sock = dec.take_fd(index).map_err(serde::de::Error::custom)?;
        check_seqpacket(&sock)
            .map_err(|e| serde::de::Error::custom(dec.fail(Error::InvalidMessage(e))))?;
        Ok(Self::from_fd(sock))
    }
}
