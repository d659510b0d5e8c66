//! Distributed: the torchrun environment `spawn` gives its workers, torchelastic error
//! files, and the shared-memory collectives of `ProcessGroup` across spawned ranks
//! (values checked, a rank killed mid-collective).

multiproc::test_init!();

mod common;

use std::time::Duration;

use multiproc::dist::{Env, Launcher};
use multiproc::{Error, SimpleQueue, SpawnOptions, StartMethod};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

// ---------------------------------------------------------------------------------------
// The environment.

/// What a worker saw: its Env, and the caller's variables.
type Seen = (usize, Env, Option<String>, Option<String>);

fn report_env(rank: usize, q: SimpleQueue<Seen>) -> multiproc::Result<()> {
    let env = Env::detect()?;
    q.put((
        rank,
        env,
        std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        std::env::var("K").ok(),
    ))?;
    Ok(())
}

#[test]
fn workers_see_torchruns_contract_and_their_own_variables() {
    common::run(secs(60), || {
        for method in StartMethod::ALL {
            let q = SimpleQueue::new().unwrap();
            SpawnOptions::new()
                .start_method(method)
                .env("K", "v")
                .env_per_rank(|rank| vec![("CUDA_VISIBLE_DEVICES", (rank + 4).to_string())])
                .spawn(report_env, q.clone(), 3)
                .unwrap();
            let mut seen: Vec<Seen> = (0..3).map(|_| q.get().unwrap()).collect();
            seen.sort_by_key(|s| s.0);
            let port = seen[0].1.master_port;
            let run_id = seen[0].1.run_id.clone();
            assert!(port.is_some_and(|p| p > 0), "{method}: {seen:?}");
            assert!(
                run_id
                    .as_deref()
                    .is_some_and(|r| r.starts_with("multiproc-"))
            );
            for (rank, env, cuda, k) in seen {
                assert_eq!(env.launcher, Launcher::Multiproc, "{method}");
                assert_eq!((env.rank, env.local_rank), (rank, rank), "{method}");
                assert_eq!((env.world_size, env.local_world_size), (3, 3), "{method}");
                assert_eq!((env.node_rank, env.restart_count), (0, 0), "{method}");
                assert_eq!(env.master_addr.as_deref(), Some("127.0.0.1"), "{method}");
                assert_eq!(env.master_port, port, "{method}: one port for the group");
                assert_eq!(env.run_id, run_id, "{method}: one run id for the group");
                assert_eq!(cuda, Some((rank + 4).to_string()), "{method}");
                assert_eq!(k.as_deref(), Some("v"), "{method}");
            }
        }
    });
}

#[test]
fn a_callers_master_port_wins() {
    common::run(secs(60), || {
        let q = SimpleQueue::new().unwrap();
        SpawnOptions::new()
            .env("MASTER_PORT", "29123")
            .spawn(report_env, q.clone(), 1)
            .unwrap();
        let (_, env, _, _) = q.get().unwrap();
        assert_eq!(env.master_port, Some(29123));
    });
}

// ---------------------------------------------------------------------------------------
// torchelastic error files.

fn fail_how(rank: usize, panic: bool) -> Result<(), String> {
    if panic {
        panic!("rank {rank} panicked on purpose");
    }
    Err(format!("rank {rank} returned an error on purpose"))
}

#[test]
fn a_failed_worker_writes_torchelastics_error_file() {
    common::run(secs(60), || {
        let dir = std::env::temp_dir().join(format!("multiproc-errfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for panic in [true, false] {
            let path = dir.join(format!("error-{panic}.json"));
            let _ = std::fs::remove_file(&path);
            let err = SpawnOptions::new()
                .env("TORCHELASTIC_ERROR_FILE", path.to_str().unwrap())
                .spawn(fail_how, panic, 1)
                .unwrap_err();
            assert!(matches!(err, Error::ProcessRaised { .. }), "{err}");
            let text = std::fs::read_to_string(&path).expect("the worker wrote its error file");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let message = v["message"]["message"].as_str().unwrap();
            let want = if panic {
                "panicked on purpose"
            } else {
                "returned an error on purpose"
            };
            assert!(message.contains(want), "{message}");
            let stack = v["message"]["extraInfo"]["py_callstack"].as_str().unwrap();
            if panic {
                assert!(
                    stack.contains("fail_how"),
                    "the backtrace names the worker: {stack}"
                );
            }
            let ts: u64 = v["message"]["extraInfo"]["timestamp"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(ts > 1_600_000_000);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

// ---------------------------------------------------------------------------------------
// Collectives through shared memory.

use multiproc::dist::{ProcessGroup, ReduceOp};
use multiproc::{DType, Tensor};

/// Checks every collective's values on rank `rank` of `p`; `n` elements per tensor
/// (more than one chunk when large).
fn collectives(rank: usize, (group, n): (ProcessGroup, usize)) -> Result<(), String> {
    let p = group.world_size();
    let e = |e: Error| e.to_string();
    let check = |what: &str, got: Vec<f64>, want: &dyn Fn(usize) -> f64| -> Result<(), String> {
        for (i, g) in got.iter().enumerate() {
            if *g != want(i) {
                return Err(format!(
                    "rank {rank}: {what}[{i}] = {g}, expected {}",
                    want(i)
                ));
            }
        }
        Ok(())
    };
    let v = |i: usize, r: usize| ((i % 1000) as f64) + 10.0 * r as f64;
    let mine: Vec<f64> = (0..n).map(|i| v(i, rank)).collect();
    let t = Tensor::from_vec(mine.clone(), &[n]).map_err(e)?;

    group.all_reduce_(&t, ReduceOp::Sum).map_err(e)?;
    check("sum", t.to_vec::<f64>().map_err(e)?, &|i| {
        (0..p).map(|r| v(i, r)).sum()
    })?;
    for (op, f) in [(ReduceOp::Max, p - 1), (ReduceOp::Min, 0)] {
        let t = Tensor::from_vec(mine.clone(), &[n]).map_err(e)?;
        group.all_reduce_(&t, op).map_err(e)?;
        check(&format!("{op:?}"), t.to_vec::<f64>().map_err(e)?, &|i| {
            v(i, f)
        })?;
    }
    let f = Tensor::from_vec(vec![rank as f32 * 2.0; n], &[n]).map_err(e)?;
    group
        .all_reduce_async(&f, ReduceOp::Mean)
        .wait()
        .map_err(e)?;
    let mean = (p - 1) as f64;
    check(
        "mean",
        f.to_vec::<f32>()
            .map_err(e)?
            .into_iter()
            .map(f64::from)
            .collect(),
        &|_| mean,
    )?;
    let ints = Tensor::from_vec(vec![rank as i64 + 1; 7], &[7]).map_err(e)?;
    group.all_reduce_(&ints, ReduceOp::Sum).map_err(e)?;
    let want = (p * (p + 1) / 2) as i64;
    if ints.to_vec::<i64>().map_err(e)? != vec![want; 7] {
        return Err(format!("rank {rank}: i64 sum wrong"));
    }

    let b = Tensor::from_vec(vec![rank as f64; n], &[n]).map_err(e)?;
    group.broadcast_(&b, p - 1).map_err(e)?;
    check("broadcast", b.to_vec::<f64>().map_err(e)?, &|_| {
        (p - 1) as f64
    })?;

    let small = Tensor::from_vec(vec![rank as f64; 3], &[3]).map_err(e)?;
    let gathered = Tensor::zeros(&[3 * p], DType::F64).map_err(e)?;
    group.all_gather(&gathered, &small).map_err(e)?;
    check("all_gather", gathered.to_vec::<f64>().map_err(e)?, &|i| {
        (i / 3) as f64
    })?;

    let input = Tensor::from_vec(
        (0..2 * p).map(|i| (i + rank) as f64).collect::<Vec<_>>(),
        &[2 * p],
    )
    .map_err(e)?;
    let out = Tensor::zeros(&[2], DType::F64).map_err(e)?;
    group
        .reduce_scatter(&out, &input, ReduceOp::Sum)
        .map_err(e)?;
    check("reduce_scatter", out.to_vec::<f64>().map_err(e)?, &|i| {
        (0..p).map(|r| (2 * rank + i + r) as f64).sum()
    })?;
    group.barrier().map_err(e)?;
    Ok(())
}

#[test]
fn collectives_across_spawned_ranks() {
    common::run(secs(120), || {
        // 3 ranks with tensors of 1.5 chunks (f64, 4 MiB slots), then 2 with small ones.
        for (p, n) in [(3usize, 768 * 1024usize), (2, 1001)] {
            let group = ProcessGroup::new_local(p).unwrap();
            multiproc::spawn(collectives, (group, n), p).unwrap();
        }
    });
}

/// Large tensors take the zero-copy path: the same tensor again (its peers' mapping
/// reused), more tensors than the peers keep mapped, views at an offset into one
/// storage, tensors dropped and replaced, each op, broadcasts from every rank, a
/// transposed view; then sizes that differ between ranks are an error on every rank,
/// and the group still works after it.
fn zero_copy_rounds(rank: usize, group: ProcessGroup) -> Result<(), String> {
    let p = group.world_size();
    let e = |e: Error| e.to_string();
    let n = 100_000; // 400 KB of f32: above the zero-copy threshold
    let base = Tensor::zeros(&[3 * n], DType::F32).map_err(e)?;
    let mut pool: Vec<Tensor> = (0..36)
        .map(|_| Tensor::zeros(&[n], DType::F32))
        .collect::<multiproc::Result<_>>()
        .map_err(e)?;
    for round in 0..90usize {
        let k = (round * 7) % (pool.len() + 3);
        let t = if k < pool.len() {
            pool[k].clone()
        } else {
            base.narrow(0, (k - pool.len()) * n, n).map_err(e)?
        };
        if round % 11 == 10 {
            pool[round % 36] = Tensor::zeros(&[n], DType::F32).map_err(e)?;
        }
        let (op, want) = match round % 4 {
            0 => (
                ReduceOp::Sum,
                (0..p).map(|r| (r + round) as f32).sum::<f32>(),
            ),
            1 => (ReduceOp::Max, (p - 1 + round) as f32),
            2 => (ReduceOp::Min, round as f32),
            _ => (
                ReduceOp::Mean,
                (0..p).map(|r| (r + round) as f32).sum::<f32>() / p as f32,
            ),
        };
        t.fill_((rank + round) as f64).map_err(e)?;
        group.all_reduce_(&t, op).map_err(e)?;
        if !t.is_shared() {
            return Err(format!(
                "rank {rank}: round {round} did not take the zero-copy path"
            ));
        }
        let got = t.to_vec::<f32>().map_err(e)?;
        if let Some(i) = got.iter().position(|&x| x != want) {
            return Err(format!(
                "rank {rank} round {round} ({op:?}): [{i}] = {}, expected {want}",
                got[i]
            ));
        }
    }
    // Broadcasts from every rank, of tensors the peers already map and of a new one.
    for (src, known) in pool.iter().take(p).enumerate() {
        for t in [known.clone(), Tensor::zeros(&[n], DType::F32).map_err(e)?] {
            t.fill_((rank + 100) as f64).map_err(e)?;
            group.broadcast_(&t, src).map_err(e)?;
            let got = t.to_vec::<f32>().map_err(e)?;
            if got.iter().any(|&x| x != (src + 100) as f32) || !t.is_shared() {
                return Err(format!("rank {rank}: zero-copy broadcast from {src} wrong"));
            }
        }
    }
    // A transposed view: reduced through a contiguous copy, written back into the view.
    let square = Tensor::from_vec(
        (0..400 * 400)
            .map(|i| (i + rank) as f32)
            .collect::<Vec<_>>(),
        &[400, 400],
    )
    .map_err(e)?;
    let view = square.transpose(0, 1).map_err(e)?;
    group.all_reduce_(&view, ReduceOp::Sum).map_err(e)?;
    let sums = square.to_vec::<f32>().map_err(e)?;
    let want = |i: usize| (0..p).map(|r| (i + r) as f32).sum::<f32>();
    if let Some(i) = (0..sums.len()).find(|&i| sums[i] != want(i)) {
        return Err(format!("rank {rank}: transposed sum [{i}] = {}", sums[i]));
    }
    let odd = Tensor::zeros(&[n + rank], DType::F32).map_err(e)?;
    let err = group
        .all_reduce_(&odd, ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    if !err.contains("same size") {
        return Err(format!("rank {rank}: unexpected error {err}"));
    }
    let t = Tensor::full(&[n], 1.0, DType::F32).map_err(e)?;
    group.all_reduce_(&t, ReduceOp::Sum).map_err(e)?;
    if t.to_vec::<f32>().map_err(e)?.iter().any(|&x| x != p as f32) {
        return Err(format!("rank {rank}: wrong sum after the size error"));
    }
    Ok(())
}

#[test]
fn zero_copy_collectives_follow_the_ranks_storages() {
    common::run(secs(120), || {
        for p in [2usize, 3] {
            multiproc::spawn(zero_copy_rounds, ProcessGroup::new_local(p).unwrap(), p).unwrap();
        }
    });
}

#[test]
fn the_creating_process_is_not_a_rank() {
    common::run(secs(30), || {
        let group = ProcessGroup::new_local(2).unwrap();
        let t = Tensor::zeros(&[4], DType::F32).unwrap();
        let err = group.all_reduce_(&t, ReduceOp::Sum).unwrap_err();
        assert!(err.to_string().contains("not one of its ranks"), "{err}");
        let err = ProcessGroup::new_local(0).unwrap_err();
        assert!(err.to_string().contains("not 0"), "{err}");
    });
}

/// Rank 1 tells the parent it is in the loop, then waits to be killed; rank 0 reduces
/// until its call fails, and reports that error.
fn reduce_until_failure(
    rank: usize,
    (group, q): (ProcessGroup, SimpleQueue<Result<String, String>>),
) -> Result<(), String> {
    let t = Tensor::zeros(&[1 << 20], DType::F32).map_err(|e| e.to_string())?;
    let mut rounds = 0u64;
    loop {
        match group.all_reduce_(&t, ReduceOp::Sum) {
            Ok(()) => {
                rounds += 1;
                if rank == 1 && rounds == 3 {
                    q.put(Ok("ready".into())).map_err(|e| e.to_string())?;
                }
            }
            Err(e) => {
                q.put(Err(e.to_string())).map_err(|e| e.to_string())?;
                return match e {
                    Error::RankDied { rank: 1, .. } => Ok(()),
                    other => Err(format!("rank {rank}: unexpected error {other}")),
                };
            }
        }
    }
}

#[test]
fn a_rank_killed_mid_all_reduce_is_named_by_the_others() {
    common::run(secs(120), || {
        let group = ProcessGroup::new_local(2).unwrap();
        let q = SimpleQueue::new().unwrap();
        let mut ctx = SpawnOptions::new()
            .pre_termination_grace(Some(secs(60)))
            .start(reduce_until_failure, (group, q.clone()), 2)
            .unwrap();
        assert_eq!(q.get().unwrap(), Ok("ready".to_string()));
        let victim = ctx.pids()[1];
        let killed_at = std::time::Instant::now();
        // SAFETY: kill(2) takes plain integers; the pid is our unreaped child.
        assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
        let reported = q.get().unwrap().unwrap_err();
        let took = killed_at.elapsed();
        assert!(reported.contains("rank 1"), "{reported}");
        assert!(
            reported.contains(&victim.to_string()),
            "names the pid: {reported}"
        );
        assert!(took < secs(20), "the survivor learned it after {took:?}");
        let err = ctx.join_timeout(secs(60)).unwrap_err();
        match err {
            Error::ProcessExited {
                error_index,
                signal_name,
                others,
                ..
            } => {
                assert_eq!(error_index, 1);
                assert_eq!(signal_name.as_deref(), Some("SIGKILL"));
                assert!(others.is_empty(), "rank 0 finished cleanly: {others:?}");
            }
            other => panic!("expected rank 1's SIGKILL, got {other}"),
        }
    });
}

fn from_env_sum(rank: usize, _: ()) -> multiproc::Result<()> {
    let group = ProcessGroup::from_env()?;
    assert_eq!(group.rank(), Some(rank));
    let t = Tensor::full(&[5], rank as f64 + 1.0, DType::F64)?;
    group.all_reduce_(&t, ReduceOp::Sum)?;
    let p = group.world_size() as f64;
    if t.to_vec::<f64>()? != vec![p * (p + 1.0) / 2.0; 5] {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: wrong sum {:?}",
            t.to_vec::<f64>()?
        )));
    }
    Ok(())
}

#[test]
fn ranks_meet_through_the_launchers_variables() {
    common::run(secs(60), || {
        for method in StartMethod::ALL {
            SpawnOptions::new()
                .start_method(method)
                .spawn(from_env_sum, (), 3)
                .unwrap();
        }
    });
}

/// A ring: rank r sends a multi-chunk tensor to r + 1 and receives from r - 1 (even
/// ranks send first, odd ranks receive first, as synchronous sends need).
fn ring(rank: usize, group: ProcessGroup) -> multiproc::Result<()> {
    let p = group.world_size();
    let n = 1_500_000; // f32: more than one 4 MiB chunk
    let out = Tensor::full(&[n], rank as f64, DType::F32)?;
    let got = Tensor::zeros(&[n], DType::F32)?;
    let (next, prev) = ((rank + 1) % p, (rank + p - 1) % p);
    if rank % 2 == 0 {
        group.send(&out, next)?;
        group.recv(&got, prev)?;
    } else {
        group.recv(&got, prev)?;
        group.send(&out, next)?;
    }
    if got.to_vec::<f32>()?.iter().any(|&x| x != prev as f32) {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: wrong data from {prev}"
        )));
    }
    let err = group.send(&out, rank).unwrap_err();
    assert!(err.to_string().contains("another rank"), "{err}");
    group.barrier()
}

#[test]
fn send_and_recv_around_a_ring() {
    common::run(secs(60), || {
        multiproc::spawn(ring, ProcessGroup::new_local(4).unwrap(), 4).unwrap();
    });
}

/// Each rank makes calls that disagree with the other rank's in one way at a time (the
/// dtype, the size, the collective), each refused on both ranks, the group going on
/// after each; then empty all-reduces between full ones, which keep the ranks in step.
fn disagree_then_agree(rank: usize, group: ProcessGroup) -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let refused = |got: multiproc::Result<()>, says: &str| -> Result<(), String> {
        match got {
            Err(Error::Tensor(m)) if m.contains(says) => Ok(()),
            other => Err(format!(
                "rank {rank}: expected a refusal saying {says:?}: {other:?}"
            )),
        }
    };
    // all_gather: the dtype, then the size.
    let dtype = if rank == 0 { DType::F32 } else { DType::I32 };
    let (inp, out) = (
        Tensor::ones(&[2], dtype).map_err(e)?,
        Tensor::zeros(&[4], dtype).map_err(e)?,
    );
    refused(group.all_gather(&out, &inp), "2 elements of int32")?;
    let n = 2 + rank;
    let (inp, out) = (
        Tensor::ones(&[n], DType::F64).map_err(e)?,
        Tensor::zeros(&[2 * n], DType::F64).map_err(e)?,
    );
    refused(group.all_gather(&out, &inp), "all_gather of 3 elements")?;
    // reduce_scatter's size.
    let (inp, out) = (
        Tensor::ones(&[4 * (rank + 1)], DType::F64).map_err(e)?,
        Tensor::zeros(&[2 * (rank + 1)], DType::F64).map_err(e)?,
    );
    refused(
        group.reduce_scatter(&out, &inp, ReduceOp::Sum),
        "reduce_scatter (Sum) of 8",
    )?;
    // Different collectives at the same point: a barrier beside an all_gather.
    if rank == 0 {
        refused(group.barrier(), "all_gather")?;
    } else {
        let (inp, out) = (
            Tensor::ones(&[1], DType::F32).map_err(e)?,
            Tensor::zeros(&[2], DType::F32).map_err(e)?,
        );
        refused(group.all_gather(&out, &inp), "called barrier")?;
    }
    // The group goes on: an all_gather that agrees.
    let inp = Tensor::full(&[2], rank as f64 + 1.0, DType::F32).map_err(e)?;
    let out = Tensor::zeros(&[4], DType::F32).map_err(e)?;
    group.all_gather(&out, &inp).map_err(e)?;
    if out.to_vec::<f32>().map_err(e)? != [1.0, 1.0, 2.0, 2.0] {
        return Err(format!(
            "rank {rank}: all_gather gave {:?}",
            out.to_vec::<f32>()
        ));
    }
    // Empty all-reduces between full ones, and empty sends.
    let empty = Tensor::zeros(&[0], DType::F32).map_err(e)?;
    for round in 0..200 {
        group.all_reduce_(&empty, ReduceOp::Sum).map_err(e)?;
        let t = Tensor::full(&[6], (rank + round) as f64, DType::I32).map_err(e)?;
        group.all_reduce_(&t, ReduceOp::Sum).map_err(e)?;
        let want = (2 * round + 1) as i32;
        if t.to_vec::<i32>().map_err(e)? != [want; 6] {
            return Err(format!(
                "rank {rank} round {round}: {:?}",
                t.to_vec::<i32>()
            ));
        }
    }
    if rank == 0 {
        group.send(&empty, 1).map_err(e)?;
    } else {
        group.recv(&empty, 0).map_err(e)?;
    }
    group.barrier().map_err(e)
}

#[test]
fn calls_that_disagree_are_refused_on_every_rank_and_empty_ones_keep_step() {
    common::run(secs(120), || {
        let group = ProcessGroup::new_local(2).unwrap();
        SpawnOptions::new()
            .start(disagree_then_agree, group, 2)
            .unwrap()
            .join_timeout(secs(100))
            .unwrap();
    });
}

/// Rank 1 stops itself (SIGSTOP) inside the loop after telling the parent; rank 0's
/// all-reduce then times out, and every later call on the group, rank 1's after it is
/// continued included, fails naming the rank that ended it, never passing a barrier
/// with a rank missing.
fn stop_then_try_again(
    rank: usize,
    (group, q): (ProcessGroup, SimpleQueue<String>),
) -> Result<(), String> {
    group.set_timeout(Some(Duration::from_millis(300)));
    let t = Tensor::zeros(&[1024], DType::F32).map_err(|e| e.to_string())?;
    group
        .all_reduce_(&t, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if rank == 1 {
        q.put("stopping".into()).map_err(|e| e.to_string())?;
        // SAFETY: raise(2) takes a plain signal number.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
    let first = group.all_reduce_(&t, ReduceOp::Sum);
    let mut said = format!("rank {rank}: first {}", first.is_ok());
    for _ in 0..3 {
        match group.barrier() {
            Err(Error::RankDied {
                rank: 0, message, ..
            }) if message.contains("ended by rank 0") => {}
            other => said.push_str(&format!("; a later barrier gave {other:?}")),
        }
    }
    q.put(said).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn a_collective_that_times_out_ends_the_group_for_every_rank() {
    common::run(secs(120), || {
        let group = ProcessGroup::new_local(2).unwrap();
        let q = SimpleQueue::new().unwrap();
        let mut ctx = SpawnOptions::new()
            .start(stop_then_try_again, (group, q.clone()), 2)
            .unwrap();
        assert_eq!(q.get().unwrap(), "stopping");
        let victim = ctx.pids()[1] as i32;
        // Rank 0 times out (300 ms) while rank 1 is stopped; then rank 1 goes on.
        assert_eq!(q.get_timeout(secs(60)).unwrap(), "rank 0: first false");
        // SAFETY: kill(2) takes plain integers; the pid is our unreaped child.
        assert_eq!(unsafe { libc::kill(victim, libc::SIGCONT) }, 0);
        assert_eq!(q.get_timeout(secs(60)).unwrap(), "rank 1: first false");
        ctx.join_timeout(secs(60)).unwrap();
    });
}
