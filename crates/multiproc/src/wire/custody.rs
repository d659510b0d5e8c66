//! Handles without fds: how a message names a block by its inode alone.
//!
//! Attaching a block's fd to every message costs a `sendmsg` and a `recvmsg` per
//! message, and the receiver an `fstat` and a cache lookup. A channel that can keep
//! fds on its own (a queue's custody, see `queue::custody`) lends itself to the codec
//! for one encode ([`encode_in`](super::encode_in)) and, through what gives back its
//! packets' uses ([`GiveBack::custody`](super::GiveBack::custody)), to every decode of
//! its packets. A block handle then asks the message's context for it
//! ([`Encoder::custody`](super::Encoder::custody),
//! [`Decoder::custody`](super::Decoder::custody)): the block travels as `(device,
//! inode)` — [`Reference::Inode`](super::Reference::Inode) in the packet's references
//! section — and its fd goes into the custody once, the first time this process sends
//! the block through that channel. A receiver that already maps the block (most of
//! them, most of the time: blocks are recycled and stay mapped on both sides) needs no
//! system call at all; one that does not takes a duplicate of the fd out of the
//! custody.
//!
//! The custody is what keeps the block alive while a message naming it is in flight:
//! its fds live in a socket buffer that every holder of the channel shares, so the
//! sender may exit (or be killed) right after `put` returns and the receiver still
//! finds the block. A block that cannot go into custody (its buffer is full, the fd
//! limit) travels with its fd attached to the message, which then goes on the socket.
//!
//! The codec knows custodies only by this trait, and blocks only by what the trait
//! takes ([`KeptBlock`]); the layer that owns blocks and the layer that owns channels
//! meet here, each calling down.

use std::any::Any;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;

/// A block as a custody keeps it.
pub(crate) struct KeptBlock<'a> {
    /// The device and inode of its memfd: how messages name it.
    pub(crate) dev: u64,
    pub(crate) ino: u64,
    /// Its memfd.
    pub(crate) fd: BorrowedFd<'a>,
    /// Its size in bytes (what keeping it costs).
    pub(crate) len: u64,
    /// The value that maps it here: a custody remembers the blocks it keeps by a
    /// `Weak` of it, so that a block freed and an inode number reused are told apart.
    pub(crate) identity: &'a Arc<dyn Any + Send + Sync>,
}

/// Something that keeps the fds of the blocks sent through one channel.
pub(crate) trait Custody: Send + Sync {
    /// Makes sure the custody holds `block`'s fd, putting it there the first time;
    /// `false` when it cannot (the handle must then carry the fd).
    fn keep(&self, block: &KeptBlock<'_>) -> bool;

    /// A duplicate of the fd of the block with this device and inode, `None` when the
    /// custody holds no such block. Other processes may be looking through it (see
    /// `queue::custody`): the lookup waits for them `patience` at most, then fails with
    /// [`Error::Timeout`](crate::Error::Timeout), and the caller keeps its message for
    /// another try.
    fn find(&self, dev: u64, ino: u64, patience: Duration) -> Result<Option<OwnedFd>>;
}

/// How long a lookup waits for other processes looking through a custody when it may
/// block (a blocking get with time left; giving back an unread message's uses): long
/// enough for any running process's pass, short enough that one stopped while it looks
/// (a debugger, Ctrl-Z) costs a get half a second, after which it keeps its message for
/// another try.
pub(crate) const LOOKUP_PATIENCE: Duration = Duration::from_millis(500);

/// How long a lookup waits when the call must not block: a `try_get`, the poll of an
/// awaited get (which runs on an executor's thread). A running process's pass over a
/// shelf takes microseconds, or a few milliseconds for a sweep of a long one, so this
/// still finds the block unless both shelves' holders are stopped; then the message is
/// kept for a later try (an awaited get's next wake-up or re-check) instead of holding
/// up the caller's thread for half a second.
pub(crate) const TRY_PATIENCE: Duration = Duration::from_millis(10);
