//! Snapshots of an engine's cache at a sequence number, for an agent that starts after the
//! engine: the `publish` sidecar keeps a [`ledger::Ledger`] per engine from its events and
//! serves it ([`serve`]); the agent fetches one when it first hears an engine ([`fetch`]) and
//! joins its live batches after it (see [`crate::ingest`]).
//!
//! The protocol is vLLM's proposed one (a snapshot at sequence S, then the live batches after
//! S) over HTTP: `GET /snapshot?dp_rank=R` answers a vLLM `KVEventBatch` (msgpack) whose
//! `BlockStored` events, applied to an empty cache, leave the engine's blocks as of batch S;
//! S is in the `x-llmgw-snapshot-seq` header, and `x-llmgw-snapshot-incomplete-from: F` says
//! the sidecar itself knows only what batches from F on stored.

pub mod chunked;
pub mod fetch;
pub mod ledger;
pub mod record;
pub mod serve;

/// The header carrying the sequence number a snapshot is exact at.
pub const SEQ_HEADER: &str = "x-llmgw-snapshot-seq";
/// The header saying from which batch on a snapshot is known (absent: since the engine started).
pub const INCOMPLETE_HEADER: &str = "x-llmgw-snapshot-incomplete-from";

/// An engine's blocks as of batch `seq`.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub seq: u64,
    /// `Some(f)`: only what batches from `f` on stored is in it.
    pub incomplete_from: Option<u64>,
    /// One vLLM `KVEventBatch` (msgpack).
    pub payload: Vec<u8>,
}
