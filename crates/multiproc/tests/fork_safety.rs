//! `StartMethod::Fork` from a multithreaded parent: a forked child holds copies of the
//! library's process-wide locks in whatever state the parent's other threads left them,
//! so a child whose first put or get needs one that another thread held at the fork
//! would hang. The library's process-wide state is rebuilt in a fork child instead
//! (`sys::fork_local`): here 4 parent threads keep putting and getting shared tensors
//! (the map cache, the pools of recycled blocks, the received-storage cache, all busy)
//! while the parent forks 200 children that each get a tensor, sum it and put a new
//! one. A hung child is a join that runs past its deadline: a failure, not a stuck run.

multiproc::test_init!();

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use multiproc::{DType, SimpleQueue, StartMethod, Tensor, start_processes};

const DEADLINE: Duration = Duration::from_secs(240);
const WAIT: Duration = Duration::from_secs(20);
const CHILDREN: usize = 200;
const BUSY_THREADS: usize = 4;

/// Gets the parent's tensor, sums it, and answers with a new shared tensor holding the
/// sum.
fn answer(
    _rank: usize,
    (to_child, to_parent): (SimpleQueue<Tensor>, SimpleQueue<Tensor>),
) -> multiproc::Result<()> {
    let t = to_child.get_timeout(WAIT)?;
    let sum = t.sum()?;
    let reply = Tensor::full(&[1024], sum, DType::F32)?;
    reply.share_memory_()?;
    to_parent.put(reply)?;
    Ok(())
}

#[test]
fn fork_from_a_parent_whose_threads_keep_putting_and_getting() {
    common::run(DEADLINE, || {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let busy: Vec<_> = (0..BUSY_THREADS)
            .map(|i| {
                let (stop, rounds) = (Arc::clone(&stop), Arc::clone(&rounds));
                std::thread::spawn(move || {
                    let q = SimpleQueue::<Tensor>::new().unwrap();
                    let _other_end = q.clone();
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Small (arena) and large (own block) tensors, made, shared,
                        // sent, received and dropped.
                        let len = if n % 8 == 0 { 1 << 18 } else { 64 + i };
                        let t = Tensor::full(&[len], 1.0, DType::F32).unwrap();
                        q.put(t).map_err(|e| e.error).unwrap();
                        let back = q.get_timeout(WAIT).unwrap();
                        assert_eq!(back.sum().unwrap(), len as f64);
                        n += 1;
                    }
                    rounds.fetch_add(n, Ordering::Relaxed);
                })
            })
            .collect();
        let to_child = SimpleQueue::<Tensor>::new().unwrap();
        let to_parent = SimpleQueue::<Tensor>::new().unwrap();
        for i in 0..CHILDREN {
            let value = i as f64;
            to_child
                .put(Tensor::full(&[16], value, DType::F32).unwrap())
                .map_err(|e| e.error)
                .unwrap();
            let mut ctx = start_processes(
                answer,
                (to_child.clone(), to_parent.clone()),
                1,
                StartMethod::Fork,
            )
            .unwrap();
            let reply = to_parent
                .get_timeout(WAIT)
                .unwrap_or_else(|e| panic!("fork child {i} did not answer (hung?): {e}"));
            assert_eq!(reply.sum().unwrap(), value * 16.0 * 1024.0);
            ctx.join_timeout(WAIT)
                .unwrap_or_else(|e| panic!("fork child {i}: {e}"));
        }
        stop.store(true, Ordering::Relaxed);
        for t in busy {
            t.join().unwrap();
        }
        let rounds = rounds.load(Ordering::Relaxed);
        eprintln!("{CHILDREN} fork children answered while the busy threads did {rounds} rounds");
        assert!(rounds > 0, "the busy threads never ran");
    });
}
