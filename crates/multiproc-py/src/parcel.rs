//! Handles sealed into one fd (`multiproc::parcel`), for pickling them to a process
//! that Python's `multiprocessing` starts: the reducer passes the fd with
//! `multiprocessing.reduction.DupFd`, the child opens it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use multiproc::{
    Barrier, Condition, Connection, Dynamic, Event, JoinableQueue, Lock, Queue, RLock, Semaphore,
    SimpleQueue, Tensor,
};
use pyo3::exceptions::{PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use serde::{Deserialize, Serialize};

use crate::dlpack::NativeTensor;
use crate::errors::to_py;
use crate::queues::{Flavor, NativeConnection, NativeQueue};
use crate::sync::{PyBarrier, PyCondition, PyEvent, PyLock, PyRLock, PySemaphore};

/// Everything the package can pickle, as one wire type (received).
#[derive(Deserialize)]
enum Handle {
    Queue(Queue<Dynamic>),
    Joinable(JoinableQueue<Dynamic>),
    Simple(SimpleQueue<Dynamic>),
    Connection(Connection<Dynamic>),
    Event(Event),
    Lock(Lock),
    RLock(RLock),
    Semaphore(Semaphore),
    Condition(Condition),
    Barrier(Barrier),
    Tensor(Tensor),
}

/// [`Handle`] as sent: the same variants in the same order, a pipe end shared with its
/// Python object rather than owned.
#[derive(Serialize)]
enum HandleOut {
    Queue(Queue<Dynamic>),
    Joinable(JoinableQueue<Dynamic>),
    Simple(SimpleQueue<Dynamic>),
    Connection(SharedConnection),
    Event(Event),
    Lock(Lock),
    RLock(RLock),
    Semaphore(Semaphore),
    Condition(Condition),
    Barrier(Barrier),
    Tensor(Tensor),
}

/// A pipe end that its Python object keeps, serialized as the end itself.
struct SharedConnection(Arc<Connection<Dynamic>>);

impl Serialize for SharedConnection {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

/// A sealed handle: its fd, to pass with `DupFd`.
#[pyclass(module = "multiproc._native", name = "Parcel", frozen)]
pub struct Parcel {
    fd: Mutex<Option<OwnedFd>>,
}

#[pymethods]
impl Parcel {
    fn fileno(&self) -> PyResult<RawFd> {
        self.fd
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(AsRawFd::as_raw_fd)
            .ok_or_else(|| PyOSError::new_err("the parcel is closed"))
    }

    fn close(&self) {
        self.fd.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

fn handle_of(obj: &Bound<'_, PyAny>) -> PyResult<HandleOut> {
    if let Ok(q) = obj.downcast::<NativeQueue>() {
        q.get().leaves_this_process();
        return Ok(match &q.get().flavor {
            Flavor::Queue(q) => HandleOut::Queue(q.clone()),
            Flavor::Joinable(q) => HandleOut::Joinable(q.clone()),
            Flavor::Simple(q) => HandleOut::Simple(q.clone()),
        });
    }
    if let Ok(c) = obj.downcast::<NativeConnection>() {
        return Ok(HandleOut::Connection(SharedConnection(c.get().get()?)));
    }
    if let Ok(t) = obj.downcast::<NativeTensor>() {
        return Ok(HandleOut::Tensor(t.get().tensor.clone()));
    }
    macro_rules! sync_handle {
        ($($py:ty => $variant:ident),*) => {
            $(if let Ok(x) = obj.downcast::<$py>() {
                return Ok(HandleOut::$variant(x.get().inner.clone()));
            })*
        };
    }
    sync_handle!(PyEvent => Event, PyLock => Lock, PyRLock => RLock, PySemaphore => Semaphore,
        PyCondition => Condition, PyBarrier => Barrier);
    Err(PyTypeError::new_err(format!(
        "multiproc cannot seal a {}",
        obj.get_type().name()?
    )))
}

/// Seals a queue, pipe end, lock, event, barrier or `NativeTensor` into a parcel.
#[pyfunction]
pub fn seal(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Parcel> {
    let handle = handle_of(obj)?;
    let fd = crate::errors::without_gil(py, || multiproc::parcel::seal(&handle)).map_err(to_py)?;
    Ok(Parcel {
        fd: Mutex::new(Some(fd)),
    })
}

/// Opens a parcel from an fd this process owns (`DupFd.detach()`), closing the fd.
#[pyfunction]
pub fn open_parcel(py: Python<'_>, fd: RawFd) -> PyResult<PyObject> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "{fd} is not a file descriptor"
        )));
    }
    // SAFETY: the Python layer passes an fd that it owns and hands over here
    // (`DupFd.detach()` returns a new fd for the caller to close); nothing else closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let handle: Handle =
        crate::errors::without_gil(py, || multiproc::parcel::open(fd)).map_err(to_py)?;
    let obj = match handle {
        Handle::Queue(q) => Bound::new(py, NativeQueue::received(Flavor::Queue(q)))?.into_any(),
        Handle::Joinable(q) => {
            Bound::new(py, NativeQueue::received(Flavor::Joinable(q)))?.into_any()
        }
        Handle::Simple(q) => Bound::new(py, NativeQueue::received(Flavor::Simple(q)))?.into_any(),
        Handle::Connection(c) => Bound::new(py, NativeConnection::wrap(c))?.into_any(),
        Handle::Event(inner) => Bound::new(py, PyEvent { inner })?.into_any(),
        Handle::Lock(inner) => Bound::new(py, PyLock { inner })?.into_any(),
        Handle::RLock(inner) => Bound::new(py, PyRLock { inner })?.into_any(),
        Handle::Semaphore(inner) => Bound::new(py, PySemaphore { inner })?.into_any(),
        Handle::Condition(inner) => Bound::new(py, PyCondition { inner })?.into_any(),
        Handle::Barrier(inner) => Bound::new(py, PyBarrier { inner })?.into_any(),
        Handle::Tensor(t) => Bound::new(py, NativeTensor::new(t)?)?.into_any(),
    };
    Ok(obj.unbind())
}

/// Seals the handle alone (no type tag), for a program that knows what it receives: a
/// Rust program opens a queue with `multiproc::parcel::open::<Queue<Dynamic>>`.
#[pyfunction]
pub fn seal_bare(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Parcel> {
    let handle = handle_of(obj)?;
    let fd = crate::errors::without_gil(py, || match &handle {
        HandleOut::Queue(h) => multiproc::parcel::seal(h),
        HandleOut::Joinable(h) => multiproc::parcel::seal(h),
        HandleOut::Simple(h) => multiproc::parcel::seal(h),
        HandleOut::Connection(h) => multiproc::parcel::seal(h),
        HandleOut::Event(h) => multiproc::parcel::seal(h),
        HandleOut::Lock(h) => multiproc::parcel::seal(h),
        HandleOut::RLock(h) => multiproc::parcel::seal(h),
        HandleOut::Semaphore(h) => multiproc::parcel::seal(h),
        HandleOut::Condition(h) => multiproc::parcel::seal(h),
        HandleOut::Barrier(h) => multiproc::parcel::seal(h),
        HandleOut::Tensor(h) => multiproc::parcel::seal(h),
    })
    .map_err(to_py)?;
    Ok(Parcel {
        fd: Mutex::new(Some(fd)),
    })
}

/// Opens a parcel that [`seal_bare`] (or a Rust program's `multiproc::parcel::seal`)
/// made, as a value of the named kind.
#[pyfunction]
pub fn open_bare(py: Python<'_>, fd: RawFd, kind: &str) -> PyResult<PyObject> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!(
            "{fd} is not a file descriptor"
        )));
    }
    // SAFETY: as in `open_parcel`: the caller hands over an fd it owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    fn open<T: serde::de::DeserializeOwned + Send>(py: Python<'_>, fd: OwnedFd) -> PyResult<T> {
        crate::errors::without_gil(py, || multiproc::parcel::open(fd)).map_err(to_py)
    }
    let obj = match kind {
        "queue" => Bound::new(py, NativeQueue::received(Flavor::Queue(open(py, fd)?)))?.into_any(),
        "joinable" => {
            Bound::new(py, NativeQueue::received(Flavor::Joinable(open(py, fd)?)))?.into_any()
        }
        "simple" => {
            Bound::new(py, NativeQueue::received(Flavor::Simple(open(py, fd)?)))?.into_any()
        }
        "connection" => Bound::new(py, NativeConnection::wrap(open(py, fd)?))?.into_any(),
        "event" => Bound::new(
            py,
            PyEvent {
                inner: open(py, fd)?,
            },
        )?
        .into_any(),
        "lock" => Bound::new(
            py,
            PyLock {
                inner: open(py, fd)?,
            },
        )?
        .into_any(),
        "rlock" => Bound::new(
            py,
            PyRLock {
                inner: open(py, fd)?,
            },
        )?
        .into_any(),
        "semaphore" => Bound::new(
            py,
            PySemaphore {
                inner: open(py, fd)?,
            },
        )?
        .into_any(),
        "condition" => Bound::new(
            py,
            PyCondition {
                inner: open(py, fd)?,
            },
        )?
        .into_any(),
        "barrier" => Bound::new(
            py,
            PyBarrier {
                inner: open(py, fd)?,
            },
        )?
        .into_any(),
        other => return Err(PyValueError::new_err(format!("no handle kind {other:?}"))),
    };
    Ok(obj.unbind())
}
