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

/// A router with `profile_json` as its only profile (model "m"), whose feed knows A and B
/// with the given hash settings, B holding `on_b`.
/// The serving table as the feed would send it again, with replica `id`'s KV-cache groups
/// from `groups`.
fn wire_table(r: &Router, groups: impl Fn(u32) -> Vec<crate::feed::KvCacheGroup>) -> ReplicaTable {
    let replicas = r
        .feed
        .serving()
        .replicas
        .iter()
        .map(|x| Replica {
            id: u32::from(x.id),
            name: x.name.clone(),
            address: x.address.clone(),
            models: x.models.clone(),
            up: x.up,
            dp_rank: x.rank,
            hash: x.hash.as_ref().and_then(|h| h.as_ref().ok()).map(crate::feed::HashSettings::from_spec),
            dp_size: if x.dp_rank.is_some() { 2 } else { 1 },
            kv_groups: groups(u32::from(x.id)),
            lora_adapters: vec![],
            mirror_incomplete: false,
        })
        .collect();
    ReplicaTable { replicas }
}

fn router_with_hash(
    profile_json: &str,
    a: Option<crate::feed::HashSettings>,
    b: Option<crate::feed::HashSettings>,
    on_b: Vec<u64>,
) -> Router {
    let json = format!(r#"{{"profiles":[{profile_json}]}}"#);
    let mut r = Router::new(Compiled::from_json(json.as_bytes(), None).unwrap(), 2);
    let replica = |id: u32, address: &str, hash| Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![],
        up: true,
        dp_rank: 0,
        hash,
        dp_size: 1,
        kv_groups: vec![],
        lora_adapters: vec![],
        mirror_incomplete: false,
    };
    r.feed.begin_subscription();
    for (seq, body) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, a), replica(1, B, b)] }),
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

#[test]
fn a_profile_without_hash_settings_hashes_as_the_feed_says_the_replicas_do() {
    // The replicas hash with seed "0" and 4-token blocks; the profile names neither (its own
    // defaults would be no seed and 16-token blocks, which match nothing).
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router_with_hash(
        r#"{"name":"p","models":["m"],"kv_events":true}"#,
        Some(settings("0", BS as u32)),
        Some(settings("0", BS as u32)),
        keys(&tokens),
    );
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    assert!(!got.report.hash_mismatch);
    assert_eq!(r.take_hash_note(), None);
    // Without settings in the feed (an older agent), the profile's defaults apply.
    let mut old = router_with_hash(r#"{"name":"p","models":["m"],"kv_events":true}"#, None, None, keys(&tokens));
    let got = routed(old.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::NoMatch));
}

#[test]
fn a_profile_pinning_another_seed_counts_names_both_values_and_falls_back() {
    let tokens: Vec<u32> = (0..32).collect();
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"1"}}"#),
        Some(settings("0", BS as u32)),
        Some(settings("0", BS as u32)),
        keys(&tokens),
    );
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert!(got.report.hash_mismatch);
    assert_eq!(got.decision.outcome, Outcome::Approx);
    assert_eq!(got.report.matched_blocks, None);
    let note = r.take_hash_note().unwrap();
    assert!(
        note.contains(r#"replica `r1` rank 0 (127.0.0.1:8002) hashes with seed "0" (profile `p` uses "1")"#),
        "{note}"
    );
    assert!(note.contains(r#"replica `r0`"#) && note.ends_with("routing by the fallback"), "{note}");
    // Counted on every request, logged once.
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert!(got.report.hash_mismatch);
    assert_eq!(r.take_hash_note(), None);
}

#[test]
fn a_replica_hashing_otherwise_is_never_credited_while_the_others_route_exactly() {
    let tokens: Vec<u32> = (0..32).collect();
    // A says it hashes with seed "1", B with "0"; the profile pins "0". B holds the prompt.
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}}"#),
        Some(settings("1", BS as u32)),
        Some(settings("0", BS as u32)),
        keys(&tokens),
    );
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome), (B, Outcome::Exact));
    assert!(got.report.hash_mismatch);
    let note = r.take_hash_note().unwrap();
    assert!(
        note.contains(r#"replica `r0` rank 0 (127.0.0.1:8001) hashes with seed "1" (profile `p` uses "0")"#),
        "{note}"
    );
    assert!(!note.contains("`r1`") && note.ends_with("its blocks are not credited"), "{note}");
    // Another block size is a mismatch too, named with both values.
    let mut r = router_with_hash(
        r#"{"name":"p","models":["m"],"kv_events":true,"block_size":16}"#,
        Some(settings("0", BS as u32)),
        None,
        vec![],
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert!(r.take_hash_note().unwrap().contains("block_size 4 (profile `p` uses 16)"));
}

#[test]
fn an_eagle_engines_lookahead_hashes_are_matched_from_the_profile_or_the_feed() {
    // 33 tokens, lookahead 1: the engine hashes 8 blocks of 4, each also over the next token.
    let tokens: Vec<u32> = (0..33).collect();
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let ex = RequestExtras { lookahead: 1, ..RequestExtras::default() };
    let eagle: Vec<u64> = h.hash_request(&tokens, BS, &ex).unwrap().iter().map(|b| b.key.0).collect();
    assert_eq!(eagle.len(), 8);
    let bytes = format!(r#"{{"model":"m","prompt":{tokens:?}}}"#);
    let eagle_settings = || crate::feed::HashSettings { lookahead_tokens: 1, ..settings("0", BS as u32) };
    // The profile says lookahead 1 (the feed says nothing).
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","lookahead_tokens":1}}"#),
        None,
        None,
        eagle.clone(),
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    // The feed says lookahead 1 (the profile says nothing about it).
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}}"#),
        Some(eagle_settings()),
        Some(eagle_settings()),
        eagle.clone(),
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    // A profile pinning lookahead 0 against such engines: a mismatch naming both values.
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","lookahead_tokens":0}}"#),
        Some(eagle_settings()),
        Some(eagle_settings()),
        eagle,
    );
    let got = routed(r.on_body(&body(COMPLETIONS, bytes.as_bytes()), &(), 0));
    assert_eq!(got.report.fallback, Some(Fallback::HashMismatch));
    assert!(r.take_hash_note().unwrap().contains("lookahead_tokens 1 (profile `p` uses 0)"));
}

#[test]
fn a_hybrid_engine_is_scored_as_vllms_coordinator_hits_it() {
    use crate::feed::KvCacheGroup;
    use crate::hash::group_key;
    // B: full attention (group 0) plus a sliding window of 8 tokens (group 1): a hit needs the
    // 2 blocks before its end cached in group 1 too.
    let tokens: Vec<u32> = (0..33).collect();
    let k = keys(&tokens);
    let group = |group_idx, kind: &str, sliding_window| KvCacheGroup {
        group_idx,
        kind: kind.into(),
        block_size: BS as u32,
        sliding_window,
    };
    let hybrid = vec![group(0, "full_attention", 0), group(1, "sliding_window", 8)];
    let mut on_b = k.clone();
    // The window group keeps only the last two blocks of the prompt (as vLLM's does).
    on_b.extend([6, 7].map(|i| group_key(BlockKey(k[i]), 1).0));
    let mut r = router_with_hash(
        &format!(r#"{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0"}}"#),
        None,
        None,
        on_b,
    );
    let table = wire_table(&r, |id| if id == 1 { hybrid.clone() } else { vec![] });
    r.feed.apply(&FeedMessage { seq: 3, body: Some(Msg::Replicas(table)) }).unwrap();
    // The whole prompt and more: every group hits all 8 blocks.
    let longer: Vec<u32> = (0..40).collect();
    let body_of = |t: &[u32]| format!(r#"{{"model":"m","prompt":{t:?}}}"#);
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&longer).as_bytes()), &(), 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    // Exactly the prompt: vLLM never hits the last token, so 7 blocks are the most it can
    // hit, and the window group has no 2 cached blocks ending there (6 is, 5 is not).
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&tokens[..32]).as_bytes()), &(), 0));
    assert_eq!(got.report.matched_blocks, Some(0));
    // Sharing the first 5 blocks only: group 0 holds them, group 1 holds none of blocks 3 and
    // 4, so vLLM hits nothing (group 0 alone would claim 5).
    let mut diverging: Vec<u32> = (0..20).collect();
    diverging.extend(1000..1020);
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&diverging).as_bytes()), &(), 0));
    assert_eq!((got.report.matched_blocks, got.report.fallback), (Some(0), Some(Fallback::NoMatch)));
    assert!(!got.report.hybrid_unsupported);
    // A Mamba group is not modelled: scored by group 0 alone, and said so.
    let table =
        wire_table(&r, |id| if id == 1 { vec![group(0, "full_attention", 0), group(1, "mamba", 0)] } else { vec![] });
    r.feed.apply(&FeedMessage { seq: 4, body: Some(Msg::Replicas(table)) }).unwrap();
    let got = routed(r.on_body(&body(COMPLETIONS, body_of(&diverging).as_bytes()), &(), 0));
    assert_eq!(got.report.matched_blocks, Some(5));
    assert!(got.report.hybrid_unsupported);
}

#[test]
fn a_chat_with_an_image_is_rendered_and_hashed_with_its_media_items() {
    use crate::hash::MmFeature;
    let tokens: Vec<u32> = (0..33).collect();
    let image = MmFeature { identifier: "9f2c-image-hash".into(), offset: 5, length: 10 };
    let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap();
    let with_image = RequestExtras { mm: vec![image.clone()], ..RequestExtras::default() };
    let mm_keys: Vec<u64> = h.hash_request(&tokens, BS, &with_image).unwrap().iter().map(|b| b.key.0).collect();
    // B holds the blocks as vLLM hashed them for this image; A holds the same tokens hashed
    // without it (block 0, before the image, is the same in both).
    let mut r = router("", mm_keys.clone(), true);
    r.feed
        .apply(&FeedMessage {
            seq: 3,
            body: Some(Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: keys(&tokens) })),
        })
        .unwrap();
    let chat = br#"{"model":"m","messages":[{"role":"user","content":[
        {"type":"text","text":"What is in this picture?"},
        {"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}]}]}"#;
    let reply = format!(
        r#"{{"request_id":"x","token_ids":{tokens:?},"features":{{"mm_hashes":{{"image":["9f2c-image-hash"]}},
            "mm_placeholders":{{"image":[{{"offset":5,"length":10}}]}}}},"sampling_params":{{}}}}"#
    )
    .into_bytes();
    for round in 0..2 {
        // The profile tokenizes with /tokenize, but a chat with media goes to render, unchanged.
        let call = tokenize(r.on_body(&body("/v1/chat/completions", chat), &(), round));
        assert_eq!((call.path, call.body.as_slice()), ("/v1/chat/completions/render", &chat[..]));
        // Never cached: each round asks again.
        assert_eq!(call.report.tokenizer_cache, None, "round {round}");
        let read = || reply.clone();
        let got = routed(r.on_tokenizer_reply(
            *call.pending,
            &TokenizerReply::Answered { status: Some(b"200"), body: &read },
            &(),
            round,
        ));
        assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
    }
    // A text-only chat still uses /tokenize.
    let text = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(tokenize(r.on_body(&body("/v1/chat/completions", text), &(), 9)).path, "/tokenize");
    // Features that do not pair hashes with placeholders are a bad answer.
    let call = tokenize(r.on_body(&body("/v1/chat/completions", chat), &(), 10));
    let bad = format!(r#"{{"token_ids":{tokens:?},"features":{{"mm_hashes":{{"image":["a","b"]}},"mm_placeholders":{{"image":[{{"offset":5,"length":10}}]}}}}}}"#).into_bytes();
    let read = || bad.clone();
    let got = routed(r.on_tokenizer_reply(
        *call.pending,
        &TokenizerReply::Answered { status: Some(b"200"), body: &read },
        &(),
        10,
    ));
    assert_eq!(got.report.tokenizer_failure, Some(TokenizerFailure::BadResponse));
}

#[test]
fn a_catch_all_profile_over_replicas_hashing_differently_keeps_each_models_tokenizations() {
    // Model m1 runs on A with seed "0", model m2 on B with seed "1"; one catch-all profile
    // names no hash settings, so each request hashes as its model's replicas do.
    let json = format!(r#"{{"profiles":[{{"name":"any","models":["*"],"kv_events":true,"block_size":{BS}}}]}}"#);
    let mut r = Router::new(Compiled::from_json(json.as_bytes(), None).unwrap(), 2);
    let text: Vec<u32> = (0..32).collect();
    let ids: Vec<u32> = (500..532).collect();
    let seeded = |seed: &str, tokens: &[u32]| {
        let mut h = BlockHasher::new(HashAlgo::Sha256Cbor, Some(seed)).unwrap();
        h.hash_request(tokens, BS, &RequestExtras::default()).unwrap().iter().map(|b| b.key.0).collect::<Vec<_>>()
    };
    let replica = |id: u32, address: &str, model: &str, seed: &str| Replica {
        id,
        name: format!("r{id}"),
        address: address.into(),
        models: vec![model.into()],
        up: true,
        dp_rank: 0,
        hash: Some(settings(seed, BS as u32)),
        dp_size: 1,
        kv_groups: vec![],
        lora_adapters: vec![],
        mirror_incomplete: false,
    };
    r.feed.begin_subscription();
    for (seq, b) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, "m1", "0"), replica(1, B, "m2", "1")] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: seeded("0", &text) }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: seeded("1", &ids) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]
    .into_iter()
    .enumerate()
    {
        r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(b) }).unwrap();
    }
    let m1 = br#"{"model":"m1","prompt":"a text prompt"}"#;
    let m2 = format!(r#"{{"model":"m2","prompt":{ids:?}}}"#);
    let call = tokenize(r.on_body(&body(COMPLETIONS, m1), &(), 0));
    let got = routed(answer(&mut r, *call.pending, &text, 0));
    assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (A, Outcome::Exact, 8));
    for round in 1..3 {
        let got = routed(r.on_body(&body(COMPLETIONS, m2.as_bytes()), &(), round));
        assert_eq!((got.address.as_str(), got.decision.outcome, got.decision.matched), (B, Outcome::Exact, 8));
        // Back to m1: its tokenization is still cached and still hashes as A does.
        let got = routed(r.on_body(&body(COMPLETIONS, m1), &(), round));
        assert_eq!((got.address.as_str(), got.decision.matched), (A, 8), "round {round}");
        assert!(got.report.tokenizer_cache.is_some_and(CacheLookup::is_hit), "round {round}");
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
    impl crate::flow::EarlierTurns for Failing {}
    let text = br#"{"model":"m","prompt":"hello"}"#;
    let mut r = router("", vec![], true);
    // Equal loads: A first; A failing: B.
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(&[]), 0)).target, A);
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(&[A]), 0)).target, B);
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
    assert_eq!(tokenize(r.on_body(&body(COMPLETIONS, text), &Failing(&[T]), 0)).target, A);
    let bad = br#"{"profiles":[{"name":"p","models":["m"],"tokenizer_address":"render:8000"}]}"#;
    assert!(Compiled::from_json(bad, None).err().unwrap().to_string().contains("profiles[0].tokenizer_address"));
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
    assert_eq!((again.target.as_str(), again.path), (A, first.path));
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

mod earlier_turns;
mod incomplete;
