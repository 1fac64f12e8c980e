//! What the router asks the gateway, read once per decision from this Envoy's shared data: the
//! in-flight counts over the live VMs (`crate::inflight`), which replicas and tokenizers are
//! avoided (`crate::health`), the speculative index entries (`crate::speculative`), the
//! rates learned per replica (`crate::rates`), the requests routed lately (`crate::recent`) and
//! the requests answered lately (`crate::returns`); how long requests hold their KV blocks
//! (`crate::hold_times`) is read only where an engine's cache size is known;
//! the tokens kept for conversations' next turns (`crate::earlier_turns`), the text prompts
//! the other VMs handed on (`crate::earlier_prompts`) and the tokenizer calls' usual round trip
//! (`crate::tokenizer_times`) are read when asked.

use crate::health::Health;
use crate::hold_times::HoldTimes;
use crate::host::Host;
use crate::inflight::Counts;
use crate::rates::Learned;
use crate::recent::Recent;
use crate::returns::Returns;
use crate::speculative::Entries;
use llmgw_core::flow::{
    EarlierTurns, InFlightCounts, LearnedRates, ReplicaAvoidance, SharedPrompt, SpeculativeEntries, SpeculativeHit,
    TokenizerCalls,
};
use llmgw_core::policy::rates::Rates;
use llmgw_core::policy::returns::Returning;
use std::rc::Rc;

pub struct Snapshot {
    host: Rc<dyn Host>,
    counts: Counts,
    health: Health,
    tokenizers: Health,
    speculative: Entries,
    rates: Learned,
    recent: Recent,
    returns: Returns,
    /// Read at the first ask: only where an engine's cache size is known.
    holds: std::cell::OnceCell<HoldTimes>,
}

impl Snapshot {
    pub fn read(shared: &Rc<dyn Host>) -> Snapshot {
        let host = shared.as_ref();
        Snapshot {
            host: shared.clone(),
            counts: Counts::read(host),
            health: Health::read(host),
            tokenizers: Health::read_tokenizers(host),
            speculative: Entries::read(host),
            rates: Learned::read(host),
            recent: Recent::read(host),
            returns: Returns::read(host),
            holds: std::cell::OnceCell::new(),
        }
    }
}

impl InFlightCounts for Snapshot {
    fn in_flight(&self, address: &str) -> u32 {
        self.counts.of(address).0
    }

    fn pending_tokens(&self, address: &str) -> u64 {
        self.counts.of(address).1
    }

    fn recent_requests(&self, address: &str) -> f64 {
        self.recent.of(address)
    }

    fn returning(&self, address: &str) -> Returning {
        let (in_flight, pending_tokens) = self.counts.of(address);
        self.returns.of(address, in_flight, pending_tokens > 0)
    }

    fn ended_request(&self, key: u64) -> bool {
        self.returns.ended(key)
    }

    fn held_blocks(&self, address: &str) -> u64 {
        self.counts.blocks(address)
    }

    fn hold_us(&self, address: &str) -> f64 {
        self.holds.get_or_init(|| HoldTimes::read(self.host.as_ref())).of(address)
    }
}

impl ReplicaAvoidance for Snapshot {
    fn avoided(&self, address: &str) -> bool {
        self.health.avoided(address)
    }

    fn tokenizer_avoided(&self, address: &str) -> bool {
        self.tokenizers.avoided(address)
    }
}

impl SpeculativeEntries for Snapshot {
    fn speculative(&self, keys: &[u64], out: &mut Vec<SpeculativeHit>) {
        self.speculative.lookup(keys, out);
    }
}

impl LearnedRates for Snapshot {
    fn learned_rates(&self, address: &str) -> Option<Rates> {
        self.rates.of(address)
    }
}

impl TokenizerCalls for Snapshot {
    fn tokenizer_round_trip_us(&self) -> Option<u64> {
        crate::tokenizer_times::median_us(self.host.as_ref())
    }
}

impl EarlierTurns for Snapshot {
    fn earlier_tokens(&self, tag: u128) -> Option<(Vec<u32>, usize)> {
        crate::earlier_turns::lookup(self.host.as_ref(), tag)
    }

    fn prompts_since(&self, seen: u64, out: &mut Vec<SharedPrompt>) -> u64 {
        crate::earlier_prompts::since(self.host.as_ref(), seen, out)
    }
}
