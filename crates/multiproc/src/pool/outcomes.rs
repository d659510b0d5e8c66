//! The channel that carries one job's chunk outcomes from the dispatcher thread to the
//! caller's result handle ([`AsyncResult`](super::AsyncResult),
//! [`MapResult`](super::MapResult), [`Imap`](super::Imap), the blocking `map`).
//!
//! It replaces `std::sync::mpsc` because an mpsc receiver cannot be awaited: besides the
//! blocking waits (a `Condvar`) it keeps the [`Waker`] of the one future, if any, that
//! waits on it (feature `async`), so the dispatcher's `send` wakes a parked
//! `get_async` directly — no thread per wait, no timer.
//!
//! **What it owns.** One [`OutcomeSender`] (kept in the pool's job table, dropped when
//! the job ends or the dispatcher clears the table on its way out) and one
//! [`OutcomeReceiver`] (kept by the result handle), sharing a mutex over the outcomes
//! not yet received, a "sender gone" flag and the waiting future's waker.
//!
//! **Invariants.**
//! - Outcomes are received in the order they were sent, each exactly once: only a
//!   receive that returns it takes it out of the queue, so an awaiting future that is
//!   dropped before it completes has taken nothing (the caller's handle, not the future,
//!   keeps what it took).
//! - As with mpsc, "disconnected" is reported only when the queue is empty *and* the
//!   sender is gone: outcomes sent before the sender was dropped are still received.
//! - Every `send` and the sender's drop notify the condvar and wake the stored waker
//!   (taken out, so each registration is woken once; a future polled again stores its
//!   waker afresh). Both happen under the mutex that a waiter checks the queue under,
//!   so no wake-up is lost between a waiter's check and its sleep.
//! - A poisoned mutex is used as is: every critical section leaves the state whole
//!   (a push, a pop, a flag, a waker swap).

use std::collections::VecDeque;
use std::sync::mpsc::{RecvError, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::Waker;
#[cfg(feature = "async")]
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::wire::Opaque;

/// A chunk's outcome on its way to the caller: `(first index, per-task results)`.
pub(super) type ChunkOutcome = (usize, Vec<Result<Opaque>>);

struct Chan {
    queue: VecDeque<ChunkOutcome>,
    sender_gone: bool,
    /// The waker of the future parked on this channel, if any (at most one: the
    /// receiver is used through `&mut` of its handle).
    waker: Option<Waker>,
}

struct Inner {
    chan: Mutex<Chan>,
    arrived: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Chan> {
        self.chan.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A new channel for one job.
pub(super) fn channel() -> (OutcomeSender, OutcomeReceiver) {
    let inner = Arc::new(Inner {
        chan: Mutex::new(Chan {
            queue: VecDeque::new(),
            sender_gone: false,
            waker: None,
        }),
        arrived: Condvar::new(),
    });
    (
        OutcomeSender {
            inner: Arc::clone(&inner),
        },
        OutcomeReceiver { inner },
    )
}

/// The dispatcher's end. Dropping it tells the receiver that no more outcomes come.
pub(super) struct OutcomeSender {
    inner: Arc<Inner>,
}

impl OutcomeSender {
    /// Queues `outcome` for the receiver and wakes it. (A receiver already dropped just
    /// leaves it to be freed with the channel: nobody asks for it any more.)
    pub(super) fn send(&self, outcome: ChunkOutcome) {
        let waker = {
            let mut chan = self.inner.lock();
            chan.queue.push_back(outcome);
            chan.waker.take()
        };
        self.inner.arrived.notify_all();
        // Woken outside the lock: a waker may run the task inline (some executors do).
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Drop for OutcomeSender {
    fn drop(&mut self) {
        let waker = {
            let mut chan = self.inner.lock();
            chan.sender_gone = true;
            chan.waker.take()
        };
        self.inner.arrived.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The result handle's end.
pub(super) struct OutcomeReceiver {
    inner: Arc<Inner>,
}

impl OutcomeReceiver {
    /// The next outcome if one is there.
    pub(super) fn try_recv(&self) -> Result<ChunkOutcome, TryRecvError> {
        let mut chan = self.inner.lock();
        match chan.queue.pop_front() {
            Some(o) => Ok(o),
            None if chan.sender_gone => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Waits for the next outcome as long as it takes.
    pub(super) fn recv(&self) -> Result<ChunkOutcome, RecvError> {
        let mut chan = self.inner.lock();
        loop {
            if let Some(o) = chan.queue.pop_front() {
                return Ok(o);
            }
            if chan.sender_gone {
                return Err(RecvError);
            }
            chan = self
                .inner
                .arrived
                .wait(chan)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits at most `timeout` for the next outcome.
    pub(super) fn recv_timeout(&self, timeout: Duration) -> Result<ChunkOutcome, RecvTimeoutError> {
        // A timeout too large for an `Instant` is as good as none.
        let deadline = Instant::now().checked_add(timeout);
        let mut chan = self.inner.lock();
        loop {
            if let Some(o) = chan.queue.pop_front() {
                return Ok(o);
            }
            if chan.sender_gone {
                return Err(RecvTimeoutError::Disconnected);
            }
            chan = match deadline {
                None => self
                    .inner
                    .arrived
                    .wait(chan)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(RecvTimeoutError::Timeout);
                    }
                    self.inner
                        .arrived
                        .wait_timeout(chan, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }

    /// The next outcome if one is there; otherwise registers `cx`'s waker, which the
    /// next `send` or the sender's drop wakes. (Checked and registered under one lock,
    /// so a send cannot slip in between.)
    #[cfg(feature = "async")]
    pub(super) fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Result<ChunkOutcome, RecvError>> {
        let mut chan = self.inner.lock();
        if let Some(o) = chan.queue.pop_front() {
            return Poll::Ready(Ok(o));
        }
        if chan.sender_gone {
            return Poll::Ready(Err(RecvError));
        }
        match &mut chan.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(first: usize) -> ChunkOutcome {
        (first, Vec::new())
    }

    #[test]
    fn in_order_then_disconnected_only_when_drained() {
        let (tx, rx) = channel();
        tx.send(outcome(1));
        tx.send(outcome(2));
        drop(tx);
        assert_eq!(rx.try_recv().map(|o| o.0), Ok(1));
        assert_eq!(rx.recv().map(|o| o.0), Ok(2));
        assert_eq!(rx.try_recv().map(|o| o.0), Err(TryRecvError::Disconnected));
        assert_eq!(rx.recv().map(|o| o.0), Err(RecvError));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).map(|o| o.0),
            Err(RecvTimeoutError::Disconnected)
        );
    }

    #[test]
    fn blocking_waits_time_out_and_wake_on_send_and_on_drop() {
        let (tx, rx) = channel();
        assert_eq!(rx.try_recv().map(|o| o.0), Err(TryRecvError::Empty));
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(20)).map(|o| o.0),
            Err(RecvTimeoutError::Timeout)
        );
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(outcome(7));
            std::thread::sleep(Duration::from_millis(20));
            drop(tx);
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(30)).map(|o| o.0), Ok(7));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(30)).map(|o| o.0),
            Err(RecvTimeoutError::Disconnected)
        );
        sender.join().unwrap();
    }

    #[cfg(feature = "async")]
    #[test]
    fn poll_recv_registers_and_is_woken_by_send_and_by_drop() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::Wake;

        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let (tx, rx) = channel();
        assert!(rx.poll_recv(&mut cx).is_pending());
        // Polled again before anything came: one registration, woken once.
        assert!(rx.poll_recv(&mut cx).is_pending());
        tx.send(outcome(3));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(rx.poll_recv(&mut cx), Poll::Ready(Ok((3, _)))));
        assert!(rx.poll_recv(&mut cx).is_pending());
        drop(tx);
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        assert!(matches!(rx.poll_recv(&mut cx), Poll::Ready(Err(RecvError))));
    }
}
