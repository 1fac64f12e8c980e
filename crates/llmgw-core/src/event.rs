//! The domain view of vLLM's KV-cache events: what happened to which blocks, independent of
//! how the payload was encoded. Built from [`crate::wire`] types.

use crate::hash::{BlockKey, ExtraKey};
use crate::wire::{WireBatch, WireBlockRemoved, WireBlockStored, WireEvent, WireValue};

/// Where a block lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Medium {
    Gpu,
    Cpu,
    Storage,
    /// A connector's own name (LMCache and others).
    Other(String),
}

impl Medium {
    /// `None` on the wire predates the field (vLLM before 0.10): the GPU pool was the only source.
    fn from_wire(m: Option<String>) -> Medium {
        match m.as_deref() {
            None | Some("GPU") => Medium::Gpu,
            Some("CPU") => Medium::Cpu,
            Some("STORAGE") => Medium::Storage,
            Some(_) => Medium::Other(m.unwrap_or_default()),
        }
    }
}

/// One element of a block's published `extra_keys` entry. vLLM publishes them untagged, in
/// the order LoRA name, multimodal `[identifier, offset]` pairs, cache salt, prompt-embeds digest.
#[derive(Debug, Clone, PartialEq)]
pub enum PublishedExtra {
    /// A LoRA name (first, when the event has `lora_name`) or a cache salt (block 0).
    Text(String),
    /// `[identifier, offset]` of a multimodal item.
    Mm { identifier: String, offset: i64 },
    /// A prompt-embeds digest.
    Bytes(Vec<u8>),
    /// Anything else (kept so that nothing is silently reinterpreted).
    Unrecognised(WireValue),
}

impl PublishedExtra {
    fn from_wire(v: WireValue) -> PublishedExtra {
        match v {
            WireValue::Str(s) => PublishedExtra::Text(s),
            WireValue::Bin(b) => PublishedExtra::Bytes(b),
            WireValue::Array(items) => match items.as_slice() {
                [WireValue::Str(id), off] => match wire_i64(off) {
                    Some(offset) => PublishedExtra::Mm { identifier: id.clone(), offset },
                    None => PublishedExtra::Unrecognised(WireValue::Array(items)),
                },
                _ => PublishedExtra::Unrecognised(WireValue::Array(items)),
            },
            other => PublishedExtra::Unrecognised(other),
        }
    }
}

fn wire_i64(v: &WireValue) -> Option<i64> {
    match v {
        WireValue::Int(i) => Some(*i),
        WireValue::UInt(u) => i64::try_from(*u).ok(),
        _ => None,
    }
}

/// Blocks that entered a cache.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredBlocks {
    /// Block keys, in chain order.
    pub hashes: Vec<BlockKey>,
    /// Key of the block before the first one, `None` when the run starts at block 0.
    pub parent: Option<BlockKey>,
    pub token_ids: Vec<u32>,
    pub block_size: u64,
    pub medium: Medium,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    /// Per block (same length as `hashes` when published).
    pub extra_keys: Vec<Option<Vec<PublishedExtra>>>,
    pub group_idx: Option<i64>,
    pub spec_kind: Option<String>,
    pub sliding_window: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

impl StoredBlocks {
    /// The tagged extra keys vLLM hashed for block `i`, rebuilt from the published ones.
    /// `lora_path` resolves an adapter name to the path the engine loaded (it is not published).
    /// `None` when they cannot be rebuilt (unknown adapter path, unrecognised items).
    pub fn hashed_extra_keys(&self, i: usize, lora_path: impl Fn(&str) -> Option<String>) -> Option<Vec<ExtraKey>> {
        let published = self.extra_keys.get(i).cloned().flatten().unwrap_or_default();
        let mut items = published.into_iter().peekable();
        let mut out = Vec::new();
        if let Some(name) = &self.lora_name {
            // The name comes first in the published list; the hash needs its path too.
            if let Some(PublishedExtra::Text(t)) = items.peek() {
                if t == name {
                    items.next();
                }
            }
            out.push(ExtraKey::Lora { name: name.clone(), path: lora_path(name)? });
        }
        for it in items {
            match it {
                PublishedExtra::Mm { identifier, offset } => out.push(ExtraKey::Mm { identifier, offset }),
                PublishedExtra::Text(s) => out.push(ExtraKey::CacheSalt(s)),
                PublishedExtra::Bytes(b) => out.push(ExtraKey::PromptEmbeds(b)),
                PublishedExtra::Unrecognised(_) => return None,
            }
        }
        Some(out)
    }
}

/// Blocks that left a cache.
#[derive(Debug, Clone, PartialEq)]
pub struct RemovedBlocks {
    pub hashes: Vec<BlockKey>,
    pub medium: Medium,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored(StoredBlocks),
    Removed(RemovedBlocks),
    AllCleared,
    /// An event type this version does not know.
    Unknown(String),
}

/// One engine step's events.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock time of the step, seconds since the epoch.
    pub ts: f64,
    pub dp_rank: Option<i64>,
    pub events: Vec<KvEvent>,
}

impl From<WireBlockStored> for StoredBlocks {
    fn from(w: WireBlockStored) -> Self {
        StoredBlocks {
            hashes: w.block_hashes.into_iter().map(BlockKey).collect(),
            parent: w.parent_block_hash.map(BlockKey),
            token_ids: w.token_ids,
            block_size: w.block_size,
            medium: Medium::from_wire(w.medium),
            lora_id: w.lora_id,
            lora_name: w.lora_name,
            extra_keys: w
                .extra_keys
                .unwrap_or_default()
                .into_iter()
                .map(|e| e.map(|items| items.into_iter().map(PublishedExtra::from_wire).collect()))
                .collect(),
            group_idx: w.group_idx,
            spec_kind: w.kv_cache_spec_kind,
            sliding_window: w.kv_cache_spec_sliding_window,
            locality: w.locality,
            ownership: w.ownership,
            session_id: w.session_id,
            lookahead_token_ids: w.lookahead_token_ids,
        }
    }
}

impl From<WireBlockRemoved> for RemovedBlocks {
    fn from(w: WireBlockRemoved) -> Self {
        RemovedBlocks {
            hashes: w.block_hashes.into_iter().map(BlockKey).collect(),
            medium: Medium::from_wire(w.medium),
            group_idx: w.group_idx,
            locality: w.locality,
            ownership: w.ownership,
        }
    }
}

impl From<WireEvent> for KvEvent {
    fn from(w: WireEvent) -> Self {
        match w {
            WireEvent::BlockStored(s) => KvEvent::Stored(s.into()),
            WireEvent::BlockRemoved(r) => KvEvent::Removed(r.into()),
            WireEvent::AllBlocksCleared => KvEvent::AllCleared,
            WireEvent::Unknown { type_name } => KvEvent::Unknown(type_name),
        }
    }
}

impl From<WireBatch> for EventBatch {
    fn from(w: WireBatch) -> Self {
        EventBatch {
            ts: w.ts,
            dp_rank: w.data_parallel_rank,
            events: w.events.into_iter().map(KvEvent::from).collect(),
        }
    }
}

impl EventBatch {
    /// Decodes a payload straight into the domain view.
    pub fn decode(payload: &[u8]) -> Result<EventBatch, crate::wire::DecodeError> {
        crate::wire::decode_batch(payload).map(EventBatch::from)
    }
}
