//! CUDA tensors shared across processes by handle (cargo feature `cuda`).
//!
//! A CUDA tensor's storage is a VMM allocation (`cuMemCreate` with a POSIX-fd shareable
//! handle) exported once as an fd. Sent through any multiproc channel, the fd rides in
//! the message's `SCM_RIGHTS` like a memfd; the receiver imports it, reserves address
//! space and maps it, once per process (the same allocation sent twice maps once, and
//! views keep their offset, shape and strides). Without the feature this module is a
//! stub with the same API: [`is_available`] is `false` and every CUDA operation is
//! [`Error::CudaUnavailable`].
//!
//! ```no_run
//! # fn main() -> multiproc::Result<()> {
//! use multiproc::{DType, Device, Tensor};
//! let t = Tensor::arange(0.0, 1024.0, 1.0, DType::F32)?.to(Device::Cuda(0))?;
//! assert_eq!(t.device(), Device::Cuda(0));
//! let q = multiproc::Queue::new()?;
//! q.put(t.clone())?; // the allocation travels as an fd; no copy is made
//! let back: Tensor = q.get()?;
//! assert_eq!(back.to(Device::Cpu)?.sum(), t.to(Device::Cpu)?.sum());
//! # Ok(()) }
//! ```
//!
//! ## What torch cannot do, and this can
//!
//! The physical memory lives while any process maps it or holds an fd of it — the
//! driver's rule for exported allocations, the kernel's for the fds. So:
//!
//! - the producer may exit right after `put` (torch requires it to stay alive while any
//!   consumer holds the tensor);
//! - a consumer killed by a signal releases its share when the kernel closes its fds
//!   (torch pins the memory "forever" while the producer runs);
//! - a received CUDA tensor may be sent on (torch forbids it).
//!
//! ## Ordering: the sender waits for its device
//!
//! Sending a CUDA tensor calls `cuCtxSynchronize` on its device before the handle is
//! written: every write issued before the send, on any stream of the sending process,
//! is complete when the receiver can see the handle, so the receiver may read at once
//! on any stream. We chose this over an interprocess event (`cuIpcGetEventHandle`
//! recorded at `put`, waited on by the consumer's stream) because (1) multiproc has no
//! "current stream": writes come from the user's own kernels on streams we cannot see,
//! and only a device-wide wait covers them all; (2) an interprocess event belongs to
//! the producer, and opening it after the producer exited fails — the very trap of
//! torch's we avoid. The cost is one synchronisation per send (a few microseconds on
//! an idle device). Every operation of this module on CUDA memory (`zeros_on`,
//! `copy_`, `to`) is complete when it returns. The same rule runs the other way: a
//! receiver waits for its device before its last tensor on an allocation lets go of
//! it, and an owner before it hands a recycled allocation out again, so no kernel still
//! reading old bytes can see new ones.
//!
//! ## Allocation and lifetime
//!
//! Allocations are whole multiples of the device's granularity
//! (`cuMemGetAllocationGranularity`, 2 MiB on current GPUs); storages of up to 256 KiB
//! are carved (512-byte aligned) out of a shared one-granule arena, as the CPU side
//! carves small storages out of 1 MiB arenas. Allocations are recycled like the
//! CPU blocks: an allocation goes back to this process's pool when the last storage on
//! it (for an arena, every storage carved from it), in every process, is gone — counted by *leases* the kernel drops when a holder
//! dies (see `sys::lease`), so a SIGKILLed consumer never pins one. A fresh CUDA tensor
//! of a size seen before therefore costs no `cuMemCreate`. The pool keeps at most 32
//! allocations and 4 GiB of idle ones. A receiver keeps its 8 most recently received
//! allocations (2 GiB at most) mapped after their tensors are dropped — holding no
//! lease, so their owner still recycles them — so a tensor that comes again costs no
//! import and no mapping; this pins their memory until they are pushed out, the
//! process exits, or [`empty_cache`] gives them up with the pool's idle ones. Out of
//! device memory is [`Error::Cuda`] naming the device, the size and the free memory.
//!
//! ## Pinned shared memory and batches on the device
//!
//! A data loader with [`pin_memory`](crate::data::DataLoaderBuilder::pin_memory)
//! page-locks the shared blocks its batches arrive in, in the trainer, once per block
//! (`cuMemHostRegister`, portable, so every context sees the pages as pinned): the
//! workers write into shared memory, and the trainer registers that very memory, so no
//! batch is copied to be pinned. The registration lives with the trainer's mapping of
//! the block — the workers recycle blocks, so after the first few batches none costs a
//! registration — and is undone just before the mapping goes.
//! [`Tensor::is_pinned`](crate::Tensor::is_pinned) asks the driver.
//! [`prefetch_to`](crate::data::DataLoaderBuilder::prefetch_to) copies each batch to a
//! device on a stream of the loader's own (non-blocking), `n` batches ahead; a batch
//! is handed over once its copy is complete, as every operation of this module is.
//!
//! ## Start methods and devices per worker
//!
//! CUDA does not survive `fork`: start workers with `Spawn` or `Forkserver` (the fork
//! server is a fresh process that never initialises CUDA). Starting `Fork` workers once
//! this process has initialised CUDA is an error that says so. To give each worker its
//! own GPU, set `CUDA_VISIBLE_DEVICES` in the worker's environment before it first
//! touches CUDA — each worker then sees its GPU as `cuda:0`: with a per-rank
//! environment option of the spawn options where there is one, or first thing in the
//! worker function (`unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", rank.to_string()) }`
//! while the worker has no other threads). The driver reads it once, at initialisation:
//! a CUDA tensor among the worker's *arguments* initialises CUDA while they are
//! decoded, before the worker function runs, so hand such tensors over through a queue
//! instead. A handle names its device by the sender's ordinal, and the receiver checks
//! it against the device the driver reports for the allocation: processes that
//! exchange CUDA tensors must number the devices alike (the same
//! `CUDA_VISIBLE_DEVICES`, as in torch); workers that each see only their own GPU can
//! exchange CPU tensors with everyone and CUDA tensors with workers of the same GPU.

// `memory`: CUDA memory other processes can map (allocations, the pool, the wire
// form), or `stub` without the feature (pinning host tensors and copying them to a
// device on a side stream is the tensor's, `tensor::side_stream`). The driver calls (FFI) are
// `sys::cuda_driver`'s; this module has no unsafe code: host memory reaches the
// driver's copies as a checked `SharedBytes`.
#[cfg(feature = "cuda")]
mod memory;
#[cfg(not(feature = "cuda"))]
mod stub;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[cfg(feature = "cuda")]
use crate::sys::cuda_driver as driver;
#[cfg(feature = "cuda")]
pub(crate) use memory::{CudaUse, allocate, receive, send};
#[cfg(not(feature = "cuda"))]
pub(crate) use stub::{CudaUse, allocate, receive, send};

use crate::error::{Error, Result};

/// Where a tensor's elements live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Device {
    /// Host memory (private, or shared memory once shared).
    #[default]
    Cpu,
    /// The CUDA device with this ordinal, as this process sees it.
    Cuda(u32),
}

impl fmt::Display for Device {
    /// torch's names: `cpu`, `cuda:0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// `cpu`, `cuda` (device 0) or `cuda:N`, as torch spells them.
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "unknown device {s:?}: expected cpu, cuda or cuda:N"
                    ))
                }),
        }
    }
}

/// The wire form of a storage's CUDA bytes: the allocation (fd #`export`), a lease for
/// the receiver (fd #`lease`), the allocation's id, device and length, and where the
/// storage is in it. Plain data, the same with and without the feature (a build
/// without it refuses the handle with `CudaUnavailable`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct CudaHandle {
    pub(crate) export: u32,
    pub(crate) lease: u32,
    pub(crate) id: u128,
    pub(crate) device: u32,
    pub(crate) len: u64,
    pub(crate) offset: u64,
    pub(crate) nbytes: u64,
}

/// Whether CUDA can be used: the driver library loads, initialises, and sees at least
/// one device. Never panics, also where there is no driver at all.
pub fn is_available() -> bool {
    device_count() > 0
}

/// The number of CUDA devices this process sees (0 without a driver, a device or the
/// `cuda` feature). See [`init`] for why there are none.
pub fn device_count() -> usize {
    init().map_or(0, |n| n)
}

/// Loads and initialises the CUDA driver (done on first use anyway) and returns the
/// number of devices.
///
/// # Errors
///
/// [`Error::CudaUnavailable`] with the reason: no
/// `libcuda.so.1`, a driver older than CUDA 11.4, `cuInit` failing (no device), or a
/// build without the `cuda` feature.
pub fn init() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        driver::driver().map(driver::Driver::device_count)
    }
    #[cfg(not(feature = "cuda"))]
    {
        stub::device_count()
    }
}

/// Free and total memory of a device, in bytes (torch's `torch.cuda.mem_get_info`).
///
/// # Errors
///
/// [`Error::CudaUnavailable`], or an invalid device.
pub fn mem_get_info(device: u32) -> Result<(usize, usize)> {
    #[cfg(feature = "cuda")]
    {
        driver::driver()?.mem_info(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        stub::mem_get_info(device)
    }
}

/// Waits for all work on a device to finish (torch's `torch.cuda.synchronize`).
///
/// # Errors
///
/// [`Error::CudaUnavailable`], or what the device reports.
pub fn synchronize(device: u32) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        driver::driver()?.synchronize(device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        stub::synchronize(device)
    }
}

/// Gives the idle allocations of this process's pool back to the device (torch's
/// `torch.cuda.empty_cache`), and unmaps the received allocations kept mapped after
/// their tensors were dropped. Allocations still used here or by another process stay
/// until they are not.
pub fn empty_cache() {
    #[cfg(feature = "cuda")]
    memory::empty_cache();
    #[cfg(not(feature = "cuda"))]
    stub::empty_cache();
}

/// Whether this process has initialised CUDA.
pub(crate) fn initialised() -> bool {
    #[cfg(feature = "cuda")]
    {
        driver::initialised()
    }
    #[cfg(not(feature = "cuda"))]
    {
        stub::initialised()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_have_torch_names() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(s.parse::<Device>().unwrap(), d);
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert!("gpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
