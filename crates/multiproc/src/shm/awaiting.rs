//! A block of shared words is what the async reactor (`sys::reactor`) waits on.

use std::sync::atomic::AtomicU32;

use super::SharedWords;
use crate::sys::reactor::WordHost;

impl WordHost for SharedWords {
    fn host_word(&self, index: usize) -> &AtomicU32 {
        self.word(index)
    }
}
