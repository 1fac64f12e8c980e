//! The endpoint picker's routing: the core's [`Router`] (the filter's very flow and policies),
//! fed in-process from the agent's hub as a feed subscriber is, and driven through the same
//! host seam as the filter: a body in, a [`Step`] out (route, answer 503, or call the tokenizer
//! and hand its reply back). What the filter does with Envoy's shared data the picker does with
//! [`Gateway`]; what it adds is the protocol's: the subset hint and the ordered fallback list.

use super::after_routing::{Keeper, Pending};
use super::gateway::{now_ns, Charge, Gateway, Snapshot};
use super::metrics::{inc, EppMetrics};
use super::tokenize::{self, Answer};
use super::wire::Destination;
use crate::hub::Hub;
use llmgw_core::flow::{Body, Routed, Router, Step, Tokenize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tracing::warn;

/// Tokenizer calls one decision may make (a dedicated tokenizer that declines, then a replica).
const MAX_TOKENIZER_CALLS: u32 = 3;

/// The picker's answer for one request.
#[derive(Debug)]
pub enum Pick {
    /// The endpoints, the request as counted at the primary until [`Picker::finished`], and
    /// the tokens it was routed without, still to come ([`Picker::after_routing`], or its
    /// answer: [`Picker::ids_from_answer`]).
    Route(Destination, Charge, Option<Pending>),
    /// Answer locally with this status and JSON body.
    Reject { status: u32, body: Vec<u8>, details: &'static str },
}

pub struct Picker {
    router: Arc<Mutex<Router>>,
    pub gateway: Arc<Gateway>,
    pub metrics: Arc<EppMetrics>,
    max_fallbacks: usize,
}

impl Picker {
    pub fn new(router: Router, gateway: Gateway, metrics: Arc<EppMetrics>, max_fallbacks: usize) -> Picker {
        Picker { router: Arc::new(Mutex::new(router)), gateway: Arc::new(gateway), metrics, max_fallbacks }
    }

    fn router(&self) -> MutexGuard<'_, Router> {
        self.router.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The configured body limit: bodies past it are decided on their head.
    pub fn max_body_bytes(&self) -> usize {
        self.router().config().max_body_bytes
    }

    /// Whether the index is complete (the first snapshot arrived).
    pub fn synced(&self) -> bool {
        self.router().feed.serving().synced
    }

    /// Decides where a request goes. `subset`: the data plane's subset hint (only endpoints in it
    /// may be chosen). The primary is counted in flight until [`Self::finished`].
    pub async fn pick(&self, path: &str, bytes: &[u8], too_large: bool, subset: Option<&[String]>) -> Pick {
        let t0 = Instant::now();
        let pick = self.decide(path, bytes, too_large, subset).await;
        self.metrics.decided(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
        if let Pick::Route(_, charge, _) = &pick {
            self.gateway.started(charge);
        }
        pick
    }

    /// Makes the tokenizer call of a request routed before its tokens came, in the background.
    pub fn after_routing(&self, p: Pending) {
        self.keeper().spawn(p);
    }

    /// The prompt's ids of a request routed before its tokens came, read from its answer.
    pub fn ids_from_answer(&self, p: Pending, ids: &[u32]) {
        self.keeper().ids_from_answer(p, ids);
    }

    fn keeper(&self) -> Keeper {
        Keeper { router: self.router.clone(), gateway: self.gateway.clone(), metrics: self.metrics.clone() }
    }

    /// A request [`Self::pick`] routed finished.
    pub fn finished(&self, charge: Charge) {
        self.gateway.finished(charge);
    }

    /// The picker's metrics, the rates it learned included, as Prometheus text.
    pub fn metrics_text(&self) -> String {
        let mut text = self.metrics.text();
        text.push_str(&self.gateway.learned_text());
        text
    }

    async fn decide(&self, path: &str, bytes: &[u8], too_large: bool, subset: Option<&[String]>) -> Pick {
        if subset.is_some_and(<[String]>::is_empty) {
            inc(&self.metrics.subset_unavailable);
            return unavailable("the subset hint names no endpoint");
        }
        let mut step = {
            let gw = self.gateway.snapshot(subset);
            let mut r = self.router();
            let step = r.on_body(&Body { path, bytes, too_large }, &gw, now_ns());
            self.note(&mut r, &step);
            step
        };
        let mut calls = 0u32;
        loop {
            match step {
                Step::Route(routed) => return self.route(routed, None, subset),
                Step::RouteThenTokenize(routed, call) => return self.route(routed, Some(call), subset),
                Step::Reject(rej) => {
                    inc(&self.metrics.rejected);
                    return Pick::Reject { status: rej.status, body: rej.body, details: "llmgw: no healthy replica" };
                }
                Step::Tokenize(t) => {
                    calls = calls.saturating_add(1);
                    let answer = if calls > MAX_TOKENIZER_CALLS {
                        Answer::Reset
                    } else {
                        tokenize::counted_call(&t, &self.metrics, &self.gateway).await
                    };
                    step = self.reply(t, &answer, subset);
                }
            }
        }
    }

    /// The answer for a routed request: its endpoints, and what it counts at the primary. Its
    /// tokens are kept for its conversation's next turn. `after`: it was routed on an estimate
    /// of its length (on its conversation's turn before, or on what its siblings share), and
    /// this call, made after the route is answered (or its answer read for them), tells its
    /// tokens (what its first token then teaches) and keeps them.
    fn route(&self, routed: Routed, after: Option<Box<Tokenize>>, subset: Option<&[String]>) -> Pick {
        let gw = self.gateway.snapshot(subset);
        if !gw.eligible(&routed.address) {
            // Every endpoint of the subset is down: the core chose outside it.
            inc(&self.metrics.subset_unavailable);
            return unavailable("no endpoint of the subset hint is eligible");
        }
        let endpoints = {
            let r = self.router();
            self.ordered(&r, &routed.address, routed.runner_up.as_deref(), &gw, routed.model.clone())
        };
        self.gateway.keep(&routed.keep);
        if let Some(spec) = &routed.speculation {
            let dropped = self.gateway.speculate(spec);
            self.metrics.speculative_dropped.fetch_add(dropped as u64, std::sync::atomic::Ordering::Relaxed);
        }
        // A prediction with a wait for room in the cache says nothing of the rates.
        let d = &routed.decision;
        let learning = d.basis.as_deref().copied().filter(|b| b.learning.enabled && d.capacity_wait_us.0 == 0);
        if let Some(key) = routed.follows {
            self.gateway.followed(key);
        }
        let mut charge = Charge::new(routed.address.clone(), routed.prefill_tokens, routed.holding, learning)
            .recorded_as(routed.ends_as);
        let pending = after.map(|call| Pending { call, counted: charge.counted_later() });
        Pick::Route(Destination { endpoints, dp_rank: routed.dp_rank }, charge, pending)
    }

    /// Hands a tokenizer reply back to the core; a failure the tokenizer caused makes its
    /// address avoided for tokenizer calls, as the filter's circuit breaker does.
    fn reply(&self, t: Tokenize, answer: &Answer, subset: Option<&[String]>) -> Step {
        let gw = self.gateway.snapshot(subset);
        let mut r = self.router();
        let target = t.target.clone();
        let step = answer.with_reply(|reply| r.on_tokenizer_reply(*t.pending, reply, &gw, now_ns()));
        if step.report().tokenizer_failure.is_some() && !step.report().tokenizer_failure_request_caused {
            self.gateway.avoid_tokenizer(&target);
        }
        self.note(&mut r, &step);
        step
    }

    fn note(&self, r: &mut Router, step: &Step) {
        self.metrics.report(step.report());
        if let Some(note) = r.take_hash_note() {
            warn!("{note}");
        }
    }

    /// The primary, then up to `max_fallbacks` other endpoints serving the model: the core's
    /// runner-up first when it named one, then the least loaded (this picker's requests in
    /// flight, then the engines' running and waiting requests). Endpoints the request may not
    /// use (down, avoided, outside the subset, refused by the allowlist) are left out; an
    /// address appears once even when several data-parallel ranks share it.
    fn ordered(
        &self,
        r: &Router,
        primary: &str,
        runner_up: Option<&str>,
        gw: &Snapshot,
        model: Option<String>,
    ) -> Vec<String> {
        use llmgw_core::flow::{InFlightCounts, ReplicaAvoidance};
        let feed = r.feed.serving();
        let mut others: Vec<(bool, u64, &str)> = Vec::new();
        for rep in &feed.replicas {
            let addr = rep.address.as_str();
            if addr.is_empty()
                || addr == primary
                || !rep.up
                || !rep.serves(model.as_deref())
                || !feed.allowed(u32::from(rep.id))
                || gw.avoided(addr)
                || others.iter().any(|(_, _, a)| *a == addr)
            {
                continue;
            }
            let load = feed.load(rep.id).map_or(0, |l| u64::from(l.running).saturating_add(u64::from(l.waiting)));
            let weight = u64::from(gw.in_flight(addr)).saturating_add(load);
            others.push((Some(addr) != runner_up, weight, addr));
        }
        others.sort();
        let mut out = Vec::with_capacity(self.max_fallbacks.saturating_add(1));
        out.push(primary.to_owned());
        out.extend(others.into_iter().take(self.max_fallbacks).map(|(_, _, a)| a.to_owned()));
        out
    }

    /// Feeds the router from the hub until the process ends: a subscriber's table and snapshot,
    /// then its changes, applied as the filter applies the feed stream.
    pub async fn follow(self: Arc<Self>, hub: Arc<Hub>) {
        loop {
            let sub = hub.subscribe("llmgw-epp".to_owned());
            self.router().feed.begin_subscription();
            loop {
                if sub.needs_resync() {
                    let (s, h) = (sub.clone(), hub.clone());
                    if tokio::task::spawn_blocking(move || s.prepare(&h)).await.is_err() {
                        return;
                    }
                }
                match sub.pop(&hub) {
                    Some(m) => {
                        // The picker's requests on each endpoint as a load report came: what the
                        // engine reports beyond them is other requests' (read before the
                        // router is locked).
                        let shares =
                            matches!(m.body, Some(llmgw_core::feed::Body::Load(_))).then(|| self.gateway.shares());
                        let mut router = self.router();
                        if let Err(e) = router.apply_feed(&m, now_ns()) {
                            warn!(error = ?e, "endpoint picker: feed message not applied; subscribing again");
                            break;
                        }
                        if let Some(shares) = shares {
                            router.feed.note_gateway_share(&|a| shares.get(a).copied().unwrap_or_default());
                        }
                    }
                    None => sub.notify.notified().await,
                }
            }
        }
    }
}

/// A tokenizer reply, before it is lent to the core.
fn unavailable(why: &'static str) -> Pick {
    let body = serde_json::json!({
        "error": { "message": why, "type": "llmgw_no_replica", "code": 503 }
    });
    Pick::Reject { status: 503, body: serde_json::to_vec(&body).unwrap_or_default(), details: why }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::epp::gateway::Gateway;
    use llmgw_core::config::Compiled;
    use llmgw_core::feed::{Body as FeedBody, FeedMessage, Replica, ReplicaTable, SnapshotComplete};
    use std::time::Duration;

    const A: &str = "10.0.0.1:8000";
    const B: &str = "10.0.0.2:8000";
    const C: &str = "10.0.0.3:8000";

    /// A picker with the filter's default routing over three replicas up, serving model "m".
    fn picker() -> Picker {
        picker_serving(["m", "m", "m"])
    }

    /// The same, A, B and C serving the models named.
    fn picker_serving(models: [&str; 3]) -> Picker {
        let mut router = Router::new(Compiled::from_json(b"", None).unwrap(), 7);
        let replicas = [A, B, C]
            .iter()
            .zip(models)
            .enumerate()
            .map(|(i, (a, m))| Replica {
                id: i as u32,
                name: format!("r{i}"),
                address: (*a).to_owned(),
                models: vec![m.into()],
                up: true,
                ..Default::default()
            })
            .collect();
        router.feed.begin_subscription();
        let bodies = [FeedBody::Replicas(ReplicaTable { replicas }), FeedBody::SnapshotComplete(SnapshotComplete {})];
        for (seq, body) in [1u64, 2].into_iter().zip(bodies) {
            router.apply_feed(&FeedMessage { seq, body: Some(body) }, 1).unwrap();
        }
        Picker::new(router, Gateway::new(Duration::from_secs(60)), Arc::new(EppMetrics::default()), 2)
    }

    const BODY: &[u8] = br#"{"model":"m","prompt":"hello there"}"#;

    fn routed(p: Pick) -> (Destination, Charge) {
        match p {
            Pick::Route(d, c, _) => (d, c),
            other => panic!("not routed: {other:?}"),
        }
    }

    fn route(p: Pick) -> Destination {
        routed(p).0
    }

    #[tokio::test]
    async fn the_answer_is_the_primary_then_distinct_fallbacks_of_the_model() {
        let p = picker();
        let (d, charge) = routed(p.pick("/v1/completions", BODY, false, None).await);
        assert_eq!(d.endpoints.len(), 3);
        let mut sorted = d.endpoints.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted, vec![A.to_owned(), B.to_owned(), C.to_owned()]);
        p.finished(charge);
    }

    #[tokio::test]
    async fn fallbacks_serve_the_model_the_body_names() {
        let p = picker_serving(["m", "n", "m"]);
        for _ in 0..4 {
            let (d, charge) = routed(p.pick("/v1/completions", BODY, false, None).await);
            let mut sorted = d.endpoints.clone();
            sorted.sort();
            assert_eq!(sorted, vec![A.to_owned(), C.to_owned()], "B serves another model");
            p.finished(charge);
        }
    }

    #[tokio::test]
    async fn only_endpoints_of_the_subset_hint_are_named() {
        let p = picker();
        for only in [A, B, C] {
            let subset = vec![only.to_owned()];
            let d = route(p.pick("/v1/completions", BODY, false, Some(&subset)).await);
            assert_eq!(d.endpoints, vec![only.to_owned()], "subset {only}");
        }
        let two = vec![A.to_owned(), C.to_owned()];
        let d = route(p.pick("/v1/completions", BODY, false, Some(&two)).await);
        assert!(d.endpoints.iter().all(|e| two.contains(e)) && d.endpoints.len() == 2, "{d:?}");
    }

    #[tokio::test]
    async fn an_empty_or_ineligible_subset_is_answered_503() {
        let p = picker();
        for subset in [vec![], vec!["10.9.9.9:1".to_owned()]] {
            match p.pick("/v1/completions", BODY, false, Some(&subset)).await {
                Pick::Reject { status, .. } => assert_eq!(status, 503, "{subset:?}"),
                other => panic!("{subset:?} routed: {other:?}"),
            }
        }
        assert_eq!(p.metrics.subset_unavailable.load(std::sync::atomic::Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_primary_the_gateway_could_not_use_is_avoided_next_time() {
        let p = picker();
        let first = route(p.pick("/v1/completions", BODY, false, None).await).endpoints[0].clone();
        p.gateway.avoid(&first);
        let next = route(p.pick("/v1/completions", BODY, false, None).await);
        assert_ne!(next.endpoints[0], first);
        assert!(!next.endpoints.contains(&first), "an avoided endpoint is no fallback either");
    }
}
