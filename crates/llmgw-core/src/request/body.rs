//! Parsing a generation request body into a [`ParsedRequest`]. Only a JSON object is a
//! request. The scalar fields and `prompt` read as absent when of the wrong type (an empty
//! cache salt too); `messages` must be an array or null, and an empty array is no prompt. Chat
//! messages and template inputs stay the raw JSON the client sent (validated, never decoded).

use super::{ApiKind, ParsedRequest, Prompt, RawJson, RequestError};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

#[derive(Deserialize)]
struct RawRequest {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    stream: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Box<RawValue>>,
    #[serde(default)]
    add_generation_prompt: Option<Value>,
    #[serde(default)]
    continue_final_message: Option<Value>,
    #[serde(default)]
    add_special_tokens: Option<Value>,
    #[serde(default)]
    chat_template: Option<Box<RawValue>>,
    #[serde(default)]
    chat_template_kwargs: Option<Box<RawValue>>,
    #[serde(default)]
    tools: Option<Box<RawValue>>,
}

fn string(v: Option<Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn boolean(v: &Option<Value>) -> Option<bool> {
    v.as_ref().and_then(Value::as_bool)
}

/// A raw value unless it is JSON `null`.
fn non_null(v: Option<Box<RawValue>>) -> Option<RawJson> {
    v.filter(|v| v.get() != "null").map(RawJson)
}

/// The first byte of JSON text after whitespace.
fn first_byte(s: &[u8]) -> Option<u8> {
    s.iter().copied().find(|b| !b.is_ascii_whitespace())
}

/// Token ids from a JSON array, if every element is a u32.
fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items.iter().map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

fn completion_prompt(v: Option<Value>) -> Prompt {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Prompt::Text(s),
        Some(Value::Array(items)) => {
            match items.first() {
                // A batch of prompts: each is its own engine request; route by the first.
                Some(Value::String(s)) => Prompt::Text(s.clone()),
                Some(Value::Array(inner)) => token_ids(inner).map_or(Prompt::None, Prompt::Tokens),
                Some(_) => token_ids(&items).map_or(Prompt::None, Prompt::Tokens),
                None => Prompt::None,
            }
        }
        _ => Prompt::None,
    }
}

/// Parses a generation request body for the API its path names.
pub fn parse_request(kind: ApiKind, body: &[u8]) -> Result<ParsedRequest, RequestError> {
    // serde would also read a struct from a JSON array (by position): only objects are requests.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(RequestError::Unparseable("not a JSON object".into()));
    }
    let raw: RawRequest = serde_json::from_slice(body).map_err(|e| RequestError::Unparseable(e.to_string()))?;
    let prompt = match kind {
        ApiKind::Completions => completion_prompt(raw.prompt),
        ApiKind::Chat => match raw.messages {
            None => Prompt::None,
            Some(m) if m.get() == "null" => Prompt::None,
            Some(m) => {
                let text = m.get().as_bytes();
                if first_byte(text) != Some(b'[') {
                    return Err(RequestError::Unparseable("`messages` is not an array".into()));
                }
                // `[` then `]` (whitespace aside) is the empty array.
                if first_byte(text.get(1..).unwrap_or_default()) == Some(b']') {
                    Prompt::None
                } else {
                    Prompt::Chat(RawJson(m))
                }
            }
        },
        ApiKind::Other => Prompt::None,
    };
    Ok(ParsedRequest {
        kind,
        stream: boolean(&raw.stream).unwrap_or(false),
        add_generation_prompt: boolean(&raw.add_generation_prompt),
        continue_final_message: boolean(&raw.continue_final_message),
        add_special_tokens: boolean(&raw.add_special_tokens),
        model: string(raw.model),
        cache_salt: string(raw.cache_salt).filter(|s| !s.is_empty()),
        prompt,
        chat_template: non_null(raw.chat_template),
        chat_template_kwargs: non_null(raw.chat_template_kwargs),
        tools: non_null(raw.tools),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenizerEndpoint;
    use crate::request::tests::body;
    use serde_json::json;

    #[test]
    fn completion_text_and_tokens() {
        let r = parse_request(
            ApiKind::Completions,
            &body(json!({"model":"m","prompt":"hello","stream":true,"cache_salt":"s1","max_tokens":3})),
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.stream);
        assert_eq!(r.cache_salt.as_deref(), Some("s1"));
        assert_eq!(r.prompt, Prompt::Text("hello".into()));
        let call = r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap();
        assert_eq!(call.path, "/tokenize");
        let sent: Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(sent, json!({"model":"m","prompt":"hello","add_special_tokens":true}));

        let r = parse_request(ApiKind::Completions, &body(json!({"model":"m","prompt":[1,2,3]}))).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert!(!r.stream);
        assert_eq!(r.tokenizer_call(TokenizerEndpoint::Tokenize, b""), None);
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":[[7,8],[9]]}))).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![7, 8]));
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":["a","b"]}))).unwrap();
        assert_eq!(r.prompt, Prompt::Text("a".into()));
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":[1,-2]}))).unwrap();
        assert_eq!(r.prompt, Prompt::None);
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":"x","add_special_tokens":false}))).unwrap();
        let sent: Value =
            serde_json::from_slice(&r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap().body).unwrap();
        assert_eq!(sent["add_special_tokens"], json!(false));
    }

    #[test]
    fn bad_bodies() {
        assert!(matches!(parse_request(ApiKind::Chat, b"not json"), Err(RequestError::Unparseable(_))));
        assert!(matches!(parse_request(ApiKind::Chat, br#"{"messages":"x"}"#), Err(RequestError::Unparseable(_))));
        assert!(matches!(parse_request(ApiKind::Chat, b"[1,2]"), Err(RequestError::Unparseable(_))));
        let r = parse_request(ApiKind::Chat, br#"{"model":3,"messages":[]}"#).unwrap();
        assert_eq!(r.model, None);
        assert_eq!(r.prompt, Prompt::None);
        assert_eq!(r.tokenizer_call(TokenizerEndpoint::Tokenize, b""), None);
    }
}
