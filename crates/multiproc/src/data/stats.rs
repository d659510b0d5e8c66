//! [`LoaderStats`]: where an epoch's time went — the caller waiting for batches, the
//! workers loading and collating, the hand-over between them.

use std::time::Duration;

use super::worker::Timing;

/// Where the time of a loader's epoch went (the epoch running, or the last one run):
/// from [`DataLoader::stats`](super::DataLoader::stats) or
/// [`IterableDataLoader::stats`](super::IterableDataLoader::stats).
///
/// `waiting` against the epoch's wall time says whether the loader keeps up: a trainer
/// that waits little is not slowed by its data. The workers' times are sums over all
/// workers (with 4 workers, `loading` may be 4× the wall time), for the batches of the
/// epoch that reached the loader (prefetched ones included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoaderStats {
    /// The epoch.
    pub epoch: u64,
    /// Batches yielded so far.
    pub batches: usize,
    /// Time the caller spent in the epoch's `next`, waiting for batches and taking them
    /// in (with `num_workers(0)`, loading and collating them too).
    pub waiting: Duration,
    /// Time spent loading samples: `Dataset::get`, or an iterable data set's `next`.
    pub loading: Duration,
    /// Time spent collating samples into batches.
    pub collating: Duration,
    /// Time workers spent putting batches on the loader's queue (encoding and sending
    /// them: a batch's tensors travel as handles, so this stays small). A worker's
    /// report of it rides on its next batch, so each worker's last one of the epoch may
    /// be missing.
    pub hand_over: Duration,
}

impl LoaderStats {
    /// Zeroed stats for epoch `epoch`.
    pub(crate) fn new(epoch: u64) -> Self {
        LoaderStats {
            epoch,
            ..LoaderStats::default()
        }
    }

    /// Adds a worker's times for one batch.
    pub(crate) fn add(&mut self, t: &Timing) {
        self.loading += Duration::from_nanos(t.load_ns);
        self.collating += Duration::from_nanos(t.collate_ns);
        self.hand_over += Duration::from_nanos(t.previous_put_ns);
    }
}
