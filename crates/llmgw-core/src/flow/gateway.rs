//! What the gateway around the router knows and the router asks for: the requests this Envoy
//! has in flight, the replicas it avoids, the speculative entries it wrote, and the
//! tokenizations it kept for conversations' next turns. The filter keeps
//! them in Envoy's shared data (every worker sees them); `()` knows nothing.

use super::shared_prompt::SharedPrompt;
use super::speculative::Hit;
use crate::policy::rates::Rates;
use crate::policy::returns::Returning;

/// The requests this gateway has sent to a replica and not yet finished.
pub trait InFlightCounts {
    fn in_flight(&self, address: &str) -> u32;
    /// Prefill tokens of those requests that have not produced a first token yet.
    fn pending_tokens(&self, _address: &str) -> u64 {
        0
    }
    /// Requests routed to the replica lately, fading by request (see
    /// [`crate::policy::Candidate::recent`]); 0 when the gateway keeps no such count.
    fn recent_requests(&self, _address: &str) -> f64 {
        0.0
    }
    /// The requests expected back on the replica (see [`crate::policy::returns`]); none when
    /// the gateway keeps no record of requests' ends.
    fn returning(&self, _address: &str) -> Returning {
        Returning::default()
    }
    /// Whether `key` (a prompt's last full block) is that of a request that ended lately and
    /// has not been followed yet: a request whose blocks include it is its next one.
    fn ended_request(&self, _key: u64) -> bool {
        false
    }
    /// The blocks those requests' prompts hold on the replica (see
    /// [`crate::policy::capacity`]); 0 when the gateway does not count them.
    fn held_blocks(&self, _address: &str) -> u64 {
        0
    }
    /// How long a request held its blocks on the replica lately, from its routing to its end
    /// (µs); 0 when none was observed.
    fn hold_us(&self, _address: &str) -> f64 {
        0.0
    }
}

/// The replicas the gateway leaves alone for now.
pub trait ReplicaAvoidance {
    /// Whether requests avoid this replica (its connects failed or it answered 5xx): it is
    /// treated as down.
    fn avoided(&self, _address: &str) -> bool {
        false
    }
    /// Whether tokenizer calls leave this address alone (its recent calls timed out, were
    /// reset or answered 5xx): the tokenizer's circuit breaker.
    fn tokenizer_avoided(&self, _address: &str) -> bool {
        false
    }
}

/// Speculative index entries (see [`super::speculative`]).
pub trait SpeculativeEntries {
    /// One hit pushed onto `out` for each of `keys` (block keys) this Envoy sent to an engine
    /// within the TTL.
    fn speculative(&self, _keys: &[u64], _out: &mut Vec<Hit>) {}
}

/// Rates learned from the replicas' observed times to first token (see
/// [`crate::policy::rates`]).
pub trait LearnedRates {
    fn learned_rates(&self, _address: &str) -> Option<Rates> {
        None
    }
}

/// The tokenizer calls the gateway made (see [`super::tokenizer_wait`]).
pub trait TokenizerCalls {
    /// Their usual round trip (µs): the median of the last [`super::tokenizer_wait::WINDOW`]
    /// calls every worker of the gateway made, once [`super::tokenizer_wait::MIN_CALLS`] were;
    /// `None` before, or where the gateway times none (a request that might gain from its own
    /// tokens then waits for them).
    fn tokenizer_round_trip_us(&self) -> Option<u64> {
        None
    }
}

/// Turns a gateway keeps for their conversations' next requests (the filter: one shared-data
/// slot each, a turn replacing the one in its slot; the endpoint picker: the same).
pub const KEPT_TURNS: u64 = 1024;
/// Leading tokens kept per turn: what routing reads (the replica holding them holds the
/// conversation).
pub const KEPT_TURN_TOKENS: usize = 4096;

/// Tokenizations this Envoy made, for the next turn of chat conversations (see
/// [`super::earlier_turns`]) and for text prompts that begin alike (see
/// [`super::earlier_prompts`]): every worker sees them.
pub trait EarlierTurns {
    /// The leading tokens of the request whose turn tag is `tag`, when still kept, and its
    /// prompt's token count.
    fn earlier_tokens(&self, _tag: u128) -> Option<(Vec<u32>, usize)> {
        None
    }
    /// The text prompts other VMs of this Envoy learned since `seen` (a position this method
    /// returned before; 0 at first), pushed onto `out`; the position now. Those shared long
    /// before may be gone.
    fn prompts_since(&self, seen: u64, _out: &mut Vec<SharedPrompt>) -> u64 {
        seen
    }
}

/// Everything the router asks the gateway.
pub trait GatewayState:
    InFlightCounts + ReplicaAvoidance + SpeculativeEntries + LearnedRates + TokenizerCalls + EarlierTurns
{
}

impl<T: InFlightCounts + ReplicaAvoidance + SpeculativeEntries + LearnedRates + TokenizerCalls + EarlierTurns>
    GatewayState for T
{
}

/// Nothing in flight, nothing avoided, no speculative entries.
impl InFlightCounts for () {
    fn in_flight(&self, _address: &str) -> u32 {
        0
    }
}
impl ReplicaAvoidance for () {}
impl SpeculativeEntries for () {}
impl LearnedRates for () {}
impl TokenizerCalls for () {}
impl EarlierTurns for () {}
