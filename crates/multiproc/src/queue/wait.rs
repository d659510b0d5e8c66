//! [`wait`]: one blocking wait on queues, pipe ends and processes together, like
//! Python's `multiprocessing.connection.wait([q._reader, p.sentinel])`, and the
//! [`Waitable`] trait of what it takes.
//!
//! **Ready** means: a queue, that a get would not wait (an item is there, or the queue
//! is disconnected or closed, which the get then says); a pipe end or any fd, that it
//! is readable (an item, or the other end hung up); a process, that it has exited (its
//! pidfd is readable). Readiness only: nothing is taken, nothing is reaped.
//!
//! **How it sleeps.** A queue's getters sleep on its ring's `SEQ` word, which every
//! publication bumps (waking one sleeper when `GET_WAITERS` counts one) and every
//! holder that leaves bumps (waking all). So the wait reads every queue's `SEQ`, *then*
//! looks at everything, and sleeps in one `futex_waitv` over the values it read,
//! counted in each queue's `GET_WAITERS` like a sleeping get: a put between the read
//! and the sleep changed the word, so the sleep returns at once (no lost wake-up). A
//! futex cannot be polled beside fds, so when fds are waited on with queues, a helper
//! thread (one per call, started only once the first look found nothing) sits in
//! `poll` over the fds and an eventfd, and bumps and wakes a word of the same
//! `futex_waitv` when an fd is ready; the eventfd ends it when the wait returns.
//! Without queues the wait is one `poll`.
//!
//! **Re-checks.** Like a blocking get, a wait on queues also looks again every
//! `SOCKET_RECHECK` (20 ms) while nothing wakes it: that is when it hears of a queue
//! whose last other holder was SIGKILLed (one that drops its handle wakes it at once)
//! and of a packet that reached a queue's socket without a put. Processes and fds wake
//! it at once.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::bounded::Queue;
use super::channel::Channel;
use super::joinable::JoinableQueue;
use super::pipe::Connection;
use super::ring::SOCKET_RECHECK;
use super::simple::SimpleQueue;
use crate::error::{Error, Result};
use crate::sys::futex::{self, WaitOn};
use crate::sys::socket::poll_readable;
use crate::sys::{Deadline, deadline_after};

/// What [`wait`] waits on: a queue ([`Queue`], [`SimpleQueue`], [`JoinableQueue`]), a
/// pipe end ([`Connection`]), a [`Process`](crate::Process) (ready once it has
/// exited), or an fd (`BorrowedFd`, `OwnedFd`, `dyn AsFd`: ready when readable).
/// Different kinds mix as `&[&q as &dyn Waitable, &p]`.
///
/// Implemented by multiproc's types only (its method names a type of multiproc's own).
pub trait Waitable {
    /// What to watch.
    #[doc(hidden)]
    fn wait_source(&self) -> source::Source<'_>;
}

pub(crate) mod source {
    use std::os::fd::BorrowedFd;

    /// What a [`Waitable`](super::Waitable) is, to [`wait`](super::wait).
    pub struct Source<'a>(pub(crate) super::Kind<'a>);

    impl<'a> Source<'a> {
        /// Ready when `fd` is readable.
        pub(crate) fn fd(fd: BorrowedFd<'a>) -> Self {
            Source(super::Kind::Fd(fd))
        }
    }
}

/// A queue as [`wait`] sees it: its channel, and whether another handle of it exists
/// in this process (so that "nobody left to put" is told as a get tells it).
pub(crate) trait GetReady {
    fn channel(&self) -> &Channel;
    fn others_here(&self) -> bool;
}

pub(crate) enum Kind<'a> {
    Fd(BorrowedFd<'a>),
    Queue(&'a dyn GetReady),
}

impl<W: Waitable + ?Sized> Waitable for &W {
    fn wait_source(&self) -> source::Source<'_> {
        (**self).wait_source()
    }
}

impl Waitable for dyn AsFd + '_ {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source::fd(self.as_fd())
    }
}

impl Waitable for BorrowedFd<'_> {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source::fd(self.as_fd())
    }
}

impl Waitable for OwnedFd {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source::fd(self.as_fd())
    }
}

impl<T> Waitable for Connection<T> {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source::fd(self.as_fd())
    }
}

impl<T: Serialize + DeserializeOwned> GetReady for Queue<T> {
    fn channel(&self) -> &Channel {
        &self.shared.channel
    }
    fn others_here(&self) -> bool {
        Queue::others_here(self)
    }
}

impl<T: Serialize + DeserializeOwned> Waitable for Queue<T> {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source(Kind::Queue(self))
    }
}

impl<T: Serialize + DeserializeOwned> GetReady for SimpleQueue<T> {
    fn channel(&self) -> &Channel {
        &self.channel
    }
    fn others_here(&self) -> bool {
        SimpleQueue::others_here(self)
    }
}

impl<T: Serialize + DeserializeOwned> Waitable for SimpleQueue<T> {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source(Kind::Queue(self))
    }
}

impl<T: Serialize + DeserializeOwned> Waitable for JoinableQueue<T> {
    fn wait_source(&self) -> source::Source<'_> {
        source::Source(Kind::Queue(&self.queue))
    }
}

/// Waits until at least one of `objects` is ready, at most `timeout` (`None`: as long
/// as it takes), like Python's `multiprocessing.connection.wait`, and returns the
/// indices of the ready ones, in order. Ready: a queue has an item (or is disconnected
/// or closed, which its get then says), a pipe end or fd is readable (an item, or the
/// other end hung up), a [`Process`](crate::Process) has exited. Nothing is taken or
/// reaped: get the item, join the process, afterwards.
///
/// Mix kinds as `&[&q as &dyn Waitable, &p]` (or `&dyn AsFd` for fds alone). It sleeps
/// until something happens (see [`Waitable`] for what counts), except that with queues
/// among the objects it looks again every 20 ms, as a blocking get does, to hear of a
/// queue whose last other holder was killed.
///
/// # Errors
/// [`Error::Timeout`] when none was ready in time; [`Error::InvalidArgument`] for more
/// than 127 queues; an [`Error::Os`] when the kernel refuses the wait.
///
/// # Examples
///
/// A queue and a process: whichever comes first, an item or the end of the worker.
///
/// ```no_run
/// use std::time::Duration;
/// use multiproc::connection::{Waitable, wait};
/// use multiproc::{Process, Queue};
///
/// fn produce(_rank: usize, q: Queue<u32>) -> multiproc::Result<()> {
///     q.put(7)?;
///     Ok(())
/// }
///
/// fn main() -> multiproc::Result<()> {
///     multiproc::init();
///     let q = Queue::with_capacity(4)?;
///     let mut p = Process::builder(produce, 0, q.clone()).name("producer").start()?;
///     let ready = wait(&[&q as &dyn Waitable, &p], Some(Duration::from_secs(10)))?;
///     if ready.contains(&0) {
///         assert_eq!(q.get()?, 7); // still there: wait took nothing
///     }
///     p.join()?;
///     Ok(())
/// }
/// ```
///
/// Pipe ends:
///
/// ```
/// use std::os::fd::AsFd;
/// use std::time::Duration;
/// let (a, a_peer) = multiproc::pipe::<u8>()?;
/// let (b, b_peer) = multiproc::pipe::<String>()?;
/// b_peer.send("ready".into())?;
/// let ready = multiproc::connection::wait(&[&a as &dyn AsFd, &b], Some(Duration::from_secs(5)))?;
/// assert_eq!(ready, [1]);
/// # drop((a_peer, a));
/// # Ok::<(), multiproc::Error>(())
/// ```
pub fn wait<W: Waitable>(objects: &[W], timeout: Option<Duration>) -> Result<Vec<usize>> {
    let deadline = deadline_after(timeout);
    let sources: Vec<source::Source<'_>> = objects.iter().map(Waitable::wait_source).collect();
    let mut fds = Vec::new();
    let mut queues = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        match &s.0 {
            Kind::Fd(fd) => fds.push((i, *fd)),
            Kind::Queue(q) => queues.push((i, *q)),
        }
    }
    let ready = if queues.is_empty() {
        let only: Vec<BorrowedFd<'_>> = fds.iter().map(|&(_, fd)| fd).collect();
        let ready = poll_readable(&only, deadline)?;
        fds.iter()
            .zip(ready)
            .filter(|(_, r)| *r)
            .map(|(&(i, _), _)| i)
            .collect()
    } else {
        wait_with_queues(&queues, &fds, deadline)?
    };
    if ready.is_empty() {
        return Err(Error::timeout(
            format!(
                "a wait on {} queues, connections or processes",
                objects.len()
            ),
            timeout,
        ));
    }
    Ok(ready)
}

/// [`wait`] when queues are among the objects: the indices of the ready ones, empty at
/// the deadline (see the module docs).
fn wait_with_queues(
    queues: &[(usize, &dyn GetReady)],
    fds: &[(usize, BorrowedFd<'_>)],
    deadline: Deadline,
) -> Result<Vec<usize>> {
    if queues.len() >= futex::WAITV_MAX {
        return Err(Error::InvalidArgument(format!(
            "connection::wait on {} queues: at most {} can be waited on together",
            queues.len(),
            futex::WAITV_MAX - 1
        )));
    }
    let only: Vec<BorrowedFd<'_>> = fds.iter().map(|&(_, fd)| fd).collect();
    // Bumped (and woken) by the helper when an fd is ready.
    let fd_word = AtomicU32::new(0);
    let mut helper: Option<OwnedFd> = None;
    std::thread::scope(|scope| {
        let result = (|| loop {
            let seen: Vec<u32> = queues
                .iter()
                .map(|(_, q)| q.channel().get_words().0.load(Ordering::SeqCst))
                .collect();
            let fd_seen = fd_word.load(Ordering::SeqCst);
            let mut ready: Vec<usize> = Vec::new();
            if !only.is_empty() {
                let now = poll_readable(&only, Some(Instant::now()))?;
                ready.extend(
                    fds.iter()
                        .zip(now)
                        .filter(|(_, r)| *r)
                        .map(|(&(i, _), _)| i),
                );
            }
            ready.extend(
                queues
                    .iter()
                    .filter(|(_, q)| q.channel().get_would_not_wait(&|| q.others_here()))
                    .map(|&(i, _)| i),
            );
            if !ready.is_empty() {
                ready.sort_unstable();
                return Ok(ready);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(ready);
            }
            if !only.is_empty() && helper.is_none() {
                let stop = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
                    .map_err(|e| Error::os("making the eventfd of connection::wait", e))?;
                let watch = stop
                    .try_clone()
                    .map_err(|e| Error::os("duplicating the eventfd of connection::wait", e))?;
                let (only, fd_word) = (&only, &fd_word);
                scope.spawn(move || watch_fds(only, watch.as_fd(), fd_word));
                helper = Some(stop);
            }
            let mut words: Vec<WaitOn<'_>> = queues
                .iter()
                .zip(&seen)
                .map(|((_, q), &expected)| WaitOn {
                    word: q.channel().get_words().0,
                    expected,
                })
                .collect();
            if helper.is_some() {
                words.push(WaitOn {
                    word: &fd_word,
                    expected: fd_seen,
                });
            }
            for (_, q) in queues {
                q.channel().get_words().1.fetch_add(1, Ordering::SeqCst);
            }
            let slice = now + SOCKET_RECHECK;
            let slept = futex::wait_any(&words, Some(deadline.map_or(slice, |d| d.min(slice))));
            for (_, q) in queues {
                q.channel().get_words().1.fetch_sub(1, Ordering::SeqCst);
            }
            slept?;
        })();
        if let Some(stop) = &helper {
            // Ends the helper's poll; the scope joins it.
            let _ = rustix::io::write(stop, &1u64.to_ne_bytes());
        }
        result
    })
}

/// The helper of a wait on queues and fds: polls the fds and `stop`, and when one is
/// ready, bumps and wakes `word`, on which the waiting thread sleeps.
fn watch_fds(fds: &[BorrowedFd<'_>], stop: BorrowedFd<'_>, word: &AtomicU32) {
    let mut all = fds.to_vec();
    all.push(stop);
    if let Err(e) = poll_readable(&all, None) {
        // The waiting thread still looks at the fds on each of its re-checks.
        tracing::debug!("multiproc: connection::wait's poll of its fds failed: {e}");
        return;
    }
    word.fetch_add(1, Ordering::SeqCst);
    futex::wake_all(word);
}
