//! Collating samples into a batch: the [`Collate`] trait, and [`DefaultCollate`], which
//! stacks through the [`Stack`] trait.
//!
//! Invariant: the default collate writes each sample's bytes once, into a batch tensor
//! made in shared memory ([`Tensor::empty_shared`]); sending that batch to the loader
//! sends its handle, so a batch crosses from worker to trainer with no other copy.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::tensors::{Tensors, VisitTensors};
use crate::error::{Error, Result};
#[cfg(test)]
use crate::tensor::DType;
use crate::tensor::{Element, Tensor};

/// Turns the samples of one batch into the batch (torch's `collate_fn`).
///
/// The collate function runs in the workers, so it travels like the data set.
pub trait Collate<Item>: Serialize + DeserializeOwned + Clone {
    /// What one batch is.
    type Batch: Serialize + DeserializeOwned;

    /// The batch of `items`, in sampler order (never empty).
    ///
    /// # Errors
    /// When the samples cannot be combined (shapes differ, memory is short).
    fn collate(&self, items: Vec<Item>) -> Result<Self::Batch>;

    /// How the loader reaches a batch's tensors, for
    /// [`pin_memory`](super::DataLoaderBuilder::pin_memory) and
    /// [`prefetch_to`](super::DataLoaderBuilder::prefetch_to): `None` (the default)
    /// when this collate does not say, and then those options are an error at
    /// `build`. For a batch type that implements [`Tensors`]:
    /// `Some(Tensors::visit_tensors)`.
    fn batch_tensors(&self) -> Option<VisitTensors<Self::Batch>> {
        None
    }
}

/// The default collate: [`Stack::stack`] the samples.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct DefaultCollate;

impl<I: Stack> Collate<I> for DefaultCollate {
    type Batch = I::Stacked;

    fn collate(&self, items: Vec<I>) -> Result<I::Stacked> {
        I::stack(items)
    }

    fn batch_tensors(&self) -> Option<VisitTensors<I::Stacked>> {
        I::stacked_tensors()
    }
}

/// A sample type the default collate can stack into a batch, like torch's
/// `default_collate`: tensors stack along a new first dimension, numbers become a 1-D
/// tensor, and tuples stack field by field.
///
/// For a struct, stack its fields:
///
/// ```
/// use multiproc::Tensor;
/// use multiproc::data::Stack;
///
/// struct Sample {
///     image: Tensor,
///     label: i64,
/// }
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Batch {
///     images: Tensor,
///     labels: Tensor,
/// }
///
/// impl Stack for Sample {
///     type Stacked = Batch;
///     fn stack(items: Vec<Sample>) -> multiproc::Result<Batch> {
///         let (images, labels): (Vec<_>, Vec<_>) =
///             items.into_iter().map(|s| (s.image, s.label)).unzip();
///         Ok(Batch { images: Tensor::stack(images)?, labels: i64::stack(labels)? })
///     }
/// }
/// ```
pub trait Stack: Sized {
    /// The batch of many of these.
    type Stacked: Serialize + DeserializeOwned;

    /// Stacks `items` (at least one) into a batch.
    ///
    /// # Errors
    /// When the items cannot be stacked (tensors of different shapes or dtypes).
    fn stack(items: Vec<Self>) -> Result<Self::Stacked>;

    /// How the loader reaches the tensors of a stacked batch (see
    /// [`Collate::batch_tensors`]); `None` (the default) when the type does not say.
    /// For a `Stacked` type that implements [`Tensors`]: `Some(Tensors::visit_tensors)`.
    fn stacked_tensors() -> Option<VisitTensors<Self::Stacked>> {
        None
    }
}

impl Stack for Tensor {
    type Stacked = Tensor;

    fn stack(items: Vec<Tensor>) -> Result<Tensor> {
        stack_tensors(&items)
    }

    fn stacked_tensors() -> Option<VisitTensors<Tensor>> {
        Some(Tensor::visit_tensors)
    }
}

/// Stacks tensors of one shape and dtype along a new first dimension, into a tensor
/// made in shared memory: each sample is copied once, where the receiver will read it.
fn stack_tensors(items: &[Tensor]) -> Result<Tensor> {
    let Some(first) = items.first() else {
        return Err(Error::InvalidArgument(
            "cannot stack an empty list of tensors: a batch has at least one sample".into(),
        ));
    };
    if let Some((i, t)) = items
        .iter()
        .enumerate()
        .find(|(_, t)| t.shape() != first.shape() || t.dtype() != first.dtype())
    {
        return Err(Error::Tensor(format!(
            "cannot stack sample {i} ({} {:?}) with sample 0 ({} {:?}): every sample of a \
             batch needs the same shape and dtype (resize or pad them, or write a Collate)",
            t.dtype(),
            t.shape(),
            first.dtype(),
            first.shape()
        )));
    }
    let mut shape = Vec::with_capacity(first.dim() + 1);
    shape.push(items.len());
    shape.extend_from_slice(first.shape());
    let batch = Tensor::empty_shared(&shape, first.dtype())?;
    for (i, t) in items.iter().enumerate() {
        batch.select(0, i)?.copy_(t)?;
    }
    Ok(batch)
}

/// Numbers stack into a 1-D shared tensor of their dtype.
fn stack_numbers<T: Element>(items: &[T]) -> Result<Tensor> {
    let batch = Tensor::empty_shared(&[items.len()], T::DTYPE)?;
    batch.copy_(&Tensor::from_slice(items, &[items.len()])?)?;
    Ok(batch)
}

macro_rules! stack_number {
    ($($t:ty),*) => {$(
        impl Stack for $t {
            type Stacked = Tensor;

            fn stack(items: Vec<$t>) -> Result<Tensor> {
                stack_numbers(&items)
            }

            fn stacked_tensors() -> Option<VisitTensors<Tensor>> {
                Some(Tensor::visit_tensors)
            }
        }
    )*};
}

stack_number!(u8, i8, i16, i32, i64, f32, f64, bool);

/// `usize` indices and labels stack as `I64`, torch's default for Python ints.
impl Stack for usize {
    type Stacked = Tensor;

    fn stack(items: Vec<usize>) -> Result<Tensor> {
        let values = items
            .iter()
            .map(|&v| {
                i64::try_from(v).map_err(|_| {
                    Error::Tensor(format!("cannot stack {v} as an I64 label: it is too large"))
                })
            })
            .collect::<Result<Vec<i64>>>()?;
        stack_numbers(&values)
    }

    fn stacked_tensors() -> Option<VisitTensors<Tensor>> {
        Some(Tensor::visit_tensors)
    }
}

macro_rules! stack_tuple {
    ($($name:ident $vec:ident),+) => {
        impl<$($name: Stack),+> Stack for ($($name,)+) {
            type Stacked = ($($name::Stacked,)+);

            fn stack(items: Vec<Self>) -> Result<Self::Stacked> {
                $(let mut $vec = Vec::with_capacity(items.len());)+
                for ($($name,)+) in items {
                    $($vec.push($name);)+
                }
                Ok(($($name::stack($vec)?,)+))
            }

            fn stacked_tensors() -> Option<VisitTensors<Self::Stacked>> {
                // Every field must say how, or the tuple cannot.
                $($name::stacked_tensors()?;)+
                Some(|batch, f| {
                    let ($($vec,)+) = batch;
                    $(if let Some(visit) = $name::stacked_tensors() {
                        visit($vec, f)?;
                    })+
                    Ok(())
                })
            }
        }
    };
}

#[allow(non_snake_case)]
mod tuples {
    use super::{Result, Stack, VisitTensors};
    stack_tuple!(A a);
    stack_tuple!(A a, B b);
    stack_tuple!(A a, B b, C c);
    stack_tuple!(A a, B b, C c, D d);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_and_labels_stack_into_shared_batches() {
        let items: Vec<(Tensor, i64)> = (0..3)
            .map(|i| (Tensor::full(&[2, 2], i as f64, DType::F32).unwrap(), i))
            .collect();
        let (x, y) = DefaultCollate.collate(items).unwrap();
        assert_eq!(x.shape(), [3, 2, 2]);
        assert!(x.is_shared() && y.is_shared());
        assert_eq!(
            x.to_vec::<f32>().unwrap(),
            [0., 0., 0., 0., 1., 1., 1., 1., 2., 2., 2., 2.]
        );
        assert_eq!(y.to_vec::<i64>().unwrap(), [0, 1, 2]);
    }

    #[test]
    fn samples_of_different_shapes_are_an_error_naming_them() {
        let a = Tensor::zeros(&[2], DType::F32).unwrap();
        let b = Tensor::zeros(&[3], DType::F32).unwrap();
        let err = Tensor::stack(vec![a, b]).unwrap_err().to_string();
        assert!(err.contains("sample 1") && err.contains("[3]"), "{err}");
    }
}
