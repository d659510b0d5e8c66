//! `multiproc gc`: removes named segments whose creator is dead.
//!
//! Which segments are stale is `multiproc::maintenance`'s to say (a tree whose root
//! has exited; or, for a name without a tree, a dead creator that no live shm manager
//! of this user holds, each manager asked); this module prints what it finds and
//! removes. A process that opened a segment still keeps its memory mapped after the
//! name is removed, so removing a name is safe even if some process still uses the
//! segment. Several `gc` runs at once are safe: each removal is one `unlink`, so each
//! segment is removed by exactly one of them and counted once; a name another run
//! removed first is skipped.

use multiproc::maintenance::{self, Segment, StaleCheck, Verdict};

/// A segment that `gc` would remove.
pub struct Stale {
    /// The segment.
    pub segment: Segment,
    /// Its size in bytes (0 when it could not be read).
    pub bytes: u64,
}

/// What a scan of /dev/shm found.
pub struct Scan {
    /// Segments nobody will remove: their creator is dead and no live manager of this
    /// user could still remove them.
    pub stale: Vec<Stale>,
    /// Segments whose creator is dead but which a live shm manager of this user may
    /// still hold (and will remove when its tree has exited); gc leaves them alone.
    pub left_to_managers: usize,
    /// Addresses of live managers that did not answer a query (an older multiproc):
    /// every name they might hold was left alone.
    pub unanswering: Vec<String>,
}

/// Scans /dev/shm for our segments whose creator has ended.
pub fn scan() -> Scan {
    let mut check = StaleCheck::new();
    let mut stale = Vec::new();
    let mut left_to_managers = 0;
    for segment in maintenance::segments() {
        match check.verdict(&segment) {
            Verdict::InUse => {}
            Verdict::HeldByManager => left_to_managers += 1,
            Verdict::Stale => stale.push(Stale {
                bytes: segment.size().unwrap_or(0),
                segment,
            }),
        }
    }
    Scan {
        stale,
        left_to_managers,
        unanswering: check
            .unanswering()
            .iter()
            .map(|m| m.address().to_owned())
            .collect(),
    }
}

/// Removes (or with `dry_run`, lists) stale segments; prints what it did and returns
/// the number of bytes reclaimed.
pub fn run(dry_run: bool) -> u64 {
    let Scan {
        stale,
        left_to_managers,
        unanswering,
    } = scan();
    for m in &unanswering {
        println!(
            "could not ask the shm manager at @{m} which names it holds (it does not answer \
             queries: an older multiproc?); left alone every name it might hold"
        );
    }
    let mut reclaimed = 0;
    let mut count = 0;
    for s in &stale {
        let path = s.segment.path();
        if dry_run {
            println!(
                "would remove {} ({} bytes, creator pid {} is dead)",
                path.display(),
                s.bytes,
                s.segment.creator()
            );
            reclaimed += s.bytes;
            count += 1;
            continue;
        }
        match s.segment.remove() {
            Ok(true) => {
                println!("removed {} ({} bytes)", path.display(), s.bytes);
                reclaimed += s.bytes;
                count += 1;
            }
            // Another gc (or the segment's manager) removed it first.
            Ok(false) => {}
            Err(e) => eprintln!("cannot remove {}: {e}", path.display()),
        }
    }
    if left_to_managers > 0 {
        println!(
            "left alone {left_to_managers} segment(s) of dead processes: a live shm manager of \
             this user holds them and removes them when its process tree exits"
        );
    }
    println!(
        "{} {count} segment(s), {reclaimed} bytes",
        if dry_run {
            "would reclaim"
        } else {
            "reclaimed"
        },
    );
    reclaimed
}
