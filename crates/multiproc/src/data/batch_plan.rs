//! An epoch's batch plan: the sampler's indices cut into batches, checked against the
//! data set's length, and shown shortened in messages.

use crate::error::{Error, Result};

/// The sampler's indices cut into batches.
pub(super) fn batch_plan(
    indices: Vec<usize>,
    batch_size: usize,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    indices
        .chunks(batch_size)
        .filter(|c| !drop_last || c.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// An error when the sampler gave an index outside the data set's `len` samples.
pub(super) fn check_in_range(indices: &[usize], len: usize) -> Result<()> {
    match indices.iter().find(|&&i| i >= len) {
        None => Ok(()),
        Some(i) => Err(Error::InvalidArgument(format!(
            "data loader: the sampler gave index {i}, but the data set has {len} samples \
             (0..{len}): the sampler's length or indices do not match the data set"
        ))),
    }
}

/// A batch's sample indices for a message (the first 16, then how many more).
pub(super) fn show_indices(indices: &[usize]) -> String {
    const SHOWN: usize = 16;
    if indices.len() <= SHOWN {
        format!("{indices:?}")
    } else {
        let head: Vec<String> = indices[..SHOWN].iter().map(usize::to_string).collect();
        format!("[{}, … {} more]", head.join(", "), indices.len() - SHOWN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_cuts_batches_and_drops_the_short_tail_on_request() {
        assert_eq!(
            batch_plan((0..5).collect(), 2, false),
            [vec![0, 1], vec![2, 3], vec![4]]
        );
        assert_eq!(
            batch_plan((0..5).collect(), 2, true),
            [vec![0, 1], vec![2, 3]]
        );
    }

    #[test]
    fn long_index_lists_are_shortened_in_messages() {
        assert_eq!(show_indices(&[1, 2]), "[1, 2]");
        let long: Vec<usize> = (0..20).collect();
        assert!(show_indices(&long).ends_with("… 4 more]"));
    }
}
