//! `multiproc gc`: removes named segments whose creator is dead.
//!
//! A segment is `/dev/shm/multiproc_<pid>_<random>`. It is stale when the process that
//! created it is gone and no live shm manager holds it; then nobody will unlink it. A
//! process that opened it still keeps its memory mapped after the name is removed, so
//! removing a name is safe even if some process still uses the segment. Several `gc`
//! runs at once are safe: each removal is one `unlink`, so each segment is removed by
//! exactly one of them and counted once; a name another run removed first is skipped.

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

/// What a scan of /dev/shm found.
pub struct Scan {
    /// Segments nobody will remove: their creator is dead and no live manager of this
    /// user could still remove them.
    pub stale: Vec<Stale>,
    /// Segments whose creator is dead but which a live shm manager of this user may
    /// still hold (and will remove when its tree has exited); gc leaves them alone.
    pub left_to_managers: usize,
}

/// Our segments in /dev/shm whose creator has ended.
pub fn stale_segments() -> Vec<Stale> {
    scan().stale
}

/// Scans /dev/shm for our segments whose creator has ended.
pub fn scan() -> Scan {
    let mut out = Scan {
        stale: Vec::new(),
        left_to_managers: 0,
    };
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return out;
    };
    let managers = live_managers();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(creator) = creator_pid(&name) else {
            continue;
        };
        if creator_alive(creator) {
            continue;
        }
        // A manager keeps the names its tree registered; a segment whose creator died
        // is that manager's to clean once its clients are gone, and which manager holds
        // which name cannot be seen from outside: leave them all to a live one.
        if managers > 0 {
            out.left_to_managers += 1;
            continue;
        }
        let bytes = entry.metadata().map(|m| m.len()).unwrap_or(0);
        out.stale.push(Stale {
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

/// Live shm managers of this user (`MULTIPROC_ROLE=shm-manager` in their
/// environment). A manager of another user cannot remove our files, so it does not
/// count.
fn live_managers() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let me = rustix::process::geteuid().as_raw();
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
        .filter(|e| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(e.path()).is_ok_and(|m| m.uid() == me)
        })
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|p| p.parse().ok())
                .is_some_and(creator_alive)
        })
        .count()
}

/// Removes (or with `dry_run`, lists) stale segments; prints what it did and returns
/// the number of bytes reclaimed.
pub fn run(dry_run: bool) -> u64 {
    let Scan {
        stale,
        left_to_managers,
    } = scan();
    let mut reclaimed = 0;
    let mut count = 0;
    for s in &stale {
        if dry_run {
            println!(
                "would remove {} ({} bytes, creator pid {} is dead)",
                s.path.display(),
                s.bytes,
                s.creator
            );
            reclaimed += s.bytes;
            count += 1;
            continue;
        }
        match std::fs::remove_file(&s.path) {
            Ok(()) => {
                println!("removed {} ({} bytes)", s.path.display(), s.bytes);
                reclaimed += s.bytes;
                count += 1;
            }
            // Another gc (or the segment's manager) removed it first.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("cannot remove {}: {e}", s.path.display()),
        }
    }
    if left_to_managers > 0 {
        println!(
            "left alone {left_to_managers} segment(s) of dead processes: a live shm manager of \
             this user may still remove them when its process tree exits; run gc again after that"
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
