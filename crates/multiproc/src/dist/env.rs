//! [`Env`]: who this process is in a distributed job, read from the variables its
//! launcher set (torchrun, Open MPI, MPICH/PMI, SLURM, multiproc's own spawn).
//!
//! Reading is a pure function of a map of variables ([`Env::from_vars`]), so every
//! launcher's contract is unit-tested without touching the process environment.
//!
//! When several launchers' variables are present, the innermost launcher wins: torchrun
//! started under `srun` sets `RANK` for its workers while `SLURM_PROCID` still names the
//! torchrun agent, so torchrun's variables come first, then MPI's, then SLURM's. A set
//! that is only partly there (`RANK` without `WORLD_SIZE`), a value that does not parse,
//! or values that contradict each other (`RANK=3` with `WORLD_SIZE=2`, a hand-set `RANK`
//! that differs from `OMPI_COMM_WORLD_RANK`) is an [`Error::Env`] naming the variables.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod launchers;
#[cfg(test)]
mod tests;
mod vars;

use launchers::{master, mpich, open_mpi, slurm, torchrun};
use vars::Vars;

/// Which program started this process and set its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Launcher {
    /// torchrun / torchelastic (`TORCHELASTIC_RUN_ID`, or a bare `RANK`/`WORLD_SIZE`).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH / Intel MPI Hydra (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`).
    Mpich,
    /// SLURM's `srun` (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`, `SLURM_NODEID`).
    Slurm,
    /// multiproc's own [`spawn`](crate::spawn) / [`start_processes`](crate::start_processes).
    Multiproc,
    /// No launcher: one process, rank 0 of 1.
    Single,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Mpich => "MPICH/PMI",
            Launcher::Slurm => "SLURM",
            Launcher::Multiproc => "multiproc spawn",
            Launcher::Single => "single process",
        })
    }
}

/// Who this process is in a distributed job: its ranks, the sizes, the rendezvous
/// address, and which launcher said so.
///
/// ```no_run
/// let env = multiproc::dist::Env::detect()?;
/// println!("rank {} of {} ({})", env.rank, env.world_size, env.launcher);
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Env {
    /// The global rank, `0..world_size`.
    pub rank: usize,
    /// The rank among the processes on this node, `0..local_world_size`.
    pub local_rank: usize,
    /// The number of processes in the job.
    pub world_size: usize,
    /// The number of processes of the job on this node.
    pub local_world_size: usize,
    /// The index of this node (torchrun's `GROUP_RANK`, `SLURM_NODEID`).
    pub node_rank: usize,
    /// `MASTER_ADDR`, when set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, when set.
    pub master_port: Option<u16>,
    /// How many times the launcher restarted the job (`TORCHELASTIC_RESTART_COUNT`,
    /// `SLURM_RESTART_COUNT`; 0 otherwise).
    pub restart_count: usize,
    /// An identifier of this run of the job shared by all its ranks, when the launcher
    /// gives one (`TORCHELASTIC_RUN_ID`, the MPI job id, `SLURM_JOB_ID.SLURM_STEP_ID`).
    pub run_id: Option<String>,
    /// Who set all this.
    pub launcher: Launcher,
}

impl Env {
    /// Reads this process's environment.
    ///
    /// # Errors
    /// [`Error::Env`] when a launcher's variables are partial, unparsable or
    /// contradictory; the message names them and their values.
    pub fn detect() -> Result<Env> {
        let map: HashMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        Env::from_vars(&map)
    }

    /// Reads a given set of variables, as [`detect`](Self::detect) reads the process's.
    ///
    /// # Errors
    /// As [`detect`](Self::detect).
    pub fn from_vars(map: &HashMap<String, String>) -> Result<Env> {
        let v = Vars::new(map);
        let (master_addr, master_port) = master(&v)?;
        let mut env = if v.has("TORCHELASTIC_RUN_ID") || v.has("RANK") || v.has("WORLD_SIZE") {
            torchrun(&v)?
        } else if v.has("OMPI_COMM_WORLD_RANK") || v.has("OMPI_COMM_WORLD_SIZE") {
            open_mpi(&v)?
        } else if v.has("PMI_RANK") || v.has("PMI_SIZE") {
            mpich(&v)?
        } else if v.has("SLURM_PROCID") {
            slurm(&v)?
        } else {
            Env::single()
        };
        env.master_addr = master_addr;
        env.master_port = master_port;
        env.check(&v)?;
        Ok(env)
    }

    /// Rank 0 of 1, no launcher.
    pub fn single() -> Env {
        Env {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            restart_count: 0,
            run_id: None,
            launcher: Launcher::Single,
        }
    }

    /// The number of nodes, assuming every node runs `local_world_size` ranks.
    pub fn nodes(&self) -> usize {
        self.world_size.div_ceil(self.local_world_size.max(1))
    }

    fn check(&self, v: &Vars<'_>) -> Result<()> {
        let bad = |what: String| {
            Err(Error::Env(format!(
                "{} variables contradict each other: {what} (have: {})",
                self.launcher,
                v.present_of(self.launcher)
            )))
        };
        if self.world_size == 0 {
            return bad("the world size is 0".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below the world size {}",
                self.rank, self.world_size
            ));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return bad(format!(
                "the local world size {} is not in 1..={}",
                self.local_world_size, self.world_size
            ));
        }
        if self.local_rank >= self.local_world_size {
            return bad(format!(
                "local rank {} is not below the local world size {}",
                self.local_rank, self.local_world_size
            ));
        }
        // A rank set by hand for torch beside MPI's own must agree with it.
        if self.launcher == Launcher::Torchrun && !v.has("TORCHELASTIC_RUN_ID") {
            for (ours, theirs) in [
                ("RANK", "OMPI_COMM_WORLD_RANK"),
                ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
                ("RANK", "PMI_RANK"),
                ("WORLD_SIZE", "PMI_SIZE"),
            ] {
                if let (Some(a), Some(b)) = (v.num(ours)?, v.num(theirs)?) {
                    if a != b {
                        return Err(Error::Env(format!(
                            "{ours}={a} contradicts {theirs}={b}: set {ours} from the MPI \
                             launcher's value or unset it"
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}
