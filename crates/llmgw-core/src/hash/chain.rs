//! A request's block chain: every full block hashed in order, each with the extra keys vLLM
//! gives it (LoRA on every block, multimodal items on the blocks they overlap, the cache salt on
//! block 0), optionally a few blocks at a time.

use super::block_key::Digest;
use super::extras::{ExtraKey, MmFeature, RequestExtras};
use super::hasher::{digest, BlockHash, BlockHasher};
use super::preimage;
use super::spec::HashError;

impl BlockHasher {
    /// Hashes every full block of a request's tokens, as the engine does when the request arrives.
    pub fn hash_request(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
    ) -> Result<Vec<BlockHash>, HashError> {
        let mut out = Vec::new();
        self.hash_request_into(tokens, block_size, extras, &mut out)?;
        Ok(out)
    }

    /// As [`Self::hash_request`], appending to `out`.
    pub fn hash_request_into(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
        out: &mut Vec<BlockHash>,
    ) -> Result<(), HashError> {
        let root = self.root;
        self.hash_blocks(tokens, block_size, extras, 0, root, usize::MAX, out).map(|_| ())
    }

    /// Hashes a request's blocks a few at a time: `done` holds the hashes of its first blocks
    /// (from earlier calls, empty at first); appends those of up to `n` more full blocks and
    /// returns how many. A router that only needs the leading run some replica holds can stop
    /// at the first block nobody holds instead of hashing the whole prompt.
    pub fn hash_request_more(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
        done: &mut Vec<BlockHash>,
        n: usize,
    ) -> Result<usize, HashError> {
        let parent = done.last().map_or(self.root, |b| b.digest);
        self.hash_blocks(tokens, block_size, extras, done.len(), parent, n, done)
    }

    /// Hashes up to `n` full blocks from block `first` (whose parent is `parent`), appending.
    #[allow(clippy::too_many_arguments)]
    fn hash_blocks(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        extras: &RequestExtras,
        first: usize,
        mut parent: Digest,
        n: usize,
        out: &mut Vec<BlockHash>,
    ) -> Result<usize, HashError> {
        if block_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        // With lookahead, a block is hashed only once the tokens after it exist.
        let la = extras.lookahead;
        let hashable = tokens.get(..tokens.len().saturating_sub(la)).unwrap_or_default();
        let blocks = hashable.chunks_exact(block_size).enumerate().skip(first).take(n);
        let mut added = 0usize;
        if self.cache.is_some()
            && extras.cache_salt.is_none()
            && extras.lora.is_none()
            && extras.mm.is_empty()
            && la == 0
        {
            // No extra keys: the memo's tag is taken over the parent digest and the raw token ids
            // (what the preimage encodes), so a memo hit needs no preimage encoding.
            let Self { algo, buf, pickler, cache, .. } = self;
            let mut raw = std::mem::take(buf);
            for (_, block) in blocks {
                let d = match cache.as_mut() {
                    Some(c) => {
                        let tag = c.plain_tag(&parent, block, &mut raw);
                        match c.get(&tag) {
                            Some(d) => d,
                            None => {
                                let d = digest(*algo, preimage::block(*algo, &mut raw, pickler, &parent, block, &[]));
                                c.put(tag, &d);
                                d
                            }
                        }
                    }
                    None => digest(*algo, preimage::block(*algo, &mut raw, pickler, &parent, block, &[])),
                };
                out.push(BlockHash { digest: d, key: d.key() });
                parent = d;
                added = added.saturating_add(1);
            }
            *buf = raw;
            return Ok(added);
        }
        let mut mm_idx = 0usize;
        let mut extra = std::mem::take(&mut self.extras);
        for (i, block) in blocks {
            let start = (i as u64).saturating_mul(block_size as u64);
            let end = start.saturating_add(block_size as u64);
            extra.clear();
            if let Some((name, path)) = &extras.lora {
                extra.push(ExtraKey::Lora { name: name.clone(), path: path.clone() });
            }
            // With lookahead the keys cover the block and the tokens after it; the item index
            // rewinds to the first item still reaching past the block.
            let window_end = end.saturating_add(la as u64);
            mm_idx = mm_extra_keys(&extras.mm, start, window_end, mm_idx, &mut extra);
            if la > 0 {
                while let Some(prev) = mm_idx.checked_sub(1).and_then(|p| extras.mm.get(p)) {
                    if prev.offset.saturating_add(prev.length) <= end {
                        break;
                    }
                    mm_idx = mm_idx.saturating_sub(1);
                }
            }
            if i == 0 {
                if let Some(salt) = &extras.cache_salt {
                    extra.push(ExtraKey::CacheSalt(salt.clone()));
                }
            }
            if la > 0 {
                let from = usize::try_from(end).unwrap_or(usize::MAX);
                let next = tokens.get(from..from.saturating_add(la)).unwrap_or_default();
                extra.push(ExtraKey::Lookahead(next.to_vec()));
            }
            let digest = self.hash_block(&parent, block, &extra);
            out.push(BlockHash { digest, key: digest.key() });
            parent = digest;
            added = added.saturating_add(1);
        }
        self.extras = extra;
        Ok(added)
    }
}

/// vLLM's `_gen_mm_extra_hash_keys`: walks the (offset-sorted) items from `idx`, pushing
/// `("mm", id, offset - start)` for each item the block `[start, end)` reaches, and returns the
/// index of the first item a later block must look at.
fn mm_extra_keys(items: &[MmFeature], start: u64, end: u64, mut idx: usize, out: &mut Vec<ExtraKey>) -> usize {
    let Some(last) = items.last() else { return idx };
    if last.offset.saturating_add(last.length) <= start {
        return idx;
    }
    while let Some(item) = items.get(idx) {
        let item_end = item.offset.saturating_add(item.length);
        if end <= item.offset {
            break;
        }
        if start >= item_end {
            idx = idx.saturating_add(1);
            continue;
        }
        let rel = i128::from(item.offset).saturating_sub(i128::from(start));
        let offset = i64::try_from(rel).unwrap_or(i64::MIN);
        out.push(ExtraKey::Mm { identifier: item.identifier.clone(), offset });
        if end >= item_end {
            idx = idx.saturating_add(1);
        } else {
            break;
        }
    }
    idx
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::super::*;
    use super::mm_extra_keys;

    #[test]
    fn hashing_a_few_blocks_at_a_time_gives_the_same_chain() {
        let toks: Vec<u32> = (0..200).map(|i| i * 31 % 50_000).collect();
        let mm = vec![MmFeature { identifier: "img".into(), offset: 20, length: 30 }];
        // An item ending exactly where a later call starts (block 3 starts at token 48).
        let edge = vec![
            MmFeature { identifier: "img".into(), offset: 20, length: 28 },
            MmFeature { identifier: "two".into(), offset: 60, length: 10 },
        ];
        for memo in [0, 64] {
            for ex in [
                RequestExtras::default(),
                RequestExtras { cache_salt: Some("s".into()), ..Default::default() },
                RequestExtras { lora: Some(("a".into(), "/p".into())), mm: mm.clone(), ..Default::default() },
                RequestExtras { mm: edge.clone(), ..Default::default() },
            ] {
                let Ok(h) = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")) else { panic!("hasher") };
                let mut h = h.with_cache(memo, 9);
                let whole = h.hash_request(&toks, 16, &ex).unwrap_or_default();
                assert_eq!(whole.len(), 12);
                let mut done = Vec::new();
                let mut steps = Vec::new();
                for n in [1, 2, 4, 8, 16] {
                    steps.push(h.hash_request_more(&toks, 16, &ex, &mut done, n).unwrap_or(99));
                }
                assert_eq!(steps, vec![1, 2, 4, 5, 0]);
                assert_eq!(done, whole);
            }
        }
    }

    #[test]
    fn mm_keys_span_blocks() {
        let items = [MmFeature { identifier: "i".into(), offset: 4, length: 20 }];
        let mut out = Vec::new();
        let idx = mm_extra_keys(&items, 0, 16, 0, &mut out);
        let idx = mm_extra_keys(&items, 16, 32, idx, &mut out);
        let idx2 = mm_extra_keys(&items, 32, 48, idx, &mut out);
        assert_eq!(
            out,
            vec![
                ExtraKey::Mm { identifier: "i".into(), offset: 4 },
                ExtraKey::Mm { identifier: "i".into(), offset: -12 }
            ]
        );
        assert_eq!((idx, idx2), (1, 1));
    }
}
