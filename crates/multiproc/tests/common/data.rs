//! The data sets shared by the data loader tests (tests/data_loader.rs,
//! tests/data_sampling.rs, tests/data_failures.rs, tests/async_data.rs): numbered samples whose hooks make
//! chosen samples fail or wait, and a numbered stream.

use std::time::Duration;

use multiproc::data::{DataLoader, Dataset, worker_info};
use multiproc::{DType, Error, Event, Semaphore, Tensor};
use serde::{Deserialize, Serialize};

/// How long a gated sample waits before it gives up (far beyond any test's need; a
/// test that reaches it has failed anyway).
pub const GATE_WAIT: Duration = Duration::from_secs(60);

/// Sample `i` is `([i; 4] as f32, i)`; hooks make chosen samples fail or wait.
#[derive(Clone, Serialize, Deserialize)]
pub struct Samples {
    pub n: usize,
    /// The sample that misbehaves, and how.
    pub fault: Option<(usize, Fault)>,
    /// When set, the fault happens only while this event is clear, and sets it: the
    /// first attempt fails, a retry succeeds.
    pub once: Option<Event>,
    /// Every sample but 0 releases it; sample 0 first acquires it `hold_first` times
    /// (so batch 0 finishes after that many other samples).
    pub finished: Option<Semaphore>,
    pub hold_first: u32,
    /// Samples at or past this index wait for the event (never set: they hang).
    pub gate: Option<(usize, Event)>,
    /// Sample 0 waits for this event.
    pub first_waits: Option<Event>,
    /// Each sample sleeps this long: stands for decoding work (so that an epoch can be
    /// dropped mid-way), not a synchronisation.
    pub slow_ms: u64,
}

#[derive(Clone, Copy, Serialize, Deserialize, Debug)]
pub enum Fault {
    Err,
    Panic,
    Kill,
    Hang,
}

/// Sample `i`'s fault, if `fault` names it: an `Err`, a panic, a SIGKILL of this worker
/// or a hang. With `once`, only while the event is clear, which the fault then sets (the
/// first attempt fails, a retry succeeds).
pub fn misbehave(
    fault: Option<(usize, Fault)>,
    once: Option<&Event>,
    i: usize,
) -> multiproc::Result<()> {
    let Some((at, how)) = fault else {
        return Ok(());
    };
    if i != at || once.is_some_and(|e| e.is_set()) {
        return Ok(());
    }
    if let Some(e) = once {
        e.set();
    }
    match how {
        Fault::Err => return Err(Error::InvalidArgument(format!("sample {i} is corrupt"))),
        Fault::Panic => panic!("decoder crashed on sample {i}"),
        Fault::Kill => {
            // SAFETY: kill(2) on our own pid; no memory is involved.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        Fault::Hang => std::thread::sleep(GATE_WAIT),
    }
    Ok(())
}

impl Samples {
    pub fn new(n: usize) -> Self {
        Samples {
            n,
            fault: None,
            once: None,
            finished: None,
            hold_first: 0,
            gate: None,
            first_waits: None,
            slow_ms: 0,
        }
    }

    pub fn fault(mut self, at: usize, how: Fault) -> Self {
        self.fault = Some((at, how));
        self
    }

    /// Sample 0 finishes only after `others` other samples have (so batch 0 is the
    /// last of the first ones to arrive).
    pub fn first_finishing_after(mut self, others: u32) -> Self {
        self.finished = Some(Semaphore::new(0).unwrap());
        self.hold_first = others;
        self
    }

    pub fn once(mut self) -> Self {
        self.once = Some(Event::new().unwrap());
        self
    }
}

impl Dataset for Samples {
    type Item = (Tensor, i64);

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> multiproc::Result<(Tensor, i64)> {
        misbehave(self.fault, self.once.as_ref(), i)?;
        if let Some(sem) = &self.finished {
            if i == 0 {
                for _ in 0..self.hold_first {
                    // A timeout here is an error: the other samples never finished.
                    sem.acquire_timeout(GATE_WAIT)?;
                }
            } else {
                sem.release()?;
            }
        }
        if let (0, Some(event)) = (i, &self.first_waits) {
            event.wait_timeout(GATE_WAIT)?;
        }
        if let Some((from, event)) = &self.gate {
            if i >= *from {
                event.wait_timeout(GATE_WAIT)?;
            }
        }
        if self.slow_ms > 0 {
            std::thread::sleep(Duration::from_millis(self.slow_ms));
        }
        Ok((Tensor::full(&[4], i as f64, DType::F32)?, i as i64))
    }
}

pub type Loader = DataLoader<Samples>;

/// The labels of every batch of one epoch, panicking on an error.
pub fn labels_of_epoch(loader: &mut Loader) -> Vec<Vec<i64>> {
    loader
        .iter()
        .map(|b| {
            let (x, y) = b.expect("batch");
            let labels = y.to_vec::<i64>().unwrap();
            // The images match their labels: sample i is [i; 4].
            let pixels = x.to_vec::<f32>().unwrap();
            for (k, l) in labels.iter().enumerate() {
                assert!(pixels[4 * k..4 * k + 4].iter().all(|&p| p == *l as f32));
            }
            labels
        })
        .collect()
}

/// A stream of `0..n`; worker k of m yields k, k + m, …; `fail_at` yields an `Err`.
#[derive(Clone, Serialize, Deserialize)]
pub struct Stream {
    pub n: usize,
    pub fail_at: Option<usize>,
}

impl multiproc::data::IterableDataset for Stream {
    type Item = i64;
    type Iter = Box<dyn Iterator<Item = multiproc::Result<i64>>>;

    fn iter(&self, _epoch: u64) -> Self::Iter {
        let (k, m) = worker_info().map_or((0, 1), |w| (w.id, w.num_workers));
        let fail_at = self.fail_at;
        Box::new((k..self.n).step_by(m).map(move |i| {
            if Some(i) == fail_at {
                Err(Error::InvalidArgument(format!("record {i} is truncated")))
            } else {
                Ok(i as i64)
            }
        }))
    }
}

pub fn stream_batches(
    stream: Stream,
    workers: usize,
    in_order: bool,
) -> Vec<multiproc::Result<Vec<i64>>> {
    let mut loader = multiproc::data::DataLoaderBuilder::new(stream)
        .batch_size(2)
        .num_workers(workers)
        .in_order(in_order)
        .build_iterable()
        .unwrap();
    let epochs: Vec<Vec<_>> = (0..2)
        .map(|_| {
            loader
                .iter()
                .map(|b| b.map(|t| t.to_vec::<i64>().unwrap()))
                .collect()
        })
        .collect();
    epochs.into_iter().next().unwrap()
}
