//! Functions that travel to loader workers: [`FromFn`], a data set that each process
//! builds for itself, and the `worker_init` hook.
//!
//! Both travel as a [`Code`] of their one function-pointer type (`fn() -> Result<D>`
//! for `FromFn<D>`, `fn(usize)` for the init hook), which `process::code` turns back
//! into that same type after checking that both processes run the same executable: no
//! `unsafe` here.

use std::fmt;
use std::sync::Arc;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::dataset::Dataset;
use crate::error::Result;
use crate::process::code::Code;

/// A data set built by a function in every process that uses it, rather than sent to
/// the workers: for data sets that hold open files, decoders, caches or anything else
/// that should not (or cannot) travel.
///
/// The loader's process calls `make` once when the `FromFn` is made (to know the
/// length); every worker calls it again when it starts, before `worker_init`.
///
/// ```no_run
/// use multiproc::data::{DataLoader, Dataset, FromFn};
///
/// struct Files(Vec<std::path::PathBuf>);
///
/// impl Dataset for Files {
///     type Item = multiproc::Tensor;
///     fn len(&self) -> usize {
///         self.0.len()
///     }
///     fn get(&self, i: usize) -> multiproc::Result<multiproc::Tensor> {
///         let bytes = std::fs::read(&self.0[i]).map_err(|e| {
///             multiproc::Error::InvalidArgument(format!("{}: {e}", self.0[i].display()))
///         })?;
///         let n = bytes.len();
///         multiproc::Tensor::from_vec(bytes, &[n])
///     }
/// }
///
/// fn open() -> multiproc::Result<Files> {
///     Ok(Files(vec!["/etc/hostname".into()]))
/// }
///
/// # fn main() -> multiproc::Result<()> {
/// multiproc::init();
/// let loader = DataLoader::builder(FromFn::new(open)?).num_workers(2).build()?;
/// # let _ = loader; Ok(()) }
/// ```
pub struct FromFn<D> {
    make: fn() -> Result<D>,
    dataset: Arc<D>,
}

impl<D> FromFn<D> {
    /// Builds the data set here with `make`, and in each worker again.
    ///
    /// `make` must be a function (or a closure capturing nothing) of this executable.
    ///
    /// # Errors
    /// Whatever `make` returns.
    pub fn new(make: fn() -> Result<D>) -> Result<Self> {
        Ok(Self {
            make,
            dataset: Arc::new(make()?),
        })
    }

    /// The data set this process built.
    pub fn inner(&self) -> &D {
        &self.dataset
    }
}

impl<D: Dataset> Dataset for FromFn<D> {
    type Item = D::Item;

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn get(&self, index: usize) -> Result<D::Item> {
        self.dataset.get(index)
    }

    /// Tells the data set, when this handle is its only one (as in a worker, which
    /// builds its own); a data set shared with other clones is not told.
    fn set_epoch(&mut self, epoch: u64) {
        if let Some(d) = Arc::get_mut(&mut self.dataset) {
            d.set_epoch(epoch);
        }
    }
}

impl<D> Clone for FromFn<D> {
    /// Another handle to this process's data set (cheap); a copy sent to a worker is
    /// built there anew.
    fn clone(&self) -> Self {
        Self {
            make: self.make,
            dataset: Arc::clone(&self.dataset),
        }
    }
}

impl<D> fmt::Debug for FromFn<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromFn").finish_non_exhaustive()
    }
}

impl<D> Serialize for FromFn<D> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        Code::of(self.make).serialize(s)
    }
}

impl<'de, D> Deserialize<'de> for FromFn<D> {
    fn deserialize<De: Deserializer<'de>>(d: De) -> std::result::Result<Self, De::Error> {
        let make = Code::<fn() -> Result<D>>::deserialize(d)?
            .get()
            .map_err(De::Error::custom)?;
        let dataset = make()
            .map_err(|e| De::Error::custom(format!("building the data set in the worker: {e}")))?;
        Ok(Self {
            make,
            dataset: Arc::new(dataset),
        })
    }
}

/// The loader's `worker_init` hook, as it travels to a worker.
#[derive(Clone, Copy)]
pub(crate) struct InitFn(pub fn(usize));

impl InitFn {
    /// Runs the hook for worker `id`.
    pub(crate) fn call(&self, id: usize) -> std::result::Result<(), String> {
        (self.0)(id);
        Ok(())
    }
}

impl Serialize for InitFn {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        Code::of(self.0).serialize(s)
    }
}

impl<'de> Deserialize<'de> for InitFn {
    fn deserialize<De: Deserializer<'de>>(d: De) -> std::result::Result<Self, De::Error> {
        let f = Code::<fn(usize)>::deserialize(d)?
            .get()
            .map_err(De::Error::custom)?;
        Ok(InitFn(f))
    }
}
