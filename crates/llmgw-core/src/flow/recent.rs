//! A map of at most a fixed number of entries by 128-bit tag, that makes room by dropping the
//! least recently used entry, among those its owner would rather lose first, and counts what it
//! dropped (for a metric).
//!
//! Our own rather than the `lru` crate's: the kept prefixes rank entries (a single request's
//! tokens go before a prefix two requests agreed on) ahead of recency, which a plain LRU list
//! cannot. At a few hundred entries, a scan when full and new costs less than moving a list node
//! on every lookup, and needs no unsafe code.

use std::collections::HashMap;

pub(super) struct Recent<V> {
    entries: HashMap<u128, Entry<V>>,
    capacity: usize,
    /// Entries for which this is true go after those for which it is false.
    keep_longer: fn(&V) -> bool,
    /// Bumped by every lookup and insertion.
    clock: u64,
    /// Entries dropped for room since the count was last taken.
    evicted: u64,
}

struct Entry<V> {
    value: V,
    used: u64,
}

impl<V> std::fmt::Debug for Recent<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recent").field("len", &self.entries.len()).field("capacity", &self.capacity).finish()
    }
}

impl<V> Recent<V> {
    pub(super) fn new(capacity: usize, keep_longer: fn(&V) -> bool) -> Self {
        Recent { entries: HashMap::new(), capacity, keep_longer, clock: 0, evicted: 0 }
    }

    fn tick(&mut self) -> u64 {
        self.clock = self.clock.wrapping_add(1);
        self.clock
    }

    /// The entry under `tag`, now the most recently used.
    pub(super) fn get(&mut self, tag: u128) -> Option<&mut V> {
        let now = self.tick();
        let e = self.entries.get_mut(&tag)?;
        e.used = now;
        Some(&mut e.value)
    }

    /// The entry under `tag`, its recency unchanged.
    pub(super) fn peek(&self, tag: u128) -> Option<&V> {
        self.entries.get(&tag).map(|e| &e.value)
    }

    pub(super) fn contains(&self, tag: u128) -> bool {
        self.entries.contains_key(&tag)
    }

    /// Keeps `value` under `tag` (replacing what was there), dropping an entry first if the map
    /// is full and `tag` is new.
    pub(super) fn insert(&mut self, tag: u128, value: V) {
        if !self.entries.contains_key(&tag) && self.entries.len() >= self.capacity {
            let keep_longer = self.keep_longer;
            let victim = self.entries.iter().min_by_key(|(_, e)| (keep_longer(&e.value), e.used)).map(|(t, _)| *t);
            if let Some(t) = victim {
                self.entries.remove(&t);
                self.evicted = self.evicted.saturating_add(1);
            }
        }
        let used = self.tick();
        self.entries.insert(tag, Entry { value, used });
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries dropped for room since the last call.
    pub(super) fn take_evicted(&mut self) -> u64 {
        std::mem::take(&mut self.evicted)
    }

    pub(super) fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_goes_first_among_those_not_kept_longer() {
        // Even values are kept longer.
        let mut r: Recent<u32> = Recent::new(3, |v| v % 2 == 0);
        r.insert(1, 2);
        r.insert(2, 3);
        r.insert(3, 5);
        // 3 was used after 2: 2 goes, although 1 is older.
        assert!(r.get(2).is_some() && r.get(3).is_some());
        r.insert(4, 7);
        assert!(r.contains(1) && !r.contains(2) && r.contains(3) && r.contains(4));
        // Replacing an entry drops nothing.
        r.insert(4, 9);
        assert_eq!((r.len(), r.take_evicted(), r.take_evicted()), (3, 1, 0));
        // Only values kept longer left: the least recently used of them goes.
        let mut r: Recent<u32> = Recent::new(2, |_| true);
        r.insert(1, 0);
        r.insert(2, 0);
        assert!(r.get(1).is_some());
        r.insert(3, 0);
        assert!(r.contains(1) && !r.contains(2) && r.contains(3));
    }
}
