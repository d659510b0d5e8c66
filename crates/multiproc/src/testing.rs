//! Hooks for the integration tests' leak checks (`tests/common`). **Not public API**:
//! hidden from the docs, exempt from semver, and may change or vanish in any release.

/// Lets go of the received segments this process keeps mapped after their last tensor
/// was dropped (the retention cache, see `shm::cache`), so that a leak check can count
/// fds exactly. Returns how many were let go.
pub fn flush_retained_segments() -> usize {
    crate::shm::flush_retained()
}

/// Lets go of this process's idle pooled blocks (full arenas and large blocks that no
/// storage uses, here or elsewhere), so that a leak check can count fds exactly.
/// Returns how many were let go.
pub fn release_idle_blocks() -> usize {
    // The CUDA pool and its receive cache hold fds too (exports and leases); only
    // where CUDA is already initialised, so a leak check never starts the driver.
    if crate::cuda::initialised() {
        crate::cuda::empty_cache();
    }
    crate::shm::release_idle_blocks()
}

/// Runs `f` while this process holds the lock of `queue`'s block custody: a test makes
/// a holder that stops (SIGSTOP) inside it. Built with the `fuzzing` feature only.
#[cfg(feature = "fuzzing")]
pub fn while_custody_locked<T: serde::Serialize + serde::de::DeserializeOwned, R>(
    queue: &crate::Queue<T>,
    f: impl FnOnce() -> R,
) -> crate::Result<R> {
    queue.while_custody_locked(f)
}
