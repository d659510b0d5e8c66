//! `multiproc::data` worker kinds: thread workers under the same API as processes —
//! the same batches, the same failure report, restart and resume.

multiproc::test_init!();

mod common;

use common::data::{Fault, misbehave};
use common::secs;
use multiproc::data::{DataLoader, Dataset, WorkerKind, worker_info};
use multiproc::{Error, Event};
use serde::{Deserialize, Serialize};

/// Sample `i` is `(i, the id of the worker that loaded it)`; sample `fail_at` fails
/// (once, when `once` is given: the first attempt sets it).
#[derive(Clone, Serialize, Deserialize)]
struct Faulty {
    n: usize,
    fault: Option<(usize, Fault)>,
    once: Option<Event>,
}

impl Dataset for Faulty {
    type Item = (i64, i64);

    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, i: usize) -> multiproc::Result<(i64, i64)> {
        misbehave(self.fault, self.once.as_ref(), i)?;
        let id = worker_info().map_or(-1, |w| w.id as i64);
        Ok((i as i64, id))
    }
}

fn loader(data: Faulty, kind: WorkerKind, restart: bool) -> DataLoader<Faulty> {
    DataLoader::builder(data)
        .batch_size(3)
        .shuffle(8)
        .num_workers(2)
        .workers(kind)
        .restart_workers(restart)
        .build()
        .unwrap()
}

/// The epoch's batches (sample indices), or the first error; and the workers that
/// loaded them.
fn epoch(l: &mut DataLoader<Faulty>) -> (Result<Vec<Vec<i64>>, Error>, Vec<i64>) {
    let mut batches = Vec::new();
    let mut ids = Vec::new();
    for b in l.iter() {
        match b {
            Ok((i, w)) => {
                batches.push(i.to_vec::<i64>().unwrap());
                ids.extend(w.to_vec::<i64>().unwrap());
            }
            Err(e) => return (Err(e), ids),
        }
    }
    (Ok(batches), ids)
}

fn clean(n: usize) -> Faulty {
    Faulty {
        n,
        fault: None,
        once: None,
    }
}

#[test]
fn thread_workers_load_what_process_workers_load() {
    common::run(secs(60), || {
        let (by_process, _) = epoch(&mut loader(clean(20), WorkerKind::Process, false));
        let mut threads = loader(clean(20), WorkerKind::Thread, false);
        let (by_thread, ids) = epoch(&mut threads);
        assert_eq!(by_thread.unwrap(), by_process.unwrap());
        assert!(
            ids.contains(&0) && ids.contains(&1),
            "both workers loaded: {ids:?}"
        );
        // Their ids are threads of this process.
        let mut first = threads.iter();
        let _ = first.next();
        for tid in first.worker_pids() {
            assert!(
                std::path::Path::new(&format!("/proc/self/task/{tid}")).exists(),
                "worker tid {tid} is a thread of this process"
            );
        }
    });
}

#[test]
fn both_kinds_report_an_error_and_a_panic_alike() {
    common::run(secs(60), || {
        for how in [Fault::Err, Fault::Panic] {
            let mut reports = Vec::new();
            for kind in [WorkerKind::Process, WorkerKind::Thread] {
                let data = Faulty {
                    fault: Some((7, how)),
                    ..clean(20)
                };
                let (got, _) = epoch(&mut loader(data, kind, false));
                let e = got.unwrap_err();
                let Error::LoaderFailed {
                    worker,
                    batch,
                    indices,
                    message,
                    ..
                } = &e
                else {
                    panic!("{kind:?}: not a LoaderFailed: {e}");
                };
                assert!(worker.is_some(), "{message}");
                assert!(
                    indices.contains(&7),
                    "{kind:?}: the batch of sample 7: {message}"
                );
                let why = match how {
                    Fault::Err => "sample 7 is corrupt",
                    _ => "decoder crashed on sample 7",
                };
                assert!(message.contains(why), "{kind:?}: {message}");
                let named = match kind {
                    WorkerKind::Process => "(pid ",
                    _ => "(thread ",
                };
                assert!(message.contains(named), "{kind:?}: {message}");
                if let Fault::Panic = how {
                    // Both name the place of the panic.
                    assert!(message.contains("common/data.rs:"), "{kind:?}: {message}");
                }
                reports.push((*batch, indices.clone()));
            }
            assert_eq!(reports[0], reports[1], "{how:?}: the same batch named");
        }
    });
}

#[test]
fn a_panicking_thread_worker_is_restarted_and_the_batch_retried() {
    common::run(secs(60), || {
        let (want, _) = epoch(&mut loader(clean(20), WorkerKind::Thread, false));
        let panicked = Event::new().unwrap();
        let data = Faulty {
            fault: Some((7, Fault::Panic)),
            once: Some(panicked.clone()),
            ..clean(20)
        };
        let mut l = loader(data, WorkerKind::Thread, true);
        let (got, _) = epoch(&mut l);
        assert!(
            panicked.is_set(),
            "sample 7 never panicked: nothing was retried"
        );
        assert_eq!(got.unwrap(), want.unwrap());
    });
}

#[test]
fn thread_workers_resume_mid_epoch_exactly() {
    common::run(secs(60), || {
        let (want, _) = epoch(&mut loader(clean(20), WorkerKind::Thread, false));
        let want = want.unwrap();
        let mut first = loader(clean(20), WorkerKind::Thread, false);
        let mut e = first.iter();
        let mut got: Vec<Vec<i64>> = (0..3)
            .map(|_| e.next().unwrap().unwrap().0.to_vec::<i64>().unwrap())
            .collect();
        let state = serde_json::to_string(&e.state_dict()).unwrap();
        drop(e);
        drop(first);
        let mut second = loader(clean(20), WorkerKind::Thread, false);
        second
            .load_state_dict(&serde_json::from_str(&state).unwrap())
            .unwrap();
        let (rest, _) = epoch(&mut second);
        got.extend(rest.unwrap());
        assert_eq!(got, want);
    });
}

/// Each sample takes at least 2 ms to load.
#[derive(Clone, Serialize, Deserialize)]
struct Slow(usize);

impl Dataset for Slow {
    type Item = i64;

    fn len(&self) -> usize {
        self.0
    }

    fn get(&self, i: usize) -> multiproc::Result<i64> {
        // The work of loading a sample (not a synchronisation).
        std::thread::sleep(std::time::Duration::from_millis(2));
        Ok(i as i64)
    }
}

#[test]
fn stats_say_where_the_epoch_time_went() {
    common::run(secs(60), || {
        let floor = std::time::Duration::from_millis(2 * 20);
        for (workers, kind) in [
            (0, WorkerKind::Process),
            (2, WorkerKind::Process),
            (2, WorkerKind::Thread),
        ] {
            let mut l = DataLoader::builder(Slow(20))
                .batch_size(4)
                .num_workers(workers)
                .workers(kind)
                .build()
                .unwrap();
            l.set_epoch(3);
            let mut e = l.iter();
            e.next().unwrap().unwrap();
            drop(e);
            assert_eq!(l.stats().batches, 1);
            for b in l.iter() {
                b.unwrap();
            }
            let s = l.stats();
            let what = format!("{workers} {kind:?} workers: {s:?}");
            assert_eq!((s.epoch, s.batches), (4, 5), "{what}");
            assert!(s.loading >= floor, "every sample's load counted: {what}");
            assert!(s.collating > std::time::Duration::ZERO, "{what}");
            assert!(s.waiting > std::time::Duration::ZERO, "{what}");
            if workers == 0 {
                assert!(
                    s.waiting >= s.loading,
                    "in this process, waiting is loading: {what}"
                );
            } else {
                assert!(s.hand_over > std::time::Duration::ZERO, "{what}");
            }
        }
    });
}

#[test]
fn a_killed_worker_is_reported_with_the_sample_it_was_loading_and_its_memory() {
    common::run(secs(60), || {
        let data = Faulty {
            fault: Some((7, Fault::Kill)),
            ..clean(20)
        };
        let (got, _) = epoch(&mut loader(data, WorkerKind::Process, false));
        let e = got.unwrap_err();
        let Error::LoaderFailed {
            indices, message, ..
        } = &e
        else {
            panic!("not a LoaderFailed: {e}");
        };
        assert!(indices.contains(&7), "{message}");
        assert!(message.contains("SIGKILL"), "{message}");
        assert!(message.contains("it was loading sample 7"), "{message}");
        assert!(message.contains("resident memory was"), "{message}");
        // A SIGKILL sent by hand is not blamed on the OOM killer, where the memory
        // cgroup's count can be read.
        assert!(!message.contains("the OOM killer killed it"), "{message}");
    });
}

/// Sample `i` is the sum of row `i` of a shared table.
#[derive(Clone, Serialize, Deserialize)]
struct Indexed {
    index: multiproc::data::SharedRows<u64>,
}

impl Dataset for Indexed {
    type Item = i64;

    fn len(&self) -> usize {
        self.index.len()
    }

    fn get(&self, i: usize) -> multiproc::Result<i64> {
        Ok(self.index.row(i)?.iter().sum::<u64>() as i64)
    }
}

#[test]
fn a_shared_table_reaches_every_worker_of_either_kind() {
    common::run(secs(60), || {
        // 4,096 rows of 3: row i is (i, 2i, 3i).
        let flat: Vec<u64> = (0..4096u64).flat_map(|i| [i, 2 * i, 3 * i]).collect();
        let index = multiproc::data::SharedRows::new(&flat, 3).unwrap();
        for kind in [WorkerKind::Process, WorkerKind::Thread] {
            let mut l = DataLoader::builder(Indexed {
                index: index.clone(),
            })
            .batch_size(256)
            .num_workers(4)
            .workers(kind)
            .build()
            .unwrap();
            let sums: Vec<i64> = l
                .iter()
                .flat_map(|b| b.unwrap().to_vec::<i64>().unwrap())
                .collect();
            assert_eq!(
                sums,
                (0..4096).map(|i| 6 * i).collect::<Vec<i64>>(),
                "{kind:?}"
            );
        }
    });
}

#[test]
fn dropping_a_loader_of_busy_thread_workers_leaves_nothing_behind() {
    common::run(secs(60), || {
        let before = common::threads_named_like("multiproc-load");
        for persistent in [false, true] {
            let mut l = DataLoader::builder(Slow(400))
                .batch_size(4)
                .num_workers(4)
                .workers(WorkerKind::Thread)
                .persistent_workers(persistent)
                .build()
                .unwrap();
            let mut e = l.iter();
            e.next().unwrap().unwrap();
            // The others are still loading their batches when the loader goes.
            drop(e);
            drop(l);
        }
        // A busy worker thread is left to finish its batch: then it ends too.
        let until = std::time::Instant::now() + secs(10);
        while common::threads_named_like("multiproc-load") > before {
            assert!(
                std::time::Instant::now() < until,
                "{} worker threads still run 10 s after their loaders were dropped",
                common::threads_named_like("multiproc-load") - before
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    });
}

/// The memory cgroup (v1) of this process, as `/sys/fs/cgroup/memory/<path>`.
fn memory_cgroup_v1() -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| path.to_string())
    })?;
    Some(format!("/sys/fs/cgroup/memory{path}").into())
}

/// The 64 MiB memory cgroup a worker of test process `pid` moves into.
fn small_cgroup_of(pid: u32) -> Option<std::path::PathBuf> {
    Some(memory_cgroup_v1()?.join(format!("multiproc_oom_test_{pid}")))
}

/// A memory cgroup of 64 MiB (no swap) under this process's, made when the machine
/// lets us (root, the cgroup v1 memory controller); removed on drop.
struct SmallCgroup(std::path::PathBuf);

impl SmallCgroup {
    fn make() -> Option<Self> {
        let dir = small_cgroup_of(std::process::id())?;
        std::fs::create_dir(&dir).ok()?;
        let cgroup = SmallCgroup(dir);
        let limit = (64u64 << 20).to_string();
        std::fs::write(cgroup.0.join("memory.limit_in_bytes"), &limit).ok()?;
        // With swap accounting, swap must not rescue it either.
        let memsw = cgroup.0.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            std::fs::write(memsw, &limit).ok()?;
        }
        Some(cgroup)
    }
}

impl Drop for SmallCgroup {
    fn drop(&mut self) {
        // Empty once its one (killed) worker is reaped; the kernel may take a moment.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::remove_dir(&self.0).is_err() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// `worker_init`: move this worker into its test process's small cgroup.
fn move_into_small_cgroup(_id: usize) {
    let parent = std::os::unix::process::parent_id();
    if let Some(dir) = small_cgroup_of(parent) {
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .expect("moving the worker into the small cgroup");
    }
}

/// Sample 0 is small; sample 1 touches 512 MiB.
#[derive(Clone, Serialize, Deserialize)]
struct Hungry;

impl Dataset for Hungry {
    type Item = i64;

    fn len(&self) -> usize {
        2
    }

    fn get(&self, i: usize) -> multiproc::Result<i64> {
        if i == 1 {
            let mut big = vec![0u8; 512 << 20];
            for page in big.iter_mut().step_by(4096) {
                *page = 1;
            }
            return Ok(std::hint::black_box(big).iter().step_by(4096).count() as i64);
        }
        Ok(0)
    }
}

#[test]
#[ignore = "needs root and the cgroup v1 memory controller: .ci/run runs it where they exist"]
fn a_worker_killed_by_the_oom_killer_is_reported_as_such() {
    common::run(secs(60), || {
        let cgroup = SmallCgroup::make().expect(
            "cannot make a memory cgroup here: this test needs root and the cgroup v1 memory \
             controller (/sys/fs/cgroup/memory)",
        );
        let mut l = DataLoader::builder(Hungry)
            .num_workers(1)
            .prefetch_factor(1)
            .worker_init(move_into_small_cgroup)
            .build()
            .unwrap();
        let mut e = l.iter();
        e.next().unwrap().unwrap();
        let err = e.next().unwrap().unwrap_err();
        drop(e);
        drop(l);
        drop(cgroup);
        let Error::LoaderFailed {
            indices, message, ..
        } = &err
        else {
            panic!("not a LoaderFailed: {err}");
        };
        assert_eq!(indices, &[1]);
        assert!(message.contains("the OOM killer killed it"), "{message}");
        assert!(message.contains("it was loading sample 1"), "{message}");
    });
}
