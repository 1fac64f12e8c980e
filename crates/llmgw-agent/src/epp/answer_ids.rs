//! A routed request's prompt ids read from its streamed answer instead of a tokenizer call
//! after routing (`tokens_from_answers`), as the filter reads them: the request body handed
//! back asks for them (`return_token_ids`), each chunk of the answer is handed back as vLLM
//! would have sent it unasked (the core's [`AnswerStream`]), and the first event's ids go to the
//! router. Where they do not come (an error, an answer not streamed, an engine that ignores the
//! field, a stream cut before its first event), the call is made after all.
//!
//! Only where the data plane hands the whole request body back through the picker and streams
//! the answer through it both ways (full-duplex modes): elsewhere a client would see the ids.

use super::after_routing::Pending;
use llmgw_core::request::{ask_for_token_ids, AnswerStream, FirstEvent};

/// An answer asked for the prompt's ids.
#[derive(Debug)]
pub struct FromAnswer {
    stream: AnswerStream,
    /// The call to make if the ids do not come (taken once they did, or once it was made).
    pending: Option<Pending>,
}

/// What the answer's first event said.
#[derive(Debug)]
pub enum Said {
    /// The prompt's ids, for the request's pending tokens.
    Ids(Pending, Vec<u32>),
    /// No ids: the call is to be made.
    Missing(Pending),
}

impl FromAnswer {
    /// `body` (a whole request body) asking for the ids, and the answer to read them from; the
    /// pending call back where the body cannot ask (not a JSON object).
    pub fn ask(body: &[u8], pending: Pending) -> Result<(Vec<u8>, FromAnswer), Pending> {
        match ask_for_token_ids(body) {
            Some(asked) => Ok((asked, FromAnswer { stream: AnswerStream::default(), pending: Some(pending) })),
            None => Err(pending),
        }
    }

    /// A chunk of the answer: the bytes to hand back (the events it completes, as they would
    /// have come unasked; an event not yet complete is held, up to the core's bound).
    pub fn chunk(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        self.stream.feed(chunk, end)
    }

    /// Whether the held event went past the bound (the stream then passes as it comes), once.
    pub fn overflowed(&mut self) -> bool {
        std::mem::take(&mut self.stream.overflowed)
    }

    /// What the first event said, once it went by (None before, and after it was taken).
    pub fn take(&mut self) -> Option<Said> {
        let first = self.stream.take_first()?;
        let pending = self.pending.take()?;
        Some(match first {
            FirstEvent::Ids(ids) => Said::Ids(pending, ids),
            FirstEvent::Missing => Said::Missing(pending),
        })
    }

    /// The call still to make: the answer is not a stream that carries the ids, or it ended
    /// before its first event was read.
    pub fn unanswered(self) -> Option<Pending> {
        self.pending
    }
}
