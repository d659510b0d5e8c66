//! CUDA tensors through a queue, beside the device's own floor (needs a GPU and the
//! `cuda` feature; run by `scripts/gpu_check.sh`, with `scripts/compare_torch_cuda.py`
//! for torch's figures on the same machine).
//!
//! ```text
//! cargo run --release --features cuda --example cuda_bench [-- --json] [--scale 0.5]
//! ```
//!
//! Scenarios, each for 4 KiB, 64 MiB and 1 GiB:
//!
//! - `cuda_fresh`: the producer makes a fresh CUDA tensor (`zeros_on`: taken from the
//!   pool and cleared on the device) and puts it; the consumer (another process) gets
//!   it, reads its first element back to the host, drops it and acknowledges. Time per
//!   cycle, and bytes per second as if the tensor had been copied.
//! - `cuda_ping`: one CUDA tensor sent to the other process and sent back (a received
//!   tensor can be sent on; torch cannot do this, see the torch script).
//! - `d2d_copy` (the floor): one device-to-device copy of the same size (`copy_`
//!   between two CUDA tensors, waited for), in this process.
//! - `h2d_pinned` and `h2d_pageable`, for 64 MiB: a data loader's worker process makes
//!   64 MiB batches in shared memory; this process receives each and copies it to the
//!   device (`to(cuda:0)`, waited for). Pinned: the loader has `pin_memory(true)`, so
//!   the block a batch arrives in is page-locked where it is (registered once, then
//!   recycled); pageable: the same without. Only the copy is timed.
//!
//! Prints a table, or with `--json` one object per line with the fields of
//! `multiproc bench --json` (`scenario, strategy, bytes, count, per_s, GB_s,
//! us_per_roundtrip, seconds, impl`).

use std::time::{Duration, Instant};

use multiproc::data::{DataLoader, Dataset};
use multiproc::{DType, Device, Queue, StartMethod, Tensor, start_processes};

const GPU: Device = Device::Cuda(0);
const SIZES: [(usize, usize); 3] = [(4 << 10, 2000), (64 << 20, 200), (1 << 30, 20)];
/// No scenario runs longer than this (count is cut short).
const BUDGET: Duration = Duration::from_secs(4);

fn consume(_rank: usize, (q, acks): (Queue<Option<Tensor>>, Queue<u32>)) -> multiproc::Result<()> {
    let mut i = 0;
    while let Some(t) = q.get()? {
        let first = t.narrow(0, 0, 1)?.to(Device::Cpu)?.to_vec::<u8>()?[0];
        drop(t);
        acks.put(u32::from(first) + i)?;
        i += 1;
    }
    Ok(())
}

fn pong(
    _rank: usize,
    (inbox, outbox): (Queue<Option<Tensor>>, Queue<Tensor>),
) -> multiproc::Result<()> {
    while let Some(t) = inbox.get()? {
        outbox.put(t)?;
    }
    Ok(())
}

/// 16 MiB samples of `u8`, sample `i` all `i`: four make a 64 MiB batch.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Bytes16M(usize);

impl Dataset for Bytes16M {
    type Item = Tensor;

    fn len(&self) -> usize {
        self.0
    }

    fn get(&self, i: usize) -> multiproc::Result<Tensor> {
        Tensor::full(&[16 << 20], (i % 251) as f64, DType::U8)
    }
}

/// Host-to-device copies of `batches` 64 MiB batches as they arrive from a worker,
/// pinned or not; the copies' count and total time (the first two untimed).
fn h2d_from_batches(pinned: bool, batches: usize) -> multiproc::Result<(usize, f64)> {
    let mut loader = DataLoader::builder(Bytes16M(4 * (batches + 2)))
        .batch_size(4)
        .num_workers(1)
        .pin_memory(pinned)
        .build()?;
    let (mut count, mut seconds) = (0, 0.0);
    for (i, batch) in loader.iter().enumerate() {
        let x = batch?;
        assert_eq!(x.is_pinned(), pinned, "batch {i} pinned");
        let start = Instant::now();
        let on_gpu = x.to(GPU)?;
        let took = start.elapsed().as_secs_f64();
        assert_eq!(on_gpu.numel(), 64 << 20);
        if i >= 2 {
            count += 1;
            seconds += took;
        }
    }
    Ok((count, seconds))
}

struct Figure {
    scenario: &'static str,
    bytes: usize,
    count: usize,
    seconds: f64,
}

impl Figure {
    fn print(&self, json: bool) {
        let per = self.seconds / self.count as f64;
        let gb_s = self.bytes as f64 / per / 1e9;
        if json {
            println!(
                "{{\"scenario\":\"{}\",\"strategy\":\"{}\",\"bytes\":{},\"count\":{},\"per_s\":{:.1},\"GB_s\":{:.3},\"us_per_roundtrip\":{:.2},\"seconds\":{:.4},\"impl\":\"multiproc\"}}",
                self.scenario,
                // The copies from host memory: the host side is a data loader's shared
                // block (the default strategy).
                if self.scenario.starts_with("h2d") {
                    "file_descriptor"
                } else {
                    "cuda_vmm_fd"
                },
                self.bytes,
                self.count,
                1.0 / per,
                gb_s,
                per * 1e6,
                self.seconds
            );
        } else {
            println!(
                "{:<12} {:>10} {:>7} {:>12.1} us {:>10.2} GB/s",
                self.scenario,
                human(self.bytes),
                self.count,
                per * 1e6,
                gb_s
            );
        }
    }
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 30 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n => format!("{} KiB", n >> 10),
    }
}

/// Runs `step` `count` times (fewer if the budget runs out) after `warm` untimed ones.
fn timed(
    count: usize,
    warm: usize,
    mut step: impl FnMut(usize) -> multiproc::Result<()>,
) -> multiproc::Result<(usize, f64)> {
    for i in 0..warm {
        step(i)?;
    }
    let start = Instant::now();
    let mut done = 0;
    while done < count && (done == 0 || start.elapsed() < BUDGET) {
        step(warm + done)?;
        done += 1;
    }
    Ok((done, start.elapsed().as_secs_f64()))
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let scale = args
        .iter()
        .position(|a| a == "--scale")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(1.0);
    let n = multiproc::cuda::init()?;
    let (free, total) = multiproc::cuda::mem_get_info(0)?;
    if !json {
        println!(
            "{n} CUDA device(s); cuda:0 has {} MiB free of {} MiB",
            free >> 20,
            total >> 20
        );
        println!(
            "{:<12} {:>10} {:>7} {:>15} {:>15}",
            "scenario", "size", "count", "per op", "as a copy"
        );
    }
    let count_of = |c: usize| ((c as f64 * scale) as usize).max(3);

    // fresh: make, put; get, read one element, drop, ack
    let (q, acks) = (Queue::new()?, Queue::new()?);
    let mut consumer = start_processes(consume, (q.clone(), acks.clone()), 1, StartMethod::Spawn)?;
    let mut sent = 0u32;
    for &(bytes, count) in &SIZES {
        let (done, seconds) = timed(count_of(count), 3, |_| {
            let t = Tensor::zeros_on(&[bytes], DType::U8, GPU)?;
            q.put(Some(t))?;
            let ack = acks.get()?;
            assert_eq!(ack, sent, "the consumer read a zero and counted");
            sent += 1;
            Ok(())
        })?;
        Figure {
            scenario: "cuda_fresh",
            bytes,
            count: done,
            seconds,
        }
        .print(json);
    }
    q.put(None)?;
    consumer.join_timeout(Duration::from_secs(60))?;

    // ping: one tensor there and back
    let (inbox, outbox) = (Queue::new()?, Queue::new()?);
    let mut ponger = start_processes(pong, (inbox.clone(), outbox.clone()), 1, StartMethod::Spawn)?;
    for &(bytes, count) in &SIZES {
        let t = Tensor::zeros_on(&[bytes], DType::U8, GPU)?;
        let (done, seconds) = timed(count_of(count * 2), 3, |_| {
            inbox.put(Some(t.clone()))?;
            let back: Tensor = outbox.get()?;
            assert_eq!(
                back.data_ptr(),
                t.data_ptr(),
                "it came back to the same mapping"
            );
            Ok(())
        })?;
        Figure {
            scenario: "cuda_ping",
            bytes,
            count: done,
            seconds,
        }
        .print(json);
    }
    inbox.put(None)?;
    ponger.join_timeout(Duration::from_secs(60))?;

    // the floor: one device-to-device copy of the same size
    for &(bytes, count) in &SIZES {
        let src = Tensor::zeros_on(&[bytes], DType::U8, GPU)?;
        let dst = Tensor::empty_on(&[bytes], DType::U8, GPU)?;
        let (done, seconds) = timed(count_of(count * 2), 3, |_| dst.copy_(&src))?;
        Figure {
            scenario: "d2d_copy",
            bytes,
            count: done,
            seconds,
        }
        .print(json);
    }

    // host to device from a received batch, pinned against pageable
    for (scenario, pinned) in [("h2d_pinned", true), ("h2d_pageable", false)] {
        let (count, seconds) = h2d_from_batches(pinned, count_of(20))?;
        Figure {
            scenario,
            bytes: 64 << 20,
            count,
            seconds,
        }
        .print(json);
    }
    multiproc::cuda::empty_cache();
    Ok(())
}
