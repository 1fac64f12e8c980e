//! A completions request is routed at once on the tokens of an earlier text prompt it begins
//! with, or on those of the leading text it shares with one where that decides as its own
//! tokens would.

use super::{keys, ok_reply, replica, router, tokenize, A, B};
use crate::feed::{BlockDelta, Body as Msg, FeedMessage, ReplicaTable};
use crate::flow::{Body, CacheLookup, Router, Step, TokenizerReply};
use crate::policy::Outcome;

const COMPLETIONS: &str = "/v1/completions";

fn completion(prompt: &str) -> Vec<u8> {
    format!(r#"{{"model":"m","prompt":"{prompt}"}}"#).into_bytes()
}

/// 300 bytes every prompt begins with (a system prompt).
fn system() -> String {
    "system: answer briefly. ".repeat(13).chars().take(300).collect()
}

/// A router (B holding `on_b`) that tokenized `prompt` into `tokens`.
fn tokenized_once(extra: &str, on_b: &[u32], prompt: &str, tokens: &[u32]) -> Router {
    let mut r = router(extra, keys(on_b), true);
    r.set_background_calls(Some(5));
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(prompt), too_large: false }, &(), 0);
    let read = ok_reply(tokens);
    let read = || read.clone();
    let reply = TokenizerReply::Answered { status: Some(b"200"), body: &read };
    let routed = r.on_tokenizer_reply(*tokenize(step).pending, &reply, &(), 1);
    assert!(matches!(routed, Step::Route(_)), "{routed:?}");
    r
}

#[test]
fn a_prompt_that_begins_with_an_earlier_one_is_routed_at_once_on_its_tokens() {
    let first = format!("{}user: hello?\\nassistant:", system());
    let tokens: Vec<u32> = (0..24).collect();
    let next = format!("{first} hi.\\nuser: and then?\\nassistant:");
    let mut r = tokenized_once("", &tokens, &first, &tokens);
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&next), too_large: false }, &(), 2);
    let Step::RouteThenTokenize(routed, call) = step else { panic!("{step:?}") };
    // All its tokens but the last: 23, five whole blocks of 4.
    assert_eq!((routed.address.as_str(), routed.decision.outcome), (B, Outcome::Exact));
    assert_eq!((routed.decision.matched, routed.report.tokenizer_cache), (5, Some(CacheLookup::EarlierTurn)));
    assert!(routed.explain("0").contains("; scored_on=earlier_turn; vm=0"), "{}", routed.explain("0"));
    assert_eq!(call.target, A);
    // Both options off: it waits for its call.
    let off = r#""route_on_earlier_turns":false,"route_on_shared_prefixes":false,"#;
    let mut r = tokenized_once(off, &tokens, &first, &tokens);
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&next), too_large: false }, &(), 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn a_prompt_sharing_leading_text_goes_at_once_only_where_one_replica_holds_it() {
    // 340 bytes in 24 tokens: the first 256 bytes' worth is 18 tokens, less an eighth: 16, the
    // four blocks B holds.
    let first = format!("{}user: what is the first question of all?", system());
    assert_eq!(first.len(), 340);
    let shared: Vec<u32> = (0..16).collect();
    let tokens: Vec<u32> = shared.iter().copied().chain(100..108).collect();
    let other = format!("{}user: and another one, quite different?", system());
    let mut r = tokenized_once("", &shared, &first, &tokens);
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&other), too_large: false }, &(), 2);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.address.as_str(), routed.decision.matched), (B, 4));
    assert_eq!(routed.report.tokenizer_cache, Some(CacheLookup::SharedPrefix));
    assert!(routed.explain("0").contains("; scored_on=shared_prefix; vm=0"), "{}", routed.explain("0"));
    // Where A holds them too, which holds more of the request only its tokens tell.
    let mut r = tokenized_once("", &shared, &first, &tokens);
    let delta = Msg::Delta(BlockDelta { replica: 0, added: keys(&shared), removed: vec![] });
    r.feed.apply(&FeedMessage { seq: 3, body: Some(delta) }).unwrap();
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&other), too_large: false }, &(), 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
    // Unless waiting cannot pay: what either holds past those blocks is at most the request's
    // one further whole block (4 tokens at 100 µs), and calls take 5 ms.
    let calls = super::shared_data::CallsTaking(Some(5_000));
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&other), too_large: false }, &calls, 3);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.decision.matched, routed.report.tokenizer_cache), (4, Some(CacheLookup::SharedPrefix)));
    // With shared prefixes off, too.
    let mut r = tokenized_once(r#""route_on_shared_prefixes":false,"#, &shared, &first, &tokens);
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&other), too_large: false }, &(), 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn a_prompt_is_routed_at_once_on_an_earlier_prompt_another_vm_tokenized() {
    use super::shared_data::Kept;
    let first = format!("{}user: hello?\\nassistant:", system());
    let tokens: Vec<u32> = (0..24).collect();
    let next = format!("{first} hi.\\nuser: and then?\\nassistant:");
    let gw = Kept::default();
    // VM 1 tokenizes the first prompt and hands it to the gateway.
    let mut vm1 = router("", keys(&tokens), true);
    vm1.set_background_calls(Some(5));
    let step = vm1.on_body(&Body { path: COMPLETIONS, bytes: &completion(&first), too_large: false }, &gw, 0);
    let read = ok_reply(&tokens);
    let read = || read.clone();
    let reply = TokenizerReply::Answered { status: Some(b"200"), body: &read };
    let Step::Route(routed) = vm1.on_tokenizer_reply(*tokenize(step).pending, &reply, &gw, 1) else { panic!() };
    assert!(routed.keep.prompt.is_some());
    gw.keep(routed.keep);
    // VM 2 (the same secret, nothing tokenized itself) routes the next turn at once.
    let mut vm2 = router("", keys(&tokens), true);
    vm2.set_background_calls(Some(5));
    let step = vm2.on_body(&Body { path: COMPLETIONS, bytes: &completion(&next), too_large: false }, &gw, 2);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.address.as_str(), routed.decision.matched), (B, 5));
    assert_eq!(routed.report.tokenizer_cache, Some(CacheLookup::EarlierTurn));
    // A VM with another secret computes other tags: it waits for its call.
    let mut other = router("", keys(&tokens), true);
    other.set_background_calls(Some(6));
    let step = other.on_body(&Body { path: COMPLETIONS, bytes: &completion(&next), too_large: false }, &gw, 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn prompts_sharing_leading_text_skip_their_wait_once_waiting_found_nothing_past_it() {
    // The system prompt is 20 tokens (5 blocks), which A and B hold and C does not; every
    // prompt's first 256 bytes claim 16 of them. Which of A and B holds more of a prompt only
    // its own tokens tell, and no round trip is known to weigh the wait against.
    let first = format!("{}user: what is the first question of all?", system());
    let shared: Vec<u32> = (0..20).collect();
    let tokens: Vec<u32> = shared.iter().copied().chain(100..104).collect();
    let mut r = tokenized_once("", &shared, &first, &tokens);
    let table = vec![replica(0, A, true), replica(1, B, true), replica(2, "127.0.0.1:8003", true)];
    r.feed.apply(&FeedMessage { seq: 3, body: Some(Msg::Replicas(ReplicaTable { replicas: table })) }).unwrap();
    let delta = Msg::Delta(BlockDelta { replica: 0, added: keys(&shared), removed: vec![] });
    r.feed.apply(&FeedMessage { seq: 4, body: Some(delta) }).unwrap();
    // C holds another prompt.
    let other: Vec<u32> = (500..508).collect();
    let delta = Msg::Delta(BlockDelta { replica: 2, added: keys(&other), removed: vec![] });
    r.feed.apply(&FeedMessage { seq: 5, body: Some(delta) }).unwrap();
    let mut steps = String::new();
    for i in 0..7u32 {
        if i == 6 {
            // B holds the first prompt's 6th block from now on.
            let delta = Msg::Delta(BlockDelta { replica: 1, added: keys(&tokens), removed: vec![] });
            r.feed.apply(&FeedMessage { seq: 6, body: Some(delta) }).unwrap();
        }
        // After the first, the questions begin alike for a mark more than the first's did: the
        // same family still (its tag is the lookup boundary's, 256 bytes).
        let prompt = format!("{}user: a question that begins as the others do, number {i}?", system());
        let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&prompt), too_large: false }, &(), 2);
        match step {
            Step::Tokenize(t) => {
                steps.push('w');
                // Its own tokens: the whole system prompt, which A and B hold alike (past the
                // claim: no gain), then its question; but for the last, which goes on as the
                // first prompt did (B holds its 6th block).
                let tail = if i == 6 { 100 } else { 200 + 10 * i };
                let own: Vec<u32> = shared.iter().copied().chain(tail..tail + 4).collect();
                let read = ok_reply(&own);
                let read = || read.clone();
                let reply = TokenizerReply::Answered { status: Some(b"200"), body: &read };
                let routed = r.on_tokenizer_reply(*t.pending, &reply, &(), 3);
                assert!(matches!(routed, Step::Route(_)), "{routed:?}");
            }
            Step::RouteThenTokenize(routed, _) => {
                steps.push('o');
                assert_eq!(routed.report.tokenizer_cache, Some(CacheLookup::SharedPrefix));
            }
            other => panic!("{other:?}"),
        }
    }
    // Waited, 1 at once, waited, 3 at once, waited (and found B holding more).
    assert_eq!(steps, "wowooow");
    // So the next waits again.
    let prompt = format!("{}user: a question that begins as the others do, number 7?", system());
    let step = r.on_body(&Body { path: COMPLETIONS, bytes: &completion(&prompt), too_large: false }, &(), 4);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}
