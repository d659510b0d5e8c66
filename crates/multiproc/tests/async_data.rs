//! Feature `async` (issue 23): the data loader's epoch as a `futures_core::Stream`
//! (`DataLoader::stream`), across real worker processes, on tokio.
//!
//! - the stream yields exactly the batches the iterator yields, in order, with batch 0
//!   finishing last (so the reordering buffer is used);
//! - a worker's error, and a SIGKILLed worker, reach the stream naming the worker;
//! - the loader's timeout fires on a stream parked on a hung worker;
//! - dropping a stream mid-epoch stops the workers, and the next epoch (streamed)
//!   is whole;
//! - several loaders' streams polled concurrently on one task all complete;
//! - an `IterableDataLoader`'s stream yields what its iterator yields, and a stream's
//!   failing record reaches it naming the worker.
//!
//! Every test runs under `common::run` (a deadline, and /dev/shm, fd and child counts
//! unchanged at its end), and every await under a timeout.

multiproc::test_init!();

mod common;

use std::future::poll_fn;
use std::pin::Pin;
use std::time::{Duration, Instant};

use common::async_rt::{until_parked, warm_up};
use common::data::{Fault, Loader, Samples};
use common::{alive, secs};
use futures_core::Stream;
use multiproc::data::{DataLoader, EpochStream};
use multiproc::{Error, Event, Tensor};
use serde::{Deserialize, Serialize};

/// How long one awaited batch may take before the test fails.
const WAIT: Duration = Duration::from_secs(30);
type Batch = (Tensor, Tensor);

/// The labels of a batch, checking that its images match them.
fn labels(batch: &Batch) -> Vec<i64> {
    let (x, y) = batch;
    let labels = y.to_vec::<i64>().unwrap();
    let pixels = x.to_vec::<f32>().unwrap();
    for (k, l) in labels.iter().enumerate() {
        assert!(pixels[4 * k..4 * k + 4].iter().all(|&p| p == *l as f32));
    }
    labels
}

/// The stream's next item, failing the test if it takes longer than `WAIT`.
async fn next(
    stream: &mut EpochStream<'_, Samples, multiproc::data::DefaultCollate>,
) -> Option<multiproc::Result<Batch>> {
    tokio::time::timeout(WAIT, poll_fn(|cx| Pin::new(&mut *stream).poll_next(cx)))
        .await
        .expect("a batch within the deadline")
}

/// Every item of one streamed epoch, as labels.
async fn stream_epoch(loader: &mut Loader) -> Vec<multiproc::Result<Vec<i64>>> {
    let mut stream = loader.stream();
    let mut out = Vec::new();
    while let Some(item) = next(&mut stream).await {
        out.push(item.map(|b| labels(&b)));
    }
    out
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn late_first(n: usize) -> Samples {
    // Worker 1's first batches finish before batch 0 can.
    Samples::new(n).first_finishing_after(2)
}

#[test]
fn the_stream_yields_what_the_iterator_yields_in_order() {
    warm_up();
    common::run(secs(90), || {
        let build = || {
            DataLoader::builder(late_first(16))
                .batch_size(2)
                .num_workers(2)
                .prefetch_factor(2)
                .build()
                .unwrap()
        };
        let mut loader = build();
        let iterated: Vec<Vec<i64>> = loader.iter().map(|b| labels(&b.unwrap())).collect();
        let mut loader = build();
        let streamed: Vec<Vec<i64>> = runtime()
            .block_on(stream_epoch(&mut loader))
            .into_iter()
            .map(|b| b.expect("batch"))
            .collect();
        assert_eq!(streamed, iterated);
        assert_eq!(streamed.concat(), (0..16).collect::<Vec<_>>());
        assert_eq!(loader.stats().batches, 8);
        assert!(
            loader.worker_pids().is_empty(),
            "the epoch's end stopped the workers"
        );
    });
}

#[test]
fn a_failing_worker_reaches_the_stream_named() {
    warm_up();
    common::run(secs(90), || {
        for (how, what) in [
            (Fault::Err, "sample 5 is corrupt"),
            (Fault::Kill, "SIGKILL"),
        ] {
            let mut data = Samples::new(8);
            data.fault = Some((5, how));
            let mut loader = DataLoader::builder(data)
                .batch_size(2)
                .num_workers(2)
                .build()
                .unwrap();
            let (results, pids) = runtime().block_on(async {
                let mut stream = loader.stream();
                let mut results = vec![next(&mut stream).await.unwrap().map(|b| labels(&b))];
                let pids = stream.epoch().worker_pids();
                while let Some(item) = next(&mut stream).await {
                    results.push(item.map(|b| labels(&b)));
                }
                (results, pids)
            });
            assert_eq!(results[0].as_ref().unwrap(), &[0, 1], "{how:?}");
            assert_eq!(results[1].as_ref().unwrap(), &[2, 3], "{how:?}");
            assert_eq!(
                results.len(),
                3,
                "the epoch stops after the error ({how:?})"
            );
            match &results[2] {
                Err(Error::LoaderFailed {
                    worker,
                    pid,
                    batch,
                    message,
                    ..
                }) => {
                    let w = worker.expect("a worker is named");
                    assert_eq!((*pid, *batch), (pids[w], 2), "{message}");
                    let (worker_text, pid_text) = (format!("worker {w}"), format!("pid {pid}"));
                    for needle in [worker_text.as_str(), pid_text.as_str(), what] {
                        assert!(
                            message.contains(needle),
                            "{needle:?} missing from: {message}"
                        );
                    }
                }
                other => panic!("expected a LoaderFailed error, got {other:?}"),
            }
            assert!(loader.worker_pids().is_empty());
        }
    });
}

/// A worker SIGKILLed while the stream is parked wakes it through the worker's pidfd
/// (the stream waits on the pidfds of the workers holding tasks beside the results
/// queue), not at the queue's next re-check: the parked stream holds an fd
/// registration, and the kill reaches it as a failure naming the worker.
#[test]
fn a_worker_killed_while_the_stream_is_parked_wakes_it_by_its_pidfd() {
    warm_up();
    common::run(secs(90), || {
        let mut data = Samples::new(8);
        let gate = Event::new().unwrap();
        data.gate = Some((0, gate.clone()));
        let mut loader = DataLoader::builder(data)
            .batch_size(2)
            .num_workers(2)
            .build()
            .unwrap();
        let (err, killed) = runtime().block_on(async {
            let before = common::children();
            let mut stream = loader.stream();
            let (words, fds) = (
                multiproc::__testing::parked_word_waits(),
                multiproc::__testing::parked_fd_waits(),
            );
            let (item, killed) = tokio::join!(next(&mut stream), async {
                until_parked(multiproc::__testing::parked_word_waits, words + 1).await;
                until_parked(multiproc::__testing::parked_fd_waits, fds + 1).await;
                // One of the workers the epoch started (both hold a gated batch).
                let victim = *common::children()
                    .difference(&before)
                    .next()
                    .expect("the epoch's workers are children of this process");
                // SAFETY: kill(2) takes no pointers.
                assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
                victim
            });
            (item.unwrap().unwrap_err(), killed)
        });
        gate.set();
        let message = err.to_string();
        assert!(
            matches!(err, Error::LoaderFailed { pid, .. } if pid == killed),
            "{err:?}"
        );
        assert!(message.contains("SIGKILL"), "{message}");
        assert!(!alive(killed));
        assert!(loader.worker_pids().is_empty());
    });
}

#[test]
fn the_timeout_fires_on_a_parked_stream() {
    warm_up();
    common::run(secs(90), || {
        let mut data = Samples::new(8);
        data.fault = Some((4, Fault::Hang));
        let mut loader = DataLoader::builder(data)
            .batch_size(2)
            .num_workers(2)
            .timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        let pids = runtime().block_on(async {
            let mut stream = loader.stream();
            next(&mut stream).await.unwrap().unwrap();
            next(&mut stream).await.unwrap().unwrap();
            let pids = stream.epoch().worker_pids();
            let started = Instant::now();
            let err = next(&mut stream).await.unwrap().unwrap_err();
            let took = started.elapsed();
            assert!(took >= Duration::from_millis(100), "{took:?}");
            // Woken at the deadline itself, not at the parked get's once-a-second
            // re-check (which comes at least half a second after the park).
            assert!(took < Duration::from_millis(480), "{took:?}");
            assert!(err.is_timeout(), "expected a timeout, got {err:?}");
            let message = err.to_string();
            for needle in ["worker 0", &format!("pid {}", pids[0]), "batch 2", "100ms"] {
                assert!(
                    message.contains(needle),
                    "{needle:?} missing from: {message}"
                );
            }
            assert!(next(&mut stream).await.is_none(), "the epoch ended");
            pids
        });
        assert!(loader.worker_pids().is_empty());
        assert!(!alive(pids[0]), "the hung worker was stopped");
    });
}

#[test]
fn dropping_a_stream_mid_epoch_then_a_new_epoch_is_whole() {
    warm_up();
    common::run(secs(90), || {
        let mut data = Samples::new(64);
        data.slow_ms = 5;
        let mut loader = DataLoader::builder(data)
            .batch_size(2)
            .num_workers(2)
            .build()
            .unwrap();
        let rt = runtime();
        let pids = rt.block_on(async {
            let mut stream = loader.stream();
            for want in 0..3 {
                let b = next(&mut stream).await.unwrap().unwrap();
                assert_eq!(labels(&b), [2 * want, 2 * want + 1]);
            }
            let pids = stream.epoch().worker_pids();
            // Also drop a poll that is pending: poll once more, with a no-op context.
            let waker = std::task::Waker::noop();
            let _ = Pin::new(&mut stream).poll_next(&mut std::task::Context::from_waker(waker));
            drop(stream);
            pids
        });
        assert!(
            loader.worker_pids().is_empty(),
            "dropping the stream stopped the workers"
        );
        let until = Instant::now() + Duration::from_secs(10);
        while pids.iter().any(|&p| alive(p)) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(pids.iter().all(|&p| !alive(p)), "the workers ended");
        let whole: Vec<i64> = rt
            .block_on(stream_epoch(&mut loader))
            .into_iter()
            .map(|b| b.expect("batch"))
            .collect::<Vec<_>>()
            .concat();
        assert_eq!(whole, (0..64).collect::<Vec<_>>());
    });
}

#[test]
fn several_loaders_streamed_on_one_task_all_complete() {
    warm_up();
    common::run(secs(90), || {
        let mut loaders: Vec<Loader> = (0..3)
            .map(|k| {
                let mut data = late_first(12 + 4 * k);
                data.slow_ms = 1;
                DataLoader::builder(data)
                    .batch_size(2)
                    .num_workers(2)
                    .build()
                    .unwrap()
            })
            .collect();
        let [a, b, c] = &mut loaders[..] else {
            unreachable!()
        };
        let (ra, rb, rc) = runtime().block_on(async {
            // One task: the three streams are polled by one join.
            tokio::join!(stream_epoch(a), stream_epoch(b), stream_epoch(c))
        });
        for (k, r) in [ra, rb, rc].into_iter().enumerate() {
            let got: Vec<i64> = r
                .into_iter()
                .map(|b| b.expect("batch"))
                .collect::<Vec<_>>()
                .concat();
            assert_eq!(got, (0..(12 + 4 * k as i64)).collect::<Vec<_>>());
        }
    });
}

/// A stream of `0..n`; worker k of m yields k, k + m, …; `fail_at` yields an `Err`.
#[derive(Clone, Serialize, Deserialize)]
struct Records {
    n: usize,
    fail_at: Option<usize>,
}

impl multiproc::data::IterableDataset for Records {
    type Item = i64;
    type Iter = Box<dyn Iterator<Item = multiproc::Result<i64>>>;

    fn iter(&self, _epoch: u64) -> Self::Iter {
        let (k, m) = multiproc::data::worker_info().map_or((0, 1), |w| (w.id, w.num_workers));
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

fn iterable_loader(
    records: Records,
) -> multiproc::data::IterableDataLoader<Records, multiproc::data::DefaultCollate> {
    multiproc::data::DataLoaderBuilder::new(records)
        .batch_size(2)
        .num_workers(2)
        .build_iterable()
        .unwrap()
}

#[test]
fn an_iterable_loader_streams_what_it_iterates() {
    warm_up();
    common::run(secs(90), || {
        let records = Records {
            n: 11,
            fail_at: None,
        };
        let mut loader = iterable_loader(records.clone());
        let iterated: Vec<Vec<i64>> = loader
            .iter()
            .map(|b| b.unwrap().to_vec::<i64>().unwrap())
            .collect();
        let mut loader = iterable_loader(records);
        let streamed = runtime().block_on(async {
            let mut stream = loader.stream();
            let mut out = Vec::new();
            while let Some(b) =
                tokio::time::timeout(WAIT, poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)))
                    .await
                    .expect("a batch within the deadline")
            {
                out.push(b.unwrap().to_vec::<i64>().unwrap());
            }
            out
        });
        assert_eq!(streamed, iterated);
        // Worker 0 streams 0, 2, 4, … and worker 1 streams 1, 3, 5, …: torch's order.
        assert_eq!(streamed[..2], [vec![0, 2], vec![1, 3]]);
        assert_eq!(streamed.concat().len(), 11);

        let mut failing = iterable_loader(Records {
            n: 11,
            fail_at: Some(5),
        });
        let results = runtime().block_on(async {
            let mut stream = failing.stream();
            let mut out = Vec::new();
            while let Some(b) =
                tokio::time::timeout(WAIT, poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)))
                    .await
                    .expect("a batch within the deadline")
            {
                out.push(b.map(|t| t.to_vec::<i64>().unwrap()));
            }
            out
        });
        let last = results.last().expect("some items");
        match last {
            Err(Error::LoaderFailed {
                worker: Some(1),
                message,
                ..
            }) => assert!(message.contains("record 5 is truncated"), "{message}"),
            other => panic!("expected worker 1's failure, got {other:?}"),
        }
        assert!(failing.worker_pids().is_empty());
    });
}
