//! A conversation's next turn, routed at once on the turn before whichever worker VM it reaches;
//! its own tokenizer call made after routing, its answer kept for the turn after it.

use super::{keys, second_vm, synced, tokenize_answer, B};
use proxy_wasm::traits::HttpContext;
use proxy_wasm::types::Action;

const CHAT: &str = "/v1/chat/completions";

fn chat(turns: &[&str]) -> Vec<u8> {
    let mut messages = vec![r#"{"role":"system","content":"be brief"}"#.to_owned()];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(format!(r#"{{"role":"{role}","content":"{t}"}}"#));
    }
    format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(",")).into_bytes()
}

#[test]
fn the_next_turn_goes_at_once_on_any_vm_and_its_call_follows() {
    let first: Vec<u32> = (0..24).collect();
    let second: Vec<u32> = (0..40).collect();
    let e = synced("", vec![], keys(&first), true);
    let e2 = second_vm(&e, vec![], keys(&first));
    // Turn 1 on the first VM waits for its call.
    let (mut ctx, action) = e.request(CHAT, &chat(&["hi"]));
    assert_eq!(action, Action::Pause);
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&first));
    assert_eq!(e.dest().as_deref(), Some(B));
    ctx.on_log();
    // Turn 2 on the other VM: routed before any call, exactly; its call goes out after.
    let calls = e.host.calls.borrow().len();
    let decided = e.host.samples("llmgw_phase_gateway_us").len();
    let (mut ctx, action) = e2.request(CHAT, &chat(&["hi", "hello there", "and then?"]));
    assert_eq!(action, Action::Continue);
    // Its time in the gateway is recorded at the decision, before its call answers.
    assert_eq!(e.host.samples("llmgw_phase_gateway_us").len(), decided + 1);
    assert_eq!(e2.dest().as_deref(), Some(B));
    assert_eq!(e.host.calls.borrow().len(), calls + 1, "the call after routing");
    assert_eq!(e2.counter("llmgw_tokenizer_cache_total.result.earlier_turn"), 1);
    assert_eq!(e2.counter("llmgw_prefix_decisions_total.outcome.exact"), 2);
    // Its answer is kept: turn 3, on the first VM, goes at once too, on turn 2's 10 blocks.
    e2.answer(&mut ctx, Some("200"), &tokenize_answer(&second));
    ctx.on_log();
    let (_ctx, action) = e.request(CHAT, &chat(&["hi", "hello there", "and then?", "then this", "ok"]));
    assert_eq!(action, Action::Continue);
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.counter("llmgw_tokenizer_cache_total.result.earlier_turn"), 2);
    // Without the option, a turn waits for its call.
    let off = synced(r#""route_on_earlier_turns":false,"#, vec![], keys(&first), true);
    let (mut ctx, _) = off.request(CHAT, &chat(&["hi"]));
    off.answer(&mut ctx, Some("200"), &tokenize_answer(&first));
    let (_ctx, action) = off.request(CHAT, &chat(&["hi", "hello there", "and then?"]));
    assert_eq!(action, Action::Pause);
}
