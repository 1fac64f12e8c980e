//! The fallbacks: where a request goes when the index does not decide.
//!
//! * **Approx**: rendezvous (highest random weight) hashing of a hash of the prompt's leading
//!   text over the replicas' addresses gives every worker and every gateway the same order for
//!   the same prefix, with no coordination; the first replica in that order whose pressure is
//!   within the bounded-load capacity wins, so a burst sharing a new prefix lands together
//!   until load says otherwise.
//! * **Load**: nothing to hash: the least-pressured replica.
//! * **Spill**: every replica holding the request's blocks is past the holders' load bound:
//!   the least loaded replica within the bound, so a hot prefix is replicated.

use super::candidate::Candidate;
use super::decision::Outcome;
use super::limits::Limits;
use super::validation::InvalidWeight;

/// The fallbacks' weights and the holders' load bound.
#[derive(Debug, Clone, PartialEq)]
pub struct FallbackWeights {
    /// A replica takes a prefix's request while its pressure stays within `spill_factor` × the
    /// mean pressure (+ `spill_slack`); past it the request spills to the next replica in the
    /// prefix's rendezvous order.
    pub spill_factor: f64,
    pub spill_slack: u32,
    /// A prefix the index shows no replica holds goes to one of its first `approx_choices`
    /// replicas in rendezvous order (every gateway computes the same order), 0 (the default)
    /// meaning every replica within the load bound: the one the holder policy predicts fastest,
    /// equally fast ones by fewer recent requests ([`super::Candidate::recent`]), then by that
    /// order ([`FallbackWeights::new_prefix_choices`]). Every replica, because what tells them
    /// apart is their own state (predicted time, the requests expected back there,
    /// [`super::returns`]), known for each: limiting the choice to a prompt's first few leaves
    /// out the one replica where nothing is about to come back. Fallbacks without exact data
    /// always take the first.
    pub approx_choices: u32,
    /// Replicas holding a request's blocks keep it while their pressure stays within
    /// `holder_spill_factor` × the mean pressure (+ 2 × `spill_slack`); when every holder is past
    /// that, the request goes where a new prefix would (outcome `spill`). 0 turns the bound off.
    pub holder_spill_factor: f64,
}

impl Default for FallbackWeights {
    fn default() -> Self {
        FallbackWeights { spill_factor: 1.25, spill_slack: 2, approx_choices: 0, holder_spill_factor: 1.5 }
    }
}

impl FallbackWeights {
    pub fn validate(&self) -> Result<(), InvalidWeight> {
        if !self.spill_factor.is_finite() || self.spill_factor < 1.0 {
            return Err(InvalidWeight { field: "spill_factor", message: "must be a finite number of at least 1" });
        }
        let h = self.holder_spill_factor;
        if !h.is_finite() || (h != 0.0 && h < 1.0) {
            return Err(InvalidWeight {
                field: "holder_spill_factor",
                message: "must be 0 (no bound) or a finite number of at least 1",
            });
        }
        Ok(())
    }

    /// Whether a candidate among `idx` is within the holders' load bound (always, when the
    /// bound is off).
    pub fn holders_within<'c>(&self, cands: &'c [Candidate<'_>], idx: &[usize]) -> impl Fn(usize) -> bool + 'c {
        let bounded = self.holder_spill_factor > 0.0;
        let cap = load_cap(cands, idx, self.holder_spill_factor, self.spill_slack.saturating_mul(2));
        move |i| !bounded || cands.get(i).is_some_and(|c| c.pressure().saturating_add(1) <= cap)
    }

    /// The fallback's choice among `idx`: by the prompt's rendezvous order when there is a
    /// `key`, else by load. When the prefix is known to be new (`known_new`: exact data, from
    /// complete mirrors, shows nobody holding it) it may go to the less loaded of its first
    /// rendezvous choices; otherwise (a fallback, or an incomplete mirror) its first choice is
    /// the best guess of where earlier requests sharing it went, so only the load bound moves
    /// it. A spilled hot prefix goes to the least loaded replica within the bound.
    pub fn pick(
        &self,
        cands: &[Candidate<'_>],
        idx: &[usize],
        key: Option<u64>,
        known_new: bool,
        spilled: bool,
    ) -> (Option<usize>, Outcome) {
        let choices = if spilled {
            u32::try_from(idx.len()).unwrap_or(u32::MAX)
        } else if known_new {
            self.approx_choices
        } else {
            1
        };
        let (approx, load) = if spilled { (Outcome::Spill, Outcome::Spill) } else { (Outcome::Approx, Outcome::Load) };
        match key {
            Some(k) => (self.approx_pick(cands, idx, k, choices), approx),
            None => (least_of(cands, idx), load),
        }
    }

    /// Where a prefix known to be new may go: its first `approx_choices` replicas in the key's
    /// rendezvous order among those within the load bound (empty when none is).
    pub fn new_prefix_choices(&self, cands: &[Candidate<'_>], idx: &[usize], key: u64) -> Vec<usize> {
        let cap = load_cap(cands, idx, self.spill_factor, self.spill_slack);
        let mut order: Vec<(u64, usize)> = idx
            .iter()
            .filter_map(|&i| cands.get(i).map(|c| (c, i)))
            .filter(|(c, _)| c.pressure().saturating_add(1) <= cap)
            .map(|(c, i)| (c.rendezvous_weight(key), i))
            .collect();
        order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        order.into_iter().take(choice_count(self.approx_choices)).map(|(_, i)| i).collect()
    }

    /// Rendezvous order with bounded-load spillover: among the replicas within the load bound,
    /// the least pressured of the first `choices` in the key's rendezvous order (ties: the
    /// earlier one), so equal loads keep a prefix on its first replica everywhere.
    fn approx_pick(&self, cands: &[Candidate<'_>], idx: &[usize], key: u64, choices: u32) -> Option<usize> {
        if idx.is_empty() {
            return None;
        }
        let cap = load_cap(cands, idx, self.spill_factor, self.spill_slack);
        let mut order: Vec<(u64, usize)> =
            idx.iter().filter_map(|&i| cands.get(i).map(|c| (c.rendezvous_weight(key), i))).collect();
        order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let choices = choice_count(choices);
        order
            .iter()
            .filter_map(|&(_, i)| cands.get(i).map(|c| (i, c)))
            .filter(|(_, c)| c.pressure().saturating_add(1) <= cap)
            .take(choices)
            // `min_by_key` keeps the first of equal minima: the earlier rendezvous choice.
            .min_by_key(|(_, c)| c.pressure())
            .map(|(i, _)| i)
            .or_else(|| least_of(cands, idx))
    }
}

/// The least-pressured replica among `idx` (ties: lower KV usage, then address order).
fn least_of(cands: &[Candidate<'_>], idx: &[usize]) -> Option<usize> {
    least_by(cands, idx, None)
}

/// The least pressure among `idx`; ties by `key`'s rendezvous order where given (spreading
/// requests of different keys), else by KV-cache use; then by address.
fn least_by(cands: &[Candidate<'_>], idx: &[usize], key: Option<u64>) -> Option<usize> {
    idx.iter()
        .copied()
        .filter_map(|i| cands.get(i).map(|c| (i, c)))
        .min_by(|(_, a), (_, b)| {
            let tie = match key {
                Some(k) => b.rendezvous_weight(k).cmp(&a.rendezvous_weight(k)),
                None => a.kv_usage.total_cmp(&b.kv_usage),
            };
            a.pressure().cmp(&b.pressure()).then(tie).then(a.address.cmp(b.address))
        })
        .map(|(i, _)| i)
}

/// The least-loaded healthy replica for a tokenizer call, ties broken by `key`'s rendezvous
/// order (a key of the call's prompt): calls made at once for different prompts spread over
/// equally loaded replicas' API servers instead of queueing on one (the first of them by
/// KV-cache use, which says nothing of an API server's work, or by address).
pub fn least_loaded(cands: &[Candidate<'_>], limits: &Limits, key: u64) -> Option<usize> {
    least_by(cands, &limits.eligible(cands), Some(key))
}

/// The load bound: `ceil(factor × (total pressure + 1) / n) + slack`, the most pressure a
/// replica may have after taking the request.
fn load_cap(cands: &[Candidate<'_>], idx: &[usize], factor: f64, slack: u32) -> u64 {
    let n = idx.len().max(1);
    let total: u64 = idx.iter().filter_map(|&i| cands.get(i)).map(|c| c.pressure()).fold(0u64, u64::saturating_add);
    let mean = (total.saturating_add(1)) as f64 / n as f64;
    let cap = (factor * mean).ceil() as u64;
    cap.saturating_add(u64::from(slack))
}

/// How many of a prefix's rendezvous order may take it: `approx_choices`, 0 meaning all.
fn choice_count(approx_choices: u32) -> usize {
    match approx_choices {
        0 => usize::MAX,
        n => usize::try_from(n).unwrap_or(usize::MAX),
    }
}
