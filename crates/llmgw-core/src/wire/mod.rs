//! vLLM's `KVEventBatch` msgpack payload, as it travels on the wire.
//!
//! The batch is always an array `[ts, events, data_parallel_rank]` (extra trailing elements are
//! ignored). Each event is either a map tagged by `"type"` (vLLM ≥ 0.24) or a positional array
//! `["BlockStored", field1, …]` (vLLM ≤ 0.23); both decode to the same [`WireEvent`]. Hashes may
//! be integers of any msgpack width or binaries (16 or 32 bytes), and are reduced to the published
//! u64 form. Unknown fields and unknown event types are skipped, never refused.
//!
//! These types mirror the wire one to one; [`crate::event`] holds the domain view.
//!
//! Split by concern: `batch` holds the types and `error` the errors; `decode` maps the schema
//! onto them (on the `reader`, built on `rmp`), `encode` writes them as vLLM would (for the
//! simulator, tests and benchmarks).

mod batch;
mod decode;
mod encode;
mod error;
mod reader;

pub use batch::{Encoding, HashForm, WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, WireValue};
pub use decode::decode_batch;
pub use encode::encode_batch;
pub use error::{DecodeError, DecodeErrorKind, MsgpackError, MsgpackErrorKind};
