//! Fault injection, the harness shared by tests/faults_queue.rs and
//! tests/faults_processes.rs: SIGKILL a producer mid-put, a consumer mid-get, a pool worker
//! mid-task, a lock holder and the shm manager at random points, and check what the
//! survivors see.
//!
//! Every scenario runs as the root of its own process tree (the test binary executed
//! again with `--ignored --exact scenario_…`, no inherited shm manager, a 200 ms manager
//! grace), so that once the tree has exited its shm manager cleans up and this process
//! can check that nothing of the tree is left: no process (found by a tag in its
//! environment) and no segment in `/dev/shm`. Inside the tree, after every iteration:
//! the killed process is reaped, no other worker is left, and the survivors either got
//! a clear error or carried on (each role's scenario says which).
//!
//! Seeded and reproducible: the seed is printed; `MULTIPROC_FAULT_SEED=<seed>` replays
//! the same random choices (the kill instants still depend on the machine's timing).
//! `MULTIPROC_FAULT_ITERATIONS` changes the iterations of the default run (8 per role
//! and strategy); the `#[ignore]`d soak runs 100.

use std::collections::BTreeSet;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use multiproc::{DType, Process, Queue, SharingStrategy, SimpleQueue, Tensor};

use super::Rng;

/// Iterations per role and strategy in the default run.
pub const DEFAULT_ITERATIONS: u32 = 8;
/// Iterations per role and strategy in the soak.
pub const SOAK_ITERATIONS: u32 = 100;
/// How long any single wait inside a scenario may take before it counts as a hang.
pub const WAIT: Duration = Duration::from_secs(30);

// ----- a small reproducible PRNG (splitmix64) -----

pub fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// The run's seed: `MULTIPROC_FAULT_SEED`, or one drawn from the clock; printed once.
pub fn base_seed() -> u64 {
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
pub fn tree_seed(scenario: &str, strategy: SharingStrategy) -> u64 {
    let mut h = base_seed();
    for b in scenario.bytes().chain(strategy.to_string().bytes()) {
        h = Rng(h ^ u64::from(b)).next_u64();
    }
    h
}

// ----- the outer side: run a scenario as its own tree and check what it leaves -----

/// What one tree reported, for the soak's table.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub line: String,
}

impl Report {
    pub fn field(&self, key: &str) -> u64 {
        self.line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

/// The pids of live processes whose environment carries `tag`.
pub fn tagged_processes(tag: &str) -> BTreeSet<u32> {
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
        if env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) && super::alive(pid) {
            out.insert(pid);
        }
    }
    out
}

pub fn creator_of(segment: &str) -> Option<u32> {
    multiproc::maintenance::Segment::parse(segment)
        .ok()
        .map(|s| s.creator())
}

/// Runs `scenario` (an `#[ignore]`d test of this file) as the root of a new process
/// tree with `iterations` iterations, then checks that the tree left no process and no
/// segment behind. Returns the scenario's `FAULTSTATS` line.
pub fn run_tree(scenario: &str, strategy: SharingStrategy, iterations: u32) -> Report {
    static TREES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let tag = format!(
        "{}-{}-{}",
        std::process::id(),
        TREES.fetch_add(1, Ordering::Relaxed),
        scenario
    );
    let seed = tree_seed(scenario, strategy);
    let before = super::our_segments();
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
    let new: Vec<String> = super::our_segments().difference(&before).cloned().collect();
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

pub fn iterations() -> u32 {
    std::env::var("MULTIPROC_FAULT_ITERATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_ITERATIONS)
}

pub const BOTH: [SharingStrategy; 2] =
    [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem];

pub fn outer(scenario: &'static str, strategies: &'static [SharingStrategy]) {
    let n = iterations();
    super::run(Duration::from_secs(600), move || {
        for &s in strategies {
            run_tree(scenario, s, n);
        }
    });
}

/// The soak of one test binary's scenarios: `SOAK_ITERATIONS` per role and strategy;
/// prints a table of what was measured.
pub fn soak(plan: &'static [(&'static str, &'static [SharingStrategy])]) {
    super::run(Duration::from_secs(3600), move || {
        let mut rows = Vec::new();
        for &(scenario, strategies) in plan {
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

pub struct Config {
    pub rng: Rng,
    pub iterations: u32,
    pub strategy: SharingStrategy,
}

impl Config {
    /// From the environment the outer side sets; defaults when a scenario is run by
    /// hand (`cargo test --test faults_processes -- --ignored scenario_lock_holder`).
    pub fn from_env() -> Config {
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
pub struct Stats {
    pub iterations: u32,
    pub kills: u32,
    pub errors: u32,
    pub details: Vec<(&'static str, u64)>,
    pub pids: BTreeSet<u32>,
}

impl Stats {
    pub fn add(&mut self, key: &'static str, n: u64) {
        match self.details.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v += n,
            None => self.details.push((key, n)),
        }
    }

    pub fn pid(&mut self, pid: u32) {
        self.pids.insert(pid);
    }
}

/// Runs a scenario body and prints its `FAULTSTATS` line.
pub fn scenario(name: &str, body: fn(&mut Config, &mut Stats)) {
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
pub fn assert_no_children_left() {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let kids = super::children();
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
pub fn kill_and_reap(p: &mut Process, stats: &mut Stats) {
    p.kill().expect("SIGKILL the worker");
    stats.kills += 1;
    let status = p
        .join_timeout(WAIT)
        .unwrap_or_else(|e| panic!("worker {} was not joined after SIGKILL: {e}", p.pid()));
    assert_eq!(
        status.signal_name().as_deref(),
        Some("SIGKILL"),
        "the worker ended by itself before it was killed: {:?}",
        p.error()
    );
}

pub fn kill_pid(pid: u32) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    // ESRCH (already gone) is fine: the point is that it is not running.
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
}

/// The value every element of item `seq` holds.
pub fn value_of(seq: u64) -> f32 {
    (seq % 1024) as f32
}

pub fn check_item(seq: u64, t: &Tensor) -> Result<(), String> {
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

pub fn make_item(seq: u64, rng: &mut Rng) -> Result<Tensor, String> {
    let n = 1 + rng.below(1 << 14) as usize;
    Tensor::full(&[n], f64::from(value_of(seq)), DType::F32).map_err(|e| e.to_string())
}

/// The survivor carries on: the queue still delivers a fresh item both ways.
/// The next item a queue still holds once the processes on its other side are gone:
/// `None` at empty, whether another handle is left (`Ok(None)`) or none is
/// (`Disconnected`).
pub fn still_queued<T>(got: multiproc::Result<Option<T>>, what: &str) -> Option<T> {
    match got {
        Ok(item) => item,
        Err(e) if e.is_disconnected() => None,
        Err(e) => panic!("{what}: {e}"),
    }
}

pub fn queue_still_works<Q: RoundTrip>(q: &Q) {
    let t = Tensor::full(&[5], f64::from(value_of(77)), DType::F32).unwrap();
    let (seq, back) = q.round_trip((77, t));
    assert_eq!(seq, 77);
    check_item(77, &back).unwrap();
}

pub trait RoundTrip {
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
