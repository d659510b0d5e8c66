//! Interop with burn (feature `burn`): every dtype to burn's `TensorData` and back, the
//! dtypes only burn has, the zero-copy borrows (`into_burn` on the only handle of a
//! private tensor, the `unsafe` `as_burn` on shared memory) seen through burn's NdArray
//! backend, and a worker that computes with burn on a tensor it received by handle.
//!
//! Every test runs under `common::run` (a deadline, and a leak check of /dev/shm, fds
//! and child processes). Run them with
//! `cargo test -p multiproc --features burn --test burn`.

multiproc::test_init!();

mod common;

// burn 0.22 deprecates its NdArray backend in favour of Flex; it is the one named here.
#[allow(deprecated)]
use burn_ndarray::NdArrayTensor;
use burn_tensor::quantization::QuantScheme;
use burn_tensor::{BoolStore, DType as BurnDType, TensorData};
use common::secs;
use multiproc::{DType, Queue, Tensor};

/// The first byte of what NdArray computes on when it is given `data`, and whether it
/// borrowed it (`None` for the dtypes NdArray does not have: f16, bf16).
#[allow(deprecated)]
fn ndarray_borrow(data: TensorData) -> Option<(bool, *const u8)> {
    macro_rules! seen {
        ($s:expr) => {
            Some(($s.is_borrowed(), $s.view().as_ptr().cast::<u8>()))
        };
    }
    if matches!(data.dtype(), BurnDType::F16 | BurnDType::BF16) {
        return None;
    }
    match NdArrayTensor::from_data(data) {
        NdArrayTensor::F64(s) => seen!(s),
        NdArrayTensor::F32(s) => seen!(s),
        NdArrayTensor::I64(s) => seen!(s),
        NdArrayTensor::I32(s) => seen!(s),
        NdArrayTensor::I16(s) => seen!(s),
        NdArrayTensor::I8(s) => seen!(s),
        NdArrayTensor::U64(s) => seen!(s),
        NdArrayTensor::U32(s) => seen!(s),
        NdArrayTensor::U16(s) => seen!(s),
        NdArrayTensor::U8(s) => seen!(s),
        NdArrayTensor::Bool(s) => seen!(s),
    }
}

#[test]
fn every_dtype_round_trips_and_maps_to_burns_own() {
    common::run(secs(60), || {
        for dtype in DType::ALL {
            let t = Tensor::arange(0.0, 6.0, 1.0, dtype)
                .unwrap()
                .reshape(&[2, 3])
                .unwrap();
            let data = t.to_burn().unwrap();
            assert_eq!(data.shape().as_slice(), [2, 3], "{dtype}");
            let expected = match dtype {
                DType::Bool => "bool",
                DType::F32 => "f32",
                DType::F64 => "f64",
                DType::F16 => "f16",
                DType::BF16 => "bf16",
                DType::I8 => "i8",
                DType::I16 => "i16",
                DType::I32 => "i32",
                DType::I64 => "i64",
                DType::U8 => "u8",
                DType::U16 => "u16",
                DType::U32 => "u32",
                DType::U64 => "u64",
            };
            assert_eq!(data.dtype().name(), expected, "{dtype}");
            let back = Tensor::from_burn(&data).unwrap();
            assert_eq!(back.dtype(), dtype);
            assert!(!back.is_shared());
            assert!(back.allclose(&t, 0.0, 0.0).unwrap(), "{dtype}");
            let shared = Tensor::from_burn_shared(&data).unwrap();
            assert!(shared.is_shared(), "{dtype}");
            assert!(shared.allclose(&t, 0.0, 0.0).unwrap(), "{dtype}");

            // The borrowing forms give the same data, over the tensor's own bytes.
            let private = t.deep_clone().unwrap();
            let at = private.data_ptr().cast_const();
            let borrowed = private.into_burn().unwrap();
            assert_eq!(borrowed, data, "{dtype}");
            assert_eq!(
                borrowed.as_bytes().as_ptr(),
                at,
                "{dtype}: into_burn copied"
            );
            if let Some((is_borrowed, ptr)) = ndarray_borrow(borrowed) {
                assert!(
                    is_borrowed,
                    "{dtype}: NdArray copied the private tensor's bytes"
                );
                assert_eq!(ptr, at, "{dtype}");
            }
            // SAFETY: nothing writes `shared` in this test.
            let viewed = unsafe { shared.as_burn() }.unwrap();
            assert_eq!(viewed, data, "{dtype}");
            let at = shared.data_ptr().cast_const();
            assert_eq!(viewed.as_bytes().as_ptr(), at, "{dtype}: as_burn copied");
            if let Some((is_borrowed, ptr)) = ndarray_borrow(viewed) {
                assert!(is_borrowed, "{dtype}: NdArray copied the shared bytes");
                assert_eq!(ptr, at, "{dtype}: NdArray computes elsewhere");
            }
        }
    });
}

#[test]
fn burn_only_dtypes_are_converted_or_refused_by_name() {
    common::run(secs(60), || {
        // flex32 is stored as f32.
        let bits: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        let f = TensorData::from_bytes_vec(bits, [2], BurnDType::Flex32);
        assert_eq!(f.dtype(), BurnDType::Flex32);
        let t = Tensor::from_burn(&f).unwrap();
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.5, -2.0]);
        // burn's bool(u8) and bool(u32): any non-zero element is true.
        let b8 =
            TensorData::from_bytes_vec(vec![0, 1, 2, 0], [2, 2], BurnDType::Bool(BoolStore::U8));
        let t = Tensor::from_burn_shared(&b8).unwrap();
        assert_eq!((t.dtype(), t.shape()), (DType::Bool, &[2, 2][..]));
        assert!(t.is_shared());
        assert_eq!(t.to_vec::<bool>().unwrap(), [false, true, true, false]);
        let words: Vec<u8> = [0u32, 1, 0x100, 0]
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .collect();
        let b32 = TensorData::from_bytes_vec(words, [4], BurnDType::Bool(BoolStore::U32));
        let t = Tensor::from_burn(&b32).unwrap();
        assert_eq!(t.to_vec::<bool>().unwrap(), [false, true, true, false]);
        // Quantized data has no counterpart.
        let q =
            TensorData::from_bytes_vec(vec![0; 8], [8], BurnDType::QFloat(QuantScheme::default()));
        for err in [Tensor::from_burn(&q), Tensor::from_burn_shared(&q)] {
            let err = err.unwrap_err().to_string();
            assert!(
                err.contains("qfloat") && err.contains("dequantize"),
                "{err}"
            );
        }
        // Empty tensors, both ways.
        let empty = Tensor::zeros(&[0, 3], DType::I32).unwrap();
        let data = empty.clone().into_burn().unwrap();
        assert_eq!(
            (data.shape().as_slice(), data.as_bytes().len()),
            (&[0, 3][..], 0)
        );
        assert_eq!(Tensor::from_burn(&data).unwrap().shape(), [0, 3]);
    });
}

#[test]
fn into_burn_borrows_only_the_only_handle_of_a_private_tensor() {
    common::run(secs(60), || {
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let t = Tensor::from_slice(&values, &[3, 4]).unwrap();
        // A contiguous view of the only handle is borrowed, offset included.
        let rows = t.narrow(0, 1, 2).unwrap();
        drop(t);
        let at = rows.data_ptr().cast_const();
        let data = rows.into_burn().unwrap();
        assert_eq!(data.as_bytes().as_ptr(), at);
        assert_eq!(data.as_slice::<f32>().unwrap(), &values[4..]);
        // burn writes a copy, never the borrowed bytes (copy-on-write)...
        let mut written = data.clone();
        written.as_mut_slice::<f32>().unwrap()[0] = -1.0;
        assert_ne!(written.as_bytes().as_ptr(), at);
        // ...and its clones keep the buffer alive after the tensor is gone.
        assert_eq!(data.clone().as_slice::<f32>().unwrap()[0], 4.0);
        drop(data);

        // Copies: another handle, a shared tensor, a transposed view.
        let t = Tensor::from_slice(&values, &[3, 4]).unwrap();
        let other = t.clone();
        let data = t.into_burn().unwrap();
        assert_ne!(data.as_bytes().as_ptr(), other.data_ptr().cast_const());
        assert_eq!(data.as_slice::<f32>().unwrap(), values);
        other.share_memory_().unwrap();
        let at = other.data_ptr().cast_const();
        let data = other.into_burn().unwrap();
        assert_ne!(data.as_bytes().as_ptr(), at);
        let t = Tensor::from_slice(&values, &[3, 4]).unwrap();
        let data = t.transpose(0, 1).unwrap().into_burn().unwrap();
        assert_eq!(data.shape().as_slice(), [4, 3]);
        assert_eq!(data.as_slice::<f32>().unwrap()[..4], [0.0, 4.0, 8.0, 1.0]);

        // A bool tensor whose bytes are not all 0 or 1 is copied (and read as true).
        let raw = Tensor::from_slice(&[0u8, 2, 1], &[3]).unwrap();
        let storage = raw.storage().clone();
        drop(raw);
        let flags = Tensor::from_storage(storage, DType::Bool, &[3], &[1], 0).unwrap();
        let at = flags.data_ptr().cast_const();
        let data = flags.into_burn().unwrap();
        assert_ne!(data.as_bytes().as_ptr(), at);
        assert_eq!(data.as_slice::<bool>().unwrap(), [false, true, true]);
    });
}

#[test]
fn as_burn_refuses_what_it_cannot_borrow_and_keeps_the_mapping_alive() {
    common::run(secs(60), || {
        let private = Tensor::from_slice(&[1.0f64, 2.0], &[2]).unwrap();
        // SAFETY: refused before anything is borrowed.
        let err = unsafe { private.as_burn() }.unwrap_err().to_string();
        assert!(
            err.contains("private") && err.contains("into_burn"),
            "{err}"
        );

        let shared =
            Tensor::from_slice_shared(&[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        // SAFETY: refused before anything is borrowed.
        let err = unsafe { shared.transpose(0, 1).unwrap().as_burn() }
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("contiguous") && err.contains("to_burn"),
            "{err}"
        );
        let raw = Tensor::from_slice_shared(&[1u8, 3], &[2]).unwrap();
        let flags =
            Tensor::from_storage(raw.storage().clone(), DType::Bool, &[2], &[1], 0).unwrap();
        // SAFETY: refused before anything is borrowed.
        let err = unsafe { flags.as_burn() }.unwrap_err().to_string();
        assert!(err.contains("0 and 1"), "{err}");
        assert_eq!(
            flags.to_burn().unwrap().as_slice::<bool>().unwrap(),
            [true, true]
        );

        // The borrow outlives every multiproc handle: the mapping stays until burn lets go
        // (the leak check at the end sees it unmapped and its segment gone).
        let at = shared.data_ptr().cast_const();
        // SAFETY: nothing writes `shared` (it is dropped right after).
        let data = unsafe { shared.narrow(0, 1, 1).unwrap().as_burn() }.unwrap();
        drop(shared);
        assert_eq!(data.as_bytes().as_ptr(), at.wrapping_add(3 * 8));
        assert_eq!(data.as_slice::<f64>().unwrap(), [4.0, 5.0, 6.0]);
        #[allow(deprecated)]
        let device = burn_tensor::Device::ndarray();
        let row = burn_tensor::Tensor::<2>::from_data(data, (&device, BurnDType::F64));
        let total: f64 = row.sum().into_scalar();
        assert_eq!(total, 15.0);
    });
}

/// Receives weights by handle, computes `weights · ones` with burn on NdArray over the
/// shared bytes, and sends back the product (in shared memory) and where NdArray read
/// the weights.
fn infer(
    _rank: usize,
    (inbox, outbox, seen): (Queue<Tensor>, Queue<Tensor>, Queue<(bool, bool)>),
) -> multiproc::Result<()> {
    let weights = inbox.get()?;
    // SAFETY: the parent does not write the weights until it has the answer, and burn's
    // tensors made from them are dropped before this worker answers.
    let data = unsafe { weights.as_burn() }?;
    let same_bytes = data.as_bytes().as_ptr() == weights.data_ptr().cast_const();
    let borrowed = ndarray_borrow(data.clone())
        .is_some_and(|(b, ptr)| b && ptr == weights.data_ptr().cast_const());
    #[allow(deprecated)]
    let device = burn_tensor::Device::ndarray();
    let w = burn_tensor::Tensor::<2>::from_data(data, (&device, BurnDType::F32));
    let ones = burn_tensor::Tensor::<2>::ones([weights.shape()[1], 1], &device);
    let product = w.matmul(ones).into_data();
    let answer = Tensor::from_burn_shared(&product)?;
    seen.put((same_bytes, borrowed)).map_err(|e| e.error)?;
    outbox.put(answer).map_err(|e| e.error)?;
    Ok(())
}

#[test]
fn a_worker_computes_with_burn_on_a_tensor_it_received_by_handle() {
    common::run(secs(120), || {
        let (inbox, outbox, seen) = (
            Queue::new().unwrap(),
            Queue::new().unwrap(),
            Queue::new().unwrap(),
        );
        let weights: Vec<f32> = (0..64 * 32).map(|i| (i % 7) as f32).collect();
        let w = Tensor::from_slice_shared(&weights, &[64, 32]).unwrap();
        inbox.put(w.clone()).map_err(|e| e.error).unwrap();
        multiproc::spawn(infer, (inbox, outbox.clone(), seen.clone()), 1).unwrap();
        assert_eq!(
            seen.get().unwrap(),
            (true, true),
            "the worker's burn tensor copied"
        );
        let product = outbox.get().unwrap();
        assert!(product.is_shared());
        assert_eq!(product.shape(), [64, 1]);
        let expected: Vec<f32> = weights.chunks(32).map(|row| row.iter().sum()).collect();
        assert_eq!(product.to_vec::<f32>().unwrap(), expected);
        // And the safe copy gives the same numbers here.
        #[allow(deprecated)]
        let device = burn_tensor::Device::ndarray();
        let here = burn_tensor::Tensor::<2>::from_data(w.to_burn().unwrap(), &device)
            .sum_dim(1)
            .into_data();
        assert_eq!(here.as_slice::<f32>().unwrap(), expected);
    });
}
