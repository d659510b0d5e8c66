//! Python values to and from `multiproc::Dynamic`, the type a queue carries.
//!
//! Plain values (None, bool, int, float, str, bytes, list, tuple, dict) convert here;
//! anything else goes to the Python layer's `encode_other` hook, which answers with a
//! tensor's memory (a CPU `torch.Tensor` or numpy array), a `NativeTensor`, or the
//! object's pickle. Received tensors go to its `decode_tensor` hook, which makes a
//! `torch.Tensor` (or a numpy array) over the shared block without a copy.

use std::collections::HashMap;
use std::sync::Mutex;

use multiproc::{DType, Dynamic, Storage, Tensor};
use pyo3::exceptions::{PyRecursionError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType,
    PyWeakrefMethods, PyWeakrefReference,
};

use crate::dlpack::{NativeTensor, dtype_name, find_exported, parse_dtype};
use crate::errors::to_py;

/// The Python layer's hooks (see the module docs).
struct Hooks {
    encode_other: PyObject,
    decode_tensor: PyObject,
    view_tensor: PyObject,
    loads: PyObject,
}

static HOOKS: GILOnceCell<Hooks> = GILOnceCell::new();

/// Installs the Python layer's hooks (once, when `multiproc` is imported).
#[pyfunction]
pub fn _set_hooks(
    py: Python<'_>,
    encode_other: PyObject,
    decode_tensor: PyObject,
    view_tensor: PyObject,
) -> PyResult<()> {
    let loads = py.import("pickle")?.getattr("loads")?.unbind();
    let _ = HOOKS.set(
        py,
        Hooks {
            encode_other,
            decode_tensor,
            view_tensor,
            loads,
        },
    );
    Ok(())
}

fn hooks(py: Python<'_>) -> PyResult<&Hooks> {
    HOOKS.get(py).ok_or_else(|| {
        PyValueError::new_err(
            "multiproc._native is used without the multiproc package: import multiproc",
        )
    })
}

/// How deep messages may nest (a self-containing list stops here, not in a crash): as
/// deep as a receiver accepts (`Dynamic::MAX_NESTING` containers inside one another).
const MAX_DEPTH: usize = Dynamic::MAX_NESTING as usize;

/// One message's conversion: storages copied into shared memory so far, by address, so
/// that two views of one storage arrive sharing memory.
#[derive(Default)]
pub struct ToDynamic {
    copied: HashMap<usize, Storage>,
    /// Every tensor becomes a multiproc block, copied if need be, even one that a
    /// message would send as torch does (see `torch_tensor`): what `as_native` (an
    /// explicit `share_memory_`, a process argument) asks for.
    into_blocks: bool,
}

impl ToDynamic {
    /// A conversion that makes every tensor a multiproc block (see `into_blocks`).
    pub fn into_blocks() -> Self {
        Self {
            into_blocks: true,
            ..Self::default()
        }
    }

    /// Converts `obj` (and everything in it).
    pub fn convert(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Dynamic> {
        self.value(obj, 0)
    }

    fn value(&mut self, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Dynamic> {
        if depth > MAX_DEPTH {
            return Err(PyRecursionError::new_err(format!(
                "a message nests deeper than {MAX_DEPTH} levels (or contains itself)"
            )));
        }
        let py = obj.py();
        if obj.is_none() {
            return Ok(Dynamic::None);
        }
        if let Ok(b) = obj.downcast_exact::<PyBool>() {
            return Ok(Dynamic::Bool(b.is_true()));
        }
        if obj.is_exact_instance_of::<PyInt>() {
            return Ok(match obj.extract::<i64>() {
                Ok(i) => Dynamic::Int(i),
                Err(_) => self.other(obj)?,
            });
        }
        if let Ok(f) = obj.downcast_exact::<PyFloat>() {
            return Ok(Dynamic::Float(f.value()));
        }
        if let Ok(s) = obj.downcast_exact::<PyString>() {
            return match s.to_cow() {
                Ok(s) => Ok(Dynamic::Str(s.into_owned())),
                // Not valid UTF-8 (lone surrogates, as `os.fsdecode` makes of a file
                // name that is not UTF-8): pickled, which carries it exactly.
                Err(_) => self.other(obj),
            };
        }
        if let Ok(b) = obj.downcast_exact::<PyBytes>() {
            return Ok(Dynamic::Bytes(b.as_bytes().to_vec()));
        }
        if let Ok(b) = obj.downcast_exact::<PyByteArray>() {
            return Ok(Dynamic::Bytes(b.to_vec()));
        }
        if let Ok(l) = obj.downcast_exact::<PyList>() {
            let mut items = Vec::with_capacity(l.len());
            for item in l.iter() {
                items.push(self.value(&item, depth + 1)?);
            }
            return Ok(Dynamic::List(items));
        }
        if let Ok(t) = obj.downcast_exact::<PyTuple>() {
            let mut items = Vec::with_capacity(t.len());
            for item in t.iter() {
                items.push(self.value(&item, depth + 1)?);
            }
            return Ok(Dynamic::Tuple(items));
        }
        if let Ok(d) = obj.downcast_exact::<PyDict>() {
            let mut items = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                items.push((self.value(&k, depth + 1)?, self.value(&v, depth + 1)?));
            }
            return Ok(Dynamic::Dict(items));
        }
        if let Ok(t) = obj.downcast::<NativeTensor>() {
            return Ok(Dynamic::Tensor(t.get().tensor.clone()));
        }
        if let Some(torch) = torch_if_imported(py) {
            if obj.get_type().is(torch.tensor_type.bind(py)) {
                if let Some(t) = self.torch_tensor(obj, torch)? {
                    return Ok(Dynamic::Tensor(t));
                }
            }
        }
        self.other(obj)
    }

    /// A CPU strided `torch.Tensor` of a dtype multiproc knows, read here rather than
    /// by the Python hook (a Python call and a tuple per tensor, and the dtype's name
    /// parsed): the same reads as the hook's `_torch_memory`. `None` for any other
    /// tensor, which the hook then explains (a CUDA tensor, a sparse one...).
    fn torch_tensor(&mut self, obj: &Bound<'_, PyAny>, torch: &Torch) -> PyResult<Option<Tensor>> {
        let py = obj.py();
        if !obj.getattr(intern!(py, "is_cpu"))?.is_truthy()?
            || !obj
                .getattr(intern!(py, "layout"))?
                .is(torch.strided.bind(py))
        {
            return Ok(None);
        }
        let dtype = obj.getattr(intern!(py, "dtype"))?;
        let Some(dtype) = torch.dtype_of(&dtype) else {
            return Ok(None);
        };
        let storage = obj.call_method0(intern!(py, "untyped_storage"))?;
        let addr: usize = storage.call_method0(intern!(py, "data_ptr"))?.extract()?;
        let nbytes: usize = storage.call_method0(intern!(py, "nbytes"))?.extract()?;
        let shape = usizes(&obj.getattr(intern!(py, "shape"))?)?;
        let strides = usizes(&obj.call_method0(intern!(py, "stride"))?)?;
        let offset: usize = obj.call_method0(intern!(py, "storage_offset"))?.extract()?;
        // Not in a multiproc block, and in torch's shared memory (`share_memory_()`) or
        // requiring grad: the Python layer sends it as torch does (shared, not copied;
        // `requires_grad` kept).
        if !self.into_blocks
            && self.find(addr, nbytes, dtype.size()).is_none()
            && (storage
                .call_method0(intern!(py, "is_shared"))?
                .is_truthy()?
                || obj.getattr(intern!(py, "requires_grad"))?.is_truthy()?)
        {
            return Ok(None);
        }
        // `storage` keeps the bytes alive while they are found or copied.
        self.tensor_from_memory(addr, nbytes, dtype, &shape, &strides, offset)
            .map(Some)
    }

    /// Asks the Python layer: a tensor's memory, a `NativeTensor`, or a pickle.
    fn other(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Dynamic> {
        let py = obj.py();
        let answer = hooks(py)?.encode_other.bind(py).call1((obj,))?;
        if let Ok(b) = answer.downcast::<PyBytes>() {
            return Ok(Dynamic::Pickled(b.as_bytes().to_vec()));
        }
        if let Ok(t) = answer.downcast::<NativeTensor>() {
            return Ok(Dynamic::Tensor(t.get().tensor.clone()));
        }
        // The answer's last item owns the memory (the object, or a contiguous copy of
        // it); `answer` keeps it alive until the bytes are copied or found.
        let (addr, nbytes, dtype, shape, strides, offset, _owner): (
            usize,
            usize,
            String,
            Vec<usize>,
            Vec<usize>,
            usize,
            Bound<'_, PyAny>,
        ) = answer.extract().map_err(|_| {
            PyTypeError::new_err(
                "multiproc's encode hook answered neither bytes nor a tensor's memory",
            )
        })?;
        let dtype = parse_dtype(&dtype)?;
        let tensor = self.tensor_from_memory(addr, nbytes, dtype, &shape, &strides, offset)?;
        Ok(Dynamic::Tensor(tensor))
    }

    /// A tensor over `nbytes` at `addr` (a torch storage or a numpy array's extent): by
    /// handle when those bytes lie in a block this process exported, else copied once
    /// into a new shared block (once per message for one storage).
    /// The storage that holds `nbytes` at `addr` when it is already in a block: one
    /// this message copied, or a multiproc block (with the byte offset in it).
    fn find(&self, addr: usize, nbytes: usize, size: usize) -> Option<(Storage, usize)> {
        self.copied
            .get(&addr)
            .map(|s| (s.clone(), 0))
            .or_else(|| find_exported(addr, nbytes).filter(|(_, off)| off % size == 0))
    }

    fn tensor_from_memory(
        &mut self,
        addr: usize,
        nbytes: usize,
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> PyResult<Tensor> {
        let size = dtype.size();
        let (storage, byte_offset) = match self.find(addr, nbytes, size) {
            Some(f) => f,
            None => {
                let copy = if nbytes == 0 {
                    Tensor::from_slice_shared::<u8>(&[], &[0])
                } else {
                    // SAFETY: `addr` and `nbytes` are the address and size of the memory
                    // of a CPU tensor or array that the caller holds alive for the
                    // duration of this call (the Python layer reads them from the object
                    // being sent); the bytes are only read, and copied.
                    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, nbytes) };
                    Tensor::from_slice_shared::<u8>(bytes, &[nbytes])
                }
                .map_err(to_py)?;
                let storage = copy.storage().clone();
                self.copied.insert(addr, storage.clone());
                (storage, 0)
            }
        };
        Tensor::from_storage(storage, dtype, shape, strides, offset + byte_offset / size)
            .map_err(to_py)
    }
}

/// One received message's conversion to Python objects. A tensor arrives as a view
/// (shape, strides, storage offset) of a torch tensor (or numpy array) over its whole
/// storage, made once per storage and dtype: views of one storage share one torch
/// storage, and keep their offsets (DLPack alone would make each view a storage of
/// its own, starting at its first element).
#[derive(Default)]
pub struct FromDynamic {
    bases: HashMap<(usize, DType), PyObject>,
}

impl FromDynamic {
    /// Converts `value`.
    pub fn convert(&mut self, py: Python<'_>, value: Dynamic) -> PyResult<PyObject> {
        Ok(match value {
            Dynamic::None => py.None(),
            Dynamic::Bool(b) => PyBool::new(py, b).to_owned().into_any().unbind(),
            Dynamic::Int(i) => i.into_pyobject(py)?.into_any().unbind(),
            Dynamic::Float(f) => PyFloat::new(py, f).into_any().unbind(),
            Dynamic::Str(s) => PyString::new(py, &s).into_any().unbind(),
            Dynamic::Bytes(b) => PyBytes::new(py, &b).into_any().unbind(),
            Dynamic::List(items) => {
                let list = PyList::empty(py);
                for item in items {
                    list.append(self.convert(py, item)?)?;
                }
                list.into_any().unbind()
            }
            Dynamic::Tuple(items) => {
                let items = items
                    .into_iter()
                    .map(|i| self.convert(py, i))
                    .collect::<PyResult<Vec<_>>>()?;
                PyTuple::new(py, items)?.into_any().unbind()
            }
            Dynamic::Dict(items) => {
                let dict = PyDict::new(py);
                for (k, v) in items {
                    dict.set_item(self.convert(py, k)?, self.convert(py, v)?)?;
                }
                dict.into_any().unbind()
            }
            Dynamic::Tensor(t) => self.tensor(py, t)?,
            Dynamic::Pickled(b) => hooks(py)?
                .loads
                .bind(py)
                .call1((PyBytes::new(py, &b),))?
                .unbind(),
        })
    }

    fn tensor(&mut self, py: Python<'_>, t: Tensor) -> PyResult<PyObject> {
        let hooks = hooks(py)?;
        let t = NativeTensor::new(t)?.tensor;
        let block = (t.storage().data_ptr() as usize, t.storage().nbytes());
        let torch = torch_imported(py);
        // A storage torch still holds: a view of it, no DLPack export.
        if let Some(torch) = torch {
            if let Some(storage) = torch_storage(py, block) {
                return torch.view_of_storage(&storage, &t);
            }
        }
        let key = (block.0, t.dtype());
        // A tensor over its whole storage (the common case: one tensor, its own block)
        // is exported as it is: torch's storage from DLPack is then the whole block,
        // and no view has to be made of it.
        let whole = t.storage_offset() == 0
            && t.is_contiguous()
            && t.numel() * t.dtype().size() == t.storage().nbytes();
        if let (true, Some(torch), false) = (whole, torch, self.bases.contains_key(&key)) {
            let (tensor, storage) = torch.tensor_over(py, &NativeTensor { tensor: t })?;
            remember_torch_storage(block, &storage)?;
            self.bases.insert(key, tensor.clone().unbind());
            return Ok(tensor.unbind());
        }
        let base = match self.bases.get(&key) {
            Some(base) => base.clone_ref(py),
            None => {
                let elements = t.storage().nbytes() / t.dtype().size();
                let whole =
                    Tensor::from_storage(t.storage().clone(), t.dtype(), &[elements], &[1], 0)
                        .map_err(to_py)?;
                let native = NativeTensor::new(whole)?;
                let (base, storage) = match torch {
                    Some(torch) => torch.tensor_over(py, &native)?,
                    None => hooks
                        .decode_tensor
                        .bind(py)
                        .call1((Bound::new(py, native)?,))?
                        .extract()?,
                };
                if !storage.is_none() {
                    remember_torch_storage(block, &storage)?;
                }
                self.bases.insert(key, base.clone().unbind());
                base.unbind()
            }
        };
        Ok(hooks
            .view_tensor
            .bind(py)
            .call1((
                base,
                PyTuple::new(py, t.shape())?,
                PyTuple::new(py, t.strides())?,
                t.storage_offset(),
            ))?
            .unbind())
    }
}

/// Every dtype multiproc knows.
const DTYPES: [DType; 13] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U8,
    DType::Bool,
    DType::U16,
    DType::U32,
    DType::U64,
];

/// One torch dtype: its object, multiproc's dtype, and an empty tensor of it.
struct TorchDType {
    object: PyObject,
    dtype: DType,
    /// `empty.new()` is the cheapest new tensor of this dtype torch makes (a factory
    /// such as `torch.empty(0, dtype=...)` parses its arguments first).
    empty: PyObject,
}

/// What the conversions use of torch, looked up once.
struct Torch {
    tensor_type: Py<PyType>,
    strided: PyObject,
    /// `torch._C._from_dlpack` (what `torch.from_dlpack` calls once it has a capsule).
    from_dlpack: PyObject,
    dtypes: Vec<TorchDType>,
}

impl Torch {
    fn load(py: Python<'_>) -> PyResult<Self> {
        let torch = py.import("torch")?;
        let mut dtypes = Vec::with_capacity(DTYPES.len());
        for dtype in DTYPES {
            // A torch without this dtype (an older one): tensors of it never come from
            // torch, and one received says so when it is made.
            let Ok(object) = torch.getattr(dtype_name(dtype)) else {
                continue;
            };
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", &object)?;
            let Ok(empty) = torch.call_method("empty", (0,), Some(&kwargs)) else {
                continue;
            };
            dtypes.push(TorchDType {
                object: object.unbind(),
                dtype,
                empty: empty.unbind(),
            });
        }
        Ok(Self {
            tensor_type: torch.getattr("Tensor")?.downcast_into::<PyType>()?.unbind(),
            strided: torch.getattr("strided")?.unbind(),
            from_dlpack: torch.getattr("_C")?.getattr("_from_dlpack")?.unbind(),
            dtypes,
        })
    }

    /// multiproc's dtype for a torch dtype object (torch keeps one object per dtype).
    fn dtype_of(&self, object: &Bound<'_, PyAny>) -> Option<DType> {
        let py = object.py();
        self.dtypes
            .iter()
            .find(|d| d.object.bind(py).is(object))
            .map(|d| d.dtype)
    }

    /// A torch tensor over `native` (no copy) and its untyped storage.
    fn tensor_over<'py>(
        &self,
        py: Python<'py>,
        native: &NativeTensor,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let capsule = native.capsule(py, native.tensor.is_read_only())?;
        let tensor = self.from_dlpack.bind(py).call1((capsule,))?;
        let storage = tensor.call_method0(intern!(py, "untyped_storage"))?;
        Ok((tensor, storage))
    }

    /// A received tensor over a storage torch already has (from an earlier message):
    /// a new tensor of its dtype, set to its place in the storage.
    fn view_of_storage(&self, storage: &Bound<'_, PyAny>, t: &Tensor) -> PyResult<PyObject> {
        let py = storage.py();
        let Some(d) = self.dtypes.iter().find(|d| d.dtype == t.dtype()) else {
            return Err(PyTypeError::new_err(format!(
                "this torch has no dtype {}",
                dtype_name(t.dtype())
            )));
        };
        let fresh = d.empty.bind(py).call_method0(intern!(py, "new"))?;
        let set = intern!(py, "set_");
        // Over the whole storage, 1-D: `set_(storage)` alone gives that shape, stride
        // and offset, without parsing them.
        let view = if t.shape().len() == 1
            && t.storage_offset() == 0
            && t.is_contiguous()
            && t.numel() * t.dtype().size() == t.storage().nbytes()
        {
            fresh.call_method1(set, (storage,))?
        } else {
            fresh.call_method1(
                set,
                (
                    storage,
                    t.storage_offset(),
                    PyTuple::new(py, t.shape())?,
                    PyTuple::new(py, t.strides())?,
                ),
            )?
        };
        Ok(view.unbind())
    }
}

static TORCH: GILOnceCell<Option<Torch>> = GILOnceCell::new();

/// torch, imported if it is installed: received tensors become torch tensors then
/// (numpy arrays without it).
fn torch_imported(py: Python<'_>) -> Option<&Torch> {
    TORCH.get_or_init(py, || Torch::load(py).ok()).as_ref()
}

/// torch if this process imported it already: a put of a value that is no tensor
/// must not import it (seconds), and without torch no torch tensor can be put.
fn torch_if_imported(py: Python<'_>) -> Option<&Torch> {
    if let Some(torch) = TORCH.get(py) {
        return torch.as_ref();
    }
    let imported = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .and_then(|modules| modules.contains("torch"))
        .unwrap_or(false);
    if imported { torch_imported(py) } else { None }
}

/// The sizes in a tuple (a `torch.Size`, or what `stride()` returns).
fn usizes(tuple: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let tuple = tuple.downcast::<PyTuple>()?;
    tuple.iter().map(|n| n.extract()).collect()
}

/// The torch storages made from received blocks, by the block's address and size, as
/// weak references. While torch keeps such a storage (any tensor on it lives), the
/// block stays mapped at that address, so a block received again there is the same
/// one, and a new view of the storage is all it takes (torch keeps one Python object
/// per storage for as long as the storage lives).
static TORCH_STORAGES: Mutex<Option<StorageTable>> = Mutex::new(None);

/// Weak references to torch storages by (block address, block size), and when to sweep
/// the dead ones out.
struct StorageTable {
    entries: HashMap<(usize, usize), Py<PyWeakrefReference>>,
    /// Inserts since the last sweep (a block received again at its old address
    /// replaces its entry, and counts too).
    inserted: usize,
    /// How many inserts the next sweep waits for: as many as the last one kept, at
    /// least [`SWEEP_AT`]. A sweep visits at most the entries it kept last time plus
    /// those inserted since, so it costs at most two steps per insert it waited for
    /// (amortised O(1), as a `HashMap` that doubles), and dead entries go within as
    /// many inserts as there were live ones, even when every block is received again
    /// at an address the table knows.
    sweep_after: usize,
    /// Inserts and entries visited by sweeps, in all (for the test suite).
    inserts: u64,
    visited: u64,
}

/// The fewest inserts between two sweeps.
const SWEEP_AT: usize = 1024;

impl StorageTable {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
            inserted: 0,
            sweep_after: SWEEP_AT,
            inserts: 0,
            visited: 0,
        }
    }

    fn insert(&mut self, py: Python<'_>, block: (usize, usize), weak: Py<PyWeakrefReference>) {
        self.inserted += 1;
        self.inserts += 1;
        if self.inserted >= self.sweep_after {
            self.visited += self.entries.len() as u64;
            self.entries.retain(|_, w| w.bind(py).upgrade().is_some());
            self.sweep_after = self.entries.len().max(SWEEP_AT);
            self.inserted = 0;
            // Room for the live entries and the inserts until the next sweep.
            self.entries
                .shrink_to(self.entries.len() + self.sweep_after);
        }
        self.entries.insert(block, weak);
    }
}

fn torch_storage<'py>(py: Python<'py>, block: (usize, usize)) -> Option<Bound<'py, PyAny>> {
    let table = TORCH_STORAGES.lock().unwrap_or_else(|p| p.into_inner());
    table.as_ref()?.entries.get(&block)?.bind(py).upgrade()
}

fn remember_torch_storage(block: (usize, usize), storage: &Bound<'_, PyAny>) -> PyResult<()> {
    let weak = PyWeakrefReference::new(storage)?.unbind();
    let mut table = TORCH_STORAGES.lock().unwrap_or_else(|p| p.into_inner());
    table
        .get_or_insert_with(StorageTable::new)
        .insert(storage.py(), block, weak);
    Ok(())
}

/// For the test suite: the table of torch storages as `(entries, inserts, visited)`:
/// the entries it holds, live or dead (dead ones stay until a sweep), the inserts so
/// far, and the entries its sweeps visited so far.
#[pyfunction]
pub fn _torch_storage_table() -> (usize, u64, u64) {
    let table = TORCH_STORAGES.lock().unwrap_or_else(|p| p.into_inner());
    table
        .as_ref()
        .map_or((0, 0, 0), |t| (t.entries.len(), t.inserts, t.visited))
}

/// Converts a received value to Python objects.
pub fn from_dynamic(py: Python<'_>, value: Dynamic) -> PyResult<PyObject> {
    FromDynamic::default().convert(py, value)
}
