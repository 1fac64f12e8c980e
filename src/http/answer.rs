//! A streamed request's prompt token ids read from the replica's answer instead of a
//! tokenizer call after routing (`tokens_from_answers`): the body asks for them, the answer's
//! chunks are handed on as they would have come unasked (`AnswerStream`), and the first event's
//! ids go to the router, or the call is made after all.

use super::Request;
use crate::host::{Buffer, Headers};
use llmgw_core::flow::{Tokenize, TokenizerReply};
use llmgw_core::request::{AnswerStream, FirstEvent};

/// The answer being rewritten, and the tokenizer call made if it does not carry the ids.
pub(super) struct FromAnswer {
    pub(super) stream: AnswerStream,
    pub(super) call: Option<Box<Tokenize>>,
}

impl Request {
    /// Asks the replica for the prompt's token ids in its answer: the whole body, still held,
    /// gains `return_token_ids` (and its length); false when it cannot be rewritten.
    pub(super) fn ask_for_token_ids(&mut self) -> bool {
        let Some(size) = self.whole_body.take() else { return false };
        let body = self.host.buffer(Buffer::Request, size);
        let Some(asked) = llmgw_core::request::ask_for_token_ids(&body) else { return false };
        if !self.host.replace_buffer(Buffer::Request, size, &asked) {
            return false;
        }
        if self.host.header(Headers::Request, "content-length").is_some() {
            self.host.set_header(Headers::Request, "content-length", Some(&asked.len().to_string()));
        }
        true
    }

    /// A chunk of a streamed answer asked for the prompt's ids: handed on as it would have come
    /// unasked (its lessons are taken after it went: [`Self::answer_lessons`]).
    pub(super) fn answer_chunk(&mut self, body_size: usize, end_of_stream: bool) {
        let Some(a) = self.answer.as_mut() else { return };
        let chunk = self.host.buffer(Buffer::Response, body_size);
        let out = a.stream.feed(&chunk, end_of_stream);
        if out != chunk && !self.host.replace_buffer(Buffer::Response, body_size, &out) {
            log::warn!("llmgw: a streamed answer could not be rewritten");
        }
    }

    /// Once the stream's first event went by: its ids go to the router, or the call is made
    /// (not when the request is `ending`: a call from a context being destroyed is cancelled).
    pub(super) fn answer_lessons(&mut self, ending: bool) {
        if self.answer.is_none() {
            return;
        }
        // What the stream said is taken only once it can be acted on (else at a later chunk).
        let Some(shared) = self.shared.clone() else { return };
        let Ok(mut s) = shared.try_borrow_mut() else { return };
        let Some(a) = self.answer.as_mut() else { return };
        let too_large = std::mem::take(&mut a.stream.overflowed);
        let (first, call) = match a.stream.take_first() {
            Some(first) => (Some(first), a.call.take()),
            None => (None, None),
        };
        if too_large {
            s.metrics.answer_event_too_large();
        }
        match (first, call) {
            (Some(FirstEvent::Ids(ids)), Some(call)) => {
                s.metrics.answer_tokens(true);
                let now = self.host.now_ns();
                let b = self.tokens_after_routing(&mut s, *call.pending, &TokenizerReply::FromAnswer(&ids), now);
                self.correct_learning(b.tokens, b.estimated_tokens);
                s.metrics.shared_update_failed(self.teach_rates());
            }
            (Some(FirstEvent::Missing), Some(call)) => {
                s.metrics.answer_tokens(false);
                if ending {
                    // No call from a context being destroyed: its prompt tokens stay an
                    // estimate, and its first token teaches no rates.
                    self.learning = None;
                } else {
                    self.call_after_routing(&s, *call);
                }
            }
            _ => {}
        }
    }

    /// The answer is not a stream that can carry the ids (an error, or not streamed): it is
    /// left as it comes, and the call is made now.
    pub(super) fn answer_not_streamed(&mut self) {
        let Some(call) = self.answer.take().and_then(|a| a.call) else { return };
        let Some(shared) = self.shared.clone() else { return };
        let Ok(s) = shared.try_borrow() else { return };
        s.metrics.answer_tokens(false);
        self.call_after_routing(&s, *call);
    }
}
