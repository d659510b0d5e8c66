//! Departed peers are an error, not a hang: a get or recv on an empty queue or pipe that
//! no other handle can ever feed — none left in another process, in another thread of
//! this one, or inside a message in flight — is `Error::Disconnected`, after every
//! message already queued has been received. Handles that still exist anywhere keep it
//! connected.
//!
//! Every test runs under `common::run` (a watchdog: a get that waited forever fails the
//! test) and ends with its leak check.

multiproc::test_init!();

mod common;

use std::time::Duration;

use multiproc::{
    DType, Error, Event, JoinableQueue, Process, Queue, SimpleQueue, StartMethod, Tensor, pipe,
    start_processes,
};

const DEADLINE: Duration = Duration::from_secs(60);
const WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------
// Workers.

/// Puts `count` items (a tensor every tenth) and returns at once.
fn put_and_exit(
    rank: usize,
    (queue, count): (Queue<(usize, u32, Option<Tensor>)>, u32),
) -> multiproc::Result<()> {
    for i in 0..count {
        let t = if i % 10 == 0 {
            Some(Tensor::full(&[64], f64::from(i), DType::F32)?)
        } else {
            None
        };
        queue.put((rank, i, t))?;
    }
    Ok(())
}

/// Puts one item, says so, and waits (to be SIGKILLed).
fn put_then_wait(_rank: usize, (queue, put): (SimpleQueue<u32>, Event)) -> multiproc::Result<()> {
    queue.put(7)?;
    put.set();
    std::thread::sleep(Duration::from_secs(120));
    Ok(())
}

/// Sends `count` items down the pipe and returns.
fn send_and_exit(
    _rank: usize,
    (conn, count): (multiproc::Connection<u32>, u32),
) -> multiproc::Result<()> {
    for i in 0..count {
        conn.send(i)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn a_handle_never_cloned_or_sent_is_disconnected_at_once() {
    common::run(DEADLINE, || {
        let q = Queue::<u32>::new().unwrap();
        assert!(q.get().unwrap_err().is_disconnected());
        assert!(q.try_get().unwrap_err().is_disconnected());
        let s = SimpleQueue::<u32>::new().unwrap();
        assert!(s.get().unwrap_err().is_disconnected());
        let j = JoinableQueue::<u32>::with_capacity(3).unwrap();
        assert!(j.get_timeout(WAIT).unwrap_err().is_disconnected());
        // What it put itself comes first.
        q.put(1).unwrap();
        assert_eq!(q.get().unwrap(), 1);
        let err = q.get().unwrap_err();
        assert!(matches!(err, Error::Disconnected(_)), "{err:?}");
        assert!(err.to_string().contains("no other handle"), "{err}");
    });
}

#[test]
fn a_clone_in_another_thread_keeps_the_queue_connected_until_it_is_dropped() {
    common::run(DEADLINE, || {
        let q = SimpleQueue::<u32>::new().unwrap();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let producer = {
            let q = q.clone();
            std::thread::spawn(move || {
                ready_tx.send(()).unwrap();
                go_rx.recv().unwrap();
                q.put(42).unwrap();
                // The clone is dropped here, after the put.
            })
        };
        ready_rx.recv().unwrap();
        // Empty, but a clone lives in the other thread: a wait, not an error.
        assert!(
            q.get_timeout(Duration::from_millis(30))
                .unwrap_err()
                .is_timeout()
        );
        assert_eq!(q.try_get().unwrap(), None);
        go_tx.send(()).unwrap();
        assert_eq!(q.get().unwrap(), 42);
        producer.join().unwrap();
        assert!(q.get().unwrap_err().is_disconnected());
    });
}

#[test]
fn a_consumer_whose_producers_all_exited_gets_every_message_then_disconnected() {
    common::run(DEADLINE, || {
        const WORKERS: usize = 4;
        const EACH: u32 = 500;
        let q = Queue::<(usize, u32, Option<Tensor>)>::new().unwrap();
        let mut ctx =
            start_processes(put_and_exit, (q.clone(), EACH), WORKERS, StartMethod::Spawn).unwrap();
        // The parent's clone went into the workers' arguments: only `q` is left here.
        let mut seen = vec![0u32; WORKERS];
        loop {
            match q.get() {
                Ok((rank, i, t)) => {
                    assert_eq!(i, seen[rank], "in order per producer");
                    if let Some(t) = t {
                        assert_eq!(t.sum().unwrap(), f64::from(i) * 64.0);
                    }
                    seen[rank] += 1;
                }
                Err(e) if e.is_disconnected() => break,
                Err(e) => panic!("unexpected {e}"),
            }
        }
        assert_eq!(seen, vec![EACH; WORKERS], "nothing lost before the end");
        ctx.join_timeout(WAIT).unwrap();
    });
}

#[test]
fn a_killed_producer_disconnects_its_queue() {
    common::run(DEADLINE, || {
        let q = SimpleQueue::<u32>::new().unwrap();
        let put = Event::new().unwrap();
        let mut p = Process::builder(put_then_wait, 0, (q.clone(), put.clone()))
            .start()
            .unwrap();
        put.wait_timeout(WAIT).unwrap();
        drop(put);
        p.kill().unwrap();
        p.join_timeout(WAIT).unwrap();
        assert_eq!(q.get().unwrap(), 7, "what it put before it died arrives");
        assert!(q.get().unwrap_err().is_disconnected());
    });
}

#[test]
fn a_handle_inside_a_message_in_flight_keeps_the_queue_connected() {
    common::run(DEADLINE, || {
        let carrier = SimpleQueue::<SimpleQueue<u32>>::new().unwrap();
        let _carrier_here = carrier.clone();
        let q = SimpleQueue::<u32>::new().unwrap();
        carrier.put(q.clone()).map_err(|e| e.error).unwrap();
        // The only other handle is in a message nobody has received.
        assert!(
            q.get_timeout(Duration::from_millis(30))
                .unwrap_err()
                .is_timeout()
        );
        let received = carrier.get().unwrap();
        received.put(9).map_err(|e| e.error).unwrap();
        assert_eq!(q.get().unwrap(), 9);
        drop(received);
        assert!(q.get().unwrap_err().is_disconnected());
        // A message dropped unread gives its handle back too.
        carrier.put(q.clone()).map_err(|e| e.error).unwrap();
        assert!(q.try_get().unwrap().is_none());
        drop((carrier, _carrier_here));
        assert!(q.get().unwrap_err().is_disconnected());
    });
}

#[test]
fn a_pipe_whose_other_end_exited_is_disconnected_after_its_messages() {
    common::run(DEADLINE, || {
        let (here, there) = pipe::<u32>().unwrap();
        let mut ctx = start_processes(send_and_exit, (there, 3), 1, StartMethod::Spawn).unwrap();
        ctx.join_timeout(WAIT).unwrap();
        assert_eq!(
            (0..3).map(|_| here.recv().unwrap()).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert!(here.recv().unwrap_err().is_disconnected());
        assert!(here.try_recv().unwrap_err().is_disconnected());
    });
}

#[test]
fn queues_sent_together_in_one_message_each_keep_their_own_handle() {
    common::run(DEADLINE, || {
        let carrier = SimpleQueue::<(SimpleQueue<u32>, SimpleQueue<u32>)>::new().unwrap();
        let _carrier_here = carrier.clone();
        let (a, b) = (SimpleQueue::new().unwrap(), SimpleQueue::new().unwrap());
        carrier
            .put((a.clone(), b.clone()))
            .map_err(|e| e.error)
            .unwrap();
        let (ra, rb) = carrier.get().unwrap();
        drop(ra);
        assert!(a.get().unwrap_err().is_disconnected());
        assert!(
            b.get_timeout(Duration::from_millis(30))
                .unwrap_err()
                .is_timeout()
        );
        drop(rb);
        assert!(b.get().unwrap_err().is_disconnected());
    });
}

/// A `fork` child inherits the queue, not by message but as the copy of the parent's
/// memory: it is a holder of its own all the same (it could put), so the parent's get
/// waits for it, and, once it has put and exited, gets its item and then
/// `Disconnected`. The child checks from its side too: the parent's holder is another.
#[test]
fn a_fork_child_that_inherited_a_queue_is_a_holder_of_its_own() {
    common::run(DEADLINE, || {
        let q = Queue::<u32>::new().unwrap();
        let back = Queue::<u32>::new().unwrap();
        // SAFETY: fork(2); the child uses the library (fork-safe: `sys::fork_local`,
        // `sys::peer_lease`) and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // Late, so that the parent is already waiting in its get.
            std::thread::sleep(Duration::from_millis(300));
            let code = match (q.put(7), back.get_timeout(WAIT)) {
                (Ok(()), Ok(8)) => 0,
                _ => 1,
            };
            // SAFETY: ends the forked child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        assert_eq!(q.get().unwrap(), 7, "the get waited for the fork child");
        back.put(8).unwrap();
        let mut status = 0;
        // SAFETY: waitpid(2) on our own child, with a valid pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "{status}"
        );
        let err = q.get().unwrap_err();
        assert!(err.is_disconnected(), "{err:?}");
    });
}
