//! Process-isolated inference workers that share one copy of the weights.
//!
//! The example makes a small model (a 2-layer MLP, 32 MiB of `f32` weights), saves it as
//! safetensors, loads it with [`multiproc::safetensors::load`] (the file's pages, mapped
//! read-only and shared) and starts 4 worker processes that receive the weights *by
//! handle* (the file's fd) and answer requests from a queue. Each worker then reports
//! its memory from `/proc/self/smaps_rollup`.
//!
//! The same run repeats the exercise with workers that copy the weights into private
//! ndarrays (`to_ndarray`, what a program without zero-copy views does): the baseline.
//!
//! ```text
//! cargo run --release -p multiproc --features safetensors,ndarray --example inference_workers
//! ```
//!
//! Expected: with the weights by handle, each worker's private memory is that of an
//! idle worker (a few MiB; the weights are shared pages, one page-cache copy for all
//! five processes); with private copies, each worker's private memory grows by the
//! model's 32 MiB.

use std::collections::BTreeMap;

use multiproc::{Queue, StartMethod, Tensor};
use ndarray::{ArrayD, ArrayView1, ArrayView2, ArrayViewD, Ix1, Ix2};

const INPUT: usize = 2048;
const HIDDEN: usize = 4096;
const CLASSES: usize = 16;
const WORKERS: usize = 4;
const REQUESTS: usize = 64;

type Weights = BTreeMap<String, Tensor>;
/// A request: its id and the input vector; `None` asks the worker to report and stop.
type Request = Option<(usize, Vec<f32>)>;
/// An answer: request id, the rank that answered, the predicted class.
type Answer = (usize, usize, usize);
/// A worker's memory report: rank, pid and the `smaps_rollup` fields in kB.
type Report = (usize, u32, Vec<(String, u64)>);

/// The names of the model's tensors, in the order [`Mlp`] takes them.
const NAMES: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

/// The model as ndarray views (of the shared pages, or of a private copy).
struct Mlp<'a> {
    w1: ArrayView2<'a, f32>,
    b1: ArrayView1<'a, f32>,
    w2: ArrayView2<'a, f32>,
    b2: ArrayView1<'a, f32>,
}

impl<'a> Mlp<'a> {
    fn new(views: [ArrayViewD<'a, f32>; 4]) -> multiproc::Result<Mlp<'a>> {
        let dim = |e: ndarray::ShapeError| multiproc::Error::Tensor(e.to_string());
        let [w1, b1, w2, b2] = views;
        Ok(Mlp {
            w1: w1.into_dimensionality::<Ix2>().map_err(dim)?,
            b1: b1.into_dimensionality::<Ix1>().map_err(dim)?,
            w2: w2.into_dimensionality::<Ix2>().map_err(dim)?,
            b2: b2.into_dimensionality::<Ix1>().map_err(dim)?,
        })
    }

    fn predict(&self, x: &[f32]) -> usize {
        let x = ArrayView1::from(x);
        let hidden = (self.w1.dot(&x) + self.b1).mapv(|v| v.max(0.0));
        let logits = self.w2.dot(&hidden) + self.b2;
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::MIN),
                |best, (i, &v)| if v > best.1 { (i, v) } else { best },
            )
            .0
    }
}

/// Handles on the model's tensors, in [`NAMES`] order.
fn handles(weights: &Weights) -> [Tensor; 4] {
    NAMES.map(|n| weights[n].clone())
}

/// Zero-copy views of the read-only weights. The safe `array_view` refuses them (any
/// process that can open the file could write it under a Rust borrow), so this uses the
/// `unsafe` view under its contract: nothing writes the weights file while views live.
fn views(handles: &mut [Tensor; 4]) -> multiproc::Result<[ArrayViewD<'_, f32>; 4]> {
    let [a, b, c, d] = handles;
    // SAFETY: the example wrote the weights file once, before loading it, and no
    // process writes it again while the model's views live.
    unsafe {
        Ok([
            a.as_array_view()?,
            b.as_array_view()?,
            c.as_array_view()?,
            d.as_array_view()?,
        ])
    }
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

fn worker(
    rank: usize,
    (weights, private_copy, requests, answers, reports): (
        Weights,
        bool,
        Queue<Request>,
        Queue<Answer>,
        Queue<Report>,
    ),
) -> multiproc::Result<()> {
    let mut shared = handles(&weights);
    // The baseline: what a program that copies the weights out of shared memory pays.
    let copies: Vec<ArrayD<f32>> = if private_copy {
        shared
            .iter()
            .map(|t| t.to_ndarray::<f32>())
            .collect::<multiproc::Result<_>>()?
    } else {
        Vec::new()
    };
    let model = if private_copy {
        Mlp::new([
            copies[0].view(),
            copies[1].view(),
            copies[2].view(),
            copies[3].view(),
        ])?
    } else {
        Mlp::new(views(&mut shared)?)?
    };
    while let Some((id, x)) = requests.get()? {
        answers.put((id, rank, model.predict(&x)))?;
    }
    reports.put((rank, std::process::id(), rollup()))?;
    Ok(())
}

fn make_model() -> multiproc::Result<Weights> {
    // Deterministic pseudo-random weights (a small LCG), scaled like an initialised MLP.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut values = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    };
    let mut m = BTreeMap::new();
    let s1 = 2.0 / (INPUT as f32).sqrt();
    let s2 = 2.0 / (HIDDEN as f32).sqrt();
    m.insert(
        "fc1.weight".into(),
        Tensor::from_vec(values(HIDDEN * INPUT, s1), &[HIDDEN, INPUT])?,
    );
    m.insert(
        "fc1.bias".into(),
        Tensor::from_vec(values(HIDDEN, 0.1), &[HIDDEN])?,
    );
    m.insert(
        "fc2.weight".into(),
        Tensor::from_vec(values(CLASSES * HIDDEN, s2), &[CLASSES, HIDDEN])?,
    );
    m.insert(
        "fc2.bias".into(),
        Tensor::from_vec(values(CLASSES, 0.1), &[CLASSES])?,
    );
    Ok(m)
}

fn kb(fields: &[(String, u64)], key: &str) -> u64 {
    fields.iter().find(|(k, _)| k == key).map_or(0, |(_, v)| *v)
}

/// Serves `REQUESTS` requests with `WORKERS` workers; prints and returns each worker's
/// private memory in MiB.
fn serve(
    weights: &Weights,
    private_copy: bool,
    inputs: &[Vec<f32>],
    expected: &[usize],
) -> multiproc::Result<Vec<f64>> {
    let (requests, answers, reports) = (Queue::new()?, Queue::new()?, Queue::new()?);
    let mut ctx = multiproc::start_processes(
        worker,
        (
            weights.clone(),
            private_copy,
            requests.clone(),
            answers.clone(),
            reports.clone(),
        ),
        WORKERS,
        StartMethod::Spawn,
    )?;
    for (id, x) in inputs.iter().enumerate() {
        requests.put(Some((id, x.clone())))?;
    }
    let mut served = [0usize; WORKERS];
    for _ in 0..inputs.len() {
        let (id, rank, class) = answers.get()?;
        assert_eq!(
            class, expected[id],
            "worker {rank} answered request {id} wrongly"
        );
        served[rank] += 1;
    }
    for _ in 0..WORKERS {
        requests.put(None)?;
    }
    let mut rows: Vec<Report> = (0..WORKERS)
        .map(|_| reports.get())
        .collect::<multiproc::Result<_>>()?;
    rows.sort_by_key(|r| r.0);
    ctx.join()?;
    let label = if private_copy {
        "private copy (baseline)"
    } else {
        "weights by handle"
    };
    println!(
        "\n{label}: {} requests answered, per worker {served:?}",
        inputs.len()
    );
    println!("  rank     pid      Rss      Pss   Shared (Clean+Dirty)  Private (Clean+Dirty)");
    let mib = |v: u64| v as f64 / 1024.0;
    let mut private = Vec::new();
    for (rank, pid, f) in &rows {
        let p = kb(f, "Private_Clean") + kb(f, "Private_Dirty");
        private.push(mib(p));
        println!(
            "  {rank:>4} {pid:>7} {:>7.1}M {:>7.1}M {:>20.1}M {:>21.1}M",
            mib(kb(f, "Rss")),
            mib(kb(f, "Pss")),
            mib(kb(f, "Shared_Clean") + kb(f, "Shared_Dirty")),
            mib(p)
        );
    }
    Ok(private)
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let dir = std::env::temp_dir().join(format!("multiproc-inference-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| multiproc::Error::Tensor(format!("{}: {e}", dir.display())))?;
    let path = dir.join("mlp.safetensors");
    multiproc::safetensors::save(&path, &make_model()?)?;
    let weights = multiproc::safetensors::load(&path)?;
    let model_mib: f64 = weights
        .values()
        .map(|t| (t.numel() * t.dtype().size()) as f64)
        .sum::<f64>()
        / (1 << 20) as f64;
    println!(
        "model: {} tensors, {model_mib:.1} MiB in {}",
        weights.len(),
        path.display()
    );
    assert!(weights.values().all(|t| t.is_read_only() && t.is_shared()));

    let inputs: Vec<Vec<f32>> = (0..REQUESTS)
        .map(|r| {
            (0..INPUT)
                .map(|i| (((r * 31 + i * 7) % 97) as f32 / 97.0) - 0.5)
                .collect()
        })
        .collect();
    let mut parent_handles = handles(&weights);
    let parent_model = Mlp::new(views(&mut parent_handles)?)?;
    let expected: Vec<usize> = inputs.iter().map(|x| parent_model.predict(x)).collect();

    let shared = serve(&weights, false, &inputs, &expected)?;
    let copied = serve(&weights, true, &inputs, &expected)?;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "\nper-worker private memory, {WORKERS} workers: {:.1} MiB with the weights by handle, \
         {:.1} MiB with private copies (model {model_mib:.1} MiB)",
        mean(&shared),
        mean(&copied)
    );
    drop((parent_handles, weights));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
