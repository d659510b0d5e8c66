//! Which process tree a manager address and a segment name belong to, so that the
//! knowledge of which names a tree made survives the manager.
//!
//! A tree is named by its root process — pid and start time (clock ticks since boot,
//! `/proc/<pid>/stat` field 22), so a reused pid is never taken for the root — and the
//! random part of its manager address. The root writes all three into the address
//! (`multiproc-shm-<uid>-<root pid>-<start time>-<random>`), and every segment a
//! process of the tree creates carries them at the end of its name
//! (`multiproc_<pid>_<random>_<root pid>_<start time>_<address random>`).
//!
//! Invariant: once the root has exited, no process of the tree can hold a segment of
//! the tree — every worker dies with its parent (parent-death signal), and the shm
//! manager holds none — so every name carrying the tree's tag can be removed by
//! whoever sees the root gone: the tree's manager at its cleanup (a restarted one
//! included), the root itself as it exits when no manager is left
//! (`registry::clean_up_at_root_exit`), or `multiproc gc`. Reading a tree out of a
//! segment name and removing a tree's names are `name`'s.
//!
//! This module also owns the manager address itself: chosen once per process (or
//! inherited from `MULTIPROC_SHM_MANAGER`), so that names and the registry client
//! (`registry`) agree on one tree.

use std::sync::OnceLock;

/// The environment variable that holds the manager's address.
pub(crate) const ADDRESS_ENV: &str = "MULTIPROC_SHM_MANAGER";
const ADDRESS_PREFIX: &str = "multiproc-shm-";

/// Whether `a` can be a manager address (our prefix, fits an abstract socket name,
/// printable).
pub(crate) fn is_valid_address(a: &str) -> bool {
    a.starts_with(ADDRESS_PREFIX)
        && a.len() < 100
        && a.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The manager address of this process tree: inherited from `MULTIPROC_SHM_MANAGER`,
/// or chosen now (`multiproc-shm-<uid>-<pid>-<start time>-<random>`). Choosing it starts nothing.
pub(crate) fn address() -> &'static str {
    ADDRESS.get_or_init(|| {
        if let Ok(a) = std::env::var(ADDRESS_ENV) {
            if is_valid_address(&a) {
                return a;
            }
            tracing::warn!("ignoring {ADDRESS_ENV}={a:?}: not a multiproc shm manager address");
        }
        new_address()
    })
}

static ADDRESS: OnceLock<String> = OnceLock::new();

/// The address, if this process has used one.
pub(crate) fn address_if_used() -> Option<&'static str> {
    ADDRESS.get().map(String::as_str)
}

pub(crate) fn new_address() -> String {
    let mut random = [0u8; 8];
    let random = match getrandom::fill(&mut random) {
        Ok(()) => u64::from_le_bytes(random),
        // The address need not be secret (the manager checks the peer's uid); it only
        // has to differ between trees.
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    };
    // The root's start time makes the tree's name survive pid reuse (see the module docs).
    let pid = std::process::id();
    // (Miri, whose isolation forbids reading /proc, runs the codec tests with 0.)
    let start = if cfg!(miri) {
        0
    } else {
        crate::sys::process::start_time(pid).unwrap_or(0)
    };
    format!(
        "{ADDRESS_PREFIX}{}-{pid}-{start}-{random:016x}",
        crate::sys::process::current_uid(),
    )
}

/// A process tree, as its manager address names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tree {
    /// The root's pid.
    pub root: u32,
    /// The root's start time, in clock ticks since boot.
    pub start: u64,
    /// The random part of the manager address (16 hex digits).
    pub random: String,
}

impl Tree {
    /// The tree of a manager address, if it has the current form.
    pub(crate) fn of_address(addr: &str) -> Option<Tree> {
        let rest = addr.strip_prefix(ADDRESS_PREFIX)?;
        let parts: Vec<&str> = rest.split('-').collect();
        let [_uid, root, start, random] = parts.as_slice() else {
            return None;
        };
        Tree::from_parts(root, start, random)
    }

    pub(crate) fn from_parts(root: &str, start: &str, random: &str) -> Option<Tree> {
        let (root, start) = Tree::parse_parts(root, start, random)?;
        Some(Tree {
            root,
            start,
            random: random.to_owned(),
        })
    }

    /// Whether [`from_parts`](Self::from_parts) would accept these parts, without
    /// building the tree (no allocation: every received segment name is checked).
    pub(crate) fn parts_are_valid(root: &str, start: &str, random: &str) -> bool {
        Tree::parse_parts(root, start, random).is_some()
    }

    fn parse_parts(root: &str, start: &str, random: &str) -> Option<(u32, u64)> {
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(root)
            || !digits(start)
            || random.len() != 16
            || !random
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        Some((root.parse().ok()?, start.parse().ok()?))
    }

    /// The address of this tree's manager, as this user's (a manager serves its own
    /// user only).
    pub(crate) fn address(&self) -> String {
        format!(
            "{ADDRESS_PREFIX}{}-{}-{}-{}",
            crate::sys::process::current_uid(),
            self.root,
            self.start,
            self.random
        )
    }

    /// The suffix of the names this tree makes: `<root>_<start>_<random>`.
    pub(crate) fn tag(&self) -> String {
        format!("{}_{}_{}", self.root, self.start, self.random)
    }

    /// Whether the root still runs (same pid and start time, not a zombie).
    pub(crate) fn root_alive(&self) -> bool {
        crate::sys::process::start_time(self.root) == Some(self.start)
    }
}

/// The tree of this process (from its manager address), if the address names one.
pub(crate) fn this_tree() -> Option<Tree> {
    Tree::of_address(address())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_the_root_of_its_own_tree() {
        let tree = Tree::of_address(&new_address()).unwrap();
        assert_eq!(tree.root, std::process::id());
        assert!(tree.root_alive());
        let gone = Tree {
            start: tree.start + 1,
            ..tree
        };
        assert!(
            !gone.root_alive(),
            "a pid with another start time is another process"
        );
    }

    #[test]
    fn a_tree_gives_back_the_address_it_was_read_from() {
        let address = new_address();
        assert_eq!(Tree::of_address(&address).unwrap().address(), address);
    }
}
