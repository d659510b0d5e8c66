//! Benchmark: what resumability costs a data loader per batch.
//!
//! The same epochs are run three ways over 64 × 3 × 32 × 32 `f32` batches (2 worker
//! processes, persistent): plain; taking `state_dict()` after every batch; and taking
//! it and writing it as JSON after every batch (a checkpoint of the loader at each
//! step, the worst case). It prints the time per batch of each, the difference, and the
//! time of one `state_dict()` (+ JSON) taken mid-epoch in a tight loop, in and out of
//! order — against a target of 1% of a batch's time.
//!
//! ```sh
//! cargo run --release --example dataloader_resume_cost
//! ```

use std::time::Instant;

use multiproc::data::{DataLoader, Dataset};
use multiproc::{DType, Tensor};

/// `n` images of 3 × 32 × 32, sample `i` filled with `i`.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Images(usize);

impl Dataset for Images {
    type Item = (Tensor, i64);

    fn len(&self) -> usize {
        self.0
    }

    fn get(&self, i: usize) -> multiproc::Result<(Tensor, i64)> {
        Ok((Tensor::full(&[3, 32, 32], i as f64, DType::F32)?, i as i64))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    State,
    StateJson,
}

/// Seconds per batch over `epochs` epochs (after a warm-up epoch).
fn per_batch(in_order: bool, mode: Mode, epochs: usize) -> multiproc::Result<f64> {
    let mut loader = DataLoader::builder(Images(8192))
        .batch_size(64)
        .shuffle(1)
        .num_workers(2)
        .persistent_workers(true)
        .in_order(in_order)
        .build()?;
    for b in &mut loader {
        b?;
    }
    let mut batches = 0usize;
    let mut bytes = 0usize;
    let start = Instant::now();
    for _ in 0..epochs {
        let mut epoch = loader.iter();
        while let Some(b) = epoch.next() {
            let (x, _) = b?;
            std::hint::black_box(x.numel());
            match mode {
                Mode::Plain => {}
                Mode::State => {
                    std::hint::black_box(epoch.state_dict());
                }
                Mode::StateJson => {
                    let json = serde_json::to_string(&epoch.state_dict())
                        .map_err(|e| multiproc::Error::InvalidArgument(e.to_string()))?;
                    bytes += json.len();
                }
            }
            batches += 1;
        }
    }
    std::hint::black_box(bytes);
    Ok(start.elapsed().as_secs_f64() / batches as f64)
}

/// Seconds per `state_dict()` (and per JSON write of it) mid-epoch.
fn state_alone(in_order: bool) -> multiproc::Result<(f64, f64, usize)> {
    let mut loader = DataLoader::builder(Images(8192))
        .batch_size(64)
        .shuffle(1)
        .num_workers(2)
        .in_order(in_order)
        .build()?;
    let mut epoch = loader.iter();
    for _ in 0..40 {
        epoch.next().transpose()?;
    }
    let n = 100_000;
    let start = Instant::now();
    for _ in 0..n {
        std::hint::black_box(epoch.state_dict());
    }
    let state = start.elapsed().as_secs_f64() / n as f64;
    let start = Instant::now();
    let mut len = 0;
    for _ in 0..n {
        len = serde_json::to_string(&epoch.state_dict())
            .map_err(|e| multiproc::Error::InvalidArgument(e.to_string()))?
            .len();
    }
    let json = start.elapsed().as_secs_f64() / n as f64;
    Ok((state, json, len))
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let epochs = 3;
    println!("64 x 3x32x32 f32 batches, 2 worker processes, {epochs} epochs of 128 batches");
    println!(
        "{:>9} {:>14} {:>14} {:>14} {:>12} {:>12} {:>11}",
        "order", "plain us/b", "+state us/b", "+json us/b", "state us", "json us", "json bytes"
    );
    for in_order in [true, false] {
        let plain = per_batch(in_order, Mode::Plain, epochs)?;
        let state = per_batch(in_order, Mode::State, epochs)?;
        let json = per_batch(in_order, Mode::StateJson, epochs)?;
        let (alone, alone_json, bytes) = state_alone(in_order)?;
        println!(
            "{:>9} {:>14.1} {:>14.1} {:>14.1} {:>12.3} {:>12.3} {:>11}",
            if in_order { "in order" } else { "as ready" },
            plain * 1e6,
            state * 1e6,
            json * 1e6,
            alone * 1e6,
            alone_json * 1e6,
            bytes
        );
        println!(
            "{:>9} state_dict + JSON per batch = {:.4}% of a batch's time",
            "",
            alone_json / plain * 100.0
        );
    }
    Ok(())
}
