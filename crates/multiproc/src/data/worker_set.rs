//! The loader's side of its worker processes: starting them, sending tasks, taking in
//! replies and noticing deaths, restarting one, stopping all.
//!
//! Invariants:
//!
//! - Each worker's outstanding tasks are kept in the order sent; its replies come in
//!   that order, so a reply always answers the oldest outstanding task of its worker,
//!   and a worker that dies was working on that one.
//! - A death is attributed only after every reply already queued has been taken in
//!   (a worker may finish a batch and then die on the next).
//! - Stopping closes the task pipes, gives the workers [`STOP_GRACE`] to leave, then
//!   kills and reaps them, and takes in the batches they had put: nothing outlives the
//!   set, not even a segment in an unread message.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::state::Cursor;
use super::worker::{Outcome, Reply, Task, Timing};
use super::worker_kind::Worker;
use crate::error::{Error, Result};
use crate::queue::{Connection, SimpleQueue, pipe};

/// How many workers may be starting at once before the first batch of an epoch has
/// come: the machine's cores. On a machine with fewer cores than workers, starting
/// all of them at once would make the first one — whose batch the caller waits for —
/// share the cores with the starts of all the others; the rest start once a batch has
/// come.
pub(crate) fn eager_starts() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How long stopped workers get to exit on their own before they are killed.
pub(crate) const STOP_GRACE: Duration = Duration::from_millis(50);

/// How often a wait for replies also checks whether a worker has died.
const DEATH_CHECK_INTERVAL: Duration = Duration::from_millis(10);

/// Starts worker `id` (generation `generation`) reading tasks from the given pipe end
/// and putting replies on the given queue.
pub(crate) type Launch<'a, B> =
    &'a dyn Fn(usize, u64, Connection<Task>, SimpleQueue<Reply<B>>) -> Result<Worker>;

/// A task sent and not yet answered.
#[derive(Clone, Debug)]
pub(crate) struct Sent {
    pub task: Task,
    /// Whether this is the one retry after a failure.
    pub retried: bool,
}

/// What a wait produced.
pub(crate) enum Arrival<B> {
    /// A batch of the current run, from `worker`, with where its stream stands after
    /// it (iterable data sets).
    Loaded {
        worker: usize,
        batch: usize,
        data: B,
        cursor: Option<Cursor>,
        timing: Timing,
    },
    /// Task `batch` found the worker's iterable data set exhausted for this run.
    Exhausted { worker: usize, batch: usize },
    /// A task of the current run failed: the worker returned `Err`, panicked or died.
    Failed {
        worker: usize,
        pid: u32,
        sent: Sent,
        what: String,
    },
}

struct Slot {
    process: Worker,
    pid: u32,
    tasks: Connection<Task>,
    generation: u64,
    outstanding: VecDeque<Sent>,
}

/// The running workers of one loader.
pub(crate) struct WorkerSet<B> {
    slots: Vec<Slot>,
    results: SimpleQueue<Reply<B>>,
    arrived: VecDeque<Arrival<B>>,
    last_death_check: Instant,
}

impl<B: Serialize + DeserializeOwned> WorkerSet<B> {
    /// A set with no worker yet: [`grow`](Self::grow) adds them one at a time, so
    /// that the first can be sent its batches while the others start.
    pub(crate) fn empty() -> Result<Self> {
        Ok(WorkerSet {
            slots: Vec::new(),
            results: SimpleQueue::new()?,
            arrived: VecDeque::new(),
            last_death_check: Instant::now(),
        })
    }

    /// Starts one more worker, with the next id.
    pub(crate) fn grow(&mut self, launch: Launch<'_, B>) -> Result<()> {
        let slot = self.start_slot(self.slots.len(), 0, launch)?;
        self.slots.push(slot);
        Ok(())
    }

    fn start_slot(&self, id: usize, generation: u64, launch: Launch<'_, B>) -> Result<Slot> {
        let (ours, theirs) = pipe::<Task>()?;
        let process = launch(id, generation, theirs, self.results.clone())?;
        let pid = process.id();
        Ok(Slot {
            process,
            pid,
            tasks: ours,
            generation,
            outstanding: VecDeque::new(),
        })
    }

    /// The workers' pids, by id.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.pid).collect()
    }

    /// Tasks sent and not answered, over all workers (abandoned runs included).
    pub(crate) fn in_flight(&self) -> usize {
        self.slots.iter().map(|s| s.outstanding.len()).sum()
    }

    /// Tasks of run `run` sent and not answered.
    pub(crate) fn in_flight_of(&self, run: u64) -> usize {
        self.slots
            .iter()
            .flat_map(|s| &s.outstanding)
            .filter(|o| o.task.run == run)
            .count()
    }

    /// Worker `id`'s outstanding tasks of run `run`.
    pub(crate) fn outstanding_in_run(&self, id: usize, run: u64) -> usize {
        self.slots.get(id).map_or(0, |s| {
            s.outstanding.iter().filter(|o| o.task.run == run).count()
        })
    }

    /// The number of workers.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The worker with the fewest outstanding tasks, if it has fewer than `limit`.
    pub(crate) fn least_busy(&self, limit: usize) -> Option<usize> {
        let (id, slot) = self
            .slots
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.outstanding.len())?;
        (slot.outstanding.len() < limit).then_some(id)
    }

    /// The worker that holds task `batch` of run `run`, with its pid.
    pub(crate) fn holder(&self, run: u64, batch: usize) -> Option<(usize, u32)> {
        self.slots.iter().enumerate().find_map(|(id, s)| {
            s.outstanding
                .iter()
                .any(|o| o.task.run == run && o.task.batch == batch)
                .then_some((id, s.pid))
        })
    }

    /// The oldest outstanding task of run `run` on any worker, with the worker and pid.
    pub(crate) fn oldest(&self, run: u64) -> Option<(usize, u32, &Sent)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(id, s)| {
                s.outstanding
                    .iter()
                    .find(|o| o.task.run == run)
                    .map(|o| (id, s.pid, o))
            })
            .min_by_key(|(_, _, o)| o.task.batch)
    }

    /// Sends a task to worker `id`.
    ///
    /// A worker closes its end of the task pipe only by ending, so a send that finds it
    /// closed means the worker is dying: the task is kept outstanding, and the death
    /// (found by [`wait`](Self::wait) once the process can be reaped) is reported
    /// against the task it was loading, with restarts resending the rest.
    pub(crate) fn send(&mut self, id: usize, sent: Sent) -> Result<()> {
        let slot = &mut self.slots[id];
        match slot.tasks.send(sent.task.clone()) {
            Ok(()) => {}
            Err(e) if matches!(e.error, Error::Closed(_)) && !slot.outstanding.is_empty() => {
                tracing::debug!(
                    "multiproc: data loader worker {id} ({} {}) closed its task pipe; \
                     its death will be reported",
                    slot.process.label(),
                    slot.pid
                );
            }
            Err(e) => {
                return Err(Error::Closed(format!(
                    "cannot send batch {} to data loader worker {id} ({} {}): {}",
                    sent.task.batch,
                    slot.process.label(),
                    slot.pid,
                    e.error
                )));
            }
        }
        slot.outstanding.push_back(sent);
        Ok(())
    }

    /// Waits until something about run `run` happens or `deadline` passes (`Ok(None)`).
    pub(crate) fn wait(
        &mut self,
        run: u64,
        deadline: Option<Instant>,
    ) -> Result<Option<Arrival<B>>> {
        loop {
            if let Some(a) = self.arrived.pop_front() {
                return Ok(Some(a));
            }
            let now = Instant::now();
            // Past the deadline, what is already queued is still taken in (a deadline
            // of now is a poll).
            let expired = deadline.is_some_and(|d| d <= now);
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(now).min(DEATH_CHECK_INTERVAL),
                None => DEATH_CHECK_INTERVAL,
            };
            if let Some(reply) = recv_within(&self.results, slice)? {
                self.accept(reply, run);
                // A steady stream of replies from the others must not hide a death.
                if self.last_death_check.elapsed() < DEATH_CHECK_INTERVAL {
                    continue;
                }
            }
            self.last_death_check = Instant::now();
            self.check_deaths(run)?;
            if expired && self.arrived.is_empty() {
                return Ok(None);
            }
        }
    }

    /// [`wait`](Self::wait) without blocking a thread (the data loader's stream):
    /// `Poll::Ready` with what `wait` would return, `Poll::Pending` with `parked`
    /// registered on the results queue and on the pidfds of the workers that hold
    /// tasks, until a reply comes or one of them exits. Each try is `wait` with a
    /// deadline of now (everything queued taken in, dead workers looked for); the
    /// queue's registration also wakes the future at `deadline` (`WordWait::wake_by`),
    /// which is when the wait gives up.
    #[cfg(feature = "async")]
    pub(crate) fn poll_wait(
        &mut self,
        cx: &mut std::task::Context<'_>,
        parked: &mut Option<crate::sys::reactor::Parked>,
        run: u64,
        deadline: Option<Instant>,
    ) -> std::task::Poll<Result<Option<Arrival<B>>>> {
        use crate::sys::reactor::{self, Step};
        reactor::poll_step(
            cx,
            parked,
            || {
                // Read before the try: a reply put after it changes the word. Woken at
                // the loader's deadline too, to give up then.
                let mut word = self.results.get_wait();
                word.wake_by = deadline;
                let now = Instant::now();
                match self.wait(run, Some(now)) {
                    Ok(Some(arrival)) => Step::Done(Ok(Some(arrival))),
                    Ok(None) if deadline.is_some_and(|d| d <= now) => Step::Done(Ok(None)),
                    Ok(None) => {
                        // A worker's death wakes it through its pidfd, a reply through
                        // the word: it looks again unwoken only while a reply is kept
                        // back (see `Channel::needs_recheck`).
                        word.recheck = self.results.needs_recheck();
                        match self.busy_pidfds() {
                            Ok(fds) if fds.is_empty() => Step::Word(word),
                            Ok(fds) => Step::WordOrFds(word, fds, reactor::Ready::Readable),
                            Err(e) => Step::Done(Err(e)),
                        }
                    }
                    Err(e) => Step::Done(Err(e)),
                }
            },
            Err,
        )
    }

    /// Duplicates of the pidfds of the worker processes that hold tasks: a death
    /// among them wakes a parked stream at once (a worker that holds none is not
    /// waited for; thread workers report by reply).
    #[cfg(feature = "async")]
    fn busy_pidfds(&self) -> Result<Vec<std::os::fd::OwnedFd>> {
        self.slots
            .iter()
            .filter(|s| !s.outstanding.is_empty())
            .filter_map(|s| s.process.pidfd())
            .map(|fd| {
                fd.try_clone_to_owned()
                    .map_err(|e| Error::os("duplicating a data loader worker's pidfd", e))
            })
            .collect()
    }

    /// Takes in one reply: an arrival if it answers a task of run `run`, nothing if it is
    /// stale (an abandoned run, or a replaced worker).
    fn accept(&mut self, mut reply: Reply<B>, run: u64) {
        let Some(slot) = self.slots.get_mut(reply.worker) else {
            return;
        };
        if reply.generation != slot.generation {
            return;
        }
        if let Some((file, count)) = reply.memory_cgroup.take() {
            slot.process.watch_memory_cgroup(file, count);
        }
        let Some(pos) = slot
            .outstanding
            .iter()
            .position(|o| o.task.run == reply.run && o.task.batch == reply.batch)
        else {
            return;
        };
        let Some(sent) = slot.outstanding.remove(pos) else {
            return;
        };
        if sent.task.run != run {
            return;
        }
        self.arrived.push_back(match reply.outcome {
            Outcome::Batch(data) => Arrival::Loaded {
                worker: reply.worker,
                batch: reply.batch,
                data,
                cursor: reply.cursor,
                timing: reply.timing,
            },
            Outcome::Exhausted => Arrival::Exhausted {
                worker: reply.worker,
                batch: reply.batch,
            },
            Outcome::Failed(what) => Arrival::Failed {
                worker: reply.worker,
                pid: slot.pid,
                sent,
                what: format!("it returned an error: {what}"),
            },
        });
    }

    /// Notices workers that exited while holding tasks; each becomes a failure of the
    /// task it was working on (after the replies it sent before dying are taken in).
    fn check_deaths(&mut self, run: u64) -> Result<()> {
        for id in 0..self.slots.len() {
            let slot = &mut self.slots[id];
            if slot.outstanding.is_empty() {
                continue;
            }
            slot.process.observe();
            let Some(status) = slot.process.exited() else {
                continue;
            };
            // Take in whatever it (and the others) put before it died.
            while let Some(reply) = recv_within(&self.results, Duration::ZERO)? {
                self.accept(reply, run);
            }
            let slot = &mut self.slots[id];
            let Some(sent) = slot.outstanding.pop_front() else {
                continue;
            };
            let what = match slot.process.error() {
                Some(e) => e,
                None => format!("it exited ({status}) while loading"),
            } + &slot.process.death_note();
            // Its other tasks stay outstanding until the caller restarts or stops it.
            if sent.task.run == run {
                self.arrived.push_back(Arrival::Failed {
                    worker: id,
                    pid: slot.pid,
                    sent,
                    what,
                });
            } else {
                // It died on a task of an abandoned run: those are moot. Fail its
                // first task of this run, if it holds one.
                slot.outstanding.retain(|o| o.task.run == run);
                if let Some(sent) = slot.outstanding.pop_front() {
                    self.arrived.push_back(Arrival::Failed {
                        worker: id,
                        pid: slot.pid,
                        sent,
                        what,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks, before sending to it, that idle worker `id` still runs (one that died
    /// holding tasks is found by [`wait`](Self::wait)). A dead one is replaced when
    /// `restart` is set, and an error naming it otherwise.
    pub(crate) fn ensure_alive(
        &mut self,
        id: usize,
        restart: bool,
        launch: Launch<'_, B>,
    ) -> Result<()> {
        let slot = &mut self.slots[id];
        if !slot.outstanding.is_empty() {
            return Ok(());
        }
        let Some(status) = slot.process.exited() else {
            return Ok(());
        };
        let what = match slot.process.error() {
            Some(e) => e,
            None => format!("it exited ({status})"),
        };
        if !restart {
            return Err(Error::Closed(format!(
                "data loader worker {id} ({} {}) died while idle: {what}; \
                 restart_workers(true) replaces such a worker",
                slot.process.label(),
                slot.pid
            )));
        }
        tracing::warn!(
            "multiproc: data loader worker {id} ({} {}) died while idle ({what}); restarting it",
            slot.process.label(),
            slot.pid
        );
        let generation = slot.generation + 1;
        let fresh = self.start_slot(id, generation, launch)?;
        let old = std::mem::replace(&mut self.slots[id], fresh);
        stop_slots(vec![old], Duration::ZERO);
        Ok(())
    }

    /// Replaces worker `id` with a fresh process and sends it `first` followed by the
    /// old worker's other outstanding tasks, in order.
    pub(crate) fn restart(&mut self, id: usize, first: Sent, launch: Launch<'_, B>) -> Result<()> {
        let generation = self.slots[id].generation + 1;
        let fresh = self.start_slot(id, generation, launch)?;
        let old = std::mem::replace(&mut self.slots[id], fresh);
        let pending: Vec<Sent> = std::iter::once(first)
            .chain(old.outstanding.iter().cloned())
            .collect();
        stop_slots(vec![old], Duration::ZERO);
        for sent in pending {
            self.send(id, sent)?;
        }
        Ok(())
    }

    /// Stops every worker: closes the task pipes, waits up to `grace`, kills the rest;
    /// all are reaped when this returns.
    pub(crate) fn stop(self, grace: Duration) {
        stop_slots(self.slots, grace);
        // Batches put and never taken: receive them so their segments are released now
        // (a `file_system` segment in an unread message would otherwise stay in
        // /dev/shm until the whole process tree has exited).
        loop {
            match recv_within(&self.results, Duration::ZERO) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("multiproc: draining a stopped data loader's batches: {e}");
                    break;
                }
            }
        }
    }
}

/// Closes the slots' pipes, gives their workers `grace` to exit, then kills and reaps
/// the rest.
fn stop_slots(slots: Vec<Slot>, grace: Duration) {
    let until = Instant::now() + grace;
    let mut processes: Vec<Worker> = slots
        .into_iter()
        .map(|s| {
            drop(s.tasks); // the worker's recv sees the pipe closed and returns
            s.process
        })
        .collect();
    for p in &mut processes {
        let left = until.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            p.wait(left);
        }
        if p.is_alive() {
            p.kill();
        }
    }
    // Dropping a daemon `Process` kills (if need be) and reaps it; a thread that ended
    // is joined.
    drop(processes);
}

/// The loader's one timed receive: a reply if one comes within `wait`, `Ok(None)` if
/// not. Every wait for replies goes through here, so a change of the queues' timeout
/// convention is one edit.
fn recv_within<B: Serialize + DeserializeOwned>(
    results: &SimpleQueue<Reply<B>>,
    wait: Duration,
) -> Result<Option<Reply<B>>> {
    match results.get_timeout(wait) {
        Ok(reply) => Ok(Some(reply)),
        // Every worker gone: the loader then names which one died, and why.
        Err(e) if e.is_timeout() || e.is_disconnected() => Ok(None),
        Err(e) => Err(e),
    }
}
