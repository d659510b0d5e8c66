//! Interop with the Rust ML ecosystem, files and capsules, each part behind its
//! feature: safetensors files loaded as shared read-only pages (sent to worker processes
//! by handle), DLPack export and import. Arrays (ndarray, candle) are
//! tests/interop_arrays.rs.
//!
//! Every test runs under `common::run` (a deadline and a leak check). Run them with
//! `cargo test -p multiproc --features safetensors,dlpack --test interop_formats`.

multiproc::test_init!();

mod common;

#[cfg(feature = "safetensors")]
mod safetensors_interop {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    use super::common::{self, secs};
    use multiproc::{DType, Queue, Tensor};

    /// A fresh directory for one test's files, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("mp-interop-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
        fn file(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn model() -> BTreeMap<String, Tensor> {
        let mut m = BTreeMap::new();
        for (i, dtype) in DType::ALL.into_iter().enumerate() {
            let t = Tensor::arange(0.0, 2.0 + i as f64, 1.0, dtype).unwrap();
            m.insert(format!("t_{}", dtype.name()), t);
        }
        let w = Tensor::arange(0.0, 12.0, 0.5, DType::F32)
            .unwrap()
            .reshape(&[4, 6])
            .unwrap();
        m.insert("layer.weight".into(), w.transpose(0, 1).unwrap()); // saved in logical order
        m.insert("empty".into(), Tensor::zeros(&[0, 3], DType::F16).unwrap());
        m
    }

    #[test]
    fn save_then_load_gives_the_same_tensors_backed_by_the_file() {
        common::run(secs(60), || {
            let dir = TempDir::new("roundtrip");
            let path = dir.file("m.safetensors");
            let m = model();
            multiproc::safetensors::save(&path, &m).unwrap();
            let loaded = multiproc::safetensors::load(&path).unwrap();
            assert_eq!(
                loaded.keys().collect::<Vec<_>>(),
                m.keys().collect::<Vec<_>>()
            );
            for (name, t) in &m {
                let l = &loaded[name];
                assert_eq!((l.dtype(), l.shape()), (t.dtype(), t.shape()), "{name}");
                assert!(l.allclose(t, 0.0, 0.0).unwrap(), "{name}");
                assert!(l.is_read_only() && l.is_shared(), "{name}");
                assert_eq!(l.storage().sharing_strategy(), None);
            }
            // Loading twice maps the file once: the same bytes.
            let again = multiproc::safetensors::load(&path).unwrap();
            assert_eq!(
                again["layer.weight"].data_ptr(),
                loaded["layer.weight"].data_ptr()
            );
            // A writable copy is an ordinary tensor.
            let copy = loaded["layer.weight"].deep_clone().unwrap();
            copy.add_scalar_(1.0).unwrap();
            assert!(!copy.is_read_only());
        });
    }

    #[test]
    fn every_write_to_a_loaded_tensor_is_an_error_naming_it() {
        common::run(secs(60), || {
            let dir = TempDir::new("readonly");
            let path = dir.file("m.safetensors");
            multiproc::safetensors::save(&path, &model()).unwrap();
            let loaded = multiproc::safetensors::load(&path).unwrap();
            let w = &loaded["layer.weight"];
            let other = Tensor::ones(w.shape(), DType::F32).unwrap();
            let view = w.narrow(0, 1, 2).unwrap();
            let errors = [
                ("fill_", w.fill_(1.0)),
                ("copy_", w.copy_(&other)),
                ("add_", w.add_(&other, 1.0)),
                ("mul_", w.mul_(&other)),
                ("add_scalar_", view.add_scalar_(1.0)),
                ("mul_scalar_", view.mul_scalar_(2.0)),
                ("copy_from_slice", w.copy_from_slice(&[0.0f32; 24])),
            ];
            for (op, result) in errors {
                let err = result.unwrap_err().to_string();
                assert!(
                    err.contains(op)
                        && err.contains("\"layer.weight\"")
                        && err.contains("read-only"),
                    "{err}"
                );
            }
            #[cfg(feature = "ndarray")]
            {
                let err = w
                    .copy_from_ndarray(&ndarray::Array2::<f32>::zeros((6, 4)))
                    .unwrap_err();
                assert!(err.to_string().contains("layer.weight"), "{err}");
                // SAFETY: refused before any borrow is made.
                let err = unsafe { w.as_array_view_mut::<f32>() }.unwrap_err();
                assert!(err.to_string().contains("layer.weight"), "{err}");
                // A borrow over a file that another process may write is refused in safe
                // code (it would be undefined behaviour); a copy, or the unsafe view under
                // its contract, reads it.
                let mut r = w.clone();
                let err = r.array_view::<f32>().unwrap_err().to_string();
                assert!(
                    err.contains("read-only file") && err.contains("to_ndarray"),
                    "{err}"
                );
                assert_eq!(r.to_ndarray::<f32>().unwrap().sum(), 138.0);
                // SAFETY: nothing writes the test's weights file while the view lives.
                assert_eq!(unsafe { r.as_array_view::<f32>() }.unwrap().sum(), 138.0);
            }
            // The bytes are unchanged after all that.
            assert_eq!(w.to_vec::<f32>().unwrap()[..3], [0.0, 3.0, 6.0]);
        });
    }

    fn write_file(path: &Path, bytes: &[u8]) {
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn truncated_oversized_and_overlapping_files_are_errors() {
        common::run(secs(60), || {
            let dir = TempDir::new("bad");
            let good = dir.file("good.safetensors");
            multiproc::safetensors::save(&good, &model()).unwrap();
            let bytes = std::fs::read(&good).unwrap();
            let bad = dir.file("bad.safetensors");
            let load_err = |b: &[u8]| {
                write_file(&bad, b);
                multiproc::safetensors::load(&bad).unwrap_err().to_string()
            };
            for cut in [0, 5, 8, 20, bytes.len() / 2, bytes.len() - 1] {
                let err = load_err(&bytes[..cut]);
                assert!(err.contains("bad.safetensors"), "cut at {cut}: {err}");
            }
            let mut padded = bytes.clone();
            padded.extend_from_slice(&[0; 8]);
            assert!(load_err(&padded).contains("truncated or padded"));
            let mut huge = bytes.clone();
            huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            assert!(load_err(&huge).contains("more than the limit"));
            let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
            let mut overlap = (header.len() as u64).to_le_bytes().to_vec();
            overlap.extend_from_slice(header.as_bytes());
            overlap.extend_from_slice(&[0; 12]);
            assert!(load_err(&overlap).contains("header is not valid"));
            let err = multiproc::safetensors::load(dir.file("missing"))
                .unwrap_err()
                .to_string();
            assert!(err.contains("missing"), "{err}");
            // An empty tensor whose other sizes multiply past usize: a tensor of
            // nothing (as the format allows), not an overflow.
            let header =
                r#"{"x":{"dtype":"F32","shape":[1,0,8589934592,8589934592],"data_offsets":[0,0]}}"#;
            // Padded with spaces (as the format allows) so that the data is aligned.
            let header = format!("{header:<width$}", width = header.len().next_multiple_of(8));
            let mut empty = (header.len() as u64).to_le_bytes().to_vec();
            empty.extend_from_slice(header.as_bytes());
            write_file(&bad, &empty);
            let loaded = multiproc::safetensors::load(&bad).unwrap();
            assert_eq!(loaded["x"].numel(), 0);
            assert_eq!(loaded["x"].shape(), [1, 0, 1 << 33, 1 << 33]);
        });
    }

    /// What a worker saw: the weight's sum, aliasing, a write's error, the file mapped.
    type Seen = (f64, bool, String, bool);

    /// Receives the weights (twice), checks them and answers what it saw: the sum of
    /// the weight, whether both copies alias, the error of a write, and whether its
    /// memory map shows the file itself (pages shared, not copied).
    fn inspect_weights(
        _rank: usize,
        (inbox, outbox, path): (Queue<BTreeMap<String, Tensor>>, Queue<Seen>, String),
    ) -> multiproc::Result<()> {
        let weights = inbox.get()?;
        let again = inbox.get()?;
        let w = &weights["layer.weight"];
        let alias = w.data_ptr() == again["layer.weight"].data_ptr();
        let err = w.mul_scalar_(2.0).unwrap_err().to_string();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let mapped = maps
            .lines()
            .any(|l| l.ends_with(&path) && l.contains(" r--s "));
        let sum = w.to_vec::<f32>()?.iter().map(|&x| x as f64).sum();
        outbox.put((sum, alias, err, mapped)).map_err(|e| e.error)?;
        Ok(())
    }

    #[test]
    fn workers_receive_loaded_weights_by_handle_and_map_the_file_itself() {
        common::run(secs(120), || {
            let dir = TempDir::new("workers");
            let path = dir.file("m.safetensors");
            multiproc::safetensors::save(&path, &model()).unwrap();
            let weights = multiproc::safetensors::load(&path).unwrap();
            let (inbox, outbox) = (Queue::new().unwrap(), Queue::new().unwrap());
            for _ in 0..2 {
                inbox.put(weights.clone()).map_err(|e| e.error).unwrap();
                inbox.put(weights.clone()).map_err(|e| e.error).unwrap();
            }
            let canonical = std::fs::canonicalize(&path).unwrap().display().to_string();
            multiproc::spawn(inspect_weights, (inbox, outbox.clone(), canonical), 2).unwrap();
            for _ in 0..2 {
                let (sum, alias, err, mapped) = outbox.get().unwrap();
                assert_eq!(sum, 138.0);
                assert!(alias, "the same weights received twice alias");
                assert!(
                    err.contains("mul_scalar_") && err.contains("layer.weight"),
                    "{err}"
                );
                assert!(
                    mapped,
                    "the worker maps the weights file read-only and shared"
                );
            }
        });
    }
}

#[cfg(feature = "dlpack")]
mod dlpack_interop {
    use super::common::{self, secs};
    use dlpark::DlpackFlags;
    use dlpark::metadata::Dynamic;
    use dlpark::versioned::Dlpack;
    use multiproc::{DType, Queue, Tensor};

    #[test]
    fn export_and_import_are_zero_copy_and_the_capsule_keeps_the_storage_alive() {
        common::run(secs(60), || {
            let t = Tensor::arange(0.0, 12.0, 1.0, DType::I32)
                .unwrap()
                .reshape(&[3, 4])
                .unwrap();
            let view = t.transpose(0, 1).unwrap().narrow(0, 1, 2).unwrap();
            let capsule = view.to_dlpack().unwrap();
            assert!(
                t.is_shared(),
                "a private tensor is moved to shared memory before export"
            );
            {
                let dl = capsule.validate().unwrap();
                assert_eq!(dl.shape(), [2, 3]);
                assert_eq!(dl.strides_or_compact().unwrap().as_ref(), [1, 4]);
                assert_eq!(dl.byte_offset(), 4);
            }
            // Through a raw pointer, as a C or Python consumer would get it.
            let raw = capsule.into_raw();
            // SAFETY: `raw` came from `into_raw` just above and is owned by nobody else.
            let capsule = unsafe { Dlpack::from_raw(raw) }.unwrap();
            let expected = view.contiguous().unwrap().to_vec::<i32>().unwrap();
            drop((t, view)); // the capsule alone keeps the memory alive now
            let back = Tensor::from_dlpack(capsule).unwrap();
            assert_eq!(back.to_vec::<i32>().unwrap(), expected);
            assert_eq!(expected, [1, 5, 9, 2, 6, 10]);
            // Writes go to the same memory: export the import and look again.
            back.fill_(-1.0).unwrap();
            let again = Tensor::from_dlpack(back.to_dlpack().unwrap()).unwrap();
            assert_eq!(again.data_ptr(), back.data_ptr());
            assert_eq!(again.sum().unwrap(), -6.0);
        });
    }

    /// Sums what it receives.
    fn sum_of(_rank: usize, (inbox, outbox): (Queue<Tensor>, Queue<f64>)) -> multiproc::Result<()> {
        let t = inbox.get()?;
        outbox.put(t.sum()?).map_err(|e| e.error)?;
        Ok(())
    }

    #[test]
    fn a_foreign_capsule_is_imported_in_place_and_copied_once_to_travel() {
        common::run(secs(90), || {
            // A capsule another library made: dlpark owning a Vec.
            let data: Vec<f32> = (0..16).map(|i| i as f32).collect();
            let ptr = data.as_ptr() as *mut std::ffi::c_void;
            let mut init = Dynamic::compact(vec![4i64, 4])
                .initialize(Box::new(data))
                .unwrap();
            init.set_data(ptr)
                .set_device(dlpark::ffi::DLDevice::CPU)
                .set_dtype(dlpark::ffi::DLDataType::F32);
            // SAFETY: the data pointer is the boxed Vec's buffer, owned by the capsule.
            let capsule = unsafe { init.finish() };
            let t = Tensor::from_dlpack(capsule).unwrap();
            assert_eq!(
                t.data_ptr() as *const std::ffi::c_void,
                ptr as *const _,
                "zero-copy"
            );
            assert!(!t.is_shared());
            let (inbox, outbox) = (Queue::new().unwrap(), Queue::new().unwrap());
            inbox.put(t.clone()).map_err(|e| e.error).unwrap();
            assert!(t.is_shared(), "sending copied it into shared memory");
            let moved = t.data_ptr();
            assert_ne!(moved as *const std::ffi::c_void, ptr as *const _, "copied");
            // Sent again, it travels from the shared copy: no second copy.
            inbox.put(t.clone()).map_err(|e| e.error).unwrap();
            assert_eq!(t.data_ptr(), moved, "copied again to travel again");
            multiproc::spawn(sum_of, (inbox, outbox.clone()), 2).unwrap();
            assert_eq!([outbox.get().unwrap(), outbox.get().unwrap()], [120.0; 2]);
        });
    }

    #[test]
    fn read_only_flags_travel_both_ways_and_bad_capsules_are_errors() {
        common::run(secs(60), || {
            let data = vec![1u8, 2, 3, 4];
            let ptr = data.as_ptr() as *mut std::ffi::c_void;
            let mut init = Dynamic::compact(vec![4i64])
                .initialize(Box::new(data))
                .unwrap();
            init.set_data(ptr)
                .set_device(dlpark::ffi::DLDevice::CPU)
                .set_dtype(dlpark::ffi::DLDataType::U8)
                .set_flags(DlpackFlags::READ_ONLY)
                .unwrap();
            // SAFETY: as above.
            let t = Tensor::from_dlpack(unsafe { init.finish() }).unwrap();
            assert!(t.is_read_only());
            assert!(
                t.add_scalar_(1.0)
                    .unwrap_err()
                    .to_string()
                    .contains("read-only")
            );
            // Its memory is the other library's: it cannot move into shared memory, so
            // it is neither re-exported nor sent (a writable copy can be).
            let err = t.to_dlpack().err().expect("refused").to_string();
            assert!(err.contains("read-only DLPack import"), "{err}");
            let copy = t.deep_clone().unwrap();
            assert!(
                !copy
                    .to_dlpack()
                    .unwrap()
                    .flags()
                    .contains(DlpackFlags::READ_ONLY)
            );
            // A read-only tensor of our own (a safetensors weight) exports READ_ONLY.
            #[cfg(feature = "safetensors")]
            {
                let dir = std::env::temp_dir().join(format!("mp-dlpack-{}", std::process::id()));
                std::fs::create_dir_all(&dir).unwrap();
                let path = dir.join("w.safetensors");
                let mut m = std::collections::BTreeMap::new();
                m.insert("w".to_string(), copy);
                multiproc::safetensors::save(&path, &m).unwrap();
                let loaded = multiproc::safetensors::load(&path).unwrap();
                let out = loaded["w"].to_dlpack().unwrap();
                assert!(out.flags().contains(DlpackFlags::READ_ONLY));
                let back = Tensor::from_dlpack(out).unwrap();
                assert!(back.is_read_only() && back.data_ptr() == loaded["w"].data_ptr());
                drop((back, loaded));
                std::fs::remove_dir_all(&dir).unwrap();
            }
            // Complex numbers: no such dtype here.
            let data = vec![0f32; 4];
            let ptr = data.as_ptr() as *mut std::ffi::c_void;
            let mut init = Dynamic::compact(vec![2i64])
                .initialize(Box::new(data))
                .unwrap();
            init.set_data(ptr)
                .set_device(dlpark::ffi::DLDevice::CPU)
                .set_dtype(dlpark::ffi::DLDataType::C64);
            // SAFETY: as above.
            let err = Tensor::from_dlpack(unsafe { init.finish() })
                .unwrap_err()
                .to_string();
            assert!(err.contains("no dtype"), "{err}");
        });
    }
}
