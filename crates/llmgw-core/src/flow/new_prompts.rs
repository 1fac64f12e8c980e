//! Routing a new prompt at once, where waiting for new prompts' tokens has not paid lately.
//!
//! A request that continues no earlier conversation, shares no prefix its siblings showed held
//! and begins like no earlier text prompt (nothing routes it before its tokens) waits for its
//! own tokens, to learn what the index holds of it. Behind one gateway the replicas hold nothing
//! of a prompt it has not sent but a short opening they all share, so the wait costs a tokenizer
//! round trip and changes nothing. These waits are learned as one family ([`super::wait_ledger`]):
//! a wait paid where some replica held more of the prompt than another by more than the round
//! trip's worth of prefill (at the dearest prefill rate among the replicas serving it); after
//! waits that did not pay, new prompts go at once on the predicted time to their first token, their
//! tokens estimated at the tokens per byte the recent tokenizer calls showed, and one in 2, 4, … 64
//! still waits to check (another gateway, or a client repeating itself, may have filled a cache).
//!
//! A prompt sent at once leaves speculative entries under the keys of its leading
//! [`FIRST_BOUNDARY`], 2×, 4×, … bytes. A prompt beginning with some of the same text before
//! the first one's tokens are known would find nothing by waiting for its own (nothing holds the
//! first one's blocks yet): it goes at once too, the engine computing that text credited with
//! its whole blocks at the tokens per byte (less an eighth, as bytes per token vary along a
//! prompt), so the decision weighs that engine's head start against its load as for any held
//! prefix. Once the first one's tokens are known (from its answer, or its call), they leave the
//! speculative entries its route would have left with them ([`Router::speculation_after`]), and
//! what the prompts after it find is what they found when it waited.

use super::decide::speculation;
use super::gateway::GatewayState;
use super::shared_prompt::{FIRST_BOUNDARY, MARK, MAX_MARKS};
use super::speculative::{Hit, Speculation};
use super::step::{CacheLookup, EarlyRequest, EarlyRoute, Pending, Report};
use super::wait_ledger::{WaitLedger, WaitedOn};
use super::{ExactRequest, Router};
use crate::fleet::replica_key;
use crate::policy::{stable_hash, PolicyMode};
use crate::request::Prompt;

/// The longest leading text keyed.
const LAST_BOUNDARY: usize = MARK * MAX_MARKS;

/// The family new prompts' waits are counted under, in a ledger of their own.
const FAMILY: u128 = 0;

/// How the tokens-per-byte sums fade: each answer keeps 7/8 of what the earlier ones summed.
const FADE: u64 = 8;

/// New prompts' waits, and the tokens per call byte recent tokenizer answers showed.
#[derive(Debug, Default)]
pub struct NewPrompts {
    waits: WaitLedger,
    /// (tokens, call bytes), fading sums, per prompt kind: text, chat.
    per_byte: [(u64, u64); 2],
}

/// Where a prompt's kind keeps its tokens per byte.
fn kind(prompt: &Prompt) -> Option<usize> {
    match prompt {
        Prompt::Text(_) => Some(0),
        Prompt::Chat(_) => Some(1),
        Prompt::Tokens(_) | Prompt::None => None,
    }
}

impl NewPrompts {
    pub fn clear(&mut self) {
        *self = NewPrompts::default();
    }

    /// A tokenizer call of `bytes` for a prompt of this kind gave `tokens` tokens.
    pub(super) fn note_tokens(&mut self, prompt: &Prompt, tokens: usize, bytes: usize) {
        let Some(sums) = kind(prompt).and_then(|k| self.per_byte.get_mut(k)) else { return };
        let fade = |sum: u64, add: usize| {
            sum.saturating_sub(sum / FADE).saturating_add(u64::try_from(add).unwrap_or(u64::MAX))
        };
        *sums = (fade(sums.0, tokens), fade(sums.1, bytes));
    }

    /// The tokens of a prompt whose call takes `bytes`, at the recent answers' tokens per byte.
    pub(super) fn estimate(&self, prompt: &Prompt, bytes: usize) -> Option<u64> {
        let &(tokens, total) = kind(prompt).and_then(|k| self.per_byte.get(k))?;
        let bytes = u128::try_from(bytes).ok()?;
        let n = bytes.checked_mul(u128::from(tokens))?.checked_div(u128::from(total))?;
        (tokens > 0).then(|| u64::try_from(n).unwrap_or(u64::MAX))
    }
}

/// The speculative keys of a prompt's leading [`FIRST_BOUNDARY`], 2×, 4×, … bytes (as far as
/// it has them, to [`LAST_BOUNDARY`]) under a profile, model and salt, with those lengths.
/// Unkeyed: a client who makes them collide with another's makes that prompt go where the other
/// went, as a prompt beginning alike would.
fn lead_keys(req: &EarlyRequest<'_>) -> Vec<(usize, u64)> {
    let mut lead = Vec::new();
    req.parsed.leading_text(LAST_BOUNDARY, &mut lead);
    let profile = u64::try_from(req.profile).unwrap_or(u64::MAX).to_le_bytes();
    let mut context = Vec::with_capacity(64);
    for part in [
        b"new prompt".as_slice(),
        &profile,
        req.parsed.model.as_deref().unwrap_or_default().as_bytes(),
        req.parsed.cache_salt.as_deref().unwrap_or_default().as_bytes(),
    ] {
        context.extend_from_slice(&u64::try_from(part.len()).unwrap_or(u64::MAX).to_le_bytes());
        context.extend_from_slice(part);
    }
    let boundaries = std::iter::successors(Some(FIRST_BOUNDARY), |b| b.checked_mul(2).filter(|&n| n <= LAST_BOUNDARY));
    boundaries
        .map_while(|b| lead.get(..b).map(|text| (b, text)))
        .map(|(b, text)| {
            let mut key = context.clone();
            key.extend_from_slice(text);
            (b, stable_hash(&key))
        })
        .collect()
}

/// Where a new prompt sent at once went (its tokens leave the speculative entries of that
/// route): `None` for any other request.
pub(super) fn new_route(earlier: &EarlyRoute) -> Option<(String, Option<u32>)> {
    earlier
        .as_ref()
        .ok()
        .filter(|(r, _)| r.report.tokenizer_cache == Some(CacheLookup::NewPrompt))
        .map(|(r, _)| (r.address.clone(), r.dp_rank))
}

impl Router {
    /// A request nothing routes before its tokens (`call_bytes`: its tokenizer call's size):
    /// routed at once as a new prompt where new prompts' waits have not paid lately; else it
    /// waits, learning for new prompts where the ledger asks it to (`Err(Some(..))`).
    pub(super) fn route_new_prompt(
        &mut self,
        waits: Option<WaitedOn>,
        req: &EarlyRequest<'_>,
        call_bytes: usize,
        report: Report,
    ) -> EarlyRoute {
        if waits.is_some() {
            return Err(waits);
        }
        let ttft = self.config.profile(req.profile).is_some_and(|p| p.weights.policy == PolicyMode::Ttft);
        let on = self.config.route_new_prompts && self.background_calls.is_some() && self.tokcache.enabled();
        if !on || !ttft || req.gw.tokenizer_round_trip_us().is_none() {
            return Err(None);
        }
        let Some(estimate) = self.new_prompts.estimate(&req.parsed.prompt, call_bytes) else { return Err(None) };
        let leads = lead_keys(req);
        if leads.is_empty() {
            return Err(None);
        }
        // Prompts beginning alike sent at once lately, whose tokens are not known yet: the
        // deepest boundary each engine was sent.
        let keys: Vec<u64> = leads.iter().map(|&(_, k)| k).collect();
        let mut hits: Vec<Hit> = Vec::new();
        req.gw.speculative(&keys, &mut hits);
        hits.retain(|h| !self.resets.iter().any(|&(e, at)| e == h.engine && h.written_ns <= at));
        if hits.is_empty() && !self.new_prompts.waits.skips_waiting(FAMILY) {
            return Err(Some(WaitedOn { family: FAMILY, prefix: 0, new_prompt: true }));
        }
        let mut report = Report { tokenizer_cache: Some(CacheLookup::NewPrompt), ..report };
        let exact = ExactRequest {
            profile: req.profile,
            model: req.parsed.model.as_deref(),
            cache_salt: req.parsed.cache_salt.as_deref(),
            tokens: &[],
            known: &[],
            mm: Vec::new(),
        };
        let mut scored = self.exact(exact, req.gw, &mut report).map_err(|_| None)?;
        scored.tokens = estimate;
        // Its whole blocks, estimated, as a prompt scored on its tokens counts them: the
        // decision places it as such a new prompt.
        let block = scored.block_size.max(1);
        let per_block = |tokens: u64| {
            u32::try_from(tokens.checked_div(u64::try_from(block).unwrap_or(u64::MAX)).unwrap_or(0)).unwrap_or(u32::MAX)
        };
        self.scratch.scores.total = per_block(estimate.saturating_sub(1));
        // An engine computing text this prompt begins with is credited the whole blocks of that
        // text at the recent tokens per byte, less an eighth (bytes per token vary along a
        // prompt), as a speculative entry credits blocks sent.
        for hit in &hits {
            let Some(&(bytes, _)) = leads.get(hit.key) else { continue };
            let tokens = self.new_prompts.estimate(&req.parsed.prompt, bytes).unwrap_or(0);
            let blocks = per_block(tokens.saturating_sub(tokens / 8));
            for r in self.feed.serving().replicas.iter().filter(|r| r.engine == hit.engine) {
                let leading = &mut self.scratch.scores.leading;
                let i = usize::from(r.id);
                if leading.len() <= i {
                    leading.resize(i.saturating_add(1), 0);
                }
                if let Some(l) = leading.get_mut(i) {
                    *l = (*l).max(blocks);
                }
                self.scratch.scores.total = self.scratch.scores.total.max(blocks);
            }
        }
        let (mut routed, estimate) = self.route_early(req, &scored, report).ok_or(None)?;
        let replica = replica_key(&routed.address, routed.dp_rank);
        routed.speculation = Some(Speculation { replica, keys, reset_ns: 0 });
        Ok((routed, estimate))
    }

    /// A new prompt waited for its tokens (scored on them, its scores in the scratch space):
    /// whether that paid, for the new prompts after it. It paid where the replicas serving its
    /// model held different runs of it, and computing the difference would take longer than the
    /// tokenizer's usual round trip at the dearest of their prefill rates (any difference, when
    /// no round trip is known).
    pub(super) fn note_new_prompt_wait(
        &mut self,
        profile: usize,
        model: Option<&str>,
        block_size: usize,
        gw: &dyn GatewayState,
    ) {
        let Some(w) = self.config.profile(profile).map(|p| &p.weights) else { return };
        let leading = &self.scratch.scores.leading;
        let (mut least, mut most, mut rate) = (u32::MAX, 0u32, 0.0_f64);
        for r in self.feed.serving().replicas.iter().filter(|r| r.up && r.serves(model)) {
            let held = leading.get(usize::from(r.id)).copied().unwrap_or(0);
            (least, most) = (least.min(held), most.max(held));
            let r_rate = w.ttft.rates_from(gw.learned_rates(&r.address)).prefill_us_per_token;
            if r_rate.is_finite() {
                rate = rate.max(r_rate);
            }
        }
        let more = u64::from(most.saturating_sub(least)).saturating_mul(u64::try_from(block_size).unwrap_or(u64::MAX));
        let paid = match gw.tokenizer_round_trip_us() {
            Some(wait_us) => (more as f64) * rate >= wait_us as f64,
            None => more > 0,
        };
        self.new_prompts.waits.waited(FAMILY, paid);
    }

    /// What a new prompt sent at once to `route` (address, rank) leaves once its `tokens` are
    /// known: the speculative entries its route would have left had it waited for them, and its
    /// key as a request that ended (its last hashed block's, as a route's `ends_as`).
    pub(super) fn speculation_after(
        &mut self,
        pending: &Pending,
        route: &(String, Option<u32>),
        tokens: &[u32],
        gw: &dyn GatewayState,
    ) -> (Option<Speculation>, Option<u64>) {
        let p = &pending.parsed;
        let exact = ExactRequest {
            profile: pending.profile,
            model: p.model.as_deref(),
            cache_salt: p.cache_salt.as_deref(),
            tokens,
            known: &[],
            mm: Vec::new(),
        };
        if self.exact(exact, gw, &mut Report::default()).is_err() {
            return (None, None);
        }
        let ends_as = self.scratch.hashes.last().map(|h| h.key.0).filter(|&k| k != 0);
        let replica = replica_key(&route.0, route.1);
        let Some(r) = self.feed.serving().replicas.iter().find(|r| r.engine == replica) else { return (None, ends_as) };
        let held = self.scratch.index_leading.get(usize::from(r.id)).copied().unwrap_or(0);
        (speculation(replica, held, &self.scratch, &self.resets), ends_as)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_follows_the_recent_answers_tokens_per_byte_for_each_kind() {
        let text = Prompt::Text("a".into());
        let mut n = NewPrompts::default();
        assert_eq!(n.estimate(&text, 1000), None);
        n.note_tokens(&text, 250, 1000);
        assert_eq!(n.estimate(&text, 2000), Some(500));
        // Chat keeps its own: none yet.
        assert_eq!(n.estimate(&Prompt::None, 2000), None);
        // Later answers weigh more: 7/8 of the first, plus one at 1 token per 2 bytes.
        n.note_tokens(&text, 500, 1000);
        let (t, b) = (250 - 250 / 8 + 500, 1000 - 1000 / 8 + 1000);
        assert_eq!(n.estimate(&text, 1000), Some(1000 * t / b));
    }
}
