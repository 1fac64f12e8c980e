//! A request's decision for Envoy's access log: outcome, chosen replica, matched blocks, the
//! predicted time to first token, the tokenizer's round trip and the fallback's reason, as one
//! line of `name=value` pairs written to filter state `wasm.llmgw_decision` (printed by
//! `%FILTER_STATE(wasm.llmgw_decision:PLAIN)%`).
//!
//! Filter state, not dynamic metadata: Envoy's proxy-wasm host writes `set_property` into the
//! stream's filter state (under the `wasm.` prefix) and has no call that writes dynamic
//! metadata. The explain header says much the same to the client and stays off by default; this
//! line stays on the operator's side.

use llmgw_core::flow::{Rejected, Report, Routed};
use std::fmt::Write;

/// The filter-state name the decision is written under (Envoy prefixes `wasm.`).
pub const PROPERTY: &str = "llmgw_decision";

/// The line of a routed request. `tokenizer_us`: the tokenizer calls' round trip, when one was
/// made.
pub fn routed(r: &Routed, tokenizer_us: Option<u64>) -> String {
    let d = &r.decision;
    let mut out = String::with_capacity(160);
    let _ = write!(out, "outcome={} replica={}", d.outcome.as_str(), r.address);
    if let Some(rank) = r.dp_rank {
        let _ = write!(out, " dp_rank={rank}");
    }
    let _ = write!(out, " matched={}/{}", d.matched, d.total);
    if r.speculative_blocks > 0 {
        let _ = write!(out, " speculative={}", r.speculative_blocks);
    }
    if let Some(us) = d.predicted_us {
        let _ = write!(out, " predicted_us={us} prefill_tokens={}", r.prefill_tokens);
        let (w, r) = d.capacity_wait_us;
        if w > 0 || r > 0 {
            let _ = write!(out, " capacity_wait_us={w}/{r}");
        }
    }
    tail(&mut out, &r.report, tokenizer_us);
    out
}

/// The line of a request the filter answered itself (no healthy replica serves its model).
pub fn rejected(r: &Rejected, tokenizer_us: Option<u64>) -> String {
    let mut out = String::with_capacity(64);
    let outcome = r.report.outcome.map_or("no_replica", |o| o.as_str());
    let _ = write!(out, "outcome={outcome}");
    tail(&mut out, &r.report, tokenizer_us);
    out
}

fn tail(out: &mut String, report: &Report, tokenizer_us: Option<u64>) {
    if let Some(us) = tokenizer_us {
        let _ = write!(out, " tokenizer_us={us}");
    }
    if let Some(f) = report.tokenizer_failure {
        let _ = write!(out, " tokenizer_failure={}", f.as_str());
    }
    if let Some(f) = report.fallback {
        let _ = write!(out, " fallback={}", f.as_str());
    }
}
