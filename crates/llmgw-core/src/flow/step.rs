//! What the request path hands back: a [`Step`] (route, answer locally, or call the
//! tokenizer), with the [`Report`] of what to count, the explain header and the 503 body.

use super::gateway::GatewayState;
use super::reasons::{Fallback, TokenizerFailure};
use super::shared_prompt::SharedPrompt;
use super::speculative::Speculation;
use super::wait_ledger::WaitedOn;
use crate::policy::{Decision, Outcome};
use crate::request::ParsedRequest;
use crate::tokcache::CacheTag;

/// A request body as the filter has it.
#[derive(Debug, Clone, Copy)]
pub struct Body<'a> {
    /// The `:path` header.
    pub path: &'a str,
    /// The whole body, or its leading bytes when it is too large.
    pub bytes: &'a [u8],
    /// The body exceeds `max_body_bytes` (`bytes` is its head).
    pub too_large: bool,
}

/// What to count for a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    pub outcome: Option<Outcome>,
    pub fallback: Option<Fallback>,
    /// Leading blocks the winner holds, when the decision had exact data.
    pub matched_blocks: Option<u32>,
    /// A tokenization-cache lookup, when one was made.
    pub tokenizer_cache: Option<CacheLookup>,
    pub tokenizer_failure: Option<TokenizerFailure>,
    /// The tokenizer failure is the request's doing, not the tokenizer's (a multimodal call,
    /// whose media the tokenizer fetches and bounds, or a call body past
    /// [`super::STRIKE_MAX_CALL_BYTES`]): it does not count towards the tokenizer's circuit.
    pub tokenizer_failure_request_caused: bool,
    /// Some replica serving the model hashes otherwise than the request was hashed (see
    /// [`super::Router::take_hash_note`] for which and how): its blocks were not credited.
    pub hash_mismatch: bool,
    /// Some replica serving the model has KV-cache groups the hybrid scoring does not model
    /// (Mamba layers, mixed block sizes): it was scored by its first group alone.
    pub hybrid_unsupported: bool,
    /// Some candidate engine's mirror is incomplete: the index's misses on it were not taken
    /// as proof of absence.
    pub saw_incomplete: bool,
}

/// How the tokenization cache answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLookup {
    /// A byte-identical body (same path) resolved to its tokenization without being parsed.
    RawBodyHit,
    /// The request's tokenizer call (and salt, model, profile) was seen recently.
    Hit,
    /// Not seen, but it extends a request seen recently: routed on that one's tokens, its own
    /// tokenizer call made after it was routed.
    EarlierTurn,
    /// Not seen, but earlier requests with the same messages but the last (its siblings) were:
    /// routed on the tokens they share, its own call made after it was routed.
    SharedPrefix,
    Miss,
}

impl CacheLookup {
    pub fn is_hit(self) -> bool {
        matches!(self, CacheLookup::RawBodyHit | CacheLookup::Hit)
    }
}

/// Route to a replica.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// `ip:port`, the destination header's value.
    pub address: String,
    /// The chosen engine's data-parallel rank, when the replica behind `address` runs several
    /// (the value of `X-data-parallel-rank`).
    pub dp_rank: Option<u32>,
    /// The request's `model`, as the body named it (`None`: it named none).
    pub model: Option<String>,
    pub decision: Decision,
    pub report: Report,
    /// The prompt tokens the chosen replica computes for it (past the leading blocks it
    /// holds), when the decision had exact data: counted as queued prefill there until the
    /// request's first token.
    pub prefill_tokens: u64,
    /// The runner-up's address, when the decision predicted times to first token.
    pub runner_up: Option<String>,
    /// Speculative index entries to record for the chosen engine (its blocks at checkpoints
    /// past the run the index shows it holds), when the decision had exact data.
    pub speculation: Option<Speculation>,
    /// Of `decision.matched`, the blocks only speculative entries credit the winner with (the
    /// index shows it holding the rest): they were just sent there, no KV event confirmed them.
    pub speculative_blocks: u32,
    /// The candidate engines whose mirror is incomplete (`ip:port`, `#rank` on a data-parallel
    /// replica), at most [`MAX_EXPLAINED_INCOMPLETE`], and how many there were.
    pub incomplete: Vec<String>,
    pub incomplete_count: usize,
    /// What to keep in the gateway's shared data for the other VMs.
    pub keep: Keep,
    /// The key its end is recorded under (its prompt's last full block), when hashed: the
    /// next request extending its prompt includes it ([`crate::policy::returns`]).
    pub ends_as: Option<u64>,
    /// The key of the request that ended lately whose next request this is.
    pub follows: Option<u64>,
    /// The blocks its prompt holds on the chosen replica while it is in flight, when the
    /// decision had exact data ([`crate::policy::capacity`]).
    pub holding: Option<Holding>,
}

/// The KV blocks a routed request's prompt holds on its replica: the leading run it shares with
/// what the replica holds (its blocks counted once however many requests in flight share it),
/// and the rest, its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// The key of the shared run's last block (0: no run shared).
    pub run: u64,
    /// The shared run's blocks.
    pub run_blocks: u64,
    /// The blocks past it: the prompt's last, partly filled block included.
    pub own_blocks: u64,
}

/// What the gateway keeps in its shared data for every VM of the Envoy (see
/// [`super::EarlierTurns`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Keep {
    /// Tokens under their tags: the request's own, for its conversation's next turn, and its
    /// siblings' common prefix where it changed.
    pub tokens: Vec<(u128, Vec<u32>)>,
    /// A text prompt's tokens, for the text prompts after it.
    pub prompt: Option<SharedPrompt>,
}

/// The most incomplete engines the explain header names (the rest are counted).
pub const MAX_EXPLAINED_INCOMPLETE: usize = 8;

impl Routed {
    /// The explain header's value: the candidate engines whose mirror is incomplete
    /// (`incomplete=IP:PORT,IP:PORT#1,+3`); what a request routed before its tokenizer answered
    /// was scored on (`scored_on=earlier_turn|shared_prefix`); with the `ttft` policy, the winner's predicted time
    /// to first token and the runner-up's (`predicted_ms=12.3; runner_up=IP:PORT 180.1`), what
    /// a new prefix's prefill would cost the requests expected back on each
    /// (`returning_ms=40.2 0.0`, when either is not 0), and
    /// the rates the winner's prediction used (`rates=profile`, or `rates=learned/N …`).
    pub fn explain(&self, vm: &str) -> String {
        let d = &self.decision;
        let mut out =
            format!("outcome={}; replica={}; matched={}/{}", d.outcome.as_str(), self.address, d.matched, d.total);
        if self.speculative_blocks > 0 {
            out.push_str(&format!("; speculative={}", self.speculative_blocks));
        }
        if self.incomplete_count > 0 {
            out.push_str(&format!("; incomplete={}", self.incomplete.join(",")));
            if let Some(more) = self.incomplete_count.checked_sub(self.incomplete.len()).filter(|&n| n > 0) {
                out.push_str(&format!(",+{more}"));
            }
        }
        // Scored before its tokenizer answered, on a leading part of its prompt: the blocks
        // matched are a lower bound of what the replica holds of it.
        match self.report.tokenizer_cache {
            Some(CacheLookup::EarlierTurn) => out.push_str("; scored_on=earlier_turn"),
            Some(CacheLookup::SharedPrefix) => out.push_str("; scored_on=shared_prefix"),
            _ => {}
        }
        out.push_str(&format!("; vm={vm}"));
        if let Some(us) = d.predicted_us {
            out.push_str(&format!("; predicted_ms={:.1}; prefill_tokens={}", us as f64 / 1000.0, self.prefill_tokens));
            if let (Some(addr), Some((_, r))) = (&self.runner_up, d.runner_up) {
                out.push_str(&format!("; runner_up={addr} {:.1}", r as f64 / 1000.0));
            }
            // Counted besides the predictions: what the prefill would cost the requests
            // expected back on the winner and on the runner-up.
            let (w, r) = d.returning_us;
            if w > 0 || r > 0 {
                out.push_str(&format!("; returning_ms={:.1} {:.1}", w as f64 / 1000.0, r as f64 / 1000.0));
            }
            // Of the predictions, the waits for room in the winner's and the runner-up's KV
            // caches.
            let (w, r) = d.capacity_wait_us;
            if w > 0 || r > 0 {
                out.push_str(&format!("; capacity_wait_ms={:.1} {:.1}", w as f64 / 1000.0, r as f64 / 1000.0));
            }
            if let Some(b) = &d.basis {
                out.push_str(&format!("; {}", b.rates.explain()));
            }
        }
        out
    }
}

/// Answer locally: no healthy replica serves the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub status: u32,
    /// A JSON error body in OpenAI's shape.
    pub body: Vec<u8>,
    pub report: Report,
}

impl Rejected {
    /// The explain header's value.
    pub const EXPLAIN: &'static str = "outcome=no_replica";
}

/// Call the tokenizer on `target`, then hand the reply to [`super::Router::on_tokenizer_reply`] with
/// `pending`.
#[derive(Debug)]
pub struct Tokenize {
    pub target: String,
    pub path: &'static str,
    pub body: Vec<u8>,
    pub timeout_ms: u32,
    pub pending: Box<Pending>,
    pub report: Report,
    /// A call after routing whose tokens the replica's streamed answer can carry instead
    /// (`tokens_from_answers`): the host asks for them, and makes the call only when the answer
    /// turns out not to carry them.
    pub from_answer: bool,
}

impl Tokenize {
    /// A call made before routing (or after, once [`super::Router`] says so).
    pub(super) fn new(
        target: String,
        path: &'static str,
        body: Vec<u8>,
        timeout_ms: u32,
        pending: Box<Pending>,
        report: Report,
    ) -> Tokenize {
        Tokenize { target, path, body, timeout_ms, pending, report, from_answer: false }
    }
}

/// What a tokenizer call in flight was for.
#[derive(Debug)]
pub struct Pending {
    pub(super) profile: usize,
    pub(super) parsed: ParsedRequest,
    pub(super) approx_bytes: usize,
    /// The tokenization cache's tag of this request, when the cache is on.
    pub(super) cache_tag: Option<CacheTag>,
    /// The tag of the raw body (see [`super::Router::on_body`]).
    pub(super) raw_tag: Option<CacheTag>,
    /// The configuration generation the call was made under: a reply to a call made before a
    /// reconfigure is routed but not cached.
    pub(super) generation: u64,
    /// The hashing the cache tag was taken under (a reply hashed otherwise is not cached).
    pub(super) spec: u64,
    /// The call, kept when it went to the dedicated tokenizer: if that declines (421), the
    /// same call goes to a replica.
    pub(super) retry: Option<RetryCall>,
    /// The call's body size (a failure of a very large call is charged to the request).
    pub(super) call_bytes: usize,
    /// Its entries among the earlier turns (a chat request), written from its tokens.
    pub(super) turn_tags: Option<TurnTags>,
    /// The request was routed already, on an earlier request's tokens, with this estimate of
    /// its prompt tokens: the call only fills the caches.
    pub(super) estimated_tokens: Option<u64>,
    /// It waits to learn for its family whether waiting pays ([`super::wait_ledger`]).
    pub(super) waited_on: Option<WaitedOn>,
}

/// A request routed before its tokenizer answers, on tokens it shares with earlier ones: the
/// route and the estimate of its prompt tokens; else it waits for its tokens, and learns for
/// its family whether that paid where the family is given.
pub(super) type EarlyRoute = Result<(Routed, u64), Option<WaitedOn>>;

/// The alias tags a chat request reads and writes (see `super::earlier_turns`).
#[derive(Debug)]
pub(super) struct TurnTags {
    /// The profile and hashing the tags were taken under.
    pub(super) profile: usize,
    pub(super) spec: u64,
    /// Its own messages' (written once it is tokenized).
    pub(super) whole: CacheTag,
    /// Its messages' less the last two (the previous turn), and the bytes they span.
    pub(super) previous: Option<(CacheTag, usize)>,
    /// Its messages' less the last (what its siblings share), and the bytes they span.
    pub(super) siblings: Option<(CacheTag, usize)>,
    /// The bytes of all its messages (for the estimate of its prompt tokens).
    pub(super) bytes: usize,
}

/// What routing a request before its tokenizer answers works from: its profile and the hashing
/// the replicas use under it, its chat tags (if any), the request, its approximate key (computed
/// only if the decision needs it), the gateway's state and the time.
pub(super) struct EarlyRequest<'a> {
    pub(super) profile: usize,
    pub(super) spec: u64,
    pub(super) tags: Option<&'a TurnTags>,
    pub(super) parsed: &'a ParsedRequest,
    pub(super) approx: &'a dyn Fn() -> Option<u64>,
    pub(super) gw: &'a dyn GatewayState,
    pub(super) now_ns: u64,
}

/// What a call made after routing told (see [`super::Router::on_background_reply`]).
#[derive(Debug)]
pub struct Background {
    pub failure: Option<TokenizerFailure>,
    /// The request's prompt tokens, when the call succeeded.
    pub tokens: Option<u64>,
    /// The estimate the request was routed with.
    pub estimated_tokens: Option<u64>,
    /// What to keep in the gateway's shared data, as [`Routed::keep`].
    pub keep: Keep,
    /// The call again, on a replica (the dedicated tokenizer declined it): its reply comes
    /// back here too.
    pub retry: Option<Box<Tokenize>>,
}

/// A tokenizer call to repeat on a replica. A `/tokenize` body is written again from the
/// parsed request when needed (no copy per request); a render body is the request's own bytes,
/// which the pending call does not keep, so it is kept here.
#[derive(Debug)]
pub(super) struct RetryCall {
    pub(super) path: &'static str,
    pub(super) body: Option<Vec<u8>>,
    pub(super) timeout_ms: u32,
}

/// What to do next.
#[derive(Debug)]
pub enum Step {
    Route(Routed),
    Reject(Rejected),
    Tokenize(Tokenize),
    /// Route now, then make the tokenizer call and hand its reply to
    /// [`super::Router::on_background_reply`] (the request does not wait for it).
    RouteThenTokenize(Routed, Box<Tokenize>),
}

impl Step {
    /// What to count for this step.
    pub fn report(&self) -> &Report {
        match self {
            Step::Route(r) | Step::RouteThenTokenize(r, _) => &r.report,
            Step::Reject(r) => &r.report,
            Step::Tokenize(t) => &t.report,
        }
    }
}

/// The JSON body of the 503 sent when no healthy replica serves `model`.
pub fn no_replica_body(model: Option<&str>) -> Vec<u8> {
    let model = model.unwrap_or("(none)");
    let body = serde_json::json!({
        "error": {
            "message": format!("no healthy replica for model `{model}`"),
            "type": "llmgw_no_replica",
            "code": 503
        }
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Where a tokenizer call goes.
pub(super) enum TokenizerTarget {
    At(String),
    /// Every tokenizer the request could use is failing: no call.
    CircuitOpen,
    /// No replica to call (nor to route to).
    Nobody,
}
