//! CUDA tensors (feature `cuda`): every operation without a device, CPU tensors,
//! forged handles, the fork check once CUDA is initialised, copies across layouts and
//! dtypes. Sharing across processes is tests/cuda_sharing.rs, the data loader's pinned
//! batches and prefetch tests/cuda_loader.rs.
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

use common::cuda::*;
use common::secs;
use multiproc::__fuzz::cuda_handle_inputs;
use multiproc::{DType, Device, Error, StartMethod, Storage, Tensor, cuda, start_processes};

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
