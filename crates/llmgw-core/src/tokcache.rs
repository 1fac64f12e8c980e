//! Recent tokenizations, so a prompt sent again is routed without a tokenizer round trip.
//!
//! An entry is keyed by everything that determines a request's block hashes: the profile
//! (tokenizer, block size, hash algorithm, seed), the exact tokenizer call (path and body: the
//! raw messages, tools, template arguments and flags), the cache salt and the model (LoRA).
//! Equal keys therefore mean equal tokens and equal block hashes; nothing is approximated. The
//! entry keeps the token ids and the block hashes computed so far (hashing stops at the first
//! block no replica holds, and a later request may need more).
//!
//! Keys are a keyed 128-bit xxh3 (the key is secret per VM, so clients cannot aim collisions;
//! an accidental one has probability about n²/2¹²⁹). Memory is bounded by a byte budget; entries
//! older than a time-to-live are dropped (a tokenizer or chat template changed on the replicas
//! shows up within that time). Eviction is CLOCK (second chance), close to least-recently-used
//! at a fraction of its bookkeeping.

use crate::hash::BlockHash;
use crate::placement::BuildKeyHasher;
use std::collections::{HashMap, VecDeque};

/// A cache key: the keyed 128-bit hash of everything that determines a request's tokens and
/// block hashes (or, for an alias, of a raw body and its path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheTag(pub u128);

/// Bytes charged per entry besides its tokens and hashes (map slot, order slot, headers).
const ENTRY_OVERHEAD: usize = 96;

/// A request's cached tokenization.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokenized {
    pub tokens: Vec<u32>,
    /// Hashes of the leading blocks computed so far (a prefix of the request's block hashes).
    pub hashes: Vec<BlockHash>,
}

impl Tokenized {
    fn bytes(&self) -> usize {
        self.tokens
            .capacity()
            .saturating_mul(std::mem::size_of::<u32>())
            .saturating_add(self.hashes.capacity().saturating_mul(std::mem::size_of::<BlockHash>()))
            .saturating_add(ENTRY_OVERHEAD)
    }
}

struct Entry {
    value: Tokenized,
    charged: usize,
    stored_ns: u64,
    referenced: bool,
}

/// What a byte-identical request body (same path) resolves to, so it is routed without being
/// parsed: the tag of its tokenization and what else enters its hashes and its routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    pub tag: CacheTag,
    pub profile: usize,
    pub model: Option<String>,
    pub cache_salt: Option<String>,
    /// The hashing (`HashSpec::fingerprint`) the entry's block hashes were computed by.
    pub spec: u64,
}

/// Bytes of budget per alias slot (aliases are capped at budget / this).
const ALIAS_BYTES: usize = 2048;

/// Bytes charged per alias besides its model name and cache salt.
const ALIAS_OVERHEAD: usize = 128;

impl Alias {
    /// What the alias costs: the client chooses its model name and salt, so they are charged.
    fn bytes(&self) -> usize {
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        ALIAS_OVERHEAD.saturating_add(text(&self.model)).saturating_add(text(&self.cache_salt))
    }
}

/// Counters since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub expired: u64,
    pub evicted: u64,
    /// Aliases not kept because their model name and salt alone exceed a sixteenth of the
    /// aliases' byte budget.
    pub aliases_refused: u64,
}

/// The cache. `budget_bytes == 0` turns it off (every lookup misses, nothing is stored).
pub struct TokenCache {
    key: u64,
    budget: usize,
    ttl_ns: u64,
    used: usize,
    map: HashMap<CacheTag, Entry, BuildKeyHasher>,
    /// Insertion order for the CLOCK hand (may hold keys already removed).
    order: VecDeque<CacheTag>,
    /// Raw-body tags → tokenization tags, first in first out.
    aliases: HashMap<CacheTag, Alias, BuildKeyHasher>,
    alias_order: VecDeque<CacheTag>,
    /// Bytes the aliases held are charged (at most a quarter of the budget).
    alias_used: usize,
    pub stats: CacheStats,
}

/// A hasher under the secret `key` that has taken `parts`, each after its length (so that no
/// two lists of parts run together alike).
#[cfg(feature = "xxhash")]
fn keyed_hasher(key: u64, parts: &[&[u8]]) -> xxhash_rust::xxh3::Xxh3 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(key);
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h
}

/// A tag of `parts` under the secret `key` (see [`TokenCache::tag`]).
#[cfg(feature = "xxhash")]
pub fn keyed_tag(key: u64, parts: &[&[u8]]) -> CacheTag {
    CacheTag(keyed_hasher(key, parts).digest128())
}

#[cfg(not(feature = "xxhash"))]
pub fn keyed_tag(_key: u64, _parts: &[&[u8]]) -> CacheTag {
    CacheTag(0)
}

/// The tags of `parts` followed by each of `text`'s leading `ends` bytes (ascending; an end past
/// the text counts as its whole length), in one pass over the text.
#[cfg(feature = "xxhash")]
pub fn keyed_prefix_tags(key: u64, parts: &[&[u8]], text: &[u8], ends: &[usize]) -> Vec<CacheTag> {
    let mut h = keyed_hasher(key, parts);
    let mut at = 0;
    let mut tags = Vec::with_capacity(ends.len());
    for &end in ends {
        let end = end.min(text.len()).max(at);
        if let Some(more) = text.get(at..end) {
            h.update(more);
            at = end;
        }
        tags.push(CacheTag(h.digest128()));
    }
    tags
}

#[cfg(not(feature = "xxhash"))]
pub fn keyed_prefix_tags(_key: u64, _parts: &[&[u8]], _text: &[u8], ends: &[usize]) -> Vec<CacheTag> {
    vec![CacheTag(0); ends.len()]
}

impl TokenCache {
    /// `key`: a secret for the entry tags (pass a random value); `ttl_ns`: entry lifetime.
    pub fn new(budget_bytes: usize, ttl_ns: u64, key: u64) -> TokenCache {
        TokenCache {
            key,
            budget: budget_bytes,
            ttl_ns,
            used: 0,
            map: HashMap::default(),
            order: VecDeque::new(),
            aliases: HashMap::default(),
            alias_order: VecDeque::new(),
            alias_used: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0 && cfg!(feature = "xxhash")
    }

    /// The tag of a request: each part is length-prefixed, so part boundaries cannot shift.
    pub fn tag(&self, parts: &[&[u8]]) -> CacheTag {
        keyed_tag(self.key, parts)
    }

    /// Takes the entry for `tag` out of the cache (hand it back with [`Self::put_back`]), or
    /// `None` when absent or older than the time-to-live.
    pub fn take(&mut self, tag: CacheTag, now_ns: u64) -> Option<Tokenized> {
        if !self.enabled() {
            return None;
        }
        let Some(e) = self.map.get_mut(&tag) else {
            self.stats.misses = self.stats.misses.saturating_add(1);
            return None;
        };
        if now_ns.saturating_sub(e.stored_ns) > self.ttl_ns {
            if let Some(e) = self.map.remove(&tag) {
                self.used = self.used.saturating_sub(e.charged);
            }
            self.stats.expired = self.stats.expired.saturating_add(1);
            self.stats.misses = self.stats.misses.saturating_add(1);
            return None;
        }
        e.referenced = true;
        self.stats.hits = self.stats.hits.saturating_add(1);
        // The slot stays (charged, in the CLOCK order) with an empty value until it comes back.
        Some(std::mem::take(&mut e.value))
    }

    /// Returns an entry taken with [`Self::take`], possibly with more block hashes.
    pub fn put_back(&mut self, tag: CacheTag, value: Tokenized) {
        let Some(e) = self.map.get_mut(&tag) else { return self.insert_at(tag, value, None) };
        let charged = value.bytes();
        self.used = self.used.saturating_sub(e.charged).saturating_add(charged);
        e.charged = charged;
        e.value = value;
        self.evict();
    }

    /// Stores a new tokenization (replacing any entry with the same tag).
    pub fn insert(&mut self, tag: CacheTag, value: Tokenized, now_ns: u64) {
        self.insert_at(tag, value, Some(now_ns));
    }

    fn insert_at(&mut self, tag: CacheTag, value: Tokenized, now_ns: Option<u64>) {
        if !self.enabled() {
            return;
        }
        // Charged by capacity: no reallocation to trim the parser's spare room.
        let charged = value.bytes();
        if charged > self.budget {
            return;
        }
        let stored_ns = match (now_ns, self.map.get(&tag)) {
            (Some(t), _) => t,
            (None, Some(e)) => e.stored_ns,
            // Put back after being expired or evicted meanwhile: drop it.
            (None, None) => return,
        };
        if let Some(old) = self.map.insert(tag, Entry { value, charged, stored_ns, referenced: false }) {
            self.used = self.used.saturating_sub(old.charged);
        } else {
            self.order.push_back(tag);
        }
        self.used = self.used.saturating_add(charged);
        self.evict();
    }

    /// CLOCK: entries referenced since the hand last passed get a second chance.
    fn evict(&mut self) {
        // Each key is visited at most twice per call (once to clear its bit, once to evict).
        let mut steps = self.order.len().saturating_mul(2);
        while self.used > self.budget && steps > 0 {
            steps = steps.saturating_sub(1);
            let Some(tag) = self.order.pop_front() else { break };
            let Some(e) = self.map.get_mut(&tag) else { continue };
            if std::mem::take(&mut e.referenced) {
                self.order.push_back(tag);
                continue;
            }
            if let Some(e) = self.map.remove(&tag) {
                self.used = self.used.saturating_sub(e.charged);
                self.stats.evicted = self.stats.evicted.saturating_add(1);
            }
        }
        // Keys of entries removed on expiry linger in `order`; keep it from growing past twice
        // the live entries.
        if self.order.len() > self.map.len().saturating_mul(2).saturating_add(64) {
            let map = &self.map;
            self.order.retain(|t| map.contains_key(t));
        }
    }

    /// The tokenization a raw body was seen to resolve to (its entry may since have gone).
    pub fn alias(&self, raw_tag: CacheTag) -> Option<&Alias> {
        self.aliases.get(&raw_tag)
    }

    /// Remembers what a raw body resolves to. Aliases are capped by count (`budget / 2048`, at
    /// least 16) and by bytes (a quarter of the budget, their model names and salts charged);
    /// the oldest go first, and one larger than a sixteenth of the byte cap is not kept.
    pub fn add_alias(&mut self, raw_tag: CacheTag, alias: Alias) {
        if !self.enabled() {
            return;
        }
        let byte_cap = (self.budget / 4).max(ALIAS_BYTES.saturating_mul(16));
        let bytes = alias.bytes();
        if bytes > byte_cap / 16 {
            self.stats.aliases_refused = self.stats.aliases_refused.saturating_add(1);
            return;
        }
        match self.aliases.insert(raw_tag, alias) {
            Some(old) => self.alias_used = self.alias_used.saturating_sub(old.bytes()),
            None => self.alias_order.push_back(raw_tag),
        }
        self.alias_used = self.alias_used.saturating_add(bytes);
        let cap = (self.budget / ALIAS_BYTES).max(16);
        while self.aliases.len() > cap || self.alias_used > byte_cap {
            let Some(old) = self.alias_order.pop_front() else { break };
            if let Some(a) = self.aliases.remove(&old) {
                self.alias_used = self.alias_used.saturating_sub(a.bytes());
            }
        }
    }

    /// Bytes the aliases are charged.
    pub fn alias_bytes(&self) -> usize {
        self.alias_used
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes charged against the budget.
    pub fn used_bytes(&self) -> usize {
        self.used
    }
}

#[cfg(all(test, feature = "xxhash"))]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::hash::{BlockKey, Digest};

    fn tok(n: u32) -> Tokenized {
        Tokenized { tokens: (0..n).collect(), hashes: Vec::new() }
    }

    #[test]
    fn hit_miss_and_parts_are_delimited() {
        let mut c = TokenCache::new(1 << 20, 1_000, 42);
        let a = c.tag(&[b"ab", b"c"]);
        assert_ne!(a, c.tag(&[b"a", b"bc"]));
        assert_ne!(a, TokenCache::new(1 << 20, 1_000, 43).tag(&[b"ab", b"c"]));
        assert_eq!(c.take(a, 0), None);
        c.insert(a, tok(32), 10);
        let mut got = c.take(a, 20).unwrap();
        assert_eq!(got.tokens.len(), 32);
        got.hashes.push(BlockHash { digest: Digest::from_sha256([1; 32]), key: BlockKey(7) });
        c.put_back(a, got.clone());
        assert_eq!(c.take(a, 30), Some(got.clone()));
        c.put_back(a, got);
        assert_eq!(c.stats, CacheStats { hits: 2, misses: 1, expired: 0, evicted: 0, aliases_refused: 0 });
        // Expired after the TTL.
        assert_eq!(c.take(a, 2_000), None);
        assert_eq!(c.stats.expired, 1);
        assert!(c.is_empty());
        assert_eq!(c.used_bytes(), 0);
    }

    #[test]
    fn budget_is_kept_and_recently_used_entries_survive() {
        let one = tok(100).bytes();
        let mut c = TokenCache::new(one * 10, u64::MAX, 1);
        let tags: Vec<CacheTag> = (0..10u32).map(|i| c.tag(&[&i.to_le_bytes()])).collect();
        for &t in &tags {
            c.insert(t, tok(100), 0);
        }
        assert_eq!(c.len(), 10);
        // Use entry 0: it gets a second chance when the 11th arrives; entry 1 goes.
        let v = c.take(tags[0], 0).unwrap();
        c.put_back(tags[0], v);
        let t11 = c.tag(&[b"eleven"]);
        c.insert(t11, tok(100), 0);
        assert!(c.used_bytes() <= one * 10);
        assert!(c.take(tags[0], 0).is_some());
        assert!(c.take(tags[1], 0).is_none());
        assert!(c.take(t11, 0).is_some());
        assert_eq!(c.stats.evicted, 1);
        // Too large for the budget: not stored.
        let big = c.tag(&[b"big"]);
        c.insert(big, tok(100_000), 0);
        assert!(c.take(big, 0).is_none());
        // Off: nothing stored.
        let mut off = TokenCache::new(0, u64::MAX, 1);
        off.insert(CacheTag(1), tok(1), 0);
        assert!(off.take(CacheTag(1), 0).is_none());
    }

    #[test]
    fn aliases_are_capped_first_in_first_out() {
        let mut c = TokenCache::new(ALIAS_BYTES * 20, u64::MAX, 1);
        let a =
            |i: u128| Alias { tag: CacheTag(i + 1000), profile: 0, model: Some("m".into()), cache_salt: None, spec: 0 };
        for i in 0..30u128 {
            c.add_alias(CacheTag(i), a(i));
        }
        assert!(c.alias(CacheTag(9)).is_none());
        assert_eq!(c.alias(CacheTag(10)), Some(&a(10)));
        assert_eq!(c.alias(CacheTag(29)), Some(&a(29)));
        let mut off = TokenCache::new(0, u64::MAX, 1);
        off.add_alias(CacheTag(1), a(1));
        assert!(off.alias(CacheTag(1)).is_none());
    }

    #[test]
    fn aliases_are_capped_by_the_bytes_clients_choose() {
        let budget = 4 << 20;
        let mut c = TokenCache::new(budget, u64::MAX, 1);
        let salted = |i: u128, n: usize| Alias {
            tag: CacheTag(i + 1000),
            profile: 0,
            model: Some("m".into()),
            cache_salt: Some("s".repeat(n)),
            spec: 0,
        };
        // A salt near the largest kept (1/16 of the alias budget), many times: the aliases stay
        // within a quarter of the budget.
        for i in 0..200u128 {
            c.add_alias(CacheTag(i), salted(i, (budget / 4) / 16 - 200));
            assert!(c.alias_bytes() <= budget / 4, "{} bytes of aliases", c.alias_bytes());
        }
        assert!(c.alias(CacheTag(199)).is_some() && c.alias(CacheTag(0)).is_none());
        // A 30 MB salt is not kept at all.
        c.add_alias(CacheTag(500), salted(500, 30 << 20));
        assert!(c.alias(CacheTag(500)).is_none());
        assert_eq!(c.stats.aliases_refused, 1);
        // Replacing an alias charges it once.
        let before = c.alias_bytes();
        c.add_alias(CacheTag(199), salted(199, 10));
        assert!(c.alias_bytes() < before);
    }

    #[test]
    fn put_back_after_eviction_does_not_resurrect() {
        let one = tok(100).bytes();
        let mut c = TokenCache::new(one, u64::MAX, 1);
        c.insert(CacheTag(1), tok(100), 0);
        let v = c.take(CacheTag(1), 0).unwrap();
        c.insert(CacheTag(2), tok(100), 0);
        c.put_back(CacheTag(1), v);
        assert!(c.used_bytes() <= one);
        assert_eq!(c.len(), 1);
    }
}
