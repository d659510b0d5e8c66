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
