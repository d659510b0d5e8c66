//! [`ProcessGroup`]: collectives among the ranks of one node through a shared segment
//! ([`Arena`]), with [`ReduceOp`] and the [`Work`] handle of the async forms.
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
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::arena::{Arena, Mail, SLOT_BYTES};
use super::env::Env;
use super::rendezvous;
use crate::sync::futex;
use crate::sys::process as sysproc;
use crate::sys::{Deadline, deadline_after};
use crate::tensor::{DType, Tensor};
use crate::{Error, Result, wire};

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

struct Inner {
    arena: Arena,
    /// `None` in the process that created the group for others.
    rank: Option<usize>,
    state: Mutex<State>,
    /// The collective thread's queue, started on first use.
    jobs: Mutex<Option<Sender<Job>>>,
}

struct State {
    /// Barriers this rank has passed.
    epoch: u32,
    /// Pidfds of the peers, opened once their pid is known.
    peers: Vec<Option<OwnedFd>>,
    timeout: Option<Duration>,
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
}

impl Work {
    /// Waits for the collective to finish.
    ///
    /// # Errors
    /// The collective's error (see [`ProcessGroup::all_reduce_`]).
    pub fn wait(self) -> Result<()> {
        self.done.recv().unwrap_or_else(|_| {
            Err(Error::Closed(
                "the process group's collective thread is gone".into(),
            ))
        })
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
                "the job spans {} nodes ({} ranks, {} on this node, from {}): the                  shared-memory process group covers one node; across nodes use MPI",
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
        self.submit(|inner, st| inner.sync(st)).wait()
    }

    /// Sets `tensor` on every rank to its value on rank `src`.
    ///
    /// # Errors
    /// As [`all_reduce_`](Self::all_reduce_).
    pub fn broadcast_(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.broadcast_async(tensor, src).wait()
    }

    /// The async form of [`broadcast_`](Self::broadcast_).
    pub fn broadcast_async(&self, tensor: &Tensor, src: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |inner, st| inner.broadcast(st, &t, src))
    }

    /// Replaces `tensor` on every rank by the reduction of all ranks' values, element
    /// by element.
    ///
    /// # Errors
    /// [`Error::Tensor`] for a non-contiguous tensor or a dtype other than f32, f64,
    /// i32, i64; [`Error::InvalidArgument`] in the process that created the group (it
    /// has no rank); [`Error::RankDied`] naming a rank that exited while the others
    /// waited for it; [`Error::Timeout`] past the group's timeout.
    pub fn all_reduce_(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op).wait()
    }

    /// The async form of [`all_reduce_`](Self::all_reduce_).
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Work {
        let t = tensor.clone();
        self.submit(move |inner, st| inner.all_reduce(st, &t, op))
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
        self.submit(move |inner, st| inner.all_gather(st, &o, &i))
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
        self.submit(move |inner, st| inner.reduce_scatter(st, &o, &i, op))
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
        self.submit(move |inner, st| inner.send(st, &t, dst))
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
        self.submit(move |inner, st| inner.recv(st, &t, src))
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
            return Work { done };
        }
        Work { done }
    }
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

    fn my_rank(&self) -> Result<usize> {
        self.rank.ok_or_else(|| {
            Error::InvalidArgument(
                "this process created the group for others and is not one of its ranks: \
                 call collectives in the workers that received it"
                    .into(),
            )
        })
    }

    /// The deadline of one barrier: every timed wait of the group goes through here.
    fn deadline(st: &State) -> Deadline {
        deadline_after(st.timeout)
    }

    /// The first peer found gone: checked through pidfds, opened once a peer's pid is
    /// known (a peer that has not joined yet can only be waited out by the deadline).
    fn dead_peer(arena: &Arena, me: usize, peers: &mut [Option<OwnedFd>]) -> Option<usize> {
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

    /// One barrier among all ranks, watching the peers.
    fn sync(&self, st: &mut State) -> Result<()> {
        let me = self.my_rank()?;
        let deadline = Self::deadline(st);
        let epoch = st.epoch;
        let arena = &self.arena;
        let peers = &mut st.peers;
        let result = arena.barrier(epoch, deadline, || Self::dead_peer(arena, me, peers));
        st.epoch = epoch.wrapping_add(1);
        result
    }

    fn check_peer(&self, me: usize, peer: usize, what: &str) -> Result<()> {
        let p = self.arena.world_size();
        if peer >= p || peer == me {
            return Err(Error::InvalidArgument(format!(
                "{what} rank {peer} from rank {me} in a group of {p} ranks: the peer must be \
                 another rank of the group"
            )));
        }
        Ok(())
    }

    fn send(&self, st: &mut State, t: &Tensor, dst: usize) -> Result<()> {
        let me = self.my_rank()?;
        self.check_peer(me, dst, "send to")?;
        let bytes = Bytes::of(t, "send")?;
        let deadline = Self::deadline(st);
        let arena = &self.arena;
        let peers = &mut st.peers;
        let sent = arena.mail(me, dst, Mail::Sent);
        for (off, len) in chunks(bytes.len) {
            let s = sent.load(Ordering::Acquire);
            // The previous chunk must be taken before the slot is reused.
            wait_taken(arena, me, dst, s, deadline, peers)?;
            // SAFETY: our slot of set 0 is free (taken == sent, and this rank runs one
            // operation at a time); the tensor range is checked.
            unsafe { arena.copy_in(0, me, 0, bytes.ptr.add(off), len) };
            arena
                .mail(me, dst, Mail::Len)
                .store(len as u32, Ordering::Relaxed);
            sent.store(s.wrapping_add(1), Ordering::Release);
            futex::wake_all(sent);
        }
        // Return once the last chunk is out of our slot.
        wait_taken(
            arena,
            me,
            dst,
            sent.load(Ordering::Acquire),
            deadline,
            peers,
        )
    }

    fn recv(&self, st: &mut State, t: &Tensor, src: usize) -> Result<()> {
        let me = self.my_rank()?;
        self.check_peer(me, src, "recv from")?;
        let bytes = Bytes::of(t, "recv")?;
        let deadline = Self::deadline(st);
        let arena = &self.arena;
        let peers = &mut st.peers;
        let taken = arena.mail(src, me, Mail::Taken);
        for (off, len) in chunks(bytes.len) {
            let k = taken.load(Ordering::Acquire);
            arena.wait_mail((src, me, Mail::Sent), k, deadline, || {
                Self::dead_peer(arena, me, peers)
            })?;
            let sent_len = arena.mail(src, me, Mail::Len).load(Ordering::Relaxed) as usize;
            if sent_len != len {
                arena.abort(me);
                return Err(Error::Tensor(format!(
                    "recv on rank {me}: rank {src} sent a chunk of {sent_len} bytes where this \
                     tensor expects {len} (at byte {off} of {}): send and recv need tensors of \
                     the same size; the group is now failed",
                    bytes.len
                )));
            }
            // SAFETY: the sender filled its slot and waits for `taken` before touching it
            // again; the tensor range is checked and ours to write.
            unsafe { arena.copy_out(0, src, 0, bytes.ptr.add(off), len) };
            taken.store(k.wrapping_add(1), Ordering::Release);
            futex::wake_all(taken);
        }
        Ok(())
    }

    fn all_reduce(&self, st: &mut State, t: &Tensor, op: ReduceOp) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        let bytes = Bytes::of(t, "all_reduce_")?;
        let size = t.dtype().size();
        for (k, (off, len)) in chunks(bytes.len).enumerate() {
            let set = k % 2;
            let n = len / size;
            // This rank reduces elements lo..hi of the chunk, reading its own straight
            // from its tensor: it copies in (and later out) only the rest.
            let (lo, hi) = (me * n / p, (me + 1) * n / p);
            let (lo_b, hi_b) = (lo * size, hi * size);
            // SAFETY: the ranges are inside the tensor's storage (checked by
            // `Bytes::of`, whose guard keeps it mapped); slot `me` is ours during
            // copy-in.
            unsafe {
                let chunk = bytes.ptr.add(off);
                self.arena.copy_in(set, me, 0, chunk, lo_b);
                self.arena
                    .copy_in(set, me, hi_b, chunk.add(hi_b), len - hi_b);
            }
            self.sync(st)?;
            let own = Some((me, bytes.ptr.wrapping_add(off).cast_const()));
            // SAFETY: after the barrier no one writes the slots; elements lo..hi of the
            // result are this rank's alone until the next barrier; the tensor's chunk is
            // checked and not written during the collective.
            unsafe { reduce_dtype(&self.arena, t.dtype(), set, lo..hi, own, op, p) };
            self.sync(st)?;
            // SAFETY: the result is complete and read-only until every rank passes the
            // next barrier; the tensor's range is checked and ours to write.
            unsafe { self.arena.copy_out(set, p, 0, bytes.ptr.add(off), len) };
        }
        Ok(())
    }

    fn broadcast(&self, st: &mut State, t: &Tensor, src: usize) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        if src >= p {
            return Err(Error::InvalidArgument(format!(
                "broadcast_ from rank {src} in a group of {p} ranks"
            )));
        }
        let bytes = Bytes::of(t, "broadcast_")?;
        for (k, (off, len)) in chunks(bytes.len).enumerate() {
            let set = k % 2;
            if me == src {
                // SAFETY: as in `all_reduce`: our slot, the checked tensor range.
                unsafe { self.arena.copy_in(set, src, 0, bytes.ptr.add(off), len) };
            }
            self.sync(st)?;
            if me != src {
                // SAFETY: src's slot is read-only until the next barrier.
                unsafe { self.arena.copy_out(set, src, 0, bytes.ptr.add(off), len) };
            }
            self.sync(st)?;
        }
        Ok(())
    }

    fn all_gather(&self, st: &mut State, out: &Tensor, inp: &Tensor) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        let i = Bytes::of(inp, "all_gather input")?;
        let o = Bytes::of(out, "all_gather output")?;
        check_pair(out, inp, o.len, i.len * p, "all_gather", "output", p)?;
        for (k, (off, len)) in chunks(i.len).enumerate() {
            let set = k % 2;
            // SAFETY: as in `all_reduce`.
            unsafe { self.arena.copy_in(set, me, 0, i.ptr.add(off), len) };
            self.sync(st)?;
            for r in 0..p {
                // SAFETY: every slot is read-only until the next barrier; the output
                // range `r * i.len + off .. + len` is inside `o` (checked sizes).
                unsafe {
                    self.arena
                        .copy_out(set, r, 0, o.ptr.add(r * i.len + off), len)
                };
            }
            self.sync(st)?;
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        st: &mut State,
        out: &Tensor,
        inp: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.my_rank()?;
        let p = self.arena.world_size();
        let i = Bytes::of(inp, "reduce_scatter input")?;
        let o = Bytes::of(out, "reduce_scatter output")?;
        check_pair(out, inp, i.len, o.len * p, "reduce_scatter", "input", p)?;
        let size = inp.dtype().size();
        let (mine_lo, mine_hi) = (me * o.len, (me + 1) * o.len);
        for (k, (off, len)) in chunks(i.len).enumerate() {
            let set = k % 2;
            // SAFETY: as in `all_reduce`.
            unsafe { self.arena.copy_in(set, me, 0, i.ptr.add(off), len) };
            self.sync(st)?;
            let n = len / size;
            let (lo, hi) = (me * n / p, (me + 1) * n / p);
            // SAFETY: as in `all_reduce`.
            unsafe { reduce_dtype(&self.arena, inp.dtype(), set, lo..hi, None, op, p) };
            self.sync(st)?;
            let (a, b) = (off.max(mine_lo), (off + len).min(mine_hi));
            if a < b {
                // SAFETY: the result is read-only until the next barrier; `a - mine_lo
                // .. b - mine_lo` lies inside the output (its length is `o.len`).
                unsafe {
                    self.arena
                        .copy_out(set, p, a - off, o.ptr.add(a - mine_lo), b - a)
                };
            }
        }
        Ok(())
    }
}

/// Waits until `dst` has taken every chunk up to `sent` from `src`'s mailbox.
fn wait_taken(
    arena: &Arena,
    src: usize,
    dst: usize,
    sent: u32,
    deadline: Deadline,
    peers: &mut [Option<OwnedFd>],
) -> Result<()> {
    let taken = arena.mail(src, dst, Mail::Taken);
    loop {
        let k = taken.load(Ordering::Acquire);
        if k == sent {
            return Ok(());
        }
        arena.wait_mail((src, dst, Mail::Taken), k, deadline, || {
            Inner::dead_peer(arena, src, peers)
        })?;
    }
}

/// The bytes of a contiguous tensor, with its storage's guard held.
struct Bytes<'a> {
    _guard: crate::tensor::StorageRead<'a>,
    ptr: *mut u8,
    len: usize,
}

impl<'a> Bytes<'a> {
    fn of(t: &'a Tensor, what: &str) -> Result<Bytes<'a>> {
        if !t.is_contiguous() {
            return Err(Error::Tensor(format!(
                "{what} needs a contiguous tensor (shape {:?}, strides {:?}): call .contiguous() first",
                t.shape(),
                t.strides()
            )));
        }
        if !matches!(t.dtype(), DType::F32 | DType::F64 | DType::I32 | DType::I64) {
            return Err(Error::Tensor(format!(
                "{what} supports f32, f64, i32 and i64 tensors, not {}",
                t.dtype()
            )));
        }
        let guard = t.storage().read();
        let start = t.storage_offset() * t.dtype().size();
        let len = t.numel() * t.dtype().size();
        if start.checked_add(len).is_none_or(|end| end > guard.len()) {
            return Err(Error::Tensor(format!(
                "{what}: the tensor's {len} bytes at offset {start} overrun its {}-byte storage",
                guard.len()
            )));
        }
        let ptr = guard.ptr().wrapping_add(start);
        Ok(Bytes {
            _guard: guard,
            ptr,
            len,
        })
    }
}

fn check_pair(
    out: &Tensor,
    inp: &Tensor,
    have: usize,
    want: usize,
    what: &str,
    which: &str,
    p: usize,
) -> Result<()> {
    if out.dtype() != inp.dtype() || have != want {
        return Err(Error::Tensor(format!(
            "{what}: the {which} must hold {p} times the other's elements of the same dtype \
             (output {:?} {}, input {:?} {})",
            out.shape(),
            out.dtype(),
            inp.shape(),
            inp.dtype()
        )));
    }
    Ok(())
}

/// `(offset, length)` of each chunk of a `len`-byte transfer.
fn chunks(len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len)
        .step_by(SLOT_BYTES)
        .map(move |off| (off, SLOT_BYTES.min(len - off)))
}

/// # Safety
/// As [`Arena::reduce`].
unsafe fn reduce_dtype(
    arena: &Arena,
    dtype: DType,
    set: usize,
    elements: std::ops::Range<usize>,
    own: Option<(usize, *const u8)>,
    op: ReduceOp,
    p: usize,
) {
    let (lo, hi) = (elements.start, elements.end);
    macro_rules! go {
        ($t:ty, $div:expr) => {{
            // One monomorphic loop per op, so each inlines and vectorises.
            let none: Option<fn($t) -> $t> = None;
            match op {
                // SAFETY: forwarded from the caller.
                ReduceOp::Sum => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| a + b,
                        none,
                    )
                },
                // SAFETY: forwarded from the caller.
                ReduceOp::Mean => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| a + b,
                        Some(move |x: $t| $div(x, p)),
                    )
                },
                // SAFETY: forwarded from the caller.
                ReduceOp::Max => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| if b > a { b } else { a },
                        none,
                    )
                },
                // SAFETY: forwarded from the caller.
                ReduceOp::Min => unsafe {
                    arena.reduce::<$t>(
                        set,
                        lo,
                        hi,
                        own.map(|(r, c)| (r, c.cast::<$t>())),
                        |a, b| if b < a { b } else { a },
                        none,
                    )
                },
            }
        }};
    }
    match dtype {
        DType::F32 => go!(f32, |x: f32, p: usize| x / p as f32),
        DType::F64 => go!(f64, |x: f64, p: usize| x / p as f64),
        DType::I32 => go!(i32, |x: i32, p: usize| x.wrapping_div(p as i32)),
        DType::I64 => go!(i64, |x: i64, p: usize| x.wrapping_div(p as i64)),
        _ => {} // refused by `Bytes::of`
    }
}

/// The bare segment of a group, sent at a rendezvous where the receiver's rank comes
/// from its caller rather than from `RANK` (a node-local rank of a hierarchical group).
struct SegmentFd<'a>(&'a Arena);

impl Serialize for SegmentFd<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let index =
            wire::attach_fd(self.0.fd(), "process group").map_err(serde::ser::Error::custom)?;
        index.serialize(s)
    }
}

/// A segment received at a rendezvous (see [`SegmentFd`]).
struct ReceivedSegment(Arena);

impl<'de> Deserialize<'de> for ReceivedSegment {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        let fd = wire::received_fd(index, "process group").map_err(serde::de::Error::custom)?;
        Arena::open(fd)
            .map(ReceivedSegment)
            .map_err(|e| serde::de::Error::custom(wire::fail_with(e)))
    }
}

impl Serialize for ProcessGroup {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let index = wire::attach_fd(self.inner.arena.fd(), "process group")
            .map_err(serde::ser::Error::custom)?;
        index.serialize(s)
    }
}

/// A received group takes its rank from the environment (`RANK`, which `spawn`, torchrun
/// and the MPI launchers set; see [`Env::detect`]) and claims it in the segment.
impl<'de> Deserialize<'de> for ProcessGroup {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(d)?;
        let fd = wire::received_fd(index, "process group").map_err(serde::de::Error::custom)?;
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
        join().map_err(|e| serde::de::Error::custom(wire::fail_with(e)))
    }
}
