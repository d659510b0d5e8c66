//! Measurement: the private memory that N loader workers add when their data set holds
//! a large read-only index — a [`SharedRows`] table in shared memory (by handle), or,
//! with `--copied`, a plain `Vec` (a copy decoded in every worker, as torch's workers
//! end up with).
//!
//! The index is `--mib` MiB of `u64` rows of 4 KiB; each worker loads one sample that
//! reads every row (so every page of the table is touched in every worker), then, while
//! the persistent workers still run, each worker's `/proc/<pid>/smaps_rollup` is read:
//! `Rss`, `Pss` and `Private` (clean + dirty), in MiB.
//!
//! ```sh
//! cargo run --release --example shared_index_memory -- --mib 1024 --workers 8
//! cargo run --release --example shared_index_memory -- --mib 256 --workers 2 --copied
//! ```

use clap::Parser;
use multiproc::data::{DataLoader, Dataset, SharedRows};

#[derive(Parser, Debug)]
struct Args {
    /// Size of the index in MiB.
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Hold the index as a plain Vec, copied into every worker, instead.
    #[arg(long)]
    copied: bool,
}

/// u64s per row: 4 KiB rows.
const WIDTH: usize = 512;

/// Every sample reads the whole shared table and returns its sum.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Shared {
    index: SharedRows<u64>,
    samples: usize,
}

impl Dataset for Shared {
    type Item = i64;
    fn len(&self) -> usize {
        self.samples
    }
    fn get(&self, _i: usize) -> multiproc::Result<i64> {
        let mut sum = 0u64;
        for r in 0..self.index.len() {
            sum = sum.wrapping_add(self.index.get(r, 0)?);
        }
        Ok(sum as i64)
    }
}

/// The same, over a plain vector (every worker decodes its own copy).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Copied {
    index: Vec<u64>,
    samples: usize,
}

impl Dataset for Copied {
    type Item = i64;
    fn len(&self) -> usize {
        self.samples
    }
    fn get(&self, _i: usize) -> multiproc::Result<i64> {
        Ok(self
            .index
            .chunks(WIDTH)
            .fold(0u64, |s, row| s.wrapping_add(row[0])) as i64)
    }
}

/// `Rss`, `Pss` and private (clean + dirty) memory of `pid`, in MiB.
fn memory(pid: u32) -> (f64, f64, f64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    (
        field("Rss:"),
        field("Pss:"),
        field("Private_Clean:") + field("Private_Dirty:"),
    )
}

fn run<D>(dataset: D, workers: usize) -> multiproc::Result<Vec<(f64, f64, f64)>>
where
    D: Dataset<Item = i64> + serde::Serialize + serde::de::DeserializeOwned + Clone + 'static,
{
    let mut loader = DataLoader::builder(dataset)
        .num_workers(workers)
        .prefetch_factor(1)
        .persistent_workers(true)
        .build()?;
    let mut sums = Vec::new();
    for b in &mut loader {
        sums.extend(b?.to_vec::<i64>()?);
    }
    assert!(
        sums.windows(2).all(|w| w[0] == w[1]),
        "every worker read the same table"
    );
    Ok(loader.worker_pids().into_iter().map(memory).collect())
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args = Args::parse();
    let rows = args.mib * (1 << 20) / (WIDTH * 8);
    let flat: Vec<u64> = (0..(rows * WIDTH) as u64).collect();
    let per_worker = if args.copied {
        let samples = args.workers;
        run(
            Copied {
                index: flat,
                samples,
            },
            args.workers,
        )?
    } else {
        let index = SharedRows::new(&flat, WIDTH)?;
        drop(flat);
        run(
            Shared {
                index,
                samples: args.workers,
            },
            args.workers,
        )?
    };
    println!(
        "{} MiB index ({}), {} workers; each worker after reading every row:",
        args.mib,
        if args.copied {
            "a Vec copied into each worker"
        } else {
            "SharedRows, by handle"
        },
        args.workers
    );
    println!(
        "{:>7} {:>10} {:>10} {:>12}",
        "worker", "RSS MiB", "PSS MiB", "private MiB"
    );
    for (id, (rss, pss, private)) in per_worker.iter().enumerate() {
        println!("{id:>7} {rss:>10.1} {pss:>10.1} {private:>12.1}");
    }
    let worst = per_worker.iter().map(|m| m.2).fold(0.0, f64::max);
    println!("largest private memory of a worker: {worst:.1} MiB (target: at most 64 MiB)");
    Ok(())
}
