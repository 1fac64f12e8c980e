//! What must agree between the router and an engine for their block hashes to match: the
//! algorithm, the seed, the block size and lookahead ([`HashSpec`]), with the defaults every
//! part of llmgw assumes.

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

    pub(super) fn is_cbor(self) -> bool {
        matches!(self, Self::Sha256Cbor | Self::XxhashCbor)
    }

    pub(super) fn is_xxhash(self) -> bool {
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
