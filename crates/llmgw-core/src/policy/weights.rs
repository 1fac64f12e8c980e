//! A profile's routing weights: the policy in use, every policy's weights, the overload limits
//! and the fallbacks'.

use super::contest::HolderPolicy;
use super::fallback::FallbackWeights;
use super::limits::Limits;
use super::score::ScoreWeights;
use super::ttft::TtftWeights;
use super::validation::InvalidWeight;

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
