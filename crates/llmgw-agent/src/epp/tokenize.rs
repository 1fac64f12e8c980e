//! The tokenizer call a routing step asks for, made as the filter makes it: a POST of the step's
//! body to its path on the target it names (the profile's dedicated tokenizer, such as this
//! agent's native tokenizer, else the least-loaded replica), within the step's timeout. The
//! answer is handed to the core as the filter hands Envoy's: a status and a body.

use super::gateway::Gateway;
use super::metrics::{inc, EppMetrics};
use crate::http_client::{post_json, HttpError};
use llmgw_core::flow::{Tokenize, TokenizerReply};
use std::time::{Duration, Instant};
use tracing::debug;

/// What came back from a tokenizer call.
#[derive(Debug)]
pub enum Answer {
    /// An HTTP answer: its status code, and its body for a 200.
    Status(Vec<u8>, Vec<u8>),
    /// The call timed out (Envoy answers a callout that times out 504).
    TimedOut,
    /// Connection refused or reset, or an unreadable answer.
    Reset,
}

/// Calls the tokenizer `t` names, counted in `metrics` (the call, and its failure) and timed
/// in `gateway` (its round trip, answered or not).
pub async fn counted_call(t: &Tokenize, metrics: &EppMetrics, gateway: &Gateway) -> Answer {
    inc(&metrics.tokenizer_calls);
    let sent = Instant::now();
    let answer = call(t).await;
    gateway.tokenizer_round_trip(sent.elapsed());
    if answer.failed() {
        inc(&metrics.tokenizer_failures);
        debug!(target = %t.target, ?answer, "tokenizer call failed");
    }
    answer
}

/// Calls the tokenizer `t` names.
pub async fn call(t: &Tokenize) -> Answer {
    let url = format!("http://{}{}", t.target, t.path);
    let timeout = Duration::from_millis(u64::from(t.timeout_ms));
    match post_json(&url, &t.body, timeout).await {
        Ok(body) => Answer::Status(b"200".to_vec(), body.into_bytes()),
        Err(HttpError::Status(line)) => match line.split_whitespace().nth(1) {
            Some(code) => Answer::Status(code.as_bytes().to_vec(), Vec::new()),
            None => Answer::Reset,
        },
        Err(HttpError::TimedOut) => Answer::TimedOut,
        Err(HttpError::Io(_) | HttpError::Malformed(_) | HttpError::UnsupportedUrl) => Answer::Reset,
    }
}

impl Answer {
    /// Whether the call failed (anything but a 200).
    pub fn failed(&self) -> bool {
        !matches!(self, Answer::Status(s, _) if s.as_slice() == b"200")
    }

    /// Whether the tokenizer itself failed: it timed out, reset, or answered 5xx (a 4xx is the
    /// request's own doing).
    pub fn tokenizer_at_fault(&self) -> bool {
        match self {
            Answer::Status(s, _) => s.first() == Some(&b'5'),
            Answer::TimedOut | Answer::Reset => true,
        }
    }

    /// `f` over this answer as the core reads a tokenizer reply (a timeout as Envoy answers
    /// one: a 504 without a body).
    pub fn with_reply<R>(&self, f: impl FnOnce(&TokenizerReply<'_>) -> R) -> R {
        let empty = Vec::new;
        match self {
            Answer::Status(status, body) => {
                let read = || body.clone();
                f(&TokenizerReply::Answered { status: Some(status), body: &read })
            }
            Answer::TimedOut => f(&TokenizerReply::Answered { status: Some(b"504"), body: &empty }),
            Answer::Reset => f(&TokenizerReply::Reset),
        }
    }
}
