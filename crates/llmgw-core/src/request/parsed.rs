//! A generation request as the router needs it: which API, which model, the prompt, the cache
//! salt; and why a body could not be read.

use serde_json::value::RawValue;
use std::fmt;

/// Which OpenAI API a request path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Completions,
    Chat,
    Other,
}

impl ApiKind {
    /// From the `:path` header (query string ignored).
    pub fn from_path(path: &str) -> ApiKind {
        let p = path.split(['?', '#']).next().unwrap_or_default().trim_end_matches('/');
        match p {
            "/v1/completions" => ApiKind::Completions,
            "/v1/chat/completions" => ApiKind::Chat,
            _ => ApiKind::Other,
        }
    }
}

/// The prompt in the form the request carried it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A completion prompt as text (needs tokenizing).
    Text(String),
    /// A completion prompt as token ids: the engine caches exactly these.
    Tokens(Vec<u32>),
    /// Chat messages (a non-empty JSON array), as the raw JSON sent, so the tokenizer renders
    /// them as the engine will.
    Chat(RawJson),
    /// Nothing usable (empty, or an API the router does not read).
    None,
}

/// A JSON value kept as the text the client sent (validated JSON).
#[derive(Debug, Clone)]
pub struct RawJson(pub(super) Box<RawValue>);

impl RawJson {
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// Parses JSON text into a raw value (whitespace around it trimmed).
    pub fn from_json(s: &str) -> Option<RawJson> {
        serde_json::from_str::<Box<RawValue>>(s).ok().map(RawJson)
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

/// What the router reads from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    pub kind: ApiKind,
    pub model: Option<String>,
    pub stream: bool,
    /// Whether the filter may ask the replica for the prompt's token ids in the answer (a
    /// streamed text prompt or chat that neither asks for them itself nor echoes its prompt).
    pub answer_can_carry_tokens: bool,
    pub cache_salt: Option<String>,
    pub prompt: Prompt,
    /// Chat template inputs forwarded to `/tokenize`.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub chat_template: Option<RawJson>,
    pub chat_template_kwargs: Option<RawJson>,
    pub tools: Option<RawJson>,
    /// Whether the chat carries media parts (read once at parsing: `multimodal()`).
    pub(super) media: bool,
}

/// Why a body could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// Not JSON, or JSON of the wrong shape.
    Unparseable(String),
    /// The tokenizer's answer carried no token ids.
    BadTokenizerResponse(String),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::Unparseable(m) => write!(f, "unparseable request body: {m}"),
            RequestError::BadTokenizerResponse(m) => write!(f, "unusable tokenizer response: {m}"),
        }
    }
}

impl std::error::Error for RequestError {}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use serde_json::Value;

    /// A JSON value as a request body (shared by the submodules' tests).
    pub(in crate::request) fn body(v: Value) -> Vec<u8> {
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn paths() {
        assert_eq!(ApiKind::from_path("/v1/completions"), ApiKind::Completions);
        assert_eq!(ApiKind::from_path("/v1/chat/completions?x=1"), ApiKind::Chat);
        assert_eq!(ApiKind::from_path("/v1/chat/completions/"), ApiKind::Chat);
        assert_eq!(ApiKind::from_path("/v1/models"), ApiKind::Other);
    }
}
