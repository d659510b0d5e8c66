//! Benchmark: how fast N workers start — the latency from `iter()` on a freshly built
//! loader to its first batch, for 1, 2, 4 and 8 workers of each kind, over a data set
//! whose samples cost nothing (so the figure is start-up, not loading; with PNG
//! decoding see `dataloader_bench`'s `first_batch_ms`). The median of 7.
//!
//! Workers start in parallel: the loader hands each worker process its job through a
//! socket and goes on to the next without waiting for it to be up, sends worker 0 its
//! batch before starting worker 1, and until a worker has answered starts no more
//! workers than the machine has cores: 8 workers' first batch should come within 2× of
//! one worker's.
//!
//! ```sh
//! cargo run --release --example dataloader_first_batch
//! ```

use std::time::Instant;

use multiproc::data::{DataLoader, Dataset, WorkerKind};

#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Free(usize);

impl Dataset for Free {
    type Item = i64;
    fn len(&self) -> usize {
        self.0
    }
    fn get(&self, i: usize) -> multiproc::Result<i64> {
        Ok(i as i64)
    }
}

fn first_batch_ms(workers: usize, kind: WorkerKind) -> multiproc::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..7 {
        let mut loader = DataLoader::builder(Free(1024))
            .batch_size(8)
            .num_workers(workers)
            .workers(kind)
            .build()?;
        let start = Instant::now();
        // The epoch stays alive past the measurement: ending it stops the workers.
        let mut epoch = loader.iter();
        let first = epoch.next();
        times.push(start.elapsed().as_secs_f64() * 1e3);
        drop(epoch);
        first.transpose()?;
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("first batch of a fresh loader, median of 7 ({cores} cores)");
    println!(
        "{:>8} {:>8} {:>10} {:>12}",
        "kind", "workers", "ms", "x 1 worker"
    );
    for (name, kind) in [
        ("process", WorkerKind::Process),
        ("thread", WorkerKind::Thread),
    ] {
        let one = first_batch_ms(1, kind)?;
        for workers in [1, 2, 4, 8] {
            let ms = if workers == 1 {
                one
            } else {
                first_batch_ms(workers, kind)?
            };
            println!("{name:>8} {workers:>8} {ms:>10.2} {:>12.2}", ms / one);
        }
    }
    Ok(())
}
