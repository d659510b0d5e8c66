//! A Rust process on the other end of a Python program's queues: Python starts it with
//! two queues sealed into fds (`multiproc.parcel_for_child`), it answers every message.
//!
//! ```text
//! cargo build -p multiproc --example python_peer
//! python3 crates/multiproc-py/examples/rust_peer.py target/debug/examples/python_peer
//! ```
//!
//! Usage: `python_peer IN_FD OUT_FD`. For each message `m` taken from the queue
//! `IN_FD`, it adds 1 in place to every tensor in `m` (the Python side sees it: the
//! memory is shared), and puts on `OUT_FD` the tuple `("seen", m, sum, made)`: `m`
//! back, the sum of its tensors' elements before the increment, and a new 2×2 `f32`
//! tensor made here, filled with the number of messages seen. A `None` message ends it;
//! it answers `("bye", count)` and exits at once (the answer is delivered all the same).

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::process::ExitCode;

use multiproc::{DType, Dynamic, Queue, Tensor};

/// Every tensor in `value`, at any depth.
fn tensors<'a>(value: &'a Dynamic, out: &mut Vec<&'a Tensor>) {
    match value {
        Dynamic::Tensor(t) => out.push(t),
        Dynamic::List(items) | Dynamic::Tuple(items) => {
            items.iter().for_each(|i| tensors(i, out));
        }
        Dynamic::Dict(items) => items.iter().for_each(|(k, v)| {
            tensors(k, out);
            tensors(v, out);
        }),
        _ => {}
    }
}

fn queue_from_arg(arg: Option<String>) -> multiproc::Result<Queue<Dynamic>> {
    let fd: RawFd = arg
        .and_then(|a| a.parse().ok())
        .filter(|&fd| fd >= 0)
        .ok_or_else(|| {
            multiproc::Error::InvalidArgument("usage: python_peer IN_FD OUT_FD".into())
        })?;
    // SAFETY: the fd was inherited for this process to take over (Python's `pass_fds`);
    // nothing else in this program uses or closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    multiproc::parcel::open(fd)
}

fn run() -> multiproc::Result<()> {
    let mut args = std::env::args().skip(1);
    let incoming = queue_from_arg(args.next())?;
    let outgoing = queue_from_arg(args.next())?;
    let mut count = 0i64;
    loop {
        let message = incoming.get()?;
        if matches!(message, Dynamic::None) {
            outgoing.put(Dynamic::Tuple(vec!["bye".into(), count.into()]))?;
            return Ok(());
        }
        count += 1;
        let mut found = Vec::new();
        tensors(&message, &mut found);
        let mut sum = 0.0;
        for t in &found {
            sum += t.sum()?;
        }
        for t in &found {
            t.add_scalar_(1.0)?;
        }
        let made = Tensor::full(&[2, 2], count as f64, DType::F32)?;
        outgoing.put(Dynamic::Tuple(vec![
            "seen".into(),
            message,
            sum.into(),
            made.into(),
        ]))?;
    }
}

fn main() -> ExitCode {
    multiproc::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("python_peer: {e}");
            ExitCode::FAILURE
        }
    }
}
