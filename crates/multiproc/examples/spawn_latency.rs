//! How long `spawn` of 4 no-op workers takes, start to joined, per start method.
//!
//! ```text
//! cargo run --release -p multiproc --example spawn_latency
//! ```
//!
//! A measurement, not a test: it prints figures (torch.multiprocessing.spawn takes
//! 5–6 s for the same on the reference machine).

use std::time::{Duration, Instant};

use multiproc::{SpawnOptions, StartMethod};

fn noop(_rank: usize, _: ()) {}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let rounds = 30;
    println!("spawn of 4 no-op workers, joined; {rounds} rounds after one warm-up");
    for method in StartMethod::ALL {
        let options = SpawnOptions::new().start_method(method);
        options.spawn(noop, (), 4)?; // warm-up: launcher thread, fork server, page cache
        let mut times: Vec<Duration> = (0..rounds)
            .map(|_| {
                let start = Instant::now();
                options.spawn(noop, (), 4).map(|()| start.elapsed())
            })
            .collect::<multiproc::Result<_>>()?;
        times.sort();
        println!(
            "{method:>10}: min {:>8.2?}  median {:>8.2?}  max {:>8.2?}",
            times[0],
            times[rounds / 2],
            times[rounds - 1]
        );
    }
    Ok(())
}
