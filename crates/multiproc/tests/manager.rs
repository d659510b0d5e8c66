//! The shm manager across processes: started on demand by re-executing this test
//! binary, cleaning up after a SIGKILLed producer, restarting after being SIGKILLed
//! itself, and a full /dev/shm reported as an error.
//!
//! Each child gets a manager address of its own, so the tests do not share managers with
//! each other or with this process.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use multiproc::{DType, Error, SharingStrategy, Tensor};

multiproc::test_init!();

// Children of these tests are this binary re-executed with `TEST_CHILD=<role>`: a hook
// that runs before `main` (after `test_init!`'s, which sends a process started as the
// manager to the manager) sends them to their role.
mod child_hook {
    #[used]
    #[unsafe(link_section = ".init_array")]
    static BEFORE_MAIN: extern "C" fn() = before_main;

    extern "C" fn before_main() {
        // A process multiproc started (the manager, a worker) is `test_init!`'s, whichever
        // hook runs first.
        if std::env::var_os("MULTIPROC_ROLE").is_some() {
            return;
        }
        if let Ok(role) = std::env::var("TEST_CHILD") {
            // The order of two `.init_array` hooks is the linker's: do `init`'s part
            // here (it is idempotent), so the child is a tree root either way.
            multiproc::init();
            std::process::exit(super::run_child(&role));
        }
    }
}

/// How long any one wait in these tests may take before the test fails.
const WATCHDOG: Duration = Duration::from_secs(20);

// ----- children -----

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn wait_for_stdin_line() -> String {
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    line.trim().to_owned()
}

/// A `file_system` tensor with a block (a name) of its own: larger than the storages
/// carved from shared arenas (64 KiB), so each one creates and registers a new name,
/// which is what talks to the manager.
fn shared_fs_tensor(value: f64) -> multiproc::Result<Tensor> {
    let t = Tensor::full(&[16 * 1024 + 1], value, DType::F32)?;
    t.share_memory_()?;
    Ok(t)
}

fn run_child(role: &str) -> i32 {
    multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
    match role {
        "fs_producer" => {
            let tensors: Vec<Tensor> = (0..4)
                .map(|i| shared_fs_tensor(i as f64).expect("share"))
                .collect();
            for t in &tensors {
                say(&format!("name {}", t.storage().shm_name().expect("a name")));
            }
            say("ready");
            wait_for_stdin_line();
            0
        }
        "manager_restart" => {
            let first = shared_fs_tensor(1.0).expect("share");
            say(&format!(
                "name {}",
                first.storage().shm_name().expect("a name")
            ));
            wait_for_stdin_line();
            match shared_fs_tensor(2.0) {
                Ok(second) => {
                    say(&format!(
                        "name {}",
                        second.storage().shm_name().expect("a name")
                    ));
                    wait_for_stdin_line();
                    // Exit holding both: the restarted manager must clean up both.
                    std::mem::forget((first, second));
                    0
                }
                Err(e) => {
                    say(&format!("error {e}"));
                    1
                }
            }
        }
        "orphan_in_flight" => {
            // The last reference of this segment is in a message nobody will receive.
            let t = shared_fs_tensor(3.0).expect("share");
            let name = t.storage().shm_name().expect("a name");
            let q = multiproc::Queue::new().expect("queue");
            q.put(t).expect("put");
            drop(q);
            say(&format!("name {name}"));
            // "alloc": restart the killed manager by allocating once more, then exit.
            if wait_for_stdin_line() == "alloc" {
                let again = shared_fs_tensor(4.0).expect("share after the kill");
                say(&format!(
                    "name {}",
                    again.storage().shm_name().expect("a name")
                ));
                wait_for_stdin_line();
            }
            0
        }
        "manager_restart_on_reuse" => {
            // A large block: dropped, it stays pooled (its name too) for the next share.
            let first = shared_fs_tensor(1.0).expect("share");
            say(&format!(
                "name {}",
                first.storage().shm_name().expect("a name")
            ));
            drop(first);
            wait_for_stdin_line();
            let again = shared_fs_tensor(2.0).expect("share after the kill");
            say(&format!(
                "name {}",
                again.storage().shm_name().expect("a name")
            ));
            wait_for_stdin_line();
            // Exit holding it: the restarted manager must clean it up.
            std::mem::forget(again);
            0
        }
        "small_shm" => small_shm_child(),
        other => {
            say(&format!("error unknown role {other}"));
            2
        }
    }
}

/// In a private mount namespace with a 16 MiB /dev/shm: sharing 32 MiB with
/// file_system is a clear error and the tensor stays usable; file_descriptor (memfd)
/// is not bounded by /dev/shm.
fn small_shm_child() -> i32 {
    // SAFETY: plain system calls on constant, NUL-terminated arguments; this process is
    // single-threaded (we run before main).
    let mounted = unsafe {
        libc::unshare(libc::CLONE_NEWNS) == 0
            && libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) == 0
            && libc::mount(
                c"tmpfs".as_ptr(),
                c"/dev/shm".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                c"size=16m,mode=1777".as_ptr().cast(),
            ) == 0
    };
    if !mounted {
        say(&format!(
            "skip cannot make a private 16 MiB /dev/shm: {}",
            std::io::Error::last_os_error()
        ));
        return 0;
    }
    let t = Tensor::ones(&[32 << 20], DType::U8).expect("alloc");
    match t.share_memory_() {
        Ok(()) => say("error sharing 32 MiB in a 16 MiB /dev/shm succeeded"),
        Err(Error::OutOfSharedMemory {
            message,
            limit_source,
            size,
            ..
        }) => say(&format!("oom {size} {limit_source} {message}")),
        Err(e) => say(&format!("error wrong error: {e:?}")),
    }
    say(&format!(
        "private {} sum {}",
        !t.is_shared(),
        t.sum().unwrap()
    ));
    let leftovers = std::fs::read_dir("/dev/shm").map_or(usize::MAX, Iterator::count);
    say(&format!("leftovers {leftovers}"));
    multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    match t.share_memory_() {
        Ok(()) => say("fd ok"),
        Err(e) => say(&format!("fd error {e}")),
    }
    0
}

// ----- the parent side -----

struct Kid {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    address: String,
}

fn fresh_address() -> String {
    let mut random = [0u8; 8];
    getrandom::fill(&mut random).unwrap();
    format!(
        "multiproc-shm-{}-{}-{:016x}",
        rustix::process::getuid().as_raw(),
        std::process::id(),
        u64::from_le_bytes(random)
    )
}

fn spawn_child(role: &str) -> Kid {
    spawn_child_at(role, Some(fresh_address()))
}

/// A child that is the root of its own tree; `None`: it picks its manager address
/// itself (then `Kid::address` is empty).
fn spawn_child_at(role: &str, address: Option<String>) -> Kid {
    let mut command = Command::new(std::env::current_exe().unwrap());
    match &address {
        Some(a) => command.env("MULTIPROC_SHM_MANAGER", a),
        None => command.env_remove("MULTIPROC_SHM_MANAGER"),
    };
    let address = address.unwrap_or_default();
    let mut child = command
        .env("TEST_CHILD", role)
        .env("MULTIPROC_SHM_MANAGER_GRACE_MS", "300")
        .env_remove("MULTIPROC_SHARING_STRATEGY")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Kid {
        stdin: child.stdin.take(),
        child,
        lines,
        address,
    }
}

impl Kid {
    fn line(&self) -> String {
        self.lines
            .recv_timeout(WATCHDOG)
            .expect("the child said nothing before the watchdog deadline")
    }

    fn tell(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn names(&self, n: usize) -> Vec<String> {
        (0..n)
            .map(|_| {
                let line = self.line();
                line.strip_prefix("name ")
                    .unwrap_or_else(|| panic!("expected a name, got {line:?}"))
                    .to_owned()
            })
            .collect()
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + WATCHDOG;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the child did not exit in time");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn shm_exists(name: &str) -> bool {
    Path::new(&format!("/dev/shm/{name}")).exists()
}

/// Waits until none of `names` is in /dev/shm; fails after `limit`.
fn assert_gone_within(names: &[String], limit: Duration) {
    let deadline = Instant::now() + limit;
    while names.iter().any(|n| shm_exists(n)) {
        assert!(
            Instant::now() < deadline,
            "still in /dev/shm after {limit:?}: {:?}",
            names.iter().filter(|n| shm_exists(n)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The live (not zombie) processes serving as the manager at `address`.
fn manager_pids(address: &str) -> Vec<i32> {
    let role = b"MULTIPROC_ROLE=shm-manager".as_slice();
    let addr = format!("MULTIPROC_SHM_MANAGER={address}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        });
        if !zombie && vars.contains(&role) && vars.contains(&addr.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

fn wait_for_manager(address: &str) -> i32 {
    let deadline = Instant::now() + WATCHDOG;
    loop {
        if let [pid] = manager_pids(address)[..] {
            return pid;
        }
        assert!(Instant::now() < deadline, "no single manager at {address}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs the tree's manager at `address` and waits until it is gone; its pid.
fn kill_manager(address: &str) -> i32 {
    let old = wait_for_manager(address);
    sigkill(old);
    let deadline = Instant::now() + WATCHDOG;
    while manager_pids(address).contains(&old) {
        assert!(
            Instant::now() < deadline,
            "the killed manager {old} did not go"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    old
}

fn sigkill(pid: i32) {
    // SAFETY: sending a signal has no memory effects in this process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

/// The manager address of the tree a segment name says it was made in.
fn address_of_tree_in(name: &str) -> String {
    let segment = multiproc::maintenance::Segment::parse(name).unwrap();
    let tree = segment
        .tree()
        .unwrap_or_else(|| panic!("{name} names no tree"));
    tree.manager().address().to_owned()
}

// ----- tests -----

/// A name whose last reference is in a message nobody received, in a tree whose manager
/// was SIGKILLed: the root removes it as it exits normally (no manager is left), or a
/// restarted manager does once the root has gone: it never stays in /dev/shm.
#[test]
fn names_only_in_flight_outlive_neither_a_killed_manager_nor_its_tree() {
    for restart in [false, true] {
        let mut kid = spawn_child_at("orphan_in_flight", None);
        let orphan = kid.names(1).remove(0);
        assert!(shm_exists(&orphan), "the in-flight reference keeps it");
        let address = address_of_tree_in(&orphan);
        let old = kill_manager(&address);
        let mut names = vec![orphan];
        if restart {
            kid.tell("alloc");
            names.extend(kid.names(1));
            let new = wait_for_manager(&address);
            assert_ne!(new, old);
        }
        kid.tell("exit");
        assert!(kid.wait().success());
        assert_gone_within(&names, Duration::from_secs(5));
    }
}

#[test]
fn a_sigkilled_file_system_producer_leaves_nothing_in_dev_shm() {
    let kid = spawn_child("fs_producer");
    let names = kid.names(4);
    assert_eq!(kid.line(), "ready");
    assert!(
        names.iter().all(|n| shm_exists(n)),
        "segments exist while the producer lives"
    );
    let manager = wait_for_manager(&kid.address);
    assert_ne!(
        manager,
        kid.child.id() as i32,
        "the manager is a process of its own"
    );
    let address = kid.address.clone();
    sigkill(kid.child.id() as i32);
    let killed = Instant::now();
    drop(kid);
    assert_gone_within(&names, Duration::from_secs(5));
    println!("cleaned up {:?} after the SIGKILL", killed.elapsed());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !manager_pids(&address).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the manager did not exit after cleaning up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_sigkilled_manager_is_restarted_and_relearns_live_names() {
    let mut kid = spawn_child("manager_restart");
    let first = kid.names(1);
    let old = kill_manager(&kid.address);
    kid.tell("go");
    let line = kid.line();
    let second = line
        .strip_prefix("name ")
        .unwrap_or_else(|| panic!("the allocation after the manager died failed: {line}"))
        .to_owned();
    let new = wait_for_manager(&kid.address);
    assert_ne!(new, old);
    kid.tell("exit");
    assert!(kid.wait().success());
    // The child exited holding both segments: the new manager unlinks both, the first
    // one included, because the child registered it again on reconnecting.
    assert_gone_within(&[first[0].clone(), second], Duration::from_secs(5));
}

#[test]
fn a_sigkilled_manager_is_restarted_when_a_named_block_is_handed_out_again() {
    // Recycled blocks make new names rare: handing a pooled named block out again must
    // also find a killed manager and start another (which learns the live names).
    let mut kid = spawn_child("manager_restart_on_reuse");
    let first = kid.names(1);
    let old = kill_manager(&kid.address);
    kid.tell("go");
    let again = kid.names(1);
    assert_eq!(
        again, first,
        "the pooled block is handed out again, no new name made"
    );
    let new = wait_for_manager(&kid.address);
    assert_ne!(new, old);
    kid.tell("exit");
    assert!(kid.wait().success());
    assert_gone_within(&first, Duration::from_secs(5));
}

#[test]
#[ignore = "needs root"]
fn a_small_dev_shm_is_a_clear_error_and_memfds_are_not_bounded_by_it() {
    let mut kid = spawn_child("small_shm");
    let line = kid.line();
    if let Some(why) = line.strip_prefix("skip ") {
        panic!("{why}: this test needs root (a private mount namespace); CI runs it as root");
    }
    let msg = line
        .strip_prefix("oom ")
        .unwrap_or_else(|| panic!("expected OutOfSharedMemory, got {line}"));
    // The size asked counts the headers the segment adds (its own and its block's).
    assert!(
        msg.starts_with(&format!("{} /dev/shm ", (32u64 << 20) + 192)),
        "{msg:?}"
    );
    for part in [
        "32.0 MiB of data plus its 192-byte header",
        "/dev/shm has",
        "of 16.0 MiB",
        "--shm-size",
        "/dev/shm/multiproc_",
    ] {
        assert!(msg.contains(part), "{msg:?} should mention {part:?}");
    }
    assert_eq!(kid.line(), format!("private true sum {}", 32 << 20));
    assert_eq!(kid.line(), "leftovers 0");
    assert_eq!(kid.line(), "fd ok");
    assert!(kid.wait().success());
}
