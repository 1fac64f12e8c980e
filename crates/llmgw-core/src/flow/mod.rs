//! The request path, from a complete body to a routing step, with no host in sight: the
//! filter reads the body from Envoy, hands it here, and acts on the [`Step`] it gets back
//! (route, answer 503, or make the tokenizer call and hand its reply back).
//!
//! Order of resolution for a body:
//! 1. a byte-identical body seen recently resolves to its cached tokenization unparsed;
//! 2. a body that cannot be routed exactly goes to a fallback, for the first [`Fallback`] that
//!    applies (too large, no prompt, unparseable, no profile, `kv_events` off, index not synced);
//! 3. token ids in the body are hashed and scored at once;
//! 4. a prompt tokenized recently (same profile, tokenizer call, salt and model) is scored
//!    from its cached tokens;
//! 5. otherwise the tokenizer is called on the least-loaded healthy replica.
//!
//! Every step carries a [`Report`] of what to count. A step never fails the request: only a
//! model with no healthy replica is answered locally (503).

mod hybrid;
mod prefix;
mod reasons;
mod speculative;

pub use hybrid::{hybrid_hit, HybridHit};
pub use prefix::{prefix_scores, Scratch, FIRST_HASH_BATCH};
pub use reasons::{tokenizer_answer, tokenizer_tokens, Fallback, TokenizerFailure, TokenizerReply};
pub use speculative::{
    checkpoints, Hit as SpeculativeHit, Speculation, MAX_BLOCKS as SPECULATIVE_BLOCKS, TTL_NS as SPECULATIVE_TTL_NS,
};

use crate::config::{Compiled, CompiledProfile, DEFAULT_APPROX_PREFIX_BYTES};
use crate::feed::{FeedState, FeedView};
pub use crate::fleet::replica_key;
use crate::hash::{BlockHash, HashSpec, MmFeature, RequestExtras};
use crate::index::ReplicaId;
use crate::policy::Weights;
use crate::policy::{self, Candidate, Decision, Outcome};
use crate::request::{parse_request, ApiKind, ParsedRequest, Prompt, TokenizerAnswer, TokenizerCall};
use crate::tokcache::{Alias, CacheTag, TokenCache, Tokenized};

/// Requests in flight per replica address, as this gateway counts them.
pub trait InFlight {
    fn in_flight(&self, address: &str) -> u32;
    /// Prefill tokens of those requests that have not produced a first token yet.
    fn pending_tokens(&self, _address: &str) -> u64 {
        0
    }
    /// Speculative index entries (see [`speculative`]): one hit pushed onto `out` for each of
    /// `keys` (block keys) this Envoy sent to an engine within the TTL.
    fn speculative(&self, _keys: &[u64], _out: &mut Vec<SpeculativeHit>) {}
    /// Whether the gateway avoids this replica for now (its connects failed or it answered
    /// 5xx): it is treated as down.
    fn avoided(&self, _address: &str) -> bool {
        false
    }
    /// Whether tokenizer calls leave this address alone for now (its recent calls timed out,
    /// were reset or answered 5xx): the tokenizer's circuit breaker.
    fn tokenizer_avoided(&self, _address: &str) -> bool {
        false
    }
}

/// No requests in flight anywhere.
impl InFlight for () {
    fn in_flight(&self, _address: &str) -> u32 {
        0
    }
}

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
    /// Some replica serving the model hashes otherwise than the request was hashed (see
    /// [`Router::take_hash_note`] for which and how): its blocks were not credited.
    pub hash_mismatch: bool,
    /// Some replica serving the model has KV-cache groups the hybrid scoring does not model
    /// (Mamba layers, mixed block sizes): it was scored by its first group alone.
    pub hybrid_unsupported: bool,
}

/// How the tokenization cache answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLookup {
    /// A byte-identical body (same path) resolved to its tokenization without being parsed.
    RawBodyHit,
    /// The request's tokenizer call (and salt, model, profile) was seen recently.
    Hit,
    Miss,
}

impl CacheLookup {
    pub fn is_hit(self) -> bool {
        self != CacheLookup::Miss
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
}

impl Routed {
    /// The explain header's value: with the `ttft` policy, the winner's predicted time to first
    /// token and the runner-up's (`predicted_ms=12.3; runner_up=IP:PORT 180.1`).
    pub fn explain(&self, vm: &str) -> String {
        let d = &self.decision;
        let mut out =
            format!("outcome={}; replica={}; matched={}/{}", d.outcome.as_str(), self.address, d.matched, d.total);
        if self.speculative_blocks > 0 {
            out.push_str(&format!("; speculative={}", self.speculative_blocks));
        }
        out.push_str(&format!("; vm={vm}"));
        if let Some(us) = d.predicted_us {
            out.push_str(&format!("; predicted_ms={:.1}; prefill_tokens={}", us as f64 / 1000.0, self.prefill_tokens));
            if let (Some(addr), Some((_, r))) = (&self.runner_up, d.runner_up) {
                out.push_str(&format!("; runner_up={addr} {:.1}", r as f64 / 1000.0));
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

/// Call the tokenizer on `target`, then hand the reply to [`Router::on_tokenizer_reply`] with
/// `pending`.
#[derive(Debug)]
pub struct Tokenize {
    pub target: String,
    pub path: &'static str,
    pub body: Vec<u8>,
    pub timeout_ms: u32,
    pub pending: Box<Pending>,
    pub report: Report,
}

/// Where a tokenizer call goes.
enum TokenizerTarget {
    At(String),
    /// Every tokenizer the request could use is failing: no call.
    CircuitOpen,
    /// No replica to call (nor to route to).
    Nobody,
}

/// What a tokenizer call in flight was for.
#[derive(Debug)]
pub struct Pending {
    profile: usize,
    parsed: ParsedRequest,
    approx_bytes: usize,
    /// The tokenization cache's tag of this request, when the cache is on.
    cache_tag: Option<CacheTag>,
    /// The tag of the raw body (see [`Router::on_body`]).
    raw_tag: Option<CacheTag>,
    /// The configuration generation the call was made under: a reply to a call made before a
    /// reconfigure is routed but not cached.
    generation: u64,
    /// The hashing the cache tag was taken under (a reply hashed otherwise is not cached).
    spec: u64,
}

/// What to do next.
#[derive(Debug)]
pub enum Step {
    Route(Routed),
    Reject(Rejected),
    Tokenize(Tokenize),
}

impl Step {
    /// What to count for this step.
    pub fn report(&self) -> &Report {
        match self {
            Step::Route(r) => &r.report,
            Step::Reject(r) => &r.report,
            Step::Tokenize(t) => &t.report,
        }
    }
}

/// One VM's routing state: the compiled configuration (with each profile's hasher), the feed's
/// view of the fleet, recent tokenizations and scratch buffers.
pub struct Router {
    config: Compiled,
    /// Weights of requests no profile serves.
    default_weights: Weights,
    pub feed: FeedView,
    tokcache: TokenCache,
    tokcache_key: u64,
    scratch: Scratch,
    /// Bumped by every reconfigure.
    generation: u64,
    /// The current request's hash check: replicas whose hashing differs (not credited).
    mismatched: Vec<ReplicaId>,
    hash_mismatch: bool,
    hybrid_unsupported: bool,
    /// The last hash-settings mismatch described, and the last one handed out for the log.
    hash_note: Option<String>,
    hash_logged: Option<String>,
    /// The current request's prompt tokens, once [`Router::exact`] scored them.
    prompt_tokens: usize,
    /// The current request's leading runs as the index alone has them (before speculative
    /// entries), and the speculative lookup's buffers.
    index_leading: Vec<u32>,
    spec_keys: Vec<u64>,
    spec_hits: Vec<SpeculativeHit>,
    /// Engines the feed reset (restarted: their caches are empty), with when this VM learned it:
    /// speculative entries written before do not count. Kept for the entries' TTL.
    resets: Vec<(u64, u64)>,
}

/// What [`Router::hash_check`] found.
enum HashCheck {
    /// Hash with the profile's hasher; `changed`: it was just rebuilt for new settings (hashes
    /// computed earlier no longer apply).
    Use { changed: bool },
    /// No replica serving the model hashes as the profile does.
    Mismatch,
    /// The settings cannot be hashed here (an algorithm this build lacks, xxhash unseeded).
    Unusable,
}

/// Whether replica `r` serves `model` (every replica, when the model is unknown).
fn serves(r: &crate::feed::Replica, model: Option<&str>) -> bool {
    match model {
        Some(m) => r.models.is_empty() || r.models.iter().any(|x| x == m),
        None => true,
    }
}

fn token_cache(config: &Compiled, key: u64) -> TokenCache {
    TokenCache::new(config.tokenizer_cache_bytes, config.tokenizer_cache_ttl_ns, key)
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

/// The approximate fallback's key: a stable hash of the prompt's leading text, or of the raw
/// body's leading bytes when there is no prompt.
fn approx_key(parsed: Option<&ParsedRequest>, body: &[u8], nbytes: usize) -> Option<u64> {
    let mut lead = Vec::new();
    match parsed {
        Some(p) if !matches!(p.prompt, Prompt::None) => p.leading_text(nbytes, &mut lead),
        _ => lead.extend(body.iter().take(nbytes)),
    }
    (!lead.is_empty()).then(|| policy::stable_hash(&lead))
}

/// The first reason a parsed body cannot be routed exactly, if any.
fn fallback_reason(
    body: &Body<'_>,
    parsed: Option<&ParsedRequest>,
    profile: Option<&CompiledProfile>,
    unusable: Option<Fallback>,
    max_salt: usize,
) -> Option<Fallback> {
    match (parsed, profile) {
        _ if body.too_large => Some(Fallback::BodyTooLarge),
        (None, _) if body.bytes.is_empty() => Some(Fallback::NoPrompt),
        (None, _) => Some(Fallback::Unparseable),
        (Some(p), _) if matches!(p.prompt, Prompt::None) => Some(Fallback::NoPrompt),
        (Some(p), _) if p.cache_salt.as_ref().is_some_and(|s| s.len() > max_salt) => Some(Fallback::SaltTooLong),
        (Some(_), None) => Some(Fallback::NoProfile),
        (Some(_), Some(p)) if !p.kv_events => Some(Fallback::NoKvEvents),
        _ => unusable,
    }
}

/// Replicas that serve `model` (all replicas when the model is unknown), with their loads.
/// Replicas the gateway avoids count as down, unless it avoids every one that is up (then none
/// is avoided: a fleet-wide failure is not made worse by refusing every request).
fn candidates<'a>(feed: &'a FeedState, model: Option<&str>, in_flight: &dyn InFlight) -> Vec<Candidate<'a>> {
    let mut cands = candidates_avoiding(feed, model, in_flight, true);
    if !cands.iter().any(|c| c.up) {
        cands = candidates_avoiding(feed, model, in_flight, false);
    }
    cands
}

fn candidates_avoiding<'a>(
    feed: &'a FeedState,
    model: Option<&str>,
    in_flight: &dyn InFlight,
    avoid: bool,
) -> Vec<Candidate<'a>> {
    feed.replicas
        .iter()
        .filter(|r| serves(r, model) && feed.allowed(r.id))
        .filter_map(|r| {
            let id = ReplicaId::try_from(r.id).ok()?;
            let load = if feed.loads_stale { None } else { feed.loads.iter().find(|l| l.replica == r.id) };
            Some(Candidate {
                id,
                address: r.address.as_str(),
                up: r.up && !r.address.is_empty() && !(avoid && in_flight.avoided(&r.address)),
                in_flight: in_flight.in_flight(&r.address),
                pending_tokens: in_flight.pending_tokens(&r.address),
                running: load.map_or(0, |l| l.running),
                waiting: load.map_or(0, |l| l.waiting),
                kv_usage: load.map_or(0.0, |l| l.kv_cache_usage),
                dp_rank: r.data_parallel().then_some(r.dp_rank),
            })
        })
        .collect()
}

impl Router {
    /// `tokcache_key`: the secret of the tokenization cache's tags (clients choose the bodies
    /// they are taken over): random per VM.
    pub fn new(config: Compiled, tokcache_key: u64) -> Router {
        let mut feed = FeedView::default();
        feed.set_allowlist(&config.allow);
        Router {
            tokcache: token_cache(&config, tokcache_key),
            config,
            default_weights: Weights::default(),
            feed,
            tokcache_key,
            scratch: Scratch::default(),
            generation: 0,
            mismatched: Vec::new(),
            hash_mismatch: false,
            hybrid_unsupported: false,
            hash_note: None,
            hash_logged: None,
            prompt_tokens: 0,
            index_leading: Vec::new(),
            spec_keys: Vec::new(),
            spec_hits: Vec::new(),
            resets: Vec::new(),
        }
    }

    /// Why the serving index cannot be credited, if it cannot.
    fn unusable(&self) -> Option<Fallback> {
        if self.feed.usable() {
            None
        } else if self.feed.stale() {
            Some(Fallback::Stale)
        } else {
            Some(Fallback::NotSynced)
        }
    }

    /// The fingerprint of the hashing profile `pi` currently uses (0 without such a profile).
    fn spec_fingerprint(&self, pi: usize) -> u64 {
        self.config.profile(pi).map_or(0, |p| p.spec.fingerprint())
    }

    /// A description of the last hash-settings mismatch, naming both values, once per
    /// distinct mismatch (for the log): `None` when there is nothing new to say.
    pub fn take_hash_note(&mut self) -> Option<String> {
        let note = self.hash_note.take()?;
        if self.hash_logged.as_deref() == Some(note.as_str()) {
            return None;
        }
        self.hash_logged = Some(note.clone());
        Some(note)
    }

    /// Checks the hashing of profile `pi` against what the feed says the replicas serving
    /// `model` use: the profile's own settings first, then those of the first such replica
    /// that carries any, then the defaults. The profile switches hashers when that changes (it keeps
    /// a few);
    /// replicas that hash otherwise go into `mismatched` (never credited) and are described.
    fn hash_check(&mut self, pi: usize, model: Option<&str>) -> HashCheck {
        let Router { config, feed, mismatched, .. } = self;
        mismatched.clear();
        let Some(p) = config.profiles.get_mut(pi) else { return HashCheck::Unusable };
        let serving = feed.serving();
        let published: Vec<(&crate::feed::Replica, Result<HashSpec, String>)> = serving
            .replicas
            .iter()
            .filter(|r| r.up && serves(r, model))
            .filter_map(|r| r.hash.as_ref().map(|h| (r, h.spec())))
            .collect();
        let reference = published.iter().find_map(|(_, s)| s.as_ref().ok());
        let spec = p.effective_spec(reference);
        let before = p.spec.clone();
        if !p.use_spec(&spec) {
            return HashCheck::Unusable;
        }
        let changed = before != spec;
        let mut notes = Vec::new();
        for (r, theirs) in &published {
            let diff = match theirs {
                Ok(t) if *t == spec => continue,
                Ok(t) => spec
                    .differences(t)
                    .into_iter()
                    .map(|(field, ours, theirs)| format!("{field} {theirs} (profile `{}` uses {ours})", p.name))
                    .collect::<Vec<_>>()
                    .join(", "),
                Err(e) => format!("unusable settings ({e})"),
            };
            if let Ok(id) = ReplicaId::try_from(r.id) {
                mismatched.push(id);
            }
            notes.push(format!("replica `{}` rank {} ({}) hashes with {diff}", r.name, r.dp_rank, r.address));
        }
        let all = !published.is_empty() && mismatched.len() == published.len();
        if notes.is_empty() {
            return HashCheck::Use { changed };
        }
        self.hash_mismatch = true;
        let what = if all { "routing by the fallback" } else { "its blocks are not credited" };
        self.hash_note = Some(format!(
            "llmgw: hash settings mismatch for model `{}`: {}; {what}",
            model.unwrap_or("(none)"),
            notes.join("; ")
        ));
        if all {
            HashCheck::Mismatch
        } else {
            HashCheck::Use { changed }
        }
    }

    pub fn config(&self) -> &Compiled {
        &self.config
    }

    /// Replaces the configuration whole. The feed's state stays; recent tokenizations go
    /// (profiles may have changed what a tokenization means).
    pub fn reconfigure(&mut self, config: Compiled) {
        self.tokcache = token_cache(&config, self.tokcache_key);
        self.feed.set_allowlist(&config.allow);
        self.config = config;
        self.generation = self.generation.wrapping_add(1);
    }

    pub fn tokenizer_cache(&self) -> &TokenCache {
        &self.tokcache
    }

    fn approx_bytes(&self, profile: Option<usize>) -> usize {
        profile
            .and_then(|i| self.config.profile(i))
            .map_or(usize::try_from(DEFAULT_APPROX_PREFIX_BYTES).unwrap_or(usize::MAX), |p| p.approx_prefix_bytes)
    }

    /// Notes the engines the feed reset since the last decision (see `resets`).
    fn note_resets(&mut self, now_ns: u64) {
        self.resets.retain(|&(_, at)| now_ns.saturating_sub(at) <= SPECULATIVE_TTL_NS);
        for engine in self.feed.take_cleared() {
            self.resets.retain(|&(e, _)| e != engine);
            self.resets.push((engine, now_ns));
        }
    }

    /// Decides for a complete body (or the head of one too large to read).
    pub fn on_body(&mut self, body: &Body<'_>, in_flight: &dyn InFlight, now_ns: u64) -> Step {
        self.note_resets(now_ns);
        self.hash_mismatch = false;
        self.hybrid_unsupported = false;
        let kind = ApiKind::from_path(body.path);
        let bytes = body.bytes;
        // A byte-identical body seen recently resolves to its cached tokenization unparsed
        // (retries, several samples of one prompt).
        let raw_tag = (self.tokcache.enabled() && !body.too_large && !bytes.is_empty() && kind != ApiKind::Other)
            .then(|| self.tokcache.tag(&[b"body", body.path.as_bytes(), bytes]));
        if let Some(alias) = raw_tag.and_then(|t| self.tokcache.alias(t).cloned()) {
            let usable = self.feed.usable() && self.config.profile(alias.profile).is_some_and(|p| p.kv_events);
            let nbytes = self.approx_bytes(Some(alias.profile));
            let approx = || approx_key(parse_request(kind, bytes).ok().as_ref(), bytes, nbytes);
            if usable {
                if let Some(step) = self.route_cached(&alias, &approx, in_flight, now_ns, CacheLookup::RawBodyHit) {
                    return step;
                }
            }
        }
        let parsed_opt = if body.too_large { None } else { parse_request(kind, bytes).ok() };
        let profile = self.config.profile_for(parsed_opt.as_ref().and_then(|p| p.model.as_deref()).unwrap_or_default());
        let why = fallback_reason(
            body,
            parsed_opt.as_ref(),
            profile.and_then(|i| self.config.profile(i)),
            self.unusable(),
            self.config.max_cache_salt_bytes,
        );
        match (parsed_opt, profile, why) {
            (Some(parsed), Some(pi), None) => self.route_parsed(parsed, pi, raw_tag, bytes, in_flight, now_ns),
            (parsed, profile, why) => {
                let nbytes = self.approx_bytes(profile);
                let approx = || approx_key(parsed.as_ref(), bytes, nbytes);
                let model = parsed.as_ref().and_then(|p| p.model.as_deref());
                self.finish(model, profile, false, &approx, why, in_flight, Report::default())
            }
        }
    }

    /// A parsed body its profile routes exactly: scored at once (token ids, or a tokenization
    /// cached), or sent to the tokenizer (the request moves into the pending call).
    fn route_parsed(
        &mut self,
        parsed: ParsedRequest,
        pi: usize,
        raw_tag: Option<CacheTag>,
        bytes: &[u8],
        in_flight: &dyn InFlight,
        now_ns: u64,
    ) -> Step {
        let nbytes = self.approx_bytes(Some(pi));
        let model = parsed.model.as_deref();
        // The approximate key, computed only if the decision needs it.
        let approx = || approx_key(Some(&parsed), bytes, nbytes);
        if let Prompt::Tokens(tokens) = &parsed.prompt {
            let why = self.exact(pi, parsed.cache_salt.as_deref(), model, tokens, &[], Vec::new(), in_flight).err();
            return self.finish(model, Some(pi), why.is_none(), &approx, why, in_flight, Report::default());
        }
        let Some(p) = self.config.profile(pi) else {
            return self.finish(model, Some(pi), false, &approx, None, in_flight, Report::default());
        };
        let call = parsed.tokenizer_call(p.tokenizer, bytes);
        let timeout_ms = p.tokenizer_timeout_ms;
        let why = call.is_none().then_some(Fallback::NoPrompt);
        let mut report = Report::default();
        // The same prompt seen recently under the same hashing: its tokens (and leading hashes)
        // are known.
        let _ = self.hash_check(pi, model);
        let spec = self.spec_fingerprint(pi);
        let cache_tag = call.as_ref().and_then(|c| self.cache_tag(pi, spec, &parsed, c));
        if let Some(tag) = cache_tag {
            let alias =
                Alias { tag, profile: pi, model: parsed.model.clone(), cache_salt: parsed.cache_salt.clone(), spec };
            if let Some(step) = self.route_cached(&alias, &approx, in_flight, now_ns, CacheLookup::Hit) {
                if let Some(raw) = raw_tag {
                    self.tokcache.add_alias(raw, alias);
                }
                return step;
            }
            report.tokenizer_cache = Some(CacheLookup::Miss);
        }
        // Tokenize on the dedicated tokenizer, else the least-loaded healthy replica of the
        // model, leaving alone those whose recent calls failed.
        let target = call.as_ref().map(|_| self.tokenizer_target(pi, model, in_flight));
        let (Some(call), Some(target)) = (call, target) else {
            // No call possible; without a replica `finish` answers 503.
            return self.finish(model, Some(pi), false, &approx, why, in_flight, report);
        };
        let target = match target {
            TokenizerTarget::At(t) => t,
            TokenizerTarget::CircuitOpen => {
                report.tokenizer_failure = Some(TokenizerFailure::CircuitOpen);
                return self.finish(model, Some(pi), false, &approx, Some(Fallback::Tokenizer), in_flight, report);
            }
            TokenizerTarget::Nobody => return self.finish(model, Some(pi), false, &approx, why, in_flight, report),
        };
        let generation = self.generation;
        let pending =
            Box::new(Pending { profile: pi, parsed, approx_bytes: nbytes, cache_tag, raw_tag, generation, spec });
        Step::Tokenize(Tokenize { target, path: call.path, body: call.body, timeout_ms, pending, report })
    }

    /// Where profile `pi`'s tokenizer call goes: its dedicated tokenizer unless that is failing,
    /// else the least-loaded healthy replica serving `model` whose tokenizer is not failing.
    fn tokenizer_target(&self, pi: usize, model: Option<&str>, in_flight: &dyn InFlight) -> TokenizerTarget {
        let p = self.config.profile(pi);
        if let Some(a) = p.and_then(|p| p.tokenizer_address.as_deref()) {
            if !in_flight.tokenizer_avoided(a) {
                return TokenizerTarget::At(a.to_owned());
            }
        }
        let w = p.map_or(&self.default_weights, |p| &p.weights);
        let mut cands = candidates(self.feed.serving(), model, in_flight);
        if !cands.iter().any(|c| c.up) {
            return TokenizerTarget::Nobody;
        }
        cands.retain(|c| c.up && !in_flight.tokenizer_avoided(c.address));
        match policy::least_loaded(&cands, &w.limits).and_then(|i| cands.get(i)) {
            Some(c) => TokenizerTarget::At(c.address.to_owned()),
            None => TokenizerTarget::CircuitOpen,
        }
    }

    /// Decides once the tokenizer call for `pending` came back (or could not be made).
    pub fn on_tokenizer_reply(
        &mut self,
        pending: Pending,
        reply: &TokenizerReply<'_>,
        in_flight: &dyn InFlight,
        now_ns: u64,
    ) -> Step {
        self.note_resets(now_ns);
        self.hash_mismatch = false;
        self.hybrid_unsupported = false;
        let mut report = Report::default();
        let p = &pending.parsed;
        let (exact, why) = match tokenizer_answer(reply) {
            // The index may have lost its sync while the call was out.
            Ok(_) if !self.feed.usable() => (false, self.unusable()),
            Ok(TokenizerAnswer { tokens, mm }) => {
                // A multimodal prompt's hashes need its media items: never cached.
                let cacheable = mm.is_empty();
                let scored = self.exact(
                    pending.profile,
                    p.cache_salt.as_deref(),
                    p.model.as_deref(),
                    &tokens,
                    &[],
                    mm,
                    in_flight,
                );
                if let Err(why) = scored {
                    (false, Some(why))
                } else {
                    let same =
                        pending.generation == self.generation && pending.spec == self.spec_fingerprint(pending.profile);
                    let tag = pending.cache_tag.filter(|_| same && cacheable);
                    if let Some(tag) = tag {
                        let hashes = self.scratch.hashes.clone();
                        self.tokcache.insert(tag, Tokenized { tokens, hashes }, now_ns);
                        if let Some(raw) = pending.raw_tag {
                            let alias = Alias {
                                tag,
                                profile: pending.profile,
                                model: p.model.clone(),
                                cache_salt: p.cache_salt.clone(),
                                spec: pending.spec,
                            };
                            self.tokcache.add_alias(raw, alias);
                        }
                    }
                    (true, None)
                }
            }
            Err(f) => {
                report.tokenizer_failure = Some(f);
                (false, Some(Fallback::Tokenizer))
            }
        };
        let approx = || approx_key(Some(p), &[], pending.approx_bytes);
        self.finish(p.model.as_deref(), Some(pending.profile), exact, &approx, why, in_flight, report)
    }

    /// Hashes and scores `tokens` for a profile into the scratch space (replicas that hash
    /// otherwise score 0), or the fallback that applies: the replicas' hashing does not match
    /// ([`Fallback::HashMismatch`]) or cannot be done (no such profile, the hasher refused).
    /// Engines `in_flight`'s speculative entries say were just sent the leading blocks are
    /// credited with them.
    #[allow(clippy::too_many_arguments)]
    fn exact(
        &mut self,
        profile: usize,
        cache_salt: Option<&str>,
        model: Option<&str>,
        tokens: &[u32],
        known: &[BlockHash],
        mm: Vec<MmFeature>,
        in_flight: &dyn InFlight,
    ) -> Result<(), Fallback> {
        let known = match self.hash_check(profile, model) {
            HashCheck::Use { changed: false } => known,
            HashCheck::Use { changed: true } => &[],
            HashCheck::Mismatch => return Err(Fallback::HashMismatch),
            HashCheck::Unusable => return Err(Fallback::Hash),
        };
        self.prompt_tokens = tokens.len();
        let Router {
            config,
            feed,
            scratch,
            mismatched,
            hybrid_unsupported,
            index_leading,
            spec_keys,
            spec_hits,
            resets,
            ..
        } = self;
        let Some(p) = config.profiles.get_mut(profile) else { return Err(Fallback::Hash) };
        let extras = RequestExtras {
            cache_salt: cache_salt.map(str::to_owned),
            lora: p.lora(model),
            mm,
            lookahead: p.spec.lookahead,
        };
        prefix_scores(&feed.serving().index, &mut p.hasher, p.block_size, &extras, tokens, known, scratch)
            .map_err(|_| Fallback::Hash)?;
        for id in mismatched.iter() {
            if let Some(l) = scratch.scores.leading.get_mut(usize::from(*id)) {
                *l = 0;
            }
        }
        // Hybrid engines hit only as far as every KV-cache group allows.
        let serving = feed.serving();
        for r in serving.replicas.iter().filter(|r| r.kv_groups.len() > 1) {
            let Ok(id) = ReplicaId::try_from(r.id) else { continue };
            let Some(l) = scratch.scores.leading.get_mut(usize::from(id)) else { continue };
            let run = usize::try_from(*l).unwrap_or(usize::MAX);
            match hybrid_hit(&serving.index, r, id, &scratch.hashes, run, tokens.len(), p.block_size) {
                HybridHit::Hit(n) => *l = u32::try_from(n).unwrap_or(u32::MAX),
                HybridHit::Unsupported => *hybrid_unsupported = true,
                HybridHit::NotHybrid => {}
            }
        }
        // Speculative entries: engines this Envoy just sent this prompt's leading blocks to. The
        // blocks are hashed to a bounded depth for them, even past what the index holds.
        index_leading.clone_from(&scratch.scores.leading);
        let full = usize::try_from(scratch.scores.total).unwrap_or(usize::MAX);
        let want = full.min(SPECULATIVE_BLOCKS);
        if let Some(more) = want.checked_sub(scratch.hashes.len()).filter(|&n| n > 0) {
            p.hasher
                .hash_request_more(tokens, p.block_size, &extras, &mut scratch.hashes, more)
                .map_err(|_| Fallback::Hash)?;
        }
        let positions = || checkpoints(scratch.hashes.len().min(want));
        spec_keys.clear();
        spec_keys.extend(positions().filter_map(|i| scratch.hashes.get(i).map(|h| h.key.0)));
        spec_hits.clear();
        if !spec_keys.is_empty() {
            in_flight.speculative(spec_keys, spec_hits);
        }
        for hit in spec_hits.iter() {
            let engine = hit.engine;
            if resets.iter().any(|&(e, at)| e == engine && hit.written_ns < at) {
                continue;
            }
            let Some(run) = positions().nth(hit.key).and_then(|p| u32::try_from(p).ok()).map(|p| p.saturating_add(1))
            else {
                continue;
            };
            for r in &serving.replicas {
                let Ok(id) = ReplicaId::try_from(r.id) else { continue };
                if mismatched.contains(&id) || replica_key(&r.address, r.data_parallel().then_some(r.dp_rank)) != engine
                {
                    continue;
                }
                let leading = &mut scratch.scores.leading;
                let i = usize::from(id);
                if leading.len() <= i {
                    leading.resize(i.saturating_add(1), 0);
                }
                if let Some(l) = leading.get_mut(i) {
                    *l = (*l).max(run);
                }
            }
        }
        Ok(())
    }

    /// The cache tag of a request: profile, tokenizer call, and what else enters its hashes.
    fn cache_tag(&self, profile: usize, spec: u64, parsed: &ParsedRequest, call: &TokenizerCall) -> Option<CacheTag> {
        // A multimodal chat's hashes depend on its media items, which are not cached.
        if !self.tokcache.enabled() || parsed.multimodal() {
            return None;
        }
        let profile = u64::try_from(profile).unwrap_or(u64::MAX).to_le_bytes();
        Some(self.tokcache.tag(&[
            &profile,
            &spec.to_le_bytes(),
            call.path.as_bytes(),
            &call.body,
            parsed.cache_salt.as_deref().unwrap_or_default().as_bytes(),
            parsed.model.as_deref().unwrap_or_default().as_bytes(),
        ]))
    }

    /// Routes from the cached tokenization `alias.tag`: `None` when it is no longer cached.
    fn route_cached(
        &mut self,
        alias: &Alias,
        approx: &dyn Fn() -> Option<u64>,
        in_flight: &dyn InFlight,
        now_ns: u64,
        lookup: CacheLookup,
    ) -> Option<Step> {
        // Only a tokenization hashed as the replicas now hash is used.
        let _ = self.hash_check(alias.profile, alias.model.as_deref());
        if self.spec_fingerprint(alias.profile) != alias.spec {
            return None;
        }
        let mut t = self.tokcache.take(alias.tag, now_ns)?;
        let report = Report { tokenizer_cache: Some(lookup), ..Report::default() };
        let scored = self.exact(
            alias.profile,
            alias.cache_salt.as_deref(),
            alias.model.as_deref(),
            &t.tokens,
            &t.hashes,
            Vec::new(),
            in_flight,
        );
        let exact = scored.is_ok();
        if exact && self.scratch.hashes.len() > t.hashes.len() {
            t.hashes.clone_from(&self.scratch.hashes);
        }
        self.tokcache.put_back(alias.tag, t);
        let why = scored.err();
        Some(self.finish(alias.model.as_deref(), Some(alias.profile), exact, approx, why, in_flight, report))
    }

    /// Decides with whatever is known. `exact`: the scratch space holds the request's scores.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        model: Option<&str>,
        profile: Option<usize>,
        exact: bool,
        approx: &dyn Fn() -> Option<u64>,
        why: Option<Fallback>,
        in_flight: &dyn InFlight,
        mut report: Report,
    ) -> Step {
        let prof = profile.and_then(|i| self.config.profile(i));
        let w = prof.map_or(&self.default_weights, |p| &p.weights);
        let cands = candidates(self.feed.serving(), model, in_flight);
        let scores = exact.then_some(&self.scratch.scores);
        let block_size = prof.map_or(0, |p| u64::try_from(p.block_size).unwrap_or(u64::MAX));
        let tokens = u64::try_from(self.prompt_tokens).unwrap_or(u64::MAX);
        let work = exact.then_some(policy::Work { tokens, block_size });
        let d: Decision = policy::decide_lazy(&cands, scores, work, approx, w);
        let prefill_tokens =
            if exact { tokens.saturating_sub(u64::from(d.matched).saturating_mul(block_size)) } else { 0 };
        let runner_up = d.runner_up.and_then(|(i, _)| cands.get(i)).map(|c| c.address.to_owned());
        // With exact data: the winner and the leading blocks the index alone shows it holding.
        let exact_winner = d
            .winner
            .and_then(|i| cands.get(i))
            .filter(|_| exact)
            .map(|c| (c, self.index_leading.get(usize::from(c.id)).copied().unwrap_or(0)));
        let speculative_blocks = exact_winner.map_or(0, |(_, held)| d.matched.saturating_sub(held));
        let speculation = exact_winner.and_then(|(c, held)| {
            let held = usize::try_from(held).unwrap_or(usize::MAX);
            let n = self.scratch.hashes.len().min(SPECULATIVE_BLOCKS);
            let keys: Vec<u64> = checkpoints(n)
                .filter(|&p| p >= held)
                .filter_map(|p| self.scratch.hashes.get(p).map(|h| h.key.0))
                .collect();
            let replica = replica_key(c.address, c.dp_rank);
            let reset_ns = self.resets.iter().find(|&&(e, _)| e == replica).map_or(0, |&(_, at)| at);
            (!keys.is_empty()).then_some(Speculation { replica, keys, reset_ns })
        });
        report.outcome = Some(d.outcome);
        report.hash_mismatch = self.hash_mismatch;
        report.hybrid_unsupported = self.hybrid_unsupported;
        report.fallback = why.or((exact && d.outcome == Outcome::Approx).then_some(Fallback::NoMatch));
        if exact {
            report.matched_blocks = Some(d.matched);
        }
        match d.winner.and_then(|i| cands.get(i)) {
            Some(c) => Step::Route(Routed {
                address: c.address.to_owned(),
                dp_rank: c.dp_rank,
                decision: d,
                report,
                prefill_tokens,
                runner_up,
                speculation,
                speculative_blocks,
            }),
            None => Step::Reject(Rejected { status: 503, body: no_replica_body(model), report }),
        }
    }
}

#[cfg(test)]
mod tests;
