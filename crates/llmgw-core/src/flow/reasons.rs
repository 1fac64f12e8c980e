//! Why a request was not routed from exact data, and how a tokenizer call failed: the labels
//! of `llmgw_fallbacks_total{reason}` and `llmgw_tokenizer_failures_total{reason}`.

/// Why exact routing was not possible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No profile serves the model.
    NoProfile,
    /// The profile has `kv_events` off.
    NoKvEvents,
    /// The body is not a JSON object of the expected shape.
    Unparseable,
    /// The body has no prompt to hash.
    NoPrompt,
    /// The request's `cache_salt` is longer than `max_cache_salt_bytes` (it would be hashed,
    /// and kept by the tokenization cache, whole).
    SaltTooLong,
    /// The body exceeds `max_body_bytes`.
    BodyTooLarge,
    /// The index has not received a full snapshot.
    NotSynced,
    /// The index is complete but the agent has been silent too long (`index_stale_ms`).
    Stale,
    /// The tokenizer call failed (see the tokenizer failure counters).
    Tokenizer,
    /// Hashing failed (a profile the hasher cannot serve; compiled profiles rule it out).
    Hash,
    /// The index knows none of the request's blocks.
    NoMatch,
    /// No replica serving the model hashes as the profile says (algorithm, seed or block
    /// size): their blocks cannot be matched.
    HashMismatch,
}

impl Fallback {
    pub const ALL: [Fallback; 12] = [
        Fallback::NoProfile,
        Fallback::NoKvEvents,
        Fallback::Unparseable,
        Fallback::NoPrompt,
        Fallback::SaltTooLong,
        Fallback::BodyTooLarge,
        Fallback::NotSynced,
        Fallback::Stale,
        Fallback::Tokenizer,
        Fallback::Hash,
        Fallback::NoMatch,
        Fallback::HashMismatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::NoProfile => "no_profile",
            Fallback::NoKvEvents => "no_kv_events",
            Fallback::Unparseable => "unparseable",
            Fallback::NoPrompt => "no_prompt",
            Fallback::SaltTooLong => "salt_too_long",
            Fallback::BodyTooLarge => "body_too_large",
            Fallback::NotSynced => "not_synced",
            Fallback::Stale => "stale",
            Fallback::Tokenizer => "tokenizer",
            Fallback::Hash => "hash",
            Fallback::NoMatch => "no_match",
            Fallback::HashMismatch => "hash_mismatch",
        }
    }
}

/// How a tokenizer call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerFailure {
    /// Envoy synthesized a 504 (the call's timeout).
    Timeout,
    /// A 503 (connection refused or no upstream, often synthesized by Envoy).
    Unavailable,
    /// Any other non-200 status.
    Status,
    /// The call was reset (no headers at all).
    Reset,
    /// 200 but no token ids in the body.
    BadResponse,
    /// The host refused to dispatch the call (unknown cluster, bad headers).
    Dispatch,
    /// No call was made: every tokenizer the request could use failed recently (timed out,
    /// reset, answered 5xx or garbage) and is left alone for a while (the circuit breaker).
    CircuitOpen,
    /// The dedicated tokenizer answered 421: not its request (the native tokenizer's media,
    /// a model it does not hold or has switched off). The call goes to a replica instead.
    Declined,
}

impl TokenizerFailure {
    /// Whether the failure says the tokenizer replica is unwell (it counts towards its circuit
    /// breaker); a refused dispatch or a 4xx says nothing about it.
    pub fn strikes(self) -> bool {
        matches!(
            self,
            TokenizerFailure::Timeout
                | TokenizerFailure::Unavailable
                | TokenizerFailure::Reset
                | TokenizerFailure::BadResponse
        )
    }

    pub const ALL: [TokenizerFailure; 8] = [
        TokenizerFailure::Timeout,
        TokenizerFailure::Unavailable,
        TokenizerFailure::Status,
        TokenizerFailure::Reset,
        TokenizerFailure::BadResponse,
        TokenizerFailure::Dispatch,
        TokenizerFailure::CircuitOpen,
        TokenizerFailure::Declined,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerFailure::Timeout => "timeout",
            TokenizerFailure::Unavailable => "unavailable",
            TokenizerFailure::Status => "status",
            TokenizerFailure::Reset => "reset",
            TokenizerFailure::BadResponse => "bad_response",
            TokenizerFailure::Dispatch => "dispatch",
            TokenizerFailure::CircuitOpen => "circuit_open",
            TokenizerFailure::Declined => "declined",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct() {
        let mut f: Vec<_> = Fallback::ALL.iter().map(|f| f.as_str()).collect();
        f.sort_unstable();
        f.dedup();
        assert_eq!(f.len(), Fallback::ALL.len());
        let mut t: Vec<_> = TokenizerFailure::ALL.iter().map(|f| f.as_str()).collect();
        t.sort_unstable();
        t.dedup();
        assert_eq!(t.len(), TokenizerFailure::ALL.len());
    }
}
