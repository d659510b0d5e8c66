//! The shm manager: recovery after it is killed.

multiproc::test_init!();

mod common;

use std::time::{Duration, Instant};

use multiproc::{DType, SharingStrategy, Tensor};

const DEADLINE: Duration = Duration::from_secs(60);

/// The pids of shm managers serving this process's tree (their address names our pid).
fn our_managers() -> Vec<u32> {
    let tag = format!("-{}-", std::process::id());
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let is_manager = vars.iter().any(|v| *v == b"MULTIPROC_ROLE=shm-manager");
        let ours = vars.iter().any(|v| {
            v.starts_with(b"MULTIPROC_SHM_MANAGER=") && String::from_utf8_lossy(v).contains(&tag)
        });
        if is_manager && ours && common::alive(pid) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn a_killed_manager_is_replaced_by_the_next_allocation() {
    common::run(DEADLINE, || {
        multiproc::set_sharing_strategy(SharingStrategy::FileSystem);
        let first = Tensor::full(&[1024], 1.0, DType::F32).unwrap();
        first.share_memory_().unwrap();
        let managers = our_managers();
        assert_eq!(
            managers.len(),
            1,
            "one manager serves this tree: {managers:?}"
        );
        let killed = managers[0];
        assert!(
            std::process::Command::new("kill")
                .args(["-KILL", &killed.to_string()])
                .status()
                .unwrap()
                .success()
        );
        let until = Instant::now() + Duration::from_secs(10);
        while common::alive(killed) {
            assert!(Instant::now() < until, "manager {killed} survived SIGKILL");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The next allocation notices and starts a new manager.
        let second = Tensor::full(&[1024], 2.0, DType::F32).unwrap();
        second.share_memory_().unwrap();
        let now = our_managers();
        assert_eq!(now.len(), 1, "a new manager serves this tree: {now:?}");
        assert_ne!(now[0], killed);
        assert_eq!(first.sum() + second.sum(), 3.0 * 1024.0);
        let names = [
            first.storage().shm_name().unwrap(),
            second.storage().shm_name().unwrap(),
        ];
        drop((first, second));
        for n in names {
            assert!(
                !common::our_segments().contains(&n),
                "{n} was unlinked by its last user"
            );
        }
        multiproc::set_sharing_strategy(SharingStrategy::FileDescriptor);
    });
}
