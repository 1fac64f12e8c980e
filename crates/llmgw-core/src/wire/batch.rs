//! The types of a `KVEventBatch` as it travels, one to one with the wire.

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

/// How block hashes are written by [`encode_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashForm {
    /// Unsigned integers (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
    Int,
    /// 32-byte binaries whose last 8 bytes are the key (the leading 24 bytes are zero here).
    Bytes,
}
