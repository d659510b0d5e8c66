//! Beyond one process group: the same program under `spawn`, torchrun, `srun` and
//! `mpirun`.
//!
//! - [`Env`] (`env`) — who this process is (rank, local rank, sizes, node, rendezvous
//!   address), read from the launcher's variables.
//! - [`ProcessGroup`] (`group`) — collectives (barrier, broadcast, all-reduce,
//!   all-gather, reduce-scatter, send/recv) among the ranks of one node, through
//!   shared memory.
//!
//! multiproc's [`spawn`](crate::spawn) sets torchrun's variables for its workers, so code
//! written for torchrun runs under `spawn` unchanged, and a worker that fails with
//! `TORCHELASTIC_ERROR_FILE` set writes torchelastic's error file.

#[allow(unsafe_code)]
mod arena;
mod env;
#[allow(unsafe_code)]
mod group;
#[cfg(feature = "mpi")]
mod mpi;
mod rendezvous;

pub use env::{Env, Launcher};
pub use group::{DEFAULT_TIMEOUT, ProcessGroup, ReduceOp, Work};
#[cfg(feature = "mpi")]
pub use mpi::{MpiGroup, RANKS_PER_NODE_VAR};
