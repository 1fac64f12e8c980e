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
pub mod fallback;
pub mod limits;
pub mod score;
pub mod ttft;

pub use candidate::{rendezvous_weight, Candidate};
pub use fallback::{least_loaded, FallbackWeights};
pub use limits::Limits;
pub use score::ScoreWeights;
pub use ttft::TtftWeights;

use crate::index::Scores;

/// How a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// From the index: the winner holds leading blocks of the request.
    Exact,
    /// Rendezvous hashing of the prompt's leading text, bounded by load.
    Approx,
    /// Least load (nothing to hash, or exact data said the prefix lives on a replica that load
    /// ruled out and nobody else holds any of it).
    Load,
    /// Replicas held the request's leading blocks, but every one of them was past the holders'
    /// load bound ([`FallbackWeights::holder_spill_factor`]): the request went where a new
    /// prefix would (its rendezvous order, bounded by load), and that replica then holds the
    /// prefix too. A hot prefix is replicated this way; a cold one stays where it is.
    Spill,
    /// No healthy replica.
    NoReplica,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Exact => "exact",
            Outcome::Approx => "approx",
            Outcome::Load => "load",
            Outcome::Spill => "spill",
            Outcome::NoReplica => "no_replica",
        }
    }

    pub const ALL: [Outcome; 5] = [Outcome::Exact, Outcome::Approx, Outcome::Load, Outcome::Spill, Outcome::NoReplica];
}

/// The choice: `winner` indexes the candidate slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub winner: Option<usize>,
    pub outcome: Outcome,
    /// Leading blocks the winner holds, of `total` in the request (0/0 without exact data).
    pub matched: u32,
    pub total: u32,
    /// `ttft` policy with exact data: the winner's predicted time to first token (µs), and the
    /// runner-up's (its index and prediction), for the explain header.
    pub predicted_us: Option<u64>,
    pub runner_up: Option<(usize, u64)>,
}

impl Decision {
    fn new(winner: Option<usize>, outcome: Outcome, matched: u32, total: u32) -> Decision {
        Decision { winner, outcome, matched, total, predicted_us: None, runner_up: None }
    }
}

/// The prompt a decision is about: its token count and the block size the index counts in
/// (the `ttft` policy's uncached tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    pub tokens: u64,
    pub block_size: u64,
}

/// The replicas in contest for a request whose blocks the index knows: up, not overloaded
/// (unless all are), and not holders past their load bound.
pub struct Contest<'c, 'a> {
    pub cands: &'c [Candidate<'a>],
    /// Indices into `cands`.
    pub members: &'c [usize],
    pub scores: &'c Scores,
    /// The prompt's size; without it a policy counts the request's full blocks at 16 tokens.
    pub work: Option<Work>,
    tiebreak: &'c dyn Fn(usize) -> Option<u64>,
}

impl Contest<'_, '_> {
    /// Leading blocks candidate `i` holds.
    pub fn leading(&self, i: usize) -> u32 {
        leading(self.cands, self.scores, i)
    }

    /// The prompt's rendezvous weight of candidate `i`: equally good replicas are ordered by
    /// it, so every gateway breaks the tie the same way (computed only when asked).
    pub fn tiebreak(&self, i: usize) -> Option<u64> {
        (self.tiebreak)(i)
    }

    /// The greatest member under `better`, its ties broken by more leading blocks, then the
    /// prompt's rendezvous order, then the lower index.
    pub fn best(&self, better: impl Fn(usize, usize) -> std::cmp::Ordering) -> Option<usize> {
        self.members.iter().copied().max_by(|&a, &b| self.order(&better, a, b))
    }

    /// As [`Contest::best`], and the runner-up.
    pub fn best_two(&self, better: impl Fn(usize, usize) -> std::cmp::Ordering) -> (Option<usize>, Option<usize>) {
        let best = self.best(&better);
        let second = best
            .and_then(|w| self.members.iter().copied().filter(|&i| i != w).max_by(|&a, &b| self.order(&better, a, b)));
        (best, second)
    }

    fn order(&self, better: &impl Fn(usize, usize) -> std::cmp::Ordering, a: usize, b: usize) -> std::cmp::Ordering {
        better(a, b)
            .then(self.leading(a).cmp(&self.leading(b)))
            .then_with(|| self.tiebreak(a).cmp(&self.tiebreak(b)))
            .then(b.cmp(&a))
    }
}

/// What a holder policy chose: the winner (an index into the candidates) and, for a policy that
/// predicts times to first token, the winner's prediction and the runner-up's (µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub winner: usize,
    pub predicted_us: Option<u64>,
    pub runner_up: Option<(usize, u64)>,
}

/// How replicas in contest for a request whose blocks the index knows are compared.
pub trait HolderPolicy {
    /// The policy's name in the configuration (`weights.policy`).
    fn name(&self) -> &'static str;
    /// The winner of `contest` (`None` only when it has no members).
    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick>;
}

/// Which [`HolderPolicy`] a profile uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyMode {
    /// The lowest predicted time to first token ([`TtftWeights`]).
    #[default]
    Ttft,
    /// The highest blended score of prefix share and load ([`ScoreWeights`]).
    Score,
}

/// A weight that is out of range: the field (as the configuration names it) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidWeight {
    pub field: &'static str,
    pub message: &'static str,
}

/// Checks that each of `values` is a finite, non-negative number.
pub(crate) fn non_negative(values: &[(&'static str, f64)]) -> Result<(), InvalidWeight> {
    match values.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
        Some(&(field, _)) => Err(InvalidWeight { field, message: "must be a finite, non-negative number" }),
        None => Ok(()),
    }
}

/// A profile's routing weights: the policy in use and every policy's weights, the overload
/// limits and the fallbacks'.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Weights {
    pub policy: PolicyMode,
    pub ttft: TtftWeights,
    pub score: ScoreWeights,
    pub limits: Limits,
    pub fallback: FallbackWeights,
}

impl Weights {
    /// The weights of the `score` policy, defaults otherwise.
    pub fn score() -> Weights {
        Weights { policy: PolicyMode::Score, ..Weights::default() }
    }

    /// The holder policy in use.
    pub fn holder_policy(&self) -> &dyn HolderPolicy {
        match self.policy {
            PolicyMode::Ttft => &self.ttft,
            PolicyMode::Score => &self.score,
        }
    }

    /// Every weight in range (those of the policies not in use too).
    pub fn validate(&self) -> Result<(), InvalidWeight> {
        self.ttft.validate()?;
        self.score.validate()?;
        self.limits.validate()?;
        self.fallback.validate()
    }
}

/// Leading blocks candidate `i` holds.
fn leading(cands: &[Candidate<'_>], s: &Scores, i: usize) -> u32 {
    cands.get(i).and_then(|c| s.leading.get(usize::from(c.id))).copied().unwrap_or(0)
}

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
    // Holders past their load bound give up their claim to the prefix.
    let mut spilled = false;
    if let Some(s) = exact {
        let within = w.fallback.holders_within(cands, &idx);
        let any_match = idx.iter().any(|&i| leading(cands, s, i) > 0);
        let holders_within = idx.iter().any(|&i| leading(cands, s, i) > 0 && within(i));
        spilled = any_match && !holders_within;
        if holders_within && s.total > 0 {
            // Holders past the bound are out of this contest; replicas holding nothing stay in.
            let members: Vec<usize> = idx.iter().copied().filter(|&i| within(i) || leading(cands, s, i) == 0).collect();
            let tiebreak = |i: usize| approx_key().and_then(|k| cands.get(i).map(|c| c.rendezvous_weight(k)));
            let contest = Contest { cands, members: &members, scores: s, work, tiebreak: &tiebreak };
            if let Some(p) = w.holder_policy().pick(&contest) {
                let matched = leading(cands, s, p.winner);
                let outcome = if matched > 0 { Outcome::Exact } else { Outcome::Load };
                return Decision {
                    predicted_us: p.predicted_us,
                    runner_up: p.runner_up,
                    ..Decision::new(Some(p.winner), outcome, matched, s.total)
                };
            }
        }
    }
    let total = exact.map_or(0, |s| s.total);
    let (winner, outcome) = w.fallback.pick(cands, &idx, approx_key(), exact.is_some(), spilled);
    Decision::new(winner, outcome, 0, total)
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)]
mod tests;
