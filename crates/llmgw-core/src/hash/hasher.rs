//! The hasher: vLLM's block hash for one algorithm and seed, with scratch buffers and an
//! optional digest memo.

use super::block_key::{BlockKey, Digest};
use super::extras::ExtraKey;
use super::memo::DigestCache;
use super::preimage;
use super::spec::{HashAlgo, HashError, HashSpec, UNSET_SEED};
use crate::pickle::Pickler;
use sha2::{Digest as _, Sha256};

impl HashSpec {
    /// The hasher for this spec (without a digest memo).
    pub fn hasher(&self) -> Result<BlockHasher, HashError> {
        BlockHasher::new(self.algo, self.seed.as_deref())
    }
}

/// One hashed full block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHash {
    pub digest: Digest,
    /// The published u64 form (`digest.key()`).
    pub key: BlockKey,
}

/// Computes vLLM block hashes for one algorithm and seed. Holds scratch buffers, so reuse it.
pub struct BlockHasher {
    pub(super) algo: HashAlgo,
    pub(super) root: Digest,
    pub(super) buf: Vec<u8>,
    pub(super) pickler: Pickler,
    pub(super) extras: Vec<ExtraKey>,
    pub(super) cache: Option<DigestCache>,
}

impl BlockHasher {
    /// `seed`: the replicas' `PYTHONHASHSEED` value, or `None` when they run without it.
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> Result<Self, HashError> {
        if algo.is_xxhash() && !cfg!(feature = "xxhash") {
            return Err(HashError::XxhashUnavailable);
        }
        let seed = match (seed, algo.is_xxhash()) {
            (Some(s), _) => s,
            (None, false) => UNSET_SEED,
            (None, true) => return Err(HashError::XxhashNeedsSeed),
        };
        let mut h = Self {
            algo,
            root: Digest::from_sha256([0; 32]),
            buf: Vec::with_capacity(256),
            pickler: Pickler::new(),
            extras: Vec::new(),
            cache: None,
        };
        h.root = h.hash_seed(seed);
        Ok(h)
    }

    /// Keeps the digests of up to `slots` recent blocks (rounded up to a power of two, 56 bytes
    /// each; 0 turns the memo off) and reuses them when the same block (same parent, tokens and
    /// extra keys) comes again: requests sharing a prefix skip its sha256s. `key` keys the memo's
    /// tags (any value; pass a random one where clients choose the tokens). Digests are the same
    /// with or without the memo. Needs the `xxhash` feature (without it, this does nothing).
    pub fn with_cache(mut self, slots: usize, key: u64) -> Self {
        self.cache = (slots > 0 && cfg!(feature = "xxhash")).then(|| DigestCache::new(slots, key));
        self
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// vLLM's `NONE_HASH`: the parent of block 0.
    pub fn root(&self) -> Digest {
        self.root
    }

    fn hash_seed(&mut self, seed: &str) -> Digest {
        let data = preimage::seed(self.algo, &mut self.buf, &mut self.pickler, seed);
        digest(self.algo, data)
    }

    /// The bytes hashed for one block (the CBOR or pickle encoding of
    /// `(parent, tuple(tokens), extra_keys or None)`).
    pub fn preimage(&mut self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Vec<u8> {
        preimage::block(self.algo, &mut self.buf, &mut self.pickler, parent, tokens, extra).to_vec()
    }

    /// `hash_block_tokens(hash_fn, parent, tokens, extra_keys)`.
    pub fn hash_block(&mut self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Digest {
        let algo = self.algo;
        let data = preimage::block(algo, &mut self.buf, &mut self.pickler, parent, tokens, extra);
        let Some(cache) = self.cache.as_mut() else { return digest(algo, data) };
        let tag = cache.tag(data);
        if let Some(d) = cache.get(&tag) {
            return d;
        }
        let d = digest(algo, data);
        cache.put(tag, &d);
        d
    }
}

/// `H(data)` for the configured algorithm.
pub(super) fn digest(algo: HashAlgo, data: &[u8]) -> Digest {
    match algo {
        HashAlgo::Sha256Cbor | HashAlgo::Sha256 => Digest::from_sha256(Sha256::digest(data).into()),
        HashAlgo::XxhashCbor | HashAlgo::Xxhash => xxh128(data),
    }
}

#[cfg(feature = "xxhash")]
fn xxh128(data: &[u8]) -> Digest {
    Digest::from_xxh128(xxhash_rust::xxh3::xxh3_128(data).to_be_bytes())
}

#[cfg(not(feature = "xxhash"))]
fn xxh128(_data: &[u8]) -> Digest {
    // Unreachable in practice: `BlockHasher::new` refuses xxhash without the feature.
    Digest::from_xxh128([0; 16])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::RequestExtras;
    #[test]
    fn none_hash_matches_vllm() {
        let h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).ok();
        assert_eq!(
            h.map(|h| h.root().to_hex()).as_deref(),
            Some("4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e")
        );
        let h = BlockHasher::new(HashAlgo::Sha256Cbor, None).ok();
        assert_eq!(
            h.map(|h| h.root().to_hex()).as_deref(),
            Some("9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0")
        );
    }

    #[test]
    fn golden_first_block() {
        let Ok(mut h) = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")) else { panic!("hasher") };
        let toks: Vec<u32> = (1..=16).collect();
        let b = h.hash_request(&toks, 16, &RequestExtras::default()).unwrap_or_default();
        assert_eq!(b.len(), 1);
        assert_eq!(
            b.first().map(|b| b.digest.to_hex()).as_deref(),
            Some("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea")
        );
        assert_eq!(b.first().map(|b| b.key), Some(BlockKey(3236607068019569386)));
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let Ok(mut h) = BlockHasher::new(HashAlgo::Sha256, None) else { panic!("hasher") };
        let toks: Vec<u32> = (0..47).collect();
        assert_eq!(h.hash_request(&toks, 16, &RequestExtras::default()).map(|v| v.len()), Ok(2));
        assert_eq!(h.hash_request(&toks, 0, &RequestExtras::default()), Err(HashError::ZeroBlockSize));
    }

    #[test]
    fn xxhash_needs_a_seed() {
        assert!(matches!(BlockHasher::new(HashAlgo::Xxhash, None), Err(HashError::XxhashNeedsSeed)));
    }
}
