//! The one driver of the crate's loom models (test builds only): runs a model under
//! loom, preempting each thread at most a given number of times (loom's bound; every
//! interleaving within it is explored), and says how many interleavings it explored.
//!
//! It sits below every module with a model (`shm::segment`, `sync`, `queue`), so each
//! uses it without reaching a layer up or down. The count is kept per call, not in a
//! static: the models run as parallel tests, and a count they shared mixed their runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Runs `model` under loom with `preemption_bound`; how many interleavings it explored
/// (every 100,000 are reported on stderr as they go: the large models run for minutes).
pub(crate) fn explore(preemption_bound: usize, model: impl Fn() + Sync + Send + 'static) -> usize {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemption_bound);
    builder.check(move || {
        let runs = counted.fetch_add(1, Ordering::SeqCst) + 1;
        if runs % 100_000 == 0 {
            eprintln!("  ... {runs} interleavings");
        }
        model();
    });
    runs.load(Ordering::SeqCst)
}
