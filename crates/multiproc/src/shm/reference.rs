//! References to shared memory as values: a [`BlockUse`] is one use of a block held by
//! a value of this process (a storage; see `segment`'s blocks; a named block's use holds
//! its name too); a message carries one for its receiver as a `wire::InFlightUse` of
//! the block (a [`Segment`] is a `wire::InFlightBlock`, see `segment`'s blocks).
//! Whoever holds one gives it back by dropping it; a message that is sent hands its
//! use to its receiver instead ([`Carried::sent`]), who adopts it as a value of its own
//! ([`BlockUse::adopt`]).
//!
//! Invariant: a value gives its reference back only in the process that took or
//! adopted it. A `fork` child inherits its parent's values (inside storages and
//! unsent messages) but not their references; dropping them there gives nothing back.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::Segment;
use crate::wire::{Carried, Custody, GiveBack, Reference};

/// The pid a reference belongs to, 0 once it has been handed to a receiver.
fn this_process() -> u32 {
    crate::sys::fork_local::cached_pid()
}

/// One use of a block: the block is not handed out again while it lives.
#[derive(Debug)]
pub(crate) struct BlockUse {
    block: Arc<Segment>,
    owner: u32,
    /// The decode that adopted it (0: none): dropped while that decode still runs, it
    /// is given back only if the decode succeeds (see `wire::defer_give_back`).
    adopted_in: u64,
}

impl BlockUse {
    /// Takes a new use of `block` (which must be a block: see `Segment::is_block`).
    pub(crate) fn take(block: &Arc<Segment>) -> BlockUse {
        block.acquire_local_use();
        BlockUse {
            block: Arc::clone(block),
            owner: this_process(),
            adopted_in: 0,
        }
    }

    /// The use a received message brought for this process, adopted by the decode
    /// with id `decode` (`wire::Decoder::adopt`).
    pub(crate) fn adopt(block: Arc<Segment>, decode: u64) -> BlockUse {
        block.adopt_local_use();
        BlockUse {
            block,
            owner: this_process(),
            adopted_in: decode,
        }
    }

    /// The block it is a use of.
    pub(crate) fn block(&self) -> &Arc<Segment> {
        &self.block
    }

    /// Whether this process holds the use (not a `fork` parent).
    pub(crate) fn is_held_here(&self) -> bool {
        self.owner == this_process()
    }
}

impl Drop for BlockUse {
    fn drop(&mut self) {
        if !self.is_held_here() {
            return;
        }
        if self.adopted_in != 0 && crate::wire::is_decoding(self.adopted_in) {
            // Dropped inside the decode that adopted it: given back when (and only if)
            // that decode succeeds.
            let deferred = BlockUse {
                block: Arc::clone(&self.block),
                owner: self.owner,
                adopted_in: 0,
            };
            if let Some(now) = crate::wire::defer_give_back(self.adopted_in, Box::new(deferred)) {
                drop(now);
            }
            return;
        }
        self.block.release_local_use();
    }
}

impl Carried for BlockUse {
    /// A use adopted by a decode that then failed (see `wire::defer_give_back`): the
    /// packet kept for another try still carries it, so this process no longer counts
    /// it.
    fn sent(mut self: Box<Self>) {
        if self.is_held_here() {
            self.block.local_uses_forget();
        }
        self.owner = 0;
    }
}

/// Gives back the block uses of messages that are dropped unread (see
/// `wire::context`): finds each block — mapped here already, or mapped now from the
/// packet's fd, the channel's custody or its name — and gives its use back.
pub(crate) struct Returns {
    /// The custody of the channel the packets came through, for blocks named by inode.
    custody: Option<Arc<dyn Custody>>,
}

impl Returns {
    /// For packets of a channel with `custody`.
    pub(crate) fn with_custody(custody: Arc<dyn Custody>) -> Arc<dyn GiveBack> {
        Arc::new(Returns {
            custody: Some(custody),
        })
    }

    /// For packets of a channel without custody (a pipe, a process's arguments).
    pub(crate) fn plain() -> Arc<dyn GiveBack> {
        static PLAIN: std::sync::LazyLock<Arc<dyn GiveBack>> =
            std::sync::LazyLock::new(|| Arc::new(Returns { custody: None }));
        Arc::clone(&PLAIN)
    }
}

impl GiveBack for Returns {
    fn give_back(&self, reference: &Reference<'_>, fds: &[OwnedFd]) {
        // Only the header is needed to give a use back.
        let end = (super::segment::BLOCK_HEADER_LEN + 1) as u64;
        let block = match reference {
            Reference::Fd(i) => match fds.get(*i as usize) {
                Some(fd) => super::receive_fd(fd.as_fd(), end),
                None => return,
            },
            Reference::Inode { dev, ino } => match &self.custody {
                Some(c) => super::receive_by_inode(
                    Some((&**c, crate::wire::LOOKUP_PATIENCE)),
                    *dev,
                    *ino,
                    end,
                ),
                None => return,
            },
            Reference::Name(name) => super::named_handle(name, end),
        };
        match block {
            Ok(block) => block.give_back_in_flight_use(),
            // Not ours, or gone: nothing to give back here.
            Err(e) => tracing::debug!("a use carried by an unread message: {e}"),
        }
    }

    fn custody(&self) -> Option<&Arc<dyn Custody>> {
        self.custody.as_ref()
    }
}
