//! A GPU KV-cache block pool with vLLM's prefix-cache behaviour and events.
//!
//! * A request's full prompt blocks are hashed with llmgw-core exactly as vLLM hashes them; the
//!   leading blocks already cached are hits (never the whole prompt: at least one token is
//!   computed, as in vLLM).
//! * New blocks come from the head of a free queue (least recently freed first). Taking a free
//!   block that still holds a cached hash evicts it: one `BlockRemoved` per hash.
//! * Blocks that become full (prompt blocks at admission, then blocks filled by generated
//!   tokens) are cached and announced with `BlockStored` (one event per run, with its parent).
//! * A finished request frees its blocks tail first, so its last blocks are evicted first.
//! * Two requests can cache the same hash in two blocks; each copy is removed on its own.

use llmgw_core::hash::{BlockHash, BlockHasher, BlockKey, Digest, RequestExtras};
use llmgw_core::wire::{WireBlockRemoved, WireBlockStored, WireEvent, WireValue};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::num::NonZeroUsize;

/// Not enough free blocks for the request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolFull {
    pub needed: usize,
    pub free: usize,
}

impl fmt::Display for PoolFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "needs {} free blocks, {} available", self.needed, self.free)
    }
}

#[derive(Debug, Clone, Default)]
struct Block {
    /// Key and digest once the block is full and cached.
    hash: Option<(BlockKey, Digest)>,
    refs: u32,
    /// Position in the free queue while `refs == 0`.
    free_at: Option<u64>,
}

#[derive(Debug, Clone)]
struct Seq {
    tokens: Vec<u32>,
    blocks: Vec<usize>,
    /// Number of leading blocks that are full and cached (hashed).
    cached: usize,
    /// Hashes of the full blocks so far (extended as generated tokens fill blocks).
    hashes: Vec<BlockHash>,
    extras: RequestExtras,
    lora_name: Option<String>,
}

/// Counters vLLM exports as `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub queries_tokens: u64,
    pub hits_tokens: u64,
    pub evictions: u64,
}

pub struct BlockPool {
    block_size: NonZeroUsize,
    blocks: Vec<Block>,
    free: BTreeMap<u64, usize>,
    next_tick: u64,
    cached: HashMap<BlockKey, Vec<usize>>,
    hasher: BlockHasher,
    seqs: HashMap<u64, Seq>,
    next_seq: u64,
    events: Vec<WireEvent>,
    stats: PoolStats,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize, hasher: BlockHasher) -> BlockPool {
        let mut p = BlockPool {
            block_size: NonZeroUsize::new(block_size).unwrap_or(NonZeroUsize::MIN),
            blocks: vec![Block::default(); num_blocks],
            free: BTreeMap::new(),
            next_tick: 0,
            cached: HashMap::new(),
            hasher,
            seqs: HashMap::new(),
            next_seq: 0,
            events: Vec::new(),
            stats: PoolStats::default(),
        };
        for i in 0..num_blocks {
            p.push_free(i);
        }
        p
    }

    pub fn block_size(&self) -> NonZeroUsize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Share of blocks in use by running requests (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }

    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    /// Distinct cached block keys (for tests and debugging).
    pub fn cached_keys(&self) -> Vec<BlockKey> {
        let mut v: Vec<BlockKey> = self.cached.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Events produced since the last call, in emission order.
    pub fn take_events(&mut self) -> Vec<WireEvent> {
        std::mem::take(&mut self.events)
    }

    fn push_free(&mut self, b: usize) {
        let t = self.next_tick;
        self.next_tick = self.next_tick.saturating_add(1);
        self.free.insert(t, b);
        if let Some(blk) = self.blocks.get_mut(b) {
            blk.free_at = Some(t);
        }
    }

    fn take_free(&mut self, b: usize) {
        if let Some(t) = self.blocks.get_mut(b).and_then(|blk| blk.free_at.take()) {
            self.free.remove(&t);
        }
    }

    /// Pops the least recently freed block, evicting its cached hash.
    fn alloc_block(&mut self) -> Option<usize> {
        let (_, b) = self.free.pop_first()?;
        let blk = self.blocks.get_mut(b)?;
        blk.free_at = None;
        blk.refs = 1;
        if let Some((key, _)) = blk.hash.take() {
            if let Some(v) = self.cached.get_mut(&key) {
                v.retain(|&x| x != b);
                if v.is_empty() {
                    self.cached.remove(&key);
                }
            }
            self.stats.evictions = self.stats.evictions.saturating_add(1);
            self.events.push(WireEvent::BlockRemoved(WireBlockRemoved {
                block_hashes: vec![key.0],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..Default::default()
            }));
        }
        Some(b)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size.get())
    }

    /// How many leading prompt blocks are cached now (without admitting anything).
    pub fn probe(&mut self, tokens: &[u32], extras: &RequestExtras) -> usize {
        let keys = self.hasher.hash_request(tokens, self.block_size.get(), extras).unwrap_or_default();
        let max_hit = tokens.len().saturating_sub(1) / self.block_size;
        keys.iter().take(max_hit).take_while(|b| self.cached.contains_key(&b.key)).count()
    }

    /// Admits a request: reuses its cached leading blocks, allocates the rest, caches and
    /// announces its full prompt blocks. Returns its id and the number of cached tokens.
    pub fn admit(
        &mut self,
        tokens: Vec<u32>,
        extras: RequestExtras,
        lora_name: Option<String>,
    ) -> Result<(u64, usize), PoolFull> {
        let hashes = self.hasher.hash_request(&tokens, self.block_size.get(), &extras).unwrap_or_default();
        let max_hit = tokens.len().saturating_sub(1) / self.block_size;
        let mut hit_blocks = Vec::new();
        for h in hashes.iter().take(max_hit) {
            match self.cached.get(&h.key).and_then(|v| v.first().copied()) {
                Some(b) => hit_blocks.push(b),
                None => break,
            }
        }
        let total = self.blocks_for(tokens.len().max(1));
        let needed = total.saturating_sub(hit_blocks.len());
        // Hit blocks that sit in the free queue are taken out of it, not allocated anew.
        let free_after_hits = self
            .free
            .len()
            .saturating_sub(hit_blocks.iter().filter(|&&b| self.blocks.get(b).is_some_and(|x| x.refs == 0)).count());
        if needed > free_after_hits {
            return Err(PoolFull { needed, free: free_after_hits });
        }
        self.stats.queries_tokens = self.stats.queries_tokens.saturating_add(tokens.len() as u64);
        let hits = hit_blocks.len();
        let hit_tokens = hits.saturating_mul(self.block_size.get());
        self.stats.hits_tokens = self.stats.hits_tokens.saturating_add(hit_tokens as u64);
        for &b in &hit_blocks {
            self.take_free(b);
            if let Some(blk) = self.blocks.get_mut(b) {
                blk.refs = blk.refs.saturating_add(1);
            }
        }
        let mut blocks = hit_blocks;
        for _ in 0..needed {
            match self.alloc_block() {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        let id = self.next_seq;
        self.next_seq = self.next_seq.saturating_add(1);
        let seq = Seq { tokens, blocks, cached: hits, hashes, extras, lora_name };
        self.seqs.insert(id, seq);
        self.cache_full_blocks(id);
        Ok((id, hit_tokens))
    }

    /// Appends a generated token, allocating a block when the last one is full and caching
    /// any block that becomes full.
    pub fn append(&mut self, id: u64, token: u32) -> Result<(), PoolFull> {
        let bs = self.block_size.get();
        let (len, nblocks) = match self.seqs.get(&id) {
            Some(s) => (s.tokens.len(), s.blocks.len()),
            None => return Ok(()),
        };
        if len.saturating_add(1) > nblocks.saturating_mul(bs) {
            let b = self.alloc_block().ok_or(PoolFull { needed: 1, free: 0 })?;
            if let Some(s) = self.seqs.get_mut(&id) {
                s.blocks.push(b);
            }
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.tokens.push(token);
        }
        self.cache_full_blocks(id);
        Ok(())
    }

    /// Caches the request's newly full blocks and emits one `BlockStored` for the run.
    fn cache_full_blocks(&mut self, id: u64) {
        let bs = self.block_size.get();
        let Some(s) = self.seqs.get_mut(&id) else { return };
        let full = s.tokens.len() / self.block_size;
        if full <= s.cached {
            return;
        }
        // Only blocks filled since the last call are hashed, chained on the previous digest.
        let more = full.saturating_sub(s.hashes.len());
        if more > 0 && self.hasher.hash_request_more(&s.tokens, bs, &s.extras, &mut s.hashes, more).is_err() {
            return;
        }
        let Some(s) = self.seqs.get(&id) else { return };
        let start = s.cached;
        let hashes = &s.hashes;
        let parent = start.checked_sub(1).and_then(|p| hashes.get(p)).map(|h| h.key);
        let mut keys = Vec::new();
        let mut extra_keys = Vec::new();
        let run: Vec<(usize, BlockKey, Digest)> = (start..full)
            .filter_map(|i| Some((*s.blocks.get(i)?, hashes.get(i)?.key, hashes.get(i)?.digest)))
            .collect();
        let token_ids = s.tokens.get(start.saturating_mul(bs)..full.saturating_mul(bs)).unwrap_or_default().to_vec();
        let lora_name = s.lora_name.clone();
        for (i, _) in (start..full).enumerate() {
            let block_index = start.saturating_add(i);
            let mut published = Vec::new();
            if let Some(name) = &lora_name {
                published.push(WireValue::Str(name.clone()));
            }
            if block_index == 0 {
                if let Some(salt) = &s.extras.cache_salt {
                    published.push(WireValue::Str(salt.clone()));
                }
            }
            extra_keys.push(if published.is_empty() { None } else { Some(published) });
        }
        for &(b, key, digest) in &run {
            if let Some(blk) = self.blocks.get_mut(b) {
                blk.hash = Some((key, digest));
            }
            self.cached.entry(key).or_default().push(b);
            keys.push(key);
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.cached = full;
        }
        self.events.push(WireEvent::BlockStored(WireBlockStored {
            block_hashes: keys.iter().map(|k: &BlockKey| k.0).collect(),
            parent_block_hash: parent.map(|k: BlockKey| k.0),
            token_ids,
            block_size: bs as u64,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name,
            extra_keys: Some(extra_keys),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..Default::default()
        }));
    }

    /// Ends a request: frees its blocks, tail first.
    pub fn finish(&mut self, id: u64) {
        let Some(s) = self.seqs.remove(&id) else { return };
        for &b in s.blocks.iter().rev() {
            let free = match self.blocks.get_mut(b) {
                Some(blk) => {
                    blk.refs = blk.refs.saturating_sub(1);
                    blk.refs == 0
                }
                None => false,
            };
            if free {
                self.push_free(b);
            }
        }
    }

    /// The request's tokens so far.
    pub fn tokens(&self, id: u64) -> Option<&[u32]> {
        self.seqs.get(&id).map(|s| s.tokens.as_slice())
    }

    /// vLLM's `reset_prefix_cache`: forgets every cached hash when no block is in use and
    /// announces `AllBlocksCleared`. Returns false while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.seqs.is_empty() {
            return false;
        }
        for blk in &mut self.blocks {
            blk.hash = None;
        }
        self.cached.clear();
        self.events.push(WireEvent::AllBlocksCleared);
        true
    }

    /// An engine restart: everything is gone and nothing is announced.
    pub fn restart(&mut self) {
        let n = self.blocks.len();
        self.blocks = vec![Block::default(); n];
        self.free.clear();
        self.cached.clear();
        self.seqs.clear();
        self.events.clear();
        for i in 0..n {
            self.push_free(i);
        }
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use llmgw_core::event::EventBatch;
    use llmgw_core::hash::HashAlgo;
    use llmgw_core::mirror::EngineMirror;
    use llmgw_core::wire::WireBatch;

    fn pool(n: usize) -> BlockPool {
        BlockPool::new(n, 4, BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap())
    }

    fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    /// Feeds the pool's events to a mirror with parity on, as the agent would.
    fn mirror_sync(p: &mut BlockPool, m: &mut EngineMirror) {
        let events = p.take_events();
        let batch = EventBatch::from(WireBatch { ts: 0.0, events, data_parallel_rank: Some(0) });
        let mut ch = Vec::new();
        m.apply(&batch, &mut ch);
    }

    #[test]
    fn hits_evictions_and_events_agree_with_a_mirror() {
        let mut p = pool(8);
        let mut m = EngineMirror::new(Some(BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap()));
        let (a, hit) = p.admit(toks(0..10), RequestExtras::default(), None).unwrap();
        assert_eq!(hit, 0);
        mirror_sync(&mut p, &mut m);
        assert_eq!(m.len(), 2, "two full prompt blocks stored");
        // Decode two tokens: the third block fills and is stored.
        p.append(a, 10).unwrap();
        p.append(a, 11).unwrap();
        mirror_sync(&mut p, &mut m);
        assert_eq!(m.len(), 3);
        p.finish(a);
        // Same prefix again: 3 leading blocks hit (12 tokens; the prompt has 13).
        let (b, hit) = p.admit(toks(0..12).into_iter().chain([99]).collect(), RequestExtras::default(), None).unwrap();
        assert_eq!(hit, 12);
        p.finish(b);
        // A whole prompt cached still computes its last token: 11 tokens → 2 blocks hit.
        assert_eq!(p.probe(&toks(0..12), &RequestExtras::default()), 2);
        // Fill the pool with other requests: LRU blocks are evicted with one event each.
        let (c, _) = p.admit(toks(100..132), RequestExtras::default(), None).unwrap();
        mirror_sync(&mut p, &mut m);
        assert!(p.stats().evictions > 0);
        assert_eq!(m.keys(), p.cached_keys(), "the mirror tracks the pool exactly");
        assert_eq!(m.stats().parity.mismatched, 0);
        assert!(m.stats().parity.matched >= 10);
        p.finish(c);
        assert!(p.reset_prefix_cache());
        mirror_sync(&mut p, &mut m);
        assert!(m.is_empty());
    }

    #[test]
    fn full_pool_refuses_and_salt_is_published() {
        let mut p = pool(2);
        let salted = RequestExtras { cache_salt: Some("s".into()), ..Default::default() };
        let (a, _) = p.admit(toks(0..8), salted.clone(), None).unwrap();
        assert_eq!(p.admit(toks(50..54), RequestExtras::default(), None), Err(PoolFull { needed: 1, free: 0 }));
        let ev = p.take_events();
        let WireEvent::BlockStored(s) = &ev[0] else { panic!("{ev:?}") };
        assert_eq!(s.extra_keys, Some(vec![Some(vec![WireValue::Str("s".into())]), None]));
        let mut m = EngineMirror::new(Some(BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap()));
        let mut ch = Vec::new();
        m.apply(&EventBatch::from(WireBatch { ts: 0.0, events: ev, data_parallel_rank: Some(0) }), &mut ch);
        assert_eq!(m.stats().parity.matched, 2, "salted hashes verify from the published extra keys");
        p.finish(a);
    }

    #[test]
    fn a_concurrent_request_hits_blocks_cached_at_admission() {
        let mut p = pool(6);
        // The first request's prompt blocks are cached when it is admitted, so a second one
        // with the same prompt hits them while the first still runs.
        let (a, _) = p.admit(toks(0..9), RequestExtras::default(), None).unwrap();
        let (b, hit) = p.admit(toks(0..9), RequestExtras::default(), None).unwrap();
        assert_eq!(hit, 8);
        p.finish(a);
        p.finish(b);
        assert_eq!(p.cached_keys().len(), 2);
    }
}
