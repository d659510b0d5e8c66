//! Every launcher's contract, from maps of variables (no process environment touched).

use super::launchers::tasks_on_node;
use super::*;
use crate::process::LAUNCHER_VAR;

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
