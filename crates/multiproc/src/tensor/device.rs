//! Tensors on devices: [`Tensor::device`], [`Tensor::zeros_on`], [`Tensor::empty_on`],
//! [`Tensor::to`], and the copies between host and CUDA memory behind them and
//! [`Tensor::copy_`].
//!
//! The element kernels run on the CPU only; a CUDA tensor's elements are reached by
//! copying (`to(Device::Cpu)`), and views of CUDA tensors keep their layout like any
//! other. On a CUDA tensor the in-place kernels and `to_vec` are an [`Error::Tensor`]
//! saying so, `sum` is NaN and `allclose` false. Every copy here is complete when it
//! returns.

use super::layout::Layout;
use super::storage::{self, Storage};
use super::{DType, Tensor};
use crate::cuda::Device;
use crate::error::{Error, Result};

impl Tensor {
    /// Where the elements live.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// Whether the tensor's bytes are page-locked host memory that the CUDA driver
    /// knows (torch's `is_pinned`), as the driver reports it: a batch of a data loader
    /// with [`pin_memory`](crate::data::DataLoaderBuilder::pin_memory) is. Always
    /// `false` for CUDA tensors, before this process has initialised CUDA, and without
    /// the `cuda` feature.
    pub fn is_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device() == Device::Cpu && self.storage.is_pinned()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// A zero-filled, contiguous tensor on `device` (torch's `zeros(..., device=)`).
    ///
    /// # Errors
    ///
    /// As [`zeros`](Self::zeros); for a CUDA device,
    /// [`Error::CudaUnavailable`], an invalid device, or [`Error::Cuda`] when it is out
    /// of memory (naming the device, the size and the free memory).
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Tensor::zeros(shape, dtype),
            Device::Cuda(i) => Self::contiguous_on(shape, dtype, |n| Storage::new_cuda(n, i, true)),
        }
    }

    /// A contiguous tensor on `device` whose elements are unspecified (torch's
    /// `empty`): on CUDA, memory recycled from this process's pool is not cleared. On
    /// the CPU it is [`zeros`](Self::zeros) (private memory always starts zeroed).
    ///
    /// # Errors
    ///
    /// As [`zeros_on`](Self::zeros_on).
    pub fn empty_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Tensor::zeros(shape, dtype),
            Device::Cuda(i) => {
                Self::contiguous_on(shape, dtype, |n| Storage::new_cuda(n, i, false))
            }
        }
    }

    /// This tensor on `device`: itself (a handle copy) when it is already there, else
    /// a contiguous copy there (torch's `.to(device)`).
    ///
    /// # Errors
    ///
    /// As [`zeros_on`](Self::zeros_on).
    pub fn to(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let out = Tensor::empty_on(self.shape(), self.dtype, device)?;
        out.copy_(self)?;
        Ok(out)
    }

    /// `copy_` when either side is CUDA memory.
    pub(super) fn copy_across_devices_(&self, src: &Tensor) -> Result<()> {
        let elem = self.dtype.size();
        match self.device() {
            Device::Cpu => {
                // Bring the source's bytes over, then the CPU kernels do the rest
                // (dtype conversion, any layout).
                let host = src.host_copy()?;
                self.copy_(&host)
            }
            Device::Cuda(_) => {
                if !self.is_contiguous() {
                    return Err(Error::Tensor(
                        "copy_ into a non-contiguous CUDA tensor is not supported: copy into a \
                         contiguous one (zeros_on/empty_on) instead"
                            .into(),
                    ));
                }
                let len = self.numel() * elem;
                let dst_offset = self.layout.offset * elem;
                let same_kind = src.dtype == self.dtype && src.is_contiguous();
                // A copy within one storage may overlap itself: it goes through the host.
                let same_storage = Storage::ptr_eq(&self.storage, &src.storage);
                if same_kind && src.device() != Device::Cpu && !same_storage {
                    return storage::copy_bytes(
                        &self.storage,
                        dst_offset,
                        &src.storage,
                        src.layout.offset * elem,
                        len,
                    );
                }
                // A host tensor (or a CUDA one of another dtype or layout): staged as a
                // contiguous host tensor of this dtype, then one copy up.
                let staged = if src.device() == Device::Cpu && same_kind {
                    src.clone()
                } else {
                    let host = if src.device() == Device::Cpu {
                        src.clone()
                    } else {
                        src.host_copy()?
                    };
                    let out = Tensor::zeros(self.shape(), self.dtype)?;
                    out.copy_(&host)?;
                    out
                };
                storage::copy_bytes(
                    &self.storage,
                    dst_offset,
                    &staged.storage,
                    staged.layout.offset * elem,
                    len,
                )
            }
        }
    }

    /// A host tensor with this (CUDA) tensor's elements and layout: the bytes the view
    /// reaches, copied into a fresh private storage.
    fn host_copy(&self) -> Result<Tensor> {
        if self.device() == Device::Cpu {
            return Ok(self.clone());
        }
        let elem = self.dtype.size();
        let (lo, hi) = self.layout.reach();
        let host = Storage::new((hi - lo) * elem)?;
        storage::copy_bytes(&host, 0, &self.storage, lo * elem, (hi - lo) * elem)?;
        let layout = Layout {
            shape: self.layout.shape.clone(),
            strides: self.layout.strides.clone(),
            offset: self.layout.offset - lo,
        };
        layout.check_bounds(elem, host.nbytes())?;
        Ok(Tensor {
            storage: host,
            dtype: self.dtype,
            layout,
        })
    }
}
