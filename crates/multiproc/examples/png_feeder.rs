//! Rust decodes, Python trains: a `multiproc::data::DataLoader` whose worker processes
//! decode PNG files into shared batch tensors, feeding a PyTorch training loop in
//! another process through one queue, by handle (feature `image`).
//!
//! ```text
//! cargo build --release -p multiproc --features image --example png_feeder
//! python3 crates/multiproc-py/examples/train_from_rust.py --dir DIR
//! ```
//!
//! The Python trainer starts this program with the queue sealed into an fd
//! (`multiproc.parcel_for_child`): `png_feeder --dir DIR --queue FD [--workers N]
//! [--batch-size B] [--epochs E] [--resize S]`. Each batch goes on the queue as
//! `("batch", images, labels)` (`[B, 3, S, S]` `uint8` and `[B]` `int64` tensors,
//! received in Python as torch tensors over the workers' blocks); after the last epoch
//! it puts `("done", batches)` and exits at once (the message is delivered all the
//! same). The queue is bounded by the trainer, so decoding runs at most that far
//! ahead of training.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use clap::Parser;
use multiproc::data::{DataLoader, ImageFolder};
use multiproc::{Dynamic, Queue};

#[derive(Parser, Debug)]
struct Args {
    /// Directory of PNG files (one subdirectory per class, or files alone: class 0).
    #[arg(long)]
    dir: PathBuf,
    /// The inherited fd of the queue to feed (a parcel from Python).
    #[arg(long)]
    queue: RawFd,
    /// Decoding worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Passes over the files.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Resize every image to this side (pixels), in the workers.
    #[arg(long)]
    resize: Option<u32>,
    /// Shuffle with this seed.
    #[arg(long)]
    seed: Option<u64>,
}

fn run(args: Args) -> multiproc::Result<()> {
    if args.queue < 0 {
        return Err(multiproc::Error::InvalidArgument(format!(
            "--queue {} is not a file descriptor",
            args.queue
        )));
    }
    // SAFETY: the fd was inherited for this process to take over (the trainer's
    // `pass_fds`); nothing else in this program uses or closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(args.queue) };
    let batches: Queue<Dynamic> = multiproc::parcel::open(fd)?;
    let mut folder = ImageFolder::new(&args.dir)?;
    if let Some(side) = args.resize {
        folder = folder.resize(side, side);
    }
    let mut builder = DataLoader::builder(folder)
        .batch_size(args.batch_size)
        .drop_last(true)
        .num_workers(args.workers)
        .persistent_workers(true);
    if let Some(seed) = args.seed {
        builder = builder.shuffle(seed);
    }
    let mut loader = builder.build()?;
    let mut sent = 0i64;
    for _ in 0..args.epochs {
        for batch in &mut loader {
            let (images, labels) = batch?;
            batches.put(Dynamic::Tuple(vec![
                "batch".into(),
                images.into(),
                labels.into(),
            ]))?;
            sent += 1;
        }
    }
    batches.put(Dynamic::Tuple(vec!["done".into(), sent.into()]))?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    multiproc::init();
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("png_feeder: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
