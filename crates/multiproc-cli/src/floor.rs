//! `multiproc bench-floor`: what the hardware and kernel allow, measured with raw
//! system calls, for `scripts/compare_torch.py` to divide by.
//!
//! - `ping`: a `SOCK_SEQPACKET` socketpair between two processes; each round trip is a
//!   small packet with one fd attached (`SCM_RIGHTS`) there and back — the least any
//!   fd-passing queue can do.
//! - `futex-ping`: two processes share one 32-bit word (a memfd mapped `MAP_SHARED` in
//!   both); the parent sets it to 1 and `FUTEX_WAKE`s, the child waits for 1, sets 2 and
//!   wakes, the parent waits for 2: one round trip is parent → child → parent, and a
//!   waiter whose value has not come yet sleeps in `FUTEX_WAIT` (no spinning) — the
//!   least a queue that sleeps between messages can do.
//! - `spin-ping`: the same word, busy-polled with spin-loop hints and no system call at
//!   all — the least any cross-process round trip can do (two cache-line transfers).
//! - `fill+sum`: fill a reused buffer of S bytes with a value, then sum it, in one
//!   process — what `fresh` would cost with no process boundary and no allocation.
//! - `memcpy`: copy a reused 64 MiB buffer into another in one process — the memory
//!   bandwidth a shared-memory collective is measured against.
//!
//! The ping children are this binary re-executed as `multiproc bench-floor-child <kind>
//! <parent pid>` ([`serve_child`]), with what they share on their stdin: the socket, or
//! the shared word's page (`multiproc::__bench::SharedWord`, a page of the library's
//! shared words, whose mapping is the library's). No fd number travels. Neither child
//! outlives its parent: the socket child ends when the socket hangs up, the word child
//! when the parent says stop or, checked at least every [`WAIT_SLICE`], when its parent
//! is no longer the process that started it. A waiter never waits unboundedly: the
//! spinner falls back to `FUTEX_WAIT` after [`SPIN_LIMIT`], and every `FUTEX_WAIT` is a
//! [`WAIT_SLICE`] after which the parent checks that its child still runs (and gives up
//! after [`ANSWER_LIMIT`] without an answer). The page has no name, so nothing is left
//! in `/dev/shm`.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::thread::futex;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType, recvmsg, sendmsg, socketpair,
};

use multiproc::__bench::SharedWord;

use crate::bench::Figure;

/// The hidden subcommand that makes a re-executed `multiproc` a ping child.
pub const CHILD_COMMAND: &str = "bench-floor-child";

/// The kind of ping child that serves the socket ping (the others are [`Waiting`]'s).
const SOCKET_CHILD: &str = "socket";

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

/// Serves as the ping child of kind `kind` (`socket`, `futex` or `spin`) for the
/// `multiproc bench-floor` run `parent`, with what it shares on this process's stdin.
pub fn serve_child(kind: &str, parent: i32) -> std::io::Result<()> {
    // A copy of stdin: what the parent gave us, adopted without an fd number.
    let shared = std::io::stdin().as_fd().try_clone_to_owned()?;
    if kind == SOCKET_CHILD {
        let mut buf = [0u8; 64];
        while let Ok(Some(fd)) = recv_with_fd(&shared, &mut buf) {
            if send_with_fd(&shared, &buf[..16], &fd).is_err() {
                break;
            }
        }
        return Ok(());
    }
    let how = Waiting::parse(kind).ok_or_else(|| {
        std::io::Error::other(format!(
            "{kind:?} is no ping child's kind (expected {SOCKET_CHILD}, futex or spin)"
        ))
    })?;
    serve_word_child(shared, how, parent)
}

/// Starts this binary as the ping child of kind `kind`, `shared` on its stdin.
fn start_child(kind: &str, shared: OwnedFd) -> std::io::Result<Child> {
    std::process::Command::new(std::env::current_exe()?)
        .args([CHILD_COMMAND, kind, &std::process::id().to_string()])
        .stdin(Stdio::from(shared))
        .spawn()
}

fn ping(count: u64) -> std::io::Result<Figure> {
    let (here, there) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // The child's stdin; our copy closes with the spawn.
    let mut child = start_child(SOCKET_CHILD, there)?;
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

// ---- the futex and spin ping-pong over one shared word --------------------------------

/// The word's values: whose turn it is, or that the child is to leave.
const PARENT_SENT: u32 = 1;
const CHILD_SENT: u32 = 2;
const STOP: u32 = 3;

/// How long a spinner polls before it falls back to `FUTEX_WAIT`: long enough never to
/// happen in a healthy run, short enough that a stuck peer costs a core for a moment only.
const SPIN_LIMIT: Duration = Duration::from_secs(1);

/// The longest single `FUTEX_WAIT`: after each, the waiter checks that its peer lives.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// How long the parent waits for one answer before it gives the child up.
const ANSWER_LIMIT: Duration = Duration::from_secs(10);

/// How long one variant's timed loop may run, whatever the count: spinning on a
/// machine with fewer free cores than spinners costs a scheduler tick per hop.
const TIME_BUDGET: Duration = Duration::from_secs(3);

/// How a side waits for its value.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Waiting {
    /// Sleep in `FUTEX_WAIT`; the writer always `FUTEX_WAKE`s.
    Futex,
    /// Busy-poll; the writer makes no system call. The fallback after [`SPIN_LIMIT`]
    /// sleeps in [`WAIT_SLICE`]s, unwoken, so it stays correct without a wake.
    Spin,
}

impl Waiting {
    fn name(self) -> &'static str {
        match self {
            Waiting::Futex => "futex",
            Waiting::Spin => "spin",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        [Waiting::Futex, Waiting::Spin]
            .into_iter()
            .find(|w| w.name() == name)
    }
}

/// Sets `word` to `value` and, when the peer may sleep, wakes it.
fn hand_over(word: &AtomicU32, value: u32, how: Waiting) -> std::io::Result<()> {
    word.store(value, Ordering::Release);
    if how == Waiting::Futex {
        // Not PRIVATE: the waiter is another process with its own mapping.
        futex::wake(word, futex::Flags::empty(), 1)?;
    }
    Ok(())
}

/// Waits until `word` holds `want` or [`STOP`] and returns what it holds; after each
/// [`WAIT_SLICE`] asleep, `peer_alive` decides whether to go on waiting.
fn wait_for(
    word: &AtomicU32,
    want: u32,
    how: Waiting,
    peer_alive: &mut dyn FnMut() -> std::io::Result<()>,
) -> std::io::Result<u32> {
    let ours = |v: u32| v == want || v == STOP;
    if how == Waiting::Spin {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            let v = word.load(Ordering::Acquire);
            if ours(v) {
                return Ok(v);
            }
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            // Reading the clock costs more than a poll: look every 4096 polls only.
            if polls % 4096 == 0 && start.elapsed() >= SPIN_LIMIT {
                break;
            }
        }
    }
    let slice = futex::Timespec {
        tv_sec: 0,
        tv_nsec: WAIT_SLICE.as_nanos() as _,
    };
    loop {
        let v = word.load(Ordering::Acquire);
        if ours(v) {
            return Ok(v);
        }
        match futex::wait(word, futex::Flags::empty(), v, Some(&slice)) {
            // Woken, the word moved before we slept, or a signal: look again.
            Ok(()) | Err(Errno::AGAIN) | Err(Errno::INTR) => {}
            Err(Errno::TIMEDOUT) => peer_alive()?,
            Err(e) => return Err(e.into()),
        }
    }
}

/// The futex (or spin) ping child: answers every [`PARENT_SENT`] with [`CHILD_SENT`]
/// until the parent says [`STOP`] or is gone.
fn serve_word_child(page: OwnedFd, how: Waiting, parent: i32) -> std::io::Result<()> {
    let shared = SharedWord::open(page).map_err(std::io::Error::other)?;
    let word = shared.word();
    // Reparented (to init or a subreaper) means the parent has gone.
    let mut parent_alive = || match rustix::process::getppid() {
        p if rustix::process::Pid::as_raw(p) == parent => Ok(()),
        _ => Err(std::io::Error::other("the parent has gone")),
    };
    loop {
        if wait_for(word, PARENT_SENT, how, &mut parent_alive)? == STOP {
            return Ok(());
        }
        hand_over(word, CHILD_SENT, how)?;
    }
}

/// The child of a word ping-pong, killed and reaped when dropped unless it has
/// already been reaped.
struct WordChild(Child);

impl Drop for WordChild {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `futex-ping` or `spin-ping`: `count` round trips parent → child → parent over one
/// shared word (fewer if [`TIME_BUDGET`] runs out first; the figure says how many).
fn word_ping(how: Waiting, count: u64) -> std::io::Result<Figure> {
    let shared = SharedWord::new().map_err(std::io::Error::other)?;
    let word = shared.word();
    let mut child = WordChild(start_child(how.name(), shared.fd().try_clone_to_owned()?)?);
    let mut answers = 0u64;
    let mut asked_at = Instant::now();
    let mut round_trip = |child: &mut WordChild| -> std::io::Result<()> {
        hand_over(word, PARENT_SENT, how)?;
        asked_at = Instant::now();
        let mut child_alive = || {
            if let Some(status) = child.0.try_wait()? {
                return Err(std::io::Error::other(format!(
                    "the {} ping child exited ({status}) after {answers} answers",
                    how.name()
                )));
            }
            if asked_at.elapsed() >= ANSWER_LIMIT {
                return Err(std::io::Error::other(format!(
                    "the {} ping child did not answer for {ANSWER_LIMIT:?}",
                    how.name()
                )));
            }
            Ok(())
        };
        wait_for(word, CHILD_SENT, how, &mut child_alive)?;
        answers += 1;
        Ok(())
    };
    // Warm up (the first answer waits for the child's exec), then time.
    for _ in 0..100 {
        round_trip(&mut child)?;
    }
    let mut done = 0u64;
    let start = Instant::now();
    // The clock is read every 16 round trips: a spinning one costs little more.
    while done < count && (done % 16 != 0 || start.elapsed() < TIME_BUDGET) {
        round_trip(&mut child)?;
        done += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    // Always wake: the child may have fallen back to sleeping.
    hand_over(word, STOP, Waiting::Futex)?;
    let status = child.0.wait()?;
    if !status.success() {
        return Err(std::io::Error::other(format!(
            "the {} ping child failed ({status})",
            how.name()
        )));
    }
    let scenario = match how {
        Waiting::Futex => "futex-ping",
        Waiting::Spin => "spin-ping",
    };
    Ok(Figure::floor(
        scenario,
        None,
        done,
        seconds,
        Some(seconds * 1e6 / done as f64),
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
    let mut figures = vec![
        ping(scaled(20_000))?,
        word_ping(Waiting::Futex, scaled(20_000))?,
        word_ping(Waiting::Spin, scaled(20_000))?,
    ];
    for (bytes, count) in [
        // As many as `bench`'s fresh 4 KiB tensors.
        (4u64 << 10, 200_000u64),
        (1 << 20, 500),
        (64 << 20, 20),
        (256 << 20, 5),
    ] {
        figures.push(fill_sum(bytes, scaled(count)));
    }
    figures.push(memcpy(64 << 20, scaled(20)));
    Ok(figures)
}
