//! Groups of worker processes: spawn, start_processes, the three start methods, error
//! propagation and tear-down, the torchrun environment. Ported from torch's
//! test_multiprocessing_spawn.py where there is a counterpart (named in each test's
//! comment). One `Process` at a time, the fork server and a worker's identity are
//! tests/process.rs.
//!
//! Every test runs under `common::run`: one at a time (they count this process's
//! children and fds), on a thread with a deadline, and ends with a check that no child
//! process and no fd was left behind.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use multiproc::{Error, Event, SimpleQueue, SpawnOptions, StartMethod, spawn, start_processes};

use common::secs;
use common::workers::{noop, process_is_gone, put_rank, raise_in, sleep_then_ok};

// ---------------------------------------------------------------------------------------
// Workers (functions of this executable, found again by the spawned copies).

/// Checks a large argument (it travels out of band, in a sealed memfd).
fn check_big(rank: usize, (data, sum): (Vec<u8>, u64)) -> Result<(), String> {
    let got: u64 = data.iter().map(|&b| u64::from(b)).sum();
    if got == sum && data.len() == 3 << 20 {
        Ok(())
    } else {
        Err(format!(
            "rank {rank} got {} bytes summing to {got}, expected {sum}",
            data.len()
        ))
    }
}

fn raise_all(rank: usize, _: ()) {
    panic!("legitimate exception from process {rank}");
}

fn return_err(rank: usize, _: ()) -> Result<(), String> {
    if rank == 1 {
        Err(format!("rank {rank} returned an error on purpose"))
    } else {
        Ok(())
    }
}

fn abort_rank0(rank: usize, _: ()) {
    if rank == 0 {
        std::process::abort();
    }
}

/// Rank 0 exits with `code`; the others sleep `sleep_ms` (a slow peer, not a
/// synchronisation).
fn exit_rank0(rank: usize, (code, sleep_ms): (i32, u64)) {
    if rank == 0 {
        std::process::exit(code);
    }
    std::thread::sleep(Duration::from_millis(sleep_ms));
}

/// Rank 1 ignores SIGTERM and says so; rank 0 waits for that, then raises.
fn raise_while_one_ignores_sigterm(rank: usize, ready: SimpleQueue<()>) {
    if rank == 1 {
        // SAFETY: installing SIG_IGN for SIGTERM has no preconditions.
        unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
        ready.put(()).expect("put");
        std::thread::sleep(secs(60));
    } else {
        ready.get().expect("get");
        panic!("legitimate exception from process {rank}");
    }
}

fn report_env(rank: usize, q: SimpleQueue<(usize, String, String, String, bool)>) {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    q.put((
        rank,
        var("RANK"),
        var("LOCAL_RANK"),
        var("WORLD_SIZE"),
        std::env::var_os("MULTIPROC_ROLE").is_some()
            || std::env::var_os("MULTIPROC_WORKER_FD").is_some(),
    ))
    .expect("put");
}

/// Runs a failing group of its own and sends the error home through a queue.
fn nested_failure(_rank: usize, q: SimpleQueue<Error>) {
    let err = spawn(raise_in, 1usize, 2).expect_err("the nested group fails");
    q.put(err).expect("put");
}

/// Panics in a helper thread; the job unwraps the join, whose payload is an opaque `Any`.
fn helper_thread_panics(_rank: usize, _: ()) {
    std::thread::spawn(|| panic!("helper thread gave up on purpose"))
        .join()
        .unwrap();
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn test_init_makes_spawned_workers_run_their_job() {
    // Were `test_init!` not working, the workers would run libtest instead and never
    // put their rank.
    common::run(secs(120), || {
        let q = SimpleQueue::new().unwrap();
        spawn(put_rank, q.clone(), 2).unwrap();
        let mut got = vec![q.get().unwrap(), q.get().unwrap()];
        got.sort();
        assert_eq!(got, [0, 1]);
    });
}

// torch: test_success (for each start method)
#[test]
fn success_with_each_start_method() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            SpawnOptions::new()
                .start_method(method)
                .spawn(noop, (), 2)
                .unwrap_or_else(|e| panic!("{method}: {e}"));
        }
    });
}

/// Waits for `go`, then returns.
fn wait_for_go(_rank: usize, go: Event) -> multiproc::Result<()> {
    go.wait_timeout(secs(60))
}

// torch: test_success_non_blocking
#[test]
fn join_without_joining_until_true() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let go = Event::new().unwrap();
            let mut ctx = start_processes(wait_for_go, go.clone(), 2, method).unwrap();
            assert_eq!(ctx.pids().len(), 2);
            // The workers wait for `go`: a join cannot be true yet.
            let err = ctx
                .join_timeout(Duration::from_millis(10))
                .expect_err("joined workers that still wait");
            assert!(err.is_timeout(), "{method}: {err}");
            go.set();
            loop {
                match ctx.join_timeout(Duration::from_millis(10)) {
                    Ok(()) => break,
                    Err(e) if e.is_timeout() => {}
                    Err(e) => panic!("{method}: {e}"),
                }
            }
            ctx.join().expect("repeated join stays true");
            ctx.join_timeout(Duration::ZERO).unwrap();
            assert!(
                ctx.exit_statuses()
                    .iter()
                    .all(|s| s.is_some_and(|s| s.success()))
            );
        }
    });
}

// torch: test_first_argument_index / args delivered
#[test]
fn args_are_delivered_with_the_rank() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let q = SimpleQueue::new().unwrap();
            SpawnOptions::new()
                .start_method(method)
                .spawn(put_rank, q.clone(), 2)
                .unwrap();
            let got: BTreeSet<usize> = [q.get().unwrap(), q.get().unwrap()].into();
            assert_eq!(got, BTreeSet::from([0, 1]), "{method}");
        }
    });
}

#[test]
fn large_arguments_arrive_intact() {
    common::run(secs(120), || {
        let data: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
        let sum = data.iter().map(|&b| u64::from(b)).sum::<u64>();
        for method in StartMethod::ALL {
            SpawnOptions::new()
                .start_method(method)
                .spawn(check_big, (data.clone(), sum), 2)
                .unwrap_or_else(|e| panic!("{method}: {e}"));
        }
    });
}

// torch: test_exception_single
#[test]
fn exception_in_one_process_while_the_other_sleeps() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            for target in [0usize, 1] {
                let mut ctx = start_processes(raise_in, target, 2, method).unwrap();
                let err = ctx.join().expect_err("a worker raises");
                let Error::ProcessRaised {
                    error_index,
                    pid,
                    message,
                    others,
                } = &err
                else {
                    panic!("{method}: expected ProcessRaised, got {err:?}");
                };
                assert_eq!(*error_index, target, "{method}: {message}");
                assert!(*pid > 0);
                assert!(
                    message.contains(&format!("legitimate exception from process {target}")),
                    "{message}"
                );
                assert!(
                    message.starts_with(&format!("process {target} (pid {pid}) raised: ")),
                    "{message}"
                );
                assert!(
                    message.contains("tests/common/workers.rs:"),
                    "location missing: {message}"
                );
                assert!(
                    others.is_empty(),
                    "the sleeper was ours to kill: {others:?}"
                );
                // The sleeper was terminated, not awaited: it never ends on its own, and
                // it was reaped, ended by the SIGTERM of the tear-down.
                let sleeper = ctx.exit_statuses()[1 - target].expect("reaped");
                assert_eq!(
                    sleeper.signal_name().as_deref(),
                    Some("SIGTERM"),
                    "{method}: the sleeper {sleeper}"
                );
            }
        }
    });
}

// torch: test_exception_all
#[test]
fn exception_in_both_processes() {
    common::run(secs(120), || {
        let err = spawn(raise_all, (), 2).expect_err("both raise");
        let Error::ProcessRaised {
            error_index,
            message,
            others,
            ..
        } = &err
        else {
            panic!("expected ProcessRaised, got {err:?}");
        };
        assert!(*error_index < 2);
        assert!(
            message.contains(&format!("legitimate exception from process {error_index}")),
            "{message}"
        );
        // The other one raised too, unless it was terminated before it got there.
        for other in others {
            assert_eq!(other.error_index, 1 - error_index);
            assert!(other.message.contains("legitimate exception"), "{other:?}");
        }
        assert_eq!(err.failures().len(), 1 + others.len());
    });
}

#[test]
fn a_returned_err_counts_as_raised() {
    common::run(secs(120), || {
        let err = spawn(return_err, (), 2).expect_err("rank 1 returns Err");
        let Error::ProcessRaised {
            error_index,
            message,
            ..
        } = &err
        else {
            panic!("expected ProcessRaised, got {err:?}");
        };
        assert_eq!(*error_index, 1);
        assert!(
            message.contains("rank 1 returned an error on purpose"),
            "{message}"
        );
        assert!(message.starts_with("process 1 "), "{message}");
    });
}

// torch: test_terminate_signal
#[test]
fn abort_is_reported_with_its_signal_name() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let err = SpawnOptions::new()
                .start_method(method)
                .spawn(abort_rank0, (), 2)
                .expect_err("rank 0 aborts");
            let Error::ProcessExited {
                error_index,
                exit_code,
                signal_name,
                message,
                ..
            } = &err
            else {
                panic!("{method}: expected ProcessExited, got {err:?}");
            };
            assert_eq!(*error_index, 0);
            assert_eq!(*exit_code, None);
            assert_eq!(signal_name.as_deref(), Some("SIGABRT"), "{method}");
            assert!(
                message.starts_with("process 0 (pid ")
                    && message.contains(") terminated with signal SIGABRT"),
                "{message}"
            );
        }
    });
}

// torch: test_terminate_exit
#[test]
fn exit_code_is_reported_long_before_the_sleeper_ends() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let start = Instant::now();
            let mut ctx = start_processes(exit_rank0, (123, 4000u64), 2, method).unwrap();
            let pids = ctx.pids();
            let err = ctx.join().expect_err("rank 0 exits 123");
            let elapsed = start.elapsed();
            let Error::ProcessExited {
                error_index,
                exit_code,
                signal_name,
                message,
                others,
                ..
            } = &err
            else {
                panic!("{method}: expected ProcessExited, got {err:?}");
            };
            assert_eq!((*error_index, *exit_code), (0, Some(123)), "{method}");
            assert_eq!(*signal_name, None);
            assert_eq!(
                *message,
                format!("process 0 (pid {}) terminated with exit code 123", pids[0])
            );
            assert!(others.is_empty(), "{others:?}");
            // Reported well before the sleeper's 4 s were up: it was terminated.
            assert!(elapsed < secs(4), "{method}: took {elapsed:?}");
            let sleeper = ctx.exit_statuses()[1].expect("reaped");
            assert_eq!(
                sleeper.signal_name().as_deref(),
                Some("SIGTERM"),
                "{method}: {sleeper}"
            );
            for pid in pids {
                assert!(process_is_gone(pid), "{method}: worker {pid} still exists");
            }
            // The error stays.
            assert_eq!(ctx.join().unwrap_err(), err);
        }
    });
}

#[test]
fn a_helper_thread_panic_is_reported_with_its_text_and_location() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let err = SpawnOptions::new()
                .start_method(method)
                .spawn(helper_thread_panics, (), 1)
                .expect_err("the job panics");
            let Error::ProcessRaised { message, .. } = &err else {
                panic!("{method}: expected ProcessRaised, got {err:?}");
            };
            assert!(
                message.contains("helper thread gave up on purpose")
                    && message.contains("tests/spawn.rs:"),
                "{method}: {message}"
            );
        }
    });
}

#[test]
fn a_job_that_exits_0_without_returning_is_a_failure() {
    // Exit code 0 without the worker's report means the job never finished: its
    // function did not return (here it called `std::process::exit(0)`).
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let err = start_processes(exit_rank0, (0, 0u64), 2, method)
                .unwrap()
                .join()
                .expect_err("rank 0 never returned from its job");
            let Error::ProcessExited {
                error_index,
                exit_code,
                message,
                ..
            } = &err
            else {
                panic!("{method}: expected ProcessExited, got {err:?}");
            };
            assert_eq!((*error_index, *exit_code), (0, Some(0)), "{method}");
            assert!(
                message.contains("without reporting a result") && message.contains("exit"),
                "{method}: {message}"
            );
        }
    });
}

// torch: test_success_first_then_exception / join with a timeout
#[test]
fn join_with_a_short_timeout_returns_false() {
    common::run(secs(120), || {
        let mut ctx = SpawnOptions::new()
            .daemon(true)
            .start(sleep_then_ok, 5000u64, 1)
            .unwrap();
        let start = Instant::now();
        let err = ctx.join_timeout(Duration::from_millis(100)).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { after: Some(t), .. } if *t == Duration::from_millis(100)),
            "{err}"
        );
        assert!(err.to_string().contains("1 of which still run"), "{err}");
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
        assert!(elapsed < secs(1), "{elapsed:?}");
        // Dropping a daemon context kills and reaps its workers.
    });
}

// torch: test_process_exited / terminate by signal
#[test]
fn sigterm_to_a_worker_is_reported() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let mut ctx = start_processes(sleep_then_ok, 30_000u64, 2, method).unwrap();
            let pid = ctx.pids()[1];
            // SAFETY: kill has no memory-safety preconditions.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
            let err = ctx
                .join_timeout(secs(20))
                .expect_err("rank 1 was terminated");
            let Error::ProcessExited {
                error_index,
                pid: failed_pid,
                signal_name,
                message,
                ..
            } = &err
            else {
                panic!("{method}: expected ProcessExited, got {err:?}");
            };
            assert_eq!((*error_index, *failed_pid), (1, pid));
            assert_eq!(signal_name.as_deref(), Some("SIGTERM"));
            assert_eq!(
                *message,
                format!("process 1 (pid {pid}) terminated with signal SIGTERM")
            );
        }
    });
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_grace_period() {
    common::run(secs(120), || {
        let grace = Duration::from_millis(300);
        let ready = SimpleQueue::new().unwrap();
        let mut ctx = SpawnOptions::new()
            .grace_period(grace)
            .start(raise_while_one_ignores_sigterm, ready, 2)
            .unwrap();
        let start = Instant::now();
        let err = ctx.join_timeout(secs(20)).expect_err("rank 0 raises");
        // Rank 1 outlived its SIGTERM by the grace period at least.
        let took = start.elapsed();
        assert!(took >= grace, "the join returned after {took:?}");
        assert!(
            matches!(err, Error::ProcessRaised { error_index: 0, .. }),
            "{err:?}"
        );
        assert!(
            err.failures().len() == 1,
            "rank 1 was killed by us: {err:?}"
        );
        let statuses = ctx.exit_statuses();
        let killed = statuses[1].expect("rank 1 was reaped");
        assert_eq!(killed.signal_name().as_deref(), Some("SIGKILL"), "{killed}");
    });
}

#[test]
fn torchrun_environment_is_set() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let q = SimpleQueue::new().unwrap();
            SpawnOptions::new()
                .start_method(method)
                .spawn(report_env, q.clone(), 3)
                .unwrap();
            let mut seen: Vec<_> = (0..3).map(|_| q.get().unwrap()).collect();
            seen.sort();
            for (rank, (r, rank_var, local, world, leaked_role)) in seen.into_iter().enumerate() {
                assert_eq!(r, rank);
                assert_eq!(rank_var, rank.to_string(), "{method}");
                assert_eq!(local, rank.to_string(), "{method}");
                assert_eq!(world, "3", "{method}");
                assert!(
                    !leaked_role,
                    "{method}: multiproc's own variables must not leak"
                );
            }
        }
    });
}

#[test]
fn errors_survive_postcard_and_a_queue_from_a_worker() {
    common::run(secs(120), || {
        let q = SimpleQueue::new().unwrap();
        spawn(nested_failure, q.clone(), 1).unwrap();
        let err: Error = q.get().unwrap();
        assert!(
            matches!(err, Error::ProcessRaised { error_index: 1, .. }),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("legitimate exception from process 1")
        );
        let bytes = postcard::to_stdvec(&err).unwrap();
        let back: Error = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, err);
        let exited = Error::ProcessExited {
            error_index: 0,
            pid: 42,
            exit_code: None,
            signal_name: Some("SIGKILL".into()),
            message: "process 0 terminated with signal SIGKILL".into(),
            others: vec![],
        };
        let back: Error = postcard::from_bytes(&postcard::to_stdvec(&exited).unwrap()).unwrap();
        assert_eq!(back, exited);
    });
}
