//! A new prompt (nothing earlier routes it before its tokens) goes at once where new prompts'
//! recent waits for their tokens found nothing worth the wait.

use super::{keys, ok_reply, replica, router, A, B};
use crate::feed::{Body as Msg, FeedMessage, ReplicaTable};
use crate::flow::{
    checkpoints, replica_key, Body, CacheLookup, EarlierTurns, InFlightCounts, LearnedRates, ReplicaAvoidance, Router,
    SpeculativeEntries, SpeculativeHit, Step, TokenizerReply,
};
use std::cell::RefCell;

const COMPLETIONS: &str = "/v1/completions";

/// A streamed completions request whose first 128 bytes are `lead` (padded), then `rest`.
fn prompt(lead: &str, rest: &str) -> Vec<u8> {
    let lead: String = format!("{lead}{}", " pad".repeat(40)).chars().take(128).collect();
    format!(r#"{{"model":"m","stream":true,"prompt":"{lead}{rest}"}}"#).into_bytes()
}

/// Tokens of a prompt nobody holds: 12 of its own (3 blocks).
fn fresh(i: u32) -> Vec<u32> {
    (0..12).map(|k| 1000 * (i + 1) + k).collect()
}

/// Tokens B holds whole: 64 (16 blocks).
fn on_b() -> Vec<u32> {
    (0..64).collect()
}

/// A gateway whose tokenizer calls take `round_trip_us`, with speculative entries recorded
/// through [`Gateway::record`].
struct Gateway {
    round_trip_us: Option<u64>,
    entries: RefCell<Vec<(u64, u64)>>,
}

impl Gateway {
    fn new(round_trip_us: u64) -> Gateway {
        Gateway { round_trip_us: Some(round_trip_us), entries: RefCell::new(Vec::new()) }
    }

    fn record(&self, spec: &crate::flow::Speculation) {
        self.entries.borrow_mut().extend(spec.keys.iter().map(|&k| (k, spec.replica)));
    }
}

impl InFlightCounts for Gateway {
    fn in_flight(&self, _address: &str) -> u32 {
        0
    }
}
impl ReplicaAvoidance for Gateway {}
impl SpeculativeEntries for Gateway {
    fn speculative(&self, keys: &[u64], out: &mut Vec<SpeculativeHit>) {
        for (i, k) in keys.iter().enumerate() {
            if let Some(&(_, engine)) = self.entries.borrow().iter().find(|(e, _)| e == k) {
                out.push(SpeculativeHit { key: i, engine, written_ns: 1 });
            }
        }
    }
}
impl LearnedRates for Gateway {}
impl crate::flow::TokenizerCalls for Gateway {
    fn tokenizer_round_trip_us(&self) -> Option<u64> {
        self.round_trip_us
    }
}
impl EarlierTurns for Gateway {}

fn new_router(extra: &str) -> Router {
    let mut r = router(&format!(r#"{extra}"tokens_from_answers":true,"#), keys(&on_b()), true);
    r.set_background_calls(Some(5));
    r
}

fn reply(tokens: &[u32]) -> impl Fn() -> Vec<u8> {
    let body = ok_reply(tokens);
    move || body.clone()
}

/// Sends `bytes`; a request that waits gets `tokens` as its call's answer. 'w' where it
/// waited, 'o' where it went at once as a new prompt (its tokens given too, as its answer or
/// its call would, its speculative entries recorded).
fn send(r: &mut Router, gw: &Gateway, bytes: &[u8], tokens: &[u32]) -> char {
    match r.on_body(&Body { path: COMPLETIONS, bytes, too_large: false }, gw, 1) {
        Step::Tokenize(call) => {
            let read = reply(tokens);
            let answer = TokenizerReply::Answered { status: Some(b"200"), body: &read };
            let step = r.on_tokenizer_reply(*call.pending, &answer, gw, 2);
            let Step::Route(routed) = step else { panic!("{step:?}") };
            if let Some(spec) = &routed.speculation {
                gw.record(spec);
            }
            'w'
        }
        Step::RouteThenTokenize(routed, call) => {
            assert_eq!(routed.report.tokenizer_cache, Some(CacheLookup::NewPrompt));
            gw.record(routed.speculation.as_ref().expect("the entry of its leading bytes"));
            let read = reply(tokens);
            let answer = TokenizerReply::Answered { status: Some(b"200"), body: &read };
            let b = r.on_background_reply(*call.pending, &answer, gw, 2);
            if let Some(spec) = &b.speculation {
                gw.record(spec);
            }
            'o'
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn new_prompts_go_at_once_once_their_waits_found_nothing_and_wait_again_once_one_did() {
    let gw = Gateway::new(1_000);
    let mut r = new_router("");
    let mut steps = String::new();
    for i in 0..9u32 {
        // The eighth is a prompt B holds whole (64 tokens: 6.4 ms of prefill at the default
        // 100 µs a token, against calls taking 1 ms).
        let tokens = if i == 7 { on_b() } else { fresh(i) };
        steps.push(send(&mut r, &gw, &prompt(&format!("p{i}"), "?"), &tokens));
    }
    // The first waits with no tokens per byte known yet; then waited (nothing held), 1 at
    // once, waited, 3 at once, waited (the prompt B holds: paid), and the next waits again.
    assert_eq!(steps, "wwowoooww");
}

#[test]
fn a_wait_pays_only_where_what_one_replica_holds_more_costs_more_than_the_call() {
    // B holds 64 tokens of the eighth prompt: 6.4 ms of prefill, against calls taking 10 ms.
    let gw = Gateway::new(10_000);
    let mut r = new_router("");
    let steps: String = (0..10u32)
        .map(|i| send(&mut r, &gw, &prompt(&format!("p{i}"), "?"), &if i == 7 { on_b() } else { fresh(i) }))
        .collect();
    assert_eq!(steps, "wwowooowoo");
}

#[test]
fn prompts_beginning_like_one_sent_at_once_follow_it_and_its_tokens_leave_their_entries() {
    let gw = Gateway::new(1_000);
    let mut r = new_router("");
    let steps: String = (0..4u32).map(|i| send(&mut r, &gw, &prompt(&format!("p{i}"), "?"), &fresh(i))).collect();
    // The fourth waited and found nothing: the next three may go at once.
    assert_eq!(steps, "wwow");
    let sent = |r: &mut Router, lead: &str, rest: &str| {
        r.on_body(&Body { path: COMPLETIONS, bytes: &prompt(lead, rest), too_large: false }, &gw, 3)
    };
    let step = sent(&mut r, "p4", "?");
    let Step::RouteThenTokenize(first, call) = step else { panic!("{step:?}") };
    gw.record(first.speculation.as_ref().unwrap());
    // Prompts beginning with the same 128 bytes while its tokens are unknown go at once where
    // it went, credited with the whole blocks of those bytes at the tokens per byte of the
    // calls so far, less an eighth (12 tokens in each call of about 200 bytes: 1 block of 4),
    // whatever the ledger says.
    for i in 0..6 {
        let step = sent(&mut r, "p4", &format!(" and more {i}?"));
        let Step::RouteThenTokenize(follower, _) = step else { panic!("{step:?}") };
        assert_eq!((follower.address.as_str(), follower.decision.matched), (first.address.as_str(), 1));
    }
    // One beginning otherwise goes at once as the ledger allows: two more.
    assert!(matches!(sent(&mut r, "p5", "?"), Step::RouteThenTokenize(..)));
    assert!(matches!(sent(&mut r, "p6", "?"), Step::RouteThenTokenize(..)));
    assert!(matches!(sent(&mut r, "p7", "?"), Step::Tokenize(_)));
    // Its tokens leave the entries a route on them would have left: its blocks at the
    // checkpoints, for the replica it went to.
    let read = reply(&fresh(4));
    let b =
        r.on_background_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &gw, 4);
    let spec = b.speculation.expect("its blocks' entries");
    let blocks = keys(&fresh(4));
    let want: Vec<u64> = checkpoints(blocks.len()).map(|p| blocks[p]).collect();
    assert_eq!((spec.replica, spec.keys), (replica_key(&first.address, first.dp_rank), want));
}

#[test]
fn new_prompts_wait_without_the_setting_a_known_round_trip_or_the_ttft_policy() {
    let run = |r: &mut Router, gw: &Gateway| -> String {
        (0..4u32).map(|i| send(r, gw, &prompt(&format!("p{i}"), "?"), &fresh(i))).collect()
    };
    assert_eq!(run(&mut new_router(""), &Gateway::new(1_000)), "wwow");
    assert_eq!(run(&mut new_router(r#""route_new_prompts":false,"#), &Gateway::new(1_000)), "wwww");
    let unknown = Gateway { round_trip_us: None, entries: RefCell::new(Vec::new()) };
    assert_eq!(run(&mut new_router(""), &unknown), "wwww");
    // The `score` policy: the profile of the tests' router with its weights replaced.
    let json = format!(
        r#"{{"tokens_from_answers":true,"profiles":[{{"name":"p","models":["m"],"kv_events":true,"block_size":{},"seed":"0","weights":{{"policy":"score"}}}}]}}"#,
        super::BS
    );
    let config =
        crate::config::Compiled::from_json(json.as_bytes(), Some(crate::config::MemoSettings { slots: 64, key: 1 }))
            .unwrap();
    let mut score = Router::new(config, 2);
    score.set_background_calls(Some(5));
    score.feed.begin_subscription();
    for (seq, body) in [
        Msg::Replicas(ReplicaTable { replicas: vec![replica(0, A, true), replica(1, B, true)] }),
        Msg::SnapshotComplete(crate::feed::SnapshotComplete {}),
    ]
    .into_iter()
    .enumerate()
    {
        score.feed.apply(&FeedMessage { seq: seq as u64, body: Some(body) }).unwrap();
    }
    assert_eq!(run(&mut score, &Gateway::new(1_000)), "wwww");
}
