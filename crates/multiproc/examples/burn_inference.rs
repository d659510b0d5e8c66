//! Inference workers that run a burn model on weights they received by handle.
//!
//! The parent makes a 2-layer MLP in burn (32 MiB of `f32` weights), moves the weights
//! into shared memory with `Tensor::from_burn_shared` (one copy) and starts 4 worker
//! processes. Each receives the weights by handle and hands them to burn's NdArray
//! backend without a copy (`Tensor::as_burn`), then answers batches of requests from a
//! queue: `relu(x W1 + b1) W2 + b2`, argmax, sent back as a shared tensor. Each worker
//! reports whether burn's bytes are the shared mapping and its memory from
//! `/proc/self/smaps_rollup`. A second round does the same with workers that copy the
//! weights (`Tensor::to_burn`, the safe route for memory others may write): the baseline.
//!
//! ```text
//! cargo run --release -p multiproc --features burn --example burn_inference
//! ```
//!
//! Expected: every answer equals the parent's own forward pass; with borrowed weights
//! each worker's private memory between requests stays that of an idle worker (the
//! weights are shared pages, one copy for all five processes); with copies each grows by
//! about the model's 32 MiB. The borrowed run is the slower one: burn-ndarray 0.22 turns a
//! borrowed input into an array of its own for nearly every operation, so each batch's
//! `x W1` copies W1 (32 MiB) and frees it after. burn's Flex backend reads borrowed bytes
//! in place.

use burn_tensor::activation::relu;
use burn_tensor::{DType as BurnDType, Device, Distribution, Int, TensorData};
use multiproc::{Queue, StartMethod, Tensor};

const INPUT: usize = 2048;
const HIDDEN: usize = 4096;
const CLASSES: usize = 16;
const WORKERS: usize = 4;
const BATCHES: usize = 16;
const BATCH: usize = 8;

/// W1, b1, W2, b2 as shared multiproc tensors.
type Weights = [Tensor; 4];
/// A request: its id and a [BATCH, INPUT] input; `None` asks the worker to report.
type Request = Option<(usize, Tensor)>;
/// An answer: request id, the rank that answered, the predicted classes ([BATCH], i64).
type Answer = (usize, usize, Tensor);
/// A worker's report: rank, whether burn's bytes were the shared ones, private kB.
type Report = (usize, bool, u64);

#[allow(deprecated)] // burn 0.22 deprecates NdArray in favour of Flex; both borrow.
fn device() -> Device {
    Device::ndarray()
}

/// The model as burn tensors on NdArray, made once from the weights' data (borrowed or
/// owned); cloning a burn tensor shares its bytes.
struct Mlp {
    w1: burn_tensor::Tensor<2>,
    b1: burn_tensor::Tensor<2>,
    w2: burn_tensor::Tensor<2>,
    b2: burn_tensor::Tensor<2>,
}

impl Mlp {
    fn new([w1, b1, w2, b2]: [TensorData; 4]) -> Mlp {
        let device = device();
        // The data's own dtype, so NdArray keeps borrowed bytes borrowed.
        let f32s = (&device, BurnDType::F32);
        let matrix = |d: TensorData| burn_tensor::Tensor::<2>::from_data(d, f32s);
        let row = |d: TensorData| burn_tensor::Tensor::<1>::from_data(d, f32s).unsqueeze::<2>();
        Mlp {
            w1: matrix(w1),
            b1: row(b1),
            w2: matrix(w2),
            b2: row(b2),
        }
    }

    /// The argmax of `relu(x W1 + b1) W2 + b2` for each row of `x`.
    fn forward(&self, x: TensorData) -> TensorData {
        let x = burn_tensor::Tensor::<2>::from_data(x, (&device(), BurnDType::F32));
        let hidden = relu(x.matmul(self.w1.clone()) + self.b1.clone());
        let logits = hidden.matmul(self.w2.clone()) + self.b2.clone();
        let best: burn_tensor::Tensor<2, Int> = logits.argmax(1);
        best.reshape([BATCH]).into_data()
    }
}

/// Private memory (kB) of this process: `Private_Clean + Private_Dirty`.
fn private_kb() -> u64 {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("Private_"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

fn worker(
    rank: usize,
    (weights, borrow, requests, answers, reports): (
        Weights,
        bool,
        Queue<Request>,
        Queue<Answer>,
        Queue<Report>,
    ),
) -> multiproc::Result<()> {
    let data: Vec<TensorData> = weights
        .iter()
        .map(|t| {
            if borrow {
                // SAFETY: nobody writes the weights once they are sent: the parent made
                // them for this run and only reads them, and so do the workers.
                unsafe { t.as_burn() }
            } else {
                t.to_burn()
            }
        })
        .collect::<multiproc::Result<_>>()?;
    let shared = data[0].as_bytes().as_ptr() == weights[0].data_ptr().cast_const();
    let model = Mlp::new(data.try_into().expect("four tensors"));
    while let Some((id, x)) = requests.get()? {
        let best = model.forward(x.to_burn()?);
        answers
            .put((id, rank, Tensor::from_burn_shared(&best)?))
            .map_err(|e| e.error)?;
    }
    reports
        .put((rank, shared, private_kb()))
        .map_err(|e| e.error)?;
    Ok(())
}

fn run(weights: &Weights, reference: &[TensorData], inputs: &[Tensor], borrow: bool) {
    let (requests, answers, reports) = (
        Queue::new().unwrap(),
        Queue::new().unwrap(),
        Queue::new().unwrap(),
    );
    let args = (
        weights.clone(),
        borrow,
        requests.clone(),
        answers.clone(),
        reports.clone(),
    );
    let started = std::time::Instant::now();
    let mut ctx = multiproc::start_processes(worker, args, WORKERS, StartMethod::Spawn).unwrap();
    for (id, x) in inputs.iter().enumerate() {
        requests.put(Some((id, x.clone()))).unwrap();
    }
    let mut served = [0usize; WORKERS];
    for _ in 0..inputs.len() {
        let (id, rank, best) = answers.get().unwrap();
        assert_eq!(best.to_burn().unwrap(), reference[id], "request {id}");
        served[rank] += 1;
    }
    let elapsed = started.elapsed();
    for _ in 0..WORKERS {
        requests.put(None).unwrap();
    }
    let mut rows: Vec<Report> = (0..WORKERS).map(|_| reports.get().unwrap()).collect();
    ctx.join().unwrap();
    rows.sort();
    let how = if borrow {
        "weights borrowed (as_burn)"
    } else {
        "weights copied (to_burn)"
    };
    println!(
        "{how}: {} batches of {BATCH} in {:.0} ms, all equal to the parent's",
        inputs.len(),
        elapsed.as_secs_f64() * 1e3
    );
    for (rank, shared, kb) in rows {
        println!(
            "  worker {rank}: {} requests, burn's bytes {} the shared mapping, private {:.1} MiB",
            served[rank],
            if shared { "are" } else { "are not" },
            kb as f64 / 1024.0
        );
    }
}

fn main() {
    multiproc::init();
    let device = device();
    let normal = Distribution::Normal(0.0, 0.02);
    let made = [
        burn_tensor::Tensor::<2>::random([INPUT, HIDDEN], normal, &device).into_data(),
        burn_tensor::Tensor::<1>::random([HIDDEN], normal, &device).into_data(),
        burn_tensor::Tensor::<2>::random([HIDDEN, CLASSES], normal, &device).into_data(),
        burn_tensor::Tensor::<1>::random([CLASSES], normal, &device).into_data(),
    ];
    let weights: Weights = made
        .iter()
        .map(|d| Tensor::from_burn_shared(d).unwrap())
        .collect::<Vec<_>>()
        .try_into()
        .expect("four tensors");
    let mib = weights.iter().map(|t| t.storage().nbytes()).sum::<usize>() as f64 / 1048576.0;
    println!("model: {mib:.1} MiB of f32 in shared memory, {WORKERS} workers, NdArray backend");
    let inputs: Vec<Tensor> = (0..BATCHES)
        .map(|_| {
            let x = burn_tensor::Tensor::<2>::random([BATCH, INPUT], normal, &device);
            Tensor::from_burn_shared(&x.into_data()).unwrap()
        })
        .collect();
    let model = Mlp::new(made);
    let reference: Vec<TensorData> = inputs
        .iter()
        .map(|x| model.forward(x.to_burn().unwrap()))
        .collect();
    drop(model);
    run(&weights, &reference, &inputs, true);
    run(&weights, &reference, &inputs, false);
}
