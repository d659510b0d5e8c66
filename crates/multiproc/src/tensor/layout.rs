//! Shape, strides and offset (all in elements), and the arithmetic of views.
//!
//! Invariant checked by [`Layout::check_bounds`]: every element the layout addresses
//! lies inside the storage. All arithmetic on untrusted values is checked.

use smallvec::SmallVec;

use crate::error::{Error, Result};

/// A shape or its strides: inline up to 4 dimensions, so making or receiving a tensor
/// of the usual ranks allocates no `Vec` for them.
pub(crate) type Dims = SmallVec<[usize; 4]>;

/// Most dimensions a tensor may have (also a bound on what a message may claim).
pub(crate) const MAX_DIMS: usize = 64;

/// Where a tensor's elements are in its storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) shape: Dims,
    pub(crate) strides: Dims,
    pub(crate) offset: usize,
}

/// Row-major strides for `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Dims {
    let mut strides = Dims::from_elem(0, shape.len());
    let mut acc = 1usize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

/// The number of elements of `shape`, or an error when it overflows.
pub(crate) fn numel_of(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            Error::Tensor(format!(
                "a tensor of shape {shape:?} has more elements than memory can hold"
            ))
        })
}

impl Layout {
    /// A contiguous layout of `shape` at offset 0.
    pub(crate) fn contiguous(shape: &[usize]) -> Result<Layout> {
        if shape.len() > MAX_DIMS {
            return Err(Error::Tensor(format!(
                "a tensor may have at most {MAX_DIMS} dimensions, not {}",
                shape.len()
            )));
        }
        numel_of(shape)?;
        Ok(Layout {
            shape: Dims::from_slice(shape),
            strides: contiguous_strides(shape),
            offset: 0,
        })
    }

    /// Elements addressed (cannot overflow once [`check_bounds`](Self::check_bounds)
    /// passed; saturates otherwise).
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }

    /// The elements the layout addresses lie in `lo..hi` (both 0-based, in elements);
    /// `lo == hi` when there are none. Meaningful for a layout that passed
    /// [`check_bounds`](Self::check_bounds) (no overflow then).
    pub(crate) fn reach(&self) -> (usize, usize) {
        if self.numel() == 0 {
            return (self.offset, self.offset);
        }
        let last = self
            .shape
            .iter()
            .zip(&self.strides)
            .fold(self.offset, |acc, (&n, &s)| {
                acc.saturating_add((n - 1).saturating_mul(s))
            });
        (self.offset, last.saturating_add(1))
    }

    /// Whether the elements are exactly `offset..offset + numel` in row-major order.
    pub(crate) fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 {
                if s != expected {
                    return false;
                }
                expected = expected.saturating_mul(d);
            }
        }
        true
    }

    /// Checks that every addressed element of `elem_size` bytes lies inside a storage of
    /// `nbytes` bytes.
    pub(crate) fn check_bounds(&self, elem_size: usize, nbytes: usize) -> Result<()> {
        let outside = |what: String| {
            Err(Error::Tensor(format!(
                "shape {:?}, strides {:?} and offset {} {what} (storage of {nbytes} bytes, {elem_size}-byte elements)",
                self.shape, self.strides, self.offset
            )))
        };
        let (shape, strides) = (&self.shape[..], &self.strides[..]);
        if shape.len() != strides.len() {
            return outside(format!(
                "disagree: {} dimensions but {} strides",
                shape.len(),
                strides.len()
            ));
        }
        if shape.len() > MAX_DIMS {
            return outside(format!("have more than {MAX_DIMS} dimensions"));
        }
        // One pass (every tensor operation checks its layout): the element count, and
        // the last element addressed (meaningful only when no dimension is 0).
        let mut numel = Some(1usize);
        let mut last = Some(self.offset);
        for (&d, &s) in shape.iter().zip(strides) {
            numel = numel.and_then(|n| n.checked_mul(d));
            last = last.and_then(|l| d.checked_sub(1)?.checked_mul(s)?.checked_add(l));
        }
        // Even a layout that revisits elements (a zero stride) must describe no more
        // bytes than one buffer can hold, so that copying it out is an allocation that
        // can be attempted rather than an arithmetic overflow.
        let fits = numel
            .and_then(|n| n.checked_mul(elem_size))
            .is_some_and(|b| b <= isize::MAX as usize);
        if !fits {
            return outside("address more elements than memory can hold".into());
        }
        let capacity = nbytes / elem_size;
        if numel == Some(0) {
            return if self.offset <= capacity {
                Ok(())
            } else {
                outside("start past the end of the storage".into())
            };
        }
        match last {
            Some(l) if l < capacity => Ok(()),
            Some(l) => outside(format!(
                "reach element {l}, past the storage's {capacity} elements"
            )),
            None => outside("overflow when computing the last element".into()),
        }
    }

    /// The strides that view this layout's elements as `new_shape` without copying,
    /// if there are any (torch's `computeStride`).
    pub(crate) fn view_strides(&self, new_shape: &[usize]) -> Option<Dims> {
        if self.numel() == 0 {
            return Some(contiguous_strides(new_shape));
        }
        let (old_shape, old_strides): (&[usize], &[usize]) = if self.shape.is_empty() {
            (&[1], &[1])
        } else {
            (&self.shape, &self.strides)
        };
        let mut new_strides = Dims::from_elem(0, new_shape.len());
        let mut view_d = new_shape.len() as isize - 1;
        let mut chunk_base_stride = *old_strides.last()?;
        let mut tensor_numel = 1usize;
        let mut view_numel = 1usize;
        for tensor_d in (0..old_shape.len()).rev() {
            tensor_numel = tensor_numel.checked_mul(old_shape[tensor_d])?;
            let chunk_ends = tensor_d == 0
                || (old_shape[tensor_d - 1] != 1
                    && old_strides[tensor_d - 1] != tensor_numel.checked_mul(chunk_base_stride)?);
            if chunk_ends {
                while view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d as usize] == 1)
                {
                    new_strides[view_d as usize] = view_numel.checked_mul(chunk_base_stride)?;
                    view_numel = view_numel.checked_mul(new_shape[view_d as usize])?;
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = old_strides[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        (view_d == -1).then_some(new_strides)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(shape: &[usize], strides: &[usize], offset: usize) -> Layout {
        Layout {
            shape: Dims::from_slice(shape),
            strides: Dims::from_slice(strides),
            offset,
        }
    }

    #[test]
    fn strides_and_contiguity() {
        assert_eq!(contiguous_strides(&[2, 3, 4]).as_slice(), [12, 4, 1]);
        assert_eq!(contiguous_strides(&[]).as_slice(), [0usize; 0]);
        assert!(layout(&[2, 3], &[3, 1], 5).is_contiguous());
        assert!(!layout(&[3, 2], &[1, 3], 0).is_contiguous());
        assert!(layout(&[3, 1], &[1, 99], 0).is_contiguous());
        assert!(layout(&[0, 4], &[7, 7], 0).is_contiguous());
    }

    #[test]
    fn bounds_are_checked_without_overflow() {
        assert!(layout(&[2, 3], &[3, 1], 0).check_bounds(4, 24).is_ok());
        assert!(layout(&[2, 3], &[3, 1], 1).check_bounds(4, 24).is_err());
        assert!(layout(&[2, 3], &[3, 1], 0).check_bounds(4, 23).is_err());
        assert!(layout(&[2], &[usize::MAX], 0).check_bounds(1, 100).is_err());
        assert!(
            layout(&[usize::MAX, 2], &[1, 1], 0)
                .check_bounds(1, 100)
                .is_err()
        );
        assert!(
            layout(&[1], &[usize::MAX], usize::MAX)
                .check_bounds(1, 100)
                .is_err()
        );
        assert!(layout(&[0], &[1], 4).check_bounds(4, 16).is_ok());
        // A zero stride revisits one element; its size is still bounded.
        assert!(layout(&[1 << 20], &[0], 0).check_bounds(4, 4).is_ok());
        assert!(
            layout(&[usize::MAX / 2], &[0], 0)
                .check_bounds(4, 4)
                .is_err()
        );
        assert!(layout(&[0], &[1], 5).check_bounds(4, 16).is_err());
        assert!(layout(&[2], &[1, 1], 0).check_bounds(4, 16).is_err());
        assert!(layout(&[], &[], 3).check_bounds(4, 16).is_ok());
        assert!(layout(&[], &[], 4).check_bounds(4, 16).is_err());
    }

    #[test]
    fn views_follow_torch() {
        let c = Layout::contiguous(&[2, 3, 4]).unwrap();
        assert_eq!(c.view_strides(&[6, 4]).as_deref(), Some(&[4, 1][..]));
        assert_eq!(c.view_strides(&[24]).as_deref(), Some(&[1][..]));
        assert_eq!(
            c.view_strides(&[1, 24, 1]).as_deref(),
            Some(&[24, 1, 1][..])
        );
        // The transpose of a 2x3 cannot be flattened without a copy.
        let t = layout(&[3, 2], &[1, 3], 0);
        assert_eq!(t.view_strides(&[6]), None);
        // But splitting a dimension of a transposed tensor can.
        let t = layout(&[4, 2], &[1, 4], 0);
        assert_eq!(t.view_strides(&[2, 2, 2]).as_deref(), Some(&[2, 1, 4][..]));
        // A scalar views as ones.
        let s = layout(&[], &[], 0);
        assert_eq!(s.view_strides(&[1, 1]).as_deref(), Some(&[1, 1][..]));
        assert_eq!(s.view_strides(&[]).as_deref(), Some(&[][..]));
    }
}
