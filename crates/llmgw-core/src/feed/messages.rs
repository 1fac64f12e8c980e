//! The feed's messages (`proto/llmgw/feed/v1/feed.proto`) as plain prost structs, shared by the
//! agent (which serves them) and the filter (which decodes them inside Envoy), and their
//! resolution into the fleet's domain types. Field numbers must match the `.proto`; the agent's
//! tests check this against code generated from it.

use crate::fleet::{self, KvGroup, KvGroupKind, Load};
use crate::hash::{HashAlgo, HashSpec, MAX_LOOKAHEAD};
use crate::index::ReplicaId;
use crate::mirror::NetChange;

#[derive(Clone, PartialEq, prost::Message)]
pub struct SubscribeRequest {
    #[prost(string, tag = "1")]
    pub subscriber: String,
    #[prost(string, tag = "2")]
    pub token: String,
    /// The subscriber applies [`BlockDeltas`] (older subscribers get one message per change).
    #[prost(bool, tag = "3")]
    pub batches: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct FeedMessage {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(oneof = "Body", tags = "2, 3, 4, 5, 6, 7, 8, 9")]
    pub body: Option<Body>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Body {
    #[prost(message, tag = "2")]
    Replicas(ReplicaTable),
    #[prost(message, tag = "3")]
    Snapshot(SnapshotChunk),
    #[prost(message, tag = "4")]
    SnapshotComplete(SnapshotComplete),
    #[prost(message, tag = "5")]
    Delta(BlockDelta),
    #[prost(message, tag = "6")]
    Load(LoadReport),
    #[prost(message, tag = "7")]
    Reset(ReplicaReset),
    #[prost(message, tag = "8")]
    Heartbeat(Heartbeat),
    #[prost(message, tag = "9")]
    Deltas(BlockDeltas),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Replica {
    #[prost(uint32, tag = "1")]
    pub id: u32,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "3")]
    pub address: String,
    #[prost(string, repeated, tag = "4")]
    pub models: Vec<String>,
    #[prost(bool, tag = "5")]
    pub up: bool,
    #[prost(uint32, tag = "6")]
    pub dp_rank: u32,
    /// How this engine hashes (absent from older agents).
    #[prost(message, optional, tag = "7")]
    pub hash: Option<HashSettings>,
    /// Data-parallel ranks behind `address` (0 from older agents: read as 1).
    #[prost(uint32, tag = "8")]
    pub dp_size: u32,
    /// The engine's KV-cache groups (empty: one, as before hybrid support).
    #[prost(message, repeated, tag = "9")]
    pub kv_groups: Vec<KvCacheGroup>,
    /// The LoRA adapters it serves, with their paths (empty from older agents).
    #[prost(message, repeated, tag = "10")]
    pub lora_adapters: Vec<LoraAdapter>,
    /// The agent's mirror of this engine lacks blocks stored before some batch (false from
    /// older agents).
    #[prost(bool, tag = "11")]
    pub mirror_incomplete: bool,
}

/// A LoRA adapter an engine serves: the name requests give, and the path vLLM hashes with it.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct LoraAdapter {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub path: String,
}

/// One KV-cache group of an engine.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct KvCacheGroup {
    #[prost(uint32, tag = "1")]
    pub group_idx: u32,
    #[prost(string, tag = "2")]
    pub kind: String,
    #[prost(uint32, tag = "3")]
    pub block_size: u32,
    /// Tokens; 0 without a sliding window.
    #[prost(uint32, tag = "4")]
    pub sliding_window: u32,
}

impl KvCacheGroup {
    /// The group as prefix scoring sees it.
    pub fn resolve(&self) -> KvGroup {
        let kind = match self.kind.as_str() {
            "full_attention" | "mla_attention" => KvGroupKind::Full,
            "sliding_window" | "sliding_window_mla" if self.sliding_window > 0 => usize::try_from(self.sliding_window)
                .map_or(KvGroupKind::Unsupported, |window| KvGroupKind::Sliding { window }),
            _ => KvGroupKind::Unsupported,
        };
        KvGroup { idx: self.group_idx, kind, block_size: usize::try_from(self.block_size).unwrap_or(usize::MAX) }
    }

    /// The groups of a mirror, for the feed.
    pub fn from_mirror(groups: &std::collections::BTreeMap<u32, crate::mirror::GroupSpec>) -> Vec<KvCacheGroup> {
        groups
            .iter()
            .map(|(&group_idx, g)| KvCacheGroup {
                group_idx,
                kind: g.kind.clone(),
                block_size: u32::try_from(g.block_size).unwrap_or(u32::MAX),
                sliding_window: g.sliding_window.map_or(0, |w| u32::try_from(w).unwrap_or(u32::MAX)),
            })
            .collect()
    }
}

impl Replica {
    /// Whether the replica behind `address` runs several data-parallel ranks (requests then
    /// name the rank in `X-data-parallel-rank`).
    pub fn data_parallel(&self) -> bool {
        self.dp_size > 1
    }

    /// The replica as routing sees it (`None`: an id beyond what the index can address).
    pub fn resolve(&self) -> Option<fleet::Replica> {
        let id = ReplicaId::try_from(self.id).ok()?;
        let dp_rank = self.data_parallel().then_some(self.dp_rank);
        Some(fleet::Replica {
            id,
            name: self.name.clone(),
            address: self.address.clone(),
            models: self.models.clone(),
            up: self.up,
            dp_rank,
            rank: self.dp_rank,
            engine: fleet::replica_key(&self.address, dp_rank),
            hash: self.hash.as_ref().map(HashSettings::spec),
            kv_groups: self.kv_groups.iter().map(KvCacheGroup::resolve).collect(),
            lora_adapters: self.lora_adapters.iter().map(|a| (a.name.clone(), a.path.clone())).collect(),
            incomplete: self.mirror_incomplete,
        })
    }
}

/// vLLM's prefix-cache hashing of one engine, as the feed carries it.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct HashSettings {
    #[prost(string, tag = "1")]
    pub algo: String,
    #[prost(bool, tag = "2")]
    pub seeded: bool,
    #[prost(string, tag = "3")]
    pub seed: String,
    #[prost(uint32, tag = "4")]
    pub block_size: u32,
    #[prost(uint32, tag = "5")]
    pub lookahead_tokens: u32,
}

impl HashSettings {
    /// The settings of `spec`, for the feed.
    pub fn from_spec(spec: &HashSpec) -> HashSettings {
        HashSettings {
            algo: spec.algo.name().to_owned(),
            seeded: spec.seed.is_some(),
            seed: spec.seed.clone().unwrap_or_default(),
            block_size: u32::try_from(spec.block_size).unwrap_or(u32::MAX),
            lookahead_tokens: u32::try_from(spec.lookahead).unwrap_or(u32::MAX),
        }
    }

    /// The settings as a [`HashSpec`]; an error names what cannot be used (an unknown
    /// algorithm, a zero block size).
    pub fn spec(&self) -> Result<HashSpec, String> {
        let algo = HashAlgo::parse(&self.algo).map_err(|e| e.to_string())?;
        let block_size = usize::try_from(self.block_size).ok().filter(|&b| b > 0);
        let Some(block_size) = block_size else { return Err("block size 0".to_owned()) };
        let lookahead = usize::try_from(self.lookahead_tokens).unwrap_or(usize::MAX);
        if lookahead > MAX_LOOKAHEAD {
            return Err(format!("{lookahead} lookahead tokens (at most {MAX_LOOKAHEAD})"));
        }
        Ok(HashSpec { algo, seed: self.seeded.then(|| self.seed.clone()), block_size, lookahead })
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReplicaTable {
    #[prost(message, repeated, tag = "1")]
    pub replicas: Vec<Replica>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotChunk {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(bool, tag = "2")]
    pub first: bool,
    #[prost(uint64, repeated, tag = "3")]
    pub blocks: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct SnapshotComplete {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BlockDelta {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(uint64, repeated, tag = "2")]
    pub added: Vec<u64>,
    #[prost(uint64, repeated, tag = "3")]
    pub removed: Vec<u64>,
}

/// Changes of several replicas (or several of one), applied in order.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BlockDeltas {
    #[prost(message, repeated, tag = "1")]
    pub deltas: Vec<BlockDelta>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReplicaLoad {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(uint32, tag = "2")]
    pub running: u32,
    #[prost(uint32, tag = "3")]
    pub waiting: u32,
    #[prost(float, tag = "4")]
    pub kv_cache_usage: f32,
    /// The blocks its GPU KV cache holds (0: unknown, from older agents).
    #[prost(uint32, tag = "5")]
    pub gpu_blocks: u32,
}

impl ReplicaLoad {
    /// The load as routing sees it (`None`: an id beyond what the index can address).
    pub fn resolve(&self) -> Option<Load> {
        let replica = ReplicaId::try_from(self.replica).ok()?;
        Some(Load {
            replica,
            running: self.running,
            waiting: self.waiting,
            kv_cache_usage: self.kv_cache_usage,
            gpu_blocks: self.gpu_blocks,
            gateway: None,
        })
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LoadReport {
    #[prost(message, repeated, tag = "1")]
    pub loads: Vec<ReplicaLoad>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReplicaReset {
    #[prost(uint32, tag = "1")]
    pub replica: u32,
    #[prost(string, tag = "2")]
    pub reason: String,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Heartbeat {}

impl BlockDelta {
    /// Builds a delta from a mirror's net changes.
    pub fn from_changes(replica: u32, changes: &[NetChange]) -> BlockDelta {
        let mut d = BlockDelta { replica, added: Vec::new(), removed: Vec::new() };
        for c in changes {
            match *c {
                NetChange::Added(k) => d.added.push(k.0),
                NetChange::Removed(k) => d.removed.push(k.0),
            }
        }
        d
    }
}
