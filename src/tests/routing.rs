//! Routing through the filter: decisions, fallbacks, the tokenizer call, the destination header.

use super::*;

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
    let in_flight = e.host.shared_value("llmgw.inflight.v3").unwrap();
    assert_eq!(in_flight.len(), 24);
    ctx.on_http_response_headers(1, false);
    assert!(e
        .host
        .response_header("x-llmgw-decision")
        .unwrap()
        .starts_with(&format!("outcome=exact; replica={B}; matched=8/8")));
    ctx.on_log();
    assert_eq!(e.host.shared_value("llmgw.inflight.v3").unwrap(), Vec::<u8>::new());
}

#[test]
fn requests_in_flight_count_the_blocks_their_prompts_hold_and_their_ends_time_the_hold() {
    use llmgw_core::flow::InFlightCounts;
    let held = |e: &Env| {
        let host: Rc<dyn Host> = e.host.clone();
        let s = crate::gateway_state::Snapshot::read(&host);
        (s.held_blocks(B), s.hold_us(B))
    };
    // 32 tokens in blocks of 4, all 8 on B; a second prompt shares them and has 3 of its own
    // (10 tokens past them: the last block partly filled).
    let tokens: Vec<u32> = (0..32).collect();
    let longer: Vec<u32> = (0..42).collect();
    // Requests in flight cost nothing here: every request goes where its blocks are.
    let rates = r#""weights":{"request_us":0,"learn_rates":false}"#;
    let cfg = config("").replace(r#""seed":"0"}"#, &format!(r#""seed":"0",{rates}}}"#));
    let e1 = synced_with(&cfg, vec![], keys(&tokens), true);
    let e2 = second_vm(&e1, vec![], keys(&tokens));
    e1.host.now_ns.set(1_000_000_000);
    let (mut c1, _) = e1.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(held(&e1), (8, 0.0));
    // On the same worker, the shared run counts once: its own 3 blocks are added.
    let (mut c2, _) = e1.request(COMPLETIONS, &tokens_body("m", &longer));
    assert_eq!(e1.dest().as_deref(), Some(B));
    assert_eq!(held(&e1), (11, 0.0));
    // Another worker's request sharing it counts it again (once per worker).
    let (mut c3, _) = e2.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e2.dest().as_deref(), Some(B));
    assert_eq!(held(&e1), (19, 0.0));
    // The run stays while a request of its worker shares it; each end times a hold.
    e1.host.now_ns.set(1_400_000_000);
    c1.on_log();
    assert_eq!(held(&e1), (19, 400_000.0));
    c2.on_log();
    c3.on_log();
    assert_eq!(held(&e1).0, 0);
    assert_eq!(e1.host.shared_value("llmgw.inflight.v3").unwrap(), Vec::<u8>::new());
}

/// Two prompts of 32 tokens (8 blocks of 4), the blocks of both on B, and a configuration
/// predicting 200 µs per prompt token and nothing per request, with no rates learned.
struct Prompts {
    p1: Vec<u32>,
    p2: Vec<u32>,
    on_b: Vec<u64>,
    cfg: String,
}

fn two_prompts_on_b() -> Prompts {
    let (p1, p2): (Vec<u32>, Vec<u32>) = ((0..32).collect(), (100..132).collect());
    let on_b = [keys(&p1), keys(&p2)].concat();
    let rates = r#""weights":{"prefill_us_per_token":200,"request_us":0,"learn_rates":false}"#;
    let cfg = config("").replace(r#""seed":"0"}"#, &format!(r#""seed":"0",{rates}}}"#));
    Prompts { p1, p2, on_b, cfg }
}

/// A request for `prompt` routed to B and ended a second later (B's hold is then known), then
/// another routed there and left in flight (returned).
fn one_on_b_after_a_hold_of_a_second(e: &Env, prompt: &[u32]) -> Request {
    let t0 = e.host.now_ns.get();
    let (mut c0, _) = e.request(COMPLETIONS, &tokens_body("m", prompt));
    assert_eq!(e.dest().as_deref(), Some(B));
    e.host.now_ns.set(t0 + 1_000_000_000);
    c0.on_log();
    let (c1, _) = e.request(COMPLETIONS, &tokens_body("m", prompt));
    assert_eq!(e.dest().as_deref(), Some(B));
    c1
}

#[test]
fn a_prompt_that_does_not_fit_beside_the_blocks_held_on_its_holder_goes_where_it_fits() {
    use llmgw_core::feed::{LoadReport, ReplicaLoad};
    // B holds two prompts of 8 blocks each; its KV cache holds 12 blocks (the agent says so
    // with its load). Requests in flight cost nothing else: without the cache's size every
    // request goes to B.
    let Prompts { p1, p2, on_b, cfg } = two_prompts_on_b();
    for (gpu_blocks, second) in [(12, A), (0, B)] {
        let mut e = synced_with(&cfg, vec![], on_b.clone(), true);
        let load = |replica| ReplicaLoad { replica, running: 0, waiting: 0, kv_cache_usage: 0.0, gpu_blocks };
        e.feed(vec![Msg::Load(LoadReport { loads: vec![load(0), load(1)] })]);
        e.root.on_tick();
        // A first request to B held its blocks there for a second; another holds 8 of B's 12
        // blocks while the second prompt comes: on B it would wait for that one to end (half a
        // second's hold), on A compute 32 tokens (6.4 ms).
        let mut c1 = one_on_b_after_a_hold_of_a_second(&e, &p1);
        let (mut c2, _) = e.request(COMPLETIONS, &tokens_body("m", &p2));
        assert_eq!(e.dest().as_deref(), Some(second), "cache of {gpu_blocks} blocks");
        // The access log says what the holder, the runner-up, would have waited.
        let line = e.host.property("llmgw_decision").unwrap();
        assert_eq!(line.contains(" capacity_wait_us=0/500000"), gpu_blocks > 0, "{line}");
        c1.on_log();
        c2.on_log();
    }
}

#[test]
fn blocks_the_engine_reports_beyond_this_envoys_requests_count_against_the_room() {
    use llmgw_core::feed::{LoadReport, ReplicaLoad};
    // B holds two prompts of 8 blocks each in a cache of 20. One request of this Envoy holds 8
    // there: the second prompt fits beside it (16), and stays on B, unless the engine reports
    // more in use than this Envoy's requests held as the report came (another gateway's request
    // of 6 blocks: 22).
    let Prompts { p1, p2, on_b, cfg } = two_prompts_on_b();
    for (in_use, second) in [(8, B), (14, A)] {
        let mut e = synced_with(&cfg, vec![], on_b.clone(), true);
        let load = |replica, running, blocks: u32| ReplicaLoad {
            replica,
            running,
            waiting: 0,
            kv_cache_usage: blocks as f32 / 20.0,
            gpu_blocks: 20,
        };
        e.feed(vec![Msg::Load(LoadReport { loads: vec![load(0, 0, 0), load(1, 0, 0)] })]);
        e.root.on_tick();
        // Another holds 8 blocks there when the engine reports `in_use` blocks by two requests.
        let mut c1 = one_on_b_after_a_hold_of_a_second(&e, &p1);
        e.feed(vec![Msg::Load(LoadReport { loads: vec![load(0, 0, 0), load(1, 2, in_use)] })]);
        let (mut c2, _) = e.request(COMPLETIONS, &tokens_body("m", &p2));
        assert_eq!(e.dest().as_deref(), Some(second), "{in_use} blocks in use");
        c1.on_log();
        c2.on_log();
    }
}

#[test]
fn a_burst_sharing_a_new_prefix_follows_the_first_request_on_every_worker_before_any_event() {
    // 400 tokens (100 blocks of 4) nobody holds; the burst shares the first 160 (40 blocks).
    let prompt = |tail: u32| -> Vec<u32> { (0..160).chain(tail..tail + 240).collect() };
    // The rates below are said here, and not learned, because the test depends on them.
    let rates = r#""weights":{"prefill_us_per_token":200,"request_us":40000,"learn_rates":false}"#;
    let cfg = config("").replace(r#""seed":"0"}"#, &format!(r#""seed":"0",{rates}}}"#));
    let e1 = synced_with(&cfg, vec![], vec![], true);
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
    e1.host.now_ns.set(e1.host.now_ns.get() + llmgw_core::flow::SPECULATIVE_TTL_NS);
    new_again(&e1, 6000);
}

#[test]
fn prefill_tokens_count_on_every_worker_until_the_first_token_and_steer_the_next_request() {
    // 400 tokens (100 blocks of 4); B holds the first 10 blocks, A nothing.
    let t1: Vec<u32> = (0..400).collect();
    let mut t2: Vec<u32> = (0..40).collect();
    t2.extend(1000..1360);
    let held = keys(&t1)[..10].to_vec();
    // All of the queued prefill counts (`queued_prefill` 1, the default), at 200 µs a token and
    // 40 ms a request, not learned: said here because the test depends on them.
    let weights = r#""weights":{"queued_prefill":1,"prefill_us_per_token":200,"request_us":40000,"learn_rates":false}"#;
    let cfg = config("").replace(r#""seed":"0"}"#, &format!(r#""seed":"0",{weights}}}"#));
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
fn each_phase_of_a_routed_request_is_recorded_and_written_for_the_access_log() {
    let tokens: Vec<u32> = (0..24).collect();
    let e = synced("", vec![], keys(&tokens), true);
    let body = br#"{"model":"m","prompt":"hello"}"#;
    let step = |us: u64| e.host.now_ns.set(e.host.now_ns.get() + us * 1_000);
    // Headers, 200 µs of upload, a tokenizer call answered after 400 µs.
    e.host.next_request();
    e.host.set_header(Headers::Request, ":path", Some(COMPLETIONS));
    e.host.set_buffer(Buffer::Request, body);
    let mut ctx = e.root.request();
    assert_eq!(ctx.on_http_request_headers(3, false), Action::Pause);
    step(200);
    assert_eq!(ctx.on_http_request_body(body.len(), true), Action::Pause);
    step(400);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.host.samples("llmgw_phase_body_us"), vec![200]);
    assert_eq!(e.host.samples("llmgw_tokenizer_latency_us"), vec![400]);
    assert_eq!(e.host.samples("llmgw_phase_gateway_us"), vec![600]);
    assert_eq!(e.host.property("llmgw_phases"), None, "written once the answer starts");
    // The replica's headers after 1 ms, its first chunk 2 ms later; a second chunk changes nothing.
    step(1_000);
    e.host.set_header(Headers::Response, ":status", Some("200"));
    e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
    ctx.on_http_response_headers(2, false);
    step(2_000);
    ctx.on_http_response_body(10, false);
    step(5_000);
    ctx.on_http_response_body(10, true);
    assert_eq!(e.host.samples("llmgw_phase_upstream_first_byte_us"), vec![1_000]);
    assert_eq!(e.host.samples("llmgw_phase_upstream_first_chunk_us"), vec![3_000]);
    assert_eq!(
        e.host.property("llmgw_phases").as_deref(),
        Some(
            "body_us=200 tokenizer_us=400 decision_us=0 gateway_us=600 upstream_first_byte_us=1000 \
             upstream_first_chunk_us=3000"
        )
    );
    assert!(!e.host.property("llmgw_phases").unwrap().contains("127.0.0.1"), "no replica address");
    ctx.on_log();

    // The same body again: from the tokenization cache, no tokenizer phase; an answer without a
    // body is written at its headers.
    let (mut ctx, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Continue);
    ctx.on_http_response_headers(2, true);
    assert_eq!(e.host.samples("llmgw_tokenizer_latency_us").len(), 1);
    assert_eq!(e.host.samples("llmgw_phase_gateway_us").len(), 2);
    assert_eq!(
        e.host.property("llmgw_phases").as_deref(),
        Some("body_us=0 decision_us=0 gateway_us=0 upstream_first_byte_us=0")
    );

    // Answered 503 by the filter: the phases up to that answer.
    let e = synced("", vec![], vec![], false);
    let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!(action, Action::Pause);
    assert_eq!(e.host.property("llmgw_phases").as_deref(), Some("body_us=0 decision_us=0 gateway_us=0"));
}

#[test]
fn a_body_past_the_vms_body_budget_is_routed_by_its_head_until_the_held_one_is_routed() {
    let tokens: Vec<u32> = (0..24).collect();
    let body = br#"{"model":"m","prompt":"hello, a prompt that is tokenized by a call"}"#;
    // Room for one such body (counted twice) while it waits for its tokenizer call.
    let budget = 2 * body.len() + 10;
    let e = synced(&format!(r#""body_budget_bytes":{budget},"tokenizer_cache_bytes":0,"#), vec![], keys(&tokens), true);
    let (mut first, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Pause, "read whole, waiting for its call");
    assert_eq!(crate::body_budget::held(), 2 * body.len());
    // A second one meanwhile: not copied, routed by its leading bytes at once, counted.
    let (_second, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Continue);
    assert_eq!(e.host.calls.borrow().len(), 1, "no call for the second");
    assert!(e.dest().is_some());
    assert_eq!(e.counter("llmgw_body_budget_exhausted_total"), 1);
    assert_eq!(e.counter("llmgw_fallbacks_total.reason.body_too_large"), 1);
    // The first one routed: its room is given back, and the next body is read whole again.
    e.answer(&mut first, Some("200"), &tokenize_answer(&tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(crate::body_budget::held(), 0);
    let (_third, action) = e.request(COMPLETIONS, body);
    assert_eq!(action, Action::Pause);
    assert_eq!(e.host.calls.borrow().len(), 2);
    assert_eq!(e.counter("llmgw_body_budget_exhausted_total"), 1);
}

#[test]
fn the_decision_is_written_for_the_access_log_whatever_the_explain_header() {
    let tokens: Vec<u32> = (0..24).collect();
    // Explain header off (the default): the access log still gets the decision.
    let e = synced_with(&config("").replace(r#""explain_header":true,"#, ""), vec![], keys(&tokens), true);
    let body = br#"{"model":"m","prompt":"hello"}"#;
    e.host.next_request();
    e.host.set_header(Headers::Request, ":path", Some(COMPLETIONS));
    e.host.set_buffer(Buffer::Request, body);
    let mut ctx = e.root.request();
    assert_eq!(ctx.on_http_request_headers(3, false), Action::Pause);
    assert_eq!(ctx.on_http_request_body(body.len(), true), Action::Pause);
    assert_eq!(e.host.property("llmgw_decision"), None, "nothing decided while the tokenizer works");
    e.host.now_ns.set(e.host.now_ns.get() + 400_000);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    let line = e.host.property("llmgw_decision").unwrap();
    assert!(line.starts_with(&format!("outcome=exact replica={B} matched=6/6 predicted_us=")), "{line}");
    assert!(line.ends_with(" tokenizer_us=400"), "{line}");
    ctx.on_http_response_headers(2, true);
    assert_eq!(e.host.response_header("x-llmgw-decision"), None);

    // A fallback names its reason; no tokenizer call, no tokenizer time.
    let (_ctx, _) = e.request(COMPLETIONS, br#"{"model":"plain","prompt":"hello"}"#);
    let line = e.host.property("llmgw_decision").unwrap();
    assert!(line.starts_with("outcome=approx replica=127.0.0.1:800"), "{line}");
    assert!(line.ends_with(" matched=0/0 fallback=no_kv_events"), "{line}");

    // Answered 503 by the filter.
    let e = synced("", vec![], vec![], false);
    let (_ctx, action) = e.request(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#);
    assert_eq!(action, Action::Pause);
    assert_eq!(e.host.property("llmgw_decision").as_deref(), Some("outcome=no_replica"));
}
