//! `profiles[].weights` as the configuration writes it: one flat object whose keys each belong
//! to one policy, the overload limits or the fallbacks. Every key is optional; an absent one
//! takes its part's default ([`crate::policy`] holds the parts, their defaults and their
//! validation).

use crate::policy::rates::Learning;
use crate::policy::{FallbackWeights, Limits, PolicyMode, ScoreWeights, TtftWeights, Weights};
use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WeightsConfig {
    /// `ttft` (the default) or `score`.
    pub policy: Option<PolicyMode>,
    // `ttft` policy.
    pub prefill_us_per_token: Option<f64>,
    pub request_us: Option<f64>,
    pub queued_prefill: Option<f64>,
    pub tie_us: Option<f64>,
    pub tie_requests: Option<f64>,
    pub returning: Option<f64>,
    pub learn_rates: Option<bool>,
    pub rates_prior_weight: Option<f64>,
    pub rates_memory: Option<f64>,
    pub rates_forget_ms: Option<u64>,
    // `score` policy.
    pub prefix: Option<f64>,
    pub load: Option<f64>,
    pub load_scale: Option<f64>,
    pub kv_usage: Option<f64>,
    pub tie_margin: Option<f64>,
    // Overload limits.
    pub max_waiting: Option<u32>,
    pub max_in_flight: Option<u32>,
    pub max_kv_usage: Option<f64>,
    // Fallbacks and the holders' load bound.
    pub spill_factor: Option<f64>,
    pub spill_slack: Option<u32>,
    pub approx_choices: Option<u32>,
    pub holder_spill_factor: Option<f64>,
}

impl WeightsConfig {
    /// The weights these settings give, each absent one at its default (not yet validated).
    pub fn resolve(&self) -> Weights {
        let (t, s, l, f) =
            (TtftWeights::default(), ScoreWeights::default(), Limits::default(), FallbackWeights::default());
        Weights {
            policy: self.policy.unwrap_or_default(),
            ttft: TtftWeights {
                prefill_us_per_token: self.prefill_us_per_token.unwrap_or(t.prefill_us_per_token),
                request_us: self.request_us.unwrap_or(t.request_us),
                queued_prefill: self.queued_prefill.unwrap_or(t.queued_prefill),
                tie_us: self.tie_us.unwrap_or(t.tie_us),
                tie_requests: self.tie_requests.unwrap_or(t.tie_requests),
                returning: self.returning.unwrap_or(t.returning),
                learning: Learning {
                    enabled: self.learn_rates.unwrap_or(t.learning.enabled),
                    prior_weight: self.rates_prior_weight.unwrap_or(t.learning.prior_weight),
                    memory: self.rates_memory.unwrap_or(t.learning.memory),
                    forget_ns: self.rates_forget_ms.map_or(t.learning.forget_ns, |ms| ms.saturating_mul(1_000_000)),
                },
            },
            score: ScoreWeights {
                prefix: self.prefix.unwrap_or(s.prefix),
                load: self.load.unwrap_or(s.load),
                load_scale: self.load_scale.unwrap_or(s.load_scale),
                kv_usage: self.kv_usage.unwrap_or(s.kv_usage),
                tie_margin: self.tie_margin.unwrap_or(s.tie_margin),
            },
            limits: Limits {
                max_waiting: self.max_waiting.unwrap_or(l.max_waiting),
                max_in_flight: self.max_in_flight.unwrap_or(l.max_in_flight),
                max_kv_usage: self.max_kv_usage.unwrap_or(l.max_kv_usage),
            },
            fallback: FallbackWeights {
                spill_factor: self.spill_factor.unwrap_or(f.spill_factor),
                spill_slack: self.spill_slack.unwrap_or(f.spill_slack),
                approx_choices: self.approx_choices.unwrap_or(f.approx_choices),
                holder_spill_factor: self.holder_spill_factor.unwrap_or(f.holder_spill_factor),
            },
        }
    }
}
