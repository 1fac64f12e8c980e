//! The tokenizer call that yields the engine's own tokens for a parsed request: none when the
//! request already carries token ids or has no prompt.
//!
//! Tokenizer call forms (vLLM's `/tokenize`): completions send
//! `{model, prompt, add_special_tokens: true}` (the completions endpoint's default); chats send
//! `{model, messages, add_generation_prompt, continue_final_message, chat_template_kwargs,
//! tools, add_special_tokens: false}` (the chat endpoint's default: the template supplies BOS).
//! The render endpoints (`/v1/completions/render`, `/v1/chat/completions/render`) take the
//! generation request's body unchanged.

use super::parsed::{ApiKind, ParsedRequest, Prompt, RawJson};
use crate::config::TokenizerEndpoint;

/// vLLM's tokenize endpoint.
pub const TOKENIZE_PATH: &str = "/tokenize";

/// A tokenizer call to make on a replica.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerCall {
    pub path: &'static str,
    pub body: Vec<u8>,
}

/// Chat content part types that carry media (vLLM hashes their blocks with multimodal extra
/// keys only the render endpoint reports).
const MEDIA_PARTS: [&str; 8] = [
    "\"image_url\"",
    "\"input_audio\"",
    "\"audio_url\"",
    "\"video_url\"",
    "\"image_embeds\"",
    "\"audio_embeds\"",
    "\"image_pil\"",
    "\"input_image\"",
];

/// Whether a chat prompt carries image, audio or video parts. Read from the raw messages: a
/// media part's type name appearing anywhere (inside a text too) counts, which at worst sends a
/// text-only chat to the render endpoint (exact tokens, no features). Read once, when the body
/// is parsed (each search runs over the whole conversation).
pub(super) fn has_media_parts(prompt: &Prompt) -> bool {
    match prompt {
        Prompt::Chat(m) => {
            let raw = m.get();
            MEDIA_PARTS.iter().any(|p| raw.contains(p))
        }
        _ => false,
    }
}

impl ParsedRequest {
    /// Whether the chat carries image, audio or video parts ([`has_media_parts`]).
    pub fn multimodal(&self) -> bool {
        self.media
    }

    /// The call that yields the engine's tokens for this request, or `None` when no call is
    /// needed (token ids given) or possible (no prompt). `raw_body` is the request body, sent
    /// unchanged to the render endpoints. A multimodal chat always goes to the render endpoint:
    /// only its answer names the media items and where their placeholder tokens are.
    pub fn tokenizer_call(&self, endpoint: TokenizerEndpoint, raw_body: &[u8]) -> Option<TokenizerCall> {
        if matches!(self.prompt, Prompt::Tokens(_) | Prompt::None) {
            return None;
        }
        if endpoint == TokenizerEndpoint::Render || self.multimodal() {
            let path = match self.kind {
                ApiKind::Completions => "/v1/completions/render",
                ApiKind::Chat => "/v1/chat/completions/render",
                ApiKind::Other => return None,
            };
            return Some(TokenizerCall { path, body: raw_body.to_vec() });
        }
        // Written field by field into one buffer: the messages are serialized from the parsed
        // request without being cloned into a new JSON tree first.
        let mut body = Vec::with_capacity(raw_body.len().saturating_add(256));
        let mut first = true;
        body.push(b'{');
        if let Some(model) = &self.model {
            put(&mut body, &mut first, "model", model)?;
        }
        match &self.prompt {
            Prompt::Text(t) => {
                put(&mut body, &mut first, "prompt", t)?;
                put(&mut body, &mut first, "add_special_tokens", &self.add_special_tokens.unwrap_or(true))?;
            }
            Prompt::Chat(msgs) => {
                put_raw(&mut body, &mut first, "messages", msgs);
                let cont = self.continue_final_message.unwrap_or(false);
                // vLLM refuses both at once; continuing the final message implies no prompt.
                let gen = self.add_generation_prompt.unwrap_or(!cont) && !cont;
                put(&mut body, &mut first, "add_generation_prompt", &gen)?;
                put(&mut body, &mut first, "continue_final_message", &cont)?;
                for (k, v) in [
                    ("chat_template", &self.chat_template),
                    ("chat_template_kwargs", &self.chat_template_kwargs),
                    ("tools", &self.tools),
                ] {
                    if let Some(v) = v {
                        put_raw(&mut body, &mut first, k, v);
                    }
                }
                put(&mut body, &mut first, "add_special_tokens", &self.add_special_tokens.unwrap_or(false))?;
            }
            Prompt::Tokens(_) | Prompt::None => return None,
        }
        body.push(b'}');
        Some(TokenizerCall { path: TOKENIZE_PATH, body })
    }
}

/// Appends `"key":value` (with a leading comma after the first field) to a JSON object.
fn put<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, first: &mut bool, key: &str, v: &T) -> Option<()> {
    if !std::mem::take(first) {
        out.push(b',');
    }
    serde_json::to_writer(&mut *out, key).ok()?;
    out.push(b':');
    serde_json::to_writer(&mut *out, v).ok()
}

/// Appends `"key":<raw JSON>` to a JSON object.
fn put_raw(out: &mut Vec<u8>, first: &mut bool, key: &str, v: &RawJson) {
    if !std::mem::take(first) {
        out.push(b',');
    }
    out.push(b'"');
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(v.get().as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_request;
    use crate::request::parsed::tests::body;
    use serde_json::{json, Value};

    #[test]
    fn chat_tokenize_form() {
        let req = json!({
            "model": "m",
            "messages": [
                {"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}
            ],
            "tools": [{"type":"function","function":{"name":"f"}}],
            "chat_template_kwargs": {"enable_thinking": false},
            "temperature": 0.1
        });
        let r = parse_request(ApiKind::Chat, &body(req.clone())).unwrap();
        let call = r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap();
        assert_eq!(call.path, "/tokenize");
        let sent: Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(
            sent,
            json!({
                "model": "m",
                "messages": req["messages"],
                "add_generation_prompt": true,
                "continue_final_message": false,
                "chat_template_kwargs": {"enable_thinking": false},
                "tools": req["tools"],
                "add_special_tokens": false
            })
        );
        let mut lead = Vec::new();
        r.leading_text(1000, &mut lead);
        assert_eq!(lead, b"system\nbe brief\nuser\nhi there\n");
        r.leading_text(9, &mut lead);
        assert_eq!(lead, b"system\nbe");

        let r = parse_request(
            ApiKind::Chat,
            &body(json!({"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true})),
        )
        .unwrap();
        let sent: Value =
            serde_json::from_slice(&r.tokenizer_call(TokenizerEndpoint::Tokenize, b"").unwrap().body).unwrap();
        assert_eq!(sent["add_generation_prompt"], json!(false));
        assert_eq!(sent["continue_final_message"], json!(true));
        assert!(sent.get("model").is_none());
    }

    #[test]
    fn render_sends_the_body_unchanged() {
        let raw = body(json!({"model":"m","messages":[{"role":"user","content":"x"}]}));
        let r = parse_request(ApiKind::Chat, &raw).unwrap();
        let call = r.tokenizer_call(TokenizerEndpoint::Render, &raw).unwrap();
        assert_eq!(call.path, "/v1/chat/completions/render");
        assert_eq!(call.body, raw);
        let raw = body(json!({"model":"m","prompt":"x"}));
        let r = parse_request(ApiKind::Completions, &raw).unwrap();
        assert_eq!(r.tokenizer_call(TokenizerEndpoint::Render, &raw).unwrap().path, "/v1/completions/render");
    }
}
