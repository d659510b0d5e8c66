//! Test support shared by the integration tests: a watchdog deadline for every test,
//! and a leak check (segments in /dev/shm, open fds, child processes) at its end.
//!
//! Tests in one binary run on parallel threads of one process, so the fd and child
//! counts are only meaningful when leak-checked tests run one at a time: [`Guard::new`]
//! takes a process-wide lock for the test's duration.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// A process keeps the last few small segments it received mapped (at most this many,
/// one fd each) so that a stream of small tensors does not map and unmap every time;
/// that bounded cache is not a leak.
pub const RETAINED_SEGMENT_FDS: usize = 8;

/// Runs `body` with a deadline and a leak check; fails the test if either is broken.
pub fn run(deadline: Duration, body: impl FnOnce() + Send + 'static) {
    let guard = Guard::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(deadline) {
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
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("test exceeded its deadline of {deadline:?} (a hang is a bug)");
        }
    }
    guard.check();
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
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        warm_up();
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
            let fds = open_fds();
            let kids: Vec<_> = children().difference(&self.children).cloned().collect();
            if segs.is_empty() && fds <= self.fds + RETAINED_SEGMENT_FDS && kids.is_empty() {
                return;
            }
            if Instant::now() > until {
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

/// Makes the process-wide resources that live as long as the process (the connection
/// to the shm manager) before the first snapshot, so they do not count as leaks.
fn warm_up() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = multiproc::get_sharing_strategy();
        multiproc::set_sharing_strategy(multiproc::SharingStrategy::FileSystem);
        let t = multiproc::Tensor::zeros(&[1], multiproc::DType::U8).expect("warm-up tensor");
        t.share_memory_().expect("warm-up share");
        drop(t);
        multiproc::set_sharing_strategy(before);
    });
}

/// Our named segments in /dev/shm.
pub fn our_segments() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("multiproc_"))
                .collect()
        })
        .unwrap_or_default()
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

/// Live child processes of this process (zombies included: not reaping is a leak too).
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
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let mut fields = stat[close + 1..].split_whitespace();
        let _state = fields.next();
        if fields.next().and_then(|p| p.parse::<u32>().ok()) == Some(me) {
            out.insert(pid);
        }
    }
    out
}

/// Whether process `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].trim_start().chars().next());
            !matches!(state, Some('Z') | Some('X'))
        }
        Err(_) => false,
    }
}
