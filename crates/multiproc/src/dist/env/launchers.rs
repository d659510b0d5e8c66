//! One reader per launcher's contract: torchrun (and multiproc's own spawn), Open MPI,
//! MPICH/PMI, SLURM, and the rendezvous address (`MASTER_ADDR`/`MASTER_PORT`) they
//! share. Each reads only its own variables; [`Env::from_vars`](super::Env::from_vars)
//! chooses which one runs.

use super::vars::Vars;
use super::{Env, Launcher};
use crate::error::{Error, Result};
use crate::process::LAUNCHER_VAR;

pub(super) fn master(v: &Vars<'_>) -> Result<(Option<String>, Option<u16>)> {
    let addr = v.get("MASTER_ADDR").map(str::to_string);
    let port = match v.get("MASTER_PORT") {
        None => None,
        Some(p) => Some(p.trim().parse::<u16>().map_err(|_| {
            Error::Env(format!(
                "MASTER_PORT={p:?} is not a port number (1..=65535)"
            ))
        })?),
    };
    match (&addr, port) {
        (Some(_), None) => Err(Error::Env(
            "MASTER_ADDR is set but MASTER_PORT is not: set both or neither".into(),
        )),
        (None, Some(p)) => Err(Error::Env(format!(
            "MASTER_PORT={p} is set but MASTER_ADDR is not: set both or neither"
        ))),
        _ => Ok((addr, port)),
    }
}

pub(super) fn torchrun(v: &Vars<'_>) -> Result<Env> {
    let launcher = if v.get(LAUNCHER_VAR) == Some("spawn") {
        Launcher::Multiproc
    } else {
        Launcher::Torchrun
    };
    let rank = v.required("RANK", launcher)?;
    let world_size = v.required("WORLD_SIZE", launcher)?;
    let elastic = v.has("TORCHELASTIC_RUN_ID");
    // torchrun always sets the local pair; a hand-set RANK/WORLD_SIZE (as
    // torch.distributed's env:// needs) may leave them out: one node then.
    let (local_rank, local_world_size) = if elastic {
        (
            v.required("LOCAL_RANK", launcher)?,
            v.required("LOCAL_WORLD_SIZE", launcher)?,
        )
    } else {
        match (v.num("LOCAL_RANK")?, v.num("LOCAL_WORLD_SIZE")?) {
            (Some(l), Some(n)) => (l, n),
            (None, None) => (rank, world_size),
            (Some(l), None) => (l, world_size),
            (None, Some(_)) => {
                return Err(Error::Env(format!(
                    "{launcher} variables are incomplete: LOCAL_WORLD_SIZE is set but \
                     LOCAL_RANK is not (have: {})",
                    v.present_of(launcher)
                )));
            }
        }
    };
    let node_rank = match v.num("GROUP_RANK")? {
        Some(g) => g,
        None => rank.saturating_sub(local_rank) / local_world_size.max(1),
    };
    let restart_count = v.num("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0);
    Ok(Env {
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank,
        master_addr: None,
        master_port: None,
        restart_count,
        run_id: v.get("TORCHELASTIC_RUN_ID").map(str::to_string),
        launcher,
    })
}

/// Open MPI has no node index variable: with its default by-slot mapping a node's ranks
/// are consecutive, so the node is `(rank - local_rank) / local_size`.
pub(super) fn open_mpi(v: &Vars<'_>) -> Result<Env> {
    let l = Launcher::OpenMpi;
    let rank = v.required("OMPI_COMM_WORLD_RANK", l)?;
    let world_size = v.required("OMPI_COMM_WORLD_SIZE", l)?;
    let local_rank = v.required("OMPI_COMM_WORLD_LOCAL_RANK", l)?;
    let local_world_size = v.required("OMPI_COMM_WORLD_LOCAL_SIZE", l)?;
    let run_id = v
        .get("PMIX_NAMESPACE")
        .or_else(|| v.get("OMPI_MCA_ess_base_jobid"))
        .map(str::to_string);
    Ok(Env {
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank: rank.saturating_sub(local_rank) / local_world_size.max(1),
        master_addr: None,
        master_port: None,
        restart_count: 0,
        run_id,
        launcher: l,
    })
}

pub(super) fn mpich(v: &Vars<'_>) -> Result<Env> {
    let l = Launcher::Mpich;
    let rank = v.required("PMI_RANK", l)?;
    let world_size = v.required("PMI_SIZE", l)?;
    let (local_rank, local_world_size) =
        match (v.num("MPI_LOCALRANKID")?, v.num("MPI_LOCALNRANKS")?) {
            (Some(r), Some(n)) => (r, n),
            (None, None) => (rank, world_size),
            (r, n) => {
                let missing = if r.is_none() {
                    "MPI_LOCALRANKID"
                } else {
                    "MPI_LOCALNRANKS"
                };
                let _ = n;
                return Err(Error::Env(format!(
                    "{l} variables are incomplete: {missing} is not set (have: {})",
                    v.present_of(l)
                )));
            }
        };
    Ok(Env {
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank: rank.saturating_sub(local_rank) / local_world_size.max(1),
        master_addr: None,
        master_port: None,
        restart_count: 0,
        run_id: v.get("PMI_KVSNAME").map(str::to_string),
        launcher: l,
    })
}

pub(super) fn slurm(v: &Vars<'_>) -> Result<Env> {
    let l = Launcher::Slurm;
    let rank = v.required("SLURM_PROCID", l)?;
    let world_size = v.required("SLURM_NTASKS", l)?;
    let local_rank = v.required("SLURM_LOCALID", l)?;
    let node_rank = v.required("SLURM_NODEID", l)?;
    let local_world_size = match v.get("SLURM_TASKS_PER_NODE") {
        Some(spec) => tasks_on_node(spec, node_rank).ok_or_else(|| {
            Error::Env(format!(
                "SLURM_TASKS_PER_NODE={spec:?} does not give a task count for node \
                 SLURM_NODEID={node_rank} (expected a form like 4(x2),3)"
            ))
        })?,
        None => world_size,
    };
    let run_id = v
        .get("SLURM_JOB_ID")
        .map(|job| match v.get("SLURM_STEP_ID") {
            Some(step) => format!("{job}.{step}"),
            None => job.to_string(),
        });
    Ok(Env {
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank,
        master_addr: None,
        master_port: None,
        restart_count: v.num("SLURM_RESTART_COUNT")?.unwrap_or(0),
        run_id,
        launcher: l,
    })
}

/// The task count of node `node` in SLURM's compressed list (`4(x2),3` is 4, 4, 3).
pub(super) fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut seen = 0usize;
    for part in spec.split(',') {
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c.trim().parse().ok()?, r.strip_suffix(')')?.parse().ok()?),
            None => (part.trim().parse().ok()?, 1usize),
        };
        seen += repeat;
        if node < seen {
            return Some(count);
        }
    }
    None
}
