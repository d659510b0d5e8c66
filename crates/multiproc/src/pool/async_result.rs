//! [`AsyncResult`]: the handle to one task's result ([`Pool::apply_async`](super::Pool::apply_async)).

use std::sync::mpsc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::outcomes::{ChunkOutcome, OutcomeReceiver};
use super::state::dispatcher_gone;
use crate::error::{Error, Result};

/// The result of [`Pool::apply_async`](super::Pool::apply_async).
pub struct AsyncResult<R> {
    pub(super) rx: OutcomeReceiver,
    pub(super) value: Option<Result<R>>,
    pub(super) _r: std::marker::PhantomData<R>,
}

impl<R: Serialize + DeserializeOwned> AsyncResult<R> {
    /// Whether the result has arrived.
    pub fn ready(&mut self) -> bool {
        if self.value.is_none() {
            if let Ok(outcome) = self.rx.try_recv() {
                self.value = Some(first_result(outcome));
            }
        }
        self.value.is_some()
    }

    /// Waits for the result, as long as it takes. [`ready`](Self::ready) is the look
    /// that never waits.
    ///
    /// # Errors
    /// [`Error::TaskFailed`] when the task panicked, returned `Err` or its worker died.
    pub fn get(&mut self) -> Result<R> {
        self.get_within(None)
    }

    /// Waits at most `timeout` for the result.
    ///
    /// # Errors
    /// [`Error::Timeout`] when it did not finish in time (call again to keep waiting);
    /// otherwise as [`get`](Self::get).
    pub fn get_timeout(&mut self, timeout: Duration) -> Result<R> {
        self.get_within(Some(timeout))
    }

    fn get_within(&mut self, timeout: Option<Duration>) -> Result<R> {
        if let Some(v) = self.value.take() {
            return v;
        }
        let outcome = match timeout {
            None => self.rx.recv().map_err(|_| dispatcher_gone())?,
            Some(t) => match self.rx.recv_timeout(t) {
                Ok(o) => o,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(Error::timeout("waiting for a pool task's result", Some(t)));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(dispatcher_gone()),
            },
        };
        first_result(outcome)
    }

    /// Waits for the result, as [`get`](Self::get) does, without blocking a
    /// thread (feature `async`; any executor). The dispatcher's hand-over of the
    /// outcome wakes the task: no thread per wait, no timer.
    ///
    /// Cancel-safe: a future dropped before it completes has taken nothing, so a later
    /// [`get`](Self::get) or `get_async` still returns the result.
    ///
    /// # Errors
    /// As [`get`](Self::get) (there is no timeout here: wrap the future in your
    /// runtime's timeout).
    #[cfg(feature = "async")]
    pub async fn get_async(&mut self) -> Result<R> {
        if let Some(v) = self.value.take() {
            return v;
        }
        // `poll_recv` takes an outcome only in the poll that returns it, and nothing is
        // awaited after that: the outcome is never left in a dropped future.
        let outcome = std::future::poll_fn(|cx| self.rx.poll_recv(cx))
            .await
            .map_err(|_| dispatcher_gone())?;
        first_result(outcome)
    }
}

pub(super) fn first_result<R: DeserializeOwned>((_, results): ChunkOutcome) -> Result<R> {
    results
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(dispatcher_gone()))
        .and_then(|o| o.decode::<R>(&crate::shm::Returns::plain()))
}
