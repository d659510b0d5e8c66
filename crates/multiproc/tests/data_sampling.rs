//! `multiproc::data`: sampling across real worker processes — shuffling by seed and
//! epoch, distributed shards (and their rank and world size from the environment), a
//! sampler outside the data set.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;

use common::data::*;
use common::secs;
use multiproc::Process;
use multiproc::data::{DataLoader, DistributedSampler, RandomSampler, Sampler};

#[test]
fn shuffle_repeats_for_a_seed_and_epoch_and_changes_with_the_epoch() {
    common::run(secs(60), || {
        let epochs = |workers: usize| -> Vec<Vec<i64>> {
            let mut loader = DataLoader::builder(Samples::new(30))
                .batch_size(4)
                .shuffle(1234)
                .num_workers(workers)
                .build()
                .unwrap();
            (0..2)
                .map(|_| labels_of_epoch(&mut loader).concat())
                .collect()
        };
        let in_process = epochs(0);
        let with_workers = epochs(2);
        assert_eq!(in_process, with_workers, "same seed and epoch, same order");
        assert_ne!(in_process[0], in_process[1], "another epoch, another order");
        for order in &in_process {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(
                sorted,
                (0..30).collect::<Vec<_>>(),
                "each epoch is a permutation"
            );
        }
        assert_ne!(in_process[0], (0..30).collect::<Vec<_>>(), "it is shuffled");
        // set_epoch replays an epoch.
        let mut loader = DataLoader::builder(Samples::new(30))
            .batch_size(4)
            .shuffle(1234)
            .build()
            .unwrap();
        loader.set_epoch(1);
        assert_eq!(labels_of_epoch(&mut loader).concat(), in_process[1]);
    });
}

#[test]
fn distributed_shards_are_disjoint_and_cover_the_data_set() {
    common::run(secs(60), || {
        let (n, world) = (10usize, 3usize);
        for drop_last in [false, true] {
            let shards: Vec<Vec<i64>> = (0..world)
                .map(|rank| {
                    let sampler = DistributedSampler::new(n, rank, world)
                        .unwrap()
                        .shuffle(99)
                        .drop_last(drop_last);
                    let mut loader = DataLoader::builder(Samples::new(n))
                        .sampler(sampler)
                        .batch_size(2)
                        .num_workers(1)
                        .build()
                        .unwrap();
                    labels_of_epoch(&mut loader).concat()
                })
                .collect();
            let per_rank = if drop_last { 3 } else { 4 };
            assert!(shards.iter().all(|s| s.len() == per_rank), "{shards:?}");
            let all: Vec<i64> = shards.concat();
            let distinct: BTreeSet<i64> = all.iter().copied().collect();
            if drop_last {
                assert_eq!(distinct.len(), 9, "disjoint: {shards:?}");
            } else {
                assert_eq!(
                    distinct,
                    (0..10).collect(),
                    "they cover the data set: {shards:?}"
                );
                assert_eq!(all.len(), 12, "two padding samples: {shards:?}");
            }
        }
    });
}

fn sampler_from_env(rank: usize, world: usize) -> Result<(), String> {
    let s = DistributedSampler::from_env(10).map_err(|e| e.to_string())?;
    if (s.rank(), s.world_size(), s.len()) != (rank, world, 4) {
        return Err(format!(
            "rank {} of {} ({} samples)",
            s.rank(),
            s.world_size(),
            s.len()
        ));
    }
    Ok(())
}

fn sampler_from_env_without_world_size(_rank: usize, _: ()) -> Result<(), String> {
    match DistributedSampler::from_env(10) {
        Ok(_) => Err("from_env succeeded without WORLD_SIZE".into()),
        Err(e) if e.to_string().contains("WORLD_SIZE is not set") => Ok(()),
        Err(e) => Err(format!("unexpected error: {e}")),
    }
}

#[test]
fn distributed_sampler_reads_rank_and_world_size_from_the_environment() {
    common::run(secs(60), || {
        multiproc::spawn(sampler_from_env, 3usize, 3).unwrap();
        // A lone Process gets RANK but no WORLD_SIZE: a clear error, not a guess.
        let mut p = Process::builder(sampler_from_env_without_world_size, 0, ())
            .start()
            .unwrap();
        let status = p.join().unwrap();
        assert!(status.success(), "{:?}", p.error());
    });
}

#[test]
fn a_sampler_outside_the_data_set_is_a_clear_error() {
    common::run(secs(30), || {
        let mut loader = DataLoader::builder(Samples::new(5))
            .sampler(RandomSampler::new(8, 1))
            .num_workers(1)
            .build()
            .unwrap();
        let err = loader
            .iter()
            .find_map(Result::err)
            .expect("an out-of-range index is an error");
        assert!(err.to_string().contains("has 5 samples"), "{err}");
        assert!(
            DataLoader::builder(Samples::new(5))
                .batch_size(0)
                .build()
                .is_err()
        );
    });
}
