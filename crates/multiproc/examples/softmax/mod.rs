//! The model the `hogwild` and `ddp` examples train: softmax regression on Gaussian
//! clusters, with a deterministic data set that every process can make alike.

#![allow(dead_code)] // each example uses its own part

pub const DIM: usize = 32;
pub const CLASSES: usize = 10;
/// Weights plus one bias per class, row-major `[CLASSES][DIM + 1]`.
pub const PARAMS: usize = CLASSES * (DIM + 1);

/// A tiny deterministic generator (splitmix64): the same stream in every process.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// A standard normal sample (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u = self.uniform().max(1e-7);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f32::consts::PI * v).cos()
    }
}

/// The data set: features row-major `[n][DIM]` and labels.
pub struct Data {
    pub x: Vec<f32>,
    pub y: Vec<usize>,
}

pub fn make_data(seed: u64, n: usize, stream: u64) -> Data {
    let mut centers = Rng(seed);
    let c: Vec<f32> = (0..CLASSES * DIM)
        .map(|_| centers.normal() * 0.55)
        .collect();
    let mut rng = Rng(seed ^ stream.wrapping_mul(0x5851_f42d_4c95_7f2d));
    let mut x = Vec::with_capacity(n * DIM);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let label = (rng.next_u64() % CLASSES as u64) as usize;
        x.extend((0..DIM).map(|d| c[label * DIM + d] + rng.normal()));
        y.push(label);
    }
    Data { x, y }
}

/// Softmax probabilities of one sample under parameters `w`.
pub fn probabilities(w: &[f32], x: &[f32]) -> [f32; CLASSES] {
    let mut logits = [0f32; CLASSES];
    for (k, logit) in logits.iter_mut().enumerate() {
        let row = &w[k * (DIM + 1)..(k + 1) * (DIM + 1)];
        *logit = row[DIM] + row[..DIM].iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
    }
    let max = logits.iter().copied().fold(f32::MIN, f32::max);
    let mut total = 0.0;
    for l in &mut logits {
        *l = (*l - max).exp();
        total += *l;
    }
    logits.map(|l| l / total)
}

/// Mean cross-entropy and accuracy of `w` on `data`.
pub fn evaluate(w: &[f32], data: &Data) -> (f64, f64) {
    let (mut loss, mut correct) = (0.0f64, 0usize);
    for (i, &label) in data.y.iter().enumerate() {
        let p = probabilities(w, &data.x[i * DIM..(i + 1) * DIM]);
        loss -= f64::from(p[label].max(1e-12).ln());
        let best = (0..CLASSES)
            .max_by(|&a, &b| p[a].total_cmp(&p[b]))
            .unwrap_or(0);
        correct += usize::from(best == label);
    }
    let n = data.y.len().max(1) as f64;
    (loss / n, correct as f64 / n)
}
