//! [`Lock`] and [`RLock`]: process-shared mutual exclusion that survives its holder's
//! death.
//!
//! The lock word holds the holder's *holder id* on the lock's page (0 when free; see
//! `SharedWords::holder_id`): a number no other process of the page ever had, which
//! the kernel vouches for — the holder marks that byte of the page's file with an
//! open-file-description lock for as long as it lives. A waiter sleeps on the word with
//! a futex and, every [`LIVENESS_CHECK`], asks the kernel whether the holder's mark is
//! still there; if it is gone (the holder died, or unmapped the lock), the waiter takes
//! the lock over and reports [`Error::OwnerDied`] — as a robust mutex reports
//! `EOWNERDEAD` — instead of waiting forever. No pid is involved, so a reused pid
//! cannot make a dead holder look alive.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::word::Word;
use crate::error::{Error, LockError, Result};
use crate::shm::SharedWords;
use crate::sys::{Deadline, deadline_after};

/// How often a waiter checks that the holder still lives.
const LIVENESS_CHECK: Duration = Duration::from_millis(50);
/// How long a waiter first sleeps (woken by the release) before its first check.
const FIRST_WAIT: Duration = Duration::from_millis(1);

const LOCK_KIND: u32 = 0x4c4f_434b; // "LOCK"
const RLOCK_KIND: u32 = 0x524c_434b; // "RLCK"

/// Word offsets of a raw lock inside its block.
const OWNER: usize = 0;
const WAITERS: usize = 1;
/// The holder's thread id (written after an acquire by `Lock` and `RLock`, read by
/// their `is_owned_by_current_thread`; not part of the futex protocol).
const THREAD: usize = 2;
const DEPTH: usize = 3;
/// Words a raw lock takes.
pub(crate) const RAW_LOCK_WORDS: usize = 4;

fn my_pid() -> u32 {
    // Without a system call: a queue's custody takes a lock per lookup.
    crate::sys::fork_local::cached_pid()
}

/// This thread's id, without a system call after the thread's first ask (every acquire
/// of a lock records it): cached per thread, and asked again in a `fork` child, whose
/// thread has an id of its own.
fn my_tid() -> u32 {
    thread_local! {
        static TID: Cell<(u64, u32)> = const { Cell::new((u64::MAX, 0)) };
    }
    let generation = crate::sys::fork_local::fork_generation();
    TID.try_with(|cached| {
        let (seen_in, tid) = cached.get();
        if seen_in == generation {
            return tid;
        }
        let tid = crate::sys::process::current_tid();
        cached.set((generation, tid));
        tid
    })
    .unwrap_or_else(|_| crate::sys::process::current_tid())
}

/// The mechanism under every lock-like primitive: [`RAW_LOCK_WORDS`] words of a shared
/// block starting at `base`.
#[derive(Clone)]
pub(crate) struct RawLock {
    block: Arc<SharedWords>,
    base: usize,
}

/// How an acquisition went.
pub(crate) enum Acquired {
    /// The lock is ours.
    Yes,
    /// The lock is ours, taken over from a holder that died while holding it.
    FromDeadOwner(u32),
    /// The deadline passed.
    TimedOut,
}

impl RawLock {
    pub(crate) fn new(block: Arc<SharedWords>, base: usize) -> Self {
        Self { block, base }
    }

    fn word(&self, w: usize) -> &std::sync::atomic::AtomicU32 {
        self.block.word(self.base + w)
    }

    pub(crate) fn acquire(&self, deadline: Deadline) -> Result<Acquired> {
        let me = self.block.holder_id()?;
        let got = acquire(self.word(OWNER), self.word(WAITERS), me, deadline, |id| {
            !self.block.holder_lives(id)
        })?;
        // The dead holder's pid, for the error that names it.
        Ok(match got {
            Acquired::FromDeadOwner(id) => Acquired::FromDeadOwner(self.block.holder_pid(id)),
            other => other,
        })
    }

    /// Whether this process holds the lock.
    pub(crate) fn is_held_by_this_process(&self) -> bool {
        let holder = self.holder();
        holder != 0 && self.block.holder_id_if_any() == Some(holder)
    }

    /// The pid of the holder (0: free, or unknown).
    pub(crate) fn holder_pid(&self) -> u32 {
        match self.holder() {
            0 => 0,
            id => self.block.holder_pid(id),
        }
    }

    /// Releases the lock. Any process may release a [`Lock`] (as in Python); the caller
    /// checks ownership where the primitive requires it.
    pub(crate) fn release(&self) -> Result<()> {
        release(self.word(OWNER), self.word(WAITERS))
    }

    #[cfg(test)]
    pub(crate) fn block_word_owner(&self) -> &std::sync::atomic::AtomicU32 {
        self.word(OWNER)
    }

    /// The holder's id on the page (0: free).
    pub(crate) fn holder(&self) -> u32 {
        self.word(OWNER).load(Ordering::Acquire)
    }
}

/// The protocol of [`RawLock::acquire`], over the lock's `owner` and `waiters` words,
/// for the process `me`; `is_dead` says whether a holder's process has died.
fn acquire<W: Word>(
    owner: &W,
    waiters: &W,
    me: u32,
    deadline: Deadline,
    is_dead: impl Fn(u32) -> bool,
) -> Result<Acquired> {
    let mut waited = false;
    loop {
        match owner.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => return Ok(Acquired::Yes),
            Err(holder) => {
                // Most holders are inside a critical section of well under a
                // microsecond: retry briefly before paying for a liveness check (a
                // /proc read) and a futex sleep.
                if holder != me && spin_until_free(owner) {
                    continue;
                }
                // A holder that did not let go within the spin was most likely
                // preempted: wait for its release once (briefly) before paying for the
                // liveness check, and check before giving up.
                let now = Instant::now();
                let late = deadline.is_some_and(|d| now + FIRST_WAIT >= d);
                if holder != me && (waited || late) && is_dead(holder) {
                    if owner
                        .compare_exchange(holder, me, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                    {
                        return Ok(Acquired::FromDeadOwner(holder));
                    }
                    continue;
                }
                if deadline.is_some_and(|d| now >= d) {
                    return Ok(Acquired::TimedOut);
                }
                let slice = now + if waited { LIVENESS_CHECK } else { FIRST_WAIT };
                waited = true;
                let until = Some(deadline.map_or(slice, |d| d.min(slice)));
                // Counted with read-modify-writes on both sides (see `release`).
                waiters.fetch_add(1, Ordering::AcqRel);
                let r = owner.wait(holder, until);
                waiters.fetch_sub(1, Ordering::AcqRel);
                r?;
            }
        }
    }
}

/// The protocol of [`RawLock::release`].
fn release<W: Word>(owner: &W, waiters: &W) -> Result<()> {
    if owner.swap(0, Ordering::Release) == 0 {
        return Err(Error::InvalidArgument(
            "release of a lock that is not held".into(),
        ));
    }
    // A read-modify-write, not a load: the waiter counts itself and then sleeps only
    // while the owner word is unchanged, the releaser changes it and then reads the
    // waiters, and with plain loads on both sides each could miss the other's write
    // (store buffering; see `counter`).
    if waiters.fetch_add(0, Ordering::AcqRel) > 0 {
        owner.wake_one();
    }
    Ok(())
}

/// How many times [`spin_until_free`] looks at a held lock word before giving up.
const SPIN_TRIES: u32 = 256;

/// Polls a lock word for a short while; whether it became free (never, for a word
/// that does not spin: the model checker's).
fn spin_until_free<W: Word>(owner: &W) -> bool {
    if !W::SPINS {
        return false;
    }
    for _ in 0..SPIN_TRIES {
        if owner.load(Ordering::Relaxed) == 0 {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

pub(crate) fn owner_died(what: &str, pid: u32) -> Error {
    let who = match pid {
        0 => "pid unknown".to_string(),
        pid => format!("pid {pid}"),
    };
    Error::OwnerDied {
        pid,
        message: format!(
            "the previous holder of this {what} ({who}) died while holding it; the {what} is \
             now held by pid {} — the state it protects may be half-updated, check it before going on",
            my_pid()
        ),
    }
}

/// What a guard-returning method answers when its deadline passed.
#[derive(Clone, Copy)]
pub(crate) enum OnTimeout {
    /// `Ok(None)`: a `try_` form, which does not wait.
    Nothing,
    /// [`Error::Timeout`] after this long.
    Fail(Option<Duration>),
}

/// Turns an acquisition into the answer of a guard-returning method: the guard, `None`
/// for a `try_` form that found the lock taken, or a [`LockError`] (carrying the guard
/// when the holder died, since the lock is then ours).
pub(crate) fn guarded<G>(
    got: Result<Acquired>,
    what: &str,
    on_timeout: OnTimeout,
    guard: impl FnOnce() -> G,
) -> std::result::Result<Option<G>, LockError<G>> {
    match got? {
        Acquired::Yes => Ok(Some(guard())),
        Acquired::TimedOut => match on_timeout {
            OnTimeout::Nothing => Ok(None),
            OnTimeout::Fail(after) => {
                Err(Error::timeout(format!("an acquire of a {what}"), after).into())
            }
        },
        Acquired::FromDeadOwner(pid) => Err(LockError {
            error: owner_died(what, pid),
            guard: Some(guard()),
        }),
    }
}

/// A guard-returning wait that cannot time out (no deadline, or a deadline whose
/// timeout was turned into an error already) produced its guard.
pub(crate) fn expect_guard<G>(
    got: std::result::Result<Option<G>, LockError<G>>,
    what: &str,
) -> std::result::Result<G, LockError<G>> {
    got?.ok_or_else(|| Error::timeout(format!("an acquire of a {what}"), None).into())
}

/// A process-shared lock, like `multiprocessing.Lock`.
///
/// Not reentrant; any process may release it. If its holder dies while holding it, the
/// next acquirer gets [`Error::OwnerDied`] and holds the lock.
///
/// # Examples
///
/// ```
/// let lock = multiproc::Lock::new()?;
/// {
///     let _held = lock.lock()?;
///     assert!(lock.try_lock()?.is_none(), "held by the guard");
///     assert!(!lock.try_acquire()?);
///     assert!(lock.acquire_timeout(std::time::Duration::ZERO).unwrap_err().is_timeout());
/// } // the guard released it
/// lock.acquire()?;
/// lock.release()?;
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone)]
pub struct Lock {
    raw: RawLock,
}

impl Lock {
    /// A new, free lock.
    ///
    /// # Errors
    /// When the shared page cannot be made.
    pub fn new() -> Result<Self> {
        Ok(Self {
            raw: RawLock::new(Arc::new(SharedWords::new(LOCK_KIND)?), 1),
        })
    }

    pub(crate) fn from_raw(raw: RawLock) -> Self {
        Self { raw }
    }

    /// Acquires the raw lock and, once it is ours, records this thread in its THREAD
    /// word (for [`is_owned_by_current_thread`](Self::is_owned_by_current_thread); the
    /// protocol itself reads only OWNER and WAITERS).
    pub(super) fn acquire_raw(&self, deadline: Deadline) -> Result<Acquired> {
        let got = self.raw.acquire(deadline)?;
        if !matches!(got, Acquired::TimedOut) {
            self.raw.word(THREAD).store(my_tid(), Ordering::Release);
        }
        Ok(got)
    }

    /// Whether this thread of this process holds the lock; a snapshot, for assertions
    /// and `Condition`. (Any thread or process may release a `Lock`: one that another
    /// releases stops being this thread's.)
    ///
    /// ```
    /// let lock = multiproc::Lock::new()?;
    /// assert!(!lock.is_owned_by_current_thread());
    /// let held = lock.lock()?;
    /// assert!(lock.is_owned_by_current_thread());
    /// std::thread::scope(|s| {
    ///     s.spawn(|| assert!(lock.is_locked() && !lock.is_owned_by_current_thread()));
    /// });
    /// drop(held);
    /// assert!(!lock.is_owned_by_current_thread());
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn is_owned_by_current_thread(&self) -> bool {
        self.raw.is_held_by_this_process()
            && self.raw.word(THREAD).load(Ordering::Acquire) == my_tid()
    }

    /// Acquires the lock, waiting as long as it takes. Release it with
    /// [`release`](Self::release), or use [`lock`](Self::lock) for a guard that
    /// releases it.
    ///
    /// # Errors
    /// [`Error::OwnerDied`] when the lock was taken over from a dead holder (the caller
    /// now holds it).
    pub fn acquire(&self) -> Result<()> {
        self.acquire_within(None)
    }

    /// Acquires the lock, waiting at most `timeout` (Python's `acquire(timeout=…)`).
    ///
    /// # Errors
    /// [`Error::Timeout`] when it was not acquired in time; otherwise as
    /// [`acquire`](Self::acquire).
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<()> {
        self.acquire_within(Some(timeout))
    }

    /// Acquires the lock if it is free, without waiting: `Ok(false)` when another
    /// holder has it (Python's `acquire(block=False)`).
    ///
    /// # Errors
    /// As [`acquire`](Self::acquire) (a dead holder's lock is taken over and
    /// reported).
    #[doc(alias = "acquire_nowait")]
    pub fn try_acquire(&self) -> Result<bool> {
        acquired_now(self.acquire_within(Some(Duration::ZERO)))
    }

    fn acquire_within(&self, timeout: Option<Duration>) -> Result<()> {
        match self.acquire_raw(deadline_after(timeout))? {
            Acquired::Yes => Ok(()),
            Acquired::TimedOut => Err(Error::timeout("an acquire of a lock", timeout)),
            Acquired::FromDeadOwner(pid) => Err(owner_died("lock", pid)),
        }
    }

    /// Releases the lock.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it is not held.
    pub fn release(&self) -> Result<()> {
        // Forgotten before the lock is free (the owner word's release orders it): a
        // thread of this process that takes it next is not taken for the old holder
        // before it records itself.
        if self.raw.holder() != 0 {
            self.raw.word(THREAD).store(0, Ordering::Relaxed);
        }
        self.raw.release()
    }

    /// Acquires the lock, waiting as long as it takes, and returns a guard that releases
    /// it when dropped.
    ///
    /// # Errors
    /// [`Error::OwnerDied`] when the previous holder died holding it: the
    /// [`LockError`] then carries the guard (the lock is held), to repair the state and
    /// go on with [`LockError::into_guard`]. `?` drops that guard, releasing the lock.
    pub fn lock(&self) -> std::result::Result<LockGuard<'_>, LockError<LockGuard<'_>>> {
        let got = self.acquire_raw(None);
        expect_guard(
            guarded(got, "lock", OnTimeout::Fail(None), || LockGuard {
                lock: self,
            }),
            "lock",
        )
    }

    /// Acquires the lock if it is free: `Ok(None)` when another holder has it.
    ///
    /// # Errors
    /// As [`lock`](Self::lock) (a dead holder's lock is taken over and reported).
    pub fn try_lock(&self) -> std::result::Result<Option<LockGuard<'_>>, LockError<LockGuard<'_>>> {
        let got = self.acquire_raw(Some(Instant::now()));
        guarded(got, "lock", OnTimeout::Nothing, || LockGuard { lock: self })
    }

    /// Acquires the lock, waiting at most `timeout`, and returns a guard.
    ///
    /// # Errors
    /// [`Error::Timeout`] when it was not acquired in time; otherwise as
    /// [`lock`](Self::lock).
    pub fn lock_timeout(
        &self,
        timeout: Duration,
    ) -> std::result::Result<LockGuard<'_>, LockError<LockGuard<'_>>> {
        let got = self.acquire_raw(deadline_after(Some(timeout)));
        let t = OnTimeout::Fail(Some(timeout));
        expect_guard(guarded(got, "lock", t, || LockGuard { lock: self }), "lock")
    }

    #[cfg(test)]
    pub(crate) fn raw_for_tests(&self) -> &RawLock {
        &self.raw
    }

    /// Whether some process holds the lock right now.
    pub fn is_locked(&self) -> bool {
        self.raw.holder() != 0
    }
}

/// Holds a [`Lock`] until dropped (see [`Lock::lock`]).
#[must_use = "the lock is released when the guard is dropped"]
pub struct LockGuard<'a> {
    lock: &'a Lock,
}

impl fmt::Debug for LockGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lock", self.lock)
            .finish()
    }
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        let _ = self.lock.release();
    }
}

impl fmt::Debug for Lock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lock")
            .field("holder_pid", &self.raw.holder_pid())
            .finish()
    }
}

impl Serialize for Lock {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.raw.block.serialize_as("a Lock", s)
    }
}

impl<'de> Deserialize<'de> for Lock {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let block = SharedWords::deserialize_as(LOCK_KIND, "a Lock", d)?;
        Ok(Self::from_raw(RawLock::new(Arc::new(block), 1)))
    }
}

/// A process-shared reentrant lock, like `multiprocessing.RLock`: the thread holding it
/// may acquire it again, and must release it as many times.
#[derive(Clone)]
pub struct RLock {
    raw: RawLock,
}

impl RLock {
    /// A new, free reentrant lock.
    ///
    /// # Errors
    /// When the shared page cannot be made.
    pub fn new() -> Result<Self> {
        Ok(Self {
            raw: RawLock::new(Arc::new(SharedWords::new(RLOCK_KIND)?), 1),
        })
    }

    /// Whether this thread of this process holds the lock (at any depth); a snapshot,
    /// for assertions and `Condition`.
    ///
    /// ```
    /// let lock = multiproc::RLock::new()?;
    /// let outer = lock.lock()?;
    /// let inner = lock.lock()?;
    /// std::thread::scope(|s| {
    ///     s.spawn(|| assert!(!lock.is_owned_by_current_thread()));
    /// });
    /// drop(inner);
    /// assert!(lock.is_owned_by_current_thread(), "one level is still held");
    /// drop(outer);
    /// assert!(!lock.is_owned_by_current_thread());
    /// # Ok::<(), multiproc::Error>(())
    /// ```
    pub fn is_owned_by_current_thread(&self) -> bool {
        self.held_by_me()
    }

    fn held_by_me(&self) -> bool {
        self.raw.is_held_by_this_process()
            && self.raw.word(THREAD).load(Ordering::Acquire) == my_tid()
    }

    /// Acquires the lock (again, if this thread holds it), waiting as long as it takes.
    ///
    /// # Errors
    /// [`Error::OwnerDied`] as for [`Lock::acquire`].
    pub fn acquire(&self) -> Result<()> {
        self.acquire_within(None)
    }

    /// Acquires the lock (again, if this thread holds it), waiting at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] and [`Error::OwnerDied`] as for [`Lock::acquire_timeout`].
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<()> {
        self.acquire_within(Some(timeout))
    }

    /// Acquires the lock if it is free or held by this thread, without waiting:
    /// `Ok(false)` when another thread or process holds it.
    ///
    /// # Errors
    /// [`Error::OwnerDied`] as for [`Lock::acquire`].
    #[doc(alias = "acquire_nowait")]
    pub fn try_acquire(&self) -> Result<bool> {
        acquired_now(self.acquire_within(Some(Duration::ZERO)))
    }

    fn acquire_within(&self, timeout: Option<Duration>) -> Result<()> {
        match self.acquire_raw(deadline_after(timeout))? {
            Acquired::Yes => Ok(()),
            Acquired::TimedOut => Err(Error::timeout("an acquire of a reentrant lock", timeout)),
            Acquired::FromDeadOwner(pid) => Err(owner_died("reentrant lock", pid)),
        }
    }

    fn acquire_raw(&self, deadline: Deadline) -> Result<Acquired> {
        if self.held_by_me() {
            self.raw.word(DEPTH).fetch_add(1, Ordering::AcqRel);
            return Ok(Acquired::Yes);
        }
        let got = self.raw.acquire(deadline)?;
        if !matches!(got, Acquired::TimedOut) {
            self.raw.word(THREAD).store(my_tid(), Ordering::Release);
            self.raw.word(DEPTH).store(1, Ordering::Release);
        }
        Ok(got)
    }

    fn guard(&self) -> RLockGuard<'_> {
        RLockGuard {
            lock: self,
            _one_thread: PhantomData,
        }
    }

    /// Acquires one level of the lock, waiting as long as it takes, and returns a guard
    /// that releases that level when dropped (on this thread: the guard is not `Send`).
    ///
    /// # Errors
    /// As [`Lock::lock`].
    pub fn lock(&self) -> std::result::Result<RLockGuard<'_>, LockError<RLockGuard<'_>>> {
        let got = self.acquire_raw(None);
        expect_guard(
            guarded(got, "reentrant lock", OnTimeout::Fail(None), || {
                self.guard()
            }),
            "reentrant lock",
        )
    }

    /// Acquires one level if the lock is free or held by this thread: `Ok(None)` when
    /// another thread or process holds it.
    ///
    /// # Errors
    /// As [`Lock::lock`].
    pub fn try_lock(
        &self,
    ) -> std::result::Result<Option<RLockGuard<'_>>, LockError<RLockGuard<'_>>> {
        let got = self.acquire_raw(Some(Instant::now()));
        guarded(got, "reentrant lock", OnTimeout::Nothing, || self.guard())
    }

    /// Acquires one level, waiting at most `timeout`, and returns a guard.
    ///
    /// # Errors
    /// As [`Lock::lock_timeout`].
    pub fn lock_timeout(
        &self,
        timeout: Duration,
    ) -> std::result::Result<RLockGuard<'_>, LockError<RLockGuard<'_>>> {
        let got = self.acquire_raw(deadline_after(Some(timeout)));
        let t = OnTimeout::Fail(Some(timeout));
        expect_guard(
            guarded(got, "reentrant lock", t, || self.guard()),
            "reentrant lock",
        )
    }

    /// Releases one level of the lock.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when this thread does not hold it.
    pub fn release(&self) -> Result<()> {
        if !self.held_by_me() {
            return Err(Error::InvalidArgument(
                "release of a reentrant lock that this thread does not hold".into(),
            ));
        }
        if self.raw.word(DEPTH).fetch_sub(1, Ordering::AcqRel) == 1 {
            self.raw.word(THREAD).store(0, Ordering::Release);
            self.raw.release()?;
        }
        Ok(())
    }
}

/// Holds one level of an [`RLock`] until dropped (see [`RLock::lock`]). Not `Send`:
/// an `RLock` is released by the thread that holds it.
#[must_use = "the lock level is released when the guard is dropped"]
pub struct RLockGuard<'a> {
    lock: &'a RLock,
    _one_thread: PhantomData<*const ()>,
}

impl Drop for RLockGuard<'_> {
    fn drop(&mut self) {
        let _ = self.lock.release();
    }
}

impl fmt::Debug for RLockGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RLockGuard")
            .field("lock", self.lock)
            .finish()
    }
}

impl fmt::Debug for RLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RLock")
            .field("holder_pid", &self.raw.holder_pid())
            .finish()
    }
}

impl Serialize for RLock {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.raw.block.serialize_as("an RLock", s)
    }
}

impl<'de> Deserialize<'de> for RLock {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let block = SharedWords::deserialize_as(RLOCK_KIND, "an RLock", d)?;
        Ok(Self {
            raw: RawLock::new(Arc::new(block), 1),
        })
    }
}

/// A `try_acquire`'s answer from a zero-timeout acquire: a timeout is "not now", any
/// other error (a dead holder's lock taken over) is reported.
fn acquired_now(got: Result<()>) -> Result<bool> {
    match got {
        Ok(()) => Ok(true),
        Err(Error::Timeout { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The lock's protocol under the loom model checker, over process-local words: threads
/// stand for processes (each with a pid), and a process "dies" by setting its flag in
/// the table that the protocol's liveness check reads (as the kernel makes a dead pid's
/// `/proc` entry a zombie or gone). `.ci/run` runs them in release:
/// `cargo test --release -p multiproc --lib lock::model -- --ignored`.
#[cfg(test)]
mod model {
    use super::*;
    use crate::model_check::explore;
    use crate::sync::word::model::ModelWord;
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicU32 as LoomU32};

    /// A lock's two words, and which of the pids 1..=3 have died.
    struct Model {
        owner: ModelWord,
        waiters: ModelWord,
        dead: [AtomicBool; 4],
    }

    impl Model {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                owner: ModelWord::new(0),
                waiters: ModelWord::new(0),
                dead: std::array::from_fn(|_| AtomicBool::new(false)),
            })
        }

        fn acquire(&self, me: u32) -> Acquired {
            acquire(&self.owner, &self.waiters, me, None, |pid| {
                self.dead
                    .get(pid as usize)
                    .is_some_and(|d| d.load(Ordering::Acquire))
            })
            .unwrap()
        }

        fn release(&self) {
            release(&self.owner, &self.waiters).unwrap();
        }

        fn die(&self, me: u32) {
            self.dead[me as usize].store(true, Ordering::Release);
        }
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release"]
    fn two_processes_are_never_inside_at_once() {
        let runs = explore(2, || {
            let m = Model::new();
            let inside = Arc::new(LoomU32::new(0));
            let processes: Vec<_> = (1..=2)
                .map(|pid| {
                    let (m, inside) = (Arc::clone(&m), Arc::clone(&inside));
                    loom::thread::spawn(move || {
                        assert!(matches!(m.acquire(pid), Acquired::Yes));
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two inside");
                        inside.fetch_sub(1, Ordering::SeqCst);
                        m.release();
                    })
                })
                .collect();
            for p in processes {
                p.join().unwrap();
            }
            assert_eq!(m.owner.load(Ordering::SeqCst), 0, "left held");
        });
        eprintln!("lock model, 2 processes: {runs} interleavings");
        assert!(runs > 1);
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release"]
    fn a_holder_killed_inside_is_taken_over_once() {
        // Process 1 takes the lock and dies holding it; process 2 takes it (before 1,
        // or over from the dead 1) and releases it. Nobody waits forever, a takeover
        // names the dead holder, and the lock is taken over at most once. (A third
        // process made loom's paths too long: in the model a liveness slice is a
        // yield, so a waiter's turns are steps to explore.)
        let runs = explore(2, || {
            let m = Model::new();
            let killed = {
                let m = Arc::clone(&m);
                loom::thread::spawn(move || {
                    assert!(matches!(m.acquire(1), Acquired::Yes));
                    m.die(1);
                })
            };
            let others: Vec<_> = (2..=2)
                .map(|pid| {
                    let m = Arc::clone(&m);
                    loom::thread::spawn(move || {
                        let got = m.acquire(pid);
                        m.release();
                        match got {
                            Acquired::Yes => 0,
                            Acquired::FromDeadOwner(dead) => {
                                assert_eq!(dead, 1, "took over from a live process");
                                1
                            }
                            Acquired::TimedOut => panic!("timed out without a deadline"),
                        }
                    })
                })
                .collect();
            killed.join().unwrap();
            let takeovers: u32 = others.into_iter().map(|p| p.join().unwrap()).sum();
            let owner = m.owner.load(Ordering::SeqCst);
            // Either someone took it over from the dead holder (and released it), or
            // the dead process took it last and still holds it: never both, never twice.
            assert!(
                (takeovers == 1 && owner == 0) || (takeovers == 0 && owner == 1),
                "takeovers {takeovers}, owner {owner}"
            );
        });
        eprintln!("lock model, a holder killed inside and another process: {runs} interleavings");
        assert!(runs > 1);
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release"]
    fn a_waiter_killed_after_counting_itself_holds_nobody_up() {
        // Process 3 counts itself a waiter and dies there (its count never taken back):
        // the holder's release and the next acquirer carry on.
        let runs = explore(2, || {
            let m = Model::new();
            assert!(matches!(m.acquire(1), Acquired::Yes));
            let killed = {
                let m = Arc::clone(&m);
                loom::thread::spawn(move || {
                    m.waiters.fetch_add(1, Ordering::AcqRel);
                    m.die(3);
                })
            };
            let next = {
                let m = Arc::clone(&m);
                loom::thread::spawn(move || {
                    assert!(matches!(m.acquire(2), Acquired::Yes));
                    m.release();
                })
            };
            m.release();
            killed.join().unwrap();
            next.join().unwrap();
            assert_eq!(m.owner.load(Ordering::SeqCst), 0);
        });
        eprintln!("lock model, a waiter killed after counting itself: {runs} interleavings");
        assert!(runs > 1);
    }
}
