//! What `prefetch_to` buys a training loop: the step time of a small "model" fed by a
//! data loader, with the batch copied to the GPU in the loop (pageable, then pinned
//! memory) and with the copies prefetched on a side stream (needs a GPU and the `cuda`
//! feature; run by `scripts/gpu_check.sh`).
//!
//! ```text
//! cargo run --release --features cuda --example prefetch_overlap [-- --json] [--steps 200] [--workers 2,8]
//! ```
//!
//! The model is one kernel (PTX, loaded with `cuModuleLoadData`) that does a fixed
//! amount of arithmetic per element of the batch (`iters` fused multiply-adds) on a
//! stream of its own, and the step ends by waiting for it (as reading a loss does). The
//! kernel's work is set once at the start so that one step's compute takes about as long
//! as one batch's copy from pinned memory: where the copy and the compute overlap, a
//! step costs about one of them instead of both. The loader's workers are kept from
//! being the bottleneck: their collate writes one value per sample into a batch made
//! in a recycled shared block (`Tensor::empty_shared`), so a batch costs them
//! microseconds; the bytes copied are whatever the block holds, 16 MiB of them.
//!
//! Modes (each the same batches, the same kernel):
//!
//! - `pageable`: `batch.to(cuda:0)` in the loop, from the shared memory the batch
//!   arrived in (pageable);
//! - `pinned`: the same with `pin_memory(true)` (the copy is faster, still in the loop);
//! - `prefetch`: `prefetch_to(cuda:0, 2)` (the copy runs while the previous step
//!   computes; the batch arrives on the device).
//!
//! Each mode runs once per worker count of `--workers` (default 2 and 8), each run with
//! a new loader (new workers, new blocks) whose first `10 + 6 * workers` steps are not
//! timed. Prints, per run, the step time and its ratio to the prefetched step with as
//! many workers, and where a step's time went (means per timed step): waiting in the
//! loader's `next()` (with `pin_memory`, registering a block seen for the first time;
//! with `prefetch_to`, starting the next copy and waiting for this one), in
//! `batch.to(cuda:0)`, and in the model; then what the loader cost the trainer in
//! calls: the distinct host addresses its batches arrived at, the shared segments it
//! mapped on receipt and the `cuMemHostRegister` calls it made (each over the whole
//! run / over the timed steps: a steady state makes none), and the registrations
//! undone. With `--json`, one object per run (`scenario` = `step_pageable`,
//! `step_pinned`, `step_prefetch`; `us_per_step`, `next_us`, `to_us`, `model_us`,
//! `compute_us`, `copy_pinned_us`, `workers`, `mapped_on_receipt`, `mapped_timed`,
//! `host_registrations`, `registered_timed`, ...).

use std::ffi::{CStr, c_void};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use multiproc::data::{Collate, DataLoaderBuilder, Dataset, Tensors, VisitTensors};
use multiproc::{DType, Device, Tensor};

const GPU: Device = Device::Cuda(0);
/// Elements of one sample (4 MiB of f32); four make a 16 MiB batch.
const SAMPLE: usize = 1 << 20;
const BATCH: usize = 4;
/// Untimed steps at the start of each run: enough for every worker to have made the
/// blocks it recycles (about `prefetch_factor + 2` each), so that the timed steps
/// measure the steady state (no block mapped or registered for the first time).
fn warm(workers: usize) -> usize {
    10 + 6 * workers
}

/// A kernel that reads one f32 per thread, runs `iters` fused multiply-adds on it and
/// writes the result: `out[i] = f^iters(in[i])` with `f(x) = 0.999 x + in[i]`.
const PTX: &CStr = c"
.version 6.4
.target sm_52
.address_size 64

.visible .entry burn(
    .param .u64 p_in,
    .param .u64 p_out,
    .param .u32 p_n,
    .param .u32 p_iters
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<8>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [p_in];
    ld.param.u64 %rd2, [p_out];
    ld.param.u32 %r1, [p_n];
    ld.param.u32 %r2, [p_iters];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r6, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r6, 4;
    add.s64 %rd6, %rd3, %rd5;
    add.s64 %rd7, %rd4, %rd5;
    ld.global.f32 %f1, [%rd6];
    mov.f32 %f2, %f1;
    mov.u32 %r7, 0;
LOOP:
    setp.ge.u32 %p2, %r7, %r2;
    @%p2 bra STORE;
    fma.rn.f32 %f2, %f2, 0f3F7FBE77, %f1;
    add.u32 %r7, %r7, 1;
    bra LOOP;
STORE:
    st.global.f32 [%rd7], %f2;
DONE:
    ret;
}
";

/// Sample `i` is its index; the collate makes the batch.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Samples(usize);

impl Dataset for Samples {
    type Item = usize;

    fn len(&self) -> usize {
        self.0
    }

    fn get(&self, i: usize) -> multiproc::Result<usize> {
        Ok(i)
    }
}

/// A batch of `SAMPLE` f32 per sample in a shared block, of which only the first
/// element of each sample is written (its index): a batch costs the worker next to
/// nothing, so the loop measures the copies and the compute.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct CheapBatch;

impl Collate<usize> for CheapBatch {
    type Batch = Tensor;

    fn collate(&self, items: Vec<usize>) -> multiproc::Result<Tensor> {
        let batch = Tensor::empty_shared(&[items.len(), SAMPLE], DType::F32)?;
        for (row, i) in items.iter().enumerate() {
            batch.select(0, row)?.narrow(0, 0, 1)?.fill_(*i as f64)?;
        }
        Ok(batch)
    }

    fn batch_tensors(&self) -> Option<VisitTensors<Tensor>> {
        Some(Tensor::visit_tensors)
    }
}

fn check(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// The model: the loaded kernel, its stream, and a device buffer for its output.
struct Model {
    function: sys::CUfunction,
    stream: sys::CUstream,
    out: Tensor,
    iters: u32,
}

impl Model {
    fn new() -> Model {
        // The crate has initialised the driver and made cuda:0's primary context
        // current on this thread (the first CUDA tensor does both).
        let out = Tensor::zeros_on(&[BATCH * SAMPLE], DType::F32, GPU).expect("output buffer");
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; a valid out-pointer.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast()) },
            "cuModuleLoadData (the PTX kernel)",
        );
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module, a NUL-terminated name, a valid out-pointer.
        check(
            unsafe { sys::cuModuleGetFunction(&mut function, module, c"burn".as_ptr()) },
            "cuModuleGetFunction(burn)",
        );
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; a non-blocking stream (as a framework's).
        check(
            unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            },
            "cuStreamCreate",
        );
        Model {
            function,
            stream,
            out,
            iters: 1,
        }
    }

    /// One step on `x` (a CUDA tensor of `BATCH * SAMPLE` f32), waited for.
    fn step(&self, x: &Tensor) {
        assert_eq!(x.device(), GPU);
        assert_eq!(x.numel(), self.out.numel());
        // cuda:0's primary context is current on this thread: multiproc makes it so
        // for each of its calls (and the loader runs here).
        let mut input = x.data_ptr() as u64;
        let mut output = self.out.data_ptr() as u64;
        let mut n = x.numel() as u32;
        let mut iters = self.iters;
        let mut params: [*mut c_void; 4] = [
            (&mut input as *mut u64).cast(),
            (&mut output as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
            (&mut iters as *mut u32).cast(),
        ];
        let threads = 256u32;
        let blocks = n.div_ceil(threads);
        // SAFETY: the kernel's four parameters, by pointer, in order; both buffers hold
        // `n` f32 on the device and outlive the launch (it is waited for below).
        check(
            unsafe {
                sys::cuLaunchKernel(
                    self.function,
                    blocks,
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    self.stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel(burn)",
        );
        // SAFETY: a live stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        );
    }
}

fn loader(batches: usize, workers: usize) -> DataLoaderBuilder<Samples, CheapBatch> {
    DataLoaderBuilder::new(Samples(BATCH * batches))
        .collate(CheapBatch)
        .batch_size(BATCH)
        .num_workers(workers)
        .prefetch_factor(4)
}

/// Where one mode's steps went, per step (means over the timed steps), and what the
/// loader cost in system and driver calls over the whole run (warm-up included).
struct Figures {
    mode: &'static str,
    workers: usize,
    /// The whole step: `next()`, `to()` and the model.
    step: Duration,
    /// Waiting in the loader's `next()` (with `pin_memory`: the registration of a new
    /// block; with `prefetch_to`: starting the next copy and waiting for this one).
    next: Duration,
    /// `batch.to(GPU)` in the loop (0 with `prefetch_to`).
    to: Duration,
    /// The model's kernel, waited for.
    model: Duration,
    /// Distinct host addresses the batches arrived at (blocks, or mappings of them).
    host_addresses: usize,
    /// Shared segments mapped on receipt (the map cache's misses): in the whole run,
    /// and in its timed steps.
    mapped: (u64, u64),
    /// `cuMemHostRegister` calls made: in the whole run, and in its timed steps.
    registered: (u64, u64),
    /// Registrations undone in the whole run (the loader's drop included).
    unregistered: u64,
}

/// One mode with `workers` workers: `steps` timed steps after [`warm`] untimed ones.
fn run_mode(
    mode: &'static str,
    model: &Model,
    steps: usize,
    workers: usize,
) -> multiproc::Result<Figures> {
    let before = multiproc::__testing::counters();
    let warm = warm(workers);
    let builder = loader(steps + warm, workers);
    let mut loader = match mode {
        "pageable" => builder.build()?,
        "pinned" => builder.pin_memory(true).build()?,
        _ => builder.prefetch_to(GPU, 2).build()?,
    };
    let (mut next, mut to, mut compute) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut addresses = std::collections::HashSet::new();
    let mut iter = loader.iter();
    let mut start = Instant::now();
    let mut at_warm = before;
    for i in 0.. {
        if i == warm {
            (next, to, compute) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
            at_warm = multiproc::__testing::counters();
            start = Instant::now();
        }
        let t0 = Instant::now();
        let Some(batch) = iter.next() else {
            break;
        };
        let batch = batch?;
        let t1 = Instant::now();
        assert_eq!(batch.shape(), [BATCH, SAMPLE]);
        let x = if batch.device() == GPU {
            batch
        } else {
            addresses.insert(batch.data_ptr() as usize);
            batch.to(GPU)?
        };
        let t2 = Instant::now();
        model.step(&x);
        let t3 = Instant::now();
        next += t1 - t0;
        to += t2 - t1;
        compute += t3 - t2;
    }
    let step = start.elapsed() / steps as u32;
    let at_end = multiproc::__testing::counters();
    drop(iter);
    drop(loader);
    let after = multiproc::__testing::counters();
    Ok(Figures {
        mode,
        workers,
        step,
        next: next / steps as u32,
        to: to / steps as u32,
        model: compute / steps as u32,
        host_addresses: addresses.len(),
        mapped: (
            at_end.segments_mapped_on_receipt - before.segments_mapped_on_receipt,
            at_end.segments_mapped_on_receipt - at_warm.segments_mapped_on_receipt,
        ),
        registered: (
            at_end.host_registrations - before.host_registrations,
            at_end.host_registrations - at_warm.host_registrations,
        ),
        unregistered: after.host_unregistrations - before.host_unregistrations,
    })
}

/// The mean time of `f` over `n` runs after two untimed ones.
fn mean_of(n: usize, mut f: impl FnMut()) -> Duration {
    f();
    f();
    let start = Instant::now();
    for _ in 0..n {
        f();
    }
    start.elapsed() / n as u32
}

fn main() -> multiproc::Result<()> {
    multiproc::init();
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let arg = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let steps = arg("--steps", 200);
    // Worker counts to run each mode with: `--workers 2,8` (the default).
    let workers: Vec<usize> = args
        .iter()
        .position(|a| a == "--workers")
        .and_then(|i| args.get(i + 1))
        .map_or_else(
            || vec![2, 8],
            |s| s.split(',').filter_map(|w| w.parse().ok()).collect(),
        );
    multiproc::cuda::init()?;
    let mut model = Model::new();

    // Calibrate: the copy of one batch from pinned memory, then kernel work to match.
    let pinned_batch = {
        let mut l = loader(1, 0).pin_memory(true).build()?;
        l.iter().next().expect("one batch")?
    };
    assert!(pinned_batch.is_pinned());
    let copy_pinned = mean_of(20, || drop(pinned_batch.to(GPU).expect("copy")));
    let x = pinned_batch.to(GPU)?;
    model.iters = 64;
    let mut compute = mean_of(5, || model.step(&x));
    while compute < copy_pinned && model.iters < 1 << 20 {
        model.iters *= 2;
        compute = mean_of(5, || model.step(&x));
    }
    drop((x, pinned_batch));

    let mut figures = Vec::new();
    for &w in &workers {
        for mode in ["pageable", "pinned", "prefetch"] {
            figures.push(run_mode(mode, &model, steps, w)?);
        }
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    // Each row's ratio is to the prefetched step with as many workers.
    let vs_prefetch = |f: &Figures| {
        let prefetch = figures
            .iter()
            .find(|p| p.mode == "prefetch" && p.workers == f.workers)
            .map_or(f.step, |p| p.step);
        f.step.as_secs_f64() / prefetch.as_secs_f64()
    };
    if json {
        for f in &figures {
            println!(
                "{{\"scenario\":\"step_{}\",\"bytes\":{},\"count\":{steps},\"us_per_step\":{:.1},\"next_us\":{:.1},\"to_us\":{:.1},\"model_us\":{:.1},\"compute_us\":{:.1},\"copy_pinned_us\":{:.1},\"vs_prefetch\":{:.3},\"workers\":{},\"host_addresses\":{},\"mapped_on_receipt\":{},\"mapped_timed\":{},\"host_registrations\":{},\"registered_timed\":{},\"host_unregistrations\":{},\"impl\":\"multiproc\"}}",
                f.mode,
                BATCH * SAMPLE * 4,
                us(f.step),
                us(f.next),
                us(f.to),
                us(f.model),
                us(compute),
                us(copy_pinned),
                vs_prefetch(f),
                f.workers,
                f.host_addresses,
                f.mapped.0,
                f.mapped.1,
                f.registered.0,
                f.registered.1,
                f.unregistered,
            );
        }
    } else {
        println!(
            "batch {} MiB; compute {:.0} us per step ({} fma per element); copy from pinned memory {:.0} us; {steps} timed steps after 10 + 6 per worker untimed ones",
            (BATCH * SAMPLE * 4) >> 20,
            us(compute),
            model.iters,
            us(copy_pinned)
        );
        println!(
            "{:<9} {:>7} {:>9} {:>11}   {:>8} {:>8} {:>8}   {:>9} {:>11} {:>15} {:>12}",
            "mode",
            "workers",
            "us/step",
            "vs_prefetch",
            "next()",
            "to()",
            "model",
            "addresses",
            "mapped all/t",
            "registered all/t",
            "unregistered"
        );
        for f in &figures {
            println!(
                "{:<9} {:>7} {:>9.0} {:>10.2}x   {:>8.0} {:>8.0} {:>8.0}   {:>9} {:>11} {:>15} {:>12}",
                f.mode,
                f.workers,
                us(f.step),
                vs_prefetch(f),
                us(f.next),
                us(f.to),
                us(f.model),
                f.host_addresses,
                format!("{}/{}", f.mapped.0, f.mapped.1),
                format!("{}/{}", f.registered.0, f.registered.1),
                f.unregistered
            );
        }
    }
    multiproc::cuda::empty_cache();
    Ok(())
}
