//! The `[tokenizer]` section: the native tokenizer beside Envoy, answering vLLM's `/tokenize`
//! from each model's Hugging Face files, and how its answers are checked against the replicas.
//!
//! ```toml
//! [tokenizer]
//! listen = "127.0.0.1:8095"        # the filter's profiles name it as tokenizer_address
//! cache_bytes = 67108864           # per model: cached piece tokenizations
//! verify_first = 200               # every one of a model's first answers is checked
//! verify_fraction = 0.01           # then this share
//!
//! [[tokenizer.models]]
//! names = ["meta-llama/Llama-3.1-8B-Instruct"]   # served model names (requests' `model`)
//! dir = "/models/llama-3.1-8b-instruct"          # tokenizer.json, tokenizer_config.json, …
//! ```

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Must be set to listen on a non-loopback address (prompts arrive in clear text).
    #[serde(default)]
    pub allow_non_loopback: bool,
    /// Bytes of piece tokenizations cached per model (0: no cache).
    #[serde(default = "default_cache_bytes")]
    pub cache_bytes: usize,
    /// Largest request body read.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Requests tokenized at once (0: one per CPU); more wait.
    #[serde(default)]
    pub max_concurrent: usize,
    /// Every answer among a model's first `verify_first` is also asked of a replica.
    #[serde(default = "default_verify_first")]
    pub verify_first: u64,
    /// After those, this share of answers is (0 turns the check off after the first ones).
    #[serde(default = "default_verify_fraction")]
    pub verify_fraction: f64,
    /// Replica checks in flight at most; more are skipped and counted.
    #[serde(default = "default_verify_in_flight")]
    pub max_verify_in_flight: usize,
    #[serde(default = "default_verify_timeout")]
    pub verify_timeout_ms: u64,
    #[serde(default)]
    pub models: Vec<TokenizerModelConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerModelConfig {
    /// The names requests give in `model` (served model names, aliases).
    pub names: Vec<String>,
    /// The directory holding tokenizer.json and tokenizer_config.json.
    pub dir: PathBuf,
    /// vLLM's `--chat-template-content-format`: "auto" (detected, the default), "string" or
    /// "openai".
    #[serde(default = "default_content_format")]
    pub content_format: String,
    /// vLLM's `--default-chat-template-kwargs`.
    #[serde(default)]
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Serve a `tokenizer_class` whose `transformers` pipeline is not known to match its
    /// tokenizer.json, trusting the check against the replicas to catch a difference.
    #[serde(default)]
    pub trust_unverified_class: bool,
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8095))
}
fn default_cache_bytes() -> usize {
    64 << 20
}
fn default_max_body() -> usize {
    32 << 20
}
fn default_verify_first() -> u64 {
    200
}
fn default_verify_fraction() -> f64 {
    0.01
}
fn default_verify_in_flight() -> usize {
    4
}
fn default_verify_timeout() -> u64 {
    5_000
}
fn default_content_format() -> String {
    "auto".into()
}
