//! Queues across real processes: bounded back-pressure, joinable task accounting, a
//! queue handed over through another queue, tensors in nested values, `try_put` on a
//! full queue, iterators that drain or end on close.

multiproc::test_init!();

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::secs;
use multiproc::{
    DType, Error, JoinableQueue, Queue, SimpleQueue, StartMethod, Tensor, Value, parcel,
    start_processes,
};
use serde::{Deserialize, Serialize};

const DEADLINE: Duration = Duration::from_secs(60);
const WAIT: Duration = Duration::from_secs(30);

/// Takes six items, slowly; counts each take in `takes` before making it.
fn consume_slowly(
    _rank: usize,
    (q, taken, takes): (Queue<u32>, Queue<u32>, Value<u32>),
) -> multiproc::Result<()> {
    for _ in 0..6 {
        // A slow consumer (not a synchronisation): the producer's puts meet a full queue.
        std::thread::sleep(Duration::from_millis(50));
        takes.update(|n| n + 1)?;
        let v = q.get()?;
        taken.put(v)?;
    }
    Ok(())
}

#[test]
fn a_full_bounded_queue_holds_the_producer_back() {
    common::run(DEADLINE, || {
        let q = Queue::with_capacity(2).unwrap();
        let taken = Queue::new().unwrap();
        for v in 0..2 {
            q.put(v).unwrap();
        }
        assert!(q.is_full());
        // Nobody takes yet: a put with a deadline times out and hands the item back.
        let back = q.put_timeout(99, Duration::from_millis(50)).unwrap_err();
        assert!(matches!(back.error, Error::Timeout { .. }));
        assert_eq!(back.item, 99);
        let takes = Value::new(0u32).unwrap();
        let mut ctx = start_processes(
            consume_slowly,
            (q.clone(), taken.clone(), takes.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        for v in 2..6 {
            // Each put waits for the consumer to make room: item v fits only once item
            // v - 2 was taken, and the consumer counts a take before making it.
            q.put_timeout(v, secs(30)).unwrap();
            assert!(
                takes.get() > v - 2,
                "put {v} returned after only {} takes: the producer was not held back",
                takes.get()
            );
            assert!(q.len() <= 2, "a queue of capacity 2 holds {}", q.len());
        }
        let got: Vec<u32> = (0..6)
            .map(|_| taken.get_timeout(secs(30)).unwrap())
            .collect();
        assert_eq!(got, (0..6).collect::<Vec<_>>(), "FIFO across processes");
        ctx.join_timeout(secs(30)).unwrap();
        assert_eq!(q.len(), 0);
    });
}

fn work_then_done(_rank: usize, q: JoinableQueue<u64>) -> multiproc::Result<()> {
    // Every item was put before the workers started: take until none is waiting.
    for v in q.try_iter() {
        std::hint::black_box(v? * 3);
        q.task_done()?;
    }
    Ok(())
}

#[test]
fn joinable_queue_join_waits_for_every_task_done_in_workers() {
    common::run(DEADLINE, || {
        let q = JoinableQueue::new().unwrap();
        for v in 0..200u64 {
            q.put(v).unwrap();
        }
        let err = q.join_timeout(Duration::from_millis(1)).unwrap_err();
        assert!(err.is_timeout(), "nothing is done yet: {err}");
        assert!(err.to_string().contains("200 unfinished tasks"), "{err}");
        let mut ctx = start_processes(work_then_done, q.clone(), 2, StartMethod::Spawn).unwrap();
        let start = Instant::now();
        q.join_timeout(secs(30))
            .expect("every task was marked done");
        assert!(start.elapsed() < secs(30));
        ctx.join_timeout(secs(30)).unwrap();
        assert!(q.task_done().is_err(), "one task_done too many");
    });
}

#[derive(Serialize, Deserialize)]
struct Sample {
    id: u32,
    features: Tensor,
    extra: BTreeMap<String, (Tensor, Vec<Tensor>)>,
}

fn reply_through_a_received_queue(
    _rank: usize,
    inbox: SimpleQueue<(Sample, Queue<u32>)>,
) -> multiproc::Result<()> {
    let (sample, reply) = inbox.get()?;
    sample.features.fill_(5.0)?;
    let (t, ts) = &sample.extra["a"];
    t.fill_(6.0)?;
    for x in ts {
        x.fill_(7.0)?;
    }
    reply.put(sample.id).map_err(Error::from)
}

#[test]
fn tensors_at_any_depth_and_a_queue_inside_a_message() {
    common::run(DEADLINE, || {
        let inbox = SimpleQueue::new().unwrap();
        let reply = Queue::new().unwrap();
        let features = Tensor::zeros(&[3, 4], DType::F32).unwrap();
        let inner = Tensor::zeros(&[2], DType::F64).unwrap();
        let list = vec![
            Tensor::zeros(&[5], DType::I32).unwrap(),
            features.select(0, 1).unwrap(),
        ];
        let sample = Sample {
            id: 42,
            features: features.clone(),
            extra: BTreeMap::from([("a".to_string(), (inner.clone(), list.clone()))]),
        };
        inbox.put((sample, reply.clone())).unwrap();
        let mut ctx =
            start_processes(reply_through_a_received_queue, inbox, 1, StartMethod::Spawn).unwrap();
        assert_eq!(reply.get_timeout(secs(30)).unwrap(), 42);
        ctx.join_timeout(secs(30)).unwrap();
        assert_eq!(inner.to_vec::<f64>().unwrap(), vec![6.0, 6.0]);
        assert_eq!(list[0].to_vec::<i32>().unwrap(), vec![7; 5]);
        // Row 1 was filled with 7 through the view, after the whole tensor got 5.
        let all = features.to_vec::<f32>().unwrap();
        assert_eq!(&all[0..4], &[5.0; 4]);
        assert_eq!(&all[4..8], &[7.0; 4]);
        assert_eq!(&all[8..12], &[5.0; 4]);
    });
}

// ----- try_put, iter, len/capacity -----

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

/// `try_get` on an empty queue never enters the kernel. A thread locked down with
/// seccomp's strict mode — any system call but `read`, `write`, `exit` and
/// `sigreturn` ends it — tries each kind of queue many times, then reports through a
/// pipe and exits; a forbidden call would end it before it reports. One queue's lane
/// was used and emptied before, so its flag is clear again. A clone of each queue
/// stays in this process, so whether other holders are left needs no kernel either
/// (without one, a try asks the kernel at most once per 10 ms).
#[test]
fn try_get_on_an_empty_queue_makes_no_system_call() {
    common::run(DEADLINE, || {
        let simple = SimpleQueue::<u64>::new().unwrap();
        let bounded = Queue::<u64>::with_capacity(4).unwrap();
        let joinable = JoinableQueue::<u64>::new().unwrap();
        let lane = Queue::<Option<multiproc::Event>>::new().unwrap();
        let clones = (
            simple.clone(),
            bounded.clone(),
            joinable.clone(),
            lane.clone(),
        );
        // An fd travels on the socket: the lane is flagged until a try finds it empty.
        lane.put(Some(multiproc::Event::new().unwrap())).unwrap();
        let (report_rx, report_tx) = rustix::pipe::pipe().unwrap();
        const TRIES: u32 = 10_000;
        let tries = || {
            use std::os::fd::AsRawFd;
            let empty = |n: &mut u32| {
                *n += u32::from(matches!(simple.try_get(), Ok(None)));
                *n += u32::from(matches!(bounded.try_get(), Ok(None)));
                *n += u32::from(matches!(joinable.try_get(), Ok(None)));
                *n += u32::from(matches!(lane.try_get(), Ok(None)));
            };
            // Whatever is made on first use (this thread's locals, the lane's clearing)
            // is made before the lock-down.
            let lane_item = matches!(lane.try_get(), Ok(Some(Some(_))));
            let mut warm = 0;
            empty(&mut warm);
            let fd = report_tx.as_raw_fd();
            // SAFETY: prctl with integer arguments; from here on this thread makes no
            // system call but the write and the exit below.
            let locked = unsafe { libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_STRICT) };
            let mut nothing = 0u32;
            if locked == 0 {
                for _ in 0..TRIES {
                    empty(&mut nothing);
                }
            }
            let report = [
                u32::from(lane_item),
                warm,
                u32::try_from(locked).unwrap_or(u32::MAX),
                nothing,
            ];
            // SAFETY: `report` is 16 readable bytes; `fd` is the pipe's open write end,
            // kept by the test until it has read the report.
            unsafe { libc::write(fd, report.as_ptr().cast(), 16) };
            // A strict thread may not unwind or free anything (those are system calls
            // it no longer may make): it ends here, owning nothing.
            // SAFETY: exit(2) of this thread alone; it holds no lock and owns nothing.
            unsafe { libc::syscall(libc::SYS_exit, 0) };
            unreachable!("exit(2) returned");
        };
        // SAFETY: the thread borrows the queues and the pipe, which this test keeps
        // until the thread has reported; after that it only exits (it is never joined).
        let thread = unsafe { std::thread::Builder::new().spawn_unchecked(tries) }.unwrap();
        let mut polled = [rustix::event::PollFd::new(
            &report_rx,
            rustix::event::PollFlags::IN,
        )];
        let ten_s = rustix::event::Timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        let ready = rustix::event::poll(&mut polled, Some(&ten_s)).unwrap();
        assert_eq!(
            ready, 1,
            "the locked-down thread never reported: a try made a system call"
        );
        let mut report = [0u8; 16];
        assert_eq!(rustix::io::read(&report_rx, &mut report).unwrap(), 16);
        let word = |i: usize| u32::from_ne_bytes(report[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!(word(0), 1, "the item on the lane came first");
        assert_eq!(word(1), 4, "each warm-up try found its queue empty");
        if word(2) != 0 {
            eprintln!("SKIPPED: seccomp's strict mode is not available here");
            return;
        }
        assert_eq!(word(3), 4 * TRIES, "every try found its queue empty");
        // The thread is gone or going (its last act is exit(2)); it is never joined.
        drop(thread);
        drop((clones, report_rx, report_tx));
    });
}

/// A value whose `Serialize` impl fails (postcard, the wire codec, keeps no text of
/// a custom serde error).
#[derive(Debug, Deserialize)]
struct Unsendable;

impl Serialize for Unsendable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(
            "this value refuses to be encoded",
        ))
    }
}

/// A value whose `Deserialize` impl refuses odd numbers.
#[derive(Debug, Serialize)]
struct EvenOnly(u32);

impl<'de> Deserialize<'de> for EvenOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = u32::deserialize(d)?;
        if n % 2 == 1 {
            return Err(serde::de::Error::custom("an odd number"));
        }
        Ok(EvenOnly(n))
    }
}

fn put_odd_then_even(_rank: usize, q: Queue<EvenOnly>) -> multiproc::Result<()> {
    q.put(EvenOnly(3))?;
    q.put(EvenOnly(4))?;
    Ok(())
}

/// A user type's own serde error says whose impl failed and how to see its text —
/// not postcard's bare "Serde Serialization Error" — and the queue stays usable: the
/// value that cannot be encoded comes back to the caller, the message that cannot be
/// decoded is reported and the next one arrives.
#[test]
fn a_user_types_serde_error_says_whose_impl_failed() {
    common::run(DEADLINE, || {
        let q = Queue::<Unsendable>::new().unwrap();
        let err = q.put(Unsendable).unwrap_err();
        assert!(matches!(err.item, Unsendable));
        let text = err.error.to_string();
        assert!(
            text.contains("a Serialize impl in the value returned an error")
                && text.contains("serde_json"),
            "{text}"
        );

        let q = Queue::<EvenOnly>::new().unwrap();
        let mut ctx = start_processes(put_odd_then_even, q.clone(), 1, StartMethod::Spawn).unwrap();
        ctx.join_timeout(WAIT).unwrap();
        let err = q.get_timeout(WAIT).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidMessage(m)
                if m.contains("a Deserialize impl of the receiving type returned an error")),
            "{err}"
        );
        assert_eq!(
            q.get_timeout(WAIT).unwrap().0,
            4,
            "the next message arrives"
        );
    });
}

/// A queue handle opened as another queue type (a parcel sealed as one type, opened as
/// another: the decode a receiver runs) is refused, saying what it is; `JoinableQueue`
/// counts tasks where `Queue` does not, so a mistaken view would miscount.
#[test]
fn a_queue_received_as_another_queue_type_is_refused_saying_which() {
    common::run(DEADLINE, || {
        let joinable: JoinableQueue<u32> = JoinableQueue::new().unwrap();
        let plain: Queue<u32> = Queue::new().unwrap();
        let simple: SimpleQueue<u32> = SimpleQueue::new().unwrap();
        let refused = |got: multiproc::Result<()>, says: &str| {
            let err = got.unwrap_err();
            assert!(
                matches!(&err, Error::InvalidMessage(m) if m.contains(says)),
                "{err}"
            );
        };
        let seal = |q: &dyn erased::Sealable| q.seal();
        refused(
            parcel::open::<Queue<u32>>(seal(&joinable)).map(drop),
            "received as a Queue is a JoinableQueue",
        );
        refused(
            parcel::open::<SimpleQueue<u32>>(seal(&joinable)).map(drop),
            "received as a SimpleQueue is a JoinableQueue",
        );
        refused(
            parcel::open::<JoinableQueue<u32>>(seal(&plain)).map(drop),
            "received as a JoinableQueue is a Queue",
        );
        refused(
            parcel::open::<Queue<u32>>(seal(&simple)).map(drop),
            "received as a Queue is a SimpleQueue",
        );
        // Opened as what it is, a JoinableQueue counts what is put through it.
        let view: JoinableQueue<u32> = parcel::open(seal(&joinable)).unwrap();
        view.put(5).unwrap();
        assert_eq!(joinable.get_timeout(WAIT).unwrap(), 5);
        joinable.task_done().unwrap();
        joinable.join_timeout(WAIT).unwrap();
        let view: Queue<u32> = parcel::open(seal(&plain)).unwrap();
        view.put(6).unwrap();
        assert_eq!(plain.get_timeout(WAIT).unwrap(), 6);
    });
}

/// Sealing any of the queue types into a parcel, behind one signature.
mod erased {
    use std::os::fd::OwnedFd;

    pub trait Sealable {
        fn seal(&self) -> OwnedFd;
    }

    impl<T: serde::Serialize> Sealable for T {
        fn seal(&self) -> OwnedFd {
            multiproc::parcel::seal(self).unwrap()
        }
    }
}
