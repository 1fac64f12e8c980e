//! The tokenizer call of a request routed before its tokens came (on its conversation's turn
//! before, or on what its siblings share), made once its route is answered, as the filter makes
//! it: its tokens are kept for the conversation's next turn, and the count of its prompt's
//! tokens corrects what its first token teaches its endpoint's rates. The request does not wait
//! for it.

use super::gateway::{now_ns, Counted, Gateway};
use super::metrics::EppMetrics;
use super::tokenize;
use llmgw_core::flow::{Report, Router, Tokenize};
use std::sync::{Arc, Mutex};

/// Calls one request may make (a dedicated tokenizer that declines, then a replica).
const MAX_CALLS: u32 = 3;

/// Makes the call `t` (and the retry on a replica its reply may ask for), and keeps what its
/// reply says; `counted` gets the prompt's token count with the estimate it was routed on.
pub async fn call(
    router: Arc<Mutex<Router>>,
    gateway: Arc<Gateway>,
    metrics: Arc<EppMetrics>,
    t: Box<Tokenize>,
    counted: Arc<Counted>,
) {
    let mut next = Some(t);
    let mut calls = 0u32;
    while let Some(t) = next.take() {
        calls = calls.saturating_add(1);
        if calls > MAX_CALLS {
            return;
        }
        let answer = tokenize::counted_call(&t, &metrics).await;
        let Tokenize { target, pending, .. } = *t;
        let b = answer.with_reply(|reply| {
            let gw = gateway.snapshot(None);
            let mut r = router.lock().unwrap_or_else(|p| p.into_inner());
            r.on_background_reply(*pending, reply, &gw, now_ns())
        });
        metrics.report(&Report { tokenizer_failure: b.failure, ..Report::default() });
        if b.failure.is_some() && answer.tokenizer_at_fault() {
            gateway.avoid_tokenizer(&target);
        }
        gateway.keep(&b.keep);
        if let (Some(tokens), Some(estimated)) = (b.tokens, b.estimated_tokens) {
            counted.set(tokens, estimated);
        }
        next = b.retry;
    }
}
