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
    /// This gateway's requests in flight there as the report came, where the gateway noted
    /// them ([`crate::feed::FeedView::note_gateway_share`]).
    pub gateway: Option<GatewayShare>,
}

/// This gateway's requests in flight on a replica, and the blocks they held there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GatewayShare {
    pub requests: u32,
    pub blocks: u64,
}

impl Load {
    /// The blocks the engine reported in use (`kv_cache_usage × gpu_blocks`; 0 where either is
    /// unknown).
    pub fn blocks_in_use(&self) -> u64 {
        let usage = f64::from(self.kv_cache_usage);
        if !usage.is_finite() || usage <= 0.0 {
            return 0;
        }
        // At most the cache: the cast saturates, and usage is clamped to 1.
        (usage.min(1.0) * f64::from(self.gpu_blocks)).round() as u64
    }

    /// What the engine reported beyond this gateway's requests as the report came: the
    /// requests running beyond theirs (other gateways', or sent to the engine directly) and the
    /// blocks in use beyond those their prompts held (the others' blocks, and what every running
    /// request added while decoding). The blocks count only where other requests ran: with none,
    /// the excess is what this gateway's own answers added, which may have ended since the
    /// report, and is left out (towards room). Nothing where the gateway noted nothing.
    pub fn others(&self) -> GatewayShare {
        let Some(own) = self.gateway else { return GatewayShare::default() };
        let requests = self.running.saturating_sub(own.requests);
        let blocks = if requests == 0 { 0 } else { self.blocks_in_use().saturating_sub(own.blocks) };
        GatewayShare { requests, blocks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_of_one_address_are_different_engines() {
        assert_ne!(replica_key("a:1", None), replica_key("a:1", Some(0)));
        assert_ne!(replica_key("a:1", Some(0)), replica_key("a:1", Some(1)));
    }

    #[test]
    fn what_an_engine_reports_beyond_this_gateways_requests_is_the_others() {
        let load = |kv_cache_usage, gateway| Load {
            replica: ReplicaId::try_from(0u32).unwrap_or_default(),
            running: 3,
            waiting: 0,
            kv_cache_usage,
            gpu_blocks: 192,
            gateway,
        };
        let own = Some(GatewayShare { requests: 1, blocks: 60 });
        // Half of 192 blocks in use, 60 of them this gateway's one request's: 36 blocks of two
        // other requests.
        assert_eq!(load(0.5, own).others(), GatewayShare { requests: 2, blocks: 36 });
        // Noted nothing: nothing is taken for others'.
        assert_eq!(load(0.5, None).others(), GatewayShare::default());
        // Less in use than this gateway's requests held (a prefix shared): none.
        assert_eq!(load(0.25, own).others().blocks, 0);
        // No request beyond this gateway's running: what is in use beyond their prompts is what
        // their answers added, not counted.
        let alone = Load { running: 1, ..load(0.5, own) };
        assert_eq!(alone.others(), GatewayShare::default());
        // Usage past 1 is the whole cache; not a number is none.
        assert_eq!(load(1.5, own).blocks_in_use(), 192);
        assert_eq!(load(f32::NAN, own).others().blocks, 0);
    }
}
