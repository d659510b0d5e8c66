//! Beyond one process group: the same program under `spawn`, torchrun, `srun` and
//! `mpirun` (the guide is `docs/distributed.md` in the repository).
//!
//! - [`Env`] (`env`) — who this process is (rank, local rank, sizes, node, rendezvous
//!   address), read from the launcher's variables.
//! - [`ProcessGroup`] (`group`) — collectives (barrier, broadcast, all-reduce,
//!   all-gather, reduce-scatter, send/recv) among the ranks of one node; `arena` is its
//!   shared segment and barrier, `collectives` the data movement, `rendezvous` how
//!   launcher-started ranks find the segment, `zero_copy` the all-reduce of large
//!   tensors straight between the ranks' shared tensors, `peer_tensors` the peers'
//!   tensors that it keeps mapped.
//! - `MpiGroup` (`mpi`, feature `mpi`) — the whole job: shared memory in a node, MPI
//!   between one leader per node.
//!
//! multiproc's [`spawn`](crate::spawn) sets torchrun's variables for its workers, so code
//! written for torchrun runs under `spawn` unchanged, and a worker that fails with
//! `TORCHELASTIC_ERROR_FILE` set writes torchelastic's error file.

// No unsafe code here: this module owns the protocols (who writes which bytes in which
// phase) and reaches memory other processes write only through `shm::SharedArea` (the
// segment's words and slots) and the kernels of `tensor::bulk`; its kernel calls go
// through `sys`.
mod arena;
mod collectives;
mod env;
mod group;
#[cfg(feature = "mpi")]
mod mpi;
mod peer_tensors;
mod rendezvous;
mod zero_copy;

pub use env::{Env, Launcher};
pub use group::{DEFAULT_TIMEOUT, ProcessGroup, ReduceOp, Work};
#[cfg(feature = "mpi")]
pub use mpi::{MpiGroup, RANKS_PER_NODE_VAR};
