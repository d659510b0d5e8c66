//! # Safety
//!
//! [`CodeRef`] names a function by its offset from the job module's anchor, so that
//! another process running the same executable can call it (a pool worker receiving
//! many task functions through one channel). The invariants are those of
//! `process::job`: same executable (checked by a second known offset), and the caller
//! of [`CodeRef::resolve`] names the exact function-pointer type the offset was taken
//! from — which the callers guarantee by resolving only offsets of functions they
//! monomorphized for those types themselves.

use serde::{Deserialize, Serialize};

use super::job::{address_at, check_offset, offset_of};

/// A function of this executable, as it travels to another process.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct CodeRef {
    check: u64,
    offset: u64,
}

impl CodeRef {
    /// The reference to the function at `address` (a function pointer cast to usize).
    pub(crate) fn of(address: usize) -> Self {
        Self {
            check: check_offset(),
            offset: offset_of(address),
        }
    }

    /// The function pointer again, as type `F`.
    ///
    /// # Errors
    /// When the reference comes from another build of the program.
    ///
    /// # Safety
    /// `F` must be a function-pointer type, and exactly the type of the function this
    /// reference was made from with [`of`](Self::of).
    pub(crate) unsafe fn resolve<F: Copy>(&self) -> Result<F, String> {
        if self.check != check_offset() {
            return Err(
                "the task was sent by a different build of this program (code offsets differ); \
                        parent and worker must run the same executable"
                    .into(),
            );
        }
        if size_of::<F>() != size_of::<usize>() {
            return Err("internal error: a code reference resolved to a non-pointer type".into());
        }
        let address = address_at(self.offset);
        // SAFETY: `F` is the function-pointer type the offset was taken from (the
        // caller's contract) in this same executable (checked above), so `address` is a
        // valid value of `F`; sizes are equal (checked above).
        Ok(unsafe { std::mem::transmute_copy::<usize, F>(&address) })
    }
}
