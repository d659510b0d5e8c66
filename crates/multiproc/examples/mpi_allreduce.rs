//! The `mpi` feature's check, run under `mpirun`: every rank all-reduces known values
//! with [`MpiGroup`] and exits non-zero when a result is wrong.
//!
//! ```sh
//! cargo build --features mpi --example mpi_allreduce
//! mpirun -np 2 target/debug/examples/mpi_allreduce                                   # one node: shared memory
//! MULTIPROC_MPI_RANKS_PER_NODE=1 mpirun -np 2 -x MULTIPROC_MPI_RANKS_PER_NODE \
//!     target/debug/examples/mpi_allreduce                                            # two "nodes": MPI between leaders
//! ```

use multiproc::dist::{MpiGroup, ReduceOp};
use multiproc::{DType, Tensor};

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let group = MpiGroup::from_env()?;
    let (rank, p) = (group.rank(), group.world_size());
    let n = 3 << 20; // several 4 MiB chunks of f32
    let t = Tensor::full(&[n], rank as f64 + 1.0, DType::F32)?;
    group.all_reduce_(&t, ReduceOp::Sum)?;
    let want = (p * (p + 1) / 2) as f32;
    let got = t.to_vec::<f32>()?;
    let bad = got.iter().position(|&x| x != want);
    let m = Tensor::full(&[5], rank as f64, DType::F64)?;
    group.all_reduce_(&m, ReduceOp::Max)?;
    let mean = Tensor::full(&[5], rank as f64, DType::F64)?;
    group.all_reduce_(&mean, ReduceOp::Mean)?;
    group.barrier()?;
    let ok = bad.is_none()
        && m.to_vec::<f64>()? == vec![(p - 1) as f64; 5]
        && mean.to_vec::<f64>()? == vec![(p - 1) as f64 / 2.0; 5];
    println!(
        "rank {rank} of {p} ({:?}): sum {} max {} mean {} -> {}",
        group.local(),
        got[0],
        m.to_vec::<f64>()?[0],
        mean.to_vec::<f64>()?[0],
        if ok { "ok" } else { "WRONG" }
    );
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
