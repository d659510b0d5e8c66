//! [`Imap`]: the lazy iterator of [`Pool::imap`] and [`Pool::imap_unordered`], which
//! keeps a window of tasks submitted ahead of what it has yielded.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::mpsc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::handle::Pool;
use super::state::{ChunkOutcome, dispatcher_gone, with_index};
use crate::error::{Error, Result};
use crate::wire::Opaque;

/// The iterator of [`Pool::imap`] and [`Pool::imap_unordered`]: yields `Result<R>` per
/// item (a failed task is an `Err` with its index; the others still come).
pub struct Imap<'p, A, R, E, I> {
    pub(super) pool: &'p Pool,
    pub(super) f: fn(A) -> std::result::Result<R, E>,
    pub(super) items: I,
    pub(super) ordered: bool,
    pub(super) job: Option<(u64, mpsc::Receiver<ChunkOutcome>)>,
    pub(super) submitted: usize,
    pub(super) yielded: usize,
    /// Results that arrived, by index, not yet yielded.
    pub(super) ready: BTreeMap<usize, Result<Opaque>>,
    pub(super) window: usize,
    pub(super) failed: Option<Error>,
}

impl<'p, A, R, E, I> Imap<'p, A, R, E, I>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
    I: Iterator<Item = A>,
{
    pub(super) fn new(
        pool: &'p Pool,
        f: fn(A) -> std::result::Result<R, E>,
        items: I,
        ordered: bool,
    ) -> Self {
        let (job, failed) = match pool.new_job() {
            Ok(j) => (Some(j), None),
            Err(e) => (None, Some(e)),
        };
        Self {
            pool,
            f,
            items,
            ordered,
            job,
            submitted: 0,
            yielded: 0,
            ready: BTreeMap::new(),
            window: pool.processes * 4,
            failed,
        }
    }

    /// Keeps up to `window` tasks submitted ahead of what has been yielded.
    pub(super) fn top_up(&mut self, job: u64) -> Result<()> {
        let mut batch = Vec::new();
        while self.submitted + batch.len() - self.yielded < self.window {
            match self.items.next() {
                Some(item) => batch.push(item),
                None => break,
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        let n = batch.len();
        self.pool.enqueue(job, self.f, batch, self.submitted, 1)?;
        self.submitted += n;
        Ok(())
    }
}

impl<A, R, E, I> Iterator for Imap<'_, A, R, E, I>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
    E: Display,
    I: Iterator<Item = A>,
{
    type Item = Result<R>;

    fn next(&mut self) -> Option<Result<R>> {
        if let Some(e) = self.failed.take() {
            return Some(Err(e));
        }
        let job = self.job.as_ref()?.0;
        if let Err(e) = self.top_up(job) {
            return Some(Err(e));
        }
        loop {
            if self.yielded == self.submitted {
                return None;
            }
            let pick = if self.ordered {
                self.ready
                    .contains_key(&self.yielded)
                    .then_some(self.yielded)
            } else {
                self.ready.keys().next().copied()
            };
            if let Some(index) = pick {
                let r = self
                    .ready
                    .remove(&index)
                    .unwrap_or_else(|| Err(dispatcher_gone()));
                self.yielded += 1;
                return Some(
                    r.and_then(|o| o.decode::<R>())
                        .map_err(|e| with_index(e, index)),
                );
            }
            let rx = &self.job.as_ref()?.1;
            match rx.recv() {
                Ok((first, results)) => {
                    for (k, r) in results.into_iter().enumerate() {
                        self.ready.insert(first + k, r);
                    }
                }
                Err(_) => return Some(Err(dispatcher_gone())),
            }
        }
    }
}

impl<A, R, E, I> Drop for Imap<'_, A, R, E, I> {
    fn drop(&mut self) {
        if let Some((job, _)) = &self.job {
            self.pool.end_job(*job);
        }
    }
}
