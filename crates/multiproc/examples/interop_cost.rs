//! What crossing into ndarray and candle (and burn, with its feature) costs for a 40 MB
//! tensor, against a plain `memcpy` of 40 MB measured in the same run (the floor for any
//! one-copy conversion).
//!
//! ```text
//! cargo run --release -p multiproc --features ndarray,candle --example interop_cost
//! cargo run --release -p multiproc --features ndarray,candle,burn --example interop_cost
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

    #[allow(unused_mut)] // the burn rows are pushed with the `burn` feature
    let mut rows: Vec<(&str, Duration)> = vec![
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
    #[cfg(feature = "burn")]
    rows.extend(burn_rows(&tensor, &shared, &data)?);

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

/// burn's figures: the copies, and the borrows (which cost no copy whatever the size).
#[cfg(feature = "burn")]
fn burn_rows(
    tensor: &Tensor,
    shared: &Tensor,
    data: &[f32],
) -> multiproc::Result<Vec<(&'static str, Duration)>> {
    use burn_tensor::DType as BurnDType;
    #[allow(deprecated)] // burn 0.22 deprecates NdArray in favour of Flex
    let device = burn_tensor::Device::ndarray();
    let n = data.len();
    let burn_data = burn_tensor::TensorData::new(data.to_vec(), [n]);
    Ok(vec![
        (
            "to_burn",
            median(|| drop(black_box(tensor.to_burn().unwrap()))),
        ),
        (
            "to_burn + NdArray tensor",
            median(|| {
                let d = tensor.to_burn().unwrap();
                drop(black_box(burn_tensor::Tensor::<1>::from_data(d, &device)));
            }),
        ),
        (
            "from_burn",
            median(|| drop(black_box(Tensor::from_burn(&burn_data).unwrap()))),
        ),
        (
            "from_burn_shared",
            median(|| drop(black_box(Tensor::from_burn_shared(&burn_data).unwrap()))),
        ),
        (
            "from_burn + into_burn (borrowed)",
            median(|| {
                let t = Tensor::from_burn(&burn_data).unwrap();
                drop(black_box(t.into_burn().unwrap()));
            }),
        ),
        (
            "as_burn (shared, zero-copy)",
            // SAFETY: nothing writes `shared` while burn holds it.
            median(|| drop(black_box(unsafe { shared.as_burn() }.unwrap()))),
        ),
        (
            "as_burn + NdArray tensor (zero-copy)",
            median(|| {
                // SAFETY: nothing writes `shared` while burn holds it.
                let d = unsafe { shared.as_burn() }.unwrap();
                let t = burn_tensor::Tensor::<1>::from_data(d, (&device, BurnDType::F32));
                drop(black_box(t));
            }),
        ),
    ])
}
