//! Interop with [burn](https://burn.dev) (feature `burn`, through `burn-tensor` and its
//! NdArray backend): a tensor's elements as burn's [`TensorData`], borrowed without a
//! copy where that is sound, and burn's `TensorData` back as a tensor in one copy.
//!
//! # What borrows and what copies
//!
//! burn's [`Bytes`] can be built over memory someone else owns
//! (`Bytes::from_shared`, with a `bytes::Bytes` whose owner is kept alive). The owner
//! here holds a handle on the tensor's storage, so the mapping (or the heap buffer)
//! stays in place for as long as burn holds the bytes, in any `TensorData`, burn tensor
//! or clone of them, whatever happens to the tensor it came from. burn never writes
//! through such bytes: a write (an in-place operation, `as_mut_slice`) copies them
//! first (copy-on-write). Backends then differ:
//!
//! - **NdArray** (burn-ndarray 0.22) takes non-heap bytes without a copy and holds them
//!   borrowed (`NdArrayStorage::Borrowed`), but nearly every operation first turns a
//!   borrowed input into an array of its own (`into_shared`): one copy of that input per
//!   operation, freed when it is done. Holding the bytes is free; computing on them
//!   costs that copy each time (the model's weights, for each batch).
//! - **Flex** (burn's newer CPU backend, not built by this feature) keeps the `Bytes`
//!   it is given and reads them in place (`bytemuck::cast_slice` over them).
//! - **wgpu, CUDA, ROCm, Metal** (cubecl) upload the bytes to the device: one copy, the
//!   one any host data pays, with nothing to borrow on the other side.
//! - burn converts the data first when the tensor is made with another dtype than the
//!   data's (`Tensor::<2>::from_data(data, &device)` makes the device's default float,
//!   `f32`): pass `(&device, data.dtype())` to keep it borrowed.
//!
//! # Safety
//!
//! A borrow is a Rust reference (`&[u8]`, then `&[T]` in the backend), so the rules of
//! `interop_ndarray` hold: the bytes must not move, and nobody may write them while the
//! borrow lives. [`Tensor::into_burn`] borrows only the only handle on a private
//! storage, which it takes (nothing else can reach, write or share those bytes any
//! more), and copies otherwise; [`Tensor::as_burn`] borrows a shared or read-only
//! tensor and is `unsafe`, with that contract stated. A `bool` tensor is borrowed only
//! when every byte is 0 or 1 (another process may have stored any byte there, and burn's
//! backends read the bytes as `bool`).

use std::ptr::NonNull;

use burn_tensor::{AllocationProperty, BoolStore, Bytes, DType as BurnDType, TensorData};

use super::raw::{self, Region};
use super::{DType, Element, Storage, Tensor};
use crate::cuda::Device;
use crate::error::{Error, Result};

/// burn's dtype for each of multiproc's (all thirteen have one).
fn burn_dtype(dtype: DType) -> BurnDType {
    match dtype {
        DType::F32 => BurnDType::F32,
        DType::F64 => BurnDType::F64,
        DType::F16 => BurnDType::F16,
        DType::BF16 => BurnDType::BF16,
        DType::I8 => BurnDType::I8,
        DType::I16 => BurnDType::I16,
        DType::I32 => BurnDType::I32,
        DType::I64 => BurnDType::I64,
        DType::U8 => BurnDType::U8,
        DType::U16 => BurnDType::U16,
        DType::U32 => BurnDType::U32,
        DType::U64 => BurnDType::U64,
        DType::Bool => BurnDType::Bool(BoolStore::Native),
    }
}

/// How a burn dtype comes into multiproc: the same bytes, or converted element by
/// element; `None` when multiproc has no such dtype.
enum Incoming {
    Bytes(DType),
    /// burn's `bool(u8)` / `bool(u32)`: any non-zero element is `true`.
    BoolFrom(usize),
}

fn incoming(dtype: BurnDType) -> Option<Incoming> {
    Some(Incoming::Bytes(match dtype {
        BurnDType::F32 => DType::F32,
        // flex32 is stored as f32 (only GPU kernels compute it at lower precision).
        BurnDType::Flex32 => DType::F32,
        BurnDType::F64 => DType::F64,
        BurnDType::F16 => DType::F16,
        BurnDType::BF16 => DType::BF16,
        BurnDType::I8 => DType::I8,
        BurnDType::I16 => DType::I16,
        BurnDType::I32 => DType::I32,
        BurnDType::I64 => DType::I64,
        BurnDType::U8 => DType::U8,
        BurnDType::U16 => DType::U16,
        BurnDType::U32 => DType::U32,
        BurnDType::U64 => DType::U64,
        BurnDType::Bool(BoolStore::Native) => DType::Bool,
        BurnDType::Bool(BoolStore::U8) => return Some(Incoming::BoolFrom(1)),
        BurnDType::Bool(BoolStore::U32) => return Some(Incoming::BoolFrom(4)),
        BurnDType::QFloat(_) => return None,
    }))
}

/// The owner a borrowed `Bytes` keeps: a handle on the tensor (so its storage, and the
/// mapping or buffer under it, lives as long as burn holds the bytes) and the elements'
/// byte range in it.
struct HeldElements {
    _tensor: Tensor,
    first: NonNull<u8>,
    len: usize,
}

// SAFETY: `first` points into the storage that `_tensor` keeps alive, which is `Send`
// (tensors travel between threads); the pointer is only read through, by whichever
// thread holds the bytes.
unsafe impl Send for HeldElements {}

impl AsRef<[u8]> for HeldElements {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `first..first + len` lies inside the storage `_tensor` keeps alive
        // (checked by `borrowable`), whose bytes do not move while it lives: a shared or
        // read-only storage never moves, and a private one is held only here (see
        // `into_burn`). That nobody writes them while burn holds this borrow is
        // `into_burn`'s guarantee or `as_burn`'s contract.
        unsafe { std::slice::from_raw_parts(self.first.as_ptr(), self.len) }
    }
}

impl Tensor {
    /// The elements as burn [`TensorData`] of this tensor's shape and dtype, in one copy
    /// (any tensor, any strides): what to hand to any burn backend when the tensor is
    /// shared and others may write it.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    /// let data = t.transpose(0, 1)?.to_burn()?;
    /// assert_eq!(data.as_slice::<f32>().unwrap(), [1.0, 3.0, 2.0, 4.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] for a CUDA tensor (copy it to the host with
    /// `to(Device::Cpu)` first).
    pub fn to_burn(&self) -> Result<TensorData> {
        fn copy<T: Element + burn_tensor::Element>(t: &Tensor) -> Result<TensorData> {
            Ok(TensorData::new(t.to_vec::<T>()?, t.shape().to_vec()))
        }
        self.check_host("to_burn")?;
        match self.dtype {
            DType::F32 => copy::<f32>(self),
            DType::F64 => copy::<f64>(self),
            DType::F16 => copy::<half::f16>(self),
            DType::BF16 => copy::<half::bf16>(self),
            DType::I8 => copy::<i8>(self),
            DType::I16 => copy::<i16>(self),
            DType::I32 => copy::<i32>(self),
            DType::I64 => copy::<i64>(self),
            DType::U8 => copy::<u8>(self),
            DType::U16 => copy::<u16>(self),
            DType::U32 => copy::<u32>(self),
            DType::U64 => copy::<u64>(self),
            DType::Bool => copy::<bool>(self),
        }
    }

    /// The elements as burn [`TensorData`] without a copy when that is sound without a
    /// contract: this is the only handle on a private, contiguous tensor (it is taken,
    /// so nothing else can reach, write or share those bytes while burn borrows them).
    /// A burn tensor made from it holds the very bytes this tensor had (see the module
    /// docs for what each backend does with them); the buffer is freed when burn drops
    /// the last `TensorData` or tensor that holds it.
    ///
    /// Otherwise — a shared or read-only tensor (another process, or anyone who can
    /// open the file, may write it), other handles (clones, views), a non-contiguous
    /// view, a `bool` tensor with a byte other than 0 or 1 — it copies once, as
    /// [`to_burn`](Self::to_burn). For a zero-copy borrow of shared memory, see the
    /// `unsafe` [`as_burn`](Self::as_burn).
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let t = Tensor::from_slice(&[1i64, 2, 3], &[3])?;
    /// let at = t.data_ptr();
    /// let data = t.into_burn()?; // the only handle: borrowed
    /// assert_eq!(data.as_bytes().as_ptr(), at.cast_const());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] for a CUDA tensor (copy it to the host with
    /// `to(Device::Cpu)` first).
    pub fn into_burn(mut self) -> Result<TensorData> {
        self.check_host("into_burn")?;
        match self.storage.unique_private_ptr() {
            Some(base) if self.is_contiguous() => match self.borrowable(base)? {
                Some((first, len)) => self.borrow_as_burn(first, len),
                None => self.to_burn(),
            },
            _ => self.to_burn(),
        }
    }

    /// The elements of a shared (or read-only) tensor as burn [`TensorData`] without a
    /// copy: burn's bytes are this tensor's memory, and they keep its storage (and so
    /// its mapping) alive for as long as burn holds them, whatever happens to this
    /// tensor. burn's NdArray backend takes them as they are (its operations then copy a
    /// borrowed input, Flex reads it in place); burn itself never writes them (a
    /// mutation copies first).
    ///
    /// A private tensor is refused, since its bytes move when it is shared: share it
    /// first ([`share_memory_`](Self::share_memory_)), or hand the only handle to the
    /// safe [`into_burn`](Self::into_burn).
    ///
    /// # Safety
    ///
    /// From this call until burn drops the last `TensorData`, burn tensor or clone of
    /// them that holds these bytes (which can be long after this tensor is dropped), no
    /// other thread or process may write the elements they cover — not through this
    /// tensor, a view or a clone of it (even the relaxed atomics of the in-place
    /// operations), nor from a worker that holds the same storage, nor by writing the
    /// file a read-only tensor maps. burn's backends read them through Rust references,
    /// and a concurrent write to borrowed memory is undefined behaviour. Typical sound
    /// uses: weights that every process only reads, or parameters read after a
    /// [`Barrier`](crate::Barrier) that orders every writer before the borrow and none
    /// until burn has let go of it. When that cannot be promised, copy with
    /// [`to_burn`](Self::to_burn).
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the tensor is private or on a CUDA device, is not
    /// contiguous (make it so with [`contiguous`](Self::contiguous), a copy, or use
    /// `to_burn`), or is a `bool` tensor holding a byte other than 0 or 1 (`to_burn`
    /// reads such a byte as `true`).
    pub unsafe fn as_burn(&self) -> Result<TensorData> {
        let op = "as_burn";
        self.check_host(op)?;
        let base = self.storage.stable_ptr().ok_or_else(|| {
            Error::Tensor(format!(
                "{op}: the tensor is private to this process, and its bytes move when it is \
                 shared, which would leave burn's borrow dangling; call share_memory_() \
                 first, or give the only handle to the safe into_burn()"
            ))
        })?;
        if !self.is_contiguous() {
            return Err(Error::Tensor(format!(
                "{op}: burn's TensorData is contiguous (row-major), and this view of shape \
                 {:?} has strides {:?}; borrow contiguous() of it (a copy), or copy with \
                 to_burn()",
                self.shape(),
                self.strides()
            )));
        }
        match self.borrowable(base)? {
            Some((first, len)) => self.clone().borrow_as_burn(first, len),
            None => Err(Error::Tensor(format!(
                "{op}: the bool tensor of shape {:?} holds bytes other than 0 and 1, which \
                 burn would read as bool; copy with to_burn(), which reads them as true",
                self.shape()
            ))),
        }
    }

    /// A private multiproc tensor holding a copy of burn's `data` (one `memcpy` for
    /// every dtype but burn's `bool(u8)` and `bool(u32)`, which are converted to `bool`
    /// in one pass). burn's `flex32` (stored as `f32`) becomes `float32`. Get the data
    /// of a burn tensor with `into_data()` / `to_data()`.
    ///
    /// ```
    /// # fn main() -> multiproc::Result<()> {
    /// use multiproc::Tensor;
    /// let data = burn_tensor::TensorData::new(vec![1u16, 2, 3, 4, 5, 6], [2, 3]);
    /// let t = Tensor::from_burn(&data)?;
    /// assert_eq!(t.shape(), [2, 3]);
    /// assert_eq!(t.to_vec::<u16>()?, [1, 2, 3, 4, 5, 6]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] naming the dtype when multiproc has none for it (burn's
    /// quantized `qfloat`: dequantize first), or when the bytes do not fill the shape.
    pub fn from_burn(data: &TensorData) -> Result<Tensor> {
        Tensor::from_burn_with(data, false, "from_burn")
    }

    /// [`from_burn`](Self::from_burn) straight into shared memory (with the current
    /// sharing strategy): one copy, ready to send, with no private buffer in between.
    ///
    /// # Errors
    ///
    /// As [`from_burn`](Self::from_burn) and [`zeros_shared`](Self::zeros_shared).
    pub fn from_burn_shared(data: &TensorData) -> Result<Tensor> {
        Tensor::from_burn_with(data, true, "from_burn_shared")
    }

    fn from_burn_with(data: &TensorData, shared: bool, op: &str) -> Result<Tensor> {
        let shape: &[usize] = data.shape();
        let bytes = data.as_bytes();
        match incoming(data.dtype()) {
            Some(Incoming::Bytes(dtype)) => Tensor::contiguous_on(shape, dtype, |nbytes| {
                if nbytes != bytes.len() {
                    return Err(Error::Tensor(format!(
                        "{op}: {} bytes of {} cannot fill shape {shape:?} ({nbytes} bytes)",
                        bytes.len(),
                        data.dtype().name()
                    )));
                }
                Storage::copy_of(bytes, shared)
            }),
            Some(Incoming::BoolFrom(width)) => {
                let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
                if numel.and_then(|n| n.checked_mul(width)) != Some(bytes.len()) {
                    return Err(Error::Tensor(format!(
                        "{op}: {} bytes of {} cannot fill shape {shape:?}",
                        bytes.len(),
                        data.dtype().name()
                    )));
                }
                let values = bytes
                    .chunks_exact(width)
                    .map(|element| element.iter().any(|&b| b != 0));
                Tensor::contiguous_from_iter(values, shape, shared)
            }
            None => Err(Error::Tensor(format!(
                "{op}: multiproc has no dtype {} (burn's {:?}); dequantize it in burn first, \
                 e.g. with Tensor::dequantize()",
                data.dtype().name(),
                data.dtype()
            ))),
        }
    }

    /// `Err` naming `op` when the elements are not in host memory.
    fn check_host(&self, op: &str) -> Result<()> {
        match self.device() {
            Device::Cpu => Ok(()),
            device => Err(Error::Tensor(format!(
                "{op}: the tensor is on {device}; burn's TensorData is host memory, so copy it \
                 to the host with to(Device::Cpu) first"
            ))),
        }
    }

    /// The first byte and byte length of this contiguous tensor's elements in a storage
    /// whose first byte is `base`; `None` for a `bool` tensor holding a byte other than
    /// 0 or 1 (not a `bool` to burn). Bounds are checked, not assumed.
    fn borrowable(&self, base: *mut u8) -> Result<Option<(NonNull<u8>, usize)>> {
        let size = self.dtype.size();
        let len = self.numel().checked_mul(size);
        let start = self.storage_offset().checked_mul(size);
        let (Some(len), Some(start)) = (len, start) else {
            return Err(Error::Tensor("a tensor's layout overflows".into()));
        };
        if len == 0 {
            return Ok(Some((NonNull::dangling(), 0)));
        }
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.storage.nbytes())
        {
            return Err(Error::Tensor(format!(
                "bytes {start}..{} of a storage of {}",
                start.saturating_add(len),
                self.storage.nbytes()
            )));
        }
        let first = NonNull::new(base.wrapping_add(start))
            .ok_or_else(|| Error::Tensor("a tensor at address 0".into()))?;
        if self.dtype == DType::Bool {
            // Read with the kernels (relaxed atomics), not through a reference: until the
            // borrow is made, nothing promises that nobody writes.
            let read = self.storage.read();
            let bytes = raw::read_all(&Region::<u8>::new(&read, &self.layout)?);
            drop(read);
            if bytes.iter().any(|&b| b > 1) {
                return Ok(None);
            }
        }
        Ok(Some((first, len)))
    }

    /// burn data over `len` bytes at `first`, which lie in this tensor's storage (the
    /// returned bytes keep `self`).
    fn borrow_as_burn(self, first: NonNull<u8>, len: usize) -> Result<TensorData> {
        let shape = self.shape().to_vec();
        let dtype = burn_dtype(self.dtype);
        if len == 0 {
            return TensorData::try_from_bytes_vec(Vec::new(), shape, dtype)
                .map_err(|e| Error::Tensor(format!("an empty burn TensorData: {e}")));
        }
        let owner = HeldElements {
            _tensor: self,
            first,
            len,
        };
        // `Other`, not `Native`: burn's NdArray backend borrows bytes that are not on
        // Rust's heap, and takes `Native` ones over as a `Vec` (which would copy these).
        let bytes = Bytes::from_shared(bytes::Bytes::from_owner(owner), AllocationProperty::Other);
        TensorData::try_from_bytes(bytes, shape, dtype)
            .map_err(|e| Error::Tensor(format!("a burn TensorData over a tensor: {e}")))
    }
}
