//! Queues and pipe ends carrying Python values (`multiproc::Dynamic` on the wire).

// A failed put hands the item back in the library's `PutError`, whose size is the
// item's: moving it is what the library's own API does.
#![allow(clippy::result_large_err)]

use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use multiproc::{Connection, Dynamic, Error, JoinableQueue, PutError, Queue, SimpleQueue};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::convert::{ToDynamic, from_dynamic};
use crate::errors::{Slice, deadline, queue_error, to_py, to_py_eof, wait_in_slices};

/// The queue behind a Python `Queue`, `JoinableQueue` or `SimpleQueue`.
#[derive(Clone)]
pub enum Flavor {
    Queue(Queue<Dynamic>),
    Joinable(JoinableQueue<Dynamic>),
    Simple(SimpleQueue<Dynamic>),
}

impl Flavor {
    fn put_timeout(&self, item: Dynamic, t: Duration) -> Result<(), PutError<Dynamic>> {
        match self {
            Flavor::Queue(q) => q.put_timeout(item, t),
            Flavor::Joinable(q) => q.put_timeout(item, t),
            // Unbounded: a put waits only for the socket's room, never for a place.
            Flavor::Simple(q) => q.put(item),
        }
    }

    fn try_put(&self, item: Dynamic) -> Result<(), PutError<Dynamic>> {
        match self {
            Flavor::Queue(q) => q.try_put(item),
            Flavor::Joinable(q) => q.try_put(item),
            Flavor::Simple(q) => q.put(item),
        }
    }

    fn get_timeout(&self, t: Duration) -> multiproc::Result<Dynamic> {
        match self {
            Flavor::Queue(q) => q.get_timeout(t),
            Flavor::Joinable(q) => q.get_timeout(t),
            Flavor::Simple(q) => q.get_timeout(t),
        }
    }

    fn try_get(&self) -> multiproc::Result<Option<Dynamic>> {
        match self {
            Flavor::Queue(q) => q.try_get(),
            Flavor::Joinable(q) => q.try_get(),
            Flavor::Simple(q) => q.try_get(),
        }
    }
}

/// A queue of Python values (the Python classes `Queue`, `JoinableQueue`, `SimpleQueue`
/// wrap it).
#[pyclass(module = "multiproc._native", name = "NativeQueue", frozen)]
pub struct NativeQueue {
    pub flavor: Flavor,
    /// A second handle on the queue, held while it has never left this process. Python
    /// threads share one object, which the library cannot count as handles; so a
    /// queue made here counts as held by another thread until it is sent to another
    /// process (see `parcel`), and a `get` on it waits as torch's does rather than
    /// report `DisconnectedError`. Once sent, the other processes' handles are what
    /// keeps it connected (in-process threads are then not counted).
    pub kept_for_threads: std::sync::Mutex<Option<Flavor>>,
}

impl NativeQueue {
    /// A queue received from another process (no handle kept for threads).
    pub fn received(flavor: Flavor) -> Self {
        Self {
            flavor,
            kept_for_threads: std::sync::Mutex::new(None),
        }
    }

    /// The queue is going to another process: from now on, a `get` here that finds it
    /// empty with no other process's handle left reports `DisconnectedError`.
    pub fn leaves_this_process(&self) {
        self.kept_for_threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
    }
}

#[pymethods]
impl NativeQueue {
    /// `kind` is "queue", "joinable" or "simple"; `maxsize` <= 0 is unbounded.
    #[new]
    #[pyo3(signature = (kind, maxsize=0))]
    fn new(kind: &str, maxsize: isize) -> PyResult<Self> {
        let capacity = usize::try_from(maxsize).ok().filter(|&m| m > 0);
        let flavor = match (kind, capacity) {
            ("queue", None) => Flavor::Queue(Queue::new().map_err(to_py)?),
            ("queue", Some(c)) => Flavor::Queue(Queue::with_capacity(c).map_err(to_py)?),
            ("joinable", None) => Flavor::Joinable(JoinableQueue::new().map_err(to_py)?),
            ("joinable", Some(c)) => {
                Flavor::Joinable(JoinableQueue::with_capacity(c).map_err(to_py)?)
            }
            ("simple", _) => Flavor::Simple(SimpleQueue::new().map_err(to_py)?),
            _ => return Err(PyValueError::new_err(format!("no queue kind {kind:?}"))),
        };
        Ok(Self {
            kept_for_threads: std::sync::Mutex::new(Some(flavor.clone())),
            flavor,
        })
    }

    #[pyo3(signature = (obj, block=true, timeout=None))]
    fn put(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        block: bool,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let item = ToDynamic::default().convert(obj)?;
        if !block {
            return match crate::errors::without_gil(py, || self.flavor.try_put(item)) {
                Ok(()) => Ok(()),
                Err(e) if matches!(e.error, Error::Full(_)) => {
                    Err(queue_error(py, "Full", "the queue is full"))
                }
                Err(e) => Err(to_py(e.error)),
            };
        }
        let mut pending = Some(item);
        let sent = wait_in_slices(py, deadline(timeout)?, |slice| {
            let Some(item) = pending.take() else {
                return Slice::Done(Ok(()));
            };
            match self.flavor.put_timeout(item, slice) {
                Ok(()) => Slice::Done(Ok(())),
                Err(e) if e.error.is_timeout() => {
                    pending = Some(e.item);
                    Slice::Again
                }
                Err(e) => Slice::Done(Err(e.error)),
            }
        })?;
        match sent {
            Some(r) => r.map_err(to_py),
            None => Err(queue_error(
                py,
                "Full",
                "the queue stayed full until the timeout",
            )),
        }
    }

    #[pyo3(signature = (block=true, timeout=None))]
    fn get(&self, py: Python<'_>, block: bool, timeout: Option<f64>) -> PyResult<PyObject> {
        let got = if block {
            wait_in_slices(py, deadline(timeout)?, |slice| {
                match self.flavor.get_timeout(slice) {
                    Err(e) if e.is_timeout() => Slice::Again,
                    other => Slice::Done(other),
                }
            })?
        } else {
            // Non-blocking: a disconnected queue is empty now, as `queue.Empty` says.
            match crate::errors::without_gil(py, || self.flavor.try_get()) {
                Err(e) if e.is_disconnected() => None,
                other => other.transpose(),
            }
        };
        match got {
            Some(Ok(value)) => from_dynamic(py, value),
            Some(Err(e)) => Err(to_py(e)),
            None => Err(queue_error(py, "Empty", "the queue is empty")),
        }
    }

    fn qsize(&self) -> usize {
        match &self.flavor {
            Flavor::Queue(q) => q.len(),
            Flavor::Joinable(q) => q.len(),
            Flavor::Simple(q) => usize::from(!q.is_empty()),
        }
    }

    fn empty(&self) -> bool {
        match &self.flavor {
            Flavor::Queue(q) => q.is_empty(),
            Flavor::Joinable(q) => q.is_empty(),
            Flavor::Simple(q) => q.is_empty(),
        }
    }

    fn full(&self) -> bool {
        match &self.flavor {
            Flavor::Queue(q) => q.is_full(),
            Flavor::Joinable(q) => q.is_full(),
            Flavor::Simple(_) => false,
        }
    }

    fn close(&self) {
        match &self.flavor {
            Flavor::Queue(q) => q.close(),
            Flavor::Joinable(q) => q.close(),
            Flavor::Simple(q) => q.close(),
        }
    }

    fn task_done(&self) -> PyResult<()> {
        match &self.flavor {
            Flavor::Joinable(q) => q.task_done().map_err(to_py),
            _ => Err(PyValueError::new_err("task_done is a JoinableQueue's")),
        }
    }

    #[pyo3(signature = (timeout=None))]
    fn join(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let Flavor::Joinable(q) = &self.flavor else {
            return Err(PyValueError::new_err("join is a JoinableQueue's"));
        };
        let done = wait_in_slices(py, deadline(timeout)?, |slice| {
            match q.join_timeout(slice) {
                Err(e) if e.is_timeout() => Slice::Again,
                other => Slice::Done(other),
            }
        })?;
        match done {
            Some(r) => r.map(|()| true).map_err(to_py),
            None => Ok(false),
        }
    }
}

/// One end of a pipe (`multiproc.Pipe()`), carrying Python values.
#[pyclass(module = "multiproc._native", name = "NativeConnection", frozen)]
pub struct NativeConnection {
    conn: RwLock<Option<Arc<Connection<Dynamic>>>>,
}

impl NativeConnection {
    pub fn wrap(conn: Connection<Dynamic>) -> Self {
        Self {
            conn: RwLock::new(Some(Arc::new(conn))),
        }
    }

    pub fn get(&self) -> PyResult<Arc<Connection<Dynamic>>> {
        self.conn
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyOSError::new_err("handle is closed"))
    }
}

/// Two connected ends.
#[pyfunction]
pub fn native_pipe() -> PyResult<(NativeConnection, NativeConnection)> {
    let (a, b) = multiproc::pipe::<Dynamic>().map_err(to_py)?;
    Ok((NativeConnection::wrap(a), NativeConnection::wrap(b)))
}

#[pymethods]
impl NativeConnection {
    fn send(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        let conn = self.get()?;
        let mut pending = Some(ToDynamic::default().convert(obj)?);
        let sent = wait_in_slices(py, None, |slice| {
            let Some(item) = pending.take() else {
                return Slice::Done(Ok(()));
            };
            match conn.send_timeout(item, slice) {
                Ok(()) => Slice::Done(Ok(())),
                Err(e) if e.error.is_timeout() => {
                    pending = Some(e.item);
                    Slice::Again
                }
                Err(e) => Slice::Done(Err(e.error)),
            }
        })?;
        sent.unwrap_or(Ok(())).map_err(to_py_eof)
    }

    fn recv(&self, py: Python<'_>) -> PyResult<PyObject> {
        let conn = self.get()?;
        let got = wait_in_slices(py, None, |slice| match conn.recv_timeout(slice) {
            Err(e) if e.is_timeout() => Slice::Again,
            other => Slice::Done(other),
        })?;
        match got {
            Some(Ok(v)) => from_dynamic(py, v),
            Some(Err(e)) => Err(to_py_eof(e)),
            None => Err(to_py(Error::Closed("recv gave up".into()))),
        }
    }

    /// Whether something can be received within `timeout` seconds (`None`: wait).
    #[pyo3(signature = (timeout=0.0))]
    fn poll(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let conn = self.get()?;
        if timeout.is_some_and(|t| t <= 0.0) {
            return match conn.poll_timeout(Duration::ZERO) {
                Ok(()) => Ok(true),
                Err(e) if e.is_timeout() => Ok(false),
                Err(e) => Err(to_py(e)),
            };
        }
        let ready = wait_in_slices(py, deadline(timeout)?, |slice| {
            match conn.poll_timeout(slice) {
                Err(e) if e.is_timeout() => Slice::Again,
                other => Slice::Done(other),
            }
        })?;
        match ready {
            Some(r) => r.map(|()| true).map_err(to_py),
            None => Ok(false),
        }
    }

    fn fileno(&self) -> PyResult<i32> {
        Ok(self.get()?.as_fd().as_raw_fd())
    }

    fn close(&self) {
        self.conn.write().unwrap_or_else(|p| p.into_inner()).take();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.conn
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }
}
