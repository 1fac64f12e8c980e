//! vLLM's `/tokenize` request and answer as they travel (JSON), apart from what they mean.

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// `POST /tokenize`: a completion prompt or a chat.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenizeRequest {
    Chat(Box<ChatRequest>),
    Completion(CompletionRequest),
}

impl TokenizeRequest {
    pub fn model(&self) -> Option<&str> {
        match self {
            TokenizeRequest::Chat(c) => c.model.as_deref(),
            TokenizeRequest::Completion(c) => c.model.as_deref(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: String,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Json,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub chat_template: Option<String>,
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Json>>,
    #[serde(default)]
    pub tools: Option<Vec<ToolWire>>,
    #[serde(default)]
    pub mm_processor_kwargs: Option<Json>,
    #[serde(default)]
    pub media_io_kwargs: Option<Json>,
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

/// A tool as the OpenAI API writes it.
#[derive(Debug, Clone, Deserialize)]
pub struct ToolWire {
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    pub function: FunctionWire,
    #[serde(default)]
    pub defer_loading: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct FunctionWire {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Json>,
    #[serde(default)]
    pub strict: Option<bool>,
    #[serde(default)]
    pub defer_loading: Option<bool>,
}

/// The answer: vLLM's `TokenizeResponse`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizeAnswer {
    pub count: usize,
    pub max_model_len: u64,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// An error body as vLLM writes one.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub code: u16,
}
