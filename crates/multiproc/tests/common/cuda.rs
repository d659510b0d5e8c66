//! What the CUDA tests (tests/cuda_tensors.rs, cuda_sharing.rs, cuda_loader.rs; feature
//! `cuda`) share: the device, a warm-up before fds are counted, free device memory.

use std::time::Duration;

use multiproc::__fuzz::{ForgedCudaHandle, cuda_handle_packet, fds_of};
use multiproc::{DType, Device, Queue, Tensor, cuda};

pub const DEADLINE: Duration = Duration::from_secs(120);
pub const GPU: Device = Device::Cuda(0);
pub const MIB: usize = 1 << 20;

/// Makes the driver's own fds and threads (opened on first use) exist before a test
/// counts fds: initialise, allocate, copy both ways, send to ourselves, import an
/// allocation (a handle to our own, under another id), drop, empty the caches.
pub fn warm_up_cuda() {
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

pub fn free_device_memory() -> usize {
    cuda::mem_get_info(0).unwrap().0
}

pub fn arange_on_gpu(n: usize) -> Tensor {
    Tensor::arange(0.0, n as f64, 1.0, DType::F32)
        .unwrap()
        .to(GPU)
        .unwrap()
}
