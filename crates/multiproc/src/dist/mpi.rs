//! [`MpiGroup`] (feature `mpi`): collectives across nodes, hierarchical — the ranks of a
//! node reduce through shared memory ([`ProcessGroup`]), one leader per node runs the
//! MPI all-reduce with the other nodes' leaders (the `mpi` crate, on the MPI library
//! the job was launched with), and the leader's result goes back to its node through
//! shared memory.
//!
//! Nodes are found with `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`. For tests on one
//! machine, `MULTIPROC_MPI_RANKS_PER_NODE=k` makes every `k` consecutive ranks a "node"
//! instead, so the MPI path runs between processes of one host.

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::*;

use super::env::Env;
use super::group::{ProcessGroup, ReduceOp};
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

/// The test override of the node size (see the module docs).
pub const RANKS_PER_NODE_VAR: &str = "MULTIPROC_MPI_RANKS_PER_NODE";

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
    // Field order is drop order: the communicators before the universe (which
    // finalizes MPI).
    local: ProcessGroup,
    leaders: Option<SimpleCommunicator>,
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    _universe: Universe,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.size)
            .field("local", &self.local)
            .field("leader", &self.leaders.is_some())
            .finish()
    }
}

impl MpiGroup {
    /// Initializes MPI and joins every rank of the job: the node's ranks meet through
    /// shared memory (as [`ProcessGroup::from_env`]), the node leaders through MPI.
    /// Every rank must call it. A rank that cannot join its node's group after MPI is
    /// up prints why and aborts the MPI job (returning would leave the other ranks
    /// waiting for it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when MPI was already initialized in this process or
    /// `MULTIPROC_MPI_RANKS_PER_NODE` is not a divisor of the world size; the errors of
    /// the node's rendezvous.
    pub fn from_env() -> Result<MpiGroup> {
        let universe = mpi::initialize().ok_or_else(|| {
            Error::InvalidArgument(
                "MPI is already initialized in this process: create one MpiGroup".into(),
            )
        })?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let (local_rank, local_size) = match std::env::var(RANKS_PER_NODE_VAR) {
            Ok(v) => {
                let k = v.parse::<usize>().ok().filter(|&k| k > 0 && size % k == 0);
                let k = k.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "{RANKS_PER_NODE_VAR}={v:?} must divide the world size {size}"
                    ))
                })?;
                (rank % k, k)
            }
            Err(_) => {
                let node = world.split_shared(rank as i32);
                (node.rank() as usize, node.size() as usize)
            }
        };
        let mut env = Env::detect().unwrap_or_else(|_| Env::single());
        env.rank = rank;
        env.world_size = size;
        env.local_rank = local_rank;
        env.local_world_size = local_size;
        env.node_rank = (rank - local_rank) / local_size;
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
        let leaders = world.split_by_color(color);
        Ok(MpiGroup {
            local,
            leaders,
            world,
            rank,
            size,
            _universe: universe,
        })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.size
    }

    /// The node-local group (shared memory) this rank belongs to.
    pub fn local(&self) -> &ProcessGroup {
        &self.local
    }

    /// Waits for every rank of the job.
    ///
    /// # Errors
    /// The node group's errors (a dead local rank); MPI aborts the job on its own
    /// failures.
    pub fn barrier(&self) -> Result<()> {
        self.local.barrier()?;
        self.world.barrier();
        Ok(())
    }

    /// All-reduce over the whole job: through shared memory on each node, MPI between
    /// the node leaders, then back through shared memory.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce_`].
    pub fn all_reduce_(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let local_op = if op == ReduceOp::Mean {
            ReduceOp::Sum
        } else {
            op
        };
        self.local.all_reduce_(tensor, local_op)?;
        if let Some(leaders) = &self.leaders {
            macro_rules! across {
                ($t:ty) => {{
                    let mine: Vec<$t> = tensor.to_vec()?;
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
                        let n = self.size as $t;
                        all.iter_mut().for_each(|x| *x /= n);
                    }
                    tensor.copy_(&Tensor::from_vec(all, tensor.shape())?)?;
                }};
            }
            match tensor.dtype() {
                DType::F32 => across!(f32),
                DType::F64 => across!(f64),
                DType::I32 => across!(i32),
                DType::I64 => across!(i64),
                other => {
                    return Err(Error::Tensor(format!(
                        "MpiGroup::all_reduce_ supports f32, f64, i32 and i64 tensors, not {other}"
                    )));
                }
            }
        }
        self.local.broadcast_(tensor, 0)
    }
}
