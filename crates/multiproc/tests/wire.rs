//! The wire across real processes: pipes and queues between workers and the parent.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use multiproc::{Error, Queue, SimpleQueue, StartMethod, pipe, start_processes};

const DEADLINE: Duration = Duration::from_secs(60);

fn put_three_mib_and_exit(_rank: usize, q: SimpleQueue<Vec<u8>>) {
    for i in 0..3u8 {
        q.put(vec![i; 1 << 20]).expect("put");
    }
    // Returning ends the process at once: what was put must still arrive.
}

#[test]
fn producer_exits_before_the_consumer_reads() {
    common::run(DEADLINE, || {
        let q = SimpleQueue::new().unwrap();
        let mut ctx =
            start_processes(put_three_mib_and_exit, q.clone(), 1, StartMethod::Spawn).unwrap();
        ctx.join_timeout(Duration::from_secs(30))
            .expect("producer did not finish");
        for i in 0..3u8 {
            let got = q
                .get_timeout(Duration::from_secs(10))
                .expect("message lost");
            assert_eq!(got.len(), 1 << 20);
            assert!(got.iter().all(|&b| b == i));
        }
    });
}

fn echo_big(_rank: usize, conn: multiproc::Connection<Vec<u8>>) {
    let msg = conn.recv().expect("recv");
    conn.send(msg).expect("send");
}

#[test]
fn sixteen_mib_message_through_a_pipe() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<Vec<u8>>().unwrap();
        let mut ctx = start_processes(echo_big, there, 1, StartMethod::Spawn).unwrap();
        let big: Vec<u8> = (0..(16u32 << 20) + 3).map(|i| (i % 253) as u8).collect();
        here.send(big.clone()).unwrap();
        let back = here.recv_timeout(Duration::from_secs(30)).expect("no echo");
        assert_eq!(back, big);
        ctx.join_timeout(Duration::from_secs(30)).unwrap();
    });
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Mpmc {
    work: Queue<u32>,
    results: Queue<(usize, u32)>,
}

const PER_PRODUCER: u32 = 10_000;

fn mpmc_worker(rank: usize, q: Mpmc) {
    if rank < 2 {
        for i in 0..PER_PRODUCER {
            q.work.put(rank as u32 * PER_PRODUCER + i).expect("put");
        }
    } else {
        // Each consumer takes until it sees the end marker; the parent sends one each.
        loop {
            let v = q
                .work
                .get_timeout(Duration::from_secs(30))
                .expect("stalled");
            if v == u32::MAX {
                break;
            }
            q.results.put((rank, v)).expect("result");
        }
    }
}

#[test]
fn two_putters_two_getters_lose_and_duplicate_nothing() {
    common::run(DEADLINE, || {
        let q = Mpmc {
            work: Queue::new().unwrap(),
            results: Queue::new().unwrap(),
        };
        let work = q.work.clone();
        let results = q.results.clone();
        let mut ctx = start_processes(mpmc_worker, q, 4, StartMethod::Spawn).unwrap();
        let mut seen = BTreeSet::new();
        let mut by_consumer = [0usize; 4];
        while seen.len() < 2 * PER_PRODUCER as usize {
            let (rank, v) = results
                .get_timeout(Duration::from_secs(30))
                .expect("results stalled");
            assert!(seen.insert(v), "message {v} delivered twice");
            by_consumer[rank] += 1;
        }
        work.put(u32::MAX).unwrap();
        work.put(u32::MAX).unwrap();
        ctx.join_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(seen.len(), 20_000);
        assert_eq!(by_consumer[2] + by_consumer[3], 20_000);
        // No duplicate left over: empty, and (every worker gone) disconnected.
        let end = results.try_get();
        assert!(
            matches!(&end, Err(e) if e.is_disconnected()),
            "expected the end, got {end:?}"
        );
    });
}

fn send_garbage(_rank: usize, conn: multiproc::Connection<u64>) {
    // Raw bytes on the connection's socket: to the receiver, a forged message.
    use std::os::fd::AsFd;
    let raw =
        std::os::unix::net::UnixDatagram::from(conn.as_fd().try_clone_to_owned().expect("dup"));
    raw.send(b"MPW\x01 definitely not a multiproc message")
        .expect("send");
    raw.send(&[0xff; 3]).expect("send");
    conn.send(42).expect("send");
}

#[test]
fn a_forged_message_is_an_error_and_the_pipe_stays_usable() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<u64>().unwrap();
        let mut ctx = start_processes(send_garbage, there, 1, StartMethod::Spawn).unwrap();
        for _ in 0..2 {
            let err = here.recv_timeout(Duration::from_secs(30)).unwrap_err();
            assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
        }
        assert_eq!(here.recv_timeout(Duration::from_secs(30)).unwrap(), 42);
        ctx.join_timeout(Duration::from_secs(30)).unwrap();
    });
}
