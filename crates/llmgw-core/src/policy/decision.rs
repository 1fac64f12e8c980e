//! What a decision says: where the request goes and how that was decided.

use super::rates::Basis;

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
#[derive(Debug, Clone, PartialEq)]
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
    /// What the winner's prediction was made of and the rates it used: the observed time to
    /// first token is learned against it.
    pub basis: Option<Box<Basis>>,
    /// What the request would cost the requests expected back on the winner and on the
    /// runner-up (µs), counted besides the predictions (new prefixes only).
    pub returning_us: (u64, u64),
    /// Of the winner's and the runner-up's predictions, the waits for room in their KV caches
    /// (µs; 0: the prompt fits there). An observation whose prediction includes one says
    /// nothing of the rates.
    pub capacity_wait_us: (u64, u64),
}

impl Decision {
    pub(super) fn new(winner: Option<usize>, outcome: Outcome, matched: u32, total: u32) -> Decision {
        Decision {
            winner,
            outcome,
            matched,
            total,
            predicted_us: None,
            runner_up: None,
            basis: None,
            returning_us: (0, 0),
            capacity_wait_us: (0, 0),
        }
    }
}
