//! A message's references: the uses of shared blocks it carries for its receiver,
//! listed in the packet itself so that a packet nobody decodes can still give them back.
//!
//! Every block handle in a message stands for one use of its block that the sender took
//! for the receiver (see `shm::reference`). The packet lists them in its *references
//! section*, one entry per use, each saying how the block is found: by an fd of the
//! packet, by device and inode in the custody of the channel it travels through, or by
//! name. A handle in the payload names its entry by index.
//!
//! That list is what makes a message that is never decoded — a queue dropped with
//! messages in it, a pool result nobody reads, an [`Opaque`](super::Opaque) dropped, a
//! packet refused as malformed — give back what it carried: [`give_back_unread`] reads
//! the section alone (never the payload, which only the receiver's type can read) and
//! hands each entry to a [`GiveBack`], which the layer that owns blocks provides.
//!
//! Section layout (after the payload, or after the header when the payload is in a
//! memfd): a `u32` count, then that many postcard-encoded [`Reference`]s. Its length in
//! bytes is the header's bytes 16..20.
//!
//! Invariant: each entry is given back at most once — by the value that adopted it, by
//! the decode that failed (which adopted nothing it kept), or by the holder that drops
//! the packet unread — and a packet kept for another try gives back nothing.

use std::borrow::Cow;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::Custody;
use crate::error::{Error, Result};
use crate::sys::socket::Packet;

/// How a message's block is found (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Reference<'a> {
    /// A block whose memfd is fd number `.0` of the packet.
    Fd(u32),
    /// A block named by its memfd's device and inode, its fd in the custody of the
    /// channel the packet travels through.
    Inode { dev: u64, ino: u64 },
    /// A named block (the `file_system` strategy).
    Name(#[serde(borrow)] Cow<'a, str>),
}

impl Reference<'_> {
    /// The same reference, owning its name.
    pub(crate) fn into_owned(self) -> Reference<'static> {
        match self {
            Reference::Fd(i) => Reference::Fd(i),
            Reference::Inode { dev, ino } => Reference::Inode { dev, ino },
            Reference::Name(n) => Reference::Name(Cow::Owned(n.into_owned())),
        }
    }
}

/// Gives back the use a reference of an unread message stands for. Implemented by the
/// layer that owns blocks, one per channel; `fds` are the packet's.
pub(crate) trait GiveBack: Send + Sync {
    fn give_back(&self, reference: &Reference<'_>, fds: &[OwnedFd]);

    /// The custody of the channel whose packets these are, if it keeps its blocks'
    /// fds: a decode of them finds blocks named by inode there (see `custody`).
    fn custody(&self) -> Option<&Arc<dyn Custody>> {
        None
    }
}

impl std::fmt::Debug for dyn GiveBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GiveBack")
    }
}

/// A section being built: the count and a few entries are kept inline (an inode
/// entry is at most 21 bytes), so a message with a tensor or two allocates none.
pub(crate) type Section = SmallVec<[u8; 64]>;

/// A section's entries as a decode keeps them: one or two inline.
pub(crate) type Entries<R> = SmallVec<[R; 2]>;

/// Most entries one section may declare: a section is read from a packet of at most
/// a few hundred KiB, and an entry takes at least two bytes.
const MAX_ENTRIES: usize = 1 << 20;

/// The entries of a references section (`section`: the bytes the header says it
/// spans). Untrusted: every count and entry is checked.
pub(crate) fn parse(section: &[u8]) -> Result<Entries<Reference<'_>>> {
    parse_into(section, |r| r)
}

/// [`parse`], each entry made into what `into` returns, with no allocation for one or
/// two (a decode keeps owned entries with a flag each).
pub(crate) fn parse_into<'a, R>(
    section: &'a [u8],
    mut into: impl FnMut(Reference<'a>) -> R,
) -> Result<Entries<R>> {
    if section.is_empty() {
        return Ok(Entries::new());
    }
    let bad = |what: String| Error::InvalidMessage(format!("the references section {what}"));
    let Some((count, mut rest)) = section.split_first_chunk::<4>() else {
        return Err(bad(format!(
            "is {} bytes, too short for its count",
            section.len()
        )));
    };
    let count = u32::from_le_bytes(*count) as usize;
    if count > MAX_ENTRIES.min(rest.len() / 2) {
        return Err(bad(format!(
            "declares {count} entries in {} bytes",
            rest.len()
        )));
    }
    let mut entries = Entries::with_capacity(count);
    for i in 0..count {
        let (entry, after) = postcard::take_from_bytes::<Reference<'_>>(rest)
            .map_err(|e| bad(format!("has a malformed entry #{i}: {e}")))?;
        entries.push(into(entry));
        rest = after;
    }
    if !rest.is_empty() {
        return Err(bad(format!("has {} bytes after its entries", rest.len())));
    }
    Ok(entries)
}

/// Appends one entry to a section being built (`count` entries so far).
pub(crate) fn push(section: &mut Section, count: &mut u32, reference: &Reference<'_>) {
    if section.is_empty() {
        section.extend_from_slice(&[0; 4]);
    }
    // Written into a buffer on the stack, then copied in one go: postcard's extending
    // writer checks the section's room byte by byte. Only a long name needs more.
    let mut entry = [0u8; 48];
    match postcard::to_slice(reference, &mut entry) {
        Ok(bytes) => section.extend_from_slice(bytes),
        // Writing into a growable buffer cannot fail for these types.
        Err(_) => {
            if let Ok(out) = postcard::to_extend(reference, std::mem::take(section)) {
                *section = out;
            }
        }
    }
    *count += 1;
    section[..4].copy_from_slice(&count.to_le_bytes());
}

/// Gives back every reference `packet` carries, without decoding its payload: for a
/// packet dropped unread. A packet too malformed to list its references gives back
/// nothing (it is not one of ours).
pub(crate) fn give_back_unread(packet: Packet, to: &dyn GiveBack) {
    let Packet { bytes, mut fds } = packet;
    let Some(section) = super::references_section(&bytes, &mut fds) else {
        return;
    };
    match parse(&section) {
        Ok(entries) => {
            for entry in &entries {
                to.give_back(entry, &fds);
            }
        }
        Err(e) => tracing::debug!("an unread packet's references cannot be read: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_round_trips_and_refuses_garbage() {
        let entries = [
            Reference::Fd(3),
            Reference::Inode {
                dev: 7,
                ino: 1 << 40,
            },
            Reference::Name(Cow::Borrowed("mp-1-2-3")),
            // Longer than the stack buffer an entry is first written into.
            Reference::Name(Cow::Owned("n".repeat(100))),
        ];
        let (mut section, mut count) = (Section::new(), 0);
        for e in &entries {
            push(&mut section, &mut count, e);
        }
        assert_eq!(parse(&section).unwrap().as_slice(), entries);
        assert!(parse(&[]).unwrap().is_empty());
        assert!(parse(&[1, 0]).is_err());
        assert!(parse(&[9, 0, 0, 0, 0]).is_err());
        let mut longer = section.clone();
        longer.push(0);
        assert!(parse(&longer).is_err());
        assert!(parse(&section[..section.len() - 1]).is_err());
    }
}
