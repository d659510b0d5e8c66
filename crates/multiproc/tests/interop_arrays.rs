//! Interop with the Rust ML ecosystem, arrays, each part behind its feature: ndarray
//! copies and views (safe and unsafe, in this process and in a worker), candle
//! conversions (every dtype both know, strided tensors, candle-only dtypes). Files and
//! capsules (safetensors, DLPack) are tests/interop_formats.rs.
//!
//! Every test runs under `common::run` (a deadline and a leak check). Run them with
//! `cargo test -p multiproc --features ndarray,candle --test interop_arrays`.

multiproc::test_init!();

mod common;

#[cfg(feature = "ndarray")]
mod ndarray_interop {
    use super::common::{self, secs};
    use multiproc::{DType, Queue, Tensor};
    use ndarray::{Array2, Array3, ArrayD, IxDyn, array, s};

    #[test]
    fn from_ndarray_honours_strides_and_to_ndarray_round_trips() {
        common::run(secs(60), || {
            let a = Array3::from_shape_fn((2, 3, 4), |(i, j, k)| (i * 100 + j * 10 + k) as f32);
            let t = Tensor::from_ndarray(&a).unwrap();
            assert_eq!(t.shape(), [2, 3, 4]);
            assert!(!t.is_shared());
            assert_eq!(t.to_ndarray::<f32>().unwrap(), a.clone().into_dyn());
            // A permuted, reversed and stepped view: the logical order is what counts.
            let v = a.slice(s![.., ..;-1, ..;2]).permuted_axes([2, 0, 1]);
            let t = Tensor::from_ndarray_shared(&v).unwrap();
            assert!(t.is_shared());
            assert_eq!(t.shape(), v.shape());
            assert_eq!(t.to_ndarray::<f32>().unwrap(), v.to_owned().into_dyn());
            // Every dtype both sides have.
            let b = array![[true, false], [false, true]];
            assert_eq!(
                Tensor::from_ndarray(&b).unwrap().to_vec::<bool>().unwrap(),
                [true, false, false, true]
            );
            let u = array![1u64 << 60, 7];
            assert_eq!(Tensor::from_ndarray(&u).unwrap().dtype(), DType::U64);
            // The dtype is checked on the way out.
            let err = t.to_ndarray::<f64>().unwrap_err().to_string();
            assert!(err.contains("float32"), "{err}");
        });
    }

    /// Writes `value * identity` into the shared parameters it was given.
    fn write_identity(_rank: usize, (params, value): (Tensor, f64)) -> multiproc::Result<()> {
        let n = params.shape()[0];
        params.copy_from_ndarray(&(Array2::<f64>::eye(n) * value))?;
        Ok(())
    }

    #[test]
    fn copy_from_ndarray_writes_into_a_tensor_another_process_holds() {
        common::run(secs(90), || {
            let params = Tensor::zeros_shared(&[3, 3], DType::F64).unwrap();
            multiproc::spawn(write_identity, (params.clone(), 2.0), 1).unwrap();
            let seen = params.to_ndarray::<f64>().unwrap();
            assert_eq!(seen, (Array2::<f64>::eye(3) * 2.0).into_dyn());
            // And the other way: the parent writes a transposed array into a view.
            let col = params.select(1, 0).unwrap();
            col.copy_from_ndarray(&array![7.0, 8.0, 9.0]).unwrap();
            assert_eq!(
                params.to_vec::<f64>().unwrap()[..5],
                [7.0, 0.0, 0.0, 8.0, 2.0]
            );
            let err = params
                .copy_from_ndarray(&Array2::<f64>::zeros((2, 2)))
                .unwrap_err();
            assert!(err.to_string().contains("[2, 2]"), "{err}");
            let err = params.copy_from_slice(&[1.0f32; 9]).unwrap_err();
            assert!(err.to_string().contains("float32"), "{err}");
        });
    }

    #[test]
    fn the_safe_views_need_the_only_handle_on_a_private_tensor() {
        common::run(secs(60), || {
            let mut t = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3]).unwrap();
            assert_eq!(t.array_view::<i32>().unwrap().sum(), 21);
            t.array_view_mut::<i32>().unwrap()[[1, 2]] = 60;
            assert_eq!(t.to_vec::<i32>().unwrap()[5], 60);
            // A transposed view is still a view (strides honoured, no copy).
            let mut tt = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3])
                .unwrap()
                .transpose(0, 1)
                .unwrap();
            assert_eq!(
                tt.array_view::<i32>().unwrap(),
                array![[1, 4], [2, 5], [3, 6]].into_dyn()
            );
            // Another handle exists: another thread could write, so no safe view.
            let other = t.clone();
            let err = t.array_view::<i32>().unwrap_err().to_string();
            assert!(err.contains("other handles"), "{err}");
            drop(other);
            // Shared: another process could write.
            t.share_memory_().unwrap();
            let err = t.array_view_mut::<i32>().unwrap_err().to_string();
            assert!(err.contains("shared"), "{err}");
            let err = t.array_view::<f32>().unwrap_err().to_string();
            assert!(err.contains("shared"), "{err}");
            // An empty tensor whose other sizes pass what ndarray can hold: an error,
            // where ndarray's precondition would be broken.
            let mut huge = Tensor::zeros(&[0, 1 << 33, 1 << 33], DType::U8).unwrap();
            let err = huge.array_view::<u8>().unwrap_err().to_string();
            assert!(err.contains("isize::MAX"), "{err}");
            assert!(huge.array_view_mut::<u8>().is_err());
            let mut empty = Tensor::zeros(&[0, 3], DType::U8).unwrap();
            assert_eq!(empty.array_view::<u8>().unwrap().shape(), [0, 3]);
        });
    }

    #[test]
    fn unsafe_views_refuse_a_private_tensor_whose_bytes_would_move() {
        common::run(secs(60), || {
            let t = Tensor::arange(0.0, 8.0, 1.0, DType::F32).unwrap();
            // SAFETY: refused before any borrow is made.
            let err = unsafe { t.as_array_view::<f32>() }.unwrap_err().to_string();
            assert!(err.contains("move"), "{err}");
            t.share_memory_().unwrap();
            let before = t.data_ptr();
            {
                // SAFETY: no other thread or process writes `t` while the view lives.
                let v = unsafe { t.as_array_view::<f32>() }.unwrap();
                assert_eq!(v.sum(), 28.0);
                assert_eq!(v.as_ptr() as *mut u8, before);
            }
            {
                let middle = t.narrow(0, 2, 3).unwrap();
                // SAFETY: nothing else reads or writes `t` while the view lives.
                let mut v = unsafe { middle.as_array_view_mut::<f32>() }.unwrap();
                v.fill(-1.0);
            }
            assert_eq!(
                t.to_vec::<f32>().unwrap(),
                [0.0, 1.0, -1.0, -1.0, -1.0, 5.0, 6.0, 7.0]
            );
            // A layout that addresses an element twice cannot be viewed mutably.
            let broadcast =
                Tensor::from_storage(t.storage().clone(), DType::F32, &[3, 2], &[0, 1], 0).unwrap();
            // SAFETY: refused before any borrow is made.
            let err = unsafe { broadcast.as_array_view_mut::<f32>() }
                .unwrap_err()
                .to_string();
            assert!(err.contains("twice"), "{err}");
            // SAFETY: nothing writes `t` while the view lives.
            let v = unsafe { broadcast.as_array_view::<f32>() }.unwrap();
            assert_eq!(
                v,
                ArrayD::from_shape_vec(IxDyn(&[3, 2]), vec![0.0, 1.0, 0.0, 1.0, 0.0, 1.0]).unwrap()
            );
        });
    }

    /// Receives a tensor and answers the sum of its ndarray view.
    fn view_sum(
        _rank: usize,
        (inbox, outbox): (Queue<Tensor>, Queue<f64>),
    ) -> multiproc::Result<()> {
        let t = inbox.get()?;
        // SAFETY: the parent does not write the tensor after sending it.
        let sum = unsafe { t.as_array_view::<f64>() }?.sum();
        outbox.put(sum).map_err(|e| e.error)?;
        Ok(())
    }

    #[test]
    fn a_received_tensor_is_viewed_in_place_by_a_worker() {
        common::run(secs(90), || {
            let (inbox, outbox) = (Queue::new().unwrap(), Queue::new().unwrap());
            let t = Tensor::from_ndarray_shared(&Array2::<f64>::from_elem((64, 64), 0.5)).unwrap();
            inbox.put(t).map_err(|e| e.error).unwrap();
            multiproc::spawn(view_sum, (inbox, outbox.clone()), 1).unwrap();
            assert_eq!(outbox.get().unwrap(), 2048.0);
        });
    }
}

#[cfg(feature = "candle")]
mod candle_interop {
    use super::common::{self, secs};
    use candle_core::{Device, IndexOp};
    use multiproc::{DType, Tensor};

    #[test]
    fn every_dtype_both_sides_know_round_trips() {
        common::run(secs(60), || {
            for dtype in DType::ALL {
                let t = Tensor::arange(0.0, 6.0, 1.0, dtype)
                    .unwrap()
                    .reshape(&[2, 3])
                    .unwrap();
                match t.to_candle() {
                    Ok(c) => {
                        assert_eq!(c.dims(), [2, 3], "{dtype}");
                        let back = Tensor::from_candle(&c).unwrap();
                        assert_eq!(back.dtype(), dtype);
                        assert!(back.allclose(&t, 0.0, 0.0).unwrap(), "{dtype}");
                        let shared = Tensor::from_candle_shared(&c).unwrap();
                        assert!(
                            shared.is_shared() && shared.allclose(&t, 0.0, 0.0).unwrap(),
                            "{dtype}"
                        );
                    }
                    Err(e) => {
                        assert!(
                            matches!(dtype, DType::I8 | DType::U16 | DType::U64 | DType::Bool),
                            "{dtype}: {e}"
                        );
                        assert!(e.to_string().contains(dtype.name()), "{e}");
                    }
                }
            }
        });
    }

    #[test]
    fn strided_candle_tensors_and_candle_only_dtypes() {
        common::run(secs(60), || {
            let c = candle_core::Tensor::arange(0f32, 12.0, &Device::Cpu)
                .unwrap()
                .reshape((3, 4))
                .unwrap();
            let ct = c.t().unwrap().i((1..3, ..)).unwrap();
            let t = Tensor::from_candle(&ct).unwrap();
            assert_eq!(t.shape(), [2, 3]);
            assert_eq!(
                t.to_vec::<f32>().unwrap(),
                ct.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
            // A strided multiproc view goes out in logical order.
            let mp = Tensor::arange(0.0, 12.0, 1.0, DType::F32)
                .unwrap()
                .reshape(&[3, 4])
                .unwrap();
            let out = mp.transpose(0, 1).unwrap().to_candle().unwrap();
            assert_eq!(
                out.to_vec2::<f32>().unwrap(),
                c.t().unwrap().to_vec2::<f32>().unwrap()
            );
            // candle's argmax answers u32.
            let best = c.argmax(1).unwrap();
            assert_eq!(
                Tensor::from_candle(&best).unwrap().to_vec::<u32>().unwrap(),
                [3, 3, 3]
            );
            let f8 = c.to_dtype(candle_core::DType::F8E4M3).unwrap();
            let err = Tensor::from_candle(&f8).unwrap_err().to_string();
            assert!(err.contains("f8e4m3"), "{err}");
        });
    }
}
