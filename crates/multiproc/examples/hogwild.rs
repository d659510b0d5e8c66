//! Hogwild training: N worker processes train one softmax classifier whose parameters
//! live in shared memory, each applying its own updates without locks (Niu et al.,
//! 2011), like torch's `examples/mnist_hogwild`.
//!
//! The data set is synthetic and deterministic: 10 Gaussian clusters in 32 dimensions,
//! generated identically in every process from a seed, so nothing but the parameters'
//! handle crosses the process boundary. The parent reports the loss per epoch, the
//! final test accuracy, the throughput, and the same training done in one process for
//! comparison.
//!
//! ```sh
//! cargo run --release --example hogwild -- --workers 4 --epochs 8
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use multiproc::{Barrier, DType, Queue, SharingStrategy, Tensor};
use serde::{Deserialize, Serialize};

/// Hogwild training on shared-memory parameters.
#[derive(Parser, Debug, Clone, Serialize, Deserialize)]
struct Args {
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Passes over the training set.
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Training samples (a test set of a quarter of that is drawn too).
    #[arg(long, default_value_t = 40_000)]
    samples: usize,
    /// Samples per gradient step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    /// Seed of the data set and the shuffles.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// `file_descriptor` or `file_system`.
    #[arg(long, default_value = "file_descriptor")]
    strategy: SharingStrategy,
}

mod softmax;
use softmax::{CLASSES, DIM, Data, PARAMS, Rng, evaluate, make_data, probabilities};

/// One epoch of SGD on this worker's shard, reading and updating the shared
/// parameters without locks. Returns the summed loss and the sample count.
fn train_epoch(
    params: &Tensor,
    data: &Data,
    rank: usize,
    world: usize,
    epoch: usize,
    args: &Args,
) -> (f64, usize) {
    let mut order: Vec<usize> = (rank..data.y.len()).step_by(world).collect();
    let mut rng = Rng(args.seed ^ ((epoch as u64) << 32) ^ rank as u64);
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut grad = vec![0f32; PARAMS];
    let (mut loss, mut seen) = (0.0f64, 0usize);
    for batch in order.chunks(args.batch) {
        // A snapshot of the parameters; other workers keep writing them meanwhile.
        let w: Vec<f32> = params.to_vec().expect("read parameters");
        grad.iter_mut().for_each(|g| *g = 0.0);
        for &i in batch {
            let x = &data.x[i * DIM..(i + 1) * DIM];
            let p = probabilities(&w, x);
            loss -= f64::from(p[data.y[i]].max(1e-12).ln());
            for (k, &pk) in p.iter().enumerate() {
                let err = pk - f32::from(u8::from(k == data.y[i]));
                let row = &mut grad[k * (DIM + 1)..(k + 1) * (DIM + 1)];
                row.iter_mut().zip(x).for_each(|(g, xv)| *g += err * xv);
                row[DIM] += err;
            }
        }
        seen += batch.len();
        let step = Tensor::from_vec(grad.clone(), &[CLASSES, DIM + 1]).expect("gradient");
        params
            .add_(&step, -f64::from(args.lr) / batch.len() as f64)
            .expect("update");
    }
    (loss, seen)
}

#[derive(Serialize, Deserialize)]
struct Job {
    params: Tensor,
    reports: Queue<(usize, usize, f64, usize)>,
    epoch_done: Barrier,
    args: Args,
}

fn worker(rank: usize, job: Job) {
    let data = make_data(job.args.seed, job.args.samples, 1);
    for epoch in 0..job.args.epochs {
        let (loss, seen) =
            train_epoch(&job.params, &data, rank, job.args.workers, epoch, &job.args);
        job.reports.put((epoch, rank, loss, seen)).expect("report");
        // Epochs stay in step so the parent's per-epoch figures mean something.
        job.epoch_done
            .wait_timeout(Duration::from_secs(300))
            .expect("epoch barrier");
    }
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args = Args::parse();
    multiproc::set_sharing_strategy(args.strategy);
    let test = make_data(args.seed, args.samples / 4, 2);
    println!(
        "hogwild: {} workers, {} epochs, {} samples of {DIM} features in {CLASSES} classes, strategy {}",
        args.workers, args.epochs, args.samples, args.strategy
    );

    let params = Tensor::zeros(&[CLASSES, DIM + 1], DType::F32)?;
    params.share_memory_()?;
    let reports = Queue::new()?;
    let job = Job {
        params: params.clone(),
        reports: reports.clone(),
        epoch_done: Barrier::new(args.workers)?,
        args: args.clone(),
    };
    let start = Instant::now();
    let mut ctx =
        multiproc::start_processes(worker, job, args.workers, multiproc::StartMethod::Spawn)?;
    let mut trained = 0usize;
    for epoch in 0..args.epochs {
        let (mut loss, mut seen) = (0.0, 0);
        for _ in 0..args.workers {
            let report = loop {
                match reports.get_timeout(Duration::from_millis(200)) {
                    Ok(r) => break r,
                    Err(e) if e.is_timeout() => {}
                    Err(e) => return Err(e),
                }
                // A worker that failed is reported with its rank, not waited for; a
                // timeout here only says that they all still run.
                match ctx.join_timeout(Duration::ZERO) {
                    Err(e) if !e.is_timeout() => return Err(e),
                    _ => {}
                }
            };
            let (e, _rank, l, s) = report;
            debug_assert_eq!(e, epoch);
            loss += l;
            seen += s;
        }
        trained += seen;
        let (_, acc) = evaluate(&params.to_vec::<f32>()?, &test);
        println!(
            "epoch {:>2}: train loss {:.4}  test accuracy {:.2}%",
            epoch + 1,
            loss / seen.max(1) as f64,
            acc * 100.0
        );
    }
    ctx.join_timeout(Duration::from_secs(60))?;
    let elapsed = start.elapsed().as_secs_f64();
    let (loss, acc) = evaluate(&params.to_vec::<f32>()?, &test);

    // The same training in one process, for comparison.
    let single = Tensor::zeros(&[CLASSES, DIM + 1], DType::F32)?;
    let data = make_data(args.seed, args.samples, 1);
    let single_start = Instant::now();
    for epoch in 0..args.epochs {
        train_epoch(&single, &data, 0, 1, epoch, &args);
    }
    let single_elapsed = single_start.elapsed().as_secs_f64();
    let (single_loss, single_acc) = evaluate(&single.to_vec::<f32>()?, &test);

    println!(
        "hogwild, {} workers: test loss {loss:.4}, accuracy {:.2}%, {:.0} samples/s",
        args.workers,
        acc * 100.0,
        trained as f64 / elapsed
    );
    println!(
        "one process:        test loss {single_loss:.4}, accuracy {:.2}%, {:.0} samples/s",
        single_acc * 100.0,
        (args.samples * args.epochs) as f64 / single_elapsed
    );
    Ok(())
}
