//! Fault injection on processes: SIGKILL a pool worker mid-task, a lock holder and the
//! shm manager at random points, and check what the survivors see. Each scenario runs
//! as the root of its own process tree, seeded; the harness and what it checks are
//! described in tests/common/faults.rs. The queue roles are tests/faults_queue.rs.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::Rng;
use common::faults::*;
use multiproc::{
    DType, Error, Event, Lock, Pool, Process, SharingStrategy, SimpleQueue, TaskFailure, Tensor,
    Value,
};

#[test]
fn pool_worker_killed_mid_task() {
    outer("scenario_pool_worker_mid_task", &BOTH);
}

#[test]
fn lock_holder_killed() {
    outer("scenario_lock_holder", &[SharingStrategy::FileDescriptor]);
}

#[test]
fn shm_manager_killed() {
    outer("scenario_shm_manager", &[SharingStrategy::FileSystem]);
}

/// `SOAK_ITERATIONS` per role and strategy; prints a table of what was measured.
#[test]
#[ignore = "soak: long; run with `cargo test --test faults_processes -- --ignored soak`"]
fn soak() {
    common::faults::soak(&[
        ("scenario_pool_worker_mid_task", &BOTH),
        ("scenario_lock_holder", &[SharingStrategy::FileDescriptor]),
        ("scenario_shm_manager", &[SharingStrategy::FileSystem]),
    ]);
}

// --- pool worker mid-task ---

fn pool_task((i, t, pause_us): (u32, Tensor, u64)) -> Result<(u32, u32, Tensor), String> {
    check_item(u64::from(i), &t)?;
    std::thread::sleep(Duration::from_micros(pause_us));
    let out = Tensor::full(&[16], f64::from(value_of(u64::from(i) * 2)), DType::F32)
        .map_err(|e| e.to_string())?;
    Ok((i, std::process::id(), out))
}

fn double(x: u32) -> Result<u32, String> {
    Ok(2 * x)
}

/// A pool works through tensor tasks; a worker (one that has answered before) is
/// SIGKILLed at a random instant: mid-task, between tasks or while answering. At most
/// the task it ran fails, with `TaskFailed` saying it was killed; every other task
/// succeeds; the pool replaces the worker and keeps working.
#[test]
#[ignore = "run as its own process tree by pool_worker_killed_mid_task"]
fn scenario_pool_worker_mid_task() {
    scenario("pool_worker_mid_task", |cfg, stats| {
        for i in 0..cfg.iterations {
            let mut pool = Pool::new(2).unwrap();
            let total = 24u32;
            let pauses: Vec<u64> = (0..total).map(|_| cfg.rng.below(3000)).collect();
            let kill_after = 1 + cfg.rng.below(8) as usize;
            let delay = cfg.rng.delay(3);
            let pick = cfg.rng.next_u64();
            let items = (0..total).map(move |k| {
                let t = Tensor::full(&[64], f64::from(value_of(u64::from(k))), DType::F32)
                    .expect("task tensor");
                (k, t, pauses[k as usize])
            });
            let mut seen_pids = Vec::new();
            let mut failed = 0u64;
            let mut killed = None;
            for (k, r) in pool.imap(pool_task, items).enumerate() {
                match r {
                    Ok((idx, pid, t)) => {
                        assert_eq!(idx as usize, k);
                        check_item(u64::from(idx) * 2, &t).unwrap();
                        stats.pids.insert(pid);
                        if !seen_pids.contains(&pid) {
                            seen_pids.push(pid);
                        }
                    }
                    Err(Error::TaskFailed {
                        index,
                        reason,
                        message,
                    }) => {
                        assert_eq!(index, k);
                        assert_eq!(reason, TaskFailure::WorkerDied, "{message}");
                        assert!(
                            message.contains("SIGKILL"),
                            "task {index} failed without saying its worker was killed: {message}"
                        );
                        failed += 1;
                    }
                    Err(e) => panic!("task {k}: unexpected {e}"),
                }
                if k + 1 == kill_after && killed.is_none() {
                    let victim = seen_pids[(pick % seen_pids.len() as u64) as usize];
                    std::thread::sleep(delay);
                    kill_pid(victim);
                    stats.kills += 1;
                    killed = Some(victim);
                }
            }
            assert!(failed <= 1, "{failed} tasks failed for one killed worker");
            stats.errors += failed as u32;
            // The pool carries on, with a replacement worker.
            assert_eq!(
                pool.map(double, 0..8u32).unwrap(),
                (0..8).map(|x| 2 * x).collect::<Vec<_>>()
            );
            pool.close();
            pool.join_timeout(WAIT).expect("the pool did not wind down");
            drop(pool);
            if let Some(v) = killed {
                assert!(!common::alive(v), "the killed worker {v} survived");
            }
            assert_no_children_left();
            stats.iterations += 1;
            stats.add("tasks", u64::from(total));
            stats.add("failed_tasks", failed);
            eprintln!("iteration {i}: {failed} of {total} tasks failed");
        }
    });
}

// --- lock holder ---

fn hold_lock_until_killed(
    _rank: usize,
    (lock, a, b, started): (Lock, Value<u64>, Value<u64>, Event),
) -> Result<(), String> {
    loop {
        let held = lock.lock().map_err(|e| e.to_string())?;
        // Half-updated state while the lock is held: what OwnerDied warns about.
        a.set(a.get() + 1);
        std::thread::sleep(Duration::from_micros(200));
        b.set(b.get() + 1);
        started.set();
        drop(held);
    }
}

/// A process takes and releases a lock in a loop (holding it most of the time, its
/// protected pair half-updated meanwhile) and is SIGKILLed at a random instant. The
/// next acquirer either gets the lock cleanly — and then the pair is consistent — or
/// gets `OwnerDied` naming the dead pid, and holds the lock. Nobody waits forever.
#[test]
#[ignore = "run as its own process tree by lock_holder_killed"]
fn scenario_lock_holder() {
    scenario("lock_holder", |cfg, stats| {
        for i in 0..cfg.iterations {
            let lock = Lock::new().unwrap();
            let a = Value::new(0u64).unwrap();
            let b = Value::new(0u64).unwrap();
            let started = Event::new().unwrap();
            let mut p = Process::builder(
                hold_lock_until_killed,
                0,
                (lock.clone(), a.clone(), b.clone(), started.clone()),
            )
            .daemon(true)
            .start()
            .unwrap();
            let pid = p.pid();
            stats.pid(pid);
            if cfg.rng.chance(3, 4) {
                started.wait_timeout(WAIT).expect("the holder never ran");
            }
            std::thread::sleep(cfg.rng.delay(20));
            kill_and_reap(&mut p, stats);
            let asked = Instant::now();
            let outcome = match lock.acquire_timeout(WAIT) {
                Ok(()) => {
                    assert_eq!(a.get(), b.get(), "a clean acquire sees consistent state");
                    "clean"
                }
                Err(e) if e.is_timeout() => {
                    panic!("acquire timed out after {WAIT:?}: the dead holder was waited for")
                }
                Err(Error::OwnerDied { message, .. }) => {
                    assert!(
                        message.contains(&pid.to_string()),
                        "names the dead holder: {message}"
                    );
                    assert!(lock.is_locked(), "OwnerDied hands the lock to the caller");
                    b.set(a.get()); // repair what the dead holder left half-done
                    stats.errors += 1;
                    "owner_died"
                }
                Err(e) => panic!("acquire after the kill: unexpected {e}"),
            };
            assert!(
                asked.elapsed() < Duration::from_secs(10),
                "the takeover was slow"
            );
            lock.release().unwrap();
            // The survivor carries on: the lock works as before.
            lock.acquire_timeout(Duration::from_secs(5)).unwrap();
            lock.release().unwrap();
            drop(p);
            assert_no_children_left();
            stats.iterations += 1;
            stats.add(outcome, 1);
            eprintln!("iteration {i}: {outcome}");
        }
    });
}

// --- shm manager ---

/// What the file_system producer sends: an item, or the error its allocation met.
type Produced = Result<(u64, Tensor), String>;

fn produce_file_system_tensors(
    _rank: usize,
    (q, stop, seed): (SimpleQueue<Produced>, Event, u64),
) -> Result<(), String> {
    let mut rng = Rng(seed);
    let mut seq = 0;
    while !stop.is_set() {
        let item = make_item(seq, &mut rng).and_then(|t| {
            t.share_memory_().map_err(|e| e.to_string())?;
            Ok((seq, t))
        });
        if item.is_ok() {
            seq += 1;
        }
        q.put(item).map_err(|e| e.error.to_string())?;
    }
    Ok(())
}

/// The pids of live shm managers of this process tree (their address names our pid).
fn our_managers() -> Vec<u32> {
    let tag = format!("-{}-", std::process::id());
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let is_manager = vars.iter().any(|v| *v == b"MULTIPROC_ROLE=shm-manager");
        let ours = vars.iter().any(|v| {
            v.starts_with(b"MULTIPROC_SHM_MANAGER=") && String::from_utf8_lossy(v).contains(&tag)
        });
        if is_manager && ours && common::alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// The one manager of this tree, once starters racing to start one have settled.
fn one_manager() -> u32 {
    let until = Instant::now() + WAIT;
    loop {
        let managers = our_managers();
        if managers.len() == 1 {
            return managers[0];
        }
        assert!(
            Instant::now() < until,
            "not exactly one manager serves the tree: {managers:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_dead(pid: u32) {
    let until = Instant::now() + WAIT;
    while common::alive(pid) {
        assert!(Instant::now() < until, "process {pid} outlived SIGKILL");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// While a worker makes and sends file_system tensors, the shm manager is SIGKILLed at
/// a random instant. The next file_system allocation (here and in the worker) starts a
/// new manager and succeeds; tensors already shared stay valid; and once the tree has
/// exited the new manager has cleaned up everything (the outer side checks).
#[test]
#[ignore = "run as its own process tree by shm_manager_killed"]
fn scenario_shm_manager() {
    scenario("shm_manager", |cfg, stats| {
        multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
        let keep = Tensor::full(&[1000], 3.0, DType::F32).unwrap();
        keep.share_memory_().unwrap();
        for i in 0..cfg.iterations {
            let manager = one_manager();
            stats.pids.insert(manager);
            let q = SimpleQueue::new().unwrap();
            let stop = Event::new().unwrap();
            let mut p = Process::builder(
                produce_file_system_tensors,
                0,
                (q.clone(), stop.clone(), cfg.rng.next_u64()),
            )
            .daemon(true)
            .start()
            .unwrap();
            stats.pid(p.pid());
            let mut received = 0u64;
            let take = |item: Produced, received: &mut u64, stats: &mut Stats| {
                match item {
                    Ok((seq, t)) => {
                        check_item(seq, &t).unwrap();
                        *received += 1;
                    }
                    Err(e) => {
                        // A survivor may see one clear error from the manager's death.
                        assert!(e.contains("shm manager"), "unclear error: {e}");
                        stats.errors += 1;
                    }
                }
            };
            if cfg.rng.chance(3, 4) {
                let first = q.get_timeout(WAIT).expect("the worker never put");
                take(first, &mut received, stats);
            }
            std::thread::sleep(cfg.rng.delay(30));
            kill_pid(manager);
            stats.kills += 1;
            wait_dead(manager);
            // The next allocation here recovers.
            let next = Tensor::full(&[100], 5.0, DType::F32).unwrap();
            next.share_memory_().unwrap_or_else(|e| {
                panic!("the first allocation after the manager's death failed: {e}")
            });
            // A racing starter (this process and the worker both noticed) briefly
            // shows as a second manager process until it has seen the winner.
            let now = one_manager();
            assert_ne!(now, manager, "a new manager serves the tree");
            stats.pids.insert(now);
            // The worker carries on too: a few more of its tensors arrive.
            let until = Instant::now() + WAIT;
            let target = received + 5;
            while received < target {
                assert!(Instant::now() < until, "the worker stopped producing");
                let item = q.get_timeout(WAIT).unwrap();
                take(item, &mut received, stats);
            }
            stop.set();
            let status = p.join_timeout(WAIT).expect("the worker did not stop");
            assert!(status.success(), "worker: {:?}", p.error());
            while let Some(item) = still_queued(q.try_get(), "a get after the worker stopped") {
                take(item, &mut received, stats);
            }
            assert_eq!(
                keep.sum().unwrap(),
                3000.0,
                "a tensor shared before the kill is intact"
            );
            assert_eq!(next.sum().unwrap(), 500.0);
            drop(p);
            assert_no_children_left();
            stats.iterations += 1;
            stats.add("tensors", received);
            stats.add("recovered", 1);
            eprintln!("iteration {i}: {received} tensors, manager {manager} replaced");
        }
    });
}
