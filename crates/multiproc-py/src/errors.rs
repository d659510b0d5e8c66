//! The library's errors as Python exceptions, and the loop that makes a blocking wait
//! interruptible: waits run in slices with the GIL released, and Ctrl-C is checked
//! between slices.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use multiproc::Error;
use pyo3::exceptions::{PyEOFError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

pyo3::create_exception!(
    multiproc,
    MultiprocError,
    PyRuntimeError,
    "An error of the multiproc library (the base of its other exceptions)."
);
pyo3::create_exception!(
    multiproc,
    FdLimitError,
    MultiprocError,
    "This process ran out of file descriptors; the message stayed queued."
);
pyo3::create_exception!(
    multiproc,
    InvalidMessageError,
    MultiprocError,
    "Received bytes or handles that are not a valid message."
);
pyo3::create_exception!(
    multiproc,
    OutOfSharedMemoryError,
    MultiprocError,
    "/dev/shm has no room for a new block."
);
pyo3::create_exception!(
    multiproc,
    ClosedError,
    MultiprocError,
    "The queue or connection was closed."
);
pyo3::create_exception!(
    multiproc,
    OwnerDiedError,
    MultiprocError,
    "A lock's holder died while holding it."
);

/// The Python exception for a library error.
pub fn to_py(err: Error) -> PyErr {
    let text = err.to_string();
    match err {
        Error::FdLimit { .. } => FdLimitError::new_err(text),
        Error::InvalidMessage(_) => InvalidMessageError::new_err(text),
        Error::OutOfSharedMemory { .. } => OutOfSharedMemoryError::new_err(text),
        Error::Closed(_) => ClosedError::new_err(text),
        Error::Disconnected(_) => disconnected(text),
        Error::OwnerDied { .. } => OwnerDiedError::new_err(text),
        Error::InvalidArgument(_) | Error::Tensor(_) => PyValueError::new_err(text),
        Error::Encode(_) => PyTypeError::new_err(text),
        _ => MultiprocError::new_err(text),
    }
}

/// `multiproc.DisconnectedError` (defined in Python: it is a `MultiprocError`, an
/// `EOFError` and a `queue.Empty` at once), or a plain `EOFError` if the package
/// cannot be imported.
fn disconnected(text: String) -> PyErr {
    Python::with_gil(|py| {
        match py
            .import("multiproc")
            .and_then(|m| m.getattr("DisconnectedError"))
            .and_then(|c| Ok(c.downcast_into::<PyType>()?))
        {
            Ok(cls) => PyErr::from_type(cls, text),
            Err(_) => PyEOFError::new_err(text),
        }
    })
}

/// [`to_py`] where a closed channel is Python's `EOFError` (a `Connection`'s `recv`).
pub fn to_py_eof(err: Error) -> PyErr {
    match err {
        Error::Closed(text) => PyEOFError::new_err(text),
        other => to_py(other),
    }
}

/// `queue.Empty` or `queue.Full` (the standard library's, as `multiprocessing` raises).
pub fn queue_error(py: Python<'_>, name: &str, text: &str) -> PyErr {
    match py
        .import("queue")
        .and_then(|m| m.getattr(name))
        .and_then(|c| Ok(c.downcast_into::<PyType>()?))
    {
        Ok(cls) => PyErr::from_type(cls, text.to_owned()),
        Err(e) => e,
    }
}

/// How long one slice of a blocking wait lasts: Ctrl-C is noticed within it.
const SLICE: Duration = Duration::from_millis(50);

/// A Python timeout as a deadline, read as `multiprocessing` reads one (see
/// [`timeout_duration`]).
pub fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    Ok(timeout_duration(timeout)?.and_then(|t| Instant::now().checked_add(t)))
}

/// A Python timeout as a `Duration`, `None` for no deadline: `None` waits forever; a
/// negative timeout is 0, one try (as `multiprocessing`'s queues, locks and events read
/// it: `get(timeout=-1)` on an empty queue raises `queue.Empty` at once); NaN is a
/// `ValueError`; one too long for the clock to count (`float('inf')`, `1e300`) waits
/// forever.
pub fn timeout_duration(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(PyValueError::new_err(
            "timeout is NaN: pass a number of seconds, or None to wait without one",
        )),
        Some(t) if t <= 0.0 => Ok(Some(Duration::ZERO)),
        Some(t) => Ok(Duration::try_from_secs_f64(t).ok()),
    }
}

/// Set from the package's `atexit` hook, before the interpreter starts finalizing.
static INTERPRETER_ENDING: AtomicBool = AtomicBool::new(false);
/// Threads inside [`without_gil`] that have not parked: each may take the GIL back.
static RELEASED: AtomicUsize = AtomicUsize::new(0);
/// How long the `atexit` hook gives threads that may take the GIL back to do it.
const ENDING_GRACE: Duration = Duration::from_millis(500);

/// Called by the package's `atexit` hook (on the main thread), before the interpreter
/// finalizes: from now on a thread whose wait ends parks (see [`without_gil`]). A
/// thread already on its way back to the GIL gets it now, while taking it is still
/// safe: the hook lends the GIL out until no thread is left between its wait and the
/// GIL (at most [`ENDING_GRACE`]; about one wait slice when a thread was waiting).
#[pyfunction]
pub fn _interpreter_ending(py: Python<'_>) {
    INTERPRETER_ENDING.store(true, Ordering::SeqCst);
    let until = Instant::now() + ENDING_GRACE;
    while RELEASED.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        py.allow_threads(|| std::thread::sleep(Duration::from_millis(1)));
    }
}

/// Runs `f` with the GIL released, as `Python::allow_threads` does, except on a thread
/// other than the main one once the interpreter is ending: there the thread stays
/// parked instead of taking the GIL back. A daemon thread left waiting in a `get` or
/// `wait` would otherwise take it during finalization, which ends the thread with
/// `pthread_exit`, a forced unwind that the Rust frames on its stack turn into an abort
/// of the whole process ("FATAL: exception not rethrown"). Python 3.14 parks such
/// threads itself; the process ends around them.
pub fn without_gil<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    RELEASED.fetch_add(1, Ordering::SeqCst);
    let out = py.allow_threads(|| {
        let out = f();
        if INTERPRETER_ENDING.load(Ordering::SeqCst) && !is_main_thread() {
            RELEASED.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        out
    });
    RELEASED.fetch_sub(1, Ordering::SeqCst);
    out
}

/// Whether this is the process's main thread (its thread id is the pid).
fn is_main_thread() -> bool {
    rustix::thread::gettid() == rustix::process::getpid()
}

/// What one slice of a wait did.
pub enum Slice<T> {
    /// Done (or failed): stop waiting.
    Done(T),
    /// Not yet: wait another slice, unless the deadline passed.
    Again,
}

/// Runs `attempt` in slices of at most [`SLICE`] with the GIL released, checking for
/// signals (Ctrl-C raises `KeyboardInterrupt`) between slices, until it is done or the
/// deadline passes. Returns `None` when the deadline passed.
pub fn wait_in_slices<T: Send>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut attempt: impl FnMut(Duration) -> Slice<T> + Send,
) -> PyResult<Option<T>> {
    loop {
        let slice = match deadline {
            None => SLICE,
            Some(d) => d.saturating_duration_since(Instant::now()).min(SLICE),
        };
        if let Slice::Done(v) = without_gil(py, || attempt(slice)) {
            return Ok(Some(v));
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
    }
}
