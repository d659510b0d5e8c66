//! Hogwild with the Rust ML ecosystem: 4 worker processes train one softmax classifier
//! whose parameters live in shared memory, computing their gradients with `ndarray` and
//! applying them without locks; the parent evaluates the model with `candle`.
//!
//! The point is the glue: every crossing between multiproc and the two libraries is one
//! call, marked `// glue` below (5 lines), and there is no `unsafe`.
//!
//! ```text
//! cargo run --release -p multiproc --features ndarray,candle --example hogwild_ndarray_candle
//! ```

use candle_core::{Device, Tensor as CandleTensor};
use multiproc::{DType, Tensor};
use ndarray::{Array1, Array2, Axis, Ix2};

const DIM: usize = 16;
const CLASSES: usize = 4;
const WORKERS: usize = 4;
const STEPS: usize = 300;
const BATCH: usize = 32;

/// A deterministic data set: `n` points around `CLASSES` centres (the same in every
/// process, from `seed`), with their labels.
fn data(n: usize, seed: u64) -> (Array2<f32>, Vec<usize>) {
    let mut s = seed;
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let labels: Vec<usize> = (0..n).map(|i| i % CLASSES).collect();
    let x = Array2::from_shape_fn((n, DIM), |(i, j)| {
        let centre = if j % CLASSES == labels[i] { 2.0 } else { 0.0 };
        centre + next()
    });
    (x, labels)
}

/// One gradient of the softmax cross-entropy on a batch, with ndarray.
fn gradient(w: &Array2<f32>, x: &Array2<f32>, labels: &[usize]) -> Array2<f32> {
    let mut p = x.dot(&w.t());
    for mut row in p.axis_iter_mut(Axis(0)) {
        let max = row.fold(f32::MIN, |a, &b| a.max(b));
        row.mapv_inplace(|v| (v - max).exp());
        let sum = row.sum();
        row /= sum;
    }
    for (i, &l) in labels.iter().enumerate() {
        p[[i, l]] -= 1.0;
    }
    p.t().dot(x) / labels.len() as f32
}

fn train(rank: usize, params: Tensor) -> multiproc::Result<()> {
    let (x, labels) = data(BATCH * STEPS, 100 + rank as u64);
    for step in 0..STEPS {
        let w = params.to_ndarray::<f32>()?; // glue: one copy out of shared memory
        let w = w.into_dimensionality::<Ix2>().expect("2-d"); // glue
        let rows = step * BATCH..(step + 1) * BATCH;
        let g = gradient(
            &w,
            &x.slice(ndarray::s![rows.clone(), ..]).to_owned(),
            &labels[rows],
        );
        params.add_(&Tensor::from_ndarray(&g)?, -0.5)?; // glue: atomic Hogwild update
    }
    Ok(())
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let params = Tensor::zeros_shared(&[CLASSES, DIM], DType::F32)?;
    multiproc::spawn(train, params.clone(), WORKERS)?;

    let (x, labels) = data(2000, 999);
    let candle = |e: candle_core::Error| multiproc::Error::Tensor(e.to_string());
    let w = params.to_candle()?; // glue: one memcpy into candle
    let x = CandleTensor::from_slice(
        x.as_slice().expect("standard layout"),
        (2000, DIM),
        &Device::Cpu,
    )
    .map_err(candle)?;
    let predicted = x
        .matmul(&w.t().map_err(candle)?)
        .map_err(candle)?
        .argmax(1)
        .map_err(candle)?;
    let predicted = Tensor::from_candle(&predicted)?.to_vec::<u32>()?; // glue: u32 back
    let correct = predicted
        .iter()
        .zip(&labels)
        .filter(|(p, l)| **p as usize == **l)
        .count();
    let accuracy = correct as f64 / labels.len() as f64;
    let norm = Array1::from(params.to_vec::<f32>()?)
        .mapv(|v| v * v)
        .sum()
        .sqrt();
    println!(
        "{WORKERS} workers x {STEPS} steps: test accuracy {:.1}% (|w| = {norm:.2})",
        accuracy * 100.0
    );
    assert!(accuracy > 0.9, "Hogwild training did not learn: {accuracy}");
    Ok(())
}
