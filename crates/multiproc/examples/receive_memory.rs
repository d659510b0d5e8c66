//! What receiving a 256 MiB tensor costs the receiver in memory: its RSS and PSS (and
//! the private part of them) from `/proc/self/smaps_rollup`, before the `get`, after
//! it, and after reading every byte (`sum`).
//!
//! ```text
//! cargo run --release -p multiproc --example receive_memory
//! ```
//!
//! A measurement, not a test. Expected: RSS grows by the 256 MiB the receiver reads
//! (shared pages, mapped from the sender's segment), PSS by half of that while the
//! sender still maps it too, and private memory not at all.

use std::time::Duration;

use multiproc::{DType, Queue, SharingStrategy, StartMethod, Tensor};

const BYTES: usize = 256 << 20;

fn producer(_rank: usize, (q, done): (Queue<Tensor>, multiproc::Event)) -> multiproc::Result<()> {
    let t = Tensor::zeros_shared(&[BYTES / 4], DType::F32)?;
    t.fill_(1.0)?;
    q.put(t)?;
    // Keep the sender's mapping while the parent measures (as a producer that goes on
    // working would).
    done.wait_timeout(Duration::from_secs(120))?;
    Ok(())
}

/// The `kB` fields of `/proc/self/smaps_rollup` that say where memory is charged.
fn rollup() -> Vec<(String, u64)> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (key, rest) = line.split_once(':')?;
            let kb = rest.trim().strip_suffix(" kB")?.trim().parse().ok()?;
            matches!(
                key,
                "Rss" | "Pss" | "Shared_Clean" | "Shared_Dirty" | "Private_Clean" | "Private_Dirty"
            )
            .then(|| (key.to_owned(), kb))
        })
        .collect()
}

fn show(label: &str, now: &[(String, u64)], before: &[(String, u64)]) {
    print!("{label:<28}");
    for ((key, kb), (_, base)) in now.iter().zip(before) {
        let delta = *kb as i64 - *base as i64;
        print!(" {key} {:>+8.1} MiB", delta as f64 / 1024.0);
    }
    println!();
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    let q = Queue::new()?;
    let done = multiproc::Event::new()?;
    let mut ctx =
        multiproc::start_processes(producer, (q.clone(), done.clone()), 1, StartMethod::Spawn)?;
    // Wait for the tensor to be queued before measuring the baseline.
    while q.is_empty() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = rollup();
    let t = q.get()?;
    let got = rollup();
    let total = t.sum()?;
    let read = rollup();
    println!(
        "receiving one {} MiB f32 tensor (sum {total}); change from before the get:",
        BYTES >> 20
    );
    show("after get (mapped)", &got, &before);
    show("after sum (every page read)", &read, &before);
    drop(t);
    done.set();
    ctx.join_timeout(Duration::from_secs(60))?;
    Ok(())
}
