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

/// The replica's streamed answer: `chunks` through the context; what the client gets.
fn stream_answer(e: &super::Env, ctx: &mut super::Request, chunks: &[&str]) -> String {
    use crate::host::{Buffer, Headers, Host};
    e.host.set_header(Headers::Response, ":status", Some("200"));
    e.host.set_header(Headers::Response, "content-type", Some("text/event-stream; charset=utf-8"));
    assert_eq!(ctx.on_http_response_headers(2, false), Action::Continue);
    let mut client = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        e.host.set_buffer(Buffer::Response, c.as_bytes());
        assert_eq!(ctx.on_http_response_body(c.len(), i + 1 == chunks.len()), Action::Continue);
        client.extend(e.host.buffer(Buffer::Response, usize::MAX));
    }
    String::from_utf8(client).unwrap()
}

fn streamed(turns: &[&str]) -> Vec<u8> {
    let body = String::from_utf8(chat(turns)).unwrap();
    body.replacen('{', r#"{"stream":true,"#, 1).into_bytes()
}

/// A chat stream's first event as vLLM sends it when asked, with prompt ids `0..n`.
fn first_event(n: u32) -> String {
    let ids = format!("{:?}", (0..n).collect::<Vec<u32>>()).replace(' ', "");
    format!("data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"prompt_token_ids\":{ids}}}\n\n")
}

/// A chat stream's next event, with text.
const NEXT_EVENT: &str = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n";

/// The first chunk of a stream asked for its ids goes to the client before what it teaches is
/// taken (its ids, its phases): at the next chunk, or at the end of a stream cut after it.
#[test]
fn a_first_chunk_goes_on_before_its_ids_and_phases_are_taken() {
    use crate::host::{Buffer, Headers, Host};
    let first: Vec<u32> = (0..24).collect();
    let e = synced("", vec![], keys(&first), true);
    let (mut ctx, _) = e.request(CHAT, &streamed(&["hi"]));
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&first));
    ctx.on_log();
    let event = first_event(40);
    let next = NEXT_EVENT;
    let read = "llmgw_answer_tokens_total.result.read";
    for cut in [false, true] {
        let samples = e.host.samples("llmgw_phase_upstream_first_chunk_us").len();
        let question = if cut { "and then?" } else { "what now?" };
        let (mut ctx, action) = e.request(CHAT, &streamed(&["hi", "hello there", question]));
        assert_eq!(action, Action::Continue);
        e.host.set_header(Headers::Response, ":status", Some("200"));
        e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
        ctx.on_http_response_headers(2, false);
        let before = e.counter(read);
        e.host.set_buffer(Buffer::Response, event.as_bytes());
        ctx.on_http_response_body(event.len(), false);
        // Handed on rewritten, and nothing taught yet.
        let sent = String::from_utf8(e.host.buffer(Buffer::Response, usize::MAX)).unwrap();
        assert!(sent.contains(r#""prompt_token_ids":null"#), "{sent}");
        assert_eq!(e.counter(read), before);
        assert_eq!(e.host.samples("llmgw_phase_upstream_first_chunk_us").len(), samples);
        if cut {
            ctx.on_log();
        } else {
            e.host.set_buffer(Buffer::Response, next.as_bytes());
            ctx.on_http_response_body(next.len(), false);
        }
        assert_eq!(e.counter(read), before + 1, "cut: {cut}");
        assert_eq!(e.host.samples("llmgw_phase_upstream_first_chunk_us").len(), samples + 1, "cut: {cut}");
        if !cut {
            ctx.on_log();
        }
    }
    // A stream cut after a first event without ids: no call from a context Envoy is destroying.
    let (mut ctx, _) = e.request(CHAT, &streamed(&["hi", "hello there", "and so?"]));
    e.host.set_header(Headers::Response, ":status", Some("200"));
    e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
    ctx.on_http_response_headers(2, false);
    let plain = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[],\"prompt_token_ids\":null}\n\n";
    e.host.set_buffer(Buffer::Response, plain.as_bytes());
    ctx.on_http_response_body(plain.len(), false);
    let (calls, missing) = (e.host.calls.borrow().len(), e.counter("llmgw_answer_tokens_total.result.missing"));
    assert_eq!(e.dest().as_deref(), Some(B));
    let rates = || crate::rates::Learned::read(e.host.as_ref()).of(B);
    let before = rates();
    assert!(before.is_some(), "the streams before taught B's rates");
    ctx.on_log();
    assert_eq!(e.counter("llmgw_answer_tokens_total.result.missing"), missing + 1);
    assert_eq!(e.host.calls.borrow().len(), calls, "no call at the end");
    // Its length stays an estimate: its first chunk teaches B's rates nothing.
    assert_eq!(rates(), before);
}

#[test]
fn a_streamed_next_turn_takes_its_tokens_from_the_answer_and_the_client_sees_the_stream_as_if_unasked() {
    use crate::host::{Buffer, Host};
    let first: Vec<u32> = (0..24).collect();
    let second: Vec<u32> = (0..40).collect();
    let e = synced("", vec![], keys(&first), true);
    let (mut ctx, _) = e.request(CHAT, &streamed(&["hi"]));
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&first));
    ctx.on_log();
    // Turn 2 goes at once and makes no call: its body asks vLLM for the ids, its length too.
    let calls = e.host.calls.borrow().len();
    let body = streamed(&["hi", "hello there", "and then?"]);
    let (mut ctx, action) = e.request_with(CHAT, &body, &[("content-length", &body.len().to_string())]);
    assert_eq!(action, Action::Continue);
    assert_eq!(e.dest().as_deref(), Some(B));
    assert_eq!(e.host.calls.borrow().len(), calls, "no call after routing");
    let sent = e.host.buffer(Buffer::Request, usize::MAX);
    let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(v["return_token_ids"], true);
    assert_eq!(e.host.request_header("content-length"), Some(sent.len().to_string()));
    // The answer, split inside its first event: the client gets vLLM's unasked stream.
    let head = r#"data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":"#;
    let ids = format!("{second:?}").replace(' ', "");
    let rest = format!(
        r#"{ids},"prompt_text":null}}

data: {{"id":"c","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":null,"token_ids":[7]}}]}}

"#
    );
    let last = r#"data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"},"logprobs":null,"finish_reason":"stop","token_ids":[8,9]}]}

data: [DONE]

"#;
    let client = stream_answer(&e, &mut ctx, &[head, &rest, last]);
    let unasked = r#"data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}

data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"},"logprobs":null,"finish_reason":"stop","token_ids":null}]}

data: [DONE]

"#;
    assert_eq!(client, unasked);
    assert_eq!(e.counter("llmgw_answer_tokens_total.result.read"), 1);
    ctx.on_log();
    // The ids were kept: turn 3 goes at once on turn 2's blocks.
    let (_ctx, action) = e.request(CHAT, &streamed(&["hi", "hello there", "and then?", "then this", "ok"]));
    assert_eq!(action, Action::Continue);
    assert_eq!(e.counter("llmgw_tokenizer_cache_total.result.earlier_turn"), 2);
    assert_eq!(e.host.calls.borrow().len(), calls, "no call for turn 3 either");
    // An answer without the ids (an engine that does not know the field): the call is made.
    let (mut ctx, _) = e.request(CHAT, &streamed(&["hi", "hello there", "and then?", "so", "yes"]));
    let plain = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[],\"prompt_token_ids\":null}\n\n";
    assert_eq!(stream_answer(&e, &mut ctx, &[plain]), plain);
    assert_eq!(e.counter("llmgw_answer_tokens_total.result.missing"), 1);
    assert_eq!(e.host.calls.borrow().len(), calls + 1, "the call after all");
    // Turned off, the call follows routing and the body is the client's.
    let off = synced(r#""tokens_from_answers":false,"#, vec![], keys(&first), true);
    let (mut ctx, _) = off.request(CHAT, &streamed(&["hi"]));
    off.answer(&mut ctx, Some("200"), &tokenize_answer(&first));
    let calls = off.host.calls.borrow().len();
    let body = streamed(&["hi", "hello there", "and then?"]);
    let (_ctx, action) = off.request(CHAT, &body);
    assert_eq!(action, Action::Continue);
    assert_eq!(off.host.calls.borrow().len(), calls + 1);
    assert_eq!(off.host.buffer(Buffer::Request, usize::MAX), body);
}

/// A first event split over two chunks: the first chunk's time teaches the replica's rates once
/// the event is whole (its ids known), once.
#[test]
fn a_first_event_split_over_chunks_teaches_the_rates_once_it_is_whole() {
    use crate::host::{Buffer, Headers, Host};
    let first: Vec<u32> = (0..24).collect();
    let e = synced("", vec![], keys(&first), true);
    let (mut ctx, _) = e.request(CHAT, &streamed(&["hi"]));
    e.answer(&mut ctx, Some("200"), &tokenize_answer(&first));
    ctx.on_log();
    let (mut ctx, action) = e.request(CHAT, &streamed(&["hi", "hello there", "and then?"]));
    assert_eq!(action, Action::Continue);
    assert_eq!(e.dest().as_deref(), Some(B));
    let observations = || crate::rates::Learned::read(e.host.as_ref()).of(B).map_or(0, |r| r.observations);
    let event = first_event(40);
    let (head, tail) = event.split_at(event.len() / 2);
    e.host.set_header(Headers::Response, ":status", Some("200"));
    e.host.set_header(Headers::Response, "content-type", Some("text/event-stream"));
    ctx.on_http_response_headers(2, false);
    for part in [head, tail] {
        e.host.set_buffer(Buffer::Response, part.as_bytes());
        ctx.on_http_response_body(part.len(), false);
    }
    // The tail's lessons are taken at the next callback: the event is whole there.
    assert_eq!(observations(), 0);
    let next = NEXT_EVENT;
    e.host.set_buffer(Buffer::Response, next.as_bytes());
    ctx.on_http_response_body(next.len(), true);
    ctx.on_log();
    assert_eq!(e.counter("llmgw_answer_tokens_total.result.read"), 1);
    assert_eq!(observations(), 1);
}
