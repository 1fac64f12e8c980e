//! One engine's KV cache as vLLM reports it: a reference-counted multiset of block keys.
//!
//! vLLM can store the same hash more than once (two physical copies, or a `full` report-mode
//! re-announcement) and removes each copy with its own `BlockRemoved`, so a block is held while
//! its count is positive. Applying a batch yields the **net** changes of that batch: blocks that
//! were not held before and are now, and the reverse. Only events about this engine's local GPU
//! cache change the mirror; the rest are counted and ignored. Every KV-cache group is mirrored
//! (hybrid models: full attention plus sliding window, ...), group g's blocks under
//! [`group_key`]`(key, g)`, and each group's spec as its events describe it is kept.
//!
//! Parity: each stored block whose parent's full digest is known (a run starting at block 0, or
//! a parent this mirror verified earlier) is re-hashed from the event's `token_ids` and compared
//! with the published key, so an engine started with another seed or algorithm shows up at once.
//!
//! Block claims are checked by the same recomputation: a stored block whose hash can be
//! recomputed and differs is not credited to the engine, nor are the blocks after it in the same
//! event (they continue from it). A claim that cannot be recomputed (its parent's digest unknown,
//! no token ids, extra keys the mirror cannot reproduce) is credited and counted unverifiable.

use crate::event::{EventBatch, KvEvent, Medium, RemovedBlocks, StoredBlocks};
use crate::hash::{group_key, BlockHasher, BlockKey, Digest, ExtraKey, MAX_KV_GROUPS};
use crate::placement::KeyMap;
use std::collections::BTreeMap;

/// A change in whether a block is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NetChange {
    Added(BlockKey),
    Removed(BlockKey),
}

impl NetChange {
    pub fn key(self) -> BlockKey {
        match self {
            NetChange::Added(k) | NetChange::Removed(k) => k,
        }
    }
}

/// Counters of everything the mirror saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MirrorStats {
    pub batches: u64,
    pub events_applied: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// `BlockRemoved` for a block this mirror did not hold.
    pub removed_not_held: u64,
    pub clears: u64,
    pub resets: u64,
    pub ignored_medium: u64,
    pub ignored_locality: u64,
    pub ignored_group: u64,
    pub unknown_events: u64,
    pub parity: ParityStats,
    /// Lookahead hashing seen in this engine's events (EAGLE-family speculative decoding):
    /// the tokens per block of the last store that carried `lookahead_token_ids`.
    pub lookahead_tokens: Option<usize>,
}

/// Hash parity of stored blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParityStats {
    pub matched: u64,
    pub mismatched: u64,
    /// Blocks whose hash could not be recomputed (unknown parent, no hasher configured,
    /// LoRA path unknown, hybrid-model token layout). Lookahead-hashed stores are verified
    /// with the lookahead tokens their events carry.
    pub unverifiable: u64,
    /// The last mismatch: (published key, recomputed key).
    pub last_mismatch: Option<(BlockKey, BlockKey)>,
    /// Claims not credited: blocks whose recomputed hash differed from the published one.
    pub rejected_mismatch: u64,
    /// Claims not credited: blocks after a rejected one in the same stored event (they
    /// continue from it).
    pub rejected_after_mismatch: u64,
}

impl ParityStats {
    /// Every block claim not credited.
    pub fn rejected(&self) -> u64 {
        self.rejected_mismatch.saturating_add(self.rejected_after_mismatch)
    }
}

impl ParityStats {
    /// Share of verified blocks that matched; `None` before any block was verified.
    pub fn match_ratio(&self) -> Option<f64> {
        let total = self.matched.saturating_add(self.mismatched);
        if total == 0 {
            None
        } else {
            Some(self.matched as f64 / total as f64)
        }
    }
}

/// A KV-cache group as the engine's events describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    /// `kv_cache_spec_kind` (`full_attention`, `sliding_window`, `mamba`, ...; empty when the
    /// events do not say, as before vLLM 0.33).
    pub kind: String,
    pub block_size: u64,
    /// `kv_cache_spec_sliding_window`, in tokens.
    pub sliding_window: Option<u64>,
}

/// Longest `kv_cache_spec_kind` kept (vLLM's are under 32 bytes).
const MAX_KIND_LEN: usize = 64;

/// One engine's (replica, data-parallel rank) mirror.
///
/// Memory: a held block costs one map entry (key and copy count). Full digests, needed to
/// verify a later run that continues from a block, are kept only for the last block of each
/// verified run (where decode-filled blocks and follow-up turns continue) while it is held.
pub struct EngineMirror {
    held: KeyMap<u32>,
    tails: KeyMap<Digest>,
    hasher: Option<BlockHasher>,
    lora_paths: BTreeMap<String, String>,
    stats: MirrorStats,
    touched: KeyMap<bool>,
    touched_order: Vec<BlockKey>,
    groups: BTreeMap<u32, GroupSpec>,
    groups_version: u64,
}

impl EngineMirror {
    /// `parity`: the hasher the engine is expected to use, to check its published hashes.
    pub fn new(parity: Option<BlockHasher>) -> Self {
        Self {
            held: KeyMap::default(),
            tails: KeyMap::default(),
            hasher: parity,
            lora_paths: BTreeMap::new(),
            stats: MirrorStats::default(),
            touched: KeyMap::default(),
            touched_order: Vec::new(),
            groups: BTreeMap::new(),
            groups_version: 0,
        }
    }

    /// Bumped whenever [`Self::groups`] changes.
    pub fn groups_version(&self) -> u64 {
        self.groups_version
    }

    /// The KV-cache groups seen in this engine's stores, by index (at most [`MAX_KV_GROUPS`]).
    pub fn groups(&self) -> &BTreeMap<u32, GroupSpec> {
        &self.groups
    }

    /// Tells parity checks where the engine loaded a LoRA adapter from (vLLM hashes the path
    /// but does not publish it).
    pub fn set_lora_path(&mut self, name: impl Into<String>, path: impl Into<String>) {
        self.lora_paths.insert(name.into(), path.into());
    }

    pub fn stats(&self) -> &MirrorStats {
        &self.stats
    }

    /// Number of distinct blocks held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn contains(&self, key: BlockKey) -> bool {
        self.held.contains_key(&key)
    }

    /// How many copies of `key` the engine holds.
    pub fn count(&self, key: BlockKey) -> u32 {
        self.held.get(&key).copied().unwrap_or(0)
    }

    /// Every held block key, sorted (a snapshot).
    pub fn keys(&self) -> Vec<BlockKey> {
        let mut v = self.keys_unsorted();
        v.sort_unstable();
        v
    }

    /// Every held block key, in no particular order (the cheapest copy, e.g. under a lock).
    pub fn keys_unsorted(&self) -> Vec<BlockKey> {
        self.held.keys().copied().collect()
    }

    /// At most `n` held block keys, in no particular order.
    pub fn some_keys(&self, n: usize) -> Vec<BlockKey> {
        self.held.keys().take(n).copied().collect()
    }

    /// Drops everything (engine restarted, sequence gap that cannot be repaired, replica down).
    /// Appends a `Removed` for every block that was held.
    pub fn reset(&mut self, out: &mut Vec<NetChange>) {
        self.stats.resets = self.stats.resets.saturating_add(1);
        let mut keys = self.keys();
        self.held.clear();
        self.tails.clear();
        out.extend(keys.drain(..).map(NetChange::Removed));
    }

    /// Applies one batch and appends its net changes to `out`, in the order blocks were first
    /// touched.
    pub fn apply(&mut self, batch: &EventBatch, out: &mut Vec<NetChange>) {
        self.stats.batches = self.stats.batches.saturating_add(1);
        self.touched.clear();
        self.touched_order.clear();
        for ev in &batch.events {
            match ev {
                KvEvent::Stored(s) => self.apply_stored(s),
                KvEvent::Removed(r) => self.apply_removed(r),
                KvEvent::AllCleared => {
                    self.stats.events_applied = self.stats.events_applied.saturating_add(1);
                    self.stats.clears = self.stats.clears.saturating_add(1);
                    let keys: Vec<BlockKey> = self.held.keys().copied().collect();
                    for k in keys {
                        self.touch(k);
                    }
                    self.held.clear();
                    self.tails.clear();
                }
                KvEvent::Unknown(_) => self.stats.unknown_events = self.stats.unknown_events.saturating_add(1),
            }
        }
        for &k in &self.touched_order {
            let before = self.touched.get(&k).copied().unwrap_or(false);
            let now = self.held.contains_key(&k);
            match (before, now) {
                (false, true) => out.push(NetChange::Added(k)),
                (true, false) => out.push(NetChange::Removed(k)),
                _ => {}
            }
        }
    }

    fn touch(&mut self, k: BlockKey) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.touched.entry(k) {
            e.insert(self.held.contains_key(&k));
            self.touched_order.push(k);
        }
    }

    /// The KV-cache group of an event about this engine's local GPU cache (0 when the event
    /// names none); `None`, counted, for other media and localities and for group indexes past
    /// [`MAX_KV_GROUPS`].
    fn relevant(&mut self, medium: &Medium, locality: Option<&str>, group: Option<i64>) -> Option<u32> {
        if *medium != Medium::Gpu {
            self.stats.ignored_medium = self.stats.ignored_medium.saturating_add(1);
            return None;
        }
        if !matches!(locality, None | Some("LOCAL")) {
            self.stats.ignored_locality = self.stats.ignored_locality.saturating_add(1);
            return None;
        }
        match u32::try_from(group.unwrap_or(0)) {
            Ok(g) if g < MAX_KV_GROUPS => Some(g),
            _ => {
                self.stats.ignored_group = self.stats.ignored_group.saturating_add(1);
                None
            }
        }
    }

    fn apply_stored(&mut self, s: &StoredBlocks) {
        let Some(group) = self.relevant(&s.medium, s.locality.as_deref(), s.group_idx) else {
            return;
        };
        self.stats.events_applied = self.stats.events_applied.saturating_add(1);
        let kind = s.spec_kind.as_deref().unwrap_or_default();
        let spec = GroupSpec {
            kind: kind.get(..MAX_KIND_LEN).unwrap_or(kind).to_owned(),
            block_size: s.block_size,
            sliding_window: s.sliding_window.and_then(|w| u64::try_from(w).ok()),
        };
        if self.groups.get(&group) != Some(&spec) {
            self.groups.insert(group, spec);
            self.groups_version = self.groups_version.wrapping_add(1);
        }
        // Group 0's verified runs are the chains later stores continue from.
        let (tail, credited) = self.check_parity(s);
        let tail = tail.filter(|_| group == 0);
        for &k in s.hashes.iter().take(credited) {
            let k = group_key(k, group);
            self.touch(k);
            let c = self.held.entry(k).or_insert(0);
            *c = c.saturating_add(1);
            self.stats.blocks_stored = self.stats.blocks_stored.saturating_add(1);
        }
        if let Some((k, d)) = tail {
            self.tails.insert(k, d);
        }
    }

    fn apply_removed(&mut self, r: &RemovedBlocks) {
        let Some(group) = self.relevant(&r.medium, r.locality.as_deref(), r.group_idx) else {
            return;
        };
        self.stats.events_applied = self.stats.events_applied.saturating_add(1);
        for &k in &r.hashes {
            let k = group_key(k, group);
            self.touch(k);
            match self.held.get_mut(&k) {
                Some(c) if *c > 1 => *c = c.saturating_sub(1),
                Some(_) => {
                    self.held.remove(&k);
                    self.tails.remove(&k);
                }
                None => self.stats.removed_not_held = self.stats.removed_not_held.saturating_add(1),
            }
            self.stats.blocks_removed = self.stats.blocks_removed.saturating_add(1);
        }
    }

    /// Recomputes the stored run's hashes where possible. Returns the last block's key and
    /// digest when the whole run verified (a later run may continue from it), and how many of
    /// the run's leading blocks are credited: all of them, or those before the first block whose
    /// recomputed hash differs.
    fn check_parity(&mut self, s: &StoredBlocks) -> (Option<(BlockKey, Digest)>, usize) {
        let n = s.hashes.len();
        let unverifiable = |stats: &mut MirrorStats| {
            stats.parity.unverifiable = stats.parity.unverifiable.saturating_add(n as u64);
            (None, n)
        };
        let Some(hasher) = self.hasher.as_mut() else {
            return unverifiable(&mut self.stats);
        };
        let Ok(bs) = usize::try_from(s.block_size) else {
            return unverifiable(&mut self.stats);
        };
        if bs == 0 || Some(s.token_ids.len()) != n.checked_mul(bs) {
            return unverifiable(&mut self.stats);
        }
        // Lookahead hashing: each block's hash also covers the tokens after it, published
        // beside it (one list per hash).
        let lookahead = s.lookahead_token_ids.as_deref();
        if let Some(la) = lookahead {
            if la.len() != n {
                return unverifiable(&mut self.stats);
            }
            self.stats.lookahead_tokens = la.first().map(Vec::len);
        }
        let parent = match s.parent {
            None => Some(hasher.root()),
            Some(p) => self.tails.get(&p).copied(),
        };
        let Some(mut parent) = parent else {
            return unverifiable(&mut self.stats);
        };
        // The blocks before the first mismatch (all of them while none differs).
        let mut credited = n;
        let mut last: Option<(BlockKey, Digest)> = None;
        let lora_paths = &self.lora_paths;
        for (i, (block, &published)) in s.token_ids.chunks_exact(bs).zip(&s.hashes).enumerate() {
            let Some(mut extra) = s.hashed_extra_keys(i, |name| lora_paths.get(name).cloned()) else {
                let rest = n.saturating_sub(i) as u64;
                self.stats.parity.unverifiable = self.stats.parity.unverifiable.saturating_add(rest);
                return (None, self.reject_from(credited, n));
            };
            if let Some(next) = lookahead.and_then(|la| la.get(i)) {
                extra.push(ExtraKey::Lookahead(next.clone()));
            }
            let d = hasher.hash_block(&parent, block, &extra);
            if d.key() == published {
                self.stats.parity.matched = self.stats.parity.matched.saturating_add(1);
                last = Some((published, d));
            } else {
                self.stats.parity.mismatched = self.stats.parity.mismatched.saturating_add(1);
                self.stats.parity.last_mismatch = Some((published, d.key()));
                credited = credited.min(i);
            }
            // On a mismatch the engine's true digest is unknown; chaining on ours keeps a
            // wrong seed or algorithm visible on every block of the run.
            parent = d;
        }
        if credited < n {
            return (None, self.reject_from(credited, n));
        }
        (last, n)
    }

    /// Counts the claims of a run of `n` blocks from its first mismatch, `first`, on; returns
    /// how many are credited (`first`, or `n` when nothing mismatched).
    fn reject_from(&mut self, first: usize, n: usize) -> usize {
        if first < n {
            let p = &mut self.stats.parity;
            p.rejected_mismatch = p.rejected_mismatch.saturating_add(1);
            let after = n.saturating_sub(first).saturating_sub(1);
            p.rejected_after_mismatch =
                p.rejected_after_mismatch.saturating_add(u64::try_from(after).unwrap_or(u64::MAX));
        }
        first.min(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::HashAlgo;

    const BS: usize = 4;

    fn hasher() -> BlockHasher {
        BlockHasher::new(HashAlgo::Sha256Cbor, Some("1234")).unwrap()
    }

    /// The keys vLLM would publish for `tokens` (whole blocks) from block 0.
    fn keys_of(tokens: &[u32]) -> Vec<BlockKey> {
        let mut h = hasher();
        let mut parent = h.root();
        tokens
            .chunks_exact(BS)
            .map(|b| {
                parent = h.hash_block(&parent, b, &[]);
                parent.key()
            })
            .collect()
    }

    fn stored(hashes: Vec<BlockKey>, parent: Option<BlockKey>, token_ids: Vec<u32>) -> EventBatch {
        EventBatch {
            ts: 0.0,
            dp_rank: None,
            events: vec![KvEvent::Stored(StoredBlocks {
                hashes,
                parent,
                token_ids,
                block_size: BS as u64,
                medium: Medium::Gpu,
                lora_id: None,
                lora_name: None,
                extra_keys: Vec::new(),
                group_idx: None,
                spec_kind: None,
                sliding_window: None,
                locality: None,
                ownership: None,
                session_id: None,
                lookahead_token_ids: None,
            })],
        }
    }

    #[test]
    fn honest_claims_are_credited() {
        let tokens: Vec<u32> = (1..=12).collect();
        let keys = keys_of(&tokens);
        let mut m = EngineMirror::new(Some(hasher()));
        let mut out = Vec::new();
        m.apply(&stored(keys.clone(), None, tokens), &mut out);
        assert_eq!(out, keys.iter().copied().map(NetChange::Added).collect::<Vec<_>>());
        assert_eq!((m.stats().parity.matched, m.stats().parity.rejected()), (3, 0));
    }

    #[test]
    fn a_forged_claim_and_what_follows_it_are_not_credited() {
        // A peer's prompt, whose keys the forger learnt, claimed with other tokens: block 1's
        // recomputed hash differs, so blocks 1 and 2 (which continue from it) are not credited.
        let victim: Vec<u32> = (100..112).collect();
        let claimed = keys_of(&victim);
        let mut tokens = victim.clone();
        tokens[5] = 7;
        let mut m = EngineMirror::new(Some(hasher()));
        let mut out = Vec::new();
        m.apply(&stored(claimed.clone(), None, tokens), &mut out);
        assert_eq!(out, vec![NetChange::Added(claimed[0])], "only the block whose tokens hash to its key");
        assert!(m.contains(claimed[0]) && !m.contains(claimed[1]) && !m.contains(claimed[2]));
        let p = &m.stats().parity;
        assert_eq!((p.rejected_mismatch, p.rejected_after_mismatch, p.rejected()), (1, 1, 2));
        // Keys claimed with tokens that hash to none of them: nothing credited.
        let mut m = EngineMirror::new(Some(hasher()));
        m.apply(&stored(claimed.clone(), None, vec![0; 12]), &mut out);
        assert!(m.is_empty());
        assert_eq!(m.stats().parity.rejected(), 3);
        // Its removal later is of blocks never held.
        out.clear();
        m.apply(
            &EventBatch {
                ts: 0.0,
                dp_rank: None,
                events: vec![KvEvent::Removed(RemovedBlocks {
                    hashes: claimed,
                    medium: Medium::Gpu,
                    group_idx: None,
                    locality: None,
                    ownership: None,
                })],
            },
            &mut out,
        );
        assert!(out.is_empty());
        assert_eq!(m.stats().removed_not_held, 3);
    }

    #[test]
    fn claims_that_cannot_be_recomputed_are_credited_and_counted() {
        let tokens: Vec<u32> = (1..=8).collect();
        let keys = keys_of(&tokens);
        // No token ids (as a snapshot carries them), an unknown parent, no hasher configured.
        for (batch, hasher) in [
            (stored(keys.clone(), None, Vec::new()), Some(hasher())),
            (stored(keys.clone(), Some(BlockKey(42)), tokens.clone()), Some(hasher())),
            (stored(keys.clone(), None, vec![0; 8]), None),
        ] {
            let checked = hasher.is_some();
            let mut m = EngineMirror::new(hasher);
            let mut out = Vec::new();
            m.apply(&batch, &mut out);
            assert_eq!(m.len(), 2);
            let p = &m.stats().parity;
            assert_eq!((p.unverifiable, p.rejected()), (2, 0), "checked: {checked}");
        }
    }
}
