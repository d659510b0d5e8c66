//! Reductions to one host value: `sum` and `allclose`, accumulated in `f64`.

use super::dtype::dispatch;
use super::dtype::sealed::Sealed;
use super::raw::{self, Region};
use super::storage::Storage;
use super::{Tensor, read_two};
use crate::error::{Error, Result};

impl Tensor {
    /// The sum of all elements, accumulated in `f64` whatever the dtype (bool counts
    /// `true`s; `i64`/`u64` values beyond 2^53 are rounded). torch returns a 0-d tensor; a
    /// plain `f64` is what Rust callers want.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the elements cannot be read (a storage not aligned for the
    /// dtype, e.g. a DLPack import at an odd address) — never a silent `NaN`.
    pub fn sum(&self) -> Result<f64> {
        let read = self.storage.read();
        dispatch!(self.dtype, T => Ok(raw::sum(&Region::<T>::new(&read, &self.layout)?)))
    }

    /// Whether every element satisfies `|self - other| <= atol + rtol * |other|`
    /// (torch's `allclose`, `equal_nan=False`; torch's defaults are `rtol = 1e-5`,
    /// `atol = 1e-8`). Compared as `f64`, so any two dtypes can be compared.
    ///
    /// # Errors
    ///
    /// [`Error::Tensor`] when the shapes differ (torch raises too) or the elements cannot
    /// be read — never a silent `false`.
    pub fn allclose(&self, other: &Tensor, rtol: f64, atol: f64) -> Result<bool> {
        if self.shape() != other.shape() {
            return Err(Error::Tensor(format!(
                "allclose: shapes {:?} and {:?} differ",
                self.shape(),
                other.shape()
            )));
        }
        let close = |a: f64, b: f64| (a - b).abs() <= atol + rtol * b.abs();
        if self.dtype == other.dtype && !Storage::ptr_eq(&self.storage, &other.storage) {
            let (ra, rb) = read_two(&self.storage, &other.storage);
            dispatch!(self.dtype, T => {
                let (a, b) = (Region::<T>::new(&ra, &self.layout)?, Region::<T>::new(&rb, &other.layout)?);
                raw::all_pairs(&a, &b, |x, y| close(x.to_f64(), y.to_f64()))
            })
        } else {
            let (a, b) = (self.to_f64_vec()?, other.to_f64_vec()?);
            Ok(a.iter().zip(&b).all(|(&x, &y)| close(x, y)))
        }
    }

    /// The elements as `f64`, row-major.
    pub(super) fn to_f64_vec(&self) -> Result<Vec<f64>> {
        let read = self.storage.read();
        dispatch!(self.dtype, T => Ok(raw::read_all(&Region::<T>::new(&read, &self.layout)?)
            .into_iter()
            .map(Sealed::to_f64)
            .collect()))
    }
}
