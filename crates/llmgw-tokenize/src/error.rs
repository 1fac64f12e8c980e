//! Errors: a model that cannot be loaded (refused at start, never guessed) and a request that
//! cannot be answered (each with the HTTP status vLLM would give it, or a decline that sends
//! the caller to a replica).

/// Why a model directory was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LoadError {
    #[error("cannot read {path}: {error}")]
    Io { path: String, error: String },
    #[error("{file} is not usable: {reason}")]
    Invalid { file: String, reason: String },
    #[error("no tokenizer.json in the model directory (only fast tokenizers can be served natively)")]
    NoTokenizerJson,
    #[error("tokenizer.json cannot be loaded: {0}")]
    Tokenizer(String),
    #[error("the chat template cannot be compiled: {0}")]
    Template(String),
    #[error("refused: {0}")]
    Refused(String),
}

/// Why a request was not answered with tokens.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RequestError {
    /// The request is malformed, or the template rejected it: vLLM answers 400 too.
    #[error("{0}")]
    BadRequest(String),
    /// Something this tokenizer does not do (media parts, a per-request template, a model it
    /// has not loaded): the caller asks a replica.
    #[error("declined: {0}")]
    Declined(String),
    /// Rendering or encoding failed in a way vLLM's would not, or ran out of its work budget.
    #[error("{0}")]
    Internal(String),
}

impl RequestError {
    /// The HTTP status to answer with.
    pub fn status(&self) -> u16 {
        match self {
            RequestError::BadRequest(_) => 400,
            // 421 Misdirected Request: "ask someone else", never counted as a tokenizer failure.
            RequestError::Declined(_) => 421,
            RequestError::Internal(_) => 500,
        }
    }
}
