//! Tensors shared between processes, for both sharing strategies. Ported from torch's
//! test_multiprocessing.py where there is a counterpart (its name is the test's name),
//! plus the cases torch cannot do (a producer that has already exited).
//!
//! Every test runs under [`guarded`]: one at a time (they set the process-wide sharing
//! strategy and count this process's children, fds and /dev/shm entries), on a thread
//! with a deadline, and ends with a check that no worker, no fd and no segment of ours
//! was left behind.

multiproc::test_init!();

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use multiproc::{
    DType, Event, Process, Queue, SharingStrategy, SimpleQueue, StartMethod, Storage, Tensor,
    set_sharing_strategy, start_processes,
};

// ---------------------------------------------------------------------------------------
// Harness.

static SERIAL: Mutex<()> = Mutex::new(());

/// torch repeats its leak-prone tests this many times.
const TEST_REPEATS: usize = 30;

/// How many small received segments a process keeps mapped after use.
const RECENT_SEGMENTS: usize = 8;

fn our_children() -> BTreeSet<i32> {
    let me = std::process::id() as i32;
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let comm = stat.find('(').map_or("", |open| &stat[open + 1..close]);
        let ppid = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(me) && comm != "multiproc-fsrv" {
            out.insert(pid);
        }
    }
    out
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Our named segments in /dev/shm.
fn shm_segments() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("multiproc_"))
        .collect()
}

/// Makes the resources this process keeps for its whole life exist before a test
/// counts fds: the fork server, the current small-storage arena, the connection to the
/// shm manager.
fn prime() {
    multiproc::ensure_forkserver_running().expect("fork server");
    let t = Tensor::zeros(&[1], DType::U8).unwrap();
    t.share_memory_().unwrap();
    set_sharing_strategy(SharingStrategy::FileSystem);
    Tensor::zeros(&[1], DType::U8)
        .unwrap()
        .share_memory_()
        .unwrap();
    set_sharing_strategy(SharingStrategy::FileDescriptor);
}

/// Runs `body` alone, on its own thread, failing if it takes longer than `limit`; then
/// checks that it left no worker, no fd and no /dev/shm segment behind.
fn guarded(limit: Duration, body: impl FnOnce() + Send + 'static) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    prime();
    let children_before = our_children();
    let fds_before = open_fds();
    let shm_before = shm_segments();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
        let _ = done_tx.send(());
        result
    });
    let outcome = done_rx.recv_timeout(limit);
    set_sharing_strategy(SharingStrategy::FileDescriptor);
    assert!(outcome.is_ok(), "the test ran past its {limit:?} deadline");
    if let Err(panic) = runner.join().expect("runner thread") {
        std::panic::resume_unwind(panic);
    }
    let left: Vec<i32> = our_children()
        .difference(&children_before)
        .copied()
        .collect();
    assert!(left.is_empty(), "worker processes left behind: {left:?}");
    // A process keeps the 8 small segments it received last mapped (each an fd), so a
    // consumer of small tensors does not map and unmap an arena per tensor: bounded, so
    // allowed here.
    let fds_after = open_fds();
    assert!(
        fds_after <= fds_before + RECENT_SEGMENTS,
        "fds grew from {fds_before} to {fds_after}"
    );
    // Segments are unlinked by their last user as it drops them, so this is immediate;
    // the short wait only absorbs a worker that is still exiting.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let new: Vec<String> = shm_segments().difference(&shm_before).cloned().collect();
        if new.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "segments left in /dev/shm: {new:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Runs `test` once per sharing strategy (the setting is inherited by workers).
fn for_each_strategy(test: impl Fn(SharingStrategy)) {
    for &strategy in multiproc::get_all_sharing_strategies() {
        set_sharing_strategy(strategy);
        test(strategy);
    }
}

fn all_equal(t: &Tensor, value: f64) -> bool {
    t.allclose(
        &Tensor::full(t.shape(), value, t.dtype()).unwrap(),
        0.0,
        0.0,
    )
}

// ---------------------------------------------------------------------------------------
// Workers (functions of this executable, found again by the spawned copies).

/// torch's `simple_fill`: fill the first tensor received with 4, then set the event.
fn simple_fill(_rank: usize, (queue, event): (Queue<Vec<Tensor>>, Event)) -> multiproc::Result<()> {
    let data = queue.get()?;
    data[0].fill_(4.0)?;
    event.set();
    Ok(())
}

/// torch's `send_tensor`: put the same ones tensor twice, wait for the event.
fn send_tensor(_rank: usize, (queue, event): (Queue<Tensor>, Event)) -> multiproc::Result<()> {
    let t = Tensor::ones(&[5, 5], DType::F64)?;
    queue.put(t.clone())?;
    queue.put(t)?;
    event.wait(Some(secs(30)))?;
    Ok(())
}

/// Puts a fresh tensor and returns at once: the parent gets it after we are gone.
fn put_and_exit(_rank: usize, (queue, value): (SimpleQueue<Tensor>, f64)) -> multiproc::Result<()> {
    let t = Tensor::full(&[1000], value, DType::F32)?;
    queue.put(t.narrow(0, 10, 20)?)?;
    Ok(())
}

/// torch's `SubProcess.run`: add 3 in place to the tensor it was given.
fn add_three(_rank: usize, t: Tensor) -> multiproc::Result<()> {
    t.add_scalar_(3.0)
}

/// A tensor and the dtype and shape a worker saw.
type Echo = (Tensor, DType, Vec<usize>);

/// Sends back each empty tensor it receives, with its dtype and shape as it saw them.
fn echo_empty(
    _rank: usize,
    (inbox, outbox): (SimpleQueue<Option<Tensor>>, SimpleQueue<Echo>),
) -> multiproc::Result<()> {
    while let Some(t) = inbox.get()? {
        let (dtype, shape) = (t.dtype(), t.shape().to_vec());
        outbox.put((t, dtype, shape))?;
    }
    Ok(())
}

/// Hogwild: adds 1 to its own row `steps` times.
fn add_to_row(rank: usize, (t, steps): (Tensor, usize)) -> multiproc::Result<()> {
    let row = t.select(0, rank)?;
    for _ in 0..steps {
        row.add_scalar_(1.0)?;
    }
    Ok(())
}

/// Lowers its own fd limit, then shares file_descriptor tensors until that limit is
/// hit: the error must be an `FdLimit` that names the limit and the way out.
fn hit_the_fd_limit(_rank: usize, _: ()) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let open = open_fds() as u64;
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open + 8),
            maximum,
        },
    )
    .map_err(|e| e.to_string())?;
    let mut keep = Vec::new();
    for _ in 0..64 {
        let t = Tensor::zeros(&[128 << 10], DType::U8).map_err(|e| e.to_string())?;
        match t.share_memory_() {
            Ok(()) => keep.push(t),
            Err(multiproc::Error::FdLimit(m)) => {
                return if m.contains(&format!("limit {}", open + 8)) && m.contains("FileSystem") {
                    Ok(())
                } else {
                    Err(format!("unhelpful message: {m}"))
                };
            }
            Err(e) => return Err(format!("wrong error: {e:?}")),
        }
    }
    Err("never hit the fd limit".into())
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn test_fill() {
    guarded(secs(120), || {
        for_each_strategy(|strategy| {
            for method in StartMethod::ALL {
                let x = Tensor::zeros(&[5, 5], DType::F32).unwrap();
                let queue = Queue::new().unwrap();
                let event = Event::new().unwrap();
                let data = vec![x.clone(), x.select(1, 1).unwrap()];
                queue.put(data.clone()).unwrap();
                let mut ctx =
                    start_processes(simple_fill, (queue, event.clone()), 1, method).unwrap();
                assert!(
                    event.wait(Some(secs(30))).unwrap(),
                    "{strategy}/{method}: the child did not fill in time"
                );
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
                assert!(ctx.join(Some(secs(30))).unwrap());
            }
        });
    });
}

#[test]
fn test_receive() {
    guarded(secs(120), || {
        for_each_strategy(|strategy| {
            for method in StartMethod::ALL {
                let queue = Queue::new().unwrap();
                let event = Event::new().unwrap();
                let mut ctx =
                    start_processes(send_tensor, (queue.clone(), event.clone()), 1, method)
                        .unwrap();
                let t1 = queue.get_timeout(secs(30)).unwrap().expect("first tensor");
                let t2 = queue.get_timeout(secs(30)).unwrap().expect("second tensor");
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
                assert!(ctx.join(Some(secs(30))).unwrap());
            }
        });
    });
}

#[test]
fn a_tensor_outlives_the_producer_that_put_it() {
    guarded(secs(60), || {
        for_each_strategy(|strategy| {
            let queue = SimpleQueue::new().unwrap();
            let mut ctx =
                start_processes(put_and_exit, (queue.clone(), 2.5), 1, StartMethod::Spawn).unwrap();
            assert!(
                ctx.join(Some(secs(30))).unwrap(),
                "the producer exited first"
            );
            let t: Tensor = queue.get_timeout(secs(5)).unwrap().expect("a tensor");
            assert_eq!(t.shape(), [20]);
            assert_eq!(t.storage_offset(), 10);
            assert_eq!(t.storage().nbytes(), 4000);
            assert!(all_equal(&t, 2.5), "{strategy}: {t:?}");
            t.fill_(1.0).unwrap();
            assert_eq!(t.sum(), 20.0);
        });
    });
}

#[test]
fn test_fs() {
    guarded(secs(60), || {
        set_sharing_strategy(SharingStrategy::FileSystem);
        for _ in 0..TEST_REPEATS {
            let before = shm_segments();
            let x = Storage::new(4 * 8).unwrap();
            let q = Queue::new().unwrap();
            assert!(!x.is_shared());
            q.put(x.clone()).unwrap();
            let name = x.shm_name().expect("file_system storages have a name");
            assert!(
                shm_segments().contains(&name) && !before.contains(&name),
                "the segment is visible in /dev/shm after put"
            );
            let back: Storage = q.get().unwrap();
            assert_eq!(back.shm_name().as_deref(), Some(name.as_str()));
            assert_eq!(back.data_ptr(), x.data_ptr());
            drop((x, back));
            assert!(
                !shm_segments().contains(&name),
                "the last user unlinked the segment"
            );
        }
    });
}

#[test]
fn test_is_shared() {
    guarded(secs(30), || {
        for_each_strategy(|strategy| {
            let t = Tensor::arange(0.0, 25.0, 1.0, DType::F32)
                .unwrap()
                .reshape(&[5, 5])
                .unwrap();
            assert!(!t.is_shared());
            t.share_memory_().unwrap();
            assert!(t.is_shared());
            assert_eq!(t.storage().sharing_strategy(), Some(strategy));
            assert_eq!(t.sum(), 300.0);
        });
    });
}

#[test]
fn test_inherit_tensor() {
    guarded(secs(60), || {
        for_each_strategy(|strategy| {
            let t = Tensor::zeros(&[5, 5], DType::F32).unwrap();
            t.share_memory_().unwrap();
            let mut p = Process::new(add_three, 0, t.clone()).start_method(StartMethod::Fork);
            p.start().unwrap();
            let status = p.join(Some(secs(30))).unwrap().expect("the child exited");
            assert!(status.success(), "{strategy}: {status:?} {:?}", p.error());
            assert!(all_equal(&t, 3.0), "{strategy}: {t:?}");
        });
    });
}

#[test]
fn put_and_get_in_one_process_preserve_values_views_and_aliasing() {
    guarded(secs(30), || {
        for_each_strategy(|strategy| {
            let x = Tensor::arange(0.0, 12.0, 1.0, DType::I64)
                .unwrap()
                .view(&[3, 4])
                .unwrap();
            let col = x.select(1, 2).unwrap();
            let q: Queue<(Tensor, Tensor, Tensor)> = Queue::new().unwrap();
            q.put((x.clone(), col.clone(), x.transpose(0, 1).unwrap()))
                .unwrap();
            let (rx, rcol, rt) = q.get().unwrap();
            assert_eq!(rx.to_vec::<i64>().unwrap(), (0..12).collect::<Vec<_>>());
            assert_eq!(
                (rcol.shape(), rcol.strides(), rcol.storage_offset()),
                (&[3][..], &[4][..], 2)
            );
            assert_eq!(rcol.to_vec::<i64>().unwrap(), [2, 6, 10]);
            assert_eq!(rt.strides(), [1, 4]);
            assert_eq!(rx.data_ptr(), x.data_ptr(), "{strategy}");
            rcol.fill_(-1.0).unwrap();
            assert_eq!(col.to_vec::<i64>().unwrap(), [-1, -1, -1]);
            assert_eq!(
                rt.select(0, 2).unwrap().to_vec::<i64>().unwrap(),
                [-1, -1, -1]
            );
        });
    });
}

#[test]
fn empty_tensors_of_every_dtype_cross_processes() {
    guarded(secs(60), || {
        for_each_strategy(|strategy| {
            let inbox = SimpleQueue::new().unwrap();
            let outbox = SimpleQueue::new().unwrap();
            let mut ctx = start_processes(
                echo_empty,
                (inbox.clone(), outbox.clone()),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            let dtypes = [
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
            for dtype in dtypes {
                for shape in [vec![0], vec![2, 0, 3]] {
                    inbox
                        .put(Some(Tensor::zeros(&shape, dtype).unwrap()))
                        .unwrap();
                    let (back, seen_dtype, seen_shape) =
                        outbox.get_timeout(secs(30)).unwrap().expect("an echo");
                    assert_eq!((seen_dtype, &seen_shape), (dtype, &shape), "{strategy}");
                    assert_eq!((back.dtype(), back.shape()), (dtype, &shape[..]));
                    assert_eq!(back.numel(), 0);
                    assert!(back.is_shared());
                }
            }
            inbox.put(None).unwrap();
            assert!(ctx.join(Some(secs(30))).unwrap());
        });
    });
}

#[test]
fn hogwild_workers_update_one_shared_tensor() {
    guarded(secs(120), || {
        for_each_strategy(|strategy| {
            let steps = 200;
            let t = Tensor::zeros(&[4, 256], DType::F32).unwrap();
            let mut ctx =
                start_processes(add_to_row, (t.clone(), steps), 4, StartMethod::Spawn).unwrap();
            assert!(ctx.join(Some(secs(60))).unwrap());
            assert!(t.is_shared(), "sending shared it in place");
            assert!(all_equal(&t, steps as f64), "{strategy}: {t:?}");
        });
    });
}

#[test]
fn a_large_tensor_is_shared_not_copied() {
    guarded(secs(60), || {
        for_each_strategy(|strategy| {
            let t = Tensor::zeros(&[16 << 20], DType::U8).unwrap();
            let q = Queue::new().unwrap();
            let event = Event::new().unwrap();
            let mut ctx = start_processes(
                simple_fill,
                (q.clone(), event.clone()),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            q.put(vec![t.clone()]).unwrap();
            assert!(event.wait(Some(secs(30))).unwrap());
            assert_eq!(t.sum(), 4.0 * (16 << 20) as f64, "{strategy}");
            assert!(ctx.join(Some(secs(30))).unwrap());
        });
    });
}

#[test]
fn the_fd_limit_is_a_clear_error() {
    guarded(secs(60), || {
        let mut ctx = start_processes(hit_the_fd_limit, (), 1, StartMethod::Spawn).unwrap();
        assert!(ctx.join(Some(secs(30))).unwrap());
    });
}
