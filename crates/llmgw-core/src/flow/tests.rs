#![allow(clippy::arithmetic_side_effects)]

use super::*;
use crate::config::MemoSettings;
use crate::feed::{Body as Msg, FeedMessage, Replica, ReplicaTable, SnapshotChunk, SnapshotComplete};
use crate::hash::{BlockHasher, BlockKey, HashAlgo};
use crate::policy::Outcome;

const A: &str = "127.0.0.1:8001";
const B: &str = "127.0.0.1:8002";
const BS: usize = 4;

fn config(extra: &str) -> Compiled {
    let json = format!(
        r#"{{{extra}"profiles":[{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}},
            {{"name":"off","models":["plain"]}}]}}"#
    );
    Compiled::from_json(json.as_bytes(), Some(MemoSettings { slots: 64, key: 1 })).unwrap()
}

fn keys(tokens: &[u32]) -> Vec<u64> {
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    h.hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect()
}

/// A router whose feed knows replicas A and B (both up), B holding `on_b`.
fn router(extra: &str, on_b: Vec<u64>, up: bool) -> Router {
    let mut r = Router::new(config(extra), 2);
    r.feed.begin_subscription();
    for (seq, body) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, up), replica(1, B, up)] }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: on_b }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]
    .into_iter()
    .enumerate()
    {
        r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(body) }).unwrap();
    }
    r
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
        lora_adapters: vec![],
        mirror_incomplete: false,
    }
}

fn body<'a>(path: &'a str, bytes: &'a [u8]) -> Body<'a> {
    Body { path, bytes, too_large: false }
}

fn routed(step: Step) -> Routed {
    match step {
        Step::Route(r) => r,
        other => panic!("expected a route, got {other:?}"),
    }
}

fn tokenize(step: Step) -> Tokenize {
    match step {
        Step::Tokenize(t) => t,
        other => panic!("expected a tokenizer call, got {other:?}"),
    }
}

fn ok_reply(tokens: &[u32]) -> Vec<u8> {
    format!(r#"{{"count":{},"max_model_len":4096,"tokens":{tokens:?}}}"#, tokens.len()).into_bytes()
}

/// Answers a pending tokenizer call with `tokens`.
fn answer(r: &mut Router, pending: Pending, tokens: &[u32], now_ns: u64) -> Step {
    let answer = ok_reply(tokens);
    let read = || answer.clone();
    r.on_tokenizer_reply(pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), now_ns)
}

/// Routes a text prompt through a tokenizer call answered with `tokens`.
fn tokenized(r: &mut Router, bytes: &[u8], tokens: &[u32], now_ns: u64) -> Step {
    let call = tokenize(r.on_body(&body(COMPLETIONS, bytes), &(), now_ns));
    answer(r, *call.pending, tokens, now_ns)
}

const COMPLETIONS: &str = "/v1/completions";

#[test]
fn each_fallback_reason_is_reported_in_order() {
    let mut r = router("", vec![], true);
    let cases: [(&str, &[u8], bool, Fallback); 7] = [
        (COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#, true, Fallback::BodyTooLarge),
        (COMPLETIONS, b"", false, Fallback::NoPrompt),
        (COMPLETIONS, b"{not json", false, Fallback::Unparseable),
        (COMPLETIONS, br#"{"model":"m"}"#, false, Fallback::NoPrompt),
        (COMPLETIONS, br#"{"model":"other","prompt":"hi"}"#, false, Fallback::NoProfile),
        (COMPLETIONS, br#"{"model":"plain","prompt":"hi"}"#, false, Fallback::NoKvEvents),
        // Token ids nobody holds: exact data, no match.
        (COMPLETIONS, br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#, false, Fallback::NoMatch),
    ];
    for (path, bytes, too_large, want) in cases {
        let got = routed(r.on_body(&Body { path, bytes, too_large }, &(), 0));
        assert_eq!(got.report.fallback, Some(want), "{}", String::from_utf8_lossy(bytes));
        assert_ne!(got.report.outcome, Some(Outcome::Exact));
    }
    // Not synced: a fresh subscription has not completed its snapshot.
    let mut fresh = Router::new(config(""), 2);
    let got = fresh.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#), &(), 0);
    // No replicas known at all: answered locally, still counted as not synced.
    match got {
        Step::Reject(rej) => assert_eq!(rej.report.fallback, Some(Fallback::NotSynced)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn token_ids_held_by_a_replica_route_there_exactly() {
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router("", keys(&tokens), true);
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.address, B);
    assert_eq!(
        got.report,
        Report {
            outcome: Some(Outcome::Exact),
            fallback: None,
            matched_blocks: Some(8),
            tokenizer_cache: None,
            tokenizer_failure: None,
            tokenizer_failure_request_caused: false,
            hash_mismatch: false,
            hybrid_unsupported: false,
            saw_incomplete: false,
        }
    );
    // The predicted times to first token: nothing to compute on B; A would compute all 32
    // tokens (3.2 ms at the profile's 100 µs a token; nothing learned yet).
    assert_eq!(
        got.explain("vm1"),
        format!(
            "outcome=exact; replica={B}; matched=8/8; vm=vm1; predicted_ms=0.0; prefill_tokens=0; runner_up={A} 3.2; rates=profile"
        )
    );
}

#[test]
fn a_text_prompt_is_tokenized_on_the_least_loaded_replica_then_scored() {
    let tokens: Vec<u32> = (100..140).collect();
    let mut r = router("", keys(&tokens[..20]), true);
    struct Busy;
    impl InFlightCounts for Busy {
        fn in_flight(&self, address: &str) -> u32 {
            u32::from(address == A) * 3
        }
    }
    impl ReplicaAvoidance for Busy {}
    impl SpeculativeEntries for Busy {}
    impl LearnedRates for Busy {}
    impl crate::flow::TokenizerCalls for Busy {}
    impl crate::flow::EarlierTurns for Busy {}
    let call = tokenize(r.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"hello"}"#), &Busy, 0));
    assert_eq!((call.target.as_str(), call.path, call.timeout_ms), (B, "/tokenize", 500));
    assert!(String::from_utf8_lossy(&call.body).contains(r#""prompt":"hello""#));
    assert_eq!(call.report.tokenizer_cache, Some(CacheLookup::Miss));
    let got = routed(answer(&mut r, *call.pending, &tokens, 0));
    assert_eq!((got.address.as_str(), got.decision.matched, got.decision.total), (B, 5, 10));
    assert_eq!(got.report.outcome, Some(Outcome::Exact));
}

#[test]
fn a_failed_tokenizer_call_falls_back_and_names_the_failure() {
    let mut r = router("", vec![], true);
    for (reply, failure) in [
        (TokenizerReply::Reset, TokenizerFailure::Reset),
        (TokenizerReply::Refused, TokenizerFailure::Dispatch),
        (TokenizerReply::Answered { status: Some(b"504"), body: &Vec::new }, TokenizerFailure::Timeout),
    ] {
        let call = tokenize(r.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"hello"}"#), &(), 0));
        let got = routed(r.on_tokenizer_reply(*call.pending, &reply, &(), 0));
        assert_eq!(got.report.tokenizer_failure, Some(failure));
        assert_eq!(got.report.fallback, Some(Fallback::Tokenizer));
        assert_eq!(got.report.outcome, Some(Outcome::Approx));
    }
}

#[test]
fn a_prompt_seen_again_skips_the_tokenizer_by_its_raw_body_or_its_call() {
    let tokens: Vec<u32> = (0..24).collect();
    let mut r = router("", keys(&tokens), true);
    let first = br#"{"model":"m","prompt":"hello"}"#;
    assert_eq!(routed(tokenized(&mut r, first, &tokens, 10)).address, B);
    // The same bytes: resolved through the raw-body alias, no call.
    let again = routed(r.on_body(&body(COMPLETIONS, first), &(), 20));
    assert_eq!((again.address.as_str(), again.report.tokenizer_cache), (B, Some(CacheLookup::RawBodyHit)));
    assert_eq!(again.decision.matched, 6);
    // Other bytes, same tokenizer call (key order, spacing): the call's tag finds it.
    let respaced = br#"{ "prompt": "hello", "model": "m" }"#;
    let again = routed(r.on_body(&body(COMPLETIONS, respaced), &(), 30));
    assert_eq!((again.address.as_str(), again.report.tokenizer_cache), (B, Some(CacheLookup::Hit)));
    // Now the respaced bytes have an alias of their own.
    let again = routed(r.on_body(&body(COMPLETIONS, respaced), &(), 31));
    assert_eq!(again.report.tokenizer_cache, Some(CacheLookup::RawBodyHit));
    // Past the time-to-live the tokenizer is asked again.
    let late = r.on_body(&body(COMPLETIONS, first), &(), 61_000_000_000);
    assert_eq!(tokenize(late).report.tokenizer_cache, Some(CacheLookup::Miss));
    // With the cache off every text prompt is tokenized.
    let mut off = router(r#""tokenizer_cache_bytes":0,"#, keys(&tokens), true);
    let _ = tokenized(&mut off, first, &tokens, 0);
    let call = tokenize(off.on_body(&body(COMPLETIONS, first), &(), 0));
    assert_eq!(call.report.tokenizer_cache, None);
}

#[test]
fn no_healthy_replica_is_a_503_with_a_json_error() {
    let mut r = router("", vec![], false);
    let Step::Reject(rej) = r.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"hi"}"#), &(), 0) else {
        panic!("expected a rejection")
    };
    assert_eq!(rej.status, 503);
    assert_eq!(rej.report.outcome, Some(Outcome::NoReplica));
    let v: serde_json::Value = serde_json::from_slice(&rej.body).unwrap();
    assert_eq!(v["error"]["type"], "llmgw_no_replica");
    assert_eq!(v["error"]["code"], 503);
    assert_eq!(v["error"]["message"], "no healthy replica for model `m`");
}

#[test]
fn a_reply_after_the_index_lost_its_sync_falls_back() {
    let tokens: Vec<u32> = (0..24).collect();
    let mut r = router("", keys(&tokens), true);
    let call = tokenize(r.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"x"}"#), &(), 0));
    // The view was replaced while the call was out (nothing synced yet).
    r.feed = FeedView::default();
    let step = answer(&mut r, *call.pending, &tokens, 0);
    let Step::Reject(rej) = step else { panic!("no replicas are known: {step:?}") };
    assert_eq!(rej.report.fallback, Some(Fallback::NotSynced));
}

#[test]
fn reconfiguring_replaces_profiles_and_forgets_tokenizations() {
    let tokens: Vec<u32> = (0..24).collect();
    let mut r = router("", keys(&tokens), true);
    let first = br#"{"model":"m","prompt":"hello"}"#;
    let _ = tokenized(&mut r, first, &tokens, 0);
    assert_eq!(r.tokenizer_cache().len(), 1);
    r.reconfigure(config(r#""explain_header":true,"#));
    assert!(r.config().explain_header);
    assert!(r.tokenizer_cache().is_empty());
    // The feed stays: the index still routes.
    assert!(r.feed.usable());
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, first), &(), 0)).report.tokenizer_cache, Some(CacheLookup::Miss));
    // A call made before a reconfigure and answered after it is routed, not cached.
    let call = tokenize(r.on_body(&body(COMPLETIONS, first), &(), 0));
    r.reconfigure(config(""));
    assert_eq!(routed(answer(&mut r, *call.pending, &tokens, 0)).address, B);
    assert!(r.tokenizer_cache().is_empty());
}

fn settings(seed: &str, block_size: u32) -> crate::feed::HashSettings {
    crate::feed::HashSettings {
        algo: "sha256_cbor".into(),
        seeded: true,
        seed: seed.into(),
        block_size,
        lookahead_tokens: 0,
    }
}

#[test]
fn a_replica_outside_the_allowlist_is_never_routed_to_nor_asked_to_tokenize() {
    let tokens: Vec<u32> = (0..32).collect();
    let ids = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    // B holds the prompt, but only A's port is allowed.
    let mut r = router(r#""allowed_destinations":["127.0.0.1:8001"],"#, keys(&tokens), true);
    assert_eq!(r.feed.serving().refused(), &[1]);
    assert_eq!(routed(r.on_body(&body(COMPLETIONS, ids.as_bytes()), &(), 0)).address, A);
    let call = tokenize(r.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"hello"}"#), &(), 0));
    assert_eq!(call.target, A);
    // Nothing allowed: nobody is routed to (answered locally), whatever the feed says.
    r.reconfigure(config(r#""allowed_destinations":["10.0.0.0/8"],"#));
    assert_eq!(r.feed.serving().refused(), &[0, 1]);
    assert!(matches!(r.on_body(&body(COMPLETIONS, ids.as_bytes()), &(), 0), Step::Reject(_)));
    // The default networks include loopback: both are routable again, B holds the prompt.
    r.reconfigure(config(""));
    assert!(r.feed.serving().refused().is_empty());
    assert_eq!(routed(r.on_body(&body(COMPLETIONS, ids.as_bytes()), &(), 0)).address, B);
}

#[test]
fn tokenizer_calls_leave_failing_tokenizers_alone_and_prefer_the_dedicated_one() {
    struct Failing(&'static [&'static str]);
    impl InFlightCounts for Failing {
        fn in_flight(&self, _address: &str) -> u32 {
            0
        }
    }
    impl ReplicaAvoidance for Failing {
        fn tokenizer_avoided(&self, address: &str) -> bool {
            self.0.contains(&address)
        }
    }
    impl SpeculativeEntries for Failing {}
    impl LearnedRates for Failing {}
    impl crate::flow::TokenizerCalls for Failing {}
    impl crate::flow::EarlierTurns for Failing {}
    let text = br#"{"model":"m","prompt":"hello"}"#;
    let mut r = router("", vec![], true);
    // Equal loads: the first in the prompt's rendezvous order; that one failing: the other.
    let first = tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(&[]), 0)).target;
    let (first, second, failing): (&str, &str, &'static [&'static str]) =
        if first == A { (A, B, &[A]) } else { (B, A, &[B]) };
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(failing), 0)).target, second);
    // Every tokenizer failing: no call, an immediate fallback that names the open circuit,
    // still routed.
    let got = routed(r.on_body(&body(COMPLETIONS, text), &Failing(&[A, B]), 0));
    assert_eq!(got.report.fallback, Some(Fallback::Tokenizer));
    assert_eq!(got.report.tokenizer_failure, Some(TokenizerFailure::CircuitOpen));
    // A dedicated tokenizer is called first, and skipped while it fails.
    const T: &str = "127.0.0.1:9100";
    let profile = format!(
        r#"{{"profiles":[{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","tokenizer_address":"{T}"}}]}}"#
    );
    r.reconfigure(Compiled::from_json(profile.as_bytes(), None).unwrap());
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(&[]), 0)).target, T);
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(&[T]), 0)).target, first);
    let bad = br#"{"profiles":[{"name":"p","models":["m"],"tokenizer_address":"render:8000"}]}"#;
    assert!(Compiled::from_json(bad, None).err().unwrap().to_string().contains("profiles[0].tokenizer_address"));
}

#[test]
fn tokenizer_calls_for_different_prompts_spread_over_equally_loaded_replicas() {
    struct Busy(Option<&'static str>);
    impl InFlightCounts for Busy {
        fn in_flight(&self, address: &str) -> u32 {
            u32::from(self.0 == Some(address))
        }
    }
    impl ReplicaAvoidance for Busy {}
    impl SpeculativeEntries for Busy {}
    impl LearnedRates for Busy {}
    impl crate::flow::TokenizerCalls for Busy {}
    impl crate::flow::EarlierTurns for Busy {}
    let mut r = router("", vec![], true);
    let text = |i: u32| format!(r#"{{"model":"m","prompt":"a long shared start, then question {i}"}}"#);
    let targets = |r: &mut Router, gw: &Busy| -> Vec<String> {
        (0..16).map(|i| tokenize(r.on_body(&body(COMPLETIONS, text(i).as_bytes()), gw, 0)).target).collect()
    };
    // Idle replicas: the calls of different prompts go to both, the same prompt's to one.
    let idle = targets(&mut r, &Busy(None));
    assert!(idle.iter().any(|t| t == A) && idle.iter().any(|t| t == B), "{idle:?}");
    assert_eq!(idle, targets(&mut r, &Busy(None)));
    // A busier: every call goes to B.
    assert!(targets(&mut r, &Busy(Some(A))).iter().all(|t| t == B));
}

#[test]
fn a_cache_salt_past_the_limit_is_neither_hashed_nor_cached() {
    let tokens: Vec<u32> = (0..32).collect();
    let with_salt = |salt: &str| format!(r#"{{"model":"m","prompt":{tokens:?},"cache_salt":"{salt}"}}"#);
    let mut r = router(r#""max_cache_salt_bytes":16,"#, keys(&tokens), true);
    let got = routed(r.on_body(&body(COMPLETIONS, with_salt(&"s".repeat(17)).as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::SaltTooLong));
    // Within the limit: hashed (the salt changes the keys, so nobody holds them).
    let got = routed(r.on_body(&body(COMPLETIONS, with_salt(&"s".repeat(16)).as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::NoMatch));
    // A text prompt with a long salt makes no tokenizer call.
    let long = format!(r#"{{"model":"m","prompt":"hello","cache_salt":"{}"}}"#, "s".repeat(17));
    let got = routed(r.on_body(&body(COMPLETIONS, long.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::SaltTooLong));
    assert_eq!((r.tokenizer_cache().alias_bytes(), r.tokenizer_cache().len()), (0, 0));
}

#[test]
fn a_call_the_dedicated_tokenizer_declines_goes_once_to_a_replica_without_striking_it() {
    const T: &str = "127.0.0.1:9100";
    let profile = format!(
        r#""profiles":[{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","tokenizer_address":"{T}"}}]}}"#
    );
    let mut r = router("", vec![], true);
    r.reconfigure(Compiled::from_json(format!("{{{profile}").as_bytes(), None).unwrap());
    let text = br#"{"model":"m","prompt":"hello"}"#;
    let first = tokenize(r.on_body(&body(COMPLETIONS, text), &(), 0));
    assert_eq!(first.target, T);
    let declined = |r: &mut Router, pending: Pending| {
        let read = || br#"{"error":{"message":"declined: media"}}"#.to_vec();
        r.on_tokenizer_reply(pending, &TokenizerReply::Answered { status: Some(b"421"), body: &read }, &(), 0)
    };
    // Declined: the same call, now to the least-loaded replica; the decline is reported and
    // does not count against the dedicated tokenizer's circuit.
    let again = tokenize(declined(&mut r, *first.pending));
    assert!([A, B].contains(&again.target.as_str()), "{}", again.target);
    assert_eq!(again.path, first.path);
    assert_eq!(again.body, first.body);
    assert_eq!(again.report.tokenizer_failure, Some(TokenizerFailure::Declined));
    assert!(!TokenizerFailure::Declined.strikes());
    // The replica's answer routes as any; a second decline falls back instead of looping.
    assert!(matches!(answer(&mut r, *again.pending, &[1, 2, 3], 0), Step::Route(_)));
    let call = tokenize(r.on_body(&body(COMPLETIONS, br#"{"model":"m","prompt":"other"}"#), &(), 0));
    let again = tokenize(declined(&mut r, *call.pending));
    let got = routed(declined(&mut r, *again.pending));
    assert_eq!(got.report.fallback, Some(Fallback::Tokenizer));
    // A render call (a chat with an image) goes again with the request's own body.
    let chat = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x/i.png"}}]}]}"#;
    let first = tokenize(r.on_body(&body("/v1/chat/completions", chat), &(), 0));
    assert_eq!((first.target.as_str(), first.path), (T, "/v1/chat/completions/render"));
    let again = tokenize(declined(&mut r, *first.pending));
    assert_eq!((again.target.as_str(), again.path, again.body.as_slice()), (A, first.path, &chat[..]));
}

#[test]
fn an_adapter_the_replicas_list_is_hashed_with_its_path_as_vllm_does() {
    let json =
        format!(r#"{{"profiles":[{{"name":"any","models":["*"],"kv_events":true,"block_size":{BS},"seed":"0"}}]}}"#);
    let tokens: Vec<u32> = (0..32).collect();
    let hashed = |lora: Option<(&str, &str)>| {
        let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
        let extras = RequestExtras { lora: lora.map(|(n, p)| (n.to_owned(), p.to_owned())), ..Default::default() };
        h.hash_request(&tokens, BS, &extras).unwrap().iter().map(|b| b.key.0).collect::<Vec<_>>()
    };
    let replica = |id: u32, address: &str, path: &str| Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec!["base".into(), "sql".into()],
        up: true,
        dp_rank: 0,
        hash: Some(settings("0", BS as u32)),
        dp_size: 1,
        kv_groups: vec![],
        lora_adapters: vec![crate::feed::LoraAdapter { name: "sql".into(), path: path.into() }],
        mirror_incomplete: false,
    };
    // A holds the prompt's blocks for the base model, B the adapter's.
    let fleet = |path_on_a: &str| {
        let mut r = Router::new(Compiled::from_json(json.as_bytes(), None).unwrap(), 2);
        r.feed.begin_subscription();
        for (seq, b) in [
            Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, path_on_a), replica(1, B, "/a/sql")] }),
            Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: hashed(None) }),
            Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: hashed(Some(("sql", "/a/sql"))) }),
            Msg::SnapshotComplete(SnapshotComplete {}),
        ]
        .into_iter()
        .enumerate()
        {
            r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(b) }).unwrap();
        }
        r
    };
    let ask = |r: &mut Router, model: &str| {
        let got = routed(r.on_body(
            &body(COMPLETIONS, format!(r#"{{"model":"{model}","prompt":{tokens:?}}}"#).as_bytes()),
            &(),
            0,
        ));
        (got.address, got.decision.outcome, got.decision.matched)
    };
    let mut r = fleet("/a/sql");
    assert_eq!(ask(&mut r, "sql"), (B.to_owned(), Outcome::Exact, 8));
    assert_eq!(ask(&mut r, "base"), (A.to_owned(), Outcome::Exact, 8));
    // Replicas that disagree on the adapter's path: its requests are not credited with blocks
    // hashed under either path.
    let mut r = fleet("/elsewhere/sql");
    let got =
        routed(r.on_body(&body(COMPLETIONS, format!(r#"{{"model":"sql","prompt":{tokens:?}}}"#).as_bytes()), &(), 0));
    assert_eq!((got.decision.outcome, got.decision.matched), (Outcome::Approx, 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert_eq!(ask(&mut r, "base"), (A.to_owned(), Outcome::Exact, 8));
}

mod earlier_prompts;
mod earlier_turns;
mod hash_settings;
mod incomplete;
mod shared_data;
mod shared_prefix;
