//! `multiproc gc`: removes named segments whose creator is dead.
//!
//! A segment is `/dev/shm/multiproc_<pid>_<random>[_<root pid>_<root start>_<tree>]`.
//! One that names its process tree is stale once the tree's root has exited (no
//! process of the tree can hold it any more: workers die with their parents). One
//! without a tree is stale when the process that created it is gone and no live shm
//! manager of this user holds it — `gc` asks each one (`Q<name>`, answered `Y` or
//! `N`); a manager that cannot be asked counts as holding it. A
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
    /// Live managers that did not answer a query (an older multiproc): every name
    /// they might hold was left alone.
    pub unanswering: Vec<String>,
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
        unanswering: Vec::new(),
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
        match tree_root(&name) {
            // A live tree's names are its own (and its manager's) business.
            Some((root, start)) if start_time(root) == Some(start) => continue,
            // Its root is gone, so is every process of the tree.
            Some(_) => {}
            None => {
                if creator_alive(creator) {
                    continue;
                }
                let mut held = false;
                for m in &managers {
                    // One that did not answer is not asked again: it counts as holding.
                    if out.unanswering.contains(m) {
                        held = true;
                        break;
                    }
                    match manager_holds(m, &name) {
                        Some(false) => {}
                        Some(true) => {
                            held = true;
                            break;
                        }
                        None => {
                            out.unanswering.push(m.clone());
                            held = true;
                            break;
                        }
                    }
                }
                if held {
                    out.left_to_managers += 1;
                    continue;
                }
            }
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

/// The tree's root (pid, start time) a segment name carries, if any.
fn tree_root(name: &str) -> Option<(u32, u64)> {
    let parts: Vec<&str> = name.strip_prefix("multiproc_")?.split('_').collect();
    let [_, _, root, start, random] = parts.as_slice() else {
        return None;
    };
    (random.len() == 16 && random.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    Some((root.parse().ok()?, start.parse().ok()?))
}

/// The start time of process `pid` (`/proc/<pid>/stat` field 22), unless it is gone or
/// a zombie.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Asks the manager at `address` whether it holds `name`: `None` when it gave no clear
/// answer in time (then gc must assume it does: it never removes what a live manager
/// may still own).
fn manager_holds(address: &str, name: &str) -> Option<bool> {
    use rustix::net::{
        AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
    };
    let ask = || -> Option<bool> {
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .ok()?;
        let addr = SocketAddrUnix::new_abstract_name(address.as_bytes()).ok()?;
        rustix::net::connect(&sock, &addr).ok()?;
        let me = rustix::process::getuid();
        (rustix::net::sockopt::socket_peercred(&sock).ok()?.uid == me).then_some(())?;
        rustix::net::sockopt::set_socket_timeout(
            &sock,
            rustix::net::sockopt::Timeout::Recv,
            Some(std::time::Duration::from_millis(500)),
        )
        .ok()?;
        let mut request = b"Q".to_vec();
        request.extend_from_slice(name.as_bytes());
        rustix::net::send(&sock, &request, SendFlags::NOSIGNAL).ok()?;
        let mut answer = [0u8; 1];
        let (n, _) = rustix::net::recv(&sock, &mut answer, RecvFlags::empty()).ok()?;
        (n == 1 && matches!(answer[0], b'Y' | b'N')).then_some(answer[0] == b'Y')
    };
    ask()
}

/// The creator pid encoded in one of our segment names.
fn creator_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("multiproc_")?;
    let (pid, rest) = rest.split_once('_')?;
    // `<pid>_<32 hex>`, then the tree's suffix (`_<root pid>_<root start>_<16 hex>`) in
    // names made since segments carry their tree.
    let random = rest.split('_').next()?;
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

/// The addresses of the live shm managers of this user (`MULTIPROC_ROLE=shm-manager`
/// and `MULTIPROC_SHM_MANAGER=<address>` in their environment). A manager of another
/// user cannot remove our files, so it does not count.
fn live_managers() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = rustix::process::geteuid().as_raw();
    dir.flatten()
        .filter(|e| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(e.path()).is_ok_and(|m| m.uid() == me)
                && e.file_name()
                    .to_str()
                    .and_then(|p| p.parse().ok())
                    .is_some_and(creator_alive)
        })
        .filter_map(|e| {
            let env = std::fs::read(e.path().join("environ")).ok()?;
            let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
            if !vars.contains(&b"MULTIPROC_ROLE=shm-manager".as_slice()) {
                return None;
            }
            vars.iter().find_map(|v| {
                v.strip_prefix(b"MULTIPROC_SHM_MANAGER=")
                    .and_then(|a| std::str::from_utf8(a).ok())
                    .map(str::to_owned)
            })
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_and_without_a_tree_suffix_give_their_creator_and_root() {
        let old = "multiproc_4242_00d4e1b4f99ab117123bde5aa3313e6b";
        let new = "multiproc_19447_ab79c54535247b8e7efabf2712a3f8c5_19440_1042197_0a1dc4da1d19eb0e";
        assert_eq!(creator_pid(old), Some(4242));
        assert_eq!(tree_root(old), None);
        // A tree-suffixed name (found left behind by a killed tree): gc must see its
        // creator, or it never reclaims it.
        assert_eq!(creator_pid(new), Some(19447));
        assert_eq!(tree_root(new), Some((19440, 1042197)));
        for bad in [
            "multiproc_x_00d4e1b4f99ab117123bde5aa3313e6b",
            "multiproc_4242_short",
            "other_4242_00d4e1b4f99ab117123bde5aa3313e6b",
            "multiproc_4242_00d4e1b4f99ab117123bde5aa3313e6bzz",
        ] {
            assert_eq!(creator_pid(bad), None, "{bad}");
        }
    }
}
