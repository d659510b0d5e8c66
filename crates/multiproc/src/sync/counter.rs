//! [`FutexCount`]: a count of free places in two shared words — the count and its
//! sleepers — that takers wait on with a futex. The one mechanism under
//! [`Semaphore`](super::Semaphore) (its permits) and a bounded queue (its places).
//!
//! The protocol is written against [`Word`] (see `sync::word`): in a process, a `std`
//! atomic in shared memory and the kernel's futex; in the model checker (the `loom`
//! tests below), a loom atomic and a futex emulated with a loom mutex and condition
//! variable, over process-local words. So the code that runs is the code that is
//! checked.
//!
//! Invariants: a place is taken once (`try_take` is one compare-and-swap that never
//! goes below 0); a give never exceeds the bound; a taker that sleeps is always woken
//! by a give that finds it counted in the sleepers (it counts itself before it sleeps,
//! the futex sleeps only while the count is still 0, and the giver reads the sleepers
//! with a read-modify-write after it raised the count, so no wake-up is lost).

use std::sync::atomic::{AtomicU32, Ordering};

use super::word::Word;
use crate::error::Result;
use crate::sys::Deadline;

/// The count and sleeper words of one counter, borrowed from a shared block.
pub(crate) struct FutexCount<'a, W: Word = AtomicU32> {
    value: &'a W,
    sleepers: &'a W,
}

impl<'a, W: Word> FutexCount<'a, W> {
    /// The counter made of these two words.
    pub(crate) fn new(value: &'a W, sleepers: &'a W) -> Self {
        Self { value, sleepers }
    }

    /// Takes one place if one is free now.
    pub(crate) fn try_take(&self) -> bool {
        self.value.update(|v| v.checked_sub(1)).is_ok()
    }

    /// Takes one place, waiting until the deadline; `false` when none came. Spins
    /// briefly before it sleeps: most waits end within microseconds (another process
    /// is giving a place back right now), and a sleep and a wake-up cost far more.
    pub(crate) fn take(&self, deadline: Deadline) -> Result<bool> {
        loop {
            if self.try_take() {
                return Ok(true);
            }
            if self
                .value
                .spin_until(deadline, || self.value.load(Ordering::Acquire) > 0)
            {
                continue;
            }
            self.sleepers.fetch_add(1, Ordering::AcqRel);
            let woke = self.value.wait(0, deadline);
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
            if !woke? {
                return Ok(false);
            }
        }
    }

    /// Gives one place back and wakes a sleeper, unless the count would reach `bound`
    /// (`false` then, nothing changed).
    pub(crate) fn give(&self, bound: Option<u32>) -> bool {
        let given = self
            .value
            .update(|v| {
                let next = v.checked_add(1)?;
                bound.is_none_or(|b| next < b).then_some(next)
            })
            .is_ok();
        // The sleepers are read with a read-modify-write, not a load: a taker counts
        // itself (an RMW) and then sleeps only while the count is 0, and a giver raises
        // the count (an RMW) and then reads the sleepers. With plain acquire loads on
        // both sides that is the store-buffering pattern, which the C++ memory model
        // (and ARM) allows: each side misses the other's write, the taker sleeps and
        // nobody wakes it. An RMW reads the latest value, so one side always sees the
        // other. (x86's locked instructions hide it; the model checker found it.)
        if given && self.sleepers.fetch_add(0, Ordering::AcqRel) > 0 {
            self.value.wake_one();
        }
        given
    }

    /// The free places right now.
    pub(crate) fn value(&self) -> u32 {
        self.value.load(Ordering::Acquire)
    }
}

/// The counter under the loom model checker: every interleaving of a few takers and
/// givers (loom explores them all, up to its preemption bound), over process-local
/// words. Hundreds of thousands of runs: `.ci/run` runs them in release,
/// `cargo test --release -p multiproc --lib counter::model -- --ignored --nocapture`.
#[cfg(test)]
mod model {
    use super::*;
    use crate::model_check::explore;
    use crate::sync::word::model::ModelWord;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU32 as LoomU32;

    fn words(value: u32) -> Arc<(ModelWord, ModelWord)> {
        Arc::new((ModelWord::new(value), ModelWord::new(0)))
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release (cargo test --release --lib counter::model -- --ignored)"]
    fn two_takers_and_two_givers_lose_no_place_and_no_wake_up() {
        let runs = explore(2, || {
            let w = words(0);
            let takers: Vec<_> = (0..2)
                .map(|_| {
                    let w = Arc::clone(&w);
                    loom::thread::spawn(move || {
                        assert!(FutexCount::new(&w.0, &w.1).take(None).unwrap());
                    })
                })
                .collect();
            let givers: Vec<_> = (0..2)
                .map(|_| {
                    let w = Arc::clone(&w);
                    loom::thread::spawn(move || {
                        assert!(FutexCount::new(&w.0, &w.1).give(None));
                    })
                })
                .collect();
            for t in takers.into_iter().chain(givers) {
                t.join().unwrap();
            }
            let count = FutexCount::new(&w.0, &w.1);
            assert_eq!((count.value(), w.1.load(Ordering::SeqCst)), (0, 0));
        });
        eprintln!("counter model, 2 takers x 2 givers: {runs} interleavings");
        assert!(runs > 1);
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release (cargo test --release --lib counter::model -- --ignored)"]
    fn a_bounded_count_never_passes_its_bound_and_each_place_goes_once() {
        let runs = explore(2, || {
            // Capacity 2 (the bound is one past the most places): two free places,
            // two takers that try once, and a giver that gives back what it can.
            let w = words(2);
            let took = Arc::new(LoomU32::new(0));
            let takers: Vec<_> = (0..2)
                .map(|_| {
                    let (w, took) = (Arc::clone(&w), Arc::clone(&took));
                    loom::thread::spawn(move || {
                        if FutexCount::new(&w.0, &w.1).try_take() {
                            took.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                })
                .collect();
            let giver = {
                let w = Arc::clone(&w);
                loom::thread::spawn(move || FutexCount::new(&w.0, &w.1).give(Some(3)))
            };
            for t in takers {
                t.join().unwrap();
            }
            let gave = giver.join().unwrap();
            let count = FutexCount::new(&w.0, &w.1);
            let took = took.load(Ordering::SeqCst);
            assert!(count.value() <= 2, "past the bound: {}", count.value());
            assert_eq!(
                count.value() + took,
                2 + u32::from(gave),
                "a place lost or made"
            );
        });
        eprintln!("counter model, bounded, 2 takers and a giver: {runs} interleavings");
        assert!(runs > 1);
    }

    #[test]
    #[ignore = "model checker: .ci/run runs it in release (cargo test --release --lib counter::model -- --ignored)"]
    fn a_taker_that_stops_for_good_at_any_step_never_blocks_the_others() {
        // A taker that stops at any point (a process SIGSTOPped, or killed) holds no
        // lock: the other taker and the giver finish whatever it did. Here it stops
        // after its first step of `take` (it may have taken a place, or counted itself
        // a sleeper); loom tries every point of the others around it.
        let runs = explore(2, || {
            let w = words(1);
            let stopped = {
                let w = Arc::clone(&w);
                loom::thread::spawn(move || {
                    // Counts itself as a sleeper and never sleeps nor leaves.
                    w.1.fetch_add(1, Ordering::AcqRel);
                })
            };
            let taker = {
                let w = Arc::clone(&w);
                loom::thread::spawn(move || FutexCount::new(&w.0, &w.1).take(None).unwrap())
            };
            let giver = {
                let w = Arc::clone(&w);
                loom::thread::spawn(move || FutexCount::new(&w.0, &w.1).give(None))
            };
            stopped.join().unwrap();
            assert!(taker.join().unwrap());
            assert!(giver.join().unwrap());
            assert_eq!(
                w.0.load(Ordering::SeqCst),
                1,
                "one place left for whoever comes"
            );
        });
        eprintln!("counter model, a stopped sleeper: {runs} interleavings");
        assert!(runs > 1);
    }
}
