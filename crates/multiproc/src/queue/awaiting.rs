//! The queues' awaitable operations (feature `async`; the wake-up path is
//! `sys::reactor`'s).
//!
//! Every future here is a loop of *read the word, try the non-blocking form, park on
//! the word if nothing*: a message is only ever taken by a synchronous `try_get` whose
//! result the future returns at once, and a bounded queue's place only ever by a
//! synchronous `try_put` that sends (or gives the place back) before it returns. So
//! dropping a future at any await point loses no message and leaks no place; its
//! registration is removed by its drop (which passes on a wake-up it received and did
//! not use, so no other waiter is left asleep beside a message).
//!
//! A get that parks also waits on its queue's holder watch (`reactor::CloseWatch`,
//! one per channel value in this process, made when a get first polls): every
//! holder that leaves closes its description of the holder lease file, a SIGKILLed
//! one too (the kernel closes a dead process's fds), and the fd reactor's inotify
//! instance wakes the waiting gets at each close. Each then asks afresh whether any
//! other holder is left: [`Error::Disconnected`] at once. (One that drops its handle
//! also rings the ring's `SEQ`.) A get reads the watch's count of closes before its
//! tries and checks it again once its waker is registered there, so a holder that
//! leaves in between is seen either way.
//!
//! Nothing else wakes a parked get: idle, it costs nothing (no timer). It looks again
//! after `reactor::RECHECK` (1 s) only when something it waits for wakes nobody: a
//! message this value keeps back because the queue's custody was busy (its stopped
//! holders let go without a wake-up), or a killed holder where the kernel refused an
//! inotify watch. A packet that reached the socket without a `put` (something other
//! than multiproc wrote it) wakes nobody either, and is met at the get's next wake-up
//! (the next `put`, a holder leaving), in its place in the order, as a forged ring
//! record is.

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::bounded::Queue;
use super::channel::Channel;
use super::joinable::JoinableQueue;
use super::layout::{FREE_PLACES, PLACE_WAITERS, UNFINISHED};
use super::simple::SimpleQueue;
use crate::error::{Error, PutError, Result};
use crate::sys::reactor::{self, Parked, Ready, Step, WatchSeat, WordWait};

/// The step of an awaited get: `wait` read before the tries; `try_get(thorough)` takes
/// the next item. The first try is a plain `try_get` (no system call when a message is
/// in the ring); a get that finds nothing tries once more thoroughly before it parks
/// (the socket whatever the lane says, other holders asked afresh), so neither
/// `Disconnected` nor a packet written on the socket without a `put` is missed at a
/// wake-up.
fn get_step<'a, T>(
    wait: WordWait,
    mut try_get: impl FnMut(bool) -> Result<Option<T>>,
) -> Step<'a, Result<T>> {
    let got = match try_get(false) {
        Ok(None) => try_get(true),
        other => other,
    };
    match got {
        Ok(Some(item)) => Step::Done(Ok(item)),
        Ok(None) => Step::Word(wait),
        Err(e) => Step::Done(Err(e)),
    }
}

/// The poll of an awaited get on `channel`, whose tries are `try_get(thorough)`; `seat`
/// is its place among the waiters of the channel's holder watch. A get that parks
/// waits on the watch too, and one that the watch woke tries even though its word
/// registration still waits; a close that came between its look at the watch and its
/// registration there is looked for once more before it parks.
fn poll_get<T>(
    cx: &mut Context<'_>,
    parked: &mut Option<Parked>,
    seat: &mut WatchSeat,
    channel: &Channel,
    mut try_get: impl FnMut(bool) -> Result<Option<T>>,
) -> Poll<Result<T>> {
    let watch = channel.holder_watch();
    let rang = watch.is_some_and(|w| w.closed_since(seat));
    let waker = cx.waker().clone();
    reactor::poll_step_rung(
        cx,
        parked,
        rang,
        || match get_step(channel.get_wait(), &mut try_get) {
            Step::Word(mut wait) => {
                // Without a watch, a killed last holder is heard of only by looking.
                wait.recheck = watch.is_none() || channel.needs_recheck();
                match watch {
                    Some(w) if !w.wait(seat, &waker) => match try_get(true) {
                        Ok(Some(item)) => Step::Done(Ok(item)),
                        Ok(None) => {
                            wait.recheck |= channel.needs_recheck();
                            Step::Word(wait)
                        }
                        Err(e) => Step::Done(Err(e)),
                    },
                    _ => Step::Word(wait),
                }
            }
            other => other,
        },
        Err,
    )
}

impl<T: Serialize + DeserializeOwned> Queue<T> {
    /// Takes the next item, as [`get`](Self::get) does, without blocking a thread
    /// while the queue is empty (feature `async`; any executor).
    ///
    /// Cancel-safe: a future dropped before it completes has taken nothing.
    ///
    /// # Errors
    /// As [`get`](Self::get). [`Error::Disconnected`] comes as soon as the last other
    /// holder drops the queue or is killed (see the crate docs, "Async").
    pub async fn get_async(&self) -> Result<T> {
        let mut parked: Option<Parked> = None;
        let mut seat = WatchSeat::default();
        poll_fn(|cx| {
            poll_get(
                cx,
                &mut parked,
                &mut seat,
                &self.shared.channel,
                |thorough| self.shared.try_get_as(&|| self.others_here(), thorough),
            )
        })
        .await
    }

    /// Puts `item`, as [`put`](Self::put) does, without blocking a thread while a
    /// bounded queue is full (or the socket behind the ring is).
    ///
    /// Cancel-safe as far as the queue goes: a future dropped before it completes has
    /// put nothing and holds no place (the item is dropped with it).
    ///
    /// # Errors
    /// As [`put`](Self::put); the item comes back in the error.
    pub async fn put_async(&self, item: T) -> Result<(), PutError<T>> {
        let mut item = Some(item);
        let mut parked: Option<Parked> = None;
        poll_fn(|cx| {
            if parked.as_ref().is_some_and(|p| p.still_waiting(cx.waker())) {
                return Poll::Pending;
            }
            if let Some(p) = parked.take() {
                p.settle();
            }
            loop {
                // Only empty once this future has completed, which `await` never polls.
                let Some(it) = item.take() else {
                    return Poll::Pending;
                };
                let places = self.shared.block.word(FREE_PLACES).load(Ordering::SeqCst);
                let back = match self.try_put(it) {
                    Ok(()) => return Poll::Ready(Ok(())),
                    Err(PutError {
                        error: Error::Full(_),
                        item,
                    }) => item,
                    Err(e) => return Poll::Ready(Err(e)),
                };
                let registered = if self.shared.bounded() && places == 0 {
                    reactor::park_word(
                        WordWait {
                            host: Arc::clone(&self.shared.block) as _,
                            index: FREE_PLACES,
                            expected: 0,
                            counted_in: Some(PLACE_WAITERS),
                            recheck: false,
                            wake_by: None,
                        },
                        cx.waker(),
                    )
                } else {
                    // Room in the count, none on the socket: wait until it takes more.
                    reactor::park_fd(self.shared.channel.tx(), Ready::Writable, cx.waker())
                        .map(Some)
                };
                match registered {
                    Ok(Some(p)) => {
                        parked = Some(p);
                        item = Some(back);
                        return Poll::Pending;
                    }
                    Ok(None) => item = Some(back),
                    Err(error) => return Poll::Ready(Err(PutError { error, item: back })),
                }
            }
        })
        .await
    }
}

impl<T: Serialize + DeserializeOwned> SimpleQueue<T> {
    /// Takes the next item, as [`get`](Self::get) does, without blocking a thread
    /// while the queue is empty (feature `async`; any executor). Cancel-safe, as
    /// [`Queue::get_async`].
    ///
    /// # Errors
    /// As [`Queue::get_async`].
    pub async fn get_async(&self) -> Result<T> {
        let mut parked: Option<Parked> = None;
        let mut seat = WatchSeat::default();
        poll_fn(|cx| {
            poll_get(cx, &mut parked, &mut seat, &self.channel, |thorough| {
                self.channel.try_get_as(&|| self.others_here(), thorough)
            })
        })
        .await
    }
}

impl<T> SimpleQueue<T> {
    /// The word an awaited get parks on, to be read *before* a try (`try_get`) that
    /// found nothing: the data loader's stream takes its workers' replies through its
    /// own tries (which also look for dead workers) and parks here in between.
    pub(crate) fn get_wait(&self) -> WordWait {
        self.channel.get_wait()
    }

    /// Whether a wait that found nothing must be re-checked (see
    /// `Channel::needs_recheck`), asked after the tries.
    pub(crate) fn needs_recheck(&self) -> bool {
        self.channel.needs_recheck()
    }
}

impl<T: Serialize + DeserializeOwned> JoinableQueue<T> {
    /// Takes the next item, as [`Queue::get_async`] does.
    ///
    /// # Errors
    /// As [`Queue::get_async`].
    pub async fn get_async(&self) -> Result<T> {
        self.queue.get_async().await
    }

    /// Waits until every item put has been marked done, as [`join`](Self::join) does,
    /// without blocking a thread.
    ///
    /// # Errors
    /// When the reactor thread cannot be started.
    pub async fn join_async(&self) -> Result<()> {
        let mut parked: Option<Parked> = None;
        let block = &self.queue.shared.block;
        poll_fn(|cx| {
            reactor::poll_step(
                cx,
                &mut parked,
                || match block.word(UNFINISHED).load(Ordering::SeqCst) {
                    0 => Step::Done(Ok(())),
                    left => Step::Word(WordWait {
                        host: Arc::clone(block) as _,
                        index: UNFINISHED,
                        expected: left,
                        counted_in: None,
                        recheck: false,
                        wake_by: None,
                    }),
                },
                Err,
            )
        })
        .await
    }
}
