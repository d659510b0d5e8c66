//! Feature `async` (issue 23): idle costs nothing. 100 tasks parked on empty queues
//! for 10 s use (almost) no CPU, read from the process's own CPU time
//! (`CLOCK_PROCESS_CPUTIME_ID`: every thread of it, the reactor's included), not from
//! the wall clock. The test is alone in its binary, so that no other test's work is
//! counted.

multiproc::test_init!();

mod common;

use std::time::Duration;

use common::async_rt::*;
use multiproc::SimpleQueue;

/// The CPU time (user + system, all threads) this process has used so far
/// (`CLOCK_PROCESS_CPUTIME_ID`: what `getrusage` sums, in nanoseconds).
fn cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// What the idle measurement below rests on: once the tasks are counted parked and the
/// reactor settled, nothing is left to wake it. Many short rounds, because the
/// failure was a race (a registration counted before the reactor was told of it, whose
/// announcement then woke the reactor inside the measured window: about one round in
/// three hundred, and one CI run of the 10 s measurement). A second race showed on a
/// loaded machine (two busy loops on two cores: every run failed within 200 rounds):
/// the fd reactor read the close events of the previous round's dropped handles late,
/// inside the window, so "settled" now includes it having no event left unread.
fn a_settled_reactor_stays_asleep(rt: &tokio::runtime::Runtime) {
    const ROUNDS: usize = 200;
    const TASKS: usize = 20;
    for round in 0..ROUNDS {
        let queues: Vec<SimpleQueue<u32>> =
            (0..TASKS).map(|_| SimpleQueue::new().unwrap()).collect();
        let woke = rt.block_on(async {
            let tasks = park_gets(&queues).await;
            let wake_ups = multiproc::__testing::reactor_wake_ups();
            tokio::time::sleep(Duration::from_millis(5)).await;
            let woke = multiproc::__testing::reactor_wake_ups() - wake_ups;
            deliver(&queues, tasks).await;
            woke
        });
        assert_eq!(
            woke, 0,
            "round {round}: the reactor woke after its {TASKS} gets were parked and it \
             had settled"
        );
    }
}

type Get = tokio::task::JoinHandle<multiproc::Result<u32>>;

/// One task awaiting a get on each of `queues`, once all are parked and the reactor
/// threads have taken them all in. Each queue's clone stays with the caller: the queue
/// has another holder, so the get waits instead of reporting Disconnected.
async fn park_gets(queues: &[SimpleQueue<u32>]) -> Vec<Get> {
    let tasks = queues
        .iter()
        .map(|q| {
            let q = q.clone();
            tokio::spawn(async move { q.get_async().await })
        })
        .collect();
    settle(queues.len()).await;
    tasks
}

/// Puts `i` on queue `i` and checks that task `i` gets it.
async fn deliver(queues: &[SimpleQueue<u32>], tasks: Vec<Get>) {
    for (i, q) in queues.iter().enumerate() {
        q.put(i as u32).unwrap();
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let got = tokio::time::timeout(WAIT, t).await.unwrap().unwrap();
        assert_eq!(got.unwrap(), i as u32);
    }
}

/// Waits until `tasks` gets are parked and the reactor threads have taken them all in
/// (none is still catching up).
async fn settle(tasks: usize) {
    let parking = std::time::Instant::now();
    while multiproc::__testing::parked_word_waits() < tasks {
        assert!(parking.elapsed() < WAIT, "the tasks did not all park");
        tokio::task::yield_now().await;
    }
    while !multiproc::__testing::reactors_settled() {
        assert!(parking.elapsed() < WAIT, "the reactor never settled");
        tokio::task::yield_now().await;
    }
}

#[test]
fn a_hundred_idle_awaiting_tasks_cost_no_cpu() {
    warm_up();
    common::run(DEADLINE, || {
        a_settled_reactor_stays_asleep(&runtime());
        const TASKS: usize = 100;
        const WINDOW: Duration = Duration::from_secs(10);
        let queues: Vec<SimpleQueue<u32>> =
            (0..TASKS).map(|_| SimpleQueue::new().unwrap()).collect();
        let rt = runtime();
        let (used, parked_all, woke) = rt.block_on(async {
            let tasks = park_gets(&queues).await;
            let before = cpu_time();
            let wake_ups = multiproc::__testing::reactor_wake_ups();
            tokio::time::sleep(WINDOW).await;
            let used = cpu_time() - before;
            let woke = multiproc::__testing::reactor_wake_ups() - wake_ups;
            let parked_all = tasks.iter().all(|t| !t.is_finished());
            // And they were waiting, not dead: each takes its item.
            deliver(&queues, tasks).await;
            (used, parked_all, woke)
        });
        drop(rt);
        eprintln!(
            "idle: {TASKS} tasks parked on empty queues for {WINDOW:?} used {used:?} of CPU; \
             the reactor threads woke {woke} times"
        );
        assert!(parked_all, "a task returned from a get on an empty queue");
        // No timer: nothing changed, so nothing woke (a re-check would be one wake-up a
        // second).
        assert_eq!(
            woke, 0,
            "the reactor threads woke while every get was parked"
        );
        assert!(
            used < Duration::from_millis(50),
            "idle tasks used {used:?} of CPU"
        );
    });
}
