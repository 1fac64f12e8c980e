//! OpenAI-style request bodies as the router needs them: which API, which model, the prompt
//! (text, token ids or chat messages), the cache salt and LoRA adapter that change block
//! hashes; the body of the tokenizer call that yields the engine's own tokens; and the
//! tokenizer's answer.
//!
//! * `parsed`: the request as the router needs it ([`ParsedRequest`]).
//! * `body`: a generation request body → [`ParsedRequest`] ([`parse_request`]).
//! * `call`: the tokenizer call for a parsed request ([`ParsedRequest::tokenizer_call`]).
//! * `leading`: the prompt's leading text for the approximate fallback
//!   ([`ParsedRequest::leading_text`]).
//! * `answer`: the tokenizer's answer → token ids ([`parse_tokenizer_response`]).
//! * `answer_stream`: a streamed generation answer carrying the prompt's token ids, read and
//!   rewritten as it would have come unasked ([`AnswerStream`], [`ask_for_token_ids`]).
//!
//! Chat messages, tools and template arguments are kept as the raw JSON the client sent
//! ([`RawJson`]): they are only passed on to the tokenizer, so they are validated but never
//! decoded into a tree and written out again (for a 16 KB chat that copy is most of the
//! parsing cost in wasm).

mod answer;
mod answer_stream;
mod body;
mod call;
mod leading;
mod parsed;

pub use answer::{parse_tokenizer_answer, parse_tokenizer_response, TokenizerAnswer, MAX_MM_IDENTIFIER, MAX_MM_ITEMS};
pub use answer_stream::{ask as ask_for_token_ids, is_event_stream, AnswerStream, FirstEvent, MAX_EVENT_BYTES};
pub use body::parse_request;
pub use call::{TokenizerCall, TOKENIZE_PATH};
pub use parsed::{ApiKind, ParsedRequest, Prompt, RawJson, RequestError};
