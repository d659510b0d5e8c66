//! A process killed while it holds tensors pins nothing: the creator of their blocks
//! takes the dead holder's uses back (the kernel dropped its marks when it died), so the
//! blocks go back to the creator's pool, their memory is freed and, under
//! `file_system`, their names leave /dev/shm — while the tree goes on, not when it
//! ends. And the same machinery never takes back a use that someone alive still holds:
//! a live holder's tensors and a message still in a queue keep their bytes while the
//! creator recycles everything it can.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::for_each_strategy;
use multiproc::{DType, Process, Queue, Tensor};

const DEADLINE: Duration = Duration::from_secs(150);
const WAIT: Duration = Duration::from_secs(30);
/// 16 MiB of f32: a block of its own each.
const LARGE: usize = 4 << 20;
/// 1 KiB of f32: carved from an arena.
const SMALL: usize = 256;
const EACH: usize = 6;
/// What may stay committed beyond the baseline: the current arenas and whatever else the
/// machine does meanwhile (the holder held 96 MiB).
const SLACK_MIB: u64 = 40;

/// The tensors a holder gets: [`EACH`] large and [`EACH`] small ones full of `value`.
fn tensors(value: f64) -> Vec<Tensor> {
    (0..EACH)
        .flat_map(|_| [LARGE, SMALL])
        .map(|n| Tensor::full(&[n], value, DType::F32).unwrap())
        .collect()
}

/// The holder: gets `2 * EACH` tensors, says so, then waits for one more message and
/// answers whether every tensor it holds still reads 7 (the parent kills it instead
/// in one case).
fn hold(_rank: usize, (tensors, told): (Queue<Tensor>, Queue<u32>)) -> multiproc::Result<()> {
    let held: Vec<Tensor> = (0..2 * EACH)
        .map(|_| tensors.get())
        .collect::<multiproc::Result<_>>()?;
    told.put(1)?;
    let _check = tensors.get()?;
    let intact = held.iter().all(|t| common::all_equal(t, 7.0));
    told.put(u32::from(intact))?;
    Ok(())
}

fn start_holder(tensors: &Queue<Tensor>, told: &Queue<u32>) -> Process {
    Process::builder(hold, 0, (tensors.clone(), told.clone()))
        .start()
        .unwrap()
}

/// Lets this process's idle blocks go until `done` says so, or fails after [`WAIT`]
/// saying what is left.
fn release_until(what: &str, mut done: impl FnMut() -> Option<String>) {
    let start = Instant::now();
    loop {
        multiproc::__testing::flush_retained_segments();
        multiproc::__testing::release_idle_blocks();
        let Some(left) = done() else {
            return;
        };
        assert!(start.elapsed() < WAIT, "{what}: after {WAIT:?}, {left}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_holder_killed_with_tensors_pins_no_block_and_no_name() {
    common::run(DEADLINE, || {
        for_each_strategy(|strategy| {
            let (names, baseline) = (common::our_segments(), common::shmem_mib());
            let (q, told) = (
                Queue::<Tensor>::new().unwrap(),
                Queue::<u32>::new().unwrap(),
            );
            let mut holder = start_holder(&q, &told);
            for t in tensors(7.0) {
                q.put(t).unwrap();
            }
            assert_eq!(told.get_timeout(WAIT).unwrap(), 1, "{strategy}");
            holder.kill().unwrap();
            holder.join_timeout(WAIT).unwrap();
            // Every block the holder held uses of is back: idle, let go, its memory
            // freed and (named) its name unlinked. Without taking the dead holder's uses
            // back, they stay pinned for as long as this process lives.
            release_until(&format!("{strategy}, holder killed"), || {
                let left: Vec<String> =
                    common::our_segments().difference(&names).cloned().collect();
                let now = common::shmem_mib();
                (!left.is_empty() || now > baseline + SLACK_MIB).then(|| {
                    format!(
                        "{} names are left ({left:?}) and {now} MiB of shared memory is committed \
                         (baseline {baseline} MiB)",
                        left.len()
                    )
                })
            });
            // The queue still works, and what it carries now is whole.
            let fresh = Tensor::full(&[LARGE], 3.0, DType::F32).unwrap();
            q.put(fresh).unwrap();
            assert!(
                common::all_equal(&q.get_timeout(WAIT).unwrap(), 3.0),
                "{strategy}"
            );
        });
    });
}

#[test]
fn a_live_holder_and_a_queued_message_keep_their_bytes_while_the_creator_recycles() {
    common::run(DEADLINE, || {
        for_each_strategy(|strategy| {
            let (q, told) = (
                Queue::<Tensor>::new().unwrap(),
                Queue::<u32>::new().unwrap(),
            );
            // Queued before anyone reads: in flight while the creator recycles.
            for t in tensors(7.0) {
                q.put(t).unwrap();
            }
            multiproc::__testing::release_idle_blocks();
            // Blocks wrongly taken back would be handed out again here, and overwritten.
            let mut decoys = tensors(9.0);
            let mut holder = start_holder(&q, &told);
            assert_eq!(told.get_timeout(WAIT).unwrap(), 1, "{strategy}");
            // Held by a live process now, dropped here: recycle again, overwrite again.
            decoys.clear();
            for _ in 0..3 {
                multiproc::__testing::release_idle_blocks();
                decoys.extend(tensors(9.0));
            }
            q.put(Tensor::zeros(&[1], DType::F32).unwrap()).unwrap();
            assert_eq!(
                told.get_timeout(WAIT).unwrap(),
                1,
                "{strategy}: a live holder's tensors were overwritten"
            );
            holder.join_timeout(WAIT).unwrap();
            drop(decoys);
        });
    });
}
