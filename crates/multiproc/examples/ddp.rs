//! Data-parallel training (torch's DistributedDataParallel, by hand): every rank holds
//! the same softmax classifier as `hogwild` (10 Gaussian clusters in 32 dimensions),
//! computes the gradient of its share of each global batch, and the ranks average their
//! gradients with `all_reduce_(.., ReduceOp::Mean)` through shared memory before the
//! same update. The parameters stay identical on every rank, so every rank prints the
//! same final loss; rank 0 then trains one process on the whole batches to compare.
//!
//! The same binary runs under any launcher:
//!
//! ```sh
//! cargo run --release --example ddp -- --ranks 2                    # multiproc spawn
//! mpirun -np 2 target/release/examples/ddp                          # Open MPI
//! torchrun --no-python --nproc-per-node 2 target/release/examples/ddp
//! ```

use clap::Parser;
use multiproc::Tensor;
use multiproc::dist::{Env, ProcessGroup, ReduceOp};
use serde::{Deserialize, Serialize};

/// Data-parallel training with gradients averaged by all_reduce_.
#[derive(Parser, Debug, Clone, Serialize, Deserialize)]
struct Args {
    /// Start this many ranks with multiproc's spawn (without it, the ranks are the
    /// processes a launcher started: torchrun, mpirun, srun, or just this one).
    #[arg(long)]
    ranks: Option<usize>,
    /// Passes over the training set.
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Training samples (a test set of a quarter of that is drawn too).
    #[arg(long, default_value_t = 40_000)]
    samples: usize,
    /// Samples per global batch (split between the ranks).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Seed of the data set.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

mod softmax;
use softmax::{DIM, Data, PARAMS, evaluate, make_data, probabilities};

/// The mean gradient over `samples` into `grad`.
fn gradient(w: &[f32], data: &Data, samples: &[usize], grad: &mut [f32]) {
    grad.iter_mut().for_each(|g| *g = 0.0);
    for &i in samples {
        let x = &data.x[i * DIM..(i + 1) * DIM];
        let p = probabilities(w, x);
        for (k, &pk) in p.iter().enumerate() {
            let err = pk - f32::from(u8::from(k == data.y[i]));
            let row = &mut grad[k * (DIM + 1)..(k + 1) * (DIM + 1)];
            row.iter_mut().zip(x).for_each(|(g, xv)| *g += err * xv);
            row[DIM] += err;
        }
    }
    let n = samples.len().max(1) as f32;
    grad.iter_mut().for_each(|g| *g /= n);
}

/// Trains with `world` ranks (`group` None: one process on whole batches).
fn train(args: &Args, data: &Data, group: Option<&ProcessGroup>) -> multiproc::Result<Vec<f32>> {
    let (rank, world) = group.map_or((0, 1), |g| (g.rank().unwrap_or(0), g.world_size()));
    let mut w = vec![0f32; PARAMS];
    let mut grad = vec![0f32; PARAMS];
    let order: Vec<usize> = (0..data.y.len()).collect();
    let share = args.batch / world;
    for _ in 0..args.epochs {
        for batch in order.chunks_exact(share * world) {
            let mine = &batch[rank * share..(rank + 1) * share];
            gradient(&w, data, mine, &mut grad);
            if let Some(group) = group {
                let g = Tensor::from_slice(&grad, &[PARAMS])?;
                group.all_reduce_(&g, ReduceOp::Mean)?;
                grad = g.to_vec()?;
            }
            w.iter_mut().zip(&grad).for_each(|(p, g)| *p -= args.lr * g);
        }
    }
    Ok(w)
}

fn rank_main(_rank: usize, args: Args) -> multiproc::Result<()> {
    let env = Env::detect()?;
    let group = ProcessGroup::from_env()?;
    let data = make_data(args.seed, args.samples, 1);
    let test = make_data(args.seed, args.samples / 4, 2);
    let w = train(&args, &data, Some(&group))?;
    let (loss, acc) = evaluate(&w, &test);
    let check = Tensor::from_vec(vec![loss], &[1])?;
    group.all_reduce_(&check, ReduceOp::Max)?;
    println!(
        "rank {} of {} ({}): final test loss {loss:.6}, accuracy {:.2}%{}",
        env.rank,
        env.world_size,
        env.launcher,
        acc * 100.0,
        if check.to_vec::<f64>()?[0] == loss {
            ""
        } else {
            "  (ranks differ!)"
        }
    );
    group.barrier()?;
    if env.rank == 0 {
        let w1 = train(&args, &data, None)?;
        let (l1, a1) = evaluate(&w1, &test);
        println!(
            "one process, same global batches: final test loss {l1:.6}, accuracy {:.2}%",
            a1 * 100.0
        );
    }
    Ok(())
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args = Args::parse();
    match args.ranks {
        Some(n) => multiproc::spawn(rank_main, args, n),
        None => {
            let rank = Env::detect()?.rank;
            rank_main(rank, args)
        }
    }
}
