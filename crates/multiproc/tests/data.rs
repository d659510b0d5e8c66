//! `multiproc::data`: the DataLoader across real worker processes — order, shuffling,
//! sharding, the in-flight bound, failures (error, panic, SIGKILL; with and without
//! restart), timeout, early drop, persistent workers, in-process loading, no leaks.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use common::{alive, our_segments, secs};
use multiproc::data::{
    DataLoader, Dataset, DistributedSampler, FromFn, RandomSampler, Sampler, worker_info,
};
use multiproc::{DType, Error, Event, Process, Semaphore, SharingStrategy, Tensor};
use serde::{Deserialize, Serialize};

/// How long a gated sample waits before it gives up (far beyond any test's need; a
/// test that reaches it has failed anyway).
const GATE_WAIT: Duration = Duration::from_secs(60);

/// Sample `i` is `([i; 4] as f32, i)`; hooks make chosen samples fail or wait.
#[derive(Clone, Serialize, Deserialize)]
struct Samples {
    n: usize,
    /// The sample that misbehaves, and how.
    fault: Option<(usize, Fault)>,
    /// When set, the fault happens only while this event is clear, and sets it: the
    /// first attempt fails, a retry succeeds.
    once: Option<Event>,
    /// Every sample but 0 releases it; sample 0 first acquires it `hold_first` times
    /// (so batch 0 finishes after that many other samples).
    finished: Option<Semaphore>,
    hold_first: u32,
    /// Samples at or past this index wait for the event (never set: they hang).
    gate: Option<(usize, Event)>,
    /// Sample 0 waits for this event.
    first_waits: Option<Event>,
}

#[derive(Clone, Copy, Serialize, Deserialize, Debug)]
enum Fault {
    Err,
    Panic,
    Kill,
    Hang,
}

impl Samples {
    fn new(n: usize) -> Self {
        Samples {
            n,
            fault: None,
            once: None,
            finished: None,
            hold_first: 0,
            gate: None,
            first_waits: None,
        }
    }

    fn fault(mut self, at: usize, how: Fault) -> Self {
        self.fault = Some((at, how));
        self
    }

    fn once(mut self) -> Self {
        self.once = Some(Event::new().unwrap());
        self
    }
}

impl Dataset for Samples {
    type Item = (Tensor, i64);

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> multiproc::Result<(Tensor, i64)> {
        if let Some((at, how)) = self.fault {
            let armed = match &self.once {
                None => true,
                Some(e) => !e.is_set(),
            };
            if i == at && armed {
                if let Some(e) = &self.once {
                    e.set();
                }
                match how {
                    Fault::Err => {
                        return Err(Error::InvalidArgument(format!("sample {i} is corrupt")));
                    }
                    Fault::Panic => panic!("decoder crashed on sample {i}"),
                    Fault::Kill => {
                        // SAFETY: kill(2) on our own pid; no memory is involved.
                        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                    }
                    Fault::Hang => std::thread::sleep(GATE_WAIT),
                }
            }
        }
        if let Some(sem) = &self.finished {
            if i == 0 {
                for _ in 0..self.hold_first {
                    // A timeout here is an error: the other samples never finished.
                    sem.acquire_timeout(GATE_WAIT)?;
                }
            } else {
                sem.release()?;
            }
        }
        if let (0, Some(event)) = (i, &self.first_waits) {
            event.wait_timeout(GATE_WAIT)?;
        }
        if let Some((from, event)) = &self.gate {
            if i >= *from {
                event.wait_timeout(GATE_WAIT)?;
            }
        }
        Ok((Tensor::full(&[4], i as f64, DType::F32)?, i as i64))
    }
}

type Loader = DataLoader<Samples>;

/// The labels of every batch of one epoch, panicking on an error.
fn labels_of_epoch(loader: &mut Loader) -> Vec<Vec<i64>> {
    loader
        .iter()
        .map(|b| {
            let (x, y) = b.expect("batch");
            let labels = y.to_vec::<i64>().unwrap();
            // The images match their labels: sample i is [i; 4].
            let pixels = x.to_vec::<f32>().unwrap();
            for (k, l) in labels.iter().enumerate() {
                assert!(pixels[4 * k..4 * k + 4].iter().all(|&p| p == *l as f32));
            }
            labels
        })
        .collect()
}

#[test]
fn in_order_yields_sampler_order_though_batch_0_finishes_late() {
    common::run(secs(60), || {
        let mut data = Samples::new(8);
        data.finished = Some(Semaphore::new(0).unwrap());
        // Batches 1 and 3 (worker 1's first two) finish before batch 0 can.
        data.hold_first = 2;
        let mut loader = DataLoader::builder(data)
            .num_workers(2)
            .prefetch_factor(2)
            .build()
            .unwrap();
        assert_eq!(loader.len(), 8);
        let got: Vec<i64> = labels_of_epoch(&mut loader).concat();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
    });
}

#[test]
fn out_of_order_yields_batches_as_they_finish() {
    common::run(secs(60), || {
        let mut data = Samples::new(8);
        data.finished = Some(Semaphore::new(0).unwrap());
        data.hold_first = 2;
        let mut loader = DataLoader::builder(data)
            .num_workers(2)
            .in_order(false)
            .build()
            .unwrap();
        let got: Vec<i64> = labels_of_epoch(&mut loader).concat();
        assert_ne!(
            got[0], 0,
            "batch 0 cannot finish first, yet came first: {got:?}"
        );
        let set: BTreeSet<i64> = got.iter().copied().collect();
        assert_eq!(set, (0..8).collect(), "every batch exactly once: {got:?}");
        assert_eq!(got.len(), 8);
    });
}

#[test]
fn at_most_workers_times_prefetch_batches_are_in_flight() {
    common::run(secs(60), || {
        let loaded = Semaphore::new(0).unwrap();
        let release_first = Event::new().unwrap();
        let mut data = Samples::new(40);
        // Sample 0 is held until the test has counted; every other sample counts.
        data.finished = Some(loaded.clone());
        data.first_waits = Some(release_first.clone());
        let (workers, prefetch) = (2, 3);
        let window = workers * prefetch;
        let mut loader = DataLoader::builder(data)
            .num_workers(workers)
            .prefetch_factor(prefetch)
            .build()
            .unwrap();
        let mut epoch = loader.iter();
        // Batch 0 is held; release it from another thread once the loading has
        // stopped, and check that what was loaded fits the window.
        let watcher = {
            let loaded = loaded.clone();
            std::thread::spawn(move || {
                // Worker 1 loads its three batches (worker 0 is stuck on batch 0 with
                // two more queued behind it): the window of 6 is full.
                let until = Instant::now() + secs(30);
                while loaded.value() < 3 && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
                // If the bound were broken, the workers would go on loading now.
                std::thread::sleep(Duration::from_millis(300));
                let settled = loaded.value();
                release_first.set();
                settled
            })
        };
        let first = epoch.next().unwrap().unwrap();
        assert_eq!(first.1.to_vec::<i64>().unwrap(), [0]);
        let settled = watcher.join().unwrap();
        assert!(
            (3..window).contains(&settled),
            "{settled} batches besides the held one were loaded; the window is {window}"
        );
        assert_eq!(epoch.count(), 39);
    });
}

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
        let mut p = Process::new(sampler_from_env_without_world_size, 0, ());
        p.start().unwrap();
        let status = p.join().unwrap();
        assert!(status.success(), "{:?}", p.error());
    });
}

/// Runs an epoch of a loader of 8 samples in batches of 2 whose sample 5 (batch 2,
/// worker 0) misbehaves; returns what happened.
fn epoch_with_fault(data: Samples, restart: bool) -> (Vec<multiproc::Result<Vec<i64>>>, Vec<u32>) {
    let mut loader = DataLoader::builder(data)
        .batch_size(2)
        .num_workers(2)
        .restart_workers(restart)
        .build()
        .unwrap();
    let mut epoch = loader.iter();
    let mut results = vec![
        epoch
            .next()
            .unwrap()
            .map(|(_, y)| y.to_vec::<i64>().unwrap()),
    ];
    let pids = epoch.worker_pids();
    results.extend(epoch.map(|b| b.map(|(_, y)| y.to_vec::<i64>().unwrap())));
    (results, pids)
}

/// Batch 2 failed, named with the worker that held it (whichever it was: which worker
/// gets a batch depends on which is free first) and that worker's pid.
fn assert_named_failure(result: &multiproc::Result<Vec<i64>>, pids: &[u32], what: &str) {
    match result {
        Err(Error::LoaderFailed {
            worker,
            pid: p,
            batch,
            indices,
            message,
        }) => {
            let w = worker.expect("a worker is named");
            assert_eq!((*p, *batch), (pids[w], 2), "{message}");
            assert_eq!(indices, &[4, 5]);
            let (worker_text, pid_text) = (format!("worker {w}"), format!("pid {p}"));
            for needle in [&worker_text, &pid_text, "batch 2", "[4, 5]", what] {
                assert!(
                    message.contains(needle),
                    "{needle:?} missing from: {message}"
                );
            }
        }
        other => panic!("expected a LoaderFailed error, got {other:?}"),
    }
}

#[test]
fn a_failing_worker_is_named_and_stops_the_epoch() {
    common::run(secs(60), || {
        for (how, what) in [
            (Fault::Err, "sample 5 is corrupt"),
            (Fault::Panic, "decoder crashed on sample 5"),
            (Fault::Kill, "SIGKILL"),
        ] {
            let (results, pids) = epoch_with_fault(Samples::new(8).fault(5, how), false);
            assert_eq!(results[0].as_ref().unwrap(), &[0, 1], "{how:?}");
            assert_eq!(results[1].as_ref().unwrap(), &[2, 3], "{how:?}");
            assert_named_failure(&results[2], &pids, what);
            assert_eq!(
                results.len(),
                3,
                "the epoch stops after the error ({how:?})"
            );
        }
    });
}

#[test]
fn restart_workers_replaces_the_worker_and_retries_the_batch_once() {
    common::run(secs(90), || {
        for how in [Fault::Err, Fault::Panic, Fault::Kill] {
            let (results, _) = epoch_with_fault(Samples::new(8).fault(5, how).once(), true);
            let labels: Vec<Vec<i64>> = results
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("{how:?}: {e}")))
                .collect();
            assert_eq!(labels, [[0, 1], [2, 3], [4, 5], [6, 7]], "{how:?}");
        }
        // A batch that fails on the fresh worker too ends the epoch, said so.
        let (results, _) = epoch_with_fault(Samples::new(8).fault(5, Fault::Panic), true);
        let err = results.last().unwrap().as_ref().unwrap_err().to_string();
        assert!(
            err.contains("again, after a restart") && err.contains("batch 2"),
            "{err}"
        );
    });
}

#[test]
fn a_restarted_worker_has_a_new_pid() {
    common::run(secs(60), || {
        let mut loader = DataLoader::builder(Samples::new(8).fault(5, Fault::Kill).once())
            .batch_size(2)
            .num_workers(2)
            .restart_workers(true)
            .persistent_workers(true)
            .build()
            .unwrap();
        let mut epoch = loader.iter();
        epoch.next().unwrap().unwrap();
        let before = epoch.worker_pids();
        assert_eq!(epoch.by_ref().filter(Result::is_ok).count(), 3);
        drop(epoch);
        let after = loader.worker_pids();
        // The worker that loaded batch 2 (whichever was free) was replaced, the other not.
        let replaced: Vec<usize> = (0..2).filter(|&i| before[i] != after[i]).collect();
        assert_eq!(
            replaced.len(),
            1,
            "one worker replaced: {before:?} -> {after:?}"
        );
        assert!(!alive(before[replaced[0]]));
    });
}

#[test]
fn a_batch_past_its_timeout_is_an_error_naming_the_worker() {
    common::run(secs(60), || {
        let mut loader = DataLoader::builder(Samples::new(8).fault(4, Fault::Hang))
            .batch_size(2)
            .num_workers(2)
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        let mut epoch = loader.iter();
        epoch.next().unwrap().unwrap();
        epoch.next().unwrap().unwrap();
        let pids = epoch.worker_pids();
        let started = Instant::now();
        let err = epoch.next().unwrap().unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(500));
        assert!(err.is_timeout(), "expected a timeout, got {err:?}");
        let message = err.to_string();
        for needle in [
            "worker 0",
            &format!("pid {}", pids[0]),
            "batch 2",
            "[4, 5]",
            "500ms",
        ] {
            assert!(
                message.contains(needle),
                "{needle:?} missing from: {message}"
            );
        }
        assert!(epoch.next().is_none(), "the epoch ended");
        drop(epoch);
        assert!(loader.worker_pids().is_empty());
        assert!(!alive(pids[0]), "the hung worker was stopped");
    });
}

#[test]
fn dropping_the_loader_mid_epoch_stops_the_workers_at_once() {
    common::run(secs(90), || {
        common::for_each_strategy(|strategy| {
            let segments_before = our_segments();
            let mut data = Samples::new(64);
            // Everything past the first batches hangs: workers are busy when dropped.
            data.gate = Some((8, Event::new().unwrap()));
            let mut loader = DataLoader::builder(data)
                .batch_size(4)
                .num_workers(2)
                .build()
                .unwrap();
            let mut epoch = loader.iter();
            epoch.next().unwrap().unwrap();
            let pids = epoch.worker_pids();
            drop(epoch);
            // Without persistent workers the epoch's end stops them; with them, the
            // loader's drop does. Check the loader's own drop too:
            assert!(pids.iter().all(|&p| !alive(p)), "{strategy}: {pids:?}");
            let mut loader = DataLoader::builder(Samples {
                gate: Some((8, Event::new().unwrap())),
                ..Samples::new(64)
            })
            .batch_size(4)
            .num_workers(2)
            .persistent_workers(true)
            .build()
            .unwrap();
            let mut epoch = loader.iter();
            epoch.next().unwrap().unwrap();
            drop(epoch);
            let pids = loader.worker_pids();
            assert!(pids.iter().all(|&p| alive(p)), "persistent workers stay");
            let started = Instant::now();
            drop(loader);
            let took = started.elapsed();
            eprintln!("{strategy}: the loader and its 2 busy workers stopped in {took:?}");
            assert!(pids.iter().all(|&p| !alive(p)), "{strategy}: {pids:?}");
            // 50 ms of grace, then SIGKILL; generous for a loaded machine.
            assert!(
                took < Duration::from_secs(2),
                "{strategy}: drop took {took:?}"
            );
            // Nothing of the batches in flight stays in /dev/shm (the shm manager
            // removes what the killed workers made, after its grace period).
            let until = Instant::now() + secs(10);
            while our_segments() != segments_before && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert_eq!(our_segments(), segments_before, "{strategy}");
        });
    });
}

#[test]
fn persistent_workers_are_reused_across_epochs() {
    common::run(secs(60), || {
        let mut loader = DataLoader::builder(Samples::new(12))
            .batch_size(3)
            .num_workers(2)
            .persistent_workers(true)
            .build()
            .unwrap();
        let first = labels_of_epoch(&mut loader);
        let pids = loader.worker_pids();
        assert_eq!(pids.len(), 2);
        let second = labels_of_epoch(&mut loader);
        assert_eq!(first, second);
        assert_eq!(
            loader.worker_pids(),
            pids,
            "the same processes served epoch 2"
        );
        // An epoch abandoned half-way leaves the workers ready for the next one.
        let mut epoch = loader.iter();
        epoch.next().unwrap().unwrap();
        drop(epoch);
        assert_eq!(labels_of_epoch(&mut loader), first);
        assert_eq!(loader.worker_pids(), pids);

        let mut loader = DataLoader::builder(Samples::new(12))
            .batch_size(3)
            .num_workers(2)
            .build()
            .unwrap();
        let mut epoch = loader.iter();
        epoch.next().unwrap().unwrap();
        let pids = epoch.worker_pids();
        assert_eq!(epoch.count(), 3);
        assert!(
            loader.worker_pids().is_empty(),
            "stopped at the end of the epoch"
        );
        assert!(pids.iter().all(|&p| !alive(p)));
    });
}

#[test]
fn num_workers_0_loads_in_this_process() {
    common::run(secs(60), || {
        let mut loader = DataLoader::builder(Samples::new(7))
            .batch_size(3)
            .build()
            .unwrap();
        assert_eq!(loader.len(), 3);
        assert_eq!(
            labels_of_epoch(&mut loader),
            [vec![0, 1, 2], vec![3, 4, 5], vec![6]]
        );
        assert!(loader.worker_pids().is_empty());
        let mut failing = DataLoader::builder(Samples::new(7).fault(4, Fault::Err))
            .batch_size(3)
            .drop_last(true)
            .build()
            .unwrap();
        assert_eq!(failing.len(), 2);
        let results: Vec<_> = failing.iter().collect();
        match &results[1] {
            Err(Error::LoaderFailed {
                worker: None,
                pid,
                batch: 1,
                message,
                ..
            }) => {
                assert_eq!(*pid, std::process::id());
                assert!(message.contains("sample 4 is corrupt"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    });
}

/// Item = (worker id or -1, value set by worker_init or -1).
#[derive(Clone, Serialize, Deserialize)]
struct WhoLoads(usize);

static INIT_MARK: AtomicI64 = AtomicI64::new(-1);

fn mark_worker(id: usize) {
    INIT_MARK.store(100 + id as i64, Ordering::SeqCst);
}

impl Dataset for WhoLoads {
    type Item = (i64, i64);

    fn len(&self) -> usize {
        self.0
    }

    fn get(&self, _i: usize) -> multiproc::Result<(i64, i64)> {
        let id = worker_info().map_or(-1, |w| w.id as i64);
        Ok((id, INIT_MARK.load(Ordering::SeqCst)))
    }
}

#[test]
fn workers_know_their_id_and_run_worker_init() {
    common::run(secs(60), || {
        let seen = |workers: usize| -> BTreeSet<(i64, i64)> {
            let mut loader = DataLoader::builder(WhoLoads(16))
                .batch_size(2)
                .num_workers(workers)
                .worker_init(mark_worker)
                .build()
                .unwrap();
            let mut pairs = BTreeSet::new();
            for batch in &mut loader {
                let (ids, marks) = batch.unwrap();
                let ids = ids.to_vec::<i64>().unwrap();
                let marks = marks.to_vec::<i64>().unwrap();
                pairs.extend(ids.into_iter().zip(marks));
            }
            pairs
        };
        assert_eq!(seen(2), [(0, 100), (1, 101)].into_iter().collect());
        assert_eq!(
            seen(0),
            [(-1, -1)].into_iter().collect(),
            "no worker, no init"
        );
    });
}

fn build_samples() -> multiproc::Result<Samples> {
    Ok(Samples::new(6))
}

#[test]
fn a_data_set_built_in_each_worker() {
    common::run(secs(60), || {
        let data = FromFn::new(build_samples).unwrap();
        let mut loader = DataLoader::builder(data)
            .batch_size(4)
            .num_workers(2)
            .build()
            .unwrap();
        let got: Vec<i64> = loader
            .iter()
            .flat_map(|b| b.unwrap().1.to_vec::<i64>().unwrap())
            .collect();
        assert_eq!(got, (0..6).collect::<Vec<_>>());
    });
}

#[test]
fn many_epochs_leak_nothing() {
    common::run(secs(120), || {
        common::for_each_strategy(|strategy| {
            let mut loader = DataLoader::builder(Samples::new(20))
                .batch_size(5)
                .shuffle(3)
                .num_workers(2)
                .persistent_workers(strategy == SharingStrategy::FileSystem)
                .build()
                .unwrap();
            for _ in 0..5 {
                let epoch = labels_of_epoch(&mut loader);
                assert_eq!(epoch.len(), 4);
            }
        });
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

#[test]
fn every_start_method_loads_the_same_batches() {
    common::run(secs(90), || {
        let mut epochs = Vec::new();
        for method in multiproc::StartMethod::ALL {
            let mut loader = DataLoader::builder(Samples::new(10))
                .batch_size(3)
                .shuffle(5)
                .num_workers(2)
                .start_method(method)
                .build()
                .unwrap();
            epochs.push(labels_of_epoch(&mut loader));
        }
        assert!(epochs.windows(2).all(|w| w[0] == w[1]), "{epochs:?}");
    });
}

#[test]
fn out_of_order_failures_come_as_they_happen_and_restart_too() {
    common::run(secs(60), || {
        let mut loader = DataLoader::builder(Samples::new(8).fault(5, Fault::Kill).once())
            .batch_size(2)
            .num_workers(2)
            .in_order(false)
            .restart_workers(true)
            .build()
            .unwrap();
        let mut got: Vec<i64> = loader
            .iter()
            .flat_map(|b| b.unwrap().1.to_vec::<i64>().unwrap())
            .collect();
        got.sort_unstable();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
    });
}

#[cfg(feature = "image")]
mod image_folder {
    use super::*;
    use multiproc::data::ImageFolder;

    /// A temporary image folder that removes itself.
    struct Folder(std::path::PathBuf);

    impl Drop for Folder {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn folder_with_classes() -> Folder {
        let root = std::env::temp_dir().join(format!("multiproc-data-test-{}", std::process::id()));
        for (class, shade) in [("cat", 10u8), ("dog", 200u8)] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            for i in 0..3u8 {
                let img = image::RgbImage::from_pixel(6, 4, image::Rgb([shade, shade + i, 7]));
                img.save(root.join(class).join(format!("{i}.png"))).unwrap();
            }
        }
        Folder(root)
    }

    #[test]
    fn png_files_are_decoded_by_workers_into_shared_batches() {
        common::run(secs(60), || {
            let dir = folder_with_classes();
            let folder = ImageFolder::new(&dir.0).unwrap();
            assert_eq!(folder.classes(), ["cat", "dog"]);
            let mut loader = DataLoader::builder(folder)
                .batch_size(3)
                .num_workers(2)
                .build()
                .unwrap();
            let batches: Vec<(Tensor, Tensor)> = loader.iter().map(Result::unwrap).collect();
            assert_eq!(batches.len(), 2);
            for (b, (images, labels)) in batches.iter().enumerate() {
                assert_eq!(images.shape(), [3, 3, 4, 6], "[batch, rgb, height, width]");
                assert!(images.is_shared());
                assert_eq!(labels.to_vec::<i64>().unwrap(), [b as i64; 3]);
                let shade = [10u8, 200][b];
                for i in 0..3 {
                    let red = images.select(0, i).unwrap().select(0, 0).unwrap();
                    let green = images.select(0, i).unwrap().select(0, 1).unwrap();
                    assert!(red.to_vec::<u8>().unwrap().iter().all(|&v| v == shade));
                    assert!(
                        green
                            .to_vec::<u8>()
                            .unwrap()
                            .iter()
                            .all(|&v| v == shade + i as u8)
                    );
                }
            }
        });
    }

    #[test]
    fn a_corrupt_png_is_an_error_naming_the_file_and_the_worker() {
        common::run(secs(60), || {
            let dir = folder_with_classes();
            let bad = dir.0.join("dog").join("1.png");
            std::fs::write(&bad, b"not a png").unwrap();
            let folder = ImageFolder::new(&dir.0).unwrap().resize(8, 8);
            let mut loader = DataLoader::builder(folder)
                .batch_size(2)
                .num_workers(1)
                .build()
                .unwrap();
            let err = loader
                .iter()
                .find_map(Result::err)
                .expect("the bad file fails");
            let text = err.to_string();
            assert!(
                text.contains("1.png") && text.contains("worker 0"),
                "{text}"
            );
            assert!(
                matches!(err, Error::LoaderFailed { batch: 2, .. }),
                "{err:?}"
            );
        });
    }
}

#[cfg(feature = "progress")]
#[test]
fn an_epoch_with_a_progress_bar_loads_the_same_batches() {
    common::run(secs(60), || {
        let mut plain = DataLoader::builder(Samples::new(9))
            .batch_size(2)
            .build()
            .unwrap();
        let mut shown = DataLoader::builder(Samples::new(9))
            .batch_size(2)
            .num_workers(1)
            .progress(true)
            .build()
            .unwrap();
        assert_eq!(labels_of_epoch(&mut plain), labels_of_epoch(&mut shown));
    });
}

/// A stream of `0..n`; worker k of m yields k, k + m, …; `fail_at` yields an `Err`.
#[derive(Clone, Serialize, Deserialize)]
struct Stream {
    n: usize,
    fail_at: Option<usize>,
}

impl multiproc::data::IterableDataset for Stream {
    type Item = i64;
    type Iter = Box<dyn Iterator<Item = multiproc::Result<i64>>>;

    fn iter(&self, _epoch: u64) -> Self::Iter {
        let (k, m) = worker_info().map_or((0, 1), |w| (w.id, w.num_workers));
        let fail_at = self.fail_at;
        Box::new((k..self.n).step_by(m).map(move |i| {
            if Some(i) == fail_at {
                Err(Error::InvalidArgument(format!("record {i} is truncated")))
            } else {
                Ok(i as i64)
            }
        }))
    }
}

fn stream_batches(
    stream: Stream,
    workers: usize,
    in_order: bool,
) -> Vec<multiproc::Result<Vec<i64>>> {
    let mut loader = multiproc::data::DataLoaderBuilder::new(stream)
        .batch_size(2)
        .num_workers(workers)
        .in_order(in_order)
        .build_iterable()
        .unwrap();
    let epochs: Vec<Vec<_>> = (0..2)
        .map(|_| {
            loader
                .iter()
                .map(|b| b.map(|t| t.to_vec::<i64>().unwrap()))
                .collect()
        })
        .collect();
    epochs.into_iter().next().unwrap()
}

#[test]
fn an_iterable_data_set_is_batched_per_worker_round_robin() {
    common::run(secs(60), || {
        let stream = Stream {
            n: 7,
            fail_at: None,
        };
        let got: Vec<Vec<i64>> = stream_batches(stream.clone(), 2, true)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        // Worker 0 streams 0, 2, 4, 6 and worker 1 streams 1, 3, 5: torch's order.
        assert_eq!(got, [vec![0, 2], vec![1, 3], vec![4, 6], vec![5]]);
        let alone: Vec<Vec<i64>> = stream_batches(stream.clone(), 0, true)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(alone, [vec![0, 1], vec![2, 3], vec![4, 5], vec![6]]);
        let mut unordered: Vec<i64> = stream_batches(stream, 2, false)
            .into_iter()
            .flat_map(Result::unwrap)
            .collect();
        unordered.sort_unstable();
        assert_eq!(unordered, (0..7).collect::<Vec<_>>());
    });
}

#[test]
fn a_failing_stream_is_named_with_its_worker() {
    common::run(secs(60), || {
        let got = stream_batches(
            Stream {
                n: 9,
                fail_at: Some(5),
            },
            2,
            true,
        );
        assert_eq!(got[0].as_ref().unwrap(), &[0, 2]);
        assert_eq!(got[1].as_ref().unwrap(), &[1, 3]);
        assert_eq!(got[2].as_ref().unwrap(), &[4, 6]);
        let err = got[3].as_ref().unwrap_err().to_string();
        assert!(
            err.contains("worker 1") && err.contains("record 5 is truncated"),
            "{err}"
        );
        assert_eq!(got.len(), 4);
        let shuffled = multiproc::data::DataLoaderBuilder::new(Stream {
            n: 3,
            fail_at: None,
        })
        .shuffle(1)
        .build_iterable();
        assert!(
            shuffled.is_err(),
            "a stream cannot be shuffled by the loader"
        );
    });
}

#[test]
fn a_persistent_worker_killed_between_epochs_is_named_or_replaced() {
    common::run(secs(60), || {
        for restart in [false, true] {
            let mut loader = DataLoader::builder(Samples::new(8))
                .batch_size(2)
                .num_workers(2)
                .persistent_workers(true)
                .restart_workers(restart)
                .build()
                .unwrap();
            assert_eq!(labels_of_epoch(&mut loader).len(), 4);
            let pids = loader.worker_pids();
            // SAFETY: kill(2) on a worker's pid, which is alive (not yet reaped).
            assert_eq!(unsafe { libc::kill(pids[0] as i32, libc::SIGKILL) }, 0);
            let until = Instant::now() + secs(20);
            while alive(pids[0]) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            let epoch: Vec<_> = loader.iter().collect();
            if restart {
                assert_eq!(epoch.len(), 4);
                assert!(epoch.iter().all(Result::is_ok), "{epoch:?}");
                assert_ne!(loader.worker_pids()[0], pids[0], "worker 0 was replaced");
                assert_eq!(loader.worker_pids()[1], pids[1]);
            } else {
                let err = epoch.last().unwrap().as_ref().unwrap_err().to_string();
                let needle = format!("worker 0 (pid {}) died while idle", pids[0]);
                assert!(err.contains(&needle) && err.contains("SIGKILL"), "{err}");
            }
        }
    });
}
