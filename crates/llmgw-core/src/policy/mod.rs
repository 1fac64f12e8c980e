//! Choosing a replica: the request's blocks held by replicas are compared by the profile's
//! policy, and the fallbacks take over where that says nothing.
//!
//! * **Exact**: the index knows the request's blocks. Replicas holding some of them within the
//!   holders' load bound, and the replicas holding nothing, are compared by a
//!   [`HolderPolicy`]: the lowest predicted time to first token ([`ttft`], the default) or a
//!   blended score ([`score`]).
//! * **Approx**, **Load**, **Spill**: no exact data, nobody holds block 0, or every holder is
//!   past the bound: rendezvous order bounded by load, or the least loaded ([`fallback`]).
//!
//! A replica that is down never wins; an overloaded one (past any of [`limits`]) wins only when
//! every replica is overloaded.
//!
//! Adding a policy: a file with its weights struct (its defaults, its validation, its
//! [`HolderPolicy`]), a [`PolicyMode`] variant and a [`Weights`] field.

mod candidate;
pub mod capacity;
mod contest;
mod decision;
pub mod fallback;
pub mod limits;
mod new_prefix;
pub mod rates;
pub mod return_ledger;
pub mod returns;
pub mod routed_lately;
pub mod score;
pub mod ttft;
mod validation;
mod weights;

pub use candidate::{rendezvous_weight, Candidate, Pool};
pub use contest::{Contest, HolderPolicy, Pick, Work};
pub use decision::{Decision, Outcome};
pub use fallback::{least_loaded, FallbackWeights};
pub use limits::Limits;
pub use score::ScoreWeights;
pub use ttft::TtftWeights;
pub use validation::InvalidWeight;
pub use weights::{PolicyMode, Weights};

use crate::index::Scores;
use contest::leading;
use new_prefix::NewPrefixTtft;

/// The stable hash routing keys are made with (the approximate fallback's prompt key).
pub use crate::stable_hash::stable_hash;

/// Decides where a request goes.
///
/// `exact`: the index's scores for the request's blocks (indexed by replica id), when the
/// tokens were hashed and the index is synced. `approx_key`: [`stable_hash`] of the prompt's
/// leading text, when there is any.
pub fn decide(cands: &[Candidate<'_>], exact: Option<&Scores>, approx_key: Option<u64>, w: &Weights) -> Decision {
    decide_lazy(cands, exact, None, || approx_key, w)
}

/// As [`decide`], with the approximate key computed only if the decision needs it (a tie
/// between equally good replicas, or no exact match): reading a long prompt's leading text is
/// skipped whenever the index alone decides. `work`: the prompt's size (without it, the
/// `ttft` policy counts the request's full blocks at 16 tokens).
///
/// Engines whose mirror is incomplete ([`Candidate::incomplete`]: the agent started after
/// they cached blocks it could not replay) hold at least what the index shows, perhaps more.
/// Their hits are credited as any engine's: a block the index shows is held. Their misses are
/// not taken as proof: when the index shows nobody holding the request's first block while an
/// eligible engine is incomplete, the prefix is not known to be new (it may sit, cached before
/// the agent started, on that engine), so it goes where a fallback without exact data sends
/// it: its first rendezvous choice, load bound permitting, which is where earlier requests
/// sharing it went; a prefix known to be new may take another of its first choices, by predicted
/// time and, among equally fast ones, by fewer recent requests (see `place_new`).
/// In the contest among holders an incomplete engine is weighed by what it is shown to hold
/// and no more: crediting blocks nobody saw would be confidence the other way, and since an
/// engine stays incomplete until its cache is cleared or it restarts, it would turn exact
/// routing into load balancing over every such engine for as long.
pub fn decide_lazy(
    cands: &[Candidate<'_>],
    exact: Option<&Scores>,
    work: Option<Work>,
    approx_key: impl Fn() -> Option<u64>,
    w: &Weights,
) -> Decision {
    let key_cell = std::cell::OnceCell::new();
    let approx_key = || *key_cell.get_or_init(&approx_key);
    let idx = w.limits.eligible(cands);
    if idx.is_empty() {
        return Decision::new(None, Outcome::NoReplica, 0, 0);
    }
    let known_new = exact.is_some() && !idx.iter().any(|&i| cands.get(i).is_some_and(|c| c.incomplete));
    // Holders past their load bound give up their claim to the prefix.
    let mut spilled = false;
    if let Some(s) = exact {
        let within = w.fallback.holders_within(cands, &idx);
        let any_match = idx.iter().any(|&i| leading(cands, s, i) > 0);
        let holders_within = idx.iter().any(|&i| leading(cands, s, i) > 0 && within(i));
        spilled = any_match && !holders_within;
        // Every eligible replica holds the same leading blocks (a system prompt the whole fleet
        // has cached): nobody has an advantage, and the rest of the prompt is new.
        let new_past_common = known_new && common_leading(cands, s, &idx).is_some() && approx_key().is_some();
        if holders_within && s.total > 0 && !new_past_common {
            // Holders past the bound are out of this contest; replicas holding nothing stay in.
            let members: Vec<usize> = idx.iter().copied().filter(|&i| within(i) || leading(cands, s, i) == 0).collect();
            // Equal holders with equal predictions: the prompt's own rendezvous order, so that
            // prompts sharing a prefix several replicas hold are spread over all of them, and
            // every gateway sends each prompt to the same one (recent counts are this Envoy's
            // own: once two gateways' counts part, they would split the gateways' choices).
            let own = work.map(|w| w.prompt_key).filter(|&k| k != 0);
            let tiebreak =
                |i: usize| own.or_else(approx_key).and_then(|k| cands.get(i).map(|c| c.rendezvous_weight(k)));
            let contest =
                Contest { cands, members: &members, scores: s, work, tiebreak: &tiebreak, counts_returns: false };
            if let Some(p) = w.holder_policy().pick(&contest) {
                let matched = leading(cands, s, p.winner);
                let outcome = if matched > 0 { Outcome::Exact } else { Outcome::Load };
                return Decision {
                    predicted_us: p.predicted_us,
                    runner_up: p.runner_up,
                    basis: p.basis,
                    returning_us: p.returning_us,
                    capacity_wait_us: p.capacity_wait_us,
                    ..Decision::new(Some(p.winner), outcome, matched, s.total)
                };
            }
        }
    }
    let total = exact.map_or(0, |s| s.total);
    if let (true, false, Some(s), Some(key)) = (known_new, spilled, exact.filter(|s| s.total > 0), approx_key()) {
        if let Some(d) = place_new(cands, &idx, s, work, key, w) {
            return d;
        }
    }
    let (winner, outcome) = w.fallback.pick(cands, &idx, approx_key(), known_new, spilled);
    Decision::new(winner, outcome, 0, total)
}

/// A prefix known to be new (complete mirrors show nobody holding its first block, or every
/// eligible replica holding the same leading blocks and nobody more): among its
/// first rendezvous choices within the load bound, the one the holder policy prefers (everyone
/// computes the whole prompt: the fastest predicted, by the rates past their scatter and by the
/// loads within it ([`new_prefix`]), or the least loaded), equally good ones by fewer recent
/// requests ([`tie_rank`]), then by the prompt's rendezvous order.
///
/// Under equal loads rendezvous order alone spreads prefixes as a hash does: 16 prefixes on 3
/// replicas land 8/5/3 as easily as 6/5/5, and since a holder keeps its prefix until load moves
/// it, the request shares stay as uneven for as long as the prefixes are used. The recent counts
/// send each new prefix where the least traffic went lately, so prefixes of equal popularity
/// spread evenly, and a replica already carrying a popular one gets fewer new ones.
fn place_new(
    cands: &[Candidate<'_>],
    idx: &[usize],
    s: &Scores,
    work: Option<Work>,
    key: u64,
    w: &Weights,
) -> Option<Decision> {
    let members = w.fallback.new_prefix_choices(cands, idx, key);
    let tiebreak = |i: usize| cands.get(i).map(|c| tie_rank(c, key));
    let contest = Contest { cands, members: &members, scores: s, work, tiebreak: &tiebreak, counts_returns: true };
    let new_prefix;
    let policy: &dyn HolderPolicy = match w.policy {
        PolicyMode::Ttft => {
            new_prefix = NewPrefixTtft::new(&w.ttft, cands, &members);
            &new_prefix
        }
        PolicyMode::Score => w.holder_policy(),
    };
    let p = policy.pick(&contest)?;
    // Past blocks the whole fleet holds, the hit is real: exact, with what the winner holds.
    let matched = leading(cands, s, p.winner);
    let outcome = if matched > 0 { Outcome::Exact } else { Outcome::Approx };
    Some(Decision {
        predicted_us: p.predicted_us,
        runner_up: p.runner_up,
        basis: p.basis,
        returning_us: p.returning_us,
        capacity_wait_us: p.capacity_wait_us,
        ..Decision::new(Some(p.winner), outcome, matched, s.total)
    })
}

/// The number of leading blocks every eligible replica holds, when they all hold the same
/// number (`None` when they differ or there is no eligible replica).
fn common_leading(cands: &[Candidate<'_>], s: &Scores, idx: &[usize]) -> Option<u32> {
    let mut held = idx.iter().map(|&i| leading(cands, s, i));
    let first = held.next()?;
    held.all(|l| l == first).then_some(first)
}

/// The order of equally good places for a new prefix (higher first): fewer recent requests,
/// then the prompt's rendezvous weight. Recent counts are compared in whole requests: a difference of less than one is what two workers' reads a
/// moment apart differ by, and there the rendezvous order, the same on every gateway, decides.
fn tie_rank(c: &Candidate<'_>, key: u64) -> u64 {
    let recent = c.recent.round().clamp(0.0, f64::from(u32::MAX)) as u32;
    let fewer = u64::from(u32::MAX.saturating_sub(recent));
    (fewer.checked_shl(32).unwrap_or(0)) | (c.rendezvous_weight(key).checked_shr(32).unwrap_or(0))
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests;
