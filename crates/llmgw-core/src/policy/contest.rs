//! The contest among replicas holding a request's blocks, and the trait of the policies that
//! decide it.

use super::candidate::Candidate;
use super::rates::Basis;
use crate::index::Scores;

/// The prompt a decision is about: its token count and the block size the index counts in
/// (the `ttft` policy's uncached tokens), and its own key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    pub tokens: u64,
    pub block_size: u64,
    /// The hash of the deepest block of the prompt that was hashed (past the blocks any replica
    /// holds, where the prompt has more): the same on every gateway, and different for prompts
    /// that differ past a prefix they share. Equal holders are ordered by its rendezvous order.
    pub prompt_key: u64,
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
    /// Whether what the request's prefill would cost the requests expected back on each member
    /// counts ([`super::returns`]): for a new prefix, not for a conversation's next turn, which
    /// stays with its holders by predicted time alone.
    pub counts_returns: bool,
    pub(super) tiebreak: &'c dyn Fn(usize) -> Option<u64>,
}

impl Contest<'_, '_> {
    /// Leading blocks candidate `i` holds.
    pub fn leading(&self, i: usize) -> u32 {
        leading(self.cands, self.scores, i)
    }

    /// Candidate `i`'s rank among equally good replicas (computed only when asked): among
    /// holders, the prompt's own rendezvous weight, the same on every gateway; for a new
    /// prefix, fewer recent requests first.
    pub fn tiebreak(&self, i: usize) -> Option<u64> {
        (self.tiebreak)(i)
    }

    /// The greatest member under `better`, its ties broken by more leading blocks, then
    /// [`Contest::tiebreak`], then the lower index.
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
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    pub winner: usize,
    pub predicted_us: Option<u64>,
    pub runner_up: Option<(usize, u64)>,
    /// What the winner's prediction was made of, and the rates it used.
    pub basis: Option<Box<Basis>>,
    /// What computing the request would cost the requests expected back on the winner and on
    /// the runner-up (µs; [`super::returns`]), counted in the contest besides the predictions.
    pub returning_us: (u64, u64),
    /// The waits for room in the winner's and the runner-up's KV caches in their predictions
    /// (µs; [`super::capacity`]).
    pub capacity_wait_us: (u64, u64),
}

/// How replicas in contest for a request whose blocks the index knows are compared.
pub trait HolderPolicy {
    /// The policy's name in the configuration (`weights.policy`).
    fn name(&self) -> &'static str;
    /// The winner of `contest` (`None` only when it has no members).
    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick>;
}

/// Leading blocks candidate `i` holds.
pub(crate) fn leading(cands: &[Candidate<'_>], s: &Scores, i: usize) -> u32 {
    cands.get(i).and_then(|c| s.leading.get(usize::from(c.id))).copied().unwrap_or(0)
}
