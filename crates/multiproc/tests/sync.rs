//! Process-shared synchronisation across real processes.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use multiproc::{
    Barrier, Error, Event, Lock, RLock, Semaphore, SimpleQueue, StartMethod, Value, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(60);

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

fn wait_at_barrier(rank: usize, (barrier, arrived, passed): (Barrier, Value<u32>, Value<u32>)) {
    arrived.update(|n| n + 1).expect("update");
    if rank == 0 {
        // Arrive late: nobody may pass before this party has arrived.
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            passed.get(),
            0,
            "a party passed the barrier before all arrived"
        );
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
    passed.update(|n| n + 1).expect("update");
}

#[test]
fn barrier_of_four() {
    common::run(DEADLINE, || {
        let barrier = Barrier::new(4).unwrap();
        let arrived = Value::new(0u32).unwrap();
        let passed = Value::new(0u32).unwrap();
        let args = (barrier, arrived, passed.clone());
        let mut ctx = start_processes(wait_at_barrier, args, 4, StartMethod::Spawn).unwrap();
        ctx.join_timeout(Duration::from_secs(50)).unwrap();
        assert_eq!(passed.get(), 4);
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
    std::thread::sleep(Duration::from_secs(60)); // killed long before this ends
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
