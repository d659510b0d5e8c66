//! Tensors shared between processes, for both sharing strategies: what torch's own tests
//! do not cover (those are ported in torch_parity.rs) — a producer that has already
//! exited, views and aliasing, empty tensors, Hogwild updates, large tensors shared not
//! copied, the fd limit.
//!
//! Every test runs under `common::run`: one at a time, on a thread with a deadline,
//! ending with a check that no worker, no fd and no segment of ours was left behind.

multiproc::test_init!();

mod common;

use common::{all_equal, for_each_strategy, secs, simple_fill};

use multiproc::{
    DType, Event, Queue, SharingStrategy, SimpleQueue, StartMethod, Tensor, start_processes,
};

// ---------------------------------------------------------------------------------------
// Harness.

// ---------------------------------------------------------------------------------------
// Workers (functions of this executable, found again by the spawned copies).

/// Puts a fresh tensor and returns at once: the parent gets it after we are gone.
fn put_and_exit(_rank: usize, (queue, value): (SimpleQueue<Tensor>, f64)) -> multiproc::Result<()> {
    let t = Tensor::full(&[1000], value, DType::F32)?;
    queue.put(t.narrow(0, 10, 20)?)?;
    Ok(())
}

/// Puts `count` tensors of 1 MiB (a block each) and returns.
fn put_large_tensors(
    _rank: usize,
    (queue, count): (Queue<Tensor>, usize),
) -> multiproc::Result<()> {
    for i in 0..count {
        queue.put(Tensor::full(&[1 << 18], i as f64, DType::F32)?)?;
    }
    Ok(())
}

/// A tensor, and maybe a second one: what `retry_at_the_fd_limit` receives.
type OneOrTwo = (Tensor, Option<Tensor>);

/// Keeps the tensor of a first message; then, with no fd left, gets a message that
/// names that tensor's block and a new one (whose fd must come out of the queue's
/// custody): that get must fail with `FdLimit`, and the same message must come on the
/// next get once an fd is free. Drops everything and says so.
fn retry_at_the_fd_limit(
    _rank: usize,
    (inbox, done): (Queue<OneOrTwo>, Queue<bool>),
) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let (kept, _) = inbox.get_timeout(secs(30)).map_err(|e| e.to_string())?;
    let limit = getrlimit(Resource::Nofile);
    let set = |current: Option<u64>| {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current,
                maximum: limit.maximum,
            },
        )
        .map_err(|e| e.to_string())
    };
    // The limit is on fd numbers: set it to the lowest free one, so that no new fd
    // can be made at all.
    let lowest_free = {
        use std::os::fd::AsRawFd;
        let probe = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
        probe.as_raw_fd() as u64
    };
    set(Some(lowest_free))?;
    let first = inbox.get_timeout(secs(30));
    set(limit.current)?;
    match first {
        Err(multiproc::Error::FdLimit { .. }) => {}
        other => return Err(format!("expected FdLimit at the limit, got {other:?}")),
    }
    let (again, new) = inbox.get_timeout(secs(30)).map_err(|e| e.to_string())?;
    let new = new.ok_or("the second message lost its second tensor")?;
    if !all_equal(&kept, 1.0) || !all_equal(&again, 1.0) || !all_equal(&new, 2.0) {
        return Err("the retried message's tensors have the wrong values".into());
    }
    drop((kept, again, new));
    done.put(true).map_err(|e| e.to_string())
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
    let open = common::open_fds() as u64;
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
            Err(e @ multiproc::Error::FdLimit { soft, in_use, .. }) => {
                let m = e.to_string();
                return if soft == Some(open + 8)
                    && in_use as u64 >= open
                    && m.contains(&format!("soft limit is {}", open + 8))
                    && m.contains("ulimit -n")
                    && m.contains("file_system")
                {
                    Ok(())
                } else {
                    Err(format!("unhelpful error: {e:?}: {m}"))
                };
            }
            Err(e) => return Err(format!("wrong error: {e:?}")),
        }
    }
    Err("never hit the fd limit".into())
}

/// A consumer under RLIMIT_NOFILE 256 that keeps 2,000 received small tensors alive:
/// small storages share pooled arenas, so it needs a handful of fds, not 2,000.
fn keep_2000_small_tensors(
    _rank: usize,
    (inbox, done): (Queue<Tensor>, Queue<usize>),
) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(256),
            maximum,
        },
    )
    .map_err(|e| e.to_string())?;
    let mut kept = Vec::with_capacity(2000);
    for i in 0..2000 {
        let t = inbox.get().map_err(|e| format!("tensor {i}: {e}"))?;
        kept.push(t);
    }
    let ok = kept
        .iter()
        .enumerate()
        .filter(|(i, t)| all_equal(t, *i as f64))
        .count();
    done.put(ok).map_err(|e| e.error.to_string())?;
    Ok(())
}

/// Under a limit of 64 fds, keeps received large tensors (one fd each) until a `get`
/// fails for lack of fds; that error must be `FdLimit` with the figures, and after the
/// consumer drops tensors the very message that failed arrives: nothing is lost.
/// Reports `(kept before the limit, fds in use then, tensors checked in order)`.
fn keep_large_tensors_until_the_fd_limit(
    _rank: usize,
    (inbox, done, count): (Queue<Tensor>, Queue<(usize, usize, usize)>, usize),
) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(64),
            maximum,
        },
    )
    .map_err(|e| e.to_string())?;
    let mut kept: Vec<Tensor> = Vec::new();
    let mut next = 0usize;
    let mut first_failure = None;
    while next < count {
        match inbox.get() {
            Ok(t) => {
                if !all_equal(&t, next as f64) {
                    return Err(format!("tensor {next} arrived out of order or wrong"));
                }
                next += 1;
                kept.push(t);
            }
            Err(e @ multiproc::Error::FdLimit { soft, in_use, .. }) => {
                if soft != Some(64) || !e.to_string().contains("ulimit -n") {
                    return Err(format!("unhelpful error: {e:?}"));
                }
                first_failure.get_or_insert((kept.len(), in_use));
                // Make room: drop half of what is kept, then get the same message again.
                kept.truncate(kept.len() / 2);
            }
            Err(e) => return Err(format!("tensor {next}: wrong error: {e:?}")),
        }
    }
    let (before, in_use) = first_failure.ok_or("never hit the fd limit")?;
    done.put((before, in_use, next))
        .map_err(|e| e.error.to_string())?;
    Ok(())
}

/// Under a limit of 64 fds, starts 100 workers: the error is `FdLimit`.
fn spawn_100_under_64_fds(_rank: usize, _: ()) -> Result<(), String> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(64),
            maximum,
        },
    )
    .map_err(|e| e.to_string())?;
    fn idle(_rank: usize, _: ()) {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    match multiproc::start_processes(idle, (), 100, StartMethod::Spawn) {
        Err(e @ multiproc::Error::FdLimit { soft: Some(64), .. }) => {
            if e.to_string().contains("ulimit -n") {
                Ok(())
            } else {
                Err(format!("unhelpful error: {e}"))
            }
        }
        Err(e) => Err(format!("wrong error: {e:?}")),
        Ok(_) => Err("100 workers started under 64 fds".into()),
    }
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn a_get_at_the_fd_limit_is_fd_limit_and_loses_nothing() {
    common::run(secs(120), || {
        const COUNT: usize = 120;
        let (inbox, done) = (Queue::with_capacity(16).unwrap(), Queue::new().unwrap());
        let mut ctx = start_processes(
            keep_large_tensors_until_the_fd_limit,
            (inbox.clone(), done.clone(), COUNT),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        for i in 0..COUNT {
            // 256 KiB: above the arena size limit, so one block (one fd) per tensor.
            let t = Tensor::full(&[64 << 10], i as f64, DType::F32).unwrap();
            inbox.put_timeout(t, secs(60)).unwrap();
        }
        let (before, in_use, got) = done.get_timeout(secs(60)).expect("the consumer's report");
        eprintln!(
            "fd limit 64: {before} large tensors kept before the first FdLimit ({in_use} fds in use); \
             {got} of {COUNT} then received in order"
        );
        assert_eq!(got, COUNT);
        ctx.join_timeout(secs(30)).unwrap();
    });
}

/// A shared tensor larger than this process may still commit is an error naming the
/// size, the limit and its source, for both strategies (not the OOM killer's SIGKILL at
/// the first touch of a page); a memfd's error does not talk about /dev/shm.
#[test]
fn a_shared_tensor_beyond_the_memory_limit_is_out_of_shared_memory() {
    common::run(secs(60), || {
        for_each_strategy(|strategy| {
            const TIB: usize = 1 << 40;
            let err = Tensor::zeros_shared(&[TIB], DType::U8).expect_err("1 TiB cannot fit");
            let multiproc::Error::OutOfSharedMemory {
                size,
                limit,
                limit_source,
                message,
            } = &err
            else {
                panic!("{strategy}: expected OutOfSharedMemory, got {err:?}");
            };
            assert!(*size >= TIB as u64, "{strategy}: {err:?}");
            assert!(limit.is_some_and(|l| l < TIB as u64), "{strategy}: {err:?}");
            assert!(
                limit_source.contains("cgroup") || limit_source.contains("MemAvailable"),
                "{strategy}: {err:?}"
            );
            assert!(message.contains("1.0 TiB") && message.contains(limit_source.as_str()));
            match strategy {
                SharingStrategy::FileDescriptor => {
                    assert!(
                        !message.contains("/dev/shm"),
                        "a memfd is not bounded by /dev/shm: {message}"
                    )
                }
                SharingStrategy::FileSystem => {
                    assert!(message.contains("192-byte header"), "{message}")
                }
            }
        });
    });
}

#[test]
fn spawning_past_the_fd_limit_is_fd_limit() {
    common::run(secs(120), || {
        let mut ctx = start_processes(spawn_100_under_64_fds, (), 1, StartMethod::Spawn).unwrap();
        if let Err(e) = ctx.join_timeout(secs(60)) {
            panic!("{e}");
        }
    });
}

#[test]
fn a_consumer_under_a_256_fd_limit_keeps_2000_received_tensors() {
    common::run(secs(120), || {
        for_each_strategy(|strategy| {
            let (inbox, done) = (Queue::with_capacity(64).unwrap(), Queue::new().unwrap());
            let mut ctx = start_processes(
                keep_2000_small_tensors,
                (inbox.clone(), done.clone()),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            for i in 0..2000 {
                let t = Tensor::full(&[64], f64::from(i), DType::F32).unwrap();
                inbox.put_timeout(t, secs(60)).unwrap();
            }
            assert_eq!(done.get_timeout(secs(60)).unwrap(), 2000, "{strategy}");
            ctx.join_timeout(secs(30)).expect("{strategy}");
        });
    });
}

#[test]
fn the_blocks_of_a_joined_worker_are_let_go_when_it_is_joined() {
    // A receiver keeps the blocks it received mapped for reuse, but the blocks of a
    // worker that has ended can never come back: joining the worker lets them go, so
    // their memory (and, for file_descriptor, their fds) is not held until some later
    // receive happens to notice.
    common::run(secs(60), || {
        for_each_strategy(|strategy| {
            let fds = common::open_fds();
            let queue = Queue::new().unwrap();
            let mut ctx =
                start_processes(put_large_tensors, (queue.clone(), 3), 1, StartMethod::Spawn)
                    .unwrap();
            for i in 0..3 {
                let t = queue.get_timeout(secs(10)).expect("a tensor");
                assert!(all_equal(&t, i as f64), "{strategy}: tensor {i}");
            }
            drop(queue);
            ctx.join_timeout(secs(30)).expect("the producer");
            drop(ctx);
            assert_eq!(
                common::open_fds(),
                fds,
                "{strategy}: fds after the join ({})",
                common::fd_targets().join(", ")
            );
        });
    });
}

#[test]
fn a_message_retried_after_the_fd_limit_gives_each_block_back_once() {
    // A message that names a block the getter maps already and one it must take out of
    // the queue's custody fails at the fd limit after the first handle adopted its
    // use; the message is kept and decoded again. Each use must be given back once:
    // one too many would let the producer's recycler hand the first block out again
    // while the producer still holds a tensor on it.
    common::run(secs(60), || {
        let (inbox, done) = (Queue::new().unwrap(), Queue::new().unwrap());
        let mut ctx = start_processes(
            retry_at_the_fd_limit,
            (inbox.clone(), done.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        // 256 KiB each: above the arena limit, so each is a block of its own.
        let kept = Tensor::full(&[64 << 10], 1.0, DType::F32).unwrap();
        let second = Tensor::full(&[64 << 10], 2.0, DType::F32).unwrap();
        inbox.put((kept.clone(), None)).unwrap();
        inbox.put((kept.clone(), Some(second))).unwrap();
        ctx.join_timeout(secs(30)).expect("the getter");
        assert!(done.get_timeout(secs(5)).expect("the getter's report"));
        // New tensors of the same size reuse idle blocks: never the one `kept` is on.
        let fresh: Vec<Tensor> = (0..4)
            .map(|_| {
                let t = Tensor::empty_shared(&[64 << 10], DType::F32).unwrap();
                t.fill_(9.0).unwrap();
                t
            })
            .collect();
        assert!(
            all_equal(&kept, 1.0),
            "a block still in use was handed out again"
        );
        drop(fresh);
    });
}

#[test]
fn a_tensor_outlives_the_producer_that_put_it() {
    common::run(secs(60), || {
        for_each_strategy(|strategy| {
            let queue = SimpleQueue::new().unwrap();
            let mut ctx =
                start_processes(put_and_exit, (queue.clone(), 2.5), 1, StartMethod::Spawn).unwrap();
            ctx.join_timeout(secs(30))
                .expect("the producer exited first");
            let t: Tensor = queue.get_timeout(secs(5)).expect("a tensor");
            assert_eq!(t.shape(), [20]);
            assert_eq!(t.storage_offset(), 10);
            assert_eq!(t.storage().nbytes(), 4000);
            assert!(all_equal(&t, 2.5), "{strategy}: {t:?}");
            t.fill_(1.0).unwrap();
            assert_eq!(t.sum().unwrap(), 20.0);
        });
    });
}

#[test]
fn put_and_get_in_one_process_preserve_values_views_and_aliasing() {
    common::run(secs(30), || {
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
    common::run(secs(60), || {
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
            for dtype in DType::ALL {
                for shape in [vec![0], vec![2, 0, 3]] {
                    inbox
                        .put(Some(Tensor::zeros(&shape, dtype).unwrap()))
                        .unwrap();
                    let (back, seen_dtype, seen_shape) =
                        outbox.get_timeout(secs(30)).expect("an echo");
                    assert_eq!((seen_dtype, &seen_shape), (dtype, &shape), "{strategy}");
                    assert_eq!((back.dtype(), back.shape()), (dtype, &shape[..]));
                    assert_eq!(back.numel(), 0);
                    assert!(back.is_shared());
                }
            }
            inbox.put(None).unwrap();
            ctx.join_timeout(secs(30)).unwrap();
        });
    });
}

#[test]
fn hogwild_workers_update_one_shared_tensor() {
    common::run(secs(120), || {
        for_each_strategy(|strategy| {
            let steps = 200;
            let t = Tensor::zeros(&[4, 256], DType::F32).unwrap();
            let mut ctx =
                start_processes(add_to_row, (t.clone(), steps), 4, StartMethod::Spawn).unwrap();
            ctx.join_timeout(secs(60)).unwrap();
            assert!(t.is_shared(), "sending shared it in place");
            assert!(all_equal(&t, steps as f64), "{strategy}: {t:?}");
        });
    });
}

#[test]
fn a_large_tensor_is_shared_not_copied() {
    common::run(secs(60), || {
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
            event.wait_timeout(secs(30)).unwrap();
            assert_eq!(t.sum().unwrap(), 4.0 * (16 << 20) as f64, "{strategy}");
            ctx.join_timeout(secs(30)).unwrap();
        });
    });
}

#[test]
fn the_fd_limit_is_a_clear_error() {
    common::run(secs(60), || {
        let mut ctx = start_processes(hit_the_fd_limit, (), 1, StartMethod::Spawn).unwrap();
        ctx.join_timeout(secs(30)).unwrap();
    });
}

/// Receives a tensor and sends it straight on (torch warns against this for CUDA
/// tensors; CPU tensors here just travel on by handle).
fn forward(_rank: usize, (inbox, outbox): (Queue<Tensor>, Queue<Tensor>)) -> multiproc::Result<()> {
    let t = inbox.get()?;
    t.add_scalar_(1.0)?;
    outbox.put(t)?;
    Ok(())
}

#[test]
fn a_received_tensor_can_be_sent_on() {
    common::run(secs(60), || {
        for_each_strategy(|strategy| {
            let (inbox, outbox) = (Queue::new().unwrap(), Queue::new().unwrap());
            let mut ctx = start_processes(
                forward,
                (inbox.clone(), outbox.clone()),
                1,
                StartMethod::Spawn,
            )
            .unwrap();
            let small = Tensor::zeros(&[16], DType::F32).unwrap();
            inbox.put(small.clone()).unwrap();
            let back = outbox.get_timeout(secs(30)).expect("forwarded");
            assert!(
                all_equal(&small, 1.0),
                "{strategy}: the worker wrote the parent's memory"
            );
            back.add_scalar_(1.0).unwrap();
            assert!(
                all_equal(&small, 2.0),
                "{strategy}: what came back aliases what was sent"
            );
            ctx.join_timeout(secs(30)).unwrap();
        });
    });
}
