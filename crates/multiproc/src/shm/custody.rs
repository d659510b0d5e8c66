//! Handles without fds: how a message names a block by its inode alone.
//!
//! Attaching a block's fd to every message costs a `sendmsg` and a `recvmsg` per
//! message, and the receiver an `fstat` and a cache lookup. A channel that can keep
//! fds on its own (a queue's *custody*, see `queue::custody`) offers itself here for
//! the duration of one encode or decode ([`scope`]); a block then travels as `(device,
//! inode)` — `wire::Reference::Inode` in the packet's references section — and its fd
//! goes into the custody once, the first time this process sends the block through
//! that channel. A receiver that already maps the block (most of them, most of the
//! time: blocks are recycled and stay mapped on both sides) needs no system call at
//! all; one that does not takes a duplicate of the fd out of the custody.
//!
//! The custody is what keeps the block alive while a message naming it is in flight:
//! its fds live in a socket buffer that every holder of the channel shares, so the
//! sender may exit (or be killed) right after `put` returns and the receiver still
//! finds the block. A block that cannot go into custody (its buffer is full, the fd
//! limit) travels with its fd as before.

use std::cell::RefCell;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::Segment;
use crate::error::Result;

/// Something that keeps the fds of the blocks sent through one channel.
pub(crate) trait BlockCustody: Send + Sync {
    /// Makes sure the custody holds `block`'s fd, putting it there the first time;
    /// `false` when it cannot (the handle must then carry the fd).
    fn publish(&self, block: &Arc<Segment>) -> bool;

    /// A duplicate of the fd of the block with this device and inode, `None` when the
    /// custody holds no such block.
    fn find(&self, dev: u64, ino: u64) -> Result<Option<OwnedFd>>;
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<dyn BlockCustody>>> = const { RefCell::new(None) };
}

/// Runs `f` (one encode or one decode) with `custody` offered to the block handles in
/// it.
pub(crate) fn scope<R>(custody: Arc<dyn BlockCustody>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Arc<dyn BlockCustody>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            let _ = CURRENT.try_with(|c| *c.borrow_mut() = previous);
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.borrow_mut().replace(custody)));
    f()
}

/// The custody offered to the encode or decode running on this thread, if any.
pub(crate) fn current() -> Option<Arc<dyn BlockCustody>> {
    CURRENT.with(|c| c.borrow().clone())
}
