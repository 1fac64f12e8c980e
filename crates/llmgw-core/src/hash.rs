//! vLLM's prefix-cache block hash chain (vLLM 0.33 `hash_block_tokens` and
//! `get_request_block_hasher`), byte for byte.
//!
//! For every *full* block `i` of `block_size` tokens, vLLM computes
//! `h_i = H((h_{i-1}, tuple(tokens_i), extra_keys_i))` with `h_{-1} = NONE_HASH = H(seed)`, where
//! `seed` is the string value of `PYTHONHASHSEED`, or `"vllm-none-hash"` when it is unset, and `H`
//! is the configured algorithm. KV events publish `h_i` reduced to its last 8 bytes read
//! big-endian: the block *key* used everywhere in llmgw.

use crate::cbor;
use crate::pickle::{Pickler, PyValue};
use sha2::{Digest as _, Sha256};
use std::fmt;

/// The seed vLLM hashes for the root parent when `PYTHONHASHSEED` is unset (vLLM ≥ 0.29).
pub const UNSET_SEED: &str = "vllm-none-hash";

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
    pub fn key(&self) -> u64 {
        key_of_bytes(self.as_bytes()).unwrap_or(0)
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

/// The published u64 form of a hash given as bytes (`int.from_bytes(b, "big") & (2**64-1)`):
/// its last 8 bytes, big-endian. `None` when shorter than 8 bytes.
pub fn key_of_bytes(b: &[u8]) -> Option<u64> {
    let start = b.len().checked_sub(8)?;
    let tail: [u8; 8] = b.get(start..)?.try_into().ok()?;
    Some(u64::from_be_bytes(tail))
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
}

/// One hashed full block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHash {
    pub digest: Digest,
    /// The published u64 form (`digest.key()`).
    pub key: u64,
}

/// Computes vLLM block hashes for one algorithm and seed. Holds scratch buffers, so reuse it.
pub struct BlockHasher {
    algo: HashAlgo,
    root: Digest,
    buf: Vec<u8>,
    pickler: Pickler,
    extras: Vec<ExtraKey>,
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
        };
        h.root = h.hash_seed(seed);
        Ok(h)
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// vLLM's `NONE_HASH`: the parent of block 0.
    pub fn root(&self) -> Digest {
        self.root
    }

    fn hash_seed(&mut self, seed: &str) -> Digest {
        if self.algo.is_cbor() {
            self.buf.clear();
            cbor::text(&mut self.buf, seed);
            let buf = std::mem::take(&mut self.buf);
            let d = self.finish(&buf);
            self.buf = buf;
            d
        } else {
            let bytes = self.pickler.dumps(&PyValue::Str { s: seed, interned: false }).to_vec();
            self.finish(&bytes)
        }
    }

    fn finish(&self, data: &[u8]) -> Digest {
        match self.algo {
            HashAlgo::Sha256Cbor | HashAlgo::Sha256 => Digest::from_sha256(Sha256::digest(data).into()),
            HashAlgo::XxhashCbor | HashAlgo::Xxhash => xxh128(data),
        }
    }

    /// The bytes hashed for one block (the CBOR or pickle encoding of
    /// `(parent, tuple(tokens), extra_keys or None)`).
    pub fn preimage(&mut self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Vec<u8> {
        self.encode(parent, tokens, extra).to_vec()
    }

    fn encode(&mut self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> &[u8] {
        if self.algo.is_cbor() {
            let b = &mut self.buf;
            b.clear();
            cbor::array_header(b, 3);
            cbor::bytes(b, parent.as_bytes());
            cbor::array_header(b, tokens.len());
            for &t in tokens {
                cbor::uint(b, u64::from(t));
            }
            if extra.is_empty() {
                cbor::null(b);
            } else {
                cbor::array_header(b, extra.len());
                for e in extra {
                    match e {
                        ExtraKey::Lora { name, path } => {
                            cbor::array_header(b, 3);
                            cbor::text(b, "lora");
                            cbor::text(b, name);
                            cbor::text(b, path);
                        }
                        ExtraKey::Mm { identifier, offset } => {
                            cbor::array_header(b, 3);
                            cbor::text(b, "mm");
                            cbor::text(b, identifier);
                            cbor::int(b, *offset);
                        }
                        ExtraKey::CacheSalt(s) => {
                            cbor::array_header(b, 2);
                            cbor::text(b, "cache_salt");
                            cbor::text(b, s);
                        }
                        ExtraKey::PromptEmbeds(d) => {
                            cbor::array_header(b, 2);
                            cbor::text(b, "prompt_embeds");
                            cbor::bytes(b, d);
                        }
                    }
                }
            }
            &self.buf
        } else {
            let tag = |s| PyValue::Str { s, interned: true };
            let plain = |s| PyValue::Str { s, interned: false };
            let extra_v = if extra.is_empty() {
                PyValue::None
            } else {
                PyValue::Tuple(
                    extra
                        .iter()
                        .map(|e| match e {
                            ExtraKey::Lora { name, path } => {
                                PyValue::Tuple(vec![tag("lora"), plain(name), plain(path)])
                            }
                            ExtraKey::Mm { identifier, offset } => {
                                PyValue::Tuple(vec![tag("mm"), plain(identifier), PyValue::Int(*offset)])
                            }
                            ExtraKey::CacheSalt(s) => PyValue::Tuple(vec![tag("cache_salt"), plain(s)]),
                            ExtraKey::PromptEmbeds(d) => PyValue::Tuple(vec![tag("prompt_embeds"), PyValue::Bytes(d)]),
                        })
                        .collect(),
                )
            };
            let v = PyValue::Tuple(vec![PyValue::Bytes(parent.as_bytes()), PyValue::UIntTuple(tokens), extra_v]);
            self.pickler.dumps(&v)
        }
    }

    /// `hash_block_tokens(hash_fn, parent, tokens, extra_keys)`.
    pub fn hash_block(&mut self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Digest {
        let algo = self.algo;
        let data = self.encode(parent, tokens, extra);
        match algo {
            HashAlgo::Sha256Cbor | HashAlgo::Sha256 => Digest::from_sha256(Sha256::digest(data).into()),
            HashAlgo::XxhashCbor | HashAlgo::Xxhash => xxh128(data),
        }
    }

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
        if block_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        let mut parent = self.root;
        let mut mm_idx = 0usize;
        let mut extra = std::mem::take(&mut self.extras);
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let start = (i as u64).saturating_mul(block_size as u64);
            let end = start.saturating_add(block_size as u64);
            extra.clear();
            if let Some((name, path)) = &extras.lora {
                extra.push(ExtraKey::Lora { name: name.clone(), path: path.clone() });
            }
            mm_idx = mm_extra_keys(&extras.mm, start, end, mm_idx, &mut extra);
            if i == 0 {
                if let Some(salt) = &extras.cache_salt {
                    extra.push(ExtraKey::CacheSalt(salt.clone()));
                }
            }
            let digest = self.hash_block(&parent, block, &extra);
            out.push(BlockHash { digest, key: digest.key() });
            parent = digest;
        }
        self.extras = extra;
        Ok(())
    }
}

/// vLLM's `_gen_mm_extra_hash_keys`: walks the (offset-sorted) items from `idx`, pushing
/// `("mm", id, offset - start)` for each item the block `[start, end)` reaches, and returns the
/// index of the first item a later block must look at.
fn mm_extra_keys(items: &[MmFeature], start: u64, end: u64, mut idx: usize, out: &mut Vec<ExtraKey>) -> usize {
    let Some(last) = items.last() else { return idx };
    if last.offset.saturating_add(last.length) < start {
        return idx;
    }
    while let Some(item) = items.get(idx) {
        let item_end = item.offset.saturating_add(item.length);
        if end <= item.offset {
            break;
        }
        if start > item_end {
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
#[allow(clippy::arithmetic_side_effects)]
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
        assert_eq!(b.first().map(|b| b.key), Some(3236607068019569386));
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
