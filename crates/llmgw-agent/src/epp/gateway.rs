//! What the routing core asks the gateway, as the endpoint picker knows it: the requests it sent
//! and that have not finished (per endpoint), the endpoints it avoids for now (a primary the data
//! plane could not use, a tokenizer that failed), and the subset hint of the request being
//! decided (an endpoint outside it counts as down). The filter keeps the same in Envoy's shared
//! data; here one mutex-guarded table serves every stream, and each decision reads a snapshot.

use llmgw_core::flow::{InFlightCounts, LearnedRates, ReplicaAvoidance, SpeculativeEntries, TokenizerCalls};
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct Table {
    in_flight: HashMap<String, u32>,
    /// Endpoint → until when requests avoid it.
    avoided: HashMap<String, Instant>,
    tokenizers: HashMap<String, Instant>,
}

/// The picker's view of its own traffic, shared by every stream.
#[derive(Debug)]
pub struct Gateway {
    table: Mutex<Table>,
    avoid_for: Duration,
}

impl Gateway {
    pub fn new(avoid_for: Duration) -> Gateway {
        Gateway { table: Mutex::new(Table::default()), avoid_for }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request was sent to `address`.
    pub fn started(&self, address: &str) {
        let mut t = self.table();
        let n = t.in_flight.entry(address.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
    }

    /// A request counted at `address` finished.
    pub fn finished(&self, address: &str) {
        let mut t = self.table();
        if let Some(n) = t.in_flight.get_mut(address) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                t.in_flight.remove(address);
            }
        }
    }

    /// When an avoidance starting now ends.
    fn until(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.avoid_for).unwrap_or(now)
    }

    /// Requests avoid `address` for a while (the data plane could not use it).
    pub fn avoid(&self, address: &str) {
        let until = self.until();
        self.table().avoided.insert(address.to_owned(), until);
    }

    /// Tokenizer calls avoid `address` for a while (its call failed).
    pub fn avoid_tokenizer(&self, address: &str) {
        let until = self.until();
        self.table().tokenizers.insert(address.to_owned(), until);
    }

    /// What a decision reads, now, for a request limited to `subset` (if hinted).
    pub fn snapshot(&self, subset: Option<&[String]>) -> Snapshot {
        let now = Instant::now();
        let mut t = self.table();
        t.avoided.retain(|_, until| *until > now);
        t.tokenizers.retain(|_, until| *until > now);
        Snapshot {
            in_flight: t.in_flight.clone(),
            avoided: t.avoided.keys().cloned().collect(),
            tokenizers: t.tokenizers.keys().cloned().collect(),
            subset: subset.map(|s| s.iter().cloned().collect()),
        }
    }
}

/// One decision's view (see [`Gateway::snapshot`]).
#[derive(Debug, Default)]
pub struct Snapshot {
    in_flight: HashMap<String, u32>,
    avoided: HashSet<String>,
    tokenizers: HashSet<String>,
    subset: Option<HashSet<String>>,
}

impl Snapshot {
    /// Whether the subset hint (if any) admits `address`.
    pub fn eligible(&self, address: &str) -> bool {
        self.subset.as_ref().is_none_or(|s| s.contains(address))
    }
}

impl InFlightCounts for Snapshot {
    fn in_flight(&self, address: &str) -> u32 {
        self.in_flight.get(address).copied().unwrap_or(0)
    }
}

impl ReplicaAvoidance for Snapshot {
    fn avoided(&self, address: &str) -> bool {
        !self.eligible(address) || self.avoided.contains(address)
    }

    fn tokenizer_avoided(&self, address: &str) -> bool {
        self.tokenizers.contains(address)
    }
}

impl SpeculativeEntries for Snapshot {}
impl LearnedRates for Snapshot {}
impl TokenizerCalls for Snapshot {}
impl llmgw_core::flow::EarlierTurns for Snapshot {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_avoidance_and_the_subset_are_what_decisions_read() {
        let g = Gateway::new(Duration::from_secs(60));
        g.started("10.0.0.1:8000");
        g.started("10.0.0.1:8000");
        g.finished("10.0.0.1:8000");
        g.avoid("10.0.0.2:8000");
        let subset = vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()];
        let s = g.snapshot(Some(&subset));
        assert_eq!(s.in_flight("10.0.0.1:8000"), 1);
        assert!(!s.avoided("10.0.0.1:8000"));
        assert!(s.avoided("10.0.0.2:8000"), "avoided after the data plane could not use it");
        assert!(s.avoided("10.0.0.3:8000"), "outside the subset hint");
        let all = g.snapshot(None);
        assert!(!all.avoided("10.0.0.3:8000"));
        g.finished("10.0.0.1:8000");
        g.finished("10.0.0.1:8000");
        assert_eq!(g.snapshot(None).in_flight("10.0.0.1:8000"), 0);
    }
}
