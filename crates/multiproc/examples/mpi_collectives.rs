//! The `mpi` feature's check, run under `mpirun`: every rank runs each collective of
//! [`MpiGroup`] on known values (every reduce op, broadcast from every rank, all-gather,
//! reduce-scatter, send/recv around a ring, the async forms) and exits non-zero when a
//! result is wrong.
//!
//! ```sh
//! cargo build --features mpi --example mpi_collectives
//! mpirun -np 2 target/debug/examples/mpi_collectives                                 # one node: shared memory
//! mpirun -np 2 -x MULTIPROC_MPI_RANKS_PER_NODE=1 target/debug/examples/mpi_collectives  # two "nodes": MPI between leaders
//! mpirun -np 4 -x MULTIPROC_MPI_RANKS_PER_NODE=2 target/debug/examples/mpi_collectives  # two nodes of two
//! ```

use multiproc::dist::{MpiGroup, ReduceOp};
use multiproc::{DType, Tensor};

/// The first index where `got` differs from `want(i)`, as a message.
fn differs(what: &str, got: &[f64], want: impl Fn(usize) -> f64) -> Option<String> {
    got.iter()
        .enumerate()
        .find(|(i, g)| **g != want(*i))
        .map(|(i, g)| format!("{what}[{i}] = {g}, expected {}", want(i)))
}

fn as_f64(t: &Tensor) -> multiproc::Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.to_vec::<f64>()
}

fn check(group: &MpiGroup) -> multiproc::Result<Vec<String>> {
    let (rank, p) = (group.rank(), group.world_size());
    let mut wrong = Vec::new();
    let n = 3 << 20; // several 4 MiB chunks of f32, and the zero-copy path on a node
    let v = |i: usize, r: usize| ((i % 100) + 10 * r) as f64;

    for (op, want) in [
        (
            ReduceOp::Sum,
            Box::new(move |i| (0..p).map(|r| v(i, r)).sum()) as Box<dyn Fn(usize) -> f64>,
        ),
        (ReduceOp::Max, Box::new(move |i| v(i, p - 1))),
        (ReduceOp::Min, Box::new(move |i| v(i, 0))),
        (
            ReduceOp::Mean,
            Box::new(move |i| (0..p).map(|r| v(i, r)).sum::<f64>() / p as f64),
        ),
    ] {
        let t = Tensor::from_vec((0..n).map(|i| v(i, rank) as f32).collect(), &[n])?;
        group.all_reduce_(&t, op)?;
        wrong.extend(differs(&format!("all_reduce_ {op:?}"), &as_f64(&t)?, want));
    }
    let ints = Tensor::full(&[7], rank as f64 + 1.0, DType::I64)?;
    group.all_reduce_async(&ints, ReduceOp::Sum).wait()?;
    wrong.extend(differs("all_reduce_async i64", &as_f64(&ints)?, |_| {
        (p * (p + 1) / 2) as f64
    }));

    for src in 0..p {
        let b = Tensor::full(&[1000], rank as f64, DType::F64)?;
        group.broadcast_(&b, src)?;
        wrong.extend(differs(
            &format!("broadcast_ from {src}"),
            &as_f64(&b)?,
            |_| src as f64,
        ));
    }

    let small = Tensor::from_vec(vec![rank as f64, 0.5 + rank as f64, 7.0], &[3])?;
    let gathered = Tensor::zeros(&[3 * p], DType::F64)?;
    group.all_gather_async(&gathered, &small).wait()?;
    wrong.extend(differs("all_gather", &as_f64(&gathered)?, |i| {
        [(i / 3) as f64, 0.5 + (i / 3) as f64, 7.0][i % 3]
    }));

    let input = Tensor::from_vec(
        (0..2 * p).map(|i| (i + rank) as f64).collect::<Vec<_>>(),
        &[2 * p],
    )?;
    let out = Tensor::zeros(&[2], DType::F64)?;
    group.reduce_scatter(&out, &input, ReduceOp::Sum)?;
    wrong.extend(differs("reduce_scatter", &as_f64(&out)?, |i| {
        (0..p).map(|r| (2 * rank + i + r) as f64).sum()
    }));

    if p > 1 {
        // A ring: even ranks send first, odd ranks receive first (synchronous sends).
        let (next, prev) = ((rank + 1) % p, (rank + p - 1) % p);
        let mine = Tensor::full(&[5000], rank as f64, DType::F32)?;
        let got = Tensor::zeros(&[5000], DType::F32)?;
        if rank % 2 == 0 {
            group.send(&mine, next)?;
            group.recv(&got, prev)?;
        } else {
            let r = group.recv_async(&got, prev);
            r.wait()?;
            group.send_async(&mine, next).wait()?;
        }
        wrong.extend(differs("recv", &as_f64(&got)?, |_| prev as f64));
    }
    if let Ok(()) = group.broadcast_(&small, p) {
        wrong.push(format!("broadcast_ from rank {p} of {p} succeeded"));
    }
    group.barrier()?;
    Ok(wrong)
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let group = MpiGroup::from_env()?;
    let wrong = check(&group)?;
    println!(
        "rank {} of {} on {} node(s) ({:?}): {}",
        group.rank(),
        group.world_size(),
        group.nodes(),
        group.local(),
        if wrong.is_empty() {
            "ok".to_string()
        } else {
            format!("WRONG: {}", wrong.join("; "))
        }
    );
    if !wrong.is_empty() {
        drop(group);
        std::process::exit(1);
    }
    Ok(())
}
