//! Distributed: the torchrun environment `spawn` gives its workers, torchelastic error
//! files, and the shared-memory collectives of `ProcessGroup` across spawned ranks
//! (values checked, a rank killed mid-collective).

multiproc::test_init!();

mod common;

use std::time::Duration;

use multiproc::dist::{Env, Launcher};
use multiproc::{Error, SimpleQueue, SpawnOptions, StartMethod};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

// ---------------------------------------------------------------------------------------
// The environment.

/// What a worker saw: its Env, and the caller's variables.
type Seen = (usize, Env, Option<String>, Option<String>);

fn report_env(rank: usize, q: SimpleQueue<Seen>) -> multiproc::Result<()> {
    let env = Env::detect()?;
    q.put((
        rank,
        env,
        std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        std::env::var("K").ok(),
    ))?;
    Ok(())
}

#[test]
fn workers_see_torchruns_contract_and_their_own_variables() {
    common::run(secs(60), || {
        for method in StartMethod::ALL {
            let q = SimpleQueue::new().unwrap();
            SpawnOptions::new()
                .start_method(method)
                .env("K", "v")
                .env_per_rank(|rank| vec![("CUDA_VISIBLE_DEVICES", (rank + 4).to_string())])
                .spawn(report_env, q.clone(), 3)
                .unwrap();
            let mut seen: Vec<Seen> = (0..3).map(|_| q.get().unwrap()).collect();
            seen.sort_by_key(|s| s.0);
            let port = seen[0].1.master_port;
            let run_id = seen[0].1.run_id.clone();
            assert!(port.is_some_and(|p| p > 0), "{method}: {seen:?}");
            assert!(
                run_id
                    .as_deref()
                    .is_some_and(|r| r.starts_with("multiproc-"))
            );
            for (rank, env, cuda, k) in seen {
                assert_eq!(env.launcher, Launcher::Multiproc, "{method}");
                assert_eq!((env.rank, env.local_rank), (rank, rank), "{method}");
                assert_eq!((env.world_size, env.local_world_size), (3, 3), "{method}");
                assert_eq!((env.node_rank, env.restart_count), (0, 0), "{method}");
                assert_eq!(env.master_addr.as_deref(), Some("127.0.0.1"), "{method}");
                assert_eq!(env.master_port, port, "{method}: one port for the group");
                assert_eq!(env.run_id, run_id, "{method}: one run id for the group");
                assert_eq!(cuda, Some((rank + 4).to_string()), "{method}");
                assert_eq!(k.as_deref(), Some("v"), "{method}");
            }
        }
    });
}

#[test]
fn a_callers_master_port_wins() {
    common::run(secs(60), || {
        let q = SimpleQueue::new().unwrap();
        SpawnOptions::new()
            .env("MASTER_PORT", "29123")
            .spawn(report_env, q.clone(), 1)
            .unwrap();
        let (_, env, _, _) = q.get().unwrap();
        assert_eq!(env.master_port, Some(29123));
    });
}

// ---------------------------------------------------------------------------------------
// torchelastic error files.

fn fail_how(rank: usize, panic: bool) -> Result<(), String> {
    if panic {
        panic!("rank {rank} panicked on purpose");
    }
    Err(format!("rank {rank} returned an error on purpose"))
}

#[test]
fn a_failed_worker_writes_torchelastics_error_file() {
    common::run(secs(60), || {
        let dir = std::env::temp_dir().join(format!("multiproc-errfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for panic in [true, false] {
            let path = dir.join(format!("error-{panic}.json"));
            let _ = std::fs::remove_file(&path);
            let err = SpawnOptions::new()
                .env("TORCHELASTIC_ERROR_FILE", path.to_str().unwrap())
                .spawn(fail_how, panic, 1)
                .unwrap_err();
            assert!(matches!(err, Error::ProcessRaised { .. }), "{err}");
            let text = std::fs::read_to_string(&path).expect("the worker wrote its error file");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let message = v["message"]["message"].as_str().unwrap();
            let want = if panic {
                "panicked on purpose"
            } else {
                "returned an error on purpose"
            };
            assert!(message.contains(want), "{message}");
            let stack = v["message"]["extraInfo"]["py_callstack"].as_str().unwrap();
            if panic {
                assert!(
                    stack.contains("fail_how"),
                    "the backtrace names the worker: {stack}"
                );
            }
            let ts: u64 = v["message"]["extraInfo"]["timestamp"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(ts > 1_600_000_000);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    });
}
