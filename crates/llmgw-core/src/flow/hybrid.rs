//! Hybrid models: an engine with several KV-cache groups (full attention plus sliding window,
//! as in gpt-oss, Gemma 3, Llama 4) hits a prefix only as far as every group allows. This
//! scores such an engine as vLLM 0.33's hybrid coordinator finds its cache hit
//! (`HybridKVCacheCoordinator.find_longest_cache_hit`):
//!
//! * the request may hit at most `num_tokens - 1` tokens (the last one is always computed);
//! * a full-attention group hits its leading run of cached blocks;
//! * a sliding-window group of window `w` and block size `b` needs the `⌈(w - 1) / b⌉` blocks
//!   before the hit's end cached, searched from the longest candidate down: the hit ends after
//!   the rightmost such run, or, when there is none, after the blocks cached from block 0;
//! * each group bounds the candidate length in turn until no group lowers it.
//!
//! Group g's blocks are indexed under `group_key(key, g)` (see the mirror). Supported: groups
//! whose block size is the hashing block size, of kinds `full_attention`, `mla_attention`,
//! `sliding_window` and `sliding_window_mla`, group 0 full attention. Anything else (Mamba
//! layers, mixed block sizes) is reported unsupported and scored by group 0 alone.

use crate::fleet::{KvGroupKind, Replica};
use crate::hash::{group_key, BlockHash};
use crate::index::ReplicaIndex;

/// How a hybrid engine's hit was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HybridHit {
    /// One KV-cache group: its leading run is the hit.
    NotHybrid,
    /// Blocks vLLM would hit.
    Hit(usize),
    /// Groups this scoring does not model (scored by group 0 alone).
    Unsupported,
}

/// The hit of `replica` for a request of `n_tokens` tokens whose leading blocks hash
/// to `hashes`, given group 0's leading run `full_run`.
pub fn hybrid_hit(
    index: &ReplicaIndex,
    replica: &Replica,
    hashes: &[BlockHash],
    full_run: usize,
    n_tokens: usize,
    block_size: usize,
) -> HybridHit {
    if !replica.hybrid() || block_size == 0 {
        return HybridHit::NotHybrid;
    }
    let mut groups = Vec::with_capacity(replica.kv_groups.len());
    for g in &replica.kv_groups {
        if g.kind == KvGroupKind::Unsupported
            || g.block_size != block_size
            || (g.idx == 0 && g.kind != KvGroupKind::Full)
        {
            return HybridHit::Unsupported;
        }
        if g.idx != 0 {
            groups.push((g.idx, g.kind));
        }
    }
    if !replica.kv_groups.iter().any(|g| g.idx == 0) {
        return HybridHit::Unsupported;
    }
    let id = replica.id;
    let holds = |g: u32, i: usize| hashes.get(i).is_some_and(|h| index.holds(id, group_key(h.key, g)));
    let max_blocks = n_tokens.saturating_sub(1).checked_div(block_size).unwrap_or(0);
    let mut hit = full_run.min(max_blocks).min(hashes.len());
    loop {
        let before = hit;
        for &(g, k) in &groups {
            hit = match k {
                KvGroupKind::Full => (0..hit).take_while(|&i| holds(g, i)).count(),
                KvGroupKind::Sliding { window } => sliding_hit(|i| holds(g, i), window, block_size, hit),
                KvGroupKind::Unsupported => 0,
            };
        }
        if hit >= before {
            return HybridHit::Hit(hit);
        }
    }
}

/// vLLM's sliding-window hit within the first `limit` blocks: the end of the rightmost run of
/// `⌈(window - 1) / block_size⌉` cached blocks, or the cached blocks from block 0 when no run
/// is that long.
fn sliding_hit(holds: impl Fn(usize) -> bool, window: usize, block_size: usize, limit: usize) -> usize {
    let need = window.saturating_sub(1).div_ceil(block_size);
    let mut contiguous = 0usize;
    for i in (0..limit).rev() {
        if holds(i) {
            contiguous = contiguous.saturating_add(1);
            if contiguous >= need {
                return i.saturating_add(contiguous);
            }
        } else {
            contiguous = 0;
        }
    }
    contiguous
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;

    fn at(cached: &[usize]) -> impl Fn(usize) -> bool + '_ {
        move |i| cached.contains(&i)
    }

    #[test]
    fn sliding_hits_end_after_the_rightmost_run_long_enough_for_the_window() {
        // Window 32, blocks of 16: 2 blocks before the hit's end must be cached.
        assert_eq!(sliding_hit(at(&[9, 10]), 32, 16, 11), 11);
        assert_eq!(sliding_hit(at(&[3, 4, 9]), 32, 16, 11), 5);
        // No run of 2: the blocks cached from block 0 (here one).
        assert_eq!(sliding_hit(at(&[0, 5, 9]), 32, 16, 11), 1);
        assert_eq!(sliding_hit(at(&[9, 10]), 32, 16, 6), 0);
        // Window 33 needs 2 blocks as well; 49 needs 3.
        assert_eq!(sliding_hit(at(&[8, 9, 10]), 49, 16, 11), 11);
        assert_eq!(sliding_hit(at(&[9, 10]), 49, 16, 11), 0);
    }
}
