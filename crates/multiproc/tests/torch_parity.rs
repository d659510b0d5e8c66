//! torch's own multiprocessing tests (test/test_multiprocessing.py), ported under their
//! names, each for both sharing strategies, repeated where torch repeats them, each
//! ending with a leak check (no new /dev/shm entry, no fd growth, no child left).

multiproc::test_init!();

mod common;

use common::simple_fill;

use common::{TORCH_REPEATS, all_equal, for_each_strategy, secs};

use std::time::Duration;

use multiproc::{
    DType, Event, Pool, Process, Queue, SharingStrategy, StartMethod, Storage, Tensor,
    set_sharing_strategy, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(120);

fn fill_and_copy(t: Tensor) -> multiproc::Result<Tensor> {
    t.fill_(4.0)?;
    let copy = t.deep_clone()?;
    copy.add_scalar_(1.0)?;
    Ok(copy)
}

#[test]
fn test_pool() {
    common::run(DEADLINE, || {
        for_each_strategy(|_| {
            let pool = Pool::new(2).unwrap();
            for _ in 0..TORCH_REPEATS {
                let inputs: Vec<Tensor> = (0..4)
                    .map(|_| Tensor::zeros(&[2, 2], DType::F32).unwrap())
                    .collect();
                let results = pool.map(fill_and_copy, inputs.clone()).unwrap();
                for r in &results {
                    assert_eq!(r.to_vec::<f32>().unwrap(), vec![5.0; 4]);
                }
                for t in &inputs {
                    assert_eq!(
                        t.to_vec::<f32>().unwrap(),
                        vec![4.0; 4],
                        "the inputs were shared with the pool"
                    );
                }
            }
        });
    });
}

/// torch's `send_tensor`: put the same ones tensor twice, wait for the event.
fn send_tensor(_rank: usize, (queue, event): (Queue<Tensor>, Event)) -> multiproc::Result<()> {
    let t = Tensor::ones(&[5, 5], DType::F64)?;
    queue.put(t.clone())?;
    queue.put(t)?;
    event.wait_timeout(secs(30))?;
    Ok(())
}

/// torch's `SubProcess.run`: add 3 in place to the tensor it was given.
fn add_three(_rank: usize, t: Tensor) -> multiproc::Result<()> {
    t.add_scalar_(3.0)
}

#[test]
fn test_fill() {
    common::run(secs(120), || {
        for_each_strategy(|strategy| {
            for method in StartMethod::ALL {
                let x = Tensor::zeros(&[5, 5], DType::F32).unwrap();
                let queue = Queue::new().unwrap();
                let event = Event::new().unwrap();
                let data = vec![x.clone(), x.select(1, 1).unwrap()];
                queue.put(data.clone()).unwrap();
                let mut ctx =
                    start_processes(simple_fill, (queue, event.clone()), 1, method).unwrap();
                event
                    .wait_timeout(secs(30))
                    .expect("{strategy}/{method}: the child did not fill in time");
                assert!(
                    all_equal(&data[0], 4.0),
                    "{strategy}/{method}: {:?}",
                    data[0]
                );
                assert!(
                    all_equal(&data[1], 4.0),
                    "{strategy}/{method}: {:?}",
                    data[1]
                );
                ctx.join_timeout(secs(30)).unwrap();
            }
        });
    });
}

#[test]
fn test_receive() {
    common::run(secs(120), || {
        for_each_strategy(|strategy| {
            for method in StartMethod::ALL {
                let queue = Queue::new().unwrap();
                let event = Event::new().unwrap();
                let mut ctx =
                    start_processes(send_tensor, (queue.clone(), event.clone()), 1, method)
                        .unwrap();
                let t1 = queue.get_timeout(secs(30)).expect("first tensor");
                let t2 = queue.get_timeout(secs(30)).expect("second tensor");
                assert!(all_equal(&t1, 1.0), "{strategy}/{method}");
                assert_eq!(t1.dtype(), t2.dtype());
                assert_eq!(
                    t1.data_ptr(),
                    t2.data_ptr(),
                    "{strategy}/{method}: the same storage sent twice is mapped once"
                );
                assert!(
                    Storage::ptr_eq(t1.storage(), t2.storage()),
                    "{strategy}/{method}: one storage, as in torch"
                );
                assert!(t1.is_shared() && t2.is_shared());
                assert_eq!(t1.storage().sharing_strategy(), Some(strategy));
                // Drop them before the producer exits, as torch's test does (not needed
                // here: the producer may exit first).
                drop((t1, t2));
                event.set();
                ctx.join_timeout(secs(30)).unwrap();
            }
        });
    });
}

#[test]
fn test_fs() {
    common::run(secs(60), || {
        set_sharing_strategy(SharingStrategy::FileSystem);
        for _ in 0..TORCH_REPEATS {
            let before = common::our_segments();
            let x = Storage::new(4 * 8).unwrap();
            let q = Queue::new().unwrap();
            assert!(!x.is_shared());
            q.put(x.clone()).unwrap();
            let name = x.shm_name().expect("file_system storages have a name");
            assert!(
                common::our_segments().contains(&name) && !before.contains(&name),
                "the segment is visible in /dev/shm after put"
            );
            let back: Storage = q.get().unwrap();
            assert_eq!(back.shm_name().as_deref(), Some(name.as_str()));
            assert_eq!(back.data_ptr(), x.data_ptr());
            drop((x, back));
            // The segment is a block this process recycles (its name stays while the
            // pool keeps it); once the pool lets it go, nothing holds the name.
            multiproc::__testing::release_idle_blocks();
            assert!(
                !common::our_segments().contains(&name),
                "the last user unlinked the segment"
            );
        }
    });
}

#[test]
fn test_is_shared() {
    common::run(secs(30), || {
        for_each_strategy(|strategy| {
            let t = Tensor::arange(0.0, 25.0, 1.0, DType::F32)
                .unwrap()
                .reshape(&[5, 5])
                .unwrap();
            assert!(!t.is_shared());
            t.share_memory_().unwrap();
            assert!(t.is_shared());
            assert_eq!(t.storage().sharing_strategy(), Some(strategy));
            assert_eq!(t.sum().unwrap(), 300.0);
        });
    });
}

#[test]
fn test_inherit_tensor() {
    common::run(secs(60), || {
        for_each_strategy(|strategy| {
            let t = Tensor::zeros(&[5, 5], DType::F32).unwrap();
            t.share_memory_().unwrap();
            let mut p = Process::builder(add_three, 0, t.clone())
                .start_method(StartMethod::Fork)
                .start()
                .unwrap();
            let status = p.join_timeout(secs(30)).expect("the child exited");
            assert!(status.success(), "{strategy}: {status:?} {:?}", p.error());
            assert!(all_equal(&t, 3.0), "{strategy}: {t:?}");
        });
    });
}
