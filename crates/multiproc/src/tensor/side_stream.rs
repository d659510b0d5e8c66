//! Host tensors page-locked where they are ([`pin`]) and copied to a device on a side
//! stream ([`Copier`]): what the data loader's `pin_memory` and `prefetch_to` do to
//! each batch in the trainer.
//!
//! Pinning registers the shared segment a tensor's bytes live in, once per mapping
//! (the registration is kept with the mapping and undone when it goes, see
//! `tensor::storage::pinned`); a tensor in private memory is first moved into shared
//! memory, as `share_memory_` does. A copy to the device is issued on a stream of the
//! copier's own that does not wait for the default stream, from the held host bytes,
//! into a fresh contiguous CUDA tensor; [`InFlight::wait`] returns once it is complete,
//! and [`InFlight::poll_done`] (for copies started `awaited`) says so without blocking.

use std::sync::Arc;
#[cfg(feature = "async")]
use std::task::{Context, Poll};

use super::Tensor;
use crate::cuda::Device;
use crate::error::Result;
use crate::sys::cuda_driver::{self as driver, CopiesDone, Stream, Transfer};

/// Page-locks the host bytes of `t` for every CUDA context of this process (registered
/// with `device`'s context current), once per shared segment. A tensor in private
/// memory is moved into shared memory first; CUDA tensors, empty ones and read-only
/// file pages are left as they are. Returns whether a registration was made now.
///
/// # Errors
/// [`Error::CudaUnavailable`](crate::Error::CudaUnavailable), out of shared memory, or
/// what the driver says (the limit on page-locked memory).
pub(crate) fn pin(t: &Tensor, device: u32) -> Result<bool> {
    if t.device() != Device::Cpu || t.storage().nbytes() == 0 || t.is_read_only() {
        return Ok(false);
    }
    if !t.is_shared() {
        t.share_memory_()?;
    }
    t.storage().pin_shared(device)
}

/// Copies host tensors to one device on a stream of its own.
pub(crate) struct Copier {
    device: u32,
    stream: Arc<Stream>,
}

/// Copies issued by a [`Copier`]: complete once [`wait`](Self::wait) returns (or the
/// value is dropped, which waits too). Holds the host bytes until then.
pub(crate) struct InFlight {
    transfer: Transfer,
    /// Set by the driver when the copies are done (copies started `awaited`, which
    /// only a stream does: feature `async`).
    #[cfg_attr(not(feature = "async"), allow(dead_code))]
    done: Option<Arc<CopiesDone>>,
}

impl InFlight {
    /// Waits until every copy is complete (at once, for copies `poll_done` saw done),
    /// and says whether they all succeeded.
    pub(crate) fn wait(mut self) -> Result<()> {
        self.transfer.wait()
    }

    /// `Ready` once the copies are done (then [`wait`](Self::wait) does not block);
    /// until then `cx` is woken by the driver when they are. Always `Ready` for copies
    /// not started `awaited`.
    #[cfg(feature = "async")]
    pub(crate) fn poll_done(&self, cx: &mut Context<'_>) -> Poll<()> {
        match &self.done {
            Some(done) => done.poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Copier {
    /// A copier to `device`, with a new stream there.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`](crate::Error::CudaUnavailable), an invalid device.
    pub(crate) fn new(device: u32) -> Result<Copier> {
        let d = driver::driver()?;
        d.check_device(device, "prefetch_to")?;
        Ok(Copier {
            device,
            stream: d.stream(device)?,
        })
    }

    /// Replaces each tensor `visit` hands over with its copy on the device: host
    /// tensors are pinned ([`pin`]) and copied on the copier's stream; tensors already
    /// on the device stay; tensors on another device are copied there (waited for).
    /// The copies are complete once the returned [`InFlight`] is waited for; with
    /// `awaited`, the driver also tells it when they are ([`InFlight::poll_done`]).
    ///
    /// # Errors
    /// As [`pin`], out of device memory, or what the driver says; the copies issued
    /// before the error are waited for before it is returned.
    pub(crate) fn start(
        &self,
        visit: impl FnOnce(&mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()>,
        awaited: bool,
    ) -> Result<InFlight> {
        let d = driver::driver()?;
        let mut transfer = d.transfer(&self.stream)?;
        let target = Device::Cuda(self.device);
        visit(&mut |t: &mut Tensor| {
            match t.device() {
                Device::Cpu => {}
                device if device == target => return Ok(()),
                Device::Cuda(_) => {
                    *t = t.to(target)?;
                    return Ok(());
                }
            }
            let src = if t.is_contiguous() {
                t.clone()
            } else {
                t.contiguous()?
            };
            pin(&src, self.device)?;
            let out = Tensor::empty_on(src.shape(), src.dtype(), target)?;
            let elem = src.dtype().size();
            let len = src.numel() * elem;
            if len > 0 {
                let held = src.storage().held_bytes(src.storage_offset() * elem, len)?;
                out.storage().copy_from_host_async(
                    out.storage_offset() * elem,
                    Box::new(held),
                    &mut transfer,
                )?;
            }
            *t = out;
            Ok(())
        })?;
        transfer.record()?;
        let done = if awaited {
            Some(transfer.copies_done()?)
        } else {
            None
        };
        Ok(InFlight { transfer, done })
    }
}
