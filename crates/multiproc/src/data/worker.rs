//! The loader worker: the messages between a worker process and its loader, and the
//! worker's body.
//!
//! Protocol: each worker has its own pipe on which the loader sends [`Task`]s (the
//! indices of one batch), and all workers put a [`Reply`] per task on one shared
//! queue, in the order their tasks came. A worker never stops on a failed batch (the
//! reply carries the error); it ends when its task pipe closes. A worker that panics
//! or is killed sends nothing more: the loader sees its process exit and blames the
//! first task it held. Replies carry the worker's generation, so a reply from a worker
//! that was replaced is recognised and dropped, and the task's run (one per
//! `iter()`), so a reply to an abandoned run — even one of the same epoch number,
//! after a `load_state_dict` — is never taken for the current run's.
//!
//! The epoch travels with every task: a worker tells its data set
//! ([`Dataset::set_epoch`]) and its [`WorkerInfo`] when it changes, so persistent
//! workers follow `set_epoch` like fresh ones.

use std::time::Instant;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::collate::Collate;
use super::dataset::{Dataset, IterableDataset, WorkerInfo, set_worker_info};
use super::options::Options;
use super::state::{Cursor, StreamState, worker_seed};
use super::worker_kind::{NOT_LOADING, ThreadWorker, Worker, WorkerKind, memory_cgroup_of_self};
use crate::error::Result;
use crate::queue::{Connection, SimpleQueue};
use crate::sync::Value;

/// One batch to load.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Task {
    /// The loader's `iter()` this task belongs to (unique per loader).
    pub run: u64,
    pub epoch: u64,
    pub batch: usize,
    pub indices: Vec<usize>,
    /// Iterable data sets: where this worker's stream resumes in this run (`None`:
    /// from its start). Read on the run's first task.
    pub from: Option<StreamState>,
}

/// What a worker says about one task.
#[derive(Serialize, Deserialize)]
pub(crate) struct Reply<B> {
    pub worker: usize,
    pub generation: u64,
    pub run: u64,
    pub batch: usize,
    pub outcome: Outcome<B>,
    /// Iterable data sets: where the worker's stream stands after this batch.
    pub cursor: Option<Cursor>,
    /// Where the worker's time went.
    pub timing: Timing,
    /// With its first reply: the worker's memory cgroup's OOM-kill file and count, read
    /// after its `worker_init` (which may have moved it), for the loader to compare
    /// when it dies.
    pub memory_cgroup: Option<(String, u64)>,
}

/// Where a worker's time went on one batch, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub(crate) struct Timing {
    /// Loading the samples (`Dataset::get`, or the stream's `next`).
    pub load_ns: u64,
    /// Collating them.
    pub collate_ns: u64,
    /// Putting this worker's *previous* reply on the queue (encoding and sending it):
    /// a reply cannot carry its own.
    pub previous_put_ns: u64,
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// How a task ended.
#[derive(Serialize, Deserialize)]
pub(crate) enum Outcome<B> {
    /// The batch.
    Batch(B),
    /// An iterable data set's worker has no sample left this epoch.
    Exhausted,
    /// The text of the error that loading or collating returned.
    Failed(String),
}

impl<B> From<Result<B>> for Outcome<B> {
    fn from(r: Result<B>) -> Self {
        match r {
            Ok(b) => Outcome::Batch(b),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }
}

/// Everything a worker process gets when it starts.
#[derive(Serialize, Deserialize)]
#[serde(
    bound = "D: Serialize + DeserializeOwned, C: Serialize + DeserializeOwned, B: Serialize + DeserializeOwned"
)]
pub(crate) struct WorkerArgs<D, C, B> {
    pub dataset: D,
    pub collate: C,
    pub tasks: Connection<Task>,
    pub results: SimpleQueue<Reply<B>>,
    pub generation: u64,
    pub num_workers: usize,
    pub seed: u64,
    pub rank: usize,
    /// The epoch the worker is started for (what `worker_init` sees).
    pub epoch: u64,
    /// Samples per batch (used by iterable data sets; a map-style task lists them).
    pub batch_size: usize,
    pub drop_last: bool,
    /// The user's `worker_init`, already resolved by the caller of this worker.
    pub init: Option<super::from_fn::InitFn>,
    /// Where the worker writes the index of the sample it is loading, so that the
    /// loader can name it if the worker dies.
    pub loading: Option<Value<u64>>,
}

impl<D, C, B> WorkerArgs<D, C, B> {
    /// What every worker does first: publish its [`WorkerInfo`] and run the user's
    /// `worker_init`.
    fn begin(&self, id: usize) -> std::result::Result<(), String> {
        self.publish(id, self.epoch);
        match &self.init {
            Some(init) => init.call(id),
            None => Ok(()),
        }
    }

    /// Publishes this worker's [`WorkerInfo`] for `epoch`.
    fn publish(&self, id: usize, epoch: u64) {
        set_worker_info(WorkerInfo {
            id,
            num_workers: self.num_workers,
            epoch,
            rank: self.rank,
            seed: worker_seed(self.seed, epoch, self.rank, id),
        });
    }

    /// The next task from the loader; `None` once the loader has closed the pipe.
    fn next_task(&self) -> std::result::Result<Option<Task>, String> {
        match self.tasks.recv() {
            Ok(task) => Ok(Some(task)),
            Err(crate::error::Error::Closed(_) | crate::error::Error::Disconnected(_)) => Ok(None),
            Err(e) => Err(format!("cannot read its next task: {e}")),
        }
    }
}

/// A loader worker's body: [`run_worker`] or [`run_iterable_worker`].
pub(crate) type WorkerBody<D, C, B> =
    fn(usize, WorkerArgs<D, C, B>) -> std::result::Result<(), String>;

/// Starts loader worker `id` of generation `generation`: `body` ([`run_worker`] or
/// [`run_iterable_worker`]) on a copy of the data set and the collate, as a daemon
/// process of the loader's start method, or a thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch<D, C, B>(
    body: WorkerBody<D, C, B>,
    dataset: &D,
    collate: &C,
    options: &Options,
    id: usize,
    generation: u64,
    epoch: u64,
    tasks: Connection<Task>,
    results: SimpleQueue<Reply<B>>,
) -> Result<Worker>
where
    D: Serialize + DeserializeOwned + Clone + 'static,
    C: Serialize + DeserializeOwned + Clone + 'static,
    B: Serialize + DeserializeOwned + 'static,
{
    let loading = Value::new(NOT_LOADING)?;
    let args = WorkerArgs {
        loading: Some(loading.clone()),
        dataset: dataset.clone(),
        collate: collate.clone(),
        tasks,
        results,
        generation,
        num_workers: options.num_workers,
        seed: options.seed,
        rank: options.rank,
        epoch,
        batch_size: options.batch_size,
        drop_last: options.drop_last,
        init: options.init_fn(),
    };
    if options.kind == WorkerKind::Thread {
        return Ok(Worker::thread(
            ThreadWorker::start(body, id, args)?,
            Some(loading),
        ));
    }
    let process = crate::process::Process::builder(body, id, args)
        .start_method(options.start_method)
        .world_size(options.num_workers)
        .daemon(true)
        .start()?;
    Ok(Worker::process(process, Some(loading)))
}

/// Loads the samples `indices` and collates them: the work of one batch, in a worker
/// or in the loader's own process.
pub(crate) fn load_batch<D, C>(
    dataset: &D,
    collate: &C,
    indices: &[usize],
    loading: Option<&Value<u64>>,
    timing: &mut Timing,
) -> Result<C::Batch>
where
    D: Dataset,
    C: Collate<D::Item>,
{
    let start = Instant::now();
    let items = indices
        .iter()
        .map(|&i| {
            if let Some(v) = loading {
                v.set(i as u64);
            }
            dataset.get(i)
        })
        .collect::<Result<Vec<_>>>();
    if let Some(v) = loading {
        v.set(NOT_LOADING);
    }
    let loaded = Instant::now();
    timing.load_ns = nanos(loaded - start);
    let batch = collate.collate(items?);
    timing.collate_ns = nanos(loaded.elapsed());
    batch
}

/// The body of every loader worker process (worker id = rank).
pub(crate) fn run_worker<D, C>(
    id: usize,
    mut args: WorkerArgs<D, C, C::Batch>,
) -> std::result::Result<(), String>
where
    D: Dataset + Serialize + DeserializeOwned,
    C: Collate<D::Item>,
{
    args.begin(id)?;
    let mut memory_cgroup = memory_cgroup_of_self();
    let mut epoch = None;
    let mut previous_put_ns = 0;
    loop {
        // `None`: the loader closed our pipe (end of epoch, or dropped): done.
        let Some(task) = args.next_task()? else {
            return Ok(());
        };
        if epoch != Some(task.epoch) {
            epoch = Some(task.epoch);
            args.publish(id, task.epoch);
            args.dataset.set_epoch(task.epoch);
        }
        let mut timing = Timing {
            previous_put_ns,
            ..Timing::default()
        };
        let outcome = load_batch(
            &args.dataset,
            &args.collate,
            &task.indices,
            args.loading.as_ref(),
            &mut timing,
        )
        .into();
        let reply = Reply {
            worker: id,
            generation: args.generation,
            run: task.run,
            batch: task.batch,
            outcome,
            cursor: None,
            timing,
            memory_cgroup: memory_cgroup.take(),
        };
        let put = Instant::now();
        if let Err(e) = args.results.put(reply) {
            return Err(format!(
                "cannot hand batch {} to the loader: {}",
                task.batch, e.error
            ));
        }
        previous_put_ns = nanos(put.elapsed());
    }
}

/// The next batch of an iterable data set's iterator: `Exhausted` (and the iterator
/// dropped) when it has no sample left, or only a short batch under `drop_last`.
pub(crate) fn next_batch<I, T, C>(
    iter: &mut Option<I>,
    collate: &C,
    batch_size: usize,
    drop_last: bool,
    timing: &mut Timing,
) -> Outcome<C::Batch>
where
    I: Iterator<Item = Result<T>>,
    C: Collate<T>,
{
    let Some(it) = iter else {
        return Outcome::Exhausted;
    };
    let start = Instant::now();
    let mut items = Vec::with_capacity(batch_size);
    while items.len() < batch_size {
        match it.next() {
            Some(Ok(item)) => items.push(item),
            Some(Err(e)) => return Outcome::Failed(e.to_string()),
            None => {
                *iter = None;
                break;
            }
        }
    }
    let loaded = Instant::now();
    timing.load_ns = nanos(loaded - start);
    if items.is_empty() || (drop_last && items.len() < batch_size) {
        *iter = None;
        return Outcome::Exhausted;
    }
    let batch = collate.collate(items).into();
    timing.collate_ns = nanos(loaded.elapsed());
    batch
}

/// Where an iterable data set's stream stands: ended, or as the data set reports it.
pub(crate) fn stream_cursor<D: IterableDataset>(dataset: &D, iter: &Option<D::Iter>) -> Cursor {
    match iter {
        None => Cursor::Done,
        Some(it) => dataset.state(it).map_or(Cursor::Unknown, Cursor::At),
    }
}

/// The body of every worker of an iterable data set: each task asks for the next batch
/// of this worker's iterator for the task's epoch.
pub(crate) fn run_iterable_worker<D, C>(
    id: usize,
    args: WorkerArgs<D, C, C::Batch>,
) -> std::result::Result<(), String>
where
    D: IterableDataset + Serialize + DeserializeOwned,
    C: Collate<D::Item>,
{
    args.begin(id)?;
    // The run the iterator belongs to, and the iterator (`None` once exhausted).
    let mut current: Option<(u64, Option<D::Iter>)> = None;
    let mut memory_cgroup = memory_cgroup_of_self();
    let mut previous_put_ns = 0;
    loop {
        // `None`: the loader closed our pipe (end of epoch, or dropped): done.
        let Some(task) = args.next_task()? else {
            return Ok(());
        };
        let mut opened = Ok(());
        if current.as_ref().map(|(r, _)| *r) != Some(task.run) {
            args.publish(id, task.epoch);
            let iter = match &task.from {
                None => Some(args.dataset.iter(task.epoch)),
                Some(state) => match args.dataset.iter_from(task.epoch, state) {
                    Ok(it) => Some(it),
                    Err(e) => {
                        opened = Err(e);
                        None
                    }
                },
            };
            current = Some((task.run, iter));
        }
        let mut timing = Timing {
            previous_put_ns,
            ..Timing::default()
        };
        let (outcome, cursor) = match (opened, current.as_mut()) {
            (Err(e), _) => (Outcome::Failed(format!("resuming its stream: {e}")), None),
            (Ok(()), Some((_, iter))) => {
                let outcome = next_batch(
                    iter,
                    &args.collate,
                    args.batch_size,
                    args.drop_last,
                    &mut timing,
                );
                let cursor = stream_cursor(&args.dataset, iter);
                (outcome, Some(cursor))
            }
            (Ok(()), None) => (Outcome::Exhausted, Some(Cursor::Done)),
        };
        let reply = Reply {
            worker: id,
            generation: args.generation,
            run: task.run,
            batch: task.batch,
            outcome,
            cursor,
            timing,
            memory_cgroup: memory_cgroup.take(),
        };
        let put = Instant::now();
        if let Err(e) = args.results.put(reply) {
            return Err(format!(
                "cannot hand batch {} to the loader: {}",
                task.batch, e.error
            ));
        }
        previous_put_ns = nanos(put.elapsed());
    }
}
