//! A job: which worker function a new worker runs, for which rank, with which
//! arguments. The function travels as a [`CodeCall`] (`process::code`, the one place
//! that turns code offsets back into functions), through a trampoline monomorphized for
//! the worker's argument and result types; this module has no unsafe code.
//!
//! Invariants:
//!
//! - The worker function and its trampoline are named by a [`CodeCall`], so a job from
//!   another build of the program is refused, never called.
//! - The trampoline re-checks `type_name::<A>()` against the name the parent sent
//!   before it decodes the arguments.
//! - Jobs come only from the process that created the worker, over a socket only the
//!   two of them hold; the decoder never panics on malformed bytes.
//!
//! Limitation (documented on `spawn`): the worker function must live in the executable
//! itself, not in a dynamically loaded library, whose base differs between processes.

use std::any::type_name;
use std::os::fd::BorrowedFd;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::code::{CodeCall, Sink};
use super::worker_outcome::IntoWorkerOutcome;

use crate::sys::socket::Packet;
use crate::wire;

/// What failed when a job ran.
pub(crate) enum Failed {
    /// The worker function returned `Err`; its text.
    Returned(String),
    /// The job could not be started (wrong build, wrong types, undecodable arguments).
    Setup(String),
}

/// What the trampoline gets: the rank, the argument type the parent named, and the
/// arguments' packet, still encoded.
struct JobInput {
    rank: usize,
    args_type: String,
    packet: Packet,
}

/// The worker function with its trampoline.
type JobCall = CodeCall<JobInput, (), Result<(), Failed>>;

/// The first message on a worker's job socket: which function, with which types, for
/// which rank. The arguments follow as a second message (an ordinary wire value whose
/// handles travel as fds), decoded by the trampoline, which alone knows their type.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct JobHeader {
    /// The worker's rank, its first argument.
    pub rank: usize,
    /// The worker's name, for [`current_process`](crate::current_process).
    pub name: String,
    /// Where the worker sends its `tracing` events, when the parent wants them.
    pub log: Option<super::logs::LogSink>,
    call: JobCall,
    args_type: String,
}

/// The name of a worker that was not given one: `Process-RANK`, as Python's.
pub(crate) fn default_name(rank: usize) -> String {
    format!("Process-{rank}")
}

/// How messages name a worker: `transformer-1 (rank 1, pid 4242)` when it was given a
/// name, `process 1 (pid 4242)` when it has its default one (which says no more than
/// the rank).
pub(crate) fn describe(rank: usize, name: &str, pid: u32) -> String {
    if name == default_name(rank) {
        format!("process {rank} (pid {pid})")
    } else {
        format!("{name} (rank {rank}, pid {pid})")
    }
}

impl JobHeader {
    /// The header for running `worker` as `rank`.
    pub(crate) fn new<A, R>(worker: fn(usize, A) -> R, rank: usize) -> Self
    where
        A: Serialize + DeserializeOwned,
        R: IntoWorkerOutcome,
    {
        JobHeader {
            rank,
            call: CodeCall::new(worker, trampoline::<A, R>),
            args_type: type_name::<A>().to_string(),
            name: default_name(rank),
            log: None,
        }
    }

    /// Receives the arguments from `sock` and runs the worker function. Panics in the
    /// worker propagate to the caller, which catches them.
    pub(crate) fn run(&self, sock: BorrowedFd<'_>) -> Result<(), Failed> {
        let packet = wire::recv_packet(sock, None)
            .map_err(|e| Failed::Setup(format!("cannot receive its arguments: {e}")))?
            .ok_or_else(|| Failed::Setup("no arguments arrived".into()))?;
        let input = JobInput {
            rank: self.rank,
            args_type: self.args_type.clone(),
            packet,
        };
        self.call
            .call(input, &mut |()| true)
            .map_err(Failed::Setup)?
    }
}

/// Checks the argument type, decodes the arguments and calls the worker.
/// Monomorphized per worker type; the job names it. (Panic reports cut backtraces at
/// this function's name: `process::panic_hook`.)
fn trampoline<A, R>(worker: fn(usize, A) -> R, job: JobInput, _: Sink<'_, ()>) -> Result<(), Failed>
where
    A: Serialize + DeserializeOwned,
    R: IntoWorkerOutcome,
{
    if job.args_type != type_name::<A>() {
        return Err(Failed::Setup(format!(
            "the job's arguments are a `{}` but this worker takes `{}`",
            job.args_type,
            type_name::<A>()
        )));
    }
    let args: A = wire::decode(job.packet, &crate::shm::Returns::plain())
        .map_err(|e| Failed::Setup(format!("cannot decode its arguments: {e}")))?;
    worker(job.rank, args)
        .into_outcome()
        .map_err(Failed::Returned)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::fd::AsFd;

    fn double(rank: usize, x: u32) -> Result<(), String> {
        if x == 2 * rank as u32 {
            Ok(())
        } else {
            Err(format!("{x} is not twice {rank}"))
        }
    }

    #[test]
    fn a_job_finds_its_function_again() {
        let (a, b) = crate::sys::socket::seqpacket_pair().unwrap();
        let header = JobHeader::new(double, 3);
        let mut args = wire::encode(&6u32).unwrap();
        args.send(a.as_fd(), None).unwrap();
        assert!(header.run(b.as_fd()).is_ok());
        let mut args = wire::encode(&5u32).unwrap();
        args.send(a.as_fd(), None).unwrap();
        match header.run(b.as_fd()) {
            Err(Failed::Returned(m)) => assert_eq!(m, "5 is not twice 3"),
            _ => panic!("expected the worker's error"),
        }
    }

    #[test]
    fn a_worker_is_described_by_its_name_when_it_has_one() {
        assert_eq!(
            describe(1, "transformer-1", 42),
            "transformer-1 (rank 1, pid 42)"
        );
        assert_eq!(describe(1, "Process-1", 42), "process 1 (pid 42)");
        assert_eq!(describe(2, "Process-1", 42), "Process-1 (rank 2, pid 42)");
    }

    #[test]
    fn a_foreign_job_is_refused() {
        let (a, b) = crate::sys::socket::seqpacket_pair().unwrap();
        let mut header = JobHeader::new(double, 0);
        header.call = header.call.as_from_another_build();
        wire::encode(&0u32).unwrap().send(a.as_fd(), None).unwrap();
        match header.run(b.as_fd()) {
            Err(Failed::Setup(m)) => assert!(m.contains("different build"), "{m}"),
            _ => panic!("expected a refusal"),
        }
        let mut header = JobHeader::new(double, 0);
        header.args_type = "String".into();
        wire::encode(&0u32).unwrap().send(a.as_fd(), None).unwrap();
        match header.run(b.as_fd()) {
            Err(Failed::Setup(m)) => assert!(m.contains("takes `u32`"), "{m}"),
            _ => panic!("expected a refusal"),
        }
    }
}
