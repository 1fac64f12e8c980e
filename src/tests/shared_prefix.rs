//! A chat request whose siblings (the same messages but the last) were tokenized goes at once on
//! the tokens they share, and its own call follows; a text prompt on an earlier prompt it begins
//! with.

use super::{keys, second_vm, synced, tokenize_answer, B};
use crate::host::{Headers, Host};
use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::Action;

const CHAT: &str = "/v1/chat/completions";

fn chat(question: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"be brief"}},{{"role":"user","content":"{question}"}}]}}"#
    )
    .into_bytes()
}

/// A sibling's tokens: 16 shared (the system prompt), then 8 of its own.
fn sibling(i: u32) -> Vec<u32> {
    (0..16).chain((0..8).map(|k| 100 * (i + 1) + k)).collect()
}

#[test]
fn a_sibling_goes_at_once_once_another_was_tokenized() {
    let e = synced("", vec![], keys(&sibling(0)), true);
    // The first waits for its call.
    let (mut ctx, action) = e.request(CHAT, &chat("q0"));
    assert_eq!(action, Action::Pause);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(0)));
    assert_eq!(e.dest().as_deref(), Some(B));
    ctx.on_log();
    // The second is routed before any call, on what it shares of the first's tokens, to the
    // replica holding them; its call goes out after. So is the third, on what both share.
    for i in 1..3 {
        let calls = e.host.calls.borrow().len();
        let (mut ctx, action) = e.request(CHAT, &chat(&format!("q{i}")));
        assert_eq!(action, Action::Continue, "sibling {i}");
        assert_eq!(e.dest().as_deref(), Some(B));
        assert_eq!(e.host.calls.borrow().len(), calls + 1, "the call after routing");
        assert_eq!(e.counter("llmgw_tokenizer_cache_total.result.shared_prefix"), i64::from(i));
        e.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(i)));
        ctx.on_log();
    }
    // Without the option, every sibling waits.
    let off = synced(r#""route_on_shared_prefixes":false,"#, vec![], keys(&sibling(0)), true);
    for i in 0..3 {
        let (mut ctx, action) = off.request(CHAT, &chat(&format!("q{i}")));
        assert_eq!(action, Action::Pause, "sibling {i}");
        off.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(i)));
        ctx.on_log();
    }
}

#[test]
fn where_two_replicas_hold_the_prefix_a_sibling_goes_at_once_once_calls_are_known_to_take_longer_than_its_further_blocks(
) {
    // A and B both hold the system prompt: each sibling waits for its call, which takes 5 ms.
    // B holds the first sibling whole, and every later one's own tokens turn out to be the
    // first's (its question asked again): waiting pays, so only the calls' timing can let a
    // sibling go at once.
    // The siblings reach two worker VMs in turn: the calls either makes count for both.
    let system: Vec<u64> = keys(&sibling(0)).into_iter().take(4).collect();
    let e = synced("", system.clone(), keys(&sibling(0)), true);
    let e2 = second_vm(&e, system, keys(&sibling(0)));
    let mut i = 0;
    loop {
        let vm = if i % 2 == 0 { &e } else { &e2 };
        let (mut ctx, action) = vm.request(CHAT, &chat(&format!("q{i}")));
        if action == Action::Continue {
            break;
        }
        e.host.now_ns.set(e.host.now_ns.get() + 5_000_000);
        vm.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(if i < 2 { i } else { 0 })));
        ctx.on_log();
        i += 1;
        assert!(i <= 8, "still waiting after {i} calls");
    }
    // Once 8 calls were timed, 4 by each worker: its one further block (4 tokens at 100 µs) is
    // worth less than a call.
    assert_eq!(i, 8);
    assert_eq!(e.counter("llmgw_tokenizer_cache_total.result.shared_prefix"), 1);
}

#[test]
fn a_text_prompt_goes_at_once_on_an_earlier_prompt_it_begins_with_on_any_vm() {
    const COMPLETIONS: &str = "/v1/completions";
    let first = format!("system: {}\\nuser: hello?\\nassistant:", "be brief. ".repeat(14));
    let second = format!("{first} hi.\\nuser: more?\\nassistant:");
    let completion = |prompt: &str| format!(r#"{{"model":"m","prompt":"{prompt}"}}"#).into_bytes();
    let e = synced("", vec![], keys(&sibling(0)), true);
    let e2 = second_vm(&e, vec![], keys(&sibling(0)));
    let (mut ctx, action) = e.request(COMPLETIONS, &completion(&first));
    assert_eq!(action, Action::Pause);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(0)));
    assert_eq!(e.dest().as_deref(), Some(B));
    ctx.on_log();
    // The next turn, written out as text, on the other VM: routed before its call, which goes
    // out after.
    let calls = e.host.calls.borrow().len();
    let (mut ctx, action) = e2.request(COMPLETIONS, &completion(&second));
    assert_eq!(action, Action::Continue);
    assert_eq!(e2.dest().as_deref(), Some(B));
    assert_eq!(e.host.calls.borrow().len(), calls + 1, "the call after routing");
    assert_eq!(e2.counter("llmgw_tokenizer_cache_total.result.earlier_turn"), 1);
    e2.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(1)));
    ctx.on_log();
}

#[test]
fn a_first_token_that_came_before_the_call_after_routing_answered_teaches_the_rates_once_it_does() {
    let e = synced("", vec![], keys(&sibling(0)), true);
    let (mut ctx, action) = e.request(CHAT, &chat("q0"));
    assert_eq!(action, Action::Pause);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(0)));
    ctx.on_log();
    // A sibling goes at once, its length estimated; not asked to stream, so its tokens come
    // from a call after routing. Its answer streams all the same, and its first chunks come
    // (and go on) before the call answers.
    let (mut ctx, action) = e.request(CHAT, &chat("q1"));
    assert_eq!(action, Action::Continue);
    let learned = || crate::rates::Learned::read(e.host.as_ref()).of(B).is_some();
    e.host.set_header(Headers::Response, ":status", Some("200"));
    e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
    ctx.on_http_response_headers(2, false);
    e.host.now_ns.set(e.host.now_ns.get() + 10_000_000);
    ctx.on_http_response_body(64, false);
    ctx.on_http_response_body(64, false);
    assert!(!learned(), "nothing learned from an estimate");
    // Its tokens: the first chunk's time teaches B's rates, with the length they say, once.
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&sibling(1)));
    assert!(learned());
    ctx.on_http_response_body(64, true);
    ctx.on_log();
    assert_eq!(crate::rates::Learned::read(e.host.as_ref()).of(B).map(|r| r.observations), Some(1));
}
