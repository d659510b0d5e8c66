//! Observability across real processes: a worker's `tracing` events reach the
//! subscriber of its parent. Its own test binary, because the subscriber it installs is
//! global.

multiproc::test_init!();

mod common;

use std::fmt::Write as _;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use multiproc::{StartMethod, start_processes};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use common::workers::noop;

const DEADLINE: Duration = Duration::from_secs(60);

/// Every event this process saw, as `target level field=value ...`.
static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
static ARRIVED: Condvar = Condvar::new();

/// A subscriber that records INFO and above.
struct Recorder;

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::INFO
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::INFO)
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields(format!(
            "{} {}",
            event.metadata().target(),
            event.metadata().level()
        ));
        event.record(&mut fields);
        SEEN.lock().unwrap().push(fields.0);
        ARRIVED.notify_all();
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn log_something(rank: usize, answer: u32) {
    tracing::info!(answer, "hello from rank {rank}");
    tracing::debug!("too verbose for the parent");
    tracing::warn!(target: "my_app::loader", "shard {rank} is slow");
}

/// Waits until `n` recorded events satisfy `pred`, at most `timeout`.
fn wait_for_events(n: usize, pred: impl Fn(&str) -> bool, timeout: Duration) -> Vec<String> {
    let until = Instant::now() + timeout;
    let mut seen = SEEN.lock().unwrap();
    loop {
        let matching: Vec<String> = seen.iter().filter(|e| pred(e)).cloned().collect();
        if matching.len() >= n {
            return matching;
        }
        let left = until.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "only {matching:?} of {n} events arrived; saw {seen:?}"
        );
        seen = ARRIVED.wait_timeout(seen, left).unwrap().0;
    }
}

#[test]
fn a_workers_events_reach_the_parents_subscriber() {
    tracing::subscriber::set_global_default(Recorder).unwrap();
    // The forwarding pipe is made with the first worker: before the leak check starts.
    multiproc::spawn(noop, (), 1).unwrap();
    common::run(DEADLINE, || {
        for method in StartMethod::ALL {
            SEEN.lock().unwrap().clear();
            let mut ctx = start_processes(log_something, 42u32, 2, method).unwrap();
            let pids = ctx.pids();
            ctx.join_timeout(Duration::from_secs(30)).unwrap();
            let hello = wait_for_events(
                2,
                |e| e.contains("hello from rank"),
                Duration::from_secs(30),
            );
            for (rank, pid) in pids.iter().enumerate() {
                let expected = format!(
                    "multiproc::worker INFO message=hello from rank {rank} answer=42 rank={rank} pid={pid} worker_target=\"observability\""
                );
                assert!(
                    hello.contains(&expected),
                    "{method}: {expected} not in {hello:?}"
                );
            }
            let slow = wait_for_events(2, |e| e.contains("is slow"), Duration::from_secs(30));
            assert!(
                slow.iter().all(|e| e.starts_with("multiproc::worker WARN")
                    && e.contains("worker_target=\"my_app::loader\"")),
                "{method}: {slow:?}"
            );
            let seen = SEEN.lock().unwrap();
            assert!(
                !seen.iter().any(|e| e.contains("too verbose")),
                "{method}: a DEBUG event crossed although the parent wants INFO: {seen:?}"
            );
        }
    });
}
