//! The fleet as routing sees it: the feed's replica table resolved once, when it arrives, into
//! replicas with their engine identity, parsed hash settings and KV-cache groups, and the loads
//! their engines report. Nothing here is parsed per request.

use crate::hash::HashSpec;
use crate::index::ReplicaId;
use crate::stable_hash::{mix64, stable_hash};

/// The identity of one engine: its replica's address, and its rank on a data-parallel replica
/// (whose ranks share the address). Speculative entries and resets name engines by it.
pub fn replica_key(address: &str, dp_rank: Option<u32>) -> u64 {
    let a = stable_hash(address.as_bytes());
    match dp_rank {
        Some(rank) => mix64(a ^ u64::from(rank).wrapping_add(1)),
        None => a,
    }
}

/// What kind of attention a KV-cache group holds, as far as prefix hits are concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvGroupKind {
    /// Full attention (MLA included): a hit is the leading run of cached blocks.
    Full,
    /// Sliding-window attention over `window` tokens.
    Sliding { window: usize },
    /// Something prefix scoring does not model (Mamba layers, a window of 0, a kind this
    /// build does not know).
    Unsupported,
}

/// One KV-cache group of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGroup {
    pub idx: u32,
    pub kind: KvGroupKind,
    pub block_size: usize,
}

/// One engine of the fleet (a replica, or one data-parallel rank of one).
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    pub id: ReplicaId,
    pub name: String,
    /// `ip:port`.
    pub address: String,
    /// Models it serves (empty: any).
    pub models: Vec<String>,
    pub up: bool,
    /// Its rank, when the replica behind `address` runs several data-parallel ranks (requests
    /// then name it in `X-data-parallel-rank`).
    pub dp_rank: Option<u32>,
    /// The rank as the agent numbered it (0 without data parallelism), for logs.
    pub rank: u32,
    /// [`replica_key`] of its address and rank.
    pub engine: u64,
    /// How it hashes, when the agent said: the settings, or why they cannot be used.
    pub hash: Option<Result<HashSpec, String>>,
    /// Its KV-cache groups (empty or one: not hybrid).
    pub kv_groups: Vec<KvGroup>,
    /// The LoRA adapters it serves: (name, path), as vLLM mixes them into block hashes.
    pub lora_adapters: Vec<(String, String)>,
    /// The agent's mirror of it is incomplete: a block the index does not show it holding may
    /// still be cached there (a block it shows is held).
    pub incomplete: bool,
}

impl Replica {
    /// Whether it serves `model` (every model, when the model is unknown or it lists none).
    pub fn serves(&self, model: Option<&str>) -> bool {
        match model {
            Some(m) => self.models.is_empty() || self.models.iter().any(|x| x == m),
            None => true,
        }
    }

    /// Whether it has several KV-cache groups (a hybrid model).
    pub fn hybrid(&self) -> bool {
        self.kv_groups.len() > 1
    }
}

/// The load an engine reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub replica: ReplicaId,
    pub running: u32,
    pub waiting: u32,
    /// KV cache usage, 0..1.
    pub kv_cache_usage: f32,
    /// The blocks its GPU KV cache holds (0: unknown).
    pub gpu_blocks: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_of_one_address_are_different_engines() {
        assert_ne!(replica_key("a:1", None), replica_key("a:1", Some(0)));
        assert_ne!(replica_key("a:1", Some(0)), replica_key("a:1", Some(1)));
    }
}
