//! The instructions one tensor's trip costs, counted rather than timed: the subject of
//! `scripts/trip_cost.sh`, which runs this under callgrind at two trip counts.
//!
//! ```text
//! TRIPS=1000 cargo run --release -p multiproc --example trip_cost
//! ```
//!
//! One process, `TRIPS` times: makes a fresh 256-byte shared tensor (as `multiproc
//! bench`'s `small` producer does), fills it, `put`s it on a queue of capacity 4,
//! `get`s it back and sums it. The difference between two trip counts is the cost of
//! the trip alone, start-up excluded. Both sides run in this process, so what only a
//! second process pays (taking back the uses a receiver gave back, keeping a
//! received block mapped) is not in the count; valgrind cannot follow multiproc's
//! workers (it lacks `pidfd_open`).
//!
//! With `MESSAGE=u64` the message is a `u64` instead (put, got and added up): what any
//! message costs, so that the difference is what a tensor adds to it (its storage's
//! block use, its handle's wire form, the map cache and the received-storage table,
//! making, filling and summing it).

use multiproc::{DType, Queue, Tensor};

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let trips: usize = std::env::var("TRIPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    if std::env::var("MESSAGE").as_deref() == Ok("u64") {
        let q = Queue::with_capacity(4)?;
        let mut total = 0u64;
        for i in 0..trips as u64 {
            q.put(i)?;
            total += q.get_timeout(std::time::Duration::from_secs(60))?;
        }
        let expected: u64 = (0..trips as u64).sum();
        if total != expected {
            return Err(multiproc::Error::user(std::io::Error::other(format!(
                "the trips summed to {total}, not {expected}"
            ))));
        }
        println!("{trips} trips of a u64");
        return Ok(());
    }
    let q = Queue::with_capacity(4)?;
    let mut total = 0.0;
    for i in 0..trips {
        let t = Tensor::empty_shared(&[64], DType::F32)?;
        t.fill_((i % 7) as f64)?;
        q.put(t)?;
        total += q.get_timeout(std::time::Duration::from_secs(60))?.sum()?;
    }
    let expected: f64 = (0..trips).map(|i| (i % 7) as f64 * 64.0).sum();
    if total != expected {
        return Err(multiproc::Error::user(std::io::Error::other(format!(
            "the trips summed to {total}, not {expected}"
        ))));
    }
    println!("{trips} trips");
    Ok(())
}
