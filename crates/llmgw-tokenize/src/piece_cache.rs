//! Token ids of prompt pieces seen before, so a conversation's next turn, or a prompt that
//! shares a system prompt with others, runs the tokenizer model only over its new text.
//!
//! A piece is text between two cut points: positions where an added token that is matched
//! before normalization begins. The tokenizer splits its input at those tokens before any
//! normalizer, pre-tokenizer or model sees it, so a piece's ids do not depend on what comes
//! before or after it; only whether it starts the text does (Metaspace's "first" prefix), which
//! is part of the key. Keys are a 128-bit xxh3 keyed with a secret drawn per process, so a
//! client cannot aim collisions. Memory is bounded by a byte budget; eviction is CLOCK
//! (second chance).

use std::collections::hash_map::{HashMap, RandomState};
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bytes charged per entry besides its ids (map slot, order slot, allocation).
const ENTRY_OVERHEAD: usize = 96;

/// Counters of one model's cache (monotonic, read by the metrics page).
#[derive(Debug, Default)]
pub struct CacheCounters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub hit_tokens: AtomicU64,
    pub miss_tokens: AtomicU64,
    pub evictions: AtomicU64,
    /// Pieces not cached because one alone is over an eighth of the budget.
    pub too_large: AtomicU64,
}

struct Entry {
    ids: Arc<[u32]>,
    referenced: bool,
}

struct Inner {
    map: HashMap<u128, Entry>,
    clock: VecDeque<u128>,
    bytes: usize,
}

/// A byte-bounded cache of piece tokenizations.
pub struct PieceCache {
    inner: Mutex<Inner>,
    budget: usize,
    seed: u64,
    pub counters: CacheCounters,
}

impl PieceCache {
    /// A cache holding at most `budget` bytes (0: nothing is cached).
    pub fn new(budget: usize) -> PieceCache {
        let seed = RandomState::new().build_hasher().finish();
        PieceCache {
            inner: Mutex::new(Inner { map: HashMap::new(), clock: VecDeque::new(), bytes: 0 }),
            budget,
            seed,
            counters: CacheCounters::default(),
        }
    }

    /// The key of a piece: its text and whether it starts the prompt.
    pub fn key(&self, piece: &str, first: bool) -> u128 {
        let mut buf = [0u8; 1];
        buf[0] = u8::from(first);
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(self.seed);
        h.update(&buf);
        h.update(piece.as_bytes());
        h.digest128()
    }

    pub fn get(&self, key: u128) -> Option<Arc<[u32]>> {
        if self.budget == 0 {
            return None;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let e = inner.map.get_mut(&key)?;
        e.referenced = true;
        Some(e.ids.clone())
    }

    pub fn insert(&self, key: u128, ids: &[u32]) {
        let cost = entry_bytes(ids.len());
        if self.budget == 0 {
            return;
        }
        if cost > self.budget / 8 {
            self.counters.too_large.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.map.contains_key(&key) {
            return;
        }
        while inner.bytes.saturating_add(cost) > self.budget {
            let Some(victim) = inner.clock.pop_front() else { break };
            let second_chance = match inner.map.get_mut(&victim) {
                Some(e) if e.referenced => {
                    e.referenced = false;
                    true
                }
                Some(_) => false,
                None => continue,
            };
            if second_chance {
                inner.clock.push_back(victim);
                continue;
            }
            if let Some(e) = inner.map.remove(&victim) {
                inner.bytes = inner.bytes.saturating_sub(entry_bytes(e.ids.len()));
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        inner.map.insert(key, Entry { ids: ids.into(), referenced: false });
        inner.clock.push_back(key);
        inner.bytes = inner.bytes.saturating_add(cost);
    }

    /// Bytes held and entries.
    pub fn usage(&self) -> (usize, usize) {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (inner.bytes, inner.map.len())
    }
}

fn entry_bytes(ids: usize) -> usize {
    ids.saturating_mul(std::mem::size_of::<u32>()).saturating_add(ENTRY_OVERHEAD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_its_budget_and_keeps_what_is_used() {
        let c = PieceCache::new(8 * (ENTRY_OVERHEAD + 40));
        let keys: Vec<u128> = (0..20).map(|i| c.key(&format!("piece {i}"), false)).collect();
        c.insert(keys[0], &[1; 10]);
        for k in &keys[1..] {
            assert!(c.get(keys[0]).is_some(), "a piece in use is kept");
            c.insert(*k, &[2; 10]);
            assert!(c.usage().0 <= 8 * (ENTRY_OVERHEAD + 40));
        }
        assert!(c.counters.evictions.load(Ordering::Relaxed) > 0);
        assert_ne!(c.key("a", true), c.key("a", false));
    }
}
