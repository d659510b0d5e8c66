//! This machine's `file_system` segments, seen from outside the programs that made
//! them: for operators, the `multiproc` command (`gc`, `doctor`) and tests.
//!
//! A segment of the `file_system` strategy is a file `/dev/shm/<name>` whose name says
//! who made it: `multiproc_<creator pid>_<32 hex digits>`, followed, when it was made
//! in a process tree with an shm manager, by `_<root pid>_<root start time>_<16 hex
//! digits>` (the tree: its root process, and the random part of its manager's
//! address). This module reads those parts ([`Segment`], [`SegmentTree`]), lists the
//! segments in `/dev/shm` ([`segments`]), asks the live shm managers of this user
//! which names they hold ([`live_managers`], [`ShmManager::holds`]), tells a stale
//! segment from one in use ([`StaleCheck`]) and removes one ([`Segment::remove`]).
//! Each is the library's own code, the one the segments and the manager themselves
//! run: a name this module parses is exactly one the library accepts, and a query is
//! the manager's own protocol.
//!
//! The shm manager's own entry points live here too: [`run_shm_manager_from_env`] is
//! what a manager process runs, and a host that is not a Rust binary of its own (the
//! Python package) names the command that starts one with
//! [`set_shm_manager_command`] and passes [`shm_manager_env`] to its children.
//!
//! Guarantees:
//!
//! - A [`Segment`] always holds a valid name (a single path component under
//!   `/dev/shm`), so [`Segment::remove`] can only ever remove one of multiproc's
//!   segments.
//! - [`StaleCheck`] calls a segment [`Verdict::Stale`] only when nobody can still
//!   use it: the root of its tree has exited (every process of a tree dies with its
//!   root), or, for a name without a tree, its creator has exited and every live shm
//!   manager of this user answered that it does not hold the name. A manager that
//!   cannot be asked counts as holding every such name.
//! - Removing is safe while some process still maps the segment (its memory stays
//!   until the last mapping goes), and several removers at once are safe: each name is
//!   removed by exactly one of them; the others see `Ok(false)`.
//!
//! ```no_run
//! use multiproc::maintenance::{StaleCheck, Verdict, segments};
//!
//! let mut check = StaleCheck::new();
//! for segment in segments() {
//!     if check.verdict(&segment) == Verdict::Stale {
//!         let bytes = segment.size().unwrap_or(0);
//!         if segment.remove()? {
//!             println!("removed {} ({bytes} bytes)", segment.path().display());
//!         }
//!     }
//! }
//! # Ok::<(), multiproc::Error>(())
//! ```

use std::fmt;
use std::path::PathBuf;

use crate::error::{Error, Result};
pub use crate::manager::run_shm_manager_from_env;
pub use crate::sharing::{set_shm_manager_command, shm_manager_env};
use crate::shm::name::{self, SegmentName};
use crate::shm::registry;
use crate::shm::tree::{Tree, is_valid_address};
use crate::sys::process::process_is_dead;

/// The prefix of every segment name (`multiproc_`).
pub const PREFIX: &str = name::PREFIX;

/// A multiproc segment name, parsed into its parts.
///
/// ```
/// use multiproc::maintenance::Segment;
///
/// let s = Segment::parse(
///     "multiproc_19447_ab79c54535247b8e7efabf2712a3f8c5_19440_1042197_0a1dc4da1d19eb0e",
/// )?;
/// assert_eq!(s.creator(), 19447);
/// assert_eq!(s.random(), "ab79c54535247b8e7efabf2712a3f8c5");
/// let tree = s.tree().expect("the name carries its tree");
/// assert_eq!((tree.root(), tree.root_start_time()), (19440, 1042197));
/// assert_eq!(tree.random(), "0a1dc4da1d19eb0e");
/// assert_eq!(
///     s.path().to_str(),
///     Some("/dev/shm/multiproc_19447_ab79c54535247b8e7efabf2712a3f8c5_19440_1042197_0a1dc4da1d19eb0e"),
/// );
/// assert!(Segment::parse("multiproc_1_../../etc/passwd").is_err());
/// # Ok::<(), multiproc::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Segment(SegmentName);

impl Segment {
    /// Parses `name` (without `/dev/shm/`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `name` is not a multiproc segment name.
    pub fn parse(name: &str) -> Result<Segment> {
        if SegmentName::is_valid(name) {
            SegmentName::parse(name).map(Segment)
        } else {
            Err(Error::InvalidArgument(format!(
                "{name:?} is not a multiproc segment name: expected {PREFIX}<pid>_<32 \
                 lowercase hex digits>, optionally followed by _<root pid>_<root start \
                 time>_<16 lowercase hex digits>"
            )))
        }
    }

    /// The name, without `/dev/shm/`.
    pub fn name(&self) -> &str {
        self.0.as_str()
    }

    /// `/dev/shm/<name>`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(name::shm_path(&self.0))
    }

    /// The pid of the process that made the segment.
    pub fn creator(&self) -> u32 {
        self.0.creator()
    }

    /// The name's 128 random bits, as 32 lowercase hex digits.
    pub fn random(&self) -> &str {
        self.0.random()
    }

    /// The process tree that made the segment, when the name carries it.
    pub fn tree(&self) -> Option<SegmentTree> {
        self.0.tree().map(SegmentTree)
    }

    /// The file's size in bytes.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when it cannot be read (the file is gone, say).
    pub fn size(&self) -> Result<u64> {
        std::fs::symlink_metadata(self.path())
            .map(|m| m.len())
            .map_err(|e| Error::os(format!("stat of {}", self.path().display()), e))
    }

    /// Removes the name from `/dev/shm`: `Ok(false)` when it was gone already (another
    /// remover came first). Processes that map the segment keep its memory until they
    /// unmap it.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the kernel refuses (the file is another user's, say).
    pub fn remove(&self) -> Result<bool> {
        name::remove(&self.0)
    }
}

impl fmt::Display for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The process tree a segment name carries: its root process (pid and start time,
/// so a reused pid is never taken for the root) and its manager address's random part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentTree(Tree);

impl SegmentTree {
    /// The pid of the tree's root process.
    pub fn root(&self) -> u32 {
        self.0.root
    }

    /// The root's start time, in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub fn root_start_time(&self) -> u64 {
        self.0.start
    }

    /// The random part of the tree's manager address (16 lowercase hex digits).
    pub fn random(&self) -> &str {
        &self.0.random
    }

    /// Whether the root still runs: a process with its pid and start time exists and
    /// is not a zombie. Once it does not, no process of the tree is left.
    pub fn root_alive(&self) -> bool {
        self.0.root_alive()
    }

    /// The tree's shm manager (this user's; whether or not it runs).
    pub fn manager(&self) -> ShmManager {
        ShmManager {
            address: self.0.address(),
        }
    }
}

/// The multiproc segments in `/dev/shm` (of every process and user), sorted by name;
/// empty when `/dev/shm` cannot be read. Other files there are not listed.
pub fn segments() -> Vec<Segment> {
    let mut all: Vec<Segment> = name::names_in_dev_shm().map(Segment).collect();
    all.sort_by(|a, b| a.name().cmp(b.name()));
    all
}

/// A live shm manager, by its address (an abstract unix socket).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShmManager {
    address: String,
}

impl ShmManager {
    /// The manager at `address` (without the leading `@`), whether or not one runs
    /// there.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `address` cannot be a manager's.
    pub fn at(address: &str) -> Result<ShmManager> {
        if is_valid_address(address) {
            Ok(ShmManager {
                address: address.to_owned(),
            })
        } else {
            Err(Error::InvalidArgument(format!(
                "{address:?} is not an shm manager address (multiproc-shm-<uid>-…, letters, \
                 digits and dashes, under 100 bytes)"
            )))
        }
    }

    /// Its address, without the leading `@`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Asks the manager whether it holds `segment` (it removes what it holds once its
    /// tree has exited). One connection, checked to be this user's, and a wait of at
    /// most half a second for the answer.
    ///
    /// # Errors
    ///
    /// [`Error::Manager`] when nobody listens there, another user does, or the answer
    /// is not clear; [`Error::Timeout`] when none came (a manager of an older
    /// multiproc does not answer queries).
    pub fn holds(&self, segment: &Segment) -> Result<bool> {
        registry::query(&self.address, &segment.0)
    }

    /// Whether the manager serves: asks it about a name nobody makes (pid 0) and
    /// expects a clear answer.
    ///
    /// # Errors
    ///
    /// As [`holds`](Self::holds).
    pub fn answers(&self) -> Result<()> {
        let probe = SegmentName::parse(&format!("{PREFIX}0_{}", "0".repeat(32)))?;
        registry::query(&self.address, &probe).map(drop)
    }
}

/// The live shm managers of this user (another user's cannot remove our files).
pub fn live_managers() -> Vec<ShmManager> {
    registry::live_manager_addresses()
        .into_iter()
        .map(|address| ShmManager { address })
        .collect()
}

/// What [`StaleCheck::verdict`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Its creator, or the root of its tree, still runs: it is theirs.
    InUse,
    /// A live shm manager of this user holds it (or could not be asked) and removes it
    /// when its tree has exited.
    HeldByManager,
    /// Nobody can use it any more: it can be removed.
    Stale,
}

/// Tells stale segments from those in use (see the module docs), asking each live shm
/// manager of this user at most once for every segment, and never again after it
/// failed to answer.
#[derive(Debug)]
pub struct StaleCheck {
    managers: Vec<ShmManager>,
    unanswering: Vec<ShmManager>,
}

impl StaleCheck {
    /// A check against the shm managers of this user that run now.
    pub fn new() -> StaleCheck {
        StaleCheck {
            managers: live_managers(),
            unanswering: Vec::new(),
        }
    }

    /// Whether `segment` is in use, held by a manager, or stale.
    pub fn verdict(&mut self, segment: &Segment) -> Verdict {
        match segment.tree() {
            // A live tree's names are its own (and its manager's) business.
            Some(tree) if tree.root_alive() => Verdict::InUse,
            // Its root is gone, so is every process of the tree.
            Some(_) => Verdict::Stale,
            None if !process_is_dead(segment.creator()) => Verdict::InUse,
            None => {
                for m in &self.managers {
                    if self.unanswering.contains(m) {
                        return Verdict::HeldByManager;
                    }
                    match m.holds(segment) {
                        Ok(false) => {}
                        Ok(true) => return Verdict::HeldByManager,
                        Err(e) => {
                            tracing::debug!(manager = m.address(), "no answer to a query: {e}");
                            self.unanswering.push(m.clone());
                            return Verdict::HeldByManager;
                        }
                    }
                }
                Verdict::Stale
            }
        }
    }

    /// The managers that did not answer a query: every name they might hold was
    /// called [`Verdict::HeldByManager`].
    pub fn unanswering(&self) -> &[ShmManager] {
        &self.unanswering
    }
}

impl Default for StaleCheck {
    fn default() -> Self {
        StaleCheck::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_and_without_a_tree_give_their_creator_and_root() {
        let old = Segment::parse("multiproc_4242_00d4e1b4f99ab117123bde5aa3313e6b").unwrap();
        assert_eq!(old.creator(), 4242);
        assert_eq!(old.random(), "00d4e1b4f99ab117123bde5aa3313e6b");
        assert!(old.tree().is_none());
        // A tree-suffixed name (found left behind by a killed tree): gc must see its
        // creator and its root, or it never reclaims it.
        let new = Segment::parse(
            "multiproc_19447_ab79c54535247b8e7efabf2712a3f8c5_19440_1042197_0a1dc4da1d19eb0e",
        )
        .unwrap();
        assert_eq!(new.creator(), 19447);
        let tree = new.tree().unwrap();
        assert_eq!((tree.root(), tree.root_start_time()), (19440, 1042197));
        assert_eq!(tree.random(), "0a1dc4da1d19eb0e");
        assert_eq!(new.to_string(), new.name());
        for bad in [
            "multiproc_x_00d4e1b4f99ab117123bde5aa3313e6b",
            "multiproc_4242_short",
            "other_4242_00d4e1b4f99ab117123bde5aa3313e6b",
            "multiproc_4242_00d4e1b4f99ab117123bde5aa3313e6bzz",
            "multiproc_4242_00D4E1B4F99AB117123BDE5AA3313E6B",
            "multiproc_4242_00d4e1b4f99ab117123bde5aa3313e6b_1_2",
            "/dev/shm/multiproc_4242_00d4e1b4f99ab117123bde5aa3313e6b",
        ] {
            let e = Segment::parse(bad).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("not a multiproc segment name")),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn only_manager_addresses_name_a_manager() {
        let m = ShmManager::at("multiproc-shm-0-42-12345-0123456789abcdef").unwrap();
        assert_eq!(m.address(), "multiproc-shm-0-42-12345-0123456789abcdef");
        for bad in ["", "@multiproc-shm-0", "other-0-42", "multiproc-shm-0 42"] {
            assert!(
                matches!(ShmManager::at(bad), Err(Error::InvalidArgument(_))),
                "{bad}"
            );
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "reads /proc")]
    fn a_name_of_a_tree_whose_root_is_gone_is_stale_and_of_a_live_one_in_use() {
        let me = std::process::id();
        let start = crate::sys::process::start_time(me).unwrap();
        let random = "ab".repeat(16);
        let live =
            Segment::parse(&format!("{PREFIX}1_{random}_{me}_{start}_0123456789abcdef")).unwrap();
        // The same pid with another start time is another process: the root is gone.
        let gone = Segment::parse(&format!(
            "{PREFIX}{me}_{random}_{me}_{}_0123456789abcdef",
            start + 1
        ))
        .unwrap();
        let untagged_live = Segment::parse(&format!("{PREFIX}{me}_{random}")).unwrap();
        // No managers to ask: the verdicts come from the names alone.
        let mut check = StaleCheck {
            managers: Vec::new(),
            unanswering: Vec::new(),
        };
        assert_eq!(check.verdict(&live), Verdict::InUse);
        assert_eq!(
            check.verdict(&gone),
            Verdict::Stale,
            "its creator runs, its root does not"
        );
        assert_eq!(check.verdict(&untagged_live), Verdict::InUse);
        assert!(check.unanswering().is_empty());
    }

    #[test]
    #[cfg_attr(miri, ignore = "starts a process")]
    fn a_manager_that_cannot_be_asked_holds_every_name_of_a_dead_creator() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let orphan = Segment::parse(&format!("{PREFIX}{dead}_{}", "cd".repeat(16))).unwrap();
        let nobody = ShmManager::at(&format!(
            "multiproc-shm-{}-1-1-{:016x}",
            crate::sys::process::current_uid(),
            u64::from(std::process::id()) << 20 | 0xdead
        ))
        .unwrap();
        assert!(matches!(nobody.holds(&orphan), Err(Error::Manager(_))));
        let mut check = StaleCheck {
            managers: vec![nobody.clone()],
            unanswering: Vec::new(),
        };
        assert_eq!(check.verdict(&orphan), Verdict::HeldByManager);
        assert_eq!(check.unanswering(), std::slice::from_ref(&nobody));
        // Not asked again, still counted as holding.
        assert_eq!(check.verdict(&orphan), Verdict::HeldByManager);
        assert_eq!(check.unanswering().len(), 1);
        let mut none = StaleCheck {
            managers: Vec::new(),
            unanswering: Vec::new(),
        };
        assert_eq!(none.verdict(&orphan), Verdict::Stale);
    }
}
