//! `multiproc::data`, v2: the epoch reaches the data set in persistent workers, and
//! every worker has its own seed from the base seed, the epoch, the rank and its id —
//! across real worker processes (and threads). Resume is tests/data_state.rs.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;

use common::secs;
use multiproc::Error;
use multiproc::data::{DataLoader, Dataset, DistributedSampler, worker_info, worker_seed};
use serde::{Deserialize, Serialize};

/// Sample `i` is `(i, the epoch this copy of the data set was told)`.
#[derive(Clone, Serialize, Deserialize)]
struct Told {
    n: usize,
    epoch: Option<u64>,
}

impl Dataset for Told {
    type Item = (i64, i64);

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> multiproc::Result<(i64, i64)> {
        Ok((i as i64, self.epoch.map_or(-1, |e| e as i64)))
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.epoch = Some(epoch);
    }
}

fn told_epoch(loader: &mut DataLoader<Told>) -> (Vec<i64>, Vec<i64>) {
    let mut indices = Vec::new();
    let mut epochs = Vec::new();
    for b in loader.iter() {
        let (i, e) = b.expect("batch");
        indices.extend(i.to_vec::<i64>().unwrap());
        epochs.extend(e.to_vec::<i64>().unwrap());
    }
    (indices, epochs)
}

fn told_loader(persistent: bool) -> DataLoader<Told> {
    DataLoader::builder(Told { n: 24, epoch: None })
        .batch_size(4)
        .shuffle(3)
        .num_workers(2)
        .persistent_workers(persistent)
        .build()
        .unwrap()
}

#[test]
fn epochs_reach_the_data_set_in_persistent_workers() {
    common::run(secs(120), || {
        let mut persistent = told_loader(true);
        let mut orders = Vec::new();
        let mut pids = None;
        for e in 0..3 {
            let (order, told) = told_epoch(&mut persistent);
            assert!(
                told.iter().all(|&t| t == e),
                "epoch {e}: the workers were told {told:?}"
            );
            let now = persistent.worker_pids();
            assert_eq!(*pids.get_or_insert(now.clone()), now, "the workers persist");
            let mut fresh = told_loader(false);
            fresh.set_epoch(e as u64);
            assert_eq!(told_epoch(&mut fresh), (order.clone(), told), "epoch {e}");
            orders.push(order);
        }
        assert!(orders[0] != orders[1] && orders[1] != orders[2] && orders[0] != orders[2]);
        // Set back: the persistent workers follow.
        persistent.set_epoch(1);
        let (order, told) = told_epoch(&mut persistent);
        assert_eq!(order, orders[1]);
        assert!(told.iter().all(|&t| t == 1), "{told:?}");
    });
}

/// Sample `i` is `(i, the seed of the worker loading it, its id)`.
#[derive(Clone, Serialize, Deserialize)]
struct Seeds(usize);

impl Dataset for Seeds {
    type Item = (i64, i64, i64);

    fn len(&self) -> usize {
        self.0
    }

    fn get(&self, i: usize) -> multiproc::Result<(i64, i64, i64)> {
        let w = worker_info().ok_or_else(|| Error::InvalidArgument("not in a worker".into()))?;
        Ok((i as i64, w.seed as i64, w.id as i64))
    }
}

#[test]
fn every_worker_has_its_own_seed_from_base_epoch_rank_and_id() {
    common::run(secs(120), || {
        let (base, rank, workers) = (77, 3, 4);
        let mut loader = DataLoader::builder(Seeds(32))
            .num_workers(workers)
            .persistent_workers(true)
            .seed(base)
            .rank(rank)
            .build()
            .unwrap();
        let mut seen = BTreeSet::new();
        for epoch in 0..2u64 {
            let mut ids = BTreeSet::new();
            for b in loader.iter() {
                let (_, seed, id) = b.expect("batch");
                let (seed, id) = (
                    seed.to_vec::<i64>().unwrap()[0],
                    id.to_vec::<i64>().unwrap()[0],
                );
                assert_eq!(seed as u64, worker_seed(base, epoch, rank, id as usize));
                ids.insert(id);
                seen.insert((seed, epoch, id));
            }
            assert_eq!(ids.len(), workers, "every worker loaded a batch");
        }
        let seeds: BTreeSet<i64> = seen.iter().map(|s| s.0).collect();
        assert_eq!(
            seeds.len(),
            2 * workers,
            "no two workers or epochs share a seed: {seen:?}"
        );
        // The rank comes from a distributed sampler too.
        let mut ranked = DataLoader::builder(Seeds(8))
            .sampler(DistributedSampler::new(8, 1, 2).unwrap())
            .num_workers(1)
            .seed(base)
            .build()
            .unwrap();
        let (_, seed, _) = ranked.iter().next().unwrap().unwrap();
        assert_eq!(
            seed.to_vec::<i64>().unwrap()[0] as u64,
            worker_seed(base, 0, 1, 0)
        );
    });
}
