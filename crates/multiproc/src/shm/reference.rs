//! References to shared memory as values: a [`BlockUse`] is one use of a block (see
//! `segment::block`; a named block's use holds its name too). Whoever holds one — a storage, a message in flight — gives it back by dropping it;
//! a message that is sent hands it to its receiver instead ([`Carried::sent`]), who
//! adopts it as a value of its own ([`BlockUse::adopt`]).
//!
//! Invariant: a value gives its reference back only in the process that took or
//! adopted it. A `fork` child inherits its parent's values (inside storages and
//! unsent messages) but not their references; dropping them there gives nothing back.

use std::sync::Arc;

use super::Segment;
use crate::wire::{Carried, Readopt};

/// The pid a reference belongs to, 0 once it has been handed to a receiver.
fn this_process() -> u32 {
    crate::sys::process::cached_pid()
}

/// One use of a block: the block is not handed out again while it lives.
#[derive(Debug)]
pub(crate) struct BlockUse {
    block: Arc<Segment>,
    owner: u32,
}

impl BlockUse {
    /// Takes a new use of `block` (which must be a block: see `Segment::is_block`).
    pub(crate) fn take(block: &Arc<Segment>) -> BlockUse {
        block.acquire_use();
        BlockUse {
            block: Arc::clone(block),
            owner: this_process(),
        }
    }

    /// The use a received message brought for this process.
    pub(crate) fn adopt(block: Arc<Segment>) -> BlockUse {
        BlockUse {
            block,
            owner: this_process(),
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
        if self.is_held_here() {
            self.block.release_use();
        }
    }
}

impl Carried for BlockUse {
    fn sent(mut self: Box<Self>) {
        self.owner = 0;
    }
}

/// A block's use, taken once more for a received packet that is kept for another try
/// (see `wire::Decoder::adopted`).
impl Readopt for Segment {
    fn take_again(self: Arc<Self>) -> std::result::Result<Box<dyn Carried>, crate::error::Error> {
        Ok(Box::new(BlockUse::take(&self)))
    }
}
