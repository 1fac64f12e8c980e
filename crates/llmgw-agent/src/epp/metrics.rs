//! The endpoint picker's counters, appended to the agent's `/metrics` as `llmgw_epp_*`.

use llmgw_core::flow::{CacheLookup, Fallback, Report};
use llmgw_core::policy::Outcome;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Decision times are summed in microseconds; this many buckets (upper bounds, µs).
const BUCKETS_US: [u64; 8] = [100, 250, 500, 1_000, 2_500, 10_000, 50_000, 250_000];

#[derive(Debug, Default)]
pub struct EppMetrics {
    pub streams: AtomicU64,
    /// Streams refused: `epp.max_streams` were being served.
    pub streams_refused: AtomicU64,
    /// Requests answered 503 (no eligible endpoint), 429 is not produced yet.
    pub rejected: AtomicU64,
    /// Requests answered 503 because no endpoint of the subset hint was eligible.
    pub subset_unavailable: AtomicU64,
    /// Subset-hint entries ignored (past the limit, or not strings).
    pub subset_dropped: AtomicU64,
    /// Bodies past `max_body_bytes`: decided on their head.
    pub body_too_large: AtomicU64,
    /// Responses served by an endpoint other than the primary (it was then avoided).
    pub served_by_fallback: AtomicU64,
    /// Responses whose served endpoint the data plane did not report.
    pub served_unreported: AtomicU64,
    /// Tokenizer calls made, and failed.
    pub tokenizer_calls: AtomicU64,
    /// Unexpired speculative entries the bound dropped.
    pub speculative_dropped: AtomicU64,
    pub tokenizer_failures: AtomicU64,
    /// Requests routed before their tokens came whose answers were asked for the prompt's ids:
    /// read from the answer, or missing (the call then made), and answers whose first event
    /// passed the bound held (handed on as they came).
    pub answer_ids_read: AtomicU64,
    pub answer_ids_missing: AtomicU64,
    pub answer_event_too_large: AtomicU64,
    /// How requests got their tokens: from the tokenization cache, routed on their
    /// conversation's turn before or on what their siblings share (their call made after
    /// routing), or by a call before routing.
    tokenizer_cache: [AtomicU64; 4],
    outcomes: [AtomicU64; Outcome::ALL.len()],
    fallbacks: [AtomicU64; Fallback::ALL.len()],
    decision_us_sum: AtomicU64,
    decision_buckets: [AtomicU64; BUCKETS_US.len()],
    decision_count: AtomicU64,
}

/// The `result` label of each slot of the tokenizer-cache counters (the filter's values).
const CACHE_RESULTS: [&str; 4] = ["hit", "earlier_turn", "shared_prefix", "miss"];

fn cache_index(c: CacheLookup) -> usize {
    match c {
        CacheLookup::RawBodyHit | CacheLookup::Hit => 0,
        CacheLookup::EarlierTurn => 1,
        CacheLookup::SharedPrefix => 2,
        CacheLookup::Miss => 3,
    }
}

pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl EppMetrics {
    /// Counts what a routing step reports (its outcome, its fallback reason).
    pub fn report(&self, r: &Report) {
        if let Some(c) = r.tokenizer_cache.and_then(|c| self.tokenizer_cache.get(cache_index(c))) {
            inc(c);
        }
        if let Some(o) = r.outcome {
            if let Some(c) = Outcome::ALL.iter().position(|x| *x == o).and_then(|i| self.outcomes.get(i)) {
                inc(c);
            }
        }
        if let Some(f) = r.fallback {
            if let Some(c) = Fallback::ALL.iter().position(|x| *x == f).and_then(|i| self.fallbacks.get(i)) {
                inc(c);
            }
        }
    }

    /// A decision took `us` microseconds (tokenizer calls included).
    pub fn decided(&self, us: u64) {
        add(&self.decision_us_sum, us);
        inc(&self.decision_count);
        for (b, c) in BUCKETS_US.iter().zip(&self.decision_buckets) {
            if us <= *b {
                inc(c);
            }
        }
    }

    /// The requests whose tokens came as `c` says.
    pub fn tokenizer_cache(&self, c: CacheLookup) -> u64 {
        self.tokenizer_cache.get(cache_index(c)).map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// The Prometheus text of every counter.
    pub fn text(&self) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::with_capacity(2048);
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        counter("llmgw_epp_streams_total", "ext_proc streams accepted.", get(&self.streams));
        counter(
            "llmgw_epp_streams_refused_total",
            "ext_proc streams refused: epp.max_streams were being served.",
            get(&self.streams_refused),
        );
        counter("llmgw_epp_rejected_total", "Requests answered 503: no eligible endpoint.", get(&self.rejected));
        counter(
            "llmgw_epp_subset_unavailable_total",
            "Requests answered 503: no endpoint of the subset hint was eligible.",
            get(&self.subset_unavailable),
        );
        counter(
            "llmgw_epp_subset_entries_dropped_total",
            "Subset-hint entries ignored (past the limit, or not strings).",
            get(&self.subset_dropped),
        );
        counter(
            "llmgw_epp_body_too_large_total",
            "Request bodies past max_body_bytes, decided on their head.",
            get(&self.body_too_large),
        );
        counter(
            "llmgw_epp_served_by_fallback_total",
            "Responses served by an endpoint other than the primary (the primary is then avoided).",
            get(&self.served_by_fallback),
        );
        counter(
            "llmgw_epp_served_unreported_total",
            "Responses whose serving endpoint the data plane did not report.",
            get(&self.served_unreported),
        );
        counter("llmgw_epp_tokenizer_calls_total", "Tokenizer calls made.", get(&self.tokenizer_calls));
        counter(
            "llmgw_epp_speculative_dropped_total",
            "Unexpired speculative entries dropped at the bound (2,048).",
            get(&self.speculative_dropped),
        );
        counter("llmgw_epp_tokenizer_failures_total", "Tokenizer calls that failed.", get(&self.tokenizer_failures));
        let _ = writeln!(
            out,
            "# HELP llmgw_epp_answer_tokens_total Answers asked for the prompt's ids: read, missing (a call made instead), or an event past the bound held.\n# TYPE llmgw_epp_answer_tokens_total counter"
        );
        for (result, c) in [
            ("read", &self.answer_ids_read),
            ("missing", &self.answer_ids_missing),
            ("too_large", &self.answer_event_too_large),
        ] {
            let _ = writeln!(out, "llmgw_epp_answer_tokens_total{{result=\"{result}\"}} {}", get(c));
        }
        let _ = writeln!(
            out,
            "# HELP llmgw_epp_tokenizer_cache_total How requests got their tokens.\n# TYPE llmgw_epp_tokenizer_cache_total counter"
        );
        for (result, c) in CACHE_RESULTS.iter().zip(&self.tokenizer_cache) {
            let _ = writeln!(out, "llmgw_epp_tokenizer_cache_total{{result=\"{result}\"}} {}", get(c));
        }
        let _ = writeln!(
            out,
            "# HELP llmgw_epp_decisions_total Routing decisions, by outcome.\n# TYPE llmgw_epp_decisions_total counter"
        );
        for (o, c) in Outcome::ALL.iter().zip(&self.outcomes) {
            let _ = writeln!(out, "llmgw_epp_decisions_total{{outcome=\"{}\"}} {}", o.as_str(), get(c));
        }
        let _ = writeln!(
            out,
            "# HELP llmgw_epp_fallbacks_total Decisions made without exact data, by reason.\n# TYPE llmgw_epp_fallbacks_total counter"
        );
        for (f, c) in Fallback::ALL.iter().zip(&self.fallbacks) {
            let _ = writeln!(out, "llmgw_epp_fallbacks_total{{reason=\"{}\"}} {}", f.as_str(), get(c));
        }
        let _ = writeln!(
            out,
            "# HELP llmgw_epp_decision_us Time from a complete body to the answer, tokenizer calls included.\n# TYPE llmgw_epp_decision_us histogram"
        );
        for (b, c) in BUCKETS_US.iter().zip(&self.decision_buckets) {
            let _ = writeln!(out, "llmgw_epp_decision_us_bucket{{le=\"{b}\"}} {}", get(c));
        }
        let n = get(&self.decision_count);
        let _ = writeln!(out, "llmgw_epp_decision_us_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(out, "llmgw_epp_decision_us_sum {}", get(&self.decision_us_sum));
        let _ = writeln!(out, "llmgw_epp_decision_us_count {n}");
        out
    }
}
