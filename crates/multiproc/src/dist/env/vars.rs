//! [`Vars`]: one process's environment variables as the launcher readers see them, with
//! the lookups and the messages that name what is present and what is missing.

use std::collections::HashMap;

use super::Launcher;
use crate::error::{Error, Result};

/// The variables of one process, with the names read so far for error messages.
pub(super) struct Vars<'a> {
    map: &'a HashMap<String, String>,
}

impl<'a> Vars<'a> {
    /// The variables of `map`.
    pub(super) fn new(map: &'a HashMap<String, String>) -> Self {
        Vars { map }
    }

    pub(super) fn get(&self, key: &str) -> Option<&str> {
        self.map.get(key).map(String::as_str)
    }

    pub(super) fn has(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    pub(super) fn num(&self, key: &str) -> Result<Option<usize>> {
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
    pub(super) fn required(&self, key: &str, launcher: Launcher) -> Result<usize> {
        self.num(key)?.ok_or_else(|| {
            Error::Env(format!(
                "{launcher} variables are incomplete: {key} is not set (have: {})",
                self.present_of(launcher)
            ))
        })
    }

    /// The launcher's variables that are set, for messages.
    pub(super) fn present_of(&self, launcher: Launcher) -> String {
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
