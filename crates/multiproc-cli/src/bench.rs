//! `multiproc bench`: the product's end-to-end scenarios, measured across real
//! processes, with both sharing strategies (`file_descriptor` and `file_system`).
//!
//! # Scenarios
//!
//! | scenario | what one iteration is | sizes (count at `--scale 1`) | figure |
//! |---|---|---|---|
//! | `fresh` | the worker makes a new shared f32 tensor (`Tensor::empty_shared`), fills it and `put`s it on a queue of capacity 4; the parent `get`s it and sums it | 4 KiB (200,000), 1 MiB (500), 64 MiB (40), 256 MiB (40) | tensors/s and GB/s |
//! | `small` | as `fresh`, with 64 f32 (256 bytes) per tensor: the per-message cost | 256 B (200,000) | tensors/s |
//! | `ping` | the parent `put`s one shared tensor, the worker sends it straight back, the parent `get`s it: a round trip of the same storage; at size 0, a number instead of a tensor (what any message costs, the tensor's handling being the difference) | 0 (a number), 4 KiB and 64 MiB (20,000 each) | µs per round trip |
//! | `spawn` | `multiproc::spawn` of 4 no-op workers and their join, after one warm-up | 4 workers (median of 10) | seconds |
//! | `memory` | 8 workers each `put` 50 fresh 64 MiB tensors (scaled) on one queue and exit; the parent `get`s and drops each, then holds the queue, idle | 8 × 50 × 64 MiB | the machine's committed shared memory (`Shmem`) before, at the end of the burst, and every 100 ms for 2 s after (one row each) |
//! | `stopped` | 8 producers and 8 consumers of plain numbers on one `SimpleQueue`; one of them is stopped (SIGSTOP, as a debugger or Ctrl-Z does) at whatever point it is at, for 2 s, then continued; a producer, then a consumer (runs only when named) | 16 processes, 3 s before, 2 s stopped, 2 s after, per victim | the others' messages/s in each window; the run fails if a message was lost or duplicated or a `get` without deadline returned |
//! | `--async` (not a scenario: its own run) | a worker `get`s a go, sleeps 1 ms (so the parent is asleep, past its spin) and `put`s the `CLOCK_MONOTONIC` time; the parent takes it with a blocking `get` and, on alternate rounds, an awaited `get_async` (on a one-thread `block_on`, no runtime): the time from the worker's `put` to the parent holding the item. Then `disconnect` with the get awaited | 2,000 rounds (half each); median of 20 | µs, median and p99, blocking beside async; seconds |
//! | `disconnect` | a worker holds the parent's queue; the parent waits in `get` on it, empty; the worker drops the queue, says so through a pipe, and exits; the time from that word to the parent's `Error::Disconnected` | median of 20 | seconds |
//!
//! Every scenario but `spawn` starts its worker first and waits for it to say it is
//! ready, so process start-up is timed only by `spawn`; and the parent shares one
//! tensor before it starts the worker, so a `file_system` run does not time starting
//! the process tree's shm manager (which the first named segment of a tree does, once). `--json` prints one object per
//! figure with the fields of [`Figure`] (`scenario, strategy, bytes, count, per_s, GB_s,
//! us_per_roundtrip, seconds, impl`).
//!
//! # Baselines
//!
//! A figure means something only against a baseline measured in the same run on the
//! same machine: `multiproc bench-floor` measures the raw floor (a `SOCK_SEQPACKET` +
//! `SCM_RIGHTS` ping-pong between two processes, a futex and a spinning ping-pong over
//! one shared word, and fill+sum of a reused buffer in one process, `impl: "floor"`), and `scripts/compare_torch.py` runs this command, the floor
//! and, when torch is installed, the same scenarios in torch.multiprocessing, and prints
//! the ratios (the README's "Performance" table is one such run). The targets the
//! project holds itself to, as ratios: `fresh` 4 KiB at ≥ 0.5× and 64 MiB / 256 MiB at
//! ≥ 0.8× the in-process fill+sum; `ping` within 1.2× of the futex round trip;
//! `file_system` within 1.5× of `file_descriptor`; `spawn` of 4 workers ≤ 30 ms.

use std::time::{Duration, Instant};

use multiproc::dist::{ProcessGroup, ReduceOp};
use multiproc::{DType, Event, Queue, SharingStrategy, SimpleQueue, StartMethod, Tensor};
use serde::{Deserialize, Serialize};

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    scenario: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    strategy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<u64>,
    count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    per_s: Option<f64>,
    #[serde(rename = "GB_s", skip_serializing_if = "Option::is_none")]
    gb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    us_per_roundtrip: Option<f64>,
    seconds: f64,
    /// Of `wake`: the median and 99th percentile wake-up, in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99_us: Option<f64>,
    #[serde(rename = "impl")]
    implementation: &'static str,
}

impl Figure {
    /// The bandwidth, when the figure has one.
    pub fn gb_s(&self) -> Option<f64> {
        self.gb_s
    }

    /// A figure of the raw floor (`impl: "floor"`).
    pub fn floor(
        scenario: &'static str,
        bytes: Option<u64>,
        count: u64,
        seconds: f64,
        us_per_roundtrip: Option<f64>,
    ) -> Self {
        Figure {
            scenario,
            strategy: None,
            bytes,
            count,
            per_s: Some(count as f64 / seconds),
            gb_s: bytes.map(|b| (b * count) as f64 / seconds / 1e9),
            us_per_roundtrip,
            seconds,
            implementation: "floor",
            p50_us: None,
            p99_us: None,
        }
    }
}

#[derive(Serialize, Deserialize)]
enum Msg {
    Ready,
    Tensor(Tensor),
    /// `ping`'s message without a tensor (`--bytes 0`).
    Number(u64),
}

/// Worker of `fresh` and `small`: makes `count` new tensors of `floats` f32, fills
/// each, puts it.
fn producer(_rank: usize, (q, floats, count): (Queue<Msg>, usize, u64)) -> multiproc::Result<()> {
    q.put(Msg::Ready)?;
    for i in 0..count {
        // Made in shared memory, as a producer of tensors to send should (torch's
        // producer does `empty` then `fill_`): `zeros` plus the implicit
        // `share_memory_` of `put` would write every byte three times.
        let t = Tensor::empty_shared(&[floats], DType::F32)?;
        t.fill_((i % 7) as f64)?;
        q.put(Msg::Tensor(t))?;
    }
    Ok(())
}

/// Worker of `ping`: sends every tensor it gets straight back.
fn ponger(
    _rank: usize,
    (inbox, outbox, count): (Queue<Msg>, Queue<Msg>, u64),
) -> multiproc::Result<()> {
    outbox.put(Msg::Ready)?;
    for _ in 0..count {
        let m = inbox.get()?;
        outbox.put(m)?;
    }
    Ok(())
}

fn noop(_rank: usize, _: ()) {}

/// Of `disconnect`: lets go of the queue, then says so.
fn let_go(
    _rank: usize,
    (q, said): (Queue<Msg>, multiproc::Connection<u8>),
) -> multiproc::Result<()> {
    drop(q);
    said.send(1)?;
    Ok(())
}

fn expect_ready(q: &Queue<Msg>) -> multiproc::Result<()> {
    match q.get_timeout(Duration::from_secs(60))? {
        Msg::Ready => Ok(()),
        _ => Err(multiproc::Error::InvalidMessage(
            "the benchmark worker sent a tensor before it said it was ready".into(),
        )),
    }
}

fn fresh(
    strategy: SharingStrategy,
    bytes: u64,
    count: u64,
    scenario: &'static str,
) -> multiproc::Result<Figure> {
    let q = Queue::with_capacity(4)?;
    let floats = (bytes / 4) as usize;
    Tensor::zeros(&[1], DType::F32)?.share_memory_()?;
    let mut ctx =
        multiproc::start_processes(producer, (q.clone(), floats, count), 1, StartMethod::Spawn)?;
    expect_ready(&q)?;
    let start = Instant::now();
    let mut total = 0.0;
    for _ in 0..count {
        match q.get_timeout(Duration::from_secs(120))? {
            Msg::Tensor(t) => total += t.sum()?,
            _ => {
                return Err(multiproc::Error::InvalidMessage(
                    "the producer sent something other than a tensor after it was ready".into(),
                ));
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(total);
    ctx.join_timeout(Duration::from_secs(60))?;
    Ok(Figure {
        scenario,
        strategy: Some(strategy.to_string()),
        bytes: Some(bytes),
        count,
        per_s: Some(count as f64 / seconds),
        gb_s: Some((bytes * count) as f64 / seconds / 1e9),
        us_per_roundtrip: None,
        seconds,
        implementation: "multiproc",
        p50_us: None,
        p99_us: None,
    })
}

fn ping(strategy: SharingStrategy, bytes: u64, count: u64) -> multiproc::Result<Figure> {
    let there = Queue::with_capacity(4)?;
    let back = Queue::with_capacity(4)?;
    let mut ctx = multiproc::start_processes(
        ponger,
        (there.clone(), back.clone(), count),
        1,
        StartMethod::Spawn,
    )?;
    expect_ready(&back)?;
    let unexpected = || {
        multiproc::Error::InvalidMessage(
            "the ping partner sent back something other than what it was sent".into(),
        )
    };
    let start;
    if bytes == 0 {
        start = Instant::now();
        for i in 0..count {
            there.put(Msg::Number(i))?;
            match back.get_timeout(Duration::from_secs(60))? {
                Msg::Number(n) if n == i => {}
                _ => return Err(unexpected()),
            }
        }
    } else {
        let mut t = Tensor::zeros(&[(bytes / 4) as usize], DType::F32)?;
        t.share_memory_()?;
        start = Instant::now();
        for _ in 0..count {
            there.put(Msg::Tensor(t))?;
            t = match back.get_timeout(Duration::from_secs(60))? {
                Msg::Tensor(t) => t,
                _ => return Err(unexpected()),
            };
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    ctx.join_timeout(Duration::from_secs(60))?;
    Ok(Figure {
        scenario: "ping",
        strategy: Some(strategy.to_string()),
        bytes: Some(bytes),
        count,
        per_s: Some(count as f64 / seconds),
        gb_s: None,
        us_per_roundtrip: Some(seconds * 1e6 / count as f64),
        seconds,
        implementation: "multiproc",
        p50_us: None,
        p99_us: None,
    })
}

fn spawn4(runs: u64) -> multiproc::Result<Figure> {
    multiproc::spawn(noop, (), 4)?; // warm the page cache and the launcher
    let mut times = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        multiproc::spawn(noop, (), 4)?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    Ok(Figure {
        scenario: "spawn",
        strategy: None,
        bytes: None,
        count: 4,
        per_s: None,
        gb_s: None,
        us_per_roundtrip: None,
        seconds: median,
        implementation: "multiproc",
        p50_us: None,
        p99_us: None,
    })
}

/// Of `memory`: `count` fresh 64 MiB tensors, then exit.
fn burst_producer(_rank: usize, (q, count): (Queue<Msg>, u64)) -> multiproc::Result<()> {
    for _ in 0..count {
        let t = Tensor::empty_shared(&[16 << 20], DType::F32)?;
        t.fill_(1.0)?;
        q.put(Msg::Tensor(t))?;
    }
    Ok(())
}

/// The machine's committed shared memory (`Shmem` of `/proc/meminfo`), in bytes.
fn shmem_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("Shmem:"))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb << 10)
}

/// The burst-then-idle curve: committed shared memory before the burst (`seconds`
/// -1), at its end (0), and every 100 ms for 2 s after, with the queue still held.
fn memory(strategy: SharingStrategy, per_worker: u64) -> multiproc::Result<Vec<Figure>> {
    const WORKERS: usize = 8;
    let sample = |seconds: f64, count: u64| Figure {
        scenario: "memory",
        strategy: Some(strategy.to_string()),
        bytes: Some(shmem_bytes()),
        count,
        per_s: None,
        gb_s: None,
        us_per_roundtrip: None,
        seconds,
        implementation: "multiproc",
        p50_us: None,
        p99_us: None,
    };
    let mut curve = vec![sample(-1.0, 0)];
    let q = Queue::<Msg>::with_capacity(4)?;
    let mut ctx = multiproc::start_processes(
        burst_producer,
        (q.clone(), per_worker),
        WORKERS,
        StartMethod::Spawn,
    )?;
    let total = per_worker * WORKERS as u64;
    for _ in 0..total {
        if let Msg::Tensor(t) = q.get()? {
            drop(t);
        }
    }
    ctx.join_timeout(Duration::from_secs(60))?;
    let end = Instant::now();
    curve.push(sample(0.0, total));
    for i in 1..=20u32 {
        let at = end + Duration::from_millis(100) * i;
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        curve.push(sample(end.elapsed().as_secs_f64(), total));
    }
    drop(q);
    Ok(curve)
}

/// The median time from the last other holder letting go of a queue to a waiting
/// `get`'s `Error::Disconnected`, over `runs`.
fn disconnect(runs: u64) -> multiproc::Result<Figure> {
    let mut times = Vec::new();
    for _ in 0..runs {
        let q = Queue::<Msg>::new()?;
        let (said, told) = multiproc::pipe::<u8>()?;
        let worker_q = q.clone();
        let waiter = std::thread::spawn(move || {
            let got = q.get();
            (
                Instant::now(),
                got.err().is_some_and(|e| e.is_disconnected()),
            )
        });
        let mut ctx = multiproc::start_processes(let_go, (worker_q, told), 1, StartMethod::Spawn)?;
        said.recv()?;
        let let_go_at = Instant::now();
        let (ended_at, disconnected) = waiter
            .join()
            .map_err(|_| multiproc::Error::InvalidArgument("the waiting thread panicked".into()))?;
        ctx.join_timeout(Duration::from_secs(30))?;
        if !disconnected {
            return Err(multiproc::Error::InvalidArgument(
                "a get on a queue whose last other holder left did not end with Disconnected"
                    .into(),
            ));
        }
        times.push(ended_at.saturating_duration_since(let_go_at).as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(Figure {
        scenario: "disconnect",
        strategy: None,
        bytes: None,
        count: runs,
        per_s: None,
        gb_s: None,
        us_per_roundtrip: None,
        seconds: times[times.len() / 2],
        implementation: "multiproc",
        p50_us: None,
        p99_us: None,
    })
}

/// Producer of `stopped`: puts `rank << 40 | i` for i = 0, 1, ... until `stop` is set;
/// reports how many it put.
fn stopped_producer(
    rank: usize,
    (q, stop, out): (SimpleQueue<u64>, Event, SimpleQueue<(u64, u64)>),
) -> multiproc::Result<()> {
    let mut i = 0u64;
    while !stop.is_set() {
        for _ in 0..64 {
            q.put((rank as u64) << 40 | i)?;
            i += 1;
        }
    }
    out.put((rank as u64, i))?;
    Ok(())
}

/// Consumer of `stopped`: gets until it takes an end mark, checking that each producer's
/// numbers come in order, each once; ticks `ticks` every 256 messages; reports how many
/// of each producer's it got (an error for a repeat, a number out of order or a failed
/// `get`). The parent sums the counts: a message lost, or taken by two consumers, shows.
fn stopped_consumer(
    _rank: usize,
    (q, ticks, out, producers): (
        SimpleQueue<u64>,
        SimpleQueue<u8>,
        SimpleQueue<Vec<u64>>,
        usize,
    ),
) -> multiproc::Result<()> {
    let mut next = vec![0u64; producers];
    let mut counts = vec![0u64; producers];
    let mut got = 0u64;
    loop {
        let v = q.get()?;
        if v == u64::MAX {
            break;
        }
        let (rank, i) = ((v >> 40) as usize, v & ((1 << 40) - 1));
        let Some(want) = next.get_mut(rank).filter(|w| **w <= i) else {
            return Err(multiproc::Error::InvalidMessage(format!(
                "producer {rank}'s message {i} came twice or out of order"
            )));
        };
        *want = i + 1;
        counts[rank] += 1;
        got += 1;
        if got % 256 == 0 {
            ticks.put(0)?;
        }
    }
    out.put(counts)?;
    Ok(())
}

/// The others' rate while one of 16 processes on a queue is stopped (see the table).
fn stopped(scale: f64) -> multiproc::Result<Vec<Figure>> {
    use rustix::process::{Pid, Signal, kill_process};
    let (producers, consumers) = (8usize, 8usize);
    let window = |s: f64| Duration::from_secs_f64(s * scale.clamp(0.2, 1.0));
    let mut figures = Vec::new();
    for victim in ["producer", "consumer"] {
        let q = SimpleQueue::<u64>::new()?;
        let ticks = SimpleQueue::<u8>::new()?;
        let stop = Event::new()?;
        let put_counts = SimpleQueue::<(u64, u64)>::new()?;
        let got_counts = SimpleQueue::<Vec<u64>>::new()?;
        let mut made = multiproc::start_processes(
            stopped_producer,
            (q.clone(), stop.clone(), put_counts.clone()),
            producers,
            StartMethod::Spawn,
        )?;
        let mut taken = multiproc::start_processes(
            stopped_consumer,
            (q.clone(), ticks.clone(), got_counts.clone(), producers),
            consumers,
            StartMethod::Spawn,
        )?;
        let pid = if victim == "producer" {
            made.pids()[0]
        } else {
            taken.pids()[0]
        };
        let pid = Pid::from_raw(pid as i32)
            .ok_or_else(|| multiproc::Error::InvalidArgument("a worker without a pid".into()))?;
        // Messages per second in a window, counted by the consumers' ticks.
        let rate = |length: Duration| -> multiproc::Result<(u64, f64)> {
            while ticks.try_get()?.is_some() {}
            let start = Instant::now();
            let mut n = 0u64;
            while start.elapsed() < length {
                if ticks.get_timeout(Duration::from_millis(50)).is_ok() {
                    n += 256;
                }
            }
            Ok((n, n as f64 / start.elapsed().as_secs_f64()))
        };
        let mut row = |what: &str, length: Duration| -> multiproc::Result<()> {
            let (count, per_s) = rate(length)?;
            figures.push(Figure {
                scenario: "stopped",
                strategy: Some(format!("{what} ({victim} stopped)")),
                bytes: None,
                count,
                per_s: Some(per_s),
                gb_s: None,
                us_per_roundtrip: None,
                seconds: length.as_secs_f64(),
                implementation: "multiproc",
                p50_us: None,
                p99_us: None,
            });
            Ok(())
        };
        row("before", window(3.0))?;
        kill_process(pid, Signal::STOP)
            .map_err(|e| multiproc::Error::InvalidArgument(format!("SIGSTOP to a worker: {e}")))?;
        let stopped_row = row("while stopped", window(2.0));
        kill_process(pid, Signal::CONT)
            .map_err(|e| multiproc::Error::InvalidArgument(format!("SIGCONT to a worker: {e}")))?;
        stopped_row?;
        row("after", window(2.0))?;
        stop.set();
        made.join_timeout(Duration::from_secs(60))?;
        let mut put = vec![0u64; producers];
        for _ in 0..producers {
            let (rank, n) = put_counts.get_timeout(Duration::from_secs(10))?;
            put[rank as usize] = n;
        }
        for _ in 0..consumers {
            q.put(u64::MAX)?;
        }
        // A consumer's error (a gap, a repeat, a get that returned) fails the join.
        taken.join_timeout(Duration::from_secs(60))?;
        let mut got = vec![0u64; producers];
        for _ in 0..consumers {
            for (rank, n) in got_counts
                .get_timeout(Duration::from_secs(10))?
                .iter()
                .enumerate()
            {
                got[rank] += *n;
            }
        }
        if got != put {
            return Err(multiproc::Error::InvalidMessage(format!(
                "messages lost with a {victim} stopped: put {put:?}, taken {got:?}"
            )));
        }
    }
    Ok(figures)
}

/// Which scenarios to run, and how big.
pub struct Plan {
    /// Scale every count by this (for a quick run).
    pub scale: f64,
    /// Only these scenarios (all when empty).
    pub only: Vec<String>,
    /// Only this strategy (both when `None`).
    pub strategy: Option<SharingStrategy>,
    /// Only these sizes of `fresh` and `ping` (all when empty).
    pub sizes: Vec<u64>,
}

/// Runs the plan, reporting each figure as it comes; returns them all.
/// `fresh`'s sizes and counts at `--scale 1`: counts large enough that a new worker's
/// first blocks (the kernel allocating and zeroing their pages, which recycling saves
/// every later tensor) are amortised, as in a producer that makes more than a handful,
/// and that the small sizes run for a few tenths of a second: at 20,000 they ran for
/// 25 ms, which one other process starting up on a shared machine could halve. 4 KiB
/// as many as its fill+sum floor.
const FRESH: [(u64, u64); 4] = [
    (4 << 10, 200_000),
    (1 << 20, 500),
    (64 << 20, 40),
    (256 << 20, 40),
];
/// `ping`'s sizes; 0: a number, no tensor — what the message path costs alone, so that
/// the difference is what a tensor's handling adds.
const PING: [u64; 3] = [0, 4 << 10, 64 << 20];

pub fn run(plan: &Plan, mut report: impl FnMut(&Figure)) -> multiproc::Result<Vec<Figure>> {
    if let Some(b) = plan
        .sizes
        .iter()
        .find(|b| !FRESH.iter().any(|(f, _)| f == *b) && !PING.contains(b))
    {
        return Err(multiproc::Error::InvalidArgument(format!(
            "--bytes {b} is none of the sizes the scenarios run: fresh runs {:?}, ping {:?}",
            FRESH.map(|(f, _)| f),
            PING
        )));
    }
    let scaled = |n: u64| ((n as f64 * plan.scale).round() as u64).max(2);
    let wanted = |s: &str| plan.only.is_empty() || plan.only.iter().any(|o| o == s);
    let size_wanted = |b: u64| plan.sizes.is_empty() || plan.sizes.contains(&b);
    let strategies = match plan.strategy {
        Some(s) => vec![s],
        None => multiproc::get_all_sharing_strategies().to_vec(),
    };
    let mut figures = Vec::new();
    let mut record = |f: Figure, figures: &mut Vec<Figure>| {
        report(&f);
        figures.push(f);
    };
    for &strategy in &strategies {
        multiproc::set_sharing_strategy(strategy);
        if wanted("fresh") {
            for (bytes, count) in FRESH {
                if !size_wanted(bytes) {
                    continue;
                }
                record(
                    fresh(strategy, bytes, scaled(count), "fresh")?,
                    &mut figures,
                );
            }
        }
        if wanted("small") {
            record(
                fresh(strategy, 256, scaled(200_000), "small")?,
                &mut figures,
            );
        }
        if wanted("ping") {
            for bytes in PING {
                if !size_wanted(bytes) {
                    continue;
                }
                // 20,000 round trips of a few µs (the tensor travels by handle,
                // whatever its size): a tenth of a second, like the rest.
                record(ping(strategy, bytes, scaled(20_000))?, &mut figures);
            }
        }
    }
    multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    if wanted("spawn") {
        record(spawn4(scaled(10))?, &mut figures);
    }
    if wanted("disconnect") {
        record(disconnect(scaled(20))?, &mut figures);
    }
    // Only when asked for: it stops a process for seconds.
    if plan.only.iter().any(|o| o == "stopped") {
        for f in stopped(plan.scale)? {
            record(f, &mut figures);
        }
    }
    // Only when asked for: it moves 25 GiB through the queue at `--scale 1`.
    if plan.only.iter().any(|o| o == "memory") {
        for &strategy in &strategies {
            multiproc::set_sharing_strategy(strategy);
            for f in memory(strategy, scaled(50))? {
                record(f, &mut figures);
            }
        }
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    }
    Ok(figures)
}

/// Worker of `--collectives`: `count` all-reduces of `floats` f32 after a warm-up; rank 0
/// reports the time.
fn all_reducer(
    rank: usize,
    (group, floats, count, q): (ProcessGroup, usize, u64, Queue<f64>),
) -> multiproc::Result<()> {
    let t = Tensor::full(&[floats], 1.0, DType::F32)?;
    for _ in 0..3 {
        group.all_reduce_(&t, ReduceOp::Sum)?;
    }
    group.barrier()?;
    let start = Instant::now();
    for _ in 0..count {
        group.all_reduce_(&t, ReduceOp::Sum)?;
    }
    group.barrier()?;
    if rank == 0 {
        q.put(start.elapsed().as_secs_f64())?;
    }
    Ok(())
}

/// `multiproc bench --collectives`: all_reduce_ of 64 MiB f32 across 2 local ranks, and
/// the memory bandwidth floor (`memcpy` of 64 MiB) measured in the same run.
pub fn collectives(scale: f64) -> multiproc::Result<Vec<Figure>> {
    let bytes = 64u64 << 20;
    let count = ((20.0 * scale).round() as u64).max(2);
    let q = Queue::new()?;
    multiproc::spawn(
        all_reducer,
        (
            ProcessGroup::new_local(2)?,
            (bytes / 4) as usize,
            count,
            q.clone(),
        ),
        2,
    )?;
    let seconds = q.get()?;
    let reduce = Figure {
        scenario: "allreduce",
        strategy: Some("2 ranks".into()),
        bytes: Some(bytes),
        count,
        per_s: Some(count as f64 / seconds),
        gb_s: Some((bytes * count) as f64 / seconds / 1e9),
        us_per_roundtrip: None,
        seconds,
        implementation: "multiproc",
        p50_us: None,
        p99_us: None,
    };
    Ok(vec![reduce, crate::floor::memcpy(bytes, count)])
}

/// The header of the table that [`row`] makes rows of.
pub fn header() -> String {
    format!(
        "{:<10} {:<16} {:>9} {:>7}  result",
        "scenario", "strategy", "size", "count"
    )
}

/// One table row for a figure.
pub fn row(f: &Figure) -> String {
    let size = if f.scenario == "memory" {
        "64 MiB".to_string()
    } else if f.scenario == "ping" && f.bytes == Some(0) {
        "a number".to_string()
    } else {
        f.bytes.map_or("-".to_string(), human)
    };
    let value = if let (Some(p50), Some(p99)) = (f.p50_us, f.p99_us) {
        format!(
            "{p50:>9.1} us median, {p99:.1} us p99 wake-up ({})",
            f.implementation
        )
    } else if let Some(us) = f.us_per_roundtrip {
        format!("{us:>12.2} us/roundtrip")
    } else if f.scenario == "spawn" {
        format!("{:>12.1} ms for 4", f.seconds * 1e3)
    } else if f.scenario == "memory" {
        let when = if f.seconds < 0.0 {
            "before the burst".to_string()
        } else {
            format!("+{:.1} s", f.seconds)
        };
        format!("{:>9} MiB committed  {when}", f.bytes.unwrap_or(0) >> 20)
    } else if f.scenario == "stopped" {
        format!("{:>12.0} messages/s", f.per_s.unwrap_or(0.0))
    } else if f.scenario == "disconnect" {
        format!(
            "{:>12.2} ms after the last holder left ({})",
            f.seconds * 1e3,
            f.implementation
        )
    } else {
        format!(
            "{:>12.0} /s  {:>7.2} GB/s",
            f.per_s.unwrap_or(0.0),
            f.gb_s.unwrap_or(0.0)
        )
    };
    format!(
        "{:<10} {:<16} {:>9} {:>7}  {value}",
        f.scenario,
        f.strategy.as_deref().unwrap_or("-"),
        size,
        f.count
    )
}

fn human(b: u64) -> String {
    match b {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of the machine.
fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Worker of `--async`: for each go, sleeps 1 ms (the parent's get is asleep by then,
/// past its spin) and puts the time of its put.
fn stamper(
    _rank: usize,
    (go, back, count): (Queue<u64>, Queue<u64>, u64),
) -> multiproc::Result<()> {
    back.put(0)?;
    for _ in 0..count {
        go.get()?;
        std::thread::sleep(Duration::from_millis(1));
        back.put(monotonic_ns())?;
    }
    Ok(())
}

/// Wakes the thread that [`block_on`] runs on.
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `f` to completion on this thread, parking while it waits: the smallest
/// executor, so that the figure is multiproc's wake-up path and a thread unpark.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut f = std::pin::pin!(f);
    let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// `multiproc bench --async`: the wake-up of an awaited `get` beside a blocking one, in
/// one run (alternate rounds), and `disconnect` with the get awaited.
pub fn wake(scale: f64) -> multiproc::Result<Vec<Figure>> {
    let count = ((2000.0 * scale).round() as u64).max(4);
    let go = Queue::<u64>::new()?;
    let back = Queue::<u64>::new()?;
    let mut ctx = multiproc::start_processes(
        stamper,
        (go.clone(), back.clone(), count),
        1,
        StartMethod::Spawn,
    )?;
    back.get_timeout(Duration::from_secs(60))?;
    let (mut blocking, mut awaited) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for i in 0..count {
        go.put(i)?;
        let (put_at, now) = if i % 2 == 0 {
            let put_at = back.get_timeout(Duration::from_secs(60))?;
            (put_at, monotonic_ns())
        } else {
            let put_at = block_on(back.get_async())?;
            (put_at, monotonic_ns())
        };
        let us = now.saturating_sub(put_at) as f64 / 1e3;
        if i % 2 == 0 {
            blocking.push(us);
        } else {
            awaited.push(us);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    ctx.join_timeout(Duration::from_secs(60))?;
    let figure = |mut us: Vec<f64>, implementation: &'static str| {
        us.sort_by(f64::total_cmp);
        let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
        Figure {
            scenario: "wake",
            strategy: None,
            bytes: None,
            count: us.len() as u64,
            per_s: None,
            gb_s: None,
            us_per_roundtrip: None,
            seconds,
            p50_us: Some(at(0.5)),
            p99_us: Some(at(0.99)),
            implementation,
        }
    };
    let mut figures = vec![figure(blocking, "blocking"), figure(awaited, "async")];
    // Disconnect, awaited: the time from the worker's word to the parked get's error.
    let runs = ((20.0 * scale).round() as u64).max(2);
    let mut times = Vec::new();
    for _ in 0..runs {
        let q = Queue::<Msg>::new()?;
        let (said, told) = multiproc::pipe::<u8>()?;
        let worker_q = q.clone();
        let waiter = std::thread::spawn(move || {
            let got = block_on(q.get_async());
            (
                Instant::now(),
                got.err().is_some_and(|e| e.is_disconnected()),
            )
        });
        let mut ctx = multiproc::start_processes(let_go, (worker_q, told), 1, StartMethod::Spawn)?;
        said.recv()?;
        let let_go_at = Instant::now();
        let (ended_at, disconnected) = waiter
            .join()
            .map_err(|_| multiproc::Error::InvalidArgument("the waiting thread panicked".into()))?;
        ctx.join_timeout(Duration::from_secs(30))?;
        if !disconnected {
            return Err(multiproc::Error::InvalidArgument(
                "an awaited get on a queue whose last other holder left did not end with \
                 Disconnected"
                    .into(),
            ));
        }
        times.push(ended_at.saturating_duration_since(let_go_at).as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    figures.push(Figure {
        scenario: "disconnect",
        strategy: None,
        bytes: None,
        count: runs,
        per_s: None,
        gb_s: None,
        us_per_roundtrip: None,
        seconds: times[times.len() / 2],
        p50_us: None,
        p99_us: None,
        implementation: "async",
    });
    Ok(figures)
}
