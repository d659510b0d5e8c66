//! [`SharedRows`]: a data set's large read-only state — an index, offsets, labels,
//! metadata as plain numbers — built once in the loader's process, in shared memory,
//! and reaching every worker by handle.
//!
//! torch copies a data set's Python lists into every worker (and reference counting
//! then dirties the copy-on-write pages, so each worker's memory grows to a full copy).
//! Here the table's bytes live once in a shared segment; a worker maps the same pages,
//! reads rows by copying them out, and adds no private memory for the table.

use std::fmt;
use std::marker::PhantomData;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::tensor::{Element, Tensor};

/// A read-only table of `len()` rows of `width()` plain numbers each, in shared memory.
/// Cloning it, or sending it to a worker inside a data set, shares the table: nothing is
/// copied but a handle.
///
/// ```no_run
/// use multiproc::data::{DataLoader, Dataset, SharedRows};
///
/// /// Sample `i` is the (offset, length) record `i` of a big index, built once.
/// #[derive(Clone, serde::Serialize, serde::Deserialize)]
/// struct Records {
///     index: SharedRows<u64>,
/// }
///
/// impl Dataset for Records {
///     type Item = (i64, i64);
///     fn len(&self) -> usize {
///         self.index.len()
///     }
///     fn get(&self, i: usize) -> multiproc::Result<(i64, i64)> {
///         let row = self.index.row(i)?;
///         Ok((row[0] as i64, row[1] as i64))
///     }
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     let flat: Vec<u64> = (0..1_000_000u64).flat_map(|i| [i * 4096, 4096]).collect();
///     let index = SharedRows::new(&flat, 2)?; // 1,000,000 rows of 2
///     let loader = DataLoader::builder(Records { index }).num_workers(8).build()?;
///     # let _ = loader;
///     Ok(())
/// }
/// ```
pub struct SharedRows<T> {
    table: Tensor,
    width: usize,
    _rows: PhantomData<fn() -> T>,
}

impl<T: Element> SharedRows<T> {
    /// A table of the rows of `width` numbers in `flat` (row after row), copied once
    /// into shared memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `width` is 0 or does not divide `flat.len()`;
    /// the errors of making shared memory (a full `/dev/shm` says so).
    pub fn new(flat: &[T], width: usize) -> Result<Self> {
        if width == 0 || flat.len() % width != 0 {
            return Err(Error::InvalidArgument(format!(
                "shared rows: {} numbers do not make rows of {width}: give a width above 0 \
                 that divides the length",
                flat.len()
            )));
        }
        let rows = flat.len() / width;
        let table = Tensor::from_slice_shared(flat, &[rows, width])?;
        Ok(SharedRows {
            table,
            width,
            _rows: PhantomData,
        })
    }

    /// The number of rows.
    pub fn len(&self) -> usize {
        self.table.shape()[0]
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The numbers per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Row `i`, copied out.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `i` is not below [`len`](Self::len).
    pub fn row(&self, i: usize) -> Result<Vec<T>> {
        self.check(i)?;
        self.table.select(0, i)?.to_vec()
    }

    /// Number `j` of row `i`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `i` or `j` is out of range.
    pub fn get(&self, i: usize, j: usize) -> Result<T> {
        self.check(i)?;
        if j >= self.width {
            return Err(Error::InvalidArgument(format!(
                "shared rows: column {j} is out of range: rows have {} numbers",
                self.width
            )));
        }
        let one = self.table.select(0, i)?.narrow(0, j, 1)?.to_vec::<T>()?;
        one.into_iter()
            .next()
            .ok_or_else(|| Error::Tensor("shared rows: an empty read (a multiproc bug)".into()))
    }

    fn check(&self, i: usize) -> Result<()> {
        if i >= self.len() {
            return Err(Error::InvalidArgument(format!(
                "shared rows: row {i} is out of range: the table has {} rows",
                self.len()
            )));
        }
        Ok(())
    }
}

impl<T> Clone for SharedRows<T> {
    /// Another handle to the same table.
    fn clone(&self) -> Self {
        SharedRows {
            table: self.table.clone(),
            width: self.width,
            _rows: PhantomData,
        }
    }
}

impl<T> fmt::Debug for SharedRows<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRows")
            .field("rows", &self.table.shape().first())
            .field("width", &self.width)
            .field("dtype", &self.table.dtype())
            .finish()
    }
}

impl<T> Serialize for SharedRows<T> {
    /// The table's handle (through a multiproc queue or to a worker), never its rows.
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.table.serialize(s)
    }
}

impl<'de, T: Element> Deserialize<'de> for SharedRows<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let table = Tensor::deserialize(d)?;
        if table.dtype() != T::DTYPE || table.dim() != 2 {
            return Err(D::Error::custom(format!(
                "shared rows: received a {} tensor of shape {:?}, not a table of {} rows",
                table.dtype(),
                table.shape(),
                T::DTYPE
            )));
        }
        let width = table.shape()[1];
        Ok(SharedRows {
            table,
            width,
            _rows: PhantomData,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_read_back_and_bad_shapes_are_refused() {
        let flat: Vec<u32> = (0..12).collect();
        let t = SharedRows::new(&flat, 3).unwrap();
        assert_eq!((t.len(), t.width()), (4, 3));
        assert_eq!(t.row(2).unwrap(), [6, 7, 8]);
        assert_eq!(t.get(3, 1).unwrap(), 10);
        assert!(t.row(4).unwrap_err().to_string().contains("4 rows"));
        assert!(t.get(0, 3).is_err());
        assert!(SharedRows::new(&flat, 5).is_err());
        assert!(SharedRows::<u32>::new(&[], 0).is_err());
    }
}
