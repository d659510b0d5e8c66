//! `multiproc::data`: the DataLoader across real worker processes — order, the
//! in-flight bound, persistent workers, in-process loading, worker ids and init, data
//! sets built in each worker, every start method, iterable data sets, PNG folders
//! (feature `image`) and the progress bar (feature `progress`), no leaks. Sampling is
//! tests/data_sampling.rs, failures tests/data_failures.rs; the data sets they share are
//! in tests/common/data.rs.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use common::data::*;
use common::{alive, secs};
use multiproc::data::{DataLoader, Dataset, FromFn, worker_info};
use multiproc::{Error, Event, Semaphore, SharingStrategy};
use serde::{Deserialize, Serialize};

#[test]
fn in_order_yields_sampler_order_though_batch_0_finishes_late() {
    common::run(secs(60), || {
        // Batches 1 and 3 (worker 1's first two) finish before batch 0 can.
        let data = Samples::new(8).first_finishing_after(2);
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
        let data = Samples::new(8).first_finishing_after(2);
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
                for n in 0..3 {
                    loaded
                        .acquire_timeout(secs(30))
                        .unwrap_or_else(|e| panic!("{n} of 3 batches loaded: {e}"));
                }
                // If the bound were broken, the workers would go on loading: each further
                // load is counted until none comes for 300 ms (a correct loader has
                // stopped for good, so it cannot pass by a slow count).
                let mut settled = 3;
                while settled < window {
                    match loaded.acquire_timeout(Duration::from_millis(300)) {
                        Ok(()) => settled += 1,
                        Err(e) if e.is_timeout() => break,
                        Err(e) => panic!("counting loads: {e}"),
                    }
                }
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
fn a_huge_timeout_and_prefetch_factor_load_as_usual() {
    common::run(secs(60), || {
        // Too long for the clock: no deadline. Too many to count: every batch may be
        // in flight (the product saturates).
        let mut loader = DataLoader::builder(Samples::new(6))
            .num_workers(2)
            .timeout(Duration::MAX)
            .prefetch_factor(usize::MAX)
            .build()
            .unwrap();
        let got: Vec<i64> = labels_of_epoch(&mut loader).concat();
        assert_eq!(got, (0..6).collect::<Vec<_>>());
        // The last epoch number there is: the one after it is 0 again.
        loader.set_epoch(u64::MAX);
        assert_eq!(labels_of_epoch(&mut loader).concat().len(), 6);
        assert_eq!(loader.state_dict().epoch(), 0);
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

/// Sample `i` is `(i, the pid of the process that built this copy of the data set)`.
struct BuiltBy(u32);

impl Dataset for BuiltBy {
    type Item = (i64, i64);

    fn len(&self) -> usize {
        6
    }

    fn get(&self, i: usize) -> multiproc::Result<(i64, i64)> {
        Ok((i as i64, i64::from(self.0)))
    }
}

fn build_here() -> multiproc::Result<BuiltBy> {
    Ok(BuiltBy(std::process::id()))
}

#[test]
fn a_data_set_built_in_each_worker() {
    common::run(secs(60), || {
        let data = FromFn::new(build_here).unwrap();
        assert_eq!(data.inner().0, std::process::id(), "built here too");
        let mut loader = DataLoader::builder(data)
            .batch_size(2)
            .num_workers(2)
            .build()
            .unwrap();
        let mut epoch = loader.iter();
        let first = epoch.next().unwrap();
        let workers: BTreeSet<i64> = epoch.worker_pids().into_iter().map(i64::from).collect();
        let (mut got, mut builders) = (Vec::new(), BTreeSet::new());
        for b in std::iter::once(first).chain(epoch) {
            let (i, by) = b.unwrap();
            got.extend(i.to_vec::<i64>().unwrap());
            builders.extend(by.to_vec::<i64>().unwrap());
        }
        assert_eq!(got, (0..6).collect::<Vec<_>>());
        // Whichever worker was free loaded a batch: each from the copy it built itself.
        assert_eq!(workers.len(), 2, "{workers:?}");
        assert!(
            !builders.is_empty() && builders.is_subset(&workers),
            "samples came from copies built by {builders:?}, not by the workers {workers:?}"
        );
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

#[cfg(feature = "image")]
mod image_folder {
    use super::*;
    use multiproc::Tensor;
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
