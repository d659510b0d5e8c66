//! [`AsyncResult`]: the handle to one task's result ([`Pool::apply_async`](super::Pool::apply_async)).

use std::sync::mpsc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::state::{ChunkOutcome, dispatcher_gone};
use crate::error::{Error, Result};

/// The result of [`Pool::apply_async`](super::Pool::apply_async).
pub struct AsyncResult<R> {
    pub(super) rx: mpsc::Receiver<ChunkOutcome>,
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

    /// Waits at most `timeout` (`None`: as long as it takes) for the result.
    ///
    /// # Errors
    /// [`Error::TaskFailed`] when the task panicked, returned `Err` or its worker died;
    /// [`Error::Timeout`] when it did not finish in time (call again to keep waiting).
    pub fn get(&mut self, timeout: Option<Duration>) -> Result<R> {
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
}

pub(super) fn first_result<R: DeserializeOwned>((_, results): ChunkOutcome) -> Result<R> {
    results
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(dispatcher_gone()))
        .and_then(|o| o.decode::<R>(&crate::shm::Returns::plain()))
}
