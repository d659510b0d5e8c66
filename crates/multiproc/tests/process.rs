//! One worker at a time and who it is: `Process` (lifecycle, daemons, a worker started
//! from a short-lived thread), the fork server (several threads at once, replaced when
//! dead), `init` refusing a worker role without its socket, `current_process`,
//! `active_children`, `cpu_count`, errors that cross a queue (user and OS errors).
//! Groups of workers (`spawn`, `start_processes`) are tests/spawn.rs.

multiproc::test_init!();

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use multiproc::{Error, Event, Process, SimpleQueue, SpawnOptions, StartMethod, start_processes};

use common::secs;
use common::workers::{noop, process_is_gone, put_rank, raise_in, sleep_then_ok};

const WAIT: Duration = Duration::from_secs(30);

#[test]
fn single_process_lifecycle() {
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            // Joining an unstarted process, or starting one twice, cannot be written:
            // `ProcessBuilder::start` consumes the builder and returns the `Process`.
            let mut p = Process::builder(sleep_then_ok, 0, 30_000u64)
                .start_method(method)
                .start()
                .unwrap();
            assert!(p.is_alive());
            assert!(
                p.join_timeout(Duration::from_millis(20))
                    .unwrap_err()
                    .is_timeout()
            );
            assert_eq!(p.exit_status(), None);
            p.terminate().unwrap();
            let status = p.join_timeout(secs(20)).expect("exited");
            assert_eq!(status.signal_name().as_deref(), Some("SIGTERM"), "{method}");
            assert!(!p.is_alive());
            assert_eq!(p.exit_status(), Some(status));
            let err = p.error().expect("a terminated process failed");
            assert!(matches!(err, Error::ProcessExited { .. }), "{err:?}");
            p.kill().unwrap(); // a no-op once exited

            let mut ok = Process::builder(noop, 3, ())
                .start_method(method)
                .world_size(4)
                .start()
                .unwrap();
            assert!(ok.join().unwrap().success());
            assert!(ok.error().is_none());

            let mut bad = Process::builder(raise_in, 2, 2usize)
                .start_method(method)
                .start()
                .unwrap();
            assert_eq!(bad.join().unwrap().code(), Some(1));
            let err = bad.error().unwrap();
            assert!(
                err.to_string()
                    .contains("legitimate exception from process 2"),
                "{err}"
            );
        }
    });
}

#[test]
fn dropping_a_daemon_process_kills_it() {
    common::run(secs(120), || {
        let p = Process::builder(sleep_then_ok, 0, 30_000u64)
            .daemon(true)
            .start()
            .unwrap();
        let pid = p.pid();
        let start = Instant::now();
        drop(p);
        assert!(start.elapsed() < secs(5));
        assert!(process_is_gone(pid));
    });
}

#[test]
fn workers_started_from_a_short_lived_thread_survive_it() {
    // The parent-death signal is tied to the forking thread: multiproc forks from its
    // own long-lived thread, so the worker outlives the thread that asked for it.
    common::run(secs(120), || {
        for method in StartMethod::ALL {
            let ctx = std::thread::spawn(move || start_processes(sleep_then_ok, 300u64, 1, method))
                .join()
                .unwrap();
            let mut ctx = ctx.unwrap();
            ctx.join_timeout(secs(20))
                .expect("{method}: the worker was killed");
        }
    });
}

#[test]
fn the_fork_server_serves_several_threads_at_once() {
    common::run(secs(120), || {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    let q = SimpleQueue::new().unwrap();
                    SpawnOptions::new()
                        .start_method(StartMethod::Forkserver)
                        .spawn(put_rank, q.clone(), 3)
                        .unwrap();
                    let got: BTreeSet<usize> = (0..3).map(|_| q.get().unwrap()).collect();
                    assert_eq!(got, BTreeSet::from([0, 1, 2]));
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    });
}

#[test]
fn a_dead_fork_server_is_replaced() {
    common::run(secs(120), || {
        let me = std::process::id() as i32;
        let server = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
            .find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                    stat.contains("(multiproc-fsrv)")
                        && stat
                            .rsplit(')')
                            .next()
                            .and_then(|rest| rest.split_whitespace().nth(1))
                            == Some(&me.to_string())
                })
            })
            .expect("the harness started the fork server");
        // Kill it and wait until it is dead (a zombie: we are its parent).
        // SAFETY: pidfd_open has no memory-safety preconditions.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, server, 0) } as i32;
        assert!(pidfd >= 0);
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(server, libc::SIGKILL) }, 0);
        let mut poll = libc::pollfd {
            fd: pidfd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; the pidfd is closed right after.
        assert_eq!(unsafe { libc::poll(&mut poll, 1, 10_000) }, 1);
        // SAFETY: we opened `pidfd` above and nothing else uses it.
        unsafe { libc::close(pidfd) };
        SpawnOptions::new()
            .start_method(StartMethod::Forkserver)
            .spawn(noop, (), 2)
            .unwrap();
        assert!(process_is_gone(server as u32), "the dead server was reaped");
    });
}

#[test]
fn init_refuses_a_worker_role_without_its_socket() {
    common::run(secs(120), || {
        let exe = std::env::current_exe().unwrap();
        for (role, fd, expected) in [
            ("worker", None, "MULTIPROC_WORKER_FD"),
            ("worker", Some("1"), "is not a socket"),
            ("worker", Some("999"), "names no open file descriptor"),
            ("no-such-role", None, "unknown MULTIPROC_ROLE"),
        ] {
            let mut cmd = std::process::Command::new(&exe);
            cmd.env("MULTIPROC_ROLE", role)
                .stdout(std::process::Stdio::null());
            if let Some(fd) = fd {
                cmd.env("MULTIPROC_WORKER_FD", fd);
            }
            let out = cmd.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{role} {fd:?}: {stderr}");
            assert!(stderr.contains(expected), "{role} {fd:?}: {stderr}");
        }
    });
}

// ----- identity: current_process, Process::name, active_children, cpu_count -----

fn report_identity(_rank: usize, out: SimpleQueue<(Option<usize>, u32, String)>) {
    let me = multiproc::current_process();
    out.put((me.rank, me.pid, me.name)).expect("put");
}

#[test]
fn a_worker_knows_its_rank_pid_and_name() {
    common::run(secs(90), || {
        let out = SimpleQueue::new().unwrap();
        for method in StartMethod::ALL {
            let mut ctx = start_processes(report_identity, out.clone(), 2, method).unwrap();
            let pids = ctx.pids();
            let mut got = vec![
                out.get_timeout(WAIT).unwrap(),
                out.get_timeout(WAIT).unwrap(),
            ];
            got.sort();
            assert_eq!(
                got,
                vec![
                    (Some(0), pids[0], "Process-0".to_string()),
                    (Some(1), pids[1], "Process-1".to_string()),
                ],
                "{method}"
            );
            ctx.join_timeout(WAIT).unwrap();

            let mut p = Process::builder(report_identity, 7, out.clone())
                .name("loader")
                .start_method(method)
                .start()
                .unwrap();
            assert_eq!(p.name(), "loader");
            let (rank, pid, name) = out.get_timeout(WAIT).unwrap();
            assert_eq!((rank, pid, name.as_str()), (Some(7), p.pid(), "loader"));
            assert!(p.join_timeout(WAIT).unwrap().success());
        }
        let me = multiproc::current_process();
        assert_eq!((me.rank, me.name.as_str()), (None, "MainProcess"));
    });
}

fn wait_for_go(_rank: usize, go: Event) -> multiproc::Result<()> {
    go.wait_timeout(WAIT)
}

#[test]
fn active_children_lists_running_workers_only() {
    common::run(secs(90), || {
        assert!(multiproc::active_children().is_empty());
        let go = Event::new().unwrap();
        let mut p = Process::builder(wait_for_go, 3, go.clone())
            .name("sleeper")
            .start()
            .unwrap();
        let kids = multiproc::active_children();
        assert_eq!(kids.len(), 1, "{kids:?}");
        assert_eq!(
            (kids[0].rank, kids[0].pid, kids[0].name.as_str()),
            (3, p.pid(), "sleeper")
        );
        go.set();
        assert!(p.join_timeout(WAIT).unwrap().success());
        assert!(
            multiproc::active_children().is_empty(),
            "a joined worker is not active"
        );
        let n = multiproc::cpu_count();
        assert!(n >= 1);
        assert_eq!(n, std::thread::available_parallelism().unwrap().get());
    });
}

// ----- errors that cross processes -----

#[derive(Debug)]
struct ModelError(u32);

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "layer {} has no weights", self.0)
    }
}

impl std::error::Error for ModelError {}

fn load(layer: u32) -> multiproc::Result<()> {
    Err(Error::user(ModelError(layer)))
}

fn send_errors(_rank: usize, out: SimpleQueue<Error>) -> multiproc::Result<()> {
    let io = std::fs::File::open("/nonexistent/multiproc").unwrap_err();
    out.put(Error::from(io)).map_err(Error::from)?;
    out.put(load(3).unwrap_err()).map_err(Error::from)?;
    load(4)
}

#[test]
fn user_and_os_errors_cross_a_queue_and_a_worker_returns_its_own() {
    common::run(secs(90), || {
        let out = SimpleQueue::new().unwrap();
        let mut ctx = start_processes(send_errors, out.clone(), 1, StartMethod::Spawn).unwrap();
        let os = out.get_timeout(WAIT).unwrap();
        assert_eq!(os.errno(), Some(libc::ENOENT));
        let source = std::error::Error::source(&os).expect("an Os error has a source");
        assert!(source.to_string().contains("No such file"), "{source}");
        let Error::Os { source, .. } = &os else {
            panic!("{os:?}")
        };
        assert_eq!(source.io_error().kind(), std::io::ErrorKind::NotFound);
        let user = out.get_timeout(WAIT).unwrap();
        assert!(matches!(user, Error::User(_)), "{user:?}");
        assert_eq!(user.to_string(), "layer 3 has no weights");
        let err = ctx.join_timeout(WAIT).unwrap_err();
        assert!(
            matches!(&err, Error::ProcessRaised { message, .. } if message.contains("layer 4 has no weights")),
            "{err}"
        );
        // In this process the user's error keeps its type.
        let here = load(5).unwrap_err();
        let Error::User(inner) = &here else { panic!() };
        assert_eq!(
            inner.get_ref().downcast_ref::<ModelError>().map(|e| e.0),
            Some(5)
        );
    });
}
