//! Who can reach what: segment names are unguessable and private; the shm manager and
//! its clients refuse a peer of another uid; a worker's job comes only through the
//! socket its parent handed it.
//!
//! The uid tests need root (to `setuid` a forked child to `nobody`, 65534): they are
//! `#[ignore = "needs root"]`, and `.ci/run` (which runs as root) runs them with
//! `--ignored`. The forks happen inside single-purpose worker processes, which
//! are single-threaded, so a forked child may run ordinary code.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;

use std::process::{Command, Stdio};
use std::time::Duration;

use multiproc::{DType, Error, Event, SharingStrategy, SimpleQueue, StartMethod, Tensor};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(20);
/// `nobody`.
const OTHER_UID: u32 = 65534;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

#[test]
fn segment_names_carry_128_random_bits_and_files_are_private() {
    common::run(DEADLINE, || {
        multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
        // Larger than the storages carved from shared arenas (64 KiB): a name each.
        let tensors: Vec<Tensor> = (0..200)
            .map(|_| {
                let t = Tensor::zeros(&[(64 << 10) + 1], DType::U8).unwrap();
                t.share_memory_().unwrap();
                t
            })
            .collect();
        let mut randoms = BTreeSet::new();
        let mut seen_per_digit = vec![BTreeSet::new(); 32];
        let me = rustix::process::geteuid().as_raw();
        for t in &tensors {
            let name = t.storage().shm_name().unwrap();
            let segment = multiproc::maintenance::Segment::parse(&name).unwrap();
            assert_eq!(segment.creator(), std::process::id(), "{name}");
            assert!(segment.tree().is_some(), "{name} carries its tree");
            let random = segment.random();
            assert_eq!(random.len(), 32, "128 bits are 32 hex digits: {name}");
            assert!(random.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            for (i, c) in random.chars().enumerate() {
                seen_per_digit[i].insert(c);
            }
            assert!(
                randoms.insert(random.to_owned()),
                "a name came twice: {name}"
            );
            let st = rustix::fs::lstat(segment.path()).unwrap();
            assert_eq!(
                rustix::fs::FileType::from_raw_mode(st.st_mode),
                rustix::fs::FileType::RegularFile
            );
            assert_eq!(st.st_mode & 0o7777, 0o600, "{name} is 0600");
            assert_eq!(st.st_uid, me, "{name} belongs to us");
        }
        // Every digit position varies (200 uniform draws leave fewer than 8 of 16
        // values in one position with probability far below 1e-20).
        for (i, seen) in seen_per_digit.iter().enumerate() {
            assert!(
                seen.len() >= 8,
                "digit {i} of the names barely varies: {seen:?}"
            );
        }
        drop(tensors);
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}

// ----- the shm manager and another uid -----

/// Becomes `nobody` (in a forked child). Clears supplementary groups first.
fn become_other_user() -> bool {
    // SAFETY: plain system calls on the calling (only) thread of a forked child; no
    // memory is shared with anything else.
    unsafe {
        libc::setgroups(0, std::ptr::null()) == 0
            && libc::setgid(OTHER_UID) == 0
            && libc::setuid(OTHER_UID) == 0
    }
}

/// How a connection attempt to the manager went, as an exit code of the forked child.
const CLOSED_BY_PEER: i32 = 0;
const STAYED_OPEN: i32 = 1;
const CONNECT_REFUSED: i32 = 10;
const SEND_REFUSED: i32 = 11;
const NO_SETUID: i32 = 20;

/// In a forked child: (optionally as `nobody`) connects to the manager at `addr`,
/// registers `name`, and reports whether the manager hung up on it.
fn probe_manager(addr: &str, name: &str, as_other_user: bool) -> i32 {
    let request = [b"R".as_slice(), name.as_bytes()].concat();
    // SAFETY: this worker process is single-threaded (a spawned worker runs its job on
    // its only thread), so the child may run ordinary code; it leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = (|| {
            if as_other_user && !become_other_user() {
                return NO_SETUID;
            }
            let Ok(sock) = rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None)
            else {
                return CONNECT_REFUSED;
            };
            let sa = SocketAddrUnix::new_abstract_name(addr.as_bytes()).unwrap();
            if rustix::net::connect(&sock, &sa).is_err() {
                return CONNECT_REFUSED;
            }
            if rustix::net::send(&sock, &request, rustix::net::SendFlags::NOSIGNAL).is_err() {
                return SEND_REFUSED;
            }
            let mut fds = [rustix::event::PollFd::new(
                &sock,
                rustix::event::PollFlags::IN | rustix::event::PollFlags::RDHUP,
            )];
            let two_s = rustix::event::Timespec {
                tv_sec: 2,
                tv_nsec: 0,
            };
            match rustix::event::poll(&mut fds, Some(&two_s)) {
                Ok(0) => STAYED_OPEN,
                _ => {
                    let mut b = [0u8; 16];
                    match rustix::net::recv(&sock, &mut b[..], rustix::net::RecvFlags::DONTWAIT) {
                        Ok((_, 0)) | Err(_) => CLOSED_BY_PEER,
                        Ok(_) => STAYED_OPEN,
                    }
                }
            }
        })();
        // SAFETY: leaving the forked child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid);
    assert!(libc::WIFEXITED(status), "the probe died: {status:#x}");
    libc::WEXITSTATUS(status)
}

/// What the manager did to a client of our uid and to one of another uid.
fn probe_as_both_users(
    _rank: usize,
    (name, results): (String, SimpleQueue<(i32, i32)>),
) -> Result<(), String> {
    let addr = std::env::var("MULTIPROC_SHM_MANAGER").map_err(|e| e.to_string())?;
    let other = probe_manager(&addr, &name, true);
    let same = probe_manager(&addr, &name, false);
    results.put((other, same)).map_err(|e| e.error.to_string())
}

/// The manager checks `SO_PEERCRED` on every connection: a process switched to another
/// uid may connect (abstract sockets have no permissions) but is hung up on at once,
/// and what it sent is never applied. A client of our uid stays connected.
#[test]
#[ignore = "needs root"]
fn the_manager_refuses_a_client_of_another_uid() {
    assert!(
        is_root(),
        "the_manager_refuses_a_client_of_another_uid needs root (setuid needs root); CI runs it as root"
    );
    common::run(DEADLINE, || {
        multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
        let t = Tensor::full(&[16], 1.0, DType::F32).unwrap();
        t.share_memory_().unwrap(); // the tree's manager runs
        let name = t.storage().shm_name().unwrap();
        let results = SimpleQueue::new().unwrap();
        let mut ctx = multiproc::start_processes(
            probe_as_both_users,
            (name.clone(), results.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        let (other, same) = results.get_timeout(WAIT).expect("the probes ran");
        ctx.join_timeout(WAIT).unwrap();
        assert_ne!(other, NO_SETUID, "could not become uid {OTHER_UID}");
        assert!(
            [CLOSED_BY_PEER, CONNECT_REFUSED, SEND_REFUSED].contains(&other),
            "the manager kept a client of uid {OTHER_UID} connected (outcome {other})"
        );
        assert_eq!(same, STAYED_OPEN, "a client of our own uid is served");
        // The manager still serves us.
        let again = Tensor::full(&[16], 2.0, DType::F32).unwrap();
        again.share_memory_().unwrap();
        assert_eq!(t.sum().unwrap() + again.sum().unwrap(), 48.0);
        drop((t, again));
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}

/// Forks a child that, as `nobody`, listens at `addr` (posing as a manager) until the
/// worker is told to stop.
fn squat_manager_address(
    _rank: usize,
    (addr, listening, stop): (String, Event, Event),
) -> Result<(), String> {
    let (ready_r, ready_w) = rustix::pipe::pipe().map_err(|e| e.to_string())?;
    let (hold_r, hold_w) = rustix::pipe::pipe().map_err(|e| e.to_string())?;
    // SAFETY: as in `probe_manager`: a single-threaded worker; the child leaves with
    // `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err("fork failed".into());
    }
    if pid == 0 {
        drop((ready_r, hold_w));
        let ok = become_other_user()
            && rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None)
                .ok()
                .and_then(|s| {
                    let sa = SocketAddrUnix::new_abstract_name(addr.as_bytes()).ok()?;
                    rustix::net::bind(&s, &sa).ok()?;
                    rustix::net::listen(&s, 16).ok()?;
                    Some(s)
                })
                .map(|listener| {
                    let _ = rustix::io::write(&ready_w, b"y");
                    // Hold the address until the worker closes its end (or dies).
                    let _ = rustix::io::read(&hold_r, &mut [0u8; 1]);
                    drop(listener);
                })
                .is_some();
        // SAFETY: leaving the forked child.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    drop((ready_w, hold_r));
    let mut b = [0u8; 1];
    let n = rustix::io::read(&ready_r, &mut b).map_err(|e| e.to_string())?;
    if n != 1 {
        return Err("the squatter could not listen as another user".into());
    }
    listening.set();
    let stopped = stop
        .wait_timeout(Duration::from_secs(60))
        .map_err(|e| e.to_string());
    drop(hold_w);
    let mut status = 0;
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    stopped.map(|_| ())
}

/// The tree of `a_client_refuses_a_manager_of_another_uid`: its manager address (from
/// the environment) is squatted by another user; a file_system allocation must fail
/// with an error that says so, not register with the squatter.
#[test]
#[ignore = "run as its own process tree by a_client_refuses_a_manager_of_another_uid"]
fn scenario_squatted_manager_address() {
    multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
    let t = Tensor::full(&[16], 1.0, DType::F32).unwrap();
    match t.share_memory_() {
        Err(Error::Manager(m)) => {
            assert!(m.contains(&format!("uid {OTHER_UID}")), "{m}");
            assert!(!t.is_shared(), "the tensor stays private");
            assert_eq!(t.sum().unwrap(), 16.0);
            println!("REFUSED: {m}");
        }
        other => panic!("a squatted manager address was used: {other:?}"),
    }
}

/// Clients check `SO_PEERCRED` of the manager too: a process of another uid that binds
/// the tree's manager address first is refused (an abstract name has no permissions).
#[test]
#[ignore = "needs root"]
fn a_client_refuses_a_manager_of_another_uid() {
    assert!(
        is_root(),
        "a_client_refuses_a_manager_of_another_uid needs root (setuid needs root); CI runs it as root"
    );
    common::run(DEADLINE, || {
        let addr = format!(
            "multiproc-shm-{}-{}-squatted{:x}",
            rustix::process::getuid().as_raw(),
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        let (listening, stop) = (Event::new().unwrap(), Event::new().unwrap());
        let mut ctx = multiproc::start_processes(
            squat_manager_address,
            (addr.clone(), listening.clone(), stop.clone()),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        listening
            .wait_timeout(WAIT)
            .expect("the squatter never listened");
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "scenario_squatted_manager_address",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("MULTIPROC_SHM_MANAGER", &addr)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        stop.set();
        ctx.join_timeout(WAIT).expect("the squatter worker failed");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && text.contains("REFUSED"), "{text}");
    });
}

// ----- a worker's job -----

fn wait_for(_rank: usize, go: Event) -> Result<(), String> {
    go.wait_timeout(Duration::from_secs(60))
        .map_err(|e| e.to_string())
        .map(|_| ())
}

/// The inodes of the unix sockets `pid` holds.
fn socket_inodes(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| {
            t.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// The job socket is one end of a socketpair the parent made and the worker inherited:
/// it has no name, in the filesystem or the abstract namespace, so no other process can
/// connect to it. (A process that can put an fd into a worker's table is the one that
/// executes it — its parent.) The job names a function of the executable by its code
/// offset, so this socket is the trust boundary; `multiproc::init` refuses to run a job
/// from anything else.
#[test]
fn a_worker_takes_its_job_only_from_the_socket_its_parent_handed_it() {
    common::run(DEADLINE, || {
        for method in [StartMethod::Spawn, StartMethod::Fork] {
            let go = Event::new().unwrap();
            let mut ctx = multiproc::start_processes(wait_for, go.clone(), 1, method).unwrap();
            let pid = ctx.pids()[0];
            let inodes = socket_inodes(pid);
            assert!(!inodes.is_empty(), "the worker holds its job socket");
            let table = std::fs::read_to_string("/proc/net/unix").unwrap();
            for ino in &inodes {
                for line in table.lines().skip(1) {
                    let cols: Vec<&str> = line.split_whitespace().collect();
                    if cols.get(6).and_then(|c| c.parse::<u64>().ok()) == Some(*ino) {
                        assert_eq!(
                            cols.get(7),
                            None,
                            "worker ({method}) socket {ino} has a name anyone could connect to: {line}"
                        );
                    }
                }
            }
            go.set();
            ctx.join_timeout(WAIT).unwrap();
        }
    });
}

/// Runs this test binary as if multiproc had started it as a worker, with `fd` (if
/// any) as stdin; returns (exit code, stderr).
fn run_as_worker(fd_var: Option<&str>, stdin: Stdio) -> (Option<i32>, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env("MULTIPROC_ROLE", "worker")
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match fd_var {
        Some(v) => cmd.env("MULTIPROC_WORKER_FD", v),
        None => cmd.env_remove("MULTIPROC_WORKER_FD"),
    };
    let out = cmd.output().unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("running"),
        "the test harness ran: the worker role was ignored"
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_process_without_its_parents_socket_runs_no_job() {
    common::run(DEADLINE, || {
        let (code, err) = run_as_worker(None, Stdio::null());
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("not started by multiproc"), "{err}");
        let (code, err) = run_as_worker(Some("77"), Stdio::null());
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("names no open file descriptor"), "{err}");
        let (code, err) = run_as_worker(Some("0"), Stdio::null());
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("is not a socket"), "{err}");
        // A socket that carries no job, or garbage: refused, nothing runs.
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::send(&ours, b"MPW\x01 not a job", rustix::net::SendFlags::empty()).unwrap();
        drop(ours);
        let (code, err) = run_as_worker(Some("0"), Stdio::from(theirs));
        assert_eq!(code, Some(2), "{err}");
        assert!(
            err.contains("cannot read its job: invalid message"),
            "{err}"
        );
    });
}
