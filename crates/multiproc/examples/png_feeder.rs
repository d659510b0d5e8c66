//! Rust decodes, Python trains: a `multiproc::data::DataLoader` whose worker processes
//! decode PNG files into shared batch tensors, feeding a PyTorch training loop in
//! another process through one queue, by handle (feature `image`).
//!
//! ```text
//! cargo build --release -p multiproc --features image --example png_feeder
//! python3 crates/multiproc-py/examples/train_from_rust.py --dir DIR
//! ```
//!
//! Either side may start the other. The Python trainer starts this program with the
//! queue sealed into an fd (`multiproc.parcel_for_child`): `png_feeder --dir DIR
//! --queue FD [--workers N] [--batch-size B] [--epochs E] [--resize S]`. Or this
//! program starts the trainer: `png_feeder --dir DIR --trainer python3
//! crates/multiproc-py/examples/train_from_rust.py` makes a queue bounded to twice the
//! workers, runs the trainer command with `--queue-fd FD --classes N` appended (the queue sealed
//! into an inherited fd), feeds it, and exits with the trainer's status. Each batch goes on the queue as
//! `("batch", images, labels)` (`[B, 3, S, S]` `uint8` and `[B]` `int64` tensors,
//! received in Python as torch tensors over the workers' blocks); after the last epoch
//! it puts `("done", batches)` and exits at once (the message is delivered all the
//! same). The queue is bounded by the trainer, so decoding runs at most that far
//! ahead of training.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
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
    #[arg(long, required_unless_present = "trainer")]
    queue: Option<RawFd>,
    /// Start this trainer command instead (with `--queue-fd FD` appended) and feed it.
    #[arg(long, num_args = 1.., allow_hyphen_values = true, conflicts_with = "queue")]
    trainer: Vec<String>,
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

/// The queue inherited from the trainer that started this program.
fn inherited_queue(fd: RawFd) -> multiproc::Result<Queue<Dynamic>> {
    if fd < 0 {
        return Err(multiproc::Error::InvalidArgument(format!(
            "--queue {fd} is not a file descriptor"
        )));
    }
    // SAFETY: the fd was inherited for this process to take over (the trainer's
    // `pass_fds`); nothing else in this program uses or closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    multiproc::parcel::open(fd)
}

/// Starts the trainer command with a new queue sealed into an fd it inherits.
fn start_trainer(
    command: &[String],
    workers: usize,
    classes: usize,
) -> multiproc::Result<(Queue<Dynamic>, std::process::Child)> {
    let queue: Queue<Dynamic> = Queue::with_capacity(2 * workers.max(1))?;
    let parcel = multiproc::parcel::seal(&queue)?;
    // The parcel is close-on-exec like every fd multiproc makes: let the trainer
    // inherit this one.
    rustix::io::fcntl_setfd(&parcel, rustix::io::FdFlags::empty())
        .map_err(|e| multiproc::Error::InvalidArgument(format!("fcntl on the parcel: {e}")))?;
    let child = std::process::Command::new(&command[0])
        .args(&command[1..])
        .arg("--queue-fd")
        .arg(parcel.as_raw_fd().to_string())
        .arg("--classes")
        .arg(classes.to_string())
        .spawn()
        .map_err(|e| {
            multiproc::Error::InvalidArgument(format!("cannot start {}: {e}", command[0]))
        })?;
    drop(parcel); // the trainer has its own copy
    Ok((queue, child))
}

fn run(args: Args) -> multiproc::Result<()> {
    let mut folder = ImageFolder::new(&args.dir)?;
    if let Some(side) = args.resize {
        folder = folder.resize(side, side);
    }
    let (batches, trainer) = match args.queue {
        Some(fd) => (inherited_queue(fd)?, None),
        None => {
            let classes = folder.classes().len();
            let (queue, child) = start_trainer(&args.trainer, args.workers, classes)?;
            (queue, Some(child))
        }
    };
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
    if let Some(mut child) = trainer {
        let status = child.wait().map_err(|e| {
            multiproc::Error::InvalidArgument(format!("waiting for the trainer: {e}"))
        })?;
        if !status.success() {
            return Err(multiproc::Error::InvalidArgument(format!(
                "the trainer {status}"
            )));
        }
    }
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
