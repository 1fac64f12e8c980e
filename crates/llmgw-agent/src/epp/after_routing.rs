//! The tokenizer call of a request routed before its tokens came (on its conversation's turn
//! before, or on what its siblings share), made once its route is answered, as the filter makes
//! it: its tokens are kept for the conversation's next turn, and the count of its prompt's
//! tokens corrects what its first token teaches its endpoint's rates. The request does not wait
//! for it. Where the answer streams through the picker, the prompt's ids are read from it
//! instead ([`super::answer_ids`]), and the call is made only if they do not come.

use super::gateway::{now_ns, Counted, Gateway};
use super::metrics::EppMetrics;
use super::tokenize;
use llmgw_core::flow::{Report, Router, Tokenize, TokenizerReply};
use std::sync::{Arc, Mutex};

/// Calls one request may make (a dedicated tokenizer that declines, then a replica).
const MAX_CALLS: u32 = 3;

/// A routed request's tokens still to come: the call to make for them, and where their count
/// goes.
#[derive(Debug)]
pub struct Pending {
    pub call: Box<Tokenize>,
    pub counted: Arc<Counted>,
}

/// What the call's reply is handed to: the picker's router and its view of its traffic.
#[derive(Clone)]
pub struct Keeper {
    pub router: Arc<Mutex<Router>>,
    pub gateway: Arc<Gateway>,
    pub metrics: Arc<EppMetrics>,
}

impl Keeper {
    /// Makes the call (and the retry on a replica its reply may ask for) in the background.
    pub fn spawn(&self, p: Pending) {
        tokio::spawn(self.clone().call(p));
    }

    async fn call(self, p: Pending) {
        let mut next = Some(p.call);
        let mut calls = 0u32;
        while let Some(t) = next.take() {
            calls = calls.saturating_add(1);
            if calls > MAX_CALLS {
                return;
            }
            let answer = tokenize::counted_call(&t, &self.metrics, &self.gateway).await;
            let target = t.target.clone();
            let (failed, retry) = answer.with_reply(|reply| self.keep(*t, reply, &p.counted));
            if failed && answer.tokenizer_at_fault() {
                self.gateway.avoid_tokenizer(&target);
            }
            next = retry;
        }
    }

    /// The prompt's ids, read from its answer: kept as the call's reply would have been.
    pub fn ids_from_answer(&self, p: Pending, ids: &[u32]) {
        self.keep(*p.call, &TokenizerReply::FromAnswer(ids), &p.counted);
    }

    /// Hands `reply` to the core for the call `t` was to make: its tokens kept, their count
    /// set. Whether it failed, and the retry it asks for.
    fn keep(&self, t: Tokenize, reply: &TokenizerReply<'_>, counted: &Counted) -> (bool, Option<Box<Tokenize>>) {
        let b = {
            let gw = self.gateway.snapshot(None);
            let mut r = self.router.lock().unwrap_or_else(|p| p.into_inner());
            r.on_background_reply(*t.pending, reply, &gw, now_ns())
        };
        self.metrics.report(&Report { tokenizer_failure: b.failure, ..Report::default() });
        self.gateway.keep(&b.keep);
        if let (Some(tokens), Some(estimated)) = (b.tokens, b.estimated_tokens) {
            counted.set(tokens, estimated);
        }
        (b.failure.is_some(), b.retry)
    }
}
