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
    let released = crate::shm::release_idle_blocks();
    // A queue dropped while its custody's idle job ran is freed when that job ends.
    crate::idle::wait_for_tick();
    released
}

/// Counters of this process since it started, for diagnostics (the examples' timing
/// breakdowns): shared segments mapped when a message named them (a miss of the map
/// cache), and with the `cuda` feature, host registrations made (`cuMemHostRegister`)
/// and undone. A loader whose workers recycle their blocks stops adding to all three
/// after its first few batches.
pub fn counters() -> Counters {
    use std::sync::atomic::Ordering::Relaxed;
    #[cfg(feature = "cuda")]
    let (registered, unregistered) = {
        let c = &crate::sys::cuda_driver::HOST_REGISTRATIONS;
        (c[0].load(Relaxed), c[1].load(Relaxed))
    };
    #[cfg(not(feature = "cuda"))]
    let (registered, unregistered) = (0, 0);
    Counters {
        segments_mapped_on_receipt: crate::shm::MAPPED_ON_RECEIPT.load(Relaxed),
        host_registrations: registered,
        host_unregistrations: unregistered,
    }
}

/// See [`counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Shared segments mapped on receipt.
    pub segments_mapped_on_receipt: u64,
    /// `cuMemHostRegister` calls that succeeded.
    pub host_registrations: u64,
    /// Host registrations undone (`cuMemHostUnregister`).
    pub host_unregistrations: u64,
}

/// How many of `pool`'s jobs wait for task outcomes: an `apply_async` or `map_async`
/// job is forgotten after its last outcome, read or not.
pub fn pool_jobs_waiting(pool: &crate::pool::Pool) -> usize {
    pool.jobs_waiting()
}

/// How many awaited waits (`get_async` and the like) are parked on a shared word in
/// this process: a test waits for its tasks to park by this count, not by a sleep.
#[cfg(feature = "async")]
pub fn parked_word_waits() -> usize {
    crate::sys::reactor::word_registrations()
}

/// How many times this process's async reactor threads have woken (from `futex_waitv`
/// or `poll`) since it started: 0 over a window in which every awaited wait stayed
/// parked means idle waits cost no timer.
#[cfg(feature = "async")]
pub fn reactor_wake_ups() -> u64 {
    crate::sys::reactor::wake_ups()
}

/// Whether the reactor threads have taken in everything so far: each word reactor
/// sleeps on its current set of registrations, and the fd reactor sleeps with no
/// doorbell and no close event left unread (the closes of a test's own queue handles,
/// dropped just before, included). A test waits for this before it counts
/// [`reactor_wake_ups`], so that a reactor still catching up is not counted.
#[cfg(feature = "async")]
pub fn reactors_settled() -> bool {
    crate::sys::reactor::words_settled() && crate::sys::reactor::fd_settled()
}

/// How many awaited waits are parked on an fd (a full socket, a pidfd, a pipe) in this
/// process.
#[cfg(feature = "async")]
pub fn parked_fd_waits() -> usize {
    crate::sys::reactor::fd_registrations()
}

/// Runs `f` while this process holds the lock of shelf `shelf` (0 or 1) of `queue`'s
/// block custody: a test makes a holder that stops (SIGSTOP) inside it. Built with the
/// `fuzzing` feature only.
#[cfg(feature = "fuzzing")]
pub fn while_custody_locked<T: serde::Serialize + serde::de::DeserializeOwned, R>(
    queue: &crate::queue::Queue<T>,
    shelf: usize,
    f: impl FnOnce() -> R,
) -> crate::error::Result<R> {
    queue.while_custody_locked(shelf, f)
}

/// Puts `item` on `queue`, running `pause` after its slot in the queue's ring is claimed
/// and before the record is written: a test makes a writer that stops (SIGSTOP) there.
/// Built with the `fuzzing` feature only.
#[cfg(feature = "fuzzing")]
pub fn put_pausing_in_ring<T: serde::Serialize + serde::de::DeserializeOwned>(
    queue: &crate::queue::SimpleQueue<T>,
    item: &T,
    pause: impl FnOnce(),
) -> crate::error::Result<()> {
    queue.put_pausing_in_ring(item, pause)
}

/// Gets one item from `queue`, running `pause` the first time a record has been copied
/// out of the queue's ring and before it is taken: a test makes a reader that stops
/// (SIGSTOP) there. Built with the `fuzzing` feature only.
#[cfg(feature = "fuzzing")]
pub fn get_pausing_in_ring<T: serde::Serialize + serde::de::DeserializeOwned>(
    queue: &crate::queue::SimpleQueue<T>,
    pause: impl FnOnce(),
) -> crate::error::Result<T> {
    queue.get_pausing_in_ring(pause)
}
