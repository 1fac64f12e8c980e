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
    cache: Option<DigestCache>,
}

/// A memo of recent block digests ([`BlockHasher::with_cache`]): direct-mapped slots keyed by
/// a 128-bit tag of what determines the block's digest, so a prefix seen before costs one tag
/// per block instead of a sha256. The result is the same digest: a hit needs the whole tag to
/// match. Blocks without extra keys (the common case) are tagged over the parent digest and the
/// token ids with two lanes of NH, the universal hash of UMAC (one 32×32→64-bit multiply per two
/// words: cheap in wasm, unlike 128-bit multiplies), under a secret per-VM key: two distinct
/// blocks collide with probability at most 2⁻⁶⁴ whatever their contents, as long as the key is
/// unknown. Other blocks use a keyed 128-bit xxh3 of the whole preimage.
struct DigestCache {
    key: u64,
    /// NH key words, two lanes (`NH_WORDS` each).
    nh: Vec<u32>,
    /// (tag, digest bytes, digest length); a zero tag marks an empty slot.
    slots: Vec<([u64; 2], [u8; 32], u8)>,
}

/// Words (parent digest + tokens, as u32) an NH tag covers: blocks of up to 56 tokens.
const NH_WORDS: usize = 64;

/// SplitMix64's finaliser: a bijection on u64 that spreads every input bit.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Key words for NH from a seed (SplitMix64 stream).
fn nh_key(seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..NH_WORDS.saturating_mul(2))
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            // The truncating cast takes the low 32 bits of a mixed word.
            mix64(state) as u32
        })
        .collect()
}

/// NH over `words` with key words `k` (as many or more): the sum of
/// ((m₂ᵢ + k₂ᵢ) mod 2³²) × ((m₂ᵢ₊₁ + k₂ᵢ₊₁) mod 2³²) mod 2⁶⁴.
fn nh(words: &[u32], k: &[u32]) -> u64 {
    words.chunks(2).zip(k.chunks_exact(2)).fold(0u64, |acc, (m, k)| {
        let m0 = m.first().copied().unwrap_or(0);
        let m1 = m.get(1).copied().unwrap_or(0);
        let k0 = k.first().copied().unwrap_or(0);
        let k1 = k.get(1).copied().unwrap_or(0);
        acc.wrapping_add(u64::from(m0.wrapping_add(k0)).wrapping_mul(u64::from(m1.wrapping_add(k1))))
    })
}

impl DigestCache {
    #[cfg(feature = "xxhash")]
    fn tag(&self, data: &[u8]) -> [u64; 2] {
        let t = xxhash_rust::xxh3::xxh3_128_with_seed(data, self.key);
        // Truncating casts: the two halves of the tag.
        let hi = (t >> 64) as u64;
        let lo = t as u64;
        [hi, if hi == 0 && lo == 0 { 1 } else { lo }]
    }

    #[cfg(not(feature = "xxhash"))]
    fn tag(&self, _data: &[u8]) -> [u64; 2] {
        [0, 0]
    }

    /// The tag of a block without extra keys: the parent digest and the raw token ids (which
    /// determine its preimage). NH when the block fits its key, else a keyed xxh3 apart from
    /// preimage tags.
    fn plain_tag(&self, parent: &Digest, tokens: &[u32], scratch: &mut Vec<u8>) -> [u64; 2] {
        let pw = parent.as_bytes().len() / 4;
        let n = pw.saturating_add(tokens.len());
        if let (Some(k0), Some(k1)) = (self.nh.get(..n), self.nh.get(NH_WORDS..NH_WORDS.saturating_add(n))) {
            let mut words = [0u32; NH_WORDS];
            for (w, c) in words.iter_mut().zip(parent.as_bytes().chunks_exact(4)) {
                *w = u32::from_le_bytes([
                    c.first().copied().unwrap_or(0),
                    c.get(1).copied().unwrap_or(0),
                    c.get(2).copied().unwrap_or(0),
                    c.get(3).copied().unwrap_or(0),
                ]);
            }
            for (w, t) in words.iter_mut().skip(pw).zip(tokens) {
                *w = *t;
            }
            let words = words.get(..n).unwrap_or_default();
            // The length enters the tag (NH's bound is for messages of equal length); the mixers
            // are bijections, so they keep NH's collision bound and spread its bits for `slot`.
            let len = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let hi = mix64(nh(words, k0) ^ len);
            let lo = mix64(nh(words, k1).wrapping_add(len));
            return [hi, if hi == 0 && lo == 0 { 1 } else { lo }];
        }
        self.plain_tag_xxh3(parent, tokens, scratch)
    }

    #[cfg(feature = "xxhash")]
    fn plain_tag_xxh3(&self, parent: &Digest, tokens: &[u32], scratch: &mut Vec<u8>) -> [u64; 2] {
        scratch.clear();
        scratch.extend_from_slice(parent.as_bytes());
        for t in tokens {
            scratch.extend_from_slice(&t.to_le_bytes());
        }
        let t = xxhash_rust::xxh3::xxh3_128_with_seed(scratch, self.key ^ 0x706c_6169_6e21_2121);
        let hi = (t >> 64) as u64;
        let lo = t as u64;
        [hi, if hi == 0 && lo == 0 { 1 } else { lo }]
    }

    #[cfg(not(feature = "xxhash"))]
    fn plain_tag_xxh3(&self, _parent: &Digest, _tokens: &[u32], _scratch: &mut Vec<u8>) -> [u64; 2] {
        [0, 0]
    }

    fn slot(&self, tag: &[u64; 2]) -> usize {
        // `slots.len()` is a power of two; the truncating cast keeps the low bits.
        (tag[1] as usize) & self.slots.len().wrapping_sub(1)
    }

    fn get(&self, tag: &[u64; 2]) -> Option<Digest> {
        let (t, bytes, len) = self.slots.get(self.slot(tag))?;
        if t != tag || *tag == [0, 0] {
            return None;
        }
        Digest::from_slice(bytes.get(..usize::from(*len))?)
    }

    fn put(&mut self, tag: [u64; 2], d: &Digest) {
        if tag == [0, 0] {
            return;
        }
        let i = self.slot(&tag);
        if let Some(s) = self.slots.get_mut(i) {
            *s = (tag, d.bytes, d.len);
        }
    }
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
        self.cache = (slots > 0 && cfg!(feature = "xxhash")).then(|| DigestCache {
            key,
            nh: nh_key(key ^ 0x6e68_6b65_7921_2121),
            slots: vec![([0, 0], [0; 32], 0); slots.checked_next_power_of_two().unwrap_or(1 << 20).min(1 << 20)],
        });
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
        encode(self.algo, &mut self.buf, &mut self.pickler, parent, tokens, extra)
    }

    /// `hash_block_tokens(hash_fn, parent, tokens, extra_keys)`.
    pub fn hash_block(&mut self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Digest {
        let algo = self.algo;
        let data = encode(algo, &mut self.buf, &mut self.pickler, parent, tokens, extra);
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

fn digest(algo: HashAlgo, data: &[u8]) -> Digest {
    match algo {
        HashAlgo::Sha256Cbor | HashAlgo::Sha256 => Digest::from_sha256(Sha256::digest(data).into()),
        HashAlgo::XxhashCbor | HashAlgo::Xxhash => xxh128(data),
    }
}

/// The bytes hashed for one block (see [`BlockHasher::preimage`]), in `buf` or the pickler's buffer.
fn encode<'a>(
    algo: HashAlgo,
    buf: &'a mut Vec<u8>,
    pickler: &'a mut Pickler,
    parent: &Digest,
    tokens: &[u32],
    extra: &[ExtraKey],
) -> &'a [u8] {
    if algo.is_cbor() {
        let b = &mut *buf;
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
        buf
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
                        ExtraKey::Lora { name, path } => PyValue::Tuple(vec![tag("lora"), plain(name), plain(path)]),
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
        pickler.dumps(&v)
    }
}

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
        let blocks = tokens.chunks_exact(block_size).enumerate().skip(first).take(n);
        let mut added = 0usize;
        if self.cache.is_some() && extras.cache_salt.is_none() && extras.lora.is_none() && extras.mm.is_empty() {
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
                                let d = digest(*algo, encode(*algo, &mut raw, pickler, &parent, block, &[]));
                                c.put(tag, &d);
                                d
                            }
                        }
                    }
                    None => digest(*algo, encode(*algo, &mut raw, pickler, &parent, block, &[])),
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
            mm_idx = mm_extra_keys(&extras.mm, start, end, mm_idx, &mut extra);
            if i == 0 {
                if let Some(salt) = &extras.cache_salt {
                    extra.push(ExtraKey::CacheSalt(salt.clone()));
                }
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
    fn the_digest_memo_changes_no_digest() {
        for algo in [HashAlgo::Sha256Cbor, HashAlgo::Sha256] {
            let Ok(mut plain) = BlockHasher::new(algo, Some("0")) else { panic!("hasher") };
            // 4 slots: most blocks evict each other, some hit.
            let Ok(memo) = BlockHasher::new(algo, Some("0")) else { panic!("hasher") };
            let mut memo = memo.with_cache(4, 0x1234);
            let base: Vec<u32> = (0..64).map(|i| i * 7919 % 150_000).collect();
            for round in 0..3u32 {
                for (salt, lora) in [(None, None), (Some("s"), None), (None, Some(("a", "/p")))] {
                    let mut toks = base.clone();
                    toks[40] = round;
                    let ex = RequestExtras {
                        cache_salt: salt.map(str::to_owned),
                        lora: lora.map(|(a, b): (&str, &str)| (a.to_owned(), b.to_owned())),
                        mm: Vec::new(),
                    };
                    assert_eq!(memo.hash_request(&toks, 8, &ex), plain.hash_request(&toks, 8, &ex));
                }
            }
            let Ok(big) = BlockHasher::new(algo, Some("0")) else { panic!("hasher") };
            let mut big = big.with_cache(1024, 7);
            let ex = RequestExtras::default();
            let first = big.hash_request(&base, 16, &ex);
            assert_eq!(big.hash_request(&base, 16, &ex), first);
            assert_eq!(first, plain.hash_request(&base, 16, &ex));
        }
    }

    #[test]
    fn memo_tags_separate_near_identical_blocks() {
        let Ok(h) = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")) else { panic!("hasher") };
        let h = h.with_cache(16, 0x5eed);
        let Some(c) = h.cache.as_ref() else { panic!("memo") };
        let parent = Digest::from_sha256([3; 32]);
        let other = Digest::from_sha256({
            let mut b = [3; 32];
            b[31] = 4;
            b
        });
        let base: Vec<u32> = (0..16).map(|i| i * 7919).collect();
        let mut scratch = Vec::new();
        let mut seen = std::collections::HashSet::new();
        assert!(seen.insert(c.plain_tag(&parent, &base, &mut scratch)));
        assert!(seen.insert(c.plain_tag(&other, &base, &mut scratch)));
        // Shorter block, and the same with a trailing zero token.
        assert!(seen.insert(c.plain_tag(&parent, &base[..15], &mut scratch)));
        let mut z = base[..15].to_vec();
        z.push(0);
        assert!(seen.insert(c.plain_tag(&parent, &z, &mut scratch)));
        // Every single-token change and every adjacent swap.
        for i in 0..16 {
            for d in [1u32, 2, 1 << 16, u32::MAX] {
                let mut t = base.clone();
                t[i] = t[i].wrapping_add(d);
                assert!(seen.insert(c.plain_tag(&parent, &t, &mut scratch)), "token {i} + {d}");
            }
            if i < 15 {
                let mut t = base.clone();
                t.swap(i, i + 1);
                assert!(seen.insert(c.plain_tag(&parent, &t, &mut scratch)), "swap {i}");
            }
        }
        // Blocks too long for the NH key take the xxh3 path, and still differ.
        let long: Vec<u32> = (0..100).collect();
        let mut long2 = long.clone();
        long2[99] = 7;
        assert!(seen.insert(c.plain_tag(&parent, &long, &mut scratch)));
        assert!(seen.insert(c.plain_tag(&parent, &long2, &mut scratch)));
        // Another key, other tags.
        let Ok(h2) = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")) else { panic!("hasher") };
        let h2 = h2.with_cache(16, 0x5eee);
        let Some(c2) = h2.cache.as_ref() else { panic!("memo") };
        assert_ne!(c2.plain_tag(&parent, &base, &mut scratch), c.plain_tag(&parent, &base, &mut scratch));
    }

    #[test]
    fn hashing_a_few_blocks_at_a_time_gives_the_same_chain() {
        let toks: Vec<u32> = (0..200).map(|i| i * 31 % 50_000).collect();
        let mm = vec![MmFeature { identifier: "img".into(), offset: 20, length: 30 }];
        for memo in [0, 64] {
            for ex in [
                RequestExtras::default(),
                RequestExtras { cache_salt: Some("s".into()), ..Default::default() },
                RequestExtras { lora: Some(("a".into(), "/p".into())), mm: mm.clone(), ..Default::default() },
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
