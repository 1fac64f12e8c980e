//! The filter's glue, natively: the root and HTTP contexts driven through a fake host.
#![allow(clippy::arithmetic_side_effects)]

use crate::fake::FakeHost;
use crate::host::{Buffer, Headers, Host};
use crate::http::Request;
use crate::Root;
use llmgw_core::feed::{
    Body as Msg, FeedMessage, Replica, ReplicaReset, ReplicaTable, SnapshotChunk, SnapshotComplete,
};
use llmgw_core::hash::{BlockHasher, HashAlgo, RequestExtras};
use prost::Message;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

const A: &str = "127.0.0.1:8001";
const B: &str = "127.0.0.1:8002";
const DEST: &str = "x-gateway-destination-endpoint";
const BS: usize = 4;
const COMPLETIONS: &str = "/v1/completions";

fn config(extra: &str) -> String {
    format!(
        r#"{{{extra}"explain_header":true,"profiles":[
            {{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}},
            {{"name":"off","models":["plain"]}}]}}"#
    )
}

fn keys(tokens: &[u32]) -> Vec<u64> {
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    h.hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect()
}

fn replica(id: u32, address: &str, up: bool) -> Replica {
    Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![],
        up,
        dp_rank: 0,
        hash: None,
        dp_size: 0,
        kv_groups: vec![],
    }
}

struct Env {
    host: Rc<FakeHost>,
    root: Root,
    seq: u64,
}

fn env(config: &str) -> Env {
    let host = Rc::new(FakeHost::new().with_config(config));
    let mut root = Root::new(host.clone());
    assert!(root.on_configure(0), "configuration refused");
    Env { host, root, seq: 0 }
}

/// A configured VM whose feed knows A and B, with `on_a` and `on_b` held.
fn synced(extra: &str, on_a: Vec<u64>, on_b: Vec<u64>, up: bool) -> Env {
    synced_with(&config(extra), on_a, on_b, up)
}

/// As [`synced`], with this configuration.
fn synced_with(config: &str, on_a: Vec<u64>, on_b: Vec<u64>, up: bool) -> Env {
    let mut e = env(config);
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, up), replica(1, B, up)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: on_a }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: on_b }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    e
}

impl Env {
    /// Opens a feed stream (the first tick, or the tick after the backoff).
    fn subscribe(&mut self) -> u32 {
        let before = self.host.streams.borrow().len();
        self.host.now_ns.set(self.host.now_ns.get() + 10_000_000_000);
        self.root.on_tick();
        let streams = self.host.streams.borrow();
        assert_eq!(streams.len(), before + 1, "no stream opened");
        self.seq = 0;
        streams.last().unwrap().0
    }

    fn stream(&self) -> u32 {
        self.host.streams.borrow().last().unwrap().0
    }

    fn feed(&mut self, bodies: Vec<Msg>) {
        let token = self.stream();
        for body in bodies {
            let bytes = FeedMessage { seq: self.seq, body: Some(body) }.encode_to_vec();
            self.seq += 1;
            self.host.set_buffer(Buffer::GrpcReceive, &bytes);
            self.root.on_grpc_stream_message(token, bytes.len());
        }
    }

    /// Sends a request's headers (with a client-chosen destination) and body; returns the
    /// context and the last action.
    fn request(&self, path: &str, body: &[u8]) -> (Request, Action) {
        self.request_with(path, body, &[])
    }

    /// As [`Self::request`], with more client headers.
    fn request_with(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> (Request, Action) {
        self.host.next_request();
        for (k, v) in headers {
            self.host.set_header(Headers::Request, k, Some(v));
        }
        self.host.set_header(Headers::Request, ":path", Some(path));
        self.host.set_header(Headers::Request, DEST, Some("169.254.169.254:80"));
        self.host.set_buffer(Buffer::Request, body);
        let mut ctx = self.root.request();
        let mut action = ctx.on_http_request_headers(3, body.is_empty());
        if !body.is_empty() && action == Action::Pause {
            action = ctx.on_http_request_body(body.len(), true);
        }
        (ctx, action)
    }

    /// Answers the last tokenizer call.
    fn answer(&self, ctx: &mut Request, status: Option<&str>, body: &[u8]) {
        let call = self.host.last_call().expect("a tokenizer call");
        if let Some(s) = status {
            self.host.set_header(Headers::CallResponse, ":status", Some(s));
        }
        self.host.set_buffer(Buffer::CallResponse, body);
        ctx.on_http_call_response(call.token, usize::from(status.is_some()), body.len(), 0);
    }

    fn dest(&self) -> Option<String> {
        self.host.request_header(DEST)
    }

    fn counter(&self, name: &str) -> i64 {
        self.host.counter(name).unwrap_or_else(|| panic!("metric {name} not defined"))
    }
}

fn tokens_body(model: &str, tokens: &[u32]) -> Vec<u8> {
    format!(r#"{{"model":"{model}","prompt":{tokens:?}}}"#).into_bytes()
}

fn tokenize_answer(tokens: &[u32]) -> Vec<u8> {
    format!(r#"{{"count":{},"max_model_len":4096,"tokens":{tokens:?}}}"#, tokens.len()).into_bytes()
}

#[test]
fn each_fallback_reason_is_counted() {
    let cases: [(&str, &[u8], &str); 6] = [
        (COMPLETIONS, b"", "no_prompt"),
        (COMPLETIONS, b"{not json", "unparseable"),
        (COMPLETIONS, br#"{"model":"m"}"#, "no_prompt"),
        (COMPLETIONS, br#"{"model":"other","prompt":"hi"}"#, "no_profile"),
        (COMPLETIONS, br#"{"model":"plain","prompt":"hi"}"#, "no_kv_events"),
        (COMPLETIONS, br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#, "no_match"),
    ];
    for (path, body, reason) in cases {
        let e = synced("", vec![], vec![], true);
        let (_ctx, action) = e.request(path, body);
        assert_eq!(action, Action::Continue);
        assert_eq!(e.counter(&format!("llmgw_fallbacks_total.reason.{reason}")), 1, "{reason}");
        let total: i64 =
            e.host.counters().iter().filter(|(n, _)| n.starts_with("llmgw_fallbacks_total")).map(|(_, v)| v).sum();
        assert_eq!(total, 1, "{reason}: one reason per request");
        assert!(e.dest().is_some_and(|d| d == A || d == B), "{reason}: routed");
    }
    // Too large: routed from the body's head without parsing it.
    {
        let e = synced(r#""max_body_bytes":16,"#, vec![], vec![], true);
        let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"a prompt past the limit"}"#);
        assert_eq!(action, Action::Continue);
        assert_eq!(e.counter("llmgw_fallbacks_total.reason.body_too_large"), 1);
    }
    // Not synced: the feed's snapshot has not completed (a fresh VM: no other root context of
    // this thread's "VM" may be alive, or the new one starts from its view).
    let mut e = env(&config(""));
    e.subscribe();
    e.feed(vec![Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true)] })]);
    let (_ctx, _) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.not_synced"), 1);
    assert_eq!(e.dest().as_deref(), Some(A));
    assert!(e.host.calls.borrow().is_empty(), "no tokenizer call without an index");
}

#[test]
fn exact_routing_sets_the_header_counts_in_flight_and_explains() {
    let tokens: Vec<u32> = (0..32).collect();
    let e = synced("", vec![], keys(&tokens), true);
    let (mut ctx, action) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(action, Action::Continue);
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 1);
    assert_eq!(e.host.samples("llmgw_matched_blocks"), vec![8]);
    assert_eq!(e.host.samples("llmgw_decision_us").len(), 1);
    let in_flight = e.host.shared_value("llmgw.inflight.v2").unwrap();
    assert_eq!(in_flight.len(), 20);
    ctx.on_http_response_headers(1, false);
    assert!(e
        .host
        .response_header("x-llmgw-decision")
        .unwrap()
        .starts_with(&format!("outcome=exact; replica={B}; matched=8/8")));
    ctx.on_log();
    assert_eq!(e.host.shared_value("llmgw.inflight.v2").unwrap(), Vec::<u8>::new());
}

/// A second worker VM of `e`'s Envoy (same host, so the same shared data), fed the same
/// replicas with `on_a` and `on_b` held.
fn second_vm(e: &Env, on_a: Vec<u64>, on_b: Vec<u64>) -> Env {
    let mut e2 = Env { host: e.host.clone(), root: Root::new(e.host.clone()), seq: 0 };
    assert!(e2.root.on_configure(0));
    e2.subscribe();
    e2.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: on_a }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: on_b }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    e2
}

#[test]
fn a_burst_sharing_a_new_prefix_follows_the_first_request_on_every_worker_before_any_event() {
    // 400 tokens (100 blocks of 4) nobody holds; the burst shares the first 160 (40 blocks).
    let prompt = |tail: u32| -> Vec<u32> { (0..160).chain(tail..tail + 240).collect() };
    let e1 = synced("", vec![], vec![], true);
    let mut e2 = second_vm(&e1, vec![], vec![]);
    let (mut c1, _) = e1.request(COMPLETIONS, &tokens_body("m", &prompt(1000)));
    let first = e1.dest().unwrap();
    let other = if first == A { B } else { A };
    assert_eq!(e1.counter("llmgw_prefix_decisions_total.outcome.approx"), 1);
    // Its first token, no KV event yet (vLLM publishes once blocks are computed, and the event
    // still has to cross the agent and the feed).
    e1.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
    c1.on_http_response_headers(2, false);
    c1.on_http_response_body(64, false);
    // Another worker: the shared blocks are credited to where the first went (32 leading
    // blocks, the deepest checkpoint within 40), so it follows, although that replica has a
    // request in flight and the other none (without the entries: the less loaded of the
    // prompt's two rendezvous choices, the other).
    let (mut c2, _) = e2.request(COMPLETIONS, &tokens_body("m", &prompt(2000)));
    assert_eq!(e2.dest(), Some(first.clone()));
    c2.on_http_response_headers(2, false);
    let explain = e2.host.response_header("x-llmgw-decision").unwrap();
    // The header says which of those blocks no KV event has confirmed yet: all 32.
    assert!(
        explain.starts_with(&format!("outcome=exact; replica={first}; matched=32/100; speculative=32;")),
        "{explain}"
    );
    c2.on_http_response_body(64, false);
    // A third while both are in flight: two requests there outweigh the shared blocks' prefill
    // (94 ms + 40 ms against 80 ms): load says otherwise.
    let (mut c3, _) = e1.request(COMPLETIONS, &tokens_body("m", &prompt(3000)));
    assert_eq!(e1.dest().as_deref(), Some(other));
    for c in [&mut c1, &mut c2, &mut c3] {
        c.on_log();
    }
    let new_again = |e: &Env, tail: u32| {
        let (mut c, _) = e.request(COMPLETIONS, &tokens_body("m", &prompt(tail)));
        c.on_http_response_headers(2, false);
        let explain = e.host.response_header("x-llmgw-decision").unwrap();
        assert!(explain.starts_with("outcome=approx;") && explain.contains("matched=0/100"), "{explain}");
        c.on_log();
    };
    // The feed says both engines restarted (their caches are empty): their entries no longer
    // count, on the worker that learned it; entries written afterwards do.
    e2.feed(vec![
        Msg::Reset(ReplicaReset { replica: 0, reason: "restart".into() }),
        Msg::Reset(ReplicaReset { replica: 1, reason: "restart".into() }),
    ]);
    e2.host.now_ns.set(e2.host.now_ns.get() + 1);
    new_again(&e2, 4000);
    e2.host.now_ns.set(e2.host.now_ns.get() + 1);
    let (mut c5, _) = e2.request(COMPLETIONS, &tokens_body("m", &prompt(5000)));
    c5.on_http_response_headers(2, false);
    let h5 = e2.host.response_header("x-llmgw-decision").unwrap();
    assert!(h5.starts_with("outcome=exact;"), "{h5}");
    c5.on_log();
    // Unconfirmed by any event, the entries expire: a prompt sharing the prefix is new again.
    e1.host.now_ns.set(e1.host.now_ns.get() + crate::speculative::TTL_NS);
    new_again(&e1, 6000);
}

/// In-flight requests and prefill tokens as every VM of this Envoy reads them.
fn inflight_at(e: &Env, address: &str) -> (u32, u64) {
    use llmgw_core::flow::InFlightCounts;
    let s = crate::gateway_state::Snapshot::read(e.host.as_ref());
    (s.in_flight(address), s.pending_tokens(address))
}

#[test]
fn prefill_tokens_count_on_every_worker_until_the_first_token_and_steer_the_next_request() {
    // 400 tokens (100 blocks of 4); B holds the first 10 blocks, A nothing.
    let t1: Vec<u32> = (0..400).collect();
    let mut t2: Vec<u32> = (0..40).collect();
    t2.extend(1000..1360);
    let held = keys(&t1)[..10].to_vec();
    // All of the queued prefill counts (`queued_prefill` 1, the default; said here because
    // the test depends on it).
    let cfg = config("").replace(r#""seed":"0"}"#, r#""seed":"0","weights":{"queued_prefill":1}}"#);
    let e1 = synced_with(&cfg, vec![], held.clone(), true);
    // A second worker VM of the same Envoy (same shared data), with the same feed.
    let e2 = second_vm(&e1, vec![], held);
    // Worker 1: B computes 360 tokens (72 ms predicted), A would compute 400 (80 ms): B.
    let (mut c1, _) = e1.request(COMPLETIONS, &tokens_body("m", &t1));
    assert_eq!(e1.dest().as_deref(), Some(B));
    assert_eq!(inflight_at(&e1, B), (1, 360));
    // The stream's headers come (vLLM sends them before any token): still prefilling.
    e1.host.set_header(Headers::Response, "content-type", Some("text/event-stream; charset=utf-8"));
    c1.on_http_response_headers(2, false);
    assert_eq!(inflight_at(&e1, B), (1, 360));
    let explain = e1.host.response_header("x-llmgw-decision").unwrap();
    assert!(explain.contains("predicted_ms=72.0; prefill_tokens=360; runner_up=127.0.0.1:8001 80.0"), "{explain}");
    // Worker 2, the same prefix while B still prefills: B now 360 + 360 queued tokens and a
    // request (184 ms), A 80 ms: A.
    let (mut c2, _) = e2.request(COMPLETIONS, &tokens_body("m", &t2));
    assert_eq!(e2.dest().as_deref(), Some(A));
    assert_eq!(inflight_at(&e2, A), (1, 400));
    // Its answer, not streamed, ends its prefill with the headers; then it ends.
    e2.host.set_header(Headers::Response, "content-type", Some("application/json"));
    c2.on_http_response_headers(2, false);
    assert_eq!(inflight_at(&e2, A), (1, 0));
    c2.on_log();
    // The first request's first chunk: its prefill is done (the body goes on unbuffered).
    assert_eq!(c1.on_http_response_body(120, false), Action::Continue);
    assert_eq!(inflight_at(&e1, B), (1, 0));
    assert_eq!(c1.on_http_response_body(80, false), Action::Continue);
    // Now B is a request (40 ms) from A's cost and holds more: the next one goes to B.
    let mut t3: Vec<u32> = (0..40).collect();
    t3.extend(2000..2360);
    let (mut c3, _) = e2.request(COMPLETIONS, &tokens_body("m", &t3));
    assert_eq!(e2.dest().as_deref(), Some(B));
    c3.on_log();
    c1.on_log();
    assert_eq!((inflight_at(&e1, A), inflight_at(&e1, B)), ((0, 0), (0, 0)));
}

#[test]
fn each_tokenizer_reply_is_counted_by_its_failure_and_the_request_resumes() {
    for (status, body, reason) in [
        (Some("504"), &b""[..], "timeout"),
        (Some("503"), b"", "unavailable"),
        (Some("500"), b"", "status"),
        (None, b"", "reset"),
        (Some("200"), b"not json", "bad_response"),
    ] {
        let e = synced("", vec![], vec![], true);
        let (mut ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hello"}"#);
        assert_eq!(action, Action::Pause, "{reason}: waits for the tokenizer");
        let call = e.host.last_call().unwrap();
        assert_eq!((call.cluster.as_str(), call.header(":path")), ("llmgw_tokenizer", Some("/tokenize")));
        assert_eq!(call.header(DEST), call.header(":authority"));
        assert!(e.dest().is_none(), "the client's destination is gone before the call");
        e.answer(&mut ctx, status, body);
        assert_eq!(e.counter(&format!("llmgw_tokenizer_failures_total.reason.{reason}")), 1, "{reason}");
        assert_eq!(e.counter("llmgw_fallbacks_total.reason.tokenizer"), 1);
        assert_eq!(e.host.resumed.get(), 1, "{reason}: resumed");
        assert!(e.dest().is_some(), "{reason}: routed anyway");
    }
    // The host refuses the callout: routed at once, counted as a dispatch failure.
    let e = synced("", vec![], vec![], true);
    e.host.refuse_calls.set(true);
    let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hello"}"#);
    assert_eq!(action, Action::Continue);
    assert_eq!(e.counter("llmgw_tokenizer_failures_total.reason.dispatch"), 1);
    assert_eq!(e.host.resumed.get(), 0);
    assert!(e.dest().is_some());
}

#[test]
fn no_healthy_replica_is_answered_503_with_a_json_error() {
    let e = synced("", vec![], vec![], false);
    let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!(action, Action::Pause);
    let replies = e.host.replies.borrow();
    assert_eq!(replies.len(), 1);
    let r = &replies[0];
    assert_eq!(r.status, 503);
    assert!(r.headers.contains(&("content-type".into(), "application/json".into())));
    assert!(r.headers.contains(&("x-llmgw-decision".into(), "outcome=no_replica".into())));
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "llmgw_no_replica");
    assert_eq!(v["error"]["message"], "no healthy replica for model `m`");
    assert!(e.dest().is_none());
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.no_replica"), 1);
}

#[test]
fn the_clients_destination_header_is_removed_on_every_path() {
    // Not configured (configure failed or never ran): removed, then passed through.
    let host = Rc::new(FakeHost::new().with_config(r#"{"profiles":[]}"#));
    let mut root = Root::new(host.clone());
    assert!(!root.on_configure(0));
    host.set_header(Headers::Request, DEST, Some("169.254.169.254:80"));
    let mut ctx = root.request();
    assert_eq!(ctx.on_http_request_headers(2, false), Action::Continue);
    assert_eq!(host.request_header(DEST), None);
    assert_eq!(ctx.on_http_request_body(10, true), Action::Continue);
    // A custom header name: both it and the default are removed.
    let e = synced(r#""destination_header":"x-route-to","#, vec![], vec![], false);
    e.host.set_header(Headers::Request, "x-route-to", Some("10.0.0.1:1"));
    let (_ctx, _) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!((e.host.request_header("x-route-to"), e.dest()), (None, None));
    // Headers only (no body): decided at once, the client's value replaced.
    let e = synced("", vec![], vec![], true);
    let (_ctx, action) = e.request(COMPLETIONS, b"");
    assert_eq!(action, Action::Continue);
    assert!(e.dest().is_some_and(|d| d == A || d == B));
    // A path the router does not read: routed by load, never to the client's choice.
    let (_ctx, _) = e.request("/metrics", b"x");
    assert!(e.dest().is_some_and(|d| d == A || d == B));
    // No healthy replica: answered locally, nothing forwarded anywhere.
    let e = synced("", vec![], vec![], false);
    let (_ctx, _) = e.request(COMPLETIONS, b"");
    assert_eq!(e.dest(), None);
}

#[test]
fn a_body_seen_again_is_routed_from_the_tokenization_cache_without_a_call() {
    let tokens: Vec<u32> = (0..24).collect();
    let e = synced("", vec![], keys(&tokens), true);
    let body = br#"{"model":"m","prompt":"hello"}"#;
    let (mut ctx, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Pause);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_tokenizer_cache_total.result.miss"), 1);
    // The same bytes: the raw-body alias, no call, no parse.
    let (_ctx, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Continue);
    assert_eq!(e.host.calls.borrow().len(), 1, "no second tokenizer call");
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_tokenizer_cache_total.result.hit"), 1);
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 2);
    // Past the time-to-live: asked again.
    e.host.now_ns.set(e.host.now_ns.get() + 61_000_000_000);
    let (_ctx, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Pause);
    assert_eq!(e.host.calls.borrow().len(), 2);
}

#[test]
fn after_a_reconnect_the_old_index_serves_until_the_new_snapshot_is_complete() {
    let old: Vec<u32> = (0..16).collect();
    let new: Vec<u32> = (100..116).collect();
    let mut e = synced("", vec![], keys(&old), true);
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &old));
    assert_eq!(e.dest().as_deref(), Some(B));
    // The stream closes; the next tick past the backoff resubscribes.
    let token = e.stream();
    e.root.on_grpc_stream_close(token, 14);
    assert_eq!(e.counter("llmgw_feed_disconnects_total"), 1);
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: keys(&new) }),
    ]);
    // Mid-resync: requests still see the old blocks, not the half-received new ones.
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &old));
    assert_eq!(e.dest().as_deref(), Some(B));
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &new));
    assert_eq!(e.host.samples("llmgw_matched_blocks").last(), Some(&0));
    e.feed(vec![Msg::SnapshotComplete(SnapshotComplete {})]);
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &new));
    assert_eq!(e.dest().as_deref(), Some(A));
    assert_eq!(e.host.samples("llmgw_matched_blocks").last(), Some(&4));
    assert_eq!(e.counter("llmgw_feed_connects_total"), 2);
}

#[test]
fn a_feed_gap_resubscribes_and_keeps_serving() {
    let tokens: Vec<u32> = (0..16).collect();
    let mut e = synced("", vec![], keys(&tokens), true);
    let first = e.stream();
    e.seq += 5;
    e.feed(vec![Msg::Heartbeat(llmgw_core::feed::Heartbeat {})]);
    assert_eq!(e.counter("llmgw_feed_rejected_total"), 1);
    assert_eq!(e.host.cancelled.borrow().as_slice(), &[first]);
    let (_c, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert!(e.subscribe() != first);
}

#[test]
fn a_configuration_error_is_refused_and_a_new_one_replaces_the_old_whole() {
    let host = Rc::new(FakeHost::new().with_config(r#"{"profiles":[{"name":"a","models":["m"],"block_size":0}]}"#));
    let mut root = Root::new(host.clone());
    assert!(!root.on_configure(0));
    host.set_buffer(Buffer::PluginConfiguration, config("").as_bytes());
    assert!(root.on_configure(0));
    assert!(host.tick.get().is_some());
    // Reconfigured with another destination header: requests use it at once.
    host.set_buffer(Buffer::PluginConfiguration, config(r#""destination_header":"x-to","#).as_bytes());
    assert!(root.on_configure(0));
    let mut e = Env { host, root, seq: 0 };
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true)] }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    let (_c, _) = e.request(COMPLETIONS, b"");
    assert_eq!(e.host.request_header("x-to").as_deref(), Some(A));
}

fn hash_settings(seed: &str) -> llmgw_core::feed::HashSettings {
    llmgw_core::feed::HashSettings {
        algo: "sha256_cbor".into(),
        seeded: true,
        seed: seed.into(),
        block_size: BS as u32,
        lookahead_tokens: 0,
    }
}

#[test]
fn a_profile_whose_seed_disagrees_with_the_feed_counts_logs_both_values_and_falls_back() {
    crate::fake::capture_logs();
    let tokens: Vec<u32> = (0..32).collect();
    // The replicas hash with seed "0" (their blocks are keyed so); the profile says "1".
    let mut e = env(&config("").replace(r#""seed":"0""#, r#""seed":"1""#));
    e.subscribe();
    let with = |id, address| Replica { hash: Some(hash_settings("0")), dp_size: 1, ..replica(id, address, true) };
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![with(0, A), with(1, B)] }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: keys(&tokens) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    for _ in 0..2 {
        let (_ctx, action) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
        assert_eq!(action, Action::Continue);
        assert!(e.dest().is_some_and(|d| d == A || d == B), "routed anyway");
    }
    assert_eq!(e.counter("llmgw_hash_mismatch_total"), 2);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.hash_mismatch"), 2);
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.approx"), 2);
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 0);
    let warnings: Vec<String> = crate::fake::logs()
        .into_iter()
        .filter(|(l, m)| *l == log::Level::Warn && m.contains("hash settings"))
        .map(|(_, m)| m)
        .collect();
    assert_eq!(warnings.len(), 1, "logged once: {warnings:?}");
    assert!(
        warnings[0].contains(r#"replica `r1` rank 0 (127.0.0.1:8002) hashes with seed "0" (profile `p` uses "1")"#),
        "{}",
        warnings[0]
    );
    assert!(warnings[0].ends_with("routing by the fallback"), "{}", warnings[0]);
    // The same profile agreeing with the feed routes exactly, nothing counted.
    let e = synced("", vec![], keys(&tokens), true);
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!((e.dest().as_deref(), e.counter("llmgw_hash_mismatch_total")), (Some(B), 0));
}

#[test]
fn a_data_parallel_engine_is_named_in_x_data_parallel_rank() {
    let tokens: Vec<u32> = (0..32).collect();
    let other: Vec<u32> = (100..132).collect();
    // Replica A runs two data-parallel ranks (two engines, one address); B runs one.
    let mut e = env(&config(""));
    e.subscribe();
    let rank = |id, r| Replica { dp_rank: r, dp_size: 2, ..replica(id, A, true) };
    e.feed(vec![
        Msg::Replicas(ReplicaTable {
            replicas: vec![rank(0, 0), rank(1, 1), Replica { dp_size: 1, ..replica(2, B, true) }],
        }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: keys(&tokens) }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: keys(&other) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    for (prompt, want) in [(&tokens, "1"), (&other, "0")] {
        let (_ctx, _) = e.request_with(COMPLETIONS, &tokens_body("m", prompt), &[("x-data-parallel-rank", "7")]);
        assert_eq!(e.dest().as_deref(), Some(A));
        assert_eq!(e.host.request_header("x-data-parallel-rank").as_deref(), Some(want));
        assert_eq!(e.host.samples("llmgw_matched_blocks").last(), Some(&8));
    }
    // A replica that is not data-parallel gets no rank; a client's value is removed.
    let b_only: Vec<u32> = (200..232).collect();
    e.feed(vec![Msg::Delta(llmgw_core::feed::BlockDelta { replica: 2, added: keys(&b_only), removed: vec![] })]);
    let (_ctx, _) = e.request_with(COMPLETIONS, &tokens_body("m", &b_only), &[("x-data-parallel-rank", "1")]);
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.host.request_header("x-data-parallel-rank"), None);
}

#[test]
fn a_replica_answering_5xx_is_avoided_from_the_next_request_then_tried_again() {
    let tokens: Vec<u32> = (0..32).collect();
    let e = synced("", vec![], keys(&tokens), true);
    e.host.now_ns.set(1_000_000_000);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    e.host.set_header(Headers::Response, ":status", Some("503"));
    ctx.on_http_response_headers(1, false);
    ctx.on_log();
    // The holder is avoided: the next request goes to the other replica.
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(A));
    // Every replica failing: none is avoided (requests still go out).
    e.host.set_header(Headers::Response, ":status", Some("502"));
    ctx.on_http_response_headers(1, false);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    e.host.set_header(Headers::Response, ":status", Some("200"));
    ctx.on_http_response_headers(1, false);
    // A second later it is tried again (and an answer below 500 clears it).
    e.host.now_ns.set(2_000_000_001);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    e.host.set_header(Headers::Response, ":status", Some("200"));
    ctx.on_http_response_headers(1, false);
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
}

#[test]
fn a_tokenizer_that_times_out_is_left_alone_by_every_worker_then_tried_again() {
    let hello = br#"{"model":"m","prompt":"hello"}"#;
    let tokens: Vec<u32> = (0..8).collect();
    let e = synced("", vec![], vec![], true);
    e.host.now_ns.set(1_000_000_000);
    let target = |e: &Env| e.host.last_call().unwrap().header(":authority").map(str::to_owned);
    // Each request ends (its in-flight count goes) so that equal loads choose A first.
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    assert_eq!(target(&e).as_deref(), Some(A));
    e.answer(&mut ctx, Some("504"), b"");
    ctx.on_log();
    // The next call (any worker: the record is shared) goes to B; B times out too.
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    assert_eq!(target(&e).as_deref(), Some(B));
    e.answer(&mut ctx, None, b"");
    ctx.on_log();
    // Both failing: no call at all, routed at once.
    let calls = e.host.calls.borrow().len();
    let (mut ctx, action) = e.request(COMPLETIONS, hello);
    assert_eq!((action, e.host.calls.borrow().len()), (Action::Continue, calls));
    assert_eq!(e.counter("llmgw_tokenizer_failures_total.reason.circuit_open"), 1);
    assert!(e.dest().is_some());
    ctx.on_log();
    // A second later A is tried again, and a good answer clears it.
    e.host.now_ns.set(2_000_000_001);
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    assert_eq!(target(&e).as_deref(), Some(A));
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&tokens));
    ctx.on_log();
    // A 4xx says nothing about the tokenizer: A stays in use.
    let (mut ctx, _) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"other"}"#);
    assert_eq!(target(&e).as_deref(), Some(A));
    e.answer(&mut ctx, Some("400"), b"");
    ctx.on_log();
    let (_ctx, _) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"third"}"#);
    assert_eq!(target(&e).as_deref(), Some(A), "a 400 does not open the circuit");
}

#[test]
fn while_the_agent_is_away_loads_then_the_index_go_stale_and_come_back_with_it() {
    use llmgw_core::feed::{LoadReport, ReplicaLoad};
    let tokens: Vec<u32> = (0..32).collect();
    // B holds the prompt but reports a long queue; A is idle.
    let mut e = synced("", vec![], keys(&tokens), true);
    let load = |replica, waiting| ReplicaLoad { replica, running: 0, waiting, kv_cache_usage: 0.0 };
    e.feed(vec![Msg::Load(LoadReport { loads: vec![load(0, 0), load(1, 40)] })]);
    let t0 = e.host.now_ns.get();
    let at = |e: &mut Env, ms: u64| {
        e.host.now_ns.set(t0 + ms * 1_000_000);
        e.root.on_tick();
    };
    let go = |e: &Env| {
        let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
        ctx.on_log();
        e.dest()
    };
    at(&mut e, 100);
    assert_eq!(go(&e).as_deref(), Some(A), "B's reported queue outweighs its hit");
    // The agent falls silent. After loads_stale_ms (5 s) B's old queue no longer counts.
    at(&mut e, 5_100);
    assert_eq!(go(&e).as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 1);
    // After index_stale_ms (60 s) the index is not credited: the fallback routes, named.
    at(&mut e, 60_100);
    let _ = go(&e);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.stale"), 1);
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 1);
    // The agent is back: a new stream, its table and snapshot.
    e.subscribe();
    e.feed(vec![
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: keys(&tokens) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]);
    e.root.on_tick();
    assert_eq!(go(&e).as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_prefix_decisions_total.outcome.exact"), 2);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.stale"), 1);
}

#[test]
fn a_vm_resubscribes_within_the_backoff_cap_however_long_the_agent_was_away() {
    let mut e = synced("", vec![], vec![], true);
    // The agent is gone: every attempt's stream closes at once, for a long outage.
    for _ in 0..20 {
        let token = e.stream();
        e.root.on_grpc_stream_close(token, 14);
        e.subscribe();
    }
    // It is back: the next attempt comes within half a second of the last failure (so the
    // fault suite's target, every VM's index equal to the agent's within 1 s, holds).
    let token = e.stream();
    e.root.on_grpc_stream_close(token, 14);
    let before = e.host.streams.borrow().len();
    e.host.now_ns.set(e.host.now_ns.get() + 500_000_001);
    e.root.on_tick();
    assert_eq!(e.host.streams.borrow().len(), before + 1, "no attempt within 500 ms of the last failure");
}

#[test]
fn a_new_root_context_routes_from_its_first_request_with_the_view_of_another_in_its_vm() {
    // A VM already subscribed (root context 1); a listener change brings root context 2 with
    // another filter configuration, whose own feed has not delivered anything yet.
    let held: Vec<u32> = (0..16).collect();
    let first = synced("", vec![], keys(&held), true);
    let host = first.host.clone();
    host.set_buffer(Buffer::PluginConfiguration, config(r#""tokenizer_cache_ttl_ms":1234,"#).as_bytes());
    let mut second = Root::new(host.clone());
    assert!(second.on_configure(0));
    let e = Env { host, root: second, seq: 0 };
    let (_ctx, action) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(action, Action::Continue);
    assert!(e.host.replies.borrow().is_empty(), "answered instead of routed");
    assert_eq!(e.dest().as_deref(), Some(B), "routed to the replica holding the prefix");
    drop(first);
}

#[test]
fn a_vm_reloaded_after_a_crash_routes_by_load_from_the_replica_table_kept_in_shared_data() {
    // A VM that received the feed's table crashes (all its root contexts are gone); Envoy
    // starts a new VM on the same host, whose feed has delivered nothing yet.
    let first = synced("", vec![], vec![], true);
    let host = first.host.clone();
    drop(first);
    let mut root = Root::new(host.clone());
    assert!(root.on_configure(0));
    let e = Env { host, root, seq: 0 };
    let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!(action, Action::Continue);
    assert!(e.host.replies.borrow().is_empty(), "answered instead of routed");
    assert!(e.dest().is_some_and(|d| d == A || d == B), "routed to a replica of the kept table");
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.not_synced"), 1);
}

#[test]
fn a_new_root_context_fed_by_another_agent_starts_from_nothing_of_this_ones() {
    let held: Vec<u32> = (0..16).collect();
    let first = synced("", vec![], keys(&held), true);
    let host = first.host.clone();
    host.set_buffer(Buffer::PluginConfiguration, config(r#""agent_cluster":"other_fleet","#).as_bytes());
    // Neither the view of a live root context of another fleet…
    let mut second = Root::new(host.clone());
    assert!(second.on_configure(0));
    let e = Env { host: host.clone(), root: second, seq: 0 };
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(e.host.replies.borrow().last().map(|r| r.status), Some(503), "routed from another fleet's view");
    drop(first);
    // …nor its table kept in shared data.
    let mut third = Root::new(host.clone());
    assert!(third.on_configure(0));
    let e = Env { host, root: third, seq: 0 };
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(e.host.replies.borrow().len(), 2, "routed from another fleet's table");
}

#[test]
fn a_view_a_new_vm_or_root_starts_from_is_held_to_its_own_allowlist() {
    let held: Vec<u32> = (0..16).collect();
    // B holds the prompt; the new configuration allows only A's port.
    let first = synced("", vec![], keys(&held), true);
    let host = first.host.clone();
    host.set_buffer(Buffer::PluginConfiguration, config(r#""allowed_destinations":["127.0.0.1:8001"],"#).as_bytes());
    let mut second = Root::new(host.clone());
    assert!(second.on_configure(0));
    let e = Env { host: host.clone(), root: second, seq: 0 };
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
    assert_eq!(e.dest().as_deref(), Some(A), "the other root's view, with its allowlist");
    drop(e);
    drop(first);
    // From the table kept in shared data (a VM reloaded after a crash).
    let mut third = Root::new(host.clone());
    assert!(third.on_configure(0));
    let e = Env { host, root: third, seq: 0 };
    for _ in 0..4 {
        let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &held));
        assert_eq!(e.dest().as_deref(), Some(A), "the kept table, unchecked");
        ctx.on_log();
    }
}

#[test]
fn shared_data_updates_that_give_up_are_counted_by_what_they_keep() {
    use crate::host::CAS_RETRIES;
    const IN_FLIGHT: &str = "llmgw.inflight.v2";
    let tokens: Vec<u32> = (0..32).collect();
    let e = synced("", vec![], keys(&tokens), true);
    let gave_up = |what: &str| e.counter(&format!("llmgw_shared_update_failures_total.what.{what}"));
    for what in ["in_flight", "heartbeat", "health", "tokenizer_health", "speculative"] {
        assert_eq!(gave_up(what), 0, "{what}");
    }
    // Races lost fewer times than the retries: the update lands, nothing is counted.
    e.host.cas_failures.set(CAS_RETRIES - 1);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.host.cas_failures.get(), 0);
    assert_eq!(e.host.shared_value(IN_FLIGHT).map(|v| v.len()), Some(20));
    assert_eq!(gave_up("in_flight"), 0);
    ctx.on_log();
    // Every attempt lost: the in-flight count stays unwritten, and that is counted.
    e.host.cas_failures.set(CAS_RETRIES);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.host.shared_value(IN_FLIGHT), Some(Vec::new()));
    assert_eq!(gave_up("in_flight"), 1);
    // The replica's 5xx not recorded as passive health.
    e.host.cas_failures.set(CAS_RETRIES);
    e.host.set_header(Headers::Response, ":status", Some("503"));
    ctx.on_http_response_headers(1, false);
    assert_eq!(gave_up("health"), 1);
    ctx.on_log();
    // A prompt nobody holds is recorded in the speculative entries: both updates give up.
    let other: Vec<u32> = (100..132).collect();
    e.host.cas_failures.set(2 * CAS_RETRIES);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &other));
    assert_eq!(e.host.cas_failures.get(), 0);
    assert_eq!((gave_up("in_flight"), gave_up("speculative")), (2, 1));
    ctx.on_log();
    // A heartbeat due on the tick, not renewed.
    e.host.now_ns.set(e.host.now_ns.get() + crate::inflight::HEARTBEAT_NS);
    e.host.cas_failures.set(CAS_RETRIES);
    let mut root = e.root;
    root.on_tick();
    assert_eq!(e.host.cas_failures.get(), 0);
    assert_eq!(e.host.counter("llmgw_shared_update_failures_total.what.heartbeat"), Some(1));
}

#[test]
fn the_manual_lists_every_metric_and_label_value_the_filter_defines() {
    let manual = include_str!("../docs/src/operations.md");
    let start = manual.find("### Metrics (Envoy `/stats/prometheus`)").expect("the metrics section");
    let section = &manual[start..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    // Every metric, the per-VM gauges too (defined on the first tick, which `synced` gives).
    let e = synced("", vec![], vec![], true);
    let names = e.host.metric_names();
    assert!(names.iter().any(|n| n.starts_with("llmgw_destinations_refused.vm.")), "{names:?}");
    for name in names {
        let mut parts = name.split('.');
        let base = parts.next().unwrap();
        match (parts.next(), parts.next()) {
            (None, _) => assert!(section.contains(&format!("`{base}`")), "{base} not in the manual"),
            (Some("vm"), Some(_)) => {
                assert!(section.contains(&format!("`{base}{{vm=…}}`")), "{name} not in the manual")
            }
            (Some(tag), Some(value)) => {
                let open = format!("`{base}{{{tag}=\"");
                let at = section.find(&open).unwrap_or_else(|| panic!("{base}{{{tag}}} not in the manual"));
                let values = &section[at + open.len()..];
                let values = &values[..values.find('"').unwrap()];
                assert!(values.split('|').any(|v| v == value), "{name}: {value} not among {values}");
            }
            _ => panic!("unexpected metric name {name}"),
        }
    }
}
