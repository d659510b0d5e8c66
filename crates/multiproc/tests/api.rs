//! The Rust-idiom and Python-familiar API across real processes: the timeout
//! convention, guards, `try_put`/iterators, `connection::wait`, `current_process`,
//! `active_children`, the pool's other call forms, and errors that cross a queue.

multiproc::test_init!();

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use multiproc::{
    Condition, Error, Event, Lock, Pool, Process, Queue, Semaphore, SimpleQueue, StartMethod,
    Value, pipe, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(30);

// ----- identity: current_process, Process::name, active_children, cpu_count -----

fn report_identity(_rank: usize, out: SimpleQueue<(Option<usize>, u32, String)>) {
    let me = multiproc::current_process();
    out.put((me.rank, me.pid, me.name)).expect("put");
}

#[test]
fn a_worker_knows_its_rank_pid_and_name() {
    common::run(DEADLINE, || {
        let out = SimpleQueue::new().unwrap();
        for method in StartMethod::ALL {
            let mut ctx = start_processes(report_identity, out.clone(), 2, method).unwrap();
            let pids = ctx.pids();
            let mut got = vec![
                out.get_timeout(WAIT).unwrap(),
                out.get_timeout(WAIT).unwrap(),
            ];
            got.sort();
            assert_eq!(
                got,
                vec![
                    (Some(0), pids[0], "Process-0".to_string()),
                    (Some(1), pids[1], "Process-1".to_string()),
                ],
                "{method}"
            );
            ctx.join_timeout(WAIT).unwrap();

            let mut p = Process::new(report_identity, 7, out.clone())
                .with_name("loader")
                .start_method(method);
            assert_eq!(p.name(), "loader");
            p.start().unwrap();
            let (rank, pid, name) = out.get_timeout(WAIT).unwrap();
            assert_eq!(
                (rank, Some(pid), name.as_str()),
                (Some(7), p.pid(), "loader")
            );
            assert!(p.join_timeout(WAIT).unwrap().success());
        }
        let me = multiproc::current_process();
        assert_eq!((me.rank, me.name.as_str()), (None, "MainProcess"));
    });
}

fn wait_for_go(_rank: usize, go: Event) -> multiproc::Result<()> {
    go.wait_timeout(WAIT)
}

#[test]
fn active_children_lists_running_workers_only() {
    common::run(DEADLINE, || {
        assert!(multiproc::active_children().is_empty());
        let go = Event::new().unwrap();
        let mut p = Process::new(wait_for_go, 3, go.clone()).with_name("sleeper");
        p.start().unwrap();
        let kids = multiproc::active_children();
        assert_eq!(kids.len(), 1, "{kids:?}");
        assert_eq!(
            (kids[0].rank, Some(kids[0].pid), kids[0].name.as_str()),
            (3, p.pid(), "sleeper")
        );
        go.set();
        assert!(p.join_timeout(WAIT).unwrap().success());
        assert!(
            multiproc::active_children().is_empty(),
            "a joined worker is not active"
        );
        let n = multiproc::cpu_count();
        assert!(n >= 1);
        assert_eq!(n, std::thread::available_parallelism().unwrap().get());
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
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_guard_after_owner_died_holds_the_lock_and_releases_it() {
    common::run(DEADLINE, || {
        let (lock, held) = (Lock::new().unwrap(), Event::new().unwrap());
        let mut p = Process::new(lock_and_hang, 0, (lock.clone(), held.clone())).daemon(true);
        p.start().unwrap();
        held.wait_timeout(WAIT).unwrap();
        let dead = p.pid().unwrap();
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

// ----- queues: try_put, iter, len/capacity; pipes: wait on several -----

fn fill_then_try(
    _rank: usize,
    (q, out): (Queue<u32>, SimpleQueue<String>),
) -> multiproc::Result<()> {
    q.put(1).map_err(Error::from)?;
    q.put(2).map_err(Error::from)?;
    let back = q.try_put(3).unwrap_err();
    out.put(format!("{:?} {}", back.error.is_timeout(), back.error))
        .map_err(Error::from)?;
    assert_eq!(back.into_inner(), 3);
    q.try_put(4).map_err(|e| e.error).unwrap_err();
    Ok(())
}

#[test]
fn try_put_on_a_full_queue_hands_the_item_back_and_iter_drains() {
    common::run(DEADLINE, || {
        let q = Queue::with_capacity(2).unwrap();
        let out = SimpleQueue::new().unwrap();
        assert_eq!(q.capacity(), Some(2));
        assert_eq!(Queue::<u8>::new().unwrap().capacity(), None);
        let mut ctx = start_processes(
            fill_then_try,
            (q.clone(), out.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        let said = out.get_timeout(WAIT).unwrap();
        assert!(
            said.starts_with("false no room in a full queue (capacity 2)"),
            "{said}"
        );
        ctx.join_timeout(WAIT).unwrap();
        assert_eq!((q.len(), q.is_empty()), (2, false));
        let got: Vec<u32> = q.try_iter().collect::<multiproc::Result<_>>().unwrap();
        assert_eq!(got, [1, 2]);
        assert!(q.is_empty());
        let _producer = q.clone();
        assert_eq!(q.try_get().unwrap(), None, "empty is not a timeout");
    });
}

fn produce(_rank: usize, q: Queue<u64>) -> multiproc::Result<()> {
    for i in 0..100 {
        q.put(i).map_err(Error::from)?;
    }
    Ok(())
}

#[test]
fn iter_takes_from_another_process_and_ends_on_close() {
    common::run(DEADLINE, || {
        let q = Queue::new().unwrap();
        let mut ctx = start_processes(produce, q.clone(), 1, StartMethod::Spawn).unwrap();
        let got: Vec<u64> = q
            .iter()
            .take(100)
            .collect::<multiproc::Result<_>>()
            .unwrap();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
        ctx.join_timeout(WAIT).unwrap();
        q.close();
        assert!(
            q.iter().next().is_none(),
            "a closed handle ends the iterator"
        );
    });
}

fn answer_on_second(
    _rank: usize,
    (first, second): (multiproc::Connection<u8>, multiproc::Connection<String>),
) -> multiproc::Result<()> {
    second.send("second".into()).map_err(Error::from)?;
    // Keep `first` open until the parent has waited, so its readiness is not a hang-up.
    first.recv()?;
    Ok(())
}

#[test]
fn connection_wait_reports_which_pipe_is_ready() {
    common::run(DEADLINE, || {
        let (a_here, a_there) = pipe::<u8>().unwrap();
        let (b_here, b_there) = pipe::<String>().unwrap();
        let err = multiproc::connection::wait(
            &[&a_here as &dyn AsFd, &b_here],
            Some(Duration::from_millis(20)),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        let mut ctx =
            start_processes(answer_on_second, (a_there, b_there), 1, StartMethod::Spawn).unwrap();
        let ready =
            multiproc::connection::wait(&[&a_here as &dyn AsFd, &b_here], Some(WAIT)).unwrap();
        assert_eq!(ready, [1]);
        assert_eq!(b_here.recv_timeout(WAIT).unwrap(), "second");
        a_here.send(0).unwrap();
        ctx.join_timeout(WAIT).unwrap();
    });
}

#[test]
fn connection_wait_on_a_process_sentinel_and_a_pipe() {
    common::run(DEADLINE, || {
        let go = Event::new().unwrap();
        let (here, _there) = pipe::<u8>().unwrap();
        let mut p = Process::new(wait_for_go, 0, go.clone());
        assert!(p.sentinel().is_none(), "no sentinel before start");
        p.start().unwrap();
        let sentinel = p.sentinel().unwrap();
        let err = multiproc::connection::wait(
            &[&sentinel as &dyn AsFd, &here],
            Some(Duration::from_millis(20)),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "the worker still waits: {err}");
        go.set();
        let ready =
            multiproc::connection::wait(&[&sentinel as &dyn AsFd, &here], Some(WAIT)).unwrap();
        assert_eq!(ready, [0], "the sentinel is ready once the worker exits");
        assert!(p.join_timeout(WAIT).unwrap().success());
    });
}

// ----- the pool's other call forms -----

fn power(base: u64, exp: u32) -> Result<u64, String> {
    base.checked_pow(exp)
        .ok_or_else(|| format!("{base}^{exp} overflows"))
}

fn square(x: u64) -> Result<u64, String> {
    Ok(x * x)
}

fn slow_square(x: u64) -> Result<u64, String> {
    std::thread::sleep(Duration::from_millis(300));
    Ok(x * x)
}

static GREETING: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

fn remember(greeting: (String, u32)) {
    *GREETING.lock().unwrap() = format!("{} x{}", greeting.0, greeting.1);
}

fn greeting_and_name(_: ()) -> Result<(String, String), String> {
    Ok((
        GREETING.lock().unwrap().clone(),
        multiproc::current_process().name,
    ))
}

#[test]
fn starmap_apply_map_async_and_initializer_arguments() {
    common::run(DEADLINE, || {
        let pool = Pool::builder()
            .processes(2)
            .initializer_with(remember, ("hello".to_string(), 3))
            .build()
            .unwrap();
        assert_eq!(
            pool.starmap(power, [(2, 10), (3, 3), (10, 0)]).unwrap(),
            vec![1024, 27, 1]
        );
        let err = pool.starmap(power, [(2, 1), (2, 64)]).unwrap_err();
        assert!(
            matches!(&err, Error::TaskFailed { index: 1, message } if message.contains("2^64 overflows")),
            "{err}"
        );
        assert_eq!(pool.apply(square, 12).unwrap(), 144);
        let (greeting, name) = pool.apply(greeting_and_name, ()).unwrap();
        assert_eq!(
            greeting, "hello x3",
            "the initializer ran with its argument"
        );
        assert!(name.starts_with("PoolWorker-"), "{name}");

        let mut pending = pool.map_async(slow_square, 0..4u64).unwrap();
        let err = pending.get_timeout(Duration::from_millis(10)).unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert_eq!(pending.get_timeout(WAIT).unwrap(), vec![0, 1, 4, 9]);
        let mut quick = pool.map_async(square, 0..50u64).unwrap();
        assert_eq!(
            quick.get().unwrap(),
            (0..50).map(|x| x * x).collect::<Vec<_>>()
        );
        assert!(quick.ready());
        assert!(matches!(quick.get(), Err(Error::InvalidArgument(_))));
    });
}

#[test]
fn pool_join_times_out_while_a_task_runs_then_joins() {
    common::run(DEADLINE, || {
        let mut pool = Pool::new(1).unwrap();
        let mut running = pool.apply_async(slow_square, 3).unwrap();
        pool.close();
        let err = pool.join_timeout(Duration::from_millis(10)).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { after: Some(t), .. } if *t == Duration::from_millis(10)),
            "{err}"
        );
        pool.join_timeout(WAIT).unwrap();
        assert_eq!(
            running.get_timeout(WAIT).unwrap(),
            9,
            "a closed pool finishes its tasks"
        );
    });
}

// ----- errors that cross processes -----

#[derive(Debug)]
struct ModelError(u32);

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layer {} has no weights", self.0)
    }
}

impl std::error::Error for ModelError {}

fn load(layer: u32) -> multiproc::Result<()> {
    Err(Error::user(ModelError(layer)))
}

fn send_errors(_rank: usize, out: SimpleQueue<Error>) -> multiproc::Result<()> {
    let io = std::fs::File::open("/nonexistent/multiproc").unwrap_err();
    out.put(Error::from(io)).map_err(Error::from)?;
    out.put(load(3).unwrap_err()).map_err(Error::from)?;
    load(4)
}

#[test]
fn user_and_os_errors_cross_a_queue_and_a_worker_returns_its_own() {
    common::run(DEADLINE, || {
        let out = SimpleQueue::new().unwrap();
        let mut ctx = start_processes(send_errors, out.clone(), 1, StartMethod::Spawn).unwrap();
        let os = out.get_timeout(WAIT).unwrap();
        assert_eq!(os.errno(), Some(libc::ENOENT));
        let source = std::error::Error::source(&os).expect("an Os error has a source");
        assert!(source.to_string().contains("No such file"), "{source}");
        let Error::Os { source, .. } = &os else {
            panic!("{os:?}")
        };
        assert_eq!(source.io_error().kind(), std::io::ErrorKind::NotFound);
        let user = out.get_timeout(WAIT).unwrap();
        assert!(matches!(user, Error::User(_)), "{user:?}");
        assert_eq!(user.to_string(), "layer 3 has no weights");
        let err = ctx.join_timeout(WAIT).unwrap_err();
        assert!(
            matches!(&err, Error::ProcessRaised { message, .. } if message.contains("layer 4 has no weights")),
            "{err}"
        );
        // In this process the user's error keeps its type.
        let here = load(5).unwrap_err();
        let Error::User(inner) = &here else { panic!() };
        assert_eq!(
            inner.get_ref().downcast_ref::<ModelError>().map(|e| e.0),
            Some(5)
        );
    });
}

// ----- renamed traits: the old names still compile (deprecated) -----

/// A worker returning `Result`, for a bound written with the old trait name.
fn ok_worker(_rank: usize, _: ()) -> Result<(), String> {
    Ok(())
}

#[test]
#[allow(deprecated)]
fn renamed_traits_keep_their_old_names_as_bounds() {
    fn hold<T: multiproc::SharedValue>(v: T) -> multiproc::Result<Value<T>> {
        Value::new(v)
    }
    fn start<R: multiproc::WorkerResult>(f: fn(usize, ()) -> R) -> multiproc::Result<()> {
        multiproc::spawn(f, (), 1)
    }
    common::run(DEADLINE, || {
        let v = hold(7u32).expect("value");
        v.set(8);
        assert_eq!(v.get(), 8);
        start(ok_worker).expect("a worker bounded by the old name");
    });
}
