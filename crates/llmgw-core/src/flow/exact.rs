//! The exact stage: a request's tokens hashed as its hash plan says and scored against the
//! index, replicas that hash otherwise uncredited, hybrid engines limited to what every
//! KV-cache group hits, and engines this Envoy just sent the prompt to credited with its
//! leading blocks (speculative entries).

use super::gateway::GatewayState;
use super::hash_plan::HashPlan;
use super::hybrid::{hybrid_hit, HybridHit};
use super::prefix::{prefix_scores, Scratch};
use super::reasons::Fallback;
use super::speculative::{checkpoints, Hit, MAX_BLOCKS};
use crate::feed::FeedState;
use crate::hash::{BlockHash, BlockHasher, RequestExtras};

/// What the exact stage reads besides the prompt.
pub struct Scoring<'a> {
    pub feed: &'a FeedState,
    pub plan: &'a HashPlan,
    /// Engines the feed reset, with when this VM learned it: speculative entries written
    /// before do not count.
    pub resets: &'a [(u64, u64)],
    pub gw: &'a dyn GatewayState,
}

/// The prompt to score: its tokens, hashes of its leading blocks computed earlier (a cached
/// tokenization) and what else enters its hashes.
pub struct PromptBlocks<'a> {
    pub tokens: &'a [u32],
    pub known: &'a [BlockHash],
    pub extras: &'a RequestExtras,
}

/// A request scored from exact data; the scratch space holds its hashes, its leading runs and
/// those the index alone shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scored {
    /// Prompt tokens.
    pub tokens: u64,
    /// The block size the plan hashes with.
    pub block_size: usize,
    /// Some replica has KV-cache groups hybrid scoring does not model: it was scored by its
    /// first group alone.
    pub hybrid_unsupported: bool,
}

/// Hashes and scores `prompt` into `scratch` with `hasher` (the plan's).
pub fn score(
    ctx: &Scoring<'_>,
    prompt: &PromptBlocks<'_>,
    hasher: &mut BlockHasher,
    scratch: &mut Scratch,
) -> Result<Scored, Fallback> {
    let block_size = ctx.plan.spec.block_size;
    let (tokens, extras) = (prompt.tokens, prompt.extras);
    prefix_scores(&ctx.feed.index, hasher, block_size, extras, tokens, prompt.known, scratch)
        .map_err(|_| Fallback::Hash)?;
    let leading = &mut scratch.scores.leading;
    for id in &ctx.plan.mismatched {
        if let Some(l) = leading.get_mut(usize::from(*id)) {
            *l = 0;
        }
    }
    // Hybrid engines hit only as far as every KV-cache group allows.
    let mut hybrid_unsupported = false;
    for r in ctx.feed.replicas.iter().filter(|r| r.hybrid()) {
        let Some(l) = scratch.scores.leading.get_mut(usize::from(r.id)) else { continue };
        let run = usize::try_from(*l).unwrap_or(usize::MAX);
        match hybrid_hit(&ctx.feed.index, r, &scratch.hashes, run, tokens.len(), block_size) {
            HybridHit::Hit(n) => *l = u32::try_from(n).unwrap_or(u32::MAX),
            HybridHit::Unsupported => hybrid_unsupported = true,
            HybridHit::NotHybrid => {}
        }
    }
    scratch.index_leading.clone_from(&scratch.scores.leading);
    // Speculative entries: engines this Envoy just sent this prompt's leading blocks to. The
    // blocks are hashed to a bounded depth for them, even past what the index holds.
    let full = usize::try_from(scratch.scores.total).unwrap_or(usize::MAX);
    let want = full.min(MAX_BLOCKS);
    if let Some(more) = want.checked_sub(scratch.hashes.len()).filter(|&n| n > 0) {
        hasher.hash_request_more(tokens, block_size, extras, &mut scratch.hashes, more).map_err(|_| Fallback::Hash)?;
    }
    credit_speculative(ctx, want, scratch);
    let tokens = u64::try_from(tokens.len()).unwrap_or(u64::MAX);
    Ok(Scored { tokens, block_size, hybrid_unsupported })
}

/// Raises the leading run of each engine a speculative entry names to the entry's checkpoint.
fn credit_speculative(ctx: &Scoring<'_>, want: usize, scratch: &mut Scratch) {
    let positions = || checkpoints(scratch.hashes.len().min(want));
    let keys: Vec<u64> = positions().filter_map(|i| scratch.hashes.get(i).map(|h| h.key.0)).collect();
    if keys.is_empty() {
        return;
    }
    let mut hits: Vec<Hit> = Vec::new();
    ctx.gw.speculative(&keys, &mut hits);
    for hit in &hits {
        if ctx.resets.iter().any(|&(e, at)| e == hit.engine && hit.written_ns <= at) {
            continue;
        }
        let Some(run) = positions().nth(hit.key).and_then(|p| u32::try_from(p).ok()).map(|p| p.saturating_add(1))
        else {
            continue;
        };
        for r in ctx.feed.replicas.iter().filter(|r| r.engine == hit.engine && !ctx.plan.mismatched.contains(&r.id)) {
            let leading = &mut scratch.scores.leading;
            let i = usize::from(r.id);
            if leading.len() <= i {
                leading.resize(i.saturating_add(1), 0);
            }
            if let Some(l) = leading.get_mut(i) {
                *l = (*l).max(run);
            }
        }
    }
}
