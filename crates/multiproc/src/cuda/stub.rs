//! The `cuda` module without the `cuda` feature: the same items, and no CUDA memory can
//! exist ([`CudaUse`] has no values), so every operation that would make or receive
//! some answers [`Error::CudaUnavailable`].

use std::sync::Arc;

use super::CudaHandle;
use crate::error::{Error, Result};
use crate::sys::shared_bytes::SharedBytes;
use crate::wire::{Decoder, Encoder};

fn unavailable() -> Error {
    Error::CudaUnavailable {
        reason: "this build of multiproc has no CUDA support: enable the `cuda` cargo feature"
            .into(),
    }
}

/// A use of CUDA memory; none exists in this build.
pub(crate) enum CudaUse {}

impl CudaUse {
    pub(crate) fn device(&self) -> u32 {
        match *self {}
    }

    pub(crate) fn device_ptr(&self) -> u64 {
        match *self {}
    }

    pub(crate) fn zero(&self, _offset: usize, _len: usize) -> Result<()> {
        match *self {}
    }

    pub(crate) fn copy_from(
        &self,
        _offset: usize,
        _src: &CudaUse,
        _src_offset: usize,
        _len: usize,
    ) -> Result<()> {
        match *self {}
    }

    pub(crate) fn copy_from_host(&self, _offset: usize, _src: SharedBytes<'_>) -> Result<()> {
        match *self {}
    }

    pub(crate) fn copy_to_host(&self, _dst: SharedBytes<'_>, _offset: usize) -> Result<()> {
        match *self {}
    }
}

pub(crate) fn allocate(_device: u32, _nbytes: usize) -> Result<(Arc<CudaUse>, usize)> {
    Err(unavailable())
}

pub(crate) fn empty_cache() {}

pub(crate) fn send(
    _enc: &Encoder<'_>,
    memory: &CudaUse,
    _offset: usize,
    _nbytes: usize,
) -> std::result::Result<CudaHandle, String> {
    match *memory {}
}

pub(crate) fn receive(
    dec: &Decoder<'_>,
    _h: &CudaHandle,
) -> std::result::Result<(Arc<CudaUse>, usize, usize), String> {
    Err(dec.fail(unavailable()))
}

pub(crate) fn initialised() -> bool {
    false
}

pub(crate) fn device_count() -> Result<usize> {
    Err(unavailable())
}

pub(crate) fn mem_get_info(_device: u32) -> Result<(usize, usize)> {
    Err(unavailable())
}

pub(crate) fn synchronize(_device: u32) -> Result<()> {
    Err(unavailable())
}
