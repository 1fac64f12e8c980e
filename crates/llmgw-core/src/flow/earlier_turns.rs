//! Routing the next turn of a conversation on the tokens of the turn before, without waiting
//! for the tokenizer.
//!
//! A conversation's next chat request repeats the messages of the one before and adds the reply
//! and a new message. The tokens of the request before are what its replica computed, block for
//! block, so the replicas holding their blocks are the ones holding the new request's prefix:
//! the new request is scored on them at once, and its own tokenizer call goes out after it is
//! routed (the answer is kept for the turn after it). Where the earlier tokens and the new
//! request's differ (a template that renders history otherwise, a merge across the boundary),
//! the blocks past the difference match nobody: the decision may credit less than is cached,
//! never more. A replica holding the whole new prompt already (the same request sent through
//! another gateway) is credited only with the earlier turn's blocks.
//!
//! A tokenized chat request leaves an alias in the tokenization cache, from a tag of the profile,
//! the hashing, the model, every field that changes the rendering (tools, template, its
//! arguments, the flags) and its messages, to its tokenization; a request with `n` messages
//! looks up the alias of its first `n - 2`.
//!
//! Requests sharing only a system prompt are not routed this way: their tokens past it are their
//! own (see [`super::shared_prefix`]).

use super::exact::Scored;
use super::step::{
    Background, CacheLookup, EarlyRequest, EarlyRoute, Keep, Pending, Report, Routed, Step, Tokenize, TokenizerTarget,
    TurnTags,
};
use super::{tokenizer_answer, ExactRequest, GatewayState, Router, TokenizerFailure, TokenizerReply};
use crate::request::{ParsedRequest, Prompt, RawJson, TokenizerAnswer};
use crate::tokcache::{keyed_tag, Alias, CacheTag, Tokenized};
use serde_json::value::RawValue;

impl Router {
    /// The tags of `parsed`'s aliases (`None` for anything but a chat without media, or with
    /// the cache off).
    pub(super) fn turn_tags(&self, profile: usize, spec: u64, parsed: &ParsedRequest) -> Option<TurnTags> {
        let Prompt::Chat(raw) = &parsed.prompt else { return None };
        let key = self.background_calls?;
        let (turns, siblings) = (self.config.route_on_earlier_turns, self.config.route_on_shared_prefixes);
        if !(turns || siblings) || !self.tokcache.enabled() || parsed.multimodal() {
            return None;
        }
        let messages: Vec<&RawValue> = serde_json::from_str(raw.get()).ok()?;
        let profile_bytes = u64::try_from(profile).unwrap_or(u64::MAX).to_le_bytes();
        let spec_bytes = spec.to_le_bytes();
        let flag = |f: Option<bool>| f.map_or(2u8, u8::from);
        let flags =
            [flag(parsed.add_generation_prompt), flag(parsed.continue_final_message), flag(parsed.add_special_tokens)];
        let context: [&[u8]; 7] = [
            &profile_bytes,
            &spec_bytes,
            parsed.model.as_deref().unwrap_or_default().as_bytes(),
            raw_text(&parsed.tools),
            raw_text(&parsed.chat_template),
            raw_text(&parsed.chat_template_kwargs),
            &flags,
        ];
        // Turn tags, and siblings' tags apart from them (`label`): both kinds are kept in the
        // same shared slots.
        let labelled = |label: &'static [u8], n: usize| {
            let mut parts: Vec<&[u8]> = Vec::with_capacity(context.len().saturating_add(n).saturating_add(1));
            parts.push(label);
            parts.extend_from_slice(&context);
            parts.extend(messages.iter().take(n).map(|m| m.get().as_bytes()));
            keyed_tag(key, &parts)
        };
        let tag = |n: usize| labelled(b"turn", n);
        let span = |n: usize| messages.iter().take(n).map(|m| m.get().len()).fold(0usize, usize::saturating_add);
        let n = messages.len();
        Some(TurnTags {
            profile,
            spec,
            whole: tag(n),
            previous: n.checked_sub(2).filter(|&k| k > 0 && turns).map(|k| (tag(k), span(k))),
            siblings: n.checked_sub(1).filter(|&k| k > 0 && siblings).map(|k| (labelled(b"siblings", k), span(k))),
            bytes: span(n),
        })
    }

    /// Routes before the tokenizer answers, by the prompt's kind: a chat request on its
    /// previous turn's tokens, else on what its siblings share ([`super::shared_prefix`]); a
    /// text prompt on an earlier prompt's ([`super::earlier_prompts`]). The route, and the
    /// estimate of the request's own prompt tokens.
    pub(super) fn route_before_tokenizing(&mut self, req: &EarlyRequest<'_>, report: Report) -> EarlyRoute {
        match req.parsed.prompt {
            Prompt::Chat(_) => match self.route_on_earlier_turn(req, report) {
                Some(routed) => Ok(routed),
                None => self.route_on_shared_prefix(req, report),
            },
            Prompt::Text(_) => self.route_on_earlier_prompt(req, report),
            Prompt::Tokens(_) | Prompt::None => Err(None),
        }
    }

    /// Routes on the previous turn's tokenization, when it is cached under the hashing the
    /// replicas use now and spans a full block: the route, and the estimate of the request's
    /// own prompt tokens (the earlier tokens, and its further messages at the bytes per token
    /// the earlier ones took).
    fn route_on_earlier_turn(&mut self, req: &EarlyRequest<'_>, report: Report) -> Option<(Routed, u64)> {
        let EarlyRequest { parsed, gw, now_ns, .. } = *req;
        let tags = req.tags?;
        let (tag, bytes) = tags.previous?;
        let mut report = Report { tokenizer_cache: Some(CacheLookup::EarlierTurn), ..report };
        let model = parsed.model.as_deref();
        let (profile, spec) = (tags.profile, tags.spec);
        if self.plan_fingerprint(profile, model, &mut report) != spec {
            return None;
        }
        // This VM's tokenization of the turn before (with the hashes computed so far), else the
        // tokens another VM of this Envoy kept.
        let alias = self.tokcache.alias(tag).filter(|a| {
            (a.profile, a.spec) == (profile, spec) && a.model == parsed.model && a.cache_salt == parsed.cache_salt
        });
        let cached = alias.map(|a| a.tag).and_then(|t| self.tokcache.take(t, now_ns).map(|v| (t, v)));
        let (mut t, back, n) = match cached {
            Some((t, v)) => {
                let n = v.tokens.len();
                (v, Some(t), n)
            }
            None => {
                let (tokens, n) = gw.earlier_tokens(tag.0)?;
                (Tokenized { tokens, hashes: Vec::new() }, None, n)
            }
        };
        let exact = ExactRequest {
            profile,
            model,
            cache_salt: parsed.cache_salt.as_deref(),
            tokens: &t.tokens,
            known: &t.hashes,
            mm: Vec::new(),
        };
        let scored = self.exact(exact, gw, &mut report);
        if let Some(back) = back {
            if scored.is_ok() && self.scratch.hashes.len() > t.hashes.len() {
                t.hashes.clone_from(&self.scratch.hashes);
            }
            self.tokcache.put_back(back, t);
        }
        let mut scored = scored.ok().filter(|_| self.scratch.scores.total > 0)?;
        scored.tokens = estimated_tokens(n, bytes, tags.bytes)?;
        self.route_early(req, &scored, report)
    }

    /// The call for `call`'s request: after routing it (`routed`), else before. A call after
    /// routing goes to another replica than the one computing the request when there is one
    /// (a replica's API server tokenizing the call would delay the request's own start there),
    /// unless it goes to the dedicated tokenizer; where the replica's streamed answer can carry
    /// the tokens, it is made only if the answer does not.
    pub(super) fn then_tokenize(&self, routed: Option<Routed>, mut call: Tokenize, gw: &dyn GatewayState) -> Step {
        let Some(routed) = routed else { return Step::Tokenize(call) };
        if call.target == routed.address && call.pending.retry.is_none() {
            let (pi, model) = (call.pending.profile, call.pending.parsed.model.as_deref());
            let key = super::tokenizer_target::call_key(&call.body);
            if let TokenizerTarget::At(address) = self.replica_tokenizer(pi, model, key, gw, Some(&routed.address)) {
                call.target = address;
            }
        }
        let p = &call.pending.parsed;
        call.from_answer = self.config.tokens_from_answers && p.answer_can_carry_tokens && !p.multimodal();
        Step::RouteThenTokenize(routed, Box::new(call))
    }

    /// Leaves the aliases of `pending`'s tokenization, just cached under `tag`: its raw body's,
    /// and its messages' for the turn after it.
    pub(super) fn remember_tokenized(&mut self, pending: &Pending, tag: CacheTag) {
        let p = &pending.parsed;
        let alias = Alias {
            tag,
            profile: pending.profile,
            model: p.model.clone(),
            cache_salt: p.cache_salt.clone(),
            spec: pending.spec,
        };
        if let Some(turn) = &pending.turn_tags {
            self.tokcache.add_alias(turn.whole, alias.clone());
        }
        if let Some(raw) = pending.raw_tag {
            self.tokcache.add_alias(raw, alias);
        }
    }

    /// The reply to a call made after its request was routed ([`Step::RouteThenTokenize`]):
    /// the tokenization is cached for the request's next turn (and for the same request sent
    /// again). What the host learns from it: the failure, if any, and the request's prompt
    /// tokens against the estimate it was routed with.
    pub fn on_background_reply(
        &mut self,
        pending: Pending,
        reply: &TokenizerReply<'_>,
        gw: &dyn GatewayState,
        now_ns: u64,
    ) -> Background {
        let estimated_tokens = pending.estimated_tokens;
        let failed =
            |f, retry| Background { failure: Some(f), tokens: None, estimated_tokens, keep: Keep::default(), retry };
        let TokenizerAnswer { tokens, mm } = match tokenizer_answer(reply) {
            Ok(answer) => answer,
            // The dedicated tokenizer declined: the same call once to a replica.
            Err(TokenizerFailure::Declined) if pending.retry.is_some() => {
                let retry = match self.retry_on_replica(pending, gw, Report::default()) {
                    Step::Tokenize(t) => Some(Box::new(t)),
                    _ => None,
                };
                return failed(TokenizerFailure::Declined, retry);
            }
            Err(f) => return failed(f, None),
        };
        let count = u64::try_from(tokens.len()).unwrap_or(u64::MAX);
        let mut report = Report::default();
        let same = pending.generation == self.generation
            && pending.spec == self.plan_fingerprint(pending.profile, pending.parsed.model.as_deref(), &mut report);
        let keep = self.kept(&pending, same && mm.is_empty(), &tokens, gw);
        if let Some(tag) = pending.cache_tag.filter(|_| same && mm.is_empty()) {
            self.tokcache.insert(tag, Tokenized { tokens, hashes: Vec::new() }, now_ns);
            self.remember_tokenized(&pending, tag);
        }
        Background { failure: None, tokens: Some(count), estimated_tokens, keep, retry: None }
    }
}

fn raw_text(v: &Option<RawJson>) -> &[u8] {
    v.as_ref().map(|j| j.get().as_bytes()).unwrap_or_default()
}

/// A request's prompt tokens, estimated from the `n` tokens its leading messages (`bytes` long)
/// took: those, and its further messages (up to `all_bytes`) at the same bytes per token.
pub(super) fn estimated_tokens(n: usize, bytes: usize, all_bytes: usize) -> Option<u64> {
    let per_token = bytes.checked_div(n)?.max(1);
    let further = all_bytes.saturating_sub(bytes).checked_div(per_token).unwrap_or(0);
    Some(u64::try_from(n.saturating_add(further)).unwrap_or(u64::MAX))
}

impl Router {
    /// Finishes a request scored before its tokenizer answered, on leading tokens, with its own
    /// prompt tokens estimated in `scored.tokens`: the route, and that estimate.
    pub(super) fn route_early(&self, req: &EarlyRequest<'_>, scored: &Scored, report: Report) -> Option<(Routed, u64)> {
        let model = req.parsed.model.as_deref();
        match self.finish(model, Some(req.profile), Some(scored), req.approx, None, req.gw, report) {
            Step::Route(r) => Some((r, scored.tokens)),
            _ => None,
        }
    }

    /// What to keep in the gateway's shared data from `pending`'s tokens (`ok`: they were
    /// hashed as the replicas hash now, and carry no media): the tokens under its turn tag, for
    /// its conversation's next turn, and its siblings' common prefix where they changed it
    /// (learned from the one another VM kept when this VM knows none). A text prompt's tokens
    /// are kept in the VM for the prompts after it ([`super::earlier_prompts`]).
    pub(super) fn kept(&mut self, pending: &Pending, ok: bool, tokens: &[u32], gw: &dyn GatewayState) -> Keep {
        if !ok {
            return Keep::default();
        }
        let mut keep = Keep {
            tokens: Vec::new(),
            prompt: self.learn_prompt(pending.profile, pending.spec, &pending.parsed, tokens),
        };
        let Some(tags) = pending.turn_tags.as_ref() else { return keep };
        if self.config.route_on_earlier_turns {
            keep.tokens.push((tags.whole.0, tokens.to_vec()));
        }
        if let Some((tag, _)) = tags.siblings {
            let kept = || gw.earlier_tokens(tag.0).map(|(t, _)| t);
            if let Some(common) = self.shared_prefixes.learn(tag.0, tokens, kept) {
                keep.tokens.push((tag.0, common));
            }
            self.shared_prefixes.note_bytes(tag.0, tags.bytes);
        }
        keep
    }
}

/// `step`, with `keep` for the gateway when it routes.
pub(super) fn keeping(step: Step, keep: Keep) -> Step {
    match step {
        Step::Route(r) => Step::Route(Routed { keep, ..r }),
        step => step,
    }
}
