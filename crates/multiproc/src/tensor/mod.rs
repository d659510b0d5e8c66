//! Tensors: [`DType`], [`Element`], [`Storage`] and [`Tensor`] — n-dimensional views over
//! bytes that can move to shared memory and travel between processes by handle.
//!
//! What this module owns: the element types, the layout arithmetic of views (shape,
//! strides and offset, all in elements), and the few operations a multi-process
//! program needs (constructors, views, in-place `fill_`/`copy_`/`add_`/`mul_`, `sum`,
//! `allclose`). It is not a numerics library: for real math, cross into `ndarray` or
//! `candle` (features of the same names, `interop_*` below: one copy, or a zero-copy
//! view where that is sound) or use [`Tensor::to_vec`] / [`Tensor::copy_from_slice`].
//!
//! Invariants:
//!
//! - A tensor's layout never addresses a byte outside its storage. This is checked
//!   when a tensor is made (constructors, views, [`Tensor::from_storage`], decoding a
//!   received message), and every kernel re-checks it once, up front.
//! - Tensor memory is never exposed as `&[T]`/`&mut [T]` by a safe function unless no
//!   one else can write it (the `ndarray` feature's `array_view` on the only handle of a
//!   private tensor — never on a read-only file, which any process that can open it may
//!   write; the `burn` feature's `into_burn`, which takes
//!   the only handle of a private tensor): other threads and processes may write it at
//!   any time.
//! - A read-only storage (a `safetensors` file's pages) is never written: every
//!   in-place operation calls `Storage::check_writable` before it touches a byte. Reads copy ([`Tensor::to_vec`]); element-wise operations
//!   use relaxed atomics, so concurrent Hogwild updates are defined behaviour (an update
//!   racing with another may be lost, never torn).
//! - `Clone` is a cheap handle copy sharing the storage (like `Arc`);
//!   [`Tensor::deep_clone`] copies the data (torch's `.clone()`).
//!
//! Scalars (`full`, `fill_`, `add_scalar_`, `mul_scalar_`, `alpha`) are `f64`. On an
//! integer or bool tensor a scalar must be representable exactly (integral and in range;
//! 0 or 1 for bool), otherwise the operation is an [`Error::Tensor`] — as torch refuses
//! `int_tensor.add_(1.5)`. `i64` values beyond 2^53 are not exact as scalars; integer
//! arithmetic itself is exact (wrapping), and bool `add_`/`mul_` are logical or/and.
//!
//! Files: `dtype` (element types), `layout` (shape/stride arithmetic), `storage` (the
//! bytes), `raw` (the element kernels, the only code that touches them, beside `bulk`,
//! the copy and reduction kernels of the collectives over memory other processes write),
//! `constructors`, `views`, `in_place`, `reductions` (the operations, by kind),
//! `copy_in` (host data in), `device` (CPU or CUDA), `interop_*` (the features: ndarray,
//! candle, DLPack, burn); this
//! file: [`Tensor`] itself, the two checked doors every tensor comes through, its
//! accessors, `Debug` and wire form.

#[allow(unsafe_code)]
pub(crate) mod bulk;
mod constructors;
pub(crate) mod copy_in;
mod device;
pub(crate) mod dtype;
mod in_place;
#[cfg(feature = "burn")]
#[allow(unsafe_code)]
mod interop_burn;
#[cfg(feature = "candle")]
mod interop_candle;
#[cfg(feature = "dlpack")]
#[allow(unsafe_code)]
mod interop_dlpack;
#[cfg(feature = "ndarray")]
#[allow(unsafe_code)]
mod interop_ndarray;
mod layout;
#[allow(unsafe_code)]
mod raw;
mod reductions;
// Host tensors pinned and copied to a device on a side stream (the data loader's
// `pin_memory` and `prefetch_to`).
#[cfg(feature = "cuda")]
pub(crate) mod side_stream;
#[allow(unsafe_code)]
mod storage;
#[cfg(test)]
mod tests;
mod views;

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

// The unit tests (`tests.rs`) use the kernels' dispatch through `super::*`.
#[cfg(test)]
use dtype::dispatch;
pub use dtype::{DType, Element};
use layout::{Dims, Layout, MAX_DIMS};
use raw::Region;
#[cfg(feature = "fuzzing")]
pub(crate) use storage::ForgedStorageWire;
pub use storage::Storage;
pub(crate) use storage::StorageRead;
pub(crate) use storage::WeakStorage;

use crate::error::{Error, Result};
use crate::wire::Decoder;

/// An n-dimensional array: a [`DType`], a shape, strides and an offset (in elements)
/// over a [`Storage`].
///
/// Cloning is cheap and shares the data; every method takes `&self` (in-place
/// operations write through the shared storage, as every torch tensor does). What holds
/// when other processes write the same memory — no `&[T]`, relaxed atomics, Hogwild —
/// and how scalars convert: [the crate docs](crate#the-rules-for-memory-other-processes-write).
///
/// Making one: [`zeros`](Self::zeros), [`ones`](Self::ones), [`full`](Self::full),
/// [`arange`](Self::arange), from your data [`from_slice`](Self::from_slice) and
/// [`from_vec`](Self::from_vec) (both copy once), over a storage
/// [`from_storage`](Self::from_storage). Straight into shared memory, to send to other
/// processes without a second copy: [`zeros_shared`](Self::zeros_shared),
/// [`empty_shared`](Self::empty_shared) and [`from_slice_shared`](Self::from_slice_shared)
/// (where `from_slice` then [`share_memory_`](Self::share_memory_) copies twice).
///
/// ```
/// # fn main() -> multiproc::Result<()> {
/// use multiproc::{DType, Tensor};
/// let t = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
/// let col = t.select(1, 1)?; // a view: [1, 4]
/// col.add_scalar_(10.0)?;
/// assert_eq!(t.to_vec::<f32>()?, [0., 11., 2., 3., 14., 5.]);
/// assert_eq!(t.transpose(0, 1)?.contiguous()?.to_vec::<f32>()?, [0., 3., 11., 14., 2., 5.]);
/// assert_eq!(t.sum()?, 35.0);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Tensor {
    storage: Storage,
    dtype: DType,
    layout: Layout,
}

fn not_representable(value: f64, dtype: DType) -> Error {
    Error::Tensor(format!(
        "the scalar {value} cannot be represented as {dtype} without loss"
    ))
}

fn scalar<T: Element>(value: f64) -> Result<T> {
    T::from_f64_exact(value).ok_or_else(|| not_representable(value, T::DTYPE))
}

/// Read-locks two storages in a fixed order (by address), so two threads locking the
/// same pair in opposite roles cannot deadlock behind a waiting writer.
fn read_two<'a>(a: &'a Storage, b: &'a Storage) -> (StorageRead<'a>, StorageRead<'a>) {
    if a.addr() <= b.addr() {
        let ra = a.read();
        (ra, b.read())
    } else {
        let rb = b.read();
        (a.read(), rb)
    }
}

/// The two doors every tensor comes through, each checking the invariant that its
/// layout addresses no byte outside its storage (the constructors, the views and the
/// wire form all build on them).
impl Tensor {
    /// [`from_storage`](Self::from_storage) with the layout taken over (checked).
    pub(super) fn from_storage_and_layout(
        storage: Storage,
        dtype: DType,
        layout: Layout,
    ) -> Result<Tensor> {
        layout.check_bounds(dtype.size(), storage.nbytes())?;
        Ok(Tensor {
            storage,
            dtype,
            layout,
        })
    }

    /// A new tensor on the same storage with another layout (checked).
    pub(super) fn with_layout(&self, layout: Layout) -> Result<Tensor> {
        layout.check_bounds(self.dtype.size(), self.storage.nbytes())?;
        Ok(Tensor {
            storage: self.storage.clone(),
            dtype: self.dtype,
            layout,
        })
    }
}

impl Tensor {
    /// The size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    /// The step, in elements, between neighbours along each dimension.
    pub fn strides(&self) -> &[usize] {
        &self.layout.strides
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of dimensions.
    pub fn dim(&self) -> usize {
        self.layout.shape.len()
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Where the first element is in the storage, in elements.
    pub fn storage_offset(&self) -> usize {
        self.layout.offset
    }

    /// Whether the elements are consecutive in row-major order.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// The storage under this tensor.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The address of the first element: for identity checks (tensors in two processes
    /// or two views alias when their pointers say so) and FFI. It changes when
    /// [`share_memory_`](Self::share_memory_) moves the storage. Dereferencing it is
    /// `unsafe` and races with other threads and processes. For a CUDA tensor it is the
    /// device address (as torch's `data_ptr`), for the user's own kernels.
    pub fn data_ptr(&self) -> *mut u8 {
        self.storage
            .data_ptr()
            .wrapping_add(self.layout.offset.wrapping_mul(self.dtype.size()))
    }

    /// The elements, copied out in row-major order.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when `T` is not this tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::Tensor(format!(
                "to_vec::<{}>() on a tensor of dtype {}; use to_dtype({:?}) first",
                T::DTYPE,
                self.dtype,
                T::DTYPE
            )));
        }
        let read = self.storage.read();
        Ok(raw::read_all(&Region::<T>::new(&read, &self.layout)?))
    }

    /// Moves the storage into shared memory (in place: every tensor and view on it
    /// follows), with the current sharing strategy. Does nothing if already shared.
    /// Sending a tensor through a multiproc channel does this implicitly.
    ///
    /// # Errors
    ///
    /// As [`Storage::share_memory_`]; the tensor stays usable (private) after an error.
    pub fn share_memory_(&self) -> Result<()> {
        self.storage.share_memory_()
    }

    /// Whether the storage is in shared memory (a read-only file's pages count: they
    /// travel by handle too).
    pub fn is_shared(&self) -> bool {
        self.storage.is_shared()
    }

    /// Whether the tensor can only be read (see [`Storage::is_read_only`]): loaded with
    /// `multiproc::safetensors::load`, or a read-only DLPack import. Every in-place
    /// operation on it is an [`Error::Tensor`] naming it.
    pub fn is_read_only(&self) -> bool {
        self.storage.is_read_only()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        let mut d = f.debug_struct("Tensor");
        d.field("dtype", &self.dtype)
            .field("shape", &self.layout.shape)
            .field("strides", &self.layout.strides)
            .field("offset", &self.layout.offset)
            .field("storage", &self.storage);
        // Values are shown for host tensors only (a CUDA tensor's would need a copy).
        let values = if self.device() == crate::cuda::Device::Cpu {
            self.narrowed_for_debug(SHOWN).and_then(|t| t.to_f64_vec())
        } else {
            Err(Error::Tensor("on a device".into()))
        };
        if let Ok(values) = values {
            if self.numel() > values.len() {
                d.field("first_values", &values);
            } else {
                d.field("values", &values);
            }
        }
        d.finish()
    }
}

impl Tensor {
    /// The first `n` elements (row-major) as a 1-D tensor, for `Debug`.
    fn narrowed_for_debug(&self, n: usize) -> Result<Tensor> {
        let flat = self.reshape(&[self.numel()])?;
        flat.narrow(0, 0, n.min(self.numel()))
    }
}

/// What a tensor looks like on the wire: its storage's handle and its layout.
#[derive(Serialize)]
struct TensorWireOut<'a> {
    dtype: u8,
    shape: &'a [usize],
    strides: &'a [usize],
    offset: usize,
    storage: &'a Storage,
}

/// Read with `usize` fields (postcard writes `usize` and `u64` alike), so the layout
/// is taken over as it arrives; a value past `usize` is a decode error.
#[derive(Deserialize)]
struct TensorWireIn {
    dtype: u8,
    #[serde(deserialize_with = "received_dims")]
    shape: Dims,
    #[serde(deserialize_with = "received_dims")]
    strides: Dims,
    offset: usize,
    storage: Storage,
}

/// A received shape or strides, as a sequence of `usize`. Room is made as elements
/// arrive, never from the length the sender claims (smallvec's own impl reserves
/// that much), so a forged length costs no memory; more than [`MAX_DIMS`] is refused
/// by the caller, with the counts.
fn received_dims<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Dims, D::Error> {
    struct Visit;
    impl<'de> serde::de::Visitor<'de> for Visit {
        type Value = Dims;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a sequence of dimensions")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> std::result::Result<Dims, A::Error> {
            let mut dims = Dims::new();
            while let Some(d) = seq.next_element()? {
                dims.push(d);
            }
            Ok(dims)
        }
    }
    d.deserialize_seq(Visit)
}

impl Serialize for Tensor {
    /// Inside a multiproc channel (`Queue::put`, `Connection::send`, worker arguments):
    /// moves the storage to shared memory if needed (as torch does), then writes its
    /// handle (fd or segment name) and the layout. The receiver's tensor aliases this
    /// one. Outside a channel (JSON…) it is an error: a tensor is a reference to memory.
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        TensorWireOut {
            dtype: self.dtype.code(),
            shape: &self.layout.shape,
            strides: &self.layout.strides,
            offset: self.layout.offset,
            storage: &self.storage,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tensor {
    /// Maps the storage (once per process: the same storage received twice aliases) and
    /// validates everything: an unknown dtype, a layout that overflows or reaches past
    /// the storage, is [`Error::InvalidMessage`].
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let w = TensorWireIn::deserialize(d)?;
        // Recorded for the caller of `decode`; outside one (a tensor on an empty
        // storage needs no fds) the error is only returned.
        let invalid = |why: String| {
            let err = Error::InvalidMessage(why);
            D::Error::custom(match Decoder::current("a tensor") {
                Ok(dec) => dec.fail(err),
                Err(_) => err.to_string(),
            })
        };
        let dtype = DType::from_code(w.dtype)
            .ok_or_else(|| invalid(format!("a tensor has unknown dtype code {}", w.dtype)))?;
        if w.shape.len() > MAX_DIMS || w.shape.len() != w.strides.len() {
            return Err(invalid(format!(
                "a tensor has {} dimensions and {} strides (at most {MAX_DIMS})",
                w.shape.len(),
                w.strides.len()
            )));
        }
        let layout = Layout {
            shape: w.shape,
            strides: w.strides,
            offset: w.offset,
        };
        Tensor::from_storage_and_layout(w.storage, dtype, layout).map_err(|e| {
            invalid(format!(
                "a received tensor's layout is invalid: {}",
                match e {
                    Error::Tensor(m) => m,
                    other => other.to_string(),
                }
            ))
        })
    }
}
