//! The custody's protocol over its shelves, written once for the kernel's socket queues
//! (`Custody`) and for the model checker's stand-ins ([`model`]): a rotation that never
//! loses an entry whoever stops or dies inside it, and a lookup that never waits for a
//! shelf another participant holds while the other shelf is free.
//!
//! Every shared step a participant takes is one call on [`Shelves`] (each is one system
//! call for the real custody: atomic in the kernel), and before each the participant
//! asks its `go_on`: the model makes a participant stop for good, or die, at any step by
//! answering `false` there. A participant that stops keeps whatever lock it holds.

use crate::error::Result;

/// A shelf's packet as a peek sees it: its bytes, and its fd if it has one.
pub(crate) type Peeked<Fd> = (Vec<u8>, Option<Fd>);

/// What the protocol does with a custody's shelves (see the parent module).
pub(crate) trait Shelves {
    /// A held duplicate of an entry's fd.
    type Fd;
    /// Takes the lock of `shelf` if it is free now (or its holder died).
    fn try_hold(&self, shelf: usize) -> bool;
    /// Waits a little for the lock of `shelf` (a slice of a lookup's patience).
    fn hold_a_while(&self, shelf: usize) -> bool;
    /// Lets go of the lock of `shelf`.
    fn release(&self, shelf: usize);
    /// The first packet of `shelf`, left queued: its bytes and its fd, if any.
    fn peek(&self, shelf: usize) -> Result<Option<Peeked<Self::Fd>>>;
    /// Drops the first packet of `shelf`.
    fn dequeue(&self, shelf: usize);
    /// Appends a packet to `shelf` (an entry with its fd, or a sentinel without);
    /// `false` when the shelf is full.
    fn append(&self, shelf: usize, bytes: &[u8], fd: Option<&Self::Fd>) -> bool;
    /// The device and inode of an entry's fd (what the kernel says of it).
    fn identity(&self, fd: &Self::Fd) -> (u64, u64);
    /// About how many entries `shelf` holds.
    fn count(&self, shelf: usize) -> usize;
    /// An entry was dropped from `shelf` (its count goes down).
    fn dropped(&self, shelf: usize);
}

/// How many shelves a custody has.
pub(crate) const SHELVES: usize = 2;
/// The bytes of one entry: device and inode.
pub(crate) const ENTRY_LEN: usize = 16;

/// Looks at every entry of `shelf` once, keeping those `keep` accepts (in their order)
/// and dropping the others; stops early when `stop` says so, leaving that entry first.
/// The shelf's lock held. Returns the fd `stop` chose, if any (`None` also when `go_on`
/// stopped the pass).
///
/// One pass ends at `sentinel`, a packet without fd unique to this pass, appended first.
/// (Counting entries instead would go round twice when the count is high, and see the
/// copies it made.) A sentinel left behind by a pass that stopped early or died is
/// dropped by the next pass, as is anything else without an fd. An entry is appended
/// again before it is dequeued, so a participant that stops or dies between the two
/// leaves it twice, never lost.
pub(crate) fn rotate<S: Shelves>(
    s: &S,
    shelf: usize,
    sentinel: &[u8],
    mut stop: impl FnMut(u64, u64, &S::Fd) -> bool,
    mut keep: impl FnMut(u64, u64, &S::Fd) -> bool,
    go_on: &mut impl FnMut() -> bool,
) -> Result<Option<S::Fd>> {
    if !go_on() {
        return Ok(None);
    }
    let appended = s.append(shelf, sentinel, None);
    // Without a sentinel (a full shelf), one pass over the counted entries.
    let mut left = if appended { usize::MAX } else { s.count(shelf) };
    while left > 0 {
        left -= 1;
        if !go_on() {
            return Ok(None);
        }
        let Some((bytes, fd)) = s.peek(shelf)? else {
            break;
        };
        let Some(fd) = fd.filter(|_| bytes.len() == ENTRY_LEN) else {
            // A sentinel, or not an entry of ours (something else wrote to the socket).
            if !go_on() {
                return Ok(None);
            }
            s.dequeue(shelf);
            if bytes == sentinel {
                break;
            }
            continue;
        };
        let (dev, ino) = s.identity(&fd);
        if stop(dev, ino, &fd) {
            return Ok(Some(fd));
        }
        if keep(dev, ino, &fd) {
            if !go_on() {
                return Ok(None);
            }
            if !s.append(shelf, &bytes, Some(&fd)) {
                // The shelf is full: nothing more can be rotated now.
                break;
            }
        } else {
            s.dropped(shelf);
        }
        if !go_on() {
            return Ok(None);
        }
        s.dequeue(shelf);
    }
    Ok(None)
}

/// What a lookup came to.
#[derive(Debug)]
pub(crate) enum Lookup<Fd> {
    /// A duplicate of the block's fd.
    Found(Fd),
    /// Neither shelf holds the block.
    Missing,
    /// A shelf not yet searched stayed taken past the lookup's patience.
    GaveUp,
    /// `go_on` stopped the lookup (the model's participants only).
    Stopped,
}

/// Looks for the block `(dev, ino)` on each shelf whose lock is free, waiting a little
/// for a taken one only while no free one is left to search, until `patient` says to
/// give up; reports the block missing only once both shelves were searched. `sentinel`
/// makes the sentinel of a pass over shelf `i`.
pub(crate) fn find<S: Shelves>(
    s: &S,
    (dev, ino): (u64, u64),
    mut sentinel: impl FnMut() -> [u8; ENTRY_LEN],
    mut patient: impl FnMut() -> bool,
    go_on: &mut impl FnMut() -> bool,
) -> Result<Lookup<S::Fd>> {
    let mut searched = [false; SHELVES];
    loop {
        for (shelf, searched) in searched.iter_mut().enumerate() {
            if *searched {
                continue;
            }
            if !go_on() {
                return Ok(Lookup::Stopped);
            }
            if !s.try_hold(shelf) {
                continue;
            }
            *searched = true;
            let found = rotate(
                s,
                shelf,
                &sentinel(),
                |d, i, _| (d, i) == (dev, ino),
                |_, _, _| true,
                go_on,
            );
            // A lookup stopped inside its pass keeps the lock, as a stopped process does.
            if matches!(found, Ok(None)) && !go_on() {
                return Ok(Lookup::Stopped);
            }
            s.release(shelf);
            if let Some(fd) = found? {
                return Ok(Lookup::Found(fd));
            }
        }
        let Some(waiting) = searched.iter().position(|s| !s) else {
            return Ok(Lookup::Missing);
        };
        if !patient() {
            return Ok(Lookup::GaveUp);
        }
        // Every shelf left to search is taken: wait a little on one, then look again.
        if s.hold_a_while(waiting) {
            s.release(waiting);
        }
    }
}

#[cfg(test)]
mod model;
