//! What the workers share: passive health, the tokenizer breaker, shared-data failures, metrics.

use super::*;

#[test]
fn a_replica_answering_5xx_is_avoided_from_the_next_request_then_tried_again() {
    let tokens: Vec<u32> = (0..32).collect();
    // B holds a second prompt nobody sends until the end: routing it shows whether B is avoided
    // (the first prompt, once routed to A, is held by both as far as the filter knows).
    let other: Vec<u32> = (100..132).collect();
    let e = synced("", vec![], [keys(&tokens), keys(&other)].concat(), true);
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
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &other));
    assert_eq!(e.dest().as_deref(), Some(B));
    e.host.set_header(Headers::Response, ":status", Some("200"));
    ctx.on_http_response_headers(1, false);
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &other));
    assert_eq!(e.dest().as_deref(), Some(B));
}

#[test]
fn a_tokenizer_that_times_out_is_left_alone_by_every_worker_then_tried_again() {
    let hello = br#"{"model":"m","prompt":"hello"}"#;
    let tokens: Vec<u32> = (0..8).collect();
    let e = synced("", vec![], vec![], true);
    e.host.now_ns.set(1_000_000_000);
    let target = |e: &Env| e.host.last_call().unwrap().header(":authority").map(str::to_owned);
    // Each request ends (its in-flight count goes), so that loads are equal and a prompt's
    // call goes where its rendezvous order puts it first.
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    let first = target(&e).unwrap();
    let second = if first == A { B } else { A };
    e.answer(&mut ctx, Some("504"), b"");
    ctx.on_log();
    // The same prompt's next call (any worker: the record is shared) goes to the other; it
    // times out too.
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    assert_eq!(target(&e).as_deref(), Some(second));
    e.answer(&mut ctx, None, b"");
    ctx.on_log();
    // Both failing: no call at all, routed at once.
    let calls = e.host.calls.borrow().len();
    let (mut ctx, action) = e.request(COMPLETIONS, hello);
    assert_eq!((action, e.host.calls.borrow().len()), (Action::Continue, calls));
    assert_eq!(e.counter("llmgw_tokenizer_failures_total.reason.circuit_open"), 1);
    assert!(e.dest().is_some());
    ctx.on_log();
    // A second later both are tried again, and a good answer clears the first.
    e.host.now_ns.set(2_000_000_001);
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    assert_eq!(target(&e).as_deref(), Some(first.as_str()));
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&tokens));
    ctx.on_log();
    // A 4xx says nothing about the tokenizer: the same prompt's next call goes there again.
    let other = br#"{"model":"m","prompt":"other"}"#;
    let (mut ctx, _) = e.request(COMPLETIONS, other);
    let to = target(&e);
    e.answer(&mut ctx, Some("400"), b"");
    ctx.on_log();
    let (_ctx, _) = e.request(COMPLETIONS, other);
    assert_eq!(target(&e), to, "a 400 does not open the circuit");
}

#[test]
fn tokenizer_failures_a_request_causes_are_charged_to_it_not_to_the_tokenizer() {
    // Media the tokenizer must fetch (a URL that never answers) and a huge prompt: their
    // timeouts are the request's doing. As many as there are replicas, and more, leave every
    // tokenizer in use; an ordinary request's timeout still opens the circuit.
    let image = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://203.0.113.1/never.png"}}]}]}"#;
    let huge = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(llmgw_core::flow::STRIKE_MAX_CALL_BYTES + 1));
    let e = synced("", vec![], vec![], true);
    e.host.now_ns.set(1_000_000_000);
    let target = |e: &Env| e.host.last_call().unwrap().header(":authority").map(str::to_owned);
    let mut targets = Vec::new();
    for (i, body) in [&image[..], huge.as_bytes(), &image[..], huge.as_bytes()].into_iter().enumerate() {
        let path = if i % 2 == 0 { "/v1/chat/completions" } else { COMPLETIONS };
        let (mut ctx, _) = e.request(path, body);
        targets.push(target(&e));
        e.answer(&mut ctx, Some("504"), b"");
        ctx.on_log();
    }
    // Each went where the same request's call went before: none was left alone.
    assert_eq!((&targets[2], &targets[3]), (&targets[0], &targets[1]), "a tokenizer was left alone");
    assert_eq!(e.counter("llmgw_tokenizer_failures_request_caused_total"), 4);
    assert_eq!(e.counter("llmgw_tokenizer_failures_total.reason.timeout"), 4);
    let hello = br#"{"model":"m","prompt":"hello"}"#;
    let (mut ctx, _) = e.request(COMPLETIONS, hello);
    let struck = target(&e);
    e.answer(&mut ctx, Some("504"), b"");
    ctx.on_log();
    let (_ctx, _) = e.request(COMPLETIONS, hello);
    assert_ne!(target(&e), struck, "an ordinary request's timeout strikes its tokenizer");
}

#[test]
fn shared_data_updates_that_give_up_are_counted_by_what_they_keep() {
    use crate::host::CAS_RETRIES;
    const IN_FLIGHT: &str = "llmgw.inflight.v3";
    let tokens: Vec<u32> = (0..32).collect();
    let e = synced("", vec![], keys(&tokens), true);
    let gave_up = |what: &str| e.counter(&format!("llmgw_shared_update_failures_total.what.{what}"));
    for what in ["in_flight", "heartbeat", "health", "tokenizer_health", "speculative", "recent"] {
        assert_eq!(gave_up(what), 0, "{what}");
    }
    // Races lost fewer times than the retries: the update lands, nothing is counted.
    e.host.cas_failures.set(CAS_RETRIES - 1);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.host.cas_failures.get(), 0);
    assert_eq!(e.host.shared_value(IN_FLIGHT).map(|v| v.len()), Some(24));
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
    // A prompt nobody holds is recorded in the speculative entries: the in-flight count, the
    // recent requests and the speculative entries all give up.
    let other: Vec<u32> = (100..132).collect();
    e.host.cas_failures.set(3 * CAS_RETRIES);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &other));
    assert_eq!(e.host.cas_failures.get(), 0);
    assert_eq!((gave_up("in_flight"), gave_up("recent"), gave_up("speculative")), (2, 1, 1));
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
fn a_request_whose_in_flight_count_was_not_written_does_not_take_back_another_ones() {
    use crate::host::CAS_RETRIES;
    let tokens: Vec<u32> = (0..32).collect();
    let e = synced("", vec![], keys(&tokens), true);
    // One request to B counted; a second to B whose count could not be written.
    let (mut first, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(inflight_at(&e, B).0, 1);
    e.host.cas_failures.set(CAS_RETRIES);
    let (mut second, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(inflight_at(&e, B).0, 1);
    // The second's end leaves the first counted; the first's end takes it back.
    second.on_http_response_headers(2, false);
    second.on_log();
    assert_eq!(inflight_at(&e, B), (1, inflight_at(&e, B).1));
    first.on_log();
    assert_eq!(inflight_at(&e, B), (0, 0));
}

#[test]
fn the_manual_lists_every_metric_and_label_value_the_filter_defines() {
    let manual = include_str!("../../docs/src/operations.md");
    let start = manual.find("### Metrics (Envoy `/stats/prometheus`)").expect("the metrics section");
    let section = &manual[start..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    // Every metric, the per-VM gauges too (defined on the first tick, which `synced` gives),
    // and the per-replica gauges of learned rates (defined at the tick after a replica's first
    // observation).
    let tokens: Vec<u32> = (0..32).collect();
    let mut e = synced("", vec![], keys(&tokens), true);
    let (mut c, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
    e.host.set_header(Headers::Response, ":status", Some("200"));
    e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
    c.on_http_response_headers(2, false);
    c.on_http_response_body(64, false);
    // The first chunk's lessons (the replica's rates among them) are taken at the next one.
    c.on_http_response_body(64, false);
    e.root.on_tick();
    let names = e.host.metric_names();
    assert!(names.iter().any(|n| n.starts_with("llmgw_destinations_refused.vm.")), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with("llmgw_rates_request_us.replica.")), "{names:?}");
    for name in names {
        let mut parts = name.split('.');
        let base = parts.next().unwrap();
        match (parts.next(), parts.next()) {
            (None, _) => assert!(section.contains(&format!("`{base}`")), "{base} not in the manual"),
            (Some(tag @ ("vm" | "replica")), Some(_)) => {
                assert!(section.contains(&format!("`{base}{{{tag}=…}}`")), "{name} not in the manual")
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

#[test]
fn a_streams_first_chunk_teaches_its_replicas_rates_to_every_worker() {
    // B holds all 8 blocks of a 32-token prompt; requests go there, each streamed, its first
    // chunk 10 ms after the decision.
    let tokens: Vec<u32> = (0..32).collect();
    let e1 = synced("", vec![], keys(&tokens), true);
    let mut e2 = second_vm(&e1, vec![], keys(&tokens));
    let stream = |e: &Env, first_chunk_ms: u64, status: &str| {
        let (mut c, _) = e.request(COMPLETIONS, &tokens_body("m", &tokens));
        assert_eq!(e.dest().as_deref(), Some(B));
        e.host.set_header(Headers::Response, ":status", Some(status));
        e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
        c.on_http_response_headers(2, false);
        let explain = e.host.response_header("x-llmgw-decision").unwrap();
        e.host.now_ns.set(e.host.now_ns.get() + first_chunk_ms * 1_000_000);
        c.on_http_response_body(64, false);
        c.on_http_response_body(64, true);
        c.on_log();
        explain
    };
    // Nothing learned yet: the profile's rates.
    assert!(stream(&e1, 10, "200").ends_with("; rates=profile"));
    // An error's first chunk teaches nothing.
    let h = stream(&e2, 900, "429");
    assert!(h.contains("rates=learned/1 "), "{h}");
    // The other worker sees what the first learned, and adds to it.
    for _ in 0..20 {
        stream(&e2, 10, "200");
    }
    let h = stream(&e1, 10, "200");
    assert!(h.contains("; rates=learned/21 base_ms="), "{h}");
    // Nothing to compute there and nothing queued: the base is the whole of it, about 10 ms.
    let base: f64 = h.split("base_ms=").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!((base - 10.0).abs() < 1.0, "{h}");
    // The gauges, on the next tick, every VM the same.
    e2.root.on_tick();
    let tag = B.replace(['.', ':'], "_");
    assert_eq!(e2.host.gauge(&format!("llmgw_rates_observations.replica.{tag}")), Some(22));
    let base_us = e2.host.gauge(&format!("llmgw_rates_base_us.replica.{tag}")).unwrap();
    assert!((9_000..11_000).contains(&base_us), "{base_us}");
    // Not streamed: the headers come after the whole answer, which teaches nothing.
    let (mut c, _) = e1.request(COMPLETIONS, &tokens_body("m", &tokens));
    e1.host.set_header(Headers::Response, "content-type", Some("application/json"));
    c.on_http_response_headers(2, false);
    e1.host.now_ns.set(e1.host.now_ns.get() + 5_000_000_000);
    c.on_http_response_body(64, true);
    c.on_log();
    e2.root.on_tick();
    assert_eq!(e2.host.gauge(&format!("llmgw_rates_observations.replica.{tag}")), Some(22));
    // How long they have been quiet shows too: the 5 s since the last first token.
    let quiet_ms = e2.host.gauge(&format!("llmgw_rates_quiet_ms.replica.{tag}")).unwrap();
    assert!((5_000..5_100).contains(&quiet_ms), "{quiet_ms}");
}

#[test]
fn a_request_extending_one_that_ended_is_its_next_one_for_every_worker() {
    use crate::returns::Returns;
    let first: Vec<u32> = (0..48).collect();
    let next: Vec<u32> = (0..80).collect();
    let failed: Vec<u32> = (500..548).collect();
    let key = *keys(&first).last().unwrap();
    let e = synced("", vec![], vec![], true);
    let ended = |e: &Env, key: u64| Returns::read(e.host.as_ref()).ended(key);
    e.host.now_ns.set(100_000_000_000);
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &first));
    assert!(e.dest().is_some());
    assert!(!ended(&e, key), "recorded before it ended");
    e.host.set_header(Headers::Response, ":status", Some("200"));
    ctx.on_http_response_headers(1, false);
    ctx.on_log();
    assert!(ended(&e, key));
    // An error is nobody's turn to follow: its end is not recorded.
    let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &failed));
    e.host.set_header(Headers::Response, ":status", Some("500"));
    ctx.on_http_response_headers(1, false);
    ctx.on_log();
    assert!(!ended(&e, *keys(&failed).last().unwrap()));
    // The same prompt again is no next turn: nothing is learned.
    let (_ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &first));
    assert!(ended(&e, key));
    assert!(e.host.shared_data("llmgw.returns.gaps").and_then(|(v, _)| v).is_none_or(|v| v.is_empty()));
    // The next request comes to another worker 6 ms after the first ended.
    let vm2 = second_vm(&e, vec![], vec![]);
    e.host.now_ns.set(100_006_000_000);
    let (_ctx, _) = vm2.request(COMPLETIONS, &tokens_body("m", &next));
    assert!(vm2.dest().is_some());
    assert!(!ended(&e, key), "followed, the record goes");
    let gaps = e.host.shared_data("llmgw.returns.gaps").and_then(|(v, _)| v).unwrap_or_default();
    // One observation from the first token and one from the end (a non-streamed answer: the
    // same instant), in the [4, 8) ms bucket (the fourth) of each.
    let weight = |b: usize| f64::from_bits(u64::from_le_bytes(gaps[b * 8..b * 8 + 8].try_into().unwrap()));
    assert_eq!((weight(3), weight(25 + 3)), (1.0, 1.0));
    assert_eq!((0..50).map(weight).sum::<f64>(), 2.0);
}

#[test]
fn a_new_prompt_is_not_computed_where_a_conversation_is_about_to_come_back() {
    // 1 ms a prompt token, not learned: a new 400-token prompt takes 400 ms to compute.
    let weights = r#""weights":{"prefill_us_per_token":1000,"learn_rates":false}"#;
    let cfg = config("").replace(r#""seed":"0"}"#, &format!(r#""seed":"0",{weights}}}"#));
    let e = synced_with(&cfg, vec![], vec![], true);
    let mut now = 100_000_000_000u64;
    let answer = |e: &Env, mut ctx: Request, now: &mut u64| -> String {
        e.host.set_header(Headers::Response, ":status", Some("200"));
        ctx.on_http_response_headers(1, false);
        ctx.on_log();
        *now += 1_000_000;
        e.host.now_ns.set(*now);
        e.dest().unwrap()
    };
    // Conversations whose next turn comes 5 ms after each answer: learned.
    for i in 0..20u32 {
        let first: Vec<u32> = (i * 1000..i * 1000 + 40).collect();
        let (ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &first));
        answer(&e, ctx, &mut now);
        now += 4_000_000;
        e.host.now_ns.set(now);
        let next: Vec<u32> = (i * 1000..i * 1000 + 48).collect();
        let (ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &next));
        answer(&e, ctx, &mut now);
        now += 1_000_000_000;
        e.host.now_ns.set(now);
    }
    // A turn answered 1 ms ago: a new prompt goes to the other replica, whatever its order.
    for j in 0..10u32 {
        let turn: Vec<u32> = (100_000 + j * 1000..100_000 + j * 1000 + 40).collect();
        let (ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &turn));
        let answered_on = answer(&e, ctx, &mut now);
        let new: Vec<u32> = (500_000 + j * 1000..500_000 + j * 1000 + 400).collect();
        let (mut ctx, _) = e.request(COMPLETIONS, &tokens_body("m", &new));
        assert_ne!(e.dest(), Some(answered_on), "prompt {j}");
        ctx.on_http_response_headers(1, false);
        let explain = e.host.response_header("x-llmgw-decision").unwrap_or_default();
        assert!(explain.contains("; returning_ms=0.0 "), "{explain}");
        ctx.on_log();
        now += 1_000_000_000;
        e.host.now_ns.set(now);
    }
}
