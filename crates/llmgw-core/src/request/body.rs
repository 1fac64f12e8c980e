//! Parsing a generation request body into a [`ParsedRequest`]. Only a JSON object is a
//! request. The scalar fields and `prompt` read as absent when of the wrong type (an empty
//! cache salt too); `messages` must be an array or null, and an empty array is no prompt. Chat
//! messages and template inputs stay the raw JSON the client sent (validated, never decoded).

use super::parsed::{ApiKind, ParsedRequest, Prompt, RawJson, RequestError};
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fmt;

/// The fields the router reads, each borrowed as the raw JSON text the client sent and read
/// typed only when used: no value tree is built for any of them (a 32 MiB array of token ids
/// parses into one `Vec<u32>`, not tens of millions of JSON values).
#[derive(Deserialize)]
struct RawRequest<'a> {
    #[serde(default, borrow)]
    model: Option<&'a RawValue>,
    #[serde(default, borrow)]
    stream: Option<&'a RawValue>,
    #[serde(default, borrow)]
    cache_salt: Option<&'a RawValue>,
    #[serde(default, borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(default, borrow)]
    messages: Option<&'a RawValue>,
    #[serde(default, borrow)]
    add_generation_prompt: Option<&'a RawValue>,
    #[serde(default, borrow)]
    continue_final_message: Option<&'a RawValue>,
    #[serde(default, borrow)]
    add_special_tokens: Option<&'a RawValue>,
    #[serde(default, borrow)]
    chat_template: Option<&'a RawValue>,
    #[serde(default, borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tools: Option<&'a RawValue>,
    #[serde(default, borrow)]
    echo: Option<&'a RawValue>,
    #[serde(default, borrow)]
    return_token_ids: Option<&'a RawValue>,
    #[serde(default, borrow)]
    truncate_prompt_tokens: Option<&'a RawValue>,
}

/// A string field, absent when of another type (read only if the text starts a string).
fn string(v: Option<&RawValue>) -> Option<String> {
    let v = v?;
    (first_byte(v.get().as_bytes()) == Some(b'"')).then(|| serde_json::from_str::<String>(v.get()).ok()).flatten()
}

fn boolean(v: Option<&RawValue>) -> Option<bool> {
    match v.map(|v| v.get().trim()) {
        Some("true") => Some(true),
        Some("false") => Some(false),
        _ => None,
    }
}

/// A raw value unless it is JSON `null`.
fn non_null(v: Option<&RawValue>) -> Option<RawJson> {
    v.filter(|v| v.get() != "null").map(|v| RawJson(v.to_owned()))
}

/// The first byte of JSON text after whitespace.
fn first_byte(s: &[u8]) -> Option<u8> {
    s.iter().copied().find(|b| !b.is_ascii_whitespace())
}

/// Token ids: every element a u32, else `None` (the rest is skipped without being kept).
struct TokenIds(Option<Vec<u32>>);

impl<'de> Deserialize<'de> for TokenIds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenIds;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of token ids")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TokenIds, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(t) = seq.next_element::<Token>()? {
                    match t.0 {
                        Some(id) => ids.push(id),
                        None => {
                            while seq.next_element::<IgnoredAny>()?.is_some() {}
                            return Ok(TokenIds(None));
                        }
                    }
                }
                Ok(TokenIds(Some(ids)))
            }
        }
        d.deserialize_seq(V)
    }
}

/// One element of a token array: a u32, or anything else (consumed, `None`).
struct Token(Option<u32>);

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Token;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Token, E> {
                Ok(Token(u32::try_from(n).ok()))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Token, E> {
                Ok(Token(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Token, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Token(None))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Token, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Token(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// A completion's `prompt` array of prompts (a batch: each is its own engine request; route by
/// the first): text or token ids from its first element, the rest skipped.
struct FirstPrompt(Prompt);

impl<'de> Deserialize<'de> for FirstPrompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FirstPrompt;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a batch of prompts")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FirstPrompt, A::Error> {
                let first = seq.next_element::<&RawValue>()?;
                let prompt = match first.map(|f| (f, first_byte(f.get().as_bytes()))) {
                    Some((f, Some(b'"'))) => serde_json::from_str::<String>(f.get()).map_or(Prompt::None, Prompt::Text),
                    Some((f, Some(b'['))) => token_prompt(f.get()),
                    _ => Prompt::None,
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(FirstPrompt(prompt))
            }
        }
        d.deserialize_seq(V)
    }
}

/// Token ids from a JSON array, `None` unless every element is a u32.
fn token_prompt(text: &str) -> Prompt {
    serde_json::from_str::<TokenIds>(text).ok().and_then(|t| t.0).map_or(Prompt::None, Prompt::Tokens)
}

fn completion_prompt(v: Option<&RawValue>) -> Prompt {
    let Some(v) = v else { return Prompt::None };
    let text = v.get().as_bytes();
    match first_byte(text) {
        Some(b'"') => match serde_json::from_str::<String>(v.get()) {
            Ok(s) if !s.is_empty() => Prompt::Text(s),
            _ => Prompt::None,
        },
        // An array of prompts (its first element is one), or the token ids themselves.
        Some(b'[') => match first_byte(text.get(1..).unwrap_or_default()) {
            Some(b'"' | b'[') => serde_json::from_str::<FirstPrompt>(v.get()).map_or(Prompt::None, |p| p.0),
            Some(b']') | None => Prompt::None,
            _ => token_prompt(v.get()),
        },
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
                    Prompt::Chat(RawJson(m.to_owned()))
                }
            }
        },
        ApiKind::Other => Prompt::None,
    };
    let stream = boolean(raw.stream).unwrap_or(false);
    // vLLM returns the prompt's token ids in a stream's first chunk when asked. Not where the
    // client asked itself (its answer is its own), echoes the prompt (the ids change the echo),
    // has its prompt cut (the ids are the cut prompt's), sends several prompts (the first event
    // may be another's), or gives tools (a tool parser may send an empty delta unasked, which
    // would read as one sent only for the ids).
    let answer_can_carry_tokens = stream
        && match &prompt {
            Prompt::Text(_) => raw.prompt.is_some_and(|p| first_byte(p.get().as_bytes()) == Some(b'"')),
            Prompt::Chat(_) => non_null(raw.tools).is_none(),
            _ => false,
        }
        && raw.return_token_ids.is_none()
        && non_null(raw.truncate_prompt_tokens).is_none()
        && boolean(raw.echo) != Some(true);
    Ok(ParsedRequest {
        kind,
        stream,
        answer_can_carry_tokens,
        add_generation_prompt: boolean(raw.add_generation_prompt),
        continue_final_message: boolean(raw.continue_final_message),
        add_special_tokens: boolean(raw.add_special_tokens),
        model: string(raw.model),
        cache_salt: string(raw.cache_salt).filter(|s| !s.is_empty()),
        chat_template: non_null(raw.chat_template),
        chat_template_kwargs: non_null(raw.chat_template_kwargs),
        tools: non_null(raw.tools),
        media: super::call::has_media_parts(&prompt),
        prompt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenizerEndpoint;
    use crate::request::parsed::tests::body;
    use serde_json::{json, Value};

    #[test]
    fn only_a_streamed_single_prompt_whose_answer_the_ids_do_not_change_may_carry_them_back() {
        let can = |kind, v: Value| parse_request(kind, &body(v)).unwrap().answer_can_carry_tokens;
        let chat = json!([{"role":"user","content":"hi"}]);
        assert!(can(ApiKind::Completions, json!({"prompt":"hi","stream":true})));
        assert!(can(ApiKind::Chat, json!({"messages":chat,"stream":true,"echo":false})));
        assert!(!can(ApiKind::Completions, json!({"prompt":"hi"})));
        assert!(!can(ApiKind::Completions, json!({"prompt":"hi","stream":true,"echo":true})));
        assert!(!can(ApiKind::Chat, json!({"messages":chat,"stream":true,"return_token_ids":false})));
        assert!(!can(ApiKind::Completions, json!({"prompt":"hi","stream":true,"return_token_ids":true})));
        assert!(!can(ApiKind::Completions, json!({"prompt":[1,2],"stream":true})));
        assert!(!can(ApiKind::Other, json!({"prompt":"hi","stream":true})));
        assert!(!can(ApiKind::Completions, json!({"prompt":["hi","there"],"stream":true})));
        assert!(!can(ApiKind::Completions, json!({"prompt":"hi","stream":true,"truncate_prompt_tokens":8})));
        assert!(can(ApiKind::Completions, json!({"prompt":"hi","stream":true,"truncate_prompt_tokens":null})));
        assert!(!can(ApiKind::Chat, json!({"messages":chat,"stream":true,"tools":[{"type":"function"}]})));
        assert!(can(ApiKind::Chat, json!({"messages":chat,"stream":true,"tools":null})));
    }

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
        let r = parse_request(ApiKind::Completions, &body(json!({"prompt":[]}))).unwrap();
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
