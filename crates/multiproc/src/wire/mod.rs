//! The wire: how a value becomes one packet — a record in a queue's ring or a packet on
//! a socket — and back.
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
//! a tensor costs no `dup`/`close` pair per message on either side. On a socket the
//! table travels as `SCM_RIGHTS` in the same `sendmsg` as the bytes, so a message and
//! its handles arrive together or not at all, and the sender may exit as soon as the
//! send returns.
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
//! | 16..20 | references section length in bytes (see `context`) |
//!
//! The *body* — the payload, then the references section — follows the header (kind 0)
//! or fills the payload memfd (kind 1). The section lists the block uses the message
//! carries, so that a packet nobody decodes gives them back ([`give_back_unread`]).
//!
//! A queue carries a packet without fds through its shared-memory ring instead of its
//! socket (see `queue`), the same bytes either way; a tensor block in such a packet is
//! named by inode, its fd in the queue's custody (see `custody`).
//!
//! Bodies above [`INLINE_MAX`] go into a sealed memfd so every message is a single
//! packet whatever its size: one packet is delivered whole to exactly one reader, which
//! is what lets many processes put and get on one socket without locks.
//!
//! Files: this one holds the codec's entry points ([`encode`], [`decode`]) and the
//! packet constants; `packet` the framing ([`Encoded`], sending, receiving, the
//! payload memfd); `context` the encoder and decoder that handles' impls talk to (the
//! fd side table, the references a message carries and the references section that
//! lists them, the error it failed with); `custody` the custody trait a channel lends
//! the codec; `opaque` nested messages ([`Opaque`]).
//!
//! Invariant: decoding never panics and never trusts the sender. Every length, count
//! and index is checked; anything malformed is [`Error::InvalidMessage`] saying what.

mod context;
mod custody;
mod opaque;
mod packet;

use std::borrow::Cow;
use std::cell::RefCell;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use context::{
    AttachedFd, DecodeTable, EncodeTable, check_all_used, decoding, encoding, is_encoding,
};
pub(crate) use context::{
    Carried, CarriedRef, Decoder, Encoder, InFlightBlock, InFlightUse, Landing, defer_give_back,
    is_decoding,
};
pub(crate) use context::{GiveBack, Reference, give_back_unread};
pub(crate) use custody::{Custody, KeptBlock, LOOKUP_PATIENCE, TRY_PATIENCE};
pub(crate) use opaque::Opaque;
use packet::read_sealed_payload;
pub(crate) use packet::{
    Encoded, buffer as packet_buffer, is_counted, recv_packet, try_recv_packet, uncount,
};

use crate::error::{Error, Result};
use crate::sys::memfd;
use crate::sys::socket::{MAX_FDS_PER_PACKET, Packet};

/// The packet magic.
pub(super) const MAGIC: [u8; 4] = *b"MPW\x01";
/// The wire format version; a packet of another version is refused. Version 2: only
/// blocks travel (the plain `Fd` and `Named` segment handles are gone). Version 3: the
/// references section, which block handles name by index. Version 4: a block's header
/// is two cache lines of counts that only grow (`shm`'s blocks), and its data starts
/// 128 bytes in.
pub(crate) const VERSION: u8 = 4;
pub(super) const HEADER_LEN: usize = 20;
pub(super) const KIND_INLINE: u8 = 0;
pub(super) const KIND_MEMFD: u8 = 1;
/// Header flag: a queue's `put` counted this message (see [`Encoded::mark_counted`]).
pub(super) const FLAG_COUNTED: u8 = 1;
/// Largest body (payload and references section) sent inside the packet itself.
pub(crate) const INLINE_MAX: usize = 60 * 1024;
/// Largest payload accepted from a memfd (a sanity bound against hostile lengths).
pub(super) const MEMFD_PAYLOAD_MAX: u64 = 1 << 40;

/// The payload buffer an encode starts with (a message with a tensor or two takes
/// under a hundred bytes).
const ENCODE_CAPACITY: usize = 256;

/// Encodes `value` into a packet, attaching the fds of every handle inside it.
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded> {
    encode_in(value, None)
}

/// [`encode`] for a channel that keeps its blocks' fds in `custody` (see `custody`):
/// its block handles name blocks by inode.
pub(crate) fn encode_in<T: Serialize + ?Sized>(
    value: &T,
    custody: Option<&Arc<dyn Custody>>,
) -> Result<Encoded> {
    if is_encoding() {
        return Err(Error::Encode(
            "a value is being sent from inside the serialization of another message".into(),
        ));
    }
    // Room for a few tensors' handles up front: growing from empty costs several
    // reallocations per message.
    let table = RefCell::new(EncodeTable::new(custody.cloned()));
    let bytes = encoding(&table, || {
        postcard::to_extend(value, packet::buffer(ENCODE_CAPACITY))
    });
    let EncodeTable {
        mut fds,
        carried,
        error,
        references,
        ..
    } = table.into_inner();
    let mut encoded = Encoded {
        header: [0; HEADER_LEN],
        payload: Vec::new(),
        fds: Vec::new(),
        carried,
    };
    let mut body =
        bytes.map_err(|e| error.map_or_else(|| Error::Encode(codec_error(&e)), |e| *e))?;
    let nfds = fds.len();
    if nfds > MAX_FDS_PER_PACKET - 1 {
        return Err(Error::Encode(format!(
            "a message would carry {nfds} file descriptors but one message carries at most {}: \
             send fewer unshared-storage tensors or queues per message, or use the file_system sharing strategy",
            MAX_FDS_PER_PACKET - 1
        )));
    }
    let payload_len = body.len();
    let section_len = references.len();
    if payload_len as u64 + section_len as u64 > u32::MAX as u64 {
        return Err(Error::Encode(format!(
            "a message of {payload_len} bytes is larger than 4 GiB; put large data in tensors"
        )));
    }
    body.extend_from_slice(&references);
    let kind = if body.len() > INLINE_MAX {
        let fd = memfd::create("multiproc-message", body.len() as u64)?;
        memfd::write_all_at(fd.as_fd(), &body)?;
        memfd::seal_contents(fd.as_fd())?;
        fds.push(AttachedFd::Owned(fd));
        KIND_MEMFD
    } else {
        encoded.payload = body;
        KIND_INLINE
    };
    encoded.header[0..4].copy_from_slice(&MAGIC);
    encoded.header[4] = VERSION;
    encoded.header[5] = kind;
    encoded.header[8..12].copy_from_slice(&(nfds as u32).to_le_bytes());
    encoded.header[12..16].copy_from_slice(&(payload_len as u32).to_le_bytes());
    encoded.header[16..20].copy_from_slice(&(section_len as u32).to_le_bytes());
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
/// what was wrong with it, and gives back the block uses it carried (to `returns`).
pub(crate) fn decode<T: DeserializeOwned>(
    packet: Packet,
    returns: &Arc<dyn GiveBack>,
) -> Result<T> {
    decode_with(packet, returns, LOOKUP_PATIENCE)
}

/// [`decode`], a block named by inode looked for in the custody with `patience`.
fn decode_with<T: DeserializeOwned>(
    packet: Packet,
    returns: &Arc<dyn GiveBack>,
    patience: Duration,
) -> Result<T> {
    let Packet { bytes, fds } = packet;
    decode_body(&bytes, fds, returns, false, patience).map_err(|(e, _)| e)
}

/// [`decode`] of a packet that its caller keeps for another try when the decode fails
/// for a reason that may pass — [`Error::FdLimit`] (a block it names had to be mapped,
/// with no fd left to do it) or [`Error::Timeout`] — and it carries no fds: then the
/// packet is put in `kept`, still carrying every use it brought (the decode adopted
/// none of them). After any other failure it is consumed. A block it names by inode is
/// looked for in the channel's custody with `patience` (see [`Custody::find`]).
pub(crate) fn decode_or_keep<T: DeserializeOwned>(
    packet: Packet,
    returns: &Arc<dyn GiveBack>,
    kept: &mut Option<Packet>,
    patience: Duration,
) -> Result<T> {
    if !packet.fds.is_empty() {
        return decode_with(packet, returns, patience);
    }
    match decode_body(&packet.bytes, Vec::new(), returns, true, patience) {
        Ok(value) => {
            packet::recycle(packet.bytes);
            Ok(value)
        }
        Err((e, keep)) => {
            if keep {
                *kept = Some(packet);
            }
            Err(e)
        }
    }
}

/// What a postcard error says, in words a user can act on: a `Serialize` or
/// `Deserialize` impl's own error reaches postcard as `custom`, whose text postcard
/// does not keep (it says only "Serde Serialization Error").
fn codec_error(e: &postcard::Error) -> String {
    match e {
        postcard::Error::SerdeSerCustom => "a Serialize impl in the value returned an error (the \
             wire codec, postcard, keeps no text of it: serializing the value with \
             serde_json shows it)"
            .into(),
        postcard::Error::SerdeDeCustom => "a Deserialize impl of the receiving type returned an \
             error (the wire codec, postcard, keeps no text of it): do both sides use the \
             same type?"
            .into(),
        other => other.to_string(),
    }
}

/// The parts of a packet whose header checked out.
struct Parts<'a> {
    payload: Cow<'a, [u8]>,
    section: Cow<'a, [u8]>,
}

/// Checks the header and finds the payload and the references section (reading the
/// body out of the payload memfd, the last of `fds`, which is taken off).
fn split_packet<'a>(bytes: &'a [u8], fds: &mut Vec<OwnedFd>) -> Result<Parts<'a>> {
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
    let word = |at: usize| {
        u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize
    };
    let (kind, nfds, len, section_len) = (bytes[5], word(8), word(12), word(16));
    let body_len = len.checked_add(section_len);
    match kind {
        KIND_INLINE => {
            if nfds != fds.len() {
                return bad(format!(
                    "the header declares {nfds} fds but {} arrived",
                    fds.len()
                ));
            }
            if body_len != Some(bytes.len() - HEADER_LEN) {
                return bad(format!(
                    "the header declares a {len}-byte payload and a {section_len}-byte \
                     references section but {} bytes arrived",
                    bytes.len() - HEADER_LEN
                ));
            }
            let body = &bytes[HEADER_LEN..];
            Ok(Parts {
                payload: Cow::Borrowed(&body[..len]),
                section: Cow::Borrowed(&body[len..]),
            })
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
            let Some(body_len) = body_len else {
                return bad("the header's body length overflows".into());
            };
            let Some(fd) = fds.pop() else {
                return bad("the payload memfd is missing".into());
            };
            let mut payload = read_sealed_payload(fd.as_fd(), body_len)?;
            let section = payload.split_off(len);
            Ok(Parts {
                payload: Cow::Owned(payload),
                section: Cow::Owned(section),
            })
        }
        other => bad(format!("unknown packet kind {other}")),
    }
}

/// The references section of a packet, when its header checks out (for a packet
/// dropped unread: see [`give_back_unread`]).
fn references_section(bytes: &[u8], fds: &mut Vec<OwnedFd>) -> Option<Vec<u8>> {
    split_packet(bytes, fds)
        .ok()
        .map(|parts| parts.section.into_owned())
}

/// Decodes a packet's bytes and fds. On failure: the error, and whether the packet is
/// to be kept for another try (only when `may_keep`); a packet that is not kept has
/// given back the uses it carried.
fn decode_body<T: DeserializeOwned>(
    bytes: &[u8],
    mut fds: Vec<OwnedFd>,
    returns: &Arc<dyn GiveBack>,
    may_keep: bool,
    patience: Duration,
) -> std::result::Result<T, (Error, bool)> {
    tracing::trace!(
        bytes = bytes.len(),
        handles = fds.len(),
        "decoding a message"
    );
    let parts = split_packet(bytes, &mut fds).map_err(|e| (e, false))?;
    // A section that cannot be read lists nothing to give back: the packet is not one
    // of ours.
    let references =
        context::parse_into(&parts.section, |r| (r.into_owned(), false)).map_err(|e| (e, false))?;
    let mut table = RefCell::new(DecodeTable::new(
        fds,
        references,
        Arc::clone(returns),
        patience,
    ));
    let result = decoding(&table, || {
        match postcard::take_from_bytes::<T>(&parts.payload) {
            Ok((value, [])) => check_all_used().map(|()| value),
            // Dropped here, inside the decode, so that its uses are deferred.
            Ok((_, rest)) => Err(Error::InvalidMessage(format!(
                "{} bytes follow the end of the value",
                rest.len()
            ))),
            Err(e) => Err(Error::InvalidMessage(format!(
                "cannot decode the payload: {}",
                codec_error(&e)
            ))),
        }
    });
    let table = table.get_mut();
    let deferred = std::mem::take(&mut table.deferred);
    let landed = std::mem::take(&mut table.landed);
    match result {
        Ok(value) => {
            // The adopted uses are this process's now, no longer the message's.
            landed.iter().for_each(|l| l.landed());
            // Uses this process held already, or dropped by the value's own impls.
            drop(deferred);
            Ok(value)
        }
        Err(e) => {
            // Nothing was adopted: the packet still carries every use.
            for reference in deferred {
                reference.sent();
            }
            let error = table.error.take().map_or(e, |e| *e);
            if may_keep && matches!(error, Error::FdLimit { .. } | Error::Timeout { .. }) {
                return Err((error, true));
            }
            let references = std::mem::take(&mut table.references);
            let fds = table.take_fds();
            for (reference, _) in &references {
                returns.give_back(reference, &fds);
            }
            Err((error, false))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::socket;

    fn decode<T: DeserializeOwned>(p: Packet) -> Result<T> {
        super::decode(p, &crate::shm::Returns::plain())
    }

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
        let ev: crate::sync::Event = outer.1.decode(&crate::shm::Returns::plain()).unwrap();
        ev.set();
        assert!(ev.is_set());
        drop((a, b));
    }

    #[test]
    #[cfg_attr(miri, ignore = "sockets and named segments")]
    fn a_nested_message_that_fails_to_send_keeps_its_references() {
        // Named blocks need the manager (the other tests that name blocks start it too).
        crate::manager::serve_in_this_process();
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
        let t: crate::tensor::Tensor = back.1.decode(&crate::shm::Returns::plain()).unwrap();
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
        header.extend([
            VERSION,
            KIND_INLINE,
            0,
            0,
            1,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        ]);
        let err = decode::<()>(Packet {
            bytes: header,
            fds: vec![],
        })
        .unwrap_err();
        assert!(err.to_string().contains("declares 1 fds"), "{err}");
    }
}
