//! Where a loader stands, to resume it: [`LoaderState`] (what `state_dict` returns and
//! `load_state_dict` takes), [`StreamState`] (what an iterable data set reports of its
//! iterator), and the bookkeeping an epoch does per batch to keep them current.
//!
//! Invariants:
//!
//! - A state counts only batches *yielded* to the caller: batches loading or waiting
//!   in the loader are loaded again after a resume, so none is lost and none repeats.
//! - A map-style epoch's batches are numbered by their place in the epoch's batch plan
//!   (the sampler's indices from the epoch's start position, cut into batches); the
//!   yielded ones are a prefix plus, out of order, a few past it.
//! - An iterable epoch's state is each worker's cursor after the last batch of its
//!   own stream that was yielded (a worker's batches reach the caller in the order it
//!   made them, in order or not), plus the worker whose turn is next.
//! - Recording a yielded batch costs a counter increment, or a set insertion when it
//!   comes out of order; nothing is copied until `state_dict` is called.

use std::collections::BTreeSet;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The format version written into every [`LoaderState`].
const VERSION: u32 = 1;

/// Where a data loader stands in its epochs, to resume it exactly: from
/// [`DataLoader::state_dict`](super::DataLoader::state_dict) (or the iterable loader's),
/// taken back by `load_state_dict` on a loader built the same way — in this process or
/// in a later run (it is `Serialize`: save it beside the model's checkpoint).
///
/// After a resume, the loader yields exactly the batches the uninterrupted run would
/// have yielded from that point: the rest of the interrupted epoch, then the following
/// epochs. A state taken with `in_order(false)` lists the batches that came early;
/// they are not loaded again.
///
/// ```no_run
/// use multiproc::data::{DataLoader, Dataset, LoaderState};
///
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct Ramp(usize);
///
/// impl Dataset for Ramp {
///     type Item = i64;
///     fn len(&self) -> usize { self.0 }
///     fn get(&self, i: usize) -> multiproc::Result<i64> { Ok(i as i64) }
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     let build = || DataLoader::builder(Ramp(1000)).batch_size(10).shuffle(7).num_workers(2).build();
///     let mut loader = build()?;
///     let mut epoch = loader.iter();
///     for _ in 0..30 {
///         let _batch = epoch.next().transpose()?; // train on it
///     }
///     // Checkpoint: save the loader's state beside the model's.
///     let saved = serde_json::to_string(&epoch.state_dict()).unwrap();
///     drop(epoch);
///     drop(loader);
///
///     // Later, in another run: the same loader, the rest of the epoch.
///     let mut loader = build()?;
///     let state: LoaderState = serde_json::from_str(&saved).unwrap();
///     loader.load_state_dict(&state)?;
///     assert_eq!(loader.iter().count(), 70); // batches 30..100 of the same epoch
///     Ok(())
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    version: u32,
    /// The epoch in progress, or the next one when none is.
    epoch: u64,
    progress: Option<EpochState>,
}

/// How far an epoch went, by kind of loader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum EpochState {
    Map(MapState),
    Stream(StreamEpochState),
}

/// A map-style epoch in progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MapState {
    /// The global position the epoch's plan started from (0 unless it was itself
    /// resumed at another world size).
    pub start: usize,
    /// The global position reached by the yielded prefix (all ranks in lockstep).
    pub position: usize,
    /// Batches `0..prefix` of the plan were yielded.
    pub prefix: usize,
    /// Batches past the prefix yielded early (out of order).
    pub beyond: Vec<usize>,
    /// `(rank, world_size)` of the sampler, `(0, 1)` for an unsharded one.
    pub shard: (usize, usize),
    pub batch_size: usize,
    pub drop_last: bool,
    pub dataset_len: usize,
    /// A hash of the epoch's plan (its sample indices in order), to refuse resuming
    /// with a sampler that orders the epoch otherwise.
    pub fingerprint: u64,
    /// The sampler's [`global_order_hash`](super::Sampler::global_order_hash) of the
    /// epoch, to refuse a resume at another shard or batch size (where the plans
    /// differ) with a sampler that orders the epoch otherwise; 0 in a state saved
    /// before it was recorded (not checked).
    #[serde(default)]
    pub order: u64,
}

/// An iterable epoch in progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StreamEpochState {
    /// Each worker's stream (one for loading in this process).
    pub cursors: Vec<Cursor>,
    /// The worker whose batch comes next in order.
    pub next_worker: usize,
    pub batch_size: usize,
    pub drop_last: bool,
}

/// Where one worker's stream stands after its last yielded batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Cursor {
    /// No batch of it was yielded: it starts from the beginning.
    Start,
    /// After a batch, as the data set reported it.
    At(StreamState),
    /// After a batch, but the data set reports no state: it cannot be resumed.
    Unknown,
    /// The stream ended.
    Done,
}

impl LoaderState {
    /// A state at the start of epoch `epoch`.
    pub(crate) fn at_epoch(epoch: u64) -> Self {
        LoaderState {
            version: VERSION,
            epoch,
            progress: None,
        }
    }

    /// A state inside epoch `epoch`.
    pub(crate) fn within(epoch: u64, progress: EpochState) -> Self {
        LoaderState {
            version: VERSION,
            epoch,
            progress: Some(progress),
        }
    }

    /// The epoch in progress, or the next one when the last ended.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether the state is inside an epoch (some of its batches were yielded).
    pub fn is_mid_epoch(&self) -> bool {
        self.progress.is_some()
    }

    /// For a map-style loader mid-epoch: the global position its yielded batches reach,
    /// counted over all ranks (ranks advance in lockstep) — where a loader resumed at
    /// another world size continues. `None` between epochs or for an iterable loader.
    pub fn position(&self) -> Option<usize> {
        match &self.progress {
            Some(EpochState::Map(m)) => Some(m.position),
            _ => None,
        }
    }

    /// The epoch's progress, once the version is checked.
    pub(crate) fn checked(&self) -> Result<Option<&EpochState>> {
        if self.version != VERSION {
            return Err(Error::InvalidArgument(format!(
                "data loader state: format version {} is not this build's ({VERSION}): \
                 resume with the multiproc version that saved it",
                self.version
            )));
        }
        Ok(self.progress.as_ref())
    }
}

/// Where an iterable data set's iterator stands, as the data set reports it
/// ([`IterableDataset::state`](super::IterableDataset::state)) and resumes from
/// ([`IterableDataset::iter_from`](super::IterableDataset::iter_from)): any
/// serializable value (a position, a shard and an offset, a generator's state),
/// kept as JSON text.
///
/// ```
/// use multiproc::data::StreamState;
///
/// let s = StreamState::new(&(3usize, 1024u64)).unwrap();
/// assert_eq!(s.get::<(usize, u64)>().unwrap(), (3, 1024));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamState(String);

impl StreamState {
    /// The state `value`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `value` cannot be written as JSON (a map with
    /// non-string keys, a tensor: keep positions, not data).
    pub fn new<T: Serialize>(value: &T) -> Result<Self> {
        serde_json::to_string(value).map(StreamState).map_err(|e| {
            Error::InvalidArgument(format!(
                "an iterable data set's state cannot be written as JSON ({e}): report \
                 plain positions (numbers, strings, vectors, structs of them)"
            ))
        })
    }

    /// The value back.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the state is not a `T` (a state saved by another
    /// data set or another version of it).
    pub fn get<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_str(&self.0).map_err(|e| {
            Error::InvalidArgument(format!(
                "an iterable data set's state {:?} does not read as {} ({e}): was it saved \
                 by another data set?",
                self.0,
                std::any::type_name::<T>()
            ))
        })
    }
}

/// The yielded batches of a map-style epoch: a prefix and those past it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Done {
    pub prefix: usize,
    pub beyond: BTreeSet<usize>,
}

impl Done {
    /// Records batch `batch` as yielded.
    pub(crate) fn mark(&mut self, batch: usize) {
        if batch == self.prefix {
            self.prefix += 1;
            while self.beyond.remove(&self.prefix) {
                self.prefix += 1;
            }
        } else if batch > self.prefix {
            self.beyond.insert(batch);
        }
    }

    /// Whether batch `batch` was yielded.
    pub(crate) fn contains(&self, batch: usize) -> bool {
        batch < self.prefix || self.beyond.contains(&batch)
    }
}

/// A map-style loader's record of the epoch it runs (or ran last).
#[derive(Clone, Debug)]
pub(crate) struct MapProgress {
    pub epoch: u64,
    /// The global position the plan starts from.
    pub start: usize,
    /// Batches in the epoch's plan.
    pub batches: usize,
    /// Samples in the plan: the first `k` batches hold `min(k × batch_size, samples)`
    /// (only the last batch can be short).
    pub samples: usize,
    /// The batches yielded.
    pub done: Done,
    /// [`fingerprint`] of the plan.
    pub fingerprint: u64,
    /// The sampler's global order hash of the epoch (see `MapState::order`).
    pub order: u64,
}

/// A hash of a sequence of sample indices.
pub(crate) fn order_hash(order: &[usize]) -> u64 {
    fnv1a(order.iter().copied())
}

/// A hash of an epoch's plan: its sample indices in order, and where batches end.
pub(crate) fn fingerprint(plan: &[Vec<usize>]) -> u64 {
    // The indices, with a marker after each batch.
    fnv1a(
        plan.iter()
            .flat_map(|batch| batch.iter().copied().chain(std::iter::once(usize::MAX))),
    )
}

/// FNV-1a over `items`.
fn fnv1a(items: impl Iterator<Item = usize>) -> u64 {
    items.fold(0xcbf2_9ce4_8422_2325, |h: u64, i| {
        (h ^ i as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A seed for worker `worker` of rank `rank` in epoch `epoch`, from the loader's base
/// seed: what [`WorkerInfo::seed`](super::WorkerInfo::seed) is.
///
/// Each of the four is mixed in turn by splitmix64's finaliser, so the seeds of
/// different (epoch, rank, worker) triples are unrelated 64-bit values: two workers
/// share a seed only by a 2⁻⁶⁴ accident, and a run repeats for the same base seed.
pub fn worker_seed(base: u64, epoch: u64, rank: usize, worker: usize) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let h = mix(base);
    let h = mix(h ^ epoch);
    let h = mix(h ^ rank as u64);
    mix(h ^ worker as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_batches_are_a_prefix_and_the_early_ones() {
        let mut d = Done::default();
        for b in [0, 2, 3, 1, 5] {
            d.mark(b);
        }
        assert_eq!(d.prefix, 4);
        assert_eq!(d.beyond.iter().copied().collect::<Vec<_>>(), [5]);
        assert!(d.contains(3) && d.contains(5) && !d.contains(4));
    }

    #[test]
    fn worker_seeds_differ_for_every_epoch_rank_and_worker() {
        let mut seen = BTreeSet::new();
        for epoch in 0..8 {
            for rank in 0..8 {
                for worker in 0..16 {
                    assert!(seen.insert(worker_seed(7, epoch, rank, worker)));
                }
            }
        }
        assert_eq!(worker_seed(7, 1, 2, 3), worker_seed(7, 1, 2, 3));
        assert_ne!(worker_seed(7, 1, 2, 3), worker_seed(8, 1, 2, 3));
    }

    #[test]
    fn a_state_of_another_version_is_refused() {
        let mut s = LoaderState::at_epoch(3);
        assert!(s.checked().is_ok());
        s.version = 99;
        let e = s.checked().unwrap_err().to_string();
        assert!(e.contains("version 99"), "{e}");
    }
}
