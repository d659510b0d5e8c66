//! Pool across real processes: ordering, failures that stay local, dead workers that
//! are replaced, recycling, the other call forms (starmap, apply, map_async,
//! initializer arguments), join with a timeout.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use multiproc::{Error, Pool, StartMethod, TaskFailure};

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(30);

fn square(x: u64) -> Result<u64, String> {
    Ok(x * x)
}

#[test]
fn map_and_imap_keep_order_over_1000_tasks() {
    common::run(DEADLINE, || {
        let pool = Pool::new(2).unwrap();
        assert_eq!(
            pool.map(square, 0..10u64).unwrap(),
            (0..10).map(|x| x * x).collect::<Vec<_>>()
        );
        let got: Vec<u64> = pool.imap(square, 0..1000u64).map(|r| r.unwrap()).collect();
        assert_eq!(got, (0..1000).map(|x| x * x).collect::<Vec<_>>());
        let mut unordered: Vec<u64> = pool
            .imap_unordered(square, 0..200u64)
            .map(|r| r.unwrap())
            .collect();
        unordered.sort();
        assert_eq!(unordered, (0..200).map(|x| x * x).collect::<Vec<_>>());
    });
}

fn panics_on_37(x: u32) -> Result<u32, String> {
    if x == 37 {
        panic!("task {x} refuses");
    }
    if x == 73 {
        return Err(format!("task {x} returns an error"));
    }
    Ok(x + 1)
}

#[test]
fn a_panicking_task_fails_alone() {
    common::run(DEADLINE, || {
        let pool = Pool::new(2).unwrap();
        let results: Vec<_> = pool.imap(panics_on_37, 0..100u32).collect();
        assert_eq!(results.len(), 100);
        for (i, r) in results.iter().enumerate() {
            match (i, r) {
                (
                    37,
                    Err(Error::TaskFailed {
                        index,
                        reason,
                        message,
                    }),
                ) => {
                    assert_eq!(*index, 37);
                    assert_eq!(*reason, TaskFailure::Panicked, "{message}");
                    assert!(message.contains("task 37 refuses"), "{message}");
                    assert!(
                        message.contains("pool.rs"),
                        "the panic location is reported: {message}"
                    );
                }
                (
                    73,
                    Err(Error::TaskFailed {
                        index: 73,
                        reason,
                        message,
                    }),
                ) => {
                    assert_eq!(*reason, TaskFailure::Returned, "{message}");
                    assert!(message.contains("task 73 returns an error"), "{message}")
                }
                (i, Ok(v)) => assert_eq!(*v as usize, i + 1),
                (i, other) => panic!("task {i}: unexpected {other:?}"),
            }
        }
        // map reports the first failure with its index; the pool keeps working.
        let err = pool.map(panics_on_37, 30..40u32).unwrap_err();
        assert!(matches!(err, Error::TaskFailed { index: 7, .. }), "{err}");
        assert_eq!(pool.map(square, [3u64]).unwrap(), vec![9]);
    });
}

fn report_pid_then_maybe_hang(x: u32) -> Result<u32, String> {
    if x == 5 {
        // Say who we are, then run long enough to be killed mid-task.
        std::fs::write(
            std::env::var("MP_TEST_PIDFILE").unwrap(),
            std::process::id().to_string(),
        )
        .map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_secs(60));
    }
    Ok(x)
}

#[test]
fn a_worker_killed_mid_task_fails_that_task_and_is_replaced() {
    common::run(DEADLINE, || {
        let dir = std::env::temp_dir().join(format!("mp-pool-kill-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("pid");
        // SAFETY: the only test in this binary that touches this variable, set before
        // the pool's workers (which inherit it) start.
        unsafe { std::env::set_var("MP_TEST_PIDFILE", &pidfile) };
        let pool = Pool::new(2).unwrap();
        let start = Instant::now();
        let mut results = pool.imap(report_pid_then_maybe_hang, 0..20u32);
        let killer = std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok(pid) =
                    std::fs::read_to_string(&pidfile).map(|s| s.parse::<i32>().unwrap())
                {
                    kill_process(pid);
                    return pid as u32;
                }
                assert!(Instant::now() < until, "the task never started");
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let mut all = Vec::new();
        for r in results.by_ref() {
            all.push(r);
        }
        let killed = killer.join().unwrap();
        assert_eq!(all.len(), 20);
        for (i, r) in all.into_iter().enumerate() {
            if i == 5 {
                let err = r.unwrap_err();
                assert!(err.to_string().contains("SIGKILL"), "{err}");
            } else {
                assert_eq!(r.unwrap(), i as u32);
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the failed task was noticed promptly"
        );
        assert_eq!(
            pool.map(square, [4u64]).unwrap(),
            vec![16],
            "the pool still works"
        );
        // Two tasks that can only finish together run in two live workers: the killed
        // one was replaced.
        let barrier = multiproc::Barrier::new(2).unwrap();
        let pids = pool
            .map_chunked(meet_and_say_pid, [(0, barrier.clone()), (1, barrier)], 1)
            .expect("two live workers");
        assert!(
            pids[0] != pids[1] && !pids.contains(&killed),
            "the killed worker {killed} was not replaced: {pids:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

/// Meets the other task at `barrier` (so the two run at once, in two workers) and
/// answers its worker's pid.
fn meet_and_say_pid((_, barrier): (u32, multiproc::Barrier)) -> Result<u32, String> {
    barrier.wait_timeout(WAIT).map_err(|e| e.to_string())?;
    Ok(std::process::id())
}

fn kill_process(pid: i32) {
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    assert!(status.is_ok_and(|s| s.success()), "kill -KILL {pid} failed");
}

fn my_pid(_: u32) -> Result<u32, String> {
    Ok(std::process::id())
}

#[test]
fn max_tasks_per_child_recycles_workers() {
    common::run(DEADLINE, || {
        let pool = Pool::builder()
            .processes(1)
            .max_tasks_per_child(1)
            .build()
            .unwrap();
        let pids = pool.map_chunked(my_pid, 0..4u32, 1).unwrap();
        let distinct: std::collections::BTreeSet<_> = pids.iter().collect();
        assert_eq!(
            distinct.len(),
            4,
            "every task ran in a fresh worker: {pids:?}"
        );
    });
}

static INITIALIZED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn mark_initialized() {
    INITIALIZED.store(true, std::sync::atomic::Ordering::SeqCst);
}

fn was_initialized(_: u8) -> Result<bool, String> {
    Ok(INITIALIZED.load(std::sync::atomic::Ordering::SeqCst))
}

#[test]
fn initializer_apply_async_close_join_and_fork() {
    common::run(DEADLINE, || {
        let mut pool = Pool::builder()
            .processes(2)
            .initializer(mark_initialized)
            .start_method(StartMethod::Fork)
            .build()
            .unwrap();
        let mut r = pool.apply_async(was_initialized, 0).unwrap();
        assert!(r.get_timeout(Duration::from_secs(30)).unwrap());
        pool.close();
        assert!(matches!(
            pool.apply_async(was_initialized, 0),
            Err(Error::Closed(_))
        ));
        pool.join_timeout(Duration::from_secs(30)).unwrap();
    });
}

fn initializer_that_panics() {
    panic!("cannot load the model file /models/a.bin");
}

#[test]
fn an_initializer_that_panics_is_named_with_its_message_and_a_huge_timeout_waits() {
    common::run(DEADLINE, || {
        let pool = Pool::builder()
            .processes(1)
            .initializer(initializer_that_panics)
            .build()
            .unwrap();
        let err = pool.map(square, 0..2u64).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                &err,
                Error::TaskFailed {
                    reason: TaskFailure::WorkerDied,
                    ..
                }
            ) && text.contains("the pool's initializer panicked")
                && text.contains("cannot load the model file /models/a.bin"),
            "{err:?}"
        );
        // A timeout too long for the clock waits without a deadline (no overflow).
        let mut pool = Pool::new(1).unwrap();
        let mut r = pool.apply_async(slow_square, 4).unwrap();
        assert_eq!(r.get_timeout(Duration::MAX).unwrap(), 16);
        let mut m = pool.map_async(square, 0..3u64).unwrap();
        assert_eq!(m.get_timeout(Duration::MAX).unwrap(), [0, 1, 4]);
        pool.close();
        pool.join_timeout(Duration::MAX).unwrap();
    });
}

/// Task 7 SIGKILLs its own worker; every other task records that it ran in `dir`
/// (plain-data arguments, so tasks that had not started can be rerun).
fn square_but_7_kills_its_worker((x, dir): (u64, String)) -> Result<u64, String> {
    if x == 7 {
        // SAFETY: kill on our own pid has no memory-safety preconditions.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let path = std::path::Path::new(&dir).join(x.to_string());
    let runs = std::fs::read_to_string(&path).map_or(0, |s| s.len());
    std::fs::write(&path, "x".repeat(runs + 1)).map_err(|e| e.to_string())?;
    Ok(x * x)
}

/// In chunks of 3, a worker killed while running task 7 (chunk 6, 7, 8) fails task 7
/// alone: the failure names task 7, task 6 had finished, and task 8, which had not
/// started, runs on the fresh worker; every other task runs exactly once.
#[test]
fn a_worker_killed_mid_chunk_fails_only_the_running_task() {
    common::run(Duration::from_secs(120), || {
        let dir = std::env::temp_dir().join(format!("mp-pool-chunk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let pool = Pool::new(1).unwrap();
        let items: Vec<(u64, String)> = (0..12).map(|x| (x, dir.display().to_string())).collect();
        let err = pool
            .map_chunked(square_but_7_kills_its_worker, items, 3)
            .expect_err("task 7 kills its worker");
        drop(pool);
        let Error::TaskFailed {
            index,
            reason,
            message,
        } = &err
        else {
            panic!("expected TaskFailed, got {err:?}");
        };
        assert_eq!(*reason, TaskFailure::WorkerDied, "{message}");
        assert_eq!(
            *index, 7,
            "the failure names the task that was running: {err}"
        );
        assert!(message.contains("SIGKILL"), "{message}");
        let mut ran: Vec<(u64, usize)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let x = e.file_name().to_string_lossy().parse().unwrap();
                (x, std::fs::read_to_string(e.path()).unwrap().len())
            })
            .collect();
        ran.sort_unstable();
        std::fs::remove_dir_all(&dir).unwrap();
        let expected: Vec<(u64, usize)> = (0..12).filter(|&x| x != 7).map(|x| (x, 1)).collect();
        assert_eq!(ran, expected, "every task but 7 ran, exactly once");
    });
}

// ----- the pool's other call forms -----

fn power(base: u64, exp: u32) -> Result<u64, String> {
    base.checked_pow(exp)
        .ok_or_else(|| format!("{base}^{exp} overflows"))
}

/// A task that takes 300 ms of work (not a synchronisation): a wait of 10 ms on it
/// cannot see it finished.
fn slow_square(x: u64) -> Result<u64, String> {
    std::thread::sleep(Duration::from_millis(300));
    Ok(x * x)
}

static GREETING: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

fn remember(greeting: (String, u32)) {
    *GREETING.lock().unwrap() = format!("{} x{}", greeting.0, greeting.1);
}

fn greeting_and_name(_: ()) -> Result<(String, String), String> {
    Ok((
        GREETING.lock().unwrap().clone(),
        multiproc::current_process().name,
    ))
}

#[test]
fn starmap_apply_map_async_and_initializer_arguments() {
    common::run(DEADLINE, || {
        let pool = Pool::builder()
            .processes(2)
            .initializer_with(remember, ("hello".to_string(), 3))
            .build()
            .unwrap();
        assert_eq!(
            pool.starmap(power, [(2, 10), (3, 3), (10, 0)]).unwrap(),
            vec![1024, 27, 1]
        );
        let err = pool.starmap(power, [(2, 1), (2, 64)]).unwrap_err();
        assert!(
            matches!(&err, Error::TaskFailed { index: 1, message, .. } if message.contains("2^64 overflows")),
            "{err}"
        );
        assert_eq!(pool.apply(square, 12).unwrap(), 144);
        let (greeting, name) = pool.apply(greeting_and_name, ()).unwrap();
        assert_eq!(
            greeting, "hello x3",
            "the initializer ran with its argument"
        );
        assert!(name.starts_with("PoolWorker-"), "{name}");

        let mut pending = pool.map_async(slow_square, 0..4u64).unwrap();
        let err = pending.get_timeout(Duration::from_millis(10)).unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert_eq!(pending.get_timeout(WAIT).unwrap(), vec![0, 1, 4, 9]);
        let mut quick = pool.map_async(square, 0..50u64).unwrap();
        assert_eq!(
            quick.get().unwrap(),
            (0..50).map(|x| x * x).collect::<Vec<_>>()
        );
        assert!(quick.ready());
        assert!(matches!(quick.get(), Err(Error::InvalidArgument(_))));
    });
}

#[test]
fn pool_join_times_out_while_a_task_runs_then_joins() {
    common::run(DEADLINE, || {
        let mut pool = Pool::new(1).unwrap();
        let mut running = pool.apply_async(slow_square, 3).unwrap();
        pool.close();
        let err = pool.join_timeout(Duration::from_millis(10)).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { after: Some(t), .. } if *t == Duration::from_millis(10)),
            "{err}"
        );
        pool.join_timeout(WAIT).unwrap();
        assert_eq!(
            running.get_timeout(WAIT).unwrap(),
            9,
            "a closed pool finishes its tasks"
        );
    });
}

/// A result that refuses to be encoded.
#[derive(Debug, serde::Deserialize)]
struct Unsendable;

impl serde::Serialize for Unsendable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this result refuses to be encoded",
        ))
    }
}

fn unsendable(_: u32) -> Result<Unsendable, String> {
    Ok(Unsendable)
}

/// Task 1 of the chunk kills its worker; the chunk's arguments hold a shared handle.
fn second_kills_its_worker((x, _handle): (u32, multiproc::Event)) -> Result<u32, String> {
    if x == 1 {
        // SAFETY: kill on our own pid has no memory-safety preconditions.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    Ok(x)
}

/// `TaskFailed`'s reason tells each way a task fails apart: a result that cannot be
/// encoded, a worker that died running it, and a task that never ran because its
/// chunk's arguments (holding a shared handle) cannot be sent to a second worker.
#[test]
fn each_way_a_task_fails_has_its_reason() {
    common::run(DEADLINE, || {
        let pool = Pool::new(1).unwrap();
        let err = pool.apply(unsendable, 1).unwrap_err();
        let Error::TaskFailed {
            reason, message, ..
        } = &err
        else {
            panic!("expected TaskFailed, got {err:?}");
        };
        assert_eq!(*reason, TaskFailure::Result, "{message}");
        // (postcard keeps no custom text of a serializer's error.)
        assert!(message.contains("cannot encode its result"), "{message}");

        let event = multiproc::Event::new().unwrap();
        let items: Vec<_> = (0..3u32).map(|x| (x, event.clone())).collect();
        let got: Vec<_> = pool
            .imap_chunked(second_kills_its_worker, items, 3)
            .collect();
        assert_eq!(got.len(), 3);
        assert_eq!(*got[0].as_ref().unwrap(), 0);
        let reasons: Vec<_> = got[1..]
            .iter()
            .map(|r| match r {
                Err(Error::TaskFailed { reason, .. }) => *reason,
                other => panic!("expected TaskFailed, got {other:?}"),
            })
            .collect();
        assert_eq!(
            reasons,
            [TaskFailure::WorkerDied, TaskFailure::NotRun],
            "{got:?}"
        );
        assert_eq!(pool.apply(square, 5).unwrap(), 25, "the pool carries on");
    });
}

/// A long-lived pool forgets each `apply_async` and `map_async` job after its last
/// outcome, whether its handle was read, dropped unread or dropped before the result
/// came: its table of jobs does not grow with the number of calls.
#[test]
fn finished_async_jobs_are_forgotten_read_or_not() {
    common::run(DEADLINE, || {
        let pool = Pool::new(2).unwrap();
        for i in 0..50u64 {
            drop(pool.apply_async(square, i).unwrap());
        }
        drop(pool.map_async(square, 0..10u64).unwrap());
        drop(pool.map_async(square, Vec::<u64>::new()).unwrap());
        let mut read = pool.apply_async(square, 3).unwrap();
        assert_eq!(read.get_timeout(WAIT).unwrap(), 9);
        let mut mapped = pool.map_async(square, 0..4u64).unwrap();
        assert_eq!(mapped.get_timeout(WAIT).unwrap(), [0, 1, 4, 9]);
        let until = Instant::now() + WAIT;
        loop {
            let waiting = multiproc::__testing::pool_jobs_waiting(&pool);
            if waiting == 0 {
                break;
            }
            assert!(
                Instant::now() < until,
                "{waiting} jobs still waiting {WAIT:?} after every task was submitted"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.apply(square, 5).unwrap(), 25, "the pool carries on");
    });
}
