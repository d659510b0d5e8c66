//! Feature `async` (issue 23): awaited waits across real processes, on tokio.
//!
//! - cancel-safety: thousands of `get_async` futures dropped at random points while
//!   producer processes put; every item arrives exactly once, and a bounded queue's
//!   places all come back (a `put_async` parked on the full queue included);
//! - idle costs nothing: 100 tasks parked on empty queues use (almost) no CPU, read
//!   from the process's own CPU time (`CLOCK_PROCESS_CPUTIME_ID`), not from the wall clock;
//! - `Disconnected` reaches an awaiting task when the only producer exits, and when it
//!   is SIGKILLed;
//! - `Event::wait_async` and `Process::join_async` across processes.
//!
//! Every test runs under `common::run` (a deadline, and /dev/shm, fd and child counts
//! unchanged at its end). The reactor threads and the fd reactor's eventfd live as long
//! as the process: `warm_up` makes them exist before a test counts fds.

multiproc::test_init!();

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use multiproc::{Event, Process, Queue, SimpleQueue, StartMethod, start_processes};

const DEADLINE: Duration = Duration::from_secs(120);
const WAIT: Duration = Duration::from_secs(30);

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

fn sleep_then_exit(_rank: usize, ms: u64) -> multiproc::Result<()> {
    std::thread::sleep(Duration::from_millis(ms));
    Ok(())
}

/// Starts the reactor threads and the fd reactor (which keep an eventfd for the life of
/// the process) before a test counts fds.
fn warm_up() {
    let rt = runtime();
    rt.block_on(async {
        let e = Event::new().unwrap();
        let waiter = {
            let e = e.clone();
            tokio::spawn(async move { e.wait_async().await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        e.set();
        waiter.await.unwrap().unwrap();
        let mut p = Process::new(sleep_then_exit, 0, 50u64);
        p.start().unwrap();
        tokio::time::timeout(WAIT, p.join_async())
            .await
            .unwrap()
            .unwrap();
    });
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The CPU time (user + system, all threads) this process has used so far
/// (`CLOCK_PROCESS_CPUTIME_ID`: what `getrusage` sums, in nanoseconds).
fn cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
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
            let putter = {
                let q = q.clone();
                tokio::spawn(async move { q.put_async((7, 0, 0)).await.map_err(|e| e.error) })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
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
            let putter = {
                let q = q.clone();
                tokio::spawn(async move { q.put_async(vec![0xFF; 8]).await.map_err(|e| e.error) })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
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

#[test]
fn a_hundred_idle_awaiting_tasks_cost_no_cpu() {
    warm_up();
    common::run(DEADLINE, || {
        const TASKS: usize = 100;
        const WINDOW: Duration = Duration::from_secs(3);
        let queues: Vec<SimpleQueue<u32>> =
            (0..TASKS).map(|_| SimpleQueue::new().unwrap()).collect();
        let rt = runtime();
        let (used, parked_all) = rt.block_on(async {
            let tasks: Vec<_> = queues
                .iter()
                .map(|q| {
                    // The clone stays here: the queue has another holder, so the get
                    // waits instead of reporting Disconnected.
                    let q = q.clone();
                    tokio::spawn(async move { q.get_async().await })
                })
                .collect();
            // Let every task park.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let before = cpu_time();
            tokio::time::sleep(WINDOW).await;
            let used = cpu_time() - before;
            let parked_all = tasks.iter().all(|t| !t.is_finished());
            // And they were waiting, not dead: each takes its item.
            for (i, q) in queues.iter().enumerate() {
                q.put(i as u32).unwrap();
            }
            for (i, t) in tasks.into_iter().enumerate() {
                let got = tokio::time::timeout(WAIT, t)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
                assert_eq!(got, i as u32);
            }
            (used, parked_all)
        });
        drop(rt);
        eprintln!("idle: {TASKS} tasks parked on empty queues for {WINDOW:?} used {used:?} of CPU");
        assert!(parked_all, "a task returned from a get on an empty queue");
        // One re-check per second per parked get (see sys::reactor), nothing else.
        assert!(
            used < Duration::from_millis(50),
            "idle tasks used {used:?} of CPU"
        );
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

/// Puts three items, says so, and waits to be killed.
fn put_three_and_hang(_rank: usize, (q, ready): (Queue<u32>, Event)) -> multiproc::Result<()> {
    for i in 0..3 {
        q.put(i)?;
    }
    ready.set();
    std::thread::sleep(Duration::from_secs(600));
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
            let mut producer = Process::new(put_three_and_leave, 0, (q.clone(), go.clone()));
            producer.start().unwrap();
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
            let getter = tokio::spawn(async move {
                let r = q.get_async().await;
                (r, Instant::now())
            });
            tokio::time::sleep(Duration::from_millis(100)).await;
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
            let mut producer = Process::new(put_three_and_hang, 0, (q.clone(), ready.clone()));
            producer.start().unwrap();
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
            let getter = {
                let q = q.clone();
                tokio::spawn(async move {
                    let r = q.get_async().await;
                    (r, Instant::now())
                })
            };
            tokio::time::sleep(Duration::from_millis(100)).await;
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
            eprintln!(
                "disconnect after a producer's SIGKILL reached the awaiting get after {:?}",
                at.saturating_duration_since(killed)
            );
        });
        drop(rt);
    });
}

/// Waits for `go`, sleeps, sets `done`, sleeps again and exits.
fn set_later(_rank: usize, (go, done): (Event, Event)) -> multiproc::Result<()> {
    go.wait_timeout(WAIT)?;
    std::thread::sleep(Duration::from_millis(200));
    done.set();
    std::thread::sleep(Duration::from_millis(200));
    Ok(())
}

#[test]
fn event_wait_async_and_process_join_async_across_processes() {
    warm_up();
    common::run(DEADLINE, || {
        let rt = runtime();
        rt.block_on(async {
            let (go, done) = (Event::new().unwrap(), Event::new().unwrap());
            let mut child = Process::new(set_later, 0, (go.clone(), done.clone()));
            child.start().unwrap();
            // Many tasks wait on one event; dropped waits in between change nothing.
            let waiters: Vec<_> = (0..10)
                .map(|_| {
                    let done = done.clone();
                    tokio::spawn(async move { done.wait_async().await })
                })
                .collect();
            for _ in 0..100 {
                let dropped =
                    tokio::time::timeout(Duration::from_micros(50), done.wait_async()).await;
                assert!(dropped.is_err());
            }
            let start = Instant::now();
            go.set();
            for w in waiters {
                tokio::time::timeout(WAIT, w)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
            }
            assert!(done.is_set());
            assert!(
                start.elapsed() >= Duration::from_millis(150),
                "woken before the set"
            );
            assert!(child.is_alive() || start.elapsed() >= Duration::from_millis(350));
            let status = tokio::time::timeout(WAIT, child.join_async())
                .await
                .unwrap()
                .unwrap();
            assert!(status.success(), "{status:?}");
            assert!(
                start.elapsed() >= Duration::from_millis(350),
                "joined before the exit"
            );
            // Joining again returns the same status at once.
            assert!(child.join_async().await.unwrap().success());

            // A semaphore's permit, given in another task.
            let sem = multiproc::Semaphore::new(0).unwrap();
            let acquirer = {
                let sem = sem.clone();
                tokio::spawn(async move { sem.acquire_async().await })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!acquirer.is_finished());
            // Futures dropped unfinished take no permit: one given meanwhile goes to
            // exactly one of them or the parked acquirer.
            let mut taken = 0;
            for i in 0..100 {
                if i == 50 {
                    sem.release().unwrap();
                }
                let r = tokio::time::timeout(Duration::from_micros(50), sem.acquire_async()).await;
                taken += usize::from(r.is_ok_and(|r| r.is_ok()));
            }
            assert!(taken <= 1, "{taken} permits out of one");
            if taken == 1 {
                sem.release().unwrap(); // the acquirer's
            }
            tokio::time::timeout(WAIT, acquirer)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert!(sem.try_permit().unwrap().is_none(), "a permit too many");
        });
        drop(rt);
    });
}

/// Takes every item of `jobs` (marking each done), then answers on `answer` and exits.
fn work_then_answer(
    _rank: usize,
    (jobs, answer, count): (
        multiproc::JoinableQueue<u32>,
        multiproc::Connection<String>,
        u32,
    ),
) -> multiproc::Result<()> {
    for _ in 0..count {
        jobs.get_timeout(WAIT)?;
        std::thread::sleep(Duration::from_millis(20));
        jobs.task_done()?;
    }
    std::thread::sleep(Duration::from_millis(100));
    answer.send("done".to_string())?;
    Ok(())
}

#[test]
fn pipes_joinable_queues_and_process_contexts_are_awaitable() {
    warm_up();
    common::run(DEADLINE, || {
        let rt = runtime();
        rt.block_on(async {
            let jobs = multiproc::JoinableQueue::<u32>::new().unwrap();
            for i in 0..5 {
                jobs.put(i).unwrap();
            }
            let (mine, theirs) = multiproc::pipe::<String>().unwrap();
            let joiner = {
                let jobs = jobs.clone();
                tokio::spawn(async move {
                    jobs.join_async().await.unwrap();
                    Instant::now()
                })
            };
            let start = Instant::now();
            let mut ctx = start_processes(
                work_then_answer,
                (jobs.clone(), theirs, 5),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            // Dropped receives in between take nothing.
            for _ in 0..50 {
                let dropped =
                    tokio::time::timeout(Duration::from_micros(100), mine.recv_async()).await;
                assert!(dropped.is_err());
            }
            let answer = tokio::time::timeout(WAIT, mine.recv_async())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(answer, "done");
            let joined_at = tokio::time::timeout(WAIT, joiner).await.unwrap().unwrap();
            assert!(joined_at.saturating_duration_since(start) >= Duration::from_millis(100));
            tokio::time::timeout(WAIT, ctx.join_async())
                .await
                .unwrap()
                .unwrap();
            // The worker's end is gone with it: the pipe reports the end of the stream.
            let end = tokio::time::timeout(WAIT, mine.recv_async()).await.unwrap();
            assert!(end.as_ref().is_err_and(|e| e.is_disconnected()), "{end:?}");
        });
        drop(rt);
    });
}

/// The threads of this process named `name`.
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| t.ok())
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end() == name)
                })
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn more_words_than_one_futex_waitv_takes_are_shared_among_reactor_threads() {
    warm_up();
    common::run(DEADLINE, || {
        const EVENTS: usize = 300;
        let events: Vec<Event> = (0..EVENTS).map(|_| Event::new().unwrap()).collect();
        let rt = runtime();
        rt.block_on(async {
            let tasks: Vec<_> = events
                .iter()
                .map(|e| {
                    let e = e.clone();
                    tokio::spawn(async move { e.wait_async().await })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(tasks.iter().all(|t| !t.is_finished()));
            // 128 words per futex_waitv, the control word included.
            let reactors = threads_named("multiproc-react");
            assert!(
                reactors >= EVENTS.div_ceil(127),
                "{reactors} reactor threads"
            );
            // Set in an order unlike the registrations'.
            for e in events
                .iter()
                .rev()
                .step_by(2)
                .chain(events.iter().step_by(2))
            {
                e.set();
            }
            for t in tasks {
                tokio::time::timeout(WAIT, t)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
            }
        });
        drop(rt);
    });
}

/// Awaits `go` and the item 42 on its own runtime (a `fork` child of a parent whose
/// reactor threads run: the child starts its own).
fn await_in_a_fork_child(_rank: usize, (go, q): (Event, Queue<u32>)) -> multiproc::Result<()> {
    let late = |what: &str| multiproc::Error::InvalidArgument(format!("{what} never came"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| multiproc::Error::InvalidArgument(format!("a runtime: {e}")))?;
    rt.block_on(async {
        tokio::time::timeout(WAIT, go.wait_async())
            .await
            .map_err(|_| late("go"))??;
        let item = tokio::time::timeout(WAIT, q.get_async())
            .await
            .map_err(|_| late("the item"))??;
        if item == 42 {
            Ok(())
        } else {
            Err(multiproc::Error::InvalidArgument(format!("got {item}")))
        }
    })
}

#[test]
fn a_fork_child_awaits_on_reactors_of_its_own() {
    warm_up();
    common::run(DEADLINE, || {
        let (go, q) = (Event::new().unwrap(), Queue::<u32>::new().unwrap());
        let rt = runtime();
        rt.block_on(async {
            // The parent's reactor threads are busy with a parked wait of its own.
            let never = Event::new().unwrap();
            let parked = {
                let never = never.clone();
                tokio::spawn(async move { never.wait_async().await })
            };
            let mut child = Process::new(await_in_a_fork_child, 0, (go.clone(), q.clone()))
                .start_method(StartMethod::Fork);
            child.start().unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            go.set();
            tokio::time::sleep(Duration::from_millis(100)).await;
            q.put(42).unwrap();
            let status = tokio::time::timeout(WAIT, child.join_async())
                .await
                .unwrap()
                .unwrap();
            assert!(status.success(), "{status:?} {:?}", child.error());
            never.set();
            parked.await.unwrap().unwrap();
        });
        drop(rt);
    });
}
