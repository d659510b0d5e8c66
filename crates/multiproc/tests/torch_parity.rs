//! torch's own multiprocessing tests (test/test_multiprocessing.py), ported under their
//! names, each for both sharing strategies, repeated where torch repeats them, each
//! ending with a leak check (no new /dev/shm entry, no fd growth, no child left).

multiproc::test_init!();

mod common;

use std::time::Duration;

use multiproc::{
    DType, Event, Pool, Queue, SharingStrategy, SimpleQueue, StartMethod, Tensor,
    set_sharing_strategy, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(120);
/// torch repeats its sharing tests this many times.
const REPEAT: usize = 30;

fn for_each_strategy(body: fn(SharingStrategy)) {
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        common::run(DEADLINE, move || {
            set_sharing_strategy(strategy);
            body(strategy);
            set_sharing_strategy(SharingStrategy::FileDescriptor);
        });
    }
}

fn simple_fill(_rank: usize, (queue, event): (SimpleQueue<Vec<Tensor>>, Event)) {
    let data = queue.get().expect("get");
    data[0].fill_(4.0).expect("fill");
    event.set();
}

#[test]
fn test_fill() {
    for_each_strategy(|_| {
        for _ in 0..REPEAT {
            let x = Tensor::zeros(&[5, 5], DType::F32).unwrap();
            let data = vec![x.clone(), x.select(1, 1).unwrap()];
            let queue = SimpleQueue::new().unwrap();
            let event = Event::new().unwrap();
            queue.put(data.clone()).unwrap();
            let mut ctx =
                start_processes(simple_fill, (queue, event.clone()), 1, StartMethod::Spawn)
                    .unwrap();
            assert!(event.wait(Some(Duration::from_secs(30))).unwrap());
            for t in &data {
                assert!(
                    t.to_vec::<f32>().unwrap().iter().all(|&v| v == 4.0),
                    "{t:?}"
                );
            }
            assert!(ctx.join(Some(Duration::from_secs(30))).unwrap());
        }
    });
}

fn send_tensor(_rank: usize, (queue, event): (SimpleQueue<Tensor>, Event)) {
    let t = Tensor::ones(&[5, 5], DType::F32).expect("ones");
    queue.put(t.clone()).expect("put");
    queue.put(t).expect("put");
    event.wait(Some(Duration::from_secs(30))).expect("wait");
}

#[test]
fn test_receive() {
    for_each_strategy(|_| {
        for _ in 0..REPEAT {
            let queue = SimpleQueue::new().unwrap();
            let event = Event::new().unwrap();
            let mut ctx = start_processes(
                send_tensor,
                (queue.clone(), event.clone()),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            let t1 = queue
                .get_timeout(Duration::from_secs(30))
                .unwrap()
                .expect("first");
            let t2 = queue
                .get_timeout(Duration::from_secs(30))
                .unwrap()
                .expect("second");
            assert_eq!(t1.to_vec::<f32>().unwrap(), vec![1.0; 25]);
            assert_eq!(
                t1.data_ptr(),
                t2.data_ptr(),
                "the same storage sent twice aliases"
            );
            t1.fill_(2.0).unwrap();
            assert_eq!(t2.sum(), 50.0);
            event.set();
            assert!(ctx.join(Some(Duration::from_secs(30))).unwrap());
        }
    });
}

#[test]
fn test_put_get_in_one_process_keeps_values_views_and_aliasing() {
    for_each_strategy(|_| {
        let q: Queue<(Tensor, Tensor, Tensor)> = Queue::new().unwrap();
        let base = Tensor::arange(0.0, 12.0, 1.0, DType::F64)
            .unwrap()
            .view(&[3, 4])
            .unwrap();
        let col = base.select(1, 2).unwrap();
        let t = base.transpose(0, 1).unwrap();
        q.put((base.clone(), col, t)).unwrap();
        let (b, c, t) = q.get().unwrap();
        assert_eq!(
            b.to_vec::<f64>().unwrap(),
            (0..12).map(f64::from).collect::<Vec<_>>()
        );
        assert_eq!(c.shape(), &[3]);
        assert_eq!(c.strides(), &[4]);
        assert_eq!(c.storage_offset(), 2);
        assert_eq!(c.to_vec::<f64>().unwrap(), vec![2.0, 6.0, 10.0]);
        assert_eq!(t.shape(), &[4, 3]);
        assert_eq!(
            b.storage().data_ptr(),
            c.storage().data_ptr(),
            "views of one storage alias"
        );
        assert_eq!(b.storage().data_ptr(), t.storage().data_ptr());
        // Put before the get: sender and receiver alias afterwards.
        b.fill_(1.5).unwrap();
        assert_eq!(base.to_vec::<f64>().unwrap(), vec![1.5; 12]);
    });
}

#[test]
fn test_fs() {
    common::run(DEADLINE, || {
        set_sharing_strategy(SharingStrategy::FileSystem);
        let before = common::our_segments();
        let q = SimpleQueue::new().unwrap();
        let t = Tensor::full(&[100], 2.0, DType::F32).unwrap();
        q.put(t.clone()).unwrap();
        let name = t
            .storage()
            .shm_name()
            .expect("a file_system storage has a name");
        assert!(
            common::our_segments().contains(&name),
            "{name} is in /dev/shm while used"
        );
        let got = q.get().unwrap();
        assert_eq!(got.sum(), 200.0);
        drop((t, got, q));
        assert_eq!(
            common::our_segments(),
            before,
            "the last user unlinked {name}"
        );
        set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}

#[test]
fn test_is_shared() {
    for_each_strategy(|_| {
        let t = Tensor::full(&[5, 5], 3.0, DType::F32).unwrap();
        assert!(!t.is_shared());
        t.share_memory_().unwrap();
        assert!(t.is_shared());
        let v = t.narrow(0, 1, 2).unwrap();
        assert!(
            v.is_shared(),
            "views follow their storage into shared memory"
        );
        assert_eq!(t.sum(), 75.0);
    });
}

fn add_three(_rank: usize, t: Tensor) {
    t.add_scalar_(3.0).expect("add");
}

#[test]
fn test_inherit_tensor() {
    for_each_strategy(|_| {
        let t = Tensor::zeros(&[5, 5], DType::F32).unwrap();
        t.share_memory_().unwrap();
        let mut ctx = start_processes(add_three, t.clone(), 1, StartMethod::Fork).unwrap();
        assert!(ctx.join(Some(Duration::from_secs(30))).unwrap());
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0; 25]);
    });
}

const DTYPES: [DType; 10] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::Bool,
];

fn echo_tensors(
    _rank: usize,
    (inbox, outbox): (SimpleQueue<Vec<Tensor>>, SimpleQueue<Vec<Tensor>>),
) {
    let got = inbox.get().expect("get");
    outbox.put(got).expect("put");
}

#[test]
fn test_empty_tensors() {
    for_each_strategy(|_| {
        let empties: Vec<Tensor> = DTYPES
            .iter()
            .map(|&d| Tensor::zeros(&[0, 3], d).unwrap())
            .collect();
        let (inbox, outbox) = (SimpleQueue::new().unwrap(), SimpleQueue::new().unwrap());
        inbox.put(empties).unwrap();
        let mut ctx =
            start_processes(echo_tensors, (inbox, outbox.clone()), 1, StartMethod::Spawn).unwrap();
        let back = outbox
            .get_timeout(Duration::from_secs(30))
            .unwrap()
            .expect("echo");
        assert_eq!(back.len(), DTYPES.len());
        for (t, d) in back.iter().zip(DTYPES) {
            assert_eq!(t.dtype(), d);
            assert_eq!(t.shape(), &[0, 3]);
            assert_eq!(t.numel(), 0);
        }
        assert!(ctx.join(Some(Duration::from_secs(30))).unwrap());
    });
}

fn produce_and_exit(_rank: usize, queue: SimpleQueue<Tensor>) {
    queue
        .put(Tensor::full(&[1 << 16], 7.0, DType::F32).expect("full"))
        .expect("put");
}

#[test]
fn test_producer_exits_before_the_tensor_is_read() {
    for_each_strategy(|_| {
        let queue = SimpleQueue::new().unwrap();
        let mut ctx =
            start_processes(produce_and_exit, queue.clone(), 1, StartMethod::Spawn).unwrap();
        assert!(ctx.join(Some(Duration::from_secs(30))).unwrap());
        let t = queue
            .get_timeout(Duration::from_secs(30))
            .unwrap()
            .expect("tensor lost");
        assert_eq!(t.sum(), 7.0 * 65536.0);
    });
}

fn fill_and_copy(t: Tensor) -> multiproc::Result<Tensor> {
    t.fill_(4.0)?;
    let copy = t.deep_clone()?;
    copy.add_scalar_(1.0)?;
    Ok(copy)
}

#[test]
fn test_pool() {
    for_each_strategy(|_| {
        let pool = Pool::new(2).unwrap();
        for _ in 0..REPEAT {
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
}
