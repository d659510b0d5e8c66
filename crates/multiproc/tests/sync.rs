//! Process-shared synchronisation across real processes: locks, barriers, semaphores,
//! conditions and events, their guards and the timeout convention, a holder that died.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use multiproc::{
    Barrier, Condition, Error, Event, Lock, Process, RLock, Semaphore, SimpleQueue, StartMethod,
    Value, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(60);
const WAIT: Duration = Duration::from_secs(30);

fn increment(_rank: usize, (lock, counter): (Lock, Value<u64>)) {
    for _ in 0..10_000 {
        let _held = lock.lock().expect("lock");
        // A read-modify-write in two steps: only mutual exclusion keeps it exact.
        let v = counter.get();
        counter.set(v + 1);
    }
}

#[test]
fn lock_excludes_four_processes() {
    common::run(DEADLINE, || {
        let lock = Lock::new().unwrap();
        let counter = Value::new(0u64).unwrap();
        let mut ctx =
            start_processes(increment, (lock, counter.clone()), 4, StartMethod::Spawn).unwrap();
        ctx.join_timeout(Duration::from_secs(50)).unwrap();
        assert_eq!(counter.get(), 40_000);
    });
}

/// Ranks 1..4 say they are at the barrier (`at`), then wait there; rank 0 arrives last,
/// only once all three are blocked, and first checks for a bounded time that none of them
/// got through (`passed` is set by whoever passes: it must not be, before rank 0 waits).
fn wait_at_barrier(
    rank: usize,
    (barrier, at, arrived, passed): (Barrier, SimpleQueue<usize>, Value<u32>, Event),
) {
    if rank == 0 {
        for _ in 1..4 {
            at.get().expect("a party at the barrier");
        }
        // All three are in (or about to enter) their wait. A barrier that let them through
        // early would set `passed` at once; 300 ms of nothing is the bounded look.
        let early = passed.wait_timeout(Duration::from_millis(300));
        assert!(
            early.as_ref().is_err_and(Error::is_timeout),
            "a party passed the barrier before all arrived: {early:?}"
        );
    }
    arrived.update(|n| n + 1).expect("update");
    if rank != 0 {
        at.put(rank).expect("put");
    }
    barrier
        .wait_timeout(Duration::from_secs(30))
        .expect("barrier");
    assert_eq!(
        arrived.get(),
        4,
        "passed the barrier with {} of 4 arrived",
        arrived.get()
    );
    passed.set();
}

#[test]
fn barrier_of_four_lets_nobody_through_before_the_last_arrives() {
    common::run(DEADLINE, || {
        let barrier = Barrier::new(4).unwrap();
        let at = SimpleQueue::new().unwrap();
        let arrived = Value::new(0u32).unwrap();
        let passed = Event::new().unwrap();
        let args = (barrier, at, arrived.clone(), passed.clone());
        let mut ctx = start_processes(wait_at_barrier, args, 4, StartMethod::Spawn).unwrap();
        ctx.join_timeout(Duration::from_secs(50)).unwrap();
        assert_eq!(arrived.get(), 4);
        assert!(passed.is_set());
    });
}

/// The first entry is held open until the parent, having seen two workers inside at
/// once, sets `go`: the semaphore must admit two (and the 20 rounds after it never more).
fn bounded_work(
    rank: usize,
    (sem, inside, most, entered, go): (
        Semaphore,
        Value<u32>,
        Value<u32>,
        SimpleQueue<usize>,
        Event,
    ),
) {
    sem.acquire_timeout(Duration::from_secs(30))
        .expect("acquire");
    let now = inside.update(|n| n + 1).expect("update");
    most.update(|m| m.max(now)).expect("update");
    entered.put(rank).expect("put");
    go.wait_timeout(Duration::from_secs(30))
        .expect("go never came");
    inside.update(|n| n - 1).expect("update");
    sem.release().expect("release");
    for _ in 0..20 {
        sem.acquire_timeout(Duration::from_secs(30))
            .expect("acquire");
        let now = inside.update(|n| n + 1).expect("update");
        most.update(|m| m.max(now)).expect("update");
        // A little work inside (not a synchronisation): time for others to try.
        std::thread::sleep(Duration::from_millis(2));
        inside.update(|n| n - 1).expect("update");
        sem.release().expect("release");
    }
}

#[test]
fn semaphore_bounds_concurrency() {
    common::run(DEADLINE, || {
        let sem = Semaphore::new(2).unwrap();
        let inside = Value::new(0u32).unwrap();
        let most = Value::new(0u32).unwrap();
        let entered = SimpleQueue::new().unwrap();
        let go = Event::new().unwrap();
        let args = (
            sem,
            inside.clone(),
            most.clone(),
            entered.clone(),
            go.clone(),
        );
        let mut ctx = start_processes(bounded_work, args, 5, StartMethod::Spawn).unwrap();
        // Two workers are inside at once (each waits for `go` before leaving).
        let first: Vec<usize> = (0..2).map(|_| entered.get().unwrap()).collect();
        assert_eq!(
            inside.get(),
            2,
            "workers {first:?} entered, but {} are inside",
            inside.get()
        );
        go.set();
        for _ in 2..5 {
            entered.get().unwrap();
        }
        ctx.join_timeout(Duration::from_secs(50)).unwrap();
        assert_eq!(
            most.get(),
            2,
            "a semaphore of 2 must admit exactly 2 at once, saw {}",
            most.get()
        );
    });
}

fn take_lock_and_die(_rank: usize, (lock, taken): (Lock, multiproc::Event)) {
    let _held = lock.lock().expect("lock");
    taken.set();
    // A holder that never lets go on its own: the test SIGKILLs it long before this ends.
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_lock_holder_killed_while_holding_is_reported() {
    common::run(DEADLINE, || {
        let lock = Lock::new().unwrap();
        let taken = multiproc::Event::new().unwrap();
        let mut ctx = start_processes(
            take_lock_and_die,
            (lock.clone(), taken.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        taken.wait_timeout(Duration::from_secs(30)).unwrap();
        let holder = ctx.pids()[0];
        assert!(
            lock.acquire_timeout(Duration::from_millis(50))
                .unwrap_err()
                .is_timeout(),
            "the holder is alive"
        );
        let status = std::process::Command::new("kill")
            .args(["-KILL", &holder.to_string()])
            .status();
        assert!(status.unwrap().success());
        let start = Instant::now();
        let err = lock.acquire_timeout(Duration::from_secs(20)).unwrap_err();
        assert!(
            matches!(err, Error::OwnerDied { pid, .. } if pid == holder),
            "{err}"
        );
        assert!(err.to_string().contains(&holder.to_string()), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(
            lock.is_owned_by_current_thread(),
            "taken over from the dead holder: this thread's"
        );
        lock.release().unwrap();
        assert!(!lock.is_owned_by_current_thread());
        let err = ctx.join_timeout(Duration::from_secs(20)).unwrap_err();
        assert!(matches!(err, Error::ProcessExited { .. }), "{err}");
    });
}

type Ownership = (Lock, RLock, Value<u32>, [Event; 4]);

/// Bits of what a worker saw: its parent's locks as not its own (0, 1) but held (2, 3),
/// then, once it took them, as its own (4, 5).
fn check_ownership(_rank: usize, (lock, rlock, seen, [reported, go, held, done]): Ownership) {
    let bit = |b: bool, at: u32| u32::from(b) << at;
    seen.set(
        bit(lock.is_owned_by_current_thread(), 0)
            | bit(rlock.is_owned_by_current_thread(), 1)
            | bit(lock.is_locked(), 2)
            | bit(rlock.acquire_timeout(Duration::ZERO).is_err(), 3),
    );
    reported.set();
    go.wait_timeout(Duration::from_secs(30)).expect("go");
    let _l = lock.lock().expect("lock");
    let _r = rlock.lock().expect("rlock");
    seen.update(|v| {
        v | bit(lock.is_owned_by_current_thread(), 4) | bit(rlock.is_owned_by_current_thread(), 5)
    })
    .expect("update");
    held.set();
    done.wait_timeout(Duration::from_secs(30)).expect("done");
}

#[test]
fn is_owned_by_current_thread_tells_this_thread_from_other_threads_and_processes() {
    common::run(DEADLINE, || {
        for method in [StartMethod::Fork, StartMethod::Spawn] {
            let (lock, rlock) = (Lock::new().unwrap(), RLock::new().unwrap());
            assert!(!lock.is_owned_by_current_thread() && !rlock.is_owned_by_current_thread());
            lock.acquire().unwrap();
            rlock.acquire().unwrap();
            rlock.acquire().unwrap();
            assert!(lock.is_owned_by_current_thread() && rlock.is_owned_by_current_thread());
            std::thread::scope(|s| {
                s.spawn(|| {
                    assert!(lock.is_locked() && !lock.is_owned_by_current_thread());
                    assert!(!rlock.is_owned_by_current_thread());
                    assert!(rlock.try_lock().unwrap().is_none(), "another thread's");
                });
            });
            let seen = Value::new(0u32).unwrap();
            let events: [Event; 4] = std::array::from_fn(|_| Event::new().unwrap());
            let [reported, go, held, done] = events.clone();
            let args = (lock.clone(), rlock.clone(), seen.clone(), events);
            let mut ctx = start_processes(check_ownership, args, 1, method).unwrap();
            reported.wait_timeout(Duration::from_secs(30)).unwrap();
            assert_eq!(seen.get(), 0b1100, "{method:?}: the parent's locks, held");
            lock.release().unwrap();
            rlock.release().unwrap();
            assert!(rlock.is_owned_by_current_thread(), "one level left");
            rlock.release().unwrap();
            assert!(!lock.is_owned_by_current_thread() && !rlock.is_owned_by_current_thread());
            go.set();
            held.wait_timeout(Duration::from_secs(30)).unwrap();
            assert_eq!(
                seen.get(),
                0b11_1100,
                "{method:?}: the child's own, once taken"
            );
            assert!(lock.is_locked() && !lock.is_owned_by_current_thread());
            assert!(!rlock.is_owned_by_current_thread());
            done.set();
            ctx.join_timeout(Duration::from_secs(30)).unwrap();
            assert!(!lock.is_locked());
        }
    });
}

// ----- the timeout convention and the guards, across processes -----

fn hold_lock_until(_rank: usize, (lock, held, release): (Lock, Event, Event)) {
    let _guard = lock.lock().expect("lock");
    held.set();
    release.wait_timeout(WAIT).expect("release");
}

#[test]
fn lock_guards_and_timeouts_against_another_process() {
    common::run(DEADLINE, || {
        let (lock, held, release) = (
            Lock::new().unwrap(),
            Event::new().unwrap(),
            Event::new().unwrap(),
        );
        let mut ctx = start_processes(
            hold_lock_until,
            (lock.clone(), held.clone(), release.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        held.wait_timeout(WAIT).unwrap();
        assert!(lock.try_lock().unwrap().is_none(), "held by the worker");
        let start = Instant::now();
        let err = lock.lock_timeout(Duration::from_millis(50)).unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert!(err.guard.is_none());
        assert!(
            matches!(&err.error, Error::Timeout { after: Some(t), .. } if *t == Duration::from_millis(50)),
            "{err}"
        );
        let err = lock.acquire_timeout(Duration::ZERO).unwrap_err();
        assert!(err.is_timeout(), "{err}");
        release.set();
        {
            let _mine = lock
                .lock_timeout(WAIT)
                .expect("the worker's guard released it");
            assert!(lock.is_locked());
        }
        assert!(!lock.is_locked(), "dropping the guard released it");
        ctx.join_timeout(WAIT).unwrap();
    });
}

fn lock_and_hang(_rank: usize, (lock, held): (Lock, Event)) {
    let _guard = lock.lock().expect("lock");
    held.set();
    // A holder that never lets go on its own: the test kills it.
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_guard_after_owner_died_holds_the_lock_and_releases_it() {
    common::run(DEADLINE, || {
        let (lock, held) = (Lock::new().unwrap(), Event::new().unwrap());
        let mut p = Process::builder(lock_and_hang, 0, (lock.clone(), held.clone()))
            .daemon(true)
            .start()
            .unwrap();
        held.wait_timeout(WAIT).unwrap();
        let dead = p.pid();
        p.kill().unwrap();
        p.join_timeout(WAIT).unwrap();
        let err = lock.lock().unwrap_err();
        assert!(
            matches!(&err.error, Error::OwnerDied { pid, .. } if *pid == dead),
            "{err}"
        );
        let guard = err.into_guard().expect("the lock is ours after OwnerDied");
        assert!(lock.is_locked());
        drop(guard);
        assert!(!lock.is_locked(), "the recovered guard releases the lock");
        let clean = lock.try_lock().unwrap().expect("a clean lock again");
        drop(clean);
    });
}

fn take_permit(_rank: usize, (sem, took, release): (Semaphore, Event, Event)) {
    let _permit = sem.permit().expect("permit");
    took.set();
    release.wait_timeout(WAIT).expect("release");
}

#[test]
fn semaphore_permits_across_processes() {
    common::run(DEADLINE, || {
        let (sem, took, release) = (
            Semaphore::new(1).unwrap(),
            Event::new().unwrap(),
            Event::new().unwrap(),
        );
        let mut ctx = start_processes(
            take_permit,
            (sem.clone(), took.clone(), release.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        took.wait_timeout(WAIT).unwrap();
        assert!(sem.try_permit().unwrap().is_none());
        assert!(
            sem.permit_timeout(Duration::from_millis(20))
                .unwrap_err()
                .is_timeout()
        );
        release.set();
        let permit = sem.permit_timeout(WAIT).expect("the worker gave it back");
        assert_eq!(sem.value(), 0);
        drop(permit);
        assert_eq!(sem.value(), 1);
        ctx.join_timeout(WAIT).unwrap();
    });
}

fn set_and_notify(_rank: usize, (cond, flag): (Condition, Value<u32>)) {
    let guard = cond.lock().expect("lock");
    flag.set(42);
    guard.notify_all();
}

#[test]
fn condition_guard_waits_for_another_process() {
    common::run(DEADLINE, || {
        let (cond, flag) = (Condition::new().unwrap(), Value::new(0u32).unwrap());
        let mut guard = cond.lock().unwrap();
        let err = guard
            .wait_for_timeout(|| flag.get() == 42, Duration::from_millis(20))
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        let mut ctx = start_processes(
            set_and_notify,
            (cond.clone(), flag.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        guard.wait_for_timeout(|| flag.get() == 42, WAIT).unwrap();
        drop(guard);
        ctx.join_timeout(WAIT).unwrap();
    });
}

/// Waits for the word to go, then sets the event and says so on the queue.
fn answer_late(_rank: usize, (go, event, said): (SimpleQueue<u8>, Event, SimpleQueue<u8>)) {
    go.get().expect("the word to go");
    event.set();
    said.put(7).expect("put");
}

#[test]
fn a_timeout_too_long_for_the_clock_waits_without_a_deadline() {
    common::run(DEADLINE, || {
        let (go, event, said) = (
            SimpleQueue::new().unwrap(),
            Event::new().unwrap(),
            SimpleQueue::new().unwrap(),
        );
        let mut ctx = start_processes(
            answer_late,
            (go.clone(), event.clone(), said.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        go.put(1).unwrap();
        // Neither is ready when the wait starts, or may not be: each waits, then returns.
        event.wait_timeout(Duration::MAX).unwrap();
        assert_eq!(said.get_timeout(Duration::MAX).unwrap(), 7);
        ctx.join_timeout(Duration::MAX).unwrap();
        let lock = Lock::new().unwrap();
        lock.acquire_timeout(Duration::MAX).unwrap();
        lock.release().unwrap();
        drop(lock.lock_timeout(Duration::from_secs(u64::MAX)).unwrap());
        let sem = Semaphore::new(1).unwrap();
        sem.acquire_timeout(Duration::MAX).unwrap();
        let rlock = RLock::new().unwrap();
        rlock.acquire_timeout(Duration::MAX).unwrap();
        rlock.release().unwrap();
    });
}

fn update_once(_rank: usize, counter: Value<u64>) {
    counter.update(|n| n + 1).expect("update");
}

#[test]
fn a_panic_inside_value_update_releases_the_lock() {
    common::run(DEADLINE, || {
        let counter = Value::new(5u64).unwrap();
        let caught = std::panic::catch_unwind(|| {
            counter
                .update(|_| panic!("the update's closure panics"))
                .ok();
        });
        assert!(caught.is_err());
        assert!(
            !counter.get_lock().is_locked(),
            "the lock outlived the panic"
        );
        assert_eq!(counter.get(), 5, "a panicking update stores nothing");
        // Another process updates as usual: it is not left waiting.
        let mut ctx = start_processes(update_once, counter.clone(), 1, StartMethod::Spawn).unwrap();
        ctx.join_timeout(WAIT).unwrap();
        assert_eq!(counter.get(), 6);
    });
}
