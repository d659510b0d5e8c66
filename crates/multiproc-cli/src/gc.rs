//! `multiproc gc`: removes named segments whose creator is dead.
//!
//! A segment is `/dev/shm/multiproc_<pid>_<random>`. It is stale when the process that
//! created it is gone and no live shm manager holds it; then nobody will unlink it. A
//! process that opened it still keeps its memory mapped after the name is removed, so
//! removing a name is safe even if some process still uses the segment. Several `gc`
//! runs at once are safe: each removal is one `unlink`, and a name another run removed
//! first is simply skipped.

use std::path::PathBuf;

/// A segment that `gc` would remove.
pub struct Stale {
    /// Its path.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// The pid of the process that created it.
    pub creator: u32,
}

/// Our segments in /dev/shm whose creator has ended.
pub fn stale_segments() -> Vec<Stale> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(creator) = creator_pid(&name) else {
            continue;
        };
        if creator_alive(creator) || held_by_live_manager(&name) {
            continue;
        }
        let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
        out.push(Stale {
            path: entry.path(),
            bytes,
            creator,
        });
    }
    out
}

/// The creator pid encoded in one of our segment names.
fn creator_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("multiproc_")?;
    let (pid, random) = rest.split_once('_')?;
    (random.len() >= 32 && random.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    pid.parse().ok()
}

fn creator_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].trim_start().chars().next());
            !matches!(state, Some('Z') | Some('X'))
        }
        Err(_) => false,
    }
}

/// Whether a live shm manager may still unlink this name itself. Managers keep their
/// registered names; a segment whose creator died is the manager's to clean once its
/// clients are gone, so leave it to it while one runs.
fn held_by_live_manager(_name: &str) -> bool {
    // A manager runs as `MULTIPROC_ROLE=shm-manager`; any live one may hold the name.
    live_managers() > 0
}

fn live_managers() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter(|e| {
            std::fs::read(e.path().join("environ"))
                .map(|env| {
                    env.split(|&b| b == 0)
                        .any(|v| v == b"MULTIPROC_ROLE=shm-manager")
                })
                .unwrap_or(false)
        })
        .count()
}

/// Removes (or with `dry_run`, lists) stale segments; prints what it did and returns
/// the number of bytes reclaimed.
pub fn run(dry_run: bool) -> u64 {
    let stale = stale_segments();
    let mut reclaimed = 0;
    for s in &stale {
        if dry_run {
            println!(
                "would remove {} ({} bytes, creator pid {} is dead)",
                s.path.display(),
                s.bytes,
                s.creator
            );
            reclaimed += s.bytes;
            continue;
        }
        match std::fs::remove_file(&s.path) {
            Ok(()) => {
                println!("removed {} ({} bytes)", s.path.display(), s.bytes);
                reclaimed += s.bytes;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("cannot remove {}: {e}", s.path.display()),
        }
    }
    println!(
        "{} {} segment(s), {} bytes",
        if dry_run {
            "would reclaim"
        } else {
            "reclaimed"
        },
        stale.len(),
        reclaimed
    );
    reclaimed
}
