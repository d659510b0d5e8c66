//! Tensor construction, views and operations in one process.

use half::{bf16, f16};

use super::*;

// ----- construction -----

#[test]
fn constructors_give_expected_values() {
    let z = Tensor::zeros(&[2, 3], DType::F32).unwrap();
    assert_eq!(z.shape(), [2, 3]);
    assert_eq!(z.strides(), [3, 1]);
    assert_eq!(z.numel(), 6);
    assert_eq!(z.dim(), 2);
    assert_eq!(z.storage().nbytes(), 24);
    assert_eq!(f32s(&z), [0.0; 6]);
    assert_eq!(
        Tensor::ones(&[3], DType::I64)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        [1, 1, 1]
    );
    assert_eq!(
        Tensor::full(&[2], 2.5, DType::F16)
            .unwrap()
            .to_vec::<f16>()
            .unwrap(),
        [f16::from_f32(2.5); 2]
    );
    assert_eq!(
        Tensor::full(&[2], 1.0, DType::Bool)
            .unwrap()
            .to_vec::<bool>()
            .unwrap(),
        [true, true]
    );
    assert_eq!(
        Tensor::arange(0.0, 5.0, 2.0, DType::I32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        [0, 2, 4]
    );
    assert_eq!(
        f32s(&Tensor::arange(1.0, 0.0, -0.25, DType::F32).unwrap()),
        [1.0, 0.75, 0.5, 0.25]
    );
    assert_eq!(
        Tensor::arange(3.0, 0.0, 1.0, DType::F32).unwrap().numel(),
        0
    );
    let t = Tensor::from_vec(vec![1u8, 2, 3, 4], &[2, 2]).unwrap();
    assert_eq!(t.dtype(), DType::U8);
    assert_eq!(t.to_vec::<u8>().unwrap(), [1, 2, 3, 4]);
    let s = Tensor::from_slice(&[bf16::ONE, bf16::ZERO], &[2]).unwrap();
    assert_eq!(s.to_vec::<bf16>().unwrap(), [bf16::ONE, bf16::ZERO]);
    let scalar = Tensor::from_vec(vec![7.0f64], &[]).unwrap();
    assert_eq!(
        (scalar.dim(), scalar.numel(), scalar.sum().unwrap()),
        (0, 1, 7.0)
    );
}

#[test]
fn bad_constructor_arguments_are_errors() {
    assert!(is_tensor_error(Tensor::from_vec(vec![1.0f32; 5], &[2, 3])).contains("5 values"));
    assert!(is_tensor_error(Tensor::full(&[2], 1.5, DType::I32)).contains("1.5"));
    is_tensor_error(Tensor::full(&[2], 256.0, DType::U8));
    is_tensor_error(Tensor::full(&[2], 2.0, DType::Bool));
    is_tensor_error(Tensor::full(&[2], 1e10, DType::F16));
    is_tensor_error(Tensor::arange(0.0, 1.0, 0.0, DType::F32));
    is_tensor_error(Tensor::zeros(&[usize::MAX, 2], DType::F32));
    is_tensor_error(Tensor::zeros(&[usize::MAX / 2], DType::F64));
    if !cfg!(miri) {
        // Miri stops at an allocation this large instead of failing it.
        is_tensor_error(Tensor::zeros(&[1 << 62], DType::U8));
    }
    is_tensor_error(Tensor::zeros(&[1; 65], DType::U8));
    let t = Tensor::zeros(&[2], DType::F32).unwrap();
    assert!(is_tensor_error(t.to_vec::<f64>()).contains("float32"));
}

#[test]
fn from_storage_checks_bounds() {
    let storage = Storage::new(24).unwrap();
    let ok = Tensor::from_storage(storage.clone(), DType::F32, &[2, 3], &[3, 1], 0).unwrap();
    assert!(Storage::ptr_eq(ok.storage(), &storage));
    Tensor::from_storage(storage.clone(), DType::F32, &[3, 2], &[1, 3], 0).unwrap();
    is_tensor_error(Tensor::from_storage(
        storage.clone(),
        DType::F32,
        &[2, 3],
        &[3, 1],
        1,
    ));
    is_tensor_error(Tensor::from_storage(
        storage.clone(),
        DType::F64,
        &[2, 3],
        &[3, 1],
        0,
    ));
    is_tensor_error(Tensor::from_storage(
        storage.clone(),
        DType::F32,
        &[2],
        &[1, 1],
        0,
    ));
    is_tensor_error(Tensor::from_storage(
        storage.clone(),
        DType::U8,
        &[2],
        &[usize::MAX],
        0,
    ));
    Tensor::from_storage(storage, DType::F32, &[0, 9], &[100, 100], 6).unwrap();
}

// ----- views -----

#[test]
fn views_address_the_expected_elements() {
    let g = grid();
    assert_eq!(f32s(&g.narrow(1, 1, 2).unwrap()), [1., 2., 5., 6., 9., 10.]);
    assert_eq!(f32s(&g.narrow(0, 2, 1).unwrap()), [8., 9., 10., 11.]);
    assert_eq!(g.narrow(0, 3, 0).unwrap().numel(), 0);
    let col = g.select(1, 2).unwrap();
    assert_eq!(
        (col.shape(), col.strides(), col.storage_offset()),
        (&[3][..], &[4][..], 2)
    );
    assert_eq!(f32s(&col), [2., 6., 10.]);
    assert_eq!(f32s(&g.select(0, 1).unwrap()), [4., 5., 6., 7.]);
    let t = g.transpose(0, 1).unwrap();
    assert_eq!(t.shape(), [4, 3]);
    assert!(!t.is_contiguous());
    assert_eq!(f32s(&t), [0., 4., 8., 1., 5., 9., 2., 6., 10., 3., 7., 11.]);
    assert_eq!(f32s(&t.select(0, 3).unwrap()), [3., 7., 11.]);
    assert_eq!(
        f32s(&g.view(&[2, 6]).unwrap().select(0, 1).unwrap()),
        [6., 7., 8., 9., 10., 11.]
    );
    assert_eq!(f32s(&g.view(&[12]).unwrap()), f32s(&g));
}

#[test]
fn views_of_empty_tensors_are_empty_views_as_in_torch() {
    // Another dimension is 0: every index below a dimension's size is valid, and the
    // view addresses nothing (the start may lie past the end of the empty storage).
    let t = Tensor::zeros(&[2, 0, 3], DType::F32).unwrap();
    let s = t.select(0, 1).unwrap();
    assert_eq!((s.shape(), s.numel()), (&[0, 3][..], 0));
    let n = t.narrow(0, 1, 1).unwrap();
    assert_eq!((n.shape(), n.numel()), (&[1, 0, 3][..], 0));
    assert_eq!(t.narrow(2, 1, 2).unwrap().shape(), [2, 0, 2]);
    assert_eq!(t.select(2, 2).unwrap().shape(), [2, 0]);
    let u = Tensor::zeros(&[4, 0], DType::I64).unwrap();
    assert_eq!(u.select(0, 3).unwrap().shape(), [0]);
    assert_eq!(u.select(0, 3).unwrap().sum().unwrap(), 0.0);
    // Sizes whose strides overflow a product with the index: still an empty view.
    let huge = 1usize << 33;
    let h = Tensor::zeros(&[0, huge, huge], DType::U8).unwrap();
    assert_eq!(h.select(1, huge - 1).unwrap().shape(), [0, huge]);
    assert_eq!(h.narrow(2, huge - 1, 1).unwrap().shape(), [0, huge, 1]);
    // An index at or past the size is still refused.
    is_tensor_error(t.select(0, 2));
    is_tensor_error(t.narrow(0, 2, 1));
}

#[test]
fn view_refuses_what_needs_a_copy_and_reshape_copies() {
    let t = grid().transpose(0, 1).unwrap();
    assert!(is_tensor_error(t.view(&[12])).contains("reshape"));
    is_tensor_error(grid().view(&[5, 2]));
    let flat = t.reshape(&[12]).unwrap();
    assert!(
        !Storage::ptr_eq(flat.storage(), t.storage()),
        "reshape copied"
    );
    assert_eq!(
        f32s(&flat),
        [0., 4., 8., 1., 5., 9., 2., 6., 10., 3., 7., 11.]
    );
    let g = grid();
    let v = g.reshape(&[4, 3]).unwrap();
    assert!(Storage::ptr_eq(v.storage(), g.storage()), "reshape viewed");
    let c = t.contiguous().unwrap();
    assert!(c.is_contiguous());
    assert_eq!(f32s(&c), f32s(&t));
    assert!(Storage::ptr_eq(
        g.contiguous().unwrap().storage(),
        g.storage()
    ));
}

#[test]
fn view_arguments_out_of_range_are_errors() {
    let g = grid();
    is_tensor_error(g.narrow(2, 0, 1));
    is_tensor_error(g.narrow(1, 3, 2));
    is_tensor_error(g.narrow(1, usize::MAX, 2));
    is_tensor_error(g.select(0, 3));
    is_tensor_error(g.transpose(0, 2));
}

#[test]
fn writes_through_views_reach_the_base() {
    let g = grid();
    g.select(1, 0).unwrap().fill_(-1.0).unwrap();
    g.narrow(0, 1, 1).unwrap().add_scalar_(100.0).unwrap();
    g.transpose(0, 1)
        .unwrap()
        .select(0, 3)
        .unwrap()
        .mul_scalar_(2.0)
        .unwrap();
    assert_eq!(
        f32s(&g),
        [-1., 1., 2., 6., 99., 105., 106., 214., -1., 9., 10., 22.]
    );
}

// ----- operations -----

#[test]
fn in_place_operations() {
    let a = Tensor::from_vec(vec![1.0f64, 2., 3., 4.], &[2, 2]).unwrap();
    let b = Tensor::from_vec(vec![10.0f64, 20., 30., 40.], &[2, 2]).unwrap();
    a.add_(&b, 0.5).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), [6., 12., 18., 24.]);
    a.mul_(&b.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), [60., 360., 360., 960.]);
    a.copy_(&b.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), [10., 30., 20., 40.]);
    a.add_scalar_(1.0).unwrap();
    a.mul_scalar_(-1.0).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), [-11., -31., -21., -41.]);
    is_tensor_error(a.add_(&Tensor::zeros(&[4], DType::F64).unwrap(), 1.0));
    is_tensor_error(a.add_(&Tensor::zeros(&[2, 2], DType::F32).unwrap(), 1.0));
}

#[test]
fn integer_and_bool_arithmetic() {
    let a = Tensor::from_vec(vec![i8::MAX, 1, -3], &[3]).unwrap();
    a.add_scalar_(1.0).unwrap();
    assert_eq!(a.to_vec::<i8>().unwrap(), [i8::MIN, 2, -2], "wrapping");
    a.add_(&Tensor::from_vec(vec![1i8, 1, 1], &[3]).unwrap(), 3.0)
        .unwrap();
    assert_eq!(a.to_vec::<i8>().unwrap(), [-125, 5, 1]);
    is_tensor_error(a.add_scalar_(0.5));
    is_tensor_error(a.add_(&a.deep_clone().unwrap(), 0.5));
    let p = Tensor::from_vec(vec![true, false, false], &[3]).unwrap();
    let q = Tensor::from_vec(vec![true, true, false], &[3]).unwrap();
    p.add_(&q, 1.0).unwrap();
    assert_eq!(p.to_vec::<bool>().unwrap(), [true, true, false]);
    p.mul_(&Tensor::from_vec(vec![false, true, true], &[3]).unwrap())
        .unwrap();
    assert_eq!(p.to_vec::<bool>().unwrap(), [false, true, false]);
    assert_eq!(p.sum().unwrap(), 1.0);
}

#[test]
fn copy_converts_between_dtypes() {
    let f = Tensor::from_vec(vec![1.9f32, -2.7, 300.0, 0.0], &[4]).unwrap();
    let i = Tensor::zeros(&[4], DType::U8).unwrap();
    i.copy_(&f).unwrap();
    assert_eq!(i.to_vec::<u8>().unwrap(), [1, 0, 255, 0]);
    let b = f.to_dtype(DType::Bool).unwrap();
    assert_eq!(b.to_vec::<bool>().unwrap(), [true, true, true, false]);
    let big = Tensor::from_vec(vec![i64::MAX - 1], &[1]).unwrap();
    assert_eq!(
        big.deep_clone().unwrap().to_vec::<i64>().unwrap(),
        [i64::MAX - 1],
        "same-dtype copies are exact"
    );
}

#[test]
#[cfg_attr(miri, ignore = "memfd, mmap, sockets")]
fn a_handle_finds_the_storage_this_process_has_there() {
    let t = Tensor::arange(0.0, 4.0, 1.0, DType::F32).unwrap();
    t.share_memory_().unwrap();
    let (seg, offset) = t.storage().segment().unwrap();
    let same = Storage::from_segment(seg.clone(), offset, 16, None).unwrap();
    assert!(Storage::ptr_eq(&same, t.storage()));
    let shorter = Storage::from_segment(seg.clone(), offset, 8, None).unwrap();
    assert!(
        !Storage::ptr_eq(&shorter, t.storage()),
        "another slice is another storage"
    );
    assert_eq!(shorter.data_ptr(), t.storage().data_ptr());
    // Two storages over the same bytes count as overlapping: the source is read first.
    let shifted = Tensor::from_storage(shorter, DType::F32, &[1], &[1], 1).unwrap();
    t.narrow(0, 2, 1).unwrap().copy_(&shifted).unwrap();
    assert_eq!(f32s(&t), [0., 1., 1., 3.]);
    assert!(Storage::from_segment(seg, offset, usize::MAX, None).is_err());
}

#[test]
fn overlapping_copies_read_the_source_first() {
    let g = Tensor::arange(0.0, 4.0, 1.0, DType::F32)
        .unwrap()
        .view(&[2, 2])
        .unwrap();
    g.copy_(&g.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(f32s(&g), [0., 2., 1., 3.]);
    let v = Tensor::arange(0.0, 5.0, 1.0, DType::F32).unwrap();
    v.narrow(0, 1, 4)
        .unwrap()
        .add_(&v.narrow(0, 0, 4).unwrap(), 1.0)
        .unwrap();
    assert_eq!(f32s(&v), [0., 1., 3., 5., 7.]);
    v.add_(&v, 1.0).unwrap();
    assert_eq!(f32s(&v), [0., 2., 6., 10., 14.]);
}

#[test]
fn sum_and_allclose() {
    let g = grid();
    assert_eq!(g.sum().unwrap(), 66.0);
    assert_eq!(
        g.transpose(0, 1)
            .unwrap()
            .narrow(0, 1, 2)
            .unwrap()
            .sum()
            .unwrap(),
        1. + 5. + 9. + 2. + 6. + 10.
    );
    let long = Tensor::ones(&[1001], DType::F16).unwrap();
    assert_eq!(long.sum().unwrap(), 1001.0);
    assert_eq!(Tensor::zeros(&[0], DType::F32).unwrap().sum().unwrap(), 0.0);
    let a = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    let b = Tensor::from_vec(vec![1.0f32 + 1e-7, 2.0], &[2]).unwrap();
    assert!(a.allclose(&b, 1e-5, 1e-8).unwrap());
    let far = Tensor::from_vec(vec![1.1f32, 2.0], &[2]).unwrap();
    assert!(!a.allclose(&far, 1e-5, 1e-8).unwrap());
    let f64s = Tensor::from_vec(vec![1.0f64, 2.0], &[2]).unwrap();
    assert!(a.allclose(&f64s, 0.0, 0.0).unwrap());
    let err = a
        .allclose(&a.view(&[1, 2]).unwrap(), 1e-5, 1e-8)
        .unwrap_err();
    assert!(
        err.to_string().contains("shapes [2] and [1, 2] differ"),
        "{err}"
    );
    assert!(a.allclose(&a, 0.0, 0.0).unwrap());
    let nan = Tensor::full(&[1], f64::NAN, DType::F32).unwrap();
    assert!(!nan.allclose(&nan.deep_clone().unwrap(), 1.0, 1.0).unwrap());
    // Every dtype sums and compares (the new unsigned ones too).
    for dtype in DType::ALL {
        let t = Tensor::arange(0.0, 4.0, 1.0, dtype).unwrap();
        let expected = if dtype == DType::Bool { 3.0 } else { 6.0 };
        assert_eq!(t.sum().unwrap(), expected, "{dtype}");
        assert!(
            t.allclose(&t.deep_clone().unwrap(), 0.0, 0.0).unwrap(),
            "{dtype}"
        );
    }
    let big = Tensor::from_slice(&[u64::MAX, 1], &[2]).unwrap();
    assert_eq!(big.sum().unwrap(), u64::MAX as f64 + 1.0);
}

#[test]
fn clone_shares_and_deep_clone_copies() {
    let a = Tensor::zeros(&[3], DType::I16).unwrap();
    let shallow = a.clone();
    let deep = a.deep_clone().unwrap();
    a.fill_(5.0).unwrap();
    assert_eq!(shallow.to_vec::<i16>().unwrap(), [5, 5, 5]);
    assert_eq!(deep.to_vec::<i16>().unwrap(), [0, 0, 0]);
    assert_eq!(shallow.data_ptr(), a.data_ptr());
    assert_ne!(deep.data_ptr(), a.data_ptr());
}

#[test]
fn debug_shows_layout_and_values() {
    let s = format!("{:?}", grid().select(1, 1).unwrap());
    assert!(
        s.contains("F32") && s.contains("[1.0, 5.0, 9.0]") && s.contains("offset: 1"),
        "{s}"
    );
    let s = format!("{:?}", Tensor::zeros(&[100], DType::U8).unwrap());
    assert!(s.contains("first_values"), "{s}");
}

#[test]
fn every_dtype_round_trips_through_to_vec() {
    for dtype in DType::ALL {
        let t = Tensor::ones(&[2, 2], dtype).unwrap();
        t.select(0, 0).unwrap().fill_(0.0).unwrap();
        assert_eq!(t.sum().unwrap(), 2.0, "{dtype}");
        dispatch!(dtype, T => {
            let v = t.to_vec::<T>().unwrap();
            let back = Tensor::from_vec(v.clone(), &[2, 2]).unwrap();
            assert_eq!(back.to_vec::<T>().unwrap(), v);
            assert_eq!(back.dtype(), dtype);
        });
    }
}

/// `fill_` and `sum` on a contiguous run take whole 16-byte vectors where they can
/// (`raw`'s lanes) and single elements at the ends: at every start (so every alignment)
/// and every length, they touch exactly the run and agree with the element loop.
#[test]
#[cfg_attr(
    miri,
    ignore = "the lanes it checks never run under Miri (no assembly)"
)]
fn fill_and_sum_agree_at_every_alignment_and_length() {
    const N: usize = 80;
    let sum_of = |from: usize, to: usize| (from..to).map(|v| v as f64).sum::<f64>();
    for dtype in [
        DType::F32,
        DType::F64,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::U8,
    ] {
        for start in 0..9 {
            for len in 0..N - start {
                let whole = Tensor::arange(0.0, N as f64, 1.0, dtype).unwrap();
                let run = whole.narrow(0, start, len).unwrap();
                assert_eq!(
                    run.sum().unwrap(),
                    sum_of(start, start + len),
                    "{dtype} sum of {len} from {start}"
                );
                run.fill_(3.0).unwrap();
                assert_eq!(
                    run.sum().unwrap(),
                    3.0 * len as f64,
                    "{dtype} fill_ of {len} from {start}"
                );
                let before = whole.narrow(0, 0, start).unwrap();
                let after = whole.narrow(0, start + len, N - start - len).unwrap();
                assert_eq!(
                    before.sum().unwrap(),
                    sum_of(0, start),
                    "{dtype}: before the run"
                );
                assert_eq!(
                    after.sum().unwrap(),
                    sum_of(start + len, N),
                    "{dtype}: after the run"
                );
            }
        }
    }
    // A shared tensor (a block's memory) takes the same path.
    let shared = Tensor::empty_shared(&[1027], DType::F32).unwrap();
    shared.fill_(0.5).unwrap();
    assert_eq!(shared.sum().unwrap(), 513.5);
    assert!(shared.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.5));
}
