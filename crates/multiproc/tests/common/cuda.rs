//! What the CUDA tests (tests/cuda_tensors.rs, cuda_sharing.rs, cuda_loader.rs,
//! cuda_async.rs; feature `cuda`) share: the device, a warm-up before fds are counted,
//! free device memory, the loader tests' data sets, and the stand-in driver's counters.

use std::time::Duration;

use multiproc::__fuzz::{ForgedCudaHandle, cuda_handle_packet, fds_of};
use multiproc::data::{DataLoader, DataLoaderBuilder, Dataset, IterableDataset};
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

/// Sample `i` is `len` elements equal to `i`, labelled `i`.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct Ramp {
    pub n: usize,
    pub width: usize,
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
pub struct Count(pub i64);

impl IterableDataset for Count {
    type Item = i64;
    type Iter = std::vec::IntoIter<multiproc::Result<i64>>;

    fn iter(&self, _epoch: u64) -> Self::Iter {
        (0..self.0).map(Ok).collect::<Vec<_>>().into_iter()
    }
}

/// Checks batch `(x, y)` of `rows` samples of `len` elements is samples `first..`.
pub fn check_ramp_batch(x: &Tensor, y: &Tensor, first: usize, rows: usize, len: usize) {
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

/// The stand-in libcuda's counters of page-locked host memory (scripts/fake_libcuda.c):
/// registrations made, undone, refused as registered already, undone after their
/// memory was unmapped, and registered now. `None` on a real driver, which has no such
/// symbol.
pub fn fake_host_counts() -> Option<[i64; 5]> {
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

/// After a test that pinned batches (`before`: [`fake_host_counts`] at its start):
/// under the stand-in, registrations were made, none twice, and none outlived the
/// mapping it pinned. Lets go of the blocks this process keeps first.
pub fn assert_registered_once_each(before: Option<[i64; 5]>) {
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
}

/// Checks batch `(x, y)` (on the device) is the CPU batch `(wx, wy)`.
pub fn same_batch_on_device(got: &(Tensor, Tensor), want: &(Tensor, Tensor), what: &str) {
    let ((x, y), (wx, wy)) = (got, want);
    assert_eq!(
        (x.device(), y.device()),
        (GPU, GPU),
        "{what} is on the device"
    );
    assert_eq!((x.shape(), y.shape()), (wx.shape(), wy.shape()), "{what}");
    let (hx, hy) = (x.to(Device::Cpu).unwrap(), y.to(Device::Cpu).unwrap());
    assert_eq!(
        hx.to_vec::<f32>().unwrap(),
        wx.to_vec::<f32>().unwrap(),
        "x of {what}"
    );
    assert_eq!(
        hy.to_vec::<i64>().unwrap(),
        wy.to_vec::<i64>().unwrap(),
        "y of {what}"
    );
}

/// Waits (10 s at most) until the device's free memory is back to `free_before`, give
/// or take 16 MiB (the driver's own), and fails the test if it is not: what a test
/// that freed its device memory checks, since the driver frees some of it lazily.
pub fn assert_device_memory_back(free_before: usize) {
    let slack = 16 * MIB;
    let until = std::time::Instant::now() + Duration::from_secs(10);
    let mut free = free_device_memory();
    while free + slack < free_before && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
        free = free_device_memory();
    }
    assert!(
        free + slack >= free_before,
        "device memory free {free} after the test, {free_before} before"
    );
}

/// Two loaders of 90 [`Ramp`] samples of 3,000 elements, in batches of 6, shuffled
/// alike, with 2 workers: a plain one, and one that prefetches 3 batches to [`GPU`].
pub fn ramp_loaders_without_and_with_prefetch() -> (DataLoader<Ramp>, DataLoader<Ramp>) {
    let data = Ramp { n: 90, width: 3000 };
    let build =
        |b: DataLoaderBuilder<Ramp>| b.batch_size(6).shuffle(7).num_workers(2).build().unwrap();
    (
        build(DataLoader::builder(data.clone())),
        build(DataLoader::builder(data).prefetch_to(GPU, 3)),
    )
}
