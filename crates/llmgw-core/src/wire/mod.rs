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
//! Split by concern: this file holds the types; `decode` maps the schema onto them (on the
//! `reader`, built on `rmp`), `encode` writes them as vLLM would (for the simulator, tests and
//! benchmarks).

mod decode;
mod encode;
mod reader;

pub use decode::decode_batch;
pub use encode::encode_batch;
use std::fmt;

/// Which encoding the events of a batch used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Maps tagged by `"type"` (vLLM ≥ 0.24).
    Tagged,
    /// Positional arrays (vLLM ≤ 0.23).
    Positional,
}

/// A decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    pub ts: f64,
    pub events: Vec<WireEvent>,
    pub data_parallel_rank: Option<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum WireEvent {
    BlockStored(WireBlockStored),
    BlockRemoved(WireBlockRemoved),
    AllBlocksCleared,
    /// An event type this version does not know; its content was skipped.
    Unknown {
        type_name: String,
    },
}

impl WireEvent {
    pub fn type_name(&self) -> &str {
        match self {
            WireEvent::BlockStored(_) => "BlockStored",
            WireEvent::BlockRemoved(_) => "BlockRemoved",
            WireEvent::AllBlocksCleared => "AllBlocksCleared",
            WireEvent::Unknown { type_name } => type_name,
        }
    }
}

/// `BlockStored`, every field vLLM 0.33 publishes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WireBlockStored {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: Vec<u32>,
    pub block_size: u64,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block hash: `None`, or the block's extra keys as published (untagged).
    pub extra_keys: Option<Vec<Option<Vec<WireValue>>>>,
    pub group_idx: Option<i64>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct WireBlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// A free-form value (the items of `extra_keys`).
#[derive(Debug, Clone, PartialEq)]
pub enum WireValue {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<WireValue>),
    /// A map or an extension value: kept only as a marker.
    Other,
}

/// Why a payload could not be decoded, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// Index of the event in the batch, when the error is inside one.
    pub event: Option<usize>,
    /// The field being read.
    pub field: Option<&'static str>,
    pub kind: DecodeErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeErrorKind {
    Msgpack(MsgpackError),
    /// The batch array has fewer than 2 elements.
    BatchTooShort(usize),
    /// An event has no `type` key, or its tag is not a string.
    MissingType,
    /// A required field is absent.
    MissingField,
    /// A hash given as binary is shorter than 8 bytes.
    HashTooShort(usize),
    /// A token id does not fit 32 bits.
    TokenOutOfRange(u64),
    /// Values nested deeper than any vLLM field.
    TooDeep,
    /// Bytes after the batch.
    TrailingBytes(usize),
}

/// Where and why the msgpack layer could not read a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsgpackError {
    /// Byte offset in the payload of the value that could not be read.
    pub at: usize,
    pub kind: MsgpackErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MsgpackErrorKind {
    /// The payload ends inside a value.
    Truncated,
    /// A marker byte that msgpack does not define (0xc1).
    InvalidMarker(u8),
    /// A value of another type than the one expected.
    Unexpected { expected: &'static str, found: &'static str },
    /// A string that is not UTF-8.
    InvalidUtf8,
    /// An integer outside the expected range.
    OutOfRange { expected: &'static str },
}

impl fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            MsgpackErrorKind::Truncated => write!(f, "payload truncated at byte {}", self.at),
            MsgpackErrorKind::InvalidMarker(m) => write!(f, "invalid msgpack marker 0x{m:02x} at byte {}", self.at),
            MsgpackErrorKind::Unexpected { expected, found } => {
                write!(f, "expected {expected}, found {found} at byte {}", self.at)
            }
            MsgpackErrorKind::InvalidUtf8 => write!(f, "string is not UTF-8 at byte {}", self.at),
            MsgpackErrorKind::OutOfRange { expected } => {
                write!(f, "integer out of range for {expected} at byte {}", self.at)
            }
        }
    }
}

impl std::error::Error for MsgpackError {}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.event, self.field) {
            (Some(e), Some(fl)) => write!(f, "event {e}, field {fl}: ")?,
            (Some(e), None) => write!(f, "event {e}: ")?,
            (None, Some(fl)) => write!(f, "batch {fl}: ")?,
            (None, None) => f.write_str("batch: ")?,
        }
        match &self.kind {
            DecodeErrorKind::Msgpack(e) => write!(f, "{e}"),
            DecodeErrorKind::BatchTooShort(n) => write!(f, "batch array has {n} elements, expected [ts, events, rank]"),
            DecodeErrorKind::MissingType => f.write_str("event has no string \"type\""),
            DecodeErrorKind::MissingField => f.write_str("required field is missing"),
            DecodeErrorKind::HashTooShort(n) => write!(f, "hash is {n} bytes, expected at least 8"),
            DecodeErrorKind::TokenOutOfRange(t) => write!(f, "token id {t} does not fit 32 bits"),
            DecodeErrorKind::TooDeep => f.write_str("values nested too deeply"),
            DecodeErrorKind::TrailingBytes(n) => write!(f, "{n} bytes after the batch"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// How block hashes are written by [`encode_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashForm {
    /// Unsigned integers (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
    Int,
    /// 32-byte binaries whose last 8 bytes are the key (the leading 24 bytes are zero here).
    Bytes,
}
