//! [`IdentityCache`]: this process's table of the live things it can find again by an
//! identity — its mappings by segment, its storages by where their bytes are, its
//! read-only files and CUDA allocations by inode or id, the blocks it has put into a
//! queue's custody.
//!
//! Every such table answers the same question ("do I already have the one named
//! so?") under the same rules, so they are one type:
//!
//! - **It keeps nothing alive.** An entry is a [`Weak`]: the thing lives exactly as
//!   long as its users hold it, and a lookup of a dead one is a miss.
//! - **Dead entries cost amortised O(1).** They are swept when the table has grown to
//!   twice its size after the last sweep (as a `HashMap` grows), never on every insert:
//!   a receiver holding 100,000 tensors pays one pass per doubling, not one per tensor.
//! - **The last hit is checked first.** A stream of tensors from one arena names the
//!   same segment again and again, and comparing a key costs less than hashing it.
//! - **The hash is fast and seeded.** Every message looks up or inserts a key or two,
//!   so SipHash (`std`'s default) cost about a tenth of a put+get; foldhash's seed,
//!   drawn per process, still keeps a peer from choosing keys that collide.
//!
//! A table is plain process-local bookkeeping: the caller holds it in a
//! `sys::fork_local::ForkLocal` (or a lock of its own) and a fork child starts with
//! an empty one.

use std::collections::HashMap;

use foldhash::fast::RandomState;
use std::hash::Hash;
use std::sync::{Arc, Weak};

/// Entries a table holds before its first sweep.
const FIRST_SWEEP: usize = 64;

/// Live things by identity, held weakly (see the module docs).
pub(crate) struct IdentityCache<K, V: ?Sized> {
    entries: HashMap<K, Weak<V>, RandomState>,
    /// The entry found or made last.
    last: Option<(K, Weak<V>)>,
    /// The size at which dead entries are swept next.
    sweep_at: usize,
}

impl<K, V: ?Sized> Default for IdentityCache<K, V> {
    fn default() -> Self {
        Self {
            entries: HashMap::default(),
            last: None,
            sweep_at: FIRST_SWEEP,
        }
    }
}

impl<K: Eq + Hash + Clone, V: ?Sized> IdentityCache<K, V> {
    /// The live thing under `key`, if there is one.
    pub(crate) fn get(&mut self, key: &K) -> Option<Arc<V>> {
        if let Some(live) = self.last_hit(key) {
            return Some(live);
        }
        let weak = self.entries.get(key)?;
        let live = weak.upgrade()?;
        self.last = Some((key.clone(), Weak::clone(weak)));
        Some(live)
    }

    /// Whether `value` itself (not merely something under the same key) is the entry
    /// under `key`.
    pub(crate) fn holds(&mut self, key: &K, value: &Arc<V>) -> bool {
        // `value` is alive, so a dead entry's address (its allocation stays while a
        // `Weak` points at it) can never be its address.
        let same = |weak: &Weak<V>| std::ptr::addr_eq(weak.as_ptr(), Arc::as_ptr(value));
        if let Some((last, weak)) = &self.last {
            if last == key && same(weak) {
                return true;
            }
        }
        let Some(weak) = self.entries.get(key).filter(|w| same(w)) else {
            return false;
        };
        self.last = Some((key.clone(), Weak::clone(weak)));
        true
    }

    /// The entry found or made last, if it is still alive.
    pub(crate) fn last(&self) -> Option<(&K, Arc<V>)> {
        let (key, weak) = self.last.as_ref()?;
        Some((key, weak.upgrade()?))
    }

    /// The live thing under `key`, or else `make()`'s, recorded under it: one hash of
    /// the key for both, where [`get`](Self::get) then [`insert`](Self::insert) cost two
    /// on a miss (every newly received storage).
    pub(crate) fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> Arc<V>) -> Arc<V> {
        use std::collections::hash_map::Entry;
        if let Some(live) = self.last_hit(&key) {
            return live;
        }
        let (value, weak) = match self.entries.entry(key.clone()) {
            Entry::Occupied(mut entry) => match entry.get().upgrade() {
                Some(live) => {
                    self.last = Some((key, Weak::clone(entry.get())));
                    return live;
                }
                None => {
                    let value = make();
                    entry.insert(Arc::downgrade(&value));
                    (value, Weak::clone(entry.get()))
                }
            },
            Entry::Vacant(entry) => {
                let value = make();
                entry.insert(Arc::downgrade(&value));
                let weak = Arc::downgrade(&value);
                (value, weak)
            }
        };
        self.recorded(key, weak);
        value
    }

    /// The entry found or made last, when it is `key`'s and alive: a stream from one
    /// arena is found without hashing.
    fn last_hit(&self, key: &K) -> Option<Arc<V>> {
        let (last, weak) = self.last.as_ref()?;
        if last == key { weak.upgrade() } else { None }
    }

    /// `weak` was just recorded under `key`: it is the last entry, and the table is
    /// swept when it has doubled.
    #[inline]
    fn recorded(&mut self, key: K, weak: Weak<V>) {
        self.last = Some((key, weak));
        if self.entries.len() >= self.sweep_at {
            self.sweep();
        }
    }

    /// Records `value` under `key` (replacing what was there).
    pub(crate) fn insert(&mut self, key: K, value: &Arc<V>) {
        let weak = Arc::downgrade(value);
        self.entries.insert(key.clone(), Weak::clone(&weak));
        self.recorded(key, weak);
    }

    /// Drops the dead entries now.
    fn sweep(&mut self) {
        self.entries.retain(|_, weak| weak.strong_count() > 0);
        self.sweep_at = (self.entries.len() * 2).max(FIRST_SWEEP);
        if self
            .last
            .as_ref()
            .is_some_and(|(_, w)| w.strong_count() == 0)
        {
            self.last = None;
        }
    }

    /// Every live thing in the table.
    pub(crate) fn live(&self) -> Vec<Arc<V>> {
        self.entries.values().filter_map(Weak::upgrade).collect()
    }

    /// How many entries the table holds, dead ones not yet swept included.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_only_what_is_alive_and_keeps_nothing_alive() {
        let mut cache: IdentityCache<u32, String> = IdentityCache::default();
        let a = Arc::new("a".to_owned());
        cache.insert(1, &a);
        assert_eq!(cache.get(&1).as_deref().map(String::as_str), Some("a"));
        assert_eq!(
            Arc::strong_count(&a),
            1,
            "the cache holds no strong reference"
        );
        drop(a);
        assert!(cache.get(&1).is_none());
        assert!(cache.last().is_none());
    }

    #[test]
    fn get_or_insert_with_makes_only_on_a_miss_and_replaces_a_dead_entry() {
        let mut cache: IdentityCache<u32, String> = IdentityCache::default();
        let mut made = 0;
        let a = cache.get_or_insert_with(1, || {
            made += 1;
            Arc::new("a".to_owned())
        });
        let again = cache.get_or_insert_with(1, || unreachable!("a hit makes nothing"));
        assert!(Arc::ptr_eq(&a, &again));
        cache.insert(2, &Arc::new("gone".to_owned()));
        let b = cache.get_or_insert_with(2, || {
            made += 1;
            Arc::new("b".to_owned())
        });
        assert_eq!(made, 2, "a dead entry is a miss");
        assert_eq!(cache.get(&2).as_deref().map(String::as_str), Some("b"));
        drop((a, again, b));
        assert!(cache.get(&1).is_none() && cache.get(&2).is_none());
    }

    #[test]
    fn holds_tells_the_same_thing_from_another_under_the_same_key() {
        let mut cache: IdentityCache<u32, dyn std::any::Any + Send + Sync> =
            IdentityCache::default();
        let a: Arc<dyn std::any::Any + Send + Sync> = Arc::new(1u8);
        let b: Arc<dyn std::any::Any + Send + Sync> = Arc::new(1u8);
        cache.insert(7, &a);
        assert!(cache.holds(&7, &a));
        assert!(!cache.holds(&7, &b));
        assert!(!cache.holds(&8, &a));
        // Found through the map as well as through the last entry.
        cache.insert(9, &b);
        assert!(cache.holds(&7, &a));
    }

    #[test]
    fn dead_entries_are_swept_when_the_table_doubles() {
        let mut cache: IdentityCache<usize, usize> = IdentityCache::default();
        let kept: Vec<Arc<usize>> = (0..10).map(Arc::new).collect();
        for (i, k) in kept.iter().enumerate() {
            cache.insert(i, k);
        }
        // 10,000 short-lived entries: the table never holds more than about twice
        // the live ones past the first sweep.
        let mut most = 0;
        for i in 10..10_010 {
            let short = Arc::new(i);
            cache.insert(i, &short);
            most = most.max(cache.len());
        }
        assert!(most <= FIRST_SWEEP, "the table grew to {most} entries");
        for (i, k) in kept.iter().enumerate() {
            assert!(Arc::ptr_eq(&cache.get(&i).expect("a live entry"), k));
        }
        assert_eq!(cache.live().len(), 10);
    }
}
