//! [`Opaque`]: a message inside a message.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::context::{AttachedFd, Carried, CarriedRef, Decoder, Encoder};
use super::context::{GiveBack, give_back_unread};
use super::{HEADER_LEN, decode, encode};
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
    /// outer message lends them to that message ([`Lent`]): if it is sent, the receiver
    /// adopts them; if it is not (a failed send hands the `Opaque` back to its caller,
    /// who may send it again), they come back here. Dropping an `Opaque` that holds
    /// them releases them.
    carried: Arc<Mutex<Vec<CarriedRef>>>,
    /// For a received `Opaque`, whose uses are in its packet: what gives them back if
    /// it is dropped unread. Lent, like `carried`, to an outer message it is sent in.
    unread: Arc<Mutex<Option<Arc<dyn GiveBack>>>>,
}

/// A received `Opaque`'s duty to give back its packet's uses, lent to the outer message
/// it was serialized into: sent, the duty goes with it; not sent, it comes back.
struct LentUnread {
    returns: Option<Arc<dyn GiveBack>>,
    home: std::sync::Weak<Mutex<Option<Arc<dyn GiveBack>>>>,
}

impl Carried for LentUnread {
    fn sent(mut self: Box<Self>) {
        self.returns = None;
    }
}

impl Drop for LentUnread {
    fn drop(&mut self) {
        if let (Some(returns), Some(home)) = (self.returns.take(), self.home.upgrade()) {
            *home.lock().unwrap_or_else(|p| p.into_inner()) = Some(returns);
        }
    }
}

impl Drop for Opaque {
    fn drop(&mut self) {
        let returns = self.unread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(returns) = returns {
            let packet = Packet {
                bytes: std::mem::take(&mut self.bytes),
                fds: std::mem::take(&mut self.fds),
            };
            give_back_unread(packet, &*returns);
        }
    }
}

/// An `Opaque`'s references, lent to the outer message it was serialized into.
struct Lent {
    references: Vec<CarriedRef>,
    home: std::sync::Weak<Mutex<Vec<CarriedRef>>>,
}

impl Carried for Lent {
    fn sent(mut self: Box<Self>) {
        for reference in self.references.drain(..) {
            reference.sent();
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        // Not sent: back to the `Opaque`, or, if it is gone, given back (dropped).
        if let Some(home) = self.home.upgrade() {
            home.lock()
                .unwrap_or_else(|p| p.into_inner())
                .append(&mut self.references);
        }
    }
}

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
            // The references move to the Opaque.
            carried: Arc::new(Mutex::new(std::mem::take(&mut inner.carried).into_vec())),
            unread: Arc::new(Mutex::new(None)),
        })
    }

    /// Decodes the value. A received `Opaque` gives its uses back through what its
    /// outer message's decode gave it; one made here through `returns`.
    pub(crate) fn decode<T: DeserializeOwned>(mut self, returns: &Arc<dyn GiveBack>) -> Result<T> {
        // Decoding here adopts the references taken for the receiver.
        for reference in self.carried_list().drain(..) {
            reference.sent();
        }
        let unread = self.unread.lock().unwrap_or_else(|p| p.into_inner()).take();
        let packet = Packet {
            bytes: std::mem::take(&mut self.bytes),
            fds: std::mem::take(&mut self.fds),
        };
        decode(packet, unread.as_ref().unwrap_or(returns))
    }
}

impl Opaque {
    /// A copy that can be sent independently, when the value holds no handles (no fds,
    /// no references taken for a receiver): then it is only bytes. `None` otherwise —
    /// a handle's references can be handed to one receiver only.
    pub(crate) fn try_clone_plain(&self) -> Option<Opaque> {
        let lists_references = self.bytes.get(16..HEADER_LEN) != Some(&[0; 4][..]);
        if !self.fds.is_empty() || !self.carried_list().is_empty() || lists_references {
            return None;
        }
        Some(Opaque {
            bytes: self.bytes.clone(),
            fds: Vec::new(),
            carried: Arc::new(Mutex::new(Vec::new())),
            unread: Arc::new(Mutex::new(None)),
        })
    }

    fn carried_list(&self) -> MutexGuard<'_, Vec<CarriedRef>> {
        self.carried.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Serialize for Opaque {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error as _;
        let enc = Encoder::current("a nested message").map_err(S::Error::custom)?;
        let mut indices = Vec::with_capacity(self.fds.len());
        for fd in &self.fds {
            indices.push(enc.attach_fd(fd.as_fd()).map_err(S::Error::custom)?);
        }
        // The outer message now carries the receiver's references; if it is never
        // sent they return to this `Opaque` (or, if it is gone, are released).
        let references: Vec<CarriedRef> = self.carried_list().drain(..).collect();
        if !references.is_empty() {
            enc.carry(Box::new(Lent {
                references,
                home: Arc::downgrade(&self.carried),
            }));
        }
        let unread = self.unread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(returns) = unread {
            enc.carry(Box::new(LentUnread {
                returns: Some(returns),
                home: Arc::downgrade(&self.unread),
            }));
        }
        (&self.bytes, indices).serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for Opaque {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let (bytes, indices) = <(Vec<u8>, Vec<u32>)>::deserialize(d)?;
        let dec = Decoder::current("a nested message").map_err(D::Error::custom)?;
        let fds = indices
            .into_iter()
            .map(|i| dec.take_fd(i))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(D::Error::custom)?;
        Ok(Self {
            bytes,
            fds,
            carried: Arc::new(Mutex::new(Vec::new())),
            unread: Arc::new(Mutex::new(Some(dec.give_back_to()))),
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
