//! `multiproc doctor`: checks what multiproc needs from this machine and says what to
//! change.

use std::io::Read;
use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One finding.
struct Check {
    name: &'static str,
    ok: bool,
    detail: String,
    advice: Option<String>,
}

/// Runs every check, prints them, and returns whether all passed.
pub fn run() -> bool {
    let checks = [
        shm_space(),
        memory_limit(),
        fd_limit(),
        memfd(),
        manager(),
        leftovers(),
    ];
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

/// Below this much room under the memory limit, sharing real tensors will fail soon.
const MEMORY_MIN: u64 = 1 << 30;

/// The memory cgroup limit (v2 `memory.max` along the ancestry, or v1
/// `memory.limit_in_bytes`) and `MemAvailable`: multiproc refuses a shared tensor
/// larger than the room left under the tighter of the two.
fn memory_limit() -> Check {
    fn read(path: &std::path::Path) -> Option<u64> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }
    let mut cgroup: Option<(u64, u64, String)> = None;
    let mut consider = |dir: &std::path::Path, max: &str, cur: &str| {
        if let Some(limit) = read(&dir.join(max)).filter(|&m| m < 1 << 62) {
            let used = read(&dir.join(cur)).unwrap_or(0);
            if cgroup
                .as_ref()
                .is_none_or(|c| limit - used.min(limit) < c.0 - c.1.min(c.0))
            {
                cgroup = Some((limit, used, dir.join(max).display().to_string()));
            }
        }
    };
    for line in std::fs::read_to_string("/proc/self/cgroup")
        .unwrap_or_default()
        .lines()
    {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(ctl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if ctl.is_empty() {
            let mut dir =
                std::path::PathBuf::from("/sys/fs/cgroup").join(path.trim_start_matches('/'));
            loop {
                consider(&dir, "memory.max", "memory.current");
                if dir == std::path::Path::new("/sys/fs/cgroup") || !dir.pop() {
                    break;
                }
            }
        } else if ctl.split(',').any(|c| c == "memory") {
            let root = std::path::Path::new("/sys/fs/cgroup/memory");
            consider(
                &root.join(path.trim_start_matches('/')),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            );
            consider(root, "memory.limit_in_bytes", "memory.usage_in_bytes");
        }
    }
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    let room = match (&cgroup, available) {
        (Some((limit, used, _)), Some(a)) => (limit - (*used).min(*limit)).min(a),
        (Some((limit, used, _)), None) => limit - (*used).min(*limit),
        (None, Some(a)) => a,
        (None, None) => u64::MAX,
    };
    let ok = room >= MEMORY_MIN;
    let cgroup_text = match &cgroup {
        Some((limit, used, file)) => format!(
            "cgroup limit {} ({} used, {file})",
            human(*limit),
            human(*used)
        ),
        None => "no cgroup memory limit".into(),
    };
    Check {
        name: "memory",
        ok,
        detail: format!(
            "{cgroup_text}; MemAvailable {}",
            available.map_or("unknown".into(), human)
        ),
        advice: (!ok).then(|| {
            "shared tensors larger than the room left are refused (OutOfSharedMemory): raise the \
             container's memory limit (docker --memory, systemd MemoryMax=) or free memory"
                .into()
        }),
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

/// How long a manager started by `doctor` waits after its client (doctor) has gone.
const THROWAWAY_GRACE_MS: &str = "100";

/// Whether an shm manager (which the file_system strategy needs) can start here:
/// starts one for a throwaway address, the way the library does (this program run
/// again as `multiproc shm-manager`), and asks it a query (which checks that it is this
/// user's). The manager exits by itself 0.1 s after doctor disconnects.
fn manager() -> Check {
    let advice = |why: &str| {
        Some(format!(
            "{why}; the file_system strategy needs the manager: it runs this program again with \
             MULTIPROC_ROLE=shm-manager (main() must call multiproc::init() first) and listens on \
             an abstract unix socket (a seccomp profile or sandbox may forbid them); the default \
             file_descriptor strategy needs no manager"
        ))
    };
    let fail = |detail: String, why: &str| Check {
        name: "shm manager",
        ok: false,
        detail,
        advice: advice(why),
    };
    let uid = rustix::process::geteuid();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let addr = format!(
        "multiproc-shm-{}-{}-doctor{:x}",
        uid.as_raw(),
        std::process::id(),
        nanos
    );
    let line = match start_manager(&addr) {
        Ok(line) => line,
        Err(e) => return fail(format!("cannot start one: {e}"), "starting it failed"),
    };
    if let Some(why) = line.strip_prefix("error: ") {
        return fail(format!("it did not start: {why}"), "starting it failed");
    }
    if !line.starts_with("ready") && !line.starts_with("in-use") {
        return fail(
            format!("it answered {line:?} instead of `ready @{addr}`"),
            "starting it failed",
        );
    }
    let answered = multiproc::maintenance::ShmManager::at(&addr).and_then(|m| m.answers());
    match answered {
        Ok(()) => Check {
            name: "shm manager",
            ok: true,
            detail: format!("started one at @{addr} and it answered a query (it exits by itself)"),
            advice: None,
        },
        Err(e) => fail(
            format!("started one at @{addr} but it does not answer: {e}"),
            "asking it failed (another user may hold the address)",
        ),
    }
}

/// Runs `multiproc shm-manager` for `addr`; returns the status line it printed.
fn start_manager(addr: &str) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut child = Command::new(exe)
        .arg("shm-manager")
        .env("MULTIPROC_SHM_MANAGER", addr)
        .env("MULTIPROC_SHM_MANAGER_GRACE_MS", THROWAWAY_GRACE_MS)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    // It detaches the daemon and exits after one line; never wait on it unbounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("no answer within 10 s".into());
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    let line = out.lines().next().unwrap_or_default().to_owned();
    if line.is_empty() {
        return Err(format!("it exited ({status}) without a status line"));
    }
    Ok(line)
}

fn leftovers() -> Check {
    let stale = crate::gc::scan().stale;
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
