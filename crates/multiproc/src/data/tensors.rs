//! [`Tensors`]: a batch type that hands over the tensors it holds, so that the loader
//! can page-lock them ([`pin_memory`](super::DataLoaderBuilder::pin_memory)) or replace
//! them with their copies on a device
//! ([`prefetch_to`](super::DataLoaderBuilder::prefetch_to)).

use crate::error::Result;
use crate::tensor::Tensor;

/// How to reach a batch's tensors: hands each to the function, in a fixed order, and
/// stops at its first error. What [`Collate::batch_tensors`](super::Collate::batch_tensors)
/// returns.
pub type VisitTensors<B> = fn(&mut B, &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()>;

/// A value made of tensors (a batch): hands each of them over, mutably, so the loader
/// can pin them or replace them with device copies. Implemented for [`Tensor`], tuples
/// of up to 6, `Vec`, arrays, `Option` and `Box` of such values.
///
/// For a struct, hand over its fields:
///
/// ```
/// use multiproc::Tensor;
/// use multiproc::data::Tensors;
///
/// struct Batch {
///     images: Tensor,
///     labels: Tensor,
///     ids: Vec<u64>, // not a tensor: stays as it is
/// }
///
/// impl Tensors for Batch {
///     fn visit_tensors(
///         &mut self,
///         f: &mut dyn FnMut(&mut Tensor) -> multiproc::Result<()>,
///     ) -> multiproc::Result<()> {
///         f(&mut self.images)?;
///         f(&mut self.labels)
///     }
/// }
/// ```
pub trait Tensors {
    /// Hands each tensor to `f`, in a fixed order; stops at the first error.
    ///
    /// # Errors
    /// The first error of `f`.
    fn visit_tensors(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()>;
}

impl Tensors for Tensor {
    fn visit_tensors(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(self)
    }
}

impl<T: Tensors> Tensors for Vec<T> {
    fn visit_tensors(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.iter_mut().try_for_each(|t| t.visit_tensors(f))
    }
}

impl<T: Tensors, const N: usize> Tensors for [T; N] {
    fn visit_tensors(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.iter_mut().try_for_each(|t| t.visit_tensors(f))
    }
}

impl<T: Tensors> Tensors for Option<T> {
    fn visit_tensors(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        self.as_mut().map_or(Ok(()), |t| t.visit_tensors(f))
    }
}

impl<T: Tensors + ?Sized> Tensors for Box<T> {
    fn visit_tensors(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        (**self).visit_tensors(f)
    }
}

macro_rules! tensors_tuple {
    ($($name:ident $field:tt),+) => {
        impl<$($name: Tensors),+> Tensors for ($($name,)+) {
            fn visit_tensors(
                &mut self,
                f: &mut dyn FnMut(&mut Tensor) -> Result<()>,
            ) -> Result<()> {
                $(self.$field.visit_tensors(f)?;)+
                Ok(())
            }
        }
    };
}

tensors_tuple!(A 0);
tensors_tuple!(A 0, B 1);
tensors_tuple!(A 0, B 1, C 2);
tensors_tuple!(A 0, B 1, C 2, D 3);
tensors_tuple!(A 0, B 1, C 2, D 3, E 4);
tensors_tuple!(A 0, B 1, C 2, D 3, E 4, F 5);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    #[test]
    fn nested_batches_hand_over_every_tensor_in_order() {
        let t = |v: f64| Tensor::full(&[1], v, DType::F32).unwrap();
        let mut batch = (t(0.0), vec![t(1.0), t(2.0)], Some([t(3.0)]), None::<Tensor>);
        let mut seen = Vec::new();
        batch
            .visit_tensors(&mut |x| {
                seen.push(x.to_vec::<f32>()?[0]);
                *x = Tensor::full(&[1], 9.0, DType::F32)?;
                Ok(())
            })
            .unwrap();
        assert_eq!(seen, [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(
            batch.1[1].to_vec::<f32>().unwrap(),
            [9.0],
            "replaced in place"
        );
    }
}
