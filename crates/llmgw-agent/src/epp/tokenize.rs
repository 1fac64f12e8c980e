//! The tokenizer call a routing step asks for, made as the filter makes it: a POST of the step's
//! body to its path on the target it names (the profile's dedicated tokenizer, such as this
//! agent's native tokenizer, else the least-loaded replica), within the step's timeout. The
//! answer is handed to the core as the filter hands Envoy's: a status and a body.

use crate::http_client::{post_json, HttpError};
use llmgw_core::flow::Tokenize;
use std::time::Duration;

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
