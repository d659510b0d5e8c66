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

use crate::{Error, Result};

use crate::process::LAUNCHER_VAR;

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
    pub restart_count: u32,
    /// An identifier of this run of the job shared by all its ranks, when the launcher
    /// gives one (`TORCHELASTIC_RUN_ID`, the MPI job id, `SLURM_JOB_ID.SLURM_STEP_ID`).
    pub run_id: Option<String>,
    /// Who set all this.
    pub launcher: Launcher,
}

/// The variables of one process, with the names read so far for error messages.
struct Vars<'a> {
    map: &'a HashMap<String, String>,
}

impl Vars<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.map.get(key).map(String::as_str)
    }

    fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    fn num(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                Error::Env(format!(
                    "{key}={v:?} is not a non-negative integer: fix or unset it"
                ))
            }),
        }
    }

    /// A number that must be there once the launcher is known.
    fn required(&self, key: &str, launcher: Launcher) -> Result<usize> {
        self.num(key)?.ok_or_else(|| {
            Error::Env(format!(
                "{launcher} variables are incomplete: {key} is not set (have: {})",
                self.present_of(launcher)
            ))
        })
    }

    /// The launcher's variables that are set, for messages.
    fn present_of(&self, launcher: Launcher) -> String {
        let prefixes: &[&str] = match launcher {
            Launcher::Torchrun | Launcher::Multiproc => &[
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "TORCHELASTIC_",
                "MASTER_",
            ],
            Launcher::OpenMpi => &["OMPI_COMM_WORLD_"],
            Launcher::Mpich => &["PMI_RANK", "PMI_SIZE", "MPI_LOCAL"],
            Launcher::Slurm => &[
                "SLURM_PROCID",
                "SLURM_LOCALID",
                "SLURM_NTASKS",
                "SLURM_NODEID",
                "SLURM_TASKS_PER_NODE",
            ],
            Launcher::Single => &[],
        };
        let mut set: Vec<String> = self
            .map
            .iter()
            .filter(|(k, _)| {
                prefixes
                    .iter()
                    .any(|p| k.as_str() == *p || (p.ends_with('_') && k.starts_with(p)))
            })
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        set.sort();
        if set.is_empty() {
            "none".into()
        } else {
            set.join(" ")
        }
    }
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
        let v = Vars { map };
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

fn master(v: &Vars<'_>) -> Result<(Option<String>, Option<u16>)> {
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

fn torchrun(v: &Vars<'_>) -> Result<Env> {
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
        restart_count: u32::try_from(restart_count).unwrap_or(u32::MAX),
        run_id: v.get("TORCHELASTIC_RUN_ID").map(str::to_string),
        launcher,
    })
}

/// Open MPI has no node index variable: with its default by-slot mapping a node's ranks
/// are consecutive, so the node is `(rank - local_rank) / local_size`.
fn open_mpi(v: &Vars<'_>) -> Result<Env> {
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

fn mpich(v: &Vars<'_>) -> Result<Env> {
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

fn slurm(v: &Vars<'_>) -> Result<Env> {
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
        restart_count: u32::try_from(v.num("SLURM_RESTART_COUNT")?.unwrap_or(0))
            .unwrap_or(u32::MAX),
        run_id,
        launcher: l,
    })
}

/// The task count of node `node` in SLURM's compressed list (`4(x2),3` is 4, 4, 3).
fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<Env> {
        let map = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Env::from_vars(&map)
    }

    #[test]
    fn no_launcher_is_one_process() {
        let e = env(&[("HOME", "/root")]).unwrap();
        assert_eq!(e, Env::single());
        assert_eq!(e.nodes(), 1);
    }

    #[test]
    fn torchrun_sets_everything() {
        let e = env(&[
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("ROLE_RANK", "5"),
            ("ROLE_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!((e.rank, e.local_rank, e.world_size), (5, 1, 8));
        assert_eq!((e.local_world_size, e.node_rank, e.nodes()), (4, 1, 2));
        assert_eq!(e.master_addr.as_deref(), Some("node0"));
        assert_eq!(e.master_port, Some(29500));
        assert_eq!(e.restart_count, 2);
        assert_eq!(e.run_id.as_deref(), Some("job7"));
    }

    #[test]
    fn torchrun_partial_is_an_error_naming_the_missing_variable() {
        let err = env(&[
            ("TORCHELASTIC_RUN_ID", "j"),
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
        ])
        .unwrap_err();
        assert!(matches!(err, Error::Env(_)));
        assert!(err.to_string().contains("LOCAL_RANK"), "{err}");
        let err = env(&[("RANK", "1")]).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE is not set"), "{err}");
        assert!(err.to_string().contains("RANK=1"), "{err}");
    }

    #[test]
    fn contradictions_name_the_values() {
        let err = env(&[("RANK", "3"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("rank 3"), "{err}");
        assert!(err.to_string().contains("WORLD_SIZE=2"), "{err}");
        let err = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ])
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("RANK=1 contradicts OMPI_COMM_WORLD_RANK=0"),
            "{err}"
        );
        let err = env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("RANK=\"x\""), "{err}");
        let err = env(&[("MASTER_ADDR", "h")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT is not"), "{err}");
        let err = env(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "99999")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT=\"99999\""), "{err}");
    }

    #[test]
    fn a_hand_set_rank_may_omit_the_local_pair() {
        let e = env(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap();
        assert_eq!((e.local_rank, e.local_world_size, e.node_rank), (1, 2, 0));
    }

    #[test]
    fn multiproc_spawn_is_recognised() {
        let e = env(&[
            (LAUNCHER_VAR, "spawn"),
            ("TORCHELASTIC_RUN_ID", "multiproc-1"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "0"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Multiproc);
    }

    #[test]
    fn open_mpi() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-host-123@1"),
            ("SLURM_PROCID", "0"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.local_rank, e.node_rank), (3, 1, 1));
        assert_eq!(e.run_id.as_deref(), Some("prterun-host-123@1"));
        let err = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            err.to_string().contains("OMPI_COMM_WORLD_LOCAL_RANK"),
            "{err}"
        );
    }

    #[test]
    fn mpich() {
        let e = env(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Mpich);
        assert_eq!((e.rank, e.local_rank, e.node_rank), (2, 0, 1));
        let err = env(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("MPI_LOCALNRANKS"), "{err}");
    }

    #[test]
    fn slurm() {
        let e = env(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "11"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2),3"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        assert_eq!(e.launcher, Launcher::Slurm);
        assert_eq!((e.rank, e.local_rank, e.world_size), (9, 1, 11));
        assert_eq!((e.local_world_size, e.node_rank), (3, 2));
        assert_eq!(e.run_id.as_deref(), Some("77.0"));
        let err = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]).unwrap_err();
        assert!(err.to_string().contains("SLURM_LOCALID"), "{err}");
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
    }

    #[test]
    fn torchrun_under_srun_is_torchrun() {
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_NODEID", "0"),
            ("TORCHELASTIC_RUN_ID", "r"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!((e.launcher, e.rank), (Launcher::Torchrun, 1));
    }
}
