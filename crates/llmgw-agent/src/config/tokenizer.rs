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
fn err(field: impl Into<String>, message: impl Into<String>) -> (String, String) {
    (field.into(), message.into())
}

fn default_content_format() -> String {
    "auto".into()
}

impl TokenizerConfig {
    /// Checks the section; an error names the field and what is wrong with it.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if !self.listen.ip().is_loopback() && !self.allow_non_loopback {
            return Err(err(
                "tokenizer.listen",
                format!("{} is not a loopback address; set tokenizer.allow_non_loopback = true to serve prompts off this host", self.listen),
            ));
        }
        if !(0.0..=1.0).contains(&self.verify_fraction) {
            return Err(err("tokenizer.verify_fraction", "must be between 0 and 1"));
        }
        if self.max_body_bytes == 0 {
            return Err(err("tokenizer.max_body_bytes", "must be positive"));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let f = |k: &str| format!("tokenizer.models[{i}].{k}");
            if m.names.is_empty() {
                return Err(err(f("names"), "must name at least one model"));
            }
            for n in &m.names {
                if !seen.insert(n.clone()) {
                    return Err(err(f("names"), format!("{n} is named by two models")));
                }
            }
            if !matches!(m.content_format.as_str(), "auto" | "string" | "openai") {
                return Err(err(f("content_format"), "must be \"auto\", \"string\" or \"openai\""));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<(), (String, String)> {
        let cfg: TokenizerConfig = toml::from_str(toml_text).unwrap();
        cfg.validate()
    }

    #[test]
    fn a_listener_off_loopback_a_bad_share_and_a_name_served_twice_are_refused_by_field() {
        let model = "[[models]]\nnames = [\"m\"]\ndir = \"/t\"\n";
        assert!(parse(model).is_ok());
        assert_eq!(parse(&format!("listen = \"0.0.0.0:8095\"\n{model}")).unwrap_err().0, "tokenizer.listen");
        assert!(parse(&format!("listen = \"0.0.0.0:8095\"\nallow_non_loopback = true\n{model}")).is_ok());
        assert_eq!(parse(&format!("verify_fraction = 1.5\n{model}")).unwrap_err().0, "tokenizer.verify_fraction");
        assert_eq!(parse(&format!("{model}{model}")).unwrap_err().0, "tokenizer.models[1].names");
        let bad_format = format!("{model}content_format = \"text\"\n");
        assert_eq!(parse(&bad_format).unwrap_err().0, "tokenizer.models[0].content_format");
    }
}
