//! Idle work: what a process does while nobody calls into the library — let go of
//! memory that stopped being used (like an allocator's dirty-page decay).
//!
//! Owns one thread per process (started on demand, ended when no job has work left)
//! that runs the registered jobs every [`TICK`]. A job is a closure that returns
//! whether it still has work for later ticks; a job that returns `false` is dropped,
//! and its owner registers it again (with [`wake`]) when it has work once more. Jobs
//! are registered under a key (the address of what the job looks after: a static, or
//! the value of a queue), once: waking a job that is registered already costs a lock
//! and a comparison.
//!
//! The layers register their own jobs (the block pools and the map cache in `shm`, each
//! queue's block custody in `queue`); this module knows nothing of them, and a job runs
//! outside the registry's lock, so it may register another. A `fork` child starts with
//! no jobs and no thread (`sys::fork_local`).

use std::time::Duration;

use crate::sys::fork_local::ForkLocal;

/// How often the idle thread runs the jobs.
pub(crate) const TICK: Duration = Duration::from_millis(200);

/// A registered job: returns whether it has work left for later ticks.
type Job = Box<dyn FnMut() -> bool + Send>;

#[derive(Default)]
struct Registry {
    jobs: Vec<(usize, Job)>,
    /// Whether the idle thread runs (it ends when no job is left).
    running: bool,
}

static REGISTRY: ForkLocal<Registry> = ForkLocal::new();

/// Held by the idle thread while it runs a tick's jobs. A job may hold what it looks
/// after for the length of its run (the custody job upgrades its `Weak`), so a value
/// dropped by its owner can be freed on the idle thread, a moment later:
/// [`wait_for_tick`] waits that moment out.
static TICK_RUNNING: ForkLocal<()> = ForkLocal::new();

/// Registers `job` under `key` unless a job with that key is registered already, and
/// makes sure the idle thread runs. `make` is called only when the job is new.
pub(crate) fn wake(key: usize, make: impl FnOnce() -> Job) {
    let mut registry = REGISTRY.lock();
    if !registry.jobs.iter().any(|(k, _)| *k == key) {
        registry.jobs.push((key, make()));
    }
    if !registry.running {
        let started = std::thread::Builder::new()
            .name("multiproc-idle".into())
            .spawn(run);
        match started {
            Ok(_) => registry.running = true,
            // Without a thread, idle memory is let go at the next call that wakes a
            // job (a later allocation or receive tries again).
            Err(e) => tracing::debug!("multiproc: cannot start the idle thread: {e}"),
        }
    }
}

/// Waits until the idle thread is between ticks, so that whatever a job held during
/// the tick that was running has been let go (a leak check counts fds after it).
/// Jobs never wait, so this returns within one tick's work.
#[cfg(feature = "testing-internals")]
pub(crate) fn wait_for_tick() {
    drop(TICK_RUNNING.lock());
}

/// The idle thread: runs every job each tick, outside the lock, until none is left.
fn run() {
    loop {
        std::thread::sleep(TICK);
        let tick = TICK_RUNNING.lock();
        let mut jobs = std::mem::take(&mut REGISTRY.lock().jobs);
        jobs.retain_mut(|(_, job)| job());
        drop(tick);
        let mut registry = REGISTRY.lock();
        // Jobs registered while these ran are kept beside them (a key twice is harmless:
        // both run, and the one without work drops out).
        jobs.append(&mut registry.jobs);
        registry.jobs = jobs;
        if registry.jobs.is_empty() {
            registry.running = false;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    #[cfg_attr(miri, ignore = "threads and sleeps")]
    fn a_job_runs_until_it_has_no_work_left_and_can_be_woken_again() {
        let runs = Arc::new(AtomicUsize::new(0));
        let job = |runs: &Arc<AtomicUsize>| {
            let runs = Arc::clone(runs);
            Box::new(move || runs.fetch_add(1, Ordering::SeqCst) + 1 < 3) as Job
        };
        let key = Arc::as_ptr(&runs) as usize;
        wake(key, || job(&runs));
        // Waking it again while registered adds nothing.
        wake(key, || panic!("registered twice"));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while runs.load(Ordering::SeqCst) < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "the job never ran 3 times"
            );
            std::thread::sleep(TICK);
        }
        // Done: it dropped out; woken again, it runs again.
        while REGISTRY.lock().jobs.iter().any(|(k, _)| *k == key) {
            assert!(
                std::time::Instant::now() < deadline,
                "the job was never dropped"
            );
            std::thread::sleep(TICK);
        }
        wake(key, || job(&runs));
        while runs.load(Ordering::SeqCst) < 4 {
            assert!(
                std::time::Instant::now() < deadline,
                "the woken job never ran"
            );
            std::thread::sleep(TICK);
        }
    }
}
