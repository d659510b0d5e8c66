//! [`MpiGroup`] (feature `mpi`): the collectives of [`ProcessGroup`] over every rank of
//! an MPI job, hierarchical — the ranks of a node go through shared memory (a
//! [`ProcessGroup`] of the node), one leader per node talks MPI (the `mpi` crate, on the
//! MPI library the job was launched with) with the other nodes' leaders.
//!
//! What travels where:
//!
//! - `all_reduce_`: reduced on each node through shared memory, all-reduced between
//!   the leaders through MPI, broadcast back on each node through shared memory.
//! - `broadcast_`: on the source's node through shared memory, then between the leaders
//!   through MPI, then on the other nodes through shared memory.
//! - `reduce_scatter`: the hierarchical all-reduce of a copy of the input, of which each
//!   rank keeps its block.
//! - `all_gather`: through MPI between all ranks (MPI's own shared-memory transport
//!   inside a node); through the node's group when the job is one node.
//! - `send`/`recv`: through the node's group when both ranks share a node, else MPI.
//!
//! Every MPI call runs on the group's one MPI thread (MPI is initialized there, so
//! `MPI_THREAD_FUNNELED` is all it needs), in the order the calls were made: the async
//! forms return a [`Work`] at once, the plain forms wait for theirs, as in
//! [`ProcessGroup`].
//!
//! Nodes are found with `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`. For tests on one
//! machine, `MULTIPROC_MPI_RANKS_PER_NODE=k` makes every `k` consecutive ranks a "node"
//! instead, so the MPI path runs between processes of one host.

use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::*;

use super::env::Env;
use super::group::{ProcessGroup, ReduceOp, Work};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The test override of the node size (see the module docs).
pub const RANKS_PER_NODE_VAR: &str = "MULTIPROC_MPI_RANKS_PER_NODE";

type Job = Box<dyn FnOnce(&Mpi) + Send>;

/// A process group over every rank of an MPI job: shared memory inside a node, MPI
/// between one leader per node.
///
/// ```no_run
/// use multiproc::dist::{MpiGroup, ReduceOp};
/// use multiproc::{DType, Tensor};
///
/// let group = MpiGroup::from_env()?; // under mpirun / srun
/// let t = Tensor::full(&[1024], 1.0, DType::F32)?;
/// group.all_reduce_(&t, ReduceOp::Sum)?; // every element is now the world size
/// # Ok::<(), multiproc::Error>(())
/// ```
pub struct MpiGroup {
    /// The MPI thread's queue; `None` once dropped (the thread then finalizes MPI).
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    local: ProcessGroup,
    rank: usize,
    size: usize,
    nodes: usize,
}

/// What the MPI thread owns. Field order is drop order: the communicators before the
/// universe (which finalizes MPI).
struct Mpi {
    local: ProcessGroup,
    leaders: Option<SimpleCommunicator>,
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// For each rank of the job: its node's index (the leader's rank among the
    /// leaders) and its rank in the node.
    places: Vec<(usize, usize)>,
    nodes: usize,
    _universe: Universe,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .field("nodes", &self.nodes)
            .field("local", &self.local)
            .finish()
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        // Closing the queue ends the thread, which finalizes MPI; wait for it, as MPI
        // must be finalized before the process exits.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs `$body` with `$t` the Rust type of `$dtype` (f32, f64, i32, i64), else returns
/// an error naming `$what`.
macro_rules! with_dtype {
    ($dtype:expr, $what:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            other => {
                return Err(Error::Tensor(format!(
                    "MpiGroup::{} supports f32, f64, i32 and i64 tensors, not {other}",
                    $what
                )));
            }
        }
    };
}

impl MpiGroup {
    /// Initializes MPI (on the group's MPI thread) and joins every rank of the job: the
    /// node's ranks meet through shared memory (as [`ProcessGroup::from_env`]), the
    /// node leaders through MPI. Every rank must call it. A rank that cannot join its
    /// node's group after MPI is up prints why and aborts the MPI job (returning would
    /// leave the other ranks waiting for it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when MPI was already initialized in this process or
    /// `MULTIPROC_MPI_RANKS_PER_NODE` is not a divisor of the world size; the errors of
    /// the node's rendezvous.
    pub fn from_env() -> Result<MpiGroup> {
        let (ready_tx, ready) = channel::<Result<(usize, usize, usize, ProcessGroup)>>();
        let (jobs, queue) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("multiproc-mpi".into())
            .spawn(move || {
                let mpi = match Mpi::init() {
                    Ok(mpi) => mpi,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((mpi.rank, mpi.size, mpi.nodes, mpi.local.clone())));
                for job in queue {
                    job(&mpi);
                }
            })
            .map_err(|e| Error::os("starting the MPI thread", e))?;
        match ready.recv() {
            Ok(Ok((rank, size, nodes, local))) => Ok(MpiGroup {
                jobs: Some(jobs),
                thread: Some(thread),
                local,
                rank,
                size,
                nodes,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(Error::Closed(
                    "the MPI thread ended while initializing MPI".into(),
                ))
            }
        }
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// The number of nodes (of node-local groups) in the job.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The node-local group (shared memory) this rank belongs to.
    pub fn local(&self) -> &ProcessGroup {
        &self.local
    }

    /// Waits for every rank of the job.
    ///
    /// # Errors
    /// The node group's errors (a dead local rank); MPI aborts the job on its own
    /// failures (a dead rank on another node ends the job through `mpirun`).
    pub fn barrier(&self) -> Result<()> {
        self.submit(Mpi::barrier).wait()
    }

    /// Sets `tensor` on every rank to its value on rank `src` (a rank of the job).
    ///
    /// # Errors
    /// As [`all_reduce_`](Self::all_reduce_), and [`Error::InvalidArgument`] for a
    /// `src` outside the job.
    pub fn broadcast_(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.broadcast_async(tensor, src).wait()
    }

    /// The async form of [`broadcast_`](Self::broadcast_).
    pub fn broadcast_async(&self, tensor: &Tensor, src: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |mpi| mpi.broadcast(&t, src))
    }

    /// All-reduce over the whole job: through shared memory on each node, MPI between
    /// the node leaders, then back through shared memory.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce_`].
    pub fn all_reduce_(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op).wait()
    }

    /// The async form of [`all_reduce_`](Self::all_reduce_).
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Work {
        let t = tensor.clone();
        self.submit(move |mpi| mpi.all_reduce(&t, op))
    }

    /// Fills `output` (`world_size` times `input`'s elements) with every rank's `input`,
    /// rank 0's first (torch's `all_gather_into_tensor`).
    ///
    /// # Errors
    /// As [`ProcessGroup::all_gather`].
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather_async(output, input).wait()
    }

    /// The async form of [`all_gather`](Self::all_gather).
    pub fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Work {
        let (o, i) = (output.clone(), input.clone());
        self.submit(move |mpi| mpi.all_gather(&o, &i))
    }

    /// Reduces `input` (`world_size` blocks of `output`'s size) across the job and
    /// leaves block `rank` of the result in `output` (torch's `reduce_scatter_tensor`).
    ///
    /// # Errors
    /// As [`ProcessGroup::reduce_scatter`].
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_async(output, input, op).wait()
    }

    /// The async form of [`reduce_scatter`](Self::reduce_scatter).
    pub fn reduce_scatter_async(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Work {
        let (o, i) = (output.clone(), input.clone());
        self.submit(move |mpi| mpi.reduce_scatter(&o, &i, op))
    }

    /// Sends `tensor` to rank `dst` of the job, which must [`recv`](Self::recv) a
    /// tensor of the same size and dtype; returns once `dst` has started taking it (a
    /// synchronous send, like [`ProcessGroup::send`]: pair the ranks so one sends while
    /// the other receives).
    ///
    /// # Errors
    /// As [`ProcessGroup::send`]. Across nodes a size mismatch is MPI's error, which
    /// aborts the job.
    pub fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.send_async(tensor, dst).wait()
    }

    /// The async form of [`send`](Self::send).
    pub fn send_async(&self, tensor: &Tensor, dst: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |mpi| mpi.send(&t, dst))
    }

    /// Receives into `tensor` what rank `src` sends with [`send`](Self::send).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.recv_async(tensor, src).wait()
    }

    /// The async form of [`recv`](Self::recv).
    pub fn recv_async(&self, tensor: &Tensor, src: usize) -> Work {
        let t = tensor.clone();
        self.submit(move |mpi| mpi.recv(&t, src))
    }

    /// Queues `op` on the MPI thread.
    fn submit(&self, op: impl FnOnce(&Mpi) -> Result<()> + Send + 'static) -> Work {
        let (tx, done) = channel();
        let job: Job = Box::new(move |mpi| {
            let _ = tx.send(op(mpi));
        });
        // A queue that is gone drops the job and its sender: `wait` then reports it.
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        Work::from_channel(done, "the MPI group's thread is gone")
    }
}

impl Mpi {
    fn init() -> Result<Mpi> {
        let (universe, _level) =
            mpi::initialize_with_threading(Threading::Funneled).ok_or_else(|| {
                Error::InvalidArgument(
                    "MPI is already initialized in this process: create one MpiGroup".into(),
                )
            })?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let (local_rank, local_size, leader) = match std::env::var(RANKS_PER_NODE_VAR) {
            Ok(v) => {
                let k = v.parse::<usize>().ok().filter(|&k| k > 0 && size % k == 0);
                let k = k.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{RANKS_PER_NODE_VAR}={v:?} must divide the world size {size}"
                    ))
                })?;
                (rank % k, k, rank - rank % k)
            }
            Err(_) => {
                let node = world.split_shared(rank as i32);
                let mut leader = rank as i32;
                node.process_at_rank(0).broadcast_into(&mut leader);
                (node.rank() as usize, node.size() as usize, leader as usize)
            }
        };
        // Where every rank is: its leader's rank and its local rank, from everyone.
        let mine = [leader as i32, local_rank as i32];
        let mut all = vec![0i32; 2 * size];
        world.all_gather_into(&mine[..], &mut all[..]);
        let mut leaders: Vec<usize> = all.chunks(2).map(|c| c[0] as usize).collect();
        leaders.sort_unstable();
        leaders.dedup();
        let places = all
            .chunks(2)
            .map(|c| {
                let node = leaders.binary_search(&(c[0] as usize)).unwrap_or(0);
                (node, c[1] as usize)
            })
            .collect();
        let mut env = Env::detect().unwrap_or_else(|_| Env::single());
        env.rank = rank;
        env.world_size = size;
        env.local_rank = local_rank;
        env.local_world_size = local_size;
        env.node_rank = leaders.binary_search(&leader).unwrap_or(0);
        let local = match ProcessGroup::node_local(&env) {
            Ok(local) => local,
            Err(e) => {
                // Returning would finalize MPI, which waits for the other ranks, who wait
                // in the collectives below for this one: end the job instead, as MPI
                // does with a failed rank.
                eprintln!("multiproc: rank {rank}: joining the node's process group: {e}");
                world.abort(1)
            }
        };
        let color = if local_rank == 0 {
            Color::with_value(0)
        } else {
            Color::undefined()
        };
        // The leaders keep the world's order (MPI_Comm_split breaks ties by old rank),
        // so a node's index is its leader's rank among the leaders.
        let leaders_comm = world.split_by_color(color);
        Ok(Mpi {
            local,
            leaders: leaders_comm,
            world,
            rank,
            size,
            places,
            nodes: leaders.len(),
            _universe: universe,
        })
    }

    fn check_rank(&self, peer: usize, what: &str) -> Result<()> {
        if peer >= self.size {
            return Err(Error::InvalidArgument(format!(
                "MpiGroup::{what}: rank {peer} in a job of {} ranks",
                self.size
            )));
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.local.barrier()?;
        self.world.barrier();
        Ok(())
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let Some(leaders) = self.leaders.as_ref().filter(|_| self.nodes > 1) else {
            if self.nodes == 1 {
                return self.local.all_reduce_(tensor, op);
            }
            // A non-leader of a job of several nodes: reduce into the leader, take the
            // result back.
            let local_op = if op == ReduceOp::Mean {
                ReduceOp::Sum
            } else {
                op
            };
            self.local.all_reduce_(tensor, local_op)?;
            return self.local.broadcast_(tensor, 0);
        };
        let local_op = if op == ReduceOp::Mean {
            ReduceOp::Sum
        } else {
            op
        };
        self.local.all_reduce_(tensor, local_op)?;
        with_dtype!(tensor.dtype(), "all_reduce_", T => {
            let mine: Vec<T> = tensor.to_vec()?;
            let mut all = mine.clone();
            match op {
                ReduceOp::Sum | ReduceOp::Mean => {
                    leaders.all_reduce_into(&mine[..], &mut all[..], SystemOperation::sum())
                }
                ReduceOp::Max => {
                    leaders.all_reduce_into(&mine[..], &mut all[..], SystemOperation::max())
                }
                ReduceOp::Min => {
                    leaders.all_reduce_into(&mine[..], &mut all[..], SystemOperation::min())
                }
            }
            if op == ReduceOp::Mean {
                let n = self.size as T;
                all.iter_mut().for_each(|x| *x /= n);
            }
            tensor.copy_from_slice(&all)?;
        });
        self.local.broadcast_(tensor, 0)
    }

    fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.check_rank(src, "broadcast_")?;
        let (src_node, src_local) = self.places[src];
        let my_node = self.places[self.rank].0;
        if my_node == src_node {
            self.local.broadcast_(tensor, src_local)?;
        }
        if self.nodes == 1 {
            return Ok(());
        }
        if let Some(leaders) = &self.leaders {
            with_dtype!(tensor.dtype(), "broadcast_", T => {
                let mut buf: Vec<T> = tensor.to_vec()?;
                leaders.process_at_rank(src_node as i32).broadcast_into(&mut buf[..]);
                if my_node != src_node {
                    tensor.copy_from_slice(&buf)?;
                }
            });
        }
        if my_node != src_node {
            self.local.broadcast_(tensor, 0)?;
        }
        Ok(())
    }

    fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        if self.nodes == 1 {
            // One node: the local ranks are the job's, in the same order.
            return self.local.all_gather(output, input);
        }
        if output.dtype() != input.dtype() || output.numel() != input.numel() * self.size {
            return Err(Error::Tensor(format!(
                "MpiGroup::all_gather: the output must hold {} times the input's elements of \
                 the same dtype (output {:?} {}, input {:?} {})",
                self.size,
                output.shape(),
                output.dtype(),
                input.shape(),
                input.dtype()
            )));
        }
        with_dtype!(input.dtype(), "all_gather", T => {
            let mine: Vec<T> = input.to_vec()?;
            let mut all: Vec<T> = vec![T::default(); output.numel()];
            self.world.all_gather_into(&mine[..], &mut all[..]);
            output.copy_from_slice(&all)?;
        });
        Ok(())
    }

    fn reduce_scatter(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        if self.nodes == 1 {
            return self.local.reduce_scatter(output, input, op);
        }
        let m = output.numel();
        if output.dtype() != input.dtype() || input.numel() != m * self.size {
            return Err(Error::Tensor(format!(
                "MpiGroup::reduce_scatter: the input must hold {} times the output's elements \
                 of the same dtype (output {:?} {}, input {:?} {})",
                self.size,
                output.shape(),
                output.dtype(),
                input.shape(),
                input.dtype()
            )));
        }
        let reduced = input.deep_clone()?;
        self.all_reduce(&reduced, op)?;
        let block = reduced
            .reshape(&[input.numel()])?
            .narrow(0, self.rank * m, m)?;
        output.reshape(&[m])?.copy_(&block)
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.check_rank(dst, "send")?;
        let (node, local) = self.places[dst];
        if node == self.places[self.rank].0 {
            return self.local.send(tensor, local);
        }
        with_dtype!(tensor.dtype(), "send", T => {
            let buf: Vec<T> = tensor.to_vec()?;
            self.world.process_at_rank(dst as i32).synchronous_send(&buf[..]);
        });
        Ok(())
    }

    fn recv(&self, tensor: &Tensor, src: usize) -> Result<()> {
        self.check_rank(src, "recv")?;
        let (node, local) = self.places[src];
        if node == self.places[self.rank].0 {
            return self.local.recv(tensor, local);
        }
        with_dtype!(tensor.dtype(), "recv", T => {
            let mut buf: Vec<T> = vec![T::default(); tensor.numel()];
            let status = self.world.process_at_rank(src as i32).receive_into(&mut buf[..]);
            let got = status.count(T::equivalent_datatype());
            if got as usize != buf.len() {
                return Err(Error::Tensor(format!(
                    "MpiGroup::recv on rank {}: rank {src} sent {got} elements where this \
                     tensor holds {}",
                    self.rank,
                    buf.len()
                )));
            }
            tensor.copy_from_slice(&buf)?;
        });
        Ok(())
    }
}
