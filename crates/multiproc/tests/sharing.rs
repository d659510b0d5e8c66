//! Shared memory under crashes and limits: a SIGKILLed file_system producer leaves
//! nothing behind once its tree has exited, a small /dev/shm is a clear error (never a
//! SIGBUS), and a forged handle is refused.

multiproc::test_init!();

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use multiproc::{
    DType, Error, Event, SharingStrategy, SimpleQueue, StartMethod, Tensor, start_processes,
};

const DEADLINE: Duration = Duration::from_secs(120);

/// Runs one `#[ignore]`d scenario of this file as the root of a new process tree: a
/// fresh process with no inherited shm manager, so the tree's manager cleans up when
/// the tree has exited.
fn run_scenario_as_new_tree(name: &str) {
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env_remove("MULTIPROC_SHM_MANAGER")
        .env("MULTIPROC_SHM_MANAGER_GRACE_MS", "200")
        .output()
        .expect("run the scenario");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "scenario {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "scenario {name} did not run:\n{text}"
    );
}

fn put_four_and_wait(_rank: usize, (q, put): (SimpleQueue<Tensor>, Event)) {
    for i in 0..4 {
        q.put(Tensor::full(&[1 << 18], f64::from(i), DType::F32).expect("tensor"))
            .expect("put");
    }
    put.set();
    std::thread::sleep(Duration::from_secs(60)); // SIGKILLed long before
}

/// The tree of `killed_file_system_producer_leaves_nothing`: a producer puts four
/// file_system tensors and is SIGKILLed before anyone takes them.
#[test]
#[ignore = "run as its own process tree by killed_file_system_producer_leaves_nothing"]
fn scenario_kill_file_system_producer() {
    multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
    let q = SimpleQueue::new().unwrap();
    let put = Event::new().unwrap();
    let mut ctx = start_processes(
        put_four_and_wait,
        (q.clone(), put.clone()),
        1,
        StartMethod::Spawn,
    )
    .unwrap();
    assert!(
        put.wait(Some(Duration::from_secs(30))).unwrap(),
        "the producer never put"
    );
    let pid = ctx.pids()[0];
    assert!(
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let err = ctx.join(Some(Duration::from_secs(30))).unwrap_err();
    assert!(matches!(err, Error::ProcessExited { .. }), "{err}");
    assert!(err.to_string().contains("SIGKILL"), "{err}");
    // Exit without taking the tensors: the producer's four segments are left to the
    // manager (check they really are there, or the test proves nothing).
    let prefix = format!("multiproc_{pid}_");
    let left = common::our_segments()
        .iter()
        .filter(|n| n.starts_with(&prefix))
        .count();
    assert_eq!(
        left, 4,
        "the killed producer's segments are still in /dev/shm"
    );
}

#[test]
fn killed_file_system_producer_leaves_nothing() {
    common::run(DEADLINE, || {
        let before = common::our_segments();
        run_scenario_as_new_tree("scenario_kill_file_system_producer");
        // Every process of that tree has exited; its manager cleans up after its grace.
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let left: Vec<_> = common::our_segments()
                .difference(&before)
                .cloned()
                .collect();
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < until,
                "segments left 5 s after the tree exited: {left:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}

/// What the small-/dev/shm scenario saw, per strategy: `Ok(())` when sharing 32 MiB
/// worked, else the error text; plus whether the tensor stayed usable.
type Outcome = (Result<(), String>, bool);

fn share_32_mib_in_a_16_mib_dev_shm(
    _rank: usize,
    results: SimpleQueue<Vec<Outcome>>,
) -> Result<(), String> {
    use rustix::mount::{MountFlags, MountPropagationFlags, mount, mount_change};
    // SAFETY: unsharing the mount namespace affects only this (single-purpose) worker.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }
        .map_err(|e| format!("unshare(CLONE_NEWNS): {e}"))?;
    // Keep the new mount private so it never reaches the machine's namespace.
    mount_change(
        "/",
        MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
    )
    .map_err(|e| format!("make / private: {e}"))?;
    mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        MountFlags::empty(),
        c"size=16m",
    )
    .map_err(|e| format!("mount a 16 MiB tmpfs on /dev/shm: {e}"))?;
    let mut outcomes = Vec::new();
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        multiproc::set_sharing_strategy(strategy);
        let t = Tensor::full(&[8 << 20], 1.0, DType::F32).map_err(|e| e.to_string())?;
        let shared = t.share_memory_().map_err(|e| e.to_string());
        // Whatever happened, the tensor is still there and whole.
        let usable = t.add_scalar_(1.0).is_ok() && t.sum() == 2.0 * (8 << 20) as f64;
        outcomes.push((shared, usable));
    }
    results.put(outcomes).map_err(|e| e.error.to_string())
}

#[test]
fn sharing_32_mib_in_a_16_mib_dev_shm() {
    if !rustix::process::geteuid().is_root() {
        eprintln!(
            "SKIPPED sharing_32_mib_in_a_16_mib_dev_shm: mounting a small /dev/shm needs root"
        );
        return;
    }
    common::run(DEADLINE, || {
        let results = SimpleQueue::new().unwrap();
        let mut ctx = start_processes(
            share_32_mib_in_a_16_mib_dev_shm,
            results.clone(),
            1,
            StartMethod::Spawn,
        )
        .unwrap();
        assert!(ctx.join(Some(Duration::from_secs(60))).unwrap());
        let outcomes = results
            .get_timeout(Duration::from_secs(10))
            .unwrap()
            .expect("outcomes");
        // file_descriptor: memfds are not bounded by /dev/shm's size (by design).
        let (fd, fd_usable) = &outcomes[0];
        assert!(fd.is_ok(), "file_descriptor: {fd:?}");
        assert!(fd_usable);
        // file_system: a clear error at allocation, never a SIGBUS later.
        let (fs, fs_usable) = &outcomes[1];
        let msg = fs
            .as_ref()
            .expect_err("file_system in a 16 MiB /dev/shm must fail");
        assert!(msg.contains("32.0 MiB"), "names the size asked: {msg}");
        assert!(
            msg.contains("free of 16.0 MiB"),
            "names the free space: {msg}"
        );
        assert!(
            msg.contains("--shm-size"),
            "says how to grow /dev/shm: {msg}"
        );
        assert!(
            fs_usable,
            "the tensor stays usable (private) after a failed share"
        );
    });
}
