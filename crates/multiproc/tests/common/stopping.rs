//! Processes that stop themselves (SIGSTOP: what a debugger, Ctrl-Z or a frozen
//! container does to a peer) at a chosen point, and their continuation: what the
//! stopped-peer tests (tests/stopped.rs, and the awaited get in tests/async_queue.rs)
//! share.

use std::time::Duration;

use multiproc::{Event, Process, Queue, Tensor};

const WAIT: Duration = Duration::from_secs(30);

/// Takes the lock of one shelf of the queue's block custody and stops itself inside it
/// until it is continued (SIGCONT), then lets go and returns.
pub fn stop_inside_the_custody_lock(
    _rank: usize,
    (q, shelf, holding): (Queue<Tensor>, usize, Event),
) -> multiproc::Result<()> {
    multiproc::__testing::while_custody_locked(&q, shelf, || {
        holding.set();
        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)
            .map_err(|e| multiproc::Error::InvalidArgument(format!("SIGSTOP to itself: {e}")))
    })?
}

/// Whether process `pid` is stopped (`T` in /proc/pid/stat).
pub fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command's closing parenthesis.
    stat.rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next())
        == Some("T")
}

/// Continues a stopped process, once it has stopped: it sets its event just before it
/// stops itself, and a SIGCONT sent in between would be lost, leaving it stopped.
pub fn continue_process(process: &Process) {
    let pid = process.pid();
    let deadline = std::time::Instant::now() + WAIT;
    while !is_stopped(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not stop"
        );
        std::thread::yield_now();
    }
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
}
