//! Feature `async` (issue 23): the pool's results awaited, with real worker processes,
//! on tokio.
//!
//! - `AsyncResult::get_async`, `MapResult::get_async` and `Imap::next_async` return what
//!   the blocking forms return;
//! - cancel-safety: a future dropped before its result arrived takes nothing, so a later
//!   `get` (or `get_async`) still returns it; `next_async` futures dropped at random
//!   points lose no item of an `imap`;
//! - a task that fails (panics, returns `Err`) or is cut short by `terminate` gives the
//!   same error through `get_async` as through `get`;
//! - hundreds of results awaited at once on a multi-thread runtime.
//!
//! Every test runs under `common::run` (a deadline, and /dev/shm, fd and child counts
//! unchanged at its end), and every await has a timeout. The pool's results need no
//! reactor thread (the dispatcher wakes the task itself); but tokio's first runtime
//! opens a process-wide socket pair (its signal driver's) that it keeps: `warm_up`
//! makes it exist before a test counts fds.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use multiproc::{Error, Pool};

const DEADLINE: Duration = Duration::from_secs(120);
const WAIT: Duration = Duration::from_secs(30);

fn square(x: u64) -> Result<u64, String> {
    Ok(x * x)
}

/// `x * x` after `ms` milliseconds.
fn slow_square((x, ms): (u64, u64)) -> Result<u64, String> {
    std::thread::sleep(Duration::from_millis(ms));
    Ok(x * x)
}

fn fails_on_37(x: u32) -> Result<u32, String> {
    match x {
        37 => panic!("task {x} refuses"),
        38 => Err(format!("task {x} declines")),
        _ => Ok(x),
    }
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Builds a first runtime, so that tokio's process-wide fds exist before a count.
fn warm_up() {
    current_thread().block_on(tokio::task::yield_now());
    drop(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
}

#[test]
fn awaited_results_are_the_blocking_ones() {
    warm_up();
    common::run(DEADLINE, || {
        let pool = Pool::new(2).unwrap();
        current_thread().block_on(async {
            let mut one = pool.apply_async(square, 7).unwrap();
            let got = tokio::time::timeout(WAIT, one.get_async()).await.unwrap();
            assert_eq!(got.unwrap(), 49);

            let mut many = pool.map_async(square, 0..100u64).unwrap();
            let got = tokio::time::timeout(WAIT, many.get_async()).await.unwrap();
            assert_eq!(got.unwrap(), (0..100).map(|x| x * x).collect::<Vec<_>>());
            // As with `get`, the results are handed out once.
            let again = tokio::time::timeout(WAIT, many.get_async()).await.unwrap();
            assert!(matches!(again, Err(Error::InvalidArgument(_))), "{again:?}");
            assert!(matches!(many.get(), Err(Error::InvalidArgument(_))));

            // An empty map is ready at once.
            let mut none = pool.map_async(square, Vec::<u64>::new()).unwrap();
            let got = tokio::time::timeout(WAIT, none.get_async()).await.unwrap();
            assert_eq!(got.unwrap(), Vec::<u64>::new());

            let mut ordered = pool.imap(square, 0..300u64);
            let mut got = Vec::new();
            while let Some(r) = tokio::time::timeout(WAIT, ordered.next_async())
                .await
                .unwrap()
            {
                got.push(r.unwrap());
            }
            assert_eq!(got, (0..300).map(|x| x * x).collect::<Vec<_>>());
            drop(ordered);

            let mut unordered = pool.imap_unordered(square, 0..100u64);
            let mut got = Vec::new();
            while let Some(r) = tokio::time::timeout(WAIT, unordered.next_async())
                .await
                .unwrap()
            {
                got.push(r.unwrap());
            }
            got.sort_unstable();
            assert_eq!(got, (0..100).map(|x| x * x).collect::<Vec<_>>());
        });
    });
}

#[test]
fn a_dropped_future_loses_no_result() {
    warm_up();
    common::run(DEADLINE, || {
        let pool = Pool::new(2).unwrap();
        current_thread().block_on(async {
            // Dropped while parked (the task takes 400 ms); the blocking get then has it.
            let mut one = pool.apply_async(slow_square, (6, 400)).unwrap();
            let early = tokio::time::timeout(Duration::from_millis(20), one.get_async()).await;
            assert!(early.is_err(), "the result came too early: {early:?}");
            assert_eq!(one.get_timeout(WAIT).unwrap(), 36);

            // Dropped while parked, then the result arrives with no future to wake (the
            // stale waker is woken and ignored); a fresh `get_async` then has it.
            let mut two = pool.apply_async(slow_square, (5, 200)).unwrap();
            let early = tokio::time::timeout(Duration::from_millis(20), two.get_async()).await;
            assert!(early.is_err());
            let until = Instant::now() + WAIT;
            while !two.ready() {
                assert!(Instant::now() < until, "the result never arrived");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let got = tokio::time::timeout(WAIT, two.get_async()).await.unwrap();
            assert_eq!(got.unwrap(), 25);

            // A map_async whose future is dropped part-way keeps what had arrived.
            let items: Vec<(u64, u64)> = (0..8).map(|x| (x, 50 * (x % 4))).collect();
            let mut many = pool.map_async(slow_square, items).unwrap();
            let early = tokio::time::timeout(Duration::from_millis(60), many.get_async()).await;
            assert!(early.is_err());
            assert_eq!(
                many.get_timeout(WAIT).unwrap(),
                (0..8).map(|x| x * x).collect::<Vec<_>>()
            );

            // `next_async` futures dropped after their first poll, again and again: the
            // imap still yields every item, in order.
            let mut imap = pool.imap(slow_square, (0..60u64).map(|x| (x, x % 3)));
            let (mut got, mut dropped) = (Vec::new(), 0u32);
            loop {
                let step = tokio::time::timeout(WAIT, async {
                    tokio::select! {
                        biased;
                        r = imap.next_async() => Some(r),
                        () = tokio::task::yield_now() => None,
                    }
                })
                .await
                .unwrap();
                match step {
                    Some(Some(r)) => got.push(r.unwrap()),
                    Some(None) => break,
                    None => dropped += 1,
                }
            }
            assert_eq!(got, (0..60).map(|x| x * x).collect::<Vec<_>>());
            assert!(dropped > 0, "no next_async future was dropped unfinished");
        });
    });
}

#[test]
fn failures_read_the_same_through_get_async_and_get() {
    warm_up();
    common::run(DEADLINE, || {
        let pool = Pool::new(2).unwrap();
        current_thread().block_on(async {
            for x in [37, 38] {
                let mut blocking = pool.apply_async(fails_on_37, x).unwrap();
                let mut awaited = pool.apply_async(fails_on_37, x).unwrap();
                let a = tokio::time::timeout(WAIT, awaited.get_async())
                    .await
                    .unwrap()
                    .unwrap_err();
                let b = blocking.get_timeout(WAIT).unwrap_err();
                assert!(matches!(a, Error::TaskFailed { .. }), "{a:?}");
                assert_eq!(a.to_string(), b.to_string());
            }

            let mut blocking = pool.map_async(fails_on_37, 0..50u32).unwrap();
            let mut awaited = pool.map_async(fails_on_37, 0..50u32).unwrap();
            let a = tokio::time::timeout(WAIT, awaited.get_async())
                .await
                .unwrap()
                .unwrap_err();
            let b = blocking.get_timeout(WAIT).unwrap_err();
            assert!(matches!(a, Error::TaskFailed { index: 37, .. }), "{a:?}");
            assert_eq!(a.to_string(), b.to_string());

            // imap: the failures come per item, the others still come.
            let mut imap = pool.imap(fails_on_37, 30..40u32);
            let mut failed = Vec::new();
            while let Some(r) = tokio::time::timeout(WAIT, imap.next_async()).await.unwrap() {
                if let Err(e) = r {
                    failed.push(e);
                }
            }
            assert!(matches!(
                failed[..],
                [
                    Error::TaskFailed { index: 7, .. },
                    Error::TaskFailed { index: 8, .. }
                ]
            ));
        });

        // Cut short by `terminate`: an awaiting task and a later blocking `get` see the
        // same error.
        let mut pool = Pool::new(1).unwrap();
        let mut blocking = pool.apply_async(slow_square, (1, 10_000)).unwrap();
        let mut awaited = pool.apply_async(slow_square, (2, 10_000)).unwrap();
        let a = current_thread().block_on(async {
            let wait = awaited.get_async();
            // `join!` polls `wait` first: it is parked when `terminate` runs.
            let terminate = async {
                pool.terminate();
            };
            let (a, ()) = tokio::time::timeout(WAIT, async { tokio::join!(wait, terminate) })
                .await
                .unwrap();
            a.unwrap_err()
        });
        pool.join_timeout(WAIT).unwrap();
        let b = blocking.get_timeout(WAIT).unwrap_err();
        assert!(
            matches!(a, Error::Closed(_) | Error::TaskFailed { .. }),
            "{a:?}"
        );
        assert_eq!(
            std::mem::discriminant(&a),
            std::mem::discriminant(&b),
            "{a:?} / {b:?}"
        );
        // After the dispatcher is gone, both forms say so, alike.
        let a = current_thread()
            .block_on(async { tokio::time::timeout(WAIT, awaited.get_async()).await })
            .unwrap()
            .unwrap_err();
        let b = blocking.get_timeout(WAIT).unwrap_err();
        assert_eq!(a.to_string(), b.to_string());
    });
}

#[test]
fn many_results_awaited_at_once() {
    warm_up();
    common::run(DEADLINE, || {
        let pool = Pool::new(3).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut tasks = Vec::new();
            for x in 0..300u64 {
                let mut r = pool.apply_async(slow_square, (x, x % 5)).unwrap();
                tasks.push(tokio::spawn(async move {
                    tokio::time::timeout(WAIT, r.get_async()).await
                }));
            }
            let mut maps = Vec::new();
            for k in 0..10u64 {
                let mut m = pool.map_async(square, k * 10..k * 10 + 10).unwrap();
                maps.push(tokio::spawn(async move {
                    tokio::time::timeout(WAIT, m.get_async()).await
                }));
            }
            for (x, t) in (0..300u64).zip(tasks) {
                assert_eq!(t.await.unwrap().unwrap().unwrap(), x * x);
            }
            for (k, m) in (0..10u64).zip(maps) {
                let want: Vec<u64> = (k * 10..k * 10 + 10).map(|x| x * x).collect();
                assert_eq!(m.await.unwrap().unwrap().unwrap(), want);
            }
        });
    });
}

/// An `Imap` and its `next_async` future are `Send`: tasks of a multi-thread runtime
/// (an axum or tonic handler) each await one, and may move between threads meanwhile.
#[test]
fn imaps_are_awaited_in_tasks_of_a_multi_thread_runtime() {
    warm_up();
    common::run(DEADLINE, || {
        let pool = std::sync::Arc::new(Pool::new(2).unwrap());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let sums: Vec<u64> = rt.block_on(async {
            let tasks: Vec<_> = (0..4u64)
                .map(|k| {
                    let pool = pool.clone();
                    tokio::spawn(async move {
                        let mut imap = pool.imap(square, k * 100..(k + 1) * 100);
                        let mut sum = 0;
                        while let Some(r) = imap.next_async().await {
                            sum += r.unwrap();
                            tokio::task::yield_now().await;
                        }
                        sum
                    })
                })
                .collect();
            let mut sums = Vec::new();
            for t in tasks {
                sums.push(tokio::time::timeout(WAIT, t).await.unwrap().unwrap());
            }
            sums
        });
        for (k, sum) in sums.iter().enumerate() {
            let k = k as u64;
            assert_eq!(*sum, (k * 100..(k + 1) * 100).map(|x| x * x).sum::<u64>());
        }
        drop(rt);
    });
}
