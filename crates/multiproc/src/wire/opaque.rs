//! [`Opaque`]: a message inside a message.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::fd_table::{AttachedFd, attach_fd, on_unsent, received_fd};
use super::{decode, encode};
use crate::error::{Error, Result};
use crate::sys::socket::Packet;

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
