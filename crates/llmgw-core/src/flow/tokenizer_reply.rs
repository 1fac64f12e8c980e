//! A tokenizer call's reply, as the host reports it, mapped to token ids or to how the call
//! failed.

use super::reasons::TokenizerFailure;
use crate::request::{parse_tokenizer_answer, TokenizerAnswer};

/// What came back from a tokenizer call, as the host reports it.
pub enum TokenizerReply<'a> {
    /// The host refused to dispatch the call.
    Refused,
    /// No headers at all: the call was reset or overflowed.
    Reset,
    /// An answer with this `:status` (absent if the host had none); `body` reads the answer's
    /// body, and is only called for a 200.
    Answered { status: Option<&'a [u8]>, body: &'a dyn Fn() -> Vec<u8> },
    /// No call: the prompt's token ids as the replica's answer carried them.
    FromAnswer(&'a [u32]),
}

/// The token ids of a tokenizer reply, or why there are none.
pub fn tokenizer_tokens(reply: &TokenizerReply<'_>) -> Result<Vec<u32>, TokenizerFailure> {
    tokenizer_answer(reply).map(|a| a.tokens)
}

/// The token ids and media items of a tokenizer reply, or why there are none.
pub fn tokenizer_answer(reply: &TokenizerReply<'_>) -> Result<TokenizerAnswer, TokenizerFailure> {
    match reply {
        TokenizerReply::Refused => Err(TokenizerFailure::Dispatch),
        TokenizerReply::Reset => Err(TokenizerFailure::Reset),
        TokenizerReply::FromAnswer(tokens) => Ok(TokenizerAnswer { tokens: tokens.to_vec(), mm: Vec::new() }),
        TokenizerReply::Answered { status: Some(b"200"), body } => {
            parse_tokenizer_answer(&body()).map_err(|_| TokenizerFailure::BadResponse)
        }
        TokenizerReply::Answered { status: Some(b"504"), .. } => Err(TokenizerFailure::Timeout),
        TokenizerReply::Answered { status: Some(b"503"), .. } => Err(TokenizerFailure::Unavailable),
        TokenizerReply::Answered { status: Some(b"421"), .. } => Err(TokenizerFailure::Declined),
        TokenizerReply::Answered { .. } => Err(TokenizerFailure::Status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: &[u8], body: &[u8]) -> Result<Vec<u32>, TokenizerFailure> {
        let owned = body.to_vec();
        let read = move || owned.clone();
        tokenizer_tokens(&TokenizerReply::Answered { status: Some(status), body: &read })
    }

    #[test]
    fn each_tokenizer_reply_maps_to_its_failure() {
        assert_eq!(answered(b"200", br#"{"count":2,"max_model_len":8,"tokens":[5,6]}"#), Ok(vec![5, 6]));
        assert_eq!(answered(b"200", b"<html>"), Err(TokenizerFailure::BadResponse));
        assert_eq!(answered(b"504", b""), Err(TokenizerFailure::Timeout));
        assert_eq!(answered(b"503", b""), Err(TokenizerFailure::Unavailable));
        assert_eq!(answered(b"404", b""), Err(TokenizerFailure::Status));
        assert_eq!(answered(b"421", b""), Err(TokenizerFailure::Declined));
        assert_eq!(answered(b"20", b""), Err(TokenizerFailure::Status));
        let never = || -> Vec<u8> { panic!("the body of a failed call is not read") };
        assert_eq!(
            tokenizer_tokens(&TokenizerReply::Answered { status: None, body: &never }),
            Err(TokenizerFailure::Status)
        );
        assert_eq!(tokenizer_tokens(&TokenizerReply::Reset), Err(TokenizerFailure::Reset));
        assert_eq!(tokenizer_tokens(&TokenizerReply::Refused), Err(TokenizerFailure::Dispatch));
        assert_eq!(tokenizer_tokens(&TokenizerReply::FromAnswer(&[7, 8])), Ok(vec![7, 8]));
    }
}
