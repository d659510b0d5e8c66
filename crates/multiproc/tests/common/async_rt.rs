//! What the async tests (feature `async`: tests/async_queue.rs, tests/async_sync.rs)
//! share: a tokio runtime, and the warm-up that starts the reactor threads and the fd
//! reactor (which live as long as the process) before a test counts fds.

use std::time::{Duration, Instant};

use multiproc::{Event, Process};

pub const DEADLINE: Duration = Duration::from_secs(120);
pub const WAIT: Duration = Duration::from_secs(30);

pub fn sleep_then_exit(_rank: usize, ms: u64) -> multiproc::Result<()> {
    std::thread::sleep(Duration::from_millis(ms));
    Ok(())
}

/// Starts the reactor threads and the fd reactor (which keep an eventfd for the life of
/// the process) before a test counts fds.
pub fn warm_up() {
    let _alone = super::one_at_a_time();
    let rt = runtime();
    rt.block_on(async {
        let e = Event::new().unwrap();
        let base = multiproc::__testing::parked_word_waits();
        let waiter = {
            let e = e.clone();
            tokio::spawn(async move { e.wait_async().await })
        };
        until_parked(multiproc::__testing::parked_word_waits, base + 1).await;
        e.set();
        waiter.await.unwrap().unwrap();
        let mut p = Process::builder(sleep_then_exit, 0, 50u64).start().unwrap();
        tokio::time::timeout(WAIT, p.join_async())
            .await
            .unwrap()
            .unwrap();
    });
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Waits (at most `WAIT`) until `count()` — `__testing::parked_word_waits` or
/// `parked_fd_waits` — reaches `n`: a test knows its task is parked before it asserts
/// that the task has not finished, instead of sleeping and hoping.
pub async fn until_parked(count: fn() -> usize, n: usize) {
    let deadline = Instant::now() + WAIT;
    while count() < n {
        assert!(
            Instant::now() < deadline,
            "{n} parked waits expected within {WAIT:?}, {} seen",
            count()
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
