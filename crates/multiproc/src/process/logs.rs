//! Workers' `tracing` events, forwarded to the parent so that the user's subscriber
//! there sees them.
//!
//! When a worker is started while a `tracing` subscriber in the parent is interested in
//! anything ([`LevelFilter::current`] is not `OFF`), its job header carries a
//! [`LogSink`]: the sending end of one process-wide pipe whose receiving end a thread
//! of the parent reads ([`Forwarder`]). The worker installs a small global subscriber
//! ([`WorkerSubscriber`]) that turns each event at or above the parent's level into a
//! [`LogRecord`] on that pipe; the parent's thread emits it again as an event with
//! target `multiproc::worker` and the fields `rank`, `pid` and `worker_target` (the
//! event's own target), its message carrying the event's fields.
//!
//! Invariants: a worker never blocks on logging (a full pipe drops the record); the
//! subscriber does not log about itself (a thread-local guard stops recursion); a
//! worker whose process already has a global subscriber (a forked child inherits its
//! parent's) forwards the events of the thread that runs the worker function, and its
//! other threads' events go where the inherited one writes.

use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use crate::queue::{Connection, pipe};

/// One event of a worker, on its way to the parent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LogRecord {
    rank: usize,
    pid: i32,
    /// 0 = ERROR … 4 = TRACE.
    level: u8,
    target: String,
    /// The `message` field followed by the other fields as `name=value`.
    message: String,
}

/// The sending end of the parent's log pipe, as a job header carries it.
#[derive(Debug, Clone)]
pub(crate) struct LogSink {
    conn: Arc<Connection<LogRecord>>,
    /// The most verbose level the parent's subscriber wanted when the worker started.
    max_level: u8,
}

fn level_index(level: Level) -> u8 {
    match level {
        Level::ERROR => 0,
        Level::WARN => 1,
        Level::INFO => 2,
        Level::DEBUG => 3,
        Level::TRACE => 4,
    }
}

fn filter_index(filter: LevelFilter) -> Option<u8> {
    filter.into_level().map(level_index)
}

impl Serialize for LogSink {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (&*self.conn, self.max_level).serialize(s)
    }
}

impl<'de> Deserialize<'de> for LogSink {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (conn, max_level) = <(Connection<LogRecord>, u8)>::deserialize(d)?;
        Ok(Self {
            conn: Arc::new(conn),
            max_level: max_level.min(4),
        })
    }
}

/// The parent's receiving thread, started on the first worker that needs it.
struct Forwarder {
    sink: Arc<Connection<LogRecord>>,
}

static FORWARDER: OnceLock<Option<Forwarder>> = OnceLock::new();

/// The sink for a worker started now: `None` when no subscriber in this process wants
/// events, or when the forwarding pipe cannot be made (then workers log nowhere new).
pub(crate) fn sink_for_child() -> Option<LogSink> {
    let max_level = filter_index(LevelFilter::current())?;
    let forwarder = FORWARDER.get_or_init(start_forwarder).as_ref()?;
    Some(LogSink {
        conn: Arc::clone(&forwarder.sink),
        max_level,
    })
}

fn start_forwarder() -> Option<Forwarder> {
    let (rx, tx) = match pipe::<LogRecord>() {
        Ok(ends) => ends,
        Err(e) => {
            tracing::warn!("multiproc: workers' log events stay in the workers: {e}");
            return None;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("multiproc-logs".into())
        .spawn(move || {
            // The pipe lives as long as the process: this thread ends with it.
            while let Ok(record) = rx.recv() {
                emit(&record);
            }
        });
    match spawned {
        Ok(_) => Some(Forwarder { sink: Arc::new(tx) }),
        Err(e) => {
            tracing::warn!("multiproc: cannot start the log forwarding thread: {e}");
            None
        }
    }
}

/// Emits a worker's event in this process. `tracing` needs a fixed level per call
/// site, hence one call per level.
fn emit(r: &LogRecord) {
    let (rank, pid, target, message) = (r.rank, r.pid, r.target.as_str(), r.message.as_str());
    match r.level {
        0 => {
            tracing::error!(target: "multiproc::worker", rank, pid, worker_target = target, "{message}")
        }
        1 => {
            tracing::warn!(target: "multiproc::worker", rank, pid, worker_target = target, "{message}")
        }
        2 => {
            tracing::info!(target: "multiproc::worker", rank, pid, worker_target = target, "{message}")
        }
        3 => {
            tracing::debug!(target: "multiproc::worker", rank, pid, worker_target = target, "{message}")
        }
        _ => {
            tracing::trace!(target: "multiproc::worker", rank, pid, worker_target = target, "{message}")
        }
    }
}

/// Installs the forwarding subscriber in a worker: as the global default, or, where
/// the process already has one (a forked child inherits its parent's), as the default
/// of the calling thread, which runs the worker function; keep the returned guard
/// while it runs. Threads the worker function starts then use the inherited one.
pub(crate) fn install_in_worker(
    sink: LogSink,
    rank: usize,
) -> Option<tracing::dispatcher::DefaultGuard> {
    let subscriber = WorkerSubscriber {
        sink,
        rank,
        pid: crate::sys::process::current_pid(),
        next_span: AtomicU64::new(1),
    };
    let dispatch = tracing::Dispatch::new(subscriber);
    match tracing::dispatcher::set_global_default(dispatch.clone()) {
        Ok(()) => None,
        Err(_) => Some(tracing::dispatcher::set_default(&dispatch)),
    }
}

/// The worker's subscriber: events to the parent, spans only numbered.
struct WorkerSubscriber {
    sink: LogSink,
    rank: usize,
    pid: i32,
    next_span: AtomicU64,
}

thread_local! {
    static FORWARDING: Cell<bool> = const { Cell::new(false) };
}

impl Subscriber for WorkerSubscriber {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        level_index(*metadata.level()) <= self.sink.max_level
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(match self.sink.max_level {
            0 => LevelFilter::ERROR,
            1 => LevelFilter::WARN,
            2 => LevelFilter::INFO,
            3 => LevelFilter::DEBUG,
            _ => LevelFilter::TRACE,
        })
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed).max(1))
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        if FORWARDING.with(|f| f.replace(true)) {
            return; // an event from inside the forwarding itself
        }
        let mut text = MessageText::default();
        event.record(&mut text);
        let record = LogRecord {
            rank: self.rank,
            pid: self.pid,
            level: level_index(*event.metadata().level()),
            target: event.metadata().target().to_string(),
            message: text.finish(),
        };
        // Never block a worker on its logs: a full pipe drops the record.
        let _ = self.sink.conn.send_timeout(record, Duration::ZERO);
        FORWARDING.with(|f| f.set(false));
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// An event's fields as one line: the message, then `name=value` for the others.
#[derive(Default)]
struct MessageText {
    message: String,
    fields: String,
}

impl MessageText {
    fn finish(self) -> String {
        match (self.message.is_empty(), self.fields.is_empty()) {
            (_, true) => self.message,
            (true, false) => self.fields,
            (false, false) => format!("{} {}", self.message, self.fields),
        }
    }
}

impl Visit for MessageText {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            if !self.fields.is_empty() {
                self.fields.push(' ');
            }
            let _ = write!(self.fields, "{}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            if !self.fields.is_empty() {
                self.fields.push(' ');
            }
            let _ = write!(self.fields, "{}={value}", field.name());
        }
    }
}
