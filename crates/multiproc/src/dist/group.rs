//! [`ProcessGroup`]: collectives among the ranks of one node through a shared segment
//! ([`Arena`]) or, for large all-reduces, straight between the ranks' shared tensors
//! (`zero_copy`), with [`ReduceOp`] and the [`Work`] handle of the async forms.
//!
//! Every collective runs on the group's one collective thread, in the order it was
//! called: the async forms return at once with a [`Work`], the plain forms wait for
//! theirs. So ranks that issue the same collectives in the same order meet in the same
//! barriers whatever mix of the two they use.
//!
//! A waiting rank checks its peers' pidfds every few tens of milliseconds: a peer that
//! exited makes the call fail with [`Error::RankDied`] naming it, and marks the group
//! failed so every other rank learns it at once.

use std::fmt;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::arena::Arena;
use super::env::Env;
use super::peer_tensors::PeerTensors;
use super::rendezvous;
use crate::error::{Error, Result};
use crate::sys::process as sysproc;
use crate::sys::{Deadline, deadline_after};
use crate::tensor::Tensor;
use crate::wire::{Decoder, Encoder};

/// How long a collective waits for slow (but living) peers by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// How [`ProcessGroup::all_reduce_`] and [`ProcessGroup::reduce_scatter`] combine
/// the ranks' elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The sum divided by the world size (integer division for integer dtypes).
    Mean,
    /// The largest.
    Max,
    /// The smallest.
    Min,
}

type Job = Box<dyn FnOnce() + Send>;

const THREAD_GONE: &str = "the process group's collective thread is gone";

/// A group of processes on one node that run collectives together.
///
/// Create it in the parent with [`new_local`](Self::new_local) and hand it to the
/// workers in their arguments (it travels as the segment's fd); a worker's copy takes
/// its rank from `RANK`, which [`spawn`](crate::spawn) sets. Each rank then calls the
/// same collectives in the same order.
///
/// ```no_run
/// use multiproc::dist::{ProcessGroup, ReduceOp};
/// use multiproc::{DType, Tensor};
///
/// fn worker(rank: usize, group: ProcessGroup) -> multiproc::Result<()> {
///     let t = Tensor::full(&[1024], rank as f64, DType::F32)?;
///     group.all_reduce_(&t, ReduceOp::Sum)?;
///     assert_eq!(t.to_vec::<f32>()?[0], 1.0); // 0 + 1
///     Ok(())
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     multiproc::spawn(worker, ProcessGroup::new_local(2)?, 2)
/// }
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) arena: Arena,
    /// `None` in the process that created the group for others.
    rank: Option<usize>,
    state: Mutex<State>,
    /// The collective thread's queue, started on first use.
    jobs: Mutex<Option<Sender<Job>>>,
}

pub(super) struct State {
    /// Barriers this rank has passed.
    pub(super) epoch: u32,
    /// Pidfds of the peers, opened once their pid is known.
    pub(super) peers: Vec<Option<OwnedFd>>,
    timeout: Option<Duration>,
    /// The peers' tensors this rank maps, and its own that they map.
    pub(super) zero_copy: PeerTensors,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.world_size())
            .finish()
    }
}

/// An async collective in flight; [`wait`](Self::wait) for its result.
#[must_use = "a collective's result arrives through wait()"]
#[derive(Debug)]
pub struct Work {
    done: Receiver<Result<()>>,
    /// What `wait` reports when the result can never come.
    gone: &'static str,
}

impl Work {
    /// The handle of a collective whose result arrives on `done`; `gone` says what
    /// ended when it never does.
    pub(super) fn from_channel(done: Receiver<Result<()>>, gone: &'static str) -> Work {
        Work { done, gone }
    }

    /// Waits for the collective to finish.
    ///
    /// # Errors
    /// The collective's error (see [`ProcessGroup::all_reduce_`]).
    pub fn wait(self) -> Result<()> {
        self.done
            .recv()
            .unwrap_or_else(|_| Err(Error::Closed(self.gone.into())))
    }
}

impl ProcessGroup {
    /// A new group for `world_size` ranks on this node, to hand to the workers (this
    /// process is not one of the ranks).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a size outside `1..=512`; shared-memory errors.
    pub fn new_local(world_size: usize) -> Result<ProcessGroup> {
        Ok(Self::with_arena(Arena::create(world_size)?, None))
    }

    /// The group of this node's ranks, when a launcher (torchrun, `mpirun`, `srun`,
    /// [`spawn`](crate::spawn)) started them: [`Env::detect`] says who is who, local rank
    /// 0 creates the shared segment and the others receive it over a local Unix socket
    /// named after the launcher's run (no TCP, no file). Every local rank must call it.
    ///
    /// # Errors
    /// [`Error::Env`] for contradictory launcher variables; [`Error::InvalidArgument`]
    /// when the job spans several nodes (the local backend covers one node);
    /// [`Error::Timeout`] when the other local ranks do not arrive within 5 minutes.
    pub fn from_env() -> Result<ProcessGroup> {
        let env = Env::detect()?;
        if env.world_size != env.local_world_size {
            return Err(Error::InvalidArgument(format!(
                "the job spans {} nodes ({} ranks, {} on this node, from {}): the \
                 shared-memory process group covers one node; across nodes use MPI",
                env.nodes(),
                env.world_size,
                env.local_world_size,
                env.launcher
            )));
        }
        Self::node_local(&env)
    }

    /// The group of this node's ranks as `env` describes them (local rank and size,
    /// node), whatever the world size: the node-local half of a hierarchical group.
    pub(crate) fn node_local(env: &Env) -> Result<ProcessGroup> {
        if env.local_world_size == 1 {
            let arena = Arena::create(1)?;
            arena.register(0)?;
            return Ok(Self::with_arena(arena, Some(0)));
        }
        let name = rendezvous::socket_name(env);
        if env.local_rank == 0 {
            let arena = Arena::create(env.local_world_size)?;
            arena.register(0)?;
            rendezvous::serve(&name, &SegmentFd(&arena), env.local_world_size - 1)?;
            Ok(Self::with_arena(arena, Some(0)))
        } else {
            let ReceivedSegment(arena) = rendezvous::join(&name)?;
            if arena.world_size() != env.local_world_size {
                return Err(Error::InvalidArgument(format!(
                    "the process group at rendezvous @{name} has {} ranks, but this node \
                     runs {} (local rank {}): are two jobs sharing launcher variables?",
                    arena.world_size(),
                    env.local_world_size,
                    env.local_rank
                )));
            }
            arena.register(env.local_rank)?;
            Ok(Self::with_arena(arena, Some(env.local_rank)))
        }
    }

    fn with_arena(arena: Arena, rank: Option<usize>) -> ProcessGroup {
        let peers = (0..arena.world_size()).map(|_| None).collect();
        ProcessGroup {
            inner: Arc::new(Inner {
                arena,
                rank,
                state: Mutex::new(State {
                    epoch: 0,
                    peers,
                    timeout: Some(DEFAULT_TIMEOUT),
                    zero_copy: PeerTensors::default(),
                }),
                jobs: Mutex::new(None),
            }),
        }
    }

    /// This process's rank in the group (`None` in the process that created it).
    pub fn rank(&self) -> Option<usize> {
        self.inner.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.arena.world_size()
    }

    /// How long a collective waits for living peers before [`Error::Timeout`] (default
    /// [`DEFAULT_TIMEOUT`]; `None`: for ever). A dead peer is reported at once
    /// whatever this says.
    pub fn set_timeout(&self, timeout: Option<Duration>) {
        self.inner.lock().timeout = timeout;
    }

    /// Waits until every rank has called `barrier`.
    ///
    /// # Errors
    /// [`Error::RankDied`] naming a rank that exited while the others waited;
    /// [`Error::Timeout`] past the group's timeout.
    pub fn barrier(&self) -> Result<()> {
        self.submit(|inner, st| inner.barrier(st)).wait()
    }

    /// Sets `tensor` on every rank to its value on rank `src`.
    ///
    /// A tensor of 256 KiB or more is copied straight between the ranks' tensors, as in
    /// [`all_reduce_`](Self::all_reduce_) (its storage moves into shared memory the
    /// first time).
    ///
    /// # Errors
    /// As [`all_reduce_`](Self::all_reduce_).
    pub fn broadcast_(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.broadcast_async(tensor, src).wait()
    }

    /// The async form of [`broadcast_`](Self::broadcast_).
    pub fn broadcast_async(&self, tensor: &Tensor, src: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |inner, st| through_contiguous(&t, |c| inner.broadcast(st, c, src)))
    }

    /// Replaces `tensor` on every rank by the reduction of all ranks' values, element
    /// by element.
    ///
    /// A tensor of 256 KiB or more is reduced in place between the ranks' tensors, which
    /// moves its storage into shared memory the first time (as
    /// [`Tensor::share_memory_`]); a non-contiguous view goes through a contiguous copy.
    ///
    /// # Errors
    /// [`Error::Tensor`] for a dtype other than f32, f64, i32, i64, a tensor in
    /// device memory, or a read-only one, and when the ranks' sizes or dtypes differ; [`Error::InvalidArgument`] in the process that created the group (it
    /// has no rank); [`Error::RankDied`] naming a rank that exited while the others
    /// waited for it; [`Error::Timeout`] past the group's timeout.
    pub fn all_reduce_(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op).wait()
    }

    /// The async form of [`all_reduce_`](Self::all_reduce_).
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Work {
        let t = tensor.clone();
        self.submit(move |inner, st| through_contiguous(&t, |c| inner.all_reduce(st, c, op)))
    }

    /// Fills `output` (`world_size` times `input`'s elements) with every rank's `input`,
    /// rank 0's first (torch's `all_gather_into_tensor`).
    ///
    /// # Errors
    /// As [`all_reduce_`](Self::all_reduce_), and [`Error::Tensor`] when the sizes or
    /// dtypes do not match.
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_async(output, input).wait()
    }

    /// The async form of [`all_gather`](Self::all_gather).
    pub fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Work {
        let (o, i) = (output.clone(), input.clone());
        self.submit(move |inner, st| {
            let i = i.contiguous()?;
            through_contiguous(&o, |o| inner.all_gather(st, o, &i))
        })
    }

    /// Reduces `input` (`world_size` blocks of `output`'s size) across ranks and leaves
    /// block `rank` of the result in `output` (torch's `reduce_scatter_tensor`).
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather).
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(output, input, op).wait()
    }

    /// The async form of [`reduce_scatter`](Self::reduce_scatter).
    pub fn reduce_scatter_async(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Work {
        let (o, i) = (output.clone(), input.clone());
        self.submit(move |inner, st| {
            let i = i.contiguous()?;
            through_contiguous(&o, |o| inner.reduce_scatter(st, o, &i, op))
        })
    }

    /// Sends `tensor` to rank `dst`, which must call [`recv`](Self::recv) with a tensor
    /// of the same size; returns once `dst` has taken all of it (a synchronous send,
    /// like `MPI_Ssend`: two ranks that both send to each other first deadlock, so pair
    /// them as one sends while the other receives).
    ///
    /// # Errors
    /// As [`all_reduce_`](Self::all_reduce_); [`Error::InvalidArgument`] when `dst` is
    /// this rank or outside the group.
    pub fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.send_async(tensor, dst).wait()
    }

    /// The async form of [`send`](Self::send).
    pub fn send_async(&self, tensor: &Tensor, dst: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |inner, st| inner.send(st, &t.contiguous()?, dst))
    }

    /// Receives into `tensor` what rank `src` sends with [`send`](Self::send).
    ///
    /// # Errors
    /// As [`send`](Self::send), and [`Error::Tensor`] when the sizes differ (the group
    /// is then failed).
    pub fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.recv_async(tensor, src).wait()
    }

    /// The async form of [`recv`](Self::recv).
    pub fn recv_async(&self, tensor: &Tensor, src: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |inner, st| through_contiguous(&t, |c| inner.recv(st, c, src)))
    }

    /// Queues `op` on the collective thread.
    fn submit(&self, op: impl FnOnce(&Inner, &mut State) -> Result<()> + Send + 'static) -> Work {
        let (tx, done) = channel();
        let inner = Arc::clone(&self.inner);
        let job: Job = Box::new(move || {
            let result = {
                let mut st = inner.lock();
                op(&inner, &mut st)
            };
            let _ = tx.send(result);
        });
        if let Err(e) = self.inner.enqueue(job) {
            let (tx, done) = channel();
            let _ = tx.send(Err(e));
            return Work::from_channel(done, THREAD_GONE);
        }
        Work::from_channel(done, THREAD_GONE)
    }
}

/// Runs `op` on `t`, or, when `t` is not contiguous (a transposed or strided view), on
/// a contiguous copy that is then written back into `t`: the collectives move
/// contiguous bytes, and the caller's view gets the result either way.
fn through_contiguous(t: &Tensor, op: impl FnOnce(&Tensor) -> Result<()>) -> Result<()> {
    if t.is_contiguous() {
        return op(t);
    }
    let c = t.contiguous()?;
    op(&c)?;
    t.copy_(&c)
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn enqueue(&self, job: Job) -> Result<()> {
        let mut slot = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            let (tx, rx) = channel::<Job>();
            std::thread::Builder::new()
                .name("multiproc-collectives".into())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| Error::os("starting the process group's collective thread", e))?;
            *slot = Some(tx);
        }
        let tx = slot.as_ref().expect("started above");
        tx.send(job)
            .map_err(|_| Error::Closed("the process group's collective thread is gone".into()))
    }

    pub(super) fn my_rank(&self) -> Result<usize> {
        self.rank.ok_or_else(|| {
            Error::InvalidArgument(
                "this process created the group for others and is not one of its ranks: \
                 call collectives in the workers that received it"
                    .into(),
            )
        })
    }

    /// The deadline of one barrier: every timed wait of the group goes through here.
    pub(super) fn deadline(st: &State) -> Deadline {
        deadline_after(st.timeout)
    }

    /// The first peer found gone: checked through pidfds, opened once a peer's pid is
    /// known (a peer that has not joined yet can only be waited out by the deadline).
    pub(super) fn dead_peer(
        arena: &Arena,
        me: usize,
        peers: &mut [Option<OwnedFd>],
    ) -> Option<usize> {
        (0..arena.world_size()).filter(|&r| r != me).find(|&r| {
            let pid = arena.pid(r);
            if pid == 0 {
                return false;
            }
            if peers[r].is_none() {
                match sysproc::pidfd_open(pid as i32) {
                    Ok(fd) => peers[r] = Some(fd),
                    Err(_) => return true, // no such process
                }
            }
            peers[r]
                .as_ref()
                .is_some_and(|fd| sysproc::has_exited(fd.as_fd()))
        })
    }

    /// One barrier among all ranks, watching the peers. A barrier that fails (a peer
    /// died, or the wait timed out) fails the group: the ranks no longer agree on how
    /// many barriers each has passed, so no later collective could pair them up again.
    /// Every later call then fails with the rank that ended it, instead of passing a
    /// barrier with a rank missing.
    pub(super) fn sync(&self, st: &mut State) -> Result<()> {
        let me = self.my_rank()?;
        let arena = &self.arena;
        if let Some(rank) = arena.aborted_by() {
            return Err(arena.ended_by(rank));
        }
        let deadline = Self::deadline(st);
        let epoch = st.epoch;
        let peers = &mut st.peers;
        let result = arena.barrier(epoch, deadline, || Self::dead_peer(arena, me, peers));
        st.epoch = epoch.wrapping_add(1);
        match result {
            // Passed, unless the group failed meanwhile (this rank may have been the
            // last to arrive at a barrier that the others had given up on).
            Ok(()) => match arena.aborted_by() {
                Some(rank) => Err(arena.ended_by(rank)),
                None => Ok(()),
            },
            Err(e) => {
                arena.abort(me);
                Err(e)
            }
        }
    }
}

/// The bare segment of a group, sent at a rendezvous where the receiver's rank comes
/// from its caller rather than from `RANK` (a node-local rank of a hierarchical group).
struct SegmentFd<'a>(&'a Arena);

impl Serialize for SegmentFd<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let index = Encoder::current("process group")
            .and_then(|enc| enc.attach_fd(self.0.fd()))
            .map_err(serde::ser::Error::custom)?;
        index.serialize(s)
    }
}

/// A segment received at a rendezvous (see [`SegmentFd`]).
struct ReceivedSegment(Arena);

impl<'de> Deserialize<'de> for ReceivedSegment {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        let dec = Decoder::current("process group").map_err(serde::de::Error::custom)?;
        let fd = dec.take_fd(index).map_err(serde::de::Error::custom)?;
        Arena::open(fd)
            .map(ReceivedSegment)
            .map_err(|e| serde::de::Error::custom(dec.fail(e)))
    }
}

impl Serialize for ProcessGroup {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let index = Encoder::current("process group")
            .and_then(|enc| enc.attach_fd(self.inner.arena.fd()))
            .map_err(serde::ser::Error::custom)?;
        index.serialize(s)
    }
}

/// A received group takes its rank from the environment (`RANK`, which `spawn`, torchrun
/// and the MPI launchers set; see [`Env::detect`]) and claims it in the segment.
impl<'de> Deserialize<'de> for ProcessGroup {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        let dec = Decoder::current("process group").map_err(serde::de::Error::custom)?;
        let fd = dec.take_fd(index).map_err(serde::de::Error::custom)?;
        let join = || -> Result<ProcessGroup> {
            let arena = Arena::open(fd)?;
            let env = Env::detect()?;
            if env.local_world_size != arena.world_size() || env.local_rank >= arena.world_size() {
                return Err(Error::InvalidArgument(format!(
                    "a process group of {} ranks arrived in local rank {} of {} (from {}): \
                     create the group with as many ranks as you spawn workers",
                    arena.world_size(),
                    env.local_rank,
                    env.local_world_size,
                    env.launcher
                )));
            }
            arena.register(env.local_rank)?;
            Ok(Self::with_arena(arena, Some(env.local_rank)))
        };
        join().map_err(|e| serde::de::Error::custom(dec.fail(e)))
    }
}
