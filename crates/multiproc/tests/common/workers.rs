//! Worker functions more than one test binary starts (each binary has its own copy; a
//! spawned worker finds its function again in the binary it runs).

use std::time::Duration;

use multiproc::SimpleQueue;

/// Does nothing: for tests about starting, naming and reaping workers.
pub fn noop(_rank: usize, _: ()) {}

/// Stands for work taking `millis` (not a synchronisation).
pub fn sleep_then_ok(_rank: usize, millis: u64) {
    std::thread::sleep(Duration::from_millis(millis));
}

/// Puts its rank on `q`.
pub fn put_rank(rank: usize, q: SimpleQueue<usize>) -> Result<(), multiproc::Error> {
    q.put(rank)?;
    Ok(())
}

/// `target` raises at once; the others sleep (torch's `_test_exception_single_func`)
/// far longer than any test's deadline: they never end on their own, so a sleeper's exit
/// status tells whether the parent terminated it or waited for it.
pub fn raise_in(rank: usize, target: usize) {
    if rank == target {
        panic!("legitimate exception from process {rank}");
    }
    std::thread::sleep(Duration::from_secs(600));
}

/// Whether no process `pid` exists any more (reaped, not only exited).
pub fn process_is_gone(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}
