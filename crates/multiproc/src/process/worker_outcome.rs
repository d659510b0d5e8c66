//! [`IntoWorkerOutcome`]: what a worker function may return, and how that becomes the
//! outcome its report carries.

use std::fmt::Display;

/// What a worker function may return: `()` or `Result<(), E>` with `E: Display`. An
/// `Err` is reported to the parent like a panic ([`Error::ProcessRaised`]).
///
/// This trait is sealed: multiproc implements it for those two shapes only.
///
/// [`Error::ProcessRaised`]: crate::Error::ProcessRaised
pub trait IntoWorkerOutcome: sealed::Sealed {
    /// `Ok(())`, or the error's text.
    #[doc(hidden)]
    fn into_outcome(self) -> Result<(), String>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for () {}
    impl<E: std::fmt::Display> Sealed for Result<(), E> {}
}

impl IntoWorkerOutcome for () {
    fn into_outcome(self) -> Result<(), String> {
        Ok(())
    }
}

impl<E: Display> IntoWorkerOutcome for Result<(), E> {
    fn into_outcome(self) -> Result<(), String> {
        self.map_err(|e| e.to_string())
    }
}

/// The former name of [`IntoWorkerOutcome`], kept so that bounds written with it still
/// compile: every `IntoWorkerOutcome` type is a `WorkerResult`.
#[deprecated(
    since = "0.1.0",
    note = "renamed to `IntoWorkerOutcome` (a trait, not a result type)"
)]
pub trait WorkerResult: IntoWorkerOutcome {}

#[allow(deprecated)]
impl<T: IntoWorkerOutcome> WorkerResult for T {}
