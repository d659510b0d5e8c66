//! A three-stage pipeline over bounded queues: a reader, two transformers, and the
//! parent that collects, with end-of-stream and a failed stage handled without a hang.
//!
//! ```text
//! cargo run -p multiproc --example pipeline            # prints the checksum, exits 0
//! cargo run -p multiproc --example pipeline -- --fail  # transformer-1 fails: reported, exit 1
//! ```
//!
//! - `reader` puts the records on `raw`, then one `None` per transformer: each
//!   transformer stops at the first `None` it takes, so both stop.
//! - `transformer-1` and `transformer-2` take from `raw`, put the results on `cooked`,
//!   and pass their `None` on when they stop.
//! - The parent waits on `cooked` and on the three processes in one call
//!   ([`connection::wait`](multiproc::connection::wait)): an item, or a stage that
//!   ended. A stage that failed is reported by name, rank and pid
//!   ("transformer-1 (rank 1, pid 4242) returned an error: …"); the others are then
//!   terminated and joined, and the program exits non-zero, instead of waiting forever
//!   for the `None` the failed stage will never send (and the reader, blocked on a full
//!   queue nobody reads, never ending).

use std::process::ExitCode;
use std::time::Duration;

use multiproc::connection::{Waitable, wait};
use multiproc::{Error, Process, Queue};

const RECORDS: u64 = 10_000;
const TRANSFORMERS: usize = 2;
/// The record that `--fail` makes transformer-1 refuse.
const BAD_RECORD: u64 = 1234;

fn transform(x: u64) -> u64 {
    x * x % 1_000_003
}

fn reader(_rank: usize, raw: Queue<Option<u64>>) -> multiproc::Result<()> {
    for x in 0..RECORDS {
        raw.put(Some(x))?;
    }
    for _ in 0..TRANSFORMERS {
        raw.put(None)?;
    }
    Ok(())
}

fn transformer(
    rank: usize,
    (raw, cooked, fail): (Queue<Option<u64>>, Queue<Option<u64>>, bool),
) -> multiproc::Result<()> {
    while let Some(x) = raw.get()? {
        if fail && rank == 1 && x >= BAD_RECORD {
            return Err(Error::msg(format!("record {x} is corrupt")));
        }
        cooked.put(Some(transform(x)))?;
    }
    cooked.put(None)?;
    Ok(())
}

fn main() -> ExitCode {
    multiproc::init();
    let fail = std::env::args().any(|a| a == "--fail");
    match run(fail) {
        Ok(checksum) => {
            let expected: u64 = (0..RECORDS).map(transform).sum();
            println!("checksum {checksum} over {RECORDS} records (expected {expected})");
            if checksum == expected {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("pipeline failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the pipeline; the sum of what came out, or the first stage's failure (the other
/// stages terminated and joined).
fn run(fail: bool) -> multiproc::Result<u64> {
    let raw = Queue::with_capacity(64)?;
    let cooked = Queue::with_capacity(64)?;
    let mut stages = vec![
        Process::builder(reader, 0, raw.clone())
            .name("reader")
            .start()?,
    ];
    for rank in 1..=TRANSFORMERS {
        stages.push(
            Process::builder(transformer, rank, (raw.clone(), cooked.clone(), fail))
                .name(format!("transformer-{rank}"))
                .start()?,
        );
    }
    let mut ended = vec![false; stages.len()];
    let (mut sum, mut ends) = (0u64, 0);
    while ends < TRANSFORMERS {
        // The queue first, then every stage still running: an ended one stays ready.
        let running: Vec<usize> = (0..stages.len()).filter(|&i| !ended[i]).collect();
        let mut objects: Vec<&dyn Waitable> = vec![&cooked];
        objects.extend(running.iter().map(|&i| &stages[i] as &dyn Waitable));
        // No item and no stage ending for a minute: a stall is a failure too.
        let ready = wait(&objects, Some(Duration::from_secs(60)))?;
        for r in ready {
            if r == 0 {
                loop {
                    match cooked.try_get() {
                        Ok(Some(Some(v))) => sum += v,
                        Ok(Some(None)) => ends += 1,
                        Ok(None) => break,
                        // Every transformer has ended (after its `None`, unless it
                        // failed: its process, ready too, says how).
                        Err(e) if e.is_disconnected() => break,
                        Err(e) => return Err(e),
                    }
                }
                continue;
            }
            let i = running[r - 1];
            ended[i] = true;
            if let Some(err) = stages[i].error() {
                stop(&mut stages);
                return Err(err);
            }
        }
    }
    for stage in &mut stages {
        stage.join()?;
        if let Some(err) = stage.error() {
            return Err(err);
        }
    }
    Ok(sum)
}

/// Terminates every stage still running and reaps them all.
fn stop(stages: &mut [Process]) {
    for stage in stages.iter_mut().filter(|s| s.is_alive()) {
        if let Err(e) = stage.terminate() {
            eprintln!("cannot terminate {}: {e}", stage.name());
        }
    }
    for stage in stages.iter_mut() {
        if let Err(e) = stage.join_timeout(Duration::from_secs(10)) {
            eprintln!(
                "{} did not end after SIGTERM ({e}): killing it",
                stage.name()
            );
            let _ = stage.kill();
        }
    }
}
