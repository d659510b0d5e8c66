//! Feature `async` (issue 23): awaited waits across real processes, on tokio, beyond
//! queues: `Event::wait_async` and `Process::join_async`, `Semaphore::acquire_async`,
//! `Connection::recv_async`, `JoinableQueue::join_async`, `ProcessContext::join_async`,
//! more waits than one `futex_waitv` takes shared among reactor threads, and a `fork`
//! child awaiting on reactors of its own. Queues are tests/async_queue.rs.
//!
//! Every test runs under `common::run` (a deadline, and /dev/shm, fd and child counts
//! unchanged at its end). The reactor threads and the fd reactor's eventfd live as long
//! as the process: `common::async_rt::warm_up` makes them exist before a test counts fds.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::async_rt::*;
use multiproc::{Event, Process, Queue, StartMethod, start_processes};

/// Waits for `go`, sleeps, sets `done`, sleeps again and exits: a slow peer (the sleeps
/// are not a synchronisation), so that `done` is set at least 200 ms after `go` and the
/// exit comes 200 ms after that, lower bounds the test checks.
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
            let mut child = Process::builder(set_later, 0, (go.clone(), done.clone()))
                .start()
                .unwrap();
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
            let again = tokio::time::timeout(Duration::from_millis(100), child.join_async())
                .await
                .expect("a second join waited");
            assert_eq!(again.unwrap(), status);

            // A semaphore's permit, given in another task.
            let sem = multiproc::Semaphore::new(0).unwrap();
            let base = multiproc::__testing::parked_word_waits();
            let acquirer = {
                let sem = sem.clone();
                tokio::spawn(async move { sem.acquire_async().await })
            };
            until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
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

/// Waits for `go`, then exits.
fn exit_on(_rank: usize, go: Event) -> multiproc::Result<()> {
    go.wait_timeout(WAIT)
}

#[test]
fn a_finished_join_async_has_closed_the_fds_it_parked_on() {
    warm_up();
    common::run(DEADLINE, || {
        let rt = runtime();
        rt.block_on(async {
            for _ in 0..20 {
                let go = Event::new().unwrap();
                let fds = common::open_fds();
                let mut child = Process::builder(exit_on, 0, go.clone()).start().unwrap();
                let base = multiproc::__testing::parked_fd_waits();
                let join = tokio::spawn(async move {
                    let status = child.join_async().await;
                    drop(child);
                    // Counted in the task, the moment the wait completes: the reactor's
                    // duplicates of the child's fds must be closed by then.
                    (status, common::open_fds())
                });
                until_parked(multiproc::__testing::parked_fd_waits, base + 1).await;
                go.set();
                let (status, after) = tokio::time::timeout(WAIT, join).await.unwrap().unwrap();
                assert!(status.unwrap().success());
                assert!(
                    after <= fds,
                    "{fds} fds before the child, {after} once its join returned: {}",
                    common::fd_targets().join(", ")
                );
            }
        });
        drop(rt);
    });
}

/// Takes every item of `jobs` (marking each done; each takes 20 ms of work, not a
/// synchronisation), then, once `go` is set, answers on `answer` and exits.
fn work_then_answer(
    _rank: usize,
    (jobs, answer, count, go): (
        multiproc::JoinableQueue<u32>,
        multiproc::Connection<String>,
        u32,
        Event,
    ),
) -> multiproc::Result<()> {
    for _ in 0..count {
        jobs.get_timeout(WAIT)?;
        std::thread::sleep(Duration::from_millis(20));
        jobs.task_done()?;
    }
    go.wait_timeout(WAIT)?;
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
            let go = Event::new().unwrap();
            let start = Instant::now();
            let mut ctx = start_processes(
                work_then_answer,
                (jobs.clone(), theirs, 5, go.clone()),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            // Dropped receives in between take nothing (nothing is sent before `go`).
            for _ in 0..50 {
                let dropped =
                    tokio::time::timeout(Duration::from_micros(100), mine.recv_async()).await;
                assert!(dropped.is_err());
            }
            go.set();
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
            // Every task parked (one registration each), then the shards they need
            // (128 words per futex_waitv, the control word included): waited for, not
            // slept for.
            let parking = std::time::Instant::now();
            loop {
                let reactors = common::threads_named_like("multiproc-react");
                if multiproc::__testing::parked_word_waits() >= EVENTS
                    && reactors >= EVENTS.div_ceil(127)
                {
                    break;
                }
                assert!(
                    parking.elapsed() < WAIT,
                    "{} of {EVENTS} waits parked, {reactors} reactor threads",
                    multiproc::__testing::parked_word_waits()
                );
                tokio::task::yield_now().await;
            }
            assert!(tasks.iter().all(|t| !t.is_finished()));
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
/// reactor threads run: the child starts its own), telling the parent on `parked` each
/// time its wait is parked.
fn await_in_a_fork_child(
    _rank: usize,
    (go, q, parked): (Event, Queue<u32>, Queue<u8>),
) -> multiproc::Result<()> {
    let late = |what: &str| multiproc::Error::InvalidArgument(format!("{what} never came"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| multiproc::Error::InvalidArgument(format!("a runtime: {e}")))?;
    let base = multiproc::__testing::parked_word_waits();
    let parked = &parked;
    let tell = |step: u8| async move {
        until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
        parked.put(step)
    };
    rt.block_on(async {
        let (woke, told) = tokio::join!(tokio::time::timeout(WAIT, go.wait_async()), tell(1));
        told?;
        woke.map_err(|_| late("go"))??;
        let (item, told) = tokio::join!(tokio::time::timeout(WAIT, q.get_async()), tell(2));
        told?;
        let item = item.map_err(|_| late("the item"))??;
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
        let parked_q = Queue::<u8>::new().unwrap();
        let rt = runtime();
        rt.block_on(async {
            // The parent's reactor threads are busy with a parked wait of its own.
            let never = Event::new().unwrap();
            let base = multiproc::__testing::parked_word_waits();
            let parked = {
                let never = never.clone();
                tokio::spawn(async move { never.wait_async().await })
            };
            until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
            let args = (go.clone(), q.clone(), parked_q.clone());
            let mut child = Process::builder(await_in_a_fork_child, 0, args)
                .start_method(StartMethod::Fork)
                .start()
                .unwrap();
            // Each wake-up reaches the child's wait while it is parked.
            let step = tokio::time::timeout(WAIT, parked_q.get_async())
                .await
                .unwrap();
            assert_eq!(step.unwrap(), 1, "the child parked on `go`");
            go.set();
            let step = tokio::time::timeout(WAIT, parked_q.get_async())
                .await
                .unwrap();
            assert_eq!(step.unwrap(), 2, "the child parked on the queue");
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
