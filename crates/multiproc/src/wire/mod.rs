//! The wire: how a value becomes one packet on a socket, and back.
//!
//! A message is a serde value encoded with postcard. Values that stand for kernel
//! objects — tensors' shared segments, queues, events, locks — do not serialize their
//! fds as numbers: their `Serialize` impls get the message being encoded from
//! [`Encoder::current`], hand it the fd ([`Encoder::attach_fd`]) and write the table
//! index instead, and give it the references they take for the receiver
//! ([`Encoder::carry`]); on the other side, their `Deserialize` impls take the fd back
//! from [`Decoder::current`] ([`Decoder::take_fd`], a duplicate, or [`Decoder::with_fd`],
//! lent). Tensors' segments use the cheap forms on both sides —
//! [`Encoder::attach_shared_fd`] keeps the segment's `Arc`'d fd instead of a `dup`, and
//! a received segment that is already mapped needs only an `fstat` of the lent fd — so
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
//! A queue carries a packet without fds through its shared-memory ring instead of its
//! socket (see `queue`), the same bytes either way; a tensor block in such a packet is
//! named by inode, its fd in the queue's custody (see `shm::custody`).
//!
//! Payloads above [`INLINE_MAX`] go into a sealed memfd so every message is a single
//! packet whatever its size: one packet is delivered whole to exactly one reader, which
//! is what lets many processes put and get on one socket without locks.
//!
//! Files: this one holds the codec's entry points ([`encode`], [`decode`]) and the
//! packet constants; `packet` the framing ([`Encoded`], sending, receiving, the
//! payload memfd); `context` the encoder and decoder that handles' impls talk to (the
//! fd side table, the references a message carries, the error it failed with);
//! `opaque` nested messages ([`Opaque`]).
//!
//! Invariant: decoding never panics and never trusts the sender. Every length, count
//! and index is checked; anything malformed is [`Error::InvalidMessage`] saying what.

mod context;
mod opaque;
mod packet;

use std::os::fd::{AsFd, OwnedFd};

use serde::Serialize;
use serde::de::DeserializeOwned;

use context::{AttachedFd, DecodeTable, EncodeTable, decoding, encoding, is_encoding};
pub(crate) use context::{Carried, Decoder, Encoder, Readopt};
pub(crate) use opaque::Opaque;
use packet::read_sealed_payload;
pub(crate) use packet::{Encoded, is_counted, recv_packet, try_recv_packet, uncount};

use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::socket::{MAX_FDS_PER_PACKET, Packet};

/// The packet magic.
pub(super) const MAGIC: [u8; 4] = *b"MPW\x01";
/// The wire format version; a packet of another version is refused. Version 2: only
/// blocks travel (the plain `Fd` and `Named` segment handles are gone).
pub(crate) const VERSION: u8 = 2;
pub(super) const HEADER_LEN: usize = 16;
pub(super) const KIND_INLINE: u8 = 0;
pub(super) const KIND_MEMFD: u8 = 1;
/// Header flag: a queue's `put` counted this message (see [`Encoded::mark_counted`]).
pub(super) const FLAG_COUNTED: u8 = 1;
/// Largest payload sent inside the packet itself.
pub(crate) const INLINE_MAX: usize = 60 * 1024;
/// Largest payload accepted from a memfd (a sanity bound against hostile lengths).
pub(super) const MEMFD_PAYLOAD_MAX: u64 = 1 << 40;

/// The payload buffer an encode starts with (a message with a tensor or two takes
/// under a hundred bytes).
const ENCODE_CAPACITY: usize = 256;

/// Encodes `value` into a packet, attaching the fds of every handle inside it.
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded> {
    if is_encoding() {
        return Err(Error::Encode(
            "a value is being sent from inside the serialization of another message".into(),
        ));
    }
    // Room for a few tensors' handles up front: growing from empty costs several
    // reallocations per message.
    let (bytes, table) = encoding(EncodeTable::default(), || {
        postcard::to_extend(value, Vec::with_capacity(ENCODE_CAPACITY))
    });
    let EncodeTable {
        mut fds,
        carried,
        error,
        ..
    } = table;
    let mut encoded = Encoded {
        header: [0; HEADER_LEN],
        payload: Vec::new(),
        fds: Vec::new(),
        carried,
    };
    let payload = bytes.map_err(|e| error.map_or_else(|| Error::Encode(e.to_string()), |e| *e))?;
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
        memfd::write_all_at(fd.as_fd(), &payload)?;
        memfd::seal_contents(fd.as_fd())?;
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

/// Decodes a received packet. Never panics; a malformed packet is an error that says
/// what was wrong with it.
pub(crate) fn decode<T: DeserializeOwned>(packet: Packet) -> Result<T> {
    let Packet { bytes, fds } = packet;
    decode_from(&bytes, fds)
}

/// [`decode`] of a packet's bytes and fds, the bytes borrowed (a packet without fds
/// stays the caller's, to keep when decoding fails for a reason that may pass).
pub(crate) fn decode_from<T: DeserializeOwned>(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<T> {
    decode_with(bytes, fds, false).0
}

/// The references a decode of a kept packet holds for the packet's next try (see
/// [`decode_keeping`]). Dropped, they are given back; [`forget`](Self::forget) hands
/// them to the next try's adoption instead.
#[must_use]
pub(crate) struct HeldReferences(Vec<Box<dyn Carried>>);

impl HeldReferences {
    /// The packet's next try has adopted what these stood for: let go of them without
    /// giving anything back.
    pub(crate) fn forget(self) {
        for reference in self.0 {
            reference.sent();
        }
    }
}

impl std::fmt::Debug for HeldReferences {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HeldReferences({})", self.0.len())
    }
}

/// [`decode_from`] of a packet without fds that its caller keeps for another try when
/// the decode fails with [`Error::FdLimit`]: then every reference the handles decoded
/// so far adopted is taken once more (see `Decoder::adopted`) and returned, so that
/// the packet still brings them on its next try. The caller keeps them with the packet,
/// or drops them (giving them back) when it does not keep it; after any other outcome
/// they are empty.
pub(crate) fn decode_keeping<T: DeserializeOwned>(bytes: &[u8]) -> (Result<T>, HeldReferences) {
    decode_with(bytes, Vec::new(), true)
}

fn decode_with<T: DeserializeOwned>(
    bytes: &[u8],
    fds: Vec<OwnedFd>,
    keep: bool,
) -> (Result<T>, HeldReferences) {
    let mut held = HeldReferences(Vec::new());
    let result = decode_checked(bytes, fds, keep, &mut held);
    (result, held)
}

fn decode_checked<T: DeserializeOwned>(
    bytes: &[u8],
    mut fds: Vec<OwnedFd>,
    keep: bool,
    held: &mut HeldReferences,
) -> Result<T> {
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
    let table = if keep {
        DecodeTable::keeping_packet(fds)
    } else {
        DecodeTable::new(fds)
    };
    let (result, mut table) = decoding(table, || postcard::take_from_bytes::<T>(payload));
    let error = table.error.take();
    let used = std::mem::take(&mut table.used);
    held.0 = table.into_held();
    let (value, rest) = match result {
        Ok(v) => v,
        Err(e) => {
            return Err(error.map_or_else(
                || Error::InvalidMessage(format!("cannot decode the payload: {e}")),
                |e| *e,
            ));
        }
    };
    if !rest.is_empty() {
        return bad(format!("{} bytes follow the end of the value", rest.len()));
    }
    if let Some(i) = used.iter().position(|u| !u) {
        return bad(format!(
            "the message carried {} fds but fd #{i} is not referred to by its payload",
            used.len()
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::socket;

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
        // A storage with a named block of its own, so the counts are this test's alone.
        let floats = crate::shm::allocate_small_max() / 4 + 1;
        let t = crate::tensor::Tensor::full(&[floats], 3.0, crate::tensor::DType::F32).unwrap();
        t.storage()
            .share_memory_with(crate::shm::strategy::SharingStrategy::FileSystem)
            .unwrap();
        let (seg, _) = t.storage().segment().unwrap();
        let inner = Opaque::encode(&t).unwrap();
        drop(t); // the Opaque's in-flight use is all that keeps the block in use now
        assert_eq!(seg.uses(), Some(1));
        // The outer send fails (nobody receives): the use must stay with the Opaque,
        // which comes back to the sender, not be released.
        let (a, b) = socket::seqpacket_pair().unwrap();
        drop(b);
        let mut outer = encode(&(1u8, &inner)).unwrap();
        assert!(outer.send(a.as_fd(), None).is_err());
        drop(outer);
        assert_eq!(
            seg.uses(),
            Some(1),
            "a failed send released the nested message's use"
        );
        // Sent again, it arrives and decodes.
        let (c, d) = socket::seqpacket_pair().unwrap();
        let mut again = encode(&(2u8, &inner)).unwrap();
        again.send(c.as_fd(), None).unwrap();
        drop((again, inner));
        let back: (u8, Opaque) = decode(recv_packet(d.as_fd(), None).unwrap().unwrap()).unwrap();
        let t: crate::tensor::Tensor = back.1.decode().unwrap();
        assert_eq!(t.sum().unwrap(), 3.0 * floats as f64);
        drop(t);
        assert_eq!(seg.uses(), Some(0), "the last user gave its use back");
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
