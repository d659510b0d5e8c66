//! This process's shared storages by where their bytes are, so that a received handle
//! naming bytes this process already has finds the same [`Storage`] (and aliasing
//! survives a round trip).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::Storage;
use super::backing::StorageInner;
use crate::shm::Segment;

/// Where a shared storage's bytes are: its segment (by address: an entry is alive only
/// while its storage, and so its segment, is), offset and length.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct StorageKey(pub(super) usize, pub(super) usize, pub(super) usize);

impl StorageKey {
    pub(super) fn new(segment: &Arc<Segment>, offset: usize, nbytes: usize) -> StorageKey {
        StorageKey(Arc::as_ptr(segment) as usize, offset, nbytes)
    }
}

/// This process's shared storages, so a received handle finds the `Storage` it names.
/// `Weak` entries; dead ones are swept when the table has doubled.
pub(super) struct StorageCache {
    pub(super) entries: HashMap<StorageKey, Weak<StorageInner>>,
    sweep_at: usize,
}

impl StorageCache {
    pub(super) fn put(&mut self, key: StorageKey, storage: &Storage) {
        self.entries.insert(key, Arc::downgrade(&storage.inner));
        if self.entries.len() >= self.sweep_at {
            self.entries.retain(|_, w| w.strong_count() > 0);
            self.sweep_at = (self.entries.len() * 2).max(64);
        }
    }
}

static STORAGES: crate::sys::fork_local::ForkLocal<Option<StorageCache>> =
    crate::sys::fork_local::ForkLocal::new();

pub(super) fn with_storage_cache<R>(f: impl FnOnce(&mut StorageCache) -> R) -> R {
    let mut guard = STORAGES.lock();
    f(guard.get_or_insert_with(|| StorageCache {
        entries: HashMap::new(),
        sweep_at: 64,
    }))
}
