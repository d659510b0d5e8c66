//! This process's shared storages by where their bytes are, so that a received handle
//! naming bytes this process already has finds the same [`Storage`] (and aliasing
//! survives a round trip).

use std::sync::Arc;

use super::backing::StorageInner;
use crate::identity_cache::IdentityCache;
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
pub(super) type StorageCache = IdentityCache<StorageKey, StorageInner>;

static STORAGES: crate::sys::fork_local::ForkLocal<StorageCache> =
    crate::sys::fork_local::ForkLocal::new();

pub(super) fn with_storage_cache<R>(f: impl FnOnce(&mut StorageCache) -> R) -> R {
    f(&mut STORAGES.lock())
}
