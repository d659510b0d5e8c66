//! `multiproc doctor`: checks what multiproc needs from this machine and says what to
//! change.

use std::os::fd::AsFd;

/// One finding.
struct Check {
    name: &'static str,
    ok: bool,
    detail: String,
    advice: Option<String>,
}

/// Runs every check, prints them, and returns whether all passed.
pub fn run() -> bool {
    let checks = [shm_space(), fd_limit(), memfd(), leftovers()];
    let mut healthy = true;
    for c in &checks {
        healthy &= c.ok;
        println!(
            "[{}] {:<14} {}",
            if c.ok { " ok " } else { "FAIL" },
            c.name,
            c.detail
        );
        if let Some(a) = &c.advice {
            println!("       {:<14} -> {a}", "");
        }
    }
    println!(
        "{}",
        if healthy {
            "healthy: multiproc has what it needs"
        } else {
            "problems found: see the advice above"
        }
    );
    healthy
}

fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (mut v, mut u) = (n as f64, 0);
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Below this, /dev/shm is too small for the file_system strategy with real tensors
/// (docker's default is 64 MiB).
const SHM_MIN: u64 = 1 << 30;

fn shm_space() -> Check {
    let mount = std::fs::read_to_string("/proc/mounts")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.split_whitespace().nth(1) == Some("/dev/shm"))
                .map(|l| l.split_whitespace().take(4).collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| "not mounted".into());
    match rustix::fs::statvfs("/dev/shm") {
        Ok(s) => {
            let size = s.f_blocks * s.f_frsize;
            let free = s.f_bavail * s.f_frsize;
            let ok = size >= SHM_MIN && free >= SHM_MIN / 4;
            Check {
                name: "/dev/shm",
                ok,
                detail: format!("{} free of {} ({mount})", human(free), human(size)),
                advice: (!ok).then(|| {
                    "the file_system strategy allocates here: grow it (docker: --shm-size=8g or --ipc=host; \
                     otherwise: mount -o remount,size=8G /dev/shm), or stay with file_descriptor, whose \
                     memfds are not bounded by /dev/shm"
                        .into()
                }),
            }
        }
        Err(e) => Check {
            name: "/dev/shm",
            ok: false,
            detail: format!("cannot stat /dev/shm: {e} ({mount})"),
            advice: Some(
                "mount a tmpfs on /dev/shm, or use only the file_descriptor strategy".into(),
            ),
        },
    }
}

/// Below this soft limit, a consumer holding many received tensors may run out.
const NOFILE_MIN: u64 = 4096;

fn fd_limit() -> Check {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |v| v.to_string());
    let ok = lim.current.is_none_or(|c| c >= NOFILE_MIN);
    let in_use = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    Check {
        name: "fd limit",
        ok,
        detail: format!(
            "RLIMIT_NOFILE soft {} hard {} ({in_use} in use by this command)",
            show(lim.current),
            show(lim.maximum)
        ),
        advice: (!ok).then(|| {
            format!(
                "raise it with `ulimit -n {}` (up to the hard limit), or use the file_system strategy",
                lim.maximum.map_or(65536, |m| m.min(65536))
            )
        }),
    }
}

fn memfd() -> Check {
    use rustix::fs::{MemfdFlags, SealFlags};
    let result = rustix::fs::memfd_create(
        "multiproc-doctor",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .and_then(|fd| {
        rustix::fs::ftruncate(&fd, 4096)?;
        rustix::fs::fcntl_add_seals(fd.as_fd(), SealFlags::SHRINK | SealFlags::GROW)?;
        Ok(())
    });
    match result {
        Ok(()) => Check {
            name: "memfd",
            ok: true,
            detail: "memfd_create and sealing work (file_descriptor strategy available)".into(),
            advice: None,
        },
        Err(e) => Check {
            name: "memfd",
            ok: false,
            detail: format!("memfd_create failed: {e}"),
            advice: Some("a seccomp profile may forbid memfd_create; allow it, or use the file_system strategy".into()),
        },
    }
}

fn leftovers() -> Check {
    let stale = crate::gc::stale_segments();
    let bytes: u64 = stale.iter().map(|s| s.bytes).sum();
    Check {
        name: "leftovers",
        ok: stale.is_empty(),
        detail: if stale.is_empty() {
            "no leftover multiproc segments in /dev/shm".into()
        } else {
            format!(
                "{} leftover multiproc segments whose creators are dead, {}",
                stale.len(),
                human(bytes)
            )
        },
        advice: (!stale.is_empty()).then(|| "run `multiproc gc` to remove them".into()),
    }
}
