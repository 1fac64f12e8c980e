//! llmgw's native tokenizer: answers vLLM 0.33's `POST /tokenize` for a model from its Hugging
//! Face files (tokenizer.json, tokenizer_config.json, chat template) with the token ids vLLM
//! itself would answer, at native speed, with a byte-bounded cache of prompt pieces. Chats with
//! media, per-request templates and tokenizer families vLLM serves otherwise are declined or
//! refused, never guessed.

pub mod conversation;
pub mod encoder;
pub mod error;
pub mod model;
pub mod model_files;
pub mod piece_cache;
pub mod py_format;
pub mod template;
pub mod tokenizer_class;
pub mod wire;

pub use error::{LoadError, RequestError};
pub use model::{ModelOptions, ModelTokenizer};
pub use wire::{TokenizeAnswer, TokenizeRequest};
