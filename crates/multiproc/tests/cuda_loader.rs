//! CUDA and the data loader (feature `cuda`): `pin_memory` and `prefetch_to`, their
//! refusals at build, pinned blocks registered once and unregistered when freed,
//! prefetched batches on the device in order, an epoch dropped with copies in flight.
//!
//! The tests marked `#[ignore = "needs a CUDA device"]` need a GPU and run with
//! `scripts/gpu_check.sh` (built by `scripts/gpu_build.sh`), or by hand with
//! `cargo test -p multiproc --features cuda --test cuda_tensors --test cuda_sharing
//! --test cuda_loader -- --include-ignored`. The others run everywhere: without a
//! driver, a device or the feature, every CUDA operation and every forged CUDA handle
//! must be a clean `CudaUnavailable`, never a panic. What they share is in
//! tests/common/cuda.rs.

multiproc::test_init!();

mod common;

use std::time::Instant;

use common::cuda::*;
use common::secs;
use multiproc::data::{Collate, DataLoader, DataLoaderBuilder, IterableDataset, WorkerKind};
use multiproc::{DType, Device, Error, StartMethod, Tensor, cuda};

/// `0..n` split over the workers (worker `k` of `m` streams `k, k + m, ...`), which
/// reports where it stands: a stream a loader can resume mid-epoch.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Split(usize);

/// [`Split`]'s iterator: the next value and the step.
struct SplitIter {
    next: usize,
    step: usize,
    n: usize,
}

impl Iterator for SplitIter {
    type Item = multiproc::Result<i64>;

    fn next(&mut self) -> Option<Self::Item> {
        (self.next < self.n).then(|| {
            let v = self.next;
            self.next += self.step;
            Ok(v as i64)
        })
    }
}

impl IterableDataset for Split {
    type Item = i64;
    type Iter = SplitIter;

    fn iter(&self, _epoch: u64) -> SplitIter {
        let (k, m) = multiproc::data::worker_info().map_or((0, 1), |w| (w.id, w.num_workers));
        SplitIter {
            next: k,
            step: m,
            n: self.0,
        }
    }

    fn state(&self, iter: &SplitIter) -> Option<multiproc::data::StreamState> {
        multiproc::data::StreamState::new(&iter.next).ok()
    }

    fn iter_from(
        &self,
        epoch: u64,
        state: &multiproc::data::StreamState,
    ) -> multiproc::Result<SplitIter> {
        let mut it = self.iter(epoch);
        it.next = state.get()?;
        Ok(it)
    }
}

/// A collate that does not say how to reach its batch's tensors.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Opaque;

impl Collate<(Tensor, i64)> for Opaque {
    type Batch = Vec<(Tensor, i64)>;

    fn collate(&self, items: Vec<(Tensor, i64)>) -> multiproc::Result<Self::Batch> {
        Ok(items)
    }
}

fn invalid(r: multiproc::Result<impl Sized>, needles: &[&str]) {
    match r {
        Err(Error::InvalidArgument(text)) => {
            for needle in needles {
                assert!(text.contains(needle), "{needle:?} not in {text:?}");
            }
        }
        Err(other) => panic!("expected InvalidArgument with {needles:?}, got {other:?}"),
        Ok(_) => panic!("expected InvalidArgument with {needles:?}, got a loader"),
    }
}

#[test]
fn pin_memory_and_prefetch_to_refuse_bad_arguments_at_build() {
    common::run(DEADLINE, || {
        let data = Ramp { n: 8, width: 4 };
        invalid(
            DataLoader::builder(data.clone())
                .prefetch_to(GPU, 0)
                .build(),
            &["prefetch_to", "at least 1"],
        );
        invalid(
            DataLoader::builder(data.clone())
                .prefetch_to(Device::Cpu, 2)
                .build(),
            &["Device::Cpu", "CUDA device"],
        );
        invalid(
            DataLoaderBuilder::new(data.clone())
                .collate(Opaque)
                .pin_memory(true)
                .build(),
            &["pin_memory(true)", "Collate::batch_tensors"],
        );
        invalid(
            DataLoader::builder(data.clone())
                .num_workers(1)
                .start_method(StartMethod::Fork)
                .prefetch_to(GPU, 1)
                .build(),
            &["Fork", "StartMethod::Spawn"],
        );
        // Thread workers may be combined with either: no fork involved.
        let threads = DataLoader::builder(data.clone())
            .num_workers(1)
            .workers(WorkerKind::Thread)
            .start_method(StartMethod::Fork)
            .pin_memory(true)
            .build();
        // Without CUDA (no feature, no driver, no device) both options are
        // CudaUnavailable, saying which option needs it; never a silent no-op.
        if !cuda::is_available() {
            for (what, r) in [
                ("pin_memory(true)", threads.map(drop)),
                (
                    "prefetch_to",
                    DataLoader::builder(data.clone())
                        .prefetch_to(GPU, 2)
                        .build()
                        .map(drop),
                ),
                (
                    "pin_memory(true)",
                    DataLoaderBuilder::new(Count(8))
                        .pin_memory(true)
                        .build_iterable()
                        .map(drop),
                ),
                (
                    "prefetch_to",
                    DataLoaderBuilder::new(Count(8))
                        .prefetch_to(GPU, 2)
                        .build_iterable()
                        .map(drop),
                ),
            ] {
                match r {
                    Err(Error::CudaUnavailable { reason }) => {
                        assert!(reason.contains(what), "{reason}")
                    }
                    other => panic!("{what} without CUDA: {other:?}"),
                }
            }
        } else {
            threads.unwrap();
        }
        // Off is off, everywhere.
        DataLoader::builder(data).pin_memory(false).build().unwrap();
    });
}

// ----- on a GPU -----

#[test]
#[ignore = "needs a CUDA device"]
fn an_iterable_loaders_prefetched_batches_match_and_its_state_counts_only_handed_over() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let build =
            |b: DataLoaderBuilder<Split>| b.batch_size(4).num_workers(3).build_iterable().unwrap();
        let mut cpu = build(DataLoaderBuilder::new(Split(70)));
        let mut gpu = build(DataLoaderBuilder::new(Split(70)).prefetch_to(GPU, 3));
        let mut want = cpu.iter();
        let mut got = gpu.iter();
        let mut saved = None;
        let mut b = 0;
        loop {
            let (w, g) = (want.next(), got.next());
            let (Some(w), Some(g)) = (w.as_ref(), g.as_ref()) else {
                assert!(w.is_none() && g.is_none(), "as many batches (past {b})");
                break;
            };
            let (w, g) = (w.as_ref().unwrap(), g.as_ref().unwrap());
            assert_eq!(g.device(), GPU, "batch {b}");
            let g = g.to(Device::Cpu).unwrap();
            assert_eq!(
                g.to_vec::<i64>().unwrap(),
                w.to_vec::<i64>().unwrap(),
                "batch {b}"
            );
            // Batches pulled ahead are not in the state: it is the unprefetched one's.
            assert_eq!(got.state_dict(), want.state_dict(), "state after batch {b}");
            if b == 5 {
                saved = Some((got.state_dict(), b));
            }
            b += 1;
        }
        assert_eq!(got.state_dict(), want.state_dict(), "state at the end");
        drop((want, got));
        // Resumed from the state after batch 5, the prefetching loader yields what the
        // plain one yielded after it.
        let (state, at) = saved.expect("more than 6 batches");
        let mut plain = build(DataLoaderBuilder::new(Split(70)));
        let rest: Vec<Vec<i64>> = plain
            .iter()
            .skip(at + 1)
            .map(|b| b.unwrap().to_vec::<i64>().unwrap())
            .collect();
        gpu.load_state_dict(&state).unwrap();
        let resumed: Vec<Vec<i64>> = gpu
            .iter()
            .map(|b| {
                let b = b.unwrap();
                assert_eq!(b.device(), GPU);
                b.to(Device::Cpu).unwrap().to_vec::<i64>().unwrap()
            })
            .collect();
        assert_eq!(resumed, rest);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_iterable_loaders_batches_are_pinned_from_workers_and_in_process() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let before = fake_host_counts();
        for workers in [0, 2] {
            let mut loader = DataLoaderBuilder::new(Count(40))
                .batch_size(5)
                .num_workers(workers)
                .pin_memory(true)
                .build_iterable()
                .unwrap();
            let mut seen = Vec::new();
            for (b, batch) in loader.iter().enumerate() {
                let batch = batch.unwrap();
                assert!(batch.is_pinned(), "{workers} workers: batch {b}");
                seen.extend(batch.to_vec::<i64>().unwrap());
            }
            // Each worker streams the whole range (the data set does not split it).
            seen.sort_unstable();
            let want: Vec<i64> = (0..40)
                .flat_map(|i| std::iter::repeat_n(i, workers.max(1)))
                .collect();
            assert_eq!(seen, want, "{workers} workers");
        }
        assert_registered_once_each(before);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_batches_register_each_block_once_and_unregister_when_freed() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let before = fake_host_counts();
        const LEN: usize = 256 << 10; // 1 MiB a sample: every batch is a block of its own
        const BATCHES: usize = 24;
        let mut loader = DataLoader::builder(Ramp {
            n: BATCHES * 4,
            width: LEN,
        })
        .batch_size(4)
        .num_workers(1)
        .prefetch_factor(1)
        .persistent_workers(true)
        .pin_memory(true)
        .build()
        .unwrap();
        let mut blocks = std::collections::BTreeSet::new();
        for epoch in 0..2 {
            let mut n = 0;
            for (b, batch) in loader.iter().enumerate() {
                let (x, y) = batch.unwrap();
                assert!(x.is_pinned() && y.is_pinned(), "batch {b} of epoch {epoch}");
                check_ramp_batch(&x, &y, b * 4, 4, LEN);
                blocks.insert(x.data_ptr() as usize);
                n += 1;
            }
            assert_eq!(n, BATCHES);
        }
        // The worker recycles its blocks and this process keeps them mapped: a handful
        // of blocks carried all 48 batches, each registered once.
        eprintln!("48 batches in {} blocks", blocks.len());
        assert!(blocks.len() <= 6, "{} blocks", blocks.len());
        if let (Some(b), Some(a)) = (before, fake_host_counts()) {
            let made = a[0] - b[0];
            eprintln!("registrations: {made} made, counts before {b:?} after {a:?}");
            assert!(made >= 1, "no registration was made");
            assert!(
                made as usize <= blocks.len() + 1,
                "{made} registrations for {} blocks (the x and y blocks)",
                blocks.len()
            );
            assert_eq!(a[2], b[2], "a block was registered twice");
        }
        drop(loader);
        multiproc::__testing::flush_retained_segments();
        multiproc::__testing::release_idle_blocks();
        if let (Some(b), Some(a)) = (before, fake_host_counts()) {
            assert_eq!(
                a[4], b[4],
                "registrations outlived their blocks: {b:?} -> {a:?}"
            );
            assert_eq!(a[0] - b[0], a[1] - b[1], "every registration undone once");
            assert_eq!(
                a[3], b[3],
                "a block was unmapped before it was unregistered"
            );
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn pin_memory_pins_batches_made_in_this_process_and_by_thread_workers() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let before = fake_host_counts();
        for (workers, kind) in [(0, WorkerKind::Process), (2, WorkerKind::Thread)] {
            let mut loader = DataLoader::builder(Ramp { n: 40, width: 1000 })
                .batch_size(5)
                .num_workers(workers)
                .workers(kind)
                .pin_memory(true)
                .build()
                .unwrap();
            let mut n = 0;
            for (b, batch) in loader.iter().enumerate() {
                let (x, y) = batch.unwrap();
                assert!(x.is_pinned() && y.is_pinned(), "{kind:?}: batch {b}");
                check_ramp_batch(&x, &y, b * 5, 5, 1000);
                n += 1;
            }
            assert_eq!(n, 8);
        }
        let plain = Tensor::full(&[1000], 1.0, DType::F32).unwrap();
        assert!(!plain.is_pinned(), "a private tensor is not pinned");
        assert!(!arange_on_gpu(4).is_pinned(), "a CUDA tensor is not pinned");
        assert_registered_once_each(before);
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefetched_batches_are_on_the_device_and_equal_the_cpu_batches_in_order() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let (mut cpu, mut gpu) = ramp_loaders_without_and_with_prefetch();
        for epoch in 0..2 {
            let mut n = 0;
            let mut on_gpu = gpu.iter();
            for (b, want) in cpu.iter().enumerate() {
                let got = on_gpu.next().expect("as many batches").unwrap();
                same_batch_on_device(&got, &want.unwrap(), &format!("batch {b} of epoch {epoch}"));
                // Batches pulled ahead are not counted as yielded.
                if b + 1 < 15 {
                    assert_eq!(
                        on_gpu.state_dict().position(),
                        Some((b + 1) * 6),
                        "state after batch {b}"
                    );
                }
                n += 1;
            }
            assert_eq!(n, 15);
            assert!(on_gpu.next().is_none(), "no batch past the end");
        }
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_epoch_dropped_with_copies_in_flight_waits_for_them_and_leaks_nothing() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        cuda::empty_cache();
        let free_before = free_device_memory();
        let mut loader = DataLoader::builder(Ramp {
            n: 64,
            width: 1 << 16,
        })
        .batch_size(4)
        .num_workers(2)
        .prefetch_to(GPU, 4)
        .build()
        .unwrap();
        let started = Instant::now();
        let mut epoch = loader.iter();
        let (x, y) = epoch.next().unwrap().unwrap();
        check_ramp_batch(&x, &y, 0, 4, 1 << 16);
        drop(epoch); // four batches still staged, their copies issued
        drop((x, y));
        // The next epoch starts where it should and is correct: the dropped epoch's
        // copies did not land in memory it handed back.
        let (x, y) = loader.iter().next().unwrap().unwrap();
        check_ramp_batch(&x, &y, 0, 4, 1 << 16);
        drop((x, y, loader));
        cuda::empty_cache();
        // Every staged batch's device memory came back once its copy was done.
        assert_device_memory_back(free_before);
        assert!(started.elapsed() < secs(60));
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefetch_to_a_device_this_process_does_not_see_is_an_error() {
    warm_up_cuda();
    common::run(DEADLINE, || {
        let r = DataLoader::builder(Ramp { n: 4, width: 4 })
            .prefetch_to(Device::Cuda(99), 2)
            .build();
        invalid(r, &["cuda:99", "prefetch_to"]);
    });
}
