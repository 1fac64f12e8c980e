//! The `ttft` policy (the default): the lowest predicted time to first token.
//!
//! Each replica in contest is predicted
//! `prefill_us_per_token × (uncached + queued_prefill × queued) + request_us × requests`, where
//! `uncached` is the request's prompt tokens past the leading blocks that replica holds,
//! `queued` the prefill tokens of requests this Envoy sent there that have not produced a first
//! token yet, and `requests = max(in-flight, running + waiting) + waiting` (engine-reported, so
//! other gateways' requests count too); the lowest wins, predictions within `tie_us` being
//! equal.

use super::candidate::Candidate;
use super::contest::{Contest, HolderPolicy, Pick, Work};
use super::validation::{non_negative, InvalidWeight};

/// The `ttft` policy's rates.
#[derive(Debug, Clone, PartialEq)]
pub struct TtftWeights {
    /// Prefill cost of one prompt token (µs).
    pub prefill_us_per_token: f64,
    /// What each request already on a replica adds to a new request's time to first token
    /// (µs): the engine steps it takes and the batch slot it holds.
    pub request_us: f64,
    /// The share of the prefill queued on a replica (its requests without a first token yet) a
    /// new request waits for: 1 when every queued token delays it (vLLM computes a step's
    /// tokens together, the step lasting longer for each), 0 when the engine computes prefills
    /// side by side (the simulator).
    pub queued_prefill: f64,
    /// Predictions within this many µs are equal: the prompt's rendezvous order picks.
    pub tie_us: f64,
}

impl Default for TtftWeights {
    fn default() -> Self {
        TtftWeights { prefill_us_per_token: 200.0, request_us: 40_000.0, queued_prefill: 1.0, tie_us: 45_000.0 }
    }
}

impl TtftWeights {
    pub fn validate(&self) -> Result<(), InvalidWeight> {
        non_negative(&[
            ("prefill_us_per_token", self.prefill_us_per_token),
            ("request_us", self.request_us),
            ("queued_prefill", self.queued_prefill),
            ("tie_us", self.tie_us),
        ])
    }

    /// Predicted time to first token on `c` (µs) of a request computing `uncached` prompt
    /// tokens.
    pub fn predicted_us(&self, c: &Candidate<'_>, uncached: u64) -> f64 {
        let tokens = uncached as f64 + self.queued_prefill * c.pending_tokens as f64;
        self.prefill_us_per_token * tokens + self.request_us * c.queued_requests() as f64
    }
}

impl HolderPolicy for TtftWeights {
    fn name(&self) -> &'static str {
        "ttft"
    }

    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick> {
        let s = contest.scores;
        let work = contest.work.unwrap_or(Work { tokens: u64::from(s.total).saturating_mul(16), block_size: 16 });
        let predicted = |i: usize| -> f64 {
            let Some(c) = contest.cands.get(i) else { return f64::INFINITY };
            let cached = u64::from(contest.leading(i)).saturating_mul(work.block_size);
            self.predicted_us(c, work.tokens.saturating_sub(cached))
        };
        // Lower is better; predictions within `tie_us` are equal.
        let (best, second) = contest.best_two(|a, b| {
            let (pa, pb) = (predicted(a), predicted(b));
            if (pa - pb).abs() <= self.tie_us {
                std::cmp::Ordering::Equal
            } else {
                pb.total_cmp(&pa)
            }
        });
        best.map(|b| Pick {
            winner: b,
            predicted_us: Some(predicted(b) as u64),
            runner_up: second.map(|r| (r, predicted(r) as u64)),
        })
    }
}
