//! Names of named segments: `multiproc_<pid>_<32 hex digits>_<tree>` in `/dev/shm`,
//! where `<tree>` (`<root pid>_<root start time>_<16 hex digits>`, see
//! `tree`) says which process tree made it; names without it (made by a tree
//! whose manager address has no tree) are still valid.
//!
//! Invariant: a [`SegmentName`] always matches that pattern, so it is a single path
//! component (no `/`, no `..`) and can only ever name one of our own segments; names that
//! arrive from other processes are parsed, never trusted. The 128 random bits come from
//! `getrandom`, so names are unguessable and never reused.
//!
//! Reading a name's parts, listing the names in `/dev/shm` and removing one are here
//! too; `crate::maintenance` is their public face (for `multiproc gc`, `doctor` and the
//! tests).

use std::fmt;

use super::tree::{Tree, this_tree};
use crate::error::{Error, Result};
use crate::sys;

/// The prefix of every segment we name.
pub(crate) const PREFIX: &str = "multiproc_";
const RANDOM_HEX: usize = 32;

/// A valid segment name (without the leading `/` or `/dev/shm/`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SegmentName(String);

impl SegmentName {
    /// A fresh name for a segment created by this process.
    pub(crate) fn generate() -> Result<SegmentName> {
        let mut random = [0u8; RANDOM_HEX / 2];
        getrandom::fill(&mut random).map_err(|e| {
            Error::os(
                "getrandom for a segment name",
                std::io::Error::other(e.to_string()),
            )
        })?;
        let mut name = format!("{PREFIX}{}_", std::process::id());
        for b in random {
            name.push_str(&format!("{b:02x}"));
        }
        if let Some(tree) = this_tree() {
            name.push('_');
            name.push_str(&tree.tag());
        }
        Ok(SegmentName(name))
    }

    /// Parses a name that came from elsewhere.
    pub(crate) fn parse(name: &str) -> Result<SegmentName> {
        if Self::is_valid(name) {
            Ok(SegmentName(name.to_owned()))
        } else {
            Err(Error::InvalidMessage(format!(
                "{name:?} is not a multiproc segment name (expected {PREFIX}<pid>_<32 hex digits>)"
            )))
        }
    }

    /// Whether `name` matches `multiproc_<pid>_<32 lowercase hex digits>`.
    pub(crate) fn is_valid(name: &str) -> bool {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            return false;
        };
        // `<pid>_<random>`, or `<pid>_<random>_<root>_<start>_<tree random>` (see
        // `tree_of_name`); checked without allocating, since every received segment
        // name is.
        let mut parts = rest.split('_');
        let (Some(pid), Some(random)) = (parts.next(), parts.next()) else {
            return false;
        };
        let tree_ok = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (None, ..) => true,
            (Some(root), Some(start), Some(tree_random), None) => {
                Tree::parts_are_valid(root, start, tree_random)
            }
            _ => false,
        };
        tree_ok
            && !pid.is_empty()
            && pid.len() <= 10
            && pid.bytes().all(|b| b.is_ascii_digit())
            && random.len() == RANDOM_HEX
            && random
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }

    /// The name as a string.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// The pid of the process that made the name.
    pub(crate) fn creator(&self) -> u32 {
        // `is_valid` checked: at most 10 digits; one above u32::MAX names no process.
        self.parts().0.parse().unwrap_or(0)
    }

    /// The 32 hex digits of the name's random part.
    pub(crate) fn random(&self) -> &str {
        self.parts().1
    }

    /// The tree the name was made in, if it carries one.
    pub(crate) fn tree(&self) -> Option<Tree> {
        tree_of_name(&self.0)
    }

    /// `<pid>` and `<random>` of a valid name.
    fn parts(&self) -> (&str, &str) {
        let mut parts = self.0.strip_prefix(PREFIX).unwrap_or_default().split('_');
        (
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default(),
        )
    }
}

impl fmt::Display for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `/dev/shm/<name>`.
pub(crate) fn shm_path(name: &SegmentName) -> String {
    format!("/dev/shm/{}", name.0)
}

/// The tree a segment name was made in, if it carries one.
pub(crate) fn tree_of_name(name: &str) -> Option<Tree> {
    let parts: Vec<&str> = name.strip_prefix(PREFIX)?.split('_').collect();
    let [_pid, _random, root, start, random] = parts.as_slice() else {
        return None;
    };
    Tree::from_parts(root, start, random)
}

/// Every segment name in `/dev/shm` (of any process, tree or user), in no particular
/// order; other files there are skipped. Empty when `/dev/shm` cannot be read.
pub(crate) fn names_in_dev_shm() -> impl Iterator<Item = SegmentName> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| SegmentName::is_valid(name))
        .map(SegmentName)
}

/// Removes the name `/dev/shm/<name>`: `Ok(false)` when it was gone already (someone
/// else removed it first).
pub(crate) fn remove(name: &SegmentName) -> Result<bool> {
    sys::fs::unlink_if_present(shm_path(name))
        .map_err(|e| Error::os(format!("unlink of {}", shm_path(name)), e))
}

/// Removes every `/dev/shm` name of `tree`; returns how many. Only sound once the
/// tree's root is gone (see `tree`).
pub(crate) fn remove_names_of(tree: &Tree) -> usize {
    let mut removed = 0;
    for name in names_in_dev_shm().filter(|n| n.tree().as_ref() == Some(tree)) {
        match remove(&name) {
            Ok(true) => removed += 1,
            Ok(false) => {}
            Err(e) => tracing::warn!(
                segment = name.as_str(),
                "cannot unlink a segment of a dead tree: {e}"
            ),
        }
    }
    removed
}

/// The names in `/dev/shm` that process `pid` of this process's tree made.
pub(crate) fn names_made_by(pid: u32) -> Vec<SegmentName> {
    let tree = this_tree();
    names_in_dev_shm()
        .filter(|name| name.creator() == pid && name.tree() == tree)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "a name's tree comes from getuid and /proc")]
    fn generated_names_parse_and_are_unique() {
        let a = SegmentName::generate().unwrap();
        let b = SegmentName::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(SegmentName::parse(a.as_str()).unwrap(), a);
        assert!(
            a.as_str()
                .starts_with(&format!("multiproc_{}_", std::process::id()))
        );
        assert!(shm_path(&a).starts_with("/dev/shm/multiproc_"));
        let tree = tree_of_name(a.as_str()).expect("a name carries its tree");
        assert_eq!(
            tree.root,
            std::process::id(),
            "this process is its tree's root"
        );
    }

    #[test]
    fn hostile_names_are_refused() {
        for bad in [
            "",
            "multiproc_",
            "multiproc_1_",
            "multiproc_1_0123456789abcdef0123456789abcde",
            "multiproc_1_0123456789abcdef0123456789abcdeF",
            "multiproc_1_0123456789abcdef0123456789abcdef0",
            "multiproc_x_0123456789abcdef0123456789abcdef",
            "multiproc_1_../../etc/passwd_89abcdef0123456",
            "../multiproc_1_0123456789abcdef0123456789abcdef",
            "torch_1_0123456789abcdef0123456789abcdef",
        ] {
            assert!(SegmentName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(SegmentName::parse("multiproc_42_0123456789abcdef0123456789abcdef").is_ok());
    }

    #[test]
    fn trees_round_trip_through_addresses_and_names() {
        let tree = Tree::of_address("multiproc-shm-0-42-12345-0123456789abcdef").unwrap();
        assert_eq!((tree.root, tree.start), (42, 12345));
        let name = format!("multiproc_7_{}_{}", "ab".repeat(16), tree.tag());
        assert!(SegmentName::is_valid(&name), "{name}");
        assert_eq!(tree_of_name(&name), Some(tree));
        assert!(Tree::of_address("multiproc-shm-0-42-0123456789abcdef").is_none());
        let untagged = format!("multiproc_7_{}", "ab".repeat(16));
        assert!(SegmentName::is_valid(&untagged) && tree_of_name(&untagged).is_none());
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
}
