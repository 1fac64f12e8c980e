//! Where a request's time goes, by the host clock: the moments the filter sees (request headers
//! in, body complete, tokenizer call sent and answered, decision, the replica's first response
//! byte and first body chunk), kept as a handful of integers per request, turned into the
//! `llmgw_phase_*_us` histograms (`crate::metrics`) and into one line for Envoy's access log
//! (filter state `wasm.llmgw_phases`, printed by `%FILTER_STATE(wasm.llmgw_phases:PLAIN)%`).
//!
//! The upstream request is sent by Envoy's router as soon as the filter resumes it, so the
//! decision's moment stands for "upstream request sent"; Envoy's own
//! `%COMMON_DURATION(...)%` points give the exact upstream times beside it.

/// The filter-state name the breakdown is written under (Envoy prefixes `wasm.`).
pub const PROPERTY: &str = "llmgw_phases";

/// A request's moments, nanoseconds since the epoch (0: not reached, or the host has no clock).
#[derive(Debug, Default, Clone, Copy)]
pub struct Phases {
    headers_ns: u64,
    body_ns: u64,
    /// Tokenizer round trips (call sent to answer), summed; `None` when no call was made.
    tokenizer_ns: Option<u64>,
    /// The filter's own time (parse, hash, score), without the tokenizer round trip.
    decision_ns: u64,
    decided_ns: u64,
    first_byte_ns: u64,
    first_chunk_ns: u64,
    /// Whether the breakdown went to the access log's filter state already.
    pub logged: bool,
}

/// Microseconds between two moments; `None` when either was not reached.
fn between(from: u64, to: u64) -> Option<u64> {
    (from != 0 && to != 0).then(|| to.saturating_sub(from) / 1_000)
}

/// A request's breakdown in microseconds (`None`: that phase did not happen).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Breakdown {
    /// Request headers in to body complete (the client's upload and Envoy's buffering).
    pub body_us: Option<u64>,
    /// The tokenizer call's round trip.
    pub tokenizer_us: Option<u64>,
    /// The filter's own work (parse, hash, score).
    pub decision_us: Option<u64>,
    /// Request headers in to the decision: everything the gateway adds before the upstream
    /// request is sent.
    pub gateway_us: Option<u64>,
    /// Decision to the replica's response headers (its first byte reaching Envoy).
    pub upstream_first_byte_us: Option<u64>,
    /// Decision to the replica's first body chunk (a stream's first token).
    pub upstream_first_chunk_us: Option<u64>,
}

impl Breakdown {
    /// The access-log line: `name=µs` pairs of the phases that happened, in order.
    pub fn line(&self) -> String {
        use std::fmt::Write;
        let mut out = String::with_capacity(128);
        for (name, v) in [
            ("body_us", self.body_us),
            ("tokenizer_us", self.tokenizer_us),
            ("decision_us", self.decision_us),
            ("gateway_us", self.gateway_us),
            ("upstream_first_byte_us", self.upstream_first_byte_us),
            ("upstream_first_chunk_us", self.upstream_first_chunk_us),
        ] {
            if let Some(v) = v {
                let sep = if out.is_empty() { "" } else { " " };
                let _ = write!(out, "{sep}{name}={v}");
            }
        }
        out
    }
}

impl Phases {
    pub fn headers(&mut self, now: u64) {
        self.headers_ns = now;
    }

    pub fn body(&mut self, now: u64) {
        if self.body_ns == 0 {
            self.body_ns = now;
        }
    }

    /// A tokenizer call sent at `sent` was answered (or failed) at `now`.
    pub fn tokenizer(&mut self, sent: u64, now: u64) {
        let d = now.saturating_sub(sent);
        self.tokenizer_ns = Some(self.tokenizer_ns.unwrap_or(0).saturating_add(d));
    }

    /// The filter worked from `since` to `now`.
    pub fn busy(&mut self, since: u64, now: u64) {
        self.decision_ns = self.decision_ns.saturating_add(now.saturating_sub(since));
    }

    pub fn decided(&mut self, now: u64) {
        self.decided_ns = now;
    }

    /// The response headers; false when they came before (a second call changes nothing).
    pub fn first_byte(&mut self, now: u64) -> bool {
        let first = self.first_byte_ns == 0;
        if first {
            self.first_byte_ns = now;
        }
        first
    }

    /// The first response body chunk; false when it came before.
    pub fn first_chunk(&mut self, now: u64) -> bool {
        let first = self.first_chunk_ns == 0;
        if first {
            self.first_chunk_ns = now;
        }
        first
    }

    pub fn breakdown(&self) -> Breakdown {
        let decided = self.decided_ns != 0;
        Breakdown {
            body_us: between(self.headers_ns, self.body_ns),
            tokenizer_us: self.tokenizer_ns.map(|ns| ns / 1_000),
            decision_us: decided.then_some(self.decision_ns / 1_000),
            gateway_us: between(self.headers_ns, self.decided_ns),
            upstream_first_byte_us: between(self.decided_ns, self.first_byte_ns),
            upstream_first_chunk_us: between(self.decided_ns, self.first_chunk_ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breakdown_names_only_the_phases_that_happened() {
        let mut p = Phases::default();
        p.headers(1_000_000);
        p.body(1_200_000);
        p.busy(1_200_000, 1_250_000);
        p.decided(1_260_000);
        assert_eq!(p.breakdown().line(), "body_us=200 decision_us=50 gateway_us=260");
        assert!(p.first_byte(2_260_000));
        assert!(!p.first_byte(9_000_000));
        assert!(p.first_chunk(3_260_000));
        assert_eq!(
            p.breakdown().line(),
            "body_us=200 decision_us=50 gateway_us=260 upstream_first_byte_us=1000 upstream_first_chunk_us=2000"
        );
        p.tokenizer(1_300_000, 1_700_000);
        assert_eq!(p.breakdown().tokenizer_us, Some(400));
        assert_eq!(Phases::default().breakdown(), Breakdown::default());
        assert_eq!(Breakdown::default().line(), "");
    }
}
