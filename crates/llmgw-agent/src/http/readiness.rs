//! `/readyz`: whether this agent is worth sending traffic through. Ready when every configured
//! model has at least one replica up with its KV events flowing (its publisher connected, or
//! the JetStream consumer reading it) and no replica's hash parity is past the configured
//! mismatch ratio; otherwise one line per problem. `/healthz` stays liveness only.
//!
//! A replica is judged by what the hub holds: `up` (reachable over HTTP and its publisher
//! judged healthy, each within its grace period) and `connected` (a publisher connection open
//! now). A model with no replica configured or discovered yet is a problem too: discovery that
//! finds nothing (a wrong DNS name, a NetworkPolicy) must not look ready.

use crate::config::{Config, ParityConfig};
use crate::hub::HubState;
use std::collections::BTreeSet;

/// What readiness is judged against, from the configuration.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    /// Every model named by a replica or a discovery entry, sorted, without repeats.
    pub models: Vec<String>,
    /// Whether any replica or discovery entry names no model (it serves any).
    pub any_model: bool,
    pub parity: ParityConfig,
}

impl Readiness {
    pub fn from_config(cfg: &Config) -> Readiness {
        let lists = cfg.replicas.iter().map(|r| &r.models).chain(cfg.discovery.iter().map(|d| &d.models));
        let mut models = BTreeSet::new();
        let mut any_model = cfg.replicas.is_empty() && cfg.discovery.is_empty();
        for l in lists {
            any_model |= l.is_empty();
            models.extend(l.iter().cloned());
        }
        Readiness { models: models.into_iter().collect(), any_model, parity: cfg.parity.clone() }
    }
}

/// One engine as readiness sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineView {
    pub label: String,
    /// Models it serves; empty: any.
    pub models: Vec<String>,
    pub up: bool,
    pub connected: bool,
    pub parity_matched: u64,
    pub parity_mismatched: u64,
}

impl EngineView {
    pub fn of(st: &HubState) -> Vec<EngineView> {
        st.live()
            .map(|e| {
                let p = &e.mirror.stats().parity;
                EngineView {
                    label: e.spec.label(),
                    models: e.models().to_vec(),
                    up: e.up,
                    connected: e.connected,
                    parity_matched: p.matched,
                    parity_mismatched: p.mismatched,
                }
            })
            .collect()
    }

    fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    fn flowing(&self) -> bool {
        self.up && self.connected
    }

    fn why_not(&self) -> &'static str {
        match (self.up, self.connected) {
            (false, _) => "down",
            (true, false) => "KV events not connected",
            (true, true) => "ok",
        }
    }
}

/// Every reason not to be ready, one line each; empty when ready.
pub fn problems(r: &Readiness, engines: &[EngineView]) -> Vec<String> {
    let mut out = Vec::new();
    let mut judge = |what: String, serving: Vec<&EngineView>| {
        if serving.iter().any(|e| e.flowing()) {
            return;
        }
        if serving.is_empty() {
            out.push(format!("{what}: no replica configured or discovered yet"));
        } else {
            let each: Vec<String> = serving.iter().map(|e| format!("{} {}", e.label, e.why_not())).collect();
            out.push(format!("{what}: no replica up with KV events flowing ({})", each.join(", ")));
        }
    };
    for m in &r.models {
        judge(format!("model {m}"), engines.iter().filter(|e| e.serves(m)).collect());
    }
    if r.any_model {
        judge("any model".to_owned(), engines.iter().filter(|e| e.models.is_empty()).collect());
    }
    for e in engines {
        let verified = e.parity_matched.saturating_add(e.parity_mismatched);
        if verified == 0 || verified < r.parity.min_verified {
            continue;
        }
        let ratio = e.parity_mismatched as f64 / verified as f64;
        if ratio > r.parity.warn_mismatch_ratio {
            out.push(format!(
                "replica {}: hash parity mismatch on {} of {verified} verified blocks (above parity.warn_mismatch_ratio \
                 {}): check [hash] algo, seed and block_size against the replica's vLLM flags (llmgw-agent vllm-args)",
                e.label, e.parity_mismatched, r.parity.warn_mismatch_ratio
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::fixtures::hub;
    use crate::hub::Health;

    fn view(label: &str, models: &[&str], up: bool, connected: bool) -> EngineView {
        EngineView {
            label: label.into(),
            models: models.iter().map(|m| (*m).to_owned()).collect(),
            up,
            connected,
            parity_matched: 0,
            parity_mismatched: 0,
        }
    }

    fn readiness(toml: &str) -> Readiness {
        Readiness::from_config(&Config::parse(toml).unwrap())
    }

    const TWO_MODELS: &str = "[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nmodels = [\"m1\"]\n\
        endpoint = \"tcp://127.0.0.1:5000\"\n\
        [[replicas]]\nname = \"b\"\naddress = \"127.0.0.1:8001\"\nmodels = [\"m1\", \"m2\"]\n\
        endpoint = \"tcp://127.0.0.1:5001\"\n";

    #[test]
    fn models_come_from_replicas_and_discovery() {
        let r = readiness(&format!(
            "{TWO_MODELS}[[discovery]]\nname = \"d\"\ndns = \"vllm\"\nport = 8000\nmodels = [\"m3\"]\n"
        ));
        assert_eq!(r.models, vec!["m1", "m2", "m3"]);
        assert!(!r.any_model);
        assert!(
            readiness(
                "[[replicas]]\nname = \"a\"\naddress = \"127.0.0.1:8000\"\nendpoint = \"tcp://127.0.0.1:5000\"\n"
            )
            .any_model
        );
    }

    #[test]
    fn every_model_needs_a_replica_up_with_events_flowing() {
        let r = readiness(TWO_MODELS);
        // Both up and connected: ready.
        assert_eq!(
            problems(&r, &[view("a", &["m1"], true, true), view("b", &["m1", "m2"], true, true)]),
            Vec::<String>::new()
        );
        // b's events not connected: m1 still has a, m2 has nothing.
        assert_eq!(
            problems(&r, &[view("a", &["m1"], true, true), view("b", &["m1", "m2"], true, false)]),
            vec!["model m2: no replica up with KV events flowing (b KV events not connected)"]
        );
        // Both down: one line per model, each naming its replicas.
        assert_eq!(
            problems(&r, &[view("a", &["m1"], false, false), view("b", &["m1", "m2"], false, true)]),
            vec![
                "model m1: no replica up with KV events flowing (a down, b down)",
                "model m2: no replica up with KV events flowing (b down)",
            ]
        );
        // Nothing discovered yet.
        assert_eq!(
            problems(&r, &[]),
            vec![
                "model m1: no replica configured or discovered yet",
                "model m2: no replica configured or discovered yet",
            ]
        );
    }

    #[test]
    fn a_replica_serving_any_model_counts_for_every_model() {
        let r = readiness(TWO_MODELS);
        assert!(problems(&r, &[view("any", &[], true, true)]).is_empty());
        let any = Readiness { any_model: true, ..Readiness::default() };
        assert_eq!(problems(&any, &[]), vec!["any model: no replica configured or discovered yet"]);
        assert!(problems(&any, &[view("x", &[], true, true)]).is_empty());
    }

    #[test]
    fn a_hash_parity_mismatch_past_the_configured_ratio_is_not_ready() {
        let r = readiness(TWO_MODELS);
        let mut a = view("a", &["m1", "m2"], true, true);
        // Under min_verified (16): not judged.
        a.parity_mismatched = 15;
        assert!(problems(&r, &[a.clone()]).is_empty());
        // 1 in 200 (0.5 %) is under the 1 % default: tolerated.
        a.parity_matched = 199;
        a.parity_mismatched = 1;
        assert!(problems(&r, &[a.clone()]).is_empty());
        a.parity_mismatched = 20;
        let got = problems(&r, &[a]);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].starts_with("replica a: hash parity mismatch on 20 of 219 verified blocks"), "{got:?}");
    }

    #[test]
    fn the_hubs_engines_judged_as_they_connect_and_go_down() {
        let h = hub(1, 64);
        let r = Readiness { any_model: true, ..Readiness::default() };
        // Configured but its publisher never connected: not ready.
        assert_eq!(
            problems(&r, &EngineView::of(&h.state())),
            vec!["any model: no replica up with KV events flowing (r0#0 KV events not connected)"]
        );
        h.state().connection(0, true);
        assert!(problems(&r, &EngineView::of(&h.state())).is_empty());
        h.state().set_health(0, Health::Http, false, "unreachable");
        assert_eq!(
            problems(&r, &EngineView::of(&h.state())),
            vec!["any model: no replica up with KV events flowing (r0#0 down)"]
        );
        h.state().set_health(0, Health::Http, true, "reachable");
        assert!(problems(&r, &EngineView::of(&h.state())).is_empty());
        h.state().connection(0, false);
        assert_eq!(problems(&r, &EngineView::of(&h.state())).len(), 1);
    }
}
