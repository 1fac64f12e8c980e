//! llmgw-core: the parts of llmgw that must be exactly right and must never panic.
//!
//! * [`hash`]: vLLM's prefix-cache block hash chain, byte for byte (`sha256_cbor`, `sha256`
//!   over Python pickle, and the optional xxhash variants), with the root parent vLLM derives
//!   from `PYTHONHASHSEED` and the extra keys (cache salt, LoRA, multimodal) it mixes in.
//! * [`wire`]: decoding of vLLM's `KVEventBatch` msgpack payloads, in both encodings
//!   (events as maps tagged by `type` since vLLM 0.24, positional arrays before), on `rmp`.
//! * [`stable_hash`]: seedless hashing, the same in every process and gateway (routing keys).
//! * [`placement`]: keyed placement of block keys in the index and maps (a per-process secret).
//! * [`event`]: the domain view of those events, independent of the wire form.
//! * [`mirror`]: one engine's held blocks as a reference-counted multiset, yielding net changes
//!   and checking hash parity.
//! * [`fleet`]: the fleet as routing sees it (engine identities).
//! * [`index`]: block key → replicas holding it, with leading-prefix scoring.
//! * [`allow`]: the networks and ports the filter may route to.
//! * [`config`]: the filter's configuration, validated with errors naming the field, and
//!   compiled once into what requests need.
//! * [`flow`]: the request path from a body to a routing step (route, 503, tokenizer call),
//!   with fallback reasons and the tokenizer-reply mapping.
//! * [`request`]: OpenAI request bodies, tokenizer call bodies and answers.
//! * [`policy`]: replica choice (prefix share blended with load, approximate and load fallbacks).
//! * [`tokcache`]: recent tokenizations, so a prompt sent again skips the tokenizer call.
//!
//! Nothing here does I/O, reads a clock or draws random numbers: every input is an argument,
//! so the same code runs natively (agent, tests, benchmarks) and inside Envoy as wasm.

pub mod allow;
pub mod config;
pub mod event;
pub mod feed;
pub mod fleet;
pub mod flow;
pub mod hash;
pub mod index;
pub mod mirror;
pub mod pickle;
pub mod placement;
pub mod policy;
pub mod request;
pub mod stable_hash;
pub mod tokcache;
pub mod wire;

pub use event::{EventBatch, KvEvent};
pub use hash::{BlockHash, BlockHasher, BlockKey, Digest, ExtraKey, HashAlgo, HashSpec, MmFeature, RequestExtras};
pub use index::{ReplicaId, ReplicaIndex};
pub use mirror::{EngineMirror, NetChange};
