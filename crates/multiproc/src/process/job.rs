//! # Safety
//!
//! A job names its worker function by code address, so that a freshly executed copy of
//! the program can call it. This module is the only place that turns such an address
//! back into a function pointer, under these invariants:
//!
//! - Addresses travel as offsets from [`anchor`], a function in this crate. The whole
//!   executable is loaded at one base (PIE or not), so an offset taken in the parent
//!   names the same code in any process running the same executable: a spawned worker
//!   (`/proc/self/exe`), a forked child, or the fork server (itself a re-execution).
//! - Before trusting the offsets, the worker checks a second offset, of a function it
//!   knows ([`check_offset`]), so a job from a different build is refused, not called.
//! - The job carries the offset of a *trampoline* monomorphized for the worker's exact
//!   argument and result types; the trampoline re-checks `type_name::<A>()` against the
//!   name the parent sent before it turns the worker's offset into `fn(usize, A) -> R`.
//! - Jobs come only from the process that created the worker, over a socket only the
//!   two of them hold; the decoder never panics on malformed bytes.
//!
//! Limitation (documented on `spawn`): the worker function must live in the executable
//! itself, not in a dynamically loaded library, whose base differs between processes.

use std::any::type_name;
use std::os::fd::BorrowedFd;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::worker_outcome::IntoWorkerOutcome;

use crate::wire;

/// The fixed point code offsets are measured from.
#[inline(never)]
fn anchor() -> usize {
    // Distinct body, so identical-code folding cannot merge it with another function
    // (it would still be a valid anchor, but a distinct one is easier to reason about).
    std::hint::black_box(0x6d70_616e_6368_6f72)
}

fn anchor_address() -> usize {
    (anchor as fn() -> usize) as usize
}

pub(super) fn offset_of(address: usize) -> u64 {
    address.wrapping_sub(anchor_address()) as u64
}

pub(super) fn address_at(offset: u64) -> usize {
    anchor_address().wrapping_add(offset as usize)
}

/// A second fixed point: its offset from [`anchor`] is what a job from another build
/// is detected by.
#[inline(never)]
fn check_point() -> usize {
    std::hint::black_box(0x6d70_6368_6563_6b70)
}

/// The offset of a function the worker knows, to detect a job from another build.
pub(super) fn check_offset() -> u64 {
    offset_of(check_point as fn() -> usize as usize)
}

/// What failed when a job ran.
pub(crate) enum Failed {
    /// The worker function returned `Err`; its text.
    Returned(String),
    /// The job could not be started (wrong build, wrong types, undecodable arguments).
    Setup(String),
}

type Trampoline = fn(&JobHeader, BorrowedFd<'_>) -> Result<(), Failed>;

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
    check: u64,
    trampoline: u64,
    function: u64,
    args_type: String,
}

impl JobHeader {
    /// The header for running `worker` as `rank`.
    pub(crate) fn new<A, R>(worker: fn(usize, A) -> R, rank: usize) -> Self
    where
        A: Serialize + DeserializeOwned,
        R: IntoWorkerOutcome,
    {
        let trampoline: Trampoline = trampoline::<A, R>;
        JobHeader {
            rank,
            check: check_offset(),
            trampoline: offset_of(trampoline as usize),
            function: offset_of(worker as usize),
            args_type: type_name::<A>().to_string(),
            name: format!("Process-{rank}"),
            log: None,
        }
    }

    /// Receives the arguments from `sock` and runs the worker function. Panics in the
    /// worker propagate to the caller, which catches them.
    pub(crate) fn run(&self, sock: BorrowedFd<'_>) -> Result<(), Failed> {
        if self.check != check_offset() {
            return Err(Failed::Setup(
                "the job was sent by a different build of this program (code offsets differ); \
                 parent and worker must run the same executable"
                    .into(),
            ));
        }
        // SAFETY: the offset was taken from a `Trampoline` in the parent, which runs this
        // same executable (checked just above), so it names a function of exactly that
        // type here (see the module's safety section).
        let trampoline: Trampoline =
            unsafe { std::mem::transmute::<usize, Trampoline>(address_at(self.trampoline)) };
        trampoline(self, sock)
    }
}

/// Receives `A`, checks the types and calls the worker. Monomorphized per worker type;
/// the parent sends its offset.
fn trampoline<A, R>(job: &JobHeader, sock: BorrowedFd<'_>) -> Result<(), Failed>
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
    let packet = wire::recv_packet(sock, None)
        .map_err(|e| Failed::Setup(format!("cannot receive its arguments: {e}")))?
        .ok_or_else(|| Failed::Setup("no arguments arrived".into()))?;
    let args: A = wire::decode(packet)
        .map_err(|e| Failed::Setup(format!("cannot decode its arguments: {e}")))?;
    // SAFETY: the parent took this offset from a `fn(usize, A) -> R` for these very
    // types (this trampoline is the one monomorphized for them, and the type name
    // matches), in the same executable.
    let worker =
        unsafe { std::mem::transmute::<usize, fn(usize, A) -> R>(address_at(job.function)) };
    worker(job.rank, args)
        .into_outcome()
        .map_err(Failed::Returned)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        args.send(std::os::fd::AsFd::as_fd(&a), None).unwrap();
        assert!(header.run(std::os::fd::AsFd::as_fd(&b)).is_ok());
        let mut args = wire::encode(&5u32).unwrap();
        args.send(std::os::fd::AsFd::as_fd(&a), None).unwrap();
        match header.run(std::os::fd::AsFd::as_fd(&b)) {
            Err(Failed::Returned(m)) => assert_eq!(m, "5 is not twice 3"),
            _ => panic!("expected the worker's error"),
        }
    }

    #[test]
    fn a_foreign_job_is_refused() {
        let (_a, b) = crate::sys::socket::seqpacket_pair().unwrap();
        let mut header = JobHeader::new(double, 0);
        header.check ^= 1;
        assert!(matches!(
            header.run(std::os::fd::AsFd::as_fd(&b)),
            Err(Failed::Setup(_))
        ));
        let mut header = JobHeader::new(double, 0);
        header.args_type = "String".into();
        // The trampoline refuses before reading anything.
        assert!(matches!(
            header.run(std::os::fd::AsFd::as_fd(&b)),
            Err(Failed::Setup(_))
        ));
    }
}
