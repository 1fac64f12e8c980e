//! The filter's Envoy stats. Names carry their labels as `.<tag>.<value>` suffixes that the
//! `stats_tags` in `envoy/llmgw-local.yaml` turn into Prometheus labels, e.g.
//! `wasmcustom.llmgw_prefix_decisions_total.outcome.exact` →
//! `llmgw_prefix_decisions_total{outcome="exact"}`. Counters and histograms are shared by name
//! by every VM; per-VM gauges carry a `vm` tag.

use llmgw_core::policy::Outcome;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Why exact routing was not possible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No profile serves the model.
    NoProfile,
    /// The profile has `kv_events` off.
    NoKvEvents,
    /// The body is not a JSON object of the expected shape.
    Unparseable,
    /// The body has no prompt to hash.
    NoPrompt,
    /// The body exceeds `max_body_bytes`.
    BodyTooLarge,
    /// The index has not received a full snapshot.
    NotSynced,
    /// The tokenizer call failed (see the tokenizer failure counters).
    Tokenizer,
    /// Hashing failed (e.g. no block fits).
    Hash,
    /// The index knows none of the request's blocks.
    NoMatch,
}

impl Fallback {
    pub const ALL: [Fallback; 9] = [
        Fallback::NoProfile,
        Fallback::NoKvEvents,
        Fallback::Unparseable,
        Fallback::NoPrompt,
        Fallback::BodyTooLarge,
        Fallback::NotSynced,
        Fallback::Tokenizer,
        Fallback::Hash,
        Fallback::NoMatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoProfile => "no_profile",
            Fallback::NoKvEvents => "no_kv_events",
            Fallback::Unparseable => "unparseable",
            Fallback::NoPrompt => "no_prompt",
            Fallback::BodyTooLarge => "body_too_large",
            Fallback::NotSynced => "not_synced",
            Fallback::Tokenizer => "tokenizer",
            Fallback::Hash => "hash",
            Fallback::NoMatch => "no_match",
        }
    }
}

/// How a tokenizer call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerFailure {
    /// Envoy synthesized a 504 (the call's timeout).
    Timeout,
    /// A 503 (connection refused or no upstream, often synthesized by Envoy).
    Unavailable,
    /// Any other non-200 status.
    Status,
    /// The call was reset (no headers at all).
    Reset,
    /// 200 but no token ids in the body.
    BadResponse,
    /// `dispatch_http_call` refused the call (unknown cluster, bad headers).
    Dispatch,
}

impl TokenizerFailure {
    pub const ALL: [TokenizerFailure; 6] = [
        TokenizerFailure::Timeout,
        TokenizerFailure::Unavailable,
        TokenizerFailure::Status,
        TokenizerFailure::Reset,
        TokenizerFailure::BadResponse,
        TokenizerFailure::Dispatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerFailure::Timeout => "timeout",
            TokenizerFailure::Unavailable => "unavailable",
            TokenizerFailure::Status => "status",
            TokenizerFailure::Reset => "reset",
            TokenizerFailure::BadResponse => "bad_response",
            TokenizerFailure::Dispatch => "dispatch",
        }
    }
}

fn define(t: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(t, name).ok()
}

/// Metric ids of one VM (`None` where the host refused to define one).
#[derive(Debug, Default)]
pub struct Metrics {
    outcomes: Vec<(Outcome, Option<u32>)>,
    fallbacks: Vec<(Fallback, Option<u32>)>,
    tokenizer_failures: Vec<(TokenizerFailure, Option<u32>)>,
    matched_blocks: Option<u32>,
    tokenizer_us: Option<u32>,
    decision_us: Option<u32>,
    feed_connects: Option<u32>,
    feed_disconnects: Option<u32>,
    feed_messages: Option<u32>,
    feed_rejected: Option<u32>,
    tokenizer_cache_hits: Option<u32>,
    tokenizer_cache_misses: Option<u32>,
    /// Per-VM gauges, defined on the first tick (the main thread's base VM never ticks, and
    /// would otherwise export a gauge that stays 0).
    feed_connected: std::cell::Cell<Option<Option<u32>>>,
    index_blocks: std::cell::Cell<Option<Option<u32>>>,
    index_bytes: std::cell::Cell<Option<Option<u32>>>,
    vm_tag: String,
    enabled: bool,
}

impl Metrics {
    pub fn define(enabled: bool, vm_tag: &str) -> Metrics {
        if !enabled {
            return Metrics::default();
        }
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
            matched_blocks: h("llmgw_matched_blocks"),
            tokenizer_us: h("llmgw_tokenizer_latency_us"),
            decision_us: h("llmgw_decision_us"),
            feed_connects: c("llmgw_feed_connects_total"),
            feed_disconnects: c("llmgw_feed_disconnects_total"),
            feed_messages: c("llmgw_feed_messages_total"),
            feed_rejected: c("llmgw_feed_rejected_total"),
            tokenizer_cache_hits: c("llmgw_tokenizer_cache_total.result.hit"),
            tokenizer_cache_misses: c("llmgw_tokenizer_cache_total.result.miss"),
            feed_connected: std::cell::Cell::new(None),
            index_blocks: std::cell::Cell::new(None),
            index_bytes: std::cell::Cell::new(None),
            vm_tag: vm_tag.to_owned(),
            enabled,
        }
    }

    fn inc(id: Option<u32>) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn record(id: Option<u32>, v: u64) {
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, v);
        }
    }

    pub fn outcome(&self, o: Outcome) {
        if let Some((_, id)) = self.outcomes.iter().find(|(x, _)| *x == o) {
            Self::inc(*id);
        }
    }

    pub fn fallback(&self, f: Fallback) {
        if let Some((_, id)) = self.fallbacks.iter().find(|(x, _)| *x == f) {
            Self::inc(*id);
        }
    }

    pub fn tokenizer_failure(&self, f: TokenizerFailure) {
        if let Some((_, id)) = self.tokenizer_failures.iter().find(|(x, _)| *x == f) {
            Self::inc(*id);
        }
    }

    pub fn matched_blocks(&self, n: u32) {
        Self::record(self.matched_blocks, u64::from(n));
    }

    /// A tokenization looked up in the VM's cache.
    pub fn tokenizer_cache(&self, hit: bool) {
        Self::inc(if hit { self.tokenizer_cache_hits } else { self.tokenizer_cache_misses });
    }

    pub fn tokenizer_latency_us(&self, us: u64) {
        Self::record(self.tokenizer_us, us);
    }

    pub fn decision_us(&self, us: u64) {
        Self::record(self.decision_us, us);
    }

    pub fn feed_connect(&self) {
        Self::inc(self.feed_connects);
    }

    pub fn feed_disconnect(&self) {
        Self::inc(self.feed_disconnects);
    }

    pub fn feed_message(&self, rejected: bool) {
        Self::inc(self.feed_messages);
        if rejected {
            Self::inc(self.feed_rejected);
        }
    }

    fn gauge(cell: &std::cell::Cell<Option<Option<u32>>>, name: &str, tag: &str) -> Option<u32> {
        if let Some(id) = cell.get() {
            return id;
        }
        let id = define(MetricType::Gauge, &format!("{name}.vm.{tag}"));
        cell.set(Some(id));
        id
    }

    /// `index_blocks`: (block, replica) entries of the serving index; `index_bytes`: its tables.
    pub fn feed_state(&self, connected: bool, index_blocks: u64, index_bytes: u64) {
        if self.enabled {
            Self::record(Self::gauge(&self.feed_connected, "llmgw_feed_connected", &self.vm_tag), u64::from(connected));
            Self::record(Self::gauge(&self.index_blocks, "llmgw_index_blocks", &self.vm_tag), index_blocks);
            Self::record(Self::gauge(&self.index_bytes, "llmgw_index_bytes", &self.vm_tag), index_bytes);
        }
    }
}
