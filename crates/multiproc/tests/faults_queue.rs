//! Fault injection on queues: SIGKILL a producer mid-put and a consumer mid-get at
//! random points, and check what the survivors see. Each scenario runs as the root of
//! its own process tree, seeded; the harness and what it checks are described in
//! tests/common/faults.rs. The other roles are tests/faults_processes.rs.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::Rng;
use common::faults::*;
use multiproc::{DType, Error, Event, Process, Queue, SimpleQueue, Tensor};

#[test]
fn producer_killed_mid_put() {
    outer("scenario_producer_mid_put", &BOTH);
}

#[test]
fn consumer_killed_mid_get() {
    outer("scenario_consumer_mid_get", &BOTH);
}

/// `SOAK_ITERATIONS` per role and strategy; prints a table of what was measured.
#[test]
#[ignore = "soak: long; run with `cargo test --test faults_queue -- --ignored soak`"]
fn soak() {
    common::faults::soak(&[
        ("scenario_producer_mid_put", &BOTH),
        ("scenario_consumer_mid_get", &BOTH),
    ]);
}

// --- producer mid-put ---

fn produce_until_killed(
    _rank: usize,
    (q, started, seed): (SimpleQueue<(u64, Tensor)>, Event, u64),
) -> Result<(), String> {
    let mut rng = Rng(seed);
    for seq in 0u64.. {
        let t = make_item(seq, &mut rng)?;
        q.put((seq, t)).map_err(|e| e.error.to_string())?;
        if seq == 0 {
            started.set();
        }
    }
    Ok(())
}

/// A producer puts tensors as fast as it can and is SIGKILLed at a random instant
/// (during start-up one time in four). The consumer gets every item it sent, in order
/// and intact, and no error: a packet is sent whole or not at all, and handles in
/// flight keep their segments alive. The queue keeps working.
#[test]
#[ignore = "run as its own process tree by producer_killed_mid_put"]
fn scenario_producer_mid_put() {
    scenario("producer_mid_put", |cfg, stats| {
        for i in 0..cfg.iterations {
            let q = SimpleQueue::<(u64, Tensor)>::new().unwrap();
            let started = Event::new().unwrap();
            let mut p = Process::builder(
                produce_until_killed,
                0,
                (q.clone(), started.clone(), cfg.rng.next_u64()),
            )
            .daemon(true)
            .start()
            .unwrap();
            stats.pid(p.pid());
            if cfg.rng.chance(3, 4) {
                started.wait_timeout(WAIT).expect("the producer never put");
            }
            let until = Instant::now() + cfg.rng.delay(40);
            let mut next = 0u64;
            let take = |item: (u64, Tensor), next: &mut u64| {
                assert_eq!(item.0, *next, "items arrive in order, none twice");
                check_item(item.0, &item.1).unwrap();
                *next += 1;
            };
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                match q.get_timeout(left) {
                    Ok(item) => take(item, &mut next),
                    Err(e) if e.is_timeout() => break,
                    Err(e) => panic!("a get while the producer runs failed: {e}"),
                }
            }
            kill_and_reap(&mut p, stats);
            // Everything it sent before it died arrives.
            while let Some(item) = still_queued(q.try_get(), "a get after the kill") {
                take(item, &mut next);
            }
            queue_still_works(&q);
            drop(p);
            assert_no_children_left();
            stats.iterations += 1;
            stats.add("items", next);
            eprintln!("iteration {i}: {next} items before and after the kill");
        }
    });
}

// --- consumer mid-get ---

fn consume_until_killed(
    _rank: usize,
    (work, acks, started): (Queue<(u64, Tensor)>, SimpleQueue<u64>, Event),
) -> Result<(), String> {
    started.set();
    loop {
        let (seq, t) = work.get().map_err(|e| e.to_string())?;
        check_item(seq, &t)?;
        acks.put(seq).map_err(|e| e.error.to_string())?;
    }
}

/// A consumer takes tensors from a bounded queue, acknowledging each, and is SIGKILLed
/// at a random instant. At most the one item in its hands is lost: every other item
/// was either acknowledged or is still in the queue, intact, and the queue keeps
/// working. `slots_lost` counts places of the bounded queue that a kill leaked (the
/// consumer died inside the `recvmsg` that took a packet, before it could free the
/// place — a window of one system call, as in Python's `multiprocessing.Queue`); a
/// full queue then says so with a `Timeout`, which counts as an error seen.
#[test]
#[ignore = "run as its own process tree by consumer_killed_mid_get"]
fn scenario_consumer_mid_get() {
    scenario("consumer_mid_get", |cfg, stats| {
        for i in 0..cfg.iterations {
            let total = 32 + cfg.rng.below(64);
            let capacity = total as usize + 8;
            let work = Queue::<(u64, Tensor)>::with_capacity(capacity).unwrap();
            let acks = SimpleQueue::<u64>::new().unwrap();
            let started = Event::new().unwrap();
            for seq in 0..total {
                let t = make_item(seq, &mut cfg.rng).unwrap();
                work.put_timeout((seq, t), WAIT)
                    .map_err(|e| e.error)
                    .unwrap();
            }
            let mut p = Process::builder(
                consume_until_killed,
                0,
                (work.clone(), acks.clone(), started.clone()),
            )
            .daemon(true)
            .start()
            .unwrap();
            stats.pid(p.pid());
            if cfg.rng.chance(3, 4) {
                started.wait_timeout(WAIT).expect("the consumer never ran");
            }
            std::thread::sleep(cfg.rng.delay(15));
            kill_and_reap(&mut p, stats);
            let mut acked = BTreeSet::new();
            while let Some(seq) = still_queued(acks.try_get(), "get an ack") {
                assert!(acked.insert(seq), "item {seq} acknowledged twice");
            }
            let mut left = BTreeSet::new();
            while let Some((seq, t)) = still_queued(work.try_get(), "get after the kill") {
                check_item(seq, &t).unwrap();
                assert!(
                    !acked.contains(&seq) && left.insert(seq),
                    "item {seq} delivered twice"
                );
            }
            let lost = total - (acked.len() + left.len()) as u64;
            assert!(
                lost <= 1,
                "{lost} items lost: only the one in the consumer's hands may be ({} acked, {} left of {total})",
                acked.len(),
                left.len()
            );
            assert!(acked.iter().chain(&left).all(|&s| s < total));
            // The survivor carries on: the queue works, and (capacity permitting) takes
            // as many items as before.
            queue_still_works(&work);
            let mut fit = 0;
            for seq in 0..capacity as u64 {
                let t = Tensor::full(&[1], f64::from(value_of(seq)), DType::F32).unwrap();
                match work.put_timeout((seq, t), Duration::from_millis(300)) {
                    Ok(()) => fit += 1,
                    Err(e) => {
                        assert!(matches!(e.error, Error::Timeout { .. }), "{}", e.error);
                        stats.errors += 1;
                        break;
                    }
                }
            }
            while still_queued(work.try_get(), "drain").is_some() {}
            drop(p);
            assert_no_children_left();
            stats.iterations += 1;
            stats.add("items", total);
            stats.add("lost_in_hand", lost);
            stats.add("slots_lost", (capacity - fit) as u64);
            eprintln!(
                "iteration {i}: {} acked, {} left, {lost} lost of {total}; {fit}/{capacity} places",
                acked.len(),
                left.len()
            );
        }
    });
}
