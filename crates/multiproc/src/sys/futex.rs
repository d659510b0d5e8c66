//! Waiting on a shared 32-bit word: process-shared futexes with deadlines.
//!
//! # Safety
//!
//! No unsafe code: rustix's futex calls take `&AtomicU32` (`futex_waitv` takes the
//! words' addresses as integers, which the kernel reads while the call borrows the
//! words; Rust never dereferences them). The words live in memory
//! other processes share, so every wait is `FUTEX_WAIT` without `FUTEX_PRIVATE`, and a
//! waiter re-checks its condition after every return.

use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::thread::futex;

use crate::error::{Error, Result};
use crate::sys::Deadline;

/// Sleeps while `*word == expected`, until woken or the deadline passes. Returns
/// `false` only when the deadline has passed; spurious wake-ups return `true`, so
/// callers re-check their condition in a loop.
pub(crate) fn wait(word: &AtomicU32, expected: u32, deadline: Deadline) -> Result<bool> {
    let timeout = match deadline {
        None => None,
        Some(d) => {
            let now = Instant::now();
            if now >= d {
                return Ok(false);
            }
            let left = d - now;
            Some(futex::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as _,
            })
        }
    };
    // Not FUTEX_PRIVATE: the word lives in memory shared with other processes.
    match futex::wait(word, futex::Flags::empty(), expected, timeout.as_ref()) {
        Ok(()) | Err(Errno::AGAIN) | Err(Errno::INTR) => Ok(true),
        Err(Errno::TIMEDOUT) => Ok(deadline.is_none_or(|d| Instant::now() < d)),
        Err(e) => Err(Error::os("futex wait on a process-shared word", e)),
    }
}

/// One word [`wait_any`] sleeps on, and the value seen there. Waited on as a shared
/// futex (the words live in memory other processes map; a word private to this
/// process works the same, as long as its wakers use [`wake`]).
pub(crate) struct WaitOn<'a> {
    pub word: &'a AtomicU32,
    pub expected: u32,
}

/// Sleeps while every word holds the value seen, until one changes, a wake-up aimed at
/// one of them, or the deadline (`futex_waitv`, Linux 5.16+; at most 128 words).
/// Returns at once when a word already differs. Callers re-check their conditions
/// after every return: wake-ups may be spurious.
///
/// Without `futex_waitv` (`ENOSYS`) it sleeps on the first word alone for at most
/// [`WAIT_ANY_FALLBACK`], so that a change of another word is seen that late at most.
pub(crate) fn wait_any(words: &[WaitOn<'_>], deadline: Deadline) -> Result<()> {
    if words.len() > WAITV_MAX {
        return Err(Error::InvalidArgument(format!(
            "a wait on {} queues and wake-up words: at most {WAITV_MAX} can be waited on \
             together",
            words.len()
        )));
    }
    let Some(first) = words.first() else {
        if let Some(d) = deadline {
            std::thread::sleep(d.saturating_duration_since(Instant::now()));
        }
        return Ok(());
    };
    let waits: Vec<futex::Wait> = words
        .iter()
        .map(|w| {
            let mut wait = futex::Wait::new();
            wait.val = u64::from(w.expected);
            wait.uaddr = futex::WaitPtr::new(w.word.as_ptr().cast());
            wait.flags = futex::WaitFlags::SIZE_U32;
            wait
        })
        .collect();
    let timeout = deadline.map(|d| monotonic_after(d.saturating_duration_since(Instant::now())));
    match futex::waitv(
        &waits,
        futex::WaitvFlags::empty(),
        timeout.as_ref(),
        rustix::time::ClockId::Monotonic,
    ) {
        Ok(_) | Err(Errno::AGAIN | Errno::TIMEDOUT | Errno::INTR) => Ok(()),
        Err(Errno::NOSYS) => {
            let slice = Instant::now() + WAIT_ANY_FALLBACK;
            let until = deadline.map_or(slice, |d| d.min(slice));
            let left = until.saturating_duration_since(Instant::now());
            let left = futex::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as _,
            };
            match futex::wait(
                first.word,
                futex::Flags::empty(),
                first.expected,
                Some(&left),
            ) {
                Ok(()) | Err(Errno::AGAIN | Errno::TIMEDOUT | Errno::INTR) => Ok(()),
                Err(e) => Err(Error::os("futex wait on a process-shared word", e)),
            }
        }
        Err(e) => Err(Error::os(
            format!("futex_waitv on {} words", words.len()),
            e,
        )),
    }
}

/// The most words one `futex_waitv` takes (the kernel's `FUTEX_WAITV_MAX`).
pub(crate) const WAITV_MAX: usize = 128;

/// How long [`wait_any`] sleeps on one word without `futex_waitv` before it looks at
/// the others.
pub(crate) const WAIT_ANY_FALLBACK: Duration = Duration::from_millis(10);

/// The absolute `CLOCK_MONOTONIC` time `d` from now (`futex_waitv` takes one).
pub(crate) fn monotonic_after(d: Duration) -> rustix::time::Timespec {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let nanos = now.tv_nsec as u64 + u64::from(d.subsec_nanos());
    rustix::time::Timespec {
        tv_sec: now.tv_sec + d.as_secs() as i64 + (nanos / 1_000_000_000) as i64,
        tv_nsec: (nanos % 1_000_000_000) as _,
    }
}

/// Wakes up to `n` waiters on `word`.
pub(crate) fn wake(word: &AtomicU32, n: u32) {
    // A failed wake can only be EFAULT/EINVAL on a bad address, which `&AtomicU32`
    // rules out.
    let _ = futex::wake(word, futex::Flags::empty(), n);
}

/// Wakes every waiter on `word`.
pub(crate) fn wake_all(word: &AtomicU32) {
    wake(word, i32::MAX as u32);
}

/// The longest [`spin_until`] keeps trying before a caller goes to sleep in the
/// kernel, unless the environment variable `MULTIPROC_SPIN_US` says otherwise (in
/// microseconds; 0 turns spinning off).
///
/// A producer and a consumer that hand items over through a short queue would
/// otherwise sleep and be woken for nearly every item: a futex wait, a wake and two
/// context switches cost tens of microseconds, far more than the item itself. Spinning
/// catches most hand-overs without any system call — when the partner is running on
/// another core. When it is not (more busy processes than cores), spinning only burns
/// the time slice the partner needs, so the budget adapts: every spin that gives up
/// halves it, every spin that succeeds grows it back by an eighth of the maximum. A
/// budget near zero would never succeed again on its own (a partner needs a
/// microsecond or two per item even when it runs), so one busy moment would leave
/// every later hand-over paying a sleep and a wake-up: every [`PROBE_EVERY`]th wait
/// spins with a quarter of the maximum instead, and its success grows the budget
/// back. On a core shared with the partner that costs an average of a fraction of a
/// microsecond per wait.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// How often (in waits) a collapsed spin budget is tried at a quarter of its maximum.
const PROBE_EVERY: u32 = 64;

/// Waits since the last probe (see [`PROBE_EVERY`]).
static SINCE_PROBE: AtomicU32 = AtomicU32::new(0);

/// The environment variable that overrides [`SPIN`].
pub(crate) const SPIN_ENV: &str = "MULTIPROC_SPIN_US";

fn spin_max_ns() -> u32 {
    static MAX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        let us = std::env::var(SPIN_ENV)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(SPIN.as_micros() as u64);
        u32::try_from(us.saturating_mul(1000)).unwrap_or(u32::MAX)
    })
}

/// The current spin budget in nanoseconds (see [`SPIN`]); per process, shared by all
/// waits, since what it measures — whether partners get a core — is the machine's.
static BUDGET_NS: AtomicU32 = AtomicU32::new(u32::MAX);

/// Polls `ready` for up to the current spin budget (never past `deadline`); returns
/// whether it became true. The caller then re-checks its condition as usual.
pub(crate) fn spin_until(deadline: Deadline, mut ready: impl FnMut() -> bool) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let max = spin_max_ns();
    if max == 0 {
        return ready();
    }
    let mut budget = BUDGET_NS.load(Relaxed).min(max);
    if budget < max / 4 && SINCE_PROBE.fetch_add(1, Relaxed) + 1 >= PROBE_EVERY {
        SINCE_PROBE.store(0, Relaxed);
        budget = max / 4;
    }
    let adapt = |ok: bool| {
        let next = if ok {
            budget.saturating_add(max / 8).min(max)
        } else {
            budget / 2
        };
        BUDGET_NS.store(next, Relaxed);
    };
    for _ in 0..64 {
        if ready() {
            adapt(true);
            return true;
        }
        std::hint::spin_loop();
    }
    let start = Instant::now();
    let mut end = start + Duration::from_nanos(u64::from(budget));
    if let Some(d) = deadline {
        end = end.min(d);
    }
    // Pure spinning, no `sched_yield`: on a busy machine a yield hands the core to an
    // unrelated process for a whole time slice, which costs more than the spin.
    loop {
        for _ in 0..64 {
            if ready() {
                adapt(true);
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= end {
            let ok = ready();
            adapt(ok);
            return ok;
        }
    }
}
