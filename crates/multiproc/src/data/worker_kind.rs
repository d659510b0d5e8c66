//! [`WorkerKind`]: a loader's workers as processes or as threads, behind one handle
//! ([`Worker`]) that the worker set starts, watches and stops the same way.
//!
//! A thread worker gets its arguments as a process does — encoded, through a pipe,
//! decoded on its side — so it holds its own copy of the data set (a [`FromFn`]
//! builds its own) and the data set need not be `Send`; it talks to the loader over
//! the same task pipe and reply queue, and its batches are the same shared-memory
//! tensors. Its failures come as a process's do: an `Err` or a panic (caught, with
//! its message) ends the thread, which the loader notices as a death.
//!
//! [`FromFn`]: super::FromFn

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::process::Process;
use crate::queue::pipe;
use crate::sync::Value;

/// What a loader's workers are (set by
/// [`DataLoaderBuilder::workers`](super::DataLoaderBuilder::workers)); the API, the
/// batches and the failure report ([`Error::LoaderFailed`]) are the same for both.
///
/// | | `Process` (default) | `Thread` |
/// |---|---|---|
/// | start | a process (spawn, fork or fork server): milliseconds | a thread: microseconds, plus decoding its arguments |
/// | an `Err` or a panic in the data set | reported, the worker restartable | the same (the panic is caught) |
/// | a crash (segfault, abort), the OOM killer | kills the worker alone: reported with its signal, restartable | kills the whole program |
/// | a worker that hangs | killed when the loader stops it (timeout, drop) | cannot be killed: left running, detached, when the loader stops it |
/// | memory | its own address space, returned to the system when it exits | the caller's: its allocations stay in this process's heap |
/// | statics, environment, working directory | its own | shared with the caller |
/// | `worker_pids` | process ids | thread ids (Linux tids) |
///
/// To report where a worker thread panicked, the first thread worker installs a panic
/// hook that notes the place for threads named `multiproc-loader-<id>` and then calls
/// the hook that was installed before (so panics print as they did).
///
/// Rust has no global interpreter lock, so threads load in parallel; choose them when
/// the data set's code is trusted not to crash or hang and start-up time matters (many
/// short epochs without persistent workers, tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WorkerKind {
    /// Worker processes, started by the loader's
    /// [`start_method`](super::DataLoaderBuilder::start_method).
    #[default]
    Process,
    /// Worker threads in the loader's own process.
    Thread,
}

impl WorkerKind {
    /// What a worker's id is, in messages: `pid` or `thread` (its tid).
    pub(crate) fn label(self) -> &'static str {
        match self {
            WorkerKind::Process => "pid",
            WorkerKind::Thread => "thread",
        }
    }
}

/// One running worker, of either kind, with what the loader knows of it.
pub(crate) struct Worker {
    handle: Handle,
    /// The sample it is loading (`NOT_LOADING` between samples), which it writes.
    loading: Option<Value<u64>>,
    /// Its memory cgroup's OOM-kill file, and the count there when first seen in it.
    oom_watch: Option<(PathBuf, u64)>,
    /// Its resident memory when last read, and when.
    rss: Option<(u64, Instant)>,
}

/// What a worker's "loading" word holds between samples.
pub(crate) const NOT_LOADING: u64 = u64::MAX;

/// How often a worker's resident memory is read (while the loader waits).
const RSS_INTERVAL: Duration = Duration::from_millis(100);

enum Handle {
    Process(Box<Process>),
    Thread(ThreadWorker),
}

impl Worker {
    /// A started worker process, writing the sample it loads into `loading`.
    pub(crate) fn process(process: Process, loading: Option<Value<u64>>) -> Self {
        Worker::new(Handle::Process(Box::new(process)), loading)
    }

    /// A started worker thread.
    pub(crate) fn thread(thread: ThreadWorker, loading: Option<Value<u64>>) -> Self {
        Worker::new(Handle::Thread(thread), loading)
    }

    fn new(handle: Handle, loading: Option<Value<u64>>) -> Self {
        let mut w = Worker {
            handle,
            loading,
            oom_watch: None,
            rss: None,
        };
        w.observe();
        w
    }

    /// What [`id`](Self::id) is, in messages: `pid` or `thread`.
    pub(crate) fn label(&self) -> &'static str {
        match &self.handle {
            Handle::Process(_) => WorkerKind::Process.label(),
            Handle::Thread(_) => WorkerKind::Thread.label(),
        }
    }

    /// A process's pidfd, readable once it has exited (a thread has none).
    #[cfg(feature = "async")]
    pub(crate) fn pidfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.handle {
            Handle::Process(p) => Some(p.sentinel()),
            Handle::Thread(_) => None,
        }
    }

    /// Its pid (a process) or tid (a thread).
    pub(crate) fn id(&self) -> u32 {
        match &self.handle {
            Handle::Process(p) => p.pid(),
            Handle::Thread(t) => t.tid,
        }
    }

    /// Reads a worker process's resident memory, at most every [`RSS_INTERVAL`].
    pub(crate) fn observe(&mut self) {
        let Handle::Process(p) = &self.handle else {
            return;
        };
        if self.rss.is_some_and(|(_, at)| at.elapsed() < RSS_INTERVAL) {
            return;
        }
        let pid = p.pid();
        // A dying process reads as 0: keep what it had.
        if let Some(bytes) = resident_bytes(pid).filter(|&b| b > 0) {
            self.rss = Some((bytes, Instant::now()));
        }
        if self.oom_watch.is_none() {
            // Until the worker says where it is (after its `worker_init`, which may move
            // it), the cgroup it was started in.
            self.oom_watch = oom_file(&format!("/proc/{pid}/cgroup"))
                .and_then(|f| Some((read_oom_kills(&f)?, f)))
                .map(|(count, f)| (f, count));
        }
    }

    /// The worker's own report of its memory cgroup's OOM-kill file and count (see
    /// [`memory_cgroup_of_self`]): the one its death is checked against.
    pub(crate) fn watch_memory_cgroup(&mut self, file: String, count: u64) {
        self.oom_watch = Some((PathBuf::from(file), count));
    }

    /// What the loader knows of a dead worker's end, to add to its report: the sample
    /// it was loading, and for a process killed by a signal, whether the OOM killer
    /// did it and its memory when last seen.
    pub(crate) fn death_note(&self) -> String {
        let mut note = String::new();
        if let Some(i) = self.loading.as_ref().map(Value::get) {
            if i != NOT_LOADING {
                note.push_str(&format!("; it was loading sample {i}"));
            }
        }
        if let Handle::Process(_) = &self.handle {
            let counts = self
                .oom_watch
                .as_ref()
                .and_then(|(file, before)| Some((*before, read_oom_kills(file)?)));
            match counts {
                Some((before, now)) if now > before => note.push_str(&format!(
                    "; the OOM killer killed it, most likely (its memory cgroup's oom_kill \
                     count rose from {before} to {now} while it ran): give the job more memory, \
                     or use fewer workers or a smaller prefetch_factor"
                )),
                Some((before, _)) => note.push_str(&format!(
                    "; its memory cgroup counted no OOM kill while it ran (oom_kill stayed at \
                     {before}): most likely not the OOM killer"
                )),
                _ => {}
            }
            if let Some((bytes, at)) = self.rss {
                note.push_str(&format!(
                    "; its resident memory was {:.1} MiB when last seen, {} ms before",
                    bytes as f64 / (1u64 << 20) as f64,
                    at.elapsed().as_millis()
                ));
            }
        }
        note
    }

    /// How it ended, once it has (`None` while it runs).
    pub(crate) fn exited(&mut self) -> Option<String> {
        match &mut self.handle {
            Handle::Process(p) => p.exit_status().map(|s| s.to_string()),
            Handle::Thread(t) => t.finished().then(|| "its thread ended".to_string()),
        }
    }

    /// Why it failed, once it has ended failing: the error it returned, its panic, or
    /// (a process) the signal or exit code.
    pub(crate) fn error(&mut self) -> Option<String> {
        match &mut self.handle {
            Handle::Process(p) => p.error().map(|e| e.to_string()),
            Handle::Thread(t) => t.outcome().and_then(|o| o.err()),
        }
    }

    pub(crate) fn is_alive(&self) -> bool {
        match &self.handle {
            Handle::Process(p) => p.is_alive(),
            Handle::Thread(t) => !t.finished(),
        }
    }

    /// Waits up to `grace` for it to end on its own (its task pipe closed).
    pub(crate) fn wait(&mut self, grace: Duration) {
        match &mut self.handle {
            Handle::Process(p) => {
                if let Err(e) = p.join_timeout(grace) {
                    if !e.is_timeout() {
                        tracing::warn!("multiproc: waiting for a data loader worker: {e}");
                    }
                }
            }
            Handle::Thread(t) => t.wait(grace),
        }
    }

    /// Ends it now: a process is killed; a thread cannot be, and is left to end on its
    /// own (detached) with a warning.
    pub(crate) fn kill(&mut self) {
        match &mut self.handle {
            Handle::Process(p) => {
                if let Err(e) = p.kill() {
                    tracing::warn!("multiproc: killing a data loader worker: {e}");
                }
            }
            Handle::Thread(t) => {
                if !t.finished() {
                    tracing::warn!(
                        "multiproc: data loader worker thread {} is still busy after its \
                         loader stopped it; a thread cannot be killed, so it is left to finish \
                         (use WorkerKind::Process for data sets that may hang)",
                        t.tid
                    );
                }
            }
        }
    }
}

/// How a thread worker ended, and a way to wait for it.
#[derive(Default)]
struct Ending {
    outcome: Mutex<Option<std::result::Result<(), String>>>,
    ended: Condvar,
}

/// A worker thread.
pub(crate) struct ThreadWorker {
    tid: u32,
    ending: Arc<Ending>,
    handle: Option<JoinHandle<()>>,
}

impl ThreadWorker {
    /// Starts `body(id, args)` on a thread, `args` sent to it encoded as a process
    /// would get them.
    pub(crate) fn start<A>(
        body: fn(usize, A) -> std::result::Result<(), String>,
        id: usize,
        args: A,
    ) -> Result<Self>
    where
        A: Serialize + DeserializeOwned + 'static,
    {
        install_location_hook();
        let (ours, theirs) = pipe::<A>()?;
        let ending = Arc::new(Ending::default());
        let theirs_ending = Arc::clone(&ending);
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name(format!("{THREAD_NAME_PREFIX}{id}"))
            .spawn(move || {
                let _ = tid_tx.send(crate::sys::process::current_tid());
                let outcome = match theirs.recv() {
                    Ok(args) => match catch_unwind(AssertUnwindSafe(|| body(id, args))) {
                        Ok(r) => r,
                        Err(panic) => {
                            let at = PANIC_AT
                                .with(|p| p.borrow_mut().take())
                                .map(|l| format!(" at {l}"))
                                .unwrap_or_default();
                            Err(format!("it panicked{at}: {}", panic_text(&*panic)))
                        }
                    },
                    Err(e) => Err(format!("cannot receive its data set and collate: {e}")),
                };
                let mut slot = theirs_ending
                    .outcome
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                *slot = Some(outcome);
                theirs_ending.ended.notify_all();
            })
            .map_err(|e| Error::os(format!("starting data loader worker thread {id}"), e))?;
        let tid = tid_rx.recv().unwrap_or(0);
        let worker = ThreadWorker {
            tid,
            ending,
            handle: Some(handle),
        };
        ours.send(args).map_err(|e| {
            Error::Closed(format!(
                "cannot hand data loader worker thread {id} its data set: {}",
                e.error
            ))
        })?;
        Ok(worker)
    }

    fn outcome(&self) -> Option<std::result::Result<(), String>> {
        self.ending
            .outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn finished(&self) -> bool {
        self.outcome().is_some()
    }

    fn wait(&mut self, grace: Duration) {
        let until = Instant::now() + grace;
        let mut slot = self
            .ending
            .outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        while slot.is_none() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            slot = match self.ending.ended.wait_timeout(slot, left) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        drop(slot);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for ThreadWorker {
    /// Joins a thread that has ended; one still running is detached.
    fn drop(&mut self) {
        if self.finished() {
            if let Some(h) = self.handle.take() {
                let _ = h.join();
            }
        }
    }
}

/// The file that counts OOM kills in the memory cgroup named by a `/proc/<pid>/cgroup`
/// file: v1 `memory.oom_control`, or v2 `memory.events` (which counts kills by any
/// OOM killer, the system's included), readable without root; `None` where neither can
/// be read.
fn oom_file(proc_cgroup: &str) -> Option<PathBuf> {
    let cgroups = std::fs::read_to_string(proc_cgroup).ok()?;
    let mut v2 = None;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.is_empty() {
            // Hybrid hierarchies mount v2 at `unified`; v1's memory controller wins.
            v2 = [
                format!("/sys/fs/cgroup{path}/memory.events"),
                format!("/sys/fs/cgroup/unified{path}/memory.events"),
            ]
            .into_iter()
            .map(PathBuf::from)
            .find(|f| read_oom_kills(f).is_some());
            continue;
        } else if controllers.split(',').any(|c| c == "memory") {
            PathBuf::from(format!("/sys/fs/cgroup/memory{path}/memory.oom_control"))
        } else {
            continue;
        };
        if read_oom_kills(&file).is_some() {
            return Some(file);
        }
    }
    v2
}

/// This process's memory cgroup's OOM-kill file and its count now: what a worker
/// reports with its first reply, after its `worker_init` (which may have moved it).
pub(crate) fn memory_cgroup_of_self() -> Option<(String, u64)> {
    let file = oom_file("/proc/self/cgroup")?;
    let count = read_oom_kills(&file)?;
    Some((file.to_string_lossy().into_owned(), count))
}

/// The OOM-kill count in `file` (see [`oom_file`]).
fn read_oom_kills(file: &Path) -> Option<u64> {
    oom_kill_count(&std::fs::read_to_string(file).ok()?)
}

/// The `oom_kill N` line of a cgroup's memory.events or memory.oom_control.
pub(crate) fn oom_kill_count(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next() == Some("oom_kill"))
            .then(|| words.next()?.parse().ok())
            .flatten()
    })
}

/// A process's resident memory (`/proc/<pid>/statm`), in bytes.
fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * crate::sys::mmap::page_size() as u64)
}

/// What worker threads are named: this, then the worker id.
const THREAD_NAME_PREFIX: &str = "multiproc-loader-";

thread_local! {
    /// Where the last panic on this worker thread happened (`file:line:column`).
    static PANIC_AT: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Installs, once per process, a panic hook that notes where a worker thread panicked
/// (a caught panic's payload does not say), so a thread's report names the place as a
/// process's does; every panic then goes on to the hook that was there before.
fn install_location_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with(THREAD_NAME_PREFIX));
            if let (true, Some(l)) = (ours, info.location()) {
                let at = format!("{}:{}:{}", l.file(), l.line(), l.column());
                PANIC_AT.with(|p| *p.borrow_mut() = Some(at));
            }
            previous(info);
        }));
    });
}

/// A panic's message.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oom_kill_count_is_read_from_either_cgroup_version() {
        let v2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(oom_kill_count(v2), Some(2));
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n";
        assert_eq!(oom_kill_count(v1), Some(7));
        assert_eq!(oom_kill_count("oom 3\n"), None);
    }

    #[test]
    fn this_process_has_an_oom_count_where_cgroups_say() {
        // Where the machine exposes a memory cgroup, it is found and read.
        if let Some(file) = oom_file("/proc/self/cgroup") {
            assert!(read_oom_kills(&file).is_some(), "{}", file.display());
        }
        assert_eq!(oom_file("/proc/self/no-such-file"), None);
    }

    #[test]
    fn this_process_has_a_resident_size() {
        let me = std::process::id();
        assert!(resident_bytes(me).is_some_and(|b| b > 0));
    }
}
