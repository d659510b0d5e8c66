//! Benchmark: batches/s of 64 × 3 × 224 × 224 `u8` images decoded from PNG files, with
//! 0, 1 and 2 worker processes or threads (feature `image`), and the first batch's
//! latency of a freshly built loader (workers started for it: `first_batch_ms`, the
//! median of 3), which shows whether N workers start in parallel.
//!
//! It writes its own PNG files (smooth gradients with noise, so they compress and
//! decode like photographs rather than like static) into a temporary directory and
//! removes them at the end; with `--dir` it uses that directory instead, writing the
//! files there first if it has none (and leaving them, for
//! `scripts/compare_dataloader.py`, which runs torch's DataLoader on the same files).
//!
//! Each setting runs one warm-up epoch with persistent workers (the workers start, the
//! page cache fills), then `--epochs` timed epochs (3).
//!
//! ```sh
//! cargo run --release --features image --example dataloader_bench
//! cargo run --release --features image --example dataloader_bench -- --workers 0,2 --json
//! cargo run --release --features image --example dataloader_bench -- --workers 1,8 --kind process,thread
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use multiproc::data::{DataLoader, Dataset, ImageFolder, WorkerKind};

#[derive(Parser, Debug)]
struct Args {
    /// Directory of PNG files to load (written first if it holds none).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Images to write when making the files.
    #[arg(long, default_value_t = 512)]
    images: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// The worker counts to measure, comma-separated.
    #[arg(long, default_value = "0,1,2", value_delimiter = ',')]
    workers: Vec<usize>,
    /// Worker kinds to measure, comma-separated: process, thread.
    #[arg(long, default_value = "process", value_delimiter = ',')]
    kind: Vec<String>,
    /// Timed epochs per setting (after the warm-up epoch).
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Measure only the baseline: decoding every file in this process, no loader.
    #[arg(long)]
    decode_only: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

const SIDE: u32 = 224;

/// Writes `n` PNG images of 224 × 224 RGB into `dir`.
fn make_images(dir: &Path, n: usize) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for i in 0..n {
        let mut h = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let img = image::RgbImage::from_fn(SIDE, SIDE, |x, y| {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            let noise = (h >> 59) as u8; // 0..32
            let base = |k: u32| ((x * (k + 1) + y * (3 - k) + i as u32 * 7) % 224) as u8;
            image::Rgb([base(0) + noise, base(1) + noise, base(2) + noise])
        });
        let path = dir.join(format!("{i:05}.png"));
        img.save(&path)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

fn has_png(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| {
        d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "png")))
    })
}

/// The median, over 3 fresh loaders, of the time from `iter()` to the first batch
/// (the workers start for it), in milliseconds.
fn first_batch_ms(
    dir: &Path,
    workers: usize,
    kind: WorkerKind,
    batch_size: usize,
) -> multiproc::Result<f64> {
    let mut times = Vec::new();
    for _ in 0..3 {
        let mut loader = DataLoader::builder(ImageFolder::new(dir)?)
            .batch_size(batch_size)
            .num_workers(workers)
            .workers(kind)
            .build()?;
        let start = Instant::now();
        // The epoch stays alive past the measurement: ending it stops the workers.
        let mut epoch = loader.iter();
        let first = epoch.next();
        times.push(start.elapsed().as_secs_f64() * 1e3);
        drop(epoch);
        if let Some(b) = first {
            b?;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[1])
}

/// Runs a warm-up epoch and `epochs` timed ones; returns (batches, seconds, checksum).
fn measure(
    dir: &Path,
    workers: usize,
    kind: WorkerKind,
    batch_size: usize,
    epochs: usize,
) -> multiproc::Result<(usize, f64, f64)> {
    let mut loader = DataLoader::builder(ImageFolder::new(dir)?)
        .batch_size(batch_size)
        .drop_last(true)
        .num_workers(workers)
        .workers(kind)
        .persistent_workers(true)
        .build()?;
    for batch in &mut loader {
        batch?;
    }
    let start = Instant::now();
    let mut batches = 0;
    let mut checksum = 0.0;
    for _ in 0..epochs {
        for batch in &mut loader {
            let (images, labels) = batch?;
            // Touch the batch as a trainer would (one read of one image per batch, so
            // the loader's throughput, not this loop's, is measured).
            checksum += images.select(0, 0)?.sum()? + labels.sum()?;
            assert_eq!(
                images.shape(),
                [batch_size, 3, SIDE as usize, SIDE as usize]
            );
            batches += 1;
        }
    }
    Ok((batches, start.elapsed().as_secs_f64(), checksum))
}

/// The baseline: decode and convert every image in this process, `epochs` times, with
/// no loader, no collate and no batch tensor; returns batches/s equivalent.
fn decode_only(dir: &Path, batch_size: usize, epochs: usize) -> multiproc::Result<f64> {
    let folder = ImageFolder::new(dir)?;
    let mut checksum = 0.0;
    let start = Instant::now();
    for _ in 0..epochs {
        for i in 0..folder.len() {
            let (image, label) = folder.get(i)?;
            checksum += label as f64 + image.numel() as f64;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    std::hint::black_box(checksum);
    Ok((folder.len() * epochs) as f64 / batch_size as f64 / secs)
}

fn main() -> Result<(), String> {
    multiproc::init();
    let args = Args::parse();
    let (dir, temporary) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("multiproc-dataloader-bench-{}", std::process::id())),
            true,
        ),
    };
    if !has_png(&dir) {
        make_images(&dir, args.images)?;
    }
    let outcome = (|| -> Result<(), String> {
        if args.decode_only {
            let per_s =
                decode_only(&dir, args.batch_size, args.epochs).map_err(|e| e.to_string())?;
            if args.json {
                println!(
                    "{{\"impl\":\"multiproc\",\"mode\":\"decode_only\",\"batches_per_s\":{per_s:.3}}}"
                );
            } else {
                println!("decode only, no loader: {per_s:.2} batches/s");
            }
            return Ok(());
        }
        if !args.json {
            println!(
                "PNG -> {}x3x{SIDE}x{SIDE} u8 batches, {}",
                args.batch_size,
                dir.display()
            );
            println!(
                "{:>8} {:>8} {:>10} {:>12} {:>9} {:>15}",
                "kind", "workers", "batches/s", "images/s", "seconds", "first_batch_ms"
            );
        }
        for kind_name in &args.kind {
            let kind = match kind_name.as_str() {
                "process" => WorkerKind::Process,
                "thread" => WorkerKind::Thread,
                other => return Err(format!("--kind {other}: expected process or thread")),
            };
            for &workers in &args.workers {
                let (batches, secs, _) = measure(&dir, workers, kind, args.batch_size, args.epochs)
                    .map_err(|e| e.to_string())?;
                let first = first_batch_ms(&dir, workers, kind, args.batch_size)
                    .map_err(|e| e.to_string())?;
                let per_s = batches as f64 / secs;
                if args.json {
                    println!(
                        "{{\"impl\":\"multiproc\",\"kind\":\"{kind_name}\",\"workers\":{workers},\"batch_size\":{},\"batches\":{batches},\"seconds\":{secs:.4},\"batches_per_s\":{per_s:.3},\"first_batch_ms\":{first:.2}}}",
                        args.batch_size
                    );
                } else {
                    println!(
                        "{kind_name:>8} {workers:>8} {per_s:>10.2} {:>12.0} {secs:>9.2} {first:>15.1}",
                        per_s * args.batch_size as f64
                    );
                }
            }
        }
        Ok(())
    })();
    if temporary {
        std::fs::remove_dir_all(&dir)
            .map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
    }
    outcome
}
