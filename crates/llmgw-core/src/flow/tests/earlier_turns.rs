//! The next turn of a conversation is routed on the turn before, and tokenized after routing.

use super::{keys, ok_reply, router, tokenize, A, B};
use crate::flow::{Body, CacheLookup, Router, Step, TokenizerReply};
use crate::policy::Outcome;

const CHAT: &str = "/v1/chat/completions";

/// A chat body whose messages are `turns` (alternately user and assistant), after a system one.
fn chat(extra: &str, turns: &[&str]) -> Vec<u8> {
    let mut messages = vec![r#"{"role":"system","content":"be brief"}"#.to_owned()];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(format!(r#"{{"role":"{role}","content":"{t}"}}"#));
    }
    format!(r#"{{"model":"m",{extra}"messages":[{}]}}"#, messages.join(",")).into_bytes()
}

fn on_body(r: &mut Router, bytes: &[u8], now_ns: u64) -> Step {
    r.on_body(&Body { path: CHAT, bytes, too_large: false }, &(), now_ns)
}

fn reply(tokens: &[u32]) -> impl Fn() -> Vec<u8> {
    let answer = ok_reply(tokens);
    move || answer.clone()
}

/// A gateway with one request in flight on A.
struct ABusy;
impl crate::flow::InFlightCounts for ABusy {
    fn in_flight(&self, address: &str) -> u32 {
        u32::from(address == A)
    }
}
impl crate::flow::ReplicaAvoidance for ABusy {}
impl crate::flow::SpeculativeEntries for ABusy {}
impl crate::flow::LearnedRates for ABusy {}
impl crate::flow::TokenizerCalls for ABusy {}
impl crate::flow::EarlierTurns for ABusy {}

#[test]
fn the_next_turn_is_routed_on_the_turn_before_and_tokenized_after() {
    // Turn 1's prompt is 24 tokens (6 blocks), all held by B; turn 2 extends it to 40.
    let first: Vec<u32> = (0..24).collect();
    let second: Vec<u32> = (0..40).collect();
    let mut r = router("", keys(&first), true);
    r.set_background_calls(Some(5));
    let call = tokenize(on_body(&mut r, &chat("", &["hi"]), 0));
    let read = reply(&first);
    let step =
        r.on_tokenizer_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), 1);
    let Step::Route(turn1) = step else { panic!("{step:?}") };
    assert_eq!(turn1.address, B);
    // Turn 2: routed at once, exactly, on turn 1's blocks; its own call follows. (A has a
    // request in flight: B is the least loaded, yet the call goes to A.)
    let bytes = chat("", &["hi", "hello there", "and then?"]);
    let step = r.on_body(&Body { path: CHAT, bytes: &bytes, too_large: false }, &ABusy, 2);
    let Step::RouteThenTokenize(turn2, call) = step else { panic!("{step:?}") };
    assert_eq!((turn2.address.as_str(), turn2.decision.outcome), (B, Outcome::Exact));
    assert_eq!((turn2.decision.matched, turn2.report.tokenizer_cache), (6, Some(CacheLookup::EarlierTurn)));
    // Its call goes to the other replica, not to the one computing it.
    assert_eq!(call.target, A);
    // Its prompt estimated from turn 1's bytes per token: more than turn 1's tokens.
    assert!(turn2.prefill_tokens > 0, "{turn2:?}");
    let read = reply(&second);
    let b =
        r.on_background_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), 3);
    assert_eq!((b.failure, b.tokens), (None, Some(40)));
    assert!(b.estimated_tokens.is_some_and(|e| e > 24), "{b:?}");
    // Turn 2 sent again is a cache hit; turn 3 is routed on turn 2's tokens (10 blocks, of
    // which B holds 6).
    let again = on_body(&mut r, &chat("", &["hi", "hello there", "and then?"]), 4);
    assert!(matches!(&again, Step::Route(t) if t.report.tokenizer_cache == Some(CacheLookup::RawBodyHit)), "{again:?}");
    let step = on_body(&mut r, &chat("", &["hi", "hello there", "and then?", "then this", "ok"]), 5);
    let Step::RouteThenTokenize(turn3, _) = step else { panic!("{step:?}") };
    assert_eq!((turn3.address.as_str(), turn3.decision.matched, turn3.decision.total), (B, 6, 10));
}

#[test]
fn a_turn_is_routed_on_an_earlier_one_only_when_everything_but_its_messages_matches() {
    let first: Vec<u32> = (0..24).collect();
    let turn2 = |extra: &str| chat(extra, &["hi", "hello there", "and then?"]);
    let mut r = router("", keys(&first), true);
    r.set_background_calls(Some(5));
    let call = tokenize(on_body(&mut r, &chat("", &["hi"]), 0));
    let read = reply(&first);
    let _ =
        r.on_tokenizer_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), 1);
    // Other tools, another template argument, a salt: another rendering or other hashes.
    for extra in [
        r#""tools":[{"type":"function","function":{"name":"f"}}],"#,
        r#""chat_template_kwargs":{"x":1},"#,
        r#""cache_salt":"s","#,
    ] {
        let step = on_body(&mut r, &turn2(extra), 2);
        assert!(matches!(step, Step::Tokenize(_)), "{extra}: {step:?}");
    }
    // A host that cannot call after routing waits for the call, as with the option off.
    let mut waits = router("", keys(&first), true);
    let call = tokenize(on_body(&mut waits, &chat("", &["hi"]), 0));
    let _ = waits.on_tokenizer_reply(
        *call.pending,
        &TokenizerReply::Answered { status: Some(b"200"), body: &read },
        &(),
        1,
    );
    assert!(matches!(on_body(&mut waits, &turn2(""), 2), Step::Tokenize(_)));
    let mut off = router(r#""route_on_earlier_turns":false,"#, keys(&first), true);
    off.set_background_calls(Some(5));
    let call = tokenize(on_body(&mut off, &chat("", &["hi"]), 0));
    let _ =
        off.on_tokenizer_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), 1);
    assert!(matches!(on_body(&mut off, &turn2(""), 2), Step::Tokenize(_)));
    // A failed call after routing caches nothing: the turn after it waits for its own call.
    let mut r = router("", keys(&first), true);
    r.set_background_calls(Some(5));
    let call = tokenize(on_body(&mut r, &chat("", &["hi"]), 0));
    let _ =
        r.on_tokenizer_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &(), 1);
    let Step::RouteThenTokenize(_, call) = on_body(&mut r, &turn2(""), 2) else { panic!() };
    let b = r.on_background_reply(*call.pending, &TokenizerReply::Reset, &(), 3);
    assert!(b.failure.is_some() && b.tokens.is_none());
    let step = on_body(&mut r, &chat("", &["hi", "hello there", "and then?", "then this", "ok"]), 4);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}

#[test]
fn the_next_turn_is_routed_on_tokens_another_vm_kept() {
    use super::shared_data::Kept;
    let first: Vec<u32> = (0..24).collect();
    let gw = Kept::default();
    // VM 1 tokenizes turn 1 and hands its tokens to the gateway; VM 2 (the same turn secret,
    // its own cache) routes turn 2 on them.
    let mut vm1 = router("", keys(&first), true);
    vm1.set_background_calls(Some(5));
    let call = tokenize(vm1.on_body(&Body { path: CHAT, bytes: &chat("", &["hi"]), too_large: false }, &gw, 0));
    let read = reply(&first);
    let step =
        vm1.on_tokenizer_reply(*call.pending, &TokenizerReply::Answered { status: Some(b"200"), body: &read }, &gw, 1);
    let Step::Route(turn1) = step else { panic!("{step:?}") };
    assert!(!turn1.keep.tokens.is_empty(), "turn 1's tokens are kept");
    gw.keep(turn1.keep);
    let mut vm2 = router("", keys(&first), true);
    vm2.set_background_calls(Some(5));
    let turn2 = chat("", &["hi", "hello there", "and then?"]);
    let step = vm2.on_body(&Body { path: CHAT, bytes: &turn2, too_large: false }, &gw, 2);
    let Step::RouteThenTokenize(routed, _) = step else { panic!("{step:?}") };
    assert_eq!((routed.address.as_str(), routed.decision.matched), (B, 6));
    // A VM with another secret computes other tags: it waits for the tokenizer.
    let mut other = router("", keys(&first), true);
    other.set_background_calls(Some(6));
    let step = other.on_body(&Body { path: CHAT, bytes: &turn2, too_large: false }, &gw, 2);
    assert!(matches!(step, Step::Tokenize(_)), "{step:?}");
}
