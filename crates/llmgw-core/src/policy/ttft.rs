//! The `ttft` policy (the default): the lowest predicted time to first token.
//!
//! Each replica in contest is predicted
//! `prefill_us_per_token × (uncached + queued_prefill × queued) + request_us × requests`, where
//! `uncached` is the request's prompt tokens past the leading blocks that replica holds,
//! `queued` the prefill tokens of requests this Envoy sent there that have not produced a first
//! token yet, and `requests = max(in-flight, running + waiting) + waiting` (engine-reported, so
//! other gateways' requests count too), with the rates learned for that replica
//! ([`super::rates`]) or the profile's; the lowest wins, predictions within the tie margin
//! (`tie_requests` requests' worth) being equal. Where the prompt's blocks do not fit in the room
//! left in a replica's KV cache, the wait for room is added ([`super::capacity`]).

use super::candidate::Candidate;
use super::capacity;
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
            quiet_ns: 0,
        }
    }

    /// The rates predicting for `c`: learned for it, or the profile's.
    pub fn rates(&self, c: &Candidate<'_>) -> Rates {
        self.rates_from(c.rates)
    }

    /// The rates predicting for a replica with these `learned` rates, if any (forgotten once
    /// quiet for [`Learning::forget_ns`]).
    pub fn rates_from(&self, learned: Option<Rates>) -> Rates {
        match learned {
            Some(r) if self.learning.enabled && !self.learning.forgets(r.quiet_ns) => r,
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
        self.returning_cost_at(c, uncached, self.rates(c).prefill_us_per_token)
    }

    /// As [`TtftWeights::returning_cost_us`], at the prefill rate `prefill_us_per_token`.
    fn returning_cost_at(&self, c: &Candidate<'_>, uncached: u64, prefill_us_per_token: f64) -> f64 {
        let prefill_us = prefill_us_per_token * uncached as f64;
        if prefill_us.is_nan() || prefill_us <= 0.0 || self.returning <= 0.0 {
            return 0.0;
        }
        self.returning * c.returning.expected_within(prefill_us) * prefill_us
    }
}

/// One contest's costs under the `ttft` policy: what each member would compute and what it is
/// predicted to take.
pub(super) struct Costs<'w, 'c, 'x> {
    w: &'w TtftWeights,
    contest: &'x Contest<'c, 'x>,
    work: Work,
}

impl Costs<'_, '_, '_> {
    /// The prompt tokens member `i` would compute (past the leading blocks it holds).
    fn uncached(&self, i: usize) -> u64 {
        let cached = u64::from(self.contest.leading(i)).saturating_mul(self.work.block_size);
        self.work.tokens.saturating_sub(cached)
    }

    /// Member `i`'s predicted time to first token with its own rates (µs), the wait for room in
    /// its KV cache included.
    fn predicted(&self, i: usize) -> f64 {
        let Some(c) = self.contest.cands.get(i) else { return f64::INFINITY };
        self.w.predicted_us(c, self.uncached(i)) + self.capacity_wait(i)
    }

    /// The wait for room in member `i`'s KV cache before its engine starts the request (µs).
    fn capacity_wait(&self, i: usize) -> f64 {
        let need = capacity::blocks_of(self.work.tokens, self.work.block_size);
        self.contest.cands.get(i).map_or(0.0, |c| capacity::wait_us(c, need))
    }

    /// What member `i`'s prefill would cost the requests expected back there (µs), where the
    /// contest counts it.
    fn returning(&self, i: usize) -> f64 {
        let c = self.contest.cands.get(i).filter(|_| self.contest.counts_returns);
        c.map_or(0.0, |c| self.w.returning_cost_us(c, self.uncached(i)))
    }

    /// Member `i`'s cost with its own rates: its prediction and what it costs the returns.
    pub(super) fn cost(&self, i: usize) -> f64 {
        self.predicted(i) + self.returning(i)
    }

    /// Member `i`'s cost were its rates `r`: what its load alone makes of the same prompt.
    pub(super) fn cost_at(&self, i: usize, r: &Rates) -> f64 {
        let Some(c) = self.contest.cands.get(i) else { return f64::INFINITY };
        let uncached = self.uncached(i);
        let returning = if self.contest.counts_returns {
            self.w.returning_cost_at(c, uncached, r.prefill_us_per_token)
        } else {
            0.0
        };
        r.predict(&TtftWeights::features(c, uncached)) + returning + self.capacity_wait(i)
    }

    /// The margin within which two costs from rates with these per-request rates are equal.
    pub(super) fn tie_margin(&self, request_a: f64, request_b: f64) -> f64 {
        self.w.tie_us.max(self.w.tie_requests * request_a.max(request_b))
    }

    /// Member `i`'s per-request rate.
    pub(super) fn request_us(&self, i: usize) -> f64 {
        self.contest.cands.get(i).map_or(0.0, |c| self.w.rates(c).request_us)
    }
}

impl TtftWeights {
    /// The winner of `contest` under `compare` (`Greater`: the first member is better), which
    /// reads the members' [`Costs`].
    pub(super) fn pick_by(
        &self,
        contest: &Contest<'_, '_>,
        compare: &dyn Fn(&Costs<'_, '_, '_>, usize, usize) -> std::cmp::Ordering,
    ) -> Option<Pick> {
        let s = contest.scores;
        let work = contest.work.unwrap_or(Work {
            tokens: u64::from(s.total).saturating_mul(16),
            block_size: 16,
            prompt_key: 0,
        });
        let costs = Costs { w: self, contest, work };
        let (best, second) = contest.best_two(|a, b| compare(&costs, a, b));
        best.map(|b| Pick {
            winner: b,
            predicted_us: Some(costs.predicted(b) as u64),
            runner_up: second.map(|r| (r, costs.predicted(r) as u64)),
            basis: contest.cands.get(b).map(|c| {
                Box::new(Basis {
                    features: Self::features(c, costs.uncached(b)),
                    rates: self.rates(c),
                    prior: self.prior(),
                    learning: self.learning,
                })
            }),
            returning_us: (costs.returning(b) as u64, second.map_or(0, |r| costs.returning(r) as u64)),
            capacity_wait_us: (costs.capacity_wait(b) as u64, second.map_or(0, |r| costs.capacity_wait(r) as u64)),
        })
    }
}

/// Lower cost is better; costs within `margin` of each other are equal.
pub(super) fn by_cost(a: f64, b: f64, margin: f64) -> std::cmp::Ordering {
    if (a - b).abs() <= margin {
        std::cmp::Ordering::Equal
    } else {
        b.total_cmp(&a)
    }
}

impl HolderPolicy for TtftWeights {
    fn name(&self) -> &'static str {
        "ttft"
    }

    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick> {
        self.pick_by(contest, &|costs, a, b| {
            by_cost(costs.cost(a), costs.cost(b), costs.tie_margin(costs.request_us(a), costs.request_us(b)))
        })
    }
}
