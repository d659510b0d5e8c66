//! Waiting without a thread per wait (feature `async`): the wake-up path under every
//! `*_async` future.
//!
//! # Safety
//!
//! No unsafe code. `futex_waitv` takes the words' addresses as integers (rustix's
//! `Wait`); the kernel reads them, Rust never dereferences them, and every word's block
//! is kept alive (an `Arc` in the registration) for as long as the word is waited on.
//!
//! **Why a thread.** A futex cannot be registered with epoll (`FUTEX_FD` was removed as
//! racy), and multiproc's producers wake their consumers with a futex wake on a shared
//! word (a queue's `SEQ`, a bounded queue's `FREE_PLACES`, an event's flag). So an
//! awaited wait is handed to a **word reactor**: one thread per process (started on the
//! first wait that parks, started afresh in a `fork` child through [`ForkLocal`]) that
//! sleeps in `futex_waitv` (Linux 5.16+) over every word a parked future registered,
//! plus one private control word that tells it the set changed. A registration is
//! (word, the value the future saw, its `Waker`); the thread wakes the future when the
//! word no longer holds that value (or a wake-up was aimed at it). A parked future
//! counts itself in the waiter count the blocking waiters use (`GET_WAITERS`,
//! `PLACE_WAITERS`), so producers' existing wake path — a wake only when someone
//! sleeps — wakes the reactor too. One `futex_waitv` takes at most 128 words: past 127
//! distinct words a second reactor thread (a *shard*) starts, and so on.
//!
//! **The race.** A future reads the word *before* its non-blocking try, and registers
//! that value: a producer that published between the two changed the word, so the
//! kernel refuses to sleep on it (`EAGAIN`) and the future is woken at once.
//!
//! **Hand-over.** A producer wakes *one* sleeper. When the woken registration belongs to
//! a future that is dropped before it runs again, [`Parked`]'s drop passes the wake-up
//! on (one futex wake on the same word), so another waiter — a blocking one, or another
//! process's reactor — is not left asleep beside a message.
//!
//! **fds.** A pidfd (a process's exit) and a full socket (a `put` whose packet goes on
//! the queue's socket) are readiness, not words: a second thread, the **fd reactor**,
//! `poll`s the registered fds (each a duplicate the registration owns) and an eventfd
//! that tells it the set changed. It starts only when a future first needs it. A
//! future may park on a word and on fds at once (a data loader's stream: its results
//! queue, and the pidfds of the workers that hold its tasks): two registrations in one
//! [`Parked`], either of which wakes it.
//!
//! **Closes.** The fd reactor also holds one inotify instance, in its `poll` set: a
//! [`CloseWatch`] counts every close of one file, in any process, and wakes the
//! futures waiting on it at each (a future that finds the count moved tries even
//! though its word registration still waits). A queue's channel value keeps one on
//! the queue's holder lease file, whose every holder closes its description when it
//! leaves — the kernel does it for a SIGKILLed one — so the last holder's end reaches
//! a parked get at once, although it wakes no futex (see `queue::awaiting`). The last
//! watch of a file removes its watch descriptor when it is dropped, with its channel
//! value. Without inotify (the user's 128 instances in use) a watch is refused and
//! the re-checks below are what remains.
//!
//! **Idle costs nothing.** Both threads sleep in the kernel without a timeout, except
//! for registrations that ask for a *re-check* after [`RECHECK`]: a parked queue `get`
//! does only while what it waits for wakes nobody — a message its channel value keeps
//! back because the custody was busy, or a holder's end where the close watch was
//! refused (see `queue::awaiting`). That costs one wake-up of the reactor per
//! `RECHECK` while such futures are parked, and one try per future: a re-checked
//! registration stays in place, so a try that finds nothing again re-registers
//! nothing and rebuilds no `futex_waitv`. A future whose try now needs re-checks and
//! whose registration has none registers anew. A registration may also carry a
//! deadline of its own (`WordWait::wake_by`, a data loader's timeout): it is woken at
//! that moment the same way, so the timeout is not rounded up to a re-check.
//!
//! Re-checks fall on a process-wide grid of whole `RECHECK`s, so however many gets are
//! parked the reactor wakes once per `RECHECK`. A future polled while its registration
//! still waits (a `select!` sibling woke the task) only swaps its waker in: nothing is
//! deregistered, tried or re-registered.
//!
//! **Lost wake-ups.** Every registration carries the value its future saw, and the
//! reactor compares before it sleeps, so a change is never missed, whoever's futex wake
//! it was. A wake that carries no change (a hand-over) can miss a reactor that is
//! between two sleeps; that happens only when the word went back to the value seen,
//! i.e. someone else took what the wake announced.
//!
//! **Lifetime.** The threads, once started, live as long as the process (asleep when
//! nothing is parked); the fd reactor keeps one eventfd. A registration's duplicate fds
//! are closed before its future is woken, so a completed wait leaves none open; a
//! future dropped while parked rings the fd reactor, whose copy of them closes as soon
//! as it wakes. A `fork` child starts its own
//! when it first parks (the parent's are the parent's, as `ForkLocal` says).
//!
//! Without `futex_waitv` (`ENOSYS`: kernels before 5.16) the word reactor falls back to
//! looking at its words every [`FALLBACK_POLL`]: correct, but not free when idle
//! (tests/async_old_kernel.rs runs the waits under a seccomp filter that answers
//! `futex_waitv` with `ENOSYS`).

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::thread::futex;

use super::fork_local::ForkLocal;
use super::futex::{WAITV_MAX, monotonic_after};
use crate::error::{Error, Result};

/// How long, about, a registration that asks for it waits before its future looks
/// again even though its word did not change (see the module docs, and
/// `recheck_due`).
pub(crate) const RECHECK: Duration = Duration::from_secs(1);

/// How often the word reactor looks at its words without `futex_waitv`.
const FALLBACK_POLL: Duration = Duration::from_millis(10);

/// Where the words a future waits on live: a shared block of 32-bit words.
pub(crate) trait WordHost: Send + Sync + 'static {
    /// The word at `index`.
    fn host_word(&self, index: usize) -> &AtomicU32;
}

/// What a future parks on: a word of a block, the value it saw there before its try,
/// and the waiter count it counts itself in while parked.
pub(crate) struct WordWait {
    pub(crate) host: Arc<dyn WordHost>,
    pub(crate) index: usize,
    pub(crate) expected: u32,
    /// The index of a waiter count in the same block (a producer wakes only when it is
    /// above 0).
    pub(crate) counted_in: Option<usize>,
    /// Whether to wake the future after [`RECHECK`] even if the word did not change.
    pub(crate) recheck: bool,
    /// A deadline of the operation's own (a data loader's timeout): the future is woken
    /// at it, changed word or not, to try once more and give up.
    pub(crate) wake_by: Option<Instant>,
}

impl WordWait {
    fn word(&self) -> &AtomicU32 {
        self.host.host_word(self.index)
    }

    fn changed(&self) -> bool {
        self.word().load(Ordering::SeqCst) != self.expected
    }

    fn uncount(&self) {
        if let Some(count) = self.counted_in {
            let _ =
                self.host
                    .host_word(count)
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1));
        }
    }
}

struct Registration {
    wait: WordWait,
    waker: Waker,
    due: Option<Instant>,
    /// What the reactor last did with it ([`WAITING`], [`RECHECKED`], [`FIRED`]), so
    /// that the woken future looks without taking the registrations' lock, which the
    /// reactor takes again at once to sleep anew.
    state: Arc<AtomicU8>,
}

/// A registration's state: the reactor waits on it.
const WAITING: u8 = 0;
/// Its re-check came: its future was woken to try once, and the registration stays in
/// place (with its next re-check due), so that a try that finds nothing again costs
/// no re-registration and no rebuilt `futex_waitv` — a hundred idle gets cost a
/// hundred tries a second, nothing more.
const RECHECKED: u8 = 1;
/// Its word changed or a wake-up was aimed at it: the reactor removed (and uncounted)
/// it and woke its future.
const FIRED: u8 = 2;

#[derive(Default)]
struct Registrations {
    next_key: u64,
    entries: HashMap<u64, Registration>,
}

impl Registrations {
    /// The distinct (address, value) pairs waited on.
    fn distinct(&self) -> Vec<(usize, u32)> {
        let mut pairs: Vec<(usize, u32)> = self
            .entries
            .values()
            .map(|r| (address(r.wait.word()), r.wait.expected))
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        pairs
    }
}

fn address(word: &AtomicU32) -> usize {
    word.as_ptr() as usize
}

/// One word-reactor thread and what it waits on.
struct Shard {
    /// Bumped (and woken) whenever the registrations change.
    control: AtomicU32,
    /// One more than the `control` value of the thread's last `futex_waitv` (0: none
    /// yet): equal to `control + 1`, it sleeps on every registration (tests).
    slept_on: AtomicU64,
    registrations: Mutex<Registrations>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shard {
    /// Announces a change of the registrations to the thread. Called with the
    /// registrations' lock held, so that whoever sees the change (a count of parked
    /// waits, taken under that lock) sees it announced too: a test that counts its
    /// tasks parked and the reactor settled does not then meet the wake-up of a
    /// registration that was in place but not yet announced.
    fn changed(&self) {
        self.control.fetch_add(1, Ordering::SeqCst);
        let _ = futex::wake(&self.control, futex::Flags::PRIVATE, 1);
    }

    fn run(self: Arc<Self>) {
        let mut fallback = false;
        loop {
            let control = self.control.load(Ordering::SeqCst);
            let (waits, addresses, due) = {
                let regs = lock(&self.registrations);
                let mut waits = vec![waiter(&self.control, control, true)];
                let mut addresses = vec![address(&self.control)];
                let mut seen = Vec::new();
                for r in regs.entries.values() {
                    let pair = (address(r.wait.word()), r.wait.expected);
                    if !seen.contains(&pair) {
                        seen.push(pair);
                        waits.push(waiter(r.wait.word(), r.wait.expected, false));
                        addresses.push(pair.0);
                    }
                }
                (
                    waits,
                    addresses,
                    regs.entries.values().filter_map(|r| r.due).min(),
                )
            };
            let due = if fallback {
                Some(due.map_or(Instant::now() + FALLBACK_POLL, |d| {
                    d.min(Instant::now() + FALLBACK_POLL)
                }))
            } else {
                due
            };
            let woken = if fallback {
                let left = due.map(|d| d.saturating_duration_since(Instant::now()));
                let _ = futex::wait(
                    &self.control,
                    futex::Flags::PRIVATE,
                    control,
                    left.map(timespec).as_ref(),
                );
                None
            } else {
                let deadline =
                    due.map(|d| monotonic_after(d.saturating_duration_since(Instant::now())));
                self.slept_on
                    .store(u64::from(control) + 1, Ordering::SeqCst);
                match futex::waitv(
                    &waits,
                    futex::WaitvFlags::empty(),
                    deadline.as_ref(),
                    rustix::time::ClockId::Monotonic,
                ) {
                    Ok(i) => addresses.get(i).copied(),
                    Err(Errno::NOSYS) => {
                        tracing::debug!(
                            "multiproc: no futex_waitv (Linux before 5.16): async waits \
                             look at their words every {FALLBACK_POLL:?}"
                        );
                        fallback = true;
                        None
                    }
                    Err(Errno::AGAIN | Errno::TIMEDOUT | Errno::INTR) => None, // see `fire`
                    Err(e) => {
                        // Never seen (the words are aligned, mapped, at most 127):
                        // every future tries again rather than this thread spinning.
                        tracing::debug!("multiproc: futex_waitv failed: {e}");
                        self.fire_all();
                        continue;
                    }
                }
            };
            WAKE_UPS.fetch_add(1, Ordering::Relaxed);
            self.fire(woken);
        }
    }

    /// Wakes (and removes) every registration.
    fn fire_all(&self) {
        let drained: Vec<Registration> = lock(&self.registrations)
            .entries
            .drain()
            .map(|(_, r)| r)
            .collect();
        for r in drained {
            r.state.store(FIRED, Ordering::SeqCst);
            r.waker.wake();
            r.wait.uncount();
        }
    }

    /// Wakes (and removes) every registration whose word changed or that the wake-up
    /// was aimed at; wakes (and keeps, see [`RECHECKED`]) those whose re-check is due.
    fn fire(&self, woken: Option<usize>) {
        let now = Instant::now();
        let mut fired = Vec::new();
        let mut rechecked = Vec::new();
        {
            let mut regs = lock(&self.registrations);
            let mut keys = Vec::new();
            for (key, r) in regs.entries.iter_mut() {
                if r.wait.changed() || woken == Some(address(r.wait.word())) {
                    keys.push(*key);
                } else if r.due.is_some_and(|d| d <= now) {
                    r.due = r.wait.recheck.then(recheck_due);
                    r.state.store(RECHECKED, Ordering::SeqCst);
                    rechecked.push(r.waker.clone());
                }
            }
            for key in keys {
                if let Some(r) = regs.entries.remove(&key) {
                    r.state.store(FIRED, Ordering::SeqCst);
                    fired.push(r);
                }
            }
        }
        // The wake-ups first: the counts are bookkeeping (a producer that still sees
        // this waiter counted wakes the word once more, which costs nothing here).
        for r in &fired {
            r.waker.wake_by_ref();
        }
        for waker in rechecked {
            waker.wake();
        }
        for r in fired {
            r.wait.uncount();
        }
    }
}

fn waiter(word: &AtomicU32, expected: u32, private: bool) -> futex::Wait {
    let mut w = futex::Wait::new();
    w.val = u64::from(expected);
    w.uaddr = futex::WaitPtr::new(word.as_ptr().cast());
    // Not private for the shared words: they live in memory other processes map.
    w.flags = if private {
        futex::WaitFlags::SIZE_U32 | futex::WaitFlags::PRIVATE
    } else {
        futex::WaitFlags::SIZE_U32
    };
    w
}

fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: d.subsec_nanos() as _,
    }
}

/// When a registration made now is re-checked: between a half and one and a half
/// [`RECHECK`] from now, on a grid of whole `RECHECK`s, so that all of a process's
/// parked gets are looked at in one wake-up of the reactor, not one each.
fn recheck_due() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let period = RECHECK.as_nanos();
    let at = (epoch.elapsed() + RECHECK / 2).as_nanos();
    let ticks = at.div_ceil(period);
    let nanos = u64::try_from(ticks.saturating_mul(period)).unwrap_or(u64::MAX);
    epoch + Duration::from_nanos(nanos)
}

/// This process's word-reactor shards (a `fork` child starts with none).
static SHARDS: ForkLocal<Vec<Arc<Shard>>> = ForkLocal::new();

/// A registration with a reactor; dropping it deregisters (and passes on a wake-up
/// that reached it, see the module docs). [`settle`](Self::settle) when the future
/// runs again.
pub(crate) struct Parked {
    kind: ParkedKind,
    done: bool,
    /// A second registration, on fds, beside a word's ([`Step::WordOrFds`]): either
    /// one wakes the future.
    fds: Option<Box<Parked>>,
}

enum ParkedKind {
    Word {
        shard: Arc<Shard>,
        key: u64,
        host: Arc<dyn WordHost>,
        index: usize,
        /// The value registered (a re-check that sees it again keeps the registration).
        expected: u32,
        /// Whether the registration is re-checked (see [`WordWait::recheck`]).
        recheck: bool,
        state: Arc<AtomicU8>,
    },
    Fd {
        reactor: Arc<FdReactor>,
        key: u64,
    },
}

impl Parked {
    /// Whether the registration still waits (the reactor has not woken it): then the
    /// future was polled for another reason (a `select!` sibling, a spurious wake-up),
    /// nothing it waits on has been seen to change, and it stays parked, with `waker`
    /// as the one to wake. A change the reactor has not looked at yet wakes `waker`.
    pub(crate) fn still_waiting(&self, waker: &Waker) -> bool {
        /// The waker to drop once the lock is let go (dropping a waker may drop a task,
        /// whose futures deregister under the same lock), if the slot holds one.
        fn rearm(waker: &Waker, slot: Option<&mut Waker>) -> Option<Option<Waker>> {
            let w = slot?;
            Some((!w.will_wake(waker)).then(|| std::mem::replace(w, waker.clone())))
        }
        if self.done {
            return false;
        }
        // Both parts are asked (each takes `waker`): the future stays parked only
        // while neither has been woken.
        if !self.fds_still_waiting(waker) {
            return false;
        }
        let old = match &self.kind {
            ParkedKind::Word { state, .. } if state.load(Ordering::SeqCst) != WAITING => None,
            ParkedKind::Word { shard, key, .. } => rearm(
                waker,
                lock(&shard.registrations)
                    .entries
                    .get_mut(key)
                    .map(|r| &mut r.waker),
            ),
            ParkedKind::Fd { reactor, key } => rearm(
                waker,
                lock(&reactor.registrations)
                    .entries
                    .get_mut(key)
                    .map(|r| &mut r.waker),
            ),
        };
        old.is_some()
    }

    /// Whether the reactor woke this registration for its re-check (and kept it): then
    /// it waits again from now on, with `waker` as the one to wake, and the future
    /// tries once (see [`poll_step`]).
    fn take_recheck(&self, waker: &Waker) -> bool {
        let ParkedKind::Word {
            shard, key, state, ..
        } = &self.kind
        else {
            return false;
        };
        if self.done
            || state
                .compare_exchange(RECHECKED, WAITING, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return false;
        }
        let old = lock(&shard.registrations)
            .entries
            .get_mut(key)
            .filter(|r| !r.waker.will_wake(waker))
            .map(|r| std::mem::replace(&mut r.waker, waker.clone()));
        drop(old); // outside the lock: dropping a waker may drop a task
        true
    }

    /// Whether the fd part of a registration (if it has one) still waits, taking
    /// `waker` as the one to wake.
    fn fds_still_waiting(&self, waker: &Waker) -> bool {
        self.fds.as_ref().is_none_or(|f| f.still_waiting(waker))
    }

    /// Whether this registration waits on `wait`'s word for `wait`'s value, re-checked
    /// if `wait` asks for it.
    fn waits_for(&self, wait: &WordWait) -> bool {
        match &self.kind {
            ParkedKind::Word {
                host,
                index,
                expected,
                recheck,
                ..
            } => {
                address(host.host_word(*index)) == address(wait.word())
                    && *expected == wait.expected
                    // A wait that now needs re-checks is registered anew with them.
                    && (*recheck || !wait.recheck)
            }
            ParkedKind::Fd { .. } => false,
        }
    }

    /// Deregisters without passing anything on: the future is running again and
    /// tries for itself.
    pub(crate) fn settle(mut self) {
        self.release(false);
    }

    fn release(&mut self, pass_on: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        // An fd registration has nothing to pass on: readiness is a level.
        drop(self.fds.take());
        match &self.kind {
            ParkedKind::Word {
                shard,
                key,
                host,
                index,
                state,
                ..
            } => {
                let removed = if state.load(Ordering::SeqCst) == FIRED {
                    None // the reactor removed it (and uncounted it)
                } else {
                    let mut regs = lock(&shard.registrations);
                    let removed = regs.entries.remove(key);
                    if removed.is_some() {
                        shard.changed();
                    }
                    removed
                };
                match removed {
                    Some(r) => r.wait.uncount(),
                    None if pass_on => {
                        super::futex::wake(host.host_word(*index), 1);
                    }
                    None => {}
                }
            }
            ParkedKind::Fd { reactor, key } => {
                let mut regs = lock(&reactor.registrations);
                if regs.entries.remove(key).is_some() {
                    reactor.changed();
                }
            }
        }
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        self.release(true);
    }
}

/// How many times this process's reactor threads (word and fd) have come back from
/// their sleep (the idle test: none while every future waits).
static WAKE_UPS: AtomicU64 = AtomicU64::new(0);

/// Whether every word reactor thread sleeps (or is about to) on its current set of
/// registrations: no change is left for it to take in, so only a word, a deadline or a
/// new change wakes it (tests).
#[cfg(feature = "testing-internals")]
pub(crate) fn words_settled() -> bool {
    SHARDS.lock().iter().all(|s| {
        s.slept_on.load(Ordering::SeqCst) == u64::from(s.control.load(Ordering::SeqCst)) + 1
    })
}

/// Whether the fd reactor (if this process has one) sleeps in `poll` with nothing left
/// to take in: no doorbell rung and no inotify event (a close of a watched file, this
/// process's own included) queued that it has not read. Its registered fds are not
/// looked at: their readiness is the caller's to know (tests).
///
/// Why both: the thread clears `polling` as soon as `poll` returns, before it reads
/// the events that woke it, so whenever what woke it has been read the flag is already
/// down; and while the flag is up, anything that would wake it is still queued, which
/// the `poll` here (a zero timeout: it consumes nothing) sees.
#[cfg(feature = "testing-internals")]
pub(crate) fn fd_settled() -> bool {
    let Some(reactor) = FD_REACTOR.lock().as_ref().map(Arc::clone) else {
        return true;
    };
    if !reactor.polling.load(Ordering::SeqCst) {
        return false;
    }
    let mut fds = vec![PollFd::new(&reactor.doorbell, PollFlags::IN)];
    if let Some(inotify) = &reactor.inotify {
        fds.push(PollFd::new(inotify, PollFlags::IN));
    }
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(0))
}

/// [`WAKE_UPS`] (tests).
#[cfg(feature = "testing-internals")]
pub(crate) fn wake_ups() -> u64 {
    WAKE_UPS.load(Ordering::Relaxed)
}

/// How many word registrations this process's reactors hold (parked futures; tests).
#[cfg(feature = "testing-internals")]
pub(crate) fn word_registrations() -> usize {
    SHARDS
        .lock()
        .iter()
        .map(|s| lock(&s.registrations).entries.len())
        .sum()
}

/// Registers `wait` with a word reactor, to wake `waker` when its word changes;
/// `Ok(None)` when it already has (the caller tries again at once).
///
/// # Errors
/// When no reactor thread can be started.
pub(crate) fn park_word(wait: WordWait, waker: &Waker) -> Result<Option<Parked>> {
    if let Some(count) = wait.counted_in {
        wait.host.host_word(count).fetch_add(1, Ordering::SeqCst);
    }
    if wait.changed() {
        wait.uncount();
        return Ok(None);
    }
    let pair = (address(wait.word()), wait.expected);
    let shard = {
        let mut shards = SHARDS.lock();
        let found = shards
            .iter()
            .find(|s| {
                let d = lock(&s.registrations).distinct();
                d.contains(&pair) || d.len() < WAITV_MAX - 1
            })
            .cloned();
        match found {
            Some(shard) => shard,
            None => {
                let shard = Arc::new(Shard {
                    control: AtomicU32::new(0),
                    slept_on: AtomicU64::new(0),
                    registrations: Mutex::new(Registrations::default()),
                });
                let runner = Arc::clone(&shard);
                if let Err(e) = std::thread::Builder::new()
                    .name("multiproc-reactor".into())
                    .spawn(move || runner.run())
                {
                    wait.uncount();
                    return Err(Error::os("starting multiproc's async reactor thread", e));
                }
                shards.push(Arc::clone(&shard));
                shard
            }
        }
    };
    let host = Arc::clone(&wait.host);
    let index = wait.index;
    let state = Arc::new(AtomicU8::new(WAITING));
    let expected = wait.expected;
    let recheck = wait.recheck;
    let key = {
        let mut regs = lock(&shard.registrations);
        let key = regs.next_key;
        regs.next_key += 1;
        let due = wait
            .recheck
            .then(recheck_due)
            .into_iter()
            .chain(wait.wake_by)
            .min();
        regs.entries.insert(
            key,
            Registration {
                wait,
                waker: waker.clone(),
                due,
                state: Arc::clone(&state),
            },
        );
        shard.changed();
        key
    };
    Ok(Some(Parked {
        kind: ParkedKind::Word {
            shard,
            key,
            host,
            index,
            expected,
            recheck,
            state,
        },
        done: false,
        fds: None,
    }))
}

/// Which readiness an fd registration waits for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ready {
    Readable,
    Writable,
}

struct FdRegistration {
    /// Any of these ready wakes the future.
    fds: Vec<Arc<OwnedFd>>,
    flags: PollFlags,
    waker: Waker,
}

#[derive(Default)]
struct FdRegistrations {
    next_key: u64,
    entries: HashMap<u64, FdRegistration>,
    /// The close watches ([`watch_closes`]), by key: their watch descriptor and what
    /// they share with the futures waiting on them.
    watches: HashMap<u64, (i32, Arc<WatchShared>)>,
    /// How many close watches use each inotify watch descriptor (two channel values
    /// of one queue in this process watch the same file, and the kernel gives both the
    /// same descriptor): the last one's drop removes it.
    wds: HashMap<i32, usize>,
}

/// What a close watch shares with the reactor: how many closes it has seen, and the
/// wakers of the futures waiting for the next one, by their id.
#[derive(Default)]
struct WatchShared {
    closes: AtomicU64,
    waiting: Mutex<HashMap<u64, Waker>>,
    next_id: AtomicU64,
}

/// The fd reactor: a thread in `poll` over the registered fds, its eventfd and its
/// inotify instance (the close watches).
struct FdReactor {
    doorbell: OwnedFd,
    /// Close watches' inotify instance; `None` where the kernel refused one (the
    /// user's 128 instances are in use): close watches are then refused, and their
    /// futures rely on their re-checks.
    inotify: Option<OwnedFd>,
    registrations: Mutex<FdRegistrations>,
    /// Set while the thread is (about to be) in `poll`, cleared as soon as `poll`
    /// returns, before it counts the wake-up or reads what woke it (tests: see
    /// [`fd_settled`]).
    polling: AtomicBool,
}

impl FdReactor {
    fn changed(&self) {
        let _ = rustix::io::write(&self.doorbell, &1u64.to_ne_bytes());
    }

    fn run(self: Arc<Self>) {
        loop {
            let watched: Vec<(u64, Arc<OwnedFd>, PollFlags)> = lock(&self.registrations)
                .entries
                .iter()
                .flat_map(|(k, r)| r.fds.iter().map(|fd| (*k, Arc::clone(fd), r.flags)))
                .collect();
            let mut fds = vec![PollFd::new(&self.doorbell, PollFlags::IN)];
            let first = match &self.inotify {
                Some(inotify) => {
                    fds.push(PollFd::new(inotify, PollFlags::IN));
                    2
                }
                None => 1,
            };
            fds.extend(
                watched
                    .iter()
                    .map(|(_, fd, flags)| PollFd::new(&**fd, *flags)),
            );
            self.polling.store(true, Ordering::SeqCst);
            let polled = rustix::event::poll(&mut fds, None);
            self.polling.store(false, Ordering::SeqCst);
            WAKE_UPS.fetch_add(1, Ordering::Relaxed);
            if polled.is_err() {
                continue; // EINTR; anything else is looked at again
            }
            if !fds[0].revents().is_empty() {
                let mut count = [0u8; 8];
                let _ = rustix::io::read(&self.doorbell, &mut count);
            }
            let closed = match &self.inotify {
                Some(inotify) if !fds[1].revents().is_empty() => closes_seen(inotify),
                _ => Closes::default(),
            };
            let ready: Vec<u64> = watched
                .iter()
                .zip(&fds[first..])
                .filter(|(_, p)| !p.revents().is_empty())
                .map(|((k, _, _), _)| *k)
                .collect();
            drop(fds);
            let mut wakers = Vec::new();
            {
                let mut regs = lock(&self.registrations);
                for key in ready {
                    if let Some(r) = regs.entries.remove(&key) {
                        wakers.push(r.waker);
                    }
                }
                for (wd, shared) in regs.watches.values() {
                    if closed.all || closed.wds.contains(wd) {
                        shared.closes.fetch_add(1, Ordering::SeqCst);
                        wakers.extend(lock(&shared.waiting).values().cloned());
                    }
                }
            }
            // The woken registrations' fds close before their futures run again: a
            // future that completes has left no duplicate open behind it.
            drop(watched);
            for waker in wakers {
                waker.wake();
            }
        }
    }
}

/// This process's fd reactor (a `fork` child starts without one).
static FD_REACTOR: ForkLocal<Option<Arc<FdReactor>>> = ForkLocal::new();

/// How many fd registrations this process's fd reactor holds (parked futures; tests).
#[cfg(feature = "testing-internals")]
pub(crate) fn fd_registrations() -> usize {
    FD_REACTOR
        .lock()
        .as_ref()
        .map_or(0, |r| lock(&r.registrations).entries.len())
}

/// This process's fd reactor, started on first use.
///
/// # Errors
/// When its eventfd cannot be made or its thread cannot be started.
fn fd_reactor() -> Result<Arc<FdReactor>> {
    let mut slot = FD_REACTOR.lock();
    if let Some(r) = &*slot {
        return Ok(Arc::clone(r));
    }
    let doorbell = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
        .map_err(|e| Error::os("making the async fd reactor's eventfd", e))?;
    let inotify = rustix::fs::inotify::init(
        rustix::fs::inotify::CreateFlags::CLOEXEC | rustix::fs::inotify::CreateFlags::NONBLOCK,
    )
    .inspect_err(|e| {
        tracing::debug!(
            "multiproc: no inotify instance for the async fd reactor ({e}): an awaited get \
             hears of a killed queue holder at its re-check"
        );
    })
    .ok();
    let reactor = Arc::new(FdReactor {
        doorbell,
        inotify,
        registrations: Mutex::new(FdRegistrations::default()),
        polling: AtomicBool::new(false),
    });
    let runner = Arc::clone(&reactor);
    std::thread::Builder::new()
        .name("multiproc-fd-reactor".into())
        .spawn(move || runner.run())
        .map_err(|e| Error::os("starting multiproc's async fd reactor thread", e))?;
    *slot = Some(Arc::clone(&reactor));
    Ok(reactor)
}

/// The watch descriptors whose files were closed, from the events queued on
/// `inotify` (`all` when the queue overflowed and some were lost).
#[derive(Default)]
struct Closes {
    wds: Vec<i32>,
    all: bool,
}

fn closes_seen(inotify: &OwnedFd) -> Closes {
    use rustix::fs::inotify::{ReadFlags, Reader};
    let mut closes = Closes::default();
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    let mut events = Reader::new(inotify, &mut buf);
    while let Ok(event) = events.next() {
        if event.events().contains(ReadFlags::QUEUE_OVERFLOW) {
            closes.all = true;
        } else if !closes.wds.contains(&event.wd()) {
            closes.wds.push(event.wd());
        }
    }
    closes
}

/// A watch of the closes of one file (any process's, its own included), with the fd
/// reactor's inotify instance: it counts them, and wakes the futures that
/// [`wait`](Self::wait) on it at each. A queue's channel value keeps one on its holder
/// lease file for as long as it lives (made when a get on it is first polled): every holder
/// that leaves closes its description of that file, a SIGKILLed one included, so an
/// awaited get hears of the last one at once (see `queue::awaiting`).
pub(crate) struct CloseWatch {
    reactor: Arc<FdReactor>,
    key: u64,
    shared: Arc<WatchShared>,
    /// The `fork` generation that made it: a `fork` child inherits the value (inside
    /// a queue handle) but not the reactor thread behind it, and must neither wait on
    /// it nor take its locks, which a parent's thread may have held at the fork.
    generation: u64,
}

/// A future's place among a [`CloseWatch`]'s waiters: the count of closes it last
/// saw, and its waker's id while one is registered (removed when the seat is dropped,
/// with its future).
#[derive(Default)]
pub(crate) struct WatchSeat {
    seen: Option<u64>,
    waiting: Option<(Arc<WatchShared>, u64)>,
}

impl Drop for WatchSeat {
    fn drop(&mut self) {
        if let Some((shared, id)) = self.waiting.take() {
            let old = lock(&shared.waiting).remove(&id);
            drop(old); // outside the lock: dropping a waker may drop a task
        }
    }
}

impl CloseWatch {
    /// Whether this process made the watch (not its `fork` parent): only then may it
    /// be waited on.
    pub(crate) fn is_here(&self) -> bool {
        self.generation == super::fork_local::fork_generation()
    }

    /// Whether the file was closed since `seat` last looked (a first look only
    /// records the count).
    pub(crate) fn closed_since(&self, seat: &mut WatchSeat) -> bool {
        let now = self.shared.closes.load(Ordering::SeqCst);
        seat.seen.replace(now).is_some_and(|seen| seen != now)
    }

    /// Registers (or updates) `waker` as `seat`'s, to be woken at the next close;
    /// `false` when a close came since `seat` last looked, which no wake-up may
    /// announce (the caller looks again rather than wait).
    pub(crate) fn wait(&self, seat: &mut WatchSeat, waker: &Waker) -> bool {
        let old = {
            let mut waiting = lock(&self.shared.waiting);
            let id = match &seat.waiting {
                Some((_, id)) => *id,
                None => {
                    let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
                    seat.waiting = Some((Arc::clone(&self.shared), id));
                    id
                }
            };
            match waiting.get_mut(&id) {
                Some(w) if w.will_wake(waker) => None,
                Some(w) => Some(std::mem::replace(w, waker.clone())),
                None => waiting.insert(id, waker.clone()),
            }
        };
        drop(old); // outside the lock: dropping a waker may drop a task
        seat.seen == Some(self.shared.closes.load(Ordering::SeqCst))
    }
}

impl std::fmt::Debug for CloseWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CloseWatch")
            .field("closes", &self.shared.closes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Drop for CloseWatch {
    fn drop(&mut self) {
        if !self.is_here() {
            return; // a fork child's copy: the parent's reactor keeps the watch
        }
        let mut regs = lock(&self.reactor.registrations);
        let Some((wd, _)) = regs.watches.remove(&self.key) else {
            return;
        };
        let users = regs.wds.entry(wd).or_default();
        *users = users.saturating_sub(1);
        if *users == 0 {
            regs.wds.remove(&wd);
            if let Some(inotify) = &self.reactor.inotify {
                // Under the lock `watch_closes` adds under: nobody is handed this
                // descriptor while it goes.
                let _ = rustix::fs::inotify::remove_watch(inotify, wd);
            }
        }
    }
}

/// Watches the closes of the file `file` refers to (see [`CloseWatch`]); `None` when
/// the kernel refuses (no inotify instance, or no watch left): the caller then relies
/// on its re-checks.
pub(crate) fn watch_closes(file: BorrowedFd<'_>) -> Option<CloseWatch> {
    use std::os::fd::AsRawFd;
    let reactor = fd_reactor().ok()?;
    let inotify = reactor.inotify.as_ref()?;
    let shared = Arc::new(WatchShared::default());
    let key = {
        // Under the lock a last watch's drop removes its descriptor under: one the
        // kernel hands back here is not removed meanwhile.
        let mut regs = lock(&reactor.registrations);
        let wd = rustix::fs::inotify::add_watch(
            inotify,
            format!("/proc/self/fd/{}", file.as_raw_fd()),
            rustix::fs::inotify::WatchFlags::CLOSE_WRITE
                | rustix::fs::inotify::WatchFlags::CLOSE_NOWRITE,
        )
        .ok()?;
        *regs.wds.entry(wd).or_default() += 1;
        let key = regs.next_key;
        regs.next_key += 1;
        regs.watches.insert(key, (wd, Arc::clone(&shared)));
        key
    };
    Some(CloseWatch {
        reactor,
        key,
        shared,
        generation: super::fork_local::fork_generation(),
    })
}

/// Registers a duplicate of `fd` with the fd reactor, to wake `waker` when it is
/// ready (or hung up).
///
/// # Errors
/// When the fd cannot be duplicated or the fd reactor cannot be started.
pub(crate) fn park_fd(fd: BorrowedFd<'_>, ready: Ready, waker: &Waker) -> Result<Parked> {
    let fd = fd
        .try_clone_to_owned()
        .map_err(|e| Error::os("duplicating an fd to wait on it", e))?;
    park_fds(vec![fd], ready, waker)
}

/// Registers `fds` with the fd reactor, to wake `waker` when any of them is ready (or
/// hung up); the registration owns them until it is woken or dropped.
///
/// # Errors
/// When the fd reactor cannot be started.
pub(crate) fn park_fds(fds: Vec<OwnedFd>, ready: Ready, waker: &Waker) -> Result<Parked> {
    let reactor = fd_reactor()?;
    let flags = match ready {
        Ready::Readable => PollFlags::IN,
        Ready::Writable => PollFlags::OUT,
    };
    let key = {
        let mut regs = lock(&reactor.registrations);
        let key = regs.next_key;
        regs.next_key += 1;
        regs.entries.insert(
            key,
            FdRegistration {
                fds: fds.into_iter().map(Arc::new).collect(),
                flags,
                waker: waker.clone(),
            },
        );
        reactor.changed();
        key
    };
    Ok(Parked {
        kind: ParkedKind::Fd { reactor, key },
        done: false,
        fds: None,
    })
}

/// What one try of an awaited operation found.
pub(crate) enum Step<'a, R> {
    /// Done (or failed): the future's output.
    Done(R),
    /// Nothing yet: park on this word (read *before* the try).
    Word(WordWait),
    /// Nothing yet: park until this fd is ready (readiness is a level: no race).
    Fd(BorrowedFd<'a>, Ready),
    /// Nothing yet: park until any of these fds is ready.
    Fds(Vec<OwnedFd>, Ready),
    /// Nothing yet: park on this word (as [`Step::Word`]) and until any of these fds is
    /// ready (a data loader's results queue, and its workers' pidfds).
    WordOrFds(WordWait, Vec<OwnedFd>, Ready),
}

/// Tries before giving the executor back, when every try finds its word changed again.
const TRIES_PER_POLL: usize = 64;

/// The poll of an awaited operation: stays parked when its registration still waits
/// (see [`Parked::still_waiting`]); otherwise settles it, then tries (`step`), parking
/// when it finds nothing, until it is done. Cancel-safe as far as
/// `step` is: a dropped future leaves only a registration, which its drop removes.
pub(crate) fn poll_step<'a, R>(
    cx: &mut Context<'_>,
    parked: &mut Option<Parked>,
    step: impl FnMut() -> Step<'a, R>,
    failed: impl FnOnce(Error) -> R,
) -> Poll<R> {
    poll_step_rung(cx, parked, false, step, failed)
}

/// [`poll_step`], when `rang` says that something besides the registration woke the
/// future (a [`CloseWatch`] an awaited get waits on): then it tries once even though its
/// registration still waits, and keeps the registration when it finds nothing new, as
/// after a re-check.
pub(crate) fn poll_step_rung<'a, R>(
    cx: &mut Context<'_>,
    parked: &mut Option<Parked>,
    rang: bool,
    mut step: impl FnMut() -> Step<'a, R>,
    failed: impl FnOnce(Error) -> R,
) -> Poll<R> {
    let mut first = None;
    if let Some(p) = parked.as_ref() {
        let waiting = p.still_waiting(cx.waker());
        if waiting && !rang {
            return Poll::Pending;
        }
        if waiting || p.take_recheck(cx.waker()) {
            match step() {
                Step::Done(r) => {
                    *parked = None; // deregisters
                    return Poll::Ready(r);
                }
                // Nothing, and the word as registered: the registration goes on.
                // (`wait` counts nowhere until it is parked: dropping it is all.)
                Step::Word(wait) if p.waits_for(&wait) => return Poll::Pending,
                Step::WordOrFds(wait, _, _)
                    if p.waits_for(&wait) && p.fds_still_waiting(cx.waker()) =>
                {
                    return Poll::Pending;
                }
                other => first = Some(other),
            }
        }
    }
    if let Some(p) = parked.take() {
        p.settle();
    }
    for _ in 0..TRIES_PER_POLL {
        let registered = match first.take().unwrap_or_else(&mut step) {
            Step::Done(r) => return Poll::Ready(r),
            Step::Word(wait) => park_word(wait, cx.waker()),
            Step::Fd(fd, ready) => park_fd(fd, ready, cx.waker()).map(Some),
            Step::Fds(fds, ready) => park_fds(fds, ready, cx.waker()).map(Some),
            Step::WordOrFds(wait, fds, ready) => match park_word(wait, cx.waker()) {
                Ok(Some(mut p)) => park_fds(fds, ready, cx.waker()).map(|f| {
                    p.fds = Some(Box::new(f));
                    Some(p)
                }),
                other => other,
            },
        };
        match registered {
            Ok(Some(p)) => {
                *parked = Some(p);
                return Poll::Pending;
            }
            Ok(None) => {}
            Err(e) => return Poll::Ready(failed(e)),
        }
    }
    cx.waker().wake_by_ref();
    Poll::Pending
}
