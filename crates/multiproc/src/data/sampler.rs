//! Samplers: which data set indices an epoch visits, in which order.
//!
//! A [`Sampler`] runs in the loader's own process only (workers get the indices of
//! their batches), so it needs no serde. Every random sampler is a pure function of its
//! seed and the epoch number: the same seed and epoch give the same order in every run
//! and on every rank, and another epoch gives another order (torch's
//! `DistributedSampler.set_epoch` contract, applied to all of them).

use crate::error::{Error, Result};

/// Which indices an epoch visits, in order.
///
/// Implement it for a custom order; the loader checks every index against the data
/// set's length before sending it to a worker.
pub trait Sampler: Send {
    /// How many indices [`indices`](Self::indices) returns per epoch.
    fn len(&self) -> usize;

    /// Whether an epoch visits no index at all.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The indices of epoch `epoch` (0, 1, …), in the order they are loaded.
    fn indices(&self, epoch: u64) -> Vec<usize>;

    /// This process's indices of epoch `epoch` once the first `start` positions of the
    /// epoch's *global* order are consumed (by every rank together): what an epoch
    /// resumed from a [`LoaderState`](super::LoaderState) taken at another world size
    /// visits.
    ///
    /// The default suits a sampler that is the only one of its epoch (no ranks): its
    /// order is the global order, and the remainder is `indices(epoch)` without its
    /// first `start`. A sharding sampler ([`DistributedSampler`]) shards the remainder.
    fn indices_from(&self, epoch: u64, start: usize) -> Vec<usize> {
        let mut all = self.indices(epoch);
        all.drain(..start.min(all.len()));
        all
    }

    /// The global position reached when this process has taken the first `taken`
    /// indices of `indices_from(epoch, start)` and every other rank as many of its own
    /// (ranks advance in lockstep, as data-parallel training does). Default:
    /// `start + taken`; a sharding sampler: `start + taken × world_size`, at most the
    /// data set's length.
    fn position_after(&self, start: usize, taken: usize) -> usize {
        start + taken
    }

    /// `(rank, world_size)` of a sampler that takes one rank's share of a global order;
    /// `None` (the default) for one that is the whole order.
    fn shard(&self) -> Option<(usize, usize)> {
        None
    }

    /// A hash of epoch `epoch`'s global order (every rank's indices together, before
    /// sharding): a resume at another shard or batch size checks it, so that a state is
    /// not carried over to a sampler that orders the epoch otherwise (another seed),
    /// which would repeat some samples and skip others. Default: the hash of
    /// `indices(epoch)`, the whole order of a sampler without ranks; a sharding sampler
    /// hashes the order it shards.
    fn global_order_hash(&self, epoch: u64) -> u64 {
        super::state::order_hash(&self.indices(epoch))
    }
}

/// `0, 1, …, len - 1`, every epoch (torch's `SequentialSampler`).
#[derive(Clone, Debug)]
pub struct SequentialSampler {
    len: usize,
}

impl SequentialSampler {
    /// A sampler over `0..len`.
    pub fn new(len: usize) -> Self {
        Self { len }
    }
}

impl Sampler for SequentialSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn indices(&self, _epoch: u64) -> Vec<usize> {
        (0..self.len).collect()
    }
}

/// A permutation of `0..len` that depends only on the seed and the epoch (torch's
/// `RandomSampler` with a seeded generator).
#[derive(Clone, Debug)]
pub struct RandomSampler {
    len: usize,
    seed: u64,
}

impl RandomSampler {
    /// A shuffling sampler over `0..len`.
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed }
    }
}

impl Sampler for RandomSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        permutation(self.len, self.seed, epoch)
    }
}

/// Draws `num_samples` indices with probability proportional to their weights
/// (torch's `WeightedRandomSampler`), deterministically for a seed and epoch.
#[derive(Clone, Debug)]
pub struct WeightedRandomSampler {
    /// Running sums of the weights (for drawing with replacement by bisection).
    cumulative: Vec<f64>,
    weights: Vec<f64>,
    num_samples: usize,
    replacement: bool,
    seed: u64,
}

impl WeightedRandomSampler {
    /// A sampler drawing `num_samples` of the indices `0..weights.len()`; with
    /// `replacement` an index may come more than once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a negative or non-finite weight, weights that sum
    /// to zero, or (without replacement) more samples than indices of positive weight.
    pub fn new(
        weights: Vec<f64>,
        num_samples: usize,
        replacement: bool,
        seed: u64,
    ) -> Result<Self> {
        if let Some((i, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !w.is_finite() || **w < 0.0)
        {
            return Err(Error::InvalidArgument(format!(
                "weight {i} of the weighted sampler is {w}: weights must be finite and non-negative"
            )));
        }
        let positive = weights.iter().filter(|w| **w > 0.0).count();
        if positive == 0 {
            return Err(Error::InvalidArgument(format!(
                "the weighted sampler's {} weights sum to zero: give at least one a positive weight",
                weights.len()
            )));
        }
        if !replacement && num_samples > positive {
            return Err(Error::InvalidArgument(format!(
                "cannot draw {num_samples} samples without replacement from {positive} indices \
                 of positive weight: draw fewer, or pass replacement = true"
            )));
        }
        // Relative to the largest: the same draws, and sums that stay finite however
        // large the weights (three of f64::MAX would sum to infinity).
        let top = weights.iter().copied().fold(0.0, f64::max);
        let weights: Vec<f64> = weights.iter().map(|w| w / top).collect();
        let cumulative = weights
            .iter()
            .scan(0.0, |sum, w| {
                *sum += w;
                Some(*sum)
            })
            .collect();
        Ok(Self {
            cumulative,
            weights,
            num_samples,
            replacement,
            seed,
        })
    }
}

impl Sampler for WeightedRandomSampler {
    fn len(&self) -> usize {
        self.num_samples
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut rng = SplitMix::for_epoch(self.seed, epoch);
        if self.replacement {
            let total = *self.cumulative.last().unwrap_or(&0.0);
            (0..self.num_samples)
                .map(|_| {
                    let x = rng.unit() * total;
                    // The first running sum above x; zero-weight indices are never hit.
                    self.cumulative
                        .partition_point(|&c| c <= x)
                        .min(self.weights.len() - 1)
                })
                .collect()
        } else {
            // Efraimidis–Spirakis: key = -ln(u) / w, smallest keys first.
            let mut keyed: Vec<(f64, usize)> = self
                .weights
                .iter()
                .enumerate()
                .filter(|(_, w)| **w > 0.0)
                .map(|(i, w)| (-(1.0 - rng.unit()).ln() / w, i))
                .collect();
            keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
            keyed.truncate(self.num_samples);
            keyed.into_iter().map(|(_, i)| i).collect()
        }
    }
}

/// One rank's share of the data set, like torch's `DistributedSampler`: every rank
/// gets `ceil(len / world_size)` indices (padded by repeating the first ones), or with
/// `drop_last` `floor(len / world_size)` (the tail dropped); the shards of all ranks are
/// disjoint (except for the padding) and together cover the data set.
///
/// With [`shuffle`](Self::shuffle) the whole index list is permuted by seed and epoch
/// first, identically on every rank, so the shards stay disjoint.
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    len: usize,
    rank: usize,
    world_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
}

impl DistributedSampler {
    /// Rank `rank`'s shard of `0..len` among `world_size` ranks, in order, padded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `world_size` is 0 or `rank >= world_size`.
    pub fn new(len: usize, rank: usize, world_size: usize) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "distributed sampler: rank {rank} is not in 0..{world_size} (world size {world_size})"
            )));
        }
        Ok(Self {
            len,
            rank,
            world_size,
            shuffle: None,
            drop_last: false,
        })
    }

    /// This process's shard, with the rank and world size read from the environment
    /// (`RANK` and `WORLD_SIZE`, as torchrun and [`spawn`](crate::spawn) set them).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a variable is missing or not a number, with its
    /// value; as [`new`](Self::new).
    pub fn from_env(len: usize) -> Result<Self> {
        let (rank, world_size) = rank_and_world_size()?;
        Self::new(len, rank, world_size)
    }

    /// Permute the whole data set by `seed` and the epoch before sharding.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Drop the tail that does not divide evenly instead of padding (default: pad).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
}

impl Sampler for DistributedSampler {
    fn len(&self) -> usize {
        if self.drop_last {
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    fn indices(&self, epoch: u64) -> Vec<usize> {
        self.indices_from(epoch, 0)
    }

    /// The global order (the data set's indices, permuted by seed and epoch when
    /// shuffling: the same whatever the world size) from position `start` on, padded
    /// to a multiple of the world size by repeating the order from its beginning (or cut
    /// to one, with `drop_last`), then every `world_size`-th from `rank`. From `start`
    /// 0 this is torch's `DistributedSampler`.
    fn indices_from(&self, epoch: u64, start: usize) -> Vec<usize> {
        let global = match self.shuffle {
            Some(seed) => permutation(self.len, seed, epoch),
            None => (0..self.len).collect(),
        };
        let start = start.min(global.len());
        let left = global.len() - start;
        let total = if self.drop_last {
            left / self.world_size * self.world_size
        } else {
            left.div_ceil(self.world_size) * self.world_size
        };
        let mut rest: Vec<usize> = global[start..].to_vec();
        if rest.len() >= total {
            rest.truncate(total);
        } else if !global.is_empty() {
            // Pad by repeating the order from its start (torch repeats the list as
            // often as needed).
            let mut k = 0;
            while rest.len() < total {
                rest.push(global[k % global.len()]);
                k += 1;
            }
        }
        rest.into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }

    fn position_after(&self, start: usize, taken: usize) -> usize {
        start
            .saturating_add(taken.saturating_mul(self.world_size))
            .min(self.len.max(start))
    }

    fn shard(&self) -> Option<(usize, usize)> {
        Some((self.rank, self.world_size))
    }

    fn global_order_hash(&self, epoch: u64) -> u64 {
        match self.shuffle {
            Some(seed) => super::state::order_hash(&permutation(self.len, seed, epoch)),
            None => super::state::order_hash(&(0..self.len).collect::<Vec<_>>()),
        }
    }
}

/// The rank and world size from `RANK` and `WORLD_SIZE`.
///
/// This is the one place the environment contract is read, so that it can follow the
/// crate's launcher detection in one edit.
fn rank_and_world_size() -> Result<(usize, usize)> {
    let read = |name: &str| -> Result<usize> {
        let value = std::env::var(name).map_err(|_| {
            Error::InvalidArgument(format!(
                "distributed sampler: {name} is not set: launch with torchrun, srun or \
                 multiproc::spawn, or use DistributedSampler::new(len, rank, world_size)"
            ))
        })?;
        value.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!(
                "distributed sampler: {name}={value:?} is not a non-negative integer"
            ))
        })
    };
    Ok((read("RANK")?, read("WORLD_SIZE")?))
}

/// A permutation of `0..n` from the seed and epoch (Fisher–Yates).
pub(crate) fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = SplitMix::for_epoch(seed, epoch);
    let mut out: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        out.swap(i, j);
    }
    out
}

/// splitmix64: small, fast and good enough to order samples; not for cryptography.
pub(crate) struct SplitMix(u64);

impl SplitMix {
    /// A generator for one (seed, epoch) pair; different epochs give unrelated streams.
    pub(crate) fn for_epoch(seed: u64, epoch: u64) -> Self {
        let mut mix = SplitMix(seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let start = mix.next_u64();
        SplitMix(start)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), without modulo bias worth speaking of (Lemire).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_permutation_and_depends_on_seed_and_epoch() {
        let p = permutation(100, 7, 0);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(p, permutation(100, 7, 0));
        assert_ne!(p, permutation(100, 7, 1));
        assert_ne!(p, permutation(100, 8, 0));
    }

    #[test]
    fn weighted_sampler_never_draws_zero_weights() {
        let s = WeightedRandomSampler::new(vec![0.0, 1.0, 0.0, 3.0], 1000, true, 1).unwrap();
        let drawn = s.indices(0);
        assert_eq!(drawn.len(), 1000);
        assert!(drawn.iter().all(|&i| i == 1 || i == 3));
        let threes = drawn.iter().filter(|&&i| i == 3).count();
        assert!(
            (600..900).contains(&threes),
            "{threes} of 1000 drew weight 3 of 4"
        );
        let once = WeightedRandomSampler::new(vec![1.0, 2.0, 0.0, 4.0], 3, false, 1).unwrap();
        let mut drawn = once.indices(5);
        drawn.sort_unstable();
        assert_eq!(drawn, [0, 1, 3]);
        let err = WeightedRandomSampler::new(vec![1.0, 0.0], 2, false, 1).unwrap_err();
        assert!(err.to_string().contains("without replacement"), "{err}");
        assert!(WeightedRandomSampler::new(vec![-1.0], 1, true, 1).is_err());
        // Weights whose sum passes f64::MAX draw as equal ones do.
        let huge = WeightedRandomSampler::new(vec![f64::MAX; 3], 3000, true, 1).unwrap();
        let drawn = huge.indices(0);
        for i in 0..3 {
            let n = drawn.iter().filter(|&&d| d == i).count();
            assert!(
                (800..1200).contains(&n),
                "index {i} drawn {n} times of 3000"
            );
        }
    }

    #[test]
    fn distributed_sampler_pads_like_torch() {
        // torch: len 10, world 4 -> 3 per rank, indices padded with 0, 1.
        let shards: Vec<Vec<usize>> = (0..4)
            .map(|r| DistributedSampler::new(10, r, 4).unwrap().indices(0))
            .collect();
        assert_eq!(
            shards,
            [vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]
        );
        let dropped: Vec<Vec<usize>> = (0..4)
            .map(|r| {
                DistributedSampler::new(10, r, 4)
                    .unwrap()
                    .drop_last(true)
                    .indices(0)
            })
            .collect();
        assert_eq!(dropped, [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert!(DistributedSampler::new(10, 4, 4).is_err());
    }

    #[test]
    fn the_global_order_is_the_same_at_every_world_size() {
        let global = permutation(24, 9, 3);
        for world in 1..=4 {
            let shards: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    DistributedSampler::new(24, r, world)
                        .unwrap()
                        .shuffle(9)
                        .indices(3)
                })
                .collect();
            // Interleaving the shards back gives the one global order.
            let woven: Vec<usize> = (0..24).map(|p| shards[p % world][p / world]).collect();
            assert_eq!(woven, global, "world size {world}");
        }
        assert_eq!(RandomSampler::new(24, 9).indices(3), global);
    }

    #[test]
    fn a_shard_resumed_at_its_own_position_continues_where_it_was() {
        // Two ranks took 3 samples each: position 6. Each rank's remainder from there is
        // the tail of its shard, padding included.
        for rank in 0..2 {
            let s = DistributedSampler::new(11, rank, 2).unwrap().shuffle(4);
            let whole = s.indices(1);
            let pos = s.position_after(0, 3);
            assert_eq!(pos, 6);
            assert_eq!(s.indices_from(1, pos), whole[3..], "rank {rank}");
        }
        // Three ranks from position 6 share the 5 samples left (one padded).
        let tails: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                DistributedSampler::new(11, r, 3)
                    .unwrap()
                    .shuffle(4)
                    .indices_from(1, 6)
            })
            .collect();
        assert_eq!(tails.concat().len(), 6, "5 left, padded to 6: {tails:?}");
        let global = permutation(11, 4, 1);
        let mut want = global[6..].to_vec();
        want.sort_unstable();
        let mut got: Vec<usize> = tails.iter().flat_map(|t| t.iter().copied()).collect();
        got.sort_unstable();
        got.dedup();
        assert!(want.iter().all(|i| got.contains(i)), "{tails:?}");
        assert_eq!(
            DistributedSampler::new(11, 0, 3)
                .unwrap()
                .position_after(9, 5),
            11
        );
    }
}
