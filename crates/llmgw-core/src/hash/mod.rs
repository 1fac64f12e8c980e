//! vLLM's prefix-cache block hash chain (vLLM 0.33 `hash_block_tokens` and
//! `get_request_block_hasher`), byte for byte.
//!
//! For every *full* block `i` of `block_size` tokens, vLLM computes
//! `h_i = H((h_{i-1}, tuple(tokens_i), extra_keys_i))` with `h_{-1} = NONE_HASH = H(seed)`, where
//! `seed` is the string value of `PYTHONHASHSEED`, or `"vllm-none-hash"` when it is unset, and `H`
//! is the configured algorithm. KV events publish `h_i` reduced to its last 8 bytes read
//! big-endian: the block *key* used everywhere in llmgw.
//!
//! Split by concern: `spec` holds the settings, `block_key` the digests and keys, `extras` what
//! a request adds, `hasher` the hasher; `preimage` writes the bytes vLLM hashes (CBOR through
//! `minicbor`, pickle by hand), `chain` walks a request's blocks with its extra keys, and `memo`
//! keeps recent digests.

mod block_key;
mod chain;
mod extras;
mod hasher;
mod memo;
mod preimage;
mod spec;

pub use block_key::{group_key, hex, key_of_bytes, BlockKey, Digest, MAX_KV_GROUPS};
pub use extras::{ExtraKey, MmFeature, RequestExtras};
pub use hasher::{BlockHash, BlockHasher};
pub use spec::{defaults, HashAlgo, HashError, HashSpec, MAX_LOOKAHEAD, UNSET_SEED};
