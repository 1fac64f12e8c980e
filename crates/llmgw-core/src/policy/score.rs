//! The `score` policy: the highest blended score `prefix × share − load × load_term`, where
//! `share` is the fraction of the request's blocks a replica's leading run covers and
//! `load_term = pressure / (pressure + load_scale) + kv_usage × kv cache usage` (pressure =
//! in-flight + running + 2 × waiting).

use super::candidate::Candidate;
use super::contest::{Contest, HolderPolicy, Pick};
use super::validation::{non_negative, InvalidWeight};

/// The `score` policy's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreWeights {
    /// Weight of the prefix share.
    pub prefix: f64,
    /// Weight of the load term.
    pub load: f64,
    /// Pressure at which the load term reaches half its weight.
    pub load_scale: f64,
    /// Weight of the engine's KV cache usage (0..1) inside the load term.
    pub kv_usage: f64,
    /// Replicas whose scores differ by at most this much are equally good: the one the
    /// prompt's rendezvous order puts first wins. A difference of one request (0.5 × 1/9 at the
    /// defaults) is within it: engine-reported loads reach every gateway at a different
    /// instant, and without the margin gateways with the same index split on them.
    pub tie_margin: f64,
}

impl Default for ScoreWeights {
    fn default() -> Self {
        ScoreWeights { prefix: 1.0, load: 0.5, load_scale: 8.0, kv_usage: 0.25, tie_margin: 0.06 }
    }
}

impl ScoreWeights {
    pub fn validate(&self) -> Result<(), InvalidWeight> {
        non_negative(&[
            ("prefix", self.prefix),
            ("load", self.load),
            ("kv_usage", self.kv_usage),
            ("tie_margin", self.tie_margin),
        ])?;
        if !self.load_scale.is_finite() || self.load_scale <= 0.0 {
            return Err(InvalidWeight { field: "load_scale", message: "must be a finite, positive number" });
        }
        Ok(())
    }

    fn load_term(&self, c: &Candidate<'_>) -> f64 {
        let p = c.pressure() as f64;
        let kv = f64::from(c.kv_usage).clamp(0.0, 1.0);
        p / (p + self.load_scale) + self.kv_usage * kv
    }
}

impl HolderPolicy for ScoreWeights {
    fn name(&self) -> &'static str {
        "score"
    }

    fn pick(&self, contest: &Contest<'_, '_>) -> Option<Pick> {
        let total = f64::from(contest.scores.total);
        let score = |i: usize| -> f64 {
            let Some(c) = contest.cands.get(i) else { return f64::NEG_INFINITY };
            let share = f64::from(contest.leading(i)) / total;
            self.prefix * share - self.load * self.load_term(c)
        };
        // Scores within the tie margin are equal.
        let best = contest.best(|a, b| {
            let (sa, sb) = (score(a), score(b));
            if (sa - sb).abs() <= self.tie_margin {
                std::cmp::Ordering::Equal
            } else {
                sa.total_cmp(&sb)
            }
        });
        best.map(|b| Pick {
            winner: b,
            predicted_us: None,
            runner_up: None,
            basis: None,
            returning_us: (0, 0),
            capacity_wait_us: (0, 0),
        })
    }
}
