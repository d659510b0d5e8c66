//! Process-shared synchronisation: state lives in a [`SharedBlock`](block::SharedBlock)
//! of atomic words that every process holding the primitive maps, and waiting is a
//! futex on one of those words (no busy-waiting, no helper process).

#[allow(unsafe_code)]
pub(crate) mod block;
mod event;
pub(crate) mod futex;

pub use event::Event;
