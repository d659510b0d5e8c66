//! Three workers, one of which panics: what the parent gets back.
//!
//! ```text
//! cargo run -p multiproc --example spawn_errors
//! RUST_BACKTRACE=1 cargo run -p multiproc --example spawn_errors   # with the worker's backtrace
//! ```
//!
//! The panicking worker is reported with its rank, pid, panic message and location; the
//! other two, still busy, are terminated (SIGTERM, then SIGKILL after the grace period)
//! instead of being waited for.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use multiproc::Error;

fn train(rank: usize, steps: u32) {
    for step in 0..steps {
        if rank == 1 && step == 3 {
            panic!("rank {rank} found a NaN in batch {step}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn main() -> ExitCode {
    multiproc::init();
    let start = Instant::now();
    let result = multiproc::spawn(train, 50u32, 3);
    let elapsed = start.elapsed();
    match result {
        Ok(()) => {
            println!("all workers finished (unexpected: rank 1 should have panicked)");
            ExitCode::FAILURE
        }
        Err(err) => {
            println!("spawn returned after {elapsed:.2?} with: {err}\n");
            if let Error::ProcessRaised {
                error_index, pid, ..
            } = &err
            {
                println!("first failure: rank {error_index}, pid {pid}");
            }
            println!("every rank that failed on its own:");
            for failure in err.failures() {
                let how = match (&failure.exit_code, &failure.signal_name) {
                    (Some(code), _) => format!("exit code {code}"),
                    (None, Some(sig)) => format!("signal {sig}"),
                    (None, None) => "raised".to_string(),
                };
                println!(
                    "  rank {} (pid {}): {how}",
                    failure.error_index, failure.pid
                );
            }
            if matches!(err, Error::ProcessRaised { error_index: 1, .. }) {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
