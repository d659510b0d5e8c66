//! A data loader's stream with `prefetch_to` (features `cuda` and `async`): the copies
//! of the batches pulled ahead run on the device while the stream is parked, and the
//! driver's stream callback wakes it when the oldest batch is on the device.
//!
//! - the stream yields the iterator's batches, on the device, in order, counting in
//!   the state only the batches handed over, over two epochs;
//! - a stream whose only wake-up can come from the driver (no workers: batches are
//!   loaded in `poll_next` itself) parks on the copies and is woken when they are done;
//! - a stream dropped with copies in flight leaves nothing behind on the device, and
//!   the next epoch is whole;
//! - an iterable loader's stream pins its batches (`pin_memory`) or hands them over on
//!   the device (`prefetch_to`), in order.
//!
//! The tests are `#[ignore = "needs a CUDA device"]`: `scripts/gpu_check.sh` runs them
//! on a GPU, and `scripts/cuda_fake_check.sh` against the stand-in libcuda (whose
//! stream callbacks run on a thread of their own 30 ms later, as the driver's
//! do). Every test runs under `common::run` (a deadline, and /dev/shm, fd and child
//! counts unchanged at its end).

multiproc::test_init!();

mod common;

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use common::cuda::*;
use futures_core::Stream;
use multiproc::data::{DataLoader, DataLoaderBuilder};
use multiproc::{Device, cuda};

/// How long one awaited batch may take before the test fails.
const WAIT: Duration = Duration::from_secs(30);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The next item of `stream`, within `WAIT`.
async fn next<S: Stream + Unpin>(stream: &mut S) -> Option<S::Item> {
    tokio::time::timeout(WAIT, poll_fn(|cx| Pin::new(&mut *stream).poll_next(cx)))
        .await
        .expect("a batch within the wait")
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_prefetching_stream_yields_the_iterators_batches_on_the_device_in_order() {
    warm_up_cuda();
    common::async_rt::warm_up();
    common::run(DEADLINE, || {
        let (mut cpu, mut gpu) = ramp_loaders_without_and_with_prefetch();
        runtime().block_on(async {
            for epoch in 0..2 {
                let mut stream = gpu.stream();
                let mut n = 0;
                for (b, want) in cpu.iter().enumerate() {
                    let got = next(&mut stream).await.expect("as many batches").unwrap();
                    same_batch_on_device(
                        &got,
                        &want.unwrap(),
                        &format!("batch {b} of epoch {epoch}"),
                    );
                    // Batches pulled ahead are not counted as yielded.
                    if b + 1 < 15 {
                        assert_eq!(
                            stream.epoch().state_dict().position(),
                            Some((b + 1) * 6),
                            "state after batch {b}"
                        );
                    }
                    n += 1;
                }
                assert_eq!(n, 15);
                assert!(next(&mut stream).await.is_none(), "no batch past the end");
            }
        });
    });
}

/// A waker that counts its wake-ups and unparks the polling thread.
struct Unpark {
    woken: AtomicUsize,
    thread: std::thread::Thread,
}

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_stream_parks_on_the_copies_and_the_driver_wakes_it() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let (n, width, batch) = (24, 256, 4);
        // No workers: every batch is loaded in poll_next, so a Pending can only be the
        // copies', and only the driver's callback can wake the stream again.
        let mut loader = DataLoader::builder(Ramp { n, width })
            .batch_size(batch)
            .prefetch_to(GPU, 2)
            .build()
            .unwrap();
        let waker = Arc::new(Unpark {
            woken: AtomicUsize::new(0),
            thread: std::thread::current(),
        });
        let w = Waker::from(Arc::clone(&waker));
        let mut cx = Context::from_waker(&w);
        let mut stream = loader.stream();
        let (mut pending, mut got) = (0, 0);
        let deadline = Instant::now() + WAIT;
        loop {
            let woken = waker.woken.load(Ordering::SeqCst);
            match Pin::new(&mut stream).poll_next(&mut cx) {
                Poll::Ready(None) => break,
                Poll::Ready(Some(b)) => {
                    let (x, y) = b.unwrap();
                    assert_eq!(x.device(), GPU);
                    check_ramp_batch(&x, &y, got * batch, batch, width);
                    got += 1;
                }
                Poll::Pending => {
                    pending += 1;
                    // Parked: only a wake-up lets it go on.
                    while waker.woken.load(Ordering::SeqCst) == woken {
                        assert!(
                            Instant::now() < deadline,
                            "a stream parked on its copies was never woken ({got} batches in)"
                        );
                        std::thread::park_timeout(Duration::from_millis(100));
                    }
                }
            }
        }
        assert_eq!(got, n / batch);
        eprintln!("{got} batches, {pending} polls parked on copies");
        if fake_host_counts().is_some() {
            // The stand-in runs a stream's copies only in its callback, 30 ms after
            // it is queued; pulling three small batches takes far less, so the first
            // poll finds the first batch's copies running.
            assert!(pending > 0, "the stream never parked on its copies");
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_stream_dropped_with_copies_in_flight_leaks_nothing() {
    warm_up_cuda();
    common::async_rt::warm_up();
    common::run(DEADLINE, || {
        cuda::empty_cache();
        let free_before = free_device_memory();
        let width = 1 << 16;
        let mut loader = DataLoader::builder(Ramp { n: 64, width })
            .batch_size(4)
            .num_workers(2)
            .prefetch_to(GPU, 4)
            .build()
            .unwrap();
        runtime().block_on(async {
            let mut stream = loader.stream();
            let (x, y) = next(&mut stream).await.unwrap().unwrap();
            check_ramp_batch(&x, &y, 0, 4, width);
            // The next poll pulls more batches and issues their copies; it may park.
            let more = poll_fn(|cx| Poll::Ready(Pin::new(&mut stream).poll_next(cx))).await;
            drop(more);
            drop(stream); // batches staged, their copies issued
            drop((x, y));
            // The next epoch starts where it should and is correct: the dropped
            // stream's copies did not land in memory it handed back.
            let mut stream = loader.stream();
            let (x, y) = next(&mut stream).await.unwrap().unwrap();
            check_ramp_batch(&x, &y, 0, 4, width);
        });
        drop(loader);
        cuda::empty_cache();
        // Every staged batch's device memory came back once its copy was done.
        assert_device_memory_back(free_before);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_iterable_loaders_stream_pins_or_prefetches_its_batches() {
    warm_up_cuda();
    common::async_rt::warm_up();
    common::run(DEADLINE, || {
        for prefetch in [false, true] {
            let builder = DataLoaderBuilder::new(Count(30))
                .batch_size(5)
                .num_workers(2);
            let mut loader = if prefetch {
                builder.prefetch_to(GPU, 2)
            } else {
                builder.pin_memory(true)
            }
            .build_iterable()
            .unwrap();
            let seen = runtime().block_on(async {
                let mut stream = loader.stream();
                let mut seen = Vec::new();
                while let Some(batch) = next(&mut stream).await {
                    let batch = batch.unwrap();
                    let what = format!("batch {} (prefetch {prefetch})", seen.len() / 5);
                    let batch = if prefetch {
                        assert_eq!(batch.device(), GPU, "{what}");
                        batch.to(Device::Cpu).unwrap()
                    } else {
                        assert!(batch.is_pinned(), "{what}");
                        batch
                    };
                    seen.extend(batch.to_vec::<i64>().unwrap());
                }
                seen
            });
            // Each of the two workers streams the whole range, in turn.
            let want: Vec<i64> = (0..6)
                .flat_map(|b| (0..2).flat_map(move |_| b * 5..b * 5 + 5))
                .collect();
            assert_eq!(seen, want, "prefetch {prefetch}");
        }
    });
}
