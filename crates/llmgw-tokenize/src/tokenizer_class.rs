//! Which tokenization pipeline `transformers` 5 builds for a model, so that the native one is
//! the same: a few classes use tokenizer.json as it is; others build their own normalizer and
//! pre-tokenizer around its vocabulary (Llama's SentencePiece-style Metaspace), which is
//! reproduced here; every other class is refused unless the operator trusts the replica check
//! to catch a difference. Model types `transformers` knows to name the wrong class in their
//! tokenizer config are served by its generic backend, which ignores `add_bos_token`.

use crate::error::LoadError;
use crate::model_files::TokenizerSettings;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::{NormalizerWrapper, Tokenizer};

/// Model types `transformers` 5 loads with its generic backend whatever their config's class
/// says (its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`).
const GENERIC_BACKEND_MODEL_TYPES: [&str; 44] = [
    "arctic",
    "chameleon",
    "chatlm",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "deepseek_vl",
    "deepseek_vl_hybrid",
    "deepseek_vl_v2",
    "deepseek_ocr",
    "deepseek_ocr2",
    "unlimited_ocr",
    "ernie4_5",
    "ernie4_5_moe",
    "fuyu",
    "h2ovl_chat",
    "hyperclovax",
    "hyperclovax_vlm",
    "hyperclovax_vision_v2",
    "internlm2",
    "jamba",
    "janus",
    "llava",
    "llava_next",
    "minicpm3",
    "minicpmv",
    "minimax_m2",
    "modernbert",
    "molmo",
    "molmo2",
    "nemotron",
    "opencua",
    "openvla",
    "paddleocr_vl",
    "phi3",
    "phi3_v",
    "phimoe",
    "qwen2",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "step3p5",
    "smolvlm",
];

/// Classes whose `transformers` 5 pipeline equals a current tokenizer.json of their family
/// (proven by the exactness fixtures).
const AS_FILE_CLASSES: [&str; 5] =
    ["PreTrainedTokenizer", "TokenizersBackend", "GPT2Tokenizer", "Qwen2Tokenizer", "GemmaTokenizer"];

/// The pipeline to build.
#[derive(Debug, Clone, PartialEq)]
pub enum Pipeline {
    /// tokenizer.json as it is; `add_bos_token`/`add_eos_token` honoured.
    AsFile,
    /// tokenizer.json as it is, by the generic backend (`add_bos_token` ignored).
    GenericBackend,
    /// Llama's class: no normalizer, a Metaspace pre-tokenizer (`▁`, no split) prepending by
    /// `add_prefix_space` and `legacy`.
    LlamaMetaspace(PrependScheme),
}

impl Pipeline {
    pub fn honours_add_bos_eos(&self) -> bool {
        !matches!(self, Pipeline::GenericBackend)
    }
}

/// The pipeline for a model of `model_type` (config.json) with these settings.
pub fn pipeline(
    model_type: Option<&str>,
    s: &TokenizerSettings,
    trust_unverified: bool,
) -> Result<Pipeline, LoadError> {
    if model_type.is_some_and(|t| GENERIC_BACKEND_MODEL_TYPES.contains(&t)) {
        return Ok(Pipeline::GenericBackend);
    }
    let class = s.class.as_deref().unwrap_or("PreTrainedTokenizerFast");
    let base = class.strip_suffix("Fast").unwrap_or(class);
    let lower = base.to_ascii_lowercase();
    if lower.contains("mistral") || lower.contains("tekken") {
        return Err(LoadError::Refused(format!(
            "tokenizer_class {class}: vLLM tokenizes this family with mistral_common, not Hugging Face tokenizers"
        )));
    }
    if AS_FILE_CLASSES.contains(&base) {
        return Ok(Pipeline::AsFile);
    }
    if base == "LlamaTokenizer" {
        let scheme = match (s.add_prefix_space.unwrap_or(true), s.legacy.unwrap_or(false)) {
            (false, _) => PrependScheme::Never,
            (true, true) => PrependScheme::Always,
            (true, false) => PrependScheme::First,
        };
        return Ok(Pipeline::LlamaMetaspace(scheme));
    }
    if trust_unverified {
        return Ok(Pipeline::AsFile);
    }
    Err(LoadError::Refused(format!(
        "tokenizer_class {class}: transformers builds this class's pipeline itself and it is not known to match tokenizer.json here; set trust_unverified_class to serve it under the replica check"
    )))
}

/// Applies `p` to a tokenizer loaded from tokenizer.json.
pub fn apply(tok: &mut Tokenizer, p: &Pipeline) -> Result<(), LoadError> {
    if let Pipeline::LlamaMetaspace(scheme) = p {
        tok.with_normalizer(None::<NormalizerWrapper>).map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        tok.with_pre_tokenizer(Some(Metaspace::new('▁', *scheme, false)));
    }
    Ok(())
}
