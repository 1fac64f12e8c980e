//! A chat request is routed at once on what its siblings' tokens share, only where that prefix
//! decides as its own tokens would.

use super::{keys, ok_reply, replica, router, tokenize, A, B, BS};
use crate::config::{Compiled, MemoSettings};
use crate::feed::{BlockDelta, Body as Msg, FeedMessage, ReplicaTable, SnapshotChunk, SnapshotComplete};
use crate::flow::{Body, CacheLookup, Router, Step, TokenizerReply};
use crate::policy::Outcome;

const CHAT: &str = "/v1/chat/completions";

/// A chat body: a system prompt, then `question`.
fn chat(extra: &str, question: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"m",{extra}"messages":[{{"role":"system","content":"be brief"}},{{"role":"user","content":"{question}"}}]}}"#
    )
    .into_bytes()
}

/// The tokens of a sibling: 16 of the system prompt (4 blocks), then 8 of its own.
fn sibling(i: u32) -> Vec<u32> {
    (0..16).chain((0..8).map(|k| 100 * (i + 1) + k)).collect()
}

fn answered(r: &mut Router, step: Step, tokens: &[u32], now_ns: u64) -> Step {
    let read = ok_reply(tokens);
    let read = || read.clone();
    r.on_tokenizer_reply(
        *tokenize(step).pending,
        &TokenizerReply::Answered { status: Some(b"200"), body: &read },
        &(),
        now_ns,
    )
}

/// A router whose B holds the first sibling whole, with the first two siblings tokenized.
fn with_two_siblings(extra: &str) -> Router {
    two_siblings_tokenized(router(extra, keys(&sibling(0)), true))
}

/// As [`with_two_siblings`], the profile with these `weights`, and A holding the system prompt
/// too.
fn both_holding_with(weights: &str) -> Router {
    let json = format!(
        r#"{{"profiles":[{{"name":"p","models":["m"],"kv_events":true,"block_size":{BS},"seed":"0","weights":{weights}}}]}}"#
    );
    let config = Compiled::from_json(json.as_bytes(), Some(MemoSettings { slots: 64, key: 1 })).unwrap();
    let mut r = Router::new(config, 2);
    r.feed.begin_subscription();
    let system: Vec<u64> = keys(&sibling(0)).into_iter().take(4).collect();
    for (seq, body) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::Snapshot(SnapshotChunk { replica: 0, first: true, blocks: system }),
        Msg::Snapshot(SnapshotChunk { replica: 1, first: true, blocks: keys(&sibling(0)) }),
        Msg::SnapshotComplete(SnapshotComplete {}),
    ]
    .into_iter()
    .enumerate()
    {
        r.feed.apply(&FeedMessage { seq: seq as u64, body: Some(body) }).unwrap();
    }
    two_siblings_tokenized(r)
}

fn two_siblings_tokenized(mut r: Router) -> Router {
    r.set_background_calls(Some(5));
    // The first waits for its call: nothing is known of its family.
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q0"), too_large: false }, &(), 0);
    let routed = answered(&mut r, step, &sibling(0), 1);
    assert!(matches!(routed, Step::Route(_)), "{routed:?}");
    // The second goes at once on what it claims of the first's tokens, or waits (several
    // replicas hold that whole); either way its own tokens are learned.
    match r.on_body(&Body { path: CHAT, bytes: &chat("", "q1"), too_large: false }, &(), 1) {
        Step::RouteThenTokenize(_, call) => {
            let read = ok_reply(&sibling(1));
            let read = || read.clone();
            let answer = TokenizerReply::Answered { status: Some(b"200"), body: &read };
            assert_eq!(r.on_background_reply(*call.pending, &answer, &(), 2).tokens, Some(24));
        }
        step => {
            let routed = answered(&mut r, step, &sibling(1), 2);
            assert!(matches!(routed, Step::Route(_)), "{routed:?}");
        }
    }
    r
}

#[test]
fn a_second_sibling_goes_at_once_on_what_it_shares_of_the_first_ones_tokens() {
    let mut r = router("", keys(&sibling(0)), true);
    r.set_background_calls(Some(5));
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q0"), too_large: false }, &(), 0);
    assert!(matches!(answered(&mut r, step, &sibling(0), 1), Step::Route(_)));
    // The shared message spans 38 of the first sibling's 68 bytes: 24 tokens × 38 / 68, less an
    // eighth, is 11 tokens, 2 whole blocks, which B holds.
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q1"), too_large: false }, &(), 2);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.address.as_str(), routed.decision.outcome), (B, Outcome::Exact));
    assert_eq!((routed.decision.matched, routed.report.tokenizer_cache), (2, Some(CacheLookup::SharedPrefix)));
    // Its length estimated at the first one's bytes per token: all 24 tokens are to compute
    // but the 8 of the claimed blocks.
    assert_eq!(routed.prefill_tokens, 16);
    // Where several replicas hold what it claims, it waits.
    let mut both = router("", keys(&sibling(0)), true);
    let on_a = keys(&sibling(0)).into_iter().take(2).collect();
    let delta = Msg::Delta(BlockDelta { replica: 0, added: on_a, removed: vec![] });
    both.feed.apply(&FeedMessage { seq: 3, body: Some(delta) }).unwrap();
    both.set_background_calls(Some(5));
    let step = both.on_body(&Body { path: CHAT, bytes: &chat("", "q0"), too_large: false }, &(), 0);
    assert!(matches!(answered(&mut both, step, &sibling(0), 1), Step::Route(_)));
    let step = both.on_body(&Body { path: CHAT, bytes: &chat("", "q1"), too_large: false }, &(), 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn a_sibling_is_routed_at_once_on_the_prefix_its_siblings_share() {
    let mut r = with_two_siblings("");
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q2"), too_large: false }, &(), 2);
    let Step::RouteThenTokenize(routed, call) = step else { panic!("{step:?}") };
    assert_eq!((routed.address.as_str(), routed.decision.outcome), (B, Outcome::Exact));
    assert_eq!((routed.decision.matched, routed.report.tokenizer_cache), (4, Some(CacheLookup::SharedPrefix)));
    assert!(routed.prefill_tokens > 0, "{routed:?}");
    assert_eq!(call.target, A);
    // Its own tokens (which begin otherwise) narrow the prefix for the next sibling.
    let read = ok_reply(&[0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 54, 55, 56, 57]);
    let read = || read.clone();
    let b =
        r.on_background_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), 3);
    assert_eq!((b.failure, b.tokens), (None, Some(16)));
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q3"), too_large: false }, &(), 4);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.decision.matched, routed.decision.total), (2, 2));
}

#[test]
fn a_sibling_waits_for_its_tokens_where_several_replicas_hold_the_prefix() {
    // A holds the system prompt's blocks too: which of A and B holds more of the request only
    // its own tokens tell.
    let mut r = with_two_siblings("");
    let on_a = keys(&sibling(1)).into_iter().take(4).collect();
    let delta = Msg::Delta(BlockDelta { replica: 0, added: on_a, removed: vec![] });
    r.feed.apply(&FeedMessage { seq: 3, body: Some(delta) }).unwrap();
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q2"), too_large: false }, &(), 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
    // Off, or with other messages before the last, it waits too.
    let mut off = with_two_siblings(r#""route_on_shared_prefixes":false,"#);
    let step = off.on_body(&Body { path: CHAT, bytes: &chat("", "q2"), too_large: false }, &(), 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
    let mut r = with_two_siblings("");
    let step = r.on_body(
        &Body { path: CHAT, bytes: &chat(r#""chat_template_kwargs":{"x":1},"#, "q2"), too_large: false },
        &(),
        2,
    );
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn a_sibling_goes_at_once_where_several_hold_the_prefix_when_its_further_blocks_cost_less_than_the_call() {
    // A and B both hold the system prompt (4 blocks); what either holds past it is at most the
    // question's one further whole block (4 tokens): 4 × 100 µs at the default rate, against
    // calls taking 5 ms.
    use super::shared_data::CallsTaking;
    let mut r = both_holding_with(r#"{"learn_rates":false}"#);
    let sibling_step = |r: &mut Router, gw: &CallsTaking| {
        r.on_body(&Body { path: CHAT, bytes: &chat("", "q2"), too_large: false }, gw, 2)
    };
    // The second sibling waited and found nothing past the prefix: the family lets the next
    // one go at once whatever a call takes (see the test below); past it, the call decides.
    let family_skip = |r: &mut Router| {
        let step = sibling_step(r, &CallsTaking(None));
        assert!(matches!(step, Step::RouteThenTokenize(..)), "{step:?}");
    };
    family_skip(&mut r);
    // Until enough calls were timed, it waits.
    assert!(matches!(sibling_step(&mut r, &CallsTaking(None)), Step::Tokenize(_)));
    let step = sibling_step(&mut r, &CallsTaking(Some(5_000)));
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.decision.matched, routed.report.tokenizer_cache), (4, Some(CacheLookup::SharedPrefix)));
    // Where that block costs more than a call (2 ms a token), it waits.
    let mut dear = both_holding_with(r#"{"learn_rates":false,"prefill_us_per_token":2000}"#);
    family_skip(&mut dear);
    assert!(matches!(sibling_step(&mut dear, &CallsTaking(Some(5_000))), Step::Tokenize(_)));
    // So does the `score` policy, which weighs no time.
    let mut score = both_holding_with(r#"{"policy":"score"}"#);
    family_skip(&mut score);
    assert!(matches!(sibling_step(&mut score, &CallsTaking(Some(5_000))), Step::Tokenize(_)));
}

#[test]
fn siblings_skip_their_wait_once_waiting_found_nothing_past_the_prefix_and_wait_again_once_it_did() {
    // A and B both hold the system prompt; no call was timed, so each sibling would wait. The
    // second sibling waited (on what it claimed of the first's tokens) and found nothing past
    // the prefix.
    let mut r = both_holding_with(r#"{"learn_rates":false}"#);
    let mut steps = Vec::new();
    for i in 2..8u32 {
        let step = r.on_body(&Body { path: CHAT, bytes: &chat("", &format!("q{i}")), too_large: false }, &(), 2);
        match step {
            Step::Tokenize(_) => {
                steps.push('w');
                // Its own tokens: nobody holds past the system prompt, but for the last,
                // which B holds whole (the first sibling's question, in other words).
                let routed = answered(&mut r, step, &sibling(if i == 7 { 0 } else { i }), 3);
                assert!(matches!(routed, Step::Route(_)), "{routed:?}");
            }
            Step::RouteThenTokenize(routed, _) => {
                steps.push('o');
                assert_eq!(routed.report.tokenizer_cache, Some(CacheLookup::SharedPrefix));
            }
            other => panic!("{other:?}"),
        }
    }
    // 1 at once, waited, 3 at once, waited (the question B holds whole).
    assert_eq!(steps.iter().collect::<String>(), "owooow");
    // That wait found B holding past the prefix: the next sibling waits again.
    let step = r.on_body(&Body { path: CHAT, bytes: &chat("", "q10"), too_large: false }, &(), 4);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn a_vm_routes_a_sibling_on_the_prefix_another_vm_kept() {
    use super::shared_data::Kept;
    let gw = Kept::default();
    let mut vm1 = router("", keys(&sibling(0)), true);
    vm1.set_background_calls(Some(5));
    for i in 0..2 {
        let step = vm1.on_body(&Body { path: CHAT, bytes: &chat("", &format!("q{i}")), too_large: false }, &gw, 0);
        let read = ok_reply(&sibling(i));
        let read = || read.clone();
        let reply = TokenizerReply::Answered { status: Some(b"200"), body: &read };
        // The first waits; the second goes at once on what it claims of the first's tokens.
        if i == 0 {
            let Step::Route(routed) = vm1.on_tokenizer_reply(*tokenize(step).pending, &reply, &gw, 1) else { panic!() };
            gw.keep(routed.keep);
        } else {
            let Step::RouteThenTokenize(_, call) = step else { panic!("{step:?}") };
            gw.keep(vm1.on_background_reply(*call.pending, &reply, &gw, 1).keep);
        }
    }
    // VM 2 (the same secret, nothing tokenized itself) routes the third at once.
    let mut vm2 = router("", keys(&sibling(0)), true);
    vm2.set_background_calls(Some(5));
    let step = vm2.on_body(&Body { path: CHAT, bytes: &chat("", "q2"), too_large: false }, &gw, 2);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.address.as_str(), routed.decision.matched), (B, 4));
    assert_eq!(routed.report.tokenizer_cache, Some(CacheLookup::SharedPrefix));
}
