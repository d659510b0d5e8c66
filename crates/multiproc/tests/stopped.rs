//! Stopped peers never cost a message or a deadline: a process stopped (SIGSTOP: a
//! debugger, Ctrl-Z, a frozen container) anywhere inside a `put` or a `get` — with a
//! slot of the queue's ring claimed, with a record copied out and not yet taken, or
//! holding the lock of the queue's block custody — loses nobody's message, a `get`
//! without a deadline never returns early, and when the stopped process resumes,
//! everything carries on (nothing lost, nothing taken twice). The ring is lock-free and
//! the custody has two shelves with a lock each, of which a process holds one at most,
//! so the others do not even wait for it.

multiproc::test_init!();

mod common;

use common::stopping::{continue_process, is_stopped, stop_inside_the_custody_lock};

use std::time::{Duration, Instant};

use multiproc::{DType, Event, Process, Queue, SimpleQueue, StartMethod, Tensor, start_processes};

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(30);

/// Puts `count` fresh tensors (their blocks go into the queue's custody, where a
/// receiver that does not map them yet must look them up) and exits.
fn put_tensors(rank: usize, (q, count): (Queue<Tensor>, usize)) -> multiproc::Result<()> {
    for i in 0..count {
        q.put(Tensor::full(
            &[1 << 16],
            (rank * 10 + i) as f64,
            DType::F32,
        )?)?;
    }
    Ok(())
}

/// A process stopped while it holds the lock of either shelf of the custody costs the
/// others nothing: gets that must look their blocks up in the custody all return while
/// it is still stopped (they look on the other shelf), and nothing is lost.
fn a_stopped_custody_holder_holds_nobody_up(shelf: usize) {
    common::run(DEADLINE, move || {
        let q = Queue::<Tensor>::new().unwrap();
        let holding = Event::new().unwrap();
        let mut holder = Process::builder(
            stop_inside_the_custody_lock,
            0,
            (q.clone(), shelf, holding.clone()),
        )
        .start()
        .unwrap();
        holding.wait_timeout(WAIT).unwrap();
        let mut producers =
            start_processes(put_tensors, (q.clone(), 3), 1, StartMethod::Spawn).unwrap();
        producers.join_timeout(WAIT).unwrap();
        // The parent maps none of the producer's blocks: each get looks one up in the
        // custody, one of whose shelves the stopped process holds.
        let (got_tx, got_rx) = std::sync::mpsc::channel();
        let getter = {
            let q = q.clone();
            std::thread::spawn(move || {
                for _ in 0..3 {
                    let got = q.get().map(|t| t.sum().unwrap());
                    let failed = got.is_err();
                    got_tx.send(got).unwrap();
                    if failed {
                        return;
                    }
                }
            })
        };
        let got: Vec<_> = (0..3).map(|_| got_rx.recv_timeout(WAIT)).collect();
        let pid = holder.pid();
        let still_stopped = is_stopped(pid);
        // Continued before anything is judged, so that a failure leaves no stopped
        // process behind.
        continue_process(&holder);
        let mut sums: Vec<f64> = got
            .into_iter()
            .map(|g| {
                g.expect("a get waited for the stopped custody holder")
                    .expect("nothing lost")
            })
            .collect();
        assert!(
            still_stopped,
            "the holder was continued before the gets returned: they may have waited for it"
        );
        sums.sort_by(f64::total_cmp);
        assert_eq!(sums, [0.0, 65536.0, 131072.0]);
        getter.join().unwrap();
        holder.join_timeout(WAIT).unwrap();
    });
}

#[test]
fn a_process_stopped_inside_the_first_custody_shelf_holds_nobody_up() {
    a_stopped_custody_holder_holds_nobody_up(0);
}

#[test]
fn a_process_stopped_inside_the_second_custody_shelf_holds_nobody_up() {
    a_stopped_custody_holder_holds_nobody_up(1);
}

/// Two processes stopped while each holds one shelf of the custody, so that a lookup
/// finds neither free: a `try_get` does not wait for them and a `get_timeout` returns
/// at its deadline (both used to wait half a second for the custody, twice for
/// `get_timeout`), the message they could not decode is kept, and once the holders
/// resume every message arrives.
#[test]
fn gets_keep_their_deadlines_while_stopped_processes_hold_both_custody_shelves() {
    common::run(DEADLINE, || {
        let q = Queue::<Tensor>::new().unwrap();
        let mut holders: Vec<Process> = (0..2)
            .map(|shelf| {
                let holding = Event::new().unwrap();
                let p = Process::builder(
                    stop_inside_the_custody_lock,
                    0,
                    (q.clone(), shelf, holding.clone()),
                )
                .start()
                .unwrap();
                holding.wait_timeout(WAIT).unwrap();
                p
            })
            .collect();
        let mut producers =
            start_processes(put_tensors, (q.clone(), 2), 1, StartMethod::Spawn).unwrap();
        producers.join_timeout(WAIT).unwrap();
        // The parent maps neither tensor's block: each must be looked up in the
        // custody, which nobody can look through now.
        let start = Instant::now();
        let tried = q.try_get().map(|t| t.is_some());
        let try_took = start.elapsed();
        let start = Instant::now();
        let timed = q
            .get_timeout(Duration::from_millis(50))
            .map(|t| t.sum().unwrap());
        let timed_took = start.elapsed();
        let still_stopped = holders.iter().all(|h| is_stopped(h.pid()));
        for h in &holders {
            continue_process(h);
        }
        let mut sums: Vec<f64> = (0..2)
            .map(|_| q.get_timeout(WAIT).expect("nothing lost").sum().unwrap())
            .collect();
        for h in &mut holders {
            h.join_timeout(WAIT).unwrap();
        }
        assert!(
            still_stopped,
            "a holder was continued before the gets were judged"
        );
        assert!(
            matches!(tried, Ok(false)),
            "try_get with both shelves held: {tried:?}"
        );
        assert!(
            matches!(timed, Err(multiproc::Error::Timeout { .. })),
            "get_timeout with both shelves held: {timed:?}"
        );
        // Far below the half second a lookup used to wait, and far above what these
        // calls take (milliseconds), so that a busy machine does not fail it.
        let bound = Duration::from_millis(400);
        assert!(
            try_took < bound,
            "try_get waited {try_took:?} for the custody"
        );
        assert!(
            timed_took < bound,
            "get_timeout(50 ms) returned after {timed_took:?}"
        );
        sums.sort_by(f64::total_cmp);
        assert_eq!(sums, [0.0, 65536.0]);
    });
}

/// What the stopped writer puts (no producer below puts it).
const STOPPED_ITEM: u64 = u64::MAX;

/// Stops this process (SIGSTOP) until it is continued; `holding` is set first.
fn stop_here(holding: &Event) {
    holding.set();
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)
        .expect("SIGSTOP to itself");
}

/// Claims a slot of the queue's ring for [`STOPPED_ITEM`] and stops itself before it
/// writes the record; once continued, finishes the put.
fn stop_inside_a_put(
    _rank: usize,
    (q, holding): (SimpleQueue<u64>, Event),
) -> multiproc::Result<()> {
    multiproc::__testing::put_pausing_in_ring(&q, &STOPPED_ITEM, || stop_here(&holding))
}

/// Copies the first record out of the queue's ring and stops itself before it takes
/// it; once continued, finishes its get and sends what it got on `out`.
fn stop_inside_a_get(
    _rank: usize,
    (q, holding, out): (SimpleQueue<u64>, Event, SimpleQueue<u64>),
) -> multiproc::Result<()> {
    let got = multiproc::__testing::get_pausing_in_ring(&q, || stop_here(&holding))?;
    out.put(got).map_err(multiproc::Error::from)
}

/// Puts `count` numbers, `rank * 1_000_000 + i`, and exits.
fn put_numbers(rank: usize, (q, count): (SimpleQueue<u64>, u64)) -> multiproc::Result<()> {
    for i in 0..count {
        q.put(rank as u64 * 1_000_000 + i)?;
    }
    Ok(())
}

/// Gets `count` items on a thread, each within [`WAIT`]; what came (fewer when a get
/// failed or waited too long: the caller continues the stopped process first, then
/// judges).
fn get_on_a_thread(q: &SimpleQueue<u64>, count: usize) -> std::thread::JoinHandle<Vec<u64>> {
    let q = q.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..count {
            match q.get() {
                Ok(v) => tx.send(v).unwrap(),
                Err(e) => {
                    eprintln!("get failed: {e}");
                    return;
                }
            }
        }
    });
    std::thread::spawn(move || {
        let mut got = Vec::new();
        while got.len() < count {
            match rx.recv_timeout(WAIT) {
                Ok(v) => got.push(v),
                Err(_) => break,
            }
        }
        got
    })
}

/// Nothing more waits on `q` (its other holders have gone, or a short get finds nothing).
fn assert_drained(q: &SimpleQueue<u64>) {
    match q.get_timeout(Duration::from_millis(200)) {
        Err(e) if e.is_disconnected() || matches!(e, multiproc::Error::Timeout { .. }) => {}
        other => panic!("the queue held more: {other:?}"),
    }
}

#[test]
fn a_writer_stopped_inside_a_put_holds_nobody_up_and_loses_nothing() {
    common::run(DEADLINE, || {
        let q = SimpleQueue::<u64>::new().unwrap();
        let holding = Event::new().unwrap();
        let mut writer = Process::builder(stop_inside_a_put, 0, (q.clone(), holding.clone()))
            .start()
            .unwrap();
        holding.wait_timeout(WAIT).unwrap();
        // While the writer is stopped with a slot of the ring claimed, three producers
        // put more than the ring holds, and every item reaches the getter in order.
        let (producers, per_producer) = (3, 1500);
        let mut ps = start_processes(
            put_numbers,
            (q.clone(), per_producer),
            producers,
            StartMethod::Spawn,
        )
        .unwrap();
        let got = get_on_a_thread(&q, producers * per_producer as usize)
            .join()
            .unwrap();
        continue_process(&writer);
        ps.join_timeout(WAIT).unwrap();
        assert_eq!(
            got.len(),
            producers * per_producer as usize,
            "the others' items did not all come while the writer was stopped"
        );
        for rank in 0..producers as u64 {
            let mine: Vec<u64> = got
                .iter()
                .copied()
                .filter(|v| v / 1_000_000 == rank)
                .collect();
            let want: Vec<u64> = (0..per_producer).map(|i| rank * 1_000_000 + i).collect();
            assert_eq!(
                mine, want,
                "producer {rank}'s items lost, duplicated or reordered"
            );
        }
        // Continued, the writer finishes its put: its item comes once.
        writer.join_timeout(WAIT).unwrap();
        assert_eq!(q.get_timeout(WAIT).unwrap(), STOPPED_ITEM);
        assert_drained(&q);
    });
}

/// A consumer that only ever tries (`try_get`, never a blocking get) is not held up by
/// a writer stopped for good with the head's slot claimed: a try finds nothing ready
/// *now* and returns at once, and once the claim has been seen for a while a later
/// try passes it and takes the items behind it, in order.
#[test]
fn a_consumer_that_only_tries_gets_past_a_writer_stopped_inside_a_put() {
    common::run(DEADLINE, || {
        let q = SimpleQueue::<u64>::new().unwrap();
        let holding = Event::new().unwrap();
        let mut writer = Process::builder(stop_inside_a_put, 0, (q.clone(), holding.clone()))
            .start()
            .unwrap();
        holding.wait_timeout(WAIT).unwrap();
        for v in 1..=3 {
            q.put(v).unwrap();
        }
        // The head is the stopped writer's claimed slot: nothing is ready yet, and the
        // try says so instead of waiting for the writer.
        let first = q.try_get();
        // Tries alone reach the items behind it (the watchdog fails a try that blocks,
        // or tries that never get there).
        let mut got = Vec::new();
        while got.len() < 3 {
            match q.try_get() {
                Ok(Some(v)) => got.push(v),
                Ok(None) => std::thread::yield_now(),
                Err(e) => {
                    got.push(u64::MAX - 1);
                    eprintln!("a try failed: {e}");
                    break;
                }
            }
        }
        continue_process(&writer);
        writer.join_timeout(WAIT).unwrap();
        assert!(
            matches!(first, Ok(None)),
            "the first try, at the stopped writer's slot: {first:?}"
        );
        assert_eq!(got, [1, 2, 3], "the items behind the stopped writer");
        // Continued, the writer finds its slot revoked and puts its item again.
        assert_eq!(q.get_timeout(WAIT).unwrap(), STOPPED_ITEM);
        assert_drained(&q);
    });
}

#[test]
fn a_reader_stopped_inside_a_get_holds_nobody_up_and_takes_nothing() {
    common::run(DEADLINE, || {
        let q = SimpleQueue::<u64>::new().unwrap();
        let out = SimpleQueue::<u64>::new().unwrap();
        let holding = Event::new().unwrap();
        q.put(1).unwrap();
        let mut reader = Process::builder(
            stop_inside_a_get,
            0,
            (q.clone(), holding.clone(), out.clone()),
        )
        .start()
        .unwrap();
        holding.wait_timeout(WAIT).unwrap();
        // The stopped reader has copied item 1 but not taken it: it is still ours to
        // get, and the queue carries on.
        let first = get_on_a_thread(&q, 1).join().unwrap();
        let mut rest = Vec::new();
        if first == [1] {
            q.put(2).unwrap();
            q.put(3).unwrap();
            rest = get_on_a_thread(&q, 2).join().unwrap();
        }
        continue_process(&reader);
        assert_eq!(
            first,
            [1],
            "the item a stopped reader copied was not left to the others"
        );
        assert_eq!(rest, [2, 3]);
        // Continued, the reader finds its copy taken and gets the next item instead.
        q.put(4).unwrap();
        assert_eq!(out.get_timeout(WAIT).unwrap(), 4);
        reader.join_timeout(WAIT).unwrap();
        assert_drained(&q);
    });
}
