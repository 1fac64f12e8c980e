//! One replica as a policy sees it: its address and rank, whether it is up, and its load.

use super::rates::Rates;
use super::returns::Returning;
use crate::index::ReplicaId;
use crate::stable_hash::{mix64, stable_hash};

/// One replica as the policy sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    pub id: ReplicaId,
    /// `ip:port`; also the replica's identity for rendezvous hashing.
    pub address: &'a str,
    pub up: bool,
    /// Requests this gateway has sent and not yet finished.
    pub in_flight: u32,
    /// Prefill tokens of those requests that have not produced a first token yet.
    pub pending_tokens: u64,
    /// Engine-reported running and waiting requests and KV cache usage (0..1).
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f32,
    /// The engine's data-parallel rank when the replica behind `address` runs several (its
    /// ranks share the address; the rank tells them apart).
    pub dp_rank: Option<u32>,
    /// Rates learned for this replica from its observed times to first token, when any.
    pub rates: Option<Rates>,
    /// The agent's mirror of this engine is incomplete: the index's hits on it are real, its
    /// misses are not proof of absence (see [`super::decide_lazy`]).
    pub incomplete: bool,
    /// Requests this gateway routed there lately: a count that fades with every request routed
    /// anywhere (not with time), so shares of it compare replicas whatever the fleet's speed.
    /// New prefixes go, among equally fast choices, where it is lowest. 0 when the gateway keeps
    /// no such count.
    pub recent: f64,
    /// The requests expected back on this replica within windows from now: ended there, not
    /// yet followed by their next request ([`super::returns`]). None when the gateway keeps no
    /// such record.
    pub returning: Returning,
    /// Its KV cache, and the blocks this gateway's requests hold there ([`super::capacity`]).
    pub pool: Pool,
}

impl Candidate<'_> {
    /// The rendezvous weight of this engine for a prefix key: by address, and by rank among a
    /// data-parallel replica's ranks.
    pub fn rendezvous_weight(&self, key: u64) -> u64 {
        let w = rendezvous_weight(key, self.address);
        match self.dp_rank {
            Some(rank) => mix64(w ^ u64::from(rank)),
            None => w,
        }
    }

    /// in-flight + running + 2 × waiting.
    pub fn pressure(&self) -> u64 {
        u64::from(self.in_flight)
            .saturating_add(u64::from(self.running))
            .saturating_add(u64::from(self.waiting).saturating_mul(2))
    }

    /// The requests on the engine a new one queues behind: `max(in-flight, running + waiting) +
    /// waiting` (this gateway's in-flight requests are among the engine's; a waiting one is
    /// surely ahead).
    pub fn queued_requests(&self) -> u64 {
        let engine = u64::from(self.running).saturating_add(u64::from(self.waiting));
        u64::from(self.in_flight).max(engine).saturating_add(u64::from(self.waiting))
    }
}

/// The rendezvous weight of `address` for a prefix key.
pub fn rendezvous_weight(key: u64, address: &str) -> u64 {
    mix64(key ^ stable_hash(address.as_bytes()))
}

/// A replica's KV cache as this gateway sees it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Pool {
    /// The blocks its GPU KV cache holds (0: unknown).
    pub blocks: u64,
    /// The blocks this gateway's requests in flight there hold: their prompts' blocks.
    pub held: u64,
    /// The blocks the engine last reported in use beyond those this gateway's requests held as
    /// the report came: other gateways' requests, and the blocks running requests added while
    /// decoding (0 where not reported).
    pub others: u64,
    /// The requests the engine last reported running beyond this gateway's as the report came.
    pub others_running: u32,
    /// How long a request of this gateway held its blocks there lately, routing to end (µs;
    /// 0: none observed yet).
    pub hold_us: f64,
}
