//! Tensors handed to torch and numpy without a copy (DLPack), and the table that
//! recognises their memory when they are put on a queue again.
//!
//! # Safety
//!
//! A capsule points at the bytes of a multiproc tensor that lives in shared memory,
//! whose bytes never move; the table of exports ([`EXPORTED`]) holds the tensor's
//! storage until the consumer calls the deleter (torch and numpy call it when the last
//! array on it is freed; the capsule's destructor calls it when no consumer took the
//! capsule), so the block stays mapped. The deleter frees exactly what the export
//! allocated, once.
//!
//! The one exception: [`give_back_at_exit`], for a process about to end, empties the
//! table, giving back the block uses its storages hold (a process that ends without
//! freeing its arrays would otherwise pin those blocks in their creators' pools). It
//! runs where no Python code can read the arrays any more; a deleter called after it
//! finds no entry and only frees its own allocation.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use multiproc::{DType, Storage, Tensor};
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::to_py;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack 0.x's managed tensor (the `"dltensor"` capsule).
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.x's managed tensor (the `"dltensor_versioned"` capsule).
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const DL_CPU: i32 = 1;
const DL_FLAG_READ_ONLY: u64 = 1;

/// What a capsule's context owns: the shape and strides the `DLTensor` points into,
/// and the key of its storage in [`EXPORTED`] (which keeps the block mapped).
struct Exported {
    storage_start: usize,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

/// dtype names as torch and numpy spell them.
pub fn dtype_name(d: DType) -> &'static str {
    d.name()
}

/// The dtype named `name` (torch's or numpy's spelling).
pub fn parse_dtype(name: &str) -> PyResult<DType> {
    name.parse::<DType>()
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

fn dl_dtype(d: DType) -> DLDataType {
    let code = match d {
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => 0,
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => 1,
        DType::F32 | DType::F64 | DType::F16 => 2,
        DType::BF16 => 4,
        DType::Bool => 6,
    };
    DLDataType {
        code,
        bits: (d.size() * 8) as u8,
        lanes: 1,
    }
}

/// A storage this process handed out through DLPack, by the address range of its bytes.
struct Block {
    end: usize,
    storage: Storage,
    exports: usize,
}

/// The storages whose bytes torch or numpy arrays may point into, by start address:
/// an array put on a queue whose memory lies in one of them travels by handle.
static EXPORTED: Mutex<BTreeMap<usize, Block>> = Mutex::new(BTreeMap::new());

fn exported() -> std::sync::MutexGuard<'static, BTreeMap<usize, Block>> {
    EXPORTED.lock().unwrap_or_else(|p| p.into_inner())
}

fn register(storage: &Storage) {
    let start = storage.data_ptr() as usize;
    let mut table = exported();
    let block = table.entry(start).or_insert_with(|| Block {
        end: start + storage.nbytes(),
        storage: storage.clone(),
        exports: 0,
    });
    block.exports += 1;
}

/// Set once the exports were given back at exit: deleters called later only free their
/// own allocation (an export at a reused address must not be counted down by them).
static GIVEN_BACK: AtomicBool = AtomicBool::new(false);

fn unregister(start: usize) {
    if GIVEN_BACK.load(Ordering::Acquire) {
        return;
    }
    let mut table = exported();
    let gone = match table.get_mut(&start) {
        Some(block) => {
            block.exports -= 1;
            (block.exports == 0).then(|| table.remove(&start))
        }
        None => None, // given back at exit already
    };
    drop(table);
    // The storage (maybe the last of it here) is dropped outside the lock.
    drop(gone);
}

/// Empties the table of exports, giving back the block uses of every storage still
/// exported: for a process about to end (see the module docs). Returns how many.
pub fn give_back_at_exit() -> usize {
    GIVEN_BACK.store(true, Ordering::Release);
    let all = std::mem::take(&mut *exported());
    all.len()
}

/// The C `atexit` handler: runs after the interpreter has finalized (no Python code
/// left to read an array), giving back what the arrays still alive then hold.
extern "C" fn give_back_at_c_exit() {
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(give_back_at_exit);
}

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
}

/// Registers [`give_back_at_c_exit`] (once, when the module is loaded).
pub fn give_back_at_c_exit_once() {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    // SAFETY: `atexit` takes a plain function pointer to a function that lives as long
    // as the process (this library is never unloaded: CPython keeps extension modules).
    REGISTER.call_once(|| unsafe {
        atexit(give_back_at_c_exit);
    });
}

/// The exported storage whose bytes hold `[start, start + len)`, and the byte offset of
/// `start` in it.
pub fn find_exported(start: usize, len: usize) -> Option<(Storage, usize)> {
    let table = exported();
    let (&base, block) = table.range(..=start).next_back()?;
    let end = start.checked_add(len)?;
    (end <= block.end).then(|| (block.storage.clone(), start - base))
}

/// A multiproc tensor on its way to torch or numpy: `torch.from_dlpack(t)` and
/// `numpy.from_dlpack(t)` take it without a copy.
#[pyclass(module = "multiproc._native", name = "NativeTensor", frozen)]
pub struct NativeTensor {
    pub tensor: Tensor,
}

impl NativeTensor {
    /// Wraps `tensor`, moving its bytes to shared memory if they are private (they would
    /// move later, leaving a capsule dangling).
    pub fn new(tensor: Tensor) -> PyResult<Self> {
        if !tensor.is_shared() {
            tensor.share_memory_().map_err(to_py)?;
        }
        Ok(Self { tensor })
    }

    fn context(&self) -> Box<Exported> {
        Box::new(Exported {
            storage_start: self.tensor.storage().data_ptr() as usize,
            shape: self.tensor.shape().iter().map(|&n| n as i64).collect(),
            strides: self.tensor.strides().iter().map(|&s| s as i64).collect(),
        })
    }
}

fn dl_tensor(tensor: &Tensor, ctx: &mut Exported) -> DLTensor {
    DLTensor {
        data: tensor.data_ptr().cast(),
        device: DLDevice {
            device_type: DL_CPU,
            device_id: 0,
        },
        ndim: ctx.shape.len() as i32,
        dtype: dl_dtype(tensor.dtype()),
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx.strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `__dlpack__`,
    // and DLPack calls the deleter once.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: as above, the context is the `Exported` box of this export.
    let ctx = unsafe { Box::from_raw(managed.manager_ctx.cast::<Exported>()) };
    unregister(ctx.storage_start);
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`.
    let managed = unsafe { Box::from_raw(managed) };
    // SAFETY: as in `delete_legacy`.
    let ctx = unsafe { Box::from_raw(managed.manager_ctx.cast::<Exported>()) };
    unregister(ctx.storage_start);
}

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// The capsule's destructor: a capsule no consumer renamed (took) still owns its tensor.
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with a live capsule; `PyCapsule_IsValid` only reads its
    // name, and `PyCapsule_GetPointer` returns the pointer stored under that name.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr());
            delete_legacy(p.cast());
        } else if pyo3::ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr());
            delete_versioned(p.cast());
        }
    }
}

impl NativeTensor {
    /// The DLPack capsule of this tensor: version 1 (`"dltensor_versioned"`) when
    /// `versioned`, else 0.x.
    pub fn capsule<'py>(&self, py: Python<'py>, versioned: bool) -> PyResult<Bound<'py, PyAny>> {
        let read_only = self.tensor.is_read_only();
        let mut ctx = self.context();
        let dl = dl_tensor(&self.tensor, &mut ctx);
        let storage = self.tensor.storage();
        let capsule = if versioned {
            let managed = Box::new(DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: Box::into_raw(ctx).cast(),
                deleter: Some(delete_versioned),
                flags: if read_only { DL_FLAG_READ_ONLY } else { 0 },
                dl_tensor: dl,
            });
            register(storage);
            let raw = Box::into_raw(managed);
            // SAFETY: `raw` is a live allocation owned from here on by the capsule (its
            // destructor or the consumer's call of the deleter frees it).
            let capsule = unsafe {
                pyo3::ffi::PyCapsule_New(raw.cast(), VERSIONED.as_ptr(), Some(capsule_destructor))
            };
            if capsule.is_null() {
                // SAFETY: no capsule took `raw`: it is still ours, freed once here.
                unsafe { delete_versioned(raw) };
            }
            capsule
        } else {
            if read_only {
                return Err(PyBufferError::new_err(
                    "a read-only tensor needs DLPack 1.0 (torch >= 2.4 or numpy >= 2.1), \
                     which can say it is read-only",
                ));
            }
            let managed = Box::new(DLManagedTensor {
                dl_tensor: dl,
                manager_ctx: Box::into_raw(ctx).cast(),
                deleter: Some(delete_legacy),
            });
            register(storage);
            let raw = Box::into_raw(managed);
            // SAFETY: as above.
            let capsule = unsafe {
                pyo3::ffi::PyCapsule_New(raw.cast(), LEGACY.as_ptr(), Some(capsule_destructor))
            };
            if capsule.is_null() {
                // SAFETY: as above.
                unsafe { delete_legacy(raw) };
            }
            capsule
        };
        // SAFETY: `PyCapsule_New` returns a new reference or null with an exception set.
        unsafe { Bound::from_owned_ptr_or_err(py, capsule) }
    }
}

#[pymethods]
impl NativeTensor {
    /// The DLPack capsule (version 1 when the consumer asks for it, else 0.x).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        if let Some((kind, _)) = dl_device {
            if kind != DL_CPU {
                return Err(PyBufferError::new_err(
                    "a multiproc tensor is on the CPU; it cannot be exported to another device",
                ));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "multiproc exports without a copy; copy the array after taking it",
            ));
        }
        self.capsule(py, max_version.is_some_and(|(major, _)| major >= 1))
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DL_CPU, 0)
    }

    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.tensor.shape())
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.tensor.dtype())
    }

    fn __repr__(&self) -> String {
        format!(
            "NativeTensor(shape={:?}, dtype={})",
            self.tensor.shape(),
            dtype_name(self.tensor.dtype())
        )
    }
}
