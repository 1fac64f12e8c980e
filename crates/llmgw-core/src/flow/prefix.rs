//! Exact prefix scoring: a request's block hashes against the index, hashing only as far as
//! some replica holds the blocks.
//!
//! Only the leading run a replica holds matters, so blocks are hashed in growing batches (8,
//! 16, 32, …) and hashing stops once no replica holds every block hashed so far: a prompt
//! nobody has cached costs a few sha256s, not one per block. Each batch is scored on its own
//! and joined to the runs so far, so every block is looked up once.

use crate::hash::{BlockHash, BlockHasher, BlockKey, HashError, RequestExtras};
use crate::index::{ReplicaIndex, Scores};

/// Blocks hashed before the first look at the index.
pub const FIRST_HASH_BATCH: usize = 8;

/// Reusable buffers for one request's hashing and scoring (one per VM: requests are served one
/// callback at a time).
#[derive(Debug, Default)]
pub struct Scratch {
    /// After [`prefix_scores`]: every hash computed or given, leading blocks first.
    pub hashes: Vec<BlockHash>,
    /// After [`prefix_scores`]: per replica, its leading run; `total` is the request's full
    /// blocks, hashed or not.
    pub scores: Scores,
    /// After the exact stage: per replica, the leading run the index alone shows (before
    /// speculative entries credit more).
    pub index_leading: Vec<u32>,
    keys: Vec<BlockKey>,
    batch: Scores,
}

/// Scores `tokens` against `index`. `known`: hashes of the request's leading blocks computed
/// earlier (a cached tokenization), used before hashing more.
pub fn prefix_scores(
    index: &ReplicaIndex,
    hasher: &mut BlockHasher,
    block_size: usize,
    extras: &RequestExtras,
    tokens: &[u32],
    known: &[BlockHash],
    scratch: &mut Scratch,
) -> Result<(), HashError> {
    let full = extras.hashed_blocks(tokens.len(), block_size).ok_or(HashError::ZeroBlockSize)?;
    let Scratch { hashes, scores, keys, batch: part, .. } = scratch;
    hashes.clear();
    hashes.extend_from_slice(known.get(..full.min(known.len())).unwrap_or_default());
    keys.clear();
    let mut batch = FIRST_HASH_BATCH;
    loop {
        let from = keys.len();
        // This round scores `batch` more blocks, or every known one if there are more.
        let want = from.saturating_add(batch).max(hashes.len()).min(full);
        if let Some(more) = want.checked_sub(hashes.len()).filter(|&n| n > 0) {
            hasher.hash_request_more(tokens, block_size, extras, hashes, more)?;
        }
        keys.extend(hashes.iter().skip(from).map(|h| h.key));
        let new_keys = keys.get(from..).unwrap_or_default();
        if from == 0 {
            index.score_into(new_keys, scores);
        } else {
            // Leading runs over the concatenation: a replica that held every block so far
            // extends its run by its run in the new batch.
            index.score_into(new_keys, part);
            for (l, &more) in scores.leading.iter_mut().zip(&part.leading) {
                if usize::try_from(*l).ok() == Some(from) {
                    *l = l.saturating_add(more);
                }
            }
        }
        let hashed = keys.len();
        let someone_holds_all = scores.leading.iter().any(|&l| usize::try_from(l).ok() == Some(hashed));
        if hashed == from || hashed >= full || !someone_holds_all {
            break;
        }
        batch = batch.saturating_mul(2);
    }
    scores.total = u32::try_from(full).unwrap_or(u32::MAX);
    Ok(())
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests {
    use super::*;
    use crate::hash::HashAlgo;
    use crate::index::ReplicaId;

    const BS: usize = 4;

    fn setup(blocks: usize) -> (BlockHasher, Vec<u32>, Vec<BlockHash>) {
        let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
        let tokens: Vec<u32> = (0..(blocks * BS) as u32 + 2).collect();
        let all = h.hash_request(&tokens, BS, &RequestExtras::default()).unwrap();
        (h, tokens, all)
    }

    fn run(index: &ReplicaIndex, h: &mut BlockHasher, tokens: &[u32], known: &[BlockHash]) -> Scratch {
        let mut s = Scratch::default();
        prefix_scores(index, h, BS, &RequestExtras::default(), tokens, known, &mut s).unwrap();
        s
    }

    #[test]
    fn a_prefix_nobody_holds_costs_one_batch_of_hashes() {
        let (mut h, tokens, all) = setup(100);
        let s = run(&ReplicaIndex::new(), &mut h, &tokens, &[]);
        assert_eq!(s.hashes.len(), FIRST_HASH_BATCH);
        assert_eq!(s.hashes[..], all[..FIRST_HASH_BATCH]);
        assert_eq!(s.scores.total, 100);
        assert!(s.scores.leading.iter().all(|&l| l == 0));
    }

    #[test]
    fn leading_runs_join_across_batches_and_hashing_stops_past_the_longest() {
        let (mut h, tokens, all) = setup(64);
        let mut index = ReplicaIndex::new();
        for b in &all[..20] {
            index.insert(ReplicaId(1), b.key);
        }
        for b in &all[..5] {
            index.insert(ReplicaId(0), b.key);
        }
        // Replica 2 holds a later block but not block 0: no leading run.
        index.insert(ReplicaId(2), all[30].key);
        let s = run(&index, &mut h, &tokens, &[]);
        assert_eq!(s.scores.leading, vec![5, 20, 0]);
        assert_eq!(s.scores.total, 64);
        // Batches of 8 then 16: block 24 is the last hashed.
        assert_eq!(s.hashes.len(), 24);
        // The same runs as hashing and scoring everything.
        let whole = index.score(&all.iter().map(|b| b.key).collect::<Vec<_>>());
        assert_eq!(whole.leading, s.scores.leading);
    }

    #[test]
    fn a_fully_held_prompt_is_hashed_to_its_end_and_known_hashes_are_reused() {
        let (mut h, tokens, all) = setup(40);
        let mut index = ReplicaIndex::new();
        for b in &all {
            index.insert(ReplicaId(0), b.key);
        }
        let s = run(&index, &mut h, &tokens, &[]);
        assert_eq!((s.scores.leading.clone(), s.hashes.len()), (vec![40], 40));
        // Known hashes are taken as given (a wrong one would show in the score).
        let mut wrong = all[..30].to_vec();
        wrong[29].key.0 ^= 1;
        let s = run(&index, &mut h, &tokens, &wrong);
        assert_eq!(s.scores.leading, vec![29]);
        assert_eq!(s.hashes[..29], all[..29]);
        // More known hashes than full blocks: only the full ones count.
        let s = run(&index, &mut h, &tokens[..8], &all);
        assert_eq!((s.scores.total, s.hashes.len()), (2, 2));
    }
}
