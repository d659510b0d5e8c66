//! Loads the PNG images of a folder (`--dir`, one subdirectory per class or a flat
//! folder) in batches with worker processes: decoding is the work that worker
//! processes pay off for, and a decoder that crashes takes down its worker, which is
//! reported (and with `--restart` replaced), not the trainer. Feature `image`.
//!
//! ```sh
//! cargo run --release --features image,progress --example image_folder -- --dir ./images --workers 2
//! ```

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use multiproc::data::{DataLoader, Dataset, ImageFolder};

#[derive(Parser, Debug)]
struct Args {
    /// The image folder.
    #[arg(long)]
    dir: PathBuf,
    /// Worker processes (0: decode in this process).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Images per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Resize every image to side × side (so images of different sizes stack).
    #[arg(long, default_value_t = 224)]
    side: u32,
    /// Shuffle with this seed.
    #[arg(long)]
    shuffle: Option<u64>,
    /// Replace a worker that fails and retry its batch once.
    #[arg(long)]
    restart: bool,
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args = Args::parse();
    let folder = ImageFolder::new(&args.dir)?.resize(args.side, args.side);
    println!(
        "{} images in {} classes",
        folder.len(),
        folder.classes().len()
    );
    let mut builder = DataLoader::builder(folder)
        .batch_size(args.batch_size)
        .num_workers(args.workers)
        .restart_workers(args.restart);
    if let Some(seed) = args.shuffle {
        builder = builder.shuffle(seed);
    }
    #[cfg(feature = "progress")]
    {
        builder = builder.progress(true);
    }
    let mut loader = builder.build()?;
    let start = Instant::now();
    let (mut images, mut mean) = (0usize, 0.0f64);
    for batch in &mut loader {
        let (x, _labels) = batch?; // [batch, 3, side, side] u8, in shared memory
        images += x.shape()[0];
        mean += x.sum()? / x.numel() as f64;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{images} images in {secs:.2} s ({:.0} images/s), mean pixel {:.1}",
        images as f64 / secs,
        mean / loader.len().max(1) as f64
    );
    Ok(())
}
