//! `multiproc::data`, v2: exact mid-epoch resume (`state_dict` / `load_state_dict`) for
//! map-style and iterable data sets, on fresh and on persistent workers, elastic resume
//! at another world size, states that do not fit — across real worker processes (and
//! threads). Epochs reaching persistent workers and per-worker seeds are
//! tests/data_epochs.rs.

multiproc::test_init!();

mod common;

use common::secs;
use multiproc::Tensor;
use multiproc::data::{
    DataLoader, DataLoaderBuilder, Dataset, DistributedSampler, IterableDataset, LoaderState,
    StreamState, WorkerKind, worker_info,
};
use serde::{Deserialize, Serialize};

/// Epochs each resume scenario runs through (the interruptions cross their boundary).
const EPOCHS: u64 = 2;

/// Sample `i` of epoch `e` is `1000 e + i`: the epoch the data set was told shows.
#[derive(Clone, Serialize, Deserialize)]
struct Ramp {
    n: usize,
    epoch: u64,
}

impl Dataset for Ramp {
    type Item = i64;

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> multiproc::Result<i64> {
        Ok(1000 * self.epoch as i64 + i as i64)
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }
}

fn values(batch: multiproc::Result<Tensor>) -> Vec<i64> {
    batch.expect("batch").to_vec::<i64>().unwrap()
}

/// How one scenario's loader is built.
#[derive(Clone, Copy, Debug)]
struct Setup {
    workers: usize,
    in_order: bool,
    shuffle: bool,
    kind: WorkerKind,
}

fn ramp_loader(s: Setup) -> DataLoader<Ramp> {
    let b = DataLoader::builder(Ramp { n: 45, epoch: 0 })
        .batch_size(2)
        .num_workers(s.workers)
        .workers(s.kind)
        .in_order(s.in_order);
    let b = if s.shuffle { b.shuffle(5) } else { b };
    b.build().unwrap()
}

/// Per epoch, the batches an uninterrupted loader yields.
fn uninterrupted(s: Setup) -> Vec<Vec<Vec<i64>>> {
    let mut loader = ramp_loader(s);
    (0..EPOCHS)
        .map(|_| loader.iter().map(values).collect())
        .collect()
}

/// Per epoch, the batches of a run stopped after every `every` batches: the state is
/// saved as JSON, the loader and its workers dropped, and a fresh loader resumes.
fn interrupted(s: Setup, every: usize) -> Vec<Vec<Vec<i64>>> {
    let mut out = vec![Vec::new(); EPOCHS as usize];
    let mut saved: Option<String> = None;
    let mut restarts = 0;
    loop {
        let mut loader = ramp_loader(s);
        if let Some(json) = &saved {
            let state: LoaderState = serde_json::from_str(json).unwrap();
            loader.load_state_dict(&state).unwrap();
            restarts += 1;
        }
        let mut taken = 0;
        loop {
            let mut epoch = loader.iter();
            let e = epoch.epoch();
            if e >= EPOCHS {
                assert!(restarts >= 5, "{s:?}: only {restarts} restarts");
                return out;
            }
            while taken < every {
                let Some(b) = epoch.next() else { break };
                out[e as usize].push(values(b));
                taken += 1;
            }
            if taken == every {
                saved = Some(serde_json::to_string(&epoch.state_dict()).unwrap());
                break;
            }
        }
    }
}

/// The batches of one epoch in a canonical order (for runs out of order).
fn sorted(mut batches: Vec<Vec<i64>>) -> Vec<Vec<i64>> {
    batches.sort();
    batches
}

#[test]
fn a_map_style_loader_resumed_every_7th_batch_yields_the_uninterrupted_batches() {
    common::run(secs(240), || {
        let kinds = [
            (0, WorkerKind::Process),
            (1, WorkerKind::Process),
            (4, WorkerKind::Process),
            (4, WorkerKind::Thread),
        ];
        for (workers, kind) in kinds {
            for shuffle in [false, true] {
                for in_order in [true, false] {
                    let s = Setup {
                        workers,
                        in_order,
                        shuffle,
                        kind,
                    };
                    let want = uninterrupted(s);
                    let got = interrupted(s, 7);
                    for e in 0..EPOCHS as usize {
                        assert!(want[e].iter().flatten().all(|v| v / 1000 == e as i64));
                        if in_order || workers == 0 {
                            assert_eq!(got[e], want[e], "{s:?}, epoch {e}");
                        } else {
                            // As they finish: the same batches, each once.
                            assert_eq!(sorted(got[e].clone()), sorted(want[e].clone()), "{s:?}");
                        }
                    }
                }
            }
        }
    });
}

/// Worker k of m streams `k, k + m, …` below `n`, plus `1000 × epoch`; its state is
/// the next value to give.
#[derive(Clone, Serialize, Deserialize)]
struct Stream {
    n: usize,
}

struct StreamIter {
    next: usize,
    step: usize,
    n: usize,
    epoch: u64,
}

impl Iterator for StreamIter {
    type Item = multiproc::Result<i64>;

    fn next(&mut self) -> Option<Self::Item> {
        (self.next < self.n).then(|| {
            let v = self.next;
            self.next += self.step;
            Ok(1000 * self.epoch as i64 + v as i64)
        })
    }
}

impl Stream {
    fn from(&self, epoch: u64, next: Option<usize>) -> StreamIter {
        let (k, m) = worker_info().map_or((0, 1), |w| (w.id, w.num_workers));
        StreamIter {
            next: next.unwrap_or(k),
            step: m,
            n: self.n,
            epoch,
        }
    }
}

impl IterableDataset for Stream {
    type Item = i64;
    type Iter = StreamIter;

    fn iter(&self, epoch: u64) -> StreamIter {
        self.from(epoch, None)
    }

    fn state(&self, iter: &StreamIter) -> Option<StreamState> {
        StreamState::new(&iter.next).ok()
    }

    fn iter_from(&self, epoch: u64, state: &StreamState) -> multiproc::Result<StreamIter> {
        Ok(self.from(epoch, Some(state.get()?)))
    }
}

fn stream_loader(
    s: Setup,
) -> multiproc::data::IterableDataLoader<Stream, multiproc::data::DefaultCollate> {
    DataLoaderBuilder::new(Stream { n: 41 })
        .batch_size(2)
        .num_workers(s.workers)
        .workers(s.kind)
        .in_order(s.in_order)
        .build_iterable()
        .unwrap()
}

fn stream_run(s: Setup, every: Option<usize>) -> Vec<Vec<Vec<i64>>> {
    let mut out = vec![Vec::new(); EPOCHS as usize];
    let mut saved: Option<String> = None;
    loop {
        let mut loader = stream_loader(s);
        if let Some(json) = &saved {
            let state: LoaderState = serde_json::from_str(json).unwrap();
            loader.load_state_dict(&state).unwrap();
        }
        let mut taken = 0;
        loop {
            let mut epoch = loader.iter();
            let e = epoch.epoch();
            if e >= EPOCHS {
                return out;
            }
            while every.is_none_or(|n| taken < n) {
                let Some(b) = epoch.next() else { break };
                out[e as usize].push(values(b));
                taken += 1;
            }
            if every == Some(taken) {
                saved = Some(serde_json::to_string(&epoch.state_dict()).unwrap());
                break;
            }
        }
    }
}

#[test]
fn an_iterable_loader_resumes_through_the_state_its_data_set_reports() {
    common::run(secs(240), || {
        let kinds = [
            (0, WorkerKind::Process),
            (1, WorkerKind::Process),
            (4, WorkerKind::Process),
            (4, WorkerKind::Thread),
        ];
        for (workers, kind) in kinds {
            for in_order in [true, false] {
                let s = Setup {
                    workers,
                    in_order,
                    shuffle: false,
                    kind,
                };
                let want = stream_run(s, None);
                let got = stream_run(s, Some(7));
                for e in 0..EPOCHS as usize {
                    let mut all: Vec<i64> = want[e].concat();
                    all.sort_unstable();
                    let expected: Vec<i64> = (0..41).map(|i| 1000 * e as i64 + i).collect();
                    assert_eq!(all, expected, "{s:?}: every sample once");
                    if in_order || workers == 0 {
                        assert_eq!(got[e], want[e], "{s:?}, epoch {e}");
                    } else {
                        assert_eq!(sorted(got[e].clone()), sorted(want[e].clone()), "{s:?}");
                    }
                }
            }
        }
    });
}

fn sharded(n: usize, rank: usize, world: usize, workers: usize) -> DataLoader<Ramp> {
    DataLoader::builder(Ramp { n, epoch: 0 })
        .batch_size(4)
        .sampler(DistributedSampler::new(n, rank, world).unwrap().shuffle(11))
        .num_workers(workers)
        .build()
        .unwrap()
}

#[test]
fn half_an_epoch_on_2_ranks_resumed_on_3_covers_the_epoch_exactly_once() {
    common::run(secs(120), || {
        let n = 96;
        let mut seen: Vec<i64> = Vec::new();
        let mut states = Vec::new();
        // 2 ranks × 2 workers, half an epoch: 6 batches of 4 each.
        for rank in 0..2 {
            let mut loader = sharded(n, rank, 2, 2);
            let mut epoch = loader.iter();
            for _ in 0..6 {
                seen.extend(values(epoch.next().unwrap()));
            }
            states.push(serde_json::to_string(&epoch.state_dict()).unwrap());
        }
        let state: LoaderState = serde_json::from_str(&states[0]).unwrap();
        assert_eq!(state.position(), Some(48));
        let other: LoaderState = serde_json::from_str(&states[1]).unwrap();
        assert_eq!(other.position(), Some(48), "ranks in lockstep agree");
        // 3 ranks × 1 worker, from rank 0's state, to the end of the epoch.
        let mut rest = Vec::new();
        for rank in 0..3 {
            let mut loader = sharded(n, rank, 3, 1);
            loader.load_state_dict(&state).unwrap();
            let mine: Vec<i64> = loader.iter().flat_map(values).collect();
            assert_eq!(mine.len(), 16, "rank {rank} of 3 takes a third of the rest");
            rest.extend(mine);
            // The epoch after it is a whole one again.
            assert_eq!(loader.iter().flat_map(values).count(), 32);
        }
        let mut union: Vec<i64> = seen.iter().chain(&rest).copied().collect();
        union.sort_unstable();
        assert_eq!(
            union,
            (0..n as i64).collect::<Vec<_>>(),
            "one epoch, no repeat, no gap"
        );
        // One process (no ranks, the same seed) resumes the same rest.
        let mut single = DataLoader::builder(Ramp { n, epoch: 0 })
            .batch_size(4)
            .shuffle(11)
            .build()
            .unwrap();
        single.load_state_dict(&state).unwrap();
        let mut alone: Vec<i64> = single.iter().flat_map(values).collect();
        alone.sort_unstable();
        rest.sort_unstable();
        assert_eq!(alone, rest);
        // Another seed at another world size and batch size orders the epoch otherwise:
        // refused, where carrying the position over would repeat and skip samples.
        let mut reseeded = DataLoader::builder(Ramp { n, epoch: 0 })
            .batch_size(3)
            .sampler(DistributedSampler::new(n, 0, 3).unwrap().shuffle(12))
            .build()
            .unwrap();
        let e = reseeded.load_state_dict(&state).unwrap_err().to_string();
        assert!(e.contains("otherwise"), "{e}");
    });
}

#[test]
fn a_state_that_does_not_fit_is_a_clear_error() {
    common::run(secs(60), || {
        let s = Setup {
            workers: 0,
            in_order: true,
            shuffle: false,
            kind: WorkerKind::Process,
        };
        let mut loader = ramp_loader(s);
        let mut epoch = loader.iter();
        epoch.next();
        let state = epoch.state_dict();
        drop(epoch);
        // Another data set length.
        let mut other = DataLoader::builder(Ramp { n: 44, epoch: 0 })
            .batch_size(2)
            .build()
            .unwrap();
        let e = other.load_state_dict(&state).unwrap_err().to_string();
        assert!(e.contains("45 samples") && e.contains("44"), "{e}");
        // Another shuffle seed orders the epoch otherwise.
        let mut reseeded = DataLoader::builder(Ramp { n: 45, epoch: 0 })
            .batch_size(2)
            .shuffle(6)
            .build()
            .unwrap();
        let mut e = reseeded.iter();
        e.next();
        let seeded_state = e.state_dict();
        drop(e);
        let e = loader
            .load_state_dict(&seeded_state)
            .unwrap_err()
            .to_string();
        assert!(e.contains("otherwise"), "{e}");
        // A map-style state in an iterable loader, and the other way round.
        let mut stream = stream_loader(s);
        let e = stream.load_state_dict(&state).unwrap_err().to_string();
        assert!(e.contains("map-style"), "{e}");
        let mut it = stream.iter();
        it.next();
        let stream_state = it.state_dict();
        drop(it);
        let e = loader
            .load_state_dict(&stream_state)
            .unwrap_err()
            .to_string();
        assert!(e.contains("iterable"), "{e}");
        // Another number of streams.
        let mut four = stream_loader(Setup { workers: 4, ..s });
        let e = four.load_state_dict(&stream_state).unwrap_err().to_string();
        assert!(e.contains("num_workers"), "{e}");
        // Between epochs, a state is just the next epoch.
        for _ in loader.iter() {}
        let between = loader.state_dict();
        assert!(!between.is_mid_epoch());
        assert_eq!(between.epoch(), 2);
    });
}

#[test]
fn persistent_workers_resume_on_the_same_loader_without_stale_batches() {
    common::run(secs(120), || {
        for in_order in [true, false] {
            let s = Setup {
                workers: 2,
                in_order,
                shuffle: true,
                kind: WorkerKind::Process,
            };
            let want = sorted(uninterrupted(s).swap_remove(0));
            let mut loader = DataLoader::builder(Ramp { n: 45, epoch: 0 })
                .batch_size(2)
                .shuffle(5)
                .num_workers(2)
                .prefetch_factor(4)
                .persistent_workers(true)
                .in_order(in_order)
                .build()
                .unwrap();
            let mut got = Vec::new();
            let mut epoch = loader.iter();
            for _ in 0..3 {
                got.push(values(epoch.next().unwrap()));
            }
            let state = epoch.state_dict();
            drop(epoch);
            let pids = loader.worker_pids();
            // The same epoch again, on workers that still hold its abandoned batches.
            loader.load_state_dict(&state).unwrap();
            got.extend(loader.iter().map(values));
            assert_eq!(sorted(got), want, "in_order {in_order}: each batch once");
            assert_eq!(
                loader.worker_pids(),
                pids,
                "in_order {in_order}: the same persistent workers resumed"
            );
        }
    });
}

#[test]
fn set_epoch_keeps_a_loaded_state_of_its_epoch_and_drops_another() {
    common::run(secs(60), || {
        let s = Setup {
            workers: 1,
            in_order: true,
            shuffle: true,
            kind: WorkerKind::Process,
        };
        let want = uninterrupted(s);
        let mut first = ramp_loader(s);
        first.set_epoch(1);
        let mut e = first.iter();
        let head: Vec<Vec<i64>> = (0..5).map(|_| values(e.next().unwrap())).collect();
        let state = e.state_dict();
        drop(e);
        assert_eq!(head, want[1][..5]);
        // A training loop that calls set_epoch(e) before each epoch resumes mid-epoch.
        let mut again = ramp_loader(s);
        again.load_state_dict(&state).unwrap();
        again.set_epoch(1);
        let rest: Vec<Vec<i64>> = again.iter().map(values).collect();
        assert_eq!(rest, want[1][5..]);
        // Another epoch drops it: epoch 0 whole.
        let mut other = ramp_loader(s);
        other.load_state_dict(&state).unwrap();
        other.set_epoch(0);
        let whole: Vec<Vec<i64>> = other.iter().map(values).collect();
        assert_eq!(whole, want[0]);
    });
}

#[test]
fn an_iterable_loader_resumes_on_its_own_persistent_workers() {
    common::run(secs(60), || {
        let s = Setup {
            workers: 2,
            in_order: true,
            shuffle: false,
            kind: WorkerKind::Process,
        };
        let want = stream_run(s, None).swap_remove(0);
        let mut loader = DataLoaderBuilder::new(Stream { n: 41 })
            .batch_size(2)
            .num_workers(2)
            .prefetch_factor(3)
            .persistent_workers(true)
            .build_iterable()
            .unwrap();
        let mut e = loader.iter();
        let mut got: Vec<Vec<i64>> = (0..3).map(|_| values(e.next().unwrap())).collect();
        let state = e.state_dict();
        drop(e);
        let pids = loader.worker_pids();
        // The same workers, which were ahead in their streams, go back to the state.
        loader.load_state_dict(&state).unwrap();
        got.extend(loader.iter().map(values));
        assert_eq!(loader.worker_pids(), pids);
        assert_eq!(got, want);
    });
}
