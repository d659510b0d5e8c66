//! Multi-process data loading with [`multiproc::data::DataLoader`], the main use of
//! torch.multiprocessing in practice (torch's `DataLoader(num_workers=N)`).
//!
//! Workers make deterministic synthetic images, the default collate stacks them into
//! batch tensors made directly in shared memory, and the batches reach this process by
//! handle. `--fail-at` makes one sample fail, to show how the failing worker is named
//! (and, with `--restart`, replaced); Ctrl-C stops cleanly, leaving nothing in
//! /dev/shm. For decoding image files, see the `image_folder` example.
//!
//! ```sh
//! cargo run --release --example dataloader -- --workers 4
//! cargo run --release --example dataloader -- --workers 2 --fail-at 1000 --restart
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use clap::Parser;
use multiproc::data::{DataLoader, Dataset};
use multiproc::{Error, SharingStrategy, Tensor};
use serde::{Deserialize, Serialize};

/// Load batches of synthetic images with worker processes.
#[derive(Parser, Debug)]
struct Args {
    /// Worker processes (0: load in this process).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Samples in the data set.
    #[arg(long, default_value_t = 25_600)]
    samples: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Image side in pixels (images are 3 × side × side f32).
    #[arg(long, default_value_t = 64)]
    side: usize,
    /// Make loading this sample fail, once.
    #[arg(long)]
    fail_at: Option<usize>,
    /// Replace a failed worker and retry its batch.
    #[arg(long)]
    restart: bool,
    /// `file_descriptor` or `file_system`.
    #[arg(long, default_value = "file_descriptor")]
    strategy: SharingStrategy,
}

/// Sample `i`: a label-dependent gradient plus hashed noise, and its label.
#[derive(Clone, Serialize, Deserialize)]
struct Synthetic {
    samples: usize,
    side: usize,
    fail_at: Option<usize>,
    failed: multiproc::Event,
}

impl Dataset for Synthetic {
    type Item = (Tensor, i64);

    fn len(&self) -> usize {
        self.samples
    }

    fn get(&self, i: usize) -> multiproc::Result<(Tensor, i64)> {
        if self.fail_at == Some(i) && !self.failed.is_set() {
            self.failed.set();
            return Err(Error::InvalidArgument(format!(
                "sample {i} is corrupt (--fail-at)"
            )));
        }
        let label = (i % 10) as i64;
        let mut h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let pixels: Vec<f32> = (0..3 * self.side * self.side)
            .map(|p| {
                h ^= h << 13;
                h ^= h >> 7;
                h ^= h << 17;
                let noise = (h >> 40) as f32 / (1u64 << 24) as f32;
                0.25 * ((p % 97) as f32 / 97.0 + label as f32 / 10.0) + 0.5 * noise
            })
            .collect();
        Ok((Tensor::from_vec(pixels, &[3, self.side, self.side])?, label))
    }
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args = Args::parse();
    multiproc::set_sharing_strategy(args.strategy);
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&interrupted);
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst))
        .map_err(|e| Error::InvalidArgument(format!("cannot install the Ctrl-C handler: {e}")))?;

    let data = Synthetic {
        samples: args.samples,
        side: args.side,
        fail_at: args.fail_at,
        failed: multiproc::Event::new()?,
    };
    let builder = DataLoader::builder(data)
        .batch_size(args.batch_size)
        .shuffle(0)
        .num_workers(args.workers)
        .restart_workers(args.restart);
    #[cfg(feature = "progress")]
    let builder = builder.progress(true);
    let mut loader = builder.build()?;

    let start = Instant::now();
    let (mut samples, mut checksum) = (0usize, 0.0f64);
    for batch in &mut loader {
        if interrupted.load(Ordering::SeqCst) {
            eprintln!("interrupted: stopping the workers");
            return Ok(()); // dropping the loader stops the workers; /dev/shm stays clean
        }
        match batch {
            Ok((images, labels)) => {
                // "Train" on the batch: read every pixel once.
                checksum += images.sum()? + labels.sum()?;
                samples += images.shape()[0];
            }
            Err(e) if interrupted.load(Ordering::SeqCst) => {
                eprintln!("interrupted ({e})");
                return Ok(());
            }
            Err(e) => {
                eprintln!("data loading failed: {e}");
                std::process::exit(1);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} batches ({samples} samples of 3x{side}x{side}) in {secs:.2} s with {} workers: \
         {:.1} batches/s, {:.0} samples/s, {:.2} GB/s (checksum {checksum:.1})",
        loader.len(),
        args.workers,
        loader.len() as f64 / secs,
        samples as f64 / secs,
        (samples * 3 * args.side * args.side * 4) as f64 / secs / 1e9,
        side = args.side,
    );
    Ok(())
}
