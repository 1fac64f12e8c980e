//! What the routing core asks the gateway, as the endpoint picker knows it: the requests it sent
//! and that have not finished (per endpoint, with the prefill tokens of those that have not
//! produced a first token and the KV blocks their prompts hold), how long its requests held their
//! blocks and the rates learned from their first tokens ([`super::learned`]), the requests it
//! expects back (those answered lately whose next request has not come, by the core's ledger of
//! returns, and how soon next requests followed), the requests routed lately per endpoint
//! (fading by request: what breaks a tie between equally fast endpoints), its tokenizer calls' usual round trip (what a
//! request that could go at once weighs its wait for its own tokens against), the endpoints it
//! avoids for now (a primary the data plane could not use, a tokenizer that failed), and the
//! subset hint of the request being decided (an endpoint outside it counts as down). The filter
//! keeps the same in Envoy's shared data; here one mutex-guarded table serves every stream, and
//! each decision reads a snapshot.

use super::learned::Learned;
use super::turns::Turns;
use llmgw_core::fleet::GatewayShare;
use llmgw_core::flow::tokenizer_wait::RoundTrips;
use llmgw_core::flow::{
    add_speculative, speculative_hits, EarlierTurns, HeldBlocks, Holding, InFlightCounts, Keep, LearnedRates,
    ReplicaAvoidance, Speculation, SpeculativeEntries, SpeculativeEntry, SpeculativeHit, TokenizerCalls,
};
use llmgw_core::policy::rates::{Basis, Rates};
use llmgw_core::policy::return_ledger::{self, ExpectedReturns, LearnedGaps, Record as ReturnRecord};
use llmgw_core::policy::returns::Returning;
use llmgw_core::policy::routed_lately::{self, Count};
use llmgw_core::stable_hash::stable_hash;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One endpoint's requests in flight.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Busy {
    requests: u32,
    /// Prefill tokens of those that have not produced a first token.
    pending_tokens: u64,
}

#[derive(Debug, Default)]
struct Table {
    in_flight: HashMap<String, Busy>,
    held: HeldBlocks,
    learned: Learned,
    /// Endpoint → until when requests avoid it.
    avoided: HashMap<String, Instant>,
    tokenizers: HashMap<String, Instant>,
    /// The last tokenizer calls' round trips (the core's window).
    round_trips: RoundTrips,
    /// Requests routed lately per endpoint (the core's counts, bounded).
    routed_lately: Vec<Count>,
}

/// The requests answered lately and not followed yet (bounded by the core's ledger), and what
/// was learned of how soon next requests follow.
#[derive(Debug, Default)]
struct Returns {
    records: Vec<ReturnRecord>,
    gaps: LearnedGaps,
}

/// The id an endpoint's requests expected back are recorded under.
fn replica_id(address: &str) -> u64 {
    stable_hash(address.as_bytes())
}

/// One routed request as the picker counts it, from its routing ([`Gateway::started`]) to its
/// end ([`Gateway::finished`]).
#[derive(Debug)]
pub struct Charge {
    pub address: String,
    /// The prompt tokens it computes there, counted as queued prefill until its first token
    /// (0 once that came).
    prefill_tokens: u64,
    /// The KV blocks its prompt holds there while it is in flight.
    holding: Option<Holding>,
    /// What its first token teaches the endpoint's rates: the prediction it was routed by
    /// (none where nothing is learned).
    learning: Option<Box<Basis>>,
    /// Where it was routed on an estimate of its length: its prompt's tokens, once its call
    /// after routing counted them (its first token teaches nothing before).
    counted: Option<Arc<Counted>>,
    /// The key its answer is recorded under from its first token, for the requests expected
    /// back (none for an error: nobody's turn follows it), and whether it was recorded.
    ends_as: Option<u64>,
    recorded: bool,
    routed_at: Instant,
}

impl Charge {
    pub fn new(address: String, prefill_tokens: u64, holding: Option<Holding>, learning: Option<Basis>) -> Charge {
        let learning = learning.map(Box::new);
        Charge {
            address,
            prefill_tokens,
            holding,
            learning,
            counted: None,
            ends_as: None,
            recorded: false,
            routed_at: Instant::now(),
        }
    }

    /// Its answer is recorded under `key` from its first token (see [`Gateway::first_token`]).
    pub fn recorded_as(mut self, key: Option<u64>) -> Charge {
        self.ends_as = key;
        self
    }

    /// It was answered with an error: nobody's next request follows it.
    pub fn failed(&mut self) {
        self.ends_as = None;
    }

    /// The request was routed on an estimate of its length: what its first token teaches waits
    /// for the count this returns to be set.
    pub fn counted_later(&mut self) -> Arc<Counted> {
        let c = Arc::new(Counted::default());
        self.counted = Some(c.clone());
        c
    }

    /// The prediction its first token teaches: as made, or corrected by its prompt's tokens
    /// where it was made on an estimate (none while they are not counted).
    fn lesson(&mut self) -> Option<Basis> {
        let basis = *self.learning.take()?;
        match &self.counted {
            None => Some(basis),
            Some(c) => c.get().map(|(tokens, estimated)| basis.corrected(tokens, estimated)),
        }
    }
}

/// A prompt's token count, set by its call after routing, with the estimate it was routed on.
#[derive(Debug, Default)]
pub struct Counted(Mutex<Option<(u64, u64)>>);

impl Counted {
    pub fn set(&self, tokens: u64, estimated: u64) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some((tokens, estimated));
    }

    fn get(&self) -> Option<(u64, u64)> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The picker's view of its own traffic, shared by every stream.
#[derive(Debug)]
pub struct Gateway {
    table: Mutex<Table>,
    /// Apart from the table, each: a lookup is made while a decision runs, not copied into it.
    turns: Arc<Mutex<Turns>>,
    speculative: Arc<Mutex<Vec<SpeculativeEntry>>>,
    returns: Arc<Mutex<Returns>>,
    avoid_for: Duration,
}

/// The wall clock as the routing core takes it (ns since the Unix epoch).
pub fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Gateway {
    pub fn new(avoid_for: Duration) -> Gateway {
        Gateway {
            table: Mutex::new(Table::default()),
            turns: Arc::default(),
            speculative: Arc::default(),
            returns: Arc::default(),
            avoid_for,
        }
    }

    /// Records a routed request's blocks as sent to its engine, until KV events confirm them;
    /// how many unexpired entries the bound dropped.
    pub fn speculate(&self, spec: &Speculation) -> usize {
        add_speculative(&mut self.speculative.lock().unwrap_or_else(|p| p.into_inner()), spec, now_ns())
    }

    /// Keeps what a routing step, or a call after routing, said to keep (its tokens, for its
    /// conversation's next turn).
    pub fn keep(&self, keep: &Keep) {
        if !keep.tokens.is_empty() {
            self.turns.lock().unwrap_or_else(|p| p.into_inner()).keep(keep);
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn returns(&self) -> MutexGuard<'_, Returns> {
        self.returns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request was sent to `c.address`.
    pub fn started(&self, c: &Charge) {
        let mut t = self.table();
        let b = t.in_flight.entry(c.address.clone()).or_default();
        b.requests = b.requests.saturating_add(1);
        b.pending_tokens = b.pending_tokens.saturating_add(c.prefill_tokens);
        if let Some(h) = &c.holding {
            t.held.add(&c.address, h);
        }
        routed_lately::routed(&mut t.routed_lately, replica_id(&c.address));
    }

    /// The request's first token came (or its answer, where not streamed): its prefill tokens
    /// stop counting. `teach`: it is a streamed answer's first chunk, whose time from the
    /// routing teaches the endpoint's rates (once).
    pub fn first_token(&self, c: &mut Charge, teach: bool) {
        if let Some(key) = c.ends_as.filter(|_| !c.recorded) {
            c.recorded = true;
            let mut r = self.returns();
            let r = &mut *r;
            let gone = return_ledger::start(&mut r.records, replica_id(&c.address), key, now_ns());
            r.gaps.learn(&gone);
        }
        let tokens = std::mem::take(&mut c.prefill_tokens);
        let basis = if teach {
            c.lesson()
        } else {
            c.learning = None;
            None
        };
        if tokens == 0 && basis.is_none() {
            return;
        }
        let ttft_us = micros(c.routed_at.elapsed());
        let mut t = self.table();
        if let Some(b) = t.in_flight.get_mut(&c.address) {
            b.pending_tokens = b.pending_tokens.saturating_sub(tokens);
        }
        if let Some(basis) = basis {
            t.learned.teach(&c.address, &basis, ttft_us, Instant::now());
        }
    }

    /// A request counted at `c.address` finished: its hold is observed.
    pub fn finished(&self, mut c: Charge) {
        // An answer that never came is not recorded at its end.
        if !c.recorded {
            c.ends_as = None;
        }
        self.first_token(&mut c, false);
        let held_us = micros(c.routed_at.elapsed());
        if let Some(key) = c.ends_as {
            return_ledger::end(&mut self.returns().records, key, now_ns());
        }
        let mut t = self.table();
        if let Some(b) = t.in_flight.get_mut(&c.address) {
            b.requests = b.requests.saturating_sub(1);
            if b.requests == 0 {
                t.in_flight.remove(&c.address);
            }
        }
        if let Some(h) = &c.holding {
            t.held.remove(&c.address, h);
        }
        t.learned.hold(&c.address, held_us);
    }

    /// A request whose blocks include `key` followed the request recorded under it: the gap
    /// is learned.
    pub fn followed(&self, key: u64) {
        let mut r = self.returns();
        let r = &mut *r;
        if let Some(o) = return_ledger::follow(&mut r.records, key, now_ns()) {
            r.gaps.learn(&[o]);
        }
    }

    /// A tokenizer call was answered (or failed) after `d`.
    pub fn tokenizer_round_trip(&self, d: Duration) {
        self.table().round_trips.observe(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// The learned rates, as Prometheus gauges.
    pub fn learned_text(&self) -> String {
        self.table().learned.text(Instant::now())
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

    /// The picker's requests in flight on each endpoint, and the blocks they hold there.
    pub fn shares(&self) -> HashMap<String, GatewayShare> {
        let t = self.table();
        t.in_flight
            .iter()
            .map(|(a, busy)| (a.clone(), GatewayShare { requests: busy.requests, blocks: t.held.total(a) }))
            .collect()
    }

    /// What a decision reads, now, for a request limited to `subset` (if hinted).
    pub fn snapshot(&self, subset: Option<&[String]>) -> Snapshot {
        let now = Instant::now();
        let mut t = self.table();
        t.avoided.retain(|_, until| *until > now);
        t.tokenizers.retain(|_, until| *until > now);
        let mut per_endpoint = HashMap::new();
        for a in t.in_flight.keys().chain(t.learned.addresses()) {
            if per_endpoint.contains_key(a) {
                continue;
            }
            let e = Endpoint {
                busy: t.in_flight.get(a).copied().unwrap_or_default(),
                held_blocks: t.held.total(a),
                hold_us: t.learned.hold_us(a),
                rates: t.learned.rates(a, now),
            };
            per_endpoint.insert(a.clone(), e);
        }
        Snapshot {
            per_endpoint,
            avoided: t.avoided.keys().cloned().collect(),
            tokenizers: t.tokenizers.keys().cloned().collect(),
            returns: self.returns.clone(),
            expected: OnceLock::new(),
            round_trip_us: t.round_trips.median_us(),
            routed_lately: t.routed_lately.iter().map(|c| (c.id, c.count)).collect(),
            subset: subset.map(|s| s.iter().cloned().collect()),
            turns: self.turns.clone(),
            speculative: self.speculative.clone(),
        }
    }
}

/// One endpoint as a decision reads it.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Endpoint {
    busy: Busy,
    held_blocks: u64,
    hold_us: f64,
    rates: Option<Rates>,
}

/// One decision's view (see [`Gateway::snapshot`]).
#[derive(Debug, Default)]
pub struct Snapshot {
    per_endpoint: HashMap<String, Endpoint>,
    avoided: HashSet<String>,
    tokenizers: HashSet<String>,
    /// Read only where a decision asks for the requests expected back, once.
    returns: Arc<Mutex<Returns>>,
    expected: OnceLock<ExpectedReturns>,
    round_trip_us: Option<u64>,
    routed_lately: HashMap<u64, f64>,
    subset: Option<HashSet<String>>,
    turns: Arc<Mutex<Turns>>,
    speculative: Arc<Mutex<Vec<SpeculativeEntry>>>,
}

impl Snapshot {
    /// Whether the subset hint (if any) admits `address`.
    pub fn eligible(&self, address: &str) -> bool {
        self.subset.as_ref().is_none_or(|s| s.contains(address))
    }

    fn expected(&self) -> &ExpectedReturns {
        self.expected.get_or_init(|| {
            let r = self.returns.lock().unwrap_or_else(|p| p.into_inner());
            ExpectedReturns::new(r.records.iter().copied(), &r.gaps, now_ns())
        })
    }

    fn endpoint(&self, address: &str) -> Endpoint {
        self.per_endpoint.get(address).copied().unwrap_or_default()
    }
}

impl InFlightCounts for Snapshot {
    fn in_flight(&self, address: &str) -> u32 {
        self.endpoint(address).busy.requests
    }
    fn pending_tokens(&self, address: &str) -> u64 {
        self.endpoint(address).busy.pending_tokens
    }
    fn held_blocks(&self, address: &str) -> u64 {
        self.endpoint(address).held_blocks
    }
    fn hold_us(&self, address: &str) -> f64 {
        self.endpoint(address).hold_us
    }
    fn recent_requests(&self, address: &str) -> f64 {
        self.routed_lately.get(&replica_id(address)).copied().unwrap_or(0.0)
    }
    fn returning(&self, address: &str) -> Returning {
        let busy = self.endpoint(address).busy;
        self.expected().of(replica_id(address), busy.requests, busy.pending_tokens > 0)
    }
    fn ended_request(&self, key: u64) -> bool {
        self.expected().ended(key)
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

impl SpeculativeEntries for Snapshot {
    fn speculative(&self, keys: &[u64], out: &mut Vec<SpeculativeHit>) {
        let entries = self.speculative.lock().unwrap_or_else(|p| p.into_inner());
        speculative_hits(entries.iter().copied(), keys, now_ns(), out);
    }
}
impl LearnedRates for Snapshot {
    fn learned_rates(&self, address: &str) -> Option<Rates> {
        self.endpoint(address).rates
    }
}
impl TokenizerCalls for Snapshot {
    fn tokenizer_round_trip_us(&self) -> Option<u64> {
        self.round_trip_us
    }
}
impl EarlierTurns for Snapshot {
    fn earlier_tokens(&self, tag: u128) -> Option<(Vec<u32>, usize)> {
        self.turns.lock().unwrap_or_else(|p| p.into_inner()).lookup(tag)
    }
}

#[cfg(test)]
mod tests;
