//! `multiproc bench-floor`: what the hardware and kernel allow, measured with raw
//! system calls, for `scripts/compare_torch.py` to divide by.
//!
//! - `ping`: a `SOCK_SEQPACKET` socketpair between two processes; each round trip is a
//!   small packet with one fd attached (`SCM_RIGHTS`) there and back — the least any
//!   fd-passing queue can do.
//! - `fill+sum`: fill a reused buffer of S bytes with a value, then sum it, in one
//!   process — what `fresh` would cost with no process boundary and no allocation.
//! - `memcpy`: copy a reused 64 MiB buffer into another in one process — the memory
//!   bandwidth a shared-memory collective is measured against.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Instant;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType, recvmsg, sendmsg, socketpair,
};

use crate::bench::Figure;

/// The environment variable that tells a re-executed `multiproc` to be the ping child.
const CHILD_FD_ENV: &str = "MULTIPROC_FLOOR_CHILD_FD";

fn send_with_fd(sock: &OwnedFd, payload: &[u8], fd: &OwnedFd) -> std::io::Result<()> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd.as_fd()];
    control.push(SendAncillaryMessage::ScmRights(&fds));
    sendmsg(
        sock,
        &[IoSlice::new(payload)],
        &mut control,
        SendFlags::empty(),
    )?;
    Ok(())
}

fn recv_with_fd(sock: &OwnedFd, buf: &mut [u8]) -> std::io::Result<Option<OwnedFd>> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = recvmsg(
        sock,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    if msg.bytes == 0 {
        return Ok(None);
    }
    let mut got = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = m {
            got = fds.next();
        }
    }
    Ok(got)
}

/// The ping child: echoes every packet and its fd until the parent closes the socket.
/// Returns `true` when this process was started as the child.
pub fn serve_child_if_asked() -> bool {
    let Ok(raw) = std::env::var(CHILD_FD_ENV) else {
        return false;
    };
    let Ok(raw) = raw.parse::<i32>() else {
        return true;
    };
    // SAFETY: the parent passed us this fd, open and ours alone, in the environment.
    let sock = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let mut buf = [0u8; 64];
    while let Ok(Some(fd)) = recv_with_fd(&sock, &mut buf) {
        if send_with_fd(&sock, &buf[..16], &fd).is_err() {
            break;
        }
    }
    true
}

fn ping(count: u64) -> std::io::Result<Figure> {
    let (here, there) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // The child's end must survive exec.
    rustix::io::fcntl_setfd(&there, rustix::io::FdFlags::empty())?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .env(CHILD_FD_ENV, there.as_raw_fd().to_string())
        .spawn()?;
    drop(there);
    let seg = rustix::fs::memfd_create("floor", rustix::fs::MemfdFlags::CLOEXEC)?;
    rustix::fs::ftruncate(&seg, 4096)?;
    let mut buf = [0u8; 64];
    let payload = [7u8; 16];
    // Warm up, then time.
    for _ in 0..100 {
        send_with_fd(&here, &payload, &seg)?;
        recv_with_fd(&here, &mut buf)?;
    }
    let start = Instant::now();
    for _ in 0..count {
        send_with_fd(&here, &payload, &seg)?;
        recv_with_fd(&here, &mut buf)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    drop(here);
    child.wait()?;
    Ok(Figure::floor(
        "ping",
        None,
        count,
        seconds,
        Some(seconds * 1e6 / count as f64),
    ))
}

fn fill_sum(bytes: u64, count: u64) -> Figure {
    let mut buf = vec![0f32; (bytes / 4) as usize];
    let mut total = 0.0f64;
    // Touch once so page faults are not counted: the floor reuses its buffer.
    buf.iter_mut().for_each(|v| *v = 1.0);
    let start = Instant::now();
    for i in 0..count {
        let value = (i % 7) as f32;
        buf.iter_mut().for_each(|v| *v = value);
        total += buf.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(total);
    Figure::floor("fill+sum", Some(bytes), count, seconds, None)
}

/// The memory bandwidth floor: copy a reused `bytes`-byte buffer into another, `count`
/// times, in one process (GB/s counts the bytes copied once).
pub fn memcpy(bytes: u64, count: u64) -> Figure {
    let src = vec![1u8; bytes as usize];
    let mut dst = vec![0u8; bytes as usize];
    dst.copy_from_slice(&src); // fault the pages in first
    let start = Instant::now();
    for _ in 0..count {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    Figure::floor(
        "memcpy",
        Some(bytes),
        count,
        start.elapsed().as_secs_f64(),
        None,
    )
}

/// Runs the floor measurements.
pub fn run(scale: f64) -> std::io::Result<Vec<Figure>> {
    let scaled = |n: u64| ((n as f64 * scale).round() as u64).max(2);
    let mut figures = vec![ping(scaled(20_000))?];
    for (bytes, count) in [
        (4u64 << 10, 20_000u64),
        (1 << 20, 500),
        (64 << 20, 20),
        (256 << 20, 5),
    ] {
        figures.push(fill_sum(bytes, scaled(count)));
    }
    figures.push(memcpy(64 << 20, scaled(20)));
    Ok(figures)
}
