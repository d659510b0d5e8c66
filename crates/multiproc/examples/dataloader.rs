//! Multi-process data loading, the main use of torch.multiprocessing in practice
//! (torch's `DataLoader(num_workers=N)`).
//!
//! Workers produce samples — from a deterministic synthetic image data set, or from a
//! directory of files — collate them into batch tensors and put them on a bounded
//! queue; the tensors travel by handle, their bytes never copied. The main process
//! takes the batches in order with a prefetch depth, shows progress and throughput,
//! reports a failed worker with its rank, and on Ctrl-C stops cleanly, leaving nothing
//! in /dev/shm.
//!
//! ```sh
//! cargo run --release --example dataloader -- --workers 4
//! cargo run --release --example dataloader -- --workers 2 --dir /usr/share/doc
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use multiproc::{Queue, SharingStrategy, SpawnOptions, Tensor};
use serde::{Deserialize, Serialize};

/// Load batches of images with worker processes.
#[derive(Parser, Debug, Clone, Serialize, Deserialize)]
struct Args {
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Batches to load.
    #[arg(long, default_value_t = 400)]
    batches: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Image side in pixels (images are 3 × side × side).
    #[arg(long, default_value_t = 64)]
    side: usize,
    /// Batches each worker may have ready ahead of the consumer.
    #[arg(long, default_value_t = 2)]
    prefetch: usize,
    /// Read samples from the files of this directory (first 3·side² bytes of each,
    /// zero-padded) instead of generating them.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Make the worker that loads this batch fail (to see how errors are reported).
    #[arg(long)]
    fail_at: Option<usize>,
    /// `file_descriptor` or `file_system`.
    #[arg(long, default_value = "file_descriptor")]
    strategy: SharingStrategy,
    /// No progress bar (for logs and benchmarks).
    #[arg(long)]
    quiet: bool,
}

/// One collated batch: images `[batch, 3, side, side]` f32 in [0, 1] and labels.
#[derive(Serialize, Deserialize)]
struct Batch {
    index: usize,
    images: Tensor,
    labels: Tensor,
}

/// The samples a data set can produce.
enum Source {
    Synthetic,
    Files(Vec<PathBuf>),
}

impl Source {
    fn open(args: &Args) -> Result<Self, String> {
        let Some(dir) = &args.dir else {
            return Ok(Source::Synthetic);
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("cannot read directory {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(format!("directory {} has no files to load", dir.display()));
        }
        Ok(Source::Files(files))
    }

    /// Writes sample `i` into `out` (3·side² values in [0, 1]); returns its label.
    fn sample(&self, i: usize, out: &mut [f32]) -> Result<u8, String> {
        match self {
            Source::Synthetic => {
                // A deterministic image: a label-dependent gradient plus hashed noise.
                let label = (i % 10) as u8;
                let mut h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for (p, v) in out.iter_mut().enumerate() {
                    h ^= h << 13;
                    h ^= h >> 7;
                    h ^= h << 17;
                    let noise = (h >> 40) as f32 / (1u64 << 24) as f32;
                    *v = 0.5 * ((p % 97) as f32 / 97.0 + f32::from(label) / 10.0) * 0.5
                        + 0.5 * noise;
                }
                Ok(label)
            }
            Source::Files(files) => {
                let path = &files[i % files.len()];
                let bytes = std::fs::read(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                for (k, v) in out.iter_mut().enumerate() {
                    *v = f32::from(bytes.get(k).copied().unwrap_or(0)) / 255.0;
                }
                Ok((bytes.len() % 10) as u8)
            }
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Job {
    batches: Queue<Batch>,
    args: Args,
}

/// Loads every batch whose index is congruent to the rank, in order (torch's
/// round-robin sampler).
fn loader(rank: usize, job: Job) -> Result<(), String> {
    let args = &job.args;
    let source = Source::open(args)?;
    let pixels = 3 * args.side * args.side;
    for index in (rank..args.batches).step_by(args.workers) {
        if args.fail_at == Some(index) {
            return Err(format!(
                "could not decode the samples of batch {index} (requested by --fail-at)"
            ));
        }
        let mut images = vec![0f32; args.batch_size * pixels];
        let mut labels = vec![0u8; args.batch_size];
        for (s, label) in labels.iter_mut().enumerate() {
            *label = source.sample(
                index * args.batch_size + s,
                &mut images[s * pixels..(s + 1) * pixels],
            )?;
        }
        let batch = Batch {
            index,
            images: Tensor::from_vec(images, &[args.batch_size, 3, args.side, args.side])
                .map_err(|e| e.to_string())?,
            labels: Tensor::from_vec(labels, &[args.batch_size]).map_err(|e| e.to_string())?,
        };
        if let Err(e) = job.batches.put(batch) {
            // The consumer has gone (Ctrl-C): stop quietly.
            return Err(format!("cannot hand over batch {index}: {}", e.error));
        }
    }
    Ok(())
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args = Args::parse();
    multiproc::set_sharing_strategy(args.strategy);
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = Arc::clone(&interrupted);
        ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).map_err(|e| {
            multiproc::Error::InvalidArgument(format!("cannot install the Ctrl-C handler: {e}"))
        })?;
    }

    let batches = Queue::with_capacity(args.workers * args.prefetch)?;
    let job = Job {
        batches: batches.clone(),
        args: args.clone(),
    };
    let start = Instant::now();
    // Daemon workers, as torch's DataLoader uses: killed (not waited for) when the
    // context is dropped, so stopping early never blocks on a worker stuck in `put`.
    let mut ctx = SpawnOptions::new()
        .daemon(true)
        .start(loader, job, args.workers)?;
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.batches as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} batches  {per_sec}  eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    // Batches arrive in any order; hand them out in index order.
    let mut waiting: BTreeMap<usize, Batch> = BTreeMap::new();
    let mut next = 0;
    let mut checksum = 0.0f64;
    let mut samples = 0usize;
    while next < args.batches {
        if interrupted.load(Ordering::SeqCst) {
            bar.abandon_with_message("interrupted");
            eprintln!("interrupted: stopping the workers");
            drop(ctx); // kills and reaps the workers
            drop(waiting); // unmaps the batches; nothing stays in /dev/shm
            std::process::exit(130);
        }
        match batches.get_timeout(Duration::from_millis(100))? {
            Some(batch) => {
                waiting.insert(batch.index, batch);
            }
            None => {
                // Nothing came: is a worker dead? Its error names its rank. (A terminal's
                // Ctrl-C reaches the workers too; that is an interruption, not a failure.)
                if let Err(e) = ctx.join(Some(Duration::ZERO)) {
                    if interrupted.load(Ordering::SeqCst) {
                        continue;
                    }
                    bar.abandon();
                    eprintln!("data loading failed: {e}");
                    std::process::exit(1);
                }
            }
        }
        while let Some(batch) = waiting.remove(&next) {
            // "Train" on the batch: read every pixel once.
            checksum += batch.images.sum()? + batch.labels.sum()?;
            samples += batch.images.shape()[0];
            next += 1;
            bar.inc(1);
        }
    }
    bar.finish();
    while !ctx.join(Some(Duration::from_secs(30)))? {}
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "{} batches ({samples} samples of 3x{}x{}) in {elapsed:.2} s with {} workers: {:.1} batches/s, {:.0} samples/s, {:.2} GB/s (checksum {checksum:.1})",
        args.batches,
        args.side,
        args.side,
        args.workers,
        args.batches as f64 / elapsed,
        samples as f64 / elapsed,
        (samples * 3 * args.side * args.side * 4) as f64 / elapsed / 1e9,
    );
    Ok(())
}
