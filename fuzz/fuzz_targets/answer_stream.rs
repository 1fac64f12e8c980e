//! The rewriting of a streamed answer asked for its prompt's token ids (`AnswerStream`), on any
//! bytes a replica could send: no panic; the same output however the bytes are split into
//! chunks; an event that was a JSON object comes out a JSON object (or not at all), with no
//! integer array left under `prompt_token_ids` or `token_ids` (keys written without escapes,
//! as vLLM writes them).
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::request::{AnswerStream, FirstEvent};
use serde_json::Value;

fn whole(chunks: &[&[u8]]) -> (Vec<u8>, Option<FirstEvent>) {
    let mut s = AnswerStream::default();
    let mut out = Vec::new();
    let last = chunks.len().saturating_sub(1);
    for (i, c) in chunks.iter().enumerate() {
        out.extend(s.feed(c, i == last));
    }
    (out, s.take_first())
}

/// Whether `v` holds, at any depth, an id key whose value is an array of integers.
fn has_ids(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.iter().any(|(k, x)| {
            let ints = x.as_array().is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_u64));
            ((k == "prompt_token_ids" || k == "token_ids") && ints) || has_ids(x)
        }),
        Value::Array(a) => a.iter().any(has_ids),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, rest)) = data.split_first() else { return };
    let at = usize::from(cut).min(rest.len());
    let (a, b) = rest.split_at(at);
    assert_eq!(whole(&[rest]), whole(&[a, b]), "the output depends on where the chunks split");
    // Each event alone: a JSON object in, a JSON object (or nothing) out, its ids gone.
    for event in rest.split_inclusive(|b| *b == b'\n').collect::<Vec<_>>().windows(2) {
        let [line, blank] = event else { continue };
        if *blank != b"\n" {
            continue;
        }
        let Some(json) = line.strip_prefix(b"data: ") else { continue };
        let Ok(Value::Object(_)) = serde_json::from_slice::<Value>(json) else { continue };
        let input = [*line, *blank].concat();
        let (out, _) = whole(&[&input]);
        if out.is_empty() {
            continue;
        }
        let body = out.strip_prefix(b"data: ").expect("the event keeps its field name");
        let v: Value = serde_json::from_slice(body).expect("a JSON object stays JSON");
        // Keys are matched as vLLM writes them: one spelled with escapes is not an id key.
        if !json.contains(&b'\\') {
            assert!(!has_ids(&v), "ids left in {}", String::from_utf8_lossy(&out));
        }
    }
});
