//! `multiproc._native`: the Python package's extension module, a thin layer over the
//! multiproc library. Python values travel as `multiproc::Dynamic` (see `convert`);
//! tensors reach torch and numpy through DLPack (`dlpack`); queues, pipes and locks are
//! the library's own (`queues`, `sync`); handles cross to processes that Python's own
//! `multiprocessing` starts as parcels (`parcel`).

mod convert;
mod dlpack;
mod errors;
mod parcel;
mod queues;
mod sync;

use multiproc::{SharingStrategy, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::{NativeTensor, parse_dtype};
use crate::errors::to_py;

/// A new tensor in a shared block: `fill` None leaves it uninitialised.
#[pyfunction]
#[pyo3(signature = (shape, dtype, fill=None))]
fn new_tensor(shape: Vec<usize>, dtype: &str, fill: Option<f64>) -> PyResult<NativeTensor> {
    let dtype = parse_dtype(dtype)?;
    let t = match fill {
        None => Tensor::empty_shared(&shape, dtype),
        Some(v) => {
            if v == 0.0 {
                Tensor::zeros_shared(&shape, dtype)
            } else {
                Tensor::empty_shared(&shape, dtype).and_then(|t| t.fill_(v).map(|()| t))
            }
        }
    }
    .map_err(to_py)?;
    NativeTensor::new(t)
}

/// [`new_tensor`] handed to torch (or numpy) at once, as `multiproc.empty`, `zeros`
/// and `full` return it: one call, no `NativeTensor` object in between.
#[pyfunction]
#[pyo3(signature = (shape, dtype, fill=None))]
fn new_python_tensor(
    py: Python<'_>,
    shape: Vec<usize>,
    dtype: &str,
    fill: Option<f64>,
) -> PyResult<PyObject> {
    let native = new_tensor(shape, dtype, fill)?;
    convert::from_dynamic(py, multiproc::Dynamic::Tensor(native.tensor))
}

/// A CPU torch tensor or numpy array as a multiproc tensor: by handle when its memory
/// is a multiproc block, else copied once into a new shared block.
#[pyfunction]
fn as_native(obj: &Bound<'_, PyAny>) -> PyResult<NativeTensor> {
    match convert::ToDynamic::into_blocks().convert(obj)? {
        multiproc::Dynamic::Tensor(t) => NativeTensor::new(t),
        _ => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "a {} is not a tensor",
            obj.get_type().name()?
        ))),
    }
}

/// A `NativeTensor` as a torch tensor (or numpy array), its storage offset kept.
#[pyfunction]
fn to_python(py: Python<'_>, native: &Bound<'_, NativeTensor>) -> PyResult<PyObject> {
    convert::from_dynamic(py, multiproc::Dynamic::Tensor(native.get().tensor.clone()))
}

/// Whether `addr..addr+nbytes` lies in a block this process handed to torch or numpy.
#[pyfunction]
fn is_shared_block(addr: usize, nbytes: usize) -> bool {
    dlpack::find_exported(addr, nbytes).is_some()
}

/// For leak checks (the test suite): lets go of the received blocks this process keeps
/// mapped for a while and of its idle pooled blocks, so that open fds can be counted
/// exactly. Returns how many were let go.
#[pyfunction]
fn _release_cached_blocks() -> usize {
    multiproc::__testing::flush_retained_segments() + multiproc::__testing::release_idle_blocks()
}

#[pyfunction]
fn get_sharing_strategy() -> String {
    multiproc::get_sharing_strategy().to_string()
}

#[pyfunction]
fn set_sharing_strategy(name: &str) -> PyResult<()> {
    let strategy: SharingStrategy = name
        .parse()
        .map_err(|e: multiproc::Error| PyValueError::new_err(e.to_string()))?;
    multiproc::set_sharing_strategy(strategy);
    Ok(())
}

/// The environment variable and value that put a process this package starts through
/// Python's `multiprocessing` into this process tree (the address of its shm manager,
/// inherited or chosen now): `multiproc::maintenance::shm_manager_env`.
#[pyfunction]
fn shm_manager_env() -> (&'static str, &'static str) {
    multiproc::maintenance::shm_manager_env()
}

/// A segment's process tree, as Python sees it: `(root pid, root start time, random
/// part)`.
type SegmentTree = (u32, u64, String);

/// multiproc's segments in /dev/shm, as `multiproc::maintenance::segments` reads
/// them: `(name, creator pid, tree)` each, the tree being `(root pid, root start time,
/// random part)` for a segment made in a process tree (file_system), else `None`.
#[pyfunction]
fn shm_segments() -> Vec<(String, u32, Option<SegmentTree>)> {
    multiproc::maintenance::segments()
        .into_iter()
        .map(|s| {
            let tree = s
                .tree()
                .map(|t| (t.root(), t.root_start_time(), t.random().to_owned()));
            (s.name().to_owned(), s.creator(), tree)
        })
        .collect()
}

/// For a process about to end without finalizing (a `fork` or `forkserver` child of
/// `multiprocessing` leaves with `os._exit`): gives back the block uses of every tensor
/// this process still holds through torch or numpy, which must not be read afterwards.
/// Returns how many storages.
#[pyfunction]
fn _give_back_at_exit() -> usize {
    dlpack::give_back_at_exit()
}

/// Becomes the shm manager at the address in `MULTIPROC_SHM_MANAGER`: the command the
/// library runs to start a tree's manager (set below, at import). Forks the manager
/// off, reports on stdout, and returns in this process. Must run in a single-threaded
/// interpreter.
#[pyfunction]
fn _run_shm_manager() -> PyResult<bool> {
    multiproc::maintenance::run_shm_manager_from_env().map_err(to_py)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    dlpack::give_back_at_c_exit_once();
    // The library would start a tree's shm manager by running this program again, which
    // for an interpreter does not serve: it runs this interpreter on the manager's entry
    // point instead: the first start of a tree's manager, a killed one restarted, a name
    // received from another tree. The package starts no manager of its own.
    let executable: String = py.import("sys")?.getattr("executable")?.extract()?;
    if !executable.is_empty() {
        multiproc::maintenance::set_shm_manager_command(
            &executable,
            &[
                "-c",
                "from multiproc import _native; _native._run_shm_manager()",
            ],
        )
        .map_err(to_py)?;
    }
    m.add_function(wrap_pyfunction!(_give_back_at_exit, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_interpreter_ending, m)?)?;
    m.add_function(wrap_pyfunction!(_run_shm_manager, m)?)?;
    m.add_function(wrap_pyfunction!(convert::_set_hooks, m)?)?;
    m.add_function(wrap_pyfunction!(convert::_torch_storage_table, m)?)?;
    m.add_function(wrap_pyfunction!(new_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(new_python_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(is_shared_block, m)?)?;
    m.add_function(wrap_pyfunction!(as_native, m)?)?;
    m.add_function(wrap_pyfunction!(to_python, m)?)?;
    m.add_function(wrap_pyfunction!(_release_cached_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(get_sharing_strategy, m)?)?;
    m.add_function(wrap_pyfunction!(set_sharing_strategy, m)?)?;
    m.add_function(wrap_pyfunction!(shm_manager_env, m)?)?;
    m.add_function(wrap_pyfunction!(shm_segments, m)?)?;
    m.add_function(wrap_pyfunction!(queues::native_pipe, m)?)?;
    m.add_function(wrap_pyfunction!(parcel::seal, m)?)?;
    m.add_function(wrap_pyfunction!(parcel::open_parcel, m)?)?;
    m.add_function(wrap_pyfunction!(parcel::seal_bare, m)?)?;
    m.add_function(wrap_pyfunction!(parcel::open_bare, m)?)?;
    m.add_class::<NativeTensor>()?;
    m.add_class::<queues::NativeQueue>()?;
    m.add_class::<queues::NativeConnection>()?;
    m.add_class::<parcel::Parcel>()?;
    m.add_class::<sync::PyEvent>()?;
    m.add_class::<sync::PyLock>()?;
    m.add_class::<sync::PyRLock>()?;
    m.add_class::<sync::PySemaphore>()?;
    m.add_class::<sync::PyCondition>()?;
    m.add_class::<sync::PyBarrier>()?;
    m.add("MultiprocError", py.get_type::<errors::MultiprocError>())?;
    m.add("FdLimitError", py.get_type::<errors::FdLimitError>())?;
    m.add(
        "InvalidMessageError",
        py.get_type::<errors::InvalidMessageError>(),
    )?;
    m.add(
        "OutOfSharedMemoryError",
        py.get_type::<errors::OutOfSharedMemoryError>(),
    )?;
    m.add("ClosedError", py.get_type::<errors::ClosedError>())?;
    m.add("OwnerDiedError", py.get_type::<errors::OwnerDiedError>())?;
    Ok(())
}
