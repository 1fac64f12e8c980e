//! The filter's Envoy stats. Names carry their labels as `.<tag>.<value>` suffixes that the
//! `stats_tags` in `envoy/llmgw-local.yaml` turn into Prometheus labels, e.g.
//! `wasmcustom.llmgw_prefix_decisions_total.outcome.exact` →
//! `llmgw_prefix_decisions_total{outcome="exact"}`. Counters and histograms are shared by name
//! by every VM; per-VM gauges carry a `vm` tag.

use crate::host::{Host, SharedKind};
use crate::phases::Breakdown;
use llmgw_core::flow::{CacheLookup, Fallback, Report, TokenizerFailure};
use llmgw_core::policy::rates::Rates;
use llmgw_core::policy::Outcome;
use proxy_wasm::types::MetricType;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// The per-replica gauges of learned rates, in the order [`Metrics::learned_rates`] sets them.
const RATE_GAUGES: [&str; 6] = [
    "llmgw_rates_base_us",
    "llmgw_rates_prefill_ns_per_token",
    "llmgw_rates_queued_ns_per_token",
    "llmgw_rates_request_us",
    "llmgw_rates_observations",
    "llmgw_rates_quiet_ms",
];

/// Metric ids of one VM (`None` where the host refused to define one).
pub struct Metrics {
    host: Rc<dyn Host>,
    outcomes: Vec<(Outcome, Option<u32>)>,
    fallbacks: Vec<(Fallback, Option<u32>)>,
    tokenizer_failures: Vec<(TokenizerFailure, Option<u32>)>,
    shared_update_failures: Vec<(SharedKind, Option<u32>)>,
    matched_blocks: Option<u32>,
    tokenizer_us: Option<u32>,
    decision_us: Option<u32>,
    phase_body_us: Option<u32>,
    phase_gateway_us: Option<u32>,
    phase_first_byte_us: Option<u32>,
    phase_first_chunk_us: Option<u32>,
    feed_connects: Option<u32>,
    feed_disconnects: Option<u32>,
    feed_messages: Option<u32>,
    feed_rejected: Option<u32>,
    feed_snapshots: Option<u32>,
    tokenizer_cache_hits: Option<u32>,
    tokenizer_cache_misses: Option<u32>,
    tokenizer_cache_earlier_turns: Option<u32>,
    tokenizer_cache_shared_prefix: Option<u32>,
    hash_mismatches: Option<u32>,
    tokenizer_failures_request_caused: Option<u32>,
    hybrid_unsupported: Option<u32>,
    incomplete_decisions: Option<u32>,
    speculative_dropped: Option<u32>,
    shared_prefixes_evicted: Option<u32>,
    earlier_prompts_evicted: Option<u32>,
    wait_families_evicted: Option<u32>,
    body_budget_exhausted: Option<u32>,
    /// Prompt token ids of streamed answers: read, missing (called for), past the event limit.
    answer_ids_read: Option<u32>,
    answer_ids_missing: Option<u32>,
    answer_event_too_large: Option<u32>,
    /// Per-VM gauges, defined on the first tick (the main thread's base VM never ticks, and
    /// would otherwise export a gauge that stays 0).
    feed_connected: Cell<Option<Option<u32>>>,
    index_blocks: Cell<Option<Option<u32>>>,
    index_bytes: Cell<Option<Option<u32>>>,
    destinations_refused: Cell<Option<Option<u32>>>,
    vm_memory: Cell<Option<Option<u32>>>,
    /// Per-replica gauges of the learned rates, defined when a replica's first are.
    rates: RefCell<HashMap<String, [Option<u32>; RATE_GAUGES.len()]>>,
    vm_tag: String,
    enabled: bool,
}

impl Metrics {
    pub fn define(host: Rc<dyn Host>, enabled: bool, vm_tag: &str) -> Metrics {
        let hr = host.as_ref();
        let define = |kind: MetricType, n: &str| if enabled { hr.define_metric(kind, n) } else { None };
        let c = |n: &str| define(MetricType::Counter, n);
        let h = |n: &str| define(MetricType::Histogram, n);
        Metrics {
            outcomes: Outcome::ALL
                .iter()
                .map(|o| (*o, c(&format!("llmgw_prefix_decisions_total.outcome.{}", o.as_str()))))
                .collect(),
            fallbacks: Fallback::ALL
                .iter()
                .map(|f| (*f, c(&format!("llmgw_fallbacks_total.reason.{}", f.as_str()))))
                .collect(),
            tokenizer_failures: TokenizerFailure::ALL
                .iter()
                .map(|f| (*f, c(&format!("llmgw_tokenizer_failures_total.reason.{}", f.as_str()))))
                .collect(),
            shared_update_failures: SharedKind::ALL
                .iter()
                .map(|k| (*k, c(&format!("llmgw_shared_update_failures_total.what.{}", k.as_str()))))
                .collect(),
            matched_blocks: h("llmgw_matched_blocks"),
            tokenizer_us: h("llmgw_tokenizer_latency_us"),
            decision_us: h("llmgw_decision_us"),
            phase_body_us: h("llmgw_phase_body_us"),
            phase_gateway_us: h("llmgw_phase_gateway_us"),
            phase_first_byte_us: h("llmgw_phase_upstream_first_byte_us"),
            phase_first_chunk_us: h("llmgw_phase_upstream_first_chunk_us"),
            feed_connects: c("llmgw_feed_connects_total"),
            feed_disconnects: c("llmgw_feed_disconnects_total"),
            feed_messages: c("llmgw_feed_messages_total"),
            feed_rejected: c("llmgw_feed_rejected_total"),
            feed_snapshots: c("llmgw_feed_snapshots_applied_total"),
            tokenizer_cache_hits: c("llmgw_tokenizer_cache_total.result.hit"),
            tokenizer_cache_misses: c("llmgw_tokenizer_cache_total.result.miss"),
            tokenizer_cache_earlier_turns: c("llmgw_tokenizer_cache_total.result.earlier_turn"),
            tokenizer_cache_shared_prefix: c("llmgw_tokenizer_cache_total.result.shared_prefix"),
            hash_mismatches: c("llmgw_hash_mismatch_total"),
            tokenizer_failures_request_caused: c("llmgw_tokenizer_failures_request_caused_total"),
            hybrid_unsupported: c("llmgw_hybrid_unsupported_total"),
            incomplete_decisions: c("llmgw_decisions_with_incomplete_engine_total"),
            speculative_dropped: c("llmgw_speculative_dropped_total"),
            shared_prefixes_evicted: c("llmgw_shared_prefixes_evicted_total"),
            earlier_prompts_evicted: c("llmgw_earlier_prompts_evicted_total"),
            wait_families_evicted: c("llmgw_wait_families_evicted_total"),
            body_budget_exhausted: c("llmgw_body_budget_exhausted_total"),
            answer_ids_read: c("llmgw_answer_tokens_total.result.read"),
            answer_ids_missing: c("llmgw_answer_tokens_total.result.missing"),
            answer_event_too_large: c("llmgw_answer_tokens_total.result.too_large"),
            feed_connected: Cell::new(None),
            index_blocks: Cell::new(None),
            index_bytes: Cell::new(None),
            destinations_refused: Cell::new(None),
            vm_memory: Cell::new(None),
            rates: RefCell::new(HashMap::new()),
            vm_tag: vm_tag.to_owned(),
            enabled,
            host,
        }
    }

    fn inc(&self, id: Option<u32>) {
        if let Some(id) = id {
            self.host.increment_metric(id, 1);
        }
    }

    fn record(&self, id: Option<u32>, v: u64) {
        if let Some(id) = id {
            self.host.record_metric(id, v);
        }
    }

    fn labelled<T: PartialEq>(&self, ids: &[(T, Option<u32>)], which: T) {
        if let Some((_, id)) = ids.iter().find(|(x, _)| *x == which) {
            self.inc(*id);
        }
    }

    /// Counts what a routing step reports.
    pub fn report(&self, r: &Report) {
        if let Some(lookup) = r.tokenizer_cache {
            self.inc(match lookup {
                CacheLookup::EarlierTurn => self.tokenizer_cache_earlier_turns,
                CacheLookup::SharedPrefix => self.tokenizer_cache_shared_prefix,
                l if l.is_hit() => self.tokenizer_cache_hits,
                _ => self.tokenizer_cache_misses,
            });
        }
        if let Some(f) = r.tokenizer_failure {
            self.labelled(&self.tokenizer_failures, f);
            if r.tokenizer_failure_request_caused {
                self.inc(self.tokenizer_failures_request_caused);
            }
        }
        if let Some(o) = r.outcome {
            self.labelled(&self.outcomes, o);
        }
        if let Some(f) = r.fallback {
            self.labelled(&self.fallbacks, f);
        }
        if r.hash_mismatch {
            self.inc(self.hash_mismatches);
        }
        if r.hybrid_unsupported {
            self.inc(self.hybrid_unsupported);
        }
        if r.saw_incomplete {
            self.inc(self.incomplete_decisions);
        }
        if let Some(n) = r.matched_blocks {
            self.record(self.matched_blocks, u64::from(n));
        }
    }

    /// Shared-data updates that gave up (refused, or every compare-and-swap lost its race).
    pub fn shared_update_failed(&self, what: impl IntoIterator<Item = SharedKind>) {
        for k in what {
            self.labelled(&self.shared_update_failures, k);
        }
    }

    /// A body routed by its leading bytes because the VM's body budget was spent.
    pub fn body_budget_exhausted(&self) {
        self.inc(self.body_budget_exhausted);
    }

    /// Unexpired speculative index entries the bound dropped.
    pub fn speculative_dropped(&self, n: usize) {
        self.add(self.speculative_dropped, n);
    }

    /// Siblings' common prefixes the VM's bound dropped.
    pub fn shared_prefixes_evicted(&self, n: u64) {
        self.add(self.shared_prefixes_evicted, n);
    }

    /// A streamed answer's prompt token ids: read (true), or missing and called for (false).
    pub fn answer_tokens(&self, read: bool) {
        self.add(if read { self.answer_ids_read } else { self.answer_ids_missing }, 1);
    }

    /// A streamed answer event past `llmgw_core::request::MAX_EVENT_BYTES`.
    pub fn answer_event_too_large(&self) {
        self.add(self.answer_event_too_large, 1);
    }

    /// Earlier text prompts' tags the VM's bound dropped.
    pub fn earlier_prompts_evicted(&self, n: u64) {
        self.add(self.earlier_prompts_evicted, n);
    }

    /// Families whose waits for their tokens were counted, dropped by the VM's bound.
    pub fn wait_families_evicted(&self, n: u64) {
        self.add(self.wait_families_evicted, n);
    }

    fn add(&self, id: Option<u32>, n: impl TryInto<i64>) {
        if let (Some(id), Ok(n)) = (id, n.try_into()) {
            if n > 0 {
                self.host.increment_metric(id, n);
            }
        }
    }

    pub fn tokenizer_latency_us(&self, us: u64) {
        self.record(self.tokenizer_us, us);
    }

    pub fn decision_us(&self, us: u64) {
        self.record(self.decision_us, us);
    }

    /// A decided request's phases before the upstream request (the tokenizer's round trip and
    /// the filter's own time are `llmgw_tokenizer_latency_us` and `llmgw_decision_us`).
    pub fn phases_decided(&self, b: &Breakdown) {
        if let Some(us) = b.body_us {
            self.record(self.phase_body_us, us);
        }
        if let Some(us) = b.gateway_us {
            self.record(self.phase_gateway_us, us);
        }
    }

    /// The replica's first response byte (headers) after the decision.
    pub fn phase_upstream_first_byte_us(&self, us: u64) {
        self.record(self.phase_first_byte_us, us);
    }

    /// The replica's first response body chunk after the decision.
    pub fn phase_upstream_first_chunk_us(&self, us: u64) {
        self.record(self.phase_first_chunk_us, us);
    }

    pub fn feed_connect(&self) {
        self.inc(self.feed_connects);
    }

    pub fn feed_disconnect(&self) {
        self.inc(self.feed_disconnects);
    }

    /// A subscription's snapshot complete: the index built from it now serves.
    pub fn feed_snapshot_applied(&self) {
        self.inc(self.feed_snapshots);
    }

    pub fn feed_message(&self, rejected: bool) {
        self.inc(self.feed_messages);
        if rejected {
            self.inc(self.feed_rejected);
        }
    }

    fn gauge(&self, cell: &Cell<Option<Option<u32>>>, name: &str) -> Option<u32> {
        if let Some(id) = cell.get() {
            return id;
        }
        let id = self.host.define_metric(MetricType::Gauge, &format!("{name}.vm.{}", self.vm_tag));
        cell.set(Some(id));
        id
    }

    /// The rates learned for the replica at `address` (gauges shared by every VM, which all
    /// read the same shared records): base and per request in µs, per token in ns, how long
    /// since their last observation in ms (past `rates_forget_ms` they are not used).
    pub fn learned_rates(&self, address: &str, r: &Rates) {
        if !self.enabled {
            return;
        }
        let mut gauges = self.rates.borrow_mut();
        if !gauges.contains_key(address) && gauges.len() >= crate::rates::MAX_RECORDS {
            return;
        }
        let ids = *gauges.entry(address.to_owned()).or_insert_with(|| {
            let tag: String = address.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
            RATE_GAUGES.map(|name| self.host.define_metric(MetricType::Gauge, &format!("{name}.replica.{tag}")))
        });
        let values = [
            r.base_us,
            r.prefill_us_per_token * 1000.0,
            r.queued_us_per_token * 1000.0,
            r.request_us,
            f64::from(r.observations),
            r.quiet_ns as f64 / 1e6,
        ];
        for (id, v) in ids.into_iter().zip(values) {
            // Saturating float-to-integer conversion; NaN gives 0.
            self.record(id, v.max(0.0) as u64);
        }
    }

    /// `index_blocks`: (block, replica) entries of the serving index; `index_bytes`: its tables;
    /// `refused`: replicas of the table whose address the allowlist refuses.
    pub fn feed_state(&self, connected: bool, index_blocks: u64, index_bytes: u64, refused: u64) {
        if self.enabled {
            self.record(self.gauge(&self.destinations_refused, "llmgw_destinations_refused"), refused);
            self.record(self.gauge(&self.feed_connected, "llmgw_feed_connected"), u64::from(connected));
            self.record(self.gauge(&self.index_blocks, "llmgw_index_blocks"), index_blocks);
            self.record(self.gauge(&self.index_bytes, "llmgw_index_bytes"), index_bytes);
            self.record(self.gauge(&self.vm_memory, "llmgw_vm_memory_bytes"), linear_memory_bytes());
        }
    }
}

/// The VM's linear memory in bytes: what Envoy holds for this VM's heap, which never shrinks
/// (0 outside wasm, where there is no such memory).
pub fn linear_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    {
        let pages = u64::try_from(core::arch::wasm32::memory_size::<0>()).unwrap_or(u64::MAX);
        pages.saturating_mul(65_536)
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        0
    }
}
