//! Fault injection: SIGKILL a producer mid-put, a consumer mid-get, a pool worker
//! mid-task, a lock holder and the shm manager at random points, and check what the
//! survivors see.
//!
//! Every scenario runs as the root of its own process tree (the test binary executed
//! again with `--ignored --exact scenario_…`, no inherited shm manager, a 200 ms manager
//! grace), so that once the tree has exited its shm manager cleans up and this process
//! can check that nothing of the tree is left: no process (found by a tag in its
//! environment) and no segment in `/dev/shm`. Inside the tree, after every iteration:
//! the killed process is reaped, no other worker is left, and the survivors either got
//! a clear error or carried on (each role below says which).
//!
//! Seeded and reproducible: the seed is printed; `MULTIPROC_FAULT_SEED=<seed>` replays
//! the same random choices (the kill instants still depend on the machine's timing).
//! `MULTIPROC_FAULT_ITERATIONS` changes the iterations of the default run (8 per role
//! and strategy); the `#[ignore]`d soak runs 100.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use multiproc::{
    DType, Error, Event, Lock, Pool, Process, Queue, SharingStrategy, SimpleQueue, Tensor, Value,
};

/// Iterations per role and strategy in the default run.
const DEFAULT_ITERATIONS: u32 = 8;
/// Iterations per role and strategy in the soak.
const SOAK_ITERATIONS: u32 = 100;
/// How long any single wait inside a scenario may take before it counts as a hang.
const WAIT: Duration = Duration::from_secs(30);

// ----- a small reproducible PRNG (splitmix64) -----

use common::Rng;

fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// The run's seed: `MULTIPROC_FAULT_SEED`, or one drawn from the clock; printed once.
fn base_seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = std::env::var("MULTIPROC_FAULT_SEED")
            .ok()
            .and_then(|s| parse_u64(&s))
            .unwrap_or_else(|| {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64);
                Rng(t ^ u64::from(std::process::id()) << 32).next_u64()
            });
        eprintln!("fault injection seed: {seed:#x} (MULTIPROC_FAULT_SEED={seed:#x} replays it)");
        seed
    })
}

/// The seed of one scenario tree, derived from the run's seed and its name.
fn tree_seed(scenario: &str, strategy: SharingStrategy) -> u64 {
    let mut h = base_seed();
    for b in scenario.bytes().chain(strategy.to_string().bytes()) {
        h = Rng(h ^ u64::from(b)).next_u64();
    }
    h
}

// ----- the outer side: run a scenario as its own tree and check what it leaves -----

/// What one tree reported, for the soak's table.
#[derive(Debug, Default, Clone)]
struct Report {
    line: String,
}

impl Report {
    fn field(&self, key: &str) -> u64 {
        self.line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

/// The pids of live processes whose environment carries `tag`.
fn tagged_processes(tag: &str) -> BTreeSet<u32> {
    let needle = format!("MULTIPROC_FAULT_TAG={tag}");
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) && common::alive(pid) {
            out.insert(pid);
        }
    }
    out
}

fn creator_of(segment: &str) -> Option<u32> {
    segment
        .strip_prefix("multiproc_")?
        .split('_')
        .next()?
        .parse()
        .ok()
}

/// Runs `scenario` (an `#[ignore]`d test of this file) as the root of a new process
/// tree with `iterations` iterations, then checks that the tree left no process and no
/// segment behind. Returns the scenario's `FAULTSTATS` line.
fn run_tree(scenario: &str, strategy: SharingStrategy, iterations: u32) -> Report {
    static TREES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let tag = format!(
        "{}-{}-{}",
        std::process::id(),
        TREES.fetch_add(1, Ordering::Relaxed),
        scenario
    );
    let seed = tree_seed(scenario, strategy);
    let before = common::our_segments();
    let deadline = Duration::from_secs(60) + Duration::from_secs(3) * iterations;

    // Who belongs to the tree: sampled while it runs (the tag is inherited by every
    // worker and by the shm manager), plus the pids the scenario itself reports.
    let members = Arc::new(Mutex::new(BTreeSet::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (members, stop, tag) = (Arc::clone(&members), Arc::clone(&stop), tag.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let seen = tagged_processes(&tag);
                members.lock().unwrap().extend(seen);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };

    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            scenario,
            "--nocapture",
            "--test-threads=1",
        ])
        .env_remove("MULTIPROC_SHM_MANAGER")
        .env("MULTIPROC_SHM_MANAGER_GRACE_MS", "200")
        .env("MULTIPROC_FAULT_TAG", &tag)
        .env("MULTIPROC_FAULT_SEED", seed.to_string())
        .env("MULTIPROC_FAULT_ITERATIONS", iterations.to_string())
        .env("MULTIPROC_FAULT_STRATEGY", strategy.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the scenario");
    let root = child.id();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the scenario") {
            break Some(s);
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    let Some(status) = status else {
        stop.store(true, Ordering::Relaxed);
        let _ = monitor.join();
        panic!(
            "HANG: scenario {scenario} ({strategy}, seed {seed:#x}) ran past its {deadline:?} deadline:\n{text}"
        );
    };
    assert!(
        status.success(),
        "scenario {scenario} ({strategy}, seed {seed:#x}) failed ({status}):\n{text}"
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("FAULTSTATS"))
        .unwrap_or_else(|| panic!("scenario {scenario} did not run:\n{text}"))
        .to_owned();

    // No process of the tree survives it (the manager leaves after its 200 ms grace).
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let left = tagged_processes(&tag);
        members.lock().unwrap().extend(left.iter().copied());
        if left.is_empty() {
            break;
        }
        if Instant::now() > until {
            let who: Vec<String> = left
                .iter()
                .map(|p| {
                    let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                    format!("{p} ({})", String::from_utf8_lossy(&cmd).replace('\0', " "))
                })
                .collect();
            for p in &left {
                let _ = Command::new("kill")
                    .args(["-KILL", &p.to_string()])
                    .status();
            }
            panic!("processes of the {scenario} tree survived it: {who:?}\n{text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    monitor.join().unwrap();

    // Nothing of the tree is left in /dev/shm. /dev/shm is machine-wide, so a new
    // segment counts against the tree when its creator was one of the tree's processes.
    let mut members = std::mem::take(&mut *members.lock().unwrap());
    members.insert(root);
    for l in text.lines().filter_map(|l| l.strip_prefix("FAULTPIDS ")) {
        members.extend(l.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    let new: Vec<String> = common::our_segments()
        .difference(&before)
        .cloned()
        .collect();
    let leaked: Vec<&String> = new
        .iter()
        .filter(|s| creator_of(s).is_some_and(|c| members.contains(&c)))
        .collect();
    assert!(
        leaked.is_empty(),
        "the {scenario} tree ({strategy}, seed {seed:#x}) left segments in /dev/shm: {leaked:?}\n{line}"
    );
    if new.len() > leaked.len() {
        eprintln!(
            "note: {} new segments of other processes on this machine appeared meanwhile",
            new.len() - leaked.len()
        );
    }
    eprintln!("{line} leaked_segments=0 surviving_processes=0");
    Report { line }
}

fn iterations() -> u32 {
    std::env::var("MULTIPROC_FAULT_ITERATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_ITERATIONS)
}

const BOTH: [SharingStrategy; 2] = [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem];

fn outer(scenario: &'static str, strategies: &'static [SharingStrategy]) {
    let n = iterations();
    common::run(Duration::from_secs(600), move || {
        for &s in strategies {
            run_tree(scenario, s, n);
        }
    });
}

#[test]
fn producer_killed_mid_put() {
    outer("scenario_producer_mid_put", &BOTH);
}

#[test]
fn consumer_killed_mid_get() {
    outer("scenario_consumer_mid_get", &BOTH);
}

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

/// 100 iterations per role and strategy; prints a table of what was measured.
#[test]
#[ignore = "soak: long; run with `cargo test --test faults -- --ignored soak`"]
fn soak() {
    common::run(Duration::from_secs(3600), || {
        let plan: [(&str, &[SharingStrategy]); 5] = [
            ("scenario_producer_mid_put", &BOTH),
            ("scenario_consumer_mid_get", &BOTH),
            ("scenario_pool_worker_mid_task", &BOTH),
            ("scenario_lock_holder", &[SharingStrategy::FileDescriptor]),
            ("scenario_shm_manager", &[SharingStrategy::FileSystem]),
        ];
        let mut rows = Vec::new();
        for (scenario, strategies) in plan {
            for &s in strategies {
                let started = Instant::now();
                let r = run_tree(scenario, s, SOAK_ITERATIONS);
                rows.push((r, started.elapsed()));
            }
        }
        println!("SOAK seed {:#x}", base_seed());
        for (r, took) in &rows {
            println!("SOAK {} seconds={:.1}", r.line, took.as_secs_f64());
        }
        let total_kills: u64 = rows.iter().map(|(r, _)| r.field("kills")).sum();
        let total_iters: u64 = rows.iter().map(|(r, _)| r.field("iterations")).sum();
        println!(
            "SOAK total iterations={total_iters} kills={total_kills} hangs=0 leaked_segments=0"
        );
    });
}

// ----- the inner side: the scenarios, run inside their own trees -----

struct Config {
    rng: Rng,
    iterations: u32,
    strategy: SharingStrategy,
}

impl Config {
    /// From the environment the outer side sets; defaults when a scenario is run by
    /// hand (`cargo test --test faults -- --ignored scenario_lock_holder`).
    fn from_env() -> Config {
        let var = |k: &str| std::env::var(k).ok();
        Config {
            rng: Rng(var("MULTIPROC_FAULT_SEED")
                .and_then(|s| parse_u64(&s))
                .unwrap_or_else(base_seed)),
            iterations: var("MULTIPROC_FAULT_ITERATIONS")
                .and_then(|s| s.parse().ok())
                .unwrap_or(3),
            strategy: var("MULTIPROC_FAULT_STRATEGY")
                .and_then(|s| s.parse().ok())
                .unwrap_or(SharingStrategy::FileDescriptor),
        }
    }
}

/// What a scenario counts. `errors` are the clear errors survivors saw (each is
/// checked where it happens); `details` are role-specific counters.
#[derive(Default)]
struct Stats {
    iterations: u32,
    kills: u32,
    errors: u32,
    details: Vec<(&'static str, u64)>,
    pids: BTreeSet<u32>,
}

impl Stats {
    fn add(&mut self, key: &'static str, n: u64) {
        match self.details.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v += n,
            None => self.details.push((key, n)),
        }
    }

    fn pid(&mut self, pid: Option<u32>) {
        if let Some(p) = pid {
            self.pids.insert(p);
        }
    }
}

/// Runs a scenario body and prints its `FAULTSTATS` line.
fn scenario(name: &str, body: fn(&mut Config, &mut Stats)) {
    let mut cfg = Config::from_env();
    multiproc::set_sharing_strategy(cfg.strategy);
    let mut stats = Stats::default();
    body(&mut cfg, &mut stats);
    let pids: Vec<String> = stats.pids.iter().map(u32::to_string).collect();
    println!("FAULTPIDS {}", pids.join(" "));
    let details: String = stats
        .details
        .iter()
        .map(|(k, v)| format!(" {k}={v}"))
        .collect();
    println!(
        "FAULTSTATS scenario={name} strategy={} iterations={} kills={} errors={}{details}",
        cfg.strategy, stats.iterations, stats.kills, stats.errors
    );
}

/// After an iteration: every child of this process has been reaped.
fn assert_no_children_left() {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let kids = common::children();
        if kids.is_empty() {
            return;
        }
        assert!(
            Instant::now() < until,
            "worker processes survived the iteration: {kids:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Kills `p` and checks that it died of it (not of something else first).
fn kill_and_reap(p: &mut Process, stats: &mut Stats) {
    p.kill().expect("SIGKILL the worker");
    stats.kills += 1;
    let status = p
        .join_timeout(WAIT)
        .unwrap_or_else(|e| panic!("worker {:?} was not joined after SIGKILL: {e}", p.pid()));
    assert_eq!(
        status.signal_name().as_deref(),
        Some("SIGKILL"),
        "the worker ended by itself before it was killed: {:?}",
        p.error()
    );
}

fn kill_pid(pid: u32) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    // ESRCH (already gone) is fine: the point is that it is not running.
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
}

/// The value every element of item `seq` holds.
fn value_of(seq: u64) -> f32 {
    (seq % 1024) as f32
}

fn check_item(seq: u64, t: &Tensor) -> Result<(), String> {
    let v = t.to_vec::<f32>().map_err(|e| e.to_string())?;
    if v.is_empty() || v.iter().any(|&x| x != value_of(seq)) {
        return Err(format!(
            "item {seq} arrived damaged: {} elements, first {:?}",
            v.len(),
            v.first()
        ));
    }
    Ok(())
}

fn make_item(seq: u64, rng: &mut Rng) -> Result<Tensor, String> {
    let n = 1 + rng.below(1 << 14) as usize;
    Tensor::full(&[n], f64::from(value_of(seq)), DType::F32).map_err(|e| e.to_string())
}

/// The survivor carries on: the queue still delivers a fresh item both ways.
/// The next item a queue still holds once the processes on its other side are gone:
/// `None` at empty, whether another handle is left (`Ok(None)`) or none is
/// (`Disconnected`).
fn still_queued<T>(got: multiproc::Result<Option<T>>, what: &str) -> Option<T> {
    match got {
        Ok(item) => item,
        Err(e) if e.is_disconnected() => None,
        Err(e) => panic!("{what}: {e}"),
    }
}

fn queue_still_works<Q: RoundTrip>(q: &Q) {
    let t = Tensor::full(&[5], f64::from(value_of(77)), DType::F32).unwrap();
    let (seq, back) = q.round_trip((77, t));
    assert_eq!(seq, 77);
    check_item(77, &back).unwrap();
}

trait RoundTrip {
    fn round_trip(&self, item: (u64, Tensor)) -> (u64, Tensor);
}

impl RoundTrip for SimpleQueue<(u64, Tensor)> {
    fn round_trip(&self, item: (u64, Tensor)) -> (u64, Tensor) {
        self.put(item)
            .map_err(|e| e.error)
            .expect("put after the kill");
        self.get_timeout(WAIT)
            .expect("the item put after the kill did not arrive")
    }
}

impl RoundTrip for Queue<(u64, Tensor)> {
    fn round_trip(&self, item: (u64, Tensor)) -> (u64, Tensor) {
        self.put_timeout(item, WAIT)
            .map_err(|e| e.error)
            .expect("put after the kill");
        self.get_timeout(WAIT)
            .expect("the item put after the kill did not arrive")
    }
}

// --- producer mid-put ---

fn produce_until_killed(
    _rank: usize,
    (q, started, seed): (SimpleQueue<(u64, Tensor)>, Event, u64),
) -> Result<(), String> {
    let mut rng = Rng(seed);
    for seq in 0u64.. {
        let t = make_item(seq, &mut rng)?;
        q.put((seq, t)).map_err(|e| e.error.to_string())?;
        if seq == 0 {
            started.set();
        }
    }
    Ok(())
}

/// A producer puts tensors as fast as it can and is SIGKILLed at a random instant
/// (during start-up one time in four). The consumer gets every item it sent, in order
/// and intact, and no error: a packet is sent whole or not at all, and handles in
/// flight keep their segments alive. The queue keeps working.
#[test]
#[ignore = "run as its own process tree by producer_killed_mid_put"]
fn scenario_producer_mid_put() {
    scenario("producer_mid_put", |cfg, stats| {
        for i in 0..cfg.iterations {
            let q = SimpleQueue::<(u64, Tensor)>::new().unwrap();
            let started = Event::new().unwrap();
            let mut p = Process::new(
                produce_until_killed,
                0,
                (q.clone(), started.clone(), cfg.rng.next_u64()),
            )
            .daemon(true);
            p.start().unwrap();
            stats.pid(p.pid());
            if cfg.rng.chance(3, 4) {
                started.wait_timeout(WAIT).expect("the producer never put");
            }
            let until = Instant::now() + cfg.rng.delay(40);
            let mut next = 0u64;
            let take = |item: (u64, Tensor), next: &mut u64| {
                assert_eq!(item.0, *next, "items arrive in order, none twice");
                check_item(item.0, &item.1).unwrap();
                *next += 1;
            };
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                match q.get_timeout(left) {
                    Ok(item) => take(item, &mut next),
                    Err(e) if e.is_timeout() => break,
                    Err(e) => panic!("a get while the producer runs failed: {e}"),
                }
            }
            kill_and_reap(&mut p, stats);
            // Everything it sent before it died arrives.
            while let Some(item) = still_queued(q.try_get(), "a get after the kill") {
                take(item, &mut next);
            }
            queue_still_works(&q);
            drop(p);
            assert_no_children_left();
            stats.iterations += 1;
            stats.add("items", next);
            eprintln!("iteration {i}: {next} items before and after the kill");
        }
    });
}

// --- consumer mid-get ---

fn consume_until_killed(
    _rank: usize,
    (work, acks, started): (Queue<(u64, Tensor)>, SimpleQueue<u64>, Event),
) -> Result<(), String> {
    started.set();
    loop {
        let (seq, t) = work.get().map_err(|e| e.to_string())?;
        check_item(seq, &t)?;
        acks.put(seq).map_err(|e| e.error.to_string())?;
    }
}

/// A consumer takes tensors from a bounded queue, acknowledging each, and is SIGKILLed
/// at a random instant. At most the one item in its hands is lost: every other item
/// was either acknowledged or is still in the queue, intact, and the queue keeps
/// working. `slots_lost` counts places of the bounded queue that a kill leaked (the
/// consumer died inside the `recvmsg` that took a packet, before it could free the
/// place — a window of one system call, as in Python's `multiprocessing.Queue`); a
/// full queue then says so with a `Timeout`, which counts as an error seen.
#[test]
#[ignore = "run as its own process tree by consumer_killed_mid_get"]
fn scenario_consumer_mid_get() {
    scenario("consumer_mid_get", |cfg, stats| {
        for i in 0..cfg.iterations {
            let total = 32 + cfg.rng.below(64);
            let capacity = total as usize + 8;
            let work = Queue::<(u64, Tensor)>::with_capacity(capacity).unwrap();
            let acks = SimpleQueue::<u64>::new().unwrap();
            let started = Event::new().unwrap();
            for seq in 0..total {
                let t = make_item(seq, &mut cfg.rng).unwrap();
                work.put_timeout((seq, t), WAIT)
                    .map_err(|e| e.error)
                    .unwrap();
            }
            let mut p = Process::new(
                consume_until_killed,
                0,
                (work.clone(), acks.clone(), started.clone()),
            )
            .daemon(true);
            p.start().unwrap();
            stats.pid(p.pid());
            if cfg.rng.chance(3, 4) {
                started.wait_timeout(WAIT).expect("the consumer never ran");
            }
            std::thread::sleep(cfg.rng.delay(15));
            kill_and_reap(&mut p, stats);
            let mut acked = BTreeSet::new();
            while let Some(seq) = still_queued(acks.try_get(), "get an ack") {
                assert!(acked.insert(seq), "item {seq} acknowledged twice");
            }
            let mut left = BTreeSet::new();
            while let Some((seq, t)) = still_queued(work.try_get(), "get after the kill") {
                check_item(seq, &t).unwrap();
                assert!(
                    !acked.contains(&seq) && left.insert(seq),
                    "item {seq} delivered twice"
                );
            }
            let lost = total - (acked.len() + left.len()) as u64;
            assert!(
                lost <= 1,
                "{lost} items lost: only the one in the consumer's hands may be ({} acked, {} left of {total})",
                acked.len(),
                left.len()
            );
            assert!(acked.iter().chain(&left).all(|&s| s < total));
            // The survivor carries on: the queue works, and (capacity permitting) takes
            // as many items as before.
            queue_still_works(&work);
            let mut fit = 0;
            for seq in 0..capacity as u64 {
                let t = Tensor::full(&[1], f64::from(value_of(seq)), DType::F32).unwrap();
                match work.put_timeout((seq, t), Duration::from_millis(300)) {
                    Ok(()) => fit += 1,
                    Err(e) => {
                        assert!(matches!(e.error, Error::Timeout { .. }), "{}", e.error);
                        stats.errors += 1;
                        break;
                    }
                }
            }
            while still_queued(work.try_get(), "drain").is_some() {}
            drop(p);
            assert_no_children_left();
            stats.iterations += 1;
            stats.add("items", total);
            stats.add("lost_in_hand", lost);
            stats.add("slots_lost", (capacity - fit) as u64);
            eprintln!(
                "iteration {i}: {} acked, {} left, {lost} lost of {total}; {fit}/{capacity} places",
                acked.len(),
                left.len()
            );
        }
    });
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
                    Err(Error::TaskFailed { index, message }) => {
                        assert_eq!(index, k);
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
            let mut p = Process::new(
                hold_lock_until_killed,
                0,
                (lock.clone(), a.clone(), b.clone(), started.clone()),
            )
            .daemon(true);
            p.start().unwrap();
            let pid = p.pid().unwrap();
            stats.pid(Some(pid));
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
            let mut p = Process::new(
                produce_file_system_tensors,
                0,
                (q.clone(), stop.clone(), cfg.rng.next_u64()),
            )
            .daemon(true);
            p.start().unwrap();
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
