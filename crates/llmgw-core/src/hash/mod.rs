//! vLLM's prefix-cache block hash chain (vLLM 0.33 `hash_block_tokens` and
//! `get_request_block_hasher`), byte for byte.
//!
//! For every *full* block `i` of `block_size` tokens, vLLM computes
//! `h_i = H((h_{i-1}, tuple(tokens_i), extra_keys_i))` with `h_{-1} = NONE_HASH = H(seed)`, where
//! `seed` is the string value of `PYTHONHASHSEED`, or `"vllm-none-hash"` when it is unset, and `H`
//! is the configured algorithm. KV events publish `h_i` reduced to its last 8 bytes read
//! big-endian: the block *key* used everywhere in llmgw.
//!
//! Split by concern: this file holds the types and the hasher; `preimage` writes the bytes
//! vLLM hashes (CBOR through `minicbor`, pickle by hand), `chain` walks a request's blocks
//! with its extra keys, and `memo` keeps recent digests.

mod chain;
mod memo;
mod preimage;

use crate::pickle::Pickler;
use memo::DigestCache;
use sha2::{Digest as _, Sha256};
use std::fmt;

/// Most lookahead tokens a hash setting may name (vLLM uses 1 for EAGLE and
/// `num_speculative_tokens` for multi-module MTP; this bounds what the feed can ask for).
pub const MAX_LOOKAHEAD: usize = 64;

/// The seed vLLM hashes for the root parent when `PYTHONHASHSEED` is unset (vLLM ≥ 0.29).
pub const UNSET_SEED: &str = "vllm-none-hash";

/// The hashing every part of llmgw assumes when nothing says otherwise (filter profiles, the
/// agent's `[hash]`, the simulator's flags): what `llmgw-agent vllm-args` starts vLLM with.
pub mod defaults {
    use super::HashAlgo;
    /// vLLM's `--block-size` default for CUDA engines.
    pub const BLOCK_SIZE: u32 = 16;
    /// `--prefix-caching-hash-algo` as llmgw's launcher sets it.
    pub const ALGO: HashAlgo = HashAlgo::Sha256Cbor;
}

/// `--prefix-caching-hash-algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// sha256 of the canonical CBOR encoding (what llmgw's launcher sets).
    Sha256Cbor,
    /// sha256 of the Python pickle (protocol 5): vLLM's default.
    Sha256,
    /// xxh3-128 of the canonical CBOR encoding (16-byte digests).
    XxhashCbor,
    /// xxh3-128 of the Python pickle (16-byte digests).
    Xxhash,
}

impl HashAlgo {
    pub const ALL: [HashAlgo; 4] = [Self::Sha256Cbor, Self::Sha256, Self::XxhashCbor, Self::Xxhash];

    /// The name vLLM's flag uses.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256Cbor => "sha256_cbor",
            Self::Sha256 => "sha256",
            Self::XxhashCbor => "xxhash_cbor",
            Self::Xxhash => "xxhash",
        }
    }

    /// Parses vLLM's flag value.
    pub fn parse(s: &str) -> Result<Self, HashError> {
        Self::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| HashError::UnknownAlgo(s.to_owned()))
    }

    fn is_cbor(self) -> bool {
        matches!(self, Self::Sha256Cbor | Self::XxhashCbor)
    }

    fn is_xxhash(self) -> bool {
        matches!(self, Self::XxhashCbor | Self::Xxhash)
    }
}

/// What must agree between the router and an engine for their block keys to match: the
/// algorithm, the seed (`PYTHONHASHSEED`, `None` when unset) and the tokens per block.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HashSpec {
    pub algo: HashAlgo,
    pub seed: Option<String>,
    /// At least 1 where a spec is built from configuration or the feed.
    pub block_size: usize,
    /// Lookahead tokens per block hash (EAGLE-family speculative decoding; 0: none).
    pub lookahead: usize,
}

impl HashSpec {
    /// The hasher for this spec (without a digest memo).
    pub fn hasher(&self) -> Result<BlockHasher, HashError> {
        BlockHasher::new(self.algo, self.seed.as_deref())
    }

    /// A stable 64-bit name of this spec (tags cached tokenizations with the hashing their
    /// block hashes were computed by).
    pub fn fingerprint(&self) -> u64 {
        let mut bytes = Vec::with_capacity(64);
        bytes.extend_from_slice(self.algo.name().as_bytes());
        bytes.push(0);
        match &self.seed {
            Some(s) => {
                bytes.push(1);
                bytes.extend_from_slice(s.as_bytes());
            }
            None => bytes.push(0),
        }
        bytes.push(0);
        bytes.extend_from_slice(&u64::try_from(self.block_size).unwrap_or(u64::MAX).to_le_bytes());
        bytes.extend_from_slice(&u64::try_from(self.lookahead).unwrap_or(u64::MAX).to_le_bytes());
        crate::stable_hash::stable_hash(&bytes)
    }

    /// The seed as a log line shows it: quoted, or `unset`.
    pub fn seed_text(&self) -> String {
        self.seed.as_ref().map_or_else(|| "unset".to_owned(), |s| format!("{s:?}"))
    }

    /// The fields where `self` and `other` differ: (field, self's value, other's value).
    pub fn differences(&self, other: &HashSpec) -> Vec<(&'static str, String, String)> {
        let mut out = Vec::new();
        if self.algo != other.algo {
            out.push(("hash_algo", self.algo.name().to_owned(), other.algo.name().to_owned()));
        }
        if self.seed != other.seed {
            out.push(("seed", self.seed_text(), other.seed_text()));
        }
        if self.block_size != other.block_size {
            out.push(("block_size", self.block_size.to_string(), other.block_size.to_string()));
        }
        if self.lookahead != other.lookahead {
            out.push(("lookahead_tokens", self.lookahead.to_string(), other.lookahead.to_string()));
        }
        out
    }
}

/// Read from configuration as vLLM's flag value (`"sha256_cbor"`, …); an unknown name is an
/// error that lists the known ones.
impl<'de> serde::Deserialize<'de> for HashAlgo {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        HashAlgo::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why hashing could not be set up or run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashError {
    UnknownAlgo(String),
    /// vLLM seeds xxhash roots randomly when `PYTHONHASHSEED` is unset: nobody can reproduce them.
    XxhashNeedsSeed,
    /// This build was made without the `xxhash` feature.
    XxhashUnavailable,
    ZeroBlockSize,
}

impl fmt::Display for HashError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownAlgo(s) => {
                write!(f, "unknown hash algorithm {s:?} (expected sha256_cbor, sha256, xxhash_cbor or xxhash)")
            }
            Self::XxhashNeedsSeed => f.write_str(
                "xxhash roots are random in vLLM when PYTHONHASHSEED is unset; set a seed on the replicas and here",
            ),
            Self::XxhashUnavailable => f.write_str("this build has no xxhash support"),
            Self::ZeroBlockSize => f.write_str("block size must be at least 1"),
        }
    }
}

impl std::error::Error for HashError {}

/// A block digest: 32 bytes for sha256, 16 for xxh3-128.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest {
    bytes: [u8; 32],
    len: u8,
}

impl Digest {
    pub fn from_sha256(bytes: [u8; 32]) -> Self {
        Self { bytes, len: 32 }
    }

    pub fn from_xxh128(bytes: [u8; 16]) -> Self {
        let mut b = [0u8; 32];
        if let Some(dst) = b.get_mut(..16) {
            dst.copy_from_slice(&bytes);
        }
        Self { bytes: b, len: 16 }
    }

    /// From raw bytes of length 16 or 32.
    pub fn from_slice(b: &[u8]) -> Option<Self> {
        match b.len() {
            32 => <[u8; 32]>::try_from(b).ok().map(Self::from_sha256),
            16 => <[u8; 16]>::try_from(b).ok().map(Self::from_xxh128),
            _ => None,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..usize::from(self.len)).unwrap_or(&self.bytes)
    }

    /// The form KV events publish: the last 8 bytes, big-endian.
    pub fn key(&self) -> BlockKey {
        key_of_bytes(self.as_bytes()).unwrap_or_default()
    }

    pub fn to_hex(&self) -> String {
        hex(self.as_bytes())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}

/// A block's key: vLLM's block hash in the u64 form its KV events publish (the digest's last 8
/// bytes, big-endian; what `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` sends as an int). Events, the
/// engine mirror, the feed and the index all name blocks by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// KV-cache groups an engine may have mirrored (hybrid models have a few; past it a group's
/// events are counted as ignored).
pub const MAX_KV_GROUPS: u32 = 16;

/// The key block `key` of KV-cache group `group` is indexed under: the key itself for group 0,
/// a stable mix of key and group for the others. vLLM publishes the same hash in every group
/// that caches the block, and a hybrid model hits only as far as every group allows, so the
/// mirror, the feed and the index keep each group's blocks apart in one key space.
pub fn group_key(key: BlockKey, group: u32) -> BlockKey {
    if group == 0 {
        return key;
    }
    let salt = crate::stable_hash::mix64(0x6b76_5f67_726f_7570 ^ u64::from(group));
    BlockKey(crate::stable_hash::mix64(key.0 ^ salt))
}

/// The published u64 form of a hash given as bytes (`int.from_bytes(b, "big") & (2**64-1)`):
/// its last 8 bytes, big-endian. `None` when shorter than 8 bytes.
pub fn key_of_bytes(b: &[u8]) -> Option<BlockKey> {
    let start = b.len().checked_sub(8)?;
    let tail: [u8; 8] = b.get(start..)?.try_into().ok()?;
    Some(BlockKey(u64::from_be_bytes(tail)))
}

/// Lowercase hex.
pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(b.len().saturating_mul(2));
    for &x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// One extra key as vLLM hashes it (tagged tuples since vLLM 0.32).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// `("lora", name, path)` on every block of a LoRA request.
    Lora { name: String, path: String },
    /// `("mm", identifier, offset - block_start)` for a multimodal item overlapping the block.
    Mm { identifier: String, offset: i64 },
    /// `("cache_salt", salt)` on block 0 only.
    CacheSalt(String),
    /// `("prompt_embeds", sha256 of the block's embedding tensor bytes)`.
    PromptEmbeds(Vec<u8>),
    /// Lookahead hashing (EAGLE-family speculative decoding, vLLM 0.33): the `L` tokens after
    /// the block. Always the last key; the block's extra keys are then `(E, *tokens)`, where `E`
    /// is the tuple of the keys before it (or `None` when there are none).
    Lookahead(Vec<u32>),
}

/// A multimodal item's placeholder range in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmFeature {
    pub identifier: String,
    pub offset: u64,
    pub length: u64,
}

/// What a request adds to its block hashes besides tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestExtras {
    pub cache_salt: Option<String>,
    /// (adapter name, adapter path) as the engine loaded it.
    pub lora: Option<(String, String)>,
    /// Sorted by offset, as vLLM keeps them.
    pub mm: Vec<MmFeature>,
    /// vLLM's `num_hash_lookahead_tokens` (EAGLE-family speculative decoding with prefix
    /// caching): each block's hash also covers the next this many tokens, so a block is hashed
    /// only once they exist. 0: plain hashing.
    pub lookahead: usize,
}

impl RequestExtras {
    /// Full blocks of `n_tokens` the engine hashes (those followed by `lookahead` more tokens);
    /// `None` for a zero block size.
    pub fn hashed_blocks(&self, n_tokens: usize, block_size: usize) -> Option<usize> {
        n_tokens.saturating_sub(self.lookahead).checked_div(block_size)
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
    algo: HashAlgo,
    root: Digest,
    buf: Vec<u8>,
    pickler: Pickler,
    extras: Vec<ExtraKey>,
    cache: Option<DigestCache>,
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
fn digest(algo: HashAlgo, data: &[u8]) -> Digest {
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
