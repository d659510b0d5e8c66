//! Feature `async` (issue 23): awaited waits across real processes, on tokio.
//!
//! - cancel-safety: thousands of `get_async` futures dropped at random points while
//!   producer processes put; every item arrives exactly once, and a bounded queue's
//!   places all come back (a `put_async` parked on the full queue included);
//! - `Disconnected` reaches an awaiting task when the only producer exits, and when it
//!   is SIGKILLed: within 100 ms either way (a `Queue` and a `SimpleQueue`);
//! - a message kept back because two processes stopped inside the queue's custody
//!   reaches a parked get once they resume (its one re-check of an idle queue).
//!
//! Idle CPU is tests/async_idle.rs (a process of its own, so that nothing else runs
//! while it reads the process's CPU time). Events, joins, pipes, joinable queues, process contexts and the reactor threads are
//! tests/async_sync.rs; the runtime and warm-up they share are in tests/common/async_rt.rs.
//!
//! Every test runs under `common::run` (a deadline, and /dev/shm, fd and child counts
//! unchanged at its end). The reactor threads and the fd reactor's eventfd live as long
//! as the process: `common::async_rt::warm_up` makes them exist before a test counts fds.

multiproc::test_init!();

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::async_rt::*;
use multiproc::{DType, Event, Process, Queue, SimpleQueue, StartMethod, Tensor, start_processes};

fn checksum(rank: u32, i: u32) -> u64 {
    (u64::from(rank) << 32 | u64::from(i)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xA5A5
}

/// Puts `count` checksummed items, pausing now and then so that the parent's getters
/// often find the queue empty (and park, and get dropped while parked).
fn produce(rank: usize, (q, count): (Queue<(u32, u32, u64)>, u32)) -> multiproc::Result<()> {
    let rank = rank as u32;
    for i in 0..count {
        q.put((rank, i, checksum(rank, i)))?;
        std::thread::sleep(Duration::from_micros(300));
    }
    Ok(())
}

#[test]
fn dropped_get_futures_lose_nothing_and_leak_no_place() {
    warm_up();
    common::run(DEADLINE, || {
        const PRODUCERS: usize = 3;
        const EACH: u32 = 2000;
        const CAPACITY: usize = 16;
        let total = PRODUCERS * EACH as usize;
        let q = Queue::<(u32, u32, u64)>::with_capacity(CAPACITY).unwrap();
        let mut producers =
            start_processes(produce, (q.clone(), EACH), PRODUCERS, StartMethod::Spawn).unwrap();
        let rt = runtime();
        let received = Arc::new(std::sync::Mutex::new(Vec::with_capacity(total)));
        let dropped = Arc::new(AtomicUsize::new(0));
        let until = Instant::now() + Duration::from_secs(60);
        rt.block_on(async {
            let mut consumers = Vec::new();
            for seed in 0..4u64 {
                let (q, received, dropped) =
                    (q.clone(), Arc::clone(&received), Arc::clone(&dropped));
                consumers.push(tokio::spawn(async move {
                    let mut rng = common::Rng(seed * 7919 + 1);
                    let done = |r: &std::sync::Mutex<Vec<_>>| r.lock().unwrap().len() >= total;
                    while !done(&received) && Instant::now() < until {
                        let got = match rng.below(4) {
                            // A timeout of up to 300 µs (tokio rounds it up to its 1 ms tick).
                            0 => tokio::time::timeout(
                                Duration::from_micros(rng.below(300)),
                                q.get_async(),
                            )
                            .await
                            .ok(),
                            // Dropped right after its first poll parked it (or not).
                            1 => tokio::select! {
                                biased;
                                item = q.get_async() => Some(item),
                                () = tokio::task::yield_now() => None,
                            },
                            // Two gets race; the loser is dropped, wherever it was.
                            2 => tokio::select! {
                                item = q.get_async() => Some(item),
                                item = q.get_async() => Some(item),
                                () = tokio::time::sleep(Duration::from_millis(2)) => None,
                            },
                            // Awaited to the end (with a bound, to re-check `done`).
                            _ => tokio::time::timeout(Duration::from_millis(50), q.get_async())
                                .await
                                .ok(),
                        };
                        match got {
                            Some(item) => received.lock().unwrap().push(item.unwrap()),
                            None => {
                                dropped.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }));
            }
            for c in consumers {
                c.await.unwrap();
            }
        });
        producers.join_timeout(WAIT).unwrap();
        let received = received.lock().unwrap().clone();
        let dropped = dropped.load(Ordering::Relaxed);
        eprintln!(
            "cancel-safety: {} items received, {dropped} get futures dropped unfinished",
            received.len()
        );
        assert_eq!(received.len(), total, "every item exactly once");
        let distinct: HashSet<(u32, u32)> = received.iter().map(|&(r, i, _)| (r, i)).collect();
        assert_eq!(distinct.len(), total, "no item twice");
        assert!(
            received.iter().all(|&(r, i, c)| c == checksum(r, i)),
            "every checksum"
        );
        assert!(dropped >= 1000, "only {dropped} futures were dropped");
        // Nothing left over (and nobody else holds the queue any more).
        let left = q.try_get();
        assert!(
            left.as_ref().is_err_and(|e| e.is_disconnected()),
            "{left:?}"
        );
        // Every place came back: the queue fills to its capacity, no further.
        rt.block_on(async {
            for i in 0..CAPACITY as u32 {
                q.try_put((9, i, 0)).unwrap();
            }
            assert!(q.is_full());
            // put_async parks on the full queue; dropped ones leave no trace ...
            for _ in 0..200 {
                let cancelled =
                    tokio::time::timeout(Duration::from_micros(100), q.put_async((8, 0, 0))).await;
                assert!(cancelled.is_err(), "a put on a full queue completed");
            }
            // ... and one that waits completes when a place comes back.
            let base = multiproc::__testing::parked_word_waits();
            let putter = {
                let q = q.clone();
                tokio::spawn(async move { q.put_async((7, 0, 0)).await.map_err(|e| e.error) })
            };
            until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
            assert!(!putter.is_finished(), "put_async returned on a full queue");
            assert_eq!(q.get_async().await.unwrap(), (9, 0, 0));
            tokio::time::timeout(WAIT, putter)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let mut left = Vec::new();
            while let Ok(Some(item)) = q.try_get() {
                left.push(item);
            }
            assert_eq!(left.len(), CAPACITY, "{left:?}");
            assert_eq!(left.last(), Some(&(7, 0, 0)));
        });
        drop(rt);
    });
}

#[test]
fn put_async_waits_for_room_on_a_full_socket() {
    warm_up();
    common::run(DEADLINE, || {
        // Unbounded, but each item is larger than a ring slot: it goes on the queue's
        // socket, whose buffer fills.
        let q = Queue::<Vec<u8>>::new().unwrap();
        let mut put = 0usize;
        while q.try_put(vec![put as u8; 32 << 10]).is_ok() {
            put += 1;
            assert!(put < 100_000, "the socket never filled");
        }
        let rt = runtime();
        rt.block_on(async {
            for _ in 0..50 {
                let dropped =
                    tokio::time::timeout(Duration::from_micros(100), q.put_async(vec![0xEE; 8]))
                        .await;
                assert!(dropped.is_err(), "a put on a full socket completed");
            }
            let base = multiproc::__testing::parked_fd_waits();
            let putter = {
                let q = q.clone();
                tokio::spawn(async move { q.put_async(vec![0xFF; 8]).await.map_err(|e| e.error) })
            };
            until_parked(multiproc::__testing::parked_fd_waits, base + 1).await;
            assert!(!putter.is_finished(), "put_async returned on a full socket");
            let mut got = Vec::new();
            while got.len() < put {
                got.push(
                    tokio::time::timeout(WAIT, q.get_async())
                        .await
                        .unwrap()
                        .unwrap(),
                );
            }
            tokio::time::timeout(WAIT, putter)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert_eq!(q.get_async().await.unwrap(), vec![0xFF; 8]);
            assert!(
                got.iter()
                    .enumerate()
                    .all(|(i, v)| v[0] == i as u8 && v.len() == 32 << 10)
            );
        });
        drop(rt);
    });
}

/// Puts three items, waits for `go` and returns: its handle of the queue is dropped on
/// the way out.
fn put_three_and_leave(_rank: usize, (q, go): (Queue<u32>, Event)) -> multiproc::Result<()> {
    for i in 0..3 {
        q.put(i)?;
    }
    go.wait_timeout(WAIT)
}

/// Says it is ready and waits to be killed.
fn say_ready_and_hang(ready: &Event) {
    ready.set();
    std::thread::sleep(Duration::from_secs(600));
}

/// Puts three items, says so, and waits to be killed.
fn put_three_and_hang(_rank: usize, (q, ready): (Queue<u32>, Event)) -> multiproc::Result<()> {
    for i in 0..3 {
        q.put(i)?;
    }
    say_ready_and_hang(&ready);
    Ok(())
}

#[test]
fn disconnected_reaches_an_awaiting_task_when_the_only_producer_leaves() {
    warm_up();
    common::run(DEADLINE, || {
        let rt = runtime();
        rt.block_on(async {
            // The producer returns (and drops its handle).
            let q = Queue::<u32>::new().unwrap();
            let go = Event::new().unwrap();
            let mut producer = Process::builder(put_three_and_leave, 0, (q.clone(), go.clone()))
                .start()
                .unwrap();
            let mut got = Vec::new();
            for _ in 0..3 {
                got.push(
                    tokio::time::timeout(WAIT, q.get_async())
                        .await
                        .unwrap()
                        .unwrap(),
                );
            }
            assert_eq!(got, [0, 1, 2]);
            let base = multiproc::__testing::parked_word_waits();
            let getter = tokio::spawn(async move {
                let r = q.get_async().await;
                (r, Instant::now())
            });
            until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
            assert!(
                !getter.is_finished(),
                "the get did not wait for the live producer"
            );
            let told = Instant::now();
            go.set();
            let (end, at) = tokio::time::timeout(WAIT, getter).await.unwrap().unwrap();
            assert!(end.as_ref().is_err_and(|e| e.is_disconnected()), "{end:?}");
            let after = at.saturating_duration_since(told);
            assert!(
                tokio::time::timeout(WAIT, producer.join_async())
                    .await
                    .unwrap()
                    .unwrap()
                    .success()
            );
            eprintln!(
                "disconnect after a producer's return reached the awaiting get after {after:?}"
            );
            // The producer's dropped handle rang the queue: no wait for the re-check.
            assert!(after < Duration::from_millis(800), "{after:?}");

            // The producer is SIGKILLed while the get is parked.
            let q = Queue::<u32>::new().unwrap();
            let ready = Event::new().unwrap();
            let mut producer = Process::builder(put_three_and_hang, 0, (q.clone(), ready.clone()))
                .start()
                .unwrap();
            tokio::time::timeout(WAIT, ready.wait_async())
                .await
                .unwrap()
                .unwrap();
            for i in 0..3 {
                assert_eq!(
                    tokio::time::timeout(WAIT, q.get_async())
                        .await
                        .unwrap()
                        .unwrap(),
                    i
                );
            }
            let base = multiproc::__testing::parked_word_waits();
            let getter = {
                let q = q.clone();
                tokio::spawn(async move {
                    let r = q.get_async().await;
                    (r, Instant::now())
                })
            };
            until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
            assert!(
                !getter.is_finished(),
                "the get did not wait for the live producer"
            );
            drop(q); // the task's handle is the only one left here
            producer.kill().unwrap();
            let killed = Instant::now();
            let (end, at) = tokio::time::timeout(WAIT, getter).await.unwrap().unwrap();
            assert!(end.as_ref().is_err_and(|e| e.is_disconnected()), "{end:?}");
            let status = tokio::time::timeout(WAIT, producer.join_async())
                .await
                .unwrap()
                .unwrap();
            assert!(!status.success());
            let after = at.saturating_duration_since(killed);
            eprintln!(
                "disconnect after a producer's SIGKILL reached the awaiting get after {after:?}"
            );
            // The kernel closed the dead producer's holder lease, which the parked get
            // watches: no wait for its one-second re-check.
            assert!(after < Duration::from_millis(100), "{after:?}");
        });
        drop(rt);
    });
}

/// Holds the queue, says so, and waits to be killed.
fn hold_and_hang(_rank: usize, (q, ready): (SimpleQueue<u32>, Event)) -> multiproc::Result<()> {
    say_ready_and_hang(&ready);
    drop(q);
    Ok(())
}

/// Parks a get on `q`, whose only other holder is `holder`, SIGKILLs `holder`, and
/// requires `Disconnected` within 100 ms.
async fn killing_the_holder_ends_a_parked_get(q: SimpleQueue<u32>, holder: &mut Process) {
    let base = multiproc::__testing::parked_word_waits();
    let getter = tokio::spawn(async move { (q.get_async().await, Instant::now()) });
    until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
    assert!(
        !getter.is_finished(),
        "the get did not wait for the live holder"
    );
    holder.kill().unwrap();
    let killed = Instant::now();
    let (end, at) = tokio::time::timeout(WAIT, getter).await.unwrap().unwrap();
    assert!(end.as_ref().is_err_and(|e| e.is_disconnected()), "{end:?}");
    let after = at.saturating_duration_since(killed);
    assert!(after < Duration::from_millis(100), "{after:?}");
    let status = tokio::time::timeout(WAIT, holder.join_async())
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success());
}

#[test]
fn a_killed_last_holder_ends_an_awaited_simple_queue_get_at_once() {
    warm_up();
    common::run(DEADLINE, || {
        let rt = runtime();
        rt.block_on(async {
            for _ in 0..3 {
                let q = SimpleQueue::<u32>::new().unwrap();
                let ready = Event::new().unwrap();
                let mut holder = Process::builder(hold_and_hang, 0, (q.clone(), ready.clone()))
                    .start()
                    .unwrap();
                tokio::time::timeout(WAIT, ready.wait_async())
                    .await
                    .unwrap()
                    .unwrap();
                killing_the_holder_ends_a_parked_get(q, &mut holder).await;
            }
        });
        drop(rt);
    });
}

/// Drops the queue it inherited from its `fork` parent and returns.
fn drop_in_a_fork_child(_rank: usize, q: SimpleQueue<u32>) -> multiproc::Result<()> {
    drop(q);
    Ok(())
}

#[test]
fn a_fork_child_that_drops_an_inherited_queue_leaves_the_parents_holder_watch() {
    warm_up();
    common::run(DEADLINE, || {
        let rt = runtime();
        rt.block_on(async {
            let q = SimpleQueue::<u32>::new().unwrap();
            let ready = Event::new().unwrap();
            let mut holder = Process::builder(hold_and_hang, 0, (q.clone(), ready.clone()))
                .start()
                .unwrap();
            tokio::time::timeout(WAIT, ready.wait_async())
                .await
                .unwrap()
                .unwrap();
            // A get polled here makes this process's watch of the queue's holders.
            assert!(
                tokio::time::timeout(Duration::from_millis(20), q.get_async())
                    .await
                    .is_err()
            );
            // A fork child inherits the queue, watch included, and drops it: the watch
            // stays the parent's (the child must not remove it from the inotify
            // instance they share).
            let mut child = Process::builder(drop_in_a_fork_child, 0, q.clone())
                .start_method(StartMethod::Fork)
                .start()
                .unwrap();
            let status = tokio::time::timeout(WAIT, child.join_async())
                .await
                .unwrap()
                .unwrap();
            assert!(status.success(), "{status:?} {:?}", child.error());
            killing_the_holder_ends_a_parked_get(q, &mut holder).await;
        });
        drop(rt);
    });
}

/// Puts one fresh tensor (its block goes into the queue's custody, where a receiver
/// that does not map it must look it up) and exits.
fn put_a_tensor(_rank: usize, q: Queue<Tensor>) -> multiproc::Result<()> {
    q.put(Tensor::full(&[1 << 12], 7.0, DType::F32)?)?;
    Ok(())
}

/// Stops inside the lock of one shelf of the queue's custody (see
/// `common::stopping`); once continued, lets go of it and stays, holding the queue,
/// until `leave` is set (so that no holder's end wakes anyone meanwhile).
fn stop_in_the_custody_then_stay(
    rank: usize,
    (q, shelf, holding, leave): (Queue<Tensor>, usize, Event, Event),
) -> multiproc::Result<()> {
    common::stopping::stop_inside_the_custody_lock(rank, (q.clone(), shelf, holding))?;
    leave.wait_timeout(WAIT)?;
    Ok(())
}

/// A message whose decode finds both shelves of the custody taken (each by a process
/// stopped inside it) is kept back, and its holders let go of the shelves without a
/// wake-up: the parked get must look again by itself (the one case of an idle queue
/// where it re-checks), so it returns once they are continued, while they still hold
/// the queue.
#[test]
fn an_awaited_get_whose_message_a_stopped_custody_kept_back_returns_once_it_resumes() {
    use common::stopping::continue_process;
    warm_up();
    common::run(DEADLINE, || {
        let q = Queue::<Tensor>::new().unwrap();
        let leave = Event::new().unwrap();
        let mut holders: Vec<(Process, Event)> = (0..2)
            .map(|shelf| {
                let holding = Event::new().unwrap();
                let p = Process::builder(
                    stop_in_the_custody_then_stay,
                    0,
                    (q.clone(), shelf, holding.clone(), leave.clone()),
                )
                .start()
                .unwrap();
                (p, holding)
            })
            .collect();
        for (_, holding) in &holders {
            holding.wait_timeout(WAIT).unwrap();
        }
        let mut producer = start_processes(put_a_tensor, q.clone(), 1, StartMethod::Spawn).unwrap();
        producer.join_timeout(WAIT).unwrap();
        let rt = runtime();
        let got = rt.block_on(async {
            let base = multiproc::__testing::parked_word_waits();
            let spawned = Instant::now();
            let getter = {
                let q = q.clone();
                tokio::spawn(async move { q.get_async().await })
            };
            // Its decode gave up on the custody (both shelves held), kept the message
            // and parked, without holding up its executor thread for long: its tries
            // look up the custody briefly (they used to wait half a second each).
            until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
            let to_park = spawned.elapsed();
            let parked_first = !getter.is_finished();
            for (p, _) in &holders {
                continue_process(p);
            }
            let got = tokio::time::timeout(Duration::from_secs(10), getter).await;
            (parked_first, to_park, got)
        });
        leave.set();
        for (p, _) in &mut holders {
            p.join_timeout(WAIT).unwrap();
        }
        let (parked_first, to_park, got) = got;
        assert!(parked_first, "the get returned while the custody was held");
        assert!(
            to_park < Duration::from_millis(400),
            "the get's tries held its thread for {to_park:?} before it parked"
        );
        let t = got
            .expect("the parked get looked again once the custody was free")
            .unwrap()
            .unwrap();
        assert_eq!(t.sum().unwrap(), 7.0 * 4096.0);
    });
}
