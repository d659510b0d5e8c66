//! Pipes across real processes: `connection::wait` over several pipes, and over a
//! process sentinel and a pipe.

multiproc::test_init!();

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use multiproc::{Error, Event, Process, StartMethod, pipe, start_processes};

const DEADLINE: Duration = Duration::from_secs(90);
const WAIT: Duration = Duration::from_secs(30);

fn wait_for_go(_rank: usize, go: Event) -> multiproc::Result<()> {
    go.wait_timeout(WAIT)
}

fn answer_on_second(
    _rank: usize,
    (first, second): (multiproc::Connection<u8>, multiproc::Connection<String>),
) -> multiproc::Result<()> {
    second.send("second".into()).map_err(Error::from)?;
    // Keep `first` open until the parent has waited, so its readiness is not a hang-up.
    first.recv()?;
    Ok(())
}

#[test]
fn connection_wait_reports_which_pipe_is_ready() {
    common::run(DEADLINE, || {
        let (a_here, a_there) = pipe::<u8>().unwrap();
        let (b_here, b_there) = pipe::<String>().unwrap();
        let err = multiproc::connection::wait(
            &[&a_here as &dyn AsFd, &b_here],
            Some(Duration::from_millis(20)),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        let mut ctx =
            start_processes(answer_on_second, (a_there, b_there), 1, StartMethod::Spawn).unwrap();
        let ready =
            multiproc::connection::wait(&[&a_here as &dyn AsFd, &b_here], Some(WAIT)).unwrap();
        assert_eq!(ready, [1]);
        assert_eq!(b_here.recv_timeout(WAIT).unwrap(), "second");
        a_here.send(0).unwrap();
        ctx.join_timeout(WAIT).unwrap();
    });
}

#[test]
fn connection_wait_on_a_process_sentinel_and_a_pipe() {
    common::run(DEADLINE, || {
        let go = Event::new().unwrap();
        let (here, _there) = pipe::<u8>().unwrap();
        // A `Process` is always started (its builder starts it), so it always has a
        // sentinel: "no sentinel before start" cannot be written.
        let mut p = Process::builder(wait_for_go, 0, go.clone())
            .start()
            .unwrap();
        let sentinel = p.sentinel();
        let err = multiproc::connection::wait(
            &[&sentinel as &dyn AsFd, &here],
            Some(Duration::from_millis(20)),
        )
        .unwrap_err();
        assert!(err.is_timeout(), "the worker still waits: {err}");
        go.set();
        let ready =
            multiproc::connection::wait(&[&sentinel as &dyn AsFd, &here], Some(WAIT)).unwrap();
        assert_eq!(ready, [0], "the sentinel is ready once the worker exits");
        assert!(p.join_timeout(WAIT).unwrap().success());
    });
}
