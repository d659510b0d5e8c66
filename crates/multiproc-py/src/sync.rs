//! Process-shared events, locks, semaphores, conditions and barriers, with the Python
//! `threading`/`multiprocessing` method names.

use std::time::{Duration, Instant};

use multiproc::{Barrier, Condition, Event, Lock, RLock, Semaphore};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::errors::{Slice, deadline, to_py, wait_in_slices};

/// Waits in slices on an operation that takes a timeout and reports `Timeout` when it
/// runs out: `Ok(true)` when it happened, `Ok(false)` when the deadline passed.
fn timed(
    py: Python<'_>,
    block: bool,
    timeout: Option<f64>,
    op: impl Fn(Duration) -> multiproc::Result<()> + Sync,
) -> PyResult<bool> {
    if !block {
        return match op(Duration::ZERO) {
            Ok(()) => Ok(true),
            Err(e) if e.is_timeout() => Ok(false),
            Err(e) => Err(to_py(e)),
        };
    }
    let done = wait_in_slices(py, deadline(timeout)?, |slice| match op(slice) {
        Err(e) if e.is_timeout() => Slice::Again,
        other => Slice::Done(other),
    })?;
    match done {
        Some(r) => r.map(|()| true).map_err(to_py),
        None => Ok(false),
    }
}

#[pyclass(module = "multiproc._native", name = "Event", frozen)]
pub struct PyEvent {
    pub inner: Event,
}

#[pymethods]
impl PyEvent {
    #[new]
    fn new() -> PyResult<Self> {
        Ok(Self {
            inner: Event::new().map_err(to_py)?,
        })
    }
    fn set(&self) {
        self.inner.set();
    }
    fn clear(&self) {
        self.inner.clear();
    }
    fn is_set(&self) -> bool {
        self.inner.is_set()
    }
    /// True when the flag is set, False when `timeout` seconds passed first.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        timed(py, true, timeout, |t| self.inner.wait_timeout(t))
    }
}

macro_rules! lock_methods {
    ($ty:ident, $name:literal, $inner:ty, $new:expr) => {
        #[pyclass(module = "multiproc._native", name = $name, frozen)]
        pub struct $ty {
            pub inner: $inner,
        }

        #[pymethods]
        impl $ty {
            #[pyo3(signature = (block=true, timeout=None))]
            fn acquire(&self, py: Python<'_>, block: bool, timeout: Option<f64>) -> PyResult<bool> {
                timed(py, block, timeout, |t| self.inner.acquire_timeout(t))
            }
            fn release(&self) -> PyResult<()> {
                self.inner.release().map_err(to_py)
            }
            fn __enter__(&self, py: Python<'_>) -> PyResult<bool> {
                self.acquire(py, true, None)
            }
            #[pyo3(signature = (*_exc))]
            fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
                self.release()
            }
        }

        impl $ty {
            pub fn create() -> PyResult<Self> {
                Ok(Self {
                    inner: $new.map_err(to_py)?,
                })
            }
        }
    };
}

lock_methods!(PyLock, "Lock", Lock, Lock::new());
lock_methods!(PyRLock, "RLock", RLock, RLock::new());
lock_methods!(PyCondition, "Condition", Condition, Condition::new());

#[pymethods]
impl PyLock {
    #[new]
    fn new() -> PyResult<Self> {
        Self::create()
    }

    /// Whether this thread of this process holds the lock (CPython's
    /// `SemLock._is_mine`): what a `Condition` over the lock checks.
    fn _is_mine(&self) -> bool {
        self.inner.is_owned_by_current_thread()
    }
}

#[pymethods]
impl PyRLock {
    #[new]
    fn new() -> PyResult<Self> {
        Self::create()
    }

    /// Whether this thread of this process holds the lock, at any depth.
    fn _is_mine(&self) -> bool {
        self.inner.is_owned_by_current_thread()
    }
}

#[pymethods]
impl PyCondition {
    #[new]
    fn new() -> PyResult<Self> {
        Self::create()
    }

    /// Waits for a notify (the lock held, released while waiting): True when notified,
    /// False after `timeout` seconds. Waiting in slices loses no notify: a notifier holds
    /// the lock, which this waiter holds between slices.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        self.check_owned("wait")?;
        timed(py, true, timeout, |t| self.inner.wait_timeout(t))
    }

    #[pyo3(signature = (n=1))]
    fn notify(&self, n: usize) -> PyResult<()> {
        self.check_owned("notify")?;
        self.inner.notify(n);
        Ok(())
    }

    fn notify_all(&self) -> PyResult<()> {
        self.check_owned("notify_all")?;
        self.inner.notify_all();
        Ok(())
    }

    /// Whether this thread of this process holds the condition's lock.
    fn _is_mine(&self) -> bool {
        self.inner.is_owned_by_current_thread()
    }
}

impl PyCondition {
    /// `RuntimeError` unless this thread holds the lock, as CPython's `threading` and
    /// `multiprocessing` conditions refuse.
    fn check_owned(&self, what: &str) -> PyResult<()> {
        if self.inner.is_owned_by_current_thread() {
            Ok(())
        } else {
            Err(PyRuntimeError::new_err(format!(
                "cannot {what} on a Condition whose lock is not held by this thread (it is \
                 free, or another thread or process holds it); acquire the lock first"
            )))
        }
    }
}

#[pyclass(module = "multiproc._native", name = "Semaphore", frozen)]
pub struct PySemaphore {
    pub inner: Semaphore,
}

#[pymethods]
impl PySemaphore {
    #[new]
    #[pyo3(signature = (value=1))]
    fn new(value: usize) -> PyResult<Self> {
        Ok(Self {
            inner: Semaphore::new(value).map_err(to_py)?,
        })
    }
    #[pyo3(signature = (block=true, timeout=None))]
    fn acquire(&self, py: Python<'_>, block: bool, timeout: Option<f64>) -> PyResult<bool> {
        timed(py, block, timeout, |t| self.inner.acquire_timeout(t))
    }
    fn release(&self) -> PyResult<()> {
        self.inner.release().map_err(to_py)
    }
    fn get_value(&self) -> usize {
        self.inner.value()
    }
    fn __enter__(&self, py: Python<'_>) -> PyResult<bool> {
        self.acquire(py, true, None)
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.release()
    }
}

#[pyclass(module = "multiproc._native", name = "Barrier", frozen)]
pub struct PyBarrier {
    pub inner: Barrier,
}

#[pymethods]
impl PyBarrier {
    #[new]
    fn new(parties: usize) -> PyResult<Self> {
        Ok(Self {
            inner: Barrier::new(parties).map_err(to_py)?,
        })
    }
    /// Waits for every party; returns this party's index (0..parties). Waited on in
    /// slices with the GIL released: Ctrl-C raises `KeyboardInterrupt` within a slice
    /// and breaks the barrier (`abort`), so the other parties are not left waiting for
    /// this one; a timeout breaks it too, as Python's does.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<usize> {
        let given = crate::errors::timeout_duration(timeout)?;
        let deadline = deadline(timeout)?;
        let arrival = match crate::errors::without_gil(py, || self.inner.arrive()).map_err(to_py)? {
            Ok(index) => return Ok(index),
            Err(arrival) => arrival,
        };
        let waited = wait_in_slices(py, deadline, |slice| {
            match self
                .inner
                .await_arrival(&arrival, Some(Instant::now() + slice))
            {
                Ok(Some(index)) => Slice::Done(Ok(index)),
                Ok(None) => Slice::Again,
                Err(e) => Slice::Done(Err(e)),
            }
        });
        match waited {
            Ok(Some(r)) => r.map_err(to_py),
            Ok(None) => Err(to_py(self.inner.time_out(given))),
            Err(interrupted) => {
                self.inner.abort();
                Err(interrupted)
            }
        }
    }
    /// Breaks the barrier: current and later waits raise `BrokenBarrierError`.
    fn abort(&self) {
        self.inner.abort();
    }
    #[getter]
    fn broken(&self) -> bool {
        self.inner.is_broken()
    }
    #[getter]
    fn n_waiting(&self) -> usize {
        self.inner.n_waiting()
    }
    #[getter]
    fn parties(&self) -> usize {
        self.inner.parties()
    }
}
