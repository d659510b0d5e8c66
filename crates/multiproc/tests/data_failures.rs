//! `multiproc::data`: a DataLoader's failures across real worker processes — a worker's
//! error, panic or SIGKILL named (with and without restart), a batch past its timeout,
//! the loader dropped mid-epoch, failures out of order, a failing stream, a persistent
//! worker killed between epochs.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::data::*;
use common::{alive, our_segments, secs};
use multiproc::data::DataLoader;
use multiproc::{Error, Event};

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
fn out_of_order_loading_restarts_a_killed_worker_and_loses_no_sample() {
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
            assert!(!alive(pids[0]), "worker 0 outlived its SIGKILL");
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
