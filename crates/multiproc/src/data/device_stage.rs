//! [`DeviceStage`]: what the trainer does to each batch before yielding it, with
//! [`pin_memory`](super::DataLoaderBuilder::pin_memory) (page-lock the shared blocks
//! the batch arrived in, once per block) and
//! [`prefetch_to`](super::DataLoaderBuilder::prefetch_to) (copy it to a device on a
//! side stream, `n` batches ahead of the one the caller holds).
//!
//! Invariants:
//!
//! - A batch handed to the caller is complete on the device: its copy's event was
//!   waited for first (the same rule as every CUDA operation of this crate), by the
//!   iterator in its thread, by a stream through the driver's callback (see
//!   `sys::cuda_driver::CopiesDone`).
//! - Batches come out in the order they were pulled, and an error after the batches
//!   pulled before it; a resumed state counts only batches handed to the caller (each
//!   staged batch carries the state changes its epoch makes at its hand-over: a
//!   map-style batch's number, an iterable epoch's stream positions).
//! - While a copy is in flight, its host batch is held (its blocks cannot be recycled)
//!   and its device tensors are not reachable by the caller; dropping a staged batch
//!   waits for its copy first.
//!
//! Without the `cuda` feature the builder refuses both options, so no stage exists.

use std::collections::VecDeque;
#[cfg(feature = "async")]
use std::task::Poll;

use super::options::Options;
use super::tensors::VisitTensors;
use crate::cuda::Device;
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::tensor::side_stream::{Copier, InFlight, pin};

/// The loader's per-batch work in the trainer (see the module docs).
pub(super) struct DeviceStage<B> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    visit: VisitTensors<B>,
    /// The device whose context registers pinned blocks (portable: every context sees
    /// them as pinned).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pin_on: u32,
    /// Batches copied ahead of the one handed over (`prefetch_to`'s `n`); 0 without.
    ahead: usize,
    #[cfg(feature = "cuda")]
    copier: Option<Copier>,
}

/// A batch whose copy to the device may still be running.
pub(super) struct Pending<B> {
    /// Declared first: dropped (waited for) before the batch.
    #[cfg(feature = "cuda")]
    copies: Option<InFlight>,
    batch: B,
}

impl<B> Pending<B> {
    /// `Ready` once the batch's copies are done (see [`InFlight::poll_done`]).
    #[cfg(feature = "async")]
    fn poll_done(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        #[cfg(feature = "cuda")]
        if let Some(copies) = &self.copies {
            return copies.poll_done(cx);
        }
        let _ = cx;
        std::task::Poll::Ready(())
    }

    /// The batch, once its copies are complete.
    fn finish(self) -> Result<B> {
        #[cfg(feature = "cuda")]
        if let Some(copies) = self.copies {
            copies.wait()?;
        }
        Ok(self.batch)
    }
}

/// Batches pulled ahead, oldest first, each with what the epoch does to its state when
/// the batch is handed over (`N`: a map-style epoch's batch number; an iterable
/// epoch's stream positions).
pub(super) type Staged<B, N> = VecDeque<(N, Result<Pending<B>>)>;

impl<B> DeviceStage<B> {
    /// The stage the options ask for, or `None` when they ask for none. `visit` is the
    /// collate's way to the batch's tensors.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without the `cuda` feature or a usable driver;
    /// [`Error::InvalidArgument`] for `n == 0`, a CPU or missing device, a collate that
    /// does not say how to reach its batch's tensors, or `Fork` workers (which cannot
    /// start once this process has initialised CUDA, which the stage does now).
    pub(super) fn new(options: &Options, visit: Option<VisitTensors<B>>) -> Result<Option<Self>> {
        let wanted = match (options.pin_memory, options.prefetch_to) {
            (false, None) => return Ok(None),
            (_, Some(_)) => "prefetch_to",
            (true, None) => "pin_memory(true)",
        };
        let ahead = match options.prefetch_to {
            None => 0,
            Some((_, 0)) => {
                return Err(Error::InvalidArgument(
                    "data loader: prefetch_to(device, 0): n is how many batches are copied \
                     ahead of the one in hand, at least 1 (leave prefetch_to out for none)"
                        .into(),
                ));
            }
            Some((Device::Cpu, _)) => {
                return Err(Error::InvalidArgument(
                    "data loader: prefetch_to(Device::Cpu, n): batches are on the CPU already; \
                     name a CUDA device (Device::Cuda(i)) or leave prefetch_to out"
                        .into(),
                ));
            }
            Some((Device::Cuda(_), n)) => n,
        };
        let Some(visit) = visit else {
            return Err(Error::InvalidArgument(format!(
                "data loader: {wanted} must reach the tensors of each batch, and this \
                 collate does not say how: implement Collate::batch_tensors (for a batch type \
                 that implements data::Tensors: Some(Tensors::visit_tensors))"
            )));
        };
        if options.start_method == crate::process::StartMethod::Fork
            && options.num_workers > 0
            && options.kind == super::worker_kind::WorkerKind::Process
        {
            return Err(Error::InvalidArgument(format!(
                "data loader: {wanted} initialises CUDA in this process, and Fork workers \
                 cannot start after that: use StartMethod::Spawn (the default) or Forkserver"
            )));
        }
        Self::with_cuda(options, visit, ahead, wanted)
    }

    #[cfg(not(feature = "cuda"))]
    fn with_cuda(
        _options: &Options,
        _visit: VisitTensors<B>,
        _ahead: usize,
        wanted: &str,
    ) -> Result<Option<Self>> {
        Err(Error::CudaUnavailable {
            reason: format!(
                "data loader: {wanted} needs the `cuda` cargo feature of multiproc: enable it \
                 (features = [\"cuda\"]), or leave {wanted} out"
            ),
        })
    }

    #[cfg(feature = "cuda")]
    fn with_cuda(
        options: &Options,
        visit: VisitTensors<B>,
        ahead: usize,
        wanted: &str,
    ) -> Result<Option<Self>> {
        let with_context = |e: Error| match e {
            Error::CudaUnavailable { reason } => Error::CudaUnavailable {
                reason: format!("data loader: {wanted} needs a CUDA device: {reason}"),
            },
            other => other,
        };
        crate::cuda::init().map_err(with_context)?;
        let (pin_on, copier) = match options.prefetch_to {
            Some((Device::Cuda(i), _)) => (i, Some(Copier::new(i)?)),
            _ => (0, None),
        };
        Ok(Some(DeviceStage {
            visit,
            pin_on,
            ahead,
            copier,
        }))
    }

    /// Batches copied ahead of the one handed over (0: no copies).
    pub(super) fn ahead(&self) -> usize {
        self.ahead
    }

    /// Page-locks the host blocks of `batch` (`pin_memory` without `prefetch_to`).
    pub(super) fn pin(&self, batch: &mut B) -> Result<()> {
        #[cfg(feature = "cuda")]
        (self.visit)(batch, &mut |t| pin(t, self.pin_on).map(drop))?;
        #[cfg(not(feature = "cuda"))]
        let _ = batch;
        Ok(())
    }

    /// Starts copying `batch` to the device (its host blocks pinned first); `awaited`
    /// for a stream, which is told when the copies are done instead of blocking.
    fn start(&self, batch: B, awaited: bool) -> Result<Pending<B>> {
        #[cfg(feature = "cuda")]
        {
            let mut batch = batch;
            let copies = match &self.copier {
                Some(copier) => Some(copier.start(|f| (self.visit)(&mut batch, f), awaited)?),
                None => None,
            };
            Ok(Pending { copies, batch })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = awaited;
            Ok(Pending { batch })
        }
    }

    /// Whether another batch may be pulled ahead: fewer than `ahead` are in flight
    /// behind the next one handed over, and none of them is an error.
    fn wants_more<N>(&self, staged: &Staged<B, N>) -> bool {
        staged.len() <= self.ahead && !staged.back().is_some_and(|(_, r)| r.is_err())
    }

    /// The next batch to hand over: pulls batches with `pull` (what to do to the
    /// state at its hand-over, and the batch; `None` at the end) and starts their
    /// copies until `ahead` are in flight behind the one returned, or an error was
    /// pulled; then waits for the oldest. Returns its `N` with it, for the caller to
    /// count it as yielded.
    pub(super) fn next<N>(
        &self,
        staged: &mut Staged<B, N>,
        mut pull: impl FnMut() -> Option<(N, Result<B>)>,
    ) -> Option<(N, Result<B>)> {
        while self.wants_more(staged) {
            let Some((number, batch)) = pull() else {
                break;
            };
            staged.push_back((number, batch.and_then(|b| self.start(b, false))));
        }
        let (number, pending) = staged.pop_front()?;
        Some((number, pending.and_then(Pending::finish)))
    }

    /// [`next`](Self::next) for a stream: `pull` is polled (`Pending` while the
    /// workers have nothing: `cx` is woken by them), and the oldest batch's copies are
    /// awaited (`cx` is woken by the driver), so no thread waits on either. A batch
    /// whose copies are done is handed over even while `pull` is pending.
    #[cfg(feature = "async")]
    pub(super) fn poll_next<N>(
        &self,
        staged: &mut Staged<B, N>,
        cx: &mut std::task::Context<'_>,
        mut pull: impl FnMut(&mut std::task::Context<'_>) -> Poll<Option<(N, Result<B>)>>,
    ) -> Poll<Option<(N, Result<B>)>> {
        let mut waiting = false;
        while self.wants_more(staged) {
            match pull(cx) {
                Poll::Ready(Some((number, batch))) => {
                    staged.push_back((number, batch.and_then(|b| self.start(b, true))));
                }
                Poll::Ready(None) => break,
                Poll::Pending => {
                    waiting = true;
                    break;
                }
            }
        }
        match staged.front() {
            None if waiting => return Poll::Pending,
            None => return Poll::Ready(None),
            Some((_, Ok(front))) if front.poll_done(cx).is_pending() => return Poll::Pending,
            Some(_) => {}
        }
        Poll::Ready(
            staged
                .pop_front()
                .map(|(number, pending)| (number, pending.and_then(Pending::finish))),
        )
    }
}
