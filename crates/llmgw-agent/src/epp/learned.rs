//! What the picker learns per endpoint from its own requests, as the filter keeps it in Envoy's
//! shared data: the rates of the `ttft` policy, from the first tokens its streamed answers
//! produced ([`llmgw_core::policy::rates`]), and how long its requests held their KV blocks
//! there, from routing to end ([`llmgw_core::policy::capacity`]). At most [`MAX_ENDPOINTS`]
//! endpoints are kept; the one updated longest ago goes first.

use llmgw_core::policy::capacity::moved_hold_us;
use llmgw_core::policy::rates::{Basis, Estimator, Rates};
use std::collections::HashMap;
use std::fmt::Write;
use std::time::Instant;

/// At most this many endpoints' rates and holds are kept.
pub const MAX_ENDPOINTS: usize = 256;

#[derive(Debug, Clone, Copy)]
struct Endpoint {
    estimator: Estimator,
    /// What the estimator gave at its last observation, and when that came; none before the
    /// first.
    rates: Option<(Rates, Instant)>,
    /// The mean hold (µs; 0: none observed yet).
    hold_us: f64,
    /// The update count when it was last updated.
    updated: u64,
}

/// A gauge of the learned rates: its name, its help, its value.
type Gauge = (&'static str, &'static str, fn(&Rates) -> f64);

/// Per endpoint (its `ip:port`): its learned rates and its mean hold.
#[derive(Debug, Default)]
pub struct Learned {
    by_address: HashMap<String, Endpoint>,
    /// Updates so far: what orders the endpoints by their last update.
    updates: u64,
}

impl Learned {
    fn entry(&mut self, address: &str) -> &mut Endpoint {
        if !self.by_address.contains_key(address) && self.by_address.len() >= MAX_ENDPOINTS {
            let oldest = self.by_address.iter().min_by_key(|(_, e)| e.updated).map(|(a, _)| a.clone());
            if let Some(a) = oldest {
                self.by_address.remove(&a);
            }
        }
        self.updates = self.updates.saturating_add(1);
        let now = self.updates;
        let e = self.by_address.entry(address.to_owned()).or_insert(Endpoint {
            estimator: Estimator::default(),
            rates: None,
            hold_us: 0.0,
            updated: now,
        });
        e.updated = now;
        e
    }

    /// A streamed request routed to `address` by a prediction resting on `basis` produced its
    /// first token `ttft_us` after its routing, at `now`.
    pub fn teach(&mut self, address: &str, basis: &Basis, ttft_us: f64, now: Instant) {
        let e = self.entry(address);
        let quiet = e.rates.map_or(0, |(_, at)| nanos(now.saturating_duration_since(at)));
        e.rates = Some((e.estimator.teach(basis, ttft_us, quiet), now));
    }

    /// A request routed to `address` ended `us` after its routing.
    pub fn hold(&mut self, address: &str, us: f64) {
        let e = self.entry(address);
        e.hold_us = moved_hold_us((e.hold_us > 0.0).then_some(e.hold_us), us);
    }

    /// The endpoints kept.
    pub fn addresses(&self) -> impl Iterator<Item = &String> {
        self.by_address.keys()
    }

    /// The rates learned for `address`, as read at `now` (how long they have been quiet).
    pub fn rates(&self, address: &str, now: Instant) -> Option<Rates> {
        self.by_address.get(address)?.rates_at(now)
    }

    pub fn hold_us(&self, address: &str) -> f64 {
        self.by_address.get(address).map_or(0.0, |e| e.hold_us)
    }

    /// The learned rates as Prometheus gauges, by endpoint (the filter's names and units), as
    /// read at `now`.
    pub fn text(&self, now: Instant) -> String {
        let mut learned: Vec<(&String, Rates)> =
            self.by_address.iter().filter_map(|(a, e)| e.rates_at(now).map(|r| (a, r))).collect();
        learned.sort_by(|a, b| a.0.cmp(b.0));
        let mut out = String::new();
        let gauges: [Gauge; 6] = [
            ("llmgw_rates_base_us", "Learned time to first token of an idle endpoint, µs.", |r| r.base_us),
            ("llmgw_rates_prefill_ns_per_token", "Learned time per prompt token computed, ns.", |r| {
                r.prefill_us_per_token * 1_000.0
            }),
            ("llmgw_rates_queued_ns_per_token", "Learned time per prefill token queued ahead, ns.", |r| {
                r.queued_us_per_token * 1_000.0
            }),
            ("llmgw_rates_request_us", "Learned time per request running or waiting ahead, µs.", |r| r.request_us),
            ("llmgw_rates_observations", "First tokens the learned rates rest on.", |r| f64::from(r.observations)),
            (
                "llmgw_rates_quiet_ms",
                "Time since the last first token observed, ms (past rates_forget_ms: not used).",
                |r| r.quiet_ns as f64 / 1e6,
            ),
        ];
        for (name, help, value) in gauges {
            if learned.is_empty() {
                break;
            }
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (address, r) in &learned {
                let v = value(r);
                let v = if v.is_finite() { v } else { 0.0 };
                let _ = writeln!(out, "{name}{{replica=\"{address}\"}} {v:.0}");
            }
        }
        out
    }
}

impl Endpoint {
    /// Its learned rates as read at `now`: with how long they have been quiet.
    fn rates_at(&self, now: Instant) -> Option<Rates> {
        let (r, at) = self.rates?;
        Some(Rates { quiet_ns: nanos(now.saturating_duration_since(at)), ..r })
    }
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A prediction at the profile's default rates for a prompt computing `uncached` tokens on an
/// idle endpoint, for tests.
#[cfg(test)]
pub fn basis(uncached: u64) -> Basis {
    use llmgw_core::policy::rates::{Features, Learning};
    {
        let prior = Rates {
            base_us: 0.0,
            prefill_us_per_token: 200.0,
            queued_us_per_token: 200.0,
            request_us: 40_000.0,
            observations: 0,
            residual_us: 0.0,
            quiet_ns: 0,
        };
        Basis {
            features: Features { uncached, queued_tokens: 0, requests: 0 },
            rates: prior,
            prior,
            learning: Learning::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_tokens_teach_an_endpoints_rates_and_ends_its_hold() {
        let mut l = Learned::default();
        let now = Instant::now();
        assert_eq!(l.rates("a:1", now), None);
        // A replica four times faster per prompt token than the profile says.
        for i in 0..60u64 {
            let u = 100 + 37 * (i % 20);
            l.teach("a:1", &basis(u), 50.0 * u as f64, now);
        }
        let r = l.rates("a:1", now).unwrap();
        assert!((r.prefill_us_per_token - 50.0).abs() < 10.0, "{r:?}");
        assert_eq!(r.observations, 60);
        assert!(l.text(now).contains("llmgw_rates_prefill_ns_per_token{replica=\"a:1\"}"), "{}", l.text(now));
        // Read later, they say how long they have been quiet; a first token after a quiet past
        // `forget_ns` starts them afresh.
        let forget = basis(0).learning.forget_ns;
        let later = now + std::time::Duration::from_nanos(forget + 1);
        assert_eq!(l.rates("a:1", later).unwrap().quiet_ns, forget + 1);
        let quiet_ms = (forget + 1) / 1_000_000;
        assert!(
            l.text(later).contains(&format!("llmgw_rates_quiet_ms{{replica=\"a:1\"}} {quiet_ms}")),
            "{}",
            l.text(later)
        );
        l.teach("a:1", &basis(100), 200.0 * 100.0, later);
        assert_eq!(l.rates("a:1", later).unwrap().observations, 1);
        assert_eq!(l.hold_us("a:1"), 0.0);
        l.hold("a:1", 160_000.0);
        l.hold("a:1", 320_000.0);
        assert!((l.hold_us("a:1") - 170_000.0).abs() < 1.0, "{}", l.hold_us("a:1"));
    }

    #[test]
    fn the_endpoint_updated_longest_ago_goes_first() {
        let mut l = Learned::default();
        for i in 0..MAX_ENDPOINTS {
            l.hold(&format!("10.0.{}.{}:8000", i / 256, i % 256), 1.0);
        }
        l.hold("10.0.0.0:8000", 2.0);
        l.hold("10.9.9.9:8000", 3.0);
        assert_eq!(l.by_address.len(), MAX_ENDPOINTS);
        assert!(l.hold_us("10.0.0.0:8000") > 0.0, "updated again: kept");
        assert_eq!(l.hold_us("10.0.0.1:8000"), 0.0, "updated longest ago: gone");
    }
}
