//! The request path, from a complete body to a routing step, with no host in sight: the
//! filter reads the body from Envoy, hands it here, and acts on the [`Step`] it gets back
//! (route, answer 503, or make the tokenizer call and hand its reply back).
//!
//! The stages pass values: triage ([`triage`]: the fallback that applies, if any) → profile →
//! hash plan ([`hash_plan`], kept per table and configuration) → exact scores ([`exact`]:
//! index, hybrid groups, speculative credit) → candidates and policy ([`decide`]) → [`Step`].
//!
//! Order of resolution for a body:
//! 1. a byte-identical body seen recently resolves to its cached tokenization unparsed;
//! 2. a body that cannot be routed exactly goes to a fallback, for the first [`Fallback`] that
//!    applies (too large, no prompt, unparseable, no profile, `kv_events` off, index not synced);
//! 3. token ids in the body are hashed and scored at once;
//! 4. a prompt tokenized recently (same profile, tokenizer call, salt, model and hashing) is
//!    scored from its cached tokens;
//! 5. otherwise the tokenizer is called on the least-loaded healthy replica.
//!
//! Every step carries a [`Report`] of what to count. A step never fails the request: only a
//! model with no healthy replica is answered locally (503).

mod candidates;
mod decide;
mod earlier_prompts;
mod earlier_turns;
mod exact;
mod gateway;
mod hash_plan;
mod held_blocks;
mod hybrid;
mod prefix;
mod reasons;
mod recent;
mod shared_prefix;
mod shared_prompt;
mod speculative;
mod step;
mod tokenizer_reply;
mod tokenizer_target;
pub mod tokenizer_wait;
mod triage;
mod wait_ledger;

pub use gateway::{
    EarlierTurns, GatewayState, InFlightCounts, LearnedRates, ReplicaAvoidance, SpeculativeEntries, TokenizerCalls,
    KEPT_TURNS, KEPT_TURN_TOKENS,
};
pub use held_blocks::HeldBlocks;
pub use hybrid::{hybrid_hit, HybridHit};
pub use prefix::{prefix_scores, Scratch, FIRST_HASH_BATCH};
pub use reasons::{Fallback, TokenizerFailure};
pub use shared_prompt::{
    EarlierPrompt, SharedPrompt, MAX_MARKS as MAX_PROMPT_MARKS, MAX_PROMPT_TAGS, MAX_TOKENS as MAX_PROMPT_TOKENS,
};
pub use speculative::{
    add as add_speculative, checkpoints, hits as speculative_hits, Entry as SpeculativeEntry, Hit as SpeculativeHit,
    Speculation, MAX_BLOCKS as SPECULATIVE_BLOCKS, MAX_ENTRIES as MAX_SPECULATIVE_ENTRIES,
    TTL_NS as SPECULATIVE_TTL_NS,
};
pub use step::{
    no_replica_body, Background, Body, CacheLookup, Holding, Keep, Pending, Rejected, Report, Routed, Step, Tokenize,
};
pub use tokenizer_reply::{tokenizer_answer, tokenizer_tokens, TokenizerReply};

pub use crate::fleet::replica_key;

use crate::config::{Compiled, TokenizerEndpoint, DEFAULT_APPROX_PREFIX_BYTES};
use crate::feed::{Applied, FeedError, FeedMessage, FeedView};
use crate::hash::{BlockHash, MmFeature, RequestExtras};
use crate::policy::Weights;
use crate::request::{parse_request, ApiKind, ParsedRequest, Prompt, TokenizerAnswer, TokenizerCall, TOKENIZE_PATH};
use crate::tokcache::{Alias, CacheTag, TokenCache, Tokenized};
use decide::{decide, Deciding};
use exact::{PromptBlocks, Scored, Scoring};
use hash_plan::{HashPlan, Hashers, PlanStatus, Plans};
use step::{EarlyRequest, RetryCall, TokenizerTarget};
use triage::{approx_key, fallback_reason};

/// A tokenizer call body past this size (about 250,000 tokens of text) that fails is charged
/// to its request, not to the tokenizer's circuit breaker.
pub const STRIKE_MAX_CALL_BYTES: usize = 1 << 20;

/// One VM's routing state: the compiled configuration, the feed's view of the fleet, the hash
/// plans and hashers, recent tokenizations and scratch buffers. Nothing in it describes the
/// request being decided: the stages pass that along.
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
    plans: Plans,
    hashers: Hashers,
    /// The last hash-settings mismatch described, and the last one handed out for the log.
    hash_note: Option<String>,
    hash_logged: Option<String>,
    /// Engines the feed reset (restarted: their caches are empty), with when this VM learned it:
    /// speculative entries written before do not count. Kept for the entries' TTL.
    resets: Vec<(u64, u64)>,
    /// With calls after routing ([`Step::RouteThenTokenize`]): the secret of the turn tags.
    background_calls: Option<u64>,
    /// What sibling chat requests' tokens begin with ([`shared_prefix`]).
    shared_prefixes: shared_prefix::SharedPrefixes,
    /// Earlier text prompts' tokens ([`earlier_prompts`]).
    earlier_prompts: earlier_prompts::EarlierPrompts,
    /// Whether waiting for a request's own tokens paid, per family ([`wait_ledger`]).
    waits: wait_ledger::WaitLedger,
}

fn token_cache(config: &Compiled, key: u64) -> TokenCache {
    TokenCache::new(config.tokenizer_cache_bytes, config.tokenizer_cache_ttl_ns, key)
}

/// Notes a plan's mismatch in the request's report, and for the log unless that note was
/// already handed out (no copy per request while a mismatch lasts).
fn note_plan(plan: &HashPlan, report: &mut Report, hash_note: &mut Option<String>, hash_logged: Option<&str>) {
    if let Some(note) = &plan.note {
        report.hash_mismatch = true;
        if hash_logged != Some(note.as_str()) && hash_note.as_deref() != Some(note.as_str()) {
            *hash_note = Some(note.clone());
        }
    }
}

/// A request the exact stage scores: which profile, and what enters its hashes besides tokens.
struct ExactRequest<'a> {
    profile: usize,
    model: Option<&'a str>,
    cache_salt: Option<&'a str>,
    tokens: &'a [u32],
    known: &'a [BlockHash],
    mm: Vec<MmFeature>,
}

impl Router {
    /// `tokcache_key`: the secret of the tokenization cache's tags (clients choose the bodies
    /// they are taken over): random per VM.
    pub fn new(config: Compiled, tokcache_key: u64) -> Router {
        let mut feed = FeedView::default();
        feed.set_allowlist(&config.allow);
        Router {
            tokcache: token_cache(&config, tokcache_key),
            hashers: Hashers::new(config.memo),
            config,
            default_weights: Weights::default(),
            feed,
            tokcache_key,
            scratch: Scratch::default(),
            generation: 0,
            plans: Plans::default(),
            hash_note: None,
            hash_logged: None,
            resets: Vec::new(),
            background_calls: None,
            shared_prefixes: shared_prefix::SharedPrefixes::default(),
            earlier_prompts: earlier_prompts::EarlierPrompts::default(),
            waits: wait_ledger::WaitLedger::default(),
        }
    }

    /// Calls after routing, with the turn tags' secret (shared by the VMs; `route_on_earlier_turns`).
    pub fn set_background_calls(&mut self, key: Option<u64>) {
        self.background_calls = key;
    }

    pub fn config(&self) -> &Compiled {
        &self.config
    }

    /// Replaces the configuration whole. The feed's state stays; recent tokenizations go
    /// (profiles may have changed what a tokenization means), and so do the hash plans.
    pub fn reconfigure(&mut self, config: Compiled) {
        self.tokcache = token_cache(&config, self.tokcache_key);
        self.shared_prefixes.clear();
        self.earlier_prompts.clear();
        self.waits.clear();
        self.hashers = Hashers::new(config.memo);
        self.feed.set_allowlist(&config.allow);
        self.config = config;
        self.generation = self.generation.wrapping_add(1);
    }

    pub fn tokenizer_cache(&self) -> &TokenCache {
        &self.tokcache
    }

    /// Applies one feed message (see [`FeedView::apply`]) and notes the engines it reset, as of
    /// `now_ns`.
    pub fn apply_feed(&mut self, msg: &FeedMessage, now_ns: u64) -> Result<Applied, FeedError> {
        let applied = self.feed.apply(msg);
        self.note_resets(now_ns);
        applied
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

    /// The fingerprint of the hashing profile `pi` uses for `model` (0 without such a
    /// profile), and whether some replica hashes otherwise (into `report`).
    fn plan_fingerprint(&mut self, pi: usize, model: Option<&str>, report: &mut Report) -> u64 {
        let Router { config, feed, plans, hash_note, hash_logged, generation, .. } = self;
        let Some(p) = config.profile(pi) else { return 0 };
        let Some(plan) = plans.get((pi, p), model, feed.serving(), *generation) else { return 0 };
        note_plan(plan, report, hash_note, hash_logged.as_deref());
        plan.fingerprint
    }

    fn approx_bytes(&self, profile: Option<usize>) -> usize {
        profile
            .and_then(|i| self.config.profile(i))
            .map_or(usize::try_from(DEFAULT_APPROX_PREFIX_BYTES).unwrap_or(usize::MAX), |p| p.approx_prefix_bytes)
    }

    /// Notes the engines the feed reset since the last call, and forgets those past the
    /// speculative entries' TTL.
    fn note_resets(&mut self, now_ns: u64) {
        self.resets.retain(|&(_, at)| now_ns.saturating_sub(at) <= SPECULATIVE_TTL_NS);
        for engine in self.feed.take_cleared() {
            self.resets.retain(|&(e, _)| e != engine);
            self.resets.push((engine, now_ns));
        }
    }

    /// Decides for a complete body (or the head of one too large to read).
    pub fn on_body(&mut self, body: &Body<'_>, gw: &dyn GatewayState, now_ns: u64) -> Step {
        self.note_resets(now_ns);
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
                let report = Report { tokenizer_cache: Some(CacheLookup::RawBodyHit), ..Report::default() };
                if let Some(step) = self.route_cached(&alias, &approx, gw, now_ns, report) {
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
            (Some(parsed), Some(pi), None) => self.route_parsed(parsed, pi, raw_tag, bytes, gw, now_ns),
            (parsed, profile, why) => {
                let nbytes = self.approx_bytes(profile);
                let approx = || approx_key(parsed.as_ref(), bytes, nbytes);
                let model = parsed.as_ref().and_then(|p| p.model.as_deref());
                self.finish(model, profile, None, &approx, why, gw, Report::default())
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
        gw: &dyn GatewayState,
        now_ns: u64,
    ) -> Step {
        let nbytes = self.approx_bytes(Some(pi));
        let model = parsed.model.as_deref();
        // The approximate key, computed only if the decision needs it.
        let approx = || approx_key(Some(&parsed), bytes, nbytes);
        let mut report = Report::default();
        if let Prompt::Tokens(tokens) = &parsed.prompt {
            let req = ExactRequest {
                profile: pi,
                model,
                cache_salt: parsed.cache_salt.as_deref(),
                tokens,
                known: &[],
                mm: Vec::new(),
            };
            let scored = self.exact(req, gw, &mut report);
            return self.finish_scored(model, pi, scored, &approx, gw, report);
        }
        let Some(p) = self.config.profile(pi) else {
            return self.finish(model, Some(pi), None, &approx, None, gw, report);
        };
        let call = parsed.tokenizer_call(p.tokenizer, bytes);
        let timeout_ms = p.tokenizer_timeout_ms;
        let why = call.is_none().then_some(Fallback::NoPrompt);
        // The same prompt seen recently under the same hashing: its tokens (and leading hashes)
        // are known.
        let spec = self.plan_fingerprint(pi, model, &mut report);
        let cache_tag = call.as_ref().and_then(|c| self.cache_tag(pi, spec, &parsed, c));
        if let Some(tag) = cache_tag {
            let alias =
                Alias { tag, profile: pi, model: parsed.model.clone(), cache_salt: parsed.cache_salt.clone(), spec };
            let hit = Report { tokenizer_cache: Some(CacheLookup::Hit), ..report };
            if let Some(step) = self.route_cached(&alias, &approx, gw, now_ns, hit) {
                if let Some(raw) = raw_tag {
                    self.tokcache.add_alias(raw, alias);
                }
                return step;
            }
            report.tokenizer_cache = Some(CacheLookup::Miss);
        }
        // Tokenize on the dedicated tokenizer, else the least-loaded healthy replica of the
        // model, leaving alone those whose recent calls failed.
        let target = call.as_ref().map(|c| self.tokenizer_target(pi, model, tokenizer_target::call_key(&c.body), gw));
        let (Some(call), Some(target)) = (call, target) else {
            // No call possible; without a replica `finish` answers 503.
            return self.finish(model, Some(pi), None, &approx, why, gw, report);
        };
        let target = match target {
            TokenizerTarget::At(t) => t,
            TokenizerTarget::CircuitOpen => {
                report.tokenizer_failure = Some(TokenizerFailure::CircuitOpen);
                return self.finish(model, Some(pi), None, &approx, Some(Fallback::Tokenizer), gw, report);
            }
            TokenizerTarget::Nobody => return self.finish(model, Some(pi), None, &approx, why, gw, report),
        };
        let generation = self.generation;
        let dedicated = self.config.profile(pi).and_then(|p| p.tokenizer_address.as_deref()) == Some(target.as_str());
        let retry = dedicated.then(|| RetryCall {
            path: call.path,
            body: (call.path != TOKENIZE_PATH).then(|| call.body.clone()),
            timeout_ms,
        });
        let call_bytes = call.body.len();
        let turn_tags = self.turn_tags(pi, spec, &parsed);
        let early =
            EarlyRequest { profile: pi, spec, tags: turn_tags.as_ref(), parsed: &parsed, approx: &approx, gw, now_ns };
        let earlier = self.route_before_tokenizing(&early, report);
        let pending = Box::new(Pending {
            profile: pi,
            parsed,
            approx_bytes: nbytes,
            cache_tag,
            raw_tag,
            generation,
            spec,
            retry,
            call_bytes,
            turn_tags,
            estimated_tokens: earlier.as_ref().ok().map(|(_, e)| *e),
            waited_on: earlier.as_ref().err().copied().flatten(),
        });
        // What the tokenizer step reports is counted now; the hash check is reported with the
        // decision once the reply is back.
        report.hash_mismatch = false;
        let call = Tokenize::new(target, call.path, call.body, timeout_ms, pending, report);
        self.then_tokenize(earlier.ok().map(|(routed, _)| routed), call, gw)
    }

    /// Decides once the tokenizer call for `pending` came back (or could not be made).
    pub fn on_tokenizer_reply(
        &mut self,
        pending: Pending,
        reply: &TokenizerReply<'_>,
        gw: &dyn GatewayState,
        now_ns: u64,
    ) -> Step {
        self.note_resets(now_ns);
        let mut report = Report::default();
        let p = &pending.parsed;
        let model = p.model.as_deref();
        let approx = || approx_key(Some(p), &[], pending.approx_bytes);
        let TokenizerAnswer { tokens, mm } = match tokenizer_answer(reply) {
            Ok(answer) => answer,
            Err(TokenizerFailure::Declined) if pending.retry.is_some() => {
                return self.retry_on_replica(pending, gw, report);
            }
            Err(f) => {
                report.tokenizer_failure = Some(f);
                // A call the request makes hard (media the tokenizer must fetch and bound, a
                // huge prompt) fails for the request's sake: it must not open the circuit for
                // everyone.
                report.tokenizer_failure_request_caused = p.multimodal() || pending.call_bytes > STRIKE_MAX_CALL_BYTES;
                return self.finish(model, Some(pending.profile), None, &approx, Some(Fallback::Tokenizer), gw, report);
            }
        };
        // The index may have lost its sync while the call was out.
        if !self.feed.usable() {
            let why = self.unusable();
            return self.finish(model, Some(pending.profile), None, &approx, why, gw, report);
        }
        // A multimodal prompt's hashes need its media items: never cached.
        let cacheable = mm.is_empty();
        let req = ExactRequest {
            profile: pending.profile,
            model,
            cache_salt: p.cache_salt.as_deref(),
            tokens: &tokens,
            known: &[],
            mm,
        };
        let scored = self.exact(req, gw, &mut report);
        if pending.generation == self.generation {
            self.note_whether_waiting_paid(&pending, scored.as_ref().ok());
        }
        let same = scored.is_ok()
            && pending.generation == self.generation
            && pending.spec == self.plan_fingerprint(pending.profile, model, &mut report);
        let keep = self.kept(&pending, same && cacheable, &tokens, gw);
        if let Some(tag) = pending.cache_tag.filter(|_| same && cacheable) {
            let hashes = self.scratch.hashes.clone();
            self.tokcache.insert(tag, Tokenized { tokens, hashes }, now_ns);
            self.remember_tokenized(&pending, tag);
        }
        earlier_turns::keeping(self.finish_scored(model, pending.profile, scored, &approx, gw, report), keep)
    }

    /// The dedicated tokenizer declined `pending`'s call: the same call to a replica (once).
    fn retry_on_replica(&mut self, mut pending: Pending, gw: &dyn GatewayState, mut report: Report) -> Step {
        report.tokenizer_failure = Some(TokenizerFailure::Declined);
        let model = pending.parsed.model.clone();
        let approx_bytes = pending.approx_bytes;
        // The call again: a render call's kept body, or the /tokenize body written anew.
        let retry = pending.retry.take().and_then(|c| {
            let body = match c.body {
                Some(b) => b,
                None => pending.parsed.tokenizer_call(TokenizerEndpoint::Tokenize, &[])?.body,
            };
            Some((c.path, body, c.timeout_ms))
        });
        let Some((path, body, timeout_ms)) = retry else {
            let approx = || approx_key(Some(&pending.parsed), &[], approx_bytes);
            return self.finish(
                model.as_deref(),
                Some(pending.profile),
                None,
                &approx,
                Some(Fallback::Tokenizer),
                gw,
                report,
            );
        };
        match self.replica_tokenizer(pending.profile, model.as_deref(), tokenizer_target::call_key(&body), gw, None) {
            TokenizerTarget::At(target) => {
                Step::Tokenize(Tokenize::new(target, path, body, timeout_ms, Box::new(pending), report))
            }
            other => {
                let why = match other {
                    TokenizerTarget::CircuitOpen => Some(Fallback::Tokenizer),
                    _ => None,
                };
                let approx = || approx_key(Some(&pending.parsed), &[], approx_bytes);
                self.finish(model.as_deref(), Some(pending.profile), None, &approx, why, gw, report)
            }
        }
    }

    /// The exact stage for `req`: its hash plan, then its scores into the scratch space
    /// (replicas that hash otherwise score 0), or the fallback that applies: the replicas'
    /// hashing does not match ([`Fallback::HashMismatch`]) or cannot be done.
    fn exact(&mut self, req: ExactRequest<'_>, gw: &dyn GatewayState, report: &mut Report) -> Result<Scored, Fallback> {
        let Router { config, feed, plans, hashers, scratch, hash_note, hash_logged, resets, generation, .. } = self;
        let Some(p) = config.profile(req.profile) else { return Err(Fallback::Hash) };
        let serving = feed.serving();
        let Some(plan) = plans.get((req.profile, p), req.model, serving, *generation) else {
            return Err(Fallback::Hash);
        };
        note_plan(plan, report, hash_note, hash_logged.as_deref());
        match plan.status {
            PlanStatus::Use => {}
            PlanStatus::Mismatch => return Err(Fallback::HashMismatch),
            PlanStatus::Unusable => return Err(Fallback::Hash),
        }
        let Some(hasher) = hashers.get(req.profile, &plan.spec) else { return Err(Fallback::Hash) };
        // The profile's `lora_adapters` first, then the adapters the replicas list (replicas that
        // disagree on an adapter's path hash its blocks differently: none can be credited).
        let lora = match p.lora(req.model) {
            Some(l) => Some(l),
            None => serving.lora_adapter(req.model).map_err(|()| Fallback::HashMismatch)?,
        };
        let extras = RequestExtras {
            cache_salt: req.cache_salt.map(str::to_owned),
            lora,
            mm: req.mm,
            lookahead: plan.spec.lookahead,
        };
        let ctx = Scoring { feed: serving, plan, resets, gw };
        let prompt = PromptBlocks { tokens: req.tokens, known: req.known, extras: &extras };
        exact::score(&ctx, &prompt, hasher, scratch)
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

    /// Routes from the cached tokenization `alias.tag`: `None` when it is no longer cached or
    /// was hashed otherwise than the replicas now hash.
    fn route_cached(
        &mut self,
        alias: &Alias,
        approx: &dyn Fn() -> Option<u64>,
        gw: &dyn GatewayState,
        now_ns: u64,
        mut report: Report,
    ) -> Option<Step> {
        let model = alias.model.as_deref();
        if self.plan_fingerprint(alias.profile, model, &mut report) != alias.spec {
            return None;
        }
        let mut t = self.tokcache.take(alias.tag, now_ns)?;
        let req = ExactRequest {
            profile: alias.profile,
            model,
            cache_salt: alias.cache_salt.as_deref(),
            tokens: &t.tokens,
            known: &t.hashes,
            mm: Vec::new(),
        };
        let scored = self.exact(req, gw, &mut report);
        if scored.is_ok() && self.scratch.hashes.len() > t.hashes.len() {
            t.hashes.clone_from(&self.scratch.hashes);
        }
        self.tokcache.put_back(alias.tag, t);
        Some(self.finish_scored(model, alias.profile, scored, approx, gw, report))
    }

    /// Decides after the exact stage: from its scores, or by the fallback it gave.
    fn finish_scored(
        &self,
        model: Option<&str>,
        profile: usize,
        scored: Result<Scored, Fallback>,
        approx: &dyn Fn() -> Option<u64>,
        gw: &dyn GatewayState,
        report: Report,
    ) -> Step {
        match scored {
            Ok(s) => self.finish(model, Some(profile), Some(&s), approx, None, gw, report),
            Err(why) => self.finish(model, Some(profile), None, approx, Some(why), gw, report),
        }
    }

    /// Decides with whatever is known (`scored`: the exact stage's result, its hashes and
    /// leading runs in the scratch space).
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        model: Option<&str>,
        profile: Option<usize>,
        scored: Option<&Scored>,
        approx: &dyn Fn() -> Option<u64>,
        why: Option<Fallback>,
        gw: &dyn GatewayState,
        report: Report,
    ) -> Step {
        let weights = profile.and_then(|i| self.config.profile(i)).map_or(&self.default_weights, |p| &p.weights);
        let ctx = Deciding { feed: self.feed.serving(), weights, gw, resets: &self.resets, model };
        decide(&ctx, scored.map(|s| (s, &self.scratch)), approx, why, report)
    }
}

#[cfg(test)]
mod tests;
