//! CUDA tensors across processes (feature `cuda`).
//!
//! The tests marked `#[ignore = "needs a CUDA device"]` need a GPU and run with
//! `scripts/gpu_check.sh` (built by `scripts/gpu_build.sh`), or by hand with
//! `cargo test -p multiproc --features cuda --test cuda -- --include-ignored`. The others
//! run everywhere: without a driver, a device or the feature, every CUDA operation and
//! every forged CUDA handle must be a clean `CudaUnavailable`, never a panic.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::secs;
use multiproc::__fuzz::{ForgedCudaHandle, cuda_handle_inputs, cuda_handle_packet, fds_of};
use multiproc::data::{
    Collate, DataLoader, DataLoaderBuilder, Dataset, IterableDataset, WorkerKind,
};
use multiproc::{
    DType, Device, Error, JoinableQueue, Pool, Queue, SimpleQueue, StartMethod, Storage, Tensor,
    cuda, pipe, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(120);
const GPU: Device = Device::Cuda(0);
const MIB: usize = 1 << 20;

/// A worker's check: an `Err` that the parent's `join` reports with the worker's rank.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(Error::InvalidArgument(format!($($msg)+)));
        }
    };
}

/// Makes the driver's own fds and threads (opened on first use) exist before a test
/// counts fds: initialise, allocate, copy both ways, send to ourselves, import an
/// allocation (a handle to our own, under another id), drop, empty the caches.
fn warm_up_cuda() {
    cuda::init().expect("a CUDA device");
    let q = Queue::new().unwrap();
    let t = Tensor::zeros_on(&[16], DType::F32, GPU).unwrap();
    t.to(Device::Cpu).unwrap();
    q.put(t.clone()).unwrap();
    drop(q.get().unwrap());
    let bytes = cuda_handle_packet(ForgedCudaHandle {
        device: 0,
        len: 2 * MIB as u64,
        offset: 0,
        nbytes: 64,
    })
    .unwrap();
    multiproc::__fuzz::decode_packet_for_fuzzing(&bytes, fds_of(&t).unwrap())
        .expect("importing our own allocation");
    drop(t);
    cuda::empty_cache();
}

fn free_device_memory() -> usize {
    cuda::mem_get_info(0).unwrap().0
}

fn arange_on_gpu(n: usize) -> Tensor {
    Tensor::arange(0.0, n as f64, 1.0, DType::F32)
        .unwrap()
        .to(GPU)
        .unwrap()
}

// ----- everywhere (CPU CI) -----

#[test]
fn without_a_device_every_cuda_operation_is_unavailable() {
    common::run(DEADLINE, || {
        let unavailable = |r: Result<Tensor, Error>, what: &str| match r {
            Err(Error::CudaUnavailable { reason }) => assert!(!reason.is_empty(), "{what}"),
            other => panic!("{what}: {other:?}"),
        };
        match cuda::init() {
            Ok(n) => {
                // A GPU machine: the same API says so consistently.
                assert!(n > 0);
                assert!(cuda::is_available());
                assert_eq!(cuda::device_count(), n);
                let t = Tensor::zeros_on(&[4], DType::F32, GPU).unwrap();
                assert_eq!(t.device(), GPU);
            }
            Err(Error::CudaUnavailable { reason }) => {
                eprintln!("CUDA unavailable here (expected on CPU CI): {reason}");
                assert!(!cuda::is_available());
                assert_eq!(cuda::device_count(), 0);
                assert!(matches!(
                    cuda::mem_get_info(0),
                    Err(Error::CudaUnavailable { .. })
                ));
                assert!(matches!(
                    cuda::synchronize(0),
                    Err(Error::CudaUnavailable { .. })
                ));
                unavailable(Tensor::zeros_on(&[4], DType::F32, GPU), "zeros_on");
                unavailable(Tensor::empty_on(&[4], DType::F32, GPU), "empty_on");
                let cpu = Tensor::full(&[4], 1.0, DType::F32).unwrap();
                unavailable(cpu.to(GPU), "to(cuda:0)");
                cuda::empty_cache(); // nothing to do, and no panic
            }
            Err(other) => panic!("cuda::init: {other}"),
        }
    });
}

#[test]
fn cpu_tensors_are_on_the_cpu() {
    common::run(DEADLINE, || {
        let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32).unwrap();
        assert_eq!(t.device(), Device::Cpu);
        let same = t.to(Device::Cpu).unwrap();
        assert!(
            Storage::ptr_eq(same.storage(), t.storage()),
            "to(own device) is a handle copy"
        );
        let z = Tensor::zeros_on(&[2, 3], DType::I32, Device::Cpu).unwrap();
        assert_eq!(z.to_vec::<i32>().unwrap(), [0; 6]);
        assert_eq!(Device::default(), Device::Cpu);
    });
}

#[test]
fn forged_cuda_handles_are_clean_errors() {
    common::run(DEADLINE, || {
        let available = cuda::is_available();
        for (name, input) in cuda_handle_inputs().unwrap() {
            let err = multiproc::__fuzz::run_input(&input).unwrap_err();
            if available {
                assert!(matches!(err, Error::InvalidMessage(_)), "{name}: {err}");
            } else {
                assert!(
                    matches!(err, Error::CudaUnavailable { .. }),
                    "{name}: {err}"
                );
                assert!(err.to_string().contains("CUDA is not available"), "{err}");
            }
        }
    });
}

/// Writes the forged CUDA inputs into the fuzz corpus (run after a wire change).
#[test]
#[ignore = "writes fuzz/corpus/decode_packet/cuda-*; run by hand"]
fn write_cuda_inputs_into_the_corpus() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus/decode_packet");
    for (name, input) in cuda_handle_inputs().unwrap() {
        std::fs::write(dir.join(name), input).unwrap();
    }
}

/// Sample `i` is `len` elements equal to `i`, labelled `i`.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Ramp {
    n: usize,
    width: usize,
}

impl Dataset for Ramp {
    type Item = (Tensor, i64);

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> multiproc::Result<(Tensor, i64)> {
        Ok((Tensor::full(&[self.width], i as f64, DType::F32)?, i as i64))
    }
}

/// A stream of `0..n`.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Count(i64);

impl IterableDataset for Count {
    type Item = i64;
    type Iter = std::vec::IntoIter<multiproc::Result<i64>>;

    fn iter(&self, _epoch: u64) -> Self::Iter {
        (0..self.0).map(Ok).collect::<Vec<_>>().into_iter()
    }
}

/// A collate that does not say how to reach its batch's tensors.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Opaque;

impl Collate<(Tensor, i64)> for Opaque {
    type Batch = Vec<(Tensor, i64)>;

    fn collate(&self, items: Vec<(Tensor, i64)>) -> multiproc::Result<Self::Batch> {
        Ok(items)
    }
}

fn invalid(r: multiproc::Result<impl Sized>, needles: &[&str]) {
    match r {
        Err(Error::InvalidArgument(text)) => {
            for needle in needles {
                assert!(text.contains(needle), "{needle:?} not in {text:?}");
            }
        }
        Err(other) => panic!("expected InvalidArgument with {needles:?}, got {other:?}"),
        Ok(_) => panic!("expected InvalidArgument with {needles:?}, got a loader"),
    }
}

#[test]
fn pin_memory_and_prefetch_to_refuse_bad_arguments_at_build() {
    common::run(DEADLINE, || {
        let data = Ramp { n: 8, width: 4 };
        invalid(
            DataLoader::builder(data.clone())
                .prefetch_to(GPU, 0)
                .build(),
            &["prefetch_to", "at least 1"],
        );
        invalid(
            DataLoader::builder(data.clone())
                .prefetch_to(Device::Cpu, 2)
                .build(),
            &["Device::Cpu", "CUDA device"],
        );
        invalid(
            DataLoaderBuilder::new(data.clone())
                .collate(Opaque)
                .pin_memory(true)
                .build(),
            &["pin_memory(true)", "Collate::batch_tensors"],
        );
        invalid(
            DataLoader::builder(data.clone())
                .num_workers(1)
                .start_method(StartMethod::Fork)
                .prefetch_to(GPU, 1)
                .build(),
            &["Fork", "StartMethod::Spawn"],
        );
        invalid(
            DataLoaderBuilder::new(Count(8))
                .pin_memory(true)
                .build_iterable(),
            &["iterable"],
        );
        // Thread workers may be combined with either: no fork involved.
        let threads = DataLoader::builder(data.clone())
            .num_workers(1)
            .workers(WorkerKind::Thread)
            .start_method(StartMethod::Fork)
            .pin_memory(true)
            .build();
        // Without CUDA (no feature, no driver, no device) both options are
        // CudaUnavailable, saying which option needs it; never a silent no-op.
        if !cuda::is_available() {
            for (what, r) in [
                ("pin_memory(true)", threads.map(drop)),
                (
                    "prefetch_to",
                    DataLoader::builder(data.clone())
                        .prefetch_to(GPU, 2)
                        .build()
                        .map(drop),
                ),
            ] {
                match r {
                    Err(Error::CudaUnavailable { reason }) => {
                        assert!(reason.contains(what), "{reason}")
                    }
                    other => panic!("{what} without CUDA: {other:?}"),
                }
            }
        } else {
            threads.unwrap();
        }
        // Off is off, everywhere.
        DataLoader::builder(data).pin_memory(false).build().unwrap();
    });
}

// ----- on a GPU -----

/// The stand-in libcuda's counters of page-locked host memory (scripts/fake_libcuda.c):
/// registrations made, undone, refused as registered already, undone after their
/// memory was unmapped, and registered now. `None` on a real driver, which has no such
/// symbol.
fn fake_host_counts() -> Option<[i64; 5]> {
    for name in [c"libcuda.so.1", c"libcuda.so"] {
        // SAFETY: RTLD_NOLOAD only finds a library already loaded (by the driver
        // loader); the handle is closed below.
        let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            continue;
        }
        // SAFETY: a live handle; looking a symbol up calls nothing.
        let sym = unsafe { libc::dlsym(lib, c"fake_cuda_host_counts".as_ptr()) };
        let mut out = [0i64; 5];
        if !sym.is_null() {
            // SAFETY: the stand-in defines `void fake_cuda_host_counts(long long[5])`.
            let f: extern "C" fn(*mut i64) = unsafe { std::mem::transmute(sym) };
            f(out.as_mut_ptr());
        }
        // SAFETY: the handle from dlopen above, closed once.
        unsafe { libc::dlclose(lib) };
        return (!sym.is_null()).then_some(out);
    }
    None
}

/// Checks batch `(x, y)` of `rows` samples of `len` elements is samples `first..`.
fn check_ramp_batch(x: &Tensor, y: &Tensor, first: usize, rows: usize, len: usize) {
    assert_eq!(x.shape(), [rows, len]);
    let xs = x.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap();
    let ys = y.to(Device::Cpu).unwrap().to_vec::<i64>().unwrap();
    for r in 0..rows {
        let want = (first + r) as f32;
        assert_eq!(ys[r], want as i64, "label of row {r}");
        assert!(
            xs[r * len..(r + 1) * len].iter().all(|&v| v == want),
            "row {r} of the batch from sample {first} is not all {want}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_batches_register_each_block_once_and_unregister_when_freed() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let before = fake_host_counts();
        const LEN: usize = 256 << 10; // 1 MiB a sample: every batch is a block of its own
        const BATCHES: usize = 24;
        let mut loader = DataLoader::builder(Ramp {
            n: BATCHES * 4,
            width: LEN,
        })
        .batch_size(4)
        .num_workers(1)
        .prefetch_factor(1)
        .persistent_workers(true)
        .pin_memory(true)
        .build()
        .unwrap();
        let mut blocks = std::collections::BTreeSet::new();
        for epoch in 0..2 {
            let mut n = 0;
            for (b, batch) in loader.iter().enumerate() {
                let (x, y) = batch.unwrap();
                assert!(x.is_pinned() && y.is_pinned(), "batch {b} of epoch {epoch}");
                check_ramp_batch(&x, &y, b * 4, 4, LEN);
                blocks.insert(x.data_ptr() as usize);
                n += 1;
            }
            assert_eq!(n, BATCHES);
        }
        // The worker recycles its blocks and this process keeps them mapped: a handful
        // of blocks carried all 48 batches, each registered once.
        eprintln!("48 batches in {} blocks", blocks.len());
        assert!(blocks.len() <= 6, "{} blocks", blocks.len());
        if let (Some(b), Some(a)) = (before, fake_host_counts()) {
            let made = a[0] - b[0];
            eprintln!("registrations: {made} made, counts before {b:?} after {a:?}");
            assert!(made >= 1, "no registration was made");
            assert!(
                made as usize <= blocks.len() + 1,
                "{made} registrations for {} blocks (the x and y blocks)",
                blocks.len()
            );
            assert_eq!(a[2], b[2], "a block was registered twice");
        }
        drop(loader);
        multiproc::__testing::flush_retained_segments();
        multiproc::__testing::release_idle_blocks();
        if let (Some(b), Some(a)) = (before, fake_host_counts()) {
            assert_eq!(
                a[4], b[4],
                "registrations outlived their blocks: {b:?} -> {a:?}"
            );
            assert_eq!(a[0] - b[0], a[1] - b[1], "every registration undone once");
            assert_eq!(
                a[3], b[3],
                "a block was unmapped before it was unregistered"
            );
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn pin_memory_pins_batches_made_in_this_process_and_by_thread_workers() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let before = fake_host_counts();
        for (workers, kind) in [(0, WorkerKind::Process), (2, WorkerKind::Thread)] {
            let mut loader = DataLoader::builder(Ramp { n: 40, width: 1000 })
                .batch_size(5)
                .num_workers(workers)
                .workers(kind)
                .pin_memory(true)
                .build()
                .unwrap();
            let mut n = 0;
            for (b, batch) in loader.iter().enumerate() {
                let (x, y) = batch.unwrap();
                assert!(x.is_pinned() && y.is_pinned(), "{kind:?}: batch {b}");
                check_ramp_batch(&x, &y, b * 5, 5, 1000);
                n += 1;
            }
            assert_eq!(n, 8);
        }
        let plain = Tensor::full(&[1000], 1.0, DType::F32).unwrap();
        assert!(!plain.is_pinned(), "a private tensor is not pinned");
        assert!(!arange_on_gpu(4).is_pinned(), "a CUDA tensor is not pinned");
        multiproc::__testing::flush_retained_segments();
        multiproc::__testing::release_idle_blocks();
        if let (Some(b), Some(a)) = (before, fake_host_counts()) {
            assert!(a[0] > b[0], "no registration was made");
            assert_eq!(a[2], b[2], "a block was registered twice");
            assert_eq!(
                a[3], b[3],
                "a block was unmapped before it was unregistered"
            );
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefetched_batches_are_on_the_device_and_equal_the_cpu_batches_in_order() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let data = Ramp { n: 90, width: 3000 };
        let build =
            |b: DataLoaderBuilder<Ramp>| b.batch_size(6).shuffle(7).num_workers(2).build().unwrap();
        let mut cpu = build(DataLoader::builder(data.clone()));
        let mut gpu = build(DataLoader::builder(data).prefetch_to(GPU, 3));
        for epoch in 0..2 {
            let mut n = 0;
            let mut on_gpu = gpu.iter();
            for (b, want) in cpu.iter().enumerate() {
                let (wx, wy) = want.unwrap();
                let (x, y) = on_gpu.next().expect("as many batches").unwrap();
                assert_eq!((x.device(), y.device()), (GPU, GPU), "batch {b}");
                assert_eq!((x.shape(), y.shape()), (wx.shape(), wy.shape()));
                let (hx, hy) = (x.to(Device::Cpu).unwrap(), y.to(Device::Cpu).unwrap());
                assert_eq!(
                    hx.to_vec::<f32>().unwrap(),
                    wx.to_vec::<f32>().unwrap(),
                    "x of batch {b} of epoch {epoch}"
                );
                assert_eq!(
                    hy.to_vec::<i64>().unwrap(),
                    wy.to_vec::<i64>().unwrap(),
                    "y of batch {b} of epoch {epoch}"
                );
                // Batches pulled ahead are not counted as yielded.
                if b + 1 < 15 {
                    assert_eq!(
                        on_gpu.state_dict().position(),
                        Some((b + 1) * 6),
                        "state after batch {b}"
                    );
                }
                n += 1;
            }
            assert_eq!(n, 15);
            assert!(on_gpu.next().is_none(), "no batch past the end");
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_epoch_dropped_with_copies_in_flight_waits_for_them_and_leaks_nothing() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let mut loader = DataLoader::builder(Ramp {
            n: 64,
            width: 1 << 16,
        })
        .batch_size(4)
        .num_workers(2)
        .prefetch_to(GPU, 4)
        .build()
        .unwrap();
        let started = Instant::now();
        let mut epoch = loader.iter();
        let (x, _) = epoch.next().unwrap().unwrap();
        check_ramp_batch(
            &x,
            &Tensor::arange(0.0, 4.0, 1.0, DType::I64).unwrap(),
            0,
            4,
            1 << 16,
        );
        drop(epoch); // four batches still staged, their copies issued
        drop(x);
        // The next epoch starts where it should and is correct.
        let (x, y) = loader.iter().next().unwrap().unwrap();
        check_ramp_batch(&x, &y, 0, 4, 1 << 16);
        drop((x, y, loader));
        cuda::empty_cache();
        assert!(started.elapsed() < secs(60));
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefetch_to_a_device_this_process_does_not_see_is_an_error() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let r = DataLoader::builder(Ramp { n: 4, width: 4 })
            .prefetch_to(Device::Cuda(99), 2)
            .build();
        invalid(r, &["cuda:99", "prefetch_to"]);
    });
}

fn inspect_and_write(
    _rank: usize,
    (inbox, outbox): (Queue<(Tensor, Tensor, Tensor)>, Queue<Tensor>),
) -> multiproc::Result<()> {
    let (a, view, b) = inbox.get()?;
    ensure!(a.device() == GPU, "received on {}", a.device());
    ensure!(
        Storage::ptr_eq(a.storage(), b.storage()) && Storage::ptr_eq(a.storage(), view.storage()),
        "one allocation sent three times maps to one storage"
    );
    ensure!(
        view.shape() == [2, 3] && view.strides() == [1, 4] && view.storage_offset() == 1,
        "the view kept its layout: {:?} {:?} {}",
        view.shape(),
        view.strides(),
        view.storage_offset()
    );
    let seen = view.to(Device::Cpu)?.to_vec::<f32>()?;
    ensure!(seen == [1., 5., 9., 2., 6., 10.], "view values {seen:?}");
    // Write into the parent's memory: elements 8..12 become 100.
    a.narrow(0, 8, 4)?
        .copy_(&Tensor::full(&[4], 100.0, DType::F32)?)?;
    outbox.put(a)?; // a received CUDA tensor may be sent on
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cuda_tensor_crosses_a_queue_by_handle_with_views_and_identity() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let t = arange_on_gpu(12);
        // Shape [2, 3], strides [1, 4], offset 1: elements 1, 5, 9 and 2, 6, 10.
        let view = t
            .view(&[3, 4])
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .narrow(0, 1, 2)
            .unwrap();
        assert_eq!(view.strides(), [1, 4]);
        let (inbox, outbox) = (Queue::new().unwrap(), Queue::new().unwrap());
        let mut ctx = start_processes(
            inspect_and_write,
            (inbox.clone(), outbox.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        inbox.put((t.clone(), view, t.clone())).unwrap();
        let back: Tensor = outbox.get_timeout(secs(60)).expect("the worker's reply");
        ctx.join_timeout(secs(60)).unwrap();
        assert!(
            Storage::ptr_eq(back.storage(), t.storage()),
            "the tensor came home to the same storage"
        );
        let mut want: Vec<f32> = (0..12).map(|i| i as f32).collect();
        want[8..12].fill(100.0);
        assert_eq!(t.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap(), want);
    });
}

fn relay(
    rank: usize,
    (inbox, hop, done): (Queue<Tensor>, Queue<Tensor>, Queue<f64>),
) -> multiproc::Result<()> {
    if rank == 0 {
        // A received CUDA tensor sent on to a third process; then this one exits.
        hop.put(inbox.get()?)?;
        return Ok(());
    }
    let t = hop.get()?;
    t.narrow(0, 0, 1)?
        .copy_(&Tensor::full(&[1], 1000.0, DType::F32)?)?;
    done.put(t.to(Device::Cpu)?.sum()?)?;
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_received_cuda_tensor_can_be_sent_on_to_a_third_process() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let t = arange_on_gpu(100);
        let (inbox, hop, done) = (
            Queue::new().unwrap(),
            Queue::new().unwrap(),
            Queue::new().unwrap(),
        );
        let mut ctx = start_processes(
            relay,
            (inbox.clone(), hop.clone(), done.clone()),
            2,
            StartMethod::Spawn,
        )
        .unwrap();
        inbox.put(t.clone()).unwrap();
        let sum = done.get_timeout(secs(60)).expect("the third process's sum");
        assert_eq!(sum, 4950.0 + 1000.0, "it saw the values and its own write");
        ctx.join_timeout(secs(60)).unwrap();
        // The write landed in this process's memory.
        let first = t.narrow(0, 0, 1).unwrap().to(Device::Cpu).unwrap();
        assert_eq!(first.to_vec::<f32>().unwrap(), [1000.0]);
        drop(t);
        cuda::empty_cache();
    });
}

fn echo_simple(
    _rank: usize,
    (inbox, outbox): (SimpleQueue<Tensor>, JoinableQueue<Tensor>),
) -> multiproc::Result<()> {
    let t = inbox.get()?;
    t.narrow(0, 0, 1)?
        .copy_(&Tensor::full(&[1], -1.0, DType::F32)?)?;
    outbox.put(t)?;
    Ok(())
}

fn echo_pipe(_rank: usize, end: multiproc::Connection<Tensor>) -> multiproc::Result<()> {
    let t = end.recv()?;
    t.narrow(0, 1, 1)?
        .copy_(&Tensor::full(&[1], -2.0, DType::F32)?)?;
    end.send(t)?;
    Ok(())
}

fn double_on_gpu(t: Tensor) -> multiproc::Result<Tensor> {
    let host = t.to(Device::Cpu)?;
    host.mul_scalar_(2.0)?;
    host.to(GPU) // a new CUDA tensor, allocated by the pool worker
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_tensors_cross_simple_and_joinable_queues_pipes_and_the_pool() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let t = arange_on_gpu(8);
        let (simple, joinable) = (SimpleQueue::new().unwrap(), JoinableQueue::new().unwrap());
        let mut ctx = start_processes(
            echo_simple,
            (simple.clone(), joinable.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        simple.put(t.clone()).unwrap();
        let back: Tensor = joinable.get().unwrap();
        joinable.task_done().unwrap();
        ctx.join_timeout(secs(60)).unwrap();
        assert!(Storage::ptr_eq(back.storage(), t.storage()));

        let (here, there) = pipe::<Tensor>().unwrap();
        let mut ctx = start_processes(echo_pipe, there, 1, StartMethod::Forkserver).unwrap();
        here.send(t.clone()).unwrap();
        let back = here.recv().unwrap();
        ctx.join_timeout(secs(60)).unwrap();
        assert!(Storage::ptr_eq(back.storage(), t.storage()));
        let seen = t.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(seen, [-1., -2., 2., 3., 4., 5., 6., 7.]);

        let mut pool = Pool::new(2).unwrap();
        let inputs: Vec<Tensor> = (0..4).map(|i| arange_on_gpu(4 + i)).collect();
        let out = pool.map(double_on_gpu, inputs.clone()).unwrap();
        for (i, o) in out.iter().enumerate() {
            assert_eq!(o.device(), GPU);
            let want: Vec<f32> = (0..4 + i).map(|v| 2.0 * v as f32).collect();
            assert_eq!(o.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap(), want);
        }
        drop((out, inputs, t, back));
        pool.close();
        pool.join_timeout(secs(60)).unwrap();
        cuda::empty_cache(); // the pool's idle allocations hold an fd or two each
    });
}

fn put_and_exit(_rank: usize, q: Queue<Tensor>) -> multiproc::Result<()> {
    let t = Tensor::arange(0.0, (16 * MIB / 4) as f64, 1.0, DType::F32)?.to(GPU)?;
    q.put(t)?;
    Ok(()) // the process exits: torch would lose the tensor here
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_producer_may_exit_right_after_put() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let q = Queue::new().unwrap();
        let mut ctx = start_processes(put_and_exit, q.clone(), 1, StartMethod::Spawn).unwrap();
        ctx.join_timeout(secs(60)).unwrap();
        let t: Tensor = q.get().unwrap();
        let host = t.to(Device::Cpu).unwrap();
        let n = 16 * MIB / 4;
        assert_eq!(host.numel(), n);
        assert_eq!(host.sum().unwrap(), (n as f64 - 1.0) * n as f64 / 2.0);
    });
}

fn produce_gib(_rank: usize, q: Queue<Tensor>) -> multiproc::Result<()> {
    let t = Tensor::zeros_on(&[1 << 30], DType::U8, GPU)?;
    t.narrow(0, 0, 1)?
        .copy_(&Tensor::full(&[1], 7.0, DType::U8)?)?;
    q.put(t)?;
    Ok(())
}

fn hold_until_killed(
    _rank: usize,
    (q, holding, never): (Queue<Tensor>, Queue<usize>, multiproc::Event),
) -> multiproc::Result<()> {
    let t = q.get()?;
    let first = t.narrow(0, 0, 1)?.to(Device::Cpu)?.to_vec::<u8>()?[0];
    ensure!(first == 7, "first byte {first}");
    holding.put(t.numel())?;
    never.wait()?; // until SIGKILL
    drop(t);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_killed_consumer_gives_its_gib_back_within_a_second() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let before = free_device_memory();
        let (q, holding) = (Queue::new().unwrap(), Queue::new().unwrap());
        let never = multiproc::Event::new().unwrap();
        let mut consumer = start_processes(
            hold_until_killed,
            (q.clone(), holding.clone(), never.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        let mut producer = start_processes(produce_gib, q.clone(), 1, StartMethod::Spawn).unwrap();
        producer.join_timeout(secs(60)).unwrap();
        assert_eq!(holding.get_timeout(secs(60)).unwrap(), 1 << 30);
        let held = free_device_memory();
        assert!(
            held + (1 << 30) <= before,
            "the consumer holds 1 GiB: free {before} -> {held}"
        );
        let pid = consumer.pids()[0];
        // SAFETY: plain kill(2) of our own child.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        let killed = Instant::now();
        let slack = 64 * MIB;
        let mut free = free_device_memory();
        while free + slack < before && killed.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(5));
            free = free_device_memory();
        }
        let took = killed.elapsed();
        eprintln!("free memory back to {free} (before {before}, held {held}) after {took:?}");
        assert!(
            free + slack >= before,
            "1 s after the consumer's death free memory is {free}, was {before}"
        );
        let err = consumer.join_timeout(secs(30)).unwrap_err();
        assert!(matches!(err, Error::ProcessExited { .. }), "{err}");
    });
}

fn consume_and_ack(
    _rank: usize,
    (q, acks, cycles): (Queue<Tensor>, Queue<u32>, u32),
) -> multiproc::Result<()> {
    for i in 0..cycles {
        let t = q.get()?;
        let first = t.narrow(0, 0, 1)?.to(Device::Cpu)?.to_vec::<f32>()?[0];
        ensure!(first == i as f32, "cycle {i} read {first}");
        drop(t);
        acks.put(i)?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_thousand_put_get_cycles_of_64_mib_grow_neither_memory_nor_fds() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        const CYCLES: u32 = 1000;
        let (q, acks) = (Queue::new().unwrap(), Queue::new().unwrap());
        let mut ctx = start_processes(
            consume_and_ack,
            (q.clone(), acks.clone(), CYCLES),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        let mut baseline = None;
        for i in 0..CYCLES {
            let t = Tensor::empty_on(&[16 * MIB], DType::F32, GPU).unwrap();
            t.narrow(0, 0, 1)
                .unwrap()
                .copy_(&Tensor::full(&[1], i as f64, DType::F32).unwrap())
                .unwrap();
            q.put(t).unwrap();
            assert_eq!(acks.get_timeout(secs(30)).unwrap(), i);
            if i == 10 {
                baseline = Some((free_device_memory(), common::open_fds()));
            }
        }
        let (free0, fds0) = baseline.unwrap();
        let (free1, fds1) = (free_device_memory(), common::open_fds());
        eprintln!("after 10 cycles: {free0} free, {fds0} fds; after {CYCLES}: {free1}, {fds1}");
        assert!(
            free1 + 2 * MIB >= free0,
            "device memory grew: {free0} -> {free1}"
        );
        assert_eq!(fds1, fds0, "fds grew");
        ctx.join_timeout(secs(60)).unwrap();
        cuda::empty_cache();
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_pool_reuses_an_allocation_only_when_nobody_holds_it() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let a = Tensor::empty_on(&[MIB], DType::F32, GPU).unwrap();
        let pa = a.data_ptr();
        drop(a);
        let b = Tensor::empty_on(&[MIB], DType::F32, GPU).unwrap();
        assert_eq!(
            b.data_ptr(),
            pa,
            "a free allocation of the same size is reused"
        );
        // A message in flight holds a lease: the allocation is not free.
        let q = Queue::new().unwrap();
        q.put(b).unwrap();
        let c = Tensor::empty_on(&[MIB], DType::F32, GPU).unwrap();
        assert_ne!(c.data_ptr(), pa, "reused while a message still names it");
        drop(c);
        let got: Tensor = q.get().unwrap();
        assert_eq!(got.data_ptr(), pa, "it came home to its mapping");
        drop(got);
        let d = Tensor::zeros_on(&[MIB], DType::F32, GPU).unwrap();
        assert_eq!(
            d.to(Device::Cpu).unwrap().sum().unwrap(),
            0.0,
            "zeros_on clears a reused allocation"
        );
        drop(d);
        // Small tensors are carved out of one shared granule, 512-byte aligned.
        let small: Vec<Tensor> = (0..3)
            .map(|i| {
                Tensor::full(&[1000], i as f64, DType::F32)
                    .unwrap()
                    .to(GPU)
                    .unwrap()
            })
            .collect();
        let base = small[0].data_ptr() as usize;
        assert_eq!(small[1].data_ptr() as usize, base + 4096);
        assert_eq!(small[2].data_ptr() as usize, base + 8192);
        let q = Queue::new().unwrap();
        q.put(small.clone()).unwrap();
        let back: Vec<Tensor> = q.get().unwrap();
        for (i, t) in back.iter().enumerate() {
            assert!(Storage::ptr_eq(t.storage(), small[i].storage()));
            assert_eq!(t.to(Device::Cpu).unwrap().sum().unwrap(), 1000.0 * i as f64);
        }
        drop((small, back));
        cuda::empty_cache();
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn forged_handles_around_a_real_allocation_are_errors() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let t = Tensor::zeros_on(&[MIB], DType::U8, GPU).unwrap(); // one 2 MiB granule
        let real = |len: u64, nbytes: u64, device: u32| {
            let fds = fds_of(&t).unwrap();
            assert_eq!(fds.len(), 2, "an export and a lease");
            let bytes = cuda_handle_packet(ForgedCudaHandle {
                device,
                len,
                offset: 0,
                nbytes,
            })
            .unwrap();
            multiproc::__fuzz::decode_packet_for_fuzzing(&bytes, fds)
        };
        let err = real(64 * MIB as u64, 1024, 0).unwrap_err();
        assert!(err.to_string().contains("does not have"), "{err}");
        let err = real(2 * MIB as u64, 1024, 9).unwrap_err();
        assert!(err.to_string().contains("cuda:9"), "{err}");
        // A well-formed one over the same allocation decodes (a fresh id: a new mapping).
        real(2 * MIB as u64, 1024, 0).unwrap();
        // That mapping is retained under the forged id; the inputs below reuse the id.
        cuda::empty_cache();
        for (name, input) in cuda_handle_inputs().unwrap() {
            let err = multiproc::__fuzz::run_input(&input).unwrap_err();
            eprintln!("{name}: {err}");
            assert!(matches!(err, Error::InvalidMessage(_)), "{name}: {err}");
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn out_of_device_memory_names_the_device_the_size_and_the_free_memory() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let err = Tensor::zeros_on(&[1 << 42], DType::U8, GPU).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Cuda(_)), "{err:?}");
        assert!(
            text.contains("cuda:0") && text.contains("4.0 TiB") && text.contains("free"),
            "{text}"
        );
        let err = Tensor::zeros_on(&[4], DType::U8, Device::Cuda(99)).unwrap_err();
        assert!(err.to_string().contains("cuda:99"), "{err}");
    });
}

fn noop(_rank: usize, _: ()) -> multiproc::Result<()> {
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn fork_is_refused_once_cuda_is_initialised() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let Err(err) = start_processes(noop, (), 1, StartMethod::Fork) else {
            panic!("fork was not refused after CUDA was initialised");
        };
        assert!(err.to_string().contains("initialised CUDA"), "{err}");
        let mut ctx = start_processes(noop, (), 1, StartMethod::Forkserver).unwrap();
        ctx.join_timeout(secs(60)).unwrap();
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn copies_convert_layouts_and_dtypes_and_cpu_kernels_refuse_device_memory() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let cpu = Tensor::arange(0.0, 6.0, 1.0, DType::F32)
            .unwrap()
            .reshape(&[2, 3])
            .unwrap();
        let g = cpu.transpose(0, 1).unwrap().to(GPU).unwrap();
        assert!(g.is_contiguous());
        assert_eq!(
            g.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap(),
            [0., 3., 1., 4., 2., 5.]
        );
        let col = g.select(1, 1).unwrap(); // a strided view on the device
        assert_eq!(
            col.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap(),
            [3., 4., 5.]
        );
        let d = Tensor::zeros_on(&[3, 2], DType::F64, GPU).unwrap();
        d.copy_(&g).unwrap(); // device to device, f32 to f64
        assert_eq!(
            d.to(Device::Cpu).unwrap().to_vec::<f64>().unwrap(),
            [0., 3., 1., 4., 2., 5.]
        );
        let e = Tensor::zeros_on(&[3, 2], DType::F32, GPU).unwrap();
        e.copy_(&g).unwrap(); // one device-to-device copy
        assert!(
            e.to(Device::Cpu)
                .unwrap()
                .allclose(&g.to(Device::Cpu).unwrap(), 0.0, 0.0)
                .unwrap()
        );
        assert!(matches!(g.fill_(1.0), Err(Error::Tensor(_))));
        assert!(matches!(g.to_vec::<f32>(), Err(Error::Tensor(_))));
        assert!(matches!(g.sum(), Err(Error::Tensor(_))));
        let shown = format!("{g:?}");
        assert!(
            shown.contains("Cuda(0)") && !shown.contains("values"),
            "{shown}"
        );
        assert!(g.share_memory_().is_ok() && g.is_shared());
    });
}
