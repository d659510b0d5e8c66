//! How much memory this process may still commit: the tightest cgroup memory limit
//! (v2 `memory.max − memory.current` along the cgroup's ancestry, or v1
//! `memory.limit_in_bytes − memory.usage_in_bytes`), else the system's `MemAvailable`.
//!
//! # Safety
//!
//! No unsafe code (it reads cgroup and /proc files).
//!
//! Shared segments are charged like any page (a memfd's and a `/dev/shm` file's pages
//! both count against the cgroup of the process that first touches them), so a segment
//! larger than this headroom would end in the OOM killer's SIGKILL, not an error. The
//! figure is read afresh for each large allocation (a few small file reads): it changes
//! with every other process of the cgroup.

use std::path::{Path, PathBuf};

/// Room left under the tightest memory limit, and which limit that is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Headroom {
    /// Bytes that may still be committed.
    pub bytes: u64,
    /// `"cgroup memory.max (/sys/fs/cgroup/…)"`, `"MemAvailable"`.
    pub source: String,
}

/// Values at or above this are "no limit" (cgroup v1 writes `PAGE_COUNTER_MAX` pages).
const UNLIMITED: u64 = 1 << 62;

/// The tightest limit that applies to this process, or `None` when none can be read.
pub(crate) fn headroom() -> Option<Headroom> {
    cgroup_headroom().or_else(mem_available)
}

/// The cgroup limit alone (for reporting), `None` when no cgroup limit applies.
pub(crate) fn cgroup_headroom() -> Option<Headroom> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut best: Option<Headroom> = None;
    let mut consider = |h: Headroom| {
        if best.as_ref().is_none_or(|b| h.bytes < b.bytes) {
            best = Some(h);
        }
    };
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.is_empty() {
            // v2: every ancestor's limit applies.
            let mut dir = PathBuf::from("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            loop {
                if let Some(h) = limited(&dir, "memory.max", "memory.current") {
                    consider(h);
                }
                if dir == Path::new("/sys/fs/cgroup") || !dir.pop() {
                    break;
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            // v1: the cgroup's own directory, or the mount root in a namespaced container.
            let root = Path::new("/sys/fs/cgroup/memory");
            for dir in [root.join(path.trim_start_matches('/')), root.to_path_buf()] {
                if let Some(h) = limited(&dir, "memory.limit_in_bytes", "memory.usage_in_bytes") {
                    consider(h);
                    break;
                }
            }
        }
    }
    best
}

fn limited(dir: &Path, max_file: &str, current_file: &str) -> Option<Headroom> {
    let max = read_u64(&dir.join(max_file))?; // "max" (no limit) does not parse
    if max >= UNLIMITED {
        return None;
    }
    let current = read_u64(&dir.join(current_file)).unwrap_or(0);
    Some(Headroom {
        bytes: max.saturating_sub(current),
        source: format!("cgroup {max_file} ({})", dir.join(max_file).display()),
    })
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn mem_available() -> Option<Headroom> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(Headroom {
        bytes: kib.saturating_mul(1024),
        source: "MemAvailable (/proc/meminfo)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn some_limit_is_known_and_nonzero() {
        let h = headroom().expect("MemAvailable is always there on Linux");
        assert!(h.bytes > 0, "{h:?}");
        assert!(h.source.contains("cgroup") || h.source.contains("MemAvailable"));
    }
}
