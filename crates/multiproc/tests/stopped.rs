//! Stopped peers never cost a message or a deadline: a process stopped (SIGSTOP: a
//! debugger, Ctrl-Z, a frozen container) while it holds a queue's lock makes the others
//! wait for it, but a `get` without a deadline never returns early and nothing is lost;
//! when the stopped process resumes, everything carries on.
//!
//! The stop lasts longer than any internal wait of the library (a lookup in a queue's
//! block custody gave up after 10 s and lost its message before).

multiproc::test_init!();

mod common;

use std::time::Duration;

use multiproc::{DType, Event, Process, Queue, StartMethod, Tensor, start_processes};

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(30);
/// How long the holder stays stopped: past every internal wait of a lookup.
const STOPPED_FOR: Duration = Duration::from_secs(11);

/// Takes the lock of the queue's block custody and stops itself inside it until it is
/// continued (SIGCONT), then lets go and returns.
fn stop_inside_the_custody_lock(
    _rank: usize,
    (q, holding): (Queue<Tensor>, Event),
) -> multiproc::Result<()> {
    multiproc::__testing::while_custody_locked(&q, || {
        holding.set();
        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)
            .map_err(|e| multiproc::Error::InvalidArgument(format!("SIGSTOP to itself: {e}")))
    })??;
    Ok(())
}

/// Puts `count` fresh tensors (their blocks go into the queue's custody, where a
/// receiver that does not map them yet must look them up) and exits.
fn put_tensors(rank: usize, (q, count): (Queue<Tensor>, usize)) -> multiproc::Result<()> {
    for i in 0..count {
        q.put(Tensor::full(
            &[1 << 16],
            (rank * 10 + i) as f64,
            DType::F32,
        )?)?;
    }
    Ok(())
}

#[test]
fn a_get_without_deadline_waits_out_a_stopped_lock_holder_and_loses_nothing() {
    common::run(DEADLINE, || {
        let q = Queue::<Tensor>::new().unwrap();
        let holding = Event::new().unwrap();
        let mut holder = Process::new(
            stop_inside_the_custody_lock,
            0,
            (q.clone(), holding.clone()),
        );
        holder.start().unwrap();
        holding.wait(Some(WAIT)).unwrap();
        let mut producers =
            start_processes(put_tensors, (q.clone(), 3), 1, StartMethod::Spawn).unwrap();
        producers.join(Some(WAIT)).unwrap();
        // The parent maps none of the producer's blocks: each get looks one up in the
        // custody, whose lock the stopped process holds.
        let (got_tx, got_rx) = std::sync::mpsc::channel();
        let getter = {
            let q = q.clone();
            std::thread::spawn(move || {
                for _ in 0..3 {
                    let got = q.get().map(|t| t.sum().unwrap());
                    let failed = got.is_err();
                    got_tx.send(got).unwrap();
                    if failed {
                        return;
                    }
                }
            })
        };
        // The holder stays stopped (sleeping here is the stop's length, not a
        // synchronisation): the getter must still be waiting, not failed.
        std::thread::sleep(STOPPED_FOR);
        let during_the_stop = got_rx.try_recv();
        // Continued before anything is judged, so that a failure leaves no stopped
        // process behind.
        let pid = rustix::process::Pid::from_raw(holder.pid().unwrap()).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
        match during_the_stop {
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
            other => {
                panic!("a get without deadline returned while the holder was stopped: {other:?}")
            }
        }
        let mut sums: Vec<f64> = (0..3)
            .map(|_| {
                got_rx
                    .recv_timeout(WAIT)
                    .expect("a get")
                    .expect("nothing lost")
            })
            .collect();
        sums.sort_by(f64::total_cmp);
        assert_eq!(sums, [0.0, 65536.0, 131072.0]);
        getter.join().unwrap();
        holder.join(Some(WAIT)).unwrap();
    });
}
