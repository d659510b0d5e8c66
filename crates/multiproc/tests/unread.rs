//! Nothing dropped unread pins anything: a message dropped without being decoded gives
//! back every block use it carried, so once the workers have exited no name of theirs
//! is left in /dev/shm and their shared memory is freed — under both strategies. The
//! cases: pool results nobody reads (`apply_async` and `map_async` results dropped,
//! `imap` left early) and a queue dropped with messages in it. (A packet refused as
//! malformed gives back its uses too: the library's own tests forge those.)
//!
//! Committed shared memory is the machine's `Shmem` (`/proc/meminfo`); the cases of
//! this file run one at a time so that each sees only its own.

multiproc::test_init!();

mod common;

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use common::for_each_strategy;
use multiproc::{DType, Pool, Queue, SharingStrategy, StartMethod, Tensor, start_processes};

const DEADLINE: Duration = Duration::from_secs(150);
const WAIT: Duration = Duration::from_secs(30);
/// 16 MiB of f32: one block each.
const FLOATS: usize = 4 << 20;
const RESULTS: u64 = 8;
const BURST_MIB: u64 = RESULTS * ((FLOATS as u64 * 4) >> 20);
/// What may stay committed beyond the baseline: the parent's current arenas and
/// whatever else the machine does meanwhile.
const SLACK_MIB: u64 = 48;

/// One case at a time: each judges the machine's committed shared memory.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A fresh 16 MiB tensor (a block of the worker's own) full of `i`.
fn big(i: u64) -> Result<Tensor, String> {
    Tensor::full(&[FLOATS], i as f64, DType::F32).map_err(|e| e.to_string())
}

/// Waits until no name of this tree's is left beyond `names` and committed shared
/// memory is back within [`SLACK_MIB`] of `baseline`; fails saying what stayed.
fn nothing_pinned(baseline: u64, names: &std::collections::BTreeSet<String>, what: &str) {
    let start = Instant::now();
    loop {
        let left: Vec<String> = common::our_segments().difference(names).cloned().collect();
        let now = common::shmem_mib();
        if left.is_empty() && now <= baseline + SLACK_MIB {
            eprintln!(
                "{what}: back to {now} MiB (baseline {baseline}) after {:?}",
                start.elapsed()
            );
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "{what}: {WAIT:?} after the workers exited, {} names are left ({left:?}) and {now} \
             MiB of shared memory is committed (baseline {baseline} MiB, {BURST_MIB} MiB unread)",
            left.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `case` under each strategy, one case of this file at a time, and checks that
/// what it left unread pins nothing once its workers are gone.
fn pins_nothing(what: &'static str, case: fn(SharingStrategy)) {
    common::run(DEADLINE, move || {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
        for_each_strategy(|strategy| {
            let (baseline, names) = (common::shmem_mib(), common::our_segments());
            case(strategy);
            nothing_pinned(baseline, &names, &format!("{what}, {strategy}"));
        });
    });
}

/// Waits until `pool`'s workers have all exited (so every result they sent is in).
fn close_and_join(mut pool: Pool) {
    pool.close();
    pool.join_timeout(WAIT).unwrap();
}

#[test]
fn pool_results_never_read_pin_nothing() {
    pins_nothing("apply_async and map_async results dropped", |_| {
        let pool = Pool::new(2).unwrap();
        let dropped: Vec<_> = (0..RESULTS / 2)
            .map(|i| pool.apply_async(big, i).unwrap())
            .collect();
        let mapped = pool.map_async(big, RESULTS / 2..RESULTS).unwrap();
        drop((dropped, mapped));
        close_and_join(pool);
    });
}

#[test]
fn an_imap_left_early_pins_nothing() {
    pins_nothing("imap left after one result", |_| {
        let pool = Pool::new(2).unwrap();
        {
            let mut results = pool.imap(big, 0..RESULTS);
            let first = results.next().expect("a first result").unwrap();
            assert_eq!(first.numel(), FLOATS);
        }
        close_and_join(pool);
    });
}

/// Puts [`RESULTS`] / 2 fresh 16 MiB tensors and exits.
fn put_big(rank: usize, q: Queue<Tensor>) -> multiproc::Result<()> {
    for i in 0..RESULTS / 2 {
        q.put(big(rank as u64 * 100 + i).map_err(multiproc::Error::InvalidArgument)?)?;
    }
    Ok(())
}

#[test]
fn a_queue_dropped_with_messages_in_it_pins_nothing() {
    pins_nothing("a queue dropped full", |_| {
        let q = Queue::<Tensor>::new().unwrap();
        let mut producers = start_processes(put_big, q.clone(), 2, StartMethod::Spawn).unwrap();
        producers.join_timeout(WAIT).unwrap();
        assert_eq!(q.len(), RESULTS as usize, "every message is queued");
        drop(q);
    });
}
