//! Test support shared by the integration tests: a watchdog deadline for every test,
//! and a leak check (segments in /dev/shm, open fds, child processes) at its end.
//! A test that runs past its deadline aborts the whole test binary (see [`run`]): its
//! body cannot be stopped, and left running it would poison the tests after it.
//!
//! Tests in one binary run on parallel threads of one process, so the fd and child
//! counts are only meaningful when leak-checked tests run one at a time: [`Guard::new`]
//! takes a process-wide lock for the test's duration.

#![allow(dead_code)]

#[cfg(feature = "async")]
pub mod async_rt;
pub mod cuda;
pub mod data;
pub mod faults;
pub mod hostile;
pub mod stopping;
pub mod workers;

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds off every leak-checked test body (and every other holder) of this binary: for
/// set-up that runs before [`run`] and must not overlap a test (a warm-up that parks
/// waits would skew another test's count of parked waits).
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `body` with a deadline and a leak check. A leak fails the test; a body still
/// running at the deadline aborts the test binary after naming the test and killing its
/// processes (a hung body cannot be stopped, and would run on into the next test).
pub fn run(deadline: Duration, body: impl FnOnce() + Send + 'static) {
    let guard = Guard::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    // Whatever the body did, the next test starts from the default strategy.
    let reset = || multiproc::set_sharing_strategy(multiproc::SharingStrategy::FileDescriptor);
    let outcome = rx.recv_timeout(deadline);
    reset();
    match outcome {
        Ok(()) => {
            worker.join().expect("test body");
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // The body panicked: re-raise its panic here.
            if let Err(p) = worker.join() {
                drop(guard);
                std::panic::resume_unwind(p);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => hung(deadline),
    }
    guard.check();
}

/// A test body ran past its deadline: a hang is a bug. A panic here would fail this test
/// but leave its body and its processes running into the next test's leak baseline, so
/// the whole test binary ends instead, loudly: it names the test and the deadline, kills
/// every process below this one (the fork server and the workers it started included)
/// and aborts.
fn hung(deadline: Duration) -> ! {
    use std::io::Write as _;
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_owned();
    let live = descendants();
    let named: Vec<String> = live
        .iter()
        .map(|&pid| format!("{pid} ({})", comm(pid).unwrap_or_default()))
        .collect();
    // Straight to fd 2: the test harness captures `eprintln!` of a test's thread and
    // shows it only when the test ends, which an abort never reaches.
    let _ = writeln!(
        std::io::stderr(),
        "test {test} exceeded its deadline of {deadline:?} (a hang is a bug): killing its \
         processes [{}] and aborting the test binary",
        named.join(", ")
    );
    for pid in live {
        // SAFETY: kill(2) sends a signal; no memory is involved. A pid that has gone
        // since the scan gets ESRCH, which is fine: it is gone.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    std::process::abort();
}

/// Every live process below this one, children first.
pub fn descendants() -> Vec<u32> {
    let me = std::process::id();
    let mut out: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
                .filter(|&pid| pid != me && descends_from(pid, me))
                .collect()
        })
        .unwrap_or_default();
    out.sort_by_key(|&pid| (parent_of(pid) != Some(me), pid));
    out
}

/// The command name of process `pid`.
fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end().to_owned())
}

/// What a test started with, to compare at its end.
pub struct Guard {
    _serial: MutexGuard<'static, ()>,
    segments: BTreeSet<String>,
    fds: usize,
    children: BTreeSet<u32>,
}

impl Guard {
    /// Serialises leak-checked tests and records the starting state.
    pub fn new() -> Self {
        let serial = one_at_a_time();
        warm_up();
        multiproc::__testing::flush_retained_segments();
        multiproc::__testing::release_idle_blocks();
        Self {
            _serial: serial,
            segments: our_segments(),
            fds: open_fds(),
            children: children(),
        }
    }

    /// Asserts that nothing leaked, giving asynchronous cleanup (children being reaped,
    /// the shm manager's grace period) up to 10 s to finish.
    pub fn check(&self) {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let segs: Vec<_> = our_segments().difference(&self.segments).cloned().collect();
            // The received segments a process keeps mapped for a while (one fd each)
            // are let go first: then every fd counts.
            multiproc::__testing::flush_retained_segments();
            multiproc::__testing::release_idle_blocks();
            let fds = open_fds();
            let kids: Vec<_> = children().difference(&self.children).cloned().collect();
            if segs.is_empty() && fds <= self.fds && kids.is_empty() {
                return;
            }
            if Instant::now() > until {
                let kids: Vec<String> = kids
                    .iter()
                    .map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default())
                    .collect();
                panic!(
                    "leak: new segments {segs:?}, open fds {} -> {fds} ({}), new child processes {kids:?}",
                    self.fds,
                    fd_targets().join(", ")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Makes the resources a process keeps for its whole life exist before a test counts
/// fds: the fork server, the current small-storage arena, the connection to the shm
/// manager. Cheap after the first call.
fn warm_up() {
    use multiproc::{DType, SharingStrategy, Tensor, set_sharing_strategy};
    multiproc::forkserver::ensure_running().expect("fork server");
    let before = multiproc::get_sharing_strategy();
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        set_sharing_strategy(strategy);
        Tensor::zeros(&[1], DType::U8)
            .and_then(|t| t.share_memory_())
            .expect("warm-up share");
    }
    set_sharing_strategy(before);
}

/// Our named segments in /dev/shm: made by this process, by one of its descendants, or
/// by a process that has ended. Segments of an unrelated live process (another test
/// binary running at the same time) are not ours to judge.
pub fn our_segments() -> BTreeSet<String> {
    let me = std::process::id();
    multiproc::maintenance::segments()
        .into_iter()
        .filter(|s| {
            let pid = s.creator();
            pid == me || !alive(pid) || descends_from(pid, me)
        })
        .map(|s| s.name().to_owned())
        .collect()
}

/// Whether `pid` is a descendant of `ancestor`.
fn descends_from(mut pid: u32, ancestor: u32) -> bool {
    for _ in 0..64 {
        let Some(parent) = parent_of(pid) else {
            return false;
        };
        if parent == ancestor {
            return true;
        }
        if parent <= 1 {
            return false;
        }
        pid = parent;
    }
    false
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = stat.rfind(')')?;
    stat[close + 1..].split_whitespace().nth(1)?.parse().ok()
}

/// The number of fds this process has open.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// What each open fd refers to, for leak reports.
pub fn fd_targets() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| {
                    let t = std::fs::read_link(e.path()).unwrap_or_default();
                    format!("{}->{}", e.file_name().to_string_lossy(), t.display())
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Child processes of this process (zombies included: not reaping is a leak too),
/// except the fork server, which lives as long as the process.
pub fn children() -> BTreeSet<u32> {
    let me = std::process::id();
    let mut out = BTreeSet::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let ppid = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(me) && comm != "multiproc-fsrv" {
            out.insert(pid);
        }
    }
    out
}

/// Whether process `pid` still runs: it exists and has not exited, as its pidfd says
/// (readable once every thread of it has ended, which is when a parent can reap it).
/// `/proc/<pid>/stat` says `Z` as soon as the main thread has exited, while its other
/// threads may still be ending, so a parent asked then would still see it running.
pub fn alive(pid: u32) -> bool {
    let Some(pid) = rustix::process::Pid::from_raw(pid as i32) else {
        return false;
    };
    let Ok(pidfd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
        return false;
    };
    let mut fds = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&zero)) {
        Ok(n) => n == 0,
        Err(_) => true,
    }
}

/// How many threads of this process have a name starting with `prefix` (a thread's
/// name is cut to 15 bytes: `multiproc-loader-0` reads `multiproc-loade`).
pub fn threads_named_like(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|t| t.ok())
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.starts_with(prefix))
                })
                .count()
        })
        .unwrap_or(0)
}

/// torch repeats its leak-prone sharing tests this many times.
pub const TORCH_REPEATS: usize = 30;

/// `Duration::from_secs`, short.
pub fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Runs `test` once per sharing strategy (the setting is inherited by workers; [`run`]
/// resets it afterwards).
pub fn for_each_strategy(test: impl Fn(multiproc::SharingStrategy)) {
    for &strategy in multiproc::get_all_sharing_strategies() {
        multiproc::set_sharing_strategy(strategy);
        test(strategy);
    }
}

/// Whether every element of `t` equals `value`.
pub fn all_equal(t: &multiproc::Tensor, value: f64) -> bool {
    t.allclose(
        &multiproc::Tensor::full(t.shape(), value, t.dtype()).expect("full"),
        0.0,
        0.0,
    )
    .expect("allclose")
}

/// torch's `simple_fill`: fill the first tensor received with 4, then set the event.
pub fn simple_fill(
    _rank: usize,
    (queue, event): (multiproc::Queue<Vec<multiproc::Tensor>>, multiproc::Event),
) -> multiproc::Result<()> {
    let data = queue.get()?;
    data[0].fill_(4.0)?;
    event.set();
    Ok(())
}

/// A small reproducible PRNG (splitmix64) for seeded tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A delay of up to `max_ms` milliseconds, in microsecond steps.
    pub fn delay(&mut self, max_ms: u64) -> Duration {
        Duration::from_micros(self.below(max_ms * 1000 + 1))
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

/// The machine's committed (`Shmem` in /proc/meminfo) shared memory, in MiB.
pub fn shmem_mib() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    text.lines()
        .find_map(|l| l.strip_prefix("Shmem:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .expect("a Shmem line")
        >> 10
}
