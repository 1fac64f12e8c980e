//! How the `ttft` policy compares the places for a new prefix.
//!
//! Every place computes the whole prompt, so the predictions differ only by the replicas' rates
//! and their loads. Two kinds of difference, weighed apart:
//!
//! * **The rates.** Learned per replica, they scatter on alike replicas by about what a
//!   prediction from them typically misses (their mean absolute residual). A difference in
//!   predictions within that is no evidence that one replica is faster; letting it decide
//!   sends every new prefix to whichever replica's estimate is lowest. So predictions from the
//!   replicas' own rates decide only past the larger of the tie margin and that residual.
//!   While a member's rates rest on too few observations for their residual to say that
//!   ([`Rates::residual_known`]: the profile's, or fewer than clipping waits for), nobody knows
//!   how far off they are, and they do not decide at all. Two observations taken in a moment of
//!   slowness (two prefills at once on a fresh engine) can make a replica's rates several times
//!   its peers'; judged by them it would get no new prefix, and nothing would correct them.
//! * **The load.** Prefill tokens queued there, requests running and waiting: known work, not
//!   scatter. Early in a fleet's life, or after a change, the residual is hundreds of
//!   milliseconds, and within it three new prefixes sent a moment apart would go to one
//!   replica and prefill together. So where the own rates call it even, the members are
//!   predicted again with one set of rates (the members' mean), which only their loads can tell
//!   apart, with the ordinary tie margin.
//!
//! Equal on both counts, the contest's tie-break decides (fewer recent requests).

use super::candidate::Candidate;
use super::contest::{Contest, HolderPolicy, Pick};
use super::rates::Rates;
use super::ttft::{by_cost, TtftWeights};

/// The `ttft` policy for the places of a new prefix.
pub(super) struct NewPrefixTtft<'w> {
    ttft: &'w TtftWeights,
    /// The largest mean absolute residual of the members' rates (µs); infinite while one
    /// member's is not known.
    scatter_us: f64,
    /// The members' rates, averaged: what compares their loads alone.
    common: Rates,
}

impl<'w> NewPrefixTtft<'w> {
    /// The policy for a contest among `members` (indices into `cands`).
    pub(super) fn new(ttft: &'w TtftWeights, cands: &[Candidate<'_>], members: &[usize]) -> Self {
        // One pass: the largest residual, and the sums of the finite rates.
        let (mut scatter_us, mut sums, mut n) = (0.0_f64, [0.0_f64; 4], 0.0_f64);
        for r in members.iter().filter_map(|&i| cands.get(i)).map(|c| ttft.rates(c)) {
            if !r.residual_known() {
                scatter_us = f64::INFINITY;
            } else if r.residual_us.is_finite() {
                scatter_us = scatter_us.max(r.residual_us);
            }
            let rates = [r.base_us, r.prefill_us_per_token, r.queued_us_per_token, r.request_us];
            for (sum, v) in sums.iter_mut().zip(rates) {
                if v.is_finite() {
                    *sum += v;
                }
            }
            n += 1.0;
        }
        let [base_us, prefill_us_per_token, queued_us_per_token, request_us] =
            sums.map(|sum| if n > 0.0 && (sum / n).is_finite() { (sum / n).max(0.0) } else { 0.0 });
        let common = Rates {
            base_us,
            prefill_us_per_token,
            queued_us_per_token,
            request_us,
            observations: 0,
            residual_us: 0.0,
            quiet_ns: 0,
        };
        NewPrefixTtft { ttft, scatter_us, common }
    }
}

impl HolderPolicy for NewPrefixTtft<'_> {
    fn name(&self) -> &'static str {
        self.ttft.name()
    }

    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick> {
        let common = &self.common;
        self.ttft.pick_by(contest, &|costs, a, b| {
            let own_margin = costs.tie_margin(costs.request_us(a), costs.request_us(b)).max(self.scatter_us);
            by_cost(costs.cost(a), costs.cost(b), own_margin).then_with(|| {
                let margin = costs.tie_margin(common.request_us, common.request_us);
                by_cost(costs.cost_at(a, common), costs.cost_at(b, common), margin)
            })
        })
    }
}
