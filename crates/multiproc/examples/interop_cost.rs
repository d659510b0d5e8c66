//! What crossing into ndarray and candle costs for a 40 MB tensor, against a plain
//! `memcpy` of 40 MB measured in the same run (the floor for any one-copy conversion).
//!
//! ```text
//! cargo run --release -p multiproc --features ndarray,candle --example interop_cost
//! ```
//!
//! A measurement, not a test: each figure is the median of 21 runs, with the ratio to
//! the memcpy into a fresh buffer (allocation and page faults included, as every
//! conversion that returns a new array pays them) and into a reused one.

use std::hint::black_box;
use std::time::{Duration, Instant};

use multiproc::{DType, Tensor};

const BYTES: usize = 40_000_000;
const RUNS: usize = 21;

fn median(mut f: impl FnMut()) -> Duration {
    f(); // warm up
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[RUNS / 2]
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let n = BYTES / 4;
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut reused = vec![0f32; n];

    let fresh_copy = median(|| {
        black_box(data.clone());
    });
    let reused_copy = median(|| {
        reused.copy_from_slice(black_box(&data));
        black_box(&reused);
    });

    let tensor = Tensor::from_slice(&data, &[n])?;
    let shared = Tensor::zeros_shared(&[n], DType::F32)?;
    let array = ndarray::Array1::from(data.clone());
    let candle = candle_core::Tensor::from_vec(data.clone(), n, &candle_core::Device::Cpu)
        .map_err(|e| multiproc::Error::Tensor(e.to_string()))?;

    let rows: Vec<(&str, Duration)> = vec![
        (
            "to_candle",
            median(|| drop(black_box(tensor.to_candle().unwrap()))),
        ),
        (
            "from_candle",
            median(|| drop(black_box(Tensor::from_candle(&candle).unwrap()))),
        ),
        (
            "from_candle_shared",
            median(|| drop(black_box(Tensor::from_candle_shared(&candle).unwrap()))),
        ),
        (
            "from_ndarray",
            median(|| drop(black_box(Tensor::from_ndarray(&array).unwrap()))),
        ),
        (
            "from_ndarray_shared",
            median(|| drop(black_box(Tensor::from_ndarray_shared(&array).unwrap()))),
        ),
        (
            "to_ndarray",
            median(|| drop(black_box(tensor.to_ndarray::<f32>().unwrap()))),
        ),
        (
            "to_vec",
            median(|| drop(black_box(tensor.to_vec::<f32>().unwrap()))),
        ),
        (
            "copy_from_ndarray (into shared)",
            median(|| shared.copy_from_ndarray(black_box(&array)).unwrap()),
        ),
        (
            "copy_from_slice (into shared)",
            median(|| shared.copy_from_slice(black_box(&data)).unwrap()),
        ),
        (
            "as_array_view (shared, zero-copy)",
            // SAFETY: nothing writes `shared` while the view lives.
            median(|| drop(black_box(unsafe { shared.as_array_view::<f32>() }.unwrap()))),
        ),
    ];

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!("40 MB of f32, median of {RUNS} runs");
    println!(
        "{:<36} {:>9} {:>14} {:>15}",
        "", "ms", "x fresh memcpy", "x reused memcpy"
    );
    println!(
        "{:<36} {:>9.2} {:>14.2} {:>15.2}",
        "memcpy into a fresh Vec (baseline)",
        ms(fresh_copy),
        1.0,
        ms(fresh_copy) / ms(reused_copy)
    );
    println!(
        "{:<36} {:>9.2} {:>14.2} {:>15.2}",
        "memcpy into a reused Vec (baseline)",
        ms(reused_copy),
        ms(reused_copy) / ms(fresh_copy),
        1.0
    );
    for (name, d) in rows {
        println!(
            "{name:<36} {:>9.2} {:>14.2} {:>15.2}",
            ms(d),
            ms(d) / ms(fresh_copy),
            ms(d) / ms(reused_copy)
        );
    }
    Ok(())
}
