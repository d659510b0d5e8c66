//! No silent hangs for a careless user: a failed stage is seen by whatever the user
//! polls, a drop that has to wait says for what, failures name the process as the user
//! named it, and one wait covers queues and processes together.
//!
//! Every test runs under `common::run`: a deadline, and a check that no segment, fd or
//! child process was left behind.

multiproc::test_init!();

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::secs;
use multiproc::connection::{Waitable, wait};
use multiproc::{Error, Event, Pool, Process, Queue, SimpleQueue, StartMethod};

// ---------------------------------------------------------------------------------------
// Workers (functions of this executable, found again by the spawned copies).

/// Waits for `go`, then fails with an error of its own.
fn fail_after(_rank: usize, go: Event) -> Result<(), String> {
    go.wait_timeout(secs(60)).map_err(|e| e.to_string())?;
    Err("the shard is corrupt".into())
}

fn exit_with(_rank: usize, code: i32) {
    std::process::exit(code);
}

/// Puts two items on a queue of capacity 1 nobody reads: blocks on the second.
fn put_two(_rank: usize, q: Queue<u32>) -> multiproc::Result<()> {
    q.put(1)?;
    q.put(2)?;
    Ok(())
}

/// Waits for `go`, then puts `item` on `q` and waits for `done` before it ends.
fn put_on_go(
    _rank: usize,
    (go, q, item, done): (Event, Queue<u32>, u32, Event),
) -> multiproc::Result<()> {
    go.wait_timeout(secs(60))?;
    q.put(item)?;
    done.wait_timeout(secs(60))?;
    Ok(())
}

/// Waits for `go`, then ends.
fn end_on_go(_rank: usize, go: Event) -> multiproc::Result<()> {
    go.wait_timeout(secs(60))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Item: `Process::error` sees an exit by itself.

#[test]
fn error_alone_notices_a_failed_process() {
    common::run(secs(60), || {
        let go = Event::new().unwrap();
        let mut p = Process::builder(fail_after, 1, go.clone())
            .name("transformer-1")
            .start()
            .unwrap();
        let pid = p.pid();
        assert!(p.error().is_none(), "it still runs");
        go.set();
        // Poll only `error()`, as a pipeline's supervisor loop does.
        let deadline = Instant::now() + secs(30);
        let err = loop {
            if let Some(err) = p.error() {
                break err;
            }
            assert!(Instant::now() < deadline, "error() never saw the failure");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(
            matches!(err, Error::ProcessRaised { error_index: 1, .. }),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!("transformer-1 (rank 1, pid {pid}) returned an error: the shard is corrupt")
        );
        assert!(!p.is_alive());
        assert!(!p.join().unwrap().success());
    });
}

#[test]
fn failures_name_the_process_and_its_pid() {
    common::run(secs(60), || {
        for method in [StartMethod::Spawn, StartMethod::Forkserver] {
            let mut named = Process::builder(exit_with, 2, 3)
                .name("reader")
                .start_method(method)
                .start()
                .unwrap();
            named.join().unwrap();
            let pid = named.pid();
            assert_eq!(
                named.error().unwrap().to_string(),
                format!("reader (rank 2, pid {pid}) terminated with exit code 3"),
                "{method}"
            );
            let mut unnamed = Process::builder(exit_with, 2, 4)
                .start_method(method)
                .start()
                .unwrap();
            unnamed.join().unwrap();
            let pid = unnamed.pid();
            assert_eq!(
                unnamed.error().unwrap().to_string(),
                format!("process 2 (pid {pid}) terminated with exit code 4"),
                "{method}"
            );
        }
    });
}

// ---------------------------------------------------------------------------------------
// Item: a drop that waits for a blocked worker says so.

/// The scenario's switch: set only in the copy of this binary that the test runs.
const SCENARIO_VAR: &str = "MULTIPROC_HANGS_SCENARIO";

/// Run by [`a_drop_that_waits_says_for_what`] in a copy of this binary: starts a worker
/// blocked on a full queue, prints its pid, and drops its handle (`Process`, or the
/// `ProcessContext` when the variable says `context`), which waits; a thread makes room
/// in the queue when a line arrives on stdin.
#[test]
#[ignore = "run by a_drop_that_waits_says_for_what in a copy of this binary"]
fn scenario_drop_a_blocked_worker() {
    let Ok(owner) = std::env::var(SCENARIO_VAR) else {
        return;
    };
    let q = Queue::<u32>::with_capacity(1).unwrap();
    let reader = q.clone();
    let release = std::thread::spawn(move || {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        (0..2).map(|_| reader.get().unwrap()).sum::<u32>()
    });
    if owner == "context" {
        let ctx = multiproc::start_processes(put_two, q, 1, StartMethod::Spawn).unwrap();
        println!("PID {}", ctx.pids()[0]);
        drop(ctx);
    } else {
        let p = Process::builder(put_two, 0, q)
            .name("stuck-reader")
            .start()
            .unwrap();
        println!("PID {}", p.pid());
        drop(p);
    }
    println!("DROPPED");
    assert_eq!(release.join().unwrap(), 3);
}

#[test]
fn a_drop_that_waits_says_for_what() {
    common::run(secs(90), || {
        for (owner, who, advice) in [
            (
                "process",
                "stuck-reader (rank 0, pid {pid})",
                ".daemon(true)",
            ),
            (
                "context",
                "process 0 (pid {pid})",
                "SpawnOptions::daemon(true)",
            ),
        ] {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--ignored",
                    "--exact",
                    "scenario_drop_a_blocked_worker",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(SCENARIO_VAR, owner)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let lines = |stream: Box<dyn std::io::Read + Send>| {
                let (tx, rx) = mpsc::channel();
                std::thread::spawn(move || {
                    for line in BufReader::new(stream).lines().map_while(Result::ok) {
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                });
                rx
            };
            let out = lines(Box::new(child.stdout.take().unwrap()));
            let err = lines(Box::new(child.stderr.take().unwrap()));
            let wait_line = |rx: &mpsc::Receiver<String>, what: &dyn Fn(&str) -> bool| {
                let deadline = Instant::now() + secs(30);
                let mut seen = Vec::new();
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match rx.recv_timeout(left) {
                        Ok(line) if what(&line) => return line,
                        Ok(line) => seen.push(line),
                        Err(e) => panic!("{owner}: no such line ({e}); saw {seen:#?}"),
                    }
                }
            };
            // libtest's "test scenario_… ... " may start the line.
            let pid_line = wait_line(&out, &|l| l.contains("PID "));
            let pid: i32 = pid_line
                .rsplit("PID ")
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let who = who.replace("{pid}", &pid.to_string());
            let warning = wait_line(&err, &|l| l.contains("still runs"));
            assert!(warning.contains(&who), "{owner}: {warning}");
            assert!(warning.contains(advice), "{owner}: {warning}");
            assert!(warning.contains("join"), "{owner}: {warning}");
            // Room in the queue: the worker ends, and so does the drop.
            child.stdin.take().unwrap().write_all(b"go\n").unwrap();
            wait_line(&out, &|l| l.ends_with("DROPPED"));
            let status = child.wait().unwrap();
            assert!(status.success(), "{owner}: {status}");
        }
    });
}

// ---------------------------------------------------------------------------------------
// Item: one wait on queues and processes together.

#[test]
fn wait_wakes_for_an_item_on_one_of_several_queues_and_takes_nothing() {
    common::run(secs(60), || {
        let (idle, busy) = (
            Queue::<u32>::new().unwrap(),
            Queue::<u32>::with_capacity(2).unwrap(),
        );
        // Another handle of each: neither is disconnected (which would make it ready).
        let keep = (idle.clone(), busy.clone());
        let (go, done) = (Event::new().unwrap(), Event::new().unwrap());
        let mut p = Process::builder(put_on_go, 0, (go.clone(), busy.clone(), 7, done.clone()))
            .start()
            .unwrap();
        let setter = std::thread::spawn(move || go.set());
        let ready = wait(&[&idle as &dyn Waitable, &busy, &p], Some(secs(30))).unwrap();
        assert_eq!(ready, [1], "only the queue with an item is ready");
        setter.join().unwrap();
        assert_eq!(busy.len(), 1, "the wait took nothing");
        assert_eq!(busy.try_get().unwrap(), Some(7));
        done.set();
        assert!(p.join().unwrap().success(), "{:?}", p.error());
        drop(keep);
    });
}

#[test]
fn wait_wakes_when_a_process_exits() {
    common::run(secs(60), || {
        let q = SimpleQueue::<u32>::new().unwrap();
        let keep = q.clone(); // another handle: the queue stays connected
        let go = Event::new().unwrap();
        let mut p = Process::builder(end_on_go, 3, go.clone())
            .name("transformer-3")
            .start()
            .unwrap();
        let setter = std::thread::spawn(move || go.set());
        let ready = wait(&[&q as &dyn Waitable, &p], Some(secs(30))).unwrap();
        assert_eq!(ready, [1]);
        setter.join().unwrap();
        assert!(!p.is_alive());
        assert!(p.join().unwrap().success());
        assert_eq!(q.try_get().unwrap(), None);
        drop(keep);
    });
}

#[test]
fn wait_times_out_when_nothing_happens() {
    common::run(secs(60), || {
        let (a, b) = (
            Queue::<u32>::new().unwrap(),
            SimpleQueue::<u32>::new().unwrap(),
        );
        let keep = (a.clone(), b.clone());
        let (reader, writer) = multiproc::pipe::<u8>().unwrap();
        let go = Event::new().unwrap();
        let mut p = Process::builder(end_on_go, 0, go.clone()).start().unwrap();
        let start = Instant::now();
        let err = wait(
            &[&a as &dyn Waitable, &b, &p, &reader],
            Some(Duration::from_millis(100)),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(start.elapsed() >= Duration::from_millis(100));
        // A queue whose last other handle goes is ready: its get says Disconnected.
        drop(keep);
        assert_eq!(
            wait(&[&a as &dyn Waitable, &b, &p], Some(secs(10))).unwrap(),
            [0, 1]
        );
        assert!(a.get().unwrap_err().is_disconnected());
        // A pipe end is ready when an item waits; a process once it ends.
        writer.send(1).unwrap();
        assert_eq!(
            wait(&[&p as &dyn Waitable, &reader], Some(secs(10))).unwrap(),
            [1]
        );
        go.set();
        p.join().unwrap();
        assert_eq!(wait(&[&p], Some(secs(10))).unwrap(), [0]);
    });
}

// ---------------------------------------------------------------------------------------
// Item: imap with a chunk size.

fn square_unless_13(x: u64) -> Result<u64, String> {
    if x == 13 {
        Err("13 is unlucky".into())
    } else {
        Ok(x * x)
    }
}

#[test]
fn imap_chunked_yields_every_result_in_order() {
    common::run(secs(60), || {
        let mut pool = Pool::new(2).unwrap();
        for chunksize in [0, 1, 7, 64, 1000] {
            let got: Vec<_> = pool
                .imap_chunked(square_unless_13, 0..500u64, chunksize)
                .collect();
            assert_eq!(got.len(), 500, "chunksize {chunksize}");
            for (x, r) in got.into_iter().enumerate() {
                match r {
                    Ok(v) => {
                        assert_ne!(x, 13, "chunksize {chunksize}: task 13 did not fail");
                        assert_eq!(v, (x * x) as u64, "chunksize {chunksize}");
                    }
                    Err(e) => assert!(
                        x == 13 && matches!(e, Error::TaskFailed { index: 13, .. }),
                        "chunksize {chunksize}, item {x}: {e}"
                    ),
                }
            }
            let mut unordered: Vec<u64> = pool
                .imap_unordered_chunked(square_unless_13, 0..500u64, chunksize)
                .filter_map(Result::ok)
                .collect();
            unordered.sort_unstable();
            let expected: Vec<u64> = (0..500u64).filter(|&x| x != 13).map(|x| x * x).collect();
            assert_eq!(unordered, expected, "chunksize {chunksize}");
        }
        pool.close();
        pool.join().unwrap();
    });
}
