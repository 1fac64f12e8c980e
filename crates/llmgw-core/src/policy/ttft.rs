//! The `ttft` policy (the default): the lowest predicted time to first token.
//!
//! Each replica in contest is predicted
//! `prefill_us_per_token × (uncached + queued_prefill × queued) + request_us × requests`, where
//! `uncached` is the request's prompt tokens past the leading blocks that replica holds,
//! `queued` the prefill tokens of requests this Envoy sent there that have not produced a first
//! token yet, and `requests = max(in-flight, running + waiting) + waiting` (engine-reported, so
//! other gateways' requests count too), with the rates learned for that replica
//! ([`super::rates`]) or the profile's; the lowest wins, predictions within the tie margin
//! (`tie_requests` requests' worth) being equal.

use super::candidate::Candidate;
use super::contest::{Contest, HolderPolicy, Pick, Work};
use super::rates::{Basis, Features, Learning, Rates};
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
    /// Predictions within `tie_requests` × the per-request rate (the larger of the two
    /// replicas'), and at least `tie_us`, are equal: the replica holding more, then the one
    /// with fewer recent requests, then the prompt's rendezvous order picks. In requests, the margin keeps its meaning whatever the fleet's
    /// speed: gateways that see one request more or less on a replica still agree, and load
    /// beyond that is weighed by the time it costs.
    pub tie_requests: f64,
    pub tie_us: f64,
    /// The share of the delay a request's prefill would cause the requests expected back on a
    /// replica within it ([`super::returns`]) that counts against the replica: 1 counts it all,
    /// 0 ignores what is about to come back.
    pub returning: f64,
    /// Rates learned per replica from observed times to first token, with the rates above as
    /// their prior ([`super::rates`]).
    pub learning: Learning,
}

impl Default for TtftWeights {
    fn default() -> Self {
        TtftWeights {
            prefill_us_per_token: 100.0,
            request_us: 20_000.0,
            queued_prefill: 1.0,
            tie_requests: 1.1,
            tie_us: 0.0,
            returning: 1.0,
            learning: Learning::default(),
        }
    }
}

impl TtftWeights {
    pub fn validate(&self) -> Result<(), InvalidWeight> {
        non_negative(&[
            ("prefill_us_per_token", self.prefill_us_per_token),
            ("request_us", self.request_us),
            ("queued_prefill", self.queued_prefill),
            ("tie_us", self.tie_us),
            ("tie_requests", self.tie_requests),
            ("returning", self.returning),
            ("rates_prior_weight", self.learning.prior_weight),
        ])?;
        if self.learning.memory.is_finite() && self.learning.memory >= 1.0 {
            Ok(())
        } else {
            Err(InvalidWeight { field: "rates_memory", message: "must be a finite number ≥ 1" })
        }
    }

    /// The profile's rates: what learning starts from, and what predicts without it.
    pub fn prior(&self) -> Rates {
        Rates {
            base_us: 0.0,
            prefill_us_per_token: self.prefill_us_per_token,
            queued_us_per_token: self.queued_prefill * self.prefill_us_per_token,
            request_us: self.request_us,
            observations: 0,
            residual_us: 0.0,
        }
    }

    /// The rates predicting for `c`: learned for it, or the profile's.
    pub fn rates(&self, c: &Candidate<'_>) -> Rates {
        self.rates_from(c.rates)
    }

    /// The rates predicting for a replica with these `learned` rates, if any.
    pub fn rates_from(&self, learned: Option<Rates>) -> Rates {
        match learned {
            Some(r) if self.learning.enabled => r,
            _ => self.prior(),
        }
    }

    /// What the prediction on `c` of a request computing `uncached` prompt tokens is made of.
    pub fn features(c: &Candidate<'_>, uncached: u64) -> Features {
        Features { uncached, queued_tokens: c.pending_tokens, requests: c.queued_requests() }
    }

    /// Predicted time to first token on `c` (µs) of a request computing `uncached` prompt
    /// tokens.
    pub fn predicted_us(&self, c: &Candidate<'_>, uncached: u64) -> f64 {
        self.rates(c).predict(&Self::features(c, uncached))
    }

    /// What computing `uncached` prompt tokens on `c` costs the requests expected back there
    /// meanwhile (µs): each waits about the prefill's time.
    pub fn returning_cost_us(&self, c: &Candidate<'_>, uncached: u64) -> f64 {
        let prefill_us = self.rates(c).prefill_us_per_token * uncached as f64;
        if prefill_us.is_nan() || prefill_us <= 0.0 || self.returning <= 0.0 {
            return 0.0;
        }
        self.returning * c.returning.expected_within(prefill_us) * prefill_us
    }
}

impl HolderPolicy for TtftWeights {
    fn name(&self) -> &'static str {
        "ttft"
    }

    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick> {
        let s = contest.scores;
        let work = contest.work.unwrap_or(Work {
            tokens: u64::from(s.total).saturating_mul(16),
            block_size: 16,
            prompt_key: 0,
        });
        let uncached = |i: usize| {
            let cached = u64::from(contest.leading(i)).saturating_mul(work.block_size);
            work.tokens.saturating_sub(cached)
        };
        let predicted = |i: usize| -> f64 {
            let Some(c) = contest.cands.get(i) else { return f64::INFINITY };
            self.predicted_us(c, uncached(i))
        };
        let returning = |i: usize| {
            let c = contest.cands.get(i).filter(|_| contest.counts_returns);
            c.map_or(0.0, |c| self.returning_cost_us(c, uncached(i)))
        };
        let cost = |i: usize| predicted(i) + returning(i);
        let request_us = |i: usize| contest.cands.get(i).map_or(0.0, |c| self.rates(c).request_us);
        // Lower is better; predictions within the tie margin are equal.
        let (best, second) = contest.best_two(|a, b| {
            let (pa, pb) = (cost(a), cost(b));
            let tie = self.tie_us.max(self.tie_requests * request_us(a).max(request_us(b)));
            if (pa - pb).abs() <= tie {
                std::cmp::Ordering::Equal
            } else {
                pb.total_cmp(&pa)
            }
        });
        best.map(|b| Pick {
            winner: b,
            predicted_us: Some(predicted(b) as u64),
            runner_up: second.map(|r| (r, predicted(r) as u64)),
            basis: contest.cands.get(b).map(|c| {
                Box::new(Basis {
                    features: Self::features(c, uncached(b)),
                    rates: self.rates(c),
                    prior: self.prior(),
                    learning: self.learning,
                })
            }),
            returning_us: (returning(b) as u64, second.map_or(0, |r| returning(r) as u64)),
        })
    }
}
