//! Fuzzes request bodies as the router reads them: `parse_request` for each API (first byte),
//! then what the router derives from a parsed body. The `/tokenize` call's body must be JSON
//! (when the client's is; the render endpoints get the client's body as sent),
//! and a chat's leading text (read by a hand-written walker over the raw messages) must be
//! byte for byte what a full serde_json parse of the messages gives, capped at `max` (from the
//! first byte too). Messages with a duplicate key, or that serde_json refuses (a lone surrogate
//! escape, which the raw-JSON validation lets through), have no reference and are only run.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llmgw_core::config::TokenizerEndpoint;
use llmgw_core::request::{parse_request, ApiKind, Prompt};
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::collections::HashSet;

/// Any JSON value, refused if an object repeats a key (where "what a full parse gives" is not
/// one thing).
struct NoDuplicateKeys;

impl<'de> Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Walk)
    }
}

struct Walk;

impl<'de> Visitor<'de> for Walk {
    type Value = NoDuplicateKeys;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<NoDuplicateKeys>()?.is_some() {}
        Ok(NoDuplicateKeys)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        while let Some(k) = map.next_key::<String>()? {
            if !seen.insert(k) {
                return Err(de::Error::custom("duplicate key"));
            }
            map.next_value::<NoDuplicateKeys>()?;
        }
        Ok(NoDuplicateKeys)
    }
}

/// The leading text by the documented rule, from a full parse: for each message its role and
/// a newline, its text (string content, or the `text` of each object part) and a newline; a
/// message that is not an object counts as an empty role and no text. Capped at `max` bytes.
fn reference(messages: &str, max: usize) -> Option<Vec<u8>> {
    serde_json::from_str::<NoDuplicateKeys>(messages).ok()?;
    let v: Value = serde_json::from_str(messages).ok()?;
    let mut out = Vec::new();
    for m in v.as_array()? {
        match m.as_object() {
            None => out.extend_from_slice(b"\n\n"),
            Some(o) => {
                out.extend_from_slice(o.get("role").and_then(Value::as_str).unwrap_or("").as_bytes());
                out.push(b'\n');
                match o.get("content") {
                    Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
                    Some(Value::Array(parts)) => {
                        for p in parts {
                            if let Some(t) = p.get("text").and_then(Value::as_str) {
                                out.extend_from_slice(t.as_bytes());
                            }
                        }
                    }
                    _ => {}
                }
                out.push(b'\n');
            }
        }
        if out.len() >= max {
            break;
        }
    }
    out.truncate(max);
    Some(out)
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else { return };
    let kind = match sel % 3 {
        0 => ApiKind::Completions,
        1 => ApiKind::Chat,
        _ => ApiKind::Other,
    };
    let max = usize::from(sel / 3) * 4;
    let Ok(parsed) = parse_request(kind, body) else { return };
    // The raw-JSON validation lets a lone surrogate escape through (vLLM's Python parser takes
    // it): the `/tokenize` body must be strict JSON when the client's is.
    let strict = serde_json::from_slice::<Value>(body).is_ok();
    for endpoint in [TokenizerEndpoint::Tokenize, TokenizerEndpoint::Render] {
        if let Some(call) = parsed.tokenizer_call(endpoint, body) {
            // The render endpoints get the client's body as sent (a body with invalid UTF-8 in
            // a field the router ignores parses; vLLM answers it as it would the request).
            if call.path.ends_with("/render") {
                assert_eq!(call.body, body);
            } else if let (true, Err(e)) = (strict, serde_json::from_slice::<Value>(&call.body)) {
                panic!(
                    "tokenizer call body to {} is not JSON ({e}): {:?}",
                    call.path,
                    String::from_utf8_lossy(&call.body)
                );
            }
        }
    }
    let mut out = Vec::new();
    parsed.leading_text(max, &mut out);
    assert!(out.len() <= max);
    if let Prompt::Chat(messages) = &parsed.prompt {
        if let Some(want) = reference(messages.get(), max) {
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&want),
                "leading text differs from a full parse's (max {max})"
            );
            assert_eq!(out, want);
        }
    }
});
