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
//! included), the root itself as it exits when no manager is left, or `multiproc gc`.

use rustix::io::Errno;

use crate::shm::name::{PREFIX, SegmentName};

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
        let rest = addr.strip_prefix(super::ADDRESS_PREFIX)?;
        let parts: Vec<&str> = rest.split('-').collect();
        let [_uid, root, start, random] = parts.as_slice() else {
            return None;
        };
        Tree::from_parts(root, start, random)
    }

    /// The tree a segment name was made in, if it carries one.
    pub(crate) fn of_name(name: &str) -> Option<Tree> {
        let parts: Vec<&str> = name.strip_prefix(PREFIX)?.split('_').collect();
        let [_pid, _random, root, start, random] = parts.as_slice() else {
            return None;
        };
        Tree::from_parts(root, start, random)
    }

    fn from_parts(root: &str, start: &str, random: &str) -> Option<Tree> {
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
        Some(Tree {
            root: root.parse().ok()?,
            start: start.parse().ok()?,
            random: random.to_owned(),
        })
    }

    /// The suffix of the names this tree makes: `<root>_<start>_<random>`.
    pub(crate) fn tag(&self) -> String {
        format!("{}_{}_{}", self.root, self.start, self.random)
    }

    /// Whether the root still runs (same pid and start time, not a zombie).
    pub(crate) fn root_alive(&self) -> bool {
        crate::sys::process::start_time(self.root) == Some(self.start)
    }

    /// Removes every `/dev/shm` name of this tree; returns how many. Only sound once
    /// the root is gone (see the module docs).
    pub(crate) fn remove_names(&self) -> usize {
        let Ok(dir) = std::fs::read_dir("/dev/shm") else {
            return 0;
        };
        let mut removed = 0;
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if !SegmentName::is_valid(name) || Tree::of_name(name).as_ref() != Some(self) {
                continue;
            }
            match rustix::fs::unlink(format!("/dev/shm/{name}")) {
                Ok(()) => removed += 1,
                Err(Errno::NOENT) => {}
                Err(e) => tracing::warn!(
                    segment = name,
                    "cannot unlink a segment of a dead tree: {e}"
                ),
            }
        }
        removed
    }
}

/// The tree of this process (from its manager address), if the address names one.
pub(crate) fn this_tree() -> Option<Tree> {
    Tree::of_address(super::address())
}

/// Run as this process exits (registered by `init` in a process that is not one
/// multiproc started): when this process is the root of its tree and no manager of
/// the tree is left to clean up after it (it was killed), removes the tree's names
/// itself. With a live manager, nothing: the manager does it once the root is gone.
pub(crate) fn clean_up_at_root_exit() {
    let Some(addr) = super::address_if_used() else {
        return;
    };
    let Some(tree) = Tree::of_address(addr) else {
        return;
    };
    if tree.root != std::process::id() || !tree.root_alive() {
        return; // not the root (its start time would differ)
    }
    if matches!(super::client::connect_to(addr), Ok(None)) {
        tree.remove_names();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trees_round_trip_through_addresses_and_names() {
        let tree = Tree::of_address("multiproc-shm-0-42-12345-0123456789abcdef").unwrap();
        assert_eq!((tree.root, tree.start), (42, 12345));
        let name = format!("multiproc_7_{}_{}", "ab".repeat(16), tree.tag());
        assert!(SegmentName::is_valid(&name), "{name}");
        assert_eq!(Tree::of_name(&name), Some(tree));
        assert!(Tree::of_address("multiproc-shm-0-42-0123456789abcdef").is_none());
        let untagged = format!("multiproc_7_{}", "ab".repeat(16));
        assert!(SegmentName::is_valid(&untagged) && Tree::of_name(&untagged).is_none());
        for bad in [
            "_1_2_x",
            "_1_2_0123456789abcdeF",
            "_1__0123456789abcdef",
            "_1_2_3",
        ] {
            let name = format!("{untagged}{bad}");
            assert!(!SegmentName::is_valid(&name), "{name}");
        }
    }

    #[test]
    fn this_process_is_the_root_of_its_own_tree() {
        let tree = Tree::of_address(&super::super::new_address()).unwrap();
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
}
