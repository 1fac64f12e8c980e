//! A model directory's tokenizer files, read and checked: `tokenizer.json` (Hugging Face
//! `tokenizers`), `tokenizer_config.json` (special tokens, `add_bos_token`/`add_eos_token`, the
//! chat template), and a chat template kept beside them (`chat_template.jinja`,
//! `chat_template.json`), as `transformers` reads them for vLLM.

use crate::error::LoadError;
use serde_json::Value as Json;
use std::path::Path;

/// The named special tokens `transformers` passes to every chat template (its
/// `special_tokens_map`), in its order.
pub const NAMED_SPECIAL: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// Files larger than this are refused at load (a tokenizer.json of the largest vocabularies
/// is under 40 MiB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// A special token as `tokenizer_config.json` writes it: a string, or an object with
/// `content` and the added-token flags.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecialToken {
    pub content: String,
    pub lstrip: bool,
    pub rstrip: bool,
    pub normalized: bool,
    pub single_word: bool,
}

/// What `tokenizer_config.json` (and the template files) say.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSettings {
    /// Named special tokens that are set, in [`NAMED_SPECIAL`] order.
    pub named: Vec<(&'static str, SpecialToken)>,
    /// `additional_special_tokens` / `extra_special_tokens`.
    pub extra: Vec<SpecialToken>,
    /// `add_bos_token` / `add_eos_token` when the file sets them.
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    /// The default chat template.
    pub template: Option<String>,
    /// Named chat templates (`tool_use`, …).
    pub named_templates: Vec<(String, String)>,
    /// `tokenizer_class`, for the refusal of tokenizers `transformers` builds otherwise.
    pub class: Option<String>,
    /// `split_special_tokens`.
    pub split_special_tokens: bool,
    /// `legacy` (SentencePiece-style tokenizers), when set.
    pub legacy: Option<bool>,
    /// `add_prefix_space`, when set.
    pub add_prefix_space: Option<bool>,
}

impl TokenizerSettings {
    pub fn named(&self, name: &str) -> Option<&SpecialToken> {
        self.named.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }
}

/// Reads a file of at most [`MAX_FILE_BYTES`].
pub fn read_bounded(path: &Path) -> Result<Option<Vec<u8>>, LoadError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LoadError::Io { path: path.display().to_string(), error: e.to_string() }),
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(LoadError::Invalid {
            file: path.display().to_string(),
            reason: format!("{} bytes, more than the {MAX_FILE_BYTES}-byte limit", meta.len()),
        });
    }
    std::fs::read(path).map(Some).map_err(|e| LoadError::Io { path: path.display().to_string(), error: e.to_string() })
}

/// Reads `tokenizer_config.json` and the template files of `dir`.
pub fn read_settings(dir: &Path) -> Result<TokenizerSettings, LoadError> {
    let path = dir.join("tokenizer_config.json");
    let invalid = |reason: String| LoadError::Invalid { file: "tokenizer_config.json".into(), reason };
    let json: Json = match read_bounded(&path)? {
        Some(bytes) => serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?,
        None => Json::Object(Default::default()),
    };
    let mut s = TokenizerSettings::default();
    for name in NAMED_SPECIAL {
        if let Some(t) = json.get(name).filter(|v| !v.is_null()) {
            s.named.push((
                name,
                special_token(t).ok_or_else(|| invalid(format!("`{name}` is neither a string nor a token object")))?,
            ));
        }
    }
    for key in ["additional_special_tokens", "extra_special_tokens"] {
        match json.get(key) {
            Some(Json::Array(items)) => {
                for t in items {
                    s.extra
                        .push(special_token(t).ok_or_else(|| invalid(format!("an entry of `{key}` is not a token")))?);
                }
            }
            Some(Json::Object(map)) => {
                for t in map.values() {
                    s.extra
                        .push(special_token(t).ok_or_else(|| invalid(format!("an entry of `{key}` is not a token")))?);
                }
            }
            _ => {}
        }
    }
    s.add_bos = json.get("add_bos_token").and_then(Json::as_bool);
    s.add_eos = json.get("add_eos_token").and_then(Json::as_bool);
    s.class = json.get("tokenizer_class").and_then(Json::as_str).map(str::to_owned);
    s.split_special_tokens = json.get("split_special_tokens").and_then(Json::as_bool).unwrap_or(false);
    s.legacy = json.get("legacy").and_then(Json::as_bool);
    s.add_prefix_space = json.get("add_prefix_space").and_then(Json::as_bool);
    read_templates(&json.get("chat_template").cloned().unwrap_or(Json::Null), &mut s).map_err(invalid)?;
    // A template file beside the config takes precedence, as in `transformers`.
    if let Some(bytes) = read_bounded(&dir.join("chat_template.jinja"))? {
        s.template = Some(
            String::from_utf8(bytes)
                .map_err(|_| LoadError::Invalid { file: "chat_template.jinja".into(), reason: "not UTF-8".into() })?,
        );
    } else if let Some(bytes) = read_bounded(&dir.join("chat_template.json"))? {
        let j: Json = serde_json::from_slice(&bytes)
            .map_err(|e| LoadError::Invalid { file: "chat_template.json".into(), reason: e.to_string() })?;
        read_templates(&j.get("chat_template").cloned().unwrap_or(Json::Null), &mut s)
            .map_err(|reason| LoadError::Invalid { file: "chat_template.json".into(), reason })?;
    }
    Ok(s)
}

fn read_templates(t: &Json, s: &mut TokenizerSettings) -> Result<(), String> {
    match t {
        Json::Null => Ok(()),
        Json::String(text) => {
            s.template = Some(text.clone());
            Ok(())
        }
        Json::Array(items) => {
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let text = item.get("template").and_then(Json::as_str);
                let (Some(name), Some(text)) = (name, text) else {
                    return Err("a `chat_template` entry lacks `name` or `template`".into());
                };
                if name == "default" {
                    s.template = Some(text.to_owned());
                } else {
                    s.named_templates.push((name.to_owned(), text.to_owned()));
                }
            }
            Ok(())
        }
        _ => Err("`chat_template` is neither a string nor a list of named templates".into()),
    }
}

fn special_token(v: &Json) -> Option<SpecialToken> {
    match v {
        Json::String(s) => Some(SpecialToken {
            content: s.clone(),
            lstrip: false,
            rstrip: false,
            normalized: false,
            single_word: false,
        }),
        Json::Object(m) => {
            let flag = |k: &str| m.get(k).and_then(Json::as_bool).unwrap_or(false);
            Some(SpecialToken {
                content: m.get("content")?.as_str()?.to_owned(),
                lstrip: flag("lstrip"),
                rstrip: flag("rstrip"),
                normalized: flag("normalized"),
                single_word: flag("single_word"),
            })
        }
        _ => None,
    }
}
