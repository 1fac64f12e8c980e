//! One model's native tokenizer: its files loaded and checked once, then vLLM 0.33's
//! `/tokenize` answered for completions and text chats.

use crate::conversation::{conversation, detect_content_format, supports_developer_role, ContentFormat};
use crate::encoder::Encoder;
use crate::error::{LoadError, RequestError};
use crate::model_files::{read_bounded, read_settings, SpecialToken, TokenizerSettings};
use crate::template::{ChatTemplate, RenderArgs};
use crate::wire::{ChatRequest, TokenizeRequest, ToolWire};
use minijinja::value::Value;
use serde_json::Value as Json;
use std::path::Path;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

/// Options of a model beside its files.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// Bytes of piece tokenizations cached (0: no cache).
    pub cache_bytes: usize,
    /// vLLM's `--chat-template-content-format` (`None`: detected from the template, as vLLM's
    /// `auto` does).
    pub content_format: Option<ContentFormat>,
    /// vLLM's `--default-chat-template-kwargs`.
    pub default_template_kwargs: serde_json::Map<String, Json>,
    /// Serve a `tokenizer_class` whose `transformers` pipeline is not known to match its
    /// tokenizer.json, trusting the check against the replicas to catch a difference.
    pub trust_unverified_class: bool,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            cache_bytes: 64 << 20,
            content_format: None,
            default_template_kwargs: Default::default(),
            trust_unverified_class: false,
        }
    }
}

/// Parameters of `transformers`' `apply_chat_template` that are not template variables but
/// that vLLM lets through from `chat_template_kwargs` all the same.
const HF_BASE_PARAMS: [&str; 14] = [
    "conversation",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "self",
];

/// A loaded model.
pub struct ModelTokenizer {
    pub encoder: Encoder,
    template: Option<ChatTemplate>,
    tool_template: Option<ChatTemplate>,
    content_format: ContentFormat,
    developer_role: bool,
    /// Special tokens passed to every render (`bos_token`, …).
    special: Vec<(String, Value)>,
    default_kwargs: serde_json::Map<String, Json>,
    /// `max_model_len` in answers.
    pub max_model_len: u64,
    /// Bytes of tokenizer files read (a lower bound of the tokenizer's memory).
    pub file_bytes: u64,
}

impl ModelTokenizer {
    /// Loads `dir`. A tokenizer or template this cannot serve exactly is refused here.
    pub fn load(dir: &Path, opts: &ModelOptions) -> Result<ModelTokenizer, LoadError> {
        let settings = read_settings(dir)?;
        if settings.split_special_tokens {
            return Err(LoadError::Refused("split_special_tokens is set".into()));
        }
        let json = read_bounded(&dir.join("tokenizer.json"))?.ok_or(LoadError::NoTokenizerJson)?;
        let file_bytes = json.len() as u64;
        let mut tokenizer = Tokenizer::from_bytes(&json).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        drop(json);
        let config: Json =
            read_bounded(&dir.join("config.json"))?.and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or(Json::Null);
        let model_type = config.get("model_type").and_then(Json::as_str);
        let pipeline = crate::tokenizer_class::pipeline(model_type, &settings, opts.trust_unverified_class)?;
        crate::tokenizer_class::apply(&mut tokenizer, &pipeline)?;
        prepare_like_transformers(&mut tokenizer, &settings, pipeline.honours_add_bos_eos())?;
        let compile = |t: &str| ChatTemplate::compile(t).map_err(LoadError::Template);
        let template = settings.template.as_deref().map(compile).transpose()?;
        let tool_template = match settings.named_templates.iter().find(|(n, _)| n == "tool_use") {
            Some((_, t)) => Some(compile(t)?),
            None => None,
        };
        let source = template.as_ref().map(|t| t.source.as_str()).unwrap_or_default();
        let content_format = opts.content_format.unwrap_or_else(|| detect_content_format(source));
        let developer_role = supports_developer_role(source);
        let special =
            settings.named.iter().map(|(name, t)| ((*name).to_owned(), Value::from(t.content.clone()))).collect();
        let max_model_len = config.get("max_position_embeddings").and_then(Json::as_u64).unwrap_or(0);
        Ok(ModelTokenizer {
            encoder: Encoder::new(tokenizer, opts.cache_bytes),
            template,
            tool_template,
            content_format,
            developer_role,
            special,
            default_kwargs: opts.default_template_kwargs.clone(),
            max_model_len,
            file_bytes,
        })
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The token ids vLLM's `/tokenize` answers for `req`.
    pub fn tokenize(&self, req: &TokenizeRequest) -> Result<Vec<u32>, RequestError> {
        match req {
            TokenizeRequest::Completion(c) => {
                self.encoder.encode(&c.prompt, c.add_special_tokens.unwrap_or(true)).map_err(RequestError::Internal)
            }
            TokenizeRequest::Chat(c) => {
                let text = self.render_chat(c)?;
                // The template writes the special tokens it wants; vLLM adds the
                // post-processor's only when the request asks (the chat default is not to).
                self.encoder.encode(&text, c.add_special_tokens.unwrap_or(false)).map_err(RequestError::Internal)
            }
        }
    }

    /// The prompt text a chat renders to.
    pub fn render_chat(&self, c: &ChatRequest) -> Result<String, RequestError> {
        if c.chat_template.is_some() {
            return Err(RequestError::Declined("a chat template given with the request".into()));
        }
        if c.mm_processor_kwargs.is_some() || c.media_io_kwargs.is_some() {
            return Err(RequestError::Declined("multimodal processor arguments".into()));
        }
        let add_generation_prompt = c.add_generation_prompt.unwrap_or(true);
        let continue_final = c.continue_final_message.unwrap_or(false);
        if add_generation_prompt && continue_final && c.add_generation_prompt == Some(true) {
            return Err(RequestError::BadRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.".into(),
            ));
        }
        let tools = c.tools.as_ref().map(|t| normalize_tools(t));
        let template = match (&tools, &self.tool_template) {
            (Some(_), Some(t)) => t,
            _ => self.template.as_ref().ok_or_else(|| {
                RequestError::BadRequest(
                    "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the tokenizer does not define one.".into(),
                )
            })?,
        };
        let conv = conversation(&c.messages, self.content_format, self.developer_role)?;
        // Template arguments: special tokens, then the server's defaults, then the request's;
        // only those the template reads or `transformers` accepts, as vLLM filters them.
        let mut extra = self.special.clone();
        let mut kwargs = self.default_kwargs.clone();
        if let Some(k) = &c.chat_template_kwargs {
            if k.contains_key("chat_template") {
                return Err(RequestError::Declined("a chat template given in chat_template_kwargs".into()));
            }
            kwargs.extend(k.iter().map(|(a, b)| (a.clone(), b.clone())));
        }
        for (k, v) in kwargs {
            // vLLM sets these itself (`tokenize` is ignored: it always tokenizes).
            if matches!(
                k.as_str(),
                "add_generation_prompt"
                    | "continue_final_message"
                    | "tools"
                    | "documents"
                    | "conversation"
                    | "tokenize"
            ) {
                continue;
            }
            if template.variables.contains(&k) || HF_BASE_PARAMS.contains(&k.as_str()) {
                extra.push((k, Value::from_serialize(&v)));
            }
        }
        template
            .render(RenderArgs {
                messages: Value::from_serialize(&conv),
                tools: tools.map(|t| Value::from_serialize(&t)),
                add_generation_prompt: add_generation_prompt && !continue_final,
                continue_final_message: continue_final,
                extra: &extra,
            })
            .map_err(RequestError::BadRequest)
    }
}

/// Tools as vLLM hands them to templates: each validated into its tool model and dumped back,
/// so `description` and `parameters` are present (null when absent) and unknown keys gone.
fn normalize_tools(tools: &[ToolWire]) -> Json {
    Json::Array(
        tools
            .iter()
            .map(|t| {
                let mut f = serde_json::Map::new();
                f.insert("name".into(), Json::String(t.function.name.clone()));
                f.insert("description".into(), t.function.description.clone().map_or(Json::Null, Json::String));
                f.insert("parameters".into(), t.function.parameters.clone().unwrap_or(Json::Null));
                if let Some(s) = t.function.strict {
                    f.insert("strict".into(), Json::Bool(s));
                }
                let defer = t.function.defer_loading.or(t.defer_loading);
                if let Some(d) = defer {
                    f.insert("defer_loading".into(), Json::Bool(d));
                }
                let mut o = serde_json::Map::new();
                o.insert("type".into(), Json::String("function".into()));
                o.insert("function".into(), Json::Object(f));
                if let Some(d) = t.defer_loading {
                    o.insert("defer_loading".into(), Json::Bool(d));
                }
                Json::Object(o)
            })
            .collect(),
    )
}

/// What `transformers` 5 does to a fast tokenizer after loading it: no truncation or padding,
/// the named and extra special tokens added where the vocabulary lacks them, and the
/// post-processor rebuilt from `add_bos_token`/`add_eos_token` when the config sets either or
/// tokenizer.json has none.
fn prepare_like_transformers(tok: &mut Tokenizer, s: &TokenizerSettings, bos_eos: bool) -> Result<(), LoadError> {
    tok.with_truncation(None).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    tok.with_padding(None);
    let to_added = |t: &SpecialToken| {
        AddedToken::from(t.content.clone(), true)
            .lstrip(t.lstrip)
            .rstrip(t.rstrip)
            .normalized(t.normalized)
            .single_word(t.single_word)
    };
    let missing: Vec<AddedToken> = s
        .named
        .iter()
        .map(|(_, t)| t)
        .chain(s.extra.iter())
        .filter(|t| tok.token_to_id(&t.content).is_none())
        .map(to_added)
        .collect();
    if !missing.is_empty() {
        tok.add_special_tokens(missing).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
    }
    let rebuild = (bos_eos && (s.add_bos.is_some() || s.add_eos.is_some())) || tok.get_post_processor().is_none();
    if !rebuild {
        return Ok(());
    }
    let token = |name: &str| s.named(name).and_then(|t| tok.token_to_id(&t.content).map(|id| (t.content.clone(), id)));
    let bos = token("bos_token").filter(|_| bos_eos && s.add_bos.unwrap_or(false));
    let eos = token("eos_token").filter(|_| bos_eos && s.add_eos.unwrap_or(false));
    let mut single = String::new();
    let mut specials = Vec::new();
    if let Some((b, id)) = &bos {
        single.push_str(&format!("{b}:0 "));
        specials.push((b.clone(), *id));
    }
    single.push_str("$A:0");
    if let Some((e, id)) = &eos {
        single.push_str(&format!(" {e}:0"));
        specials.push((e.clone(), *id));
    }
    let pair = {
        let mut p = single.clone();
        if let Some((b, _)) = &bos {
            p.push_str(&format!(" {b}:1"));
        }
        p.push_str(" $B:1");
        if let Some((e, _)) = &eos {
            p.push_str(&format!(" {e}:1"));
        }
        p
    };
    let processor = TemplateProcessing::builder()
        .try_single(single.as_str())
        .and_then(|b| b.try_pair(pair.as_str()))
        .map_err(|e| LoadError::Tokenizer(format!("post-processor: {e}")))?
        .special_tokens(specials)
        .build()
        .map_err(|e| LoadError::Tokenizer(format!("post-processor: {e}")))?;
    tok.with_post_processor(Some(processor));
    Ok(())
}
