//! CUDA tensors across processes (feature `cuda`): by handle through queues, pipes and
//! the pool, sent on to a third process, a producer that exits right after its put, a
//! killed consumer's memory given back, a thousand cycles without growth, the pool's
//! reuse of allocations, forged handles around a real allocation, out of memory.
//!
//! The tests marked `#[ignore = "needs a CUDA device"]` need a GPU and run with
//! `scripts/gpu_check.sh` (built by `scripts/gpu_build.sh`), or by hand with
//! `cargo test -p multiproc --features cuda --test cuda_tensors --test cuda_sharing
//! --test cuda_loader -- --include-ignored`. The others run everywhere: without a
//! driver, a device or the feature, every CUDA operation and every forged CUDA handle
//! must be a clean `CudaUnavailable`, never a panic. What they share is in
//! tests/common/cuda.rs.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use common::cuda::*;
use common::secs;
use multiproc::__fuzz::{ForgedCudaHandle, cuda_handle_inputs, cuda_handle_packet, fds_of};
use multiproc::{
    DType, Device, Error, JoinableQueue, Pool, Queue, SimpleQueue, StartMethod, Storage, Tensor,
    cuda, pipe, start_processes,
};

/// A worker's check: an `Err` that the parent's `join` reports with the worker's rank.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(Error::InvalidArgument(format!($($msg)+)));
        }
    };
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
