//! Memory comes back: after a burst of large tensors from workers to the parent, once
//! every tensor is dropped and the tree goes idle, the shared memory the burst
//! committed is freed — by the producers' block pools (even while a producer lives on,
//! idle), by the parent's kept mappings of received blocks, and by the queue's custody
//! of block fds — while the parent still holds the queue. The time it takes is a
//! figure of `multiproc bench --scenario memory`; here a deadline only bounds the wait.
//!
//! Committed shared memory is the machine's `Shmem` (`/proc/meminfo`): memfds and
//! `/dev/shm` files alike, whoever maps or holds them.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::for_each_strategy;
use multiproc::{DType, Event, Queue, SharingStrategy, StartMethod, Tensor, start_processes};

const DEADLINE: Duration = Duration::from_secs(120);
const WAIT: Duration = Duration::from_secs(30);
const WORKERS: usize = 4;
const TENSORS_EACH: usize = 8;
/// 16 MiB of f32.
const FLOATS: usize = 4 << 20;
const BURST_MIB: u64 = (WORKERS * TENSORS_EACH * FLOATS * 4) as u64 >> 20;
/// What may stay committed after the burst, beyond the baseline: the processes'
/// current arenas and whatever else the machine does meanwhile.
const SLACK_MIB: u64 = 96;

/// Sends its tensors (each a block of its own, all alive at once in the parent), then
/// stays alive, idle, until told to go when `linger` is set.
fn burst(
    rank: usize,
    (q, linger, go): (Queue<(usize, Tensor)>, bool, Event),
) -> multiproc::Result<()> {
    for i in 0..TENSORS_EACH {
        q.put((
            rank,
            Tensor::full(&[FLOATS], (rank * 100 + i) as f64, DType::F32)?,
        ))?;
    }
    if linger {
        go.wait_timeout(WAIT)?;
    }
    Ok(())
}

/// Waits until committed shared memory is back within `SLACK_MIB` of `baseline`;
/// returns how long that took, or fails saying where it stayed.
fn comes_back(baseline: u64, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        let now = common::shmem_mib();
        if now <= baseline + SLACK_MIB {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < WAIT,
            "{what}: {now} MiB of shared memory still committed {WAIT:?} after the burst \
             (baseline {baseline} MiB, burst {BURST_MIB} MiB)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn burst_then_idle(strategy: SharingStrategy, linger: bool) {
    let baseline = common::shmem_mib();
    let q = Queue::<(usize, Tensor)>::new().unwrap();
    let go = Event::new().unwrap();
    let mut ctx = start_processes(
        burst,
        (q.clone(), linger, go.clone()),
        WORKERS,
        StartMethod::Spawn,
    )
    .unwrap();
    let mut kept = Vec::new();
    for _ in 0..WORKERS * TENSORS_EACH {
        let (rank, t) = q.get_timeout(WAIT).unwrap();
        assert_eq!(t.numel(), FLOATS);
        kept.push((rank, t));
    }
    let peak = common::shmem_mib();
    assert!(
        peak >= baseline + BURST_MIB / 2,
        "the burst did not commit memory ({baseline} -> {peak} MiB): the check cannot tell"
    );
    if !linger {
        // Every producer has exited before the parent lets its tensors go.
        ctx.join_timeout(WAIT).unwrap();
    }
    drop(kept);
    let took = comes_back(
        baseline,
        &format!(
            "{strategy}, producers {}",
            if linger { "alive" } else { "exited" }
        ),
    );
    eprintln!(
        "{strategy}, producers {}: {peak} MiB at the peak, back within {SLACK_MIB} MiB of {baseline} \
         after {took:?}",
        if linger { "alive and idle" } else { "exited" }
    );
    if linger {
        let pids = ctx.pids();
        assert!(
            pids.iter().all(|&p| common::alive(p)),
            "{strategy}: a producer did not live on, idle, until its memory was freed: {pids:?}"
        );
        go.set();
        ctx.join_timeout(WAIT).unwrap();
    }
    // The parent still holds the queue (and so its custody) here.
    drop(q);
}

#[test]
fn a_burst_from_producers_that_exited_is_freed_while_the_queue_lives() {
    common::run(DEADLINE, || {
        for_each_strategy(|s| burst_then_idle(s, false));
    });
}

#[test]
fn a_burst_from_producers_that_live_on_idle_is_freed_too() {
    common::run(DEADLINE, || {
        for_each_strategy(|s| burst_then_idle(s, true));
    });
}
